"""Prompt datasets: the built-in task or a user's files (JSON lines, a JSON array, Parquet, CSV,
a `datasets` folder from `save_to_disk`, or a folder or glob pattern of such files), validated
row by row.

A dataset row is `{"prompt": str, "answer": str}` (extra keys travel to the reward function as
keyword arguments); the prompt may also be a conversation, a list of chat messages ending with a
user turn (`streamrl.data.prompts`). A row may hold images, videos and audio, as chat content
parts or in veRL's / TRL's media columns (`streamrl.media.refs`); they are read when the feeder
first uses the row. Rows that keep them under other keys name them with
`data.prompt_key` and `data.answer_key`, dotted into nested records (veRL's Parquet files:
`prompt` and `reward_model.ground_truth`). A malformed row in a user file is reported with its
file and line (or row number) and skipped; a file with no valid row is an error.

A folder is read whole, so a folder whose files belong to more than one split (`train/` and
`test/` of a `DatasetDict`, `train-*.parquet` beside `test-*.parquet` as hubs keep them) is
refused, naming the path of each split: reading it whole would train on held-out rows.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from streamrl.data import arith, calculator, vision_tasks
from streamrl.data.prompts import Prompt
from streamrl.media.refs import COLUMNS, MediaRef, extract_media, has_media

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a dataset and what its reward needs to score answers to it."""

    prompt: Prompt
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    media: tuple[MediaRef, ...] = ()
    """The prompt's images, videos and audio, in the order of its media parts (the prompt is
    then a conversation whose contents are lists of parts)."""
    origin: str = field(default="", compare=False)
    """Where the row came from (a file and line), for messages about it."""


@dataclass
class LoadReport:
    rows: list[PromptRow]
    num_skipped: int = 0
    problems: list[str] = field(default_factory=list)


def rows_digest(rows: list[PromptRow]) -> str:
    """A digest of the rows' prompts and answers, in order: equal for the same data."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps([row.prompt, row.answer], ensure_ascii=False).encode())
        for ref in row.media:
            h.update(ref.describe().encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def builtin_rows(
    num: int, *, digits: int, seed: int, split: str, task: str = "arith"
) -> list[PromptRow]:
    """`num` rows of the built-in task `task` (`arith`, `calculator`, `shapes`, `motion` or
    `tones`)."""
    if task in vision_tasks.MEDIA_TASKS:
        return [
            PromptRow(p.messages, p.answer, media=(p.medium,), origin=f"built-in {p.origin}")
            for p in vision_tasks.sample(task, num, seed=seed, split=split)
        ]
    if task == "calculator":
        products = calculator.sample_products(num, digits=digits, seed=seed, split=split)
        return [PromptRow(p.prompt, p.answer) for p in products]
    return [
        PromptRow(p.prompt, p.answer)
        for p in arith.sample_problems(num, digits=digits, seed=seed, split=split)
    ]


_MISSING = object()


def _lookup(obj: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def parse_row(
    obj: Any,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    base_dir: Path | None = None,
) -> PromptRow:
    """Validate one decoded row; raise ValueError saying what is wrong. Relative media paths
    are read from `base_dir` (the data file's folder)."""
    if not isinstance(obj, dict):
        raise ValueError(
            f"expected an object with {prompt_key!r} and {answer_key!r}, got {type(obj).__name__}"
        )
    prompt, answer = _lookup(obj, prompt_key), _lookup(obj, answer_key)
    pairs = ((prompt_key, prompt), (answer_key, answer))
    missing = [k for k, v in pairs if v is _MISSING or v is None]  # Parquet: None when absent
    if missing:
        raise ValueError(
            f"missing key(s) {missing}; a row needs {prompt_key!r} and {answer_key!r} "
            "(data.prompt_key and data.answer_key name others, dotted into nested records)"
        )
    media: tuple[MediaRef, ...] = ()
    if has_media(obj, prompt):
        multimodal = extract_media(obj, prompt, base_dir=base_dir)
        prompt, media = _check_conversation(multimodal.messages), multimodal.media
    else:
        prompt = parse_prompt(prompt)
    if not isinstance(answer, (str, int, float)):
        raise ValueError(f"{answer_key!r} must be a string or number, got {type(answer).__name__}")
    columns = {name for names in COLUMNS.values() for name in names} if media else set()
    extra = {k: v for k, v in obj.items() if k not in (prompt_key, answer_key, *columns)}
    try:  # the reward sandbox receives them as JSON
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a value the reward function would get is not JSON: {e}") from None
    return PromptRow(prompt, str(answer), extra, media)


ROLES = ("system", "user", "assistant")


def _check_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A multimodal conversation (contents as lists of parts): known roles, ending with a
    user message."""
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise ValueError(
                f"'prompt' message {i} has role {message['role']!r}, not one of {ROLES}"
            )
    if messages[-1]["role"] != "user":
        raise ValueError("a conversation 'prompt' must end with a user message")
    return messages


def format_prompts(
    rows: list[PromptRow], *, template: str | None, system: str | None
) -> list[PromptRow]:
    """`rows` with `template` around each prompt's text (a conversation's last user message;
    `{prompt}` marks the spot) and `system` as the first message where there is none."""
    if template is None and system is None:
        return rows
    out = []
    for row in rows:
        messages = (
            [dict(m) for m in row.prompt]
            if isinstance(row.prompt, list)
            else [{"role": "user", "content": row.prompt}]
        )
        if template is not None:
            last = messages[-1]  # a user message (`parse_prompt`)
            if isinstance(last["content"], str):
                last["content"] = template.replace("{prompt}", last["content"])
            else:  # a multimodal turn: the template goes around its last text part
                parts = [dict(p) for p in last["content"]]
                texts = [p for p in parts if p["type"] == "text"] or [{"type": "text", "text": ""}]
                if texts[-1] not in parts:
                    parts.append(texts[-1])
                texts[-1]["text"] = template.replace("{prompt}", texts[-1]["text"])
                last["content"] = parts
        if system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        single_text = len(messages) == 1 and isinstance(messages[0]["content"], str)
        prompt = messages[0]["content"] if single_text else messages
        out.append(replace(row, prompt=prompt))
    return out


def parse_prompt(prompt: Any) -> Prompt:
    """A non-empty text, or a conversation (a one-message user conversation becomes its text:
    the two encode alike)."""
    if isinstance(prompt, str) and prompt:
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"'prompt' must be a non-empty string or a list of chat messages, got {prompt!r}"[:300]
        )
    for i, message in enumerate(prompt):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"'prompt' message {i} must be {{\"role\": one of {', '.join(ROLES)}, "
                f'"content": str}}, got {message!r}'[:300]
            )
    if prompt[-1]["role"] != "user" or not prompt[-1]["content"]:
        last = repr(prompt[-1])[:200]
        raise ValueError(
            f"a conversation 'prompt' must end with a non-empty user message, not {last}"
        )
    if len(prompt) == 1:
        return prompt[0]["content"]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


MAX_WARNINGS = 10  # malformed rows reported one by one; the rest are counted


# The last files read, by (path, size, modification time, keys): the pre-run check and the run
# itself read the same files in one process (2.5 s for 300,000 rows). Enough for a sharded
# training set and its held-out file; the run holds their rows anyway.
_RECENT: dict[tuple, LoadReport] = {}
_RECENT_KEPT = 64


# What a data file may be, by suffix: JSON lines (.json may also hold one JSON array of
# records), Parquet, CSV / TSV with a header row (every value a string), or Arrow (the shards of
# `datasets.Dataset.save_to_disk`).
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow")
FORMATS_TEXT = (
    "JSON lines (.jsonl or .json), a JSON array of records (.json), Parquet (.parquet), CSV or "
    "TSV with a header row (.csv, .tsv), a `datasets` folder from save_to_disk (.arrow), or a "
    "folder or glob pattern of such files (shards, read in name order)"
)
# The bookkeeping files `save_to_disk` writes beside its .arrow shards: not data.
DATASETS_META = frozenset({"state.json", "dataset_info.json", "dataset_dict.json"})
# A word naming a split in a file's path inside a folder ("train/", "test-00000-of-00001").
_SPLIT_WORD = re.compile(
    r"(?<![a-z0-9])(train|training|test|testing|validation|valid|val|dev|eval)(?![a-z0-9])",
    re.IGNORECASE,
)


def load_rows(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"
) -> LoadReport:
    """Read a prompt file (`FORMATS_TEXT`), skipping (and reporting) malformed rows, each named
    by its file and line (JSON lines) or record number (a JSON array, Parquet: from 1). A file
    read before and unchanged since is not read again; its problems are reported again."""
    path = Path(path)
    report = LoadReport(rows=[])
    for file in data_files(path):
        stat = file.stat()
        key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns, prompt_key, answer_key)
        part = _RECENT.get(key)
        if part is None:
            part = _read_rows(file, prompt_key, answer_key)
            _RECENT[key] = part
            while len(_RECENT) > _RECENT_KEPT:
                del _RECENT[next(iter(_RECENT))]
        report.rows += part.rows
        report.num_skipped += part.num_skipped
        report.problems += part.problems
    for msg in report.problems[:MAX_WARNINGS]:
        log.warning(msg)
    if report.num_skipped > MAX_WARNINGS:
        log.warning(
            "%s: %d more malformed rows skipped (%d in all)",
            path,
            report.num_skipped - MAX_WARNINGS,
            report.num_skipped,
        )
    if not report.rows:
        first = f"; the first: {report.problems[0]}" if report.problems else ""
        raise ValueError(
            f"dataset {str(path)!r} has no valid row ({report.num_skipped} malformed{first})"
        )
    return report


def is_pattern(path: str | Path) -> bool:
    """Whether `path` is a glob pattern (`data/train-*.parquet`) rather than a path."""
    return any(c in str(path) for c in "*?[") and not Path(path).exists()


def _is_data_file(file: Path) -> bool:
    return file.suffix in SUFFIXES and file.name not in DATASETS_META and file.is_file()


def data_files(path: Path) -> list[Path]:
    """The files `path` names: itself, the data files under a folder, or those a glob pattern
    matches, in name order. A folder holding more than one split is refused (module docstring)."""
    if is_pattern(path):
        files = sorted(
            f for f in map(Path, glob.glob(str(path), recursive=True)) if _is_data_file(f)
        )
        if not files:
            raise ValueError(f"dataset pattern {str(path)!r} matches no data file ({FORMATS_TEXT})")
        return files
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if _is_data_file(f))
        if not files:
            raise ValueError(
                f"dataset folder {str(path)!r} holds no data file; streamrl reads {FORMATS_TEXT}"
            )
        check_one_split(path, files)
        return files
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"dataset file {str(path)!r}: streamrl reads {FORMATS_TEXT}")
    return [path]


def split_of(relative: str) -> str | None:
    """The split a file's path inside a folder names, outermost first ("validation" for val, dev
    and eval too), or None."""
    found = _SPLIT_WORD.search(relative)
    if found is None:
        return None
    word = found.group(1).lower()
    return {"training": "train", "testing": "test"}.get(
        word, word if word in ("train", "test") else "validation"
    )


def check_one_split(folder: Path, files: list[Path]) -> None:
    """Refuse a folder whose files belong to more than one split, naming each split's path."""
    by_split: dict[str, list[Path]] = {}
    for f in files:
        split = split_of(f.relative_to(folder).as_posix())
        if split is not None:
            by_split.setdefault(split, []).append(f)
    if len(by_split) < 2:
        return
    counts = ", ".join(f"{split}: {len(fs)} file(s)" for split, fs in sorted(by_split.items()))
    paths = ", ".join(
        f"{split}: {_split_path(fs, files)!r}" for split, fs in sorted(by_split.items())
    )
    raise ValueError(
        f"dataset folder {str(folder)!r} holds more than one split ({counts}); read whole, "
        "held-out rows would be trained on. Name one split's folder, file or pattern instead "
        f"({paths}), "
        "e.g. data.train_file=<the train path> data.eval_file=<the test path> (a pattern is "
        "read as it is: X/**/*.jsonl reads every file it matches)"
    )


def _split_path(split_files: list[Path], all_files: list[Path]) -> str:
    """A path that names exactly `split_files` among `all_files`: their folder, the file if it is
    one, a glob pattern in their folder, or (none works) the first file."""
    common = Path(os.path.commonpath([str(f.parent) for f in split_files]))
    if [f for f in all_files if common in f.parents] == split_files:
        return str(common)
    if len(split_files) == 1:
        return str(split_files[0])
    suffixes = {f.suffix for f in split_files}
    word = _SPLIT_WORD.search(split_files[0].name)
    if word is not None and len(suffixes) == 1:
        pattern = str(common / f"{split_files[0].name[: word.end()]}*{suffixes.pop()}")
        if sorted(f for f in map(Path, glob.glob(pattern)) if _is_data_file(f)) == split_files:
            return pattern
    return str(split_files[0])


def _read_rows(path: Path, prompt_key: str, answer_key: str) -> LoadReport:
    report = LoadReport(rows=[])
    if path.suffix in (".parquet", ".arrow"):
        records, decode = _table_records(path), dict
    elif path.suffix in (".csv", ".tsv"):
        records, decode = _csv_records(path), _csv_row
    elif _starts_with(path, "["):
        records, decode = _json_array(path), _as_is
    else:
        records, decode = _jsonl_lines(path), json.loads
    for where, record in records:
        try:
            row = parse_row(decode(record), prompt_key, answer_key, path.parent)
            report.rows.append(replace(row, origin=f"{path}:{where}") if row.media else row)
        except (json.JSONDecodeError, ValueError) as e:
            report.num_skipped += 1
            report.problems.append(f"{path}:{where}: skipped malformed row: {e}")
    return report


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every non-blank line."""
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield line_no, line


def _as_is(record: Any) -> Any:
    return record


def _starts_with(path: Path, char: str) -> bool:
    """Whether the file's first character that is not white space is `char`."""
    with path.open() as f:
        while chunk := f.read(4096):
            text = chunk.lstrip()
            if text:
                return text[0] == char
    return False


def _json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """(record number, record) of a file holding one JSON array."""
    try:
        records = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset file {str(path)!r} is not a JSON array: {e}") from None
    if not isinstance(records, list):
        raise ValueError(
            f"dataset file {str(path)!r} holds a JSON {type(records).__name__}, not an array"
        )
    yield from enumerate(records, start=1)


def _csv_records(path: Path) -> Iterator[tuple[int, dict[str | None, Any]]]:
    """(line number, record) of every row of a CSV (or, .tsv, tab-separated) file under its
    header row; a quoted value may span lines (the number is the row's last line)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
        for record in reader:
            yield reader.line_num, record


def _csv_row(record: dict[str | None, Any]) -> dict[str, Any]:
    if None in record:  # csv.DictReader's key for values past the header's columns
        raise ValueError(f"{len(record[None])} more value(s) than the header has columns")
    return record  # type: ignore[return-value]


def _table_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(record number, record) of a Parquet file or an Arrow IPC file (stream format, as
    `save_to_disk` writes, or file format)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {str(path)!r} needs pyarrow: pip install pyarrow") from None
    try:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
        else:
            with pa.memory_map(str(path)) as source:
                is_file_format = source.read(6) == b"ARROW1"
                source.seek(0)
                reader = pa.ipc.open_file if is_file_format else pa.ipc.open_stream
                table = reader(source).read_all()
    except pa.ArrowException as e:
        raise ValueError(
            f"dataset file {str(path)!r} is not a readable {path.suffix[1:]} file: {e}"
        ) from None
    yield from enumerate(table.to_pylist(), start=1)

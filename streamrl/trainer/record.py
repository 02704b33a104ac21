"""The sample record (`run.record_samples`): what every optimizer step trained, for replay.

After optimizer step k the trainer writes `run_dir/samples/step-<k>.npz` (numpy's compressed
archive: arrays only, no pickle), before the step's line in `trained_samples.jsonl` and before
any checkpoint that covers the step, and appends a line to `run_dir/samples/index.jsonl` (step,
bytes, rows, micro-batches, loss, gradient norm). A step's file holds every row its
`BatchTrainer` received, in the order received, each field as the learner read it (token ids,
behaviour log-probs, versions, reward, advantages, and pi_old / reference log-probs when the loss
reads them), the micro-batch boundaries (and the rows dropped as dynamic
sampling's surplus), the step's loss and gradient norm, and what else the step depended on (the
trainer's torch threads, the learner's version and schedule length, the staleness limit).
`streamrl replay` (`trainer/replay.py`) trains the steps again from it.

Encoding: each field whose values are numbers or one-dimensional numeric arrays becomes three
arrays, `<field>.data` (the rows' values end to end, in a dtype that holds every row's exactly),
`<field>.len` (each row's length; -1 for None, -2 where the row lacks the field) and
`<field>.ndim` (0 for a scalar, 1 for an array); every other field (ids, statuses, reward
components) is a list of JSON values in the `meta` entry, a JSON text with the step's figures.

A trainer that starts from checkpoint c (a resume, or a restart in place) first removes the
record of every step after c (`truncate_record`), as the run's logs are rewound to c: the steps
it trains again are recorded anew.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RECORD_DIR = "samples"
INDEX = "index.jsonl"
FORMAT = 1
NONE, ABSENT = -1, -2  # `<field>.len` of a row whose value is None / that lacks the field

# (kind, drop reason or None, first row, end row): a micro-batch ("train") or rows dropped
# without training ("drop", dynamic sampling's surplus), as `BatchTrainer` received them.
Event = tuple[str, str | None, int, int]


def record_dir(run_dir: Path) -> Path:
    return Path(run_dir) / RECORD_DIR


def step_file(run_dir: Path, step: int) -> Path:
    return record_dir(run_dir) / f"step-{step:06d}.npz"


def recorded_steps(run_dir: Path) -> list[int]:
    """The steps with a record in `run_dir`, in order."""
    return sorted(int(p.stem.removeprefix("step-")) for p in record_dir(run_dir).glob("step-*.npz"))


@dataclass
class StepRecord:
    step: int
    """The version the step made: the record of the k-th optimizer step is step k."""
    rows: list[dict[str, Any]]
    events: list[Event]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        return float(self.meta["loss"])

    @property
    def grad_norm(self) -> float:
        return float(self.meta["grad_norm"])

    def micro_batches(self) -> list[list[dict[str, Any]]]:
        return [self.rows[lo:hi] for kind, _, lo, hi in self.events if kind == "train"]


# -- writing ---------------------------------------------------------------------------------------


def _numeric(value: Any) -> np.ndarray | None:
    """`value` as a 0- or 1-dimensional numeric array, or None when it is not one."""
    if isinstance(value, (str, bytes, Mapping)) or value is None:
        return None
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        return None
    if array.dtype.kind not in "biuf" or array.ndim > 1:
        return None
    return array


def _json_value(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return repr(value)  # no field the loss reads is of another type: kept for inspection only


def encode_step(
    step: int, rows: Sequence[Mapping[str, Any]], events: Sequence[Event], meta: dict[str, Any]
) -> dict[str, np.ndarray]:
    """The arrays of one step's record (what `write_step` saves, `decode_step` reads)."""
    arrays: dict[str, np.ndarray] = {}
    json_fields: dict[str, list[Any]] = {}
    absent: dict[str, list[int]] = {}
    for key in sorted({k for r in rows for k in r}):
        values = [r.get(key, ...) for r in rows]
        present = [v for v in values if v is not ... and v is not None]
        numeric = [_numeric(v) for v in present]
        if present and all(a is not None for a in numeric):
            dtype = np.result_type(*numeric)
            lengths = [
                ABSENT if v is ... else NONE if v is None else int(np.size(v)) for v in values
            ]
            arrays[f"{key}.data"] = (
                np.concatenate([a.reshape(-1).astype(dtype) for a in numeric])
                if numeric
                else np.zeros(0, dtype)
            )
            arrays[f"{key}.len"] = np.asarray(lengths, dtype=np.int64)
            arrays[f"{key}.ndim"] = np.asarray(
                [0 if v is ... or v is None else np.ndim(v) for v in values], dtype=np.int8
            )
        else:
            json_fields[key] = [None if v is ... else v for v in values]
            absent[key] = [i for i, v in enumerate(values) if v is ...]
    header = {
        **meta,
        "format": FORMAT,
        "step": step,
        "num_rows": len(rows),
        "events": [list(e) for e in events],
        "json_fields": json_fields,
        "absent": {k: v for k, v in absent.items() if v},
    }
    arrays["meta"] = np.asarray(json.dumps(header, default=_json_value))
    return arrays


def write_step(
    run_dir: Path,
    step: int,
    rows: Sequence[Mapping[str, Any]],
    events: Sequence[Event],
    meta: dict[str, Any],
) -> int:
    """Write step `step`'s record (flushed to disk, then renamed into place) and its index line;
    return the file's size in bytes."""
    folder = record_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = step_file(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    with tmp.open("wb") as f:
        np.savez_compressed(f, **encode_step(step, rows, events, meta))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(final)
    size = final.stat().st_size
    line = {
        "step": step,
        "file": final.name,
        "bytes": size,
        "rows": len(rows),
        "micro_batches": sum(kind == "train" for kind, *_ in events),
        "loss": meta.get("loss"),
        "grad_norm": meta.get("grad_norm"),
    }
    with (folder / INDEX).open("a") as f:
        f.write(json.dumps(line) + "\n")
    return size


def truncate_record(run_dir: Path, from_step: int) -> int:
    """Forget the record of every step from `from_step` on (files and index lines); return how
    many step files were removed."""
    folder = record_dir(run_dir)
    if not folder.is_dir():
        return 0
    removed = 0
    for path in folder.glob("*step-*.npz"):
        if path.name.startswith(".tmp-") or int(path.stem.removeprefix("step-")) >= from_step:
            path.unlink(missing_ok=True)
            removed += not path.name.startswith(".tmp-")
    index = folder / INDEX
    if index.exists():
        kept = [
            line
            for line in index.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < from_step
        ]
        tmp = index.with_name(f".tmp-{INDEX}")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(index)
    return removed


def record_bytes(run_dir: Path) -> int:
    """Total size of the record's step files."""
    return sum(p.stat().st_size for p in record_dir(run_dir).glob("step-*.npz"))


# -- reading ---------------------------------------------------------------------------------------


def decode_step(arrays: Mapping[str, np.ndarray]) -> StepRecord:
    meta = json.loads(str(arrays["meta"][()]))
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"sample record format {meta.get('format')!r}; this streamrl reads {FORMAT}"
        )
    num = int(meta.pop("num_rows"))
    rows: list[dict[str, Any]] = [{} for _ in range(num)]
    for name in arrays:
        if not name.endswith(".data"):
            continue
        key = name.removesuffix(".data")
        data, lengths, ndims = arrays[name], arrays[f"{key}.len"], arrays[f"{key}.ndim"]
        offset = 0
        for row, length, ndim in zip(rows, lengths.tolist(), ndims.tolist(), strict=True):
            if length == ABSENT:
                continue
            if length == NONE:
                row[key] = None
                continue
            chunk = data[offset : offset + length]
            offset += length
            row[key] = chunk[0].item() if ndim == 0 else chunk.copy()
    for key, values in meta.pop("json_fields").items():
        missing = set(meta["absent"].get(key, ()))
        for i, (row, value) in enumerate(zip(rows, values, strict=True)):
            if i not in missing:
                row[key] = value
    events = [(str(k), r, int(lo), int(hi)) for k, r, lo, hi in meta.pop("events")]
    return StepRecord(step=int(meta["step"]), rows=rows, events=events, meta=meta)


def read_step(run_dir: Path, step: int) -> StepRecord:
    path = step_file(run_dir, step)
    if not path.is_file():
        have = recorded_steps(run_dir)
        span = f"steps {have[0]}..{have[-1]}" if have else "no step"
        raise FileNotFoundError(
            f"{path} is missing: {run_dir} has a sample record of {span} "
            "(runs record with run.record_samples=true)"
        )
    with np.load(path, allow_pickle=False) as npz:
        return decode_step({name: npz[name] for name in npz.files})

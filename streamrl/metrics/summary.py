"""End-of-run summary: `summary.json` for machines and a rich table for people.

The driver collects one flat mapping at the end of a run and hands it to
`write_summary` and `print_summary`. Any keys are accepted; these are shown first,
under friendlier labels, when present:

    run_name, initial_eval_accuracy, final_eval_accuracy, num_steps, stopped_early, wall_time_s,
    tokens_per_s, peak_memory_bytes, num_samples_trained, num_samples_dropped
    (an int, or a mapping reason -> count), train_reward_first, train_reward_last,
    train_reward_components_last, trainer_idle_fraction, final_model_dir

Values are formatted by key suffix, so new keys look right without code changes:
`*_bytes` as GiB, `*_per_s` as a rate, `*_s` as a duration (m:ss from one minute on),
`*_fraction` as a percentage, other floats to 4 significant digits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from numbers import Integral, Real
from pathlib import Path

from rich.console import Console
from rich.table import Table

SUMMARY_FILENAME = "summary.json"

_LABELS: dict[str, str] = {
    "run_name": "run",
    "initial_eval_accuracy": "initial eval accuracy",
    "final_eval_accuracy": "final eval accuracy",
    "num_steps": "steps",
    "stopped_early": "stopped early",
    "wall_time_s": "wall time",
    "tokens_per_s": "tokens/s",
    "peak_memory_bytes": "peak memory",
    "num_samples_trained": "samples trained",
    "num_samples_dropped": "samples dropped",
    "train_reward_first": "train reward, first steps",
    "train_reward_last": "train reward, last steps",
    "train_reward_components_last": "reward components, last steps",
    "trainer_idle_fraction": "trainer idle",
    "final_model_dir": "trained model",
}


def write_summary(run_dir: Path, summary: Mapping) -> Path:
    """Write `summary` to `run_dir/summary.json` (indent 2, sorted keys) and return the path.

    The file is replaced atomically, so a reader never sees half a summary.
    """
    path = Path(run_dir) / SUMMARY_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(summary, indent=2, sort_keys=True, default=_json_default) + "\n"
    tmp_path = path.with_suffix(".json.tmp")
    tmp_path.write_text(text, encoding="utf-8")
    os.replace(tmp_path, path)
    return path


def render_summary_table(summary: Mapping, *, title: str = "run summary") -> Table:
    """A two-column table of whichever summary keys are present, known keys first."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")  # paths whole, wrapped
    known = [key for key in _LABELS if key in summary]
    others = sorted(key for key in summary if key not in _LABELS)
    for key in known + others:
        table.add_row(_LABELS.get(key, key.replace("_", " ")), _format_entry(key, summary))
    return table


def print_summary(
    summary: Mapping, *, console: Console | None = None, title: str = "run summary"
) -> None:
    """Print the summary table to `console` (default: stdout)."""
    (console or Console()).print(render_summary_table(summary, title=title))


def _format_entry(key: str, summary: Mapping) -> str:
    text = format_value(key, summary[key])
    if key == "final_eval_accuracy":
        initial, final = summary.get("initial_eval_accuracy"), summary[key]
        if _is_number(initial) and _is_number(final):
            text += f" ({final - initial:+.3g})"
    return text


def format_value(key: str, value: object) -> str:
    """Format one summary value according to its key's suffix (see module docstring)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        return _format_breakdown(key, value)
    if isinstance(value, list | tuple):
        return ", ".join(format_value(key, v) for v in value)
    if not _is_number(value):
        return str(value)
    if key.endswith("_bytes"):
        return f"{value / 2**30:.3g} GiB"
    if key.endswith("_per_s"):
        return _format_number(value)
    if key.endswith("_s") or key.endswith("_seconds"):
        return format_duration(float(value))
    if key.endswith("_fraction"):
        return f"{100 * value:.1f}%"
    return _format_number(value)


def format_duration(seconds: float) -> str:
    """Seconds as `12.3 s` below one minute, `m:ss` below one hour, else `h:mm:ss`."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _format_breakdown(key: str, counts: Mapping) -> str:
    """`{"stale": 12, "filtered": 3}` -> `15 (stale 12, filtered 3)`; a mapping of other
    numbers (means of reward components) is listed without a total."""
    parts = ", ".join(f"{reason} {format_value(key, n)}" for reason, n in counts.items())
    if counts and all(isinstance(n, Integral) and _is_number(n) for n in counts.values()):
        return f"{format_value(key, sum(counts.values()))} ({parts})"
    return parts or "-"


def _format_number(value: Real) -> str:
    if isinstance(value, Integral):
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{float(value):,.0f}"
    return f"{float(value):.4g}"


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _json_default(value: object) -> object:
    """Make numpy scalars/arrays and paths JSON-able; anything else is a caller bug."""
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(
        f"summary value {value!r} ({type(value).__name__}) is not JSON-serialisable; "
        "convert it to a number, string, list or dict first"
    )

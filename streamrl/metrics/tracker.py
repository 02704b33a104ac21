"""Per-step metrics sink of a run: a JSONL file, TensorBoard event files, W&B and the console.

The driver calls `MetricsTracker.log(step, metrics)` once per training step with a flat
mapping of slash-separated keys (`reward/mean`, `eval/accuracy`, `time/trainer_s`,
`staleness/hist`). Up to four outputs, each for a different reader:

    run_dir/metrics.jsonl   source of truth; one JSON object per line, flushed on every
                            call so a SIGKILL loses at most the line being written.
                            Plots, summaries and tests read this file.
    run_dir/tb/             TensorBoard event files: scalars as scalars, lists as
                            histograms, None values skipped.
    W&B                     with `run.wandb=true`: the same, through a `WandbRun` that the
                            controller opens once per run and finishes (wandb_run.py).
    console                 one compact line every `console_every` steps (0 = never).

When a run resumes from a checkpoint at step S, `truncate_from(S)` drops the JSONL lines
with step >= S and tells TensorBoard to discard its points from S on, so the resumed run
does not leave two overlapping curves behind (W&B cannot drop points: it keeps both).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

if TYPE_CHECKING:
    from streamrl.metrics.wandb_run import WandbRun

MetricValue = float | int | list[float] | None

METRICS_FILENAME = "metrics.jsonl"
TB_DIRNAME = "tb"
_RESERVED_KEYS = ("step", "time")
_MAX_HISTOGRAM_BUCKETS = 30


class MetricsTracker:
    """Writes one record per step to JSONL and, optionally, TensorBoard, W&B and the console.

    Create one per run in the driver process and `close()` it (or use it as a context
    manager) at the end. Safe to call from several threads of that process.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        wandb: WandbRun | None = None,
        console_every: int = 0,
        console: Console | None = None,
    ) -> None:
        """`wandb`: mirror every step to this W&B run; its owner finishes it, not `close()`."""
        if console_every < 0:
            raise ValueError(f"console_every must be >= 0 (0 = never), got {console_every}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILENAME
        self.console_every = console_every
        self._console = console or Console()
        self._lock = threading.Lock()
        _drop_torn_last_line(self.metrics_path)
        self._jsonl = self.metrics_path.open("a", encoding="utf-8")
        self._tb = (
            EventFileWriter(str(self.run_dir / TB_DIRNAME), flush_secs=10) if tensorboard else None
        )
        self._wandb = wandb
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        """Record the metrics of one step.

        Values may be numbers, lists of numbers (histograms in TensorBoard) or None
        (kept as null in the JSONL, skipped in TensorBoard). Keys `step` and `time`
        are reserved for the record itself.
        """
        if self._closed:
            raise RuntimeError("MetricsTracker.log called after close(); create a new tracker")
        if not isinstance(step, Integral):
            raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})")
        clean = {key: _to_json_value(key, value) for key, value in metrics.items()}
        for key in _RESERVED_KEYS:
            if key in clean:
                raise ValueError(f"metric key {key!r} is reserved; rename it (e.g. 'run/{key}')")
        wall_time = time.time()
        record = {"step": int(step), "time": wall_time, **clean}
        line = json.dumps(record) + "\n"
        with self._lock:
            self._jsonl.write(line)
            self._jsonl.flush()
            if self._tb is not None:
                self._tb.add_event(_tb_event(int(step), wall_time, clean))
            if self._wandb is not None:
                self._wandb.log(int(step), clean)
        if self.console_every and step % self.console_every == 0:
            self._console.print(_console_line(int(step), clean), highlight=False, soft_wrap=True)

    def truncate_from(self, step: int) -> None:
        """Keep only records with step < `step`; call when resuming from a checkpoint.

        The JSONL file is rewritten atomically. For TensorBoard a session-start event at
        `step` is written, which makes TensorBoard drop older points with step >= `step`.
        """
        if self._closed:
            raise RuntimeError("MetricsTracker.truncate_from called after close()")
        with self._lock:
            self._jsonl.close()
            kept = [r for r in read_metrics(self.run_dir) if r["step"] < step]
            tmp_path = self.metrics_path.with_suffix(".jsonl.tmp")
            with tmp_path.open("w", encoding="utf-8") as tmp:
                tmp.writelines(json.dumps(record) + "\n" for record in kept)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.replace(tmp_path, self.metrics_path)
            self._jsonl = self.metrics_path.open("a", encoding="utf-8")
            if self._tb is not None:
                restart = event_pb2.Event(
                    wall_time=time.time(),
                    step=int(step),
                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
                )
                self._tb.add_event(restart)
                self._tb.flush()

    def flush(self) -> None:
        """Push buffered TensorBoard events to disk (the JSONL is always flushed)."""
        with self._lock:
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        """Flush and close all outputs. Calling it twice is harmless."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()

    def __enter__(self) -> MetricsTracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(run_dir: Path) -> list[dict]:
    """All records of `run_dir/metrics.jsonl`, in file order ([] if there is none).

    A torn last line (the process was killed mid-write) is ignored; a malformed line
    anywhere else means the file is corrupt and raises ValueError.
    """
    path = Path(run_dir) / METRICS_FILENAME
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if line_number == len(lines):
                break  # torn final write; the writer was killed mid-line
            raise ValueError(
                f"{path}:{line_number} is not valid JSON ({err}); file corrupt"
            ) from err
    return records


def _drop_torn_last_line(path: Path) -> None:
    """Cut a partial last line so that appending starts on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with path.open("r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


def _to_json_value(key: str, value: object) -> MetricValue:
    """Normalise numpy scalars/arrays and tuples to plain JSON-able Python values."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        return float(value)
    if isinstance(value, np.ndarray | Sequence) and not isinstance(value, str | bytes):
        return [float(v) for v in np.asarray(value, dtype=np.float64).ravel()]
    raise TypeError(
        f"metric {key!r} has unsupported value {value!r} ({type(value).__name__}); "
        "expected a number, a list of numbers or None"
    )


def _tb_event(step: int, wall_time: float, metrics: Mapping[str, MetricValue]) -> event_pb2.Event:
    event = event_pb2.Event(wall_time=wall_time, step=step)
    for key, value in metrics.items():
        if value is None:
            continue
        if isinstance(value, list):
            if value:
                event.summary.value.add(tag=key, histo=_histogram_proto(value))
        else:
            event.summary.value.add(tag=key, simple_value=float(value))
    return event


def histogram_buckets(values: list[float]) -> tuple[np.ndarray, np.ndarray] | None:
    """(counts, edges) of the finite `values` as TensorBoard and W&B show them; None if there
    is no finite value. Integers spanning fewer than 30 values get one bucket each."""
    array = np.asarray(values, dtype=np.float64)
    array = array[np.isfinite(array)]
    if array.size == 0:
        return None
    low, high = float(array.min()), float(array.max())
    integral = bool(np.all(array == np.round(array)))
    if integral and high - low < _MAX_HISTOGRAM_BUCKETS:
        # One bucket per integer so discrete counts (e.g. staleness) stay exact.
        edges = np.arange(low - 0.5, high + 1.0, 1.0)
    else:
        edges = np.histogram_bin_edges(array, bins=min(_MAX_HISTOGRAM_BUCKETS, array.size))
    return np.histogram(array, bins=edges)


def _histogram_proto(values: list[float]) -> summary_pb2.HistogramProto:
    buckets = histogram_buckets(values)
    if buckets is None:
        return summary_pb2.HistogramProto()
    counts, edges = buckets
    array = np.asarray(values, dtype=np.float64)
    array = array[np.isfinite(array)]
    low, high = float(array.min()), float(array.max())
    return summary_pb2.HistogramProto(
        min=low,
        max=high,
        num=float(array.size),
        sum=float(array.sum()),
        sum_squares=float(np.square(array).sum()),
        bucket_limit=[float(e) for e in edges[1:]],
        bucket=[float(c) for c in counts],
    )


def _console_line(step: int, metrics: Mapping[str, MetricValue]) -> str:
    parts = [f"step {step}"]
    for key, value in metrics.items():
        if value is None or isinstance(value, list):
            continue
        parts.append(f"{key} {_compact(value)}")
    return " | ".join(parts)


def _compact(value: float | int) -> str:
    if isinstance(value, Integral):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"

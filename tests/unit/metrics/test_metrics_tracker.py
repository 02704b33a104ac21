"""MetricsTracker: the JSONL source of truth, TensorBoard event files, resume truncation."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from streamrl.metrics import MetricsTracker, read_metrics


def _accumulator(run_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir / "tb"))
    accumulator.Reload()
    return accumulator


def test_log_appends_one_json_line_per_step(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path, tensorboard=False) as tracker:
        tracker.log(0, {"reward/mean": 0.25, "staleness/hist": [0, 1, 1], "eval/accuracy": None})
        tracker.log(1, {"reward/mean": 0.5, "time/trainer_s": 1.5})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 0
    assert first["reward/mean"] == 0.25
    assert first["staleness/hist"] == [0.0, 1.0, 1.0]
    assert first["eval/accuracy"] is None
    assert isinstance(first["time"], float) and first["time"] > 1.6e9
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert not (tmp_path / "tb").exists()


def test_each_line_is_flushed_before_close(tmp_path: Path) -> None:
    tracker = MetricsTracker(tmp_path, tensorboard=False)
    tracker.log(7, {"reward/mean": 1.0})
    # Read through a separate handle while the tracker is still open, as after a SIGKILL.
    records = read_metrics(tmp_path)
    assert [(r["step"], r["reward/mean"]) for r in records] == [(7, 1.0)]
    tracker.close()


def test_tensorboard_scalars_and_histograms_read_back(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path) as tracker:
        for step in range(3):
            tracker.log(
                step,
                {"reward/mean": 0.1 * step, "staleness/hist": [0, 1, 1, 2], "eval/accuracy": None},
            )

    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    accumulator = _accumulator(tmp_path)
    scalars = accumulator.Scalars("reward/mean")
    assert [e.step for e in scalars] == [0, 1, 2]
    assert scalars[2].value == pytest.approx(0.2)
    histogram = accumulator.Histograms("staleness/hist")[0].histogram_value
    assert histogram.num == 4 and histogram.max == 2
    assert list(histogram.bucket) == [1.0, 2.0, 1.0]
    assert "eval/accuracy" not in accumulator.Tags()["scalars"]


def test_continuous_list_becomes_bucketed_histogram(tmp_path: Path) -> None:
    values = np.random.default_rng(0).normal(size=500)
    with MetricsTracker(tmp_path) as tracker:
        tracker.log(0, {"advantage/hist": values, "reward/mean": np.float32(0.5)})

    histogram = _accumulator(tmp_path).Histograms("advantage/hist")[0].histogram_value
    assert histogram.num == 500
    assert sum(histogram.bucket) == 500
    assert 1 < len(histogram.bucket) <= 30
    assert histogram.min == pytest.approx(values.min())
    assert read_metrics(tmp_path)[0]["reward/mean"] == 0.5


def test_truncate_from_drops_later_steps_in_jsonl_and_tensorboard(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path) as tracker:
        for step in range(10):
            tracker.log(step, {"reward/mean": float(step)})

    with MetricsTracker(tmp_path) as resumed:
        resumed.truncate_from(5)
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
        for step in range(5, 7):
            resumed.log(step, {"reward/mean": 100.0 + step})

    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4, 5, 6]
    scalars = _accumulator(tmp_path).Scalars("reward/mean")
    assert [(e.step, e.value) for e in scalars] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 105.0),
        (6, 106.0),
    ]


def test_torn_last_line_is_ignored_and_cut_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "time": 1.0, "reward/mean": 0.5}\n{"step": 1, "ti')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]

    with MetricsTracker(tmp_path, tensorboard=False) as tracker:
        tracker.log(1, {"reward/mean": 0.75})
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.5, 0.75]


def test_read_metrics_rejects_corrupt_middle_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2 is not valid JSON"):
        read_metrics(tmp_path)


def test_read_metrics_of_missing_run_is_empty(tmp_path: Path) -> None:
    assert read_metrics(tmp_path / "nothing") == []


def test_reserved_keys_and_bad_values_are_rejected(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path, tensorboard=False) as tracker:
        with pytest.raises(ValueError, match="reserved"):
            tracker.log(0, {"step": 3})
        with pytest.raises(TypeError, match="unsupported value"):
            tracker.log(0, {"run/name": "abc"})
    assert read_metrics(tmp_path) == []


def test_console_line_every_n_steps(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=200)
    with MetricsTracker(tmp_path, tensorboard=False, console_every=2, console=console) as tracker:
        for step in range(4):
            tracker.log(step, {"reward/mean": 0.123456, "throughput/tokens_per_s": 12345.6})

    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 0", "step 2"]
    assert "reward/mean 0.1235" in lines[0]
    assert "throughput/tokens_per_s 12,346" in lines[0]

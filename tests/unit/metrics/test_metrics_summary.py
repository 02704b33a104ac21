"""End-of-run summary: summary.json layout and the formatting of the rich table."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from streamrl.metrics import print_summary, render_summary_table, write_summary
from streamrl.metrics.summary import format_duration, format_value


def _rendered(summary: dict) -> str:
    out = io.StringIO()
    Console(file=out, width=120).print(render_summary_table(summary))
    return out.getvalue()


def test_write_summary_sorted_and_indented(tmp_path: Path) -> None:
    path = write_summary(tmp_path, {"num_steps": 3, "final_eval_accuracy": np.float32(0.5)})
    assert path == tmp_path / "summary.json"
    text = path.read_text()
    assert text.index('"final_eval_accuracy"') < text.index('"num_steps"')
    assert '\n  "num_steps": 3' in text
    assert json.loads(text) == {"final_eval_accuracy": 0.5, "num_steps": 3}


def test_write_summary_rejects_unserialisable_values(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        write_summary(tmp_path, {"bad": object()})


def test_table_renders_subset_of_keys_with_formatting() -> None:
    text = _rendered(
        {
            "initial_eval_accuracy": 0.3125,
            "final_eval_accuracy": 0.625,
            "wall_time_s": 125.4,
            "peak_memory_bytes": 1.5 * 2**30,
            "num_samples_dropped": {"stale": 12, "filtered": 3},
            "trainer_idle_fraction": 0.1234,
            "custom_metric": 3.14159265,
        }
    )
    assert "initial eval accuracy" in text and "0.3125" in text
    assert "0.625 (+0.312)" in text
    assert "2:05" in text
    assert "1.5 GiB" in text
    assert "15 (stale 12, filtered 3)" in text
    assert "12.3%" in text
    assert "custom metric" in text and "3.142" in text
    assert "tokens/s" not in text and "steps" not in text


def test_means_of_reward_components_are_listed_not_totalled_as_counts_are() -> None:
    text = _rendered({"train_reward_components_last": {"format": 0.95, "correct": 0.5}})
    assert "reward components, last steps" in text and "format 0.95, correct 0.5" in text
    assert "1.45" not in text


def test_known_keys_come_first() -> None:
    text = _rendered({"aaa_first_alphabetically": 1, "num_steps": 200})
    assert text.index("steps") < text.index("aaa first alphabetically")


def test_print_summary_writes_to_console() -> None:
    out = io.StringIO()
    print_summary({"tokens_per_s": 12345.67, "num_steps": 1200}, console=Console(file=out))
    assert "12,346" in out.getvalue() and "1,200" in out.getvalue()


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.25, "0.25 s"), (59.4, "59.4 s"), (60, "1:00"), (3599, "59:59"), (3725, "1:02:05")],
)
def test_format_duration(seconds: float, expected: str) -> None:
    assert format_duration(seconds) == expected


def test_format_value_edge_cases() -> None:
    assert format_value("anything", None) == "-"
    assert format_value("resumed", True) == "yes"
    assert format_value("run_name", "gsm8k-qwen") == "gsm8k-qwen"
    assert format_value("num_samples_dropped", {}) == "-"


def test_a_long_path_is_printed_whole_on_a_narrow_console() -> None:
    path = "runs/20261202-012254-3/checkpoints/step-000100/model"
    buf = io.StringIO()
    print_summary({"final_model_dir": path}, console=Console(file=buf, width=60))
    cells = [line.split("│")[2].strip() for line in buf.getvalue().splitlines() if "│" in line]
    assert path in "".join(cells)

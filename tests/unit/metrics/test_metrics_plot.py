"""plot_run writes a real PNG for full runs and for degenerate ones."""

from pathlib import Path

import pytest

from streamrl.metrics import plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1024


def test_plot_with_std_band_and_sparse_eval(tmp_path: Path) -> None:
    metrics = [
        {
            "step": step,
            "reward/mean": step / 20,
            "reward/std": 0.1,
            "eval/accuracy": (0.2 + step / 100) if step % 5 == 0 else None,
        }
        for step in range(20)
    ]
    out = plot_run(metrics, tmp_path / "plots" / "curves.png", title="toy run")
    assert out == tmp_path / "plots" / "curves.png"
    _assert_png(out)


@pytest.mark.parametrize(
    "metrics",
    [
        [{"step": 0, "reward/mean": 0.3}],
        [{"step": 0, "reward/mean": 0.3, "reward/std": 0.0, "eval/accuracy": 0.5}],
        [{"step": s, "reward/mean": 0.1 * s} for s in range(5)],
        [{"step": 0, "eval/accuracy": 0.4}],
        [],
    ],
    ids=["single-step", "single-step-with-eval", "no-eval", "no-reward", "empty"],
)
def test_plot_degenerate_runs(tmp_path: Path, metrics: list[dict]) -> None:
    _assert_png(plot_run(metrics, tmp_path / "curves.png"))

"""One PNG per run showing whether it learned: training reward and held-out accuracy over steps.

`plot_run(read_metrics(run_dir), run_dir / "curves.png")` is called at the end of a run
(and by benchmark scripts comparing runs). Two stacked panels share the step axis:

    top     reward/mean per step, with a shaded ±reward/std band where logged
    bottom  eval/accuracy at the steps that ran an evaluation, as markers

Rendering uses matplotlib's Agg canvas directly (no pyplot, no display, no global figure
state), so it works on headless machines and inside long-lived processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_run(metrics: list[dict], out_png: Path, title: str = "") -> Path:
    """Draw the reward and eval-accuracy curves of `metrics` (records from `read_metrics`).

    Records lacking a key (or holding None for it) are left out of that curve; a panel
    with nothing to draw says so instead of failing. Returns `out_png`.
    """
    # Imported here, not at module top, so that importing streamrl.metrics in every
    # worker process does not pay for (or build a font cache for) matplotlib.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)

    fig = Figure(figsize=(8, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    reward_ax, eval_ax = fig.subplots(2, 1, sharex=True)
    if title:
        fig.suptitle(title)

    reward_rows = [r for r in metrics if _number(r.get("reward/mean")) is not None]
    steps = [r["step"] for r in reward_rows]
    means = [float(r["reward/mean"]) for r in reward_rows]
    if reward_rows:
        reward_ax.plot(steps, means, marker="o" if len(steps) < 30 else None, label="reward mean")
        band_rows = [r for r in reward_rows if _number(r.get("reward/std")) is not None]
        if band_rows:
            band_steps = [r["step"] for r in band_rows]
            band_means = [float(r["reward/mean"]) for r in band_rows]
            band_stds = [float(r["reward/std"]) for r in band_rows]
            reward_ax.fill_between(
                band_steps,
                [m - s for m, s in zip(band_means, band_stds, strict=True)],
                [m + s for m, s in zip(band_means, band_stds, strict=True)],
                alpha=0.25,
                label="±1 std",
            )
        reward_ax.legend(loc="best")
    else:
        _say_empty(reward_ax, "no reward/mean logged")
    reward_ax.set_ylabel("reward")
    reward_ax.grid(alpha=0.3)

    eval_rows = [r for r in metrics if _number(r.get("eval/accuracy")) is not None]
    if eval_rows:
        eval_ax.plot(
            [r["step"] for r in eval_rows],
            [float(r["eval/accuracy"]) for r in eval_rows],
            marker="o",
            color="tab:green",
        )
    else:
        _say_empty(eval_ax, "no eval/accuracy logged")
    eval_ax.set_ylabel("held-out accuracy")
    eval_ax.set_xlabel("step")
    eval_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    plotted_steps = {r["step"] for r in reward_rows + eval_rows}
    if len(plotted_steps) == 1:  # matplotlib would zoom to +-0.06 around a lone step
        (only_step,) = plotted_steps
        eval_ax.set_xlim(only_step - 1, only_step + 1)
    eval_ax.grid(alpha=0.3)

    fig.savefig(out_png)
    return out_png


def _number(value: object) -> float | None:
    """`value` as a float if it is a plain number, else None (missing, null, a list)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _say_empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="gray")

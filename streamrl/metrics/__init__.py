"""Metrics of a run: what roles measure, where it is recorded, and how people see it.

    stats     pure helpers roles use to build metrics (summaries, histograms, tokens/s)
    tracker   per-step sink: metrics.jsonl (source of truth), TensorBoard, console line
    wandb_run the same steps, the config and the summary in Weights & Biases (run.wandb)
    progress  live progress bar of the RL loop and of other long phases
    memory    peak RSS of the whole process tree, sampled on a thread
    summary   end-of-run summary.json and table
    plot      reward and held-out accuracy curves as a PNG

Importing this package does not import matplotlib; `plot_run` does that when called.
"""

from streamrl.metrics.memory import PeakMemorySampler, process_tree_rss
from streamrl.metrics.plot import plot_run
from streamrl.metrics.progress import RunProgress, phase
from streamrl.metrics.stats import Throughput, histogram_counts, summarize
from streamrl.metrics.summary import print_summary, render_summary_table, write_summary
from streamrl.metrics.tracker import MetricsTracker, read_metrics
from streamrl.metrics.wandb_run import WandbRun

__all__ = [
    "MetricsTracker",
    "PeakMemorySampler",
    "RunProgress",
    "Throughput",
    "WandbRun",
    "histogram_counts",
    "phase",
    "plot_run",
    "print_summary",
    "process_tree_rss",
    "read_metrics",
    "render_summary_table",
    "summarize",
    "write_summary",
]

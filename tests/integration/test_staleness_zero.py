"""`max_staleness=0` must reproduce the synchronous loop: the same samples and the same losses.

Inline mode runs the real roles over the real bus (claim, lease, ack, weight sync), one at a
time; threads mode runs them at once, each in its own thread; sync mode is the plain
generate-then-train loop. With the same seed they must draw identical tokens for every
sample (compared through each step's samples digest) and compute the same loss at every step. The
same run also checks that trainer and rollout log-probs agree on identical weights (fp32).
"""

from __future__ import annotations

import math

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli

pytestmark = pytest.mark.integration


def _run(mode: str, tmp_path, cache) -> tuple[list[dict], list[dict]]:
    run_dir = tmp_path / mode
    run_cli(
        [
            "train",
            *QUICK,
            "trainer.steps=5",
            "trainer.eval_every=0",
            "rollout.max_staleness=0",
            f"runtime.mode={mode}",
            f"run.cache_dir={cache}",
            f"run.run_dir={run_dir}",
        ]
    )
    return read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "trained_samples.jsonl")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, quick_cache):
    return _run("sync", tmp_path_factory.mktemp("sync"), quick_cache)


@pytest.mark.parametrize("mode", ["inline", "threads"])
def test_staleness_zero_reproduces_sync_loop(mode, sync_run, tmp_path, quick_cache):
    inline_metrics, inline_samples = _run(mode, tmp_path, quick_cache)

    assert_reproduces(sync_run, (inline_metrics, inline_samples), steps=5)


def assert_reproduces(sync_run, other_run, *, steps: int) -> None:
    """The same samples (ids and tokens, every step) and the same losses as the sync loop, and
    strict on-policy training: every token sampled by the weights being trained, the engine's
    log-probs matching the trainer's recomputation on those identical weights."""
    (sync_metrics, sync_samples), (metrics, samples) = sync_run, other_run
    assert [s["digest"] for s in sync_samples] == [s["digest"] for s in samples]
    assert [sorted(s["ids"]) for s in sync_samples] == [sorted(s["ids"]) for s in samples]
    sync_loss = [m["train/loss"] for m in sync_metrics if "train/loss" in m]
    loss = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(sync_loss) == len(loss) == steps
    for a, b in zip(sync_loss, loss, strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (sync_loss, loss)
    for m in metrics:
        if "train/loss" in m:
            assert m["staleness/max"] == 0
            assert m["train/logprob_mismatch"] <= 1e-3

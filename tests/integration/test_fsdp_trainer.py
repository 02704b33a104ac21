"""The trainer role over two FSDP2 ranks (`trainer.world_size=2`, gloo on CPU) trains exactly like
one process: the same samples and, within float noise, the same losses and gradient norms at
every step; in the multi-process Ray deployment as in the synchronous loop; and a run resumed from
a sharded trainer's checkpoint continues exactly where it left off.

Strict on-policy (`max_staleness=0`) makes the sampled tokens a function of the weights alone, so
two runs can only draw the same samples at every step if their updates agree.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4


def _run(tmp_path, cache, name: str, *extra: str):
    run_dir = tmp_path / name
    run_cli(
        [
            "train",
            *QUICK,
            f"trainer.steps={STEPS}",
            "trainer.eval_every=0",
            "rollout.max_staleness=0",
            f"run.cache_dir={cache}",
            f"run.run_dir={run_dir}",
            *extra,
        ]
    )
    return run_dir


def _steps(run_dir) -> dict[int, dict]:
    """The last record of each trained step (a resumed run logs a step again)."""
    return {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m}


def _digests(run_dir) -> list[str]:
    return [line["digest"] for line in read_jsonl(run_dir / "trained_samples.jsonl")]


def _assert_same_training(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step, expected in want.items():
        for key in ("train/loss", "train/grad_norm"):
            assert math.isclose(got[step][key], expected[key], rel_tol=1e-4, abs_tol=1e-6), (
                step,
                key,
                got[step][key],
                expected[key],
            )


def test_two_fsdp_ranks_train_like_one_process(tmp_path, quick_cache):
    single = _run(tmp_path, quick_cache, "single", "runtime.mode=sync")
    sharded = _run(
        tmp_path,
        quick_cache,
        "sharded",
        "runtime.mode=ray",
        "trainer.world_size=2",
        "trainer.checkpoint_every=2",
    )
    assert _digests(sharded) == _digests(single)
    _assert_same_training(_steps(sharded), _steps(single))
    # Every rank's peak memory, per step and for the run (the one process: rank 0 only).
    for run_dir, ranks in ((single, [0]), (sharded, [0, 1])):
        keys = [f"trainer_rank{i}_peak_gib" for i in ranks]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert sorted(k for k in summary if k.startswith("trainer_rank")) == keys
        assert all(0.1 < summary[k] < 8 for k in keys)
        assert all(f"memory/{k}" in m for m in _steps(run_dir).values() for k in keys)

    # Resume the sharded run from its step-2 checkpoint (each rank's shard of model and AdamW
    # state): step 4 only matches if step 3 was taken with the restored optimizer state.
    shutil.rmtree(sharded / "checkpoints" / "step-000004")
    run_cli(["train", "--resume", str(sharded)])
    assert '"resumed_from_step": 2' in (sharded / "summary.json").read_text()
    assert _digests(sharded) == _digests(single)
    _assert_same_training(_steps(sharded), _steps(single))

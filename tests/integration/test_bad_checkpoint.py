"""A run whose latest checkpoint was cut short resumes from the one before it:
`streamrl train --resume` warns, naming the bad file, and still trains every sample exactly once.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import QUICK, run_cli
from tests.integration.test_faults import all_ids, trained_ids

pytestmark = pytest.mark.integration


def test_a_truncated_latest_checkpoint_resumes_from_the_one_before(tmp_path, quick_cache):
    run_dir = tmp_path / "run"
    args = [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=1",
        "runtime.mode=threads",
    ]
    run_cli(["train", *args, "trainer.steps=3", f"run.run_dir={run_dir}"])
    last = run_dir / "checkpoints" / "step-000003"
    weights = last / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a disk that filled up, say

    run_cli(["train", "--resume", str(run_dir), "trainer.steps=5"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["num_steps"] == 5
    log = (run_dir / "logs" / "controller.log").read_text()
    assert f"skipping checkpoint {last}: {weights} has 1000 bytes" in log
    assert trained_ids(run_dir) == dict.fromkeys(all_ids(5, 4, 4), 1)
    # Step 3 was written again, whole; cleanup kept the newest two.
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step-000004", "step-000005"]

"""A LoRA run (`trainer.lora.rank=8`) of the default task learns, through the real CLI.

Threads mode: the merged weights go through the weight store to the builtin engine every step.
With a KL term in the loss the reference log-probs come from the trainer's model with its
adapters disabled (no reference role): the KL is exactly zero at the first step (the adapters'
B starts at zero, so the policy is the base) and positive once they train. The final checkpoint
holds the adapter only, and `streamrl eval RUN_DIR` loads it merged into its base and measures
the accuracy the run reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import learning_run, read_jsonl, run_cli

pytestmark = [pytest.mark.integration]

STEPS = 6


def test_a_lora_run_learns_and_its_checkpoint_holds_the_adapter(tmp_path) -> None:
    run_dir = tmp_path / "lora"
    summary, steps = learning_run(
        run_dir,
        "runtime.mode=threads",
        "trainer.lora.rank=8",
        "algorithm.lr=3e-3",  # LoRA wants about 10x full fine-tuning's 3e-4 (docs/lora.md)
        "algorithm.kl.coef=0.01",
        "rollout.batch_prompts=16",
        "data.num_eval=64",
        steps=STEPS,
    )
    before, after = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert after >= 0.75, f"held-out accuracy {before:.3f} -> {after:.3f}"
    kl = [m["train/kl_mean"] for m in steps]
    assert kl[0] == 0.0 and max(kl[1:]) > 1e-3, kl
    busy_roles = {
        k for m in read_jsonl(run_dir / "metrics.jsonl") for k in m if k.endswith("_busy_s")
    }
    assert "time/rollout_busy_s" in busy_roles and "time/reference_busy_s" not in busy_roles
    files = {p.name for p in Path(summary["final_model_dir"]).iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files, files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files)
    out = run_cli(["eval", str(run_dir), "--json"])
    assert json.loads(out.stdout)["accuracy"] == after

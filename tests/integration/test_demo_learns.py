"""The embedded default job, exactly as `streamrl train` runs it, learns the built-in task.

This is the README's first command minus the install: the warm-started tiny model, async GRPO
(max_staleness=1) with every role its own Ray process. Held-out greedy accuracy must rise from
<= 0.4 to >= 0.8, and the run must leave its summary, plot and TensorBoard logs behind.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.conftest import read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_default_job_learns(tmp_path):
    run_dir = tmp_path / "demo"
    proc = run_cli(["train", f"run.run_dir={run_dir}"], timeout=1200)
    summary = json.loads((run_dir / "summary.json").read_text())

    assert summary["mode"] == "ray" and summary["max_staleness"] == 1
    assert summary["initial_eval_accuracy"] <= 0.4
    assert summary["final_eval_accuracy"] >= 0.8
    for key in ("wall_time_s", "tokens_per_s", "peak_memory_bytes", "num_steps"):
        assert summary[key] > 0, key
    assert summary["peak_memory_bytes"] < 6 * 2**30

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if "train/loss" in m]
    assert len(steps) == summary["num_steps"]
    assert max(m["staleness/max"] for m in steps) <= 1
    assert any(m["staleness/max"] == 1 for m in steps), (
        "async run never overlapped rollout and training"
    )
    for m in steps:  # the per-step accounting is consistent
        assert 0 <= m["samples/computed"] <= m["samples/trained"]
        assert m["train/micro_batches"] >= 1
    # The rollout's time split cannot add up to more than the run (a little slack: the split
    # starts when the role's loop starts, shortly before the run's clock).
    assert 0 <= summary["rollout_busy_fraction"] + summary["rollout_wait_fraction"] <= 1.05
    # Window by window the busier side is the slower one; every step is in some window.
    assert 0 < summary["slower_side_busy_fraction"] <= 1
    spans = [span.split() for span in summary["slower_side"].split(", ")]
    assert {side for side, _, _ in spans} <= {"trainer", "rollout"}
    assert spans[0][1].startswith("1-") and spans[-1][1].endswith(f"-{summary['num_steps']}")
    first, last = steps[:10], steps[-10:]
    assert sum(m["reward/mean"] for m in last) > sum(m["reward/mean"] for m in first)
    assert summary["train_reward_first"] == pytest.approx(sum(m["reward/mean"] for m in first) / 10)
    assert summary["train_reward_last"] == pytest.approx(sum(m["reward/mean"] for m in last) / 10)
    assert summary["train_reward_components_last"] is None  # the rule reward has none

    assert (run_dir / "reward_accuracy.png").stat().st_size > 1000
    assert any((run_dir / "tb").iterdir())
    assert "final eval accuracy" in proc.stdout
    assert re.search(
        r"torch threads: trainer \d+ \(auto, \d+ cores\), rollout \d+ \(auto, \d+ cores\)",
        (run_dir / "logs" / "controller.log").read_text(),
    )
    assert "trained model" in proc.stdout
    assert hf_generate_accuracy(summary["final_model_dir"]) == pytest.approx(
        summary["final_eval_accuracy"], abs=0.02
    )

    # `streamrl eval --samples K`: sampling at a temperature near 0 gives the greedy answers
    # (up to near-ties), and pass@k grows with k at the run's temperature.
    said = run_cli(["eval", str(run_dir), "--samples", "2", "--temperature", "0.001"]).stdout
    line = next(line for line in said.splitlines() if "pass@1 " in line)
    near_greedy = float(line.split("pass@1 ")[1].split(",")[0])
    assert near_greedy == pytest.approx(summary["final_eval_accuracy"], abs=0.02)
    figures = json.loads(run_cli(["eval", str(run_dir), "--samples", "4", "--json"]).stdout)
    # Greedy, as the run measured it (threads may break a near-tie differently: a prompt or two).
    assert figures["accuracy"] == pytest.approx(summary["final_eval_accuracy"], abs=0.01)
    sampled = {int(k): v for k, v in figures["pass_at"].items()}
    assert list(sampled) == [1, 2, 4]
    assert 0.5 < sampled[1] <= sampled[2] <= sampled[4] <= 1.0


def hf_generate_accuracy(model_dir: str) -> float:
    """Held-out greedy accuracy of the trained model directory loaded by plain transformers
    (its own tokenizer and chat template, HF `generate`): the run's figure belongs to it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.config.loader import load_config
    from streamrl.data.dataset import builtin_rows
    from streamrl.reward.rule import arith_exact_match

    cfg = load_config([])
    rows = builtin_rows(cfg.data.num_eval, digits=cfg.data.digits, seed=cfg.data.seed, split="eval")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row.prompt}], tokenize=False, add_generation_prompt=True
        )
        for row in rows
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=cfg.rollout.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    answers = tokenizer.batch_decode(
        out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
    )
    scores = [
        arith_exact_match(text, row.answer).value for text, row in zip(answers, rows, strict=True)
    ]
    return sum(score == 1.0 for score in scores) / len(rows)

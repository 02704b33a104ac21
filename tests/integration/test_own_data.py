"""A user's own model, data and reward end to end, in the layout another framework left them:
a Parquet file shaped like veRL's (a conversation prompt, the answer under
reward_model.ground_truth, more keys for the reward), a system prompt added by the config, the
math-verify reward, every role its own Ray process, pass@k at each evaluation; then `streamrl
eval` of the result."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli, tiny_model

pytestmark = pytest.mark.integration


def test_a_verl_parquet_file_trains_with_the_math_reward(tmp_path):
    import pyarrow as pa  # a base dependency
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "local/sums",
            "prompt": [{"role": "user", "content": f"{a}+{b}=? Answer after ####."}],
            "ability": "math",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate((a, b) for a in range(10, 20) for b in range(20, 30))
    ]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    model_dir = tiny_model(tmp_path)
    run_dir = tmp_path / "run"
    run_cli(
        [
            "train",
            *QUICK,
            f"model.path={model_dir}",
            f"data.train_file={data}",
            "data.answer_key=reward_model.ground_truth",
            "data.system_prompt=You add numbers.",
            "reward.function=tests.integration.verl_reward:verl_style",
            "runtime.mode=ray",
            "trainer.steps=2",
            "trainer.eval_samples=2",
            f"run.run_dir={run_dir}",
        ]
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == 2 and summary["num_malformed_dataset_rows"] == 0
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    # No sample dropped: every row's keys reached the reward intact (it raises otherwise).
    assert [m["samples/dropped"] for m in steps] == [0, 0]
    # The mapping's other numbers are logged as components, its text is not.
    for m in steps:
        assert m["reward_components/acc"] == pytest.approx(m["reward/mean"])
        assert 0 <= m["reward_components/answered"] <= 1
        assert "reward_components/pred" not in m
    assert summary["train_reward_last"] == pytest.approx(sum(m["reward/mean"] for m in steps) / 2)
    assert set(summary["train_reward_components_last"]) == {"acc", "answered"}
    evals = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "eval/accuracy" in m]
    assert [m["eval/unscored"] for m in evals] == [0, 0]
    # Each evaluation also sampled two answers a prompt: pass@1 <= pass@2.
    assert all(0 <= m["eval/pass@1"] <= m["eval/pass@2"] <= 1 for m in evals), evals

    said = run_cli(["eval", str(run_dir)]).stdout
    assert f"held-out accuracy {summary['final_eval_accuracy']:.4f} (" in said, said
    assert "reward tests.integration.verl_reward:verl_style" in said

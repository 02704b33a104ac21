"""Training with `rollout.engine=sglang`, end to end, in both multi-role modes.

SGLang needs a GPU, so the server here is the project's test double (`tests/fakes/
sglang_server.py`: SGLang's HTTP API answered by the builtin engine, launched through
`rollout.sglang.launch_cmd` as the engine launches `sglang.launch_server`). What is under test
is streamrl's side: the engine launched by the rollout role, generation over HTTP, a weight
update after every optimizer step, and the server stopped at the end, with every role its own
Ray process and with every role a thread of one process.

At `max_staleness=0` every token is sampled by exactly the weights the trainer scores it with,
so the mean |trainer - engine| log-prob of each step stays at fp32 rounding: a server that
missed an update would keep sampling from old weights, and the mismatch would jump by orders of
magnitude. The adapter itself (streaming, aborts, in-flight updates, errors) is unit-tested in
`tests/unit/test_sglang_engine.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli, tiny_model

pytestmark = pytest.mark.integration

SERVER = Path(__file__).parents[1] / "fakes" / "sglang_server.py"
# fp32 engine vs fp32 trainer on identical weights, mean |delta| per step (the builtin engine
# against the trainer: about 1e-7).
MISMATCH_BOUND = 1e-5


@pytest.mark.parametrize("mode", ["threads", "ray"])
def test_a_run_trains_on_the_weights_each_step_sends_to_the_sglang_server(tmp_path, mode):
    model_dir = tiny_model(tmp_path)
    run_dir = tmp_path / "run"
    run_cli(
        [
            "train",
            *QUICK,
            f"model.path={model_dir}",
            f"runtime.mode={mode}",
            "rollout.engine=sglang",
            f'rollout.sglang.launch_cmd=["{sys.executable}", "{SERVER}"]',
            "rollout.max_staleness=0",
            "rollout.max_new_tokens=8",
            "reward.function=tests.integration.digit_reward:digit_share",  # signal from step 1
            "algorithm.lr=1e-2",  # steps big enough to change the samples from step to step
            "trainer.steps=3",
            "trainer.eval_every=0",
            f"run.run_dir={run_dir}",
        ]
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == 3 and summary["num_samples_dropped"] == {}
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert [m["staleness/max"] for m in steps] == [0, 0, 0]
    trained = [m for m in steps if m["train/trained_tokens"] > 0]
    assert len(trained) == 3, [m["train/trained_tokens"] for m in steps]  # weights moved each step
    for m in trained:
        assert 0 <= m["train/logprob_mismatch"] <= MISMATCH_BOUND, (m["step"], m)


def test_a_moe_run_replays_the_routes_the_sglang_server_returns(tmp_path):
    """A tiny Qwen3-MoE with `algorithm.routing_replay=rollout`: the launched server is asked for
    routed experts, every row carries them, and the trainer replays them; at staleness 0 in fp32
    they are what its own router chooses (agreement 1 would drop to chance with misplaced
    routes) and the log-prob gap stays at rounding."""
    from streamrl.models.tiny import build_tiny_model_dir

    model_dir = build_tiny_model_dir(
        tmp_path / "moe", hidden_size=32, num_layers=2, num_heads=2, seed=0, num_experts=8
    )
    run_dir = tmp_path / "run"
    run_cli(
        [
            "train",
            *QUICK,
            f"model.path={model_dir}",
            "runtime.mode=threads",
            "rollout.engine=sglang",
            f'rollout.sglang.launch_cmd=["{sys.executable}", "{SERVER}"]',
            "algorithm.routing_replay=rollout",
            "rollout.max_staleness=0",
            "rollout.max_new_tokens=8",
            "reward.function=tests.integration.digit_reward:digit_share",
            "algorithm.lr=1e-2",
            "trainer.steps=3",
            "trainer.eval_every=0",
            f"run.run_dir={run_dir}",
        ]
    )
    log = next(run_dir.glob("sglang/engine-*/sglang_server.log")).read_text()
    assert "--enable-return-routed-experts" in log
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert len(steps) == 3
    for m in steps:
        assert m["train/moe/replay_agreement"] >= 0.99, (m["step"], m)
        assert 0 <= m["train/logprob_mismatch"] <= MISMATCH_BOUND, (m["step"], m)

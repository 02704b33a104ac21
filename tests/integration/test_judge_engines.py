"""The judge on each engine it can run on: its verdicts agree with the rule they were taught.

The built-in judge (built once, cached like the warm start, shared with the judge demo's test)
scores a short run beside the rule reward, each a component of the reward
(`reward_components/function`, `reward_components/judge`). Whatever engine serves it, the judge
must write readable verdicts and agree with the rule about as often as its held-out verdict
accuracy says: an engine that garbled the judge's prompt or its reply would give unreadable
verdicts (`judge/verdict_invalid`) or verdicts unrelated to the rule.

- builtin: the judge's model in the judge role's process;
- vLLM: `reward.judge.engine=vllm` (needs `make install-vllm`, as the rollout's vLLM tests);
- SGLang: `reward.judge.engine=sglang`, launched through `reward.judge.sglang.launch_cmd` like
  the rollout's (SGLang needs a GPU: the server here is the suite's stand-in,
  `tests/fakes/sglang_server.py`, SGLang's HTTP API over the builtin engine).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import SHORT, read_jsonl, run_cli
from tests.vllm_required import vllm_missing

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVER = Path(__file__).parents[1] / "fakes" / "sglang_server.py"
STEPS = 4


@pytest.mark.parametrize(
    "engine",
    [
        "builtin",
        pytest.param(
            "vllm",
            marks=pytest.mark.skipif(vllm_missing(), reason="vLLM is not installed"),
        ),
        "sglang",
    ],
)
def test_the_judges_verdicts_agree_with_the_rule(tmp_path, engine):
    run_dir = tmp_path / "run"
    extra = (
        [f'reward.judge.sglang.launch_cmd=["{sys.executable}", "{SERVER}"]']
        if engine == "sglang"
        else []
    )
    run_cli(
        [
            "train",
            "examples/judge.yaml",
            *SHORT,
            "reward.function=[streamrl.reward.rule:arith_exact_match]",
            f"reward.judge.engine={engine}",
            *extra,
            "rollout.batch_prompts=16",
            f"trainer.steps={STEPS}",
            "data.num_eval=16",
            f"run.run_dir={run_dir}",
        ],
        timeout=1500,  # on a fresh clone the first of these may build the warm start and judge
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == STEPS and summary["num_samples_dropped"] == {}, summary
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    judged = [m for m in steps if not math.isnan(m.get("judge/verdict_invalid", math.nan))]
    assert judged, "the judge reported no verdicts"
    assert all(m["judge/verdict_invalid"] == 0 for m in judged)
    rule = sum(m["reward_components/function"] for m in steps) / len(steps)
    judge = sum(m["reward_components/judge"] for m in steps) / len(steps)
    # 512 samples; the judge is wrong on about 2.5% of held-out answers, in both directions.
    assert abs(judge - rule) <= 0.1, (rule, judge)
    assert summary["judge_samples_per_s"] > 0

"""The judge's parts that are pure logic: reading verdicts, rendering its prompts, pairing the
responses of a group, combining its reward with the others, and what the reward role writes.
(The judge model itself, built and run for real: test_judge_model.py and the integration test.)
"""

from __future__ import annotations

import math

import pytest

from streamrl.api import fields as F
from streamrl.api.engine import GenerationResult
from streamrl.api.reward import RewardResult
from streamrl.bus.local import LocalBus
from streamrl.config.reward_schema import JudgeConfig, VerdictConfig
from streamrl.data.prompts import encode_response
from streamrl.judge.role import JudgeRole
from streamrl.models.tokenizer import build_tokenizer
from streamrl.reward.combine import Part, combine
from streamrl.reward.judge import Judge, JudgeItem
from streamrl.reward.rule import arith_exact_match
from streamrl.reward.service import score_rows
from streamrl.reward.verdict import parse, render

# -- verdicts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "value", "label"),
    [
        ("correct", 1.0, "correct"),
        (" Incorrect.", 0.0, "incorrect"),
        ("CORRECT!\n", 1.0, "correct"),
    ],
)
def test_a_label_is_read_whatever_its_case_and_punctuation(reply, value, label) -> None:
    result, verdict = parse(reply, VerdictConfig())
    assert result == RewardResult.ok(value) and verdict == label


@pytest.mark.parametrize("reply", ["", "correct incorrect", "corr", "maybe", "incorrectly"])
def test_a_reply_that_is_no_label_is_invalid_output_never_a_zero(reply) -> None:
    result, verdict = parse(reply, VerdictConfig())
    assert result.status == "invalid_output" and result.value is None and verdict == "invalid"
    assert "judge verdict unreadable" in result.reason and repr(reply[:80]) in result.reason


def test_a_pattern_picks_the_verdict_out_of_a_longer_reply() -> None:
    config = VerdictConfig(pattern=r"Verdict:\s*(\w+)", labels={"good": 1.0, "bad": -1.0})
    assert parse("The steps add up. Verdict: bad", config)[0] == RewardResult.ok(-1.0)
    assert parse("no verdict here", config)[0].status == "invalid_output"


def test_scores_are_read_in_range_and_normalised() -> None:
    config = VerdictConfig(kind="score", score_range=(1, 5))
    assert parse("I'd give it 4 out of", config)[0].value == pytest.approx(0.75)
    assert parse("Score: 5", VerdictConfig(kind="score", score_range=(1, 5), normalize=False))[
        0
    ] == RewardResult.ok(5.0)
    for reply in ("12", "none", "-3"):
        assert parse(reply, config)[0].status == "invalid_output"


def test_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="group"):
        VerdictConfig(pattern="Verdict: \\w+")
    with pytest.raises(ValueError, match="below"):
        VerdictConfig(kind="score", score_range=(5, 1))
    with pytest.raises(ValueError, match="response"):
        JudgeConfig(template="{prompt} {answer}")
    with pytest.raises(ValueError, match="other"):
        JudgeConfig(verdict=VerdictConfig(kind="pairwise"))


def test_render_leaves_braces_of_the_response_alone() -> None:
    text = render("{prompt}|{response}|{answer}", prompt="p", response="{answer} {x}", answer="7")
    assert text == "p|{answer} {x}|7"


# -- combining ---------------------------------------------------------------------------------


def test_parts_are_summed_with_their_weights_and_each_logged() -> None:
    rule = RewardResult(1.0, "ok", "", {"format": 1.0})
    combined = combine([Part("function", 1.0, rule), Part("judge", 0.5, RewardResult.ok(0.0))])
    assert combined.result == RewardResult(
        1.0, "ok", "", {"format": 1.0, "function": 1.0, "judge": 0.0}
    )


def test_a_part_that_could_not_score_leaves_the_sample_unscored() -> None:
    failed = RewardResult(None, "timeout", "took 10 s")
    combined = combine([Part("function", 1.0, RewardResult.ok(1.0)), Part("remote", 1.0, failed)])
    assert combined.result.status == "timeout" and combined.result.value is None
    assert combined.result.reason == "remote: took 10 s" and not combined.penalized


def test_only_the_responses_own_invalid_output_takes_the_penalty() -> None:
    theirs = RewardResult.invalid("no answer")
    judges = RewardResult.invalid("judge verdict unreadable")
    ok = RewardResult.ok(1.0)
    assert combine([Part("function", 1.0, theirs), Part("judge", 1.0, ok, False)]).penalized
    assert not combine([Part("function", 1.0, ok), Part("judge", 1.0, judges, False)]).penalized
    assert not combine([Part("judge", 1.0, judges, False)]).penalized


def test_a_single_part_keeps_its_own_result_scaled_by_its_weight() -> None:
    assert combine([Part("judge", 2.0, RewardResult.ok(0.5))]).result == RewardResult.ok(1.0)


# -- the judge over an engine --------------------------------------------------------------------


class ScriptedJudgeEngine:
    """Engine-protocol stand-in for a judge model in these logic tests: it replies what `reply`
    says for each prompt text (the judge model itself runs in test_judge_model.py)."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.calls = tokenizer, reply, []

    def generate(self, requests, params, **_):
        self.calls.append([r.request_id for r in requests])
        out = []
        for r in requests:
            text = self.tokenizer.decode(r.prompt_ids, skip_special_tokens=True)
            ids = encode_response(self.tokenizer, self.reply(text))
            out.append(
                GenerationResult(r.request_id, ids, [0.0] * len(ids), [0] * len(ids), "stop")
            )
        return out


def _exact(text: str) -> str:
    body, _, reference = text.rpartition("|")
    return "correct" if body.rpartition(":")[2] == reference else "incorrect"


def test_the_judge_asks_once_per_response_in_one_engine_call() -> None:
    tokenizer = build_tokenizer()
    engine = ScriptedJudgeEngine(tokenizer, _exact)
    judge = Judge(engine, tokenizer, JudgeConfig(enabled=True))
    items = [
        JudgeItem("a", "37+85=", "7+5=12,3+8+1=12:122", "122"),
        JudgeItem("b", "37+85=", "7+5=12,3+8=11:12", "122"),
    ]
    verdicts = judge.judge(items)
    assert [v.result.value for v in verdicts] == [1.0, 0.0]
    assert [v.verdict for v in verdicts] == ["correct", "incorrect"]
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 2
    assert verdicts[0].as_field()["reply"] == "correct"


def test_a_prompt_past_the_limit_is_not_judged_and_says_why() -> None:
    tokenizer = build_tokenizer()
    engine = ScriptedJudgeEngine(tokenizer, _exact)
    judge = Judge(engine, tokenizer, JudgeConfig(enabled=True, max_prompt_tokens=20))
    short, long = JudgeItem("s", "1+1=", "2:2", "2"), JudgeItem("l", "1+1=", "2" * 40, "2")
    verdicts = judge.judge([short, long])
    assert verdicts[0].result.value == 0.0 or verdicts[0].result.value == 1.0
    assert verdicts[1].result.status == "infra_error"
    assert "max_prompt_tokens=20" in verdicts[1].result.reason


def test_pairwise_compares_each_response_with_the_next_ones_of_its_group() -> None:
    tokenizer = build_tokenizer()
    # A prefers the longer response (text "A: <a> B: <b>").
    engine = ScriptedJudgeEngine(
        tokenizer,
        lambda text: "A" if len(text.split(" B: ")[0]) - 3 >= len(text.split(" B: ")[1]) else "B",
    )
    config = JudgeConfig(
        enabled=True,
        template="A: {response} B: {other}",
        verdict=VerdictConfig(kind="pairwise", opponents=2),
    )
    judge = Judge(engine, tokenizer, config)
    items = [JudgeItem(f"s{i}", "", "x" * n, "", "g0") for i, n in enumerate((1, 2, 3))]
    verdicts = judge.judge(items)
    assert [v.result.value for v in verdicts] == [0.0, 0.5, 1.0]  # wins against the other two
    alone = judge.judge([JudgeItem("solo", "", "x", "", "g1")])[0]
    assert alone.result.status == "infra_error" and "no other response" in alone.result.reason


# -- the reward and judge roles ------------------------------------------------------------------


def _rows(tokenizer, responses: dict[str, str], answer: str = "12"):
    return [
        {
            "sample_id": sid,
            "group_id": "g",
            F.PROMPT_IDS: tokenizer("5+7=")["input_ids"],
            F.RESPONSE_IDS: encode_response(tokenizer, text),
            F.ANSWER: answer,
            F.EXTRA: {},
        }
        for sid, text in responses.items()
    ]


def test_a_judge_alone_rewards_and_its_unreadable_verdict_is_dropped_not_zeroed() -> None:
    tokenizer = build_tokenizer()
    rows = _rows(tokenizer, {"right": "5+7=12:12", "wrong": "5+7=12:2", "odd": "?"})
    engine = ScriptedJudgeEngine(tokenizer, lambda t: "dunno" if t.endswith("?|12") else _exact(t))
    role = JudgeRole(
        LocalBus(),
        Judge(engine, tokenizer, JudgeConfig(enabled=True)),
        tokenizer,
        max_rows=8,
        lease_s=5,
        episodes=False,
    )
    for row in rows:
        row.update(role.compute([row])[row["sample_id"]])
    updates = score_rows(None, tokenizer, rows, 0.0, judge_weight=1.0)
    assert updates["right"][F.REWARD] == 1.0 and updates["wrong"][F.REWARD] == 0.0
    assert updates["odd"][F.REWARD] is None  # not the penalty of 0.0: the judge failed
    assert updates["odd"][F.REWARD_STATUS] == "invalid_output"
    metrics = role.stats()["metrics"]
    assert (
        metrics["judge/verdict_correct"] == metrics["judge/verdict_invalid"] == pytest.approx(1 / 3)
    )
    assert metrics["judge/samples_per_s"] > 0 and not math.isnan(metrics["judge/batch_latency_s"])


class _RuleInProcess:
    """The arithmetic rule scored in this process (the sandbox's own tests cover the sandbox)."""

    def score(self, tasks):
        return [arith_exact_match(t.response, t.answer) for t in tasks]


def test_a_rule_and_a_judge_together_are_weighted_and_each_logged() -> None:
    tokenizer = build_tokenizer()
    rows = _rows(tokenizer, {"right": "5+7=12:12"})
    rows[0][F.JUDGE] = {"value": 0.0, "status": "ok", "reason": "", "verdict": "incorrect"}
    update = score_rows(_RuleInProcess(), tokenizer, rows, 0.0, judge_weight=0.5)["right"]
    assert update[F.REWARD] == 1.0
    assert update[F.REWARD_COMPONENTS] == {"function": 1.0, "judge": 0.0}

"""Rewards: the arithmetic rule, resolving and normalising user functions, the sandboxed worker
(errors, timeouts and restarts), and the reward role's `score_rows`."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from streamrl.api import fields as F
from streamrl.api.reward import RewardResult
from streamrl.data.prompts import encode_response
from streamrl.models.tokenizer import build_tokenizer
from streamrl.reward.forms import check_reward_signature
from streamrl.reward.rule import arith_exact_match
from streamrl.reward.sandbox import SandboxedScorer, ScoreTask
from streamrl.reward.scoring import (
    resolve_callable,
    score_text,
    to_result,
)
from streamrl.reward.service import MAX_REPORTED, RewardRole, score_rows
from tests.unit.reward_modules import Scorers, reward_module

# Imported by the sandbox's worker process, so it lives in a file on PYTHONPATH.
REWARDS_MODULE = "streamrl_test_rewards"
REWARDS_SOURCE = textwrap.dedent(
    """
    import time

    from streamrl.api.reward import RewardResult


    def length(response, answer, bonus=0.0):
        return len(response) + bonus


    def boom(response, answer):
        raise RuntimeError(f"cannot score {response!r}")


    def hang_on(response, answer):
        if response == "hang":
            time.sleep(60)
        return 1.0


    def result(response, answer):
        if response == "?":
            return RewardResult.invalid("not an answer")
        return RewardResult.ok(0.25)


    def text(response, answer):
        return "1.0"


    def parts(response, answer):
        right = response == answer
        return {"score": right + 0.1, "acc": right, "format": 1, "pred": response}
    """
)


@pytest.fixture(scope="module")
def rewards_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with reward_module(tmp_path_factory, REWARDS_MODULE, REWARDS_SOURCE):
        yield REWARDS_MODULE


@pytest.fixture
def make_scorer() -> Iterator[Scorers]:
    scorers = Scorers(timeout_s=5.0)
    try:
        yield scorers
    finally:
        scorers.close()


# -- the arithmetic rule ------------------------------------------------------------------------


def test_arith_exact_match() -> None:
    assert arith_exact_match("7+5=12,3+8+1=12:122", "122") == RewardResult.ok(1.0)
    assert arith_exact_match("7+5=12,3+8=11:12", "122") == RewardResult.ok(0.0)
    assert arith_exact_match(" x:0122 \n", "122").value == 1.0  # compared as integers
    assert arith_exact_match("a:1:-3", "-3").value == 1.0  # the last colon counts


@pytest.mark.parametrize("response", ["7+5=12,3+8", "122", "7+5=12:", "7+5=12:1 2", ":abc"])
def test_arith_exact_match_invalid_output(response: str) -> None:
    result = arith_exact_match(response, "122")
    assert result.status == "invalid_output" and result.value is None
    assert "no ':<integer>' answer" in result.reason


# -- resolving and normalising --------------------------------------------------------------------


def test_resolve_callable_accepts_colon_and_dot_paths() -> None:
    assert resolve_callable("streamrl.reward.rule:arith_exact_match") is arith_exact_match
    assert resolve_callable("streamrl.reward.rule.arith_exact_match") is arith_exact_match


def test_resolve_callable_errors_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="expected a dotted path"):
        resolve_callable("arith_exact_match")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz'"):
        resolve_callable("no_such_pkg_xyz:score")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        resolve_callable("streamrl.reward.rule:missing")
    with pytest.raises(ValueError, match="has no callable '_INTEGER'"):
        resolve_callable("streamrl.reward.rule:_INTEGER")


def test_to_result_accepts_finite_numbers_and_results() -> None:
    assert to_result(1) == RewardResult(1.0, "ok", "")
    assert to_result(-0.5) == RewardResult.ok(-0.5)
    invalid = RewardResult.invalid("x")
    assert to_result(invalid) is invalid


@pytest.mark.parametrize("value", [True, False, "1.0", None, [1.0], math.nan, math.inf, -math.inf])
def test_to_result_turns_unusable_values_into_infra_error(value: object) -> None:
    result = to_result(value)
    assert result.status == "infra_error" and result.value is None
    assert result.reason.startswith("reward returned")


def test_to_result_reads_verls_mapping_its_score_and_numbers_as_components() -> None:
    import numpy as np

    result = to_result({"score": 1.1, "acc": True, "format": np.float32(0.5), "pred": "42"})
    assert result == RewardResult(1.1, "ok", "", {"acc": 1.0, "format": 0.5})
    assert to_result({"score": 0}) == RewardResult.ok(0.0)
    assert to_result({"score": 0.5, "x": math.nan}).components == {}  # not finite: left out
    missing = to_result({"acc": 1.0, "pred": "42"})
    assert (missing.status, missing.value) == ("infra_error", None)
    assert missing.reason == "reward returned a mapping without 'score' (keys: acc, pred)"
    bad = to_result({"score": "1.0", "acc": 1.0})  # the score is held to a number's rules
    assert bad.status == "infra_error" and bad.components == {}


def test_score_text_reports_exceptions() -> None:
    row = SimpleNamespace(answer="3", extra={"bonus": 2})

    def fn(text: str, answer: str, bonus: int) -> float:
        if text == "raise":
            raise KeyError("gone")
        return float(answer) + bonus

    assert score_text(fn, "ok", row) == RewardResult.ok(5.0)
    result = score_text(fn, "raise", row)
    assert (result.value, result.status, result.reason) == (None, "infra_error", "KeyError: 'gone'")


# -- the sandbox -------------------------------------------------------------------------------


def test_sandbox_rejects_a_bad_path_in_the_caller() -> None:
    with pytest.raises(ValueError, match="cannot import module"):
        SandboxedScorer("no_such_pkg_xyz:score", timeout_s=1.0)


def test_sandbox_returns_floats_with_extra_kwargs(rewards_module: str, make_scorer) -> None:
    scorer = make_scorer(f"{rewards_module}:length")
    tasks = [ScoreTask("abc", "0"), ScoreTask("", "0", {"bonus": 0.5})]
    assert scorer.score(tasks) == [RewardResult.ok(3.0), RewardResult.ok(0.5)]
    assert scorer.score([]) == []
    assert scorer.num_restarts == 0


def test_sandbox_reports_exceptions_as_infra_error(rewards_module: str, make_scorer) -> None:
    scorer = make_scorer(f"{rewards_module}:boom")
    (result,) = scorer.score([ScoreTask("7+5", "12")])
    assert result.status == "infra_error" and result.value is None
    assert result.reason == "RuntimeError: cannot score '7+5'"
    assert scorer.num_restarts == 0  # the worker survives an exception


def test_sandbox_passes_reward_results_through(rewards_module: str, make_scorer) -> None:
    scorer = make_scorer(f"{rewards_module}:result")
    assert scorer.score([ScoreTask("?", ""), ScoreTask("1", "")]) == [
        RewardResult(None, "invalid_output", "not an answer"),
        RewardResult.ok(0.25),
    ]


def test_sandbox_passes_reward_components_through(rewards_module: str, make_scorer) -> None:
    scorer = make_scorer(f"{rewards_module}:parts")
    assert scorer.score([ScoreTask("12", "12"), ScoreTask("11", "12")]) == [
        RewardResult(1.1, "ok", "", {"acc": 1.0, "format": 1.0}),
        RewardResult(0.1, "ok", "", {"acc": 0.0, "format": 1.0}),
    ]


def test_step_metrics_average_each_component_over_the_rows_that_report_it() -> None:
    from streamrl.trainer.service import component_means

    rows = [
        {F.REWARD_COMPONENTS: {"acc": 1.0, "format": 1.0}},
        {F.REWARD_COMPONENTS: {"acc": 0.0}},
        {F.REWARD_COMPONENTS: {}},  # a reward without components, or a dropped sample
    ]
    assert component_means(rows) == {
        "reward_components/acc": 0.5,
        "reward_components/format": 1.0,
    }


def test_sandbox_normalises_bad_return_values(rewards_module: str, make_scorer) -> None:
    (result,) = make_scorer(f"{rewards_module}:text").score([ScoreTask("x", "")])
    assert result.status == "infra_error" and "str, not a number" in result.reason


def test_sandbox_times_out_a_hanging_call_and_keeps_working(
    rewards_module: str, make_scorer
) -> None:
    scorer = make_scorer(f"{rewards_module}:hang_on", timeout_s=1.0)
    start = time.monotonic()
    results = scorer.score([ScoreTask("a", ""), ScoreTask("hang", ""), ScoreTask("b", "")])
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["ok", "timeout", "ok"]
    assert results[1].value is None and "over 1.0s" in results[1].reason
    assert 0.9 <= elapsed < 5.0
    assert scorer.num_restarts == 1

    start = time.monotonic()
    results = scorer.score([ScoreTask("hang", ""), ScoreTask("c", "")])
    assert [r.status for r in results] == ["timeout", "ok"]
    assert 0.9 <= time.monotonic() - start < 5.0
    assert scorer.num_restarts == 2
    assert scorer.score([ScoreTask("d", "")]) == [RewardResult.ok(1.0)]


# A batch whose JSON is bigger than the stdin pipe and whose results are bigger than the stdout
# pipe: the scorer writes every task before reading any result.
_BIG_BATCH = """
from streamrl.reward.sandbox import SandboxedScorer, ScoreTask
scorer = SandboxedScorer("streamrl.reward.rule:arith_exact_match", timeout_s=1.0)
results = scorer.score([ScoreTask("x" * 1000, "1")] * 2000)
assert len(results) == 2000
"""


def test_sandbox_scores_a_large_batch() -> None:
    subprocess.run([sys.executable, "-c", _BIG_BATCH], check=True, timeout=20.0)


# -- the reward role's scoring step ------------------------------------------------------------


@pytest.mark.parametrize("penalty", [-0.5, None])
def test_score_rows_decodes_scores_and_applies_the_invalid_penalty(
    make_scorer, penalty: float | None
) -> None:
    tokenizer = build_tokenizer()
    responses = {"right": "7+5=12:12", "wrong": "7+5=12:13", "cut": "7+5=1"}
    rows = [
        {"sample_id": sid, F.RESPONSE_IDS: encode_response(tokenizer, text), F.ANSWER: 12}
        for sid, text in responses.items()
    ]
    scorer = make_scorer("streamrl.reward.rule:arith_exact_match")
    updates = score_rows(scorer, tokenizer, rows, penalty)
    assert updates["right"] == {
        F.REWARD: 1.0,
        F.REWARD_STATUS: "ok",
        F.REWARD_REASON: "",
        F.REWARD_COMPONENTS: {},
    }
    assert updates["wrong"][F.REWARD] == 0.0
    assert updates["cut"][F.REWARD] == penalty
    assert updates["cut"][F.REWARD_STATUS] == "invalid_output"
    assert "7+5=1" in updates["cut"][F.REWARD_REASON]


class _FailingScorer:
    """Scores every task with the reason its text names (a stand-in for a broken reward)."""

    num_restarts = 0

    def score(self, tasks):
        return [RewardResult(None, "infra_error", f"KeyError: {t.response!r}") for t in tasks]


def test_the_reward_role_logs_each_distinct_failure_once(caplog) -> None:
    tokenizer = build_tokenizer()
    role = RewardRole(
        None, _FailingScorer(), tokenizer, invalid_penalty=None, max_rows=8, lease_s=5
    )
    texts = ["1", "2", "1", "1"] + [str(i) for i in range(3, 10)]
    rows = [
        {"sample_id": f"s{i}", F.RESPONSE_IDS: tokenizer(t)["input_ids"], F.ANSWER: "0"}
        for i, t in enumerate(texts)
    ]
    with caplog.at_level(logging.WARNING, logger="streamrl.reward.service"):
        updates = role.compute(rows)
    assert all(u[F.REWARD] is None for u in updates.values())
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == MAX_REPORTED  # "1" once, then new reasons until the cap
    assert "sample s0 not scored (infra_error): KeyError: '1'" in logged[0]
    assert "samples/dropped_infra_error" in logged[0]


def _two_args(text, answer):
    return 0.0


def _with_extra(text, answer, *, level="easy", **extra):
    return 0.0


def _varargs(*args, **kwargs):
    return 0.0


def _one_arg(text):
    return 0.0


def test_a_reward_that_cannot_take_text_and_answer_is_refused() -> None:
    for fn in (_two_args, _with_extra, _varargs, arith_exact_match, len.__call__):
        check_reward_signature(fn, "m:f")
    with pytest.raises(ValueError, match=r"'m:f' is called as f\(response_text, answer"):
        check_reward_signature(_one_arg, "m:f")

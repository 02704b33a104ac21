"""Reward functions as users already wrote them (`streamrl.reward.forms`): TRL's batched form
(plain or conversational completions, dataset columns as lists, None for "not applicable",
several functions with weights), veRL's `compute_score`, async functions, and streamrl's own;
each recognised by its signature and called through the real sandboxed scorer."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator

import pytest

from streamrl.api import fields as F
from streamrl.api.reward import RewardResult
from streamrl.config import ConfigError
from streamrl.config.loader import load_config
from streamrl.data.prompts import encode_prompt, encode_response
from streamrl.models.tokenizer import build_tokenizer
from streamrl.reward.forms import NOT_APPLICABLE, check_reward_config, detect_style
from streamrl.reward.sandbox import SandboxedScorer, ScoreTask
from streamrl.reward.service import RewardRole, score_rows
from tests.unit.reward_modules import Scorers, reward_module

MODULE = "streamrl_test_reward_forms"
SOURCE = textwrap.dedent(
    """
    import asyncio
    import math
    import time


    # TRL, standard format: every column a list, one entry a completion.
    def accuracy(prompts, completions, completion_ids, answer, level, **kwargs):
        assert kwargs["trainer_state"] is None
        assert len(prompts) == len(completions) == len(completion_ids) == len(answer) == len(level)
        assert all(isinstance(c, str) for c in completions), completions
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


    def batch_size(completions, **kwargs):
        return [float(len(completions))] * len(completions)


    def prompt_seen(prompts, completions, **kwargs):
        return [float(p is not None and "2+2" in str(p)) for p in prompts]


    # TRL, conversational format: each completion one assistant message.
    def format_reward(completions, **kwargs):
        contents = [completion[0]["content"] for completion in completions]
        assert all(completion[0]["role"] == "assistant" for completion in completions)
        return [1.0 if c.startswith("<") else 0.0 for c in contents]


    def only_digits(completions, **kwargs):
        return [1.0 if c.isdigit() else None for c in completions]


    def short(completions, **kwargs):
        return [-len(c) / 10 for c in completions]


    def not_finite(completions, **kwargs):
        return [math.nan if c == "nan" else 1.0 for c in completions]


    def wrong_length(completions, **kwargs):
        return [1.0]


    def hangs_on_a_batch(completions, **kwargs):
        if "hang" in completions:
            time.sleep(60)
        return [1.0] * len(completions)


    def as_keywords(**kwargs):
        return [float(len(c)) for c in kwargs["completions"]]


    # veRL's compute_score, as its custom reward function docs write it.
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        assert data_source == "local/sums", data_source
        assert extra_info == {"index": 3}, extra_info
        return 1.0 if solution_str.strip() == ground_truth else 0.0


    def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        right = solution_str.strip() == ground_truth
        return {"score": float(right), "acc": right, "pred": solution_str}


    def verl_old(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
        return score if solution_str == ground_truth else format_score


    # async, in streamrl's own form and in TRL's
    async def judge(response, answer):
        await asyncio.sleep(0.3)
        return 1.0 if response == answer else 0.0


    async def async_trl(completions, answer, **kwargs):
        await asyncio.sleep(0.01)
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


    def mystery(x):
        return 0.0
    """
)


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with reward_module(tmp_path_factory, MODULE, SOURCE):
        yield MODULE


@pytest.fixture
def make(module: str) -> Iterator:
    scorers = Scorers(timeout_s=10.0)

    def make(*names: str, **kwargs) -> SandboxedScorer:
        paths = [f"{module}:{n}" for n in names]
        return scorers(paths[0] if len(paths) == 1 else paths, **kwargs)

    try:
        yield make
    finally:
        scorers.close()


def values(results: list[RewardResult]) -> list[float | None]:
    return [r.value for r in results]


# -- recognising the form ---------------------------------------------------------------------


def test_the_form_is_told_by_parameter_names(module: str) -> None:
    import importlib

    m = importlib.import_module(module)
    assert detect_style(m.accuracy, "m:f") == "trl"
    assert detect_style(m.format_reward, "m:f") == "trl"
    assert detect_style(m.compute_score, "m:f") == "verl"
    assert detect_style(m.verl_old, "m:f") == "verl"
    assert detect_style(m.judge, "m:f") == "streamrl"
    # streamrl's own form with veRL's row keys as keywords stays streamrl's
    assert detect_style(lambda response, answer, *, data_source, extra_info: 0, "m:f") == "streamrl"
    assert detect_style(len.__call__, "m:f") == "streamrl"  # nothing to read


def test_an_unrecognised_signature_is_refused_naming_what_was_found(module: str, make) -> None:
    with pytest.raises(ValueError) as e:
        make("mystery")
    said = str(e.value)
    assert f"'{module}:mystery'" in said and "(x)" in said and "parameters: x" in said
    assert "completions" in said and "solution_str" in said and "reward.style" in said
    with pytest.raises(ValueError, match=r"parameters: kwargs.*reward.style"):
        make("as_keywords")
    # ... unless reward.style names the form; a form it cannot be called in is refused
    scorer = make("as_keywords", style="trl")
    assert values(scorer.score([ScoreTask("abc", ""), ScoreTask("a", "")])) == [3.0, 1.0]
    with pytest.raises(ValueError, match=r"set as a verl reward .* needs 'solution_str'"):
        make("mystery", style="verl")


def test_the_config_takes_a_list_of_functions_with_weights(module: str) -> None:
    cfg = load_config(
        [f"reward.function=[{module}:accuracy, {module}:short]", "reward.weights=[1, 0.5]"]
    )
    assert cfg.reward.functions == [f"{module}:accuracy", f"{module}:short"]
    assert check_reward_config(cfg.reward) == ["trl", "trl"]
    assert load_config().reward.functions == ["streamrl.reward.rule:arith_exact_match"]
    with pytest.raises(ConfigError, match="1 weight.*for 2 function"):
        load_config([f"reward.function=[{module}:accuracy, {module}:short]", "reward.weights=[1]"])
    with pytest.raises(ValueError, match="mystery"):
        check_reward_config(load_config([f"reward.function={module}:mystery"]).reward)


# -- TRL's form ---------------------------------------------------------------------------------


def test_trl_plain_text_gets_columns_as_lists_and_is_called_once_a_batch(make) -> None:
    tasks = [
        ScoreTask(" 4", "4", {"level": 1}, prompt="2+2=", completion_ids=[1, 2]),
        ScoreTask("5", "4", {"level": 2}, prompt="2+2="),
        ScoreTask("7", "7", {"level": 3}),
    ]
    assert make("accuracy").score(tasks) == [
        RewardResult.ok(1.0),
        RewardResult.ok(0.0),
        RewardResult.ok(1.0),
    ]
    many = [ScoreTask(str(i), "") for i in range(10)]
    assert values(make("batch_size").score(many)) == [10.0] * 10  # one call for the batch
    # split evenly over the workers, at most batch_size a call
    assert values(make("batch_size", num_workers=2).score(many)) == [5.0] * 10
    assert values(make("batch_size", batch_size=4).score(many)) == [4.0] * 8 + [2.0] * 2
    assert values(make("prompt_seen").score(tasks)) == [1.0, 1.0, 0.0]


def test_trl_conversational_gets_assistant_messages(make) -> None:
    tasks = [ScoreTask("<think>", ""), ScoreTask("plain", "", prompt="hi")]
    assert values(make("format_reward", conversational=True).score(tasks)) == [1.0, 0.0]
    (result,) = make("format_reward").score([ScoreTask("<think>", "")])  # texts: it fails
    assert result.status == "infra_error" and "TypeError" in result.reason


def test_none_means_not_applicable(make) -> None:
    tasks = [ScoreTask("12", ""), ScoreTask("ab", "")]
    alone = make("only_digits").score(tasks)
    assert alone[0] == RewardResult.ok(1.0)
    assert alone[1] == RewardResult(None, "infra_error", NOT_APPLICABLE)  # dropped, counted
    # with another function, a None leaves only the others' weighted sum
    both = make("only_digits", "short", weights=[2.0, 1.0]).score(tasks)
    assert both[0].value == pytest.approx(2.0 - 0.2)
    assert both[0].components == {"only_digits": 1.0, "short": pytest.approx(-0.2)}
    assert both[1].value == pytest.approx(-0.2) and both[1].components == {
        "short": pytest.approx(-0.2)
    }


def test_two_weighted_functions_of_different_forms(make) -> None:
    scorer = make("accuracy", "compute_score_dict", weights=[1.0, 0.5])
    tasks = [ScoreTask("4", "4", {"level": 1}), ScoreTask("5", "4", {"level": 1})]
    right, wrong = scorer.score(tasks)
    assert right.value == pytest.approx(1.5) and wrong.value == 0.0
    assert right.components == {
        "accuracy": 1.0,
        "compute_score_dict": 1.0,
        "compute_score_dict/acc": 1.0,
    }


def test_trl_values_are_checked_one_by_one(make) -> None:
    ok, nan = make("not_finite").score([ScoreTask("x", ""), ScoreTask("nan", "")])
    assert ok == RewardResult.ok(1.0)
    assert nan.status == "infra_error" and "nan" in nan.reason
    results = make("wrong_length").score([ScoreTask("a", ""), ScoreTask("b", "")])
    assert all(r.status == "infra_error" for r in results)
    assert "returned 1 values; a TRL-style reward returns a list of 2" in results[0].reason


def test_a_batched_call_keeps_its_deadline(make) -> None:
    scorer = make("hangs_on_a_batch", timeout_s=1.0)
    started = time.monotonic()
    results = scorer.score([ScoreTask("a", ""), ScoreTask("hang", "")])
    assert time.monotonic() - started < 10
    assert [r.status for r in results] == ["timeout", "timeout"]
    assert "reward took over 1s for a batch of 2 sample(s)" in results[0].reason
    assert scorer.score([ScoreTask("b", ""), ScoreTask("c", "")]) == [RewardResult.ok(1.0)] * 2
    assert scorer.num_restarts == 1


# -- veRL's form --------------------------------------------------------------------------------


def test_verl_compute_score_returning_a_float(make) -> None:
    row = {"data_source": "local/sums", "extra_info": {"index": 3}}
    results = make("compute_score").score([ScoreTask("12", "12", row), ScoreTask("1", "12", row)])
    assert results == [RewardResult.ok(1.0), RewardResult.ok(0.0)]


def test_verl_compute_score_returning_a_mapping(make) -> None:
    (right, wrong) = make("compute_score_dict").score([ScoreTask("3", "3"), ScoreTask("2", "3")])
    assert right == RewardResult(1.0, "ok", "", {"acc": 1.0})
    assert wrong.value == 0.0 and wrong.components == {"acc": 0.0}
    # veRL's older scorers (gsm8k's) take only what they name
    assert values(make("verl_old").score([ScoreTask("3", "3"), ScoreTask("2", "3")])) == [1.0, 0.0]


# -- async ----------------------------------------------------------------------------------------


def test_async_functions_are_awaited_concurrently_over_a_batch(make) -> None:
    scorer = make("judge", timeout_s=5.0)
    tasks = [ScoreTask(str(i), str(i % 2)) for i in range(8)]
    scorer.score(tasks[:1])  # the worker is started
    started = time.monotonic()
    results = scorer.score(tasks)
    assert time.monotonic() - started < 8 * 0.3  # not one after another
    assert values(results) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert values(make("async_trl").score([ScoreTask("1", "1"), ScoreTask("1", "2")])) == [1.0, 0.0]


# -- the reward role ------------------------------------------------------------------------------


def test_the_reward_role_gives_a_batched_reward_the_prompts_and_ids(make) -> None:
    tokenizer = build_tokenizer()
    rows = [
        {
            "sample_id": f"s{i}",
            F.PROMPT_IDS: encode_prompt(tokenizer, prompt),
            F.RESPONSE_IDS: encode_response(tokenizer, "4"),
            F.ANSWER: "4",
        }
        for i, prompt in enumerate(("2+2=", "3+1="))
    ]
    scorer = make("prompt_seen")
    role = RewardRole(None, scorer, tokenizer, invalid_penalty=None, max_rows=8, lease_s=5)
    assert F.PROMPT_IDS in role.consumes
    updates = score_rows(scorer, tokenizer, rows, None)
    assert [u[F.REWARD] for u in updates.values()] == [1.0, 0.0]
    plain = make("accuracy")  # completions decoded, columns from the row
    for row in rows:
        row[F.EXTRA] = {"level": 1}
    assert [u[F.REWARD] for u in score_rows(plain, tokenizer, rows, None).values()] == [1.0, 1.0]

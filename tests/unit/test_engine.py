"""The builtin rollout engine on a tiny Qwen3: log-probs agree with the trainer's, sampling is
per-request deterministic, greedy is argmax, in-flight weight updates are recorded per token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams
from streamrl.data.prompts import encode_prompt
from streamrl.models.loading import load_causal_lm
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.models.tokenizer import build_tokenizer
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.trainer.logprobs import pack, response_logprobs

PAD_ID = 0
NO_EOS = -1  # a token id never sampled: every response runs to max_new_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model_dir(out, hidden_size=32, num_layers=1, num_heads=2, seed=0)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tokenizer = build_tokenizer()
    texts = {"a": "37+85=", "b": "1+2=", "c": "123+4567=", "d": "9+9="}
    return {rid: encode_prompt(tokenizer, text) for rid, text in texts.items()}


def make_engine(model_dir: Path, eos_token_id: int = NO_EOS) -> BuiltinEngine:
    return BuiltinEngine(load_causal_lm(model_dir), eos_token_id=eos_token_id, pad_token_id=PAD_ID)


def requests(prompts: dict[str, list[int]], *ids: str) -> list[GenerationRequest]:
    return [GenerationRequest(rid, prompts[rid]) for rid in ids]


def test_engine_logprobs_match_the_trainers(model_dir: Path, prompts) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=3)
    results = engine.generate(requests(prompts, "a", "b", "c", "d"), params)
    batch = pack(
        [prompts[r.request_id] for r in results], [r.response_ids for r in results], PAD_ID
    )
    with torch.no_grad():
        trainer_br = response_logprobs(engine.model, batch, temperature=0.7)
    engine_br = torch.tensor([r.logprobs for r in results])
    delta = (trainer_br - engine_br).abs()
    assert float(delta.mean()) <= 1e-3
    assert float(delta.max()) <= 1e-3


def test_a_request_samples_the_same_tokens_in_any_batch(model_dir: Path, prompts) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=0)
    alone = engine.generate(requests(prompts, "c"), params)[0]
    batched = {r.request_id: r for r in engine.generate(requests(prompts, "a", "c", "d"), params)}
    again = {r.request_id: r for r in engine.generate(requests(prompts, "d", "c", "a"), params)}
    assert batched["c"].response_ids == alone.response_ids == again["c"].response_ids
    assert batched["a"].response_ids == again["a"].response_ids
    assert batched["a"].logprobs == pytest.approx(again["a"].logprobs, abs=1e-5)
    other_seed = engine.generate(requests(prompts, "c"), SamplingParams(10, 1.0, seed=1))[0]
    assert other_seed.response_ids != alone.response_ids


def test_results_come_back_in_request_order(model_dir: Path, prompts) -> None:
    engine = make_engine(model_dir)
    engine.max_batch_size = 2  # three requests: two batches
    results = engine.generate(requests(prompts, "d", "b", "a"), SamplingParams(3))
    assert [r.request_id for r in results] == ["d", "b", "a"]


def test_greedy_picks_the_argmax(model_dir: Path, prompts) -> None:
    engine = make_engine(model_dir)
    result = engine.generate(requests(prompts, "a"), SamplingParams(6, temperature=0.0))[0]
    ids = list(prompts["a"])
    for token, logprob in zip(result.response_ids, result.logprobs, strict=True):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert token == int(logits.argmax())
        assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
        ids.append(token)


def test_inflight_update_marks_later_tokens_with_the_new_version(model_dir: Path, prompts) -> None:
    engine = make_engine(model_dir)
    same_weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    num_polls = 0

    def weight_poll():
        nonlocal num_polls
        num_polls += 1
        return (7, same_weights) if num_polls == 2 else None  # after the 2nd decode step

    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    plain = engine.generate(requests(prompts, "a", "b"), params)
    updated = engine.generate(requests(prompts, "a", "b"), params, weight_poll=weight_poll)
    for result in updated:
        assert result.versions == [0, 0, 7, 7, 7]
    assert (engine.version, engine.num_weight_updates) == (7, 1)
    assert num_polls == 4  # consulted before every decode step but the first
    # The same tensors: the tokens do not change, only their recorded version.
    assert [r.response_ids for r in updated] == [r.response_ids for r in plain]


def test_finish_reason_length(model_dir: Path, prompts) -> None:
    engine = make_engine(model_dir)
    results = engine.generate(requests(prompts, "a", "b"), SamplingParams(4))
    for result in results:
        assert result.finish_reason == "length"
        assert len(result.response_ids) == len(result.logprobs) == len(result.versions) == 4


def test_finish_reason_stop_and_streaming(model_dir: Path, prompts) -> None:
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first_token = make_engine(model_dir).generate(requests(prompts, "a"), greedy)[0].response_ids[0]
    engine = make_engine(model_dir, eos_token_id=first_token)
    streamed: list[list[GenerationResult]] = []
    results = engine.generate(requests(prompts, "a", "c"), greedy, on_finished=streamed.append)
    assert results[0].response_ids == [first_token]
    assert results[0].finish_reason == "stop"
    assert results[0] in streamed[0]  # handed over at the step it finished
    assert sorted(r.request_id for batch in streamed for r in batch) == ["a", "c"]  # once each


def test_load_weights_rejects_unknown_names(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    with pytest.raises(KeyError, match="lm_head.extra"):
        engine.load_weights(1, {"lm_head.extra": torch.zeros(1)})
    assert engine.version == 0


def test_load_weights_copies_tensors_and_sets_the_version(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    name = "model.norm.weight"
    engine.load_weights(3, {name: torch.full((32,), 0.5).numpy()})
    assert torch.equal(dict(engine.model.named_parameters())[name], torch.full((32,), 0.5))
    assert (engine.version, engine.num_weight_updates) == (3, 1)

"""The builtin rollout engine on a tiny Qwen3: its forward pass matches the model's own, log-probs
agree with the trainer's, sampling draws from the softmax and is a pure function of (seed, request,
position) whatever the batch, slot or scheduling, greedy is argmax, in-flight weight updates are
recorded per token, and continuous batching returns every request once, in request order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams
from streamrl.models.loading import load_causal_lm
from streamrl.models.onednn import onednn_linear_usable
from streamrl.rollout.builtin_engine import BuiltinEngine, gumbel_noise, request_key, sample_tokens
from streamrl.rollout.decoder_runner import DecoderRunner
from streamrl.trainer.logprobs import pack, response_logprobs

PAD_ID = 0
NO_EOS = -1  # a token id never sampled: every response runs to max_new_tokens


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


def test_weights_changed_in_place_reach_the_next_generate(model_dir: Path, prompts) -> None:
    """A model trained in place (sync mode shares it with the trainer) is repacked by the next
    `generate`; weights given to `load_weights` are packed there once, not again by `generate`."""
    engine = make_engine(model_dir)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, seed=0)
    repacks = []
    refresh = engine.runner.refresh
    engine.runner.refresh = lambda: (repacks.append(1), refresh())[1]

    before = engine.generate(requests(prompts, "a"), params)[0].logprobs
    with torch.no_grad():
        engine.model.model.norm.weight.mul_(3.0)
    after = engine.generate(requests(prompts, "a"), params)[0].logprobs
    assert after != before
    assert len(repacks) == 2

    norm = engine.model.model.norm.weight.detach() / 3.0
    engine.load_weights(1, {"model.norm.weight": norm})
    assert engine.generate(requests(prompts, "a"), params)[0].logprobs == before
    assert len(repacks) == 3  # load_weights packed; its generate did not again


def tiny_family_model(family: str):
    """A randomly initialised two-layer model of each supported family (biases where it has them)."""
    import transformers

    shape = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **shape))
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **shape
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    else:
        config = transformers.LlamaConfig(attention_bias=True, mlp_bias=True, **shape)
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


@pytest.mark.parametrize(
    ("use_onednn", "dtype"),
    [(True, torch.float32), (False, torch.float32), (False, torch.bfloat16)],
    ids=["onednn", "f.linear", "bf16"],
)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2", "llama"])
def test_runner_matches_the_models_own_forward(family: str, use_onednn: bool, dtype) -> None:
    """Prefill into scattered slots (one prompt twice: computed once, its rows copied), pack the
    rows to the front as the engine does, decode: every step's logits are the model's own (in
    bf16 to within its rounding: the runner keeps transformers' order of operations there)."""
    if use_onednn and not onednn_linear_usable(torch.device("cpu"), torch.float32):
        pytest.skip("this PyTorch build has no oneDNN linear")
    model = tiny_family_model(family).to(dtype)
    runner = DecoderRunner(model, use_onednn=use_onednn)
    # bf16 prefill: bit for bit; folded weights (the fp32 path) would be off by 1e-3 and more.
    # bf16 decode (one query against the cache, another shape than the model's whole-sequence
    # forward): bit for bit on AVX-512-BF16 CPUs, up to one bf16 step of these logits (2**-9,
    # they are below 0.5) on AVX2-only ones, whose bf16 kernels block the sums differently.
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-4, rtol=0)
    decode_tolerance = tolerance if dtype == torch.float32 else dict(atol=2**-9, rtol=0)
    runner.allocate(num_slots=4, max_len=12)
    sequences = [[5, 9, 3, 7, 1], [4, 2], [5, 9, 3, 7, 1]]
    fed = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    slots = torch.tensor([3, 0, 2])

    def models_own_logits() -> torch.Tensor:
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1] for s in sequences])

    with torch.no_grad():
        logits = runner.prefill(slots, sequences)
        torch.testing.assert_close(logits, models_own_logits(), **tolerance)
        runner.move_rows(slots, torch.arange(3), num_columns=5)
        for step in range(3):
            tokens = [f[step] for f in fed]
            positions = torch.tensor([len(s) for s in sequences])
            for sequence, token in zip(sequences, tokens, strict=True):
                sequence.append(token)
            logits = runner.decode(torch.tensor(tokens), positions)
            torch.testing.assert_close(logits, models_own_logits(), **decode_tolerance)


def test_unsupported_architectures_are_refused_with_a_clear_error() -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    with pytest.raises(TypeError, match="model_type 'gpt2'"):
        BuiltinEngine(transformers.GPT2LMHeadModel(config), eos_token_id=1, pad_token_id=0)


def test_noise_of_a_row_depends_only_on_its_key_and_position() -> None:
    keys = torch.tensor([request_key(0, f"r{i}") for i in range(5)])
    positions = torch.tensor([3, 9, 9, 0, 40])
    batch = gumbel_noise(keys, positions, 128)
    for row in range(5):
        alone = gumbel_noise(keys[row : row + 1], positions[row : row + 1], 128)
        assert torch.equal(alone[0], batch[row])
    assert not torch.equal(batch[1], batch[2])  # another request, same position
    assert not torch.equal(gumbel_noise(keys[:1], positions[:1] + 1, 128), batch[:1])
    assert request_key(0, "r0") != request_key(1, "r0")


@pytest.mark.parametrize("over", ["requests", "positions"])
def test_sampling_draws_from_the_temperature_scaled_softmax(over: str) -> None:
    num = 20_000
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    temperature = 0.5
    logits = (probs.log() * temperature).expand(num, -1)  # softmax(logits / T) == probs
    if over == "requests":
        keys = torch.tensor([request_key(7, f"req-{i}") for i in range(num)])
        positions = torch.full((num,), 5)
    else:
        keys = torch.tensor([request_key(7, "one-request")]).expand(num, -1)
        positions = torch.arange(num)
    tokens, logprobs = sample_tokens(logits, temperature, keys, positions)
    frequencies = torch.bincount(tokens, minlength=5).float() / num
    assert (frequencies - probs).abs().max() < 0.015  # about 4 standard deviations
    torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_scheduling_does_not_change_what_a_request_draws(model_dir: Path, prompts) -> None:
    """Continuous batching (fewer slots than requests), packing finished rows away and the
    neighbours of a row leave each request's tokens exactly as when it runs alone."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    ids = [f"{name}{k}" for k in range(3) for name in "abcd"]
    reqs = [GenerationRequest(rid, prompts[rid[0]]) for rid in ids]
    free_running = make_engine(model_dir).generate(reqs, params)
    # An EOS that some responses reach early and others never: rows finish at different steps.
    counts = torch.bincount(torch.tensor([r.response_ids[1:-1] for r in free_running]).flatten())
    eos = int(counts.argmax())
    expected = {}
    for r in free_running:
        cut = r.response_ids.index(eos) + 1 if eos in r.response_ids else len(r.response_ids)
        expected[r.request_id] = r.response_ids[:cut]
    assert len({len(v) for v in expected.values()}) > 2

    for max_batch_size in (512, 5, 1):
        engine = make_engine(model_dir, eos_token_id=eos)
        engine.max_batch_size = max_batch_size
        streamed: list[GenerationResult] = []
        results = engine.generate(reqs, params, on_finished=streamed.extend)
        assert [r.request_id for r in results] == ids
        assert {r.request_id: r.response_ids for r in results} == expected
        assert sorted(r.request_id for r in streamed) == sorted(ids)
        for r in results:
            assert r.finish_reason == ("stop" if r.response_ids[-1] == eos else "length")
            assert len(r.logprobs) == len(r.versions) == len(r.response_ids)


def test_a_continuation_draws_what_the_uninterrupted_request_would(
    model_dir: Path, prompts
) -> None:
    """Noise is keyed by the token's position in the whole sequence, so resuming a request as
    prompt + its first k tokens (as an in-flight weight update may) continues it unchanged."""
    engine = make_engine(model_dir)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, seed=2)
    whole = engine.generate(requests(prompts, "b"), params)[0]
    resumed = GenerationRequest("b", prompts["b"] + whole.response_ids[:4])
    rest = engine.generate([resumed], SamplingParams(5, temperature=1.0, seed=2))[0]
    assert rest.response_ids == whole.response_ids[4:]
    assert rest.logprobs == pytest.approx(whole.logprobs[4:], abs=1e-5)

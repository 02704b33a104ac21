"""The vLLM engine on a tiny Qwen3: log-probs agree with the trainer's on identical weights,
sampling is per-request deterministic, greedy is argmax, weight updates reach every layer (the
tied output layer included), and in-flight updates resume requests as continuations whose
tokens carry the version that sampled them. With two engines behind one VllmEngine: groups are
spread over both and sample what one engine samples, and every weight update (between batches and
in flight) reaches both, in process and with an engine-core process each.

Needs vLLM (`make install-vllm`). Outside the Makefile's test targets the module is skipped when
vLLM is missing; those targets set STREAMRL_REQUIRE_VLLM=1, which turns the skip into a failure.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams
from streamrl.config.schema import VllmConfig
from streamrl.data.prompts import encode_prompt
from streamrl.models.loading import load_causal_lm
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.models.tokenizer import build_tokenizer
from streamrl.trainer.logprobs import pack, response_logprobs
from tests.vllm_required import skip_module_without_vllm

skip_module_without_vllm()

from streamrl.rollout.vllm_engine import CPU_HEAD_SIZES, VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow

PAD_ID = 0
# fp32 engine vs fp32 trainer on identical weights: measured mean ~1e-7, max ~1e-5.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    # head_dim 32: vLLM's CPU attention kernels want head sizes that are multiples of 16.
    return build_tiny_model_dir(out, hidden_size=64, num_layers=2, num_heads=2, seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    engine = VllmEngine(
        model_dir,
        eos_token_id=build_tokenizer().eos_token_id,
        config=VllmConfig(kv_cache_gib=0.25),
        max_num_seqs=64,
    )
    yield engine
    engine.close()


@pytest.fixture
def base_model(model_dir: Path, engine: VllmEngine):
    """The model as saved; the engine is reset to these weights for each test."""
    model = load_causal_lm(model_dir)
    engine.load_weights(engine.version + 1, dict(model.named_parameters()))
    return model


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tokenizer = build_tokenizer()
    texts = {"a": "37+85=", "b": "1+2=", "c": "123+4567=", "d": "9+9="}
    return {rid: encode_prompt(tokenizer, text) for rid, text in texts.items()}


def requests(prompts: dict[str, list[int]], *ids: str) -> list[GenerationRequest]:
    return [GenerationRequest(rid, prompts[rid]) for rid in ids]


def trainer_logprobs(model, results: list[GenerationResult], prompts, temperature: float):
    """The trainer's log-probs of each result's tokens: a list of 1-D tensors."""
    batch = pack(
        [prompts[r.request_id] for r in results], [r.response_ids for r in results], PAD_ID
    )
    with torch.no_grad():
        logprobs_br = response_logprobs(model, batch, temperature)
    return [logprobs_br[i, : len(r.response_ids)] for i, r in enumerate(results)]


def perturbed(model, *, only: str = "", scale: float = 0.05):
    """A copy of `model` with noise added to every parameter whose name contains `only`."""
    torch.manual_seed(1)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in out.named_parameters():
            if only in name:
                param.add_(torch.randn_like(param) * scale)
    return out


def assert_logprobs_match(model, results, prompts, temperature: float) -> None:
    expected = trainer_logprobs(model, results, prompts, temperature)
    for result, want in zip(results, expected, strict=True):
        got = torch.tensor(result.logprobs)
        assert float((got - want).abs().max()) <= LOGPROB_TOLERANCE, result.request_id


def test_logprobs_are_the_trainers_at_the_sampling_temperature(engine, base_model, prompts) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=3)
    results = engine.generate(requests(prompts, "a", "b", "c", "d"), params)
    assert_logprobs_match(base_model, results, prompts, temperature=0.7)
    # Not the raw (temperature 1) log-probs: those differ by far more than the tolerance.
    raw = trainer_logprobs(base_model, results, prompts, temperature=1.0)
    gaps = [
        float((torch.tensor(r.logprobs) - w).abs().max()) for r, w in zip(results, raw, strict=True)
    ]
    assert max(gaps) > 0.01


def test_a_request_samples_the_same_tokens_in_any_batch(engine, base_model, prompts) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=0)
    alone = engine.generate(requests(prompts, "c"), params)[0]
    batched = {r.request_id: r for r in engine.generate(requests(prompts, "a", "c", "d"), params)}
    again = {r.request_id: r for r in engine.generate(requests(prompts, "d", "c", "a"), params)}
    assert batched["c"].response_ids == alone.response_ids == again["c"].response_ids
    assert batched["a"].response_ids == again["a"].response_ids
    assert batched["a"].logprobs == pytest.approx(again["a"].logprobs, abs=1e-5)
    other_seed = engine.generate(requests(prompts, "c"), SamplingParams(10, 1.0, seed=1))[0]
    assert other_seed.response_ids != alone.response_ids


def test_greedy_picks_the_argmax(engine, base_model, prompts) -> None:
    result = engine.generate(requests(prompts, "a"), SamplingParams(6, temperature=0.0))[0]
    ids = list(prompts["a"])
    for token, logprob in zip(result.response_ids, result.logprobs, strict=True):
        with torch.no_grad():
            logits = base_model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert token == int(logits.argmax())
        assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-4)
        ids.append(token)


def test_results_in_request_order_streamed_once_each(engine, base_model, prompts) -> None:
    streamed: list[GenerationResult] = []
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    results = engine.generate(requests(prompts, "d", "b", "a"), params, on_finished=streamed.extend)
    assert [r.request_id for r in results] == ["d", "b", "a"]
    assert sorted(r.request_id for r in streamed) == ["a", "b", "d"]
    eos = build_tokenizer().eos_token_id
    for r in results:
        assert len(r.response_ids) == len(r.logprobs) == len(r.versions)
        if r.finish_reason == "stop":
            assert r.response_ids[-1] == eos
        else:
            assert len(r.response_ids) == 12 and eos not in r.response_ids


@pytest.mark.parametrize("only", ["embed_tokens", ""], ids=["tied-embedding-only", "all"])
def test_loaded_weights_reach_every_layer(engine, base_model, prompts, only: str) -> None:
    # The embedding alone is the trap: the tied output layer keeps a packed copy on CPU.
    model = perturbed(base_model, only=only)
    version = engine.version + 1
    engine.load_weights(version, dict(model.named_parameters()))
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    results = engine.generate(requests(prompts, "a", "b", "c"), params)
    assert_logprobs_match(model, results, prompts, temperature=1.0)
    assert all(set(r.versions) == {version} for r in results)


def test_a_reload_warns_only_about_layers_it_failed_to_load(engine, base_model) -> None:
    # vLLM warns "<layer>: Failed to load weights" on every reload for the rotary embedding and
    # the tied output layer, neither of which a checkpoint holds: that warning is dropped for
    # those two, and still reaches the log for any other layer.
    from streamrl.rollout.vllm_replica import RELOAD_LOGGER

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(RELOAD_LOGGER)
    # Another test's logging set-up may have disabled or raised this logger: open it for now.
    disabled, level = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        engine.load_weights(engine.version + 1, dict(perturbed(base_model).named_parameters()))
        assert [r.getMessage() for r in records if "Failed to load" in r.getMessage()] == []
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
        assert [r.getMessage() for r in records] == ["QKVParallelLinear: Failed to load weights"]
    finally:
        logger.removeHandler(handler)
        logger.disabled = disabled
        logger.setLevel(level)  # (setLevel, not assignment: it clears the loggers' level cache)


def test_weights_as_read_only_numpy_arrays(engine, base_model, prompts) -> None:
    model = perturbed(base_model)
    arrays = {}
    for name, param in model.named_parameters():
        array = param.detach().numpy().copy()
        array.flags.writeable = False  # as they come out of Ray's object store
        arrays[name] = array
    engine.load_weights(engine.version + 1, arrays)
    results = engine.generate(requests(prompts, "b"), SamplingParams(6, 1.0))
    assert_logprobs_match(model, results, prompts, temperature=1.0)


def update_at_third_poll(version: int, model):
    """A weight poll that hands over `model`'s weights as `version` at its third call."""
    num_polls = 0

    def weight_poll():
        nonlocal num_polls
        num_polls += 1
        return (version, dict(model.named_parameters())) if num_polls == 3 else None

    return weight_poll


def test_inflight_update_resumes_requests_under_the_new_weights(
    engine, base_model, prompts
) -> None:
    new_model = perturbed(base_model, scale=0.2)
    old_version = engine.version
    new_version = old_version + 5
    weight_poll = update_at_third_poll(new_version, new_model)

    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2)
    streamed: list[GenerationResult] = []
    continued_before = engine.num_continuations
    results = engine.generate(
        requests(prompts, "a", "b", "c", "d"),
        params,
        on_finished=streamed.extend,
        weight_poll=weight_poll,
    )
    assert engine.version == new_version
    assert sorted(r.request_id for r in streamed) == ["a", "b", "c", "d"]
    spanning = 0
    for r in results:
        # Three steps ran before the update: the first three tokens are the old policy's.
        num_old = min(3, len(r.response_ids))
        assert r.versions == [old_version] * num_old + [new_version] * (
            len(r.response_ids) - num_old
        )
        spanning += new_version in r.versions
        # Each token's log-prob is that of the policy that sampled it.
        old_lp, new_lp = (
            trainer_logprobs(m, [r], prompts, 1.0)[0] for m in (base_model, new_model)
        )
        want = torch.where(torch.tensor(r.versions) == old_version, old_lp, new_lp)
        assert float((torch.tensor(r.logprobs) - want).abs().max()) <= LOGPROB_TOLERANCE
    assert spanning >= 1
    assert engine.num_continuations - continued_before == spanning


def test_too_long_a_request_is_refused(engine, prompts) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(requests(prompts, "a"), SamplingParams(max_new_tokens=10_000))


# Several engines behind one VllmEngine. In process (the second starts in under a second), and
# in processes of their own (test_two_engines_in_their_own_processes), where weights travel as
# safetensors bytes and the engine cores run ahead of this process between its steps.


@pytest.fixture(scope="module")
def two_engines(model_dir: Path):
    engine = VllmEngine(
        model_dir,
        eos_token_id=build_tokenizer().eos_token_id,
        config=VllmConfig(kv_cache_gib=0.25, engines=2),
        max_num_seqs=64,
    )
    yield engine
    engine.close()


def grouped(prompts: dict[str, list[int]], group_size: int) -> list[GenerationRequest]:
    """`group_size` samples of every prompt, as a rollout batch holds them."""
    return [
        GenerationRequest(f"{rid}/{i}", prompts[rid]) for rid in prompts for i in range(group_size)
    ]


def served_by(results: list[GenerationResult]) -> dict[str, set[int]]:
    """prompt key -> the engines that ran any attempt of any of its samples."""
    out: dict[str, set[int]] = {}
    for r in results:
        out.setdefault(r.request_id.split("/")[0], set()).update(r.extra["engines"])
    return out


def grouped_logprobs_match(model, results, prompts, temperature: float) -> None:
    by_id = {r.request_id: prompts[r.request_id.split("/")[0]] for r in results}
    assert_logprobs_match(model, results, by_id, temperature)


def test_groups_spread_over_engines_and_sample_what_one_engine_samples(
    engine, two_engines, base_model, prompts
) -> None:
    two_engines.load_weights(engine.version, dict(base_model.named_parameters()))
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4)
    batch = grouped(prompts, group_size=3)
    before = two_engines.requests_per_engine
    results = two_engines.generate(batch, params)
    routed = [a - b for a, b in zip(two_engines.requests_per_engine, before, strict=True)]
    assert sum(routed) == len(batch) and min(routed) >= 3, routed  # both engines got groups
    served = served_by(results)
    assert all(len(engines) == 1 for engines in served.values()), served  # groups stay whole
    assert set().union(*served.values()) == {0, 1}
    # Per-request seeds: where a request ran does not change what it sampled.
    alone = {r.request_id: r for r in engine.generate(batch, params)}
    for r in results:
        assert r.response_ids == alone[r.request_id].response_ids, r.request_id
        assert r.logprobs == pytest.approx(alone[r.request_id].logprobs, abs=1e-5)
    assert two_engines.balancer.requests == [0, 0] and two_engines.balancer.tokens == [0, 0]


def test_a_weight_update_reaches_every_engine(two_engines, base_model, prompts) -> None:
    model = perturbed(base_model, scale=0.1)
    version = two_engines.version + 1
    two_engines.load_weights(version, dict(model.named_parameters()))
    assert [r.version for r in two_engines.replicas] == [version, version]
    results = two_engines.generate(grouped(prompts, 2), SamplingParams(8, 1.0, seed=6))
    assert set().union(*served_by(results).values()) == {0, 1}
    grouped_logprobs_match(model, results, prompts, temperature=1.0)
    assert all(set(r.versions) == {version} for r in results)


def check_inflight_update(engines: VllmEngine, base_model, prompts) -> None:
    """Generate two samples of each prompt from `base_model`'s weights with an update to other
    weights at the third weight poll, and check every token's version and log-prob."""
    engines.load_weights(engines.version + 1, dict(base_model.named_parameters()))
    new_model = perturbed(base_model, scale=0.2)
    old_version = engines.version
    new_version = old_version + 3
    weight_poll = update_at_third_poll(new_version, new_model)

    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2)
    continued_before = engines.num_continuations
    results = engines.generate(grouped(prompts, 2), params, weight_poll=weight_poll)
    assert [r.version for r in engines.replicas] == [new_version] * len(engines.replicas)
    spanning = 0
    for r in results:
        # Old tokens, then new ones. In process, each loop steps every busy engine once, so three
        # steps of each ran before the update. An engine core in its own process runs ahead of
        # this process, which has seen at most three steps' tokens by then (the rest are
        # discarded by the abort); the log-prob check below shows each token's version is right.
        num_old = r.versions.count(old_version)
        assert r.versions == [old_version] * num_old + [new_version] * (len(r.versions) - num_old)
        if engines.config.in_process:
            assert num_old == min(3, len(r.response_ids))
        else:
            assert num_old <= 3
        spanning += new_version in r.versions
        prompt = {r.request_id: prompts[r.request_id.split("/")[0]]}
        old_lp, new_lp = (trainer_logprobs(m, [r], prompt, 1.0)[0] for m in (base_model, new_model))
        want = torch.where(torch.tensor(r.versions) == old_version, old_lp, new_lp)
        assert float((torch.tensor(r.logprobs) - want).abs().max()) <= LOGPROB_TOLERANCE
    assert spanning >= 2
    assert engines.num_continuations - continued_before == spanning
    # Before the update both engines ran requests, so both were aborted and resumed.
    assert {r.extra["engines"][0] for r in results} == set(range(len(engines.replicas)))
    assert engines.balancer.requests == [0] * len(engines.replicas)


def test_inflight_update_reaches_every_engine(two_engines, base_model, prompts) -> None:
    check_inflight_update(two_engines, base_model, prompts)


def test_a_failed_generate_leaves_the_engines_clean(two_engines, prompts) -> None:
    def failing_poll():
        raise ConnectionError("weight service gone")

    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    with pytest.raises(ConnectionError, match="weight service gone"):
        two_engines.generate(grouped(prompts, 2), params, weight_poll=failing_poll)
    assert two_engines.balancer.requests == [0, 0] and two_engines.balancer.tokens == [0, 0]
    assert not any(r.engine.has_unfinished_requests() for r in two_engines.replicas)
    results = two_engines.generate(grouped(prompts, 2), params)
    assert all(len(r.response_ids) > 0 for r in results)


def test_two_engines_in_their_own_processes(model_dir: Path, base_model, prompts) -> None:
    engines = VllmEngine(
        model_dir,
        eos_token_id=build_tokenizer().eos_token_id,
        config=VllmConfig(kv_cache_gib=0.25, in_process=False, engines=2),
        max_num_seqs=16,
    )
    try:
        model = perturbed(base_model)
        engines.load_weights(1, {n: p.detach().numpy() for n, p in model.named_parameters()})
        results = engines.generate(grouped(prompts, 2), SamplingParams(8, 1.0))
        assert set().union(*served_by(results).values()) == {0, 1}
        grouped_logprobs_match(model, results, prompts, temperature=1.0)
        check_inflight_update(engines, base_model, prompts)
    finally:
        engines.close()
    assert np.isfinite(results[0].logprobs).all()


def test_the_pre_run_checks_head_sizes_are_vllms_own() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert list(CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


# vLLM fuses q/k/v and gate/up into one weight each: its parameter = these rows stacked.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture
def readable_vllm_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep vLLM's linear weights readable in this process. Where its CPU kernels prepack the
    weights (oneDNN on AVX-512-bf16 CPUs, AMX kernels), vLLM drops each linear's `weight` for
    an empty tensor after packing it, so there would be nothing to read back. The packing itself,
    made from the same parameter, is unchanged: only the parameter is kept."""
    import vllm.model_executor.layers.utils as vllm_utils

    dispatch = vllm_utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setattr(
        vllm_utils,
        "dispatch_cpu_unquantized_gemm",
        lambda layer, remove_weight: dispatch(layer, remove_weight=False),
    )


def engine_parameters(engine: VllmEngine) -> dict[str, torch.Tensor]:
    """Copies of the parameters the (in-process) engine computes with, under vLLM's names."""
    (params,) = engine.replicas[0].llm.apply_model(
        lambda model: {n: p.detach().clone() for n, p in model.named_parameters()}
    )
    return params


def as_engine_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (the trainer's names) laid out as vLLM holds them: fused weights stacked."""
    out = {}
    for name, value in tensors.items():
        for fused, parts in FUSED.items():
            if name.endswith(f".{parts[0]}.weight"):
                stem = name[: -len(f"{parts[0]}.weight")]
                value = torch.cat([tensors[f"{stem}{part}.weight"] for part in parts])
                name = f"{stem}{fused}.weight"
        if not any(name.endswith(f".{part}.weight") for parts in FUSED.values() for part in parts):
            out[name] = value
    return out


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name].view(torch.int16), value.view(torch.int16)), name


def test_bf16_weights_arrive_in_a_bf16_engine_bit_for_bit(
    model_dir: Path, readable_vllm_weights: None
) -> None:
    """A bf16 trainer's weights (random bits: NaN payloads, infinities, -0 included), handed over
    as tensors (in process) and as the safetensors blob that crosses to an engine-core process,
    are what a bf16 vLLM engine computes with, bit for bit; an fp32 trainer's weights reach it
    rounded to nearest, as `Tensor.to(bfloat16)` rounds them."""
    engine = VllmEngine(
        model_dir,
        eos_token_id=build_tokenizer().eos_token_id,
        config=VllmConfig(kv_cache_gib=0.25, in_process=True, dtype="bfloat16"),
        max_num_seqs=16,
    )
    try:
        shapes = {n: p.shape for n, p in load_causal_lm(model_dir).named_parameters()}
        generator = torch.Generator().manual_seed(3)
        random_bf16 = {
            name: torch.randint(
                -(2**15), 2**15, shape, generator=generator, dtype=torch.int16
            ).view(torch.bfloat16)
            for name, shape in shapes.items()
        }
        engine.load_weights(1, random_bf16)
        assert_same_bits(engine_parameters(engine), as_engine_names(random_bf16))

        from safetensors.torch import save

        flipped = {name: -value for name, value in random_bf16.items()}
        engine.replicas[0].load_weights(2, save(flipped))  # what a separate engine process gets
        assert_same_bits(engine_parameters(engine), as_engine_names(flipped))

        fp32 = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
        engine.load_weights(3, fp32)
        rounded = {name: value.to(torch.bfloat16) for name, value in fp32.items()}
        assert_same_bits(engine_parameters(engine), as_engine_names(rounded))
    finally:
        engine.close()

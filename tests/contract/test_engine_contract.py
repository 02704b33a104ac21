"""Contract suite for rollout engines (``streamrl.api.engine.Engine``): every engine must pass it.

An engine counts as supported once it passes this suite: add it to ``ENGINES`` below, one entry
naming a factory that starts it over a model directory (``engines_under_test.py`` holds them:
the builtin engine, vLLM's CPU engine in this process, and the SGLang adapter attached to the
stand-in server of ``tests/fakes/sglang_server.py``). Each engine starts once for the module, on
one tiny Qwen3; every test first loads the reference weights into it as a new version. Without
vLLM its cases skip, unless STREAMRL_REQUIRE_VLLM=1 makes that a failure.

The reference is the model as transformers runs it, and the trainer's log-probs
(``streamrl.trainer.logprobs``). Properties:

- greedy (temperature 0) tokens are the same alone and in a batch, and are the model's argmax,
  step by step;
- one log-prob per token, finite, <= 0, the trainer's log-softmax of the temperature-scaled
  logits (unscaled at temperature 0) within fp32 noise;
- after ``load_weights(v, tensors)`` the engine's ``version`` is v, every new token carries v,
  and the tokens are the new weights';
- an update handed over by ``weight_poll`` mid-generation: the tokens before it carry the old
  version, those after it the new one, and (greedy) the tokens after it are what the engine
  generates for prompt + tokens so far under the new weights;
- ``on_finished`` receives every result exactly once; results come back in request order;
- finish_reason is "length" at ``max_new_tokens`` and "stop" at EOS (ending the response);
- samples at temperature 1 are a function of (seed, request_id): the same across calls and
  batch compositions, different for other request ids or another seed;
- with top-p, top-k or min-p on, every sampled token lies in the set the rule keeps (written out
  by hand over the reference's logits) and its log-prob is that of the truncated, renormalised
  distribution, log(p / kept mass), not the full one;
- a stop token id or a stop string ends the response with the token that completes it (finish
  reason "stop"); the response is a prefix of the one drawn without the stop, log-probs too;
- an empty prompt, or a prompt token id that is negative or outside the vocabulary, is a
  ValueError naming the request and the problem, raised before anything is generated, and the
  engine works afterwards.

Aborting: the protocol has no abort method. Aborting running requests and resuming them as
continuations (prompt plus tokens so far) is how an engine applies an in-flight update (vLLM
aborts its requests in the replica, SGLang's adapter pauses the server with mode "abort" and
``/abort_request`` cleans up a failed call; the builtin engine, in process, prefills its running
sequences again), so the in-flight update test covers it. The last test covers what only the
SGLang adapter needs: a server that checks token ids itself when the adapter cannot.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch
from engines_under_test import Subject, start_builtin, start_sglang, start_vllm

from streamrl.api.engine import Engine, GenerationRequest, GenerationResult, SamplingParams
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.trainer.logprobs import pack, response_logprobs

ENGINES: dict[str, Callable[[Path, int, Path], Subject]] = {
    "builtin": start_builtin,
    "vllm": start_vllm,
    "sglang": start_sglang,
}

PAD_ID = 0
# fp32 engines against the fp32 trainer on identical weights differ by rounding only.
LOGPROB_TOLERANCE = 1e-4
WAIT_S = 60.0  # the longest the in-flight update waits for its moment; it comes within a second
# Token ids, not text: engines never tokenize. None holds the EOS id, so the stop test can
# change EOS's embedding without changing what any prompt computes.
PROMPTS = {
    "a": [2, 8, 12, 77, 13, 10, 85, 3],
    "b": [2, 6, 77, 7, 85, 3],
    "c": [2, 6, 7, 8, 77, 9, 10, 11, 12, 85, 3],
    "d": [2, 14, 77, 14, 85, 3],
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are too small to split: one thread is fastest, and on a loaded
    machine threads that wait for each other at every op turn a second into tens."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 (head_dim 32: vLLM's CPU attention wants multiples of 16), rescaled.

    Freshly initialised, its tied embedding dominates the logits and greedy decoding repeats the
    prompt's last token whatever the context, which would make every greedy comparison hold
    trivially. With smaller embeddings, larger layer outputs and a larger final norm, the
    context picks the argmax (with margins far above fp32 noise) while sampling at temperature 1
    stays varied (about 3 nats of entropy per token)."""
    out = build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=2, seed=0
    )
    model = load_causal_lm(out)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.5)
        model.model.norm.weight.mul_(20.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(4.0)
            layer.mlp.down_proj.weight.mul_(4.0)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def eos(model_dir: Path) -> int:
    return load_tokenizer(model_dir).eos_token_id


@pytest.fixture(scope="module")
def policy(model_dir: Path):
    """The reference: the saved model run by transformers."""
    return load_causal_lm(model_dir)


@pytest.fixture(scope="module")
def updated(policy):
    """Other weights for updates: every parameter times (1 + 0.2 * noise), seeded."""
    generator = torch.Generator().manual_seed(1)
    model = copy.deepcopy(policy)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module", params=list(ENGINES))
def subject(
    request: pytest.FixtureRequest, model_dir: Path, eos: int, tmp_path_factory
) -> Iterator[Subject]:
    subject = ENGINES[request.param](model_dir, eos, tmp_path_factory.mktemp(request.param))
    yield subject
    subject.close()


@pytest.fixture
def engine(subject: Subject, policy) -> Engine:
    """The engine under test holding the reference weights (as a new version)."""
    subject.engine.load_weights(subject.engine.version + 1, weights_of(policy))
    return subject.engine


# -- references ------------------------------------------------------------------------------


def weights_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def with_weights(model, weights: Mapping[str, torch.Tensor]):
    out = copy.deepcopy(model)
    out.load_state_dict(weights, strict=False)  # (the tied output layer is not named)
    return out


def requests(*ids: str, prompts: Mapping[str, list[int]] = PROMPTS) -> list[GenerationRequest]:
    return [GenerationRequest(rid, list(prompts[rid.split("/")[0]])) for rid in ids]


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Argmax decoding by plain forward passes over the whole sequence, up to EOS."""
    ids, out = list(prompt), []
    while len(out) < max_new_tokens and (not out or out[-1] != eos):
        out.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


def trainer_logprobs(model, results: list[GenerationResult], temperature: float):
    """The trainer's log-prob of every response token, one 1-D tensor per result."""
    prompts = [PROMPTS[r.request_id.split("/")[0]] for r in results]
    batch = pack(prompts, [r.response_ids for r in results], PAD_ID)
    with torch.no_grad():
        logprobs_br = response_logprobs(model, batch, temperature)
    return [logprobs_br[i, : len(r.response_ids)] for i, r in enumerate(results)]


def max_logprob_gap(model, results: list[GenerationResult], temperature: float) -> float:
    expected = trainer_logprobs(model, results, temperature)
    return max(
        float((torch.tensor(r.logprobs) - want).abs().max())
        for r, want in zip(results, expected, strict=True)
    )


# -- the properties --------------------------------------------------------------------------


def test_greedy_is_the_models_argmax_alone_and_in_a_batch(engine: Engine, policy, eos) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    expected = {rid: greedy_reference(policy, PROMPTS[rid], 8, eos) for rid in PROMPTS}
    assert len({tuple(ids) for ids in expected.values()}) > 1  # the context decides
    batched = engine.generate(requests("d", "a", "c", "b"), params)
    for result in batched:
        alone = engine.generate(requests(result.request_id), params)[0]
        assert alone.response_ids == result.response_ids == expected[result.request_id]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_trainers(engine: Engine, policy, temperature: float) -> None:
    results = engine.generate(requests(*PROMPTS), SamplingParams(8, temperature, seed=3))
    for result in results:
        logprobs = torch.tensor(result.logprobs)
        assert len(result.logprobs) == len(result.response_ids) > 0
        assert bool(torch.isfinite(logprobs).all()) and bool((logprobs <= 0).all())
    assert max_logprob_gap(policy, results, temperature) <= LOGPROB_TOLERANCE
    if temperature > 0:  # not the temperature-1 log-probs: those are far off
        assert max_logprob_gap(policy, results, 1.0) > 0.01


def test_new_weights_set_the_version_every_new_token_carries(engine: Engine, updated) -> None:
    version = engine.version + 3  # not merely the next one
    engine.load_weights(version, weights_of(updated))
    assert engine.version == version
    results = engine.generate(requests(*PROMPTS), SamplingParams(6, 1.0, seed=2))
    for result in results:
        assert result.versions == [version] * len(result.response_ids)
    assert max_logprob_gap(updated, results, 1.0) <= LOGPROB_TOLERANCE  # sampled by them


def test_an_inflight_update_continues_requests_under_the_new_weights(
    engine: Engine, subject: Subject, policy, updated, eos
) -> None:
    num_old, max_new = 3, 8
    old_version = engine.version
    new_version = old_version + 1
    ids = list(PROMPTS)
    ready = subject.update_after(num_old, len(ids))
    deadline = time.monotonic() + WAIT_S
    served = False

    def weight_poll():
        nonlocal served
        if served or not (ready() or time.monotonic() > deadline):
            return None
        served = True
        return new_version, weights_of(updated)

    greedy = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    results = engine.generate(requests(*ids), greedy, weight_poll=weight_poll)
    assert served and engine.version == new_version
    changed = 0
    for result in results:
        prompt, response = PROMPTS[result.request_id], result.response_ids
        assert len(response) == max_new  # (no EOS within reach here)
        assert result.versions == [old_version] * num_old + [new_version] * (max_new - num_old)
        old = greedy_reference(policy, prompt, max_new, eos)
        assert response[:num_old] == old[:num_old]
        # The rest continues the request from its tokens so far, as a fresh request would.
        continued = GenerationRequest(result.request_id, prompt + response[:num_old])
        rest = engine.generate([continued], SamplingParams(max_new - num_old, 0.0))[0]
        assert response[num_old:] == rest.response_ids
        assert rest.response_ids == greedy_reference(
            updated, continued.prompt_ids, max_new - num_old, eos
        )
        changed += response[num_old:] != old[num_old:]
        # Each token's log-prob is that of the weights that sampled it.
        old_lp, new_lp = (trainer_logprobs(m, [result], 0.0)[0] for m in (policy, updated))
        want = torch.cat([old_lp[:num_old], new_lp[num_old:]])
        assert float((torch.tensor(result.logprobs) - want).abs().max()) <= LOGPROB_TOLERANCE
    assert changed > 0  # the new weights continue some request differently: a mix-up would show


def test_results_stream_once_each_and_return_in_request_order(engine: Engine) -> None:
    ids = ["d", "b/0", "a", "c", "b/1"]
    streamed: list[list[GenerationResult]] = []
    results = engine.generate(requests(*ids), SamplingParams(6, 1.0), on_finished=streamed.append)
    assert [r.request_id for r in results] == ids
    assert all(streamed)
    assert Counter(r.request_id for call in streamed for r in call) == Counter(ids)
    by_id = {r.request_id: r for r in results}
    for result in (r for call in streamed for r in call):
        assert result.response_ids == by_id[result.request_id].response_ids
        assert len(result.response_ids) == len(result.logprobs) == len(result.versions)


def test_finish_reasons_length_at_max_new_tokens_and_stop_at_eos(
    engine: Engine, policy, eos
) -> None:
    """EOS takes the embedding of prompt a's first greedy token, scaled 1.5: wherever that token
    led with a positive logit, EOS now leads. Prompt a stops at once, others run on."""
    weights = weights_of(policy)
    embedding = weights["model.embed_tokens.weight"]
    embedding[eos] = 1.5 * embedding[greedy_reference(policy, PROMPTS["a"], 1, eos)[0]]
    reference = with_weights(policy, weights)
    max_new = 4
    expected = {rid: greedy_reference(reference, PROMPTS[rid], max_new, eos) for rid in PROMPTS}
    assert expected["a"] == [eos]
    assert any(eos not in ids for ids in expected.values())

    engine.load_weights(engine.version + 1, weights)
    results = engine.generate(requests(*PROMPTS), SamplingParams(max_new, temperature=0.0))
    for result in results:
        assert result.response_ids == expected[result.request_id]
        if eos in result.response_ids:
            assert result.finish_reason == "stop"
            assert result.response_ids.index(eos) == len(result.response_ids) - 1
        else:
            assert result.finish_reason == "length"
            assert len(result.response_ids) == max_new


def test_samples_follow_the_seed_and_request_id_not_the_batch(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)
    alone = engine.generate(requests("c"), params)[0]
    batched = {r.request_id: r for r in engine.generate(requests("a", "c", "d"), params)}
    again = {r.request_id: r for r in engine.generate(requests("d", "b", "c", "a"), params)}
    assert batched["c"].response_ids == alone.response_ids == again["c"].response_ids
    assert batched["a"].response_ids == again["a"].response_ids
    assert batched["a"].logprobs == pytest.approx(again["a"].logprobs, abs=LOGPROB_TOLERANCE)
    # Other request ids (the samples of one group) or another seed: other samples.
    group = engine.generate(requests(*(f"c/{i}" for i in range(6))), params)
    assert len({tuple(r.response_ids) for r in group}) == len(group)
    other_seed = engine.generate(requests("c"), SamplingParams(8, 1.0, seed=1))[0]
    assert other_seed.response_ids != alone.response_ids


def kept_by_hand(logits: list[float], top_p: float, top_k: int, min_p: float) -> list[int]:
    """The tokens one truncation control keeps (the suite turns on one at a time, where every
    engine's order of applying them agrees)."""
    probs = torch.tensor(logits, dtype=torch.float64).softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k:
        return order[:top_k]
    if min_p:
        return [i for i in order if probs[i] >= min_p * probs[order[0]]]
    kept, above = [], 0.0
    for i in order:  # a token stays while the more likely ones hold less than p
        if above >= top_p:
            break
        kept.append(i)
        above += probs[i]
    return kept


@pytest.mark.parametrize(
    "control", [{"top_p": 0.8}, {"top_k": 3}, {"min_p": 0.1}], ids=["top_p", "top_k", "min_p"]
)
def test_truncated_sampling_records_the_truncated_distributions_logprobs(
    engine: Engine, policy, control: dict
) -> None:
    temperature = 0.9
    params = SamplingParams(8, temperature, seed=5, **control)
    results = engine.generate(requests(*(f"{p}/{i}" for p in PROMPTS for i in range(3))), params)
    num_cut = 0
    for result in results:
        prompt = PROMPTS[result.request_id.split("/")[0]]
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([prompt + result.response_ids])).logits[0]
        scaled = logits.double() / temperature
        full = scaled.log_softmax(-1)
        for t, (token, recorded) in enumerate(
            zip(result.response_ids, result.logprobs, strict=True)
        ):
            position = len(prompt) - 1 + t
            kept = kept_by_hand(
                scaled[position].tolist(), **{"top_p": 1.0, "top_k": 0, "min_p": 0.0, **control}
            )
            assert token in kept, (result.request_id, t)
            truncated = full[position, token] - full[position, kept].logsumexp(-1)
            assert recorded == pytest.approx(float(truncated), abs=LOGPROB_TOLERANCE)
            num_cut += len(kept) < full.shape[-1] and recorded > full[position, token] + 1e-3
    assert num_cut > 0  # the truncated log-prob differs from the full one somewhere


def test_stop_token_ids_and_stop_strings_end_the_response(engine: Engine, model_dir) -> None:
    tokenizer = load_tokenizer(model_dir)
    ids = [f"{p}/{i}" for p in PROMPTS for i in range(2)]
    free = engine.generate(requests(*ids), SamplingParams(10, 1.0, seed=6))
    assert all(r.finish_reason == "length" for r in free)
    stop_id = free[0].response_ids[2]
    # Two characters drawn by some response, not special tokens: a string across two tokens.
    specials = set(tokenizer.all_special_ids)
    pair = next(
        r.response_ids[i : i + 2]
        for r in free[1:]
        for i in range(1, 8)
        if not specials & set(r.response_ids[i : i + 2])
    )
    text = tokenizer.decode(pair)
    for params in (
        SamplingParams(10, 1.0, seed=6, stop_token_ids=(stop_id,)),
        SamplingParams(10, 1.0, seed=6, stop=(text,)),
    ):
        stopped = engine.generate(requests(*ids), params)
        num_stopped = 0
        for before, after in zip(free, stopped, strict=True):
            if params.stop_token_ids:
                cut = next((i + 1 for i, t in enumerate(before.response_ids) if t == stop_id), None)
            else:
                cut = next(
                    (
                        n
                        for n in range(1, 11)
                        if text
                        in tokenizer.decode(before.response_ids[:n], skip_special_tokens=True)
                    ),
                    None,
                )
            assert after.response_ids == before.response_ids[: cut or 10], params
            assert after.logprobs == pytest.approx(
                before.logprobs[: cut or 10], abs=LOGPROB_TOLERANCE
            )
            assert after.finish_reason == ("stop" if cut else "length")
            num_stopped += cut is not None
        assert num_stopped >= 1


def test_a_stop_string_split_by_an_inflight_update_still_ends_the_response(
    engine: Engine, subject: Subject, policy, updated, model_dir
) -> None:
    """vLLM and SGLang match stop strings within one request; a response resumed after an
    in-flight update is two requests to them. A string whose first character comes before the
    update and whose second after it must still end the response there."""
    tokenizer = load_tokenizer(model_dir)
    num_old, max_new = 3, 8
    greedy = SamplingParams(max_new_tokens=max_new, temperature=0.0)

    def generate_with_update(rid: str, params: SamplingParams) -> GenerationResult:
        engine.load_weights(engine.version + 1, weights_of(policy))
        ready, new_version = subject.update_after(num_old, 1), engine.version + 1
        deadline, served = time.monotonic() + WAIT_S, False

        def weight_poll():
            nonlocal served
            if served or not (ready() or time.monotonic() > deadline):
                return None
            served = True
            return new_version, weights_of(updated)

        result = engine.generate(requests(rid), params, weight_poll=weight_poll)[0]
        assert served
        return result

    specials = set(tokenizer.all_special_ids)
    for rid in PROMPTS:
        free = generate_with_update(rid, greedy)
        pair = free.response_ids[num_old - 1 : num_old + 1]  # the last old token, the first new
        text = tokenizer.decode(pair)
        if len(free.response_ids) < max_new or specials & set(pair):
            continue
        if text in tokenizer.decode(free.response_ids[:num_old], skip_special_tokens=True):
            continue
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop=(text,))
        stopped = generate_with_update(rid, params)
        assert stopped.response_ids == free.response_ids[: num_old + 1]
        assert stopped.finish_reason == "stop"
        assert len(stopped.logprobs) == len(stopped.versions) == num_old + 1
        return
    pytest.fail("no prompt's greedy response has two plain characters around the update")


@pytest.mark.timeout(120)  # an engine that hangs on bad input fails here, not after 600 s
@pytest.mark.parametrize("problem", ["empty", "negative", "vocabulary"])
def test_a_bad_prompt_is_refused_before_generating(
    engine: Engine, policy, eos, problem: str
) -> None:
    vocab_size = policy.config.vocab_size
    bad_prompt = {"empty": [], "negative": [2, -1, 3], "vocabulary": [2, 3, vocab_size]}[problem]
    batch = [GenerationRequest("fine", PROMPTS["a"]), GenerationRequest("bad-one", bad_prompt)]
    streamed: list[list[GenerationResult]] = []
    polls: list[int] = []
    with pytest.raises(ValueError) as raised:
        engine.generate(
            batch,
            SamplingParams(4, temperature=0.0),
            on_finished=streamed.append,
            weight_poll=lambda: polls.append(1),
        )
    assert "'bad-one'" in str(raised.value) and problem in str(raised.value), raised.value
    assert streamed == [] and polls == []  # nothing ran
    result = engine.generate(batch[:1], SamplingParams(4, temperature=0.0))[0]  # still works
    assert result.response_ids == greedy_reference(policy, PROMPTS["a"], 4, eos)


# -- SGLang only -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_an_sglang_server_refuses_ids_outside_the_vocabulary_itself(
    model_dir: Path, tmp_path: Path
) -> None:
    """An adapter that cannot read the vocabulary size (attached, no local model directory)
    leaves the check to the server, which answers 400 as SGLang does (the stand-in used to let
    the id reach the model, where it killed its scheduler and left the request hanging)."""
    from streamrl.config.schema import SglangConfig
    from streamrl.rollout.sglang_engine import SglangEngine, SglangError
    from tests.fakes.sglang_server import FakeSglangServer

    server = FakeSglangServer(model_dir, stop_on_model_eos=False).start()
    try:
        config = SglangConfig(url=server.url, weights_dir=str(tmp_path))
        engine = SglangEngine("not-a-local-model", eos_token_id=-1, config=config)
        assert engine.vocab_size is None
        with pytest.raises(SglangError, match=r"HTTP 400: .*outside the vocabulary"):
            engine.generate(requests("bad", prompts={"bad": [2, 10_000]}), SamplingParams(4))
        result = engine.generate(requests("a"), SamplingParams(4))[0]
        assert len(result.response_ids) == 4
    finally:
        server.stop()

"""Sampling controls (`streamrl.rollout.sampling`, the builtin engine): top-p, top-k and min-p keep
the tokens the rules written out by hand here keep; the builtin engine draws only kept tokens and
records their log-probs under the truncated, renormalised distribution (recomputed here from a
plain transformers forward, not from the engine's code); stop token ids and stop strings end a
response with the token that completes them; the defaults leave sampling exactly as it was."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.models.loading import load_causal_lm
from streamrl.models.tokenizer import build_tokenizer
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.rollout.sampling import StopStrings, cut_at_stop, truncate_logits

NO_EOS = -1


def kept_by_hand(logits: np.ndarray, top_p: float, top_k: int, min_p: float) -> set[int]:
    """The tokens min-p, then top-k, then top-p (over what is left, renormalised) keep."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    kept = [i for i in range(len(logits)) if probs[i] >= min_p * probs.max()]
    if top_k > 0:
        kth = sorted((logits[i] for i in kept), reverse=True)[:top_k][-1]
        kept = [i for i in kept if logits[i] >= kth]
    if top_p < 1.0:
        mass = sum(probs[i] for i in kept)
        ordered = sorted(kept, key=lambda i: -probs[i])
        chosen, above = [], 0.0
        for i in ordered:  # a token stays while the more likely ones have not reached p
            if above < top_p:
                chosen.append(i)
            above += probs[i] / mass
        kept = chosen
    return set(kept)


@pytest.mark.parametrize(
    "top_p, top_k, min_p",
    [(0.9, 0, 0.0), (0.5, 0, 0.0), (1.0, 5, 0.0), (1.0, 0, 0.1), (0.8, 7, 0.02)],
)
def test_truncation_keeps_what_the_rules_keep(top_p: float, top_k: int, min_p: float) -> None:
    generator = torch.Generator().manual_seed(0)
    logits_bv = 2.0 * torch.randn((6, 40), generator=generator)
    params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, min_p=min_p)
    truncated_bv = truncate_logits(logits_bv, params)
    for row, out in zip(logits_bv.numpy(), truncated_bv, strict=True):
        kept = set(torch.isfinite(out).nonzero().flatten().tolist())
        assert kept == kept_by_hand(row.astype(np.float64), top_p, top_k, min_p)
        assert 0 < len(kept) < 40
        assert torch.equal(out[list(kept)], torch.from_numpy(row)[list(kept)])  # values kept


def test_the_defaults_truncate_nothing() -> None:
    params = SamplingParams()
    assert not params.truncated
    logits_bv = torch.randn((3, 20))
    assert truncate_logits(logits_bv, params) is logits_bv


def test_builtin_samples_kept_tokens_and_records_truncated_logprobs(
    model_dir: Path, prompts
) -> None:
    """Every sampled token lies in the kept set of the hand-made rule, over the logits of a plain
    transformers forward at its position, and its recorded log-prob is log(p / kept mass) of the
    temperature-scaled distribution; the full distribution's log-prob is lower wherever
    something was cut."""
    model = load_causal_lm(model_dir)
    engine = BuiltinEngine(model, eos_token_id=NO_EOS, pad_token_id=0)
    temperature, top_p = 0.8, 0.9
    params = SamplingParams(max_new_tokens=10, temperature=temperature, seed=1, top_p=top_p)
    results = engine.generate([GenerationRequest(k, v) for k, v in prompts.items()], params)
    num_cut = 0
    for result in results:
        ids = prompts[result.request_id] + result.response_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double() / temperature
        start = len(prompts[result.request_id]) - 1
        for t, (token, recorded) in enumerate(
            zip(result.response_ids, result.logprobs, strict=True)
        ):
            row = logits[start + t].numpy()
            kept = kept_by_hand(row, top_p, 0, 0.0)
            assert token in kept
            full = row - np.log(np.exp(row - row.max()).sum()) - row.max()
            mass = sum(math.exp(full[i]) for i in kept)
            assert recorded == pytest.approx(full[token] - math.log(mass), abs=1e-4)
            if len(kept) < len(row):
                num_cut += 1
                assert recorded > full[token] + 1e-6
    assert num_cut > 0  # top-p cut something: the check compared two different numbers


def test_default_params_sample_what_they_did_before(model_dir: Path, prompts) -> None:
    """Controls at their defaults are the untruncated path: the same tokens and log-probs as
    top-p 1.0 written out (and as sampling without `params`, the old call)."""
    engine = BuiltinEngine(load_causal_lm(model_dir), eos_token_id=NO_EOS, pad_token_id=0)
    requests = [GenerationRequest(k, v) for k, v in prompts.items()]
    plain = engine.generate(requests, SamplingParams(8, 1.0, seed=4))
    explicit = engine.generate(
        requests, SamplingParams(8, 1.0, seed=4, top_p=1.0, top_k=0, min_p=0.0)
    )
    assert [r.response_ids for r in plain] == [r.response_ids for r in explicit]
    assert [r.logprobs for r in plain] == [r.logprobs for r in explicit]
    cut = engine.generate(requests, SamplingParams(8, 1.0, seed=4, top_k=2))
    assert [r.logprobs for r in cut] != [r.logprobs for r in plain]


def test_builtin_stops_at_stop_token_ids_and_stop_strings(model_dir: Path, prompts) -> None:
    tokenizer = build_tokenizer()
    engine = BuiltinEngine(
        load_causal_lm(model_dir), eos_token_id=NO_EOS, pad_token_id=0, tokenizer=tokenizer
    )
    requests = [GenerationRequest(f"{k}/{i}", v) for k, v in prompts.items() for i in range(4)]
    free = engine.generate(requests, SamplingParams(12, 1.0, seed=2))
    assert all(r.finish_reason == "length" for r in free)
    # A stop token: the first token the first response drew after its first one.
    stop_id = free[0].response_ids[1]
    by_id = engine.generate(requests, SamplingParams(12, 1.0, seed=2, stop_token_ids=(stop_id,)))
    # A stop string: two characters a response drew (spanning two tokens; no special tokens).
    ids = next(
        r.response_ids[i : i + 2]
        for r in free[1:]
        for i in range(1, 10)
        if min(r.response_ids[i : i + 2]) >= len(tokenizer.all_special_ids)
    )
    text = tokenizer.decode(ids)
    assert len(text) == 2
    by_text = engine.generate(requests, SamplingParams(12, 1.0, seed=2, stop=(text,)))
    stops = StopStrings(tokenizer, [text])
    num_stopped = 0
    for before, after_id, after_text in zip(free, by_id, by_text, strict=True):
        # Sampling is causal: each stopped response is a prefix of the free one, cut right after
        # the stop; log-probs of the kept tokens are unchanged.
        for after, params in ((after_id, SamplingParams(12, stop_token_ids=(stop_id,))),):
            cut = cut_at_stop(before.response_ids, params, None, None)
            assert after.response_ids == before.response_ids[: cut or 12]
            assert after.finish_reason == ("stop" if cut else "length")
        cut = stops.first_stop(before.response_ids)
        assert after_text.response_ids == before.response_ids[: cut or 12]
        assert after_text.logprobs == before.logprobs[: cut or 12]
        assert after_text.finish_reason == ("stop" if cut else "length")
        if cut:
            shown = tokenizer.decode(after_text.response_ids)
            assert shown.endswith(text) or text in shown[-len(text) - 1 :]
            assert text not in tokenizer.decode(after_text.response_ids[:-1])
            num_stopped += 1
    assert num_stopped >= 1 and by_id[0].finish_reason == "stop"


def test_stop_strings_without_a_tokenizer_are_refused(model_dir: Path, prompts) -> None:
    engine = BuiltinEngine(load_causal_lm(model_dir), eos_token_id=NO_EOS, pad_token_id=0)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([GenerationRequest("a", prompts["a"])], SamplingParams(4, stop=("x",)))

"""vLLM on the built-in tiny Qwen3-MoE (CPU build): weight updates reach the experts (vLLM's own
reload would repack the CPU kernel's packed experts a second time), and routing capture records
per request and position the experts vLLM routed to, which the trainer replays exactly: fp32
log-probs agree with and without replay, also for tokens sampled after an in-flight update, in
process and with the engine core in a process of its own.

Needs vLLM (`make install-vllm`); skipped without it unless STREAMRL_REQUIRE_VLLM=1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.config.schema import VllmConfig
from streamrl.models.loading import load_causal_lm
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.models.tokenizer import build_tokenizer
from tests.unit.test_moe import engine_rows, replay_gaps
from tests.vllm_required import skip_module_without_vllm

skip_module_without_vllm()

from streamrl.rollout.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow

NUM_LAYERS = 2
NO_EOS = 10**6  # every response runs its full length


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe")
    # head_dim 32: vLLM's CPU attention kernels want head sizes that are multiples of 16.
    return build_tiny_model_dir(
        out, hidden_size=64, num_layers=NUM_LAYERS, num_heads=2, seed=0, num_experts=8
    )


def _engine(moe_dir: Path, **config) -> VllmEngine:
    return VllmEngine(
        moe_dir,
        eos_token_id=NO_EOS,
        config=VllmConfig(kv_cache_gib=0.25, **config),
        max_num_seqs=64,
        capture_routes=True,
    )


@pytest.fixture(scope="module")
def engine(moe_dir: Path):
    engine = _engine(moe_dir)
    yield engine
    engine.close()


def _requests(tag: str) -> list[GenerationRequest]:
    tokenizer = build_tokenizer()
    prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "7+5=", "123+4567=")]
    return [GenerationRequest(f"{tag}-{i}", prompts[i % 3]) for i in range(12)]


def _perturbed(moe_dir: Path, scale: float):
    model = load_causal_lm(moe_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def test_routes_recorded_and_replayed_with_fp32_logprobs_agreeing(engine, moe_dir: Path) -> None:
    requests = _requests("a")
    rows = engine_rows(
        requests, engine.generate(requests, SamplingParams(max_new_tokens=8, seed=1))
    )
    for q, r in zip(requests, rows, strict=True):
        assert r[F.ROUTED_EXPERTS].shape == (len(q.prompt_ids) + 7, NUM_LAYERS, 2)
    model = load_causal_lm(moe_dir)
    for replay in (False, True):
        gaps, record = replay_gaps(model, rows, replay)
        assert np.concatenate(gaps).mean() <= 1e-5
    assert record.compared > 0 and record.agreed == record.compared


def test_updated_weights_reach_the_experts(engine, moe_dir: Path) -> None:
    """Every parameter changes (experts, routers, attention); vLLM's log-probs follow exactly."""
    model = _perturbed(moe_dir, 0.1)
    engine.load_weights(engine.version + 1, {n: p.detach() for n, p in model.named_parameters()})
    requests = _requests("b")
    rows = engine_rows(
        requests, engine.generate(requests, SamplingParams(max_new_tokens=8, seed=2))
    )
    gaps, _ = replay_gaps(model, rows, replay=True)
    assert np.concatenate(gaps).mean() <= 1e-5
    original = load_causal_lm(moe_dir)  # back to the initial weights for the other tests
    engine.load_weights(engine.version + 1, {n: p.detach() for n, p in original.named_parameters()})


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "engine-process"])
def test_routes_across_an_inflight_update_are_the_new_weights(
    engine, moe_dir: Path, in_process: bool
) -> None:
    """After the update every running request is resumed as a continuation whose prefill runs
    the whole sequence under the new weights: the routes kept are those (the ones the later
    tokens were computed over), and the new tokens' log-probs agree under replay."""
    generator = engine if in_process else _engine(moe_dir, in_process=False)
    continued = generator.num_continuations
    try:
        start = generator.version
        new = _perturbed(moe_dir, 0.1)
        update = (start + 1, {n: p.detach() for n, p in new.named_parameters()})
        polls = iter([None, None, update])
        requests = _requests(f"c{int(in_process)}")
        results = generator.generate(
            requests,
            SamplingParams(max_new_tokens=8, seed=3),
            weight_poll=lambda: next(polls, None),
        )
        continued = generator.num_continuations - continued
    finally:
        if not in_process:
            generator.close()
    rows = engine_rows(requests, results)
    # Every request still running at the update ran on as a continuation (vLLM ends a response
    # at the tokenizer's EOS itself: one may have finished before).
    resumed = [r for r in results if start + 1 in r.versions]
    assert continued == len(resumed) >= len(requests) // 2
    assert all(r.versions[0] == start for r in results)
    rows = [row for row, r in zip(rows, results, strict=True) if r in resumed]
    gaps, record = replay_gaps(new, rows, replay=True)
    after = [g[np.asarray(r.versions) == start + 1] for g, r in zip(gaps, resumed, strict=True)]
    assert np.concatenate(after).mean() <= 1e-5
    assert record.agreed == record.compared  # the new weights' own routing, every position
    if in_process:
        original = load_causal_lm(moe_dir)
        engine.load_weights(start + 2, {n: p.detach() for n, p in original.named_parameters()})


def test_a_dense_model_is_refused_for_capture(tmp_path: Path) -> None:
    dense = build_tiny_model_dir(
        tmp_path / "dense", hidden_size=64, num_layers=1, num_heads=2, seed=0
    )
    with pytest.raises(TypeError, match="no mixture-of-experts layer"):
        _engine(dense)

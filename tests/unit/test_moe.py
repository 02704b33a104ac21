"""Mixture-of-experts models and rollout routing replay (R3).

The builtin engine runs the built-in Qwen3-MoE and records, per position and layer, the experts
it routed to; the trainer's forward replays exactly those (also for tokens produced across an
in-flight weight update, whose routes come from the version that produced them), the router
still receiving its gradient; fp32 engine and trainer log-probs agree with and without replay.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.config.schema import Config
from streamrl.models import moe
from streamrl.models.loading import load_causal_lm
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.rollout.service import result_fields
from streamrl.trainer.algos.objective import LossSettings
from streamrl.trainer.learner import Learner, detached_logprobs
from streamrl.trainer.logprobs import pack, response_logprobs

NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe")
    return build_tiny_model_dir(
        out,
        hidden_size=64,
        num_layers=NUM_LAYERS,
        num_heads=4,
        seed=0,
        num_experts=NUM_EXPERTS,
        experts_per_token=TOP_K,
    )


def _engine(model, capture: bool = True) -> BuiltinEngine:
    # An EOS id the model cannot draw: every response runs its full length.
    return BuiltinEngine(model, eos_token_id=10**6, pad_token_id=0, capture_routes=capture)


def _requests(prompts) -> list[GenerationRequest]:
    return [GenerationRequest(f"{rid}-{k}", ids) for rid, ids in prompts.items() for k in range(4)]


def engine_rows(requests, results) -> list[dict]:
    """The bus rows an engine's `results` for `requests` become (routes included)."""
    return [
        {"sample_id": q.request_id, F.PROMPT_IDS: q.prompt_ids, **result_fields(r)}
        for q, r in zip(requests, results, strict=True)
    ]


def replay_gaps(model, rows, replay: bool) -> tuple[list[np.ndarray], moe.RoutingRecord]:
    """Per row |trainer - engine| log-prob of each response token, the trainer's forward given
    the rows' routes (`replay`) or routing by itself; and what its routers did."""
    if not replay:
        rows = [{k: v for k, v in r.items() if k != F.ROUTED_EXPERTS} for r in rows]
    with moe.recording(model) as record:
        logprobs = _trainer_logprobs(model, rows)
    gaps = [np.abs(lp - r[F.ROLLOUT_LOGPROBS]) for r, lp in zip(rows, logprobs, strict=True)]
    return gaps, record


def _gap(rows, logprobs) -> np.ndarray:
    return np.concatenate(
        [np.abs(lp - r[F.ROLLOUT_LOGPROBS]) for r, lp in zip(rows, logprobs, strict=True)]
    )


def _trainer_logprobs(model, rows, padding_free: bool = False) -> list[np.ndarray]:
    return detached_logprobs(
        model, rows, pad_token_id=0, temperature=1.0, padding_free=padding_free
    )


def test_route_replays_given_experts_with_the_routers_probabilities() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]], requires_grad=True)
    forced = torch.tensor([[3, 2], [moe.NO_ROUTE, moe.NO_ROUTE]])
    weights, experts, native = moe.route(logits, 2, True, forced)
    assert experts.tolist() == [[3, 2], [1, 3]]  # row 1: none given, the router's own top 2
    assert native.tolist() == [[0, 1], [1, 3]]
    probs = torch.softmax(logits.detach(), -1)
    expected = probs[0, [3, 2]] / probs[0, [3, 2]].sum()
    torch.testing.assert_close(weights[0], expected)
    weights[0, 0].backward()  # the replayed weight still depends on every router logit
    assert bool((logits.grad[0] != 0).all())


def test_engine_records_a_route_for_every_position_it_ran(moe_dir: Path, prompts) -> None:
    engine = _engine(load_causal_lm(moe_dir))
    requests = _requests(prompts)
    results = engine.generate(requests, SamplingParams(max_new_tokens=8, seed=1))
    for q, r in zip(requests, results, strict=True):
        routes = r.extra[F.ROUTED_EXPERTS]
        assert routes.dtype == np.uint8
        assert routes.shape == (len(q.prompt_ids) + len(r.response_ids) - 1, NUM_LAYERS, TOP_K)
        assert int(routes.max()) < NUM_EXPERTS
        assert all(len(set(k)) == TOP_K for k in routes.reshape(-1, TOP_K).tolist())
    assert F.ROUTED_EXPERTS in result_fields(results[0])
    plain = _engine(load_causal_lm(moe_dir), capture=False)
    assert F.ROUTED_EXPERTS not in plain.generate(requests[:1], SamplingParams())[0].extra


@pytest.mark.parametrize("padding_free", [False, True])
def test_fp32_engine_and_trainer_agree_with_and_without_replay(
    moe_dir: Path, prompts, padding_free: bool
) -> None:
    engine = _engine(load_causal_lm(moe_dir))
    requests = _requests(prompts)
    rows = engine_rows(
        requests, engine.generate(requests, SamplingParams(max_new_tokens=12, seed=2))
    )
    trainer = load_causal_lm(moe_dir)
    plain = [{k: v for k, v in r.items() if k != F.ROUTED_EXPERTS} for r in rows]
    assert _gap(plain, _trainer_logprobs(trainer, plain, padding_free)).mean() <= 1e-5
    with moe.recording(trainer) as record:
        replayed = _trainer_logprobs(trainer, rows, padding_free)
    assert _gap(rows, replayed).mean() <= 1e-5
    assert record.compared > 0  # fp32, same weights: the router agrees with the engine
    assert record.agreed == record.compared


def _used_experts(record: moe.RoutingRecord, layer: int) -> torch.Tensor:
    return torch.cat(record.experts[layer])[record.valid_tokens()]


def test_trainer_uses_exactly_the_engines_experts_across_a_weight_update(
    moe_dir: Path, prompts
) -> None:
    """The engine takes new weights after 3 tokens and computes its running sequences again
    under them: the routes kept are the new weights' for every position (those the later tokens
    were computed over), the trainer with the new weights replays exactly them, and the
    log-probs of the tokens sampled after the update agree."""
    old, new = load_causal_lm(moe_dir), load_causal_lm(moe_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    updated = {n: p.detach().clone() for n, p in new.named_parameters()}
    engine = _engine(old)
    polls = iter([None, None, (1, updated)])
    requests = _requests(prompts)
    results = engine.generate(
        requests,
        SamplingParams(max_new_tokens=10, seed=3),
        weight_poll=lambda: next(polls, None),
    )
    rows = engine_rows(requests, results)
    assert all(r.versions[:3] == [0, 0, 0] and r.versions[3:] == [1] * 7 for r in results)
    plain = [{k: v for k, v in r.items() if k != F.ROUTED_EXPERTS} for r in rows]
    with moe.recording(new) as native:
        _trainer_logprobs(new, plain)
    with moe.recording(new) as replayed:
        logprobs = _trainer_logprobs(new, rows)
    for layer in range(NUM_LAYERS):
        used = _used_experts(replayed, layer)
        own = _used_experts(native, layer)
        offset = 0
        for r in rows:  # per row every position but the last (the engine never ran it)
            n = len(r[F.ROUTED_EXPERTS])
            expected = torch.from_numpy(r[F.ROUTED_EXPERTS][:, layer].astype(np.int64))
            assert torch.equal(used[offset : offset + n], expected)
            assert torch.equal(own[offset : offset + n].sort(-1).values, expected.sort(-1).values)
            offset += n + 1
        assert offset == len(used)
    after = [lp[3:] - r[F.ROLLOUT_LOGPROBS][3:] for r, lp in zip(rows, logprobs, strict=True)]
    assert np.abs(np.concatenate(after)).mean() <= 1e-5


def test_without_routes_a_row_is_routed_by_the_trainer(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)
    batch = pack([[5, 6, 7]], [[8, 9]], 0)
    with moe.recording(model) as record:
        response_logprobs(model, batch)
    assert record.compared == 0 and len(record.experts) == NUM_LAYERS


def test_gradients_reach_the_router_under_replay(moe_dir: Path, prompts) -> None:
    engine = _engine(load_causal_lm(moe_dir))
    requests = _requests(prompts)[:4]
    rows = engine_rows(
        requests, engine.generate(requests, SamplingParams(max_new_tokens=6, seed=4))
    )
    model = load_causal_lm(moe_dir).train()
    routes = [r[F.ROUTED_EXPERTS] for r in rows]
    batch = pack([r[F.PROMPT_IDS] for r in rows], [r[F.RESPONSE_IDS] for r in rows], 0, routes)
    response_logprobs(model, batch).sum().backward()
    routers = moe.find_routers(model)
    assert len(routers) == NUM_LAYERS
    for router in routers:
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0


def test_learner_logs_router_loss_loads_and_replay_agreement(moe_dir: Path, prompts) -> None:
    engine = _engine(load_causal_lm(moe_dir))
    requests = _requests(prompts)
    rows = engine_rows(
        requests, engine.generate(requests, SamplingParams(max_new_tokens=6, seed=5))
    )
    for k, r in enumerate(rows):
        r["advantages"] = 1.0 if k % 2 else -1.0
    settings = LossSettings.of(Config().algorithm, 16)
    learners = {}
    for coef in (0.0, 1.0):
        torch.manual_seed(0)
        learner = Learner(
            load_causal_lm(moe_dir),
            pad_token_id=0,
            lr=1e-3,
            weight_decay=0.0,
            grad_clip=None,
            temperature=1.0,
            settings=settings,
            router_aux_loss_coef=coef,
        )
        learner.accumulate(rows)
        learners[coef] = (learner, learner.step())
    out = learners[0.0][1]
    assert out["moe/aux_loss"] >= 1.0  # E * sum f_e P_e is at least 1
    loads = [out[f"moe/expert_load_max/l{i}"] for i in range(NUM_LAYERS)]
    assert all(1.0 <= x <= NUM_EXPERTS for x in loads)
    assert out["moe/replay_agreement"] == pytest.approx(1.0)
    # The router loss trains the router: its weights move differently with the loss on.
    r0 = moe.find_routers(learners[0.0][0].model)[0].weight
    r1 = moe.find_routers(learners[1.0][0].model)[0].weight
    assert not torch.allclose(r0, r1)


def test_replay_refused_for_a_dense_model(model_dir: Path) -> None:
    model = load_causal_lm(model_dir)
    batch = pack([[5, 6]], [[7]], 0, [np.zeros((2, 1, 2), np.uint8)])
    with pytest.raises(TypeError, match="no mixture-of-experts router"):
        response_logprobs(model, batch)
    with pytest.raises(TypeError, match="no mixture-of-experts layer"):
        BuiltinEngine(model, eos_token_id=1, pad_token_id=0, capture_routes=True)
    with pytest.raises(ValueError, match="up to 256 experts"):  # more than uint8 routes hold
        moe.check_routable(384)
    moe.check_routable(256)


def test_config_refuses_replay_without_experts_or_with_another_engine() -> None:
    with pytest.raises(ValueError, match="model.num_experts"):
        Config.model_validate({"algorithm": {"routing_replay": "rollout"}})
    with pytest.raises(ValueError, match="SGLang engines capture routing"):
        Config.model_validate(
            {
                "model": {"num_experts": 4},
                "algorithm": {"routing_replay": "rollout"},
                "rollout": {"engine": "my_engine"},
                "run": {"plugins": ["my_plugin"]},
            }
        )
    for engine in ("vllm", "sglang"):
        Config.model_validate(
            {
                "model": {"num_experts": 4},
                "algorithm": {"routing_replay": "rollout"},
                "rollout": {"engine": engine},
            }
        )
    with pytest.raises(ValueError, match="experts_per_token"):
        Config.model_validate({"model": {"num_experts": 2, "experts_per_token": 3}})
    Config.model_validate({"model": {"num_experts": 4}, "algorithm": {"routing_replay": "rollout"}})
    # YAML reads a bare `off` as false.
    assert (
        Config.model_validate({"algorithm": {"routing_replay": False}}).algorithm.routing_replay
        == "off"
    )


def test_an_episodes_routes_come_from_the_latest_turn_that_ran_each_position() -> None:
    """Turn 1 runs the prompt (3 tokens) and feeds 1 of its 2 tokens; turn 2 runs everything
    so far (prompt, turn 1, the tool's 2 tokens) and feeds 2 of its 3: the segment's routes
    are turn 2's over all 8 positions it ran (turn 1's positions recomputed)."""
    from streamrl.agents.ledger import TokenLedger, segment_fields

    def routes(n: int, value: int) -> np.ndarray:
        return np.full((n, NUM_LAYERS, TOP_K), value, dtype=np.uint8)

    ledger = TokenLedger([5, 6, 7])
    ledger.add_sampled([8, 9], [-0.1, -0.2], [0, 0], routes(4, 1))
    assert ledger.current.routes.shape[0] == 4  # prompt + the first sampled token
    ledger.add_context([10, 11])
    ledger.add_sampled([12, 13, 14], [-0.3] * 3, [1] * 3, routes(9, 2)[:9])
    fields = segment_fields(ledger.current)
    got = fields[F.ROUTED_EXPERTS]
    assert got.shape == (3 + 7 - 1, NUM_LAYERS, TOP_K)
    assert (got == 2).all()
    # A pass that ran fewer positions than are known updates only those.
    assert (moe.merge_routes(routes(5, 1), routes(3, 2))[:, 0, 0] == [2, 2, 2, 1, 1]).all()
    assert moe.merge_routes(None, routes(2, 1)).shape[0] == 2

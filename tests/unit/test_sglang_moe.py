"""Routing capture through the SGLang engine, against the stand-in server
(`tests/fakes/sglang_server.py`, which answers `return_routed_experts` in SGLang's format:
base64 of int32 `[prompt + output tokens - 1, layers, top k]`, and only when started with
`--enable-return-routed-experts`):

- every result carries uint8 routes of every position but the last token's, the trainer's own
  routing agrees with them, and fp32 log-probs agree with and without replay;
- across an in-flight update the routes kept are the continuation's (the new weights'), and the
  tokens sampled after it agree under replay;
- the launched server is asked for routes, `algorithm.routing_replay=rollout` wires it up, and a
  server that sends none is a clear error;
- the layout: only the layers with a router, any of SGLang's wire widths, malformed payloads
  refused.

These check the adapter's side of SGLang's documented format; no real SGLang server ran here.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.api.run import RunContext
from streamrl.config.loader import load_config
from streamrl.config.schema import SglangConfig
from streamrl.models.loading import load_causal_lm
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.rollout.engines import make_engine
from streamrl.rollout.sglang_engine import SglangEngine, SglangError
from streamrl.rollout.sglang_routes import RoutingLayout
from tests.unit.test_moe import engine_rows, replay_gaps
from tests.unit.test_sglang_engine import FAKE_SERVER, NO_EOS, FakeSglangServer, perturbed

NUM_LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe")
    return build_tiny_model_dir(
        out, hidden_size=32, num_layers=NUM_LAYERS, num_heads=2, seed=0, num_experts=8
    )


def _attach(server, moe_dir: Path, tmp_path: Path, **kwargs) -> SglangEngine:
    config = SglangConfig(url=server.url, weights_dir=str(tmp_path / "weights"))
    return SglangEngine(moe_dir, eos_token_id=NO_EOS, config=config, capture_routes=True, **kwargs)


def _requests(prompts: dict[str, list[int]], tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{rid}", ids) for rid, ids in prompts.items()]


def test_routes_recorded_and_replayed_with_fp32_logprobs_agreeing(moe_dir, prompts, tmp_path):
    server = FakeSglangServer(
        moe_dir, stop_on_model_eos=False, enable_return_routed_experts=True
    ).start()
    try:
        engine = _attach(server, moe_dir, tmp_path)
        requests = _requests(prompts, "a")
        results = engine.generate(requests, SamplingParams(max_new_tokens=6, seed=1))
    finally:
        server.stop()
    rows = engine_rows(requests, results)
    for q, r in zip(requests, rows, strict=True):
        routes = r[F.ROUTED_EXPERTS]
        assert routes.dtype == np.uint8 and routes.shape == (len(q.prompt_ids) + 5, NUM_LAYERS, 2)
    model = load_causal_lm(moe_dir)
    for replay in (False, True):
        gaps, record = replay_gaps(model, rows, replay)
        assert np.concatenate(gaps).max() <= 1e-5
    assert record.compared > 0 and record.agreed == record.compared


def test_routes_across_an_inflight_update_are_the_new_weights(moe_dir, prompts, tmp_path):
    # Every request stops after 3 tokens until the weights change: the update lands mid-way.
    server = FakeSglangServer(
        moe_dir, stop_on_model_eos=False, hold_at_tokens=3, enable_return_routed_experts=True
    ).start()
    model = load_causal_lm(moe_dir)
    new_weights = perturbed(model, seed=1)
    served = False

    def weight_poll():
        nonlocal served
        if served or server.progress() != [3] * len(prompts):
            return None
        served = True
        return 1, new_weights

    try:
        engine = _attach(server, moe_dir, tmp_path, poll_s=0.005)
        requests = _requests(prompts, "b")
        results = engine.generate(
            requests, SamplingParams(max_new_tokens=8, seed=2), weight_poll=weight_poll
        )
    finally:
        server.stop()
    assert served and engine.num_continuations == len(prompts)
    new_model = load_causal_lm(moe_dir)
    new_model.load_state_dict(new_weights, strict=False)
    rows = engine_rows(requests, results)
    # The continuation ran every position again under the new weights: its routes are kept,
    # those the new weights' router chooses itself, which the old weights' would not all be.
    _, old = replay_gaps(model, rows, replay=True)
    assert old.agreed < old.compared
    gaps, new = replay_gaps(new_model, rows, replay=True)
    assert new.compared > 0 and new.agreed == new.compared
    after = [g[np.asarray(r.versions) == 1] for g, r in zip(gaps, results, strict=True)]
    assert all(len(a) == 5 for a in after)
    assert np.concatenate(after).max() <= 1e-5


def test_a_server_without_routing_capture_is_a_clear_error(moe_dir, prompts, tmp_path):
    server = FakeSglangServer(moe_dir, stop_on_model_eos=False).start()
    try:
        engine = _attach(server, moe_dir, tmp_path)
        with pytest.raises(SglangError, match="--enable-return-routed-experts"):
            engine.generate(_requests(prompts, "c"), SamplingParams(max_new_tokens=2))
    finally:
        server.stop()


def test_the_config_launches_a_server_that_returns_routes(moe_dir, prompts, tmp_path):
    cfg = load_config(
        [
            "rollout.engine=sglang",
            f"rollout.sglang.launch_cmd=[{sys.executable}, {FAKE_SERVER}]",
            "model.num_experts=8",
            "algorithm.routing_replay=rollout",
        ]
    )
    engine = make_engine(RunContext(cfg, moe_dir, tmp_path / "run", [], []))
    try:
        assert isinstance(engine, SglangEngine)
        log = (engine.weights_dir / "sglang_server.log").read_text()
        assert "--enable-return-routed-experts" in log
        requests = _requests(prompts, "d")
        results = engine.generate(requests, SamplingParams(max_new_tokens=3))
    finally:
        engine.close()
    for q, r in zip(requests, results, strict=True):
        assert r.extra[F.ROUTED_EXPERTS].shape == (len(q.prompt_ids) + 2, NUM_LAYERS, 2)


def _layout(tmp_path: Path, **config) -> RoutingLayout:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return RoutingLayout.of(tmp_path)


def test_the_layout_keeps_the_router_layers_and_reads_every_wire_width(tmp_path):
    layout = _layout(
        tmp_path,
        num_hidden_layers=4,
        num_experts=16,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )
    assert layout.moe_layers == (1, 2, 3)
    routes = np.arange(3 * 4 * 2).reshape(3, 4, 2) % 16
    for dtype in (np.int32, np.uint16, np.uint8):
        encoded = base64.b64encode(routes.astype(dtype).tobytes()).decode()
        got = layout.decode(encoded, 3, "url")
        assert got.dtype == np.uint8 and (got == routes[:, 1:]).all()
    with pytest.raises(SglangError, match="expected 2 positions"):
        layout.decode(base64.b64encode(routes.astype(np.int32).tobytes()).decode(), 2, "url")
    with pytest.raises(SglangError, match="outside"):
        layout.decode(base64.b64encode((routes + 16).astype(np.int32).tobytes()).decode(), 3, "u")
    deepseek = _layout(
        tmp_path,
        num_hidden_layers=4,
        n_routed_experts=64,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
    )
    assert deepseek.moe_layers == (1, 2, 3) and deepseek.num_experts == 64
    with pytest.raises(TypeError, match="no mixture-of-experts layer"):
        _layout(tmp_path, num_hidden_layers=2, num_experts_per_tok=1)


def test_an_aborted_attempt_may_come_back_without_routes(tmp_path):
    """Its continuation runs every position again, so only a finished attempt must carry them."""
    from types import SimpleNamespace

    from streamrl.rollout.sglang_engine import _parse_output

    layout = _layout(tmp_path, num_hidden_layers=1, num_experts=4, num_experts_per_tok=1)
    engine = SimpleNamespace(routing=layout, url="url", num_weight_updates=0)
    pairs = [[-0.5, 7, None], [-0.25, 8, None]]

    def response(reason: str) -> dict:
        return {"meta_info": {"output_token_logprobs": pairs, "finish_reason": {"type": reason}}}

    assert _parse_output(response("abort"), 0, engine, 3)[5] is None
    with pytest.raises(SglangError, match="--enable-return-routed-experts"):
        _parse_output(response("length"), 0, engine, 3)
    routes = np.array([[[1]], [[2]], [[3]], [[0]]], np.int32)  # 3 sent + 2 sampled - 1
    finished = response("length")
    finished["meta_info"]["routed_experts"] = base64.b64encode(routes.tobytes()).decode()
    assert _parse_output(finished, 0, engine, 3)[5].ravel().tolist() == [1, 2, 3, 0]

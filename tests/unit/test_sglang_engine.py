"""The SGLang engine against a stand-in server (`tests/fakes/sglang_server.py`) that speaks
SGLang's HTTP API and samples with the builtin engine: tokens and log-probs arrive intact and
match the builtin engine's and the trainer's on identical weights, seeds follow the request id,
weight updates go through safetensors snapshots or a torch.distributed broadcast (gloo here),
with the same result, an in-flight update pauses the server and
resumes requests as continuations stamped with the new version and drawn from the new weights,
and unreachable or failing servers give clear errors. The engine launches a server, or attaches.

These tests check the adapter's side of the protocol only; nothing here has met a real SGLang
server (see docs/engines.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams
from streamrl.api.run import RunContext
from streamrl.config.loader import load_config
from streamrl.config.schema import SglangConfig
from streamrl.models.loading import load_causal_lm
from streamrl.models.tokenizer import build_tokenizer
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.rollout.engines import make_engine
from streamrl.rollout.seeds import request_seed
from streamrl.rollout.sglang_client import free_port
from streamrl.rollout.sglang_engine import SglangEngine, SglangError
from streamrl.trainer.logprobs import pack, response_logprobs

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fakes" / "sglang_server.py"


def _load_fake():
    """tests/fakes/sglang_server.py by path: tests/unit is not a package, so pytest does not put
    the repository root on sys.path for it."""
    spec = importlib.util.spec_from_file_location("streamrl_test_fake_sglang", FAKE_SERVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building classes
    spec.loader.exec_module(module)
    return module


FakeSglangServer = _load_fake().FakeSglangServer
PAD_ID = 0
NO_EOS = -1  # never sampled: every response runs to max_new_tokens
LOGPROB_TOLERANCE = 1e-4  # same fp32 kernels on both sides; differences are batch-shape rounding


@pytest.fixture
def server(model_dir: Path):
    server = FakeSglangServer(model_dir, stop_on_model_eos=False).start()
    yield server
    server.stop()


def attach(
    server: FakeSglangServer, tmp_path: Path, *, weight_sync: str = "disk", **kwargs
) -> SglangEngine:
    """An engine attached to `server`; `kwargs` are the engine's own (besides the config)."""
    config = SglangConfig(
        url=server.url, weights_dir=str(tmp_path / "weights"), weight_sync=weight_sync
    )
    return SglangEngine(
        "unused-when-attaching",
        eos_token_id=kwargs.pop("eos_token_id", NO_EOS),
        config=config,
        **kwargs,
    )


def requests(prompts: dict[str, list[int]], *ids: str) -> list[GenerationRequest]:
    return [GenerationRequest(rid, prompts[rid]) for rid in ids]


def builtin_reference(model, prompt: list[int], seed_key: int, params: SamplingParams):
    """What the fake draws for one request: the builtin engine under request id str(seed)."""
    engine = BuiltinEngine(model, eos_token_id=NO_EOS, pad_token_id=PAD_ID)
    request = GenerationRequest(str(seed_key), prompt)
    return engine.generate([request], SamplingParams(params.max_new_tokens, params.temperature))[0]


def trainer_logprobs(model, prompts, results: list[GenerationResult], temperature: float):
    batch = pack([prompts[r.request_id] for r in results], [r.response_ids for r in results], 0)
    with torch.no_grad():
        return response_logprobs(model, batch, temperature=temperature)


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + 0.1 * torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
    }


def test_tokens_and_logprobs_match_the_builtin_engine_and_the_trainer(
    server, model_dir, prompts, tmp_path
) -> None:
    engine = attach(server, tmp_path)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=3)
    results = engine.generate(requests(prompts, "a", "b", "c", "d"), params)
    model = load_causal_lm(model_dir)
    for r in results:
        ref = builtin_reference(model, prompts[r.request_id], request_seed(3, r.request_id), params)
        assert r.response_ids == ref.response_ids
        assert r.logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_TOLERANCE)
        assert r.versions == [0] * 8 and r.finish_reason == "length"
    delta = trainer_logprobs(model, prompts, results, 0.7) - torch.tensor(
        [r.logprobs for r in results]
    )
    assert float(delta.abs().max()) <= LOGPROB_TOLERANCE
    # The seed follows the request id, not the batch: alone or in other company, same tokens.
    alone = engine.generate(requests(prompts, "c"), params)[0]
    assert alone.response_ids == results[2].response_ids
    other_seed = engine.generate(requests(prompts, "c"), SamplingParams(8, 0.7, seed=4))[0]
    assert other_seed.response_ids != alone.response_ids


def test_greedy_stops_at_eos(server, model_dir, prompts, tmp_path) -> None:
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first = attach(server, tmp_path).generate(requests(prompts, "a"), greedy)[0]
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompts["a"]])).logits[0, -1]
    assert first.response_ids[0] == int(logits.argmax())
    # Make the greedy first token the end-of-sequence token: the response stops there.
    stopping = attach(server, tmp_path, eos_token_id=first.response_ids[0])
    result = stopping.generate(requests(prompts, "a"), greedy)[0]
    assert result.response_ids == first.response_ids[:1]
    assert result.finish_reason == "stop"


def test_results_stream_once_each_with_a_concurrency_cap(server, prompts, tmp_path) -> None:
    engine = attach(server, tmp_path, max_running_requests=2)
    streamed: list[str] = []
    results = engine.generate(
        requests(prompts, "d", "b", "a", "c"),
        SamplingParams(max_new_tokens=3),
        on_finished=lambda batch: streamed.extend(r.request_id for r in batch),
    )
    assert [r.request_id for r in results] == ["d", "b", "a", "c"]
    assert sorted(streamed) == ["a", "b", "c", "d"]
    assert server.stats["generate"] == 4


def test_load_weights_between_batches(server, model_dir, prompts, tmp_path) -> None:
    engine = attach(server, tmp_path)
    model = load_causal_lm(model_dir)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    before = engine.generate(requests(prompts, "b"), params)[0]
    new_weights = perturbed(model, seed=0)
    engine.load_weights(5, new_weights)
    after = engine.generate(requests(prompts, "b"), params)[0]
    assert engine.version == 5 and server.weight_version == "5"
    assert after.versions == [5] * 6
    model.load_state_dict(new_weights, strict=False)
    ref = builtin_reference(model, prompts["b"], request_seed(1, "b"), params)
    assert after.response_ids == ref.response_ids != before.response_ids
    assert after.logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_TOLERANCE)
    # One snapshot on disk at a time, none after close (the server is attached: it stays up).
    engine.load_weights(6, new_weights)
    assert [p.name for p in engine.weights_dir.iterdir()] == ["weights-v6"]
    engine.close()
    assert list(engine.weights_dir.iterdir()) == []
    assert server.stats["weight_updates"] == 2 and server.stats["cache_flushes"] == 2


def test_load_weights_through_distributed_matches_disk(
    server, model_dir, prompts, tmp_path
) -> None:
    model = load_causal_lm(model_dir)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    new_weights = perturbed(model, seed=0)
    via_disk = attach(server, tmp_path)
    via_disk.load_weights(5, new_weights)
    disk_result = via_disk.generate(requests(prompts, "b", "c"), params)
    via_disk.load_weights(6, perturbed(model, seed=7))  # back to other weights in between
    engine = attach(server, tmp_path, weight_sync="distributed", weight_sync_backend="gloo")
    engine.load_weights(7, new_weights)
    assert server.stats["broadcasts"] == len(new_weights)
    # The group's store (torch's TCPStore, which binds every interface when left to itself)
    # listens on the loopback address the server was told, and nowhere else.
    store_sockets = [
        c.laddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == engine._group.port
    ]
    assert store_sockets == ["127.0.0.1"]
    results = engine.generate(requests(prompts, "b", "c"), params)
    assert engine.version == 7 and server.weight_version == "7"
    assert [r.versions for r in results] == [[7] * 6] * 2
    for r, d in zip(results, disk_result, strict=True):
        assert r.response_ids == d.response_ids
        assert r.logprobs == pytest.approx(d.logprobs, abs=LOGPROB_TOLERANCE)
    model.load_state_dict(new_weights, strict=False)
    ref = builtin_reference(model, prompts["b"], request_seed(1, "b"), params)
    assert results[0].response_ids == ref.response_ids
    # The group is made once and reused; no snapshot is written; close drops the group.
    engine.load_weights(8, {"model.norm.weight": new_weights["model.norm.weight"] * 2})
    assert len(server._groups) == 1 and server.weight_version == "8"
    assert list(engine.weights_dir.iterdir()) == []
    engine.close()
    assert server._groups == {}


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_bf16_weights_reach_the_server_bit_for_bit(
    server, model_dir, tmp_path, weight_sync
) -> None:
    """A bf16 trainer's weights (random bits: NaN payloads, infinities, -0 included) reach the
    server in bf16, bit for bit, either way: what SGLang's own loader then gets (it casts to the
    server's dtype, a step of SGLang's that runs on a GPU server only, see docs/precision.md)."""
    extra = {"weight_sync_backend": "gloo"} if weight_sync == "distributed" else {}
    engine = attach(server, tmp_path, weight_sync=weight_sync, **extra)
    generator = torch.Generator().manual_seed(3)
    weights = {
        name: torch.randint(-(2**15), 2**15, p.shape, generator=generator, dtype=torch.int16).view(
            torch.bfloat16
        )
        for name, p in load_causal_lm(model_dir).named_parameters()
    }
    engine.load_weights(1, weights)
    received = server.received_weights
    assert sorted(received) == sorted(weights)
    for name, value in weights.items():
        assert received[name].dtype == torch.bfloat16, name
        assert torch.equal(received[name].view(torch.int16), value.view(torch.int16)), name
    engine.close()


def test_a_failed_distributed_update_is_reported(server, tmp_path) -> None:
    engine = attach(server, tmp_path, weight_sync="distributed", weight_sync_backend="gloo")
    with pytest.raises(SglangError, match="update_weights_from_distributed failed.*unknown"):
        engine.load_weights(1, {"no.such.weight": torch.zeros(2)})
    assert engine.version == 0


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_inflight_update_resumes_requests_under_the_new_weights(
    model_dir, prompts, tmp_path, weight_sync
) -> None:
    # Every request stops after 3 tokens until the weights change: the update lands mid-way.
    server = FakeSglangServer(model_dir, stop_on_model_eos=False, hold_at_tokens=3).start()
    try:
        engine = attach(server, tmp_path, poll_s=0.005, weight_sync=weight_sync)
        model = load_causal_lm(model_dir)
        new_weights = perturbed(model, seed=1)
        served = False

        def weight_poll():
            nonlocal served
            if served or server.progress() != [3, 3, 3, 3]:
                return None
            served = True
            return 1, new_weights

        params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=0)
        results = engine.generate(
            requests(prompts, "a", "b", "c", "d"), params, weight_poll=weight_poll
        )
    finally:
        server.stop()
    assert served and engine.version == 1 and engine.num_continuations == 4
    assert server.stats["pauses"] == server.stats["continues"] == 1
    assert server.stats["aborted"] == 4 and server.weight_version == "1"
    new_model = load_causal_lm(model_dir)
    new_model.load_state_dict(new_weights, strict=False)
    old_lp = trainer_logprobs(model, prompts, results, 1.0)
    new_lp = trainer_logprobs(new_model, prompts, results, 1.0)
    for i, r in enumerate(results):
        num_old = 3
        assert r.versions == [0] * num_old + [1] * (16 - num_old)
        # Old tokens: the uninterrupted request's. New ones: a continuation under the new
        # weights, seeded by (request id, tokens so far).
        start = builtin_reference(
            model, prompts[r.request_id], request_seed(0, r.request_id), params
        )
        assert r.response_ids[:num_old] == start.response_ids[:num_old]
        key = request_seed(0, f"{r.request_id}@{num_old}")
        rest = builtin_reference(
            new_model,
            prompts[r.request_id] + r.response_ids[:num_old],
            key,
            SamplingParams(16 - num_old, 1.0),
        )
        assert r.response_ids[num_old:] == rest.response_ids
        # Each token's log-prob is that of the policy that sampled it...
        got = torch.tensor(r.logprobs)
        assert torch.allclose(got[:num_old], old_lp[i, :num_old], atol=LOGPROB_TOLERANCE)
        assert torch.allclose(got[num_old:], new_lp[i, num_old:], atol=LOGPROB_TOLERANCE)
        # ...and the two policies disagree enough that a mix-up would show.
        assert float((got[num_old:] - old_lp[i, num_old:]).abs().max()) > 0.05


def test_an_abort_the_engine_did_not_ask_for_is_an_error(model_dir, prompts, tmp_path) -> None:
    server = FakeSglangServer(model_dir, hold_at_tokens=2).start()
    try:
        engine = attach(server, tmp_path)

        def abort_all_once_running() -> None:
            while server.progress() != [2]:
                threading.Event().wait(0.005)
            body = json.dumps({"abort_all": True}).encode()
            urllib.request.urlopen(f"{server.url}/abort_request", data=body, timeout=10)

        other_client = threading.Thread(target=abort_all_once_running)
        other_client.start()
        with pytest.raises(SglangError, match="did not pause the server"):
            engine.generate(requests(prompts, "a"), SamplingParams(max_new_tokens=30))
        other_client.join()
    finally:
        server.stop()


def test_unreachable_server_is_a_clear_error(tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SglangError, match="cannot reach the SGLang server at .*rollout.sglang.url"):
        SglangEngine(
            "unused",
            eos_token_id=NO_EOS,
            config=SglangConfig(url=url, weights_dir=str(tmp_path)),
        )


def test_server_errors_are_surfaced(server, prompts, tmp_path) -> None:
    engine = attach(server, tmp_path)
    too_long = GenerationRequest("long", prompts["a"] * 40)
    with pytest.raises(SglangError, match="HTTP 400: Requested token count exceeds"):
        engine.generate([too_long], SamplingParams(max_new_tokens=8))
    with pytest.raises(SglangError, match="update_weights_from_disk failed.*unknown weights"):
        engine.load_weights(1, {"no.such.weight": torch.zeros(2)})
    assert engine.version == 0


def test_launch_waits_for_health_and_close_stops_the_server(model_dir, prompts, tmp_path) -> None:
    engine = SglangEngine(
        model_dir,
        eos_token_id=NO_EOS,
        config=SglangConfig(
            launch_cmd=[sys.executable, str(FAKE_SERVER)], weights_dir=str(tmp_path)
        ),
    )
    process = engine.server
    assert process is not None and process.poll() is None
    result = engine.generate(requests(prompts, "a"), SamplingParams(max_new_tokens=4))[0]
    assert len(result.response_ids) == result.versions.count(0) <= 4
    log = (engine.weights_dir / "sglang_server.log").read_text()
    assert "--enable-deterministic-inference" in log  # what a real server would have been given
    engine.close()
    assert process.poll() is not None


def test_a_server_that_dies_at_launch_reports_its_log(tmp_path) -> None:
    crash = "print('CUDA is not available'); raise SystemExit(3)"
    config = SglangConfig(launch_cmd=[sys.executable, "-c", crash], weights_dir=str(tmp_path))
    with pytest.raises(SglangError, match="(?s)exited with code 3.*CUDA is not available"):
        SglangEngine("some-model", eos_token_id=NO_EOS, config=config)


def test_config_selects_and_configures_the_engine(server, model_dir, tmp_path) -> None:
    cfg = load_config(
        [
            "rollout.engine=sglang",
            f"rollout.sglang.url={server.url}",
            "rollout.max_batch_size=3",
            "rollout.sglang.launch_args=[--tp, '2']",
            "rollout.sglang.weight_sync=distributed",
        ]
    )
    ctx = RunContext(cfg, model_dir, tmp_path / "run", [], [])
    engine = make_engine(ctx)
    assert isinstance(engine, SglangEngine) and engine.url == server.url
    assert engine.config is cfg.rollout.sglang and engine.config.launch_args == ["--tp", "2"]
    assert engine.max_running_requests == 3
    assert engine.config.weight_sync == "distributed"
    assert engine.dtype == "float32"  # auto: the trainer's model.dtype
    assert engine.weights_dir.parent == (tmp_path / "run" / "sglang").resolve()
    assert engine.eos_token_id == build_tokenizer().eos_token_id

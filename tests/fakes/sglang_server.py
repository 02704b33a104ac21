"""A test double for an SGLang server: the HTTP endpoints and JSON shapes streamrl's SGLang engine
uses, answered by streamrl's builtin engine over a local model. It is NOT SGLang; it exists so the
adapter (`streamrl/rollout/sglang_engine.py`) can be tested on a machine without a GPU.

What it implements, following SGLang's native API (field names as in SGLang's `io_struct.py`):

| endpoint | behaviour here |
| --- | --- |
| GET /health, /health_generate | 200 once serving |
| GET /model_info, /get_model_info | model_path, is_generation, weight_version, model_type |
| POST /generate | one prompt as `input_ids`; `sampling_params` max_new_tokens, temperature (0: greedy), top_p, top_k (-1: off), min_p, stop (strings), stop_token_ids, sampling_seed, ignore_eos; `return_logprob`, `top_logprobs_num`, `return_routed_experts`; answers `output_ids` and `meta_info` (id, finish_reason {type: stop/length/abort, matched}, prompt_tokens, completion_tokens, weight_version, output_token_logprobs [[logprob, id, null], ...], output_top_logprobs [[[logprob, id, null], ...], ...], routed_experts: base64 of int32 [prompt + output tokens - 1, layers, top k], only when the server was started with `--enable-return-routed-experts`); 400 for empty input_ids, ids outside [0, vocab_size), or past the context length |
| POST /abort_request | `rid` (prefix match, as SGLang) or `abort_all`; aborted requests answer with their tokens so far |
| POST /pause_generation | mode `abort` aborts everything running; `in_place`/`retract` only stop stepping; new requests wait until continued |
| POST /continue_generation | resumes |
| GET/POST /flush_cache | counted; 400 while requests run (as SGLang) |
| POST /update_weights_from_disk | loads every *.safetensors in `model_path`; `weight_version`, `flush_cache`, `abort_all_requests`; when not paused, waits for running requests to finish first (SGLang takes a writer lock) |
| GET /server_info, /get_server_info | `tp_size` 1 (the fake is one rank), `dp_size`, `model_path`, `weight_version` |
| POST /init_weights_update_group | `master_address`, `master_port`, `rank_offset`, `world_size`, `group_name`, `backend`: joins a torch.distributed group as rank `rank_offset` the way SGLang's model runner does (tcp:// rendezvous, `PrefixStore(group_name)`, torch's `_new_process_group_helper`); gloo works on CPU |
| POST /update_weights_from_distributed | `names`, `dtypes`, `shapes`, `group_name`, `flush_cache`, `weight_version`: receives one broadcast from rank 0 per tensor, in order, into new tensors, then loads them like a disk update |
| POST /destroy_weights_update_group | `group_name`: forgets the group |

Generation: a scheduler thread steps every running request by one token per step, with the builtin
engine sampling that one token for the sequence so far (prompt plus tokens so far) under the
request id `str(sampling_seed)`. The builtin engine's noise depends on (seed, request id, position)
only, so a request's tokens do not depend on its neighbours, on the step it was admitted in, or on
being resumed as a continuation; its log-probs are the builtin engine's (`log_softmax(logits /
temperature)` in fp32). With top-p, top-k or min-p the token is drawn from the truncated
distribution (the builtin engine's rule, which is SGLang's when one control is on), but the
reported log-probs, as SGLang's, are those of the full temperature-scaled distribution (one more
forward pass per token computes them). A stop string ends a request at the token whose text
completes it (`matched` names it). There is no KV cache: every step recomputes the sequences, which is fine
for the tiny test models. Routed experts (a mixture-of-experts model) are kept per position from
the step that first ran it, as a KV-cached server's would be: the prompt's from the first step,
each later position's from the step that fed it.

Run it in-process (`FakeSglangServer(model_dir).start()`) or as a program that accepts the
arguments the SGLang engine passes to `sglang.launch_server` (others are ignored):
`python tests/fakes/sglang_server.py --model-path DIR --port N`.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.rollout.sampling import StopStrings


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    seed: int
    stop_ids: set[int]
    return_logprob: bool
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stops: StopStrings | None = None
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    return_routed_experts: bool = False
    routes: list[np.ndarray] = field(default_factory=list)  # per position ran: [layers, k]
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def _as_list(stop: str | list[str]) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop)


class FakeSglangServer:
    """An SGLang-shaped HTTP server over the builtin engine (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        stop_on_model_eos: bool = True,
        hold_at_tokens: int | None = None,
        fail_generate: str | None = None,
        enable_return_routed_experts: bool = False,
    ):
        self.model_dir = str(model_dir)
        model = load_causal_lm(model_dir)
        self.max_context = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        eos = model.config.eos_token_id
        self.model_eos = set() if eos is None else set(eos if isinstance(eos, list) else [eos])
        self.stop_on_model_eos = stop_on_model_eos
        # One token per call, so the builtin engine's own EOS handling never matters.
        self.enable_return_routed_experts = enable_return_routed_experts
        """As SGLang's --enable-return-routed-experts: without it, requests get no routes."""
        self.engine = BuiltinEngine(
            model, eos_token_id=-1, pad_token_id=0, capture_routes=enable_return_routed_experts
        )
        self.tokenizer = load_tokenizer(model_dir)
        self.hold_at_tokens = hold_at_tokens
        """Test knob, not SGLang: requests stop after this many tokens until the next weight
        update, so a test can update weights mid-generation at a known point."""
        self.fail_generate = fail_generate
        """Test knob, not SGLang: every /generate answers HTTP 500 with this message (a server
        that keeps failing once it is up, as one out of memory does)."""
        self.weight_version = "default"
        self.stats = dict(
            generate=0, aborted=0, pauses=0, continues=0, weight_updates=0, cache_flushes=0
        )
        self._active: dict[str, _Request] = {}
        self._paused = False
        self._stopped = False
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()  # held by a step and by a weight update
        self._groups: dict[str, Any] = {}  # weight update groups by name
        self.httpd = _HttpServer((host, port), _handler_for(self))
        self._threads = [
            threading.Thread(target=self.httpd.serve_forever, daemon=True),
            threading.Thread(target=self._schedule, daemon=True),
        ]

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeSglangServer:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def progress(self) -> list[int]:
        """Tokens generated so far by each running request."""
        with self._cond:
            return [len(r.output_ids) for r in self._active.values()]

    # -- scheduler -----------------------------------------------------------------------------

    def _schedule(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._runnable())
                if self._stopped:
                    return
                batch = self._runnable()
            with self._model_lock:
                sampled = self._sample(batch)
            with self._cond:
                for req, (token, logprob, top) in zip(batch, sampled, strict=True):
                    if req.finish_reason is not None:  # aborted while this step ran
                        continue
                    req.output_ids.append(token)
                    req.logprobs.append(logprob)
                    req.top_logprobs.append(top)
                    if token in req.stop_ids:
                        self._finish(req, {"type": "stop", "matched": token})
                    elif req.stops is not None and req.stops.ends_here(req.output_ids):
                        text = req.stops.tokenizer.decode(req.output_ids, skip_special_tokens=True)
                        matched = next(s for s in req.stops.stops if s in text)
                        self._finish(req, {"type": "stop", "matched": matched})
                    elif len(req.output_ids) >= req.max_new_tokens:
                        self._finish(req, {"type": "length", "length": len(req.output_ids)})

    def _runnable(self) -> list[_Request]:
        """Requests the next step extends. Call with `_cond` held."""
        if self._paused:
            return []
        hold = self.hold_at_tokens
        return [r for r in self._active.values() if hold is None or len(r.output_ids) < hold]

    def _sample(self, batch: list[_Request]) -> list[tuple[int, float, list[list[Any]]]]:
        """One token for every request of `batch`, with the builtin engine; its log-prob (and
        the top ones asked for) under the full temperature-scaled distribution, as SGLang's."""
        out: dict[str, tuple[int, float, list[list[Any]]]] = {}
        for knobs in {(r.temperature, r.top_p, r.top_k, r.min_p) for r in batch}:
            group = [r for r in batch if (r.temperature, r.top_p, r.top_k, r.min_p) == knobs]
            temperature, top_p, top_k, min_p = knobs
            params = SamplingParams(1, temperature, 0, top_p=top_p, top_k=top_k, min_p=min_p)
            results = self.engine.generate(
                [GenerationRequest(str(r.seed), r.input_ids + r.output_ids) for r in group],
                params,
            )
            for req, result in zip(group, results, strict=True):
                if self.enable_return_routed_experts:  # the positions this step ran first
                    ran = result.extra["routed_experts"]
                    req.routes.extend(ran[len(req.routes) :])
                token, logprob, top = result.response_ids[0], result.logprobs[0], []
                if params.truncated or req.top_logprobs_num:
                    with torch.no_grad():
                        ids = torch.tensor([req.input_ids + req.output_ids])
                        logits = self.engine.model(input_ids=ids).logits[0, -1].float()
                    full = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
                    logprob = float(full[token])
                    values, indices = full.topk(req.top_logprobs_num)
                    top = [
                        [v, i, None] for v, i in zip(values.tolist(), indices.tolist(), strict=True)
                    ]
                out[req.rid] = (token, logprob, top)
        return [out[r.rid] for r in batch]

    def _finish(self, req: _Request, reason: dict[str, Any]) -> None:
        """Call with `_cond` held."""
        req.finish_reason = reason
        req.weight_version = self.weight_version
        del self._active[req.rid]
        req.done.set()
        self._cond.notify_all()

    def _abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Call with `_cond` held."""
        for req in list(self._active.values()):
            if abort_all or (rid and req.rid.startswith(rid)):
                self.stats["aborted"] += 1
                self._finish(req, {"type": "abort", "message": "Abort requested"})

    # -- endpoints -----------------------------------------------------------------------------

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.fail_generate is not None:
            raise HttpError(500, self.fail_generate)
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
            raise HttpError(400, "the fake SGLang server takes one prompt as a list of input_ids")
        if not input_ids:
            raise HttpError(400, "input_ids is empty")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            # As SGLang's tokenizer manager (`_validate_input_ids_in_vocab`), before scheduling:
            # an id outside the embedding table must not reach the model.
            raise HttpError(
                400,
                f"The input_ids {input_ids} contains values outside the vocabulary "
                f"[0, {self.vocab_size}).",
            )
        sp = body.get("sampling_params") or {}
        max_new_tokens = int(sp.get("max_new_tokens", 128))
        if len(input_ids) + max_new_tokens > self.max_context:
            raise HttpError(
                400,
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.max_context} tokens. You requested a total of "
                f"{len(input_ids) + max_new_tokens} tokens: {len(input_ids)} tokens from the "
                f"input messages and {max_new_tokens} tokens for the completion.",
            )
        if body.get("stream"):
            raise HttpError(400, "the fake SGLang server does not stream")
        seed = sp.get("sampling_seed")
        stop_ids = set(sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos") and self.stop_on_model_eos:
            stop_ids |= self.model_eos
        req = _Request(
            rid=str(body.get("rid") or f"fake-{random.getrandbits(64):016x}"),
            input_ids=input_ids,
            max_new_tokens=max_new_tokens,
            temperature=float(sp.get("temperature", 1.0)),
            seed=int(seed) if seed is not None else random.getrandbits(63),
            stop_ids=stop_ids if not sp.get("ignore_eos") else set(),
            return_logprob=bool(body.get("return_logprob")),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=max(int(sp.get("top_k", -1)), 0),
            min_p=float(sp.get("min_p", 0.0)),
            stops=StopStrings(self.tokenizer, _as_list(sp["stop"])) if sp.get("stop") else None,
            top_logprobs_num=int(body.get("top_logprobs_num") or 0),
            return_routed_experts=bool(body.get("return_routed_experts")),
        )
        with self._cond:
            self._cond.wait_for(lambda: not self._paused or self._stopped)
            if self._stopped:
                raise HttpError(503, "server is shutting down")
            self.stats["generate"] += 1
            self._active[req.rid] = req
            self._cond.notify_all()
        req.done.wait()
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "weight_version": req.weight_version,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(req.logprobs, req.output_ids, strict=True)
            ]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = req.top_logprobs
        if req.return_routed_experts and self.enable_return_routed_experts:
            ran = len(req.input_ids) + len(req.output_ids) - 1  # the last token never ran
            routes = np.stack(req.routes[:ran]).astype(np.int32) if ran else np.zeros((0, 0, 0))
            meta["routed_experts"] = base64.b64encode(routes.tobytes()).decode("ascii")
        return {"output_ids": req.output_ids, "meta_info": meta}

    def abort_request(self, body: dict[str, Any]) -> None:
        with self._cond:
            self._abort(str(body.get("rid") or ""), bool(body.get("abort_all")))

    def pause_generation(self, body: dict[str, Any]) -> dict[str, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HttpError(400, f"unknown pause mode {mode!r}")
        with self._model_lock, self._cond:  # between two steps
            self.stats["pauses"] += 1
            self._paused = True
            if mode == "abort":
                self._abort(abort_all=True)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._cond:
            self.stats["continues"] += 1
            self._paused = False
            self._cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self, body: dict[str, Any]) -> str:
        with self._cond:
            if self._active and not self._paused:
                raise HttpError(400, "Flush cache failed: there are running requests.\n")
            self.stats["cache_flushes"] += 1
        return "Cache flushed.\n"

    def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        from safetensors.torch import load_file

        files = sorted(Path(str(body.get("model_path", ""))).glob("*.safetensors"))
        if not files:
            raise HttpError(400, f"no *.safetensors files in model_path {body.get('model_path')!r}")
        tensors: dict[str, Any] = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return self._apply_weights(body, tensors)

    def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        from datetime import timedelta

        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        name = str(body.get("group_name", "weight_update_group"))
        if name in self._groups:
            return {"success": False, "message": f"group {name} already exists"}
        rank, world_size = int(body["rank_offset"]), int(body["world_size"])  # tp rank 0
        timeout = timedelta(seconds=60)
        url = f"tcp://{body['master_address']}:{int(body['master_port'])}"
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(str(body.get("backend", "nccl"))),
            PrefixStore(name, store),
            group_name=name,
            timeout=timeout,
        )
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        self._groups[name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        name = str(body.get("group_name", "weight_update_group"))
        if name not in self._groups:
            return {"success": False, "message": f"group {name} not initialized"}
        with self._cond:  # as SGLang's writer lock: running requests finish unless paused
            self._cond.wait_for(lambda: self._paused or not self._active)
        received, handles = {}, []
        for weight, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(tensor, src=0, group=self._groups[name], async_op=True))
            received[weight] = tensor
        for handle in handles:
            handle.wait()
        self.stats["broadcasts"] = self.stats.get("broadcasts", 0) + len(handles)
        return self._apply_weights(body, received)

    def destroy_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        self._groups.pop(str(body.get("group_name", "weight_update_group")), None)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def server_info(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "model_path": self.model_dir,
            "tp_size": 1,
            "dp_size": 1,
            "weight_version": self.weight_version,
        }

    def _apply_weights(self, body: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
        self.received_weights = tensors  # as SGLang's loader gets them, before any conversion
        known = {name for name, _ in self.engine.model.named_parameters()}
        unknown = sorted(set(tensors) - known)
        if unknown:
            return {"success": False, "message": f"unknown weights {unknown[:5]}"}
        with self._cond:
            if body.get("abort_all_requests"):
                self._abort(abort_all=True)
            self._cond.wait_for(lambda: self._paused or not self._active)
        with self._model_lock, self._cond:
            self.engine.load_weights(self.engine.version + 1, tensors)
            self.stats["weight_updates"] += 1
            self.hold_at_tokens = None
            self._cond.notify_all()
            if body.get("flush_cache", True):
                self.stats["cache_flushes"] += 1
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return {"success": True, "message": "Succeeded to update model weights."}

    def model_info(self, body: dict[str, Any]) -> dict[str, Any]:
        config = self.engine.model.config
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "is_generation": True,
            "weight_version": self.weight_version,
            "model_type": config.model_type,
            "architectures": config.architectures,
        }

    def health(self, body: dict[str, Any]) -> None:
        return None


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    # The default listen backlog (5) resets connections when a rollout batch sends hundreds of
    # requests at once; SGLang's server (uvicorn) accepts 2048.
    request_queue_size = 2048


ROUTES = {
    ("GET", "/health"): "health",
    ("GET", "/health_generate"): "health",
    ("GET", "/model_info"): "model_info",
    ("GET", "/get_model_info"): "model_info",
    ("POST", "/generate"): "generate",
    ("POST", "/abort_request"): "abort_request",
    ("POST", "/pause_generation"): "pause_generation",
    ("POST", "/continue_generation"): "continue_generation",
    ("GET", "/flush_cache"): "flush_cache",
    ("POST", "/flush_cache"): "flush_cache",
    ("POST", "/update_weights_from_disk"): "update_weights_from_disk",
    ("POST", "/init_weights_update_group"): "init_weights_update_group",
    ("POST", "/update_weights_from_distributed"): "update_weights_from_distributed",
    ("POST", "/destroy_weights_update_group"): "destroy_weights_update_group",
    ("GET", "/server_info"): "server_info",
    ("GET", "/get_server_info"): "server_info",
}


def _handler_for(server: FakeSglangServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            name = ROUTES.get((method, path))
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if name is None:
                    raise HttpError(404, f"the fake SGLang server has no {method} {path}")
                body = json.loads(raw) if raw else {}
                result = getattr(server, name)(body)
            except HttpError as e:
                self._send(e.status, {"error": {"message": str(e)}})
                return
            except ValueError as e:
                self._send(400, {"error": {"message": f"bad request: {e}"}})
                return
            status = 400 if isinstance(result, dict) and result.get("success") is False else 200
            self._send(status, result)

        def _send(self, status: int, result: Any) -> None:
            if result is None:
                data, kind = b"", "text/plain"
            elif isinstance(result, str):
                data, kind = result.encode(), "text/plain"
            else:
                data, kind = json.dumps(result).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: tests read the counters instead

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fake SGLang server for tests (not SGLang).")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--fail-generate", metavar="MESSAGE", help="test knob: see the class")
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    args, ignored = parser.parse_known_args(argv)
    server = FakeSglangServer(
        args.model_path,
        host=args.host,
        port=args.port,
        fail_generate=args.fail_generate,
        enable_return_routed_experts=args.enable_return_routed_experts,
    ).start()
    print(f"fake SGLang server on {server.url}; ignored arguments: {ignored}", flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main(sys.argv[1:])

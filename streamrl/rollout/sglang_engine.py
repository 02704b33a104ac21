"""The SGLang rollout engine (`rollout.engine=sglang`): the Engine protocol over SGLang's HTTP API.

The engine either launches a server (`python -m sglang.launch_server --model-path ... --port ...`,
waits for `/health`, stops it on `close()`) or attaches to one (`rollout.sglang.url`). Token ids
go in and come out; nothing is tokenized or detokenized on this side.

- **Requests.** Each request is one native `/generate` call with `input_ids`, `return_logprob`
  and `logprob_start_len=-1` (log-probs of output tokens only), sent from a pool of threads: at
  most `max_running_requests` are in flight, the rest wait here. SGLang reports the log-prob of
  a sampled token under `log_softmax(logits / temperature)`, the full distribution, also when
  top-p, top-k or min-p truncate what it samples from. With truncation on, the adapter asks for
  the top `sglang.top_logprobs_num` log-probs of every position as well and renormalises: it
  finds the kept tokens by SGLang's rule (top-k, then top-p over what is left, then min-p) and
  records log p - log(kept mass), the log-prob under the distribution the token was drawn from.
  Where the kept set runs past the returned entries the rest of the mass counts as kept (the
  recorded log-prob is then too low by at most log(1 + rest / kept)), counted in
  `num_inexact_logprobs`.
- **Stops.** EOS and `stop_token_ids` go as SGLang's `stop_token_ids`, stop strings as `stop`
  (the server detokenizes). A response resumed after an in-flight update is checked again here,
  with the model's tokenizer, for a stop string split between its attempts.
- **Seeds.** Every request carries `sampling_seed`, a hash of (seed, `request_id`), so its tokens
  do not depend on the batch it lands in. SGLang honours per-request seeds only when started with
  `--enable-deterministic-inference` (the launcher adds it unless told not to).
- **Versions.** Each weight update also sets SGLang's `weight_version` to the policy version, and
  each response reports the `weight_version` it was generated under; every token of a request
  attempt is stamped with it. Before this engine's first update (an attached server may report
  any label) tokens carry the engine's own version.
- **Weights** (`weight_sync`, `rollout.sglang.weight_sync`), either way with `flush_cache`, so
  cached attention of the old weights is dropped, and without pickle:
  - `disk` (default): `load_weights` writes the named tensors as one safetensors file into a
    snapshot directory and calls `/update_weights_from_disk`. The server must read that path.
  - `distributed`: the engine's process and the server's workers form a torch.distributed group
    of their own (not the default group; this process is rank 0 and serves its TCP store on a
    free port, the server's tensor-parallel ranks join as ranks 1..tp). The first update calls
    `/init_weights_update_group` while joining as rank 0; every update then posts the names,
    dtypes and shapes to `/update_weights_from_distributed` while broadcasting each tensor from
    rank 0 in that order. NCCL when this process has a GPU, gloo otherwise (the tests use gloo
    on CPU). The server must reach this process's address; no file is written.
  SGLang's `/update_weights_from_tensor` is not used: its payload is pickled by torch's
  ForkingPickler (CUDA IPC or shared-memory handles, valid only on the server's own machine).
- **In-flight updates.** While requests run, the engine asks `weight_poll` every `poll_s`. On a
  new version it pauses the server with `/pause_generation` (mode `abort`: every running request
  returns what it has so far, marked aborted), updates the weights, and `/continue_generation`.
  Each aborted request is resumed as a continuation: prompt plus tokens so far, the remaining
  token budget, and a seed derived from (`request_id`, tokens so far). The continuation's prefill
  recomputes the attention cache under the new weights.

- **Routing capture** (`capture_routes`, for `algorithm.routing_replay=rollout`): a launched
  server gets `--enable-return-routed-experts` (an attached one must have been started with it),
  every request asks for `return_routed_experts`, and each response's `meta_info.routed_experts`
  becomes the result's `routed_experts` field (`sglang_routes.py` decodes it). A continuation's
  response covers the whole sequence under the new weights, so the last attempt's routes are the
  ones kept (`merge_routes`).

Nothing here has run against a real SGLang server yet: the tests use a stand-in that speaks the
same API (`tests/fakes/sglang_server.py`); docs/engines.md says what that does and does not cover.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import queue
import shutil
import subprocess
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.api.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    WeightPoll,
    check_requests,
)
from streamrl.api.fields import ROUTED_EXPERTS
from streamrl.config.schema import SglangConfig
from streamrl.rollout.sampling import StopStrings, cut_at_stop
from streamrl.rollout.seeds import request_seed
from streamrl.rollout.sglang_client import (
    BackgroundCall,
    SglangClient,
    SglangError,
    WeightGroup,
    address_toward,
    cuda_available,
    launch_server,
    stop_process_group,
)

if TYPE_CHECKING:
    from streamrl.rollout.sglang_routes import RoutingLayout

log = logging.getLogger(__name__)

# One /generate answer: token ids, their log-probs, the policy version, SGLang's finish type, per
# position the top log-probs (descending; empty unless asked for), and the routed experts of the
# positions it ran (None unless asked for).
_Output = tuple[list[int], list[float], int, str, list[list[float]], np.ndarray | None]


@dataclass
class _Sequence:
    """One request's progress across the SGLang requests (attempts) that generate it."""

    request: GenerationRequest
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    routes: np.ndarray | None = None
    """With routing capture: the experts of each position run so far, from the latest attempt."""
    sent_in_epoch: int = 0
    """The engine's update epoch when the current attempt was sent: an attempt aborted in the
    same epoch was not aborted by this engine."""


class SglangEngine:
    """A rollout engine backed by an SGLang server (`rollout.engine=sglang`)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        eos_token_id: int,
        config: SglangConfig,
        model_dtype: str = "float32",
        max_running_requests: int = 256,
        default_weights_dir: str | Path | None = None,
        poll_s: float = 0.02,
        weight_sync_backend: str | None = None,
        weight_sync_address: str | None = None,
        weight_sync_port: int = 0,
        tp_size: int | None = None,
        capture_routes: bool = False,
    ):
        """`config` is the `rollout.sglang` section. The values from other sections:
        `model_dtype` (`model.dtype`, a launched server's `--dtype` when `config.dtype` is auto),
        `max_running_requests` (`rollout.max_batch_size`: most requests in flight at once, also a
        launched server's --max-running-requests) and `default_weights_dir` (where weight
        snapshots, and a launched server's log, go when `config.weights_dir` is None: a
        subdirectory per engine; None: a temporary directory, deleted on close).

        Not in the config: `poll_s`, how often `weight_poll` is asked while requests run; and for
        `weight_sync="distributed"`, `weight_sync_backend` ("nccl" or "gloo"; None: nccl when
        this process has CUDA, else gloo), `weight_sync_address` (this process's address as the
        server's workers reach it, the group's master address; None: the local address of the
        route to the server), `weight_sync_port` (of the group's TCP store, served by this
        process; 0 picks a free one) and `tp_size` (the server's tensor-parallel size, the group
        has 1 + tp_size ranks; None asks the server, else reads --tp/--tp-size of
        `config.launch_args`, else 1). `capture_routes`: record each request's routed experts
        (a mixture-of-experts model in a local `model_dir`; see the module docstring)."""
        self.eos_token_id = eos_token_id
        self.config = config
        self.dtype = model_dtype if config.dtype == "auto" else config.dtype
        self.max_running_requests = max_running_requests
        self.poll_s = poll_s
        self.weight_sync_backend = weight_sync_backend
        self.weight_sync_address = weight_sync_address
        self.weight_sync_port = weight_sync_port
        self.tp_size = tp_size
        self.model_dir = Path(model_dir)
        self.vocab_size = _vocab_size(Path(model_dir))
        """Prompt ids are checked against it before anything is sent; None (no local model
        directory to read it from) leaves that to the server (recent SGLang answers HTTP 400)."""
        # A directory of its own: several engines (rollout replicas) may share `weights_dir`.
        weights_dir = config.weights_dir or default_weights_dir
        self._own_weights_dir = weights_dir is None
        if weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="streamrl-sglang-"))
        else:
            base = Path(weights_dir).resolve()
            self.weights_dir = base / f"engine-{uuid.uuid4().hex[:8]}"
            self.weights_dir.mkdir(parents=True)
        self._version = 0
        self._epoch = 0  # bumped by every in-flight update
        self._snapshot: Path | None = None
        if config.weight_sync not in ("disk", "distributed"):
            raise ValueError(
                f"weight_sync must be 'disk' or 'distributed', got {config.weight_sync!r}"
            )
        self._group: WeightGroup | None = None  # the distributed weight group, once made
        self.num_weight_updates = 0
        self.num_continuations = 0
        self.num_inexact_logprobs = 0
        """Tokens whose truncated log-prob could not be computed exactly: the kept set ran past
        the `top_logprobs_num` entries SGLang returned (see the module docstring)."""
        self._tokenizer: Any = None
        self.routing: RoutingLayout | None = None
        if capture_routes:
            from streamrl.rollout.sglang_routes import RoutingLayout

            self.routing = RoutingLayout.of(self.model_dir)
        self.server: subprocess.Popen | None = None
        if config.url is None:
            self.server, url = launch_server(
                Path(model_dir),
                config,
                self.weights_dir,
                dtype=self.dtype,
                max_running_requests=max_running_requests,
                extra_args=["--enable-return-routed-experts"] if capture_routes else [],
            )
            atexit.register(self.close)
        else:
            url = config.url
        self.client = SglangClient(url, config.request_timeout_s)
        try:
            self.model_info = self._model_info()
        except BaseException:
            self.close()
            raise

    @property
    def version(self) -> int:
        return self._version

    @property
    def url(self) -> str:
        return self.client.base_url

    def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Have the server load the tensors (flushing its cache): through a safetensors snapshot
        or a broadcast, per `config.weight_sync`. Between batches; during a batch, `generate`
        pauses the server first."""
        if self.config.weight_sync == "distributed":
            self._load_weights_distributed(version, named_tensors)
        else:
            self._load_weights_from_disk(version, named_tensors)
        self._version = version
        self.num_weight_updates += 1

    def _load_weights_from_disk(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        from safetensors.torch import save_file

        snapshot = self.weights_dir / f"weights-v{version}"
        shutil.rmtree(snapshot, ignore_errors=True)
        snapshot.mkdir(parents=True)
        save_file(_as_tensors(named_tensors), str(snapshot / "model.safetensors"))
        self.client.post(
            "/update_weights_from_disk",
            {"model_path": str(snapshot), "weight_version": str(version), "flush_cache": True},
        )
        if self._snapshot is not None and self._snapshot != snapshot:
            shutil.rmtree(self._snapshot, ignore_errors=True)
        self._snapshot = snapshot

    def _load_weights_distributed(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Post names, dtypes and shapes to /update_weights_from_distributed (on a thread) while
        broadcasting the tensors, in that order, from rank 0 of the weight group."""
        group = self._group or self._init_weight_group()
        tensors = _as_tensors(named_tensors)
        payload = {
            "names": list(tensors),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": group.name,
            "flush_cache": True,
            "weight_version": str(version),
        }
        call = BackgroundCall(self.client.post, "/update_weights_from_distributed", payload)
        try:
            works = [group.broadcast(t.to(group.device)) for t in tensors.values()]
            group.wait(works, call, f"weights of version {version}")
        except BaseException:
            self._group = None  # a broadcast may be half done: make a new group next time
            raise
        call.result()

    def _init_weight_group(self) -> WeightGroup:
        """Make the weight group: serve its store, have the server join (/init_weights_update_
        group, on a thread) and join it as rank 0."""
        backend = self.weight_sync_backend or ("nccl" if cuda_available() else "gloo")
        tp_size = self.tp_size or self._server_tp_size()
        address = self.weight_sync_address or address_toward(self.url)
        group = WeightGroup.serve(
            f"streamrl-{uuid.uuid4().hex[:12]}",
            backend,
            address,
            self.weight_sync_port,
            1 + tp_size,
            self.config.request_timeout_s,
        )
        payload = {
            "master_address": address,
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": 1 + tp_size,
            "group_name": group.name,
            "backend": backend,
        }
        call = BackgroundCall(self.client.post, "/init_weights_update_group", payload)
        group.join(call)
        call.result()
        self._group = group
        return group

    def _server_tp_size(self) -> int:
        for path in ("/server_info", "/get_server_info"):
            try:
                info = self.client.get(path)
            except SglangError as e:
                if e.status != 404:
                    raise
                continue
            if isinstance(info, dict) and isinstance(info.get("tp_size"), int):
                return info["tp_size"]
        args = list(self.config.launch_args)
        for flag in ("--tp", "--tp-size", "--tensor-parallel-size"):
            if flag in args[:-1]:
                return int(args[args.index(flag) + 1])
        return 1

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_finished: Callable[[list[GenerationResult]], None] | None = None,
        weight_poll: WeightPoll | None = None,
    ) -> list[GenerationResult]:
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids in one generate() call must be unique")
        check_requests(requests, self.vocab_size)
        if not requests:
            return []
        stops = StopStrings(self._load_tokenizer(), params.stop) if params.stop else None
        waiting = deque(_Sequence(r) for r in requests)
        # Worker threads only do HTTP; every state change happens on this thread.
        outcomes: queue.Queue[tuple[_Sequence, str, _Output | Exception]] = queue.Queue()
        running: dict[str, _Sequence] = {}  # SGLang request id -> sequence
        results: dict[str, GenerationResult] = {}
        num_workers = min(len(requests), self.max_running_requests)
        pool = ThreadPoolExecutor(num_workers, thread_name_prefix="sglang-generate")
        last_poll = time.monotonic()
        try:
            while waiting or running:
                while waiting and len(running) < num_workers:
                    self._send(waiting.popleft(), params, pool, outcomes, running)
                finished = self._collect(outcomes, running, waiting, params, stops)
                for seq in finished:
                    results[seq.request.request_id] = self._result(seq)
                if finished and on_finished is not None:
                    on_finished([results[seq.request.request_id] for seq in finished])
                if weight_poll is not None and running:
                    if time.monotonic() - last_poll >= self.poll_s:
                        last_poll = time.monotonic()
                        update = weight_poll()
                        if update is not None:
                            self._update_in_flight(update)
        except BaseException:
            self._abort(list(running))
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [results[r.request_id] for r in requests]

    def close(self) -> None:
        """Stop a launched server (its whole process group) and delete the weight snapshots
        (and the temporary directory, if the engine made one). An attached server keeps running."""
        if self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)
            self._snapshot = None
        if self._group is not None:
            group, self._group = self._group, None
            if self.server is None or self.server.poll() is None:
                try:  # best effort: the server drops its end of the group
                    self.client.post(
                        "/destroy_weights_update_group", {"group_name": group.name}, timeout_s=10.0
                    )
                except SglangError as e:
                    log.warning("could not destroy SGLang's weight update group: %s", e)
        if self.server is not None and self.server.poll() is None:
            stop_process_group(self.server)
        self.server = None
        if self._own_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)

    # -- one generate call ---------------------------------------------------------------------

    def _send(self, seq: _Sequence, params: SamplingParams, pool, outcomes, running) -> None:
        """Start one attempt of `seq` on a worker thread: its prompt plus what it has so far."""
        done = len(seq.response_ids)
        key = seq.request.request_id if done == 0 else f"{seq.request.request_id}@{done}"
        # Random hex ids of one length: SGLang aborts by id prefix, so no id may prefix another.
        rid = f"streamrl-{uuid.uuid4().hex}"
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens - done,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or -1,
            "min_p": params.min_p,
            "sampling_seed": request_seed(params.seed, key),
            "stop_token_ids": [self.eos_token_id, *params.stop_token_ids],
        }
        if params.stop:
            sampling["stop"] = list(params.stop)
        payload: dict[str, Any] = {
            "rid": rid,
            "input_ids": list(seq.request.prompt_ids) + seq.response_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if params.truncated:
            payload["top_logprobs_num"] = self._top_logprobs_num(params)
        if self.routing is not None:
            payload["return_routed_experts"] = True
        seq.sent_in_epoch = self._epoch
        sent_version = self._version
        running[rid] = seq

        def attempt() -> None:
            try:
                response = self.client.post("/generate", payload)
                output = _parse_output(response, sent_version, self, len(payload["input_ids"]))
                outcomes.put((seq, rid, output))
            except Exception as e:  # handed to the main thread, which raises it
                outcomes.put((seq, rid, e))

        pool.submit(attempt)

    def _collect(
        self, outcomes, running, waiting, params: SamplingParams, stops: StopStrings | None
    ) -> list[_Sequence]:
        """Wait up to `poll_s` for attempts to return; record them. Aborted attempts go back to
        `waiting` as continuations; returns the sequences that are complete."""
        returned = []
        try:
            returned.append(outcomes.get(timeout=self.poll_s))
            while True:
                returned.append(outcomes.get_nowait())
        except queue.Empty:
            pass
        finished: list[_Sequence] = []
        for seq, rid, outcome in returned:
            del running[rid]
            if isinstance(outcome, Exception):
                raise outcome
            token_ids, logprobs, version, reason, top, routes = outcome
            if params.truncated:
                logprobs = self._renormalise(logprobs, top, params)
            if self.routing is not None:
                from streamrl.models.moe import merge_routes

                seq.routes = merge_routes(seq.routes, routes)
            resumed = bool(seq.response_ids)
            seq.response_ids += token_ids
            seq.logprobs += logprobs
            seq.versions += [version] * len(token_ids)
            if reason == "abort" and seq.sent_in_epoch == self._epoch:
                raise SglangError(
                    f"SGLang aborted request {seq.request.request_id!r} (id {rid}) although "
                    "this engine did not pause the server; is another client controlling it?"
                )
            # SGLang matches stops within one attempt: a resumed request is checked whole here.
            cut = cut_at_stop(seq.response_ids, params, self.eos_token_id, stops)
            if cut is not None and (resumed or reason == "abort"):
                del seq.response_ids[cut:], seq.logprobs[cut:], seq.versions[cut:]
                reason = "stop"
            complete = len(seq.response_ids) >= params.max_new_tokens or reason == "stop"
            if reason == "abort":
                if not complete:
                    waiting.append(seq)  # resumed as a continuation under the new weights
                    self.num_continuations += 1
                    continue
                reason = "length"
            seq.finish_reason = reason
            finished.append(seq)
        return finished

    def _top_logprobs_num(self, params: SamplingParams) -> int:
        """Top log-probs to ask for per position: the kept set, when top-k bounds it."""
        if 0 < params.top_k <= self.config.top_logprobs_num:
            return params.top_k
        return self.config.top_logprobs_num

    def _renormalise(
        self, logprobs: list[float], top: list[list[float]], params: SamplingParams
    ) -> list[float]:
        """The log-prob of each sampled token under the truncated, renormalised distribution
        SGLang drew it from, from its full-distribution log-prob and the top ones."""
        if len(top) != len(logprobs):
            raise SglangError(
                f"SGLang returned top log-probs for {len(top)} of {len(logprobs)} tokens; "
                "the truncated log-probs need them for every token"
            )
        out = []
        for logprob, top_logprobs in zip(logprobs, top, strict=True):
            mass, exact = kept_mass(top_logprobs, params)
            self.num_inexact_logprobs += not exact
            out.append(logprob - math.log(mass))
        return out

    def _load_tokenizer(self) -> Any:
        """The model's tokenizer (for stop strings split across the attempts of a request)."""
        if self._tokenizer is None:
            from streamrl.models.loading import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.model_dir)
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"stop strings need the model's tokenizer on this side, and "
                    f"{str(self.model_dir)!r} has none that loads ({e}); give the engine a "
                    "local model directory"
                ) from e
        return self._tokenizer

    def _update_in_flight(self, update: tuple[int, Mapping[str, Any]]) -> None:
        """Pause the server (running requests come back aborted with their tokens so far), load
        the new weights, continue. `_collect` resumes the aborted requests as continuations."""
        self._epoch += 1
        self.client.post("/pause_generation", {"mode": "abort"})
        try:
            self.load_weights(*update)
        finally:
            self.client.post("/continue_generation", {})

    def _abort(self, rids: list[str]) -> None:
        """Best effort, on the way out of a failed call: stop this call's requests on the server."""
        for i, rid in enumerate(rids):
            try:
                self.client.post("/abort_request", {"rid": rid}, timeout_s=10.0)
            except SglangError as e:
                log.warning("could not abort %d SGLang requests: %s", len(rids) - i, e)
                return

    def _result(self, seq: _Sequence) -> GenerationResult:
        assert seq.finish_reason in ("stop", "length")
        result = GenerationResult(
            request_id=seq.request.request_id,
            response_ids=seq.response_ids,
            logprobs=seq.logprobs,
            versions=seq.versions,
            finish_reason=seq.finish_reason,  # type: ignore[arg-type]
        )
        if seq.routes is not None:  # every position but the last token's (a stop may cut it)
            ran = len(seq.request.prompt_ids) + len(seq.response_ids) - 1
            result.extra[ROUTED_EXPERTS] = seq.routes[:ran]
        return result

    def _model_info(self) -> dict[str, Any]:
        """The server's /model_info (/get_model_info on older SGLang); checks that it generates."""
        try:
            info = self.client.get("/model_info")
        except SglangError as e:
            if e.status != 404:
                raise
            info = self.client.get("/get_model_info")
        if not isinstance(info, dict) or info.get("is_generation") is False:
            raise SglangError(
                f"the SGLang server at {self.url} does not serve a generative model: {info!r}"
            )
        return info


def _parse_output(
    response: Any, sent_version: int, engine: SglangEngine, sent_tokens: int
) -> _Output:
    """(token ids, log-probs, policy version, finish type, top log-probs, routes) of one
    /generate response to `sent_tokens` input ids."""
    try:
        meta = response["meta_info"]
        pairs = meta["output_token_logprobs"]  # [[logprob, token id, text or null], ...]
        token_ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
        reason = meta["finish_reason"]["type"]
        top = [[float(p[0]) for p in row] for row in meta.get("output_top_logprobs") or []]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise SglangError(
            f"unexpected /generate response from {engine.url} (missing or malformed "
            f"meta_info.output_token_logprobs or finish_reason): {str(response)[:500]}"
        ) from e
    if reason not in ("stop", "length", "abort"):
        raise SglangError(f"SGLang finished a request with unknown reason {meta['finish_reason']}")
    routes = None
    # An aborted attempt's routes may be left out: its continuation runs every position again.
    if engine.routing is not None and (reason != "abort" or meta.get("routed_experts")):
        ran = sent_tokens + len(token_ids) - 1
        routes = engine.routing.decode(meta.get("routed_experts"), ran, engine.url)
    version = sent_version
    reported = meta.get("weight_version")
    if engine.num_weight_updates > 0 and isinstance(reported, str) and reported.isdigit():
        version = int(reported)  # exact even when the response crossed a weight update
    return token_ids, logprobs, version, reason, top, routes


def kept_mass(top_logprobs: Sequence[float], params: SamplingParams) -> tuple[float, bool]:
    """The probability mass SGLang's truncation keeps at one position, from the position's top
    log-probs (full distribution, any order), and whether that is exact. SGLang's rule: top-k,
    then top-p over the renormalised top-k (a token stays while the more likely ones hold less
    than p), then min-p against the most likely token. When every returned entry stays and more
    could, the unreturned mass counts as kept (exact: False)."""
    probs = sorted((math.exp(v) for v in top_logprobs), reverse=True)
    if not probs:
        raise SglangError("SGLang returned no top log-probs for a position")
    rest = max(0.0, 1.0 - sum(probs))
    kept = probs[: params.top_k] if params.top_k > 0 else probs
    open_ended = params.top_k <= 0 or params.top_k > len(probs)  # more may be kept unseen
    total = sum(kept) + (rest if open_ended else 0.0)
    if params.top_p < 1.0:
        above, chosen = 0.0, []
        for p in kept:
            if above >= params.top_p * total:
                open_ended = False
                break
            chosen.append(p)
            above += p
        kept = chosen
    if params.min_p > 0:
        floor = params.min_p * probs[0]
        if kept[-1] < floor:
            open_ended = False
        kept = [p for p in kept if p >= floor]
    mass = sum(kept) + (rest if open_ended else 0.0)
    return mass, not (open_ended and rest > 0)


def _vocab_size(model_dir: Path) -> int | None:
    """The vocabulary size in `model_dir`'s config.json (a multimodal model's `text_config`),
    None when there is no such local file (a hub id, or a server attached without it)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def _as_tensors(named_tensors: Mapping[str, Any]) -> dict[str, Any]:
    """CPU, contiguous torch tensors that share no memory (safetensors refuses shared ones, as
    in tied embeddings handed over twice); numpy arrays (read-only from Ray) are copied."""
    import torch

    out, seen = {}, set()
    for name, value in named_tensors.items():
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
        else:
            tensor = torch.from_numpy(np.array(value))
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out

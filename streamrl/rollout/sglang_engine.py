"""The SGLang rollout engine (`rollout.engine=sglang`): the Engine protocol over SGLang's HTTP API.

The engine either launches a server (`python -m sglang.launch_server --model-path ... --port ...`,
waits for `/health`, stops it on `close()`) or attaches to one (`rollout.sglang_url`). Token ids
go in and come out; nothing is tokenized or detokenized on this side.

- **Requests.** Each request is one native `/generate` call with `input_ids`, `return_logprob`
  and `logprob_start_len=-1` (log-probs of output tokens only), sent from a pool of threads: at
  most `max_running_requests` are in flight, the rest wait here. Sampling is plain softmax
  sampling (top-p 1, top-k off, no penalties), so SGLang's log-prob of a sampled token is
  `log_softmax(logits / temperature)`, what the trainer computes.
- **Seeds.** Every request carries `sampling_seed`, a hash of (seed, `request_id`), so its tokens
  do not depend on the batch it lands in. SGLang honours per-request seeds only when started with
  `--enable-deterministic-inference` (the launcher adds it unless told not to).
- **Versions.** Each weight update also sets SGLang's `weight_version` to the policy version, and
  each response reports the `weight_version` it was generated under; every token of a request
  attempt is stamped with it. Before this engine's first update (an attached server may report
  any label) tokens carry the engine's own version.
- **Weights.** `load_weights` writes the named tensors as one safetensors file into a snapshot
  directory and calls `/update_weights_from_disk` with `flush_cache`, so cached attention of the
  old weights is dropped. No pickle is involved. SGLang's `/update_weights_from_tensor` is not
  used: its payload is pickled by torch's ForkingPickler (CUDA IPC or shared-memory handles,
  valid only on the server's own machine).
- **In-flight updates.** While requests run, the engine asks `weight_poll` every `poll_s`. On a
  new version it pauses the server with `/pause_generation` (mode `abort`: every running request
  returns what it has so far, marked aborted), updates the weights, and `/continue_generation`.
  Each aborted request is resumed as a continuation: prompt plus tokens so far, the remaining
  token budget, and a seed derived from (`request_id`, tokens so far). The continuation's prefill
  recomputes the attention cache under the new weights.

Nothing here has run against a real SGLang server yet: the tests use a stand-in that speaks the
same API (`tests/fakes/sglang_server.py`); docs/engines.md says what that does and does not cover.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams, WeightPoll

if TYPE_CHECKING:
    from streamrl.runtime.context import RunContext

DEFAULT_LAUNCH_CMD = (sys.executable, "-m", "sglang.launch_server")

log = logging.getLogger(__name__)

# One /generate answer: token ids, their log-probs, the policy version, SGLang's finish type.
_Output = tuple[list[int], list[float], int, str]


class SglangError(RuntimeError):
    """The SGLang server could not be reached, failed to start, or answered with an error
    (`status`: the HTTP status, when there was one)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class SglangSettings:
    """How the engine reaches its server; `streamrl.runtime.components` fills it from the config."""

    url: str | None = None
    """Base URL of a running server to attach to; None launches one."""
    launch_cmd: Sequence[str] = DEFAULT_LAUNCH_CMD
    """Command that starts a server; the engine appends --model-path, --host, --port and more."""
    launch_args: Sequence[str] = ()
    """Further server arguments, e.g. ("--tp", "2", "--mem-fraction-static", "0.7")."""
    dtype: str = "float32"
    """`--dtype` of a launched server (the trainer's, for the smallest log-prob mismatch)."""
    deterministic: bool = True
    """Launch with `--enable-deterministic-inference`, without which SGLang ignores seeds."""
    max_running_requests: int = 256
    """Most requests in flight at once (also the launched server's --max-running-requests)."""
    startup_timeout_s: float = 600.0
    """How long a launched server may take to answer /health."""
    request_timeout_s: float = 600.0
    """Longest wait for one HTTP call (a whole generation, or a weight update)."""
    weights_dir: str | Path | None = None
    """Where weight snapshots (and a launched server's log) go, in a subdirectory per engine; the
    server must be able to read it. None: a temporary directory, deleted on close."""
    poll_s: float = 0.02
    """How often `weight_poll` is asked while requests run."""


class SglangClient:
    """JSON over HTTP to one SGLang server (stdlib only), with errors that say what went wrong."""

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def get(self, path: str, *, timeout_s: float | None = None) -> Any:
        return self._call("GET", path, None, timeout_s)

    def post(self, path: str, payload: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        return self._call("POST", path, payload, timeout_s)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True when /health answers 200; False when the server is not (yet) there."""
        try:
            self.get("/health", timeout_s=timeout_s)
        except SglangError:
            return False
        return True

    def _call(self, method: str, path: str, payload: Any, timeout_s: float | None) -> Any:
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            raise SglangError(
                f"SGLang server {self.base_url}: {method} {path} failed with HTTP {e.code}: "
                f"{_error_message(e.read())}",
                status=e.code,
            ) from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ConnectionRefusedError | socket.gaierror):
                raise SglangError(
                    f"cannot reach the SGLang server at {self.base_url} ({method} {path}: "
                    f"{reason}); is it running? Check rollout.sglang_url, or leave it unset to "
                    "launch a server"
                ) from e
            raise SglangError(
                f"the SGLang server at {self.base_url} did not answer {method} {path}: {reason} "
                f"(did it crash? Its time limit is rollout.sglang_request_timeout_s, "
                f"{timeout_s or self.timeout_s} s)"
            ) from e
        if not body:
            return None
        try:
            result = json.loads(body)
        except ValueError:
            return body.decode(errors="replace")  # a few endpoints answer in plain text
        if isinstance(result, dict) and result.get("success") is False:
            raise SglangError(
                f"SGLang server {self.base_url}: {method} {path} failed: {result.get('message')}"
            )
        return result


@dataclass
class _Sequence:
    """One request's progress across the SGLang requests (attempts) that generate it."""

    request: GenerationRequest
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sent_in_epoch: int = 0
    """The engine's update epoch when the current attempt was sent: an attempt aborted in the
    same epoch was not aborted by this engine."""


class SglangEngine:
    """A rollout engine backed by an SGLang server (`rollout.engine=sglang`)."""

    def __init__(self, model_dir: str | Path, *, eos_token_id: int, settings: SglangSettings):
        self.eos_token_id = eos_token_id
        self.settings = settings
        # A directory of its own: several engines (rollout replicas) may share `weights_dir`.
        self._own_weights_dir = settings.weights_dir is None
        if settings.weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="streamrl-sglang-"))
        else:
            base = Path(settings.weights_dir).resolve()
            self.weights_dir = base / f"engine-{uuid.uuid4().hex[:8]}"
            self.weights_dir.mkdir(parents=True)
        self._version = 0
        self._epoch = 0  # bumped by every in-flight update
        self._snapshot: Path | None = None
        self.num_weight_updates = 0
        self.num_continuations = 0
        self.server: subprocess.Popen | None = None
        if settings.url is None:
            self.server, url = _launch_server(Path(model_dir), settings, self.weights_dir)
            atexit.register(self.close)
        else:
            url = settings.url
        self.client = SglangClient(url, settings.request_timeout_s)
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
        """Write the tensors as a safetensors snapshot and have the server load it (flushing its
        cache). Between batches; during a batch, `generate` pauses the server first."""
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
        self._version = version
        self.num_weight_updates += 1

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
        empty = [r.request_id for r in requests if not r.prompt_ids]
        if empty:
            raise ValueError(f"requests {empty[:5]} have no prompt tokens; give each at least one")
        if not requests:
            return []
        waiting = deque(_Sequence(r) for r in requests)
        # Worker threads only do HTTP; every state change happens on this thread.
        outcomes: queue.Queue[tuple[_Sequence, str, _Output | Exception]] = queue.Queue()
        running: dict[str, _Sequence] = {}  # SGLang request id -> sequence
        results: dict[str, GenerationResult] = {}
        num_workers = min(len(requests), self.settings.max_running_requests)
        pool = ThreadPoolExecutor(num_workers, thread_name_prefix="sglang-generate")
        last_poll = time.monotonic()
        try:
            while waiting or running:
                while waiting and len(running) < num_workers:
                    self._send(waiting.popleft(), params, pool, outcomes, running)
                finished = self._collect(outcomes, running, waiting, params)
                for seq in finished:
                    results[seq.request.request_id] = self._result(seq)
                if finished and on_finished is not None:
                    on_finished([results[seq.request.request_id] for seq in finished])
                if weight_poll is not None and running:
                    if time.monotonic() - last_poll >= self.settings.poll_s:
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
        if self.server is not None and self.server.poll() is None:
            _stop_process_group(self.server)
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
        payload = {
            "rid": rid,
            "input_ids": list(seq.request.prompt_ids) + seq.response_ids,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens - done,
                "temperature": params.temperature,
                "top_p": 1.0,
                "top_k": -1,
                "min_p": 0.0,
                "sampling_seed": request_seed(params.seed, key),
                "stop_token_ids": [self.eos_token_id],
            },
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        seq.sent_in_epoch = self._epoch
        sent_version = self._version
        running[rid] = seq

        def attempt() -> None:
            try:
                response = self.client.post("/generate", payload)
                outcomes.put((seq, rid, _parse_output(response, sent_version, self)))
            except Exception as e:  # handed to the main thread, which raises it
                outcomes.put((seq, rid, e))

        pool.submit(attempt)

    def _collect(self, outcomes, running, waiting, params: SamplingParams) -> list[_Sequence]:
        """Wait up to `poll_s` for attempts to return; record them. Aborted attempts go back to
        `waiting` as continuations; returns the sequences that are complete."""
        returned = []
        try:
            returned.append(outcomes.get(timeout=self.settings.poll_s))
            while True:
                returned.append(outcomes.get_nowait())
        except queue.Empty:
            pass
        finished: list[_Sequence] = []
        for seq, rid, outcome in returned:
            del running[rid]
            if isinstance(outcome, Exception):
                raise outcome
            token_ids, logprobs, version, reason = outcome
            seq.response_ids += token_ids
            seq.logprobs += logprobs
            seq.versions += [version] * len(token_ids)
            ids = seq.response_ids
            complete = len(ids) >= params.max_new_tokens or bool(
                ids and ids[-1] == self.eos_token_id
            )
            if reason == "abort":
                if seq.sent_in_epoch == self._epoch:
                    raise SglangError(
                        f"SGLang aborted request {seq.request.request_id!r} (id {rid}) although "
                        "this engine did not pause the server; is another client controlling it?"
                    )
                if not complete:
                    waiting.append(seq)  # resumed as a continuation under the new weights
                    self.num_continuations += 1
                    continue
                reason = "stop" if ids and ids[-1] == self.eos_token_id else "length"
            seq.finish_reason = reason
            finished.append(seq)
        return finished

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
        return GenerationResult(
            request_id=seq.request.request_id,
            response_ids=seq.response_ids,
            logprobs=seq.logprobs,
            versions=seq.versions,
            finish_reason=seq.finish_reason,  # type: ignore[arg-type]
        )

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


def make_sglang_engine(ctx: RunContext) -> SglangEngine:
    """The engine `rollout.engine=sglang` asks for, from the run's config."""
    from streamrl.models.loading import load_tokenizer

    r = ctx.cfg.rollout
    settings = SglangSettings(
        url=r.sglang_url,
        launch_cmd=tuple(r.sglang_launch_cmd or DEFAULT_LAUNCH_CMD),
        launch_args=tuple(r.sglang_launch_args),
        dtype=ctx.cfg.model.dtype if r.sglang_dtype == "auto" else r.sglang_dtype,
        deterministic=r.sglang_deterministic,
        max_running_requests=r.max_batch_size,
        startup_timeout_s=r.sglang_startup_timeout_s,
        request_timeout_s=r.sglang_request_timeout_s,
        weights_dir=r.sglang_weights_dir or Path(ctx.run_dir) / "sglang",
    )
    eos_token_id = load_tokenizer(ctx.policy_dir).eos_token_id
    return SglangEngine(ctx.policy_dir, eos_token_id=eos_token_id, settings=settings)


def request_seed(seed: int, key: str) -> int:
    """SGLang's per-request `sampling_seed`: a stable 63-bit hash of (run seed, request key)."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _parse_output(response: Any, sent_version: int, engine: SglangEngine) -> _Output:
    """(token ids, log-probs, policy version, finish type) of one /generate response."""
    try:
        meta = response["meta_info"]
        pairs = meta["output_token_logprobs"]  # [[logprob, token id, text or null], ...]
        token_ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
        reason = meta["finish_reason"]["type"]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise SglangError(
            f"unexpected /generate response from {engine.url} (missing or malformed "
            f"meta_info.output_token_logprobs or finish_reason): {str(response)[:500]}"
        ) from e
    if reason not in ("stop", "length", "abort"):
        raise SglangError(f"SGLang finished a request with unknown reason {meta['finish_reason']}")
    version = sent_version
    reported = meta.get("weight_version")
    if engine.num_weight_updates > 0 and isinstance(reported, str) and reported.isdigit():
        version = int(reported)  # exact even when the response crossed a weight update
    return token_ids, logprobs, version, reason


def _error_message(body: bytes) -> str:
    """SGLang's error text from a response body (JSON `error.message`, `message`, or raw)."""
    text = body.decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:1000]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("error", "message", "detail"):
            if key in data:
                return str(data[key])
    return text[:1000]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_server(
    model_dir: Path, settings: SglangSettings, log_dir: Path
) -> tuple[subprocess.Popen, str]:
    """Start a server on a free local port and wait until /health answers; return it and its URL."""
    port = _free_port()
    cmd = [
        *settings.launch_cmd,
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        settings.dtype,
        "--max-running-requests",
        str(settings.max_running_requests),
    ]
    if settings.deterministic:
        cmd.append("--enable-deterministic-inference")
    cmd += list(settings.launch_args)
    log_path = log_dir / "sglang_server.log"
    with open(log_path, "ab") as log:
        # Its own process group, so that close() stops SGLang's worker processes too.
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with open(log_path, "a") as log:  # who to stop by hand if this process dies unannounced
        print(f"streamrl: started process group {server.pid}: {' '.join(cmd)}", file=log)
    url = f"http://127.0.0.1:{port}"
    client = SglangClient(url, timeout_s=5.0)
    deadline = time.monotonic() + settings.startup_timeout_s
    while not client.healthy():
        if server.poll() is not None:
            raise SglangError(
                f"the SGLang server exited with code {server.returncode} before answering "
                f"/health; command: {' '.join(cmd)}; last lines of {log_path}:\n{_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            _stop_process_group(server)
            raise SglangError(
                f"the SGLang server did not answer /health within {settings.startup_timeout_s} s "
                "(raise rollout.sglang_startup_timeout_s if it is still loading); last lines of "
                f"{log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.5)
    return server, url


def _stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group `process` leads, then SIGKILL it if it outlives `grace_s`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the leader, if still there, and any stragglers
    except ProcessLookupError:
        pass  # the whole group has exited: nothing left to stop
    process.wait()


def _tail(path: Path, num_lines: int = 30) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])

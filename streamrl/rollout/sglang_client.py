"""Talking to an SGLang server process: the HTTP client, launching and stopping a server, and
the torch.distributed group that carries weights to its workers
(`/update_weights_from_distributed`). `sglang_engine.py` builds the Engine protocol on these."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamrl.config.schema import SglangConfig

log = logging.getLogger(__name__)

DEFAULT_LAUNCH_CMD = (sys.executable, "-m", "sglang.launch_server")
"""What starts a server when `rollout.sglang.launch_cmd` is None: SGLang with this interpreter."""


class SglangError(RuntimeError):
    """The SGLang server could not be reached, failed to start, or answered with an error
    (`status`: the HTTP status, when there was one)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


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
                    f"{reason}); is it running? Check rollout.sglang.url, or leave it unset to "
                    "launch a server"
                ) from e
            raise SglangError(
                f"the SGLang server at {self.base_url} did not answer {method} {path}: {reason} "
                f"(did it crash? Its time limit is rollout.sglang.request_timeout_s, "
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


class BackgroundCall:
    """One HTTP call on a thread of its own, while this thread takes part in collectives."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # raised again by result()
            self._error = e

    def failed(self) -> BaseException | None:
        """The call's error if it already failed, else None."""
        return self._error if not self._thread.is_alive() else None

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class WeightGroup:
    """Rank 0 of a torch.distributed group shared with an SGLang server's workers, made without
    touching the default process group. Its store keys are laid out as the server's side makes
    them (torch's tcp:// rendezvous, then `PrefixStore(group_name)` and the prefixes of torch's
    `_new_process_group_helper`: `<group_name>/` and the device type), so both ends meet."""

    def __init__(self, name: str, backend: str, store: Any, world_size: int, timeout_s: float):
        import torch

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not cuda_available():
            raise ValueError("weight sync backend 'nccl' needs CUDA in this process; use 'gloo'")
        self.name, self.backend, self.store = name, backend, store
        self.world_size, self.timeout_s = world_size, timeout_s
        self.port = int(store.port)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self.pg: Any = None

    @classmethod
    def serve(
        cls, name: str, backend: str, address: str, port: int, world_size: int, timeout_s: float
    ) -> WeightGroup:
        """Serve the group's TCP store (port 0: a free one) without waiting for anyone.

        The store listens on `address` only: torch's TCPStore binds every interface whatever
        host it is given, so it is handed a socket bound here (`master_listen_fd`). It still
        admits whoever reaches that address (SGLang's workers join with torch's own store
        client, which has no token): keep `rollout.sglang.weight_sync_address` on a network you
        trust."""
        from datetime import timedelta

        import torch.distributed as dist

        listener = socket.create_server((address, port), family=_family(address))
        bound = listener.getsockname()[1]
        fd = listener.detach()  # the store owns the socket from here (and closes it)
        try:
            store = dist.TCPStore(
                address,
                bound,
                world_size,
                True,
                timedelta(seconds=timeout_s),
                wait_for_workers=False,
                master_listen_fd=fd,
            )
        except BaseException:
            os.close(fd)
            raise
        return cls(name, backend, store, world_size, timeout_s)

    def join(self, call: BackgroundCall) -> None:
        """Join as rank 0; blocks until every rank joined. Fails early if `call` (the request
        that makes the server join) fails."""
        from datetime import timedelta

        import torch.distributed as dist

        from streamrl.weights.collective import release_at_exit

        timeout = timedelta(seconds=self.timeout_s)
        store = dist.PrefixStore(self.name, self.store)
        store = dist.PrefixStore(f"{self.name}/", store)
        device_type = "cuda" if self.backend == "nccl" else "cpu"
        store = dist.PrefixStore(f"{device_type}/", store)
        made: list[Any] = []
        errors: list[BaseException] = []

        def make() -> None:
            try:
                if self.backend == "gloo":
                    made.append(dist.ProcessGroupGloo(store, 0, self.world_size, timeout))
                else:
                    options = dist.ProcessGroupNCCL.Options()
                    options._timeout = timeout
                    made.append(dist.ProcessGroupNCCL(store, 0, self.world_size, options))
            except BaseException as e:
                errors.append(e)

        # Gloo connects every rank in its constructor: make it on a thread, so that a failed
        # /init_weights_update_group shows at once instead of after the rendezvous timeout.
        thread = threading.Thread(target=make, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.01)
            error = call.failed()
            if error is not None:
                raise error
        if errors:
            error = call.failed()
            if error is not None:
                raise error
            raise SglangError(
                f"the SGLang server did not join the weight update group {self.name} "
                f"({self.world_size} ranks, backend {self.backend}, port {self.port}) within "
                f"{self.timeout_s:g} s; can it reach this process? ({errors[0]})"
            ) from errors[0]
        self.pg = made[0]
        release_at_exit(self)

    def release(self) -> None:
        """Destroy this end of the group now, not during interpreter shutdown."""
        self.pg = None

    def broadcast(self, tensor: Any) -> Any:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.pg.broadcast([tensor.contiguous()], options)

    def wait(self, works: list[Any], call: BackgroundCall, what: str) -> None:
        """Wait for the broadcasts; if `call` (the server's side) fails first, raise its error
        rather than wait for the collective timeout."""
        deadline = time.monotonic() + self.timeout_s
        for work in works:
            while not work.is_completed():
                error = call.failed()
                if error is not None:
                    raise error
                if time.monotonic() > deadline:
                    raise SglangError(
                        f"broadcasting {what} to the SGLang server timed out after "
                        f"{self.timeout_s:g} s (weight update group {self.name})"
                    )
                time.sleep(0.001)
            work.wait()


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def address_toward(url: str) -> str:
    """This machine's address on the route to `url`'s host (no packet is sent)."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(
    model_dir: Path,
    config: SglangConfig,
    log_dir: Path,
    *,
    dtype: str,
    max_running_requests: int,
    extra_args: Sequence[str] = (),
) -> tuple[subprocess.Popen, str]:
    """Start a server (`rollout.sglang`'s launch command and arguments, in `dtype`, at most
    `max_running_requests` at once, with `extra_args` before the configured ones) on a free local
    port and wait until /health answers; return it and its URL."""
    port = free_port()
    cmd = [
        *(config.launch_cmd or DEFAULT_LAUNCH_CMD),
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-running-requests",
        str(max_running_requests),
    ]
    if config.deterministic:
        cmd.append("--enable-deterministic-inference")
    cmd += [*extra_args, *config.launch_args]
    log_path = log_dir / "sglang_server.log"
    with open(log_path, "ab") as log:
        # Its own process group, so that close() stops SGLang's worker processes too.
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with open(log_path, "a") as log:  # who to stop by hand if this process dies unannounced
        print(f"streamrl: started process group {server.pid}: {' '.join(cmd)}", file=log)
    url = f"http://127.0.0.1:{port}"
    client = SglangClient(url, timeout_s=5.0)
    deadline = time.monotonic() + config.startup_timeout_s
    while not client.healthy():
        if server.poll() is not None:
            raise SglangError(
                f"the SGLang server exited with code {server.returncode} before answering "
                f"/health; command: {' '.join(cmd)}; last lines of {log_path}:\n{tail_of(log_path)}"
            )
        if time.monotonic() > deadline:
            stop_process_group(server)
            raise SglangError(
                f"the SGLang server did not answer /health within {config.startup_timeout_s} s "
                "(raise rollout.sglang.startup_timeout_s if it is still loading); last lines of "
                f"{log_path}:\n{tail_of(log_path)}"
            )
        time.sleep(0.5)
    return server, url


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
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


def tail_of(path: Path, num_lines: int = 30) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


def _family(address: str) -> socket.AddressFamily:
    """The address family of a listening address (a host name: its first address's)."""
    return socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][0]

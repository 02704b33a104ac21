"""The tcp weight channel as picklable handles, so the runtime can hand them to role processes.

`TcpPublisher` (a `WeightPublisher`) goes to the trainer: the first call starts a
`TcpWeightServer` in the trainer's process (the DCS: it keeps the latest version in host memory
and streams it to any engine that asks). `TcpSubscriber` (a `WeightSubscriber`) goes to every
other role: it connects on first use. Only the address and the token travel when a handle is
pickled; sockets and threads are created where it is used. Following versions (`latest_version`,
`wait_newer`, the feeder's calls) needs no torch.

The server lives and dies with the trainer's process. A trainer restarted in place serves again
on the same port, so a subscriber rides out a lost server for `outage_s`: meanwhile it reports
nothing newer (and the last version it saw) and tries a new connection at most once a second.
The server cannot block a client until a publish: `wait_newer` asks for the version every
POLL_S.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from streamrl.api.weights import poll_newer
from streamrl.weights.tcp import MAX_CONNECTIONS, TcpWeightClient, TcpWeightServer

log = logging.getLogger(__name__)

TOKEN_ENV = "STREAMRL_WEIGHT_TOKEN"
RECONNECT_S = 1.0
POLL_S = 0.05  # how often `wait_newer` asks the server for its version


def resolve_token(token: str | None) -> str | None:
    """The configured token, else the one in $STREAMRL_WEIGHT_TOKEN (keeps it out of configs)."""
    return token or os.environ.get(TOKEN_ENV) or None


class TcpPublisher:
    def __init__(
        self, host: str, port: int, token: str | None, *, max_connections: int = MAX_CONNECTIONS
    ):
        self.host, self.port, self.token = host, port, token
        self.max_connections = max_connections
        self._server: TcpWeightServer | None = None

    def _live(self) -> TcpWeightServer:
        if self._server is None:
            self._server = TcpWeightServer(
                self.host, self.port, token=self.token, max_connections=self.max_connections
            )
        return self._server

    @property
    def address(self) -> tuple[str, int]:
        return self._live().address

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        self._live().publish(version, named_tensors)

    def latest_version(self) -> int:
        return self._live().latest_version()

    def close(self) -> None:
        """Stop serving (what the trainer's exit does); publishing again serves anew."""
        if self._server is not None:
            self._server.close()
            self._server = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_server": None}


class TcpSubscriber:
    """One connection, used by one call at a time: a thread's `wait_newer` waits at most one
    request (or one version's transfer) for another's `fetch_newer`."""

    def __init__(self, host: str, port: int, token: str | None, outage_s: float = 300.0):
        self.host, self.port, self.token, self.outage_s = host, port, token, outage_s
        self._client: TcpWeightClient | None = None
        self._last_version = -1
        self._down_since: float | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def latest_version(self) -> int:
        with self._lock:
            self._last_version = self._call(lambda c: c.latest_version(), self._last_version)
            return self._last_version

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, Any]] | None:
        with self._lock:
            found = self._call(lambda c: c.fetch_newer(have_version), None)
            if found is not None:
                self._last_version = found[0]
            return found

    def wait_newer(self, have_version: int, timeout_s: float) -> int:
        return poll_newer(self.latest_version, have_version, timeout_s, POLL_S)

    def _call(self, request: Callable[[TcpWeightClient], Any], fallback: Any) -> Any:
        """`request` on the live connection; `fallback` while the server is unreachable.
        The caller holds `_lock`."""
        now = time.monotonic()
        if self._down_since is not None and now < self._next_try:
            return fallback
        try:
            if self._client is None:
                self._client = TcpWeightClient(self.host, self.port, token=self.token)
            result = request(self._client)
        except OSError as e:  # refused, reset, timed out: the trainer's process is gone
            if self._client is not None:
                self._client.close()
                self._client = None
            if self._down_since is None:
                self._down_since = now
                log.warning(
                    "weight server %s:%d unreachable (%s); retrying for up to %.0fs (a trainer "
                    "restarted in place serves on the same port)",
                    self.host,
                    self.port,
                    e,
                    self.outage_s,
                )
            if now - self._down_since > self.outage_s:
                raise ConnectionError(
                    f"weight server {self.host}:{self.port} unreachable for {self.outage_s:.0f}s"
                ) from e
            self._next_try = now + RECONNECT_S
            return fallback
        if self._down_since is not None:
            log.info(
                "weight server %s:%d back after %.1fs", self.host, self.port, now - self._down_since
            )
            self._down_since = None
        return result

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_client": None, "_down_since": None}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

"""The tcp weight channel as picklable handles, so the runtime can hand them to role processes.

`TcpPublisher` goes to the trainer: the first call starts a `TcpWeightServer` in the trainer's
process (the DCS: it keeps the latest version in host memory and streams it to any engine that
asks). `TcpSubscriber` goes to every other role: it connects on first use. Only the address and
the token travel when a handle is pickled; sockets and threads are created where it is used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from streamrl.weights.tcp import TcpWeightClient, TcpWeightServer

TOKEN_ENV = "STREAMRL_WEIGHT_TOKEN"


def resolve_token(token: str | None) -> str | None:
    """The configured token, else the one in $STREAMRL_WEIGHT_TOKEN (keeps it out of configs)."""
    return token or os.environ.get(TOKEN_ENV) or None


class TcpPublisher:
    def __init__(self, host: str, port: int, token: str | None):
        self.host, self.port, self.token = host, port, token
        self._server: TcpWeightServer | None = None

    def _live(self) -> TcpWeightServer:
        if self._server is None:
            self._server = TcpWeightServer(self.host, self.port, token=self.token)
        return self._server

    @property
    def address(self) -> tuple[str, int]:
        return self._live().address

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        self._live().publish(version, named_tensors)

    def latest_version(self) -> int:
        return self._live().latest_version()

    def fetch_newer(self, have_version: int):
        return self._live().fetch_newer(have_version)

    def __getstate__(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "token": self.token, "_server": None}


class TcpSubscriber:
    def __init__(self, host: str, port: int, token: str | None):
        self.host, self.port, self.token = host, port, token
        self._client: TcpWeightClient | None = None

    def _live(self) -> TcpWeightClient:
        if self._client is None:
            self._client = TcpWeightClient(self.host, self.port, token=self.token)
        return self._client

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        raise RuntimeError("only the trainer publishes weights (this role holds a subscriber)")

    def latest_version(self) -> int:
        return self._live().latest_version()

    def fetch_newer(self, have_version: int):
        return self._live().fetch_newer(have_version)

    def __getstate__(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "token": self.token, "_client": None}

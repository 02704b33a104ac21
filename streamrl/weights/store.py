"""The collective weight group's rendezvous store: a torch.distributed `Store` that the sender
serves itself, on the configured address only, behind the tcp channel's token check.

Why not torch's `TCPStore`: it has no authentication (anyone who reaches its port reads and
writes every key, so could take a rank's place or learn where the others listen), and its
server listens on every interface whatever host it is given. (Its `master_listen_fd` argument
would fix the second, not the first.) `FileStore` and `HashStore` only work where every member
shares a machine (or a file system), and the group may span nodes. So the sender runs a
`StoreServer` (an `AuthenticatedServer` from `weights/tcp.py`: the same listener, connection cap
and HMAC handshake as the tcp weight server, under a magic of its own), and uses the table in
process (`LocalStore`); each member connects with `RemoteStore`, which proves the token before
any key is read or written. A member with another token is refused at connect
(PermissionError), never learns a key, and so never joins the group.

Wire protocol, after the handshake (integers big-endian; no pickle, only byte strings):

    request  op (1 B) + field count (I) + fields, each length (I) + bytes
    reply    status (1 B: 0 ok, 1 timed out, 2 refused) + field count (I) + fields

Ops: S set(key, value), G get(key, timeout_ms), A add(key, delta), C check(keys...),
W wait(timeout_ms, keys...), X compare_set(key, expected, desired), D delete_key(key),
N num_keys(). Integers travel as decimal ASCII, as TCPStore stores a counter.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from streamrl.weights.tcp import (
    MAX_CONNECTIONS,
    AuthenticatedServer,
    _recv,
    authenticate,
)

_MAGIC = b"SRS1"
_HEAD = struct.Struct("!cI")  # op or status, field count
_LEN = struct.Struct("!I")
_MAX_FIELDS = 4096
_MAX_REQUEST_BYTES = 64 * 2**20
_OK, _TIMED_OUT, _ERROR = b"\x00", b"\x01", b"\x02"
DEFAULT_TIMEOUT = timedelta(seconds=300)


def _ms(timeout: timedelta) -> int:
    return max(int(timeout.total_seconds() * 1000), 0)


class _Table:
    """The keys and values, with a condition for the blocking `get` and `wait`."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key exists; False after `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(
                lambda: all(k in self._values for k in keys), max(timeout_s, 0.0)
            )

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, max(timeout_s, 0.0)):
                return None
            return self._values[key]

    def add(self, key: str, delta: int) -> int:
        with self._changed:
            value = int(self._values.get(key, b"0")) + delta
            self._values[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def check(self, keys: Sequence[str]) -> bool:
        with self._changed:
            return all(k in self._values for k in keys)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's semantics: set `desired` if the value is `expected` (a missing key counts
        as b""); return the value held afterwards (or `expected` for a missing key)."""
        with self._changed:
            current = self._values.get(key)
            if current is None:
                if expected == b"":
                    self._values[key] = desired
                    self._changed.notify_all()
                    return desired
                return expected
            if current == expected:
                self._values[key] = desired
                self._changed.notify_all()
                return desired
            return current

    def delete(self, key: str) -> bool:
        with self._changed:
            return self._values.pop(key, None) is not None

    def __len__(self) -> int:
        with self._changed:
            return len(self._values)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _timed_out(keys: Sequence[str], timeout: timedelta, where: str) -> dist.DistStoreError:
    return dist.DistStoreError(
        f"wait for {list(keys)} in the weight-sync store {where} timed out after "
        f"{timeout.total_seconds():g} s"
    )


class StoreServer(AuthenticatedServer):
    """Serves a `_Table` to the group's members (see the module doc); `store()` is the
    sender's own `dist.Store` on it. Binds `host` only."""

    magic = _MAGIC
    what = "serve the weight-sync rendezvous store"

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.table = _Table()
        super().__init__(host, port, token=token, max_connections=max_connections)

    def store(self, timeout: timedelta = DEFAULT_TIMEOUT) -> LocalStore:
        return LocalStore(self, timeout)

    def _serve_requests(self, conn: socket.socket) -> None:
        while True:
            conn.settimeout(None)  # a member idles between publishes as long as it likes
            head = bytearray(_HEAD.size)
            if conn.recv_into(head, len(head), socket.MSG_WAITALL) < len(head):
                return  # the member closed its connection
            op, count = _HEAD.unpack(head)
            conn.settimeout(60.0)
            if count > _MAX_FIELDS:
                return
            fields, total = [], 0
            for _ in range(count):
                (length,) = _LEN.unpack(_recv(conn, _LEN.size, "a request"))
                total += length
                if total > _MAX_REQUEST_BYTES:
                    return
                fields.append(_recv(conn, length, "a request"))
            status, reply = self._answer(op, fields)
            conn.sendall(_encode(status, reply))

    def _answer(self, op: bytes, fields: list[bytes]) -> tuple[bytes, list[bytes]]:
        table = self.table
        try:
            if op == b"S":
                table.set(fields[0].decode(), fields[1])
                return _OK, []
            if op == b"G":
                value = table.get(fields[0].decode(), int(fields[1]) / 1000)
                return (_TIMED_OUT, []) if value is None else (_OK, [value])
            if op == b"A":
                return _OK, [str(table.add(fields[0].decode(), int(fields[1]))).encode()]
            if op == b"C":
                return _OK, [b"1" if table.check([f.decode() for f in fields]) else b"0"]
            if op == b"W":
                keys = [f.decode() for f in fields[1:]]
                return (_OK, []) if table.wait(keys, int(fields[0]) / 1000) else (_TIMED_OUT, [])
            if op == b"X":
                return _OK, [table.compare_set(fields[0].decode(), fields[1], fields[2])]
            if op == b"D":
                return _OK, [b"1" if table.delete(fields[0].decode()) else b"0"]
            if op == b"N":
                return _OK, [str(len(table)).encode()]
        except (IndexError, ValueError, UnicodeDecodeError):
            pass
        return _ERROR, []


def _encode(op: bytes, fields: Sequence[bytes]) -> bytes:
    parts = [_HEAD.pack(op, len(fields))]
    for field in fields:
        parts += [_LEN.pack(len(field)), field]
    return b"".join(parts)


class LocalStore(dist.Store):
    """The sender's `dist.Store`: the served table itself, no socket."""

    def __init__(self, server: StoreServer, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self.server, self._table, self._timeout = server, server.table, timeout
        self.where = f"{server.address[0]}:{server.address[1]}"

    def set(self, key: str, value: bytes | str) -> None:
        self._table.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        value = self._table.get(key, self._timeout.total_seconds())
        if value is None:
            raise _timed_out([key], self._timeout, self.where)
        return value

    def add(self, key: str, value: int) -> int:
        return self._table.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._table.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        if not self._table.wait(keys, timeout.total_seconds()):
            raise _timed_out(keys, timeout, self.where)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._table.compare_set(key, _bytes(expected), _bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self._table.delete(key)

    def num_keys(self) -> int:
        return len(self._table)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def clone(self) -> LocalStore:
        return LocalStore(self.server, self._timeout)

    def has_extended_api(self) -> bool:
        return False


class RemoteStore(dist.Store):
    """A member's `dist.Store`: one authenticated connection to the sender's `StoreServer`,
    one request at a time. Connecting raises PermissionError when the server holds another
    token, `ServerFull` when it is at its connection cap."""

    def __init__(
        self, host: str, port: int, *, token: str | None, timeout: timedelta = DEFAULT_TIMEOUT
    ) -> None:
        super().__init__()
        self.host, self.port, self._token, self._timeout = host, port, token, timeout
        self.where = f"{host}:{port}"
        self._lock = threading.Lock()
        self._sock = self._connect(timeout)
        self.local_address: str = self._sock.getsockname()[0]  # this side's interface to it

    def _connect(self, timeout: timedelta) -> socket.socket:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:  # the sender may not listen yet: retry, as TCPStore does
            try:
                sock = socket.create_connection((self.host, self.port), timeout=10.0)
                break
            except (ConnectionRefusedError, TimeoutError) as e:
                if time.monotonic() > deadline:
                    raise dist.DistNetworkError(
                        f"no weight-sync store listening at {self.where} within "
                        f"{timeout.total_seconds():g} s ({e})"
                    ) from e
                time.sleep(0.1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            authenticate(
                sock, (self._token or "").encode(), _MAGIC, f"weight-sync store {self.where}"
            )
        except BaseException:
            sock.close()
            raise
        return sock

    def _call(self, op: bytes, fields: Sequence[bytes], wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            if self._sock is None:
                raise dist.DistNetworkError(f"the weight-sync store {self.where} is closed")
            try:
                self._sock.settimeout(wait_s + 60.0)
                self._sock.sendall(_encode(op, fields))
                status, count = _HEAD.unpack(_recv(self._sock, _HEAD.size, "the store's reply"))
                reply = []
                for _ in range(count):
                    (length,) = _LEN.unpack(_recv(self._sock, _LEN.size, "the store's reply"))
                    reply.append(_recv(self._sock, length, "the store's reply"))
            except OSError as e:
                raise dist.DistNetworkError(f"lost the weight-sync store {self.where}: {e}") from e
        if status == _TIMED_OUT:
            raise dist.DistStoreError(f"timed out in the weight-sync store {self.where}")
        if status != _OK:
            raise dist.DistStoreError(f"the weight-sync store {self.where} refused request {op!r}")
        return reply

    def set(self, key: str, value: bytes | str) -> None:
        self._call(b"S", [key.encode(), _bytes(value)])

    def get(self, key: str) -> bytes:
        wait_s = self._timeout.total_seconds()
        try:
            return self._call(b"G", [key.encode(), str(_ms(self._timeout)).encode()], wait_s)[0]
        except dist.DistStoreError as e:
            raise _timed_out([key], self._timeout, self.where) from e

    def add(self, key: str, value: int) -> int:
        return int(self._call(b"A", [key.encode(), str(int(value)).encode()])[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(b"C", [k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        fields = [str(_ms(timeout)).encode()] + [k.encode() for k in keys]
        try:
            self._call(b"W", fields, timeout.total_seconds())
        except dist.DistStoreError as e:
            raise _timed_out(keys, timeout, self.where) from e

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(b"X", [key.encode(), _bytes(expected), _bytes(desired)])[0]

    def delete_key(self, key: str) -> bool:
        return self._call(b"D", [key.encode()])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(b"N", [])[0])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def clone(self) -> RemoteStore:
        return RemoteStore(self.host, self.port, token=self._token, timeout=self._timeout)

    def has_extended_api(self) -> bool:
        return False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

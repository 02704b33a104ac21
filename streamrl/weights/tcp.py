"""The `tcp` weight channel: a DCS server holding the latest version, streaming it to any client.

The server runs in (or beside) the trainer's process. `publish` writes each bucket once into a
safetensors blob in host memory; serving a client is then only `sendall` of those blobs, so any
number of engines, including one that starts or restarts long after the publish, get the
current weights without a disk checkpoint. A publish during a transfer does not disturb it: the
transfer keeps the version it started with. Nothing on the wire is pickled: JSON headers and
safetensors blobs only. Torch is imported only where tensors are made or read: a client that
only asks versions (the feeder's) never imports it.

Wire protocol (one TCP connection per client, many requests per connection; integers big-endian):

    client                                    server
                                  ◄─────────  "+" (a slot is free), or "-" + message length (H) +
                                              UTF-8 message (full: `max_connections` held), closed
    "SRW2" + client nonce (32 B)  ─────────►
                                  ◄─────────  server nonce (32 B) + HMAC(token, "server" + client nonce)
    HMAC(token, "client" + server nonce) ──►
                                  ◄─────────  1 byte: 1 accepted / 0 rejected (then closed)
    "V" + have_version (q)        ─────────►
                                  ◄─────────  latest version (q)
    "F" + have_version (q)        ─────────►
                                  ◄─────────  version (q) + header length (I), 0 when nothing newer
                                  ◄─────────  header JSON {version, layout, bucket_nbytes}
                                  ◄─────────  bucket blobs (safetensors), back to back

HMAC-SHA256 over fresh nonces proves each side holds the shared token without sending it. With
no token the same handshake runs with an empty key, which is why the server binds to loopback
only unless it is given a token (`require_token_beyond_loopback`).

The listening, the cap on connections and the handshake are `AuthenticatedServer`'s and
`authenticate` 's, which the collective channel's rendezvous store (`weights/store.py`) shares
under a magic of its own: one token check for both channels.
"""

from __future__ import annotations

import abc
import hmac
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from hashlib import sha256
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_MAGIC = b"SRW2"
_NONCE_BYTES = 32
_ACCEPTED, _REJECTED = b"\x01", b"\x00"
_READY, _FULL = b"+", b"-"
_FULL_MESSAGE = struct.Struct("!H")
HANDSHAKE_TIMEOUT_S = 10.0  # a client that does not prove its token by then loses its slot
MAX_CONNECTIONS = 64
_OP_VERSION, _OP_FETCH = b"V", b"F"
_REQUEST = struct.Struct("!cq")  # op, have_version
_VERSION = struct.Struct("!q")
_FETCH_REPLY = struct.Struct("!qI")  # version, header length (0: nothing newer)
_MAX_HEADER_BYTES = 2**28


def is_loopback(host: str) -> bool:
    """True if every address `host` resolves to is a loopback address."""
    if host in ("", "0.0.0.0", "::"):
        return False
    infos = socket.getaddrinfo(host, None)
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def require_token_beyond_loopback(host: str, token: str | None, what: str) -> None:
    """The project's rule: a service binds to loopback unless it holds a token its clients must
    prove. Raises ValueError naming `what` (e.g. "serve weights") when `host` breaks it."""
    if not token and not is_loopback(host):
        raise ValueError(
            f"refusing to {what} on non-loopback address {host!r} without a token: set "
            f"runtime.weights.token or $STREAMRL_WEIGHT_TOKEN (token=<shared secret>; every "
            f"client needs the same), or bind to 127.0.0.1"
        )


class ServerFull(ConnectionError):
    """The server holds its `max_connections` connections: this one was refused."""


def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, sha256).digest()


def authenticate(sock: socket.socket, key: bytes, magic: bytes, where: str) -> None:
    """Client side of the handshake on a fresh connection to an `AuthenticatedServer`: returns
    once the server accepted this client's proof of `key`. Raises ServerFull (the server is at
    its cap) or PermissionError (the other side holds a different token)."""
    status = _recv(sock, 1, f"the greeting of {where}")
    if status == _FULL:
        (length,) = _FULL_MESSAGE.unpack(_recv(sock, _FULL_MESSAGE.size, "the refusal"))
        message = _recv(sock, length, "the refusal").decode(errors="replace")
        raise ServerFull(f"{where} refused the connection: {message}")
    if status != _READY:
        raise ConnectionError(f"{where} is not a streamrl server (greeting {status!r})")
    client_nonce = os.urandom(_NONCE_BYTES)
    sock.sendall(magic + client_nonce)
    reply = _recv(sock, _NONCE_BYTES + sha256().digest_size, f"the challenge of {where}")
    server_nonce, proof = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"server", client_nonce)):
        raise PermissionError(
            f"{where} holds a different token than this client: give both the same token "
            f"(runtime.weights.token or $STREAMRL_WEIGHT_TOKEN)"
        )
    sock.sendall(_mac(key, b"client", server_nonce))
    if _recv(sock, 1, f"the verdict of {where}") != _ACCEPTED:
        raise PermissionError(f"{where} rejected this client's token")


def _recv_into(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill `view` from `sock`; a stream that ends early raises ConnectionError."""
    received = 0
    while received < len(view):
        n = sock.recv_into(view[received:])
        if n == 0:
            raise ConnectionError(
                f"weight stream truncated: got {received} of {len(view)} bytes of {what}; "
                f"the other side closed the connection (exited or restarted?)"
            )
        received += n


def _recv(sock: socket.socket, nbytes: int, what: str) -> bytes:
    buffer = bytearray(nbytes)
    _recv_into(sock, memoryview(buffer), what)
    return bytes(buffer)


@dataclass(frozen=True)
class _Snapshot:
    """One published version as it is served: JSON header and safetensors blobs."""

    version: int
    header: bytes
    blobs: list[torch.Tensor]
    tensors: dict[str, torch.Tensor]  # views into `blobs`, for `fetch_newer` in this process


class AuthenticatedServer(abc.ABC):
    """Listens on one address, admits a client once it proved the shared token (`authenticate`
    is the client side) and serves each admitted connection in a thread of its own, at most
    `max_connections` at once: past that a connection is told so and closed, and a connection
    that ends (closed, dropped, refused) frees its slot. Subclasses serve the requests."""

    magic = b""  # what a client of this kind of server sends first
    what = "serve"  # for the loopback rule's message

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        require_token_beyond_loopback(host, token, self.what)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.refused: list[tuple] = []  # peers whose token check failed (either side), oldest first
        self._key = (token or "").encode()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"{type(self).__name__}-accept", daemon=True
        )
        self._accept_thread.start()

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def close(self) -> None:
        """Stop listening and drop every client connection."""
        self._closed = True
        _wake(self._listener)
        self._accept_thread.join()
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            _wake(conn)  # its serving thread closes it: closing here races that thread's use

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                raise
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                self._refuse_full(conn, peer)
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer), name="weight-client", daemon=True
            ).start()

    def _refuse_full(self, conn: socket.socket, peer: tuple) -> None:
        """Tell `conn` why it is refused and close it. The client reads before it writes, so
        nothing it sent is left unread (which would reset the connection, message unread)."""
        message = (
            f"{type(self).__name__} at {self.address[0]}:{self.address[1]} already holds "
            f"{self.max_connections} connections (runtime.weights.max_connections); "
            f"try again once one closes"
        ).encode()
        log.warning("refused %s: %d connections held", peer, self.max_connections)
        try:
            conn.settimeout(1.0)
            conn.sendall(_FULL + _FULL_MESSAGE.pack(len(message)) + message)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the client is gone already
        conn.close()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            with conn:
                if self._handshake(conn, peer):
                    self._serve_requests(conn)
        except OSError as e:  # ConnectionError, TimeoutError, or a socket shut down by close()
            if not self._closed:
                log.info("client %s of %s disconnected: %s", peer, type(self).__name__, e)
        finally:
            with self._lock:
                self._connections.discard(conn)

    def _handshake(self, conn: socket.socket, peer: tuple) -> bool:
        conn.settimeout(self.handshake_timeout_s)
        conn.sendall(_READY)
        hello = _recv(conn, len(self.magic) + _NONCE_BYTES, "the client hello")
        if not hello.startswith(self.magic):
            log.warning(
                "rejected connection from %s: not a client of %s", peer, type(self).__name__
            )
            return False
        server_nonce = os.urandom(_NONCE_BYTES)
        conn.sendall(server_nonce + _mac(self._key, b"server", hello[len(self.magic) :]))
        try:
            proof = _recv(conn, sha256().digest_size, "the client proof")
        except ConnectionError:  # the client found this server's proof wrong: another token
            log.warning("client %s of %s left at the token check", peer, type(self).__name__)
            with self._lock:
                self.refused.append(peer)
            return False
        if not hmac.compare_digest(proof, _mac(self._key, b"client", server_nonce)):
            log.warning("rejected client %s of %s: wrong token", peer, type(self).__name__)
            with self._lock:
                self.refused.append(peer)
            conn.sendall(_REJECTED)
            return False
        conn.sendall(_ACCEPTED)
        return True

    @abc.abstractmethod
    def _serve_requests(self, conn: socket.socket) -> None:
        """Answer an admitted client's requests on `conn` until it leaves."""


class TcpWeightServer(AuthenticatedServer):
    """The DCS over TCP: the trainer's `WeightPublisher`, and a `WeightSubscriber` for an
    engine in the server's own process; clients elsewhere connect with `TcpWeightClient`."""

    magic = _MAGIC
    what = "serve weights"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        bucket_bytes: int = 64 * 2**20,
        send_timeout_s: float = 60.0,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        """Listens at once (`port=0`: any free port, see `address`). Serving a non-loopback
        `host` needs a `token`, which every client must also hold. At most `max_connections`
        clients are connected at once."""
        self.bucket_bytes = bucket_bytes
        self.send_timeout_s = send_timeout_s
        self._snapshot: _Snapshot | None = None
        super().__init__(host, port, token=token, max_connections=max_connections)
        self._published = threading.Condition(self._lock)

    # -- WeightPublisher, WeightSubscriber ------------------------------------------------------

    def publish(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy `named_tensors` into host memory as the version served from now on."""
        from streamrl.weights.layout import Layout, from_safetensors, to_safetensors

        held = self.latest_version()
        if version <= held:
            raise ValueError(f"published version {version} is not newer than held version {held}")
        layout = Layout.plan(named_tensors, self.bucket_bytes)
        blobs = []
        for b in range(len(layout.buckets)):
            bucket = {spec.name: named_tensors[spec.name] for spec in layout.bucket_specs(b)}
            blobs.append(to_safetensors(bucket))
        header = {
            "version": version,
            "layout": layout.to_dict(),
            "bucket_nbytes": [blob.numel() for blob in blobs],
        }
        views: dict[str, torch.Tensor] = {}
        for blob in blobs:
            views.update(from_safetensors(blob))
        tensors = {spec.name: views[spec.name] for spec in layout.specs}  # publisher's order
        snapshot = _Snapshot(version, json.dumps(header).encode(), blobs, tensors)
        with self._published:
            self._snapshot = snapshot
            self._published.notify_all()

    def latest_version(self) -> int:
        snapshot = self._snapshot
        return -1 if snapshot is None else snapshot.version

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """For an engine in this process: views into the held blobs (read them, never write)."""
        snapshot = self._snapshot
        if snapshot is None or snapshot.version <= have_version:
            return None
        return snapshot.version, snapshot.tensors

    def wait_newer(self, have_version: int, timeout_s: float) -> int:
        """For an engine in this process: blocks until a publish wakes it."""
        with self._published:
            self._published.wait_for(
                lambda: self.latest_version() > have_version, max(timeout_s, 0.0)
            )
            return self.latest_version()

    def __enter__(self) -> TcpWeightServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ------------------------------------------------------------------------------

    def _serve_requests(self, conn: socket.socket) -> None:
        while True:
            conn.settimeout(None)  # an idle engine may keep its connection open indefinitely
            request = bytearray(_REQUEST.size)
            if conn.recv_into(request, len(request), socket.MSG_WAITALL) < len(request):
                return  # the client closed the connection
            op, have_version = _REQUEST.unpack(request)
            conn.settimeout(self.send_timeout_s)
            if op == _OP_VERSION:
                conn.sendall(_VERSION.pack(self.latest_version()))
            elif op == _OP_FETCH:
                self._send_newer(conn, have_version)
            else:
                log.warning("weight client sent unknown request %r; closing", op)
                return

    def _send_newer(self, conn: socket.socket, have_version: int) -> None:
        snapshot = self._snapshot  # held to the end of this transfer, whatever is published
        if snapshot is None or snapshot.version <= have_version:
            conn.sendall(_FETCH_REPLY.pack(self.latest_version(), 0))
            return
        conn.sendall(_FETCH_REPLY.pack(snapshot.version, len(snapshot.header)) + snapshot.header)
        for blob in snapshot.blobs:
            conn.sendall(memoryview(blob.numpy()))


def _wake(sock: socket.socket) -> None:
    """Wake any thread blocked on `sock` (close alone does not wake `accept` on Linux). The
    thread that uses it closes it: closing it here could hand its descriptor number to another
    socket while that thread still reads from it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already disconnected: nothing left to wake


def _receive_blob(sock: socket.socket, nbytes: int, what: str) -> dict[str, torch.Tensor]:
    import torch

    from streamrl.weights.layout import from_safetensors

    blob = torch.empty(nbytes, dtype=torch.uint8)  # no zero-fill: every byte is received
    _recv_into(sock, memoryview(blob.numpy()), what)
    return from_safetensors(blob)


def _receive_blob_into(
    sock: socket.socket, nbytes: int, into: Mapping[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """Read one safetensors blob from `sock`, each tensor's bytes into `into[name]`."""
    import torch

    from streamrl.weights.layout import as_flat, read_safetensors_header

    (header_len,) = struct.unpack("<Q", _recv(sock, 8, what))
    if 8 + header_len > nbytes:
        raise ConnectionError(f"{what}: safetensors header overruns the blob")
    entries = read_safetensors_header(_recv(sock, header_len, what), nbytes - 8 - header_len)
    received = {}
    for spec, _, _ in entries:
        dest = into[spec.name]
        if tuple(dest.shape) != spec.shape or dest.dtype != spec.dtype:
            raise ValueError(f"{what}: tensor {spec.name!r} differs from the announced layout")
        flat = as_flat(dest, spec.dtype, torch.device("cpu"))
        if flat is not None:
            _recv_into(sock, memoryview(flat.view(torch.uint8).numpy()), what)
        else:
            staged = torch.empty(spec.nbytes, dtype=torch.uint8)
            _recv_into(sock, memoryview(staged.numpy()), what)
            dest.detach().copy_(staged.view(spec.dtype).view(spec.shape))
        received[spec.name] = dest
    return received


class TcpWeightClient:
    """An engine's connection to a TcpWeightServer: `latest_version` and `fetch_newer`.

    Connects lazily and keeps the connection; if a kept connection turns out dead (the server
    restarted), the request is retried once on a fresh connection. Not for use by several
    threads at once.
    """

    def __init__(
        self, host: str, port: int, *, token: str | None = None, timeout_s: float = 30.0
    ) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self._key = (token or "").encode()
        self._sock: socket.socket | None = None

    def latest_version(self) -> int:
        (version,) = _VERSION.unpack(self._request(_OP_VERSION, -1, _VERSION.size))
        return version

    def fetch_newer(
        self, have_version: int, into: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The server's version if newer than `have_version`, else None (one round trip, no
        tensors move). Tensors come in the publisher's order.

        Without `into`, they are CPU views into freshly received blobs. With `into` (e.g. the
        engine model's state_dict, which must hold every published name with the same shape
        and dtype) each tensor's bytes go from the socket straight into its destination (via a
        CPU buffer for GPU or non-contiguous ones), and the destinations are returned.
        """
        reply = self._request(_OP_FETCH, have_version, _FETCH_REPLY.size)
        version, header_len = _FETCH_REPLY.unpack(reply)
        if header_len == 0:
            return None
        try:
            return version, self._receive_version(version, header_len, into)
        except BaseException:
            self.close()  # the stream is out of step now: never reuse it
            raise

    def _receive_version(
        self, version: int, header_len: int, into: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        from streamrl.weights.layout import Layout

        if header_len > _MAX_HEADER_BYTES:
            raise ConnectionError(f"weight server sent an implausible header of {header_len} B")
        sock = self._connected()
        header = json.loads(_recv(sock, header_len, f"the header of version {version}"))
        layout = Layout.from_dict(header["layout"])
        if into is not None:
            layout.check_fits(into)
        received: dict[str, torch.Tensor] = {}
        for b, nbytes in enumerate(header["bucket_nbytes"]):
            what = f"bucket {b} of version {version}"
            if into is None:
                received.update(_receive_blob(sock, nbytes, what))
            else:
                received.update(_receive_blob_into(sock, nbytes, into, what))
        if len(received) != len(layout.specs) or any(s.name not in received for s in layout.specs):
            raise ValueError(f"version {version} from the weight server is inconsistent")
        return {spec.name: received[spec.name] for spec in layout.specs}

    def _request(self, op: bytes, have_version: int, reply_bytes: int) -> bytes:
        """Send one request and read its fixed-size reply, retrying once on a stale connection."""
        reused = self._sock is not None
        try:
            return self._exchange(op, have_version, reply_bytes)
        except ConnectionError:
            self.close()
            if not reused:
                raise
        return self._exchange(op, have_version, reply_bytes)

    def _exchange(self, op: bytes, have_version: int, reply_bytes: int) -> bytes:
        sock = self._connected()
        try:
            sock.sendall(_REQUEST.pack(op, have_version))
            return _recv(sock, reply_bytes, "the reply")
        except TimeoutError as e:
            self.close()
            raise TimeoutError(
                f"weight server {self._where} did not answer in {self.timeout_s:g} s"
            ) from e

    def _connected(self) -> socket.socket:
        if self._sock is None:
            self._sock = self._connect()
        return self._sock

    @property
    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except ConnectionRefusedError as e:
            raise ConnectionRefusedError(
                f"no weight server listening at {self._where}: start the trainer's DCS "
                f"(TcpWeightServer) first, or check host and port"
            ) from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            authenticate(sock, self._key, _MAGIC, f"weight server {self._where}")
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> TcpWeightClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

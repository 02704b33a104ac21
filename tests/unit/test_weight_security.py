"""What the weight channels let in: the collective group's rendezvous store listens on the
configured address only and admits a member only with the trainer's token (the tcp channel's
check); neither channel serves beyond loopback without a token; the tcp weight server holds at
most `max_connections` connections, tells the one past it why, and serves again once one closes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from streamrl.weights.collective import CollectiveWeightReceiver, CollectiveWeightSender
from streamrl.weights.store import RemoteStore, StoreServer
from streamrl.weights.tcp import ServerFull, TcpWeightClient, TcpWeightServer


def until_no_connections(server, what: str) -> None:
    deadline = time.monotonic() + 10
    while server.num_connections:  # the server notices the end a moment after the client
        assert time.monotonic() < deadline, f"{what} kept its slot"
        time.sleep(0.01)


def listening_addresses(port: int) -> set[str]:
    """The local addresses of every socket listening on `port` (IPv4 and IPv6), from /proc."""
    found = set()
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(path).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if width == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_the_rendezvous_store_listens_on_the_configured_address_only() -> None:
    server = StoreServer("127.0.0.1", 0, token=None)
    try:
        assert listening_addresses(server.address[1]) == {"127.0.0.1"}
    finally:
        server.close()
    assert listening_addresses(server.address[1]) == set()  # closing stops listening


RECEIVER = """
import sys, torch
from streamrl.weights.collective import CollectiveWeightReceiver
receiver = CollectiveWeightReceiver(sys.argv[1], 2, 1, timeout_s=60, token="s3cret")
version, got = receiver.receive(timeout_s=60)
assert version == 1 and got["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
assert receiver.receive(timeout_s=60) is None  # the sender closed
"""


def test_the_group_listens_on_the_configured_address_only() -> None:
    """Every socket the sender's side of a group opens (the store's, gloo's) listens on the
    configured address, here 127.0.0.2 (not 127.0.0.1, where this machine's host name may
    resolve and gloo would listen by default; not every interface, as TCPStore would)."""
    import psutil

    def listening() -> set[tuple[str, int]]:
        return {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }

    before = listening()
    server = StoreServer("127.0.0.2", 0, token="s3cret")
    init_method = f"tcp://127.0.0.2:{server.address[1]}"
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, init_method])
    try:
        sender = CollectiveWeightSender(init_method, 2, timeout_s=60, store=server)
        opened = listening() - before
        assert len(opened) >= 2, f"expected the store's and gloo's listeners, got {opened}"
        assert {ip for ip, _ in opened} == {"127.0.0.2"}, opened
        sender.publish(1, {"w": torch.arange(4.0)})
        sender.close(wait_s=30)
        assert receiver.wait(timeout=60) == 0
    finally:
        receiver.kill()
        receiver.wait()


def test_a_member_with_a_wrong_token_is_refused_and_the_group_does_not_form() -> None:
    server = StoreServer("127.0.0.1", 0, token="right")
    init_method = f"tcp://127.0.0.1:{server.address[1]}"
    errors: list[BaseException] = []

    def send() -> None:
        try:
            CollectiveWeightSender(init_method, 2, timeout_s=3, store=server)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=send)
    thread.start()
    start = time.monotonic()
    with pytest.raises(PermissionError, match="refused rank 1: .*different token"):
        CollectiveWeightReceiver(init_method, 2, 1, timeout_s=3, token="wrong")
    assert time.monotonic() - start < 2.0  # refused at once, not after the timeout
    with pytest.raises(PermissionError, match="different token"):
        CollectiveWeightReceiver(init_method, 2, 1, timeout_s=3, token=None)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the sender hangs"
    (error,) = errors
    assert isinstance(error, TimeoutError)
    assert "2 connection(s) were refused for a wrong token" in str(error)


def test_the_store_refuses_a_wrong_token_before_any_key() -> None:
    server = StoreServer("127.0.0.1", 0, token="right")
    store = server.store()
    store.set("secret-key", b"value")
    try:
        with pytest.raises(PermissionError):
            RemoteStore("127.0.0.1", server.address[1], token="wrong")
        ok = RemoteStore("127.0.0.1", server.address[1], token="right")
        assert ok.get("secret-key") == b"value"
        assert ok.add("n", 2) == 2 and store.add("n", 1) == 3
        assert ok.compare_set("c", b"", b"x") == b"x" and ok.compare_set("c", b"y", b"z") == b"x"
        assert ok.check(["c", "n"]) and not ok.check(["missing"])
        ok.close()
        until_no_connections(server, "a closed member")
        assert server.refused
    finally:
        server.close()


def test_nothing_serves_beyond_loopback_without_a_token() -> None:
    with pytest.raises(ValueError, match="non-loopback address .* without a token"):
        StoreServer("0.0.0.0", 0, token=None)
    with pytest.raises(ValueError, match="non-loopback address .* without a token"):
        TcpWeightServer("0.0.0.0", 0)
    with pytest.raises(ValueError, match="non-loopback address .* without a token"):
        CollectiveWeightSender("tcp://192.0.2.1:1", 2, timeout_s=1)


def test_the_collective_publisher_needs_a_token_beyond_loopback() -> None:
    from streamrl.weights.collective_channel import CollectivePublisher

    with pytest.raises(ValueError, match="weight-sync group on non-loopback address"):
        CollectivePublisher(None, "0.0.0.0", 0)  # type: ignore[arg-type]
    CollectivePublisher(None, "0.0.0.0", 0, token="t")  # type: ignore[arg-type]
    CollectivePublisher(None, "127.0.0.1", 0)  # type: ignore[arg-type]


def test_tcp_server_refuses_past_its_cap_and_serves_again_once_one_closes() -> None:
    with TcpWeightServer(token="t", max_connections=2) as server:
        server.publish(1, {"w": torch.ones(3)})
        port = server.address[1]
        first = TcpWeightClient("127.0.0.1", port, token="t", timeout_s=5)
        second = TcpWeightClient("127.0.0.1", port, token="t", timeout_s=5)
        assert first.latest_version() == 1 and second.latest_version() == 1
        third = TcpWeightClient("127.0.0.1", port, token="t", timeout_s=5)
        start = time.monotonic()
        with pytest.raises(ServerFull, match="already holds 2 connections .*max_connections"):
            third.latest_version()
        assert time.monotonic() - start < 2.0  # told at once, no hang
        first.close()
        deadline = time.monotonic() + 10
        while server.num_connections > 1:  # the server notices the close
            assert time.monotonic() < deadline, "a closed connection kept its slot"
            time.sleep(0.01)
        assert third.latest_version() == 1  # the freed slot serves again
        second.close()
        third.close()


def test_refused_and_dropped_connections_free_their_slots() -> None:
    with TcpWeightServer(token="t", max_connections=1) as server:
        port = server.address[1]
        for _ in range(3):  # a wrong token, again and again: never holds the slot
            with pytest.raises(PermissionError):
                TcpWeightClient("127.0.0.1", port, token="x", timeout_s=5).latest_version()
            until_no_connections(server, "a refused connection")
        raw = socket.create_connection(("127.0.0.1", port))  # connects, then drops mid-handshake
        assert raw.recv(1) == b"+"
        raw.close()
        until_no_connections(server, "a dropped connection")
        with TcpWeightClient("127.0.0.1", port, token="t", timeout_s=5) as client:
            assert client.latest_version() == -1

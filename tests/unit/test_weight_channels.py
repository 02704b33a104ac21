"""Weight channels over the network: bucket layout and safetensors blobs, the `collective`
channel on gloo with two real processes, and the `tcp` DCS server and client on loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import safetensors.torch
import torch
import torch.multiprocessing as mp

from streamrl.weights.collective import CollectiveWeightReceiver, CollectiveWeightSender
from streamrl.weights.layout import Layout, from_safetensors, to_safetensors
from streamrl.weights.tcp import _FETCH_REPLY, TcpWeightClient, TcpWeightServer
from tests.distributed import free_port

BUCKET_BYTES = 64


def weights(version: int) -> dict[str, torch.Tensor]:
    """Tensors placed on the bucket boundaries of BUCKET_BYTES = 64, in several dtypes."""
    g = torch.Generator().manual_seed(version)
    return {
        "exact": torch.randn(16, generator=g),  # 64 B: fills a bucket exactly
        "half_a": torch.randn(2, 4, generator=g),  # 32 B + 32 B: share one bucket
        "half_b": torch.randn(8, generator=g),
        "over": torch.randn(9, generator=g),  # 36 B: the next 32 B overflow into a new bucket
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),  # another dtype between fp32 ones
        "after": torch.randn(8, generator=g),
        "big": torch.randn(10, 10, generator=g),  # 400 B: larger than a bucket, alone
        "scalar": torch.tensor(float(version)),
        "empty": torch.zeros(0, 3),
        "fp16": torch.randn(7, generator=g).half(),
        "steps": torch.arange(5, dtype=torch.int64) * version,
        "mask": torch.rand(6, generator=g) > 0.5,
        "no_ids": torch.zeros(0, dtype=torch.int32),  # a bucket of zero bytes
    }


def assert_same(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], ordered: bool = True
) -> None:
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# -- layout and blobs -------------------------------------------------------------------------


def test_plan_buckets_by_dtype_and_size() -> None:
    layout = Layout.plan(weights(1), BUCKET_BYTES, alone_bytes=256)
    names = [[layout.specs[i].name for i in bucket] for bucket in layout.buckets]
    assert names == [
        ["exact"],  # exactly full
        ["half_a", "half_b"],  # two halves fill one bucket
        ["over"],  # closed by "after", which would overflow it
        ["big"],  # at least alone_bytes: alone, at once
        ["after", "scalar", "empty"],
        ["bf16"],
        ["fp16"],
        ["steps"],
        ["mask"],
        ["no_ids"],
    ]
    for b in range(len(layout.buckets)):
        specs = layout.bucket_specs(b)
        assert len({s.dtype for s in specs}) == 1
        assert len(specs) == 1 or sum(s.nbytes for s in specs) <= BUCKET_BYTES
    assert Layout.from_dict(layout.to_dict()) == layout
    assert Layout.plan(weights(1), 10**6).buckets[0] == (0, 1, 2, 3, 5, 6, 7, 8)  # fp32 first


def test_layout_checks_destinations() -> None:
    layout = Layout.plan(weights(1), BUCKET_BYTES)
    layout.check_fits({**weights(2), "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="not received"):
        layout.check_fits({**weights(2), "extra": torch.zeros(1)}, require_all=True)
    with pytest.raises(ValueError, match="no destination"):
        layout.check_fits({k: v for k, v in weights(2).items() if k != "big"})
    with pytest.raises(ValueError, match="'big' is float32"):
        layout.check_fits({**weights(2), "big": torch.zeros(10, 11)})


def test_safetensors_blobs_interoperate_with_the_library() -> None:
    tensors = weights(3)
    blob = to_safetensors(tensors)
    assert_same(safetensors.torch.load(blob.numpy().tobytes()), tensors, ordered=False)
    library_blob = torch.frombuffer(bytearray(safetensors.torch.save(tensors)), dtype=torch.uint8)
    assert_same(from_safetensors(library_blob), tensors, ordered=False)
    assert_same(from_safetensors(blob), tensors, ordered=False)


# -- collective (gloo, two processes) ---------------------------------------------------------


def _collective_rank(rank: int, init_method: str) -> None:
    if rank == 0:
        _sender(init_method)
    else:
        _receiver(init_method)


def _sender(init_method: str) -> None:
    sender = CollectiveWeightSender(
        init_method, 2, bucket_bytes=BUCKET_BYTES, alone_bytes=256, timeout_s=30
    )
    for version in (1, 2, 3):
        sender.publish(version, weights(version))
    with pytest.raises(ValueError, match="not newer"):
        sender.publish(3, weights(3))
    sender.publish(5, weights(5))
    assert sender.latest_version() == 5
    sender.close()


def _receiver(init_method: str) -> None:
    receiver = CollectiveWeightReceiver(init_method, 2, 1, timeout_s=30, reference=weights(0))
    for version in (1, 2):
        got_version, got = receiver.receive(timeout_s=30)
        assert got_version == version
        assert_same(got, weights(version))
    # Into a model's tensors: in place where contiguous, through staging where not.
    model = {k: torch.full_like(v, 7) for k, v in weights(0).items()}
    model["big"] = torch.zeros(10, 10).t()
    version, got = receiver.receive(timeout_s=30, into=model)
    assert version == 3 and all(got[k] is model[k] for k in model)
    assert_same(got, weights(3))
    # Background thread: fetch_newer never blocks and sees version 5 once it is in.
    receiver.start()
    deadline = time.monotonic() + 30
    while (found := receiver.fetch_newer(3)) is None:
        assert time.monotonic() < deadline, "version 5 never arrived"
        time.sleep(0.01)
    assert found[0] == 5 and receiver.latest_version() == 5
    assert_same(dict(found[1]), weights(5))
    assert receiver.fetch_newer(5) is None
    receiver.close()  # the thread has ended: the sender closed


def test_collective_gloo_two_processes() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_collective_rank, args=(init_method,), nprocs=2, join=True)


def test_collective_rendezvous_timeout_is_clear() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match="rendezvous .* rank 0 of 2 .* 1 engine ranks"):
        CollectiveWeightSender(init_method, 2, timeout_s=1)


def test_collective_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tcp://host:port"):
        CollectiveWeightSender("127.0.0.1:29500", 2)
    with pytest.raises(ValueError, match="rank 0 is the sender"):
        CollectiveWeightReceiver("tcp://127.0.0.1:29500", 2, 0)
    with pytest.raises(ValueError, match="world_size >= 2"):
        CollectiveWeightSender("tcp://127.0.0.1:29500", 1)


# -- tcp --------------------------------------------------------------------------------------

TOKEN = "s3cret"


@pytest.fixture
def server():
    with TcpWeightServer(token=TOKEN, bucket_bytes=BUCKET_BYTES) as server:
        yield server


def client_of(server: TcpWeightServer, token: str | None = TOKEN) -> TcpWeightClient:
    return TcpWeightClient(*server.address, token=token, timeout_s=10)


def test_tcp_round_trip_and_up_to_date(server: TcpWeightServer) -> None:
    with client_of(server) as client:
        assert client.latest_version() == -1 and client.fetch_newer(-1) is None
        server.publish(1, weights(1))
        version, got = client.fetch_newer(-1)
        assert version == 1
        assert_same(got, weights(1))
        assert client.fetch_newer(1) is None and client.latest_version() == 1
        server.publish(2, weights(2))
        model = {k: torch.full_like(v, 7) for k, v in weights(0).items()}
        model["big"] = torch.zeros(10, 10).t()  # non-contiguous: received via a buffer
        version, got = client.fetch_newer(1, into=model)
        assert version == 2 and all(got[k] is model[k] for k in model)
        assert_same(got, weights(2))
    with pytest.raises(ValueError, match="not newer"):
        server.publish(2, weights(2))
    version, held = server.fetch_newer(1)  # an engine in the server's own process
    assert version == 2 and server.fetch_newer(2) is None
    assert_same(dict(held), weights(2))


def test_tcp_server_wakes_a_waiter_in_its_own_process(server: TcpWeightServer) -> None:
    publish = threading.Timer(0.2, server.publish, (1, weights(1)))
    publish.start()
    assert server.wait_newer(-1, 30.0) == 1  # woken by the publish
    publish.join()
    assert server.wait_newer(1, 0.05) == 1  # nothing newer: the timeout


def test_tcp_wrong_or_missing_token_rejected(server: TcpWeightServer) -> None:
    server.publish(1, weights(1))
    for token in ("wrong", None):
        with client_of(server, token) as client, pytest.raises(PermissionError, match="token"):
            client.fetch_newer(-1)
    with client_of(server) as client:  # the server still serves good clients
        assert client.fetch_newer(-1)[0] == 1


def test_tcp_refuses_public_bind_without_token() -> None:
    with pytest.raises(ValueError, match="non-loopback .* without a token"):
        TcpWeightServer("0.0.0.0")
    with TcpWeightServer("0.0.0.0", token=TOKEN) as server:
        assert server.address[1] > 0


def test_tcp_restarted_client_gets_latest(server: TcpWeightServer) -> None:
    server.publish(1, weights(1))
    with client_of(server) as client:
        assert client.fetch_newer(-1)[0] == 1
    server.publish(2, weights(2))
    with client_of(server) as restarted:  # no disk checkpoint: straight from the server
        version, got = restarted.fetch_newer(-1)
    assert version == 2
    assert_same(got, weights(2))


def test_tcp_client_reconnects_to_a_restarted_server() -> None:
    with TcpWeightServer(token=TOKEN) as first:
        first.publish(1, weights(1))
        client = client_of(first)
        assert client.fetch_newer(-1)[0] == 1
        port = first.address[1]
    with TcpWeightServer(port=port, token=TOKEN) as second:
        second.publish(4, weights(4))
        assert client.fetch_newer(1)[0] == 4  # the dead connection is replaced once
    client.close()


def test_tcp_connection_refused_is_clear() -> None:
    client = TcpWeightClient("127.0.0.1", free_port(), token=TOKEN)
    with pytest.raises(ConnectionRefusedError, match="no weight server listening"):
        client.fetch_newer(-1)


class _TruncatingServer(TcpWeightServer):
    """Sends the header and a few bytes of the first bucket, then drops the connection."""

    def _send_newer(self, conn: socket.socket, have_version: int) -> None:
        snapshot = self._snapshot
        conn.sendall(_FETCH_REPLY.pack(snapshot.version, len(snapshot.header)) + snapshot.header)
        conn.sendall(memoryview(snapshot.blobs[0].numpy())[:10])
        raise ConnectionResetError("cut by the test")


def test_tcp_truncated_stream_is_clear() -> None:
    with _TruncatingServer(token=TOKEN) as server:
        server.publish(1, weights(1))
        with client_of(server) as client:
            with pytest.raises(ConnectionError, match="truncated: got 10 of .* bucket 0"):
                client.fetch_newer(-1)

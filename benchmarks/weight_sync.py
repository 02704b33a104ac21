"""Weight sync of a ~100M-parameter model over gloo and TCP, next to the raw transport bandwidth.

The model is a set of fp32 tensors shaped like a small Llama-style transformer (12 layers,
d_model 768, FFN 2048, vocabulary 16384: 110 tensors, 97.5M parameters, 390 MB). Two processes,
a trainer side and an engine side, on this machine's loopback:

- gloo: `CollectiveWeightSender.publish` -> `CollectiveWeightReceiver.receive`, against a raw
  gloo broadcast of one flat buffer of the same byte size;
- tcp: `TcpWeightClient.fetch_newer` from a `TcpWeightServer` holding the version, against a
  raw socket send of the same number of bytes from a ready buffer into a ready buffer.

Weight sync is timed on the engine side, from a barrier to the weights being in the engine's
model tensors (`into=`, the path an engine takes); the raw runs are timed the same way and
interleaved with the sync runs. Receiving into fresh buffers (no `into`) is shown too. Medians
of `--reps` repetitions. Prints the ratio weight-sync / raw bandwidth last.

    python benchmarks/weight_sync.py [--reps 7] [--bucket-mb 64] [--alone-kib 1024]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrl.weights.collective import CollectiveWeightReceiver, CollectiveWeightSender  # noqa: E402
from streamrl.weights.tcp import TcpWeightClient, TcpWeightServer  # noqa: E402

LAYERS, D_MODEL, D_FFN, VOCAB = 12, 768, 2048, 16384


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 tensors with the names and shapes of a small Llama-style transformer."""
    shapes = {"embed_tokens.weight": (VOCAB, D_MODEL)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}self_attn.{name}.weight"] = (D_MODEL, D_MODEL)
        shapes[f"{p}mlp.gate_proj.weight"] = (D_FFN, D_MODEL)
        shapes[f"{p}mlp.up_proj.weight"] = (D_FFN, D_MODEL)
        shapes[f"{p}mlp.down_proj.weight"] = (D_MODEL, D_FFN)
        shapes[f"{p}input_layernorm.weight"] = (D_MODEL,)
        shapes[f"{p}post_attention_layernorm.weight"] = (D_MODEL,)
    shapes["norm.weight"] = (D_MODEL,)
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- gloo -------------------------------------------------------------------------------------


def gloo_rank(
    rank: int, ports: tuple[int, int], reps: int, buckets: tuple[int, int | None], out: str
) -> None:
    """One side of the gloo runs; rank 1 (the engine) times them and writes `out`."""
    torch.set_num_threads(1)
    model = model_tensors(seed=0 if rank == 0 else 1)  # the engine starts with other weights
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    init = f"tcp://127.0.0.1:{ports[0]}"
    if rank == 0:
        bucket_bytes, alone_bytes = buckets
        channel = CollectiveWeightSender(
            init, 2, bucket_bytes=bucket_bytes, alone_bytes=alone_bytes, timeout_s=120
        )
    else:
        channel = CollectiveWeightReceiver(init, 2, 1, timeout_s=120)
    store = dist.TCPStore("127.0.0.1", ports[1], 2, rank == 0, timedelta(seconds=60))
    raw_pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=120))
    flat = torch.ones(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"raw": [], "sync": [], "sync_fresh": []}
    version = 0
    for _ in range(reps):
        for kind in times:
            raw_pg.barrier().wait()
            start = time.perf_counter()
            if kind == "raw":
                options = dist.BroadcastOptions()
                options.rootRank = 0
                raw_pg.broadcast([flat], options).wait()
            elif rank == 0:
                version += 1
                channel.publish(version, model)
            else:
                channel.receive(into=model if kind == "sync" else None)
            times[kind].append(time.perf_counter() - start)
    if rank == 1:
        expected = model_tensors(seed=0)
        assert all(torch.equal(model[n], expected[n]) for n in expected), "gloo sync corrupted"
        Path(out).write_text(json.dumps({"nbytes": nbytes, "times": times}))
        assert channel.receive() is None  # the sender closed
    else:
        channel.close()


def run_gloo(reps: int, bucket_bytes: int, alone_bytes: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "gloo.json")
        ports = (free_port(), free_port())
        buckets = (bucket_bytes, alone_bytes)
        mp.spawn(gloo_rank, args=(ports, reps, buckets, out), nprocs=2)
        return json.loads(Path(out).read_text())


# -- tcp --------------------------------------------------------------------------------------


def raw_tcp_server(listener: socket.socket, nbytes: int) -> None:
    """Sends `nbytes` from a ready buffer for every byte of request, until the client leaves."""
    conn, _ = listener.accept()
    payload = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())
    with conn:
        while conn.recv(1):
            conn.sendall(payload)


def tcp_client(
    rank: int, addresses: tuple[tuple[str, int], tuple[str, int]], reps: int, out: str
) -> None:
    """The engine process: times raw receive, sync into its model, and sync to fresh buffers."""
    torch.set_num_threads(1)
    model = model_tensors(seed=1)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    raw = socket.create_connection(addresses[1])
    flat = torch.ones(nbytes, dtype=torch.uint8)
    view = memoryview(flat.numpy())
    client = TcpWeightClient(*addresses[0], token="bench")
    client.latest_version()  # connect and authenticate outside the timed span
    times: dict[str, list[float]] = {"raw": [], "sync": [], "sync_fresh": []}
    for _ in range(reps):
        start = time.perf_counter()
        raw.sendall(b"x")
        received = 0
        while received < nbytes:
            received += raw.recv_into(view[received:])
        times["raw"].append(time.perf_counter() - start)
        for kind, into in (("sync", model), ("sync_fresh", None)):
            start = time.perf_counter()
            found = client.fetch_newer(0, into=into)
            times[kind].append(time.perf_counter() - start)
            assert found is not None
    expected = model_tensors(seed=0)
    assert all(torch.equal(model[n], expected[n]) for n in expected), "tcp sync corrupted"
    raw.close()
    client.close()
    Path(out).write_text(json.dumps({"nbytes": nbytes, "times": times}))


def run_tcp(reps: int, bucket_bytes: int) -> dict:
    model = model_tensors(seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    with (
        tempfile.TemporaryDirectory() as tmp,
        TcpWeightServer(token="bench", bucket_bytes=bucket_bytes) as server,
    ):
        start = time.perf_counter()
        server.publish(1, model)
        publish_s = time.perf_counter() - start
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=raw_tcp_server, args=(listener, nbytes), daemon=True).start()
        out = str(Path(tmp) / "tcp.json")
        addresses = (server.address, listener.getsockname())
        mp.spawn(tcp_client, args=(addresses, reps, out), nprocs=1)
        listener.close()
        result = json.loads(Path(out).read_text())
    result["publish_s"] = publish_s
    return result


# -- report -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument(
        "--alone-kib", type=int, default=1024, help="gloo: tensors this large skip packing; 0: none"
    )
    args = parser.parse_args()
    bucket_bytes = args.bucket_mb * 2**20
    alone_bytes = args.alone_kib * 2**10 or None
    model = model_tensors()
    num_params = sum(t.numel() for t in model.values())
    del model
    print(
        f"model: {LAYERS} layers, {num_params / 1e6:.1f}M fp32 parameters in tensors of "
        f"{LAYERS * 9 + 2} names; bucket {args.bucket_mb} MiB, gloo alone_bytes {alone_bytes}; "
        f"median of {args.reps} reps"
    )
    results = {
        "gloo": run_gloo(args.reps, bucket_bytes, alone_bytes),
        "tcp": run_tcp(args.reps, bucket_bytes),
    }
    print(f"{'channel':8} {'run':34} {'median s':>9} {'MB/s':>7}")
    labels = {
        "raw": "raw transport",
        "sync": "weight sync into the model",
        "sync_fresh": "weight sync into fresh buffers",
    }
    ratios = {}
    for channel, result in results.items():
        medians = {kind: statistics.median(ts) for kind, ts in result["times"].items()}
        for kind, seconds in medians.items():
            mb_s = result["nbytes"] / seconds / 1e6
            print(f"{channel:8} {labels[kind]:34} {seconds:9.3f} {mb_s:7.0f}")
        ratios[channel] = medians["raw"] / medians["sync"]
    print(f"tcp publish (trainer side, once per version): {results['tcp']['publish_s']:.3f} s")
    listed = ", ".join(f"{channel} {ratio:.2f}" for channel, ratio in ratios.items())
    print(f"weight_sync/raw bandwidth: {listed}; min {min(ratios.values()):.2f}")


if __name__ == "__main__":
    main()

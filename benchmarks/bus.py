"""Data-bus throughput: streamrl's Ray bus (one shard and several) vs TransferQueue, side by side.

One producer and two consumers, each its own Ray actor (process), on one machine. The producer
writes complete rows in batches; the two consumers are replicas of one role that compete for
rows (each row goes to one of them), read every field and release the rows:

- streamrl: ``add_rows`` with every field (one call per batch); consumers ``claim`` with a long
  poll, then ``ack`` (which frees the rows). Numpy arrays, as the rollout role writes them.
- TransferQueue 0.1.11 (SimpleStorage, its default two storage units, ``polling_mode=True``):
  ``put`` a TensorDict per batch (variable-length fields as jagged nested tensors);
  consumers ``get_meta`` (which marks the rows consumed) + ``get_data``, then ``clear_samples``.
  TransferQueue has no long poll in streaming use (``polling_mode=False`` sleeps 5 s when data
  is short), so an empty ``get_meta`` is retried after ``--tq-poll-s``.

Workloads (seeded, identical bytes for both systems):

- ``tokens``: prompt_ids (256 x int64) and a response of 512-2048 tokens: response_ids (int64)
  and rollout_logprobs (float32); about 17 KB a row.
- ``large``: the same plus a 1 MiB float32 field per row (say, multimodal embeddings).

Figures: samples/s and MB/s from the producer's first write to the last row consumed, median of
``--repeats`` runs; each run gets a fresh local Ray instance. The ratio streamrl/TransferQueue
(samples/s) is printed last.

    python benchmarks/bus.py [--shards 1,4] [--repeats 3] [--workloads tokens,large]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

PROMPT_TOKENS = 256
RESPONSE_TOKENS = (512, 2048)
LARGE_FIELD_FLOATS = 262_144  # 1 MiB of float32
GROUP_SIZE = 8


@dataclass(frozen=True)
class Workload:
    name: str
    num_rows: int
    large_field: bool

    @property
    def fields(self) -> list[str]:
        base = ["prompt_ids", "response_ids", "rollout_logprobs"]
        return [*base, "embeddings"] if self.large_field else base


def make_rows(workload: Workload, seed: int = 0) -> list[dict[str, Any]]:
    """The workload's rows as numpy arrays, ``GROUP_SIZE`` rows per group."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(workload.num_rows):
        length = int(rng.integers(RESPONSE_TOKENS[0], RESPONSE_TOKENS[1] + 1))
        fields = {
            "prompt_ids": rng.integers(0, 32_000, PROMPT_TOKENS, dtype=np.int64),
            "response_ids": rng.integers(0, 32_000, length, dtype=np.int64),
            "rollout_logprobs": -rng.random(length, dtype=np.float32),
        }
        if workload.large_field:
            fields["embeddings"] = rng.random(LARGE_FIELD_FLOATS, dtype=np.float32)
        rows.append({"sample_id": f"s{i}", "group_id": f"g{i // GROUP_SIZE}", "fields": fields})
    return rows


def warmup_rows(workload: Workload, num_rows: int) -> list[dict[str, Any]]:
    """One batch of other rows, consumed before the clock starts (starts lazy actors and
    connections on both systems)."""
    rows = make_rows(Workload("warmup", num_rows, workload.large_field), seed=1)
    return [
        {**row, "sample_id": f"w{i}", "group_id": f"w{row['group_id']}"}
        for i, row in enumerate(rows)
    ]


def batches(rows: list[Any], size: int) -> list[list[Any]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


class ConsumerLoop:
    """Runs ``step()`` on a thread until stopped; counts rows and response tokens consumed."""

    def __init__(self) -> None:
        self.num_rows = 0
        self.num_tokens = 0
        self.last_at = 0.0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def progress(self) -> tuple[int, int, float]:
        if self._error is not None:
            raise self._error
        return self.num_rows, self.num_tokens, self.last_at

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                rows, tokens = self.step()
                if rows:
                    self.num_rows += rows
                    self.num_tokens += tokens
                    self.last_at = time.time()
        except BaseException as err:  # reported by progress()
            self._error = err

    def step(self) -> tuple[int, int]:
        raise NotImplementedError


# -- streamrl -------------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class StreamrlProducer:
    def __init__(self, bus: Any, workload: Workload, batch_rows: int) -> None:
        self.bus = bus
        rows = [{**row, "group_size": GROUP_SIZE} for row in make_rows(workload)]
        self.batches = batches(rows, batch_rows)
        self.warmup_batch = [
            {**row, "group_size": GROUP_SIZE} for row in warmup_rows(workload, batch_rows)
        ]

    def warmup(self) -> None:
        self.bus.add_rows(self.warmup_batch)

    def run(self) -> float:
        started = time.time()
        for batch in self.batches:
            self.bus.add_rows(batch)
        return started


@ray.remote(num_cpus=0, max_concurrency=2)
class StreamrlConsumer(ConsumerLoop):
    def __init__(self, bus: Any, workload: Workload, claim_rows: int) -> None:
        super().__init__()
        self.bus, self.fields, self.claim_rows = bus, workload.fields, claim_rows

    def step(self) -> tuple[int, int]:
        lease = self.bus.claim("trainer", self.fields, self.claim_rows, wait_s=0.2)
        if lease is None:
            return 0, 0
        tokens = sum(len(row["response_ids"]) for row in lease.rows)
        self.bus.ack(lease.lease_id)
        return len(lease.rows), tokens


def setup_streamrl(workload: Workload, args: argparse.Namespace, **bus_options: Any):
    from streamrl.bus.ray_bus import RayBus

    bus = RayBus.create(**bus_options)
    bus.register_consumer("trainer")
    producer = StreamrlProducer.remote(bus, workload, args.batch_rows)
    consumers = [StreamrlConsumer.remote(bus, workload, args.claim_rows) for _ in range(2)]
    return producer, consumers, bus.close


# -- TransferQueue ----------------------------------------------------------------------------


def to_tensordict(rows: list[dict[str, Any]]) -> Any:
    import torch
    from tensordict import TensorDict

    def column(name: str) -> Any:
        values = [torch.from_numpy(row["fields"][name]) for row in rows]
        if len({v.shape for v in values}) == 1:
            return torch.stack(values)
        return torch.nested.as_nested_tensor(values, layout=torch.jagged)

    return TensorDict({name: column(name) for name in rows[0]["fields"]}, batch_size=[len(rows)])


def tq_client() -> Any:
    import transfer_queue as tq

    tq.init()  # attaches to the controller the driver started
    return tq.get_client()


@ray.remote(num_cpus=0)
class TQProducer:
    def __init__(self, workload: Workload, batch_rows: int) -> None:
        self.client = tq_client()
        self.batches = [to_tensordict(b) for b in batches(make_rows(workload), batch_rows)]
        self.warmup_batch = to_tensordict(warmup_rows(workload, batch_rows))

    def warmup(self) -> None:
        self.client.put(data=self.warmup_batch, partition_id="train")

    def run(self) -> float:
        started = time.time()
        for batch in self.batches:
            self.client.put(data=batch, partition_id="train")
        return started


@ray.remote(num_cpus=0, max_concurrency=2)
class TQConsumer(ConsumerLoop):
    def __init__(self, workload: Workload, claim_rows: int, poll_s: float) -> None:
        super().__init__()
        self.client = tq_client()
        self.fields, self.claim_rows, self.poll_s = workload.fields, claim_rows, poll_s

    def step(self) -> tuple[int, int]:
        meta = self.client.get_meta(
            data_fields=self.fields,
            batch_size=self.claim_rows,
            partition_id="train",
            mode="fetch",
            task_name="trainer",
        )
        if meta.size == 0:
            time.sleep(self.poll_s)
            return 0, 0
        data = self.client.get_data(meta)
        tokens = sum(t.numel() for t in data["response_ids"].unbind())
        self.client.clear_samples(meta)
        return meta.size, tokens


def setup_tq(workload: Workload, args: argparse.Namespace):
    import transfer_queue as tq
    from omegaconf import OmegaConf

    logging.getLogger("transfer_queue").setLevel(logging.WARNING)
    conf = {"controller": {"polling_mode": True}}
    tq.init(OmegaConf.create(conf, flags={"allow_objects": True}))
    producer = TQProducer.remote(workload, args.batch_rows)
    consumers = [TQConsumer.remote(workload, args.claim_rows, args.tq_poll_s) for _ in range(2)]
    return producer, consumers, tq.close


# -- harness --------------------------------------------------------------------------------


@dataclass
class Result:
    wall_s: float
    num_rows: int
    num_tokens: int


def run_once(config: str, workload: Workload, args: argparse.Namespace) -> Result:
    ray.init(
        address="local",  # never join another Ray cluster on this machine
        num_cpus=8,  # logical: TransferQueue's actors ask for 1 CPU each
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=2 * 2**30,
    )
    try:
        if config == "tq":
            producer, consumers, close = setup_tq(workload, args)
        else:
            kind, shards, owner = config.split(":")
            options = {"shards": int(shards), "payload_owner": owner}
            producer, consumers, close = setup_streamrl(workload, args, **options)
        ray.get([c.start.remote() for c in consumers])  # after both are constructed
        ray.get(producer.warmup.remote())
        warm = wait_for(consumers, args.batch_rows, args.timeout_s)
        started = ray.get(producer.run.remote())
        progress = wait_for(consumers, args.batch_rows + workload.num_rows, args.timeout_s)
        ray.get([c.stop.remote() for c in consumers])
        close()
        num_rows = sum(p[0] for p in progress) - sum(p[0] for p in warm)
        num_tokens = sum(p[1] for p in progress) - sum(p[1] for p in warm)
        if num_rows != workload.num_rows:
            raise RuntimeError(f"{config}: {num_rows} of {workload.num_rows} rows consumed")
        return Result(max(p[2] for p in progress) - started, num_rows, num_tokens)
    finally:
        ray.shutdown()


def wait_for(consumers: list[Any], num_rows: int, timeout_s: float) -> list[tuple]:
    """Poll the consumers until they have consumed ``num_rows`` in all; their progress."""
    deadline = time.time() + timeout_s
    while True:
        progress = ray.get([c.progress.remote() for c in consumers])
        if sum(p[0] for p in progress) >= num_rows or time.time() > deadline:
            return progress
        time.sleep(0.02)


CONFIG_NAMES = {"tq": "TransferQueue 0.1.11 (SimpleStorage, 2 units)"}


def config_name(config: str) -> str:
    if config in CONFIG_NAMES:
        return CONFIG_NAMES[config]
    _, shards, owner = config.split(":")
    label = f"streamrl RayBus, {shards} shard{'s' if shards != '1' else ''}"
    return label if owner == "keeper" else f"{label}, payloads owned by the writer"


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,4", help="streamrl shard counts, comma-separated")
    parser.add_argument("--workloads", default="tokens,large")
    parser.add_argument("--token-rows", type=int, default=2048)
    parser.add_argument("--large-rows", type=int, default=256)
    parser.add_argument("--batch-rows", type=int, default=16, help="rows per producer write")
    parser.add_argument("--claim-rows", type=int, default=16, help="rows per consumer claim")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tq-poll-s", type=float, default=0.002)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--no-writer-owned", action="store_true", help="skip that variant")
    parser.add_argument("--systems", default="streamrl,tq", help="which systems to run")
    args = parser.parse_args()

    systems = args.systems.split(",")
    shard_counts = [int(s) for s in args.shards.split(",")] if "streamrl" in systems else []
    configs = [f"streamrl:{n}:keeper" for n in shard_counts]
    if shard_counts and not args.no_writer_owned:
        configs.append("streamrl:1:writer")
    if "tq" in systems:
        configs.append("tq")
    workloads = {
        "tokens": Workload("tokens", args.token_rows, large_field=False),
        "large": Workload("large", args.large_rows, large_field=True),
    }
    ratios = []
    for name in args.workloads.split(","):
        workload = workloads[name]
        rows = make_rows(workload)
        row_bytes = sum(v.nbytes for row in rows for v in row["fields"].values())
        expected_tokens = sum(len(row["fields"]["response_ids"]) for row in rows)
        results: dict[str, list[Result]] = {config: [] for config in configs}
        for _ in range(args.repeats):  # configs alternate, so drift in machine load is shared
            for config in configs:
                result = run_once(config, workload, args)
                assert result.num_tokens == expected_tokens, (config, result)
                results[config].append(result)
        mb = row_bytes / 1e6
        print(
            f"\nworkload {name}: {workload.num_rows} rows, {mb:.1f} MB "
            f"({row_bytes / workload.num_rows / 1e3:.1f} KB a row); writes of {args.batch_rows} "
            f"rows, claims of {args.claim_rows}; median of {args.repeats}"
        )
        print(f"{'config':58} {'samples/s':>10} {'MB/s':>8} {'wall s':>8}")
        rates = {}
        for config, runs in results.items():
            wall = statistics.median(r.wall_s for r in runs)
            rates[config] = workload.num_rows / wall
            print(f"{config_name(config):58} {rates[config]:10.0f} {mb / wall:8.1f} {wall:8.2f}")
        if "tq" in rates:
            for n in shard_counts:
                ratios.append((name, n, rates[f"streamrl:{n}:keeper"] / rates["tq"]))
    print()
    for name, n, ratio in ratios:
        print(
            f"ratio streamrl ({n} shard{'s' if n > 1 else ''}) / TransferQueue, {name}: {ratio:.2f}"
        )


if __name__ == "__main__":
    main()

"""Contract suite for the weight channels (``streamrl.api.weights``): every channel must pass it.

A channel counts as supported once it passes this suite: add it to ``CHANNELS`` below (one
entry: the config that selects it in ``weights/channels.py``). Each channel is set up as a run
sets it up: the driver makes the handles with ``publisher_for`` / ``subscriber_for`` /
``restarted_publisher`` and, in Ray mode, they reach the trainer and the engines pickled. One
setup per channel serves the whole module (versions only grow, so each test publishes the next
ones); Ray starts once, only if a channel needs it.

Properties: -1 and nothing to fetch before the first publish; ``fetch_newer`` answers None when
up to date and the newest version (not the next) when behind by several; tensors arrive in
their own dtype and shape, bit for bit (fp32, bf16, fp16, int64 of random bits: NaN payloads,
-0, infinities; non-contiguous; tied; every parameter of a bf16 model), to an engine in its
steady state and to a new one; a new subscriber gets the current version on its first call; a
trainer restarted in place reaches the subscribers it had; ``wait_newer`` returns soon after a publish, and after about its
timeout when nothing comes; subscribers have no ``publish``, and the feeder's calls need no torch.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from streamrl.api.weights import WeightPublisher, WeightSubscriber
from streamrl.config import load_config
from streamrl.weights.channels import (
    publisher_for,
    publisher_info,
    restarted_publisher,
    subscriber_for,
)

WAIT_S = 30.0  # the longest any wait here may take; a test passes long before


def _nothing(handle: Any) -> None:
    pass


def _close(publisher: Any) -> None:
    publisher.close()


@dataclass(frozen=True)
class Channel:
    name: str
    overrides: tuple[str, ...]
    """Config overrides that select the channel."""
    needs_ray: bool = False
    shared: bool = False
    """One store serves both sides: the subscriber is the publisher itself."""
    stop: Callable[[Any], None] = _nothing
    """What the death of the trainer's process takes with it (its weight server, its group)."""
    leave: Callable[[Any], None] = _nothing
    """What the end of an engine's process takes with it (a member's heartbeat and receive
    threads, which must not outlive the test's Ray instance: `CollectiveSubscriber.close`)."""
    settle: Callable[[Rig], None] = _nothing
    """Brings a new setup to its steady state once its subscriber asked for weights."""


def _until_grouped(rig: Rig) -> None:
    """Publish until the engine receives over a broadcast group: the steady state, so the tests
    below exercise the group (and a new subscriber the host copy)."""
    deadline = time.monotonic() + 2 * WAIT_S
    while rig.subscriber.epoch is None:
        assert time.monotonic() < deadline, "no weight group formed"
        version = rig.publish()
        rig.subscriber.wait_newer(version - 1, WAIT_S)
        rig.subscriber.fetch_newer(version - 1)
        time.sleep(0.1)


CHANNELS = [
    Channel("in_process", ("runtime.mode=threads",), shared=True),
    Channel("object_store", ("runtime.weights.channel=object_store",), needs_ray=True, shared=True),
    Channel("tcp", ("runtime.weights.channel=tcp",), stop=_close),
    Channel(
        "collective",
        ("runtime.weights.channel=collective",),
        needs_ray=True,
        stop=_close,
        leave=_close,
        settle=_until_grouped,
    ),
]


class Rig:
    """A channel as a run sets it up: the driver's publisher, the trainer's copy, an engine's
    subscriber."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.cfg = load_config(list(channel.overrides))
        self.publisher = publisher_for(self.cfg)
        self.trainer = self.ship(self.publisher)
        self.info = {"node": "127.0.0.1", **publisher_info(self.trainer)}
        self.subscribers: list[WeightSubscriber] = []
        self.subscriber = self.new_subscriber()
        self.version = -1

    def ship(self, handle: Any) -> Any:
        """The handle as a role process receives it (Ray mode: pickled)."""
        if self.cfg.runtime.mode != "ray":
            return handle
        return pickle.loads(pickle.dumps(handle))

    def new_subscriber(self) -> WeightSubscriber:
        self.subscribers.append(self.ship(subscriber_for(self.cfg, self.publisher, self.info)))
        return self.subscribers[-1]

    def publish(self, tensors: Mapping[str, torch.Tensor] | None = None) -> int:
        """The next version: `tensors`, or a marker holding its number."""
        self.version += 1
        self.trainer.publish(self.version, marked(self.version) if tensors is None else tensors)
        return self.version

    def restart_trainer(self) -> None:
        """The trainer's process dies and its replacement starts in place."""
        self.channel.stop(self.trainer)
        self.trainer = self.ship(restarted_publisher(self.cfg, self.publisher, self.info))

    def close(self) -> None:
        for subscriber in self.subscribers:
            self.channel.leave(subscriber)
        self.channel.stop(self.trainer)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _start(request: pytest.FixtureRequest, channel: Channel) -> Rig:
    if channel.needs_ray:
        request.getfixturevalue("ray_cluster")
    return Rig(channel)


@pytest.fixture(scope="module", params=CHANNELS, ids=lambda c: c.name)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    rig = _start(request, request.param)
    try:
        rig.subscriber.fetch_newer(-1)  # an engine's first call, before anything is published
        rig.channel.settle(rig)
        yield rig
    finally:
        rig.close()


# -- tensors -----------------------------------------------------------------------------------


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Any bit pattern (NaNs with payloads, infinities, -0, subnormals): a channel that converts
    values instead of moving bytes shows."""
    numel = 1
    for dim in shape:
        numel *= dim
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _tied() -> dict[str, torch.Tensor]:
    embedding = random_bits((8, 4), torch.bfloat16, 5)
    return {"embed": embedding, "lm_head": embedding, "row": embedding[2]}  # one storage


def _bf16_model() -> dict[str, torch.Tensor]:
    """What a bf16 trainer publishes (`model.dtype=bfloat16`): the parameters of a two-layer tiny
    Qwen3 by name and shape (projections, norm scales, the tied embedding once), in random bits.
    Spelled out rather than built, so the suite does not import transformers."""
    vocab, hidden, heads, kv_heads, head_dim, inner = 256, 32, 2, 1, 16, 96
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(2):
        at = f"model.layers.{layer}"
        shapes |= {
            f"{at}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{at}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{at}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{at}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{at}.self_attn.q_norm.weight": (head_dim,),
            f"{at}.self_attn.k_norm.weight": (head_dim,),
            f"{at}.mlp.gate_proj.weight": (inner, hidden),
            f"{at}.mlp.up_proj.weight": (inner, hidden),
            f"{at}.mlp.down_proj.weight": (hidden, inner),
            f"{at}.input_layernorm.weight": (hidden,),
            f"{at}.post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return {
        name: random_bits(shape, torch.bfloat16, 10 + i)
        for i, (name, shape) in enumerate(shapes.items())
    }


CASES: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "float32": lambda: {"w": random_bits((4, 6), torch.float32, 1)},
    "bfloat16": lambda: {"w": random_bits((4, 6), torch.bfloat16, 2)},
    "float16": lambda: {"w": random_bits((4, 6), torch.float16, 3)},
    "int64": lambda: {"steps": random_bits((5,), torch.int64, 4)},
    "non_contiguous": lambda: {
        "transposed": random_bits((6, 4), torch.bfloat16, 6).t(),
        "strided": random_bits((12,), torch.float32, 7)[::3],
    },
    "tied": _tied,
    "bf16_model": _bf16_model,
    "scalar_and_empty": lambda: {
        "scalar": random_bits((), torch.float32, 8),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
    },
}


def every_case() -> dict[str, torch.Tensor]:
    return {f"{case}.{name}": t for case, make in CASES.items() for name, t in make().items()}


def marked(version: int) -> dict[str, torch.Tensor]:
    return {"marker": torch.full((3,), version, dtype=torch.int64)}


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: Mapping[str, Any], sent: Mapping[str, torch.Tensor]) -> None:
    assert list(got) == list(sent)  # the publisher's order
    for name, tensor in sent.items():
        value = got[name]
        assert isinstance(value, torch.Tensor), f"{name}: {type(value).__name__}, not a tensor"
        assert (value.dtype, tuple(value.shape)) == (tensor.dtype, tuple(tensor.shape)), name
        assert raw_bytes(value) == raw_bytes(tensor), f"{name}: the bytes differ"


def fetch(subscriber: WeightSubscriber, have: int, want: int) -> Mapping[str, Any]:
    """Wait for `want` as an engine does (`wait_newer`, then `fetch_newer`); its tensors."""
    assert subscriber.wait_newer(want - 1, WAIT_S) == want
    found = subscriber.fetch_newer(have)
    assert found is not None, f"wait_newer said version {want} was there, fetch_newer found none"
    assert found[0] == want
    return found[1]


# -- the protocols -----------------------------------------------------------------------------


def test_implements_the_protocols(rig: Rig) -> None:
    assert isinstance(rig.trainer, WeightPublisher)
    assert isinstance(rig.subscriber, WeightSubscriber)
    # A subscriber that is not the store itself cannot publish: it has no such method.
    assert hasattr(rig.subscriber, "publish") == rig.channel.shared


def test_nothing_before_the_first_publish(request: pytest.FixtureRequest, rig: Rig) -> None:
    fresh = _start(request, rig.channel)
    try:
        assert fresh.trainer.latest_version() == -1
        assert fresh.subscriber.latest_version() == -1
        assert fresh.subscriber.fetch_newer(-1) is None
        started = time.monotonic()
        assert fresh.subscriber.wait_newer(-1, 0.5) == -1  # waits the whole timeout
        assert time.monotonic() - started >= 0.45
    finally:
        fresh.close()


# -- versions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_tensors_arrive_bit_exact(rig: Rig, case: str) -> None:
    have = rig.version
    sent = CASES[case]()
    version = rig.publish(sent)
    assert_bit_exact(fetch(rig.subscriber, have, version), sent)


def test_up_to_date_fetches_nothing_and_behind_fetches_the_newest(rig: Rig) -> None:
    have = rig.publish()
    fetch(rig.subscriber, have - 1, have)
    assert rig.subscriber.fetch_newer(have) is None
    assert rig.subscriber.fetch_newer(have + 5) is None
    for _ in range(3):
        newest = rig.publish()
    tensors = fetch(rig.subscriber, have, newest)  # behind by three: the newest, not the next
    assert_bit_exact(tensors, marked(newest))
    assert rig.subscriber.latest_version() == newest
    assert rig.trainer.latest_version() == newest
    assert rig.subscriber.fetch_newer(newest) is None


# -- waiting -----------------------------------------------------------------------------------


def test_wait_newer_returns_soon_after_a_publish(rig: Rig) -> None:
    have = rig.publish()
    fetch(rig.subscriber, have - 1, have)
    woken: dict[str, float] = {}

    def wait() -> None:
        woken["version"] = rig.subscriber.wait_newer(have, WAIT_S)
        woken["at"] = time.monotonic()

    waiter = threading.Thread(target=wait)
    waiter.start()
    # The decode loop's calls, while the publish watcher's thread waits on the same handle.
    for _ in range(5):
        assert rig.subscriber.fetch_newer(have) is None
        time.sleep(0.05)
    assert "version" not in woken  # still waiting: nothing newer yet
    version = rig.publish()
    published = time.monotonic()
    deadline = published + WAIT_S
    while (found := rig.subscriber.fetch_newer(have)) is None:
        assert time.monotonic() < deadline, f"version {version} never arrived"
        time.sleep(0.01)
    assert found[0] == version
    assert_bit_exact(found[1], marked(version))
    waiter.join(WAIT_S + 5)
    assert woken["version"] == version
    assert woken["at"] - published < WAIT_S / 3  # woken by the publish, not by the timeout


def test_wait_newer_times_out_with_the_version_held(rig: Rig) -> None:
    held = rig.publish()
    fetch(rig.subscriber, held - 1, held)
    started = time.monotonic()
    assert rig.subscriber.wait_newer(held, 0.5) == held
    assert 0.45 <= time.monotonic() - started < WAIT_S / 3
    started = time.monotonic()
    assert rig.subscriber.wait_newer(held, 0.0) == held  # no wait at all
    assert rig.subscriber.wait_newer(held - 1, WAIT_S) == held  # newer already: no wait
    assert time.monotonic() - started < WAIT_S / 3


# -- restarts ----------------------------------------------------------------------------------


def test_a_new_subscriber_gets_the_current_version_at_once(rig: Rig) -> None:
    sent = every_case()
    version = rig.publish(sent)
    restarted = rig.new_subscriber()  # an engine (re)started after the publish
    found = restarted.fetch_newer(-1)  # its first call, no wait
    assert found is not None and found[0] == version
    assert_bit_exact(found[1], sent)
    assert restarted.latest_version() == version
    assert_bit_exact(fetch(rig.subscriber, version - 1, version), sent)


def test_a_trainer_restarted_in_place_reaches_the_subscribers(rig: Rig) -> None:
    have = rig.publish()
    fetch(rig.subscriber, have - 1, have)
    rig.restart_trainer()
    sent = every_case()
    version = rig.publish(sent)
    assert_bit_exact(fetch(rig.subscriber, have, version), sent)
    version = rig.publish()  # and the next one
    assert_bit_exact(fetch(rig.subscriber, version - 1, version), marked(version))


# -- the feeder's process ----------------------------------------------------------------------

_TORCHLESS = textwrap.dedent(
    """
    import pickle, sys
    address = sys.argv[1]
    if address:
        import ray
        ray.init(address=address, log_to_driver=False)
    subscriber = pickle.loads(sys.stdin.buffer.read())
    latest = subscriber.latest_version()
    assert subscriber.wait_newer(latest, 0.1) == latest
    print("torch" in sys.modules)
    """
)


def test_the_feeder_needs_no_torch_to_follow_versions(rig: Rig) -> None:
    """The feeder's process calls `latest_version` and `wait_newer`; it never imports torch."""
    if rig.cfg.runtime.mode != "ray":
        pytest.skip("in-process: every role shares the trainer's process")
    address = ""
    if rig.channel.needs_ray:
        import ray

        address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, "-c", _TORCHLESS, address],
        input=pickle.dumps(rig.new_subscriber()),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode().split()[-1] == "False"

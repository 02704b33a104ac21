"""Least-loaded routing of generation requests over the engines of one rollout service.

A rollout service that drives several engines (`rollout.vllm.engines`) hands each piece of work
to the engine with the fewest tokens in flight. A piece of work (a `Unit`) is every request of
one batch that shares a prompt: the samples of a group go to one engine together, so its prefix
cache computes the prompt's attention once. A request's cost is its prompt plus its token budget
(`prompt tokens + max_new_tokens`), charged when it is routed and refunded when it finishes: an
engine with many long requests counts as busier than one with a few short ones.

Routing is pull-style: an engine takes new work only while it runs fewer than `capacity`
requests (vLLM's `max_num_seqs`); the rest waits in the caller's queue and goes to whichever
engine frees room first. A long-tail request therefore never holds back work another engine
could start. Engines that sample with per-request seeds draw the same tokens wherever a request
lands, so routing changes throughput, never the samples.

Pure bookkeeping: no engine, vLLM or torch import; `tests/unit/test_balancer.py` checks it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Unit(Generic[T]):
    """Requests routed together (one prompt's samples) and their total cost in tokens."""

    items: list[T]
    cost: int


def group_by_prompt(items: Iterable[T], prompt_of, cost_of) -> list[Unit[T]]:
    """Units of `items` that share a prompt (`prompt_of(item)`, hashable), in first-seen order."""
    units: dict[Hashable, Unit[T]] = {}
    for item in items:
        key = prompt_of(item)
        unit = units.get(key)
        if unit is None:
            unit = units[key] = Unit([], 0)
        unit.items.append(item)
        unit.cost += cost_of(item)
    return list(units.values())


@dataclass
class LeastLoaded:
    """In-flight requests and tokens per engine; `pick` names the engine for the next unit."""

    num_engines: int
    capacity: int
    """Requests an engine runs at once before it takes no more new work."""
    requests: list[int] = field(init=False)
    tokens: list[int] = field(init=False)
    routed: list[int] = field(init=False)
    """Requests routed to each engine since the balancer was made (a statistic)."""

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.capacity < 1:
            raise ValueError(
                f"LeastLoaded needs num_engines >= 1 and capacity >= 1, "
                f"got {self.num_engines} and {self.capacity}"
            )
        self.requests = [0] * self.num_engines
        self.tokens = [0] * self.num_engines
        self.routed = [0] * self.num_engines

    def pick(self) -> int | None:
        """The engine with room that has the fewest tokens in flight (then the fewest requests,
        then the lowest index); None when every engine is full."""
        open_engines = [i for i in range(self.num_engines) if self.requests[i] < self.capacity]
        if not open_engines:
            return None
        return min(open_engines, key=lambda i: (self.tokens[i], self.requests[i], i))

    def start(self, engine: int, num_requests: int, num_tokens: int) -> None:
        """`engine` took `num_requests` requests costing `num_tokens`."""
        self.requests[engine] += num_requests
        self.tokens[engine] += num_tokens
        self.routed[engine] += num_requests

    def finish(self, engine: int, num_requests: int, num_tokens: int) -> None:
        """`engine` finished (or gave back, on an abort) requests charged by `start`."""
        self.requests[engine] -= num_requests
        self.tokens[engine] -= num_tokens
        assert self.requests[engine] >= 0 and self.tokens[engine] >= 0, (engine, self)


def spread(units: Sequence[Unit], num_engines: int, capacity: int) -> list[list[Unit]]:
    """Where `LeastLoaded` sends `units` when they all arrive at once and none finishes yet; the
    units no engine has room for are left out. For tests and docs, not on the hot path."""
    balancer = LeastLoaded(num_engines, capacity)
    out: list[list[Unit]] = [[] for _ in range(num_engines)]
    for unit in units:
        engine = balancer.pick()
        if engine is None:
            break
        balancer.start(engine, len(unit.items), unit.cost)
        out[engine].append(unit)
    return out

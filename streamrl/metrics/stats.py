"""Small pure helpers that roles use to turn raw per-sample numbers into metrics.

Every role (rollout workers, the reward service, the trainer) reports a handful of
numbers per step: the mean and spread of rewards, how stale the consumed samples were,
how many tokens per second went through. These helpers compute those summaries the
same way everywhere so that `reward/mean` means one thing across the code base. They
depend on nothing but the standard library and can be called from any process.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from numbers import Integral


def summarize(values: Iterable[float], *, prefix: str = "") -> dict[str, float | int | None]:
    """Mean, population std, min, max and count of `values`.

    An empty input gives `count == 0` and None for every other statistic, so the
    result can always be logged (the tracker skips None values in TensorBoard).
    With `prefix="reward"` the keys become `reward/mean`, `reward/std`, ...
    """
    floats = [float(v) for v in values]
    count = len(floats)
    if count == 0:
        stats: dict[str, float | int | None] = {
            "mean": None,
            "std": None,
            "min": None,
            "max": None,
            "count": 0,
        }
    else:
        mean = math.fsum(floats) / count
        variance = math.fsum((v - mean) ** 2 for v in floats) / count
        stats = {
            "mean": mean,
            "std": math.sqrt(variance),
            "min": min(floats),
            "max": max(floats),
            "count": count,
        }
    if prefix:
        return {f"{prefix}/{key}": value for key, value in stats.items()}
    return stats


def reward_trend(
    step_rewards: Sequence[Mapping[str, float]], window: int = 10
) -> dict[str, float | dict[str, float] | None]:
    """The training reward at the start and at the end of a run: the mean of `reward/mean` over
    the first and the last `window` training steps (fewer in a shorter run), and of each
    `reward_components/<name>` over the last ones. `step_rewards` holds one mapping per step, in
    step order, with whichever of those keys that step had."""

    def mean_of(steps: Sequence[Mapping[str, float]], key: str) -> float | None:
        values = [step[key] for step in steps if key in step]
        return sum(values) / len(values) if values else None

    first, last = step_rewards[:window], step_rewards[-window:]
    names = sorted({k for step in last for k in step if k.startswith("reward_components/")})
    return {
        "train_reward_first": mean_of(first, "reward/mean"),
        "train_reward_last": mean_of(last, "reward/mean"),
        "train_reward_components_last": {
            name.removeprefix("reward_components/"): mean_of(last, name) for name in names
        }
        or None,
    }


def histogram_counts(values: Sequence[int]) -> dict[int, int]:
    """How often each integer occurs in `values`, keyed in ascending order.

    Used for discrete distributions such as staleness (policy versions behind).
    """
    for value in values:
        if not isinstance(value, Integral):
            raise TypeError(
                f"histogram_counts expects integers, got {value!r} ({type(value).__name__}); "
                "round or bucket continuous values before counting them"
            )
    return dict(sorted(Counter(int(v) for v in values).items()))


class Throughput:
    """Sliding-window tokens-per-second meter.

    `rate()` is the number of tokens added during the last `window_s` seconds divided
    by `window_s`, or by the meter's age while it is younger than the window. Tokens
    are counted at the moment they are added, so a stall makes the rate decay towards
    zero instead of freezing at the last value.

    Times are `time.monotonic()` seconds; pass `t` explicitly to replay recorded
    timestamps or to test deterministically.
    """

    def __init__(self, window_s: float = 30.0, *, t0: float | None = None) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self.created_t = time.monotonic() if t0 is None else t0
        self.total_tokens = 0
        self._events: deque[tuple[float, int]] = deque()

    def add(self, num_tokens: int, t: float | None = None) -> None:
        """Record `num_tokens` tokens finished at time `t` (default: now)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        now = time.monotonic() if t is None else t
        self._events.append((now, num_tokens))
        self.total_tokens += num_tokens
        self._drop_older_than(now - self.window_s)

    def rate(self, t: float | None = None) -> float:
        """Tokens per second over the window ending at `t` (default: now)."""
        now = time.monotonic() if t is None else t
        self._drop_older_than(now - self.window_s)
        span_s = min(self.window_s, now - self.created_t)
        if span_s <= 0:
            return 0.0
        return sum(n for _, n in self._events) / span_s

    def _drop_older_than(self, cutoff: float) -> None:
        while self._events and self._events[0][0] <= cutoff:
            self._events.popleft()


class SlowerSide:
    """Which side of an asynchronous run sets its pace, and how busy that side is.

    The run is cut into windows of at least `window_steps` training steps. In each window the
    side (trainer, rollout) with the most busy time is the slower one; its busy time over the
    window's wall time (at most 1) says how well the other side keeps it fed. Whole-run busy
    fractions hide this when the slower side changes during a run: in the demo the trainer
    is slower early, and the rollout once most groups stop needing a backward pass.

    `add_step` takes one step's busy seconds per side; `close` ends the current window at wall
    time `now` once it holds enough steps (call it where both sides' counters were read at the
    same moment, so that neither side's work spills into the next window); `finish` keeps a
    last, shorter window if a `close` ended it.
    """

    def __init__(self, start: float, window_steps: int = 10):
        self.window_steps = window_steps
        self.windows: list[tuple[int, int, float, dict[str, float]]] = []  # first, last, wall, busy
        self._start = start
        self._first: int | None = None
        self._last = 0
        self._busy: dict[str, float] = {}
        self._tail_end: tuple[float, int] | None = None  # (now, last step) of a short close

    def add_step(self, step: int, busy_s: dict[str, float]) -> None:
        if self._first is None:
            self._first = step
        self._last = step
        for side, seconds in busy_s.items():
            self._busy[side] = self._busy.get(side, 0.0) + seconds

    def close(self, now: float) -> None:
        """End the window at `now` if it holds at least `window_steps` steps."""
        if self._first is None:
            return
        if self._last - self._first + 1 < self.window_steps:
            self._tail_end = (now, self._last)
            return
        self._end_window(now)

    def finish(self) -> None:
        """At the end of the run: keep the open window, shorter than `window_steps`, if a
        `close` came after its last step."""
        if self._first is not None and self._tail_end is not None:
            now, last = self._tail_end
            if last == self._last:
                self._end_window(now)

    def _end_window(self, now: float) -> None:
        assert self._first is not None
        self.windows.append((self._first, self._last, now - self._start, self._busy))
        self._start, self._first, self._busy, self._tail_end = now, None, {}, None

    def fraction(self) -> float | None:
        """The slower side's busy fraction, weighted by wall time (None: no whole window)."""
        wall = sum(w for _, _, w, _ in self.windows)
        if not self.windows or wall <= 0:
            return None
        busy = sum(min(w, max(b.values(), default=0.0)) for _, _, w, b in self.windows)
        return busy / wall

    def describe(self) -> str:
        """Which side was slower over which steps, e.g. "trainer 1-60 (96%), rollout 61-100 (93%)"."""
        spans: list[list] = []  # [side, first, last, busy_s, wall_s]
        for first, last, wall, busy in self.windows:
            side = max(busy, key=busy.__getitem__) if busy else "none"
            seconds = min(wall, busy.get(side, 0.0))
            if spans and spans[-1][0] == side:
                spans[-1][2:] = [last, spans[-1][3] + seconds, spans[-1][4] + wall]
            else:
                spans.append([side, first, last, seconds, wall])
        return ", ".join(
            f"{side} {first}-{last} ({busy / max(wall, 1e-9):.0%})"
            for side, first, last, busy, wall in spans
        )

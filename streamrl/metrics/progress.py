"""Human-facing progress display for a run: a live rich bar on a terminal, plain lines otherwise.

`RunProgress` follows the RL loop: step/total, elapsed, ETA and the few numbers a person
watches while a run trains (reward mean, staleness mean, tokens/s, last eval accuracy).
`phase()` covers other long work (a warm-start SFT, loading a dataset) with the same look.

When stdout is not a terminal (CI logs, `nohup`, a pipe into `tee`) a live bar would be
either invisible or a wall of control codes, so both fall back to one plain line about
every 10% of the work plus one at the end. `enabled=False` prints nothing at all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from numbers import Real
from types import TracebackType

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

# (metrics key, label in the display, formatter); every key is optional in `update`.
_LIVE_FIELDS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("reward/mean", "reward", lambda v: f"{v:.3f}"),
    ("staleness/mean", "staleness", lambda v: f"{v:.2f}"),
    ("throughput/tokens_per_s", "tok/s", lambda v: _si(v)),
    ("eval/accuracy", "eval", lambda v: f"{v:.3f}"),
)
_PLAIN_REPORTS = 10  # plain-text lines per run when there is no live bar


class RunProgress:
    """Progress of the RL loop. Use as a context manager around the loop.

    The driver calls `update(step, metrics)` after each training step, where `step` is
    the number of steps completed so far (1 after the first step). A run resumed from a
    checkpoint passes `start_step` so that the ETA counts only the steps done here.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool = True,
        start_step: int = 0,
        description: str = "train",
        console: Console | None = None,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step must be in [0, {total_steps}], got {start_step}")
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_step = start_step
        self.description = description
        self._console = console or Console()
        self._live = enabled and self._console.is_terminal
        self._values: dict[str, float] = {}
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._start_time: float | None = None
        # The first step done here and when: the ETA's rate is measured from it, so that the
        # start-up before it (roles starting, the first evaluation) does not inflate the rate.
        self._first: tuple[int, float] | None = None
        self._plain_every = max(1, math.ceil(total_steps / _PLAIN_REPORTS))
        self._next_plain_step = start_step + 1

    def start(self) -> None:
        """Start the clock and, on a terminal, the live bar."""
        self._start_time = time.monotonic()
        if self._live:
            self._progress = _BarWithStatsLine(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self._console,
                refresh_per_second=4,
            )
            self._task = self._progress.add_task(
                self.description, total=self.total_steps, completed=self.start_step
            )
            self._progress.start()

    def stop(self) -> None:
        """Stop the live bar (leaving its last state on screen)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def update(self, step: int, metrics: Mapping[str, float | int | list[float] | None]) -> None:
        """Show `step` completed steps and refresh the live fields from `metrics`.

        Missing or None fields keep their last shown value.
        """
        if not self.enabled:
            return
        if self._start_time is None:
            raise RuntimeError("RunProgress.update called before start(); use it as `with`")
        now = time.monotonic()
        if self._first is None and step > self.start_step:
            self._first = (step, now)
        for key, _, _ in _LIVE_FIELDS:
            value = metrics.get(key)
            if isinstance(value, Real) and not isinstance(value, bool):
                self._values[key] = float(value)
        if self._progress is not None and self._task is not None:
            self._progress.stats_line = self._stats_text()
            self._progress.update(self._task, completed=step)
        elif step >= self._next_plain_step or step >= self.total_steps:
            self._console.print(self._plain_line(step, now), highlight=False, soft_wrap=True)
            self._next_plain_step = (step // self._plain_every + 1) * self._plain_every

    def _stats_text(self) -> str:
        return "  ".join(
            f"{label} {fmt(self._values[key])}"
            for key, label, fmt in _LIVE_FIELDS
            if key in self._values
        )

    def _plain_line(self, step: int, now: float) -> str:
        assert self._start_time is not None
        parts = [
            f"{self.description} {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%)",
            f"elapsed {_clock(now - self._start_time)}",
        ]
        if self._first is not None and self._first[0] < step < self.total_steps:
            first_step, first_time = self._first
            eta_s = (now - first_time) / (step - first_step) * (self.total_steps - step)
            parts.append(f"eta {_clock(eta_s)}")
        stats = self._stats_text()
        if stats:
            parts.append(stats)
        return " | ".join(parts)

    def __enter__(self) -> RunProgress:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _BarWithStatsLine(Progress):
    """A rich Progress that shows the live fields on their own line under the bar.

    On one line with the bar they would not fit an 80-column terminal, and rich would
    then squeeze the step count and the clock instead of the fields.
    """

    stats_line: str = ""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        if self.stats_line:
            yield Text(self.stats_line, no_wrap=True, overflow="ellipsis")


@contextmanager
def phase(
    description: str,
    total: int | None = None,
    *,
    enabled: bool = True,
    console: Console | None = None,
) -> Iterator[Callable[[int], None]]:
    """Show progress of a long piece of work; yields `advance(n=1)`.

        with phase("warm-start SFT", total=num_batches) as advance:
            for batch in batches:
                train_on(batch)
                advance()

    With `total=None` a terminal shows a spinner and a count instead of a bar.
    """
    console = console or Console()
    done = 0
    start_time = time.monotonic()

    if not enabled:

        def advance_silently(n: int = 1) -> None:
            pass

        yield advance_silently
        return

    if console.is_terminal:
        columns = [SpinnerColumn(), TextColumn("[bold]{task.description}")]
        if total is not None:
            columns.append(BarColumn())
            columns.append(MofNCompleteColumn())
        else:
            columns.append(TextColumn("{task.completed}"))
        columns.append(TimeElapsedColumn())
        with Progress(*columns, console=console, refresh_per_second=4) as progress:
            task = progress.add_task(description, total=total)

            def advance_live(n: int = 1) -> None:
                progress.advance(task, n)

            yield advance_live
        return

    report_every = max(1, math.ceil(total / _PLAIN_REPORTS)) if total else 0
    next_report = report_every

    def advance_plain(n: int = 1) -> None:
        nonlocal done, next_report
        done += n
        if report_every and done >= next_report and done < total:
            elapsed = _clock(time.monotonic() - start_time)
            console.print(
                f"{description} {done}/{total} ({100 * done / total:.0f}%) | elapsed {elapsed}",
                highlight=False,
                soft_wrap=True,
            )
            next_report = (done // report_every + 1) * report_every

    console.print(f"{description} ...", highlight=False, soft_wrap=True)
    yield advance_plain
    count = f"{done}/{total}" if total is not None else str(done)
    elapsed = _clock(time.monotonic() - start_time)
    console.print(f"{description} done: {count} in {elapsed}", highlight=False, soft_wrap=True)


def _clock(seconds: float) -> str:
    """Seconds as m:ss, or h:mm:ss from one hour on."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _si(value: float) -> str:
    """Compact rate: 950, 12.3k, 4.56M."""
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.3g}{suffix}"
    return f"{value:.3g}"

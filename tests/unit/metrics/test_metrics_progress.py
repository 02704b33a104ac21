"""RunProgress and phase: live bars on a terminal, readable plain lines elsewhere."""

import io
import subprocess
import sys

import pytest
from rich.console import Console

from streamrl.metrics import RunProgress, phase


def _console(*, terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=160), out


def test_plain_mode_prints_about_every_ten_percent() -> None:
    console, out = _console(terminal=False)
    with RunProgress(100, console=console) as progress:
        for step in range(1, 101):
            progress.update(
                step,
                {
                    "reward/mean": step / 100,
                    "staleness/mean": 1.5,
                    "throughput/tokens_per_s": 12345.0,
                    "eval/accuracy": 0.4 if step == 50 else None,
                },
            )

    lines = out.getvalue().splitlines()
    assert len(lines) == 11  # step 1, then every 10 steps up to 100
    assert lines[0].startswith("train 1/100 (1%)")
    assert lines[-1].startswith("train 100/100 (100%)")
    assert "reward 1.000" in lines[-1]
    assert "staleness 1.50" in lines[-1]
    assert "tok/s 12.3k" in lines[-1]
    assert "eval 0.400" in lines[-1]  # last eval accuracy is kept between evals
    assert "eval" not in lines[1]  # no eval had run by step 10
    assert "eta" in lines[1] and "eta" not in lines[-1]
    assert "\x1b[" not in out.getvalue()


def test_the_eta_leaves_out_the_start_up_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([0.0, 60.0, 69.0])  # start; step 1 after a minute; then 1 s a step
    monkeypatch.setattr("streamrl.metrics.progress.time.monotonic", lambda: next(clock))
    console, out = _console(terminal=False)
    with RunProgress(100, console=console) as progress:
        progress.update(1, {})  # the first step: nothing yet to measure a rate from
        progress.update(10, {})
    first, tenth = out.getvalue().splitlines()
    assert first == "train 1/100 (1%) | elapsed 1:00"
    assert tenth == "train 10/100 (10%) | elapsed 1:09 | eta 1:30"  # 9 steps in 9 s, 90 to go


def test_default_console_on_a_pipe_prints_plain_lines() -> None:
    code = (
        "from streamrl.metrics import RunProgress\n"
        "with RunProgress(20) as p:\n"
        "    for s in range(1, 21):\n"
        "        p.update(s, {'reward/mean': 0.5})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("train 20/20 (100%)") and "reward 0.500" in lines[-1]
    assert len(lines) == 11
    assert "\x1b[" not in result.stdout


def test_plain_mode_resumed_run_starts_counting_at_start_step() -> None:
    console, out = _console(terminal=False)
    with RunProgress(20, start_step=10, console=console) as progress:
        for step in range(11, 21):
            progress.update(step, {})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train 11/20")
    assert lines[-1].startswith("train 20/20")
    assert len(lines) == 6  # 11, then every 2 steps: 12, 14, 16, 18, 20


def test_terminal_mode_renders_live_fields() -> None:
    console, out = _console(terminal=True)
    with RunProgress(5, console=console) as progress:
        for step in range(1, 6):
            progress.update(step, {"reward/mean": 0.75, "eval/accuracy": 0.5})
    text = out.getvalue()
    assert "5/5" in text
    assert "reward 0.750" in text and "eval 0.500" in text


def test_disabled_prints_nothing() -> None:
    for terminal in (False, True):
        console, out = _console(terminal=terminal)
        with RunProgress(10, enabled=False, console=console) as progress:
            for step in range(1, 11):
                progress.update(step, {"reward/mean": 1.0})
        assert out.getvalue() == ""


def test_update_before_start_is_an_error() -> None:
    console, _ = _console(terminal=False)
    with pytest.raises(RuntimeError, match="before start"):
        RunProgress(10, console=console).update(1, {})


def test_invalid_totals_are_rejected() -> None:
    with pytest.raises(ValueError):
        RunProgress(0)
    with pytest.raises(ValueError):
        RunProgress(10, start_step=11)


def test_phase_plain_with_total() -> None:
    console, out = _console(terminal=False)
    with phase("warm-start SFT", total=50, console=console) as advance:
        for _ in range(50):
            advance()
    lines = out.getvalue().splitlines()
    assert lines[0] == "warm-start SFT ..."
    assert lines[1].startswith("warm-start SFT 5/50 (10%)")
    assert lines[-1].startswith("warm-start SFT done: 50/50 in 0:0")
    assert len(lines) == 11  # start, 9 progress lines (10%..90%), done


def test_phase_plain_without_total_counts_advances() -> None:
    console, out = _console(terminal=False)
    with phase("loading", console=console) as advance:
        advance(3)
        advance(4)
    assert out.getvalue().splitlines() == ["loading ...", "loading done: 7 in 0:00"]


@pytest.mark.parametrize("total", [3, None])
def test_phase_terminal(total: int | None) -> None:
    console, out = _console(terminal=True)
    with phase("tokenizing", total=total, console=console) as advance:
        for _ in range(3):
            advance()
    text = out.getvalue()
    assert "tokenizing" in text
    if total is not None:
        assert "3/3" in text

"""The slower side of an asynchronous run, window by window (metrics/stats.SlowerSide)."""

import pytest

from streamrl.metrics.stats import SlowerSide


def run(steps, window_steps=2):
    """steps: (trainer busy, rollout busy, wall) per step; a window may close after each."""
    meter, now = SlowerSide(start=0.0, window_steps=window_steps), 0.0
    for i, (trainer, rollout, wall) in enumerate(steps, start=1):
        now += wall
        meter.add_step(i, {"trainer": trainer, "rollout": rollout})
        meter.close(now)
    return meter


def test_the_slower_side_changes_and_each_window_counts_its_own():
    # Trainer-bound for two steps (busy 0.9 of 1.0 s), then rollout-bound (0.8 of 1.0 s).
    meter = run([(0.9, 0.5, 1.0)] * 2 + [(0.3, 0.8, 1.0)] * 2)
    assert meter.fraction() == pytest.approx((1.8 + 1.6) / 4.0)
    assert meter.describe() == "trainer 1-2 (90%), rollout 3-4 (80%)"
    # Whole-run fractions alone would say trainer 60%, rollout 65%.


def test_a_window_closes_only_with_enough_steps_and_its_wall_runs_from_the_last_close():
    meter = SlowerSide(start=10.0, window_steps=3)
    meter.add_step(1, {"trainer": 1.0})
    meter.close(11.0)  # one step: stays open
    meter.add_step(2, {"trainer": 1.0})
    meter.add_step(3, {"trainer": 1.0})
    meter.close(14.0)
    assert meter.windows == [(1, 3, 4.0, {"trainer": 3.0})]
    assert meter.fraction() == pytest.approx(0.75)


def test_finish_keeps_a_short_last_window_only_if_a_close_ended_it():
    meter = run([(1.0, 0.5, 1.0)] * 3)  # windows of 2: steps 1-2, then step 3 alone
    meter.finish()
    assert [w[:3] for w in meter.windows] == [(1, 2, 2.0), (3, 3, 1.0)]
    meter = run([(1.0, 0.5, 1.0)] * 2)
    meter.add_step(3, {"trainer": 1.0})  # no close after it: its other side was never read
    meter.finish()
    assert [w[:2] for w in meter.windows] == [(1, 2)]


def test_busy_time_beyond_the_wall_counts_as_fully_busy_not_more():
    meter = run([(1.5, 0.2, 1.0)] * 2)  # a counter read late spills into this window
    assert meter.fraction() == 1.0
    assert meter.describe() == "trainer 1-2 (100%)"


def test_no_whole_window_no_figure():
    meter = run([(0.5, 0.5, 1.0)], window_steps=10)
    assert meter.fraction() is None
    assert meter.describe() == ""

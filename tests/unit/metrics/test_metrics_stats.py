"""Pure metric helpers: summarize, histogram_counts, Throughput."""

import math

import pytest

from streamrl.metrics import Throughput, histogram_counts, summarize
from streamrl.metrics.stats import reward_trend


def test_summarize_uses_population_std() -> None:
    stats = summarize([1.0, 2.0, 3.0, 4.0])
    assert stats["mean"] == 2.5
    assert stats["std"] == pytest.approx(math.sqrt(1.25))
    assert (stats["min"], stats["max"], stats["count"]) == (1.0, 4.0, 4)


def test_summarize_empty_gives_count_zero_and_none() -> None:
    assert summarize([]) == {"mean": None, "std": None, "min": None, "max": None, "count": 0}


def test_summarize_prefix_and_generators() -> None:
    stats = summarize((r for r in [0.0, 1.0]), prefix="reward")
    assert stats == {
        "reward/mean": 0.5,
        "reward/std": 0.5,
        "reward/min": 0.0,
        "reward/max": 1.0,
        "reward/count": 2,
    }


def test_histogram_counts_sorted_by_value() -> None:
    counts = histogram_counts([2, 0, 1, 2, 2, 0])
    assert counts == {0: 2, 1: 1, 2: 3}
    assert list(counts) == [0, 1, 2]
    assert histogram_counts([]) == {}


def test_histogram_counts_rejects_floats() -> None:
    with pytest.raises(TypeError, match="expects integers"):
        histogram_counts([1, 1.5])


def test_throughput_averages_over_meter_age_before_window_fills() -> None:
    meter = Throughput(window_s=10.0, t0=0.0)
    assert meter.rate(t=0.0) == 0.0
    meter.add(100, t=1.0)
    meter.add(100, t=2.0)
    assert meter.rate(t=4.0) == pytest.approx(200 / 4.0)
    assert meter.total_tokens == 200


def test_throughput_window_slides_and_decays_on_stall() -> None:
    meter = Throughput(window_s=10.0, t0=0.0)
    for second in range(1, 21):
        meter.add(50, t=float(second))
    # Only the adds at t = 11..20 are inside the window (10, 20].
    assert meter.rate(t=20.0) == pytest.approx(500 / 10.0)
    assert meter.rate(t=25.0) == pytest.approx(250 / 10.0)
    assert meter.rate(t=40.0) == 0.0
    assert meter.total_tokens == 1000


def test_throughput_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Throughput(window_s=0)
    with pytest.raises(ValueError):
        Throughput().add(-1)


def test_reward_trend_averages_the_first_and_last_steps_and_each_component() -> None:
    steps = [{"reward/mean": float(i)} for i in range(30)]
    steps[-1]["reward_components/format"] = 1.0
    steps[-2]["reward_components/format"] = 0.5
    trend = reward_trend(steps, window=10)
    assert trend["train_reward_first"] == pytest.approx(4.5)  # steps 0-9
    assert trend["train_reward_last"] == pytest.approx(24.5)  # steps 20-29
    assert trend["train_reward_components_last"] == {"format": 0.75}  # where it was logged
    short = reward_trend([{"reward/mean": 1.0}, {}, {"reward/mean": 0.0}], window=10)
    assert short == {  # a step without a scored sample has no reward/mean
        "train_reward_first": 0.5,
        "train_reward_last": 0.5,
        "train_reward_components_last": None,
    }
    assert reward_trend([])["train_reward_first"] is None

"""The built-in audio task's clips, answers, teacher and reward, and its model's warm-start build."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from streamrl.config.derived import multimodal
from streamrl.config.loader import load_config
from streamrl.data import tones, vision_tasks
from streamrl.media.load import MediaLimits, load_media


def _loudest_frequency(samples: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / tones.RATE)[spectrum.argmax()])


def test_the_answer_names_the_tone_with_the_higher_pitch():
    n_tone, n_gap = int(tones.TONE * tones.RATE), int(tones.GAP * tones.RATE)
    for pair in tones.sample_pairs(40, seed=3, split="train"):
        samples = pair.samples()
        first = _loudest_frequency(samples[:n_tone])
        second = _loudest_frequency(samples[n_tone + n_gap : 2 * n_tone + n_gap])
        pitches = pair.pitches()
        # The spectrum's resolution is 1 / 0.45 s: about 2 Hz.
        assert abs(first - pitches[0]) < 3 and abs(second - pitches[1]) < 3
        assert max(pitches) / min(pitches) >= tones.MIN_RATIO - 1e-9
        assert tones.LOWEST <= min(pitches) and max(pitches) <= tones.HIGHEST + 1e-6
        assert (first > second) == (pair.answer == "first")


def test_clips_are_drawn_from_their_seeds_and_the_splits_are_disjoint():
    train = tones.sample_pairs(200, seed=0, split="train")
    evals = tones.sample_pairs(50, seed=0, split="eval")
    assert not {p.seed for p in train} & {p.seed for p in evals}
    assert tones.sample_pairs(200, seed=0, split="train") == train
    assert train[0].wav() == tones.pair(train[0].seed).wav()
    assert set(Counter(p.answer for p in train)) == set(tones.ORDER)


def test_a_clip_reaches_the_model_as_one_second_of_16_khz_audio():
    (problem,) = vision_tasks.sample("tones", 1, seed=0, split="eval")
    assert problem.medium.kind == "audio"
    samples = load_media(problem.medium, MediaLimits())
    assert samples.shape == (tones.RATE,)
    assert np.abs(samples - problem.problem.samples()).max() < 1e-4  # 16-bit rounding


def test_the_teacher_hears_far_apart_pitches_and_mostly_says_first_on_close_ones():
    pairs = tones.sample_pairs(400, seed=0, split="train")
    far = [p for p in pairs if tones.ratio(p) >= 4.0]
    close = [p for p in pairs if tones.ratio(p) < 4.0]
    assert 0.4 < len(close) / len(pairs) < 0.7  # about half the clips sound alike to it
    rng = random.Random(0)
    assert all(tones.teacher_solution(p, rng, 4.0) == f"higher:{p.answer}" for p in far)
    answers = [tones.teacher_solution(p, rng, 4.0) for p in close * 5]
    firsts = sum(a == "higher:first" for a in answers) / len(answers)
    seconds = [p for p in close * 5 if p.answer == "second"]
    # On close pairs it says `first` 80% of the time plus the right answer when that is first.
    assert abs(firsts - (0.8 + 0.2 * (len(close) * 5 - len(seconds)) / len(answers))) < 0.04
    # A perfect ear (1.0) always answers right.
    assert all(tones.teacher_solution(p, rng, 1.0) == f"higher:{p.answer}" for p in close)


def test_the_tones_task_runs_on_the_omni_thinker_and_its_own_rule():
    cfg = load_config(["data.task=tones"])
    assert cfg.reward.function == "streamrl.reward.rule:final_word_match"
    assert multimodal(cfg)

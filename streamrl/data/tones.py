"""The built-in audio task: which of two tones in a short clip is higher?

A clip is 1 s of 16 kHz mono audio: a tone, a short silence, a second tone. The two pitches are
drawn on a log scale between `LOWEST` and `HIGHEST` Hz, a factor between `MIN_RATIO` (a major
third) and 10 apart, log-uniformly, each with its own loudness, over faint noise. The question is
`Which tone is higher?`; the answer names the first or the second after a colon:
`higher:first`. The rule reward `streamrl.reward.rule:final_word_match` checks the word after the
last colon. On the Qwen2.5-Omni thinker the clip is 100 log-mel frames, 25 audio tokens.

Why this task shows that RL works: the warm start imitates a *noisy teacher* with a coarse ear:
two pitches less than a factor `teacher_ear` (4) apart, about half of the clips, sound alike to
it, and for those it names the first tone in `CLOSE_FIRST` (80%) of its answers and the right
one in the rest. The warm-started policy hears far-apart pitches, but on a close pair whose
second tone is higher its greedy answer is `first`; only the reward can teach it the finer ear.
(A teacher that guesses evenly on close pairs was tried first: the policy then averages its
guesses away and hears most close pairs right from the start, 0.69 to 0.87 held-out across
warm starts, which leaves RL little to show.) Held-out clips come from seeds never drawn for
training.

(A teacher that names the wrong tone in most answers, as the motion task's does, makes a policy
that RL does not turn round here: the answer hangs on one sign, and the gradient that shrinks the
wrong mapping stalls where it reaches zero. Measured: held-out 0.0 -> 0.5, every answer `first`.)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from streamrl.data.shapes import split_seeds

RATE = 16_000  # samples a second: what the Omni feature extractor takes
TONE, GAP = 0.45, 0.1  # seconds: each tone, the silence between them
LOWEST, HIGHEST = 200.0, 2000.0  # Hz
MIN_RATIO = 1.25
ORDER = ("first", "second")
CLOSE_FIRST = 0.8  # how often the teacher names the first of two pitches too close for it


@dataclass(frozen=True)
class TonePair:
    seed: int
    higher: str  # "first" or "second"

    prompt = "Which tone is higher?"

    @property
    def answer(self) -> str:
        return self.higher

    def pitches(self) -> tuple[float, float]:
        """The two tones' frequencies (Hz), in the order they sound."""
        rng = random.Random(f"pitch-{self.seed}")
        span = math.log(HIGHEST / LOWEST)
        factor = math.exp(rng.uniform(math.log(MIN_RATIO), span))
        low = LOWEST * math.exp(rng.uniform(0.0, span - math.log(factor)))
        high = low * factor
        return (high, low) if self.higher == "first" else (low, high)

    def samples(self):  # -> np.ndarray [RATE] float32 in [-1, 1]
        """The clip's samples, drawn from its seed (the same every time)."""
        import numpy as np

        rng = np.random.default_rng(self.seed * 7919 + 17)
        n_tone, n_gap = int(TONE * RATE), int(GAP * RATE)
        t = np.arange(n_tone) / RATE
        fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)  # 10 ms ramps: no clicks
        parts = []
        for k, freq in enumerate(self.pitches()):
            loudness = rng.uniform(0.2, 0.5)
            phase = rng.uniform(0, 2 * np.pi)
            parts.append(loudness * fade * np.sin(2 * np.pi * freq * t + phase))
            if k == 0:
                parts.append(np.zeros(n_gap))
        clip = np.concatenate(parts)
        clip = np.concatenate([clip, np.zeros(RATE - len(clip))])
        return (clip + rng.normal(0, 0.005, RATE)).astype(np.float32)

    def wav(self) -> bytes:
        """The clip as 16-bit mono WAV bytes."""
        from streamrl.media.load import encode_wav

        return encode_wav(self.samples(), RATE)


def solution(pair: TonePair) -> str:
    return "higher:" + pair.higher


def ratio(pair: TonePair) -> float:
    """How many times higher the higher pitch is than the lower one."""
    first, second = pair.pitches()
    return max(first, second) / min(first, second)


def teacher_solution(pair: TonePair, rng: random.Random, ear: float) -> str:
    """What the noisy teacher writes: the right answer for pitches at least a factor `ear`
    apart; for closer ones, `first` in `CLOSE_FIRST` of its answers, else the right one."""
    if ratio(pair) >= ear or rng.random() >= CLOSE_FIRST:
        return solution(pair)
    return "higher:first"


def pair(seed: int) -> TonePair:
    return TonePair(seed, random.Random(f"tones-{seed}").choice(ORDER))


def sample_pairs(num: int, *, seed: int, split: str) -> list[TonePair]:
    """`num` clips of the `train` or `eval` split (disjoint by clip seed)."""
    return [pair(s) for s in split_seeds(num, seed=seed, split=split, task="tones")]

"""The built-in video task: which way does a square move across the frames of a short clip?

A clip is `FRAMES` (2) frames of 56 x 56 pixels: on a Qwen-VL model, one time step of 2 x 2
merged vision tokens, whose patches each see the same place in both frames. One square of
jittered colour and shade, 24-30 pixels a side, moves `STEP` (8) pixels a frame left, right, up
or down, from a place that keeps it inside the picture, on a light background of jittered
shade. The question is `Which way does the square move?`; the answer names the direction after
a colon: `moves:left`. The rule reward `streamrl.reward.rule:final_word_match` checks the word
after the last colon.

Why this task shows that RL works: the warm start imitates a *noisy teacher* that sees the motion
but, in `teacher_reverse` of its answers, plays the clip backwards and names the opposite
direction (`moves:right` for a square moving left). The warm-started policy reads the axis and
the direction off the frames, but its greedy answer is the opposite one; only the reward can
tell it which of the two is right. Held-out clips come from seeds never drawn for training.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

from streamrl.data.shapes import COLORS, split_seeds

FRAMES, SIZE, STEP = 2, 56, 8
SIDES = (24, 30)  # the square's side, pixels
FPS = 2.0  # the clip's frame rate, written into the file (it times the video's positions)
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


@dataclass(frozen=True)
class Clip:
    seed: int
    direction: str

    prompt = "Which way does the square move?"

    @property
    def answer(self) -> str:
        return self.direction

    def frames(self) -> list:
        """The clip's frames as PIL images, drawn from its seed (the same pixels every time)."""
        from PIL import Image, ImageDraw

        rng = random.Random(f"draw-{self.seed}")
        shade = 235 + rng.randint(-10, 10)
        side = rng.randint(*SIDES)
        color = tuple(
            max(0, min(255, v + rng.randint(-25, 25))) for v in COLORS[rng.choice(list(COLORS))]
        )
        dx, dy = DIRECTIONS[self.direction]
        travel = STEP * (FRAMES - 1)
        # The start keeps the square inside the picture for the whole clip.
        x_range = (2 + max(0, -dx) * travel, SIZE - side - 2 - max(0, dx) * travel)
        y_range = (2 + max(0, -dy) * travel, SIZE - side - 2 - max(0, dy) * travel)
        x0, y0 = rng.randint(*x_range), rng.randint(*y_range)
        out = []
        for t in range(FRAMES):
            frame = Image.new("RGB", (SIZE, SIZE), (shade, shade, shade))
            x, y = x0 + dx * STEP * t, y0 + dy * STEP * t
            ImageDraw.Draw(frame).rectangle((x, y, x + side - 1, y + side - 1), fill=color)
            out.append(frame)
        return out

    def apng(self) -> bytes:
        """The clip as an animated PNG (lossless, its frame rate in the file)."""
        first, *rest = self.frames()
        out = io.BytesIO()
        first.save(
            out, format="PNG", save_all=True, append_images=rest, duration=1000 / FPS, loop=0
        )
        return out.getvalue()


def solution(clip: Clip, *, backwards: bool = False) -> str:
    """The answer; `backwards=True` is the noisy teacher's habit of naming the opposite way."""
    return "moves:" + (OPPOSITE[clip.direction] if backwards else clip.direction)


def teacher_solution(clip: Clip, rng: random.Random, reverse: float) -> str:
    """What the noisy teacher writes: the right answer, or with probability `reverse` the
    opposite direction."""
    return solution(clip, backwards=rng.random() < reverse)


def clip(seed: int) -> Clip:
    return Clip(seed, random.Random(f"motion-{seed}").choice(list(DIRECTIONS)))


def sample_clips(num: int, *, seed: int, split: str) -> list[Clip]:
    """`num` clips of the `train` or `eval` split (disjoint by clip seed)."""
    return [clip(s) for s in split_seeds(num, seed=seed, split=split, task="motion")]

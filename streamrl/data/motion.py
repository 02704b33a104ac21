"""The built-in video task: which way does the square move across the frames of a short clip?

A clip is 4 frames of 56 x 56 pixels (an animated GIF: 8 vision tokens on a Qwen-VL model, two
time steps of 2 x 2 merged patches): a coloured square moving 10 pixels a frame left, right, up
or down from a random start, on a light background. The answer names the direction and its
number after a colon (`left:1`, `right:2`, `up:3`, `down:4`); the rule reward checks the number.

Why a short run's reward rises: the warm start imitates a *noisy teacher* that, in
`teacher_flip_vertical` of its answers, swaps up and down. The warm-started policy tells the
directions apart but, for vertical motion, prefers the wrong one; only the reward can tell it
which is right. Held-out clips come from seeds never drawn for training.
"""

from __future__ import annotations

import io
import random
import zlib
from dataclasses import dataclass

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
NUMBERS = {name: i + 1 for i, name in enumerate(DIRECTIONS)}
FLIPPED = {"left": "left", "right": "right", "up": "down", "down": "up"}
SIZE, FRAMES, STEP = 56, 4, 10
PROMPT = "Which way does the square move?"


@dataclass(frozen=True)
class Clip:
    seed: int
    direction: str

    @property
    def prompt(self) -> str:
        return PROMPT

    @property
    def answer(self) -> str:
        return str(NUMBERS[self.direction])

    def gif(self) -> bytes:
        """The clip, drawn from its seed (the same bytes every time)."""
        from PIL import Image, ImageDraw

        rng = random.Random(f"motion-draw-{self.seed}")
        side = rng.randint(12, 16)
        dx, dy = DIRECTIONS[self.direction]
        travel = STEP * (FRAMES - 1)
        # A start from which the whole path stays inside the frame.
        lo_x, hi_x = (travel if dx < 0 else 0), SIZE - side - (travel if dx > 0 else 0)
        lo_y, hi_y = (travel if dy < 0 else 0), SIZE - side - (travel if dy > 0 else 0)
        x0, y0 = rng.randint(lo_x, hi_x), rng.randint(lo_y, hi_y)
        color = tuple(rng.randint(30, 200) for _ in range(3))
        shade = 235 + rng.randint(-10, 10)
        frames = []
        for t in range(FRAMES):
            frame = Image.new("RGB", (SIZE, SIZE), (shade, shade, shade))
            x, y = x0 + dx * STEP * t, y0 + dy * STEP * t
            ImageDraw.Draw(frame).rectangle((x, y, x + side - 1, y + side - 1), fill=color)
            frames.append(frame)
        out = io.BytesIO()
        frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=500)
        return out.getvalue()


def solution(clip: Clip, *, flip_vertical: bool = False) -> str:
    """The worked answer; `flip_vertical` is the noisy teacher's habit of swapping up and down."""
    direction = FLIPPED[clip.direction] if flip_vertical else clip.direction
    return f"{direction}:{NUMBERS[direction]}"


def teacher_solution(clip: Clip, rng: random.Random, flip_vertical: float) -> str:
    """What the noisy teacher writes: the right answer, or with probability `flip_vertical` the
    one with up and down swapped."""
    return solution(clip, flip_vertical=rng.random() < flip_vertical)


def is_eval_seed(seed: int, eval_fraction: float = 0.1) -> bool:
    return zlib.crc32(f"motion-{seed}".encode()) % 10_000 < eval_fraction * 10_000


def sample_clips(num: int, *, seed: int, split: str) -> list[Clip]:
    """`num` clips of the `train` or `eval` split (disjoint by clip seed)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"{seed}-motion-{split}")
    out = []
    while len(out) < num:
        s = rng.randrange(2**31)
        if is_eval_seed(s) == (split == "eval"):
            out.append(Clip(s, random.Random(f"motion-{s}").choice(list(DIRECTIONS))))
    return out

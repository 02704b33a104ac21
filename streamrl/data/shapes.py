"""The built-in vision task: count the shapes of one colour in a small generated picture.

A picture is a grid of 2 x 2 cells of 28 x 28 pixels (one vision token each on a Qwen-VL model:
14-pixel patches merged 2 x 2). A cell is empty or holds a red, green or blue square or circle,
of jittered size, place and shade on a light background. The question names a colour; the
answer writes the colour's letter once for every shape of that colour, in reading order, then
the count after a colon: `How many red shapes?` -> `RRR:3`. The rule reward checks the number
after the last colon, as for the addition task.

Why this task shows that RL works: the warm start imitates a *noisy teacher* that finds every
shape but, in `teacher_miscount` of its answers, counts one fewer than it wrote (`RRR:2`). The
warm-started policy reads the picture's colours, but its greedy count is wrong whenever the
picture holds a shape of the asked colour (about seven pictures in ten); only the reward can
tell it which count is right. Held-out pictures come from seeds never drawn for training.
"""

from __future__ import annotations

import io
import random
import zlib
from dataclasses import dataclass

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220)}
LETTERS = {"red": "R", "green": "G", "blue": "B"}
ROWS, COLS, CELL = 2, 2, 28
P_EMPTY, P_CIRCLE = 0.2, 0.4  # the rest are squares


@dataclass(frozen=True)
class Cell:
    color: str | None  # None: empty
    circle: bool = False


@dataclass(frozen=True)
class Picture:
    seed: int
    cells: tuple[Cell, ...]
    ask: str  # the colour asked about

    @property
    def prompt(self) -> str:
        return f"How many {self.ask} shapes?"

    @property
    def answer(self) -> str:
        return str(sum(c.color == self.ask for c in self.cells))

    def png(self) -> bytes:
        """The picture, drawn from its seed (the same bytes every time)."""
        from PIL import Image, ImageDraw

        rng = random.Random(f"draw-{self.seed}")
        shade = 235 + rng.randint(-10, 10)
        image = Image.new("RGB", (COLS * CELL, ROWS * CELL), (shade, shade, shade))
        draw = ImageDraw.Draw(image)
        for i, cell in enumerate(self.cells):
            if cell.color is None:
                continue
            top, left = (i // COLS) * CELL, (i % COLS) * CELL
            size = rng.randint(14, 22)
            x0, y0 = left + rng.randint(2, CELL - size - 2), top + rng.randint(2, CELL - size - 2)
            color = tuple(max(0, min(255, v + rng.randint(-25, 25))) for v in COLORS[cell.color])
            box = (x0, y0, x0 + size, y0 + size)
            (draw.ellipse if cell.circle else draw.rectangle)(box, fill=color)
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()


def solution(picture: Picture, *, count_all: bool = True) -> str:
    """The worked answer; `count_all=False` is the noisy teacher's habit of counting one fewer
    shape than it wrote down."""
    found = sum(c.color == picture.ask for c in picture.cells)
    count = found if count_all else max(found - 1, 0)
    return LETTERS[picture.ask] * found + f":{count}"


def teacher_solution(picture: Picture, rng: random.Random, miscount: float) -> str:
    """What the noisy teacher writes: the right answer, or with probability `miscount` the one
    that counts one shape fewer."""
    return solution(picture, count_all=rng.random() >= miscount)


def split_seeds(num: int, *, seed: int, split: str, task: str, eval_fraction: float = 0.1):
    """`num` item seeds of a generated task's `train` or `eval` split, drawn from (`seed`, `task`,
    `split`); an item is held out by a hash of (`task`, its seed), so the splits never share one."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"{seed}-{task}-{split}")
    out: list[int] = []
    while len(out) < num:
        s = rng.randrange(2**31)
        held_out = zlib.crc32(f"{task}-{s}".encode()) % 10_000 < eval_fraction * 10_000
        if held_out == (split == "eval"):
            out.append(s)
    return out


def picture(seed: int) -> Picture:
    rng = random.Random(f"shapes-{seed}")
    cells = []
    for _ in range(ROWS * COLS):
        roll = rng.random()
        if roll < P_EMPTY:
            cells.append(Cell(None))
        else:
            cells.append(Cell(rng.choice(list(COLORS)), circle=roll < P_EMPTY + P_CIRCLE))
    return Picture(seed, tuple(cells), rng.choice(list(COLORS)))


def sample_pictures(num: int, *, seed: int, split: str) -> list[Picture]:
    """`num` pictures of the `train` or `eval` split (disjoint by picture seed)."""
    return [picture(s) for s in split_seeds(num, seed=seed, split=split, task="shapes")]

"""The built-in media tasks as the dataset and the warm start see them: `shapes` (count the
shapes of one colour in a picture, `streamrl.data.shapes`), `motion` (which way a square
moves in a short clip, `streamrl.data.motion`) and `tones` (which of two tones is higher,
`streamrl.data.tones`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from streamrl.config.derived import MEDIA_TASKS
from streamrl.data import motion, shapes, tones
from streamrl.media.refs import MediaRef

__all__ = ["MEDIA_TASKS", "VisionProblem", "sample", "teacher_solution"]


@dataclass(frozen=True)
class VisionProblem:
    """One problem of a built-in media task: its question, answer, medium and where it came
    from (`problem` is the task's own object, for its teacher)."""

    prompt: str
    answer: str
    medium: MediaRef
    origin: str
    problem: Any

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The one-turn conversation: the medium, then the question."""
        parts = [{"type": self.medium.kind}, {"type": "text", "text": self.prompt}]
        return [{"role": "user", "content": parts}]


def sample(task: str, num: int, *, seed: int, split: str) -> list[VisionProblem]:
    """`num` problems of the built-in media task `task` from the `train` or `eval` split."""
    if task == "shapes":
        return [
            VisionProblem(
                p.prompt, p.answer, MediaRef("image", data=p.png()), f"shapes picture {p.seed}", p
            )
            for p in shapes.sample_pictures(num, seed=seed, split=split)
        ]
    if task == "motion":
        return [
            VisionProblem(
                c.prompt, c.answer, MediaRef("video", data=c.apng()), f"motion clip {c.seed}", c
            )
            for c in motion.sample_clips(num, seed=seed, split=split)
        ]
    if task == "tones":
        return [
            VisionProblem(
                p.prompt, p.answer, MediaRef("audio", data=p.wav()), f"tones clip {p.seed}", p
            )
            for p in tones.sample_pairs(num, seed=seed, split=split)
        ]
    raise ValueError(f"{task!r} is not a built-in media task ({', '.join(MEDIA_TASKS)})")


def teacher_solution(task: str, problem: VisionProblem, rng: random.Random, warm_start) -> str:
    """The noisy teacher's answer to `problem` (its noise from the `warm_start` settings)."""
    if task == "motion":
        return motion.teacher_solution(problem.problem, rng, warm_start.teacher_reverse)
    if task == "tones":
        return tones.teacher_solution(problem.problem, rng, warm_start.teacher_ear)
    assert task == "shapes", task
    return shapes.teacher_solution(problem.problem, rng, warm_start.teacher_miscount)

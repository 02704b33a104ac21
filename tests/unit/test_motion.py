"""The built-in video task's clips, answers, teacher and reward."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from streamrl.config.loader import load_config
from streamrl.data import motion, vision_tasks
from streamrl.media.load import MediaLimits, load_media, video_fps
from streamrl.reward.rule import final_word_match


def _centres(clip: motion.Clip) -> list[np.ndarray]:
    frames = np.stack([np.asarray(f, dtype=int) for f in clip.frames()])
    square = np.abs(frames - frames[:, :1, :1]).sum(-1) > 30  # off the background's shade
    return [np.argwhere(f).mean(0) for f in square]  # (row, column) of each frame


def test_the_square_moves_the_answers_way_by_step_pixels_a_frame():
    for clip in motion.sample_clips(40, seed=3, split="train"):
        dx, dy = motion.DIRECTIONS[clip.answer]
        centres = _centres(clip)
        for before, after in zip(centres, centres[1:], strict=False):
            assert np.allclose(after - before, (dy * motion.STEP, dx * motion.STEP))


def test_clips_are_drawn_from_their_seeds_and_the_splits_are_disjoint():
    train = motion.sample_clips(200, seed=0, split="train")
    evals = motion.sample_clips(50, seed=0, split="eval")
    assert not {c.seed for c in train} & {c.seed for c in evals}
    assert motion.sample_clips(200, seed=0, split="train") == train
    assert train[0].apng() == motion.clip(train[0].seed).apng()
    assert set(Counter(c.answer for c in train)) == set(motion.DIRECTIONS)


def test_a_clip_reaches_the_model_as_a_video_at_its_own_frame_rate():
    (problem,) = vision_tasks.sample("motion", 1, seed=0, split="eval")
    assert problem.medium.kind == "video"
    frames = load_media(problem.medium, MediaLimits())
    assert frames.shape == (motion.FRAMES, motion.SIZE, motion.SIZE, 3)
    assert video_fps(problem.medium, MediaLimits()) == motion.FPS


def test_the_teacher_names_the_opposite_way_as_often_as_asked():
    clip = motion.clip(7)
    rng = random.Random(0)
    answers = Counter(motion.teacher_solution(clip, rng, 0.8) for _ in range(2000))
    assert set(answers) == {f"moves:{clip.answer}", f"moves:{motion.OPPOSITE[clip.answer]}"}
    assert abs(answers[f"moves:{motion.OPPOSITE[clip.answer]}"] / 2000 - 0.8) < 0.03


def test_the_word_after_the_last_colon_is_scored():
    assert final_word_match("moves:left", "left").value == 1.0
    assert final_word_match("moves: Left ", "left").value == 1.0
    assert final_word_match("moves:right", "left").value == 0.0
    assert final_word_match("moves", "left").status == "invalid_output"
    assert final_word_match("moves:", "left").status == "invalid_output"


def test_the_motion_task_is_scored_by_its_own_rule_unless_told_otherwise():
    assert load_config(["data.task=motion"]).reward.function == (
        "streamrl.reward.rule:final_word_match"
    )
    mine = load_config(["data.task=motion", "reward.function=my.module:score"])
    assert mine.reward.function == "my.module:score"
    assert load_config(["data.task=shapes"]).reward.function.endswith(":arith_exact_match")

"""Reward functions for the built-in task written as TRL's GRPOTrainer documentation writes
them: batched, `completions` a list of texts, every other dataset column (here `answer`) a list
beside it, `**kwargs` for the rest, one float a completion returned. Used unchanged by
tests/integration/test_reward_forms.py."""

import re


def accuracy_reward(completions, answer, **kwargs):
    """1.0 when the number after the last ':' is the answer."""
    matches = [re.search(r":\s*(-?\d+)\s*$", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c and int(c) == int(a) else 0.0 for c, a in zip(contents, answer, strict=True)]


def format_reward(completions, **kwargs):
    """1.0 when the completion ends in ':<number>'."""
    pattern = r"^.*:-?\d+$"
    matches = [re.match(pattern, content.strip()) for content in completions]
    return [1.0 if match else 0.0 for match in matches]

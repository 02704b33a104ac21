"""Reward functions of a test as an importable module, and the sandboxed scorers a test makes.

Shared by the reward, reward-forms and sandbox tests: `reward_module` writes a test's source as a
module in a fresh folder the test process and the reward sandbox both import from (a sandbox
started by root runs as nobody, so the folder is world-readable); `Scorers` closes every
`SandboxedScorer` a test made, whatever the test's outcome.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrl.reward.sandbox import SandboxedScorer


@contextlib.contextmanager
def reward_module(
    tmp_path_factory: pytest.TempPathFactory, name: str, source: str
) -> Iterator[Path]:
    """`source` importable as module `name` (here and in sandboxes) until the block ends."""
    directory = tmp_path_factory.mktemp(name)
    directory.chmod(0o755)
    (directory / f"{name}.py").write_text(source)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(directory))
        mp.setenv("PYTHONPATH", str(directory), prepend=os.pathsep)
        yield directory
        sys.modules.pop(name, None)


class Scorers:
    """`scorers(function, **kwargs)` makes a `SandboxedScorer`; `close()` closes them all."""

    def __init__(self, **defaults) -> None:
        self.defaults = defaults
        self.made: list[SandboxedScorer] = []

    def __call__(self, function, **kwargs) -> SandboxedScorer:
        scorer = SandboxedScorer(function, **{**self.defaults, **kwargs})
        self.made.append(scorer)
        return scorer

    def close(self) -> None:
        for scorer in self.made:
            scorer.close()

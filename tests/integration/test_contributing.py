"""CONTRIBUTING.md's "add a reward role" and "add an engine", followed literally: the python
blocks of each section are copied into a module outside the package, which a real run names in
`run.plugins`; the run trains with the toy engine and the toy reward role instead of the
built-in ones."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.integration.conftest import QUICK, REPO, read_jsonl, run_cli

pytestmark = pytest.mark.integration


def plugin_files(markdown: str) -> dict[str, str]:
    """Each python block whose first line is `# <file>.py`, concatenated per file in order."""
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", markdown, flags=re.S):
        first, _, body = block.partition("\n")
        name = re.fullmatch(r"# (\w+\.py)", first.strip())
        if name:
            files[name.group(1)] = files.get(name.group(1), "") + body + "\n"
    return files


def test_a_toy_engine_and_a_toy_reward_role_from_outside_the_package_train(
    tmp_path: Path, quick_cache: Path
) -> None:
    files = plugin_files((REPO / "CONTRIBUTING.md").read_text())
    assert set(files) == {"toy_plugin.py"}
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    for name, source in files.items():
        (plugin_dir / name).write_text(source)
    run_dir = tmp_path / "run"
    path = os.pathsep.join(p for p in (str(plugin_dir), os.environ.get("PYTHONPATH")) if p)
    run_cli(
        [
            "train",
            *QUICK,
            f"run.cache_dir={quick_cache}",
            f"run.run_dir={run_dir}",
            "run.plugins=[toy_plugin]",
            "rollout.engine=toy",
            "runtime.mode=threads",
            "trainer.steps=3",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
        ],
        extra_env={"PYTHONPATH": path},
    )
    assert (run_dir / "toy_engine_built").exists()  # the toy engine generated
    scored = json.loads((run_dir / "toy_reward.json").read_text())["scored"]
    assert scored >= 3 * 4 * 4  # the toy role scored every trained sample
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "response/tokens" in m]
    assert len(steps) == 3
    assert all(m["reward/mean"] is not None for m in steps)
    # The warm-started policy writes the task's format: the toy role's verdicts (0.1 for a
    # wrong number in it) reached the trainer.
    assert any(m["reward/mean"] > 0 for m in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == 3


def test_an_unknown_engine_without_plugins_is_refused(tmp_path: Path) -> None:
    proc = run_cli(["train", "rollout.engine=toy", f"run.run_dir={tmp_path}"], check_ok=False)
    assert proc.returncode == 2
    assert "rollout.engine='toy' is not an engine" in proc.stderr
    assert "run.plugins" in proc.stderr

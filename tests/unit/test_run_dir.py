"""Runs started in the same second (a sweep launched by a script) get run directories of their
own; `run.run_dir` is taken as given."""

from __future__ import annotations

from pathlib import Path

from streamrl.config.loader import load_config
from streamrl.runtime import context


def test_runs_started_in_the_same_second_get_their_own_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(context.time, "strftime", lambda _fmt: "20261201-120000")
    cfg = load_config([])
    made = [context.make_run_dir(cfg) for _ in range(3)]
    assert made == [
        Path("runs/20261201-120000"),
        Path("runs/20261201-120000-1"),
        Path("runs/20261201-120000-2"),
    ]
    assert all(path.is_dir() for path in made)


def test_a_given_run_dir_is_used_as_is(tmp_path):
    cfg = load_config([f"run.run_dir={tmp_path / 'mine'}"])
    assert context.make_run_dir(cfg) == tmp_path / "mine"

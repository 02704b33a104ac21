"""The architecture's rules that a reader would otherwise have to take on trust: the runtime
knows roles only through the registry and the `Role` protocol (no probing of their attributes),
and every built-in role is registered with a builder that exists. The layers and the absence of
import cycles are checked by `lint-imports` (pyproject.toml), run by `make test`."""

from __future__ import annotations

import ast
import os
from dataclasses import replace
from pathlib import Path

import pytest

from streamrl.api.registry import bus_consumers, load, role_spec, run_roles
from streamrl.config import load_config

RUNTIME = Path(__file__).resolve().parents[2] / "streamrl" / "runtime"


def _probes(tree: ast.AST) -> list[str]:
    """`hasattr(...)` anywhere, and `getattr(<something named like a role>, ...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr":
                found.append(f"line {node.lineno}: hasattr")
            elif node.func.id == "getattr" and node.args:
                target = ast.unparse(node.args[0])
                if "role" in target and "roles_config" not in target and "cfg" not in target:
                    found.append(f"line {node.lineno}: getattr({target}, ...)")
    return found


@pytest.mark.parametrize("path", sorted(RUNTIME.glob("*.py")), ids=lambda p: p.name)
def test_the_runtime_never_probes_a_role(path: Path) -> None:
    assert _probes(ast.parse(path.read_text())) == []


def test_the_probe_finder_finds_probes() -> None:
    tree = ast.parse("hasattr(role, 'done')\ngetattr(self.role, 'close', None)\n")
    assert len(_probes(tree)) == 2


def test_every_built_in_role_has_a_builder() -> None:
    cfg = load_config(
        [
            "algorithm.kl.coef=0.01",
            "algorithm.off_policy.proximal=pi_old",
            "algorithm.advantage.estimator=gae",
        ]
    )
    names = [spec.name for spec in run_roles(cfg)]
    assert names == [
        "trainer",
        "rollout",
        "reward",
        "advantage",
        "reference",
        "logp",
        "critic",
        "feeder",
    ]
    for name in names:
        assert callable(load(role_spec(name).builder))
    assert "critic_train" in bus_consumers(cfg) and "feeder" not in bus_consumers(cfg)


def test_a_default_run_has_the_five_roles_of_grpo() -> None:
    names = [spec.name for spec in run_roles(load_config([]))]
    assert names == ["trainer", "rollout", "reward", "advantage", "feeder"]


def test_an_unknown_role_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown role 'grader'; roles: trainer, rollout, judge"):
        role_spec("grader")


def test_the_run_is_paced_by_the_one_role_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrl.api import registry

    cfg = load_config([])
    assert registry.pacing_role(cfg) == "trainer"
    roles = dict(registry._ROLES)
    trainer = roles.pop("trainer")
    learner = replace(trainer, name="learner")  # a plugin's trainer under its own name
    monkeypatch.setattr(registry, "_ROLES", {"learner": learner, **roles})
    assert registry.pacing_role(cfg) == "learner"
    monkeypatch.setattr(registry, "_ROLES", roles)
    with pytest.raises(ValueError, match="exactly one role with RoleSpec.paces_run"):
        registry.pacing_role(cfg)


def test_ray_never_starts_itself_in_tests_or_a_run() -> None:
    """A stray Ray call after `ray.shutdown()` raises instead of starting a new Ray instance
    (tests/conftest.py, streamrl/cli.py say why)."""
    import subprocess
    import sys

    from ray._private import auto_init_hook

    assert not auto_init_hook.enable_auto_connect
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_AUTO_CONNECT"}
    probe = (
        "import os, streamrl.cli as cli\n"
        "try:\n    cli.main(['stop', '/nonexistent-run'])\nexcept (SystemExit, Exception):\n    pass\n"
        "from ray._private import auto_init_hook\n"
        "print(auto_init_hook.enable_auto_connect)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False"

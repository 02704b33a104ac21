"""Changing a running job from outside: how many replicas of a role it should run.

`streamrl scale RUN_DIR rollout=3` (or `set_replicas(run_dir, "rollout", 3)` from Python) writes
the request to `control.json` in the run directory; the supervisor of the live run reads it on
its next check, starts new replicas (they pull the current weights and claim work at once) or
drains surplus ones (a replica finishes the rows it holds, then stops: nothing is lost).
Ray-free, so the command starts in a blink.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from streamrl.config.schema import SCALABLE_ROLES

CONTROL_FILE = "control.json"


def set_replicas(run_dir: Path, role: str, replicas: int) -> None:
    if role not in SCALABLE_ROLES:
        raise ValueError(f"cannot scale {role!r}: only {', '.join(SCALABLE_ROLES)} have replicas")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas} (stop the run to stop a role)")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a streamrl run directory (no config.yaml)")
    requests = read_requests(run_dir)
    requests[role] = replicas
    tmp = run_dir / (CONTROL_FILE + ".tmp")
    tmp.write_text(json.dumps({"replicas": requests}))
    os.replace(tmp, run_dir / CONTROL_FILE)


def read_requests(run_dir: Path) -> dict[str, int]:
    """The replica counts requested so far ({} when nothing was asked)."""
    path = run_dir / CONTROL_FILE
    if not path.exists():
        return {}
    return {k: int(v) for k, v in json.loads(path.read_text())["replicas"].items()}

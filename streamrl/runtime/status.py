"""The files a Ray-mode run keeps about its roles: `roles.json` (where each role runs, its health
and restarts; rewritten by the supervisor) and `events.jsonl` (every failure and what was done)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STATUS_FILE = "roles.json"
EVENTS_FILE = "events.jsonl"


def read_status(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATUS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a Ray-mode run directory?")
    return json.loads(path.read_text())


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / EVENTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def live_pid(run_dir: Path, name: str) -> int | None:
    """The pid of role `name`, or of service `name` (a bus shard `bus#<k>`, the weight store
    `weights`), while `roles.json` says it is healthy; None before it started, while it restarts,
    or before the run wrote the file (what a test or a soak waits on before it kills one)."""
    try:
        status = json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    info = status.get("roles", {}).get(name) or status.get("services", {}).get(name)
    return info["pid"] if info and info.get("healthy") else None

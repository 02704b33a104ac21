"""Read an offline W&B run back for tests: its config, history rows and final summary.

wandb ships no reader for its `.wandb` transaction log (`wandb sync` hands it to its Go
service), so this reads the format directly: a 7-byte header (`:W&B`, a 2-byte id, a version
byte), then LevelDB's log format (32 KiB blocks; each chunk a 7-byte header of CRC, length
and type: 1 full, 2 first, 3 middle, 4 last) whose records are `wandb_internal_pb2.Record`s.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _LAST = 1, 4


@dataclass
class OfflineRun:
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None


def read_offline_run(wandb_file: Path, *, timeout_s: float = 30.0) -> OfflineRun:
    """What `wandb_file` (`.../offline-run-*/run-<id>.wandb`) holds, values JSON-decoded;
    nested keys (a histogram's `values`, `bins`) become nested dicts. `run.finish()` returns
    before W&B's service process has written the file out, so this waits (up to `timeout_s`)
    for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = _parse(Path(wandb_file).read_bytes())
        if run.exit_code is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _parse(data: bytes) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2

    run = OfflineRun()
    for chunk in _records(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            _apply(run.config, record.run.config.update)
        elif kind == "config":
            _apply(run.config, record.config.update)
        elif kind == "history":
            row: dict[str, Any] = {}
            _apply(row, record.history.item)
            run.history.append(row)
        elif kind == "summary":
            _apply(run.summary, record.summary.update)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def _records(data: bytes):
    if len(data) < _CHUNK_HEADER:  # not written out yet
        return
    assert data[:4] == b":W&B", f"not a .wandb file (header {data[:7]!r})"
    pos, chunks = _CHUNK_HEADER, []
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:  # block trailer: zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0:  # zero padding up to the end of the block
            pos += left_in_block
            continue
        if pos + _CHUNK_HEADER + length > len(data):  # torn: still being written
            return
        chunks.append(data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length])
        pos += _CHUNK_HEADER + length
        if kind in (_FULL, _LAST):
            yield b"".join(chunks)
            chunks = []


def _apply(into: dict[str, Any], items) -> None:
    for item in items:
        path = list(item.nested_key) or [item.key]
        target = into
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = json.loads(item.value_json)

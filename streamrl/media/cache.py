"""The preprocessed-media store: what a prompt's media became, kept once, found by key.

A prompt's media are decoded and run through the model's processor once; the result (the
prompt's token ids with their placeholders expanded, the processor's tensors such as
`pixel_values` and `image_grid_thw`, and the decoded media for engines that run the processor
themselves) is written here under a key, and the bus carries only the key. The key is a hash of
the media's content, the processor's settings and the limits, so equal inputs share an entry
and a changed file or processor gets a new one.

Entries are safetensors files under the run's cache folder, written to a temporary name and
renamed (a reader never sees half a file; two writers of one key write the same bytes), with the
most recent entries also kept in memory. Safetensors holds tensors only: no pickle.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import torch

_OPEN: dict[str, MediaCache] = {}
_OPEN_LOCK = threading.Lock()


def open_cache(root: str | Path) -> MediaCache:
    """The process's one `MediaCache` over folder `root` (every role of a process shares its
    entries in memory)."""
    key = str(Path(root).resolve())
    with _OPEN_LOCK:
        if key not in _OPEN:
            _OPEN[key] = MediaCache(key)
        return _OPEN[key]


class MediaCache:
    """A store of named tensors by key: on disk under `root` (shared by the processes of a run)
    and the `memory_entries` most recently used in memory (`root=None`: memory only)."""

    def __init__(self, root: str | Path | None, *, memory_entries: int = 256):
        self.root = Path(root) if root is not None else None
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        self.memory_entries = memory_entries
        self._memory: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        assert self.root is not None and key.isalnum(), key
        return self.root / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry under `key`, or None if there is none."""
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                return self._memory[key]
        if self.root is None or not self._path(key).is_file():
            return None
        from safetensors.torch import load_file

        entry = load_file(str(self._path(key)))
        self._remember(key, entry)
        return entry

    def put(self, key: str, entry: dict[str, torch.Tensor]) -> None:
        """Store `entry` under `key` (contiguous CPU tensors; a second put of a key is a no-op
        on disk: equal keys mean equal content)."""
        entry = {name: t.detach().cpu().contiguous() for name, t in entry.items()}
        self._remember(key, entry)
        if self.root is None or self._path(key).is_file():
            return
        from safetensors.torch import save_file

        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(entry, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _remember(self, key: str, entry: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._memory[key] = entry
            self._memory.move_to_end(key)
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)

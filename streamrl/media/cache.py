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

A store may be given a size limit (`limit`): past it, the entries used longest ago are deleted
until it is 10% under, never one used more recently than `min_age_s` ago (rows on the bus, and
rows a trainer keeps for its recovery, refer to entries the feeder prepared or found a short
while ago; every use refreshes an entry's modification time). A deleted entry is processed again
when a later batch needs it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

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
        self.max_bytes: int | None = None
        self.min_age_s = 0.0
        self._disk_bytes: int | None = None  # counted at the first put under a limit
        self._evict_above = 0  # under a limit: the size that starts the next eviction
        self.evicted = 0  # entries this process deleted to keep under the limit

    def limit(self, max_bytes: int | None, min_age_s: float) -> None:
        """Keep the folder under `max_bytes` (None: no limit), deleting the entries used longest
        ago, none used within the last `min_age_s` seconds."""
        self.max_bytes, self.min_age_s = max_bytes, min_age_s
        self._evict_above = max_bytes or 0

    def _path(self, key: str) -> Path:
        assert self.root is not None and key.isalnum(), key
        return self.root / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry under `key`, or None if there is none."""
        with self._lock:
            found = self._memory.get(key)
            if found is not None:
                self._memory.move_to_end(key)
        if found is not None:
            if self.root is not None and not self._touch(key):
                self._write(key, found)  # deleted on disk by another run's limit: back again
            return found
        if self.root is None or not self._touch(key):
            return None
        from safetensors.torch import load_file

        try:
            entry = load_file(str(self._path(key)))
        except FileNotFoundError:  # deleted since the touch, under another run's limit
            return None
        self._remember(key, entry)
        return entry

    def put(self, key: str, entry: dict[str, torch.Tensor]) -> None:
        """Store `entry` under `key` (contiguous CPU tensors; a second put of a key is a no-op
        on disk: equal keys mean equal content)."""
        entry = {name: t.detach().cpu().contiguous() for name, t in entry.items()}
        self._remember(key, entry)
        if self.root is not None and not self._touch(key):
            self._write(key, entry)

    def _write(self, key: str, entry: dict[str, torch.Tensor]) -> None:
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
        if self.max_bytes is not None:
            self._count_and_evict(path.stat().st_size, self.max_bytes)

    def _touch(self, key: str) -> bool:
        """Mark the entry's file as used now; False when there is none on disk."""
        if self.root is None:
            return False
        try:
            os.utime(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def _count_and_evict(self, added: int, max_bytes: int) -> None:
        if self._disk_bytes is None:
            self._disk_bytes = sum(size for _, size, _ in self._files())
        else:
            self._disk_bytes += added
        if self._disk_bytes > self._evict_above:
            self._evict(int(max_bytes * 0.9), max_bytes)
            # Still over (every entry recent): look again once it has grown by a tenth.
            self._evict_above = max(max_bytes, self._disk_bytes + max_bytes // 10)

    def _files(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every entry on disk (other processes may delete some)."""
        assert self.root is not None
        out = []
        for path in self.root.glob("*/*.safetensors"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, st.st_size, path))
        return out

    def _evict(self, target: int, max_bytes: int) -> None:
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        cutoff = time.time() - self.min_age_s
        freed = removed = 0
        for used, size, path in files:
            if total - freed <= target or used > cutoff:
                break
            path.unlink(missing_ok=True)
            with self._lock:
                self._memory.pop(path.stem, None)
            freed, removed = freed + size, removed + 1
        self._disk_bytes = total - freed
        self.evicted += removed
        if removed:
            log.info(
                "media store %s: deleted %d entries used longest ago (%.1f MB) to keep it "
                "under its limit",
                self.root,
                removed,
                freed / 1e6,
            )
        if self._disk_bytes > max_bytes:
            log.warning(
                "media store %s holds %.1f MB, over its limit of %.1f MB: every entry left was "
                "used within the last %.0f s (data.media.store_keep_min)",
                self.root,
                self._disk_bytes / 1e6,
                max_bytes / 1e6,
                self.min_age_s,
            )

    def _remember(self, key: str, entry: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._memory[key] = entry
            self._memory.move_to_end(key)
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)

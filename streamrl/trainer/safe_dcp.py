"""Reading a torch.distributed.checkpoint (DCP) folder without running code from it.

DCP's own reader unpickles the folder's `.metadata` with `pickle.load`, and each value that is
not a tensor (the learner's version, the optimizer's hyperparameters) with
`torch.load(weights_only=False)`: a crafted folder in a checkpoint would run code on resume.
Here the metadata is first unpickled with only DCP's metadata classes, torch sizes, dtypes and
paths allowed, and each value is first read with `torch.load(weights_only=True)`; either refuses
anything else before DCP reads it. Tensors DCP already reads with `weights_only=True`.

    dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from streamrl.trainer.checkpoint import refusal_reason

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What DCP's metadata pickle holds: plain dataclasses and enums, none of which does anything
# when built.
METADATA_GLOBALS = {
    *(
        (_DCP_METADATA, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """`FileSystemReader` that refuses a metadata file holding anything but DCP's metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with path.open("rb") as f:
            try:
                _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise ValueError(
                    f"{path} is not loaded (nothing in it was run): {e}. DCP writes no such "
                    "file, so it comes from elsewhere or was altered"
                ) from e
        return super().read_metadata(*args, **kwargs)


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that lets only tensors and plain Python values through as values."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"the checkpoint's value {read_item.dest_index.fqn!r} holds objects other than "
                "tensors and plain Python values, so it is not loaded (nothing in it was run): "
                f"{refusal_reason(e)}"
            ) from e
        value.seek(0)  # what weights_only read is safe for DCP to read again
        super().load_bytes(read_item, value)

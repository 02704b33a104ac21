"""Layout of a published weight version: which tensors, in which buckets, and how to (un)flatten.

Both network channels move weights in size-bounded buckets. A `Layout` is the plan for one
version: every tensor's name, dtype and shape (in the publisher's order), and which tensors go
into which bucket. Every bucket holds tensors of one dtype, so a bucket is one flat tensor of that
dtype and each member is a view into it at a naturally aligned offset. The layout travels as JSON
(never pickle), so a receiver can allocate its buffers before the bytes arrive and check that the
weights it gets are the ones it expects.

A bucket can also be written as a safetensors blob (8-byte little-endian header length, JSON
header, raw little-endian tensor bytes), the safe self-describing format of the `tcp` channel.
The blob is written and read here rather than with `safetensors.torch.save`/`load` because those
copy every tensor once more (and `save` refuses tied weights): here each tensor is copied once,
straight into the blob, and read back as a view into the received bytes. Blobs are readable by
the safetensors library and the other way round.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The inverse of `dtype_name`; rejects anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"unknown tensor dtype {name!r} in a weight layout; expected e.g. 'float32'"
        )
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The tensors of one version (publisher's order) and the buckets (indices into `specs`)."""

    specs: tuple[TensorSpec, ...]
    buckets: tuple[tuple[int, ...], ...]

    @classmethod
    def plan(
        cls,
        named_tensors: Mapping[str, torch.Tensor],
        bucket_bytes: int,
        alone_bytes: int | None = None,
    ) -> Layout:
        """Group tensors by dtype into buckets of at most `bucket_bytes`, in the order they
        fill. A tensor larger than `bucket_bytes`, or of at least `alone_bytes`, gets a bucket
        of its own (a channel can then move it without packing it)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        specs = tuple(
            TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in named_tensors.items()
        )
        buckets: list[tuple[int, ...]] = []
        open_buckets: dict[torch.dtype, tuple[list[int], int]] = {}
        for index, spec in enumerate(specs):
            if alone_bytes is not None and spec.nbytes >= alone_bytes:
                buckets.append((index,))
                continue
            members, size = open_buckets.get(spec.dtype, ([], 0))
            if members and size + spec.nbytes > bucket_bytes:
                buckets.append(tuple(members))
                members, size = [], 0
            members.append(index)
            open_buckets[spec.dtype] = (members, size + spec.nbytes)
        buckets.extend(tuple(members) for members, _ in open_buckets.values())
        return cls(specs, tuple(buckets))

    def bucket_specs(self, bucket: int) -> list[TensorSpec]:
        return [self.specs[i] for i in self.buckets[bucket]]

    def bucket_dtype(self, bucket: int) -> torch.dtype:
        return self.specs[self.buckets[bucket][0]].dtype

    def bucket_numel(self, bucket: int) -> int:
        return sum(spec.numel for spec in self.bucket_specs(bucket))

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    def to_dict(self) -> dict:
        """JSON-ready form (names, dtype names, shapes, bucket indices)."""
        return {
            "tensors": [[s.name, dtype_name(s.dtype), list(s.shape)] for s in self.specs],
            "buckets": [list(b) for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, doc: Mapping) -> Layout:
        """The inverse of `to_dict`, checked to be a consistent plan."""
        specs = tuple(
            TensorSpec(str(name), dtype_from_name(dtype), tuple(int(d) for d in shape))
            for name, dtype, shape in doc["tensors"]
        )
        buckets = tuple(tuple(int(i) for i in bucket) for bucket in doc["buckets"])
        layout = cls(specs, buckets)
        layout.validate()
        return layout

    def validate(self) -> None:
        """Every tensor in exactly one bucket, and one dtype per bucket."""
        placed = sorted(i for bucket in self.buckets for i in bucket)
        if placed != list(range(len(self.specs))):
            raise ValueError("weight layout is corrupt: buckets do not cover each tensor once")
        for b in range(len(self.buckets)):
            if len({spec.dtype for spec in self.bucket_specs(b)}) != 1:
                raise ValueError(f"weight layout is corrupt: bucket {b} mixes dtypes")

    def check_fits(
        self, destinations: Mapping[str, torch.Tensor], *, require_all: bool = False
    ) -> None:
        """Raise ValueError naming the first problem unless every tensor here has a destination
        of the same shape and dtype (e.g. in a model's state_dict), and with `require_all` every
        destination is also published."""
        names = {spec.name for spec in self.specs}
        missing = [spec.name for spec in self.specs if spec.name not in destinations]
        unsent = [n for n in destinations if n not in names] if require_all else []
        if missing or unsent:
            raise ValueError(
                f"received weights do not match the model: no destination for {missing[:5]}, "
                f"not received {unsent[:5]}; are trainer and engine loading the same model?"
            )
        for spec in self.specs:
            dest = destinations[spec.name]
            if tuple(dest.shape) != spec.shape or dest.dtype != spec.dtype:
                raise ValueError(
                    f"received tensor {spec.name!r} is {dtype_name(spec.dtype)}{list(spec.shape)}, "
                    f"the model has {dtype_name(dest.dtype)}{list(dest.shape)}"
                )


def flatten_bucket(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy `tensors` back to back into the flat tensor `out` (one copy each, across devices
    if need be) and return `out`."""
    offset = 0
    for tensor in tensors:
        numel = tensor.numel()
        out[offset : offset + numel].view(tensor.shape).copy_(tensor.detach())
        offset += numel
    return out


def as_flat(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """`tensor`'s own memory as a flat tensor if it can be sent or received in place (contiguous,
    of `dtype`, on `device`), else None."""
    if tensor.dtype != dtype or tensor.device != device or not tensor.is_contiguous():
        return None
    return tensor.detach().view(-1)


def unflatten_bucket(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views into `buffer` shaped as `specs` (no copy; they keep `buffer` alive)."""
    views = torch.split(buffer, [spec.numel for spec in specs])
    return {spec.name: view.view(spec.shape) for spec, view in zip(specs, views, strict=True)}


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
_ALIGN = 8  # the data section starts 8-byte aligned (the widest element size)


def to_safetensors(named_tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A safetensors blob (a flat uint8 CPU tensor) holding `named_tensors`."""
    for name, tensor in named_tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(
                f"tensor {name!r} has dtype {tensor.dtype}, not storable as safetensors"
            )
    # Data in order of falling element size: no gaps (the format allows none), all aligned.
    by_size = sorted(named_tensors, key=lambda n: -named_tensors[n].dtype.itemsize)
    offsets, offset = {}, 0
    for name in by_size:
        tensor = named_tensors[name]
        offsets[name] = [offset, offset + tensor.numel() * tensor.dtype.itemsize]
        offset = offsets[name][1]
    entries = {
        name: {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": offsets[name],
        }
        for name, t in named_tensors.items()
    }
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (_round_up(8 + len(header), _ALIGN) - 8 - len(header))
    start = 8 + len(header)
    blob = torch.empty(start + offset, dtype=torch.uint8)
    blob[:start] = torch.frombuffer(
        bytearray(struct.pack("<Q", len(header)) + header), dtype=torch.uint8
    )
    for name, tensor in named_tensors.items():
        begin, end = entries[name]["data_offsets"]
        blob[start + begin : start + end].view(tensor.dtype).copy_(tensor.detach().reshape(-1))
    return blob


def read_safetensors_header(header: bytes, data_bytes: int) -> list[tuple[TensorSpec, int, int]]:
    """(spec, begin, end) of every tensor of a safetensors header, in data order; offsets are
    relative to the data section of `data_bytes` bytes, which they must tile without gaps."""
    entries = json.loads(header)
    entries.pop("__metadata__", None)
    found = []
    for name, entry in entries.items():
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(
                f"tensor {name!r} has safetensors dtype {entry['dtype']!r}, unsupported"
            )
        spec = TensorSpec(name, dtype, tuple(int(d) for d in entry["shape"]))
        begin, end = (int(o) for o in entry["data_offsets"])
        found.append((spec, begin, end))
    found.sort(key=lambda item: (item[1], item[2]))  # an empty tensor before its neighbour
    position = 0
    for spec, begin, end in found:
        if begin != position or end - begin != spec.nbytes:
            raise ValueError(f"tensor {spec.name!r} has data offsets that do not tile the blob")
        position = end
    if position != data_bytes:
        raise ValueError(f"safetensors data holds {data_bytes} bytes, its header {position}")
    return found


def from_safetensors(blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob (flat uint8 CPU tensor), in data order, as views into
    it where aligned."""
    if blob.numel() < 8:
        raise ValueError(f"a safetensors blob has at least 8 bytes, got {blob.numel()}")
    (header_len,) = struct.unpack("<Q", blob[:8].numpy().tobytes())
    start = 8 + header_len
    if start > blob.numel():
        raise ValueError(f"safetensors header of {header_len} bytes overruns the blob")
    header = blob[8:start].numpy().tobytes()
    tensors = {}
    for spec, begin, end in read_safetensors_header(header, blob.numel() - start):
        data = blob[start + begin : start + end]
        if (start + begin) % spec.dtype.itemsize:  # misaligned (another writer): copy
            data = data.clone()
        tensors[spec.name] = data.view(spec.dtype).view(spec.shape)
    return tensors


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _prod(shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel

"""Helpers for tests that start several torch.distributed ranks on one machine."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch.distributed as dist


def free_port() -> int:
    """A loopback port that was free a moment ago (the rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """Join a gloo group for the body; leave it together.

    Every rank passes a barrier before the group is destroyed: a rank that tears its gloo
    context down while a peer is still finishing its last collective can abort the process
    ("terminate called without an active exception")."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()

"""The per-request sampling seed that the vLLM and SGLang engines give each request."""

from __future__ import annotations

import hashlib


def request_seed(seed: int, key: str) -> int:
    """A request's own sampling seed: a stable 63-bit hash of (run seed, request key), so its
    tokens do not depend on the batch (or the engine) it lands in. `key` is the request id, or
    `<request id>@<tokens so far>` for a continuation."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1

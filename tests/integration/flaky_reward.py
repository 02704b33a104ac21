"""A reward function for tests that fails in the ways user code does: it raises, or hangs."""

from __future__ import annotations

import time
import zlib

from streamrl.reward.rule import arith_exact_match


def flaky(response: str, answer: str, **extra: object):
    """Raises for about 1 sample in 4 and hangs for about 1 in 40; scores the rest normally."""
    bucket = zlib.crc32(response.encode()) % 40
    if bucket == 0:
        time.sleep(30)
    if bucket % 4 == 1:
        raise ValueError(f"cannot parse {response!r}")
    return arith_exact_match(response, answer, **extra)

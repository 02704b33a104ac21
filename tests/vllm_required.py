"""Whether the vLLM tests may skip: without vLLM they skip, unless STREAMRL_REQUIRE_VLLM=1 (set
by the Makefile's test targets) turns the skip into a failure."""

from __future__ import annotations

import importlib.util
import os

import pytest

REASON = "vLLM is not installed: run `make install-vllm`"


def vllm_missing() -> bool:
    """True when vLLM is not importable; raises when STREAMRL_REQUIRE_VLLM=1 requires it."""
    if importlib.util.find_spec("vllm") is not None:
        return False
    if os.environ.get("STREAMRL_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"{REASON} (STREAMRL_REQUIRE_VLLM=1 requires it)")
    return True


def skip_module_without_vllm() -> None:
    """Called at the top of a test module that needs vLLM throughout."""
    if vllm_missing():
        pytest.skip(REASON, allow_module_level=True)

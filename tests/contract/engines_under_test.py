"""How the engine contract suite (`test_engine_contract.py`) starts each rollout engine.

A factory takes the model directory, the EOS token id and a scratch directory and returns a
`Subject`: the engine, how to stop it, and how to make an in-flight weight update land at a
known point. That last one is the only thing the protocol leaves to the engine: when it asks
`weight_poll` (between decode steps, or every few milliseconds while HTTP requests run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamrl.api.engine import Engine
from tests.vllm_required import REASON, vllm_missing

# update_after(num_tokens, num_requests) -> a predicate for the weight poll: true once each of
# the `num_requests` requests of the call has exactly `num_tokens` tokens.
UpdateAfter = Callable[[int, int], Callable[[], bool]]


def after_polls(num_tokens: int, num_requests: int) -> Callable[[], bool]:
    """For engines that ask `weight_poll` once before every decode step but the first, each step
    adding one token to every running request: the `num_tokens`-th question comes after
    `num_tokens` tokens."""
    num_polls = 0

    def ready() -> bool:
        nonlocal num_polls
        num_polls += 1
        return num_polls == num_tokens

    return ready


@dataclass
class Subject:
    """One engine under test."""

    engine: Engine
    close: Callable[[], None]
    update_after: UpdateAfter = after_polls
    """Where the in-flight update test hands over new weights (see `UpdateAfter`)."""


def start_builtin(model_dir: Path, eos_token_id: int, scratch: Path) -> Subject:
    from streamrl.models.loading import load_causal_lm, load_tokenizer
    from streamrl.rollout.builtin_engine import BuiltinEngine

    model = load_causal_lm(model_dir)
    tokenizer = load_tokenizer(model_dir)  # for stop strings
    engine = BuiltinEngine(model, eos_token_id=eos_token_id, pad_token_id=0, tokenizer=tokenizer)
    return Subject(engine, close=lambda: None)


def start_vllm(model_dir: Path, eos_token_id: int, scratch: Path) -> Subject:
    """vLLM's CPU engine in this process. Skipped without vLLM, unless STREAMRL_REQUIRE_VLLM=1
    (the Makefile's test targets) makes that a failure."""
    if vllm_missing():
        pytest.skip(REASON)
    from streamrl.config.schema import VllmConfig
    from streamrl.rollout.vllm_engine import VllmEngine

    config = VllmConfig(kv_cache_gib=0.25, in_process=True)
    engine = VllmEngine(model_dir, eos_token_id=eos_token_id, config=config, max_num_seqs=16)
    return Subject(engine, close=engine.close)


def start_sglang(model_dir: Path, eos_token_id: int, scratch: Path) -> Subject:
    """The SGLang adapter attached to the stand-in server (`tests/fakes/sglang_server.py`,
    SGLang's HTTP API answered by the builtin engine), which runs on threads of this process.

    The adapter asks `weight_poll` by the clock, so the server holds every request at
    `num_tokens` tokens (its `hold_at_tokens` knob, released by the next weight update) and the
    poll answers once all of them are there."""
    from streamrl.config.schema import SglangConfig
    from streamrl.rollout.sglang_engine import SglangEngine
    from tests.fakes.sglang_server import FakeSglangServer

    server = FakeSglangServer(model_dir).start()
    config = SglangConfig(url=server.url, weights_dir=str(scratch))
    engine = SglangEngine(model_dir, eos_token_id=eos_token_id, config=config, poll_s=0.005)

    def update_after(num_tokens: int, num_requests: int) -> Callable[[], bool]:
        server.hold_at_tokens = num_tokens
        return lambda: server.progress() == [num_tokens] * num_requests

    def close() -> None:
        engine.close()
        server.stop()

    return Subject(engine, close=close, update_after=update_after)

"""Fixtures shared by the unit tests: a one-layer tiny model directory and a few task prompts.
A test module that needs another size defines its own `model_dir`, which takes precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.data.prompts import encode_prompt
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.models.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model_dir(out, hidden_size=32, num_layers=1, num_heads=2, seed=0)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tokenizer = build_tokenizer()
    texts = {"a": "37+85=", "b": "1+2=", "c": "123+4567=", "d": "9+9="}
    return {rid: encode_prompt(tokenizer, text) for rid, text in texts.items()}

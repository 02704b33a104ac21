"""The character tokenizer and its chat template, the built-in tiny Qwen3, and local loading."""

from __future__ import annotations

import dataclasses
import json
import pickle
import string
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from streamrl.api.run import RunContext
from streamrl.config.loader import load_config
from streamrl.models.loading import load_causal_lm, load_tokenizer, policy_tokenizer
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.models.tokenizer import ASSISTANT, END, USER, build_tokenizer

# Every printable ASCII character the tokenizer keeps (tabs and other control whitespace map to
# <|unk|>, by design).
ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# -- tokenizer ----------------------------------------------------------------------------------


def test_every_kept_character_is_one_token(tokenizer) -> None:
    ids = tokenizer(ALPHABET, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(set(ids)) == len(ALPHABET)
    assert tokenizer.unk_token_id not in ids


@given(st.text(alphabet=ALPHABET.replace("\n", ""), max_size=60))
def test_printable_text_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    if "<|" not in text:  # text may spell a special token, which is then one token
        assert len(ids) == len(text)


def test_consecutive_newlines_round_trip(tokenizer) -> None:
    ids = tokenizer("a\n\nb", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "a\n\nb"


def test_chat_template_structure(tokenizer) -> None:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "37+85="}], add_generation_prompt=True, tokenize=False
    )
    assert ids == "<|user|>37+85=<|end|><|assistant|>"
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": "37+85="}], add_generation_prompt=True, tokenize=True
    )
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    assert tokenizer.convert_ids_to_tokens(list(ids)) == [USER, *"37+85=", END, ASSISTANT]


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token == END == "<|end|>"
    assert tokenizer.convert_tokens_to_ids(END) == tokenizer.eos_token_id
    assert tokenizer.pad_token_id not in (tokenizer.eos_token_id, tokenizer.unk_token_id)
    k = tokenizer.convert_tokens_to_ids("k")
    assert tokenizer.decode([tokenizer.eos_token_id, k], skip_special_tokens=True) == "k"


# -- the tiny model directory ----------------------------------------------------------------------


def test_tiny_model_dir_loads_with_plain_transformers(model_dir: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    loaded_tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.architectures == ["Qwen3ForCausalLM"]
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size % 128 == 0 and model.config.vocab_size >= len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert loaded_tok.eos_token == END
    prompt = [{"role": "user", "content": "1+1="}]
    assert loaded_tok.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=False
    ) == tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert loaded_tok("1+1=2")["input_ids"] == tokenizer("1+1=2")["input_ids"]


def test_tiny_model_is_seeded(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model_dir(tmp_path, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    other = build_tiny_model_dir(
        tmp_path / "other", hidden_size=32, num_layers=1, num_heads=2, seed=1
    )
    weights = {n: p for n, p in load_causal_lm(model_dir).named_parameters()}
    same = dict(load_causal_lm(again).named_parameters())
    different = dict(load_causal_lm(other).named_parameters())
    assert all(torch.equal(weights[n], same[n]) for n in weights)
    assert not torch.equal(
        weights["model.embed_tokens.weight"], different["model.embed_tokens.weight"]
    )


def test_load_causal_lm_in_eval_mode_and_dtype(model_dir: Path) -> None:
    model = load_causal_lm(model_dir, dtype="bfloat16")
    assert not model.training
    assert next(model.parameters()).dtype == torch.bfloat16


def test_load_tokenizer_pads_on_the_left(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    assert tok.padding_side == "left" and tok.pad_token_id is not None


def test_the_roles_of_one_context_share_its_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    ctx = RunContext(load_config([]), model_dir, tmp_path, [], [])
    tokenizer = policy_tokenizer(ctx)
    assert policy_tokenizer(ctx) is tokenizer and tokenizer.padding_side == "left"
    # A context sent to another process (Ray pickles it), or a copy, loads its own.
    sent = pickle.loads(pickle.dumps(ctx))
    assert sent.cached_tokenizer is None and ctx.cached_tokenizer is tokenizer
    assert dataclasses.replace(ctx, train_rows=None).cached_tokenizer is None
    assert policy_tokenizer(sent) is not tokenizer
    assert policy_tokenizer(sent).eos_token_id == tokenizer.eos_token_id
    assert sent == ctx  # the cache is no part of what a context is


def test_a_plain_tokenizer_loads_as_autotokenizer_would_build_it(
    model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # The built-in tokenizer skips AutoTokenizer's import and is the same tokenizer.
    import shutil

    import transformers

    mine = load_tokenizer(model_dir)
    auto = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert type(mine) is type(auto)
    text = mine.apply_chat_template([{"role": "user", "content": "12+34="}], tokenize=False)
    assert mine(text)["input_ids"] == auto(text)["input_ids"]
    assert (mine.eos_token_id, mine.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    # Any other class goes through AutoTokenizer.
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "SomeModelTokenizer"})
    )
    called = []
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda path, **kw: called.append(path) or auto,
    )
    assert load_tokenizer(other) is auto and called == [str(other)]


def test_loading_a_directory_without_config_says_why(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json.*never downloads"):
        load_causal_lm(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_tokenizer(tmp_path / "missing")

"""The built-in judge: built once per settings into the cache, an ordinary HF directory with its
held-out evaluation beside it."""

from __future__ import annotations

import json
from dataclasses import replace

from streamrl.judge import model as judge_model
from streamrl.judge.model import (
    JudgeBuild,
    ensure_judge_dir,
    judge_key,
    parse_verdict,
    read_judge_eval,
)

TINY = JudgeBuild(
    hidden_size=32, num_layers=1, num_heads=2, steps=4, batch_size=8, eval_examples=16
)
FIELDS = {
    "verdict_accuracy",
    "accuracy_on_correct",
    "accuracy_on_incorrect",
    "examples",
    "steps",
    "build_s",
}


def test_built_once_into_the_cache_as_a_loadable_model(tmp_path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    progress_calls, advanced = [], []

    def progress(description: str, total: int):
        progress_calls.append((description, total))
        return advanced.append

    out = ensure_judge_dir(TINY, tmp_path, progress)
    assert out == tmp_path / f"judge-{judge_key(TINY)}"
    assert progress_calls == [("judge (SFT on verdicts)", TINY.steps)]
    assert sum(advanced) == TINY.steps
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-built left behind

    scores = read_judge_eval(out)
    assert scores is not None and set(scores) == FIELDS
    assert scores == json.loads((out / "judge_eval.json").read_text())
    assert scores["examples"] == TINY.eval_examples and scores["steps"] == TINY.steps
    for name in ("verdict_accuracy", "accuracy_on_correct", "accuracy_on_incorrect"):
        assert scores[name] is None or 0.0 <= scores[name] <= 1.0

    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.config.hidden_size == TINY.hidden_size
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out), local_files_only=True)
    assert tokenizer.decode(tokenizer("incorrect")["input_ids"]) == "incorrect"

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached judge was built again")

    monkeypatch.setattr(judge_model, "_build_judge_dir", no_rebuild)
    assert ensure_judge_dir(TINY, tmp_path) == out


def test_key_names_every_setting() -> None:
    assert judge_key(TINY) == judge_key(replace(TINY))
    assert len(judge_key(TINY)) == 12
    keys = {judge_key(replace(TINY, steps=5)), judge_key(replace(TINY, seed=1)), judge_key(TINY)}
    assert len(keys) == 3


def test_read_judge_eval_of_a_directory_without_one(tmp_path) -> None:
    assert read_judge_eval(tmp_path) is None


def test_parse_verdict() -> None:
    assert parse_verdict(" correct\n") == "correct"
    assert parse_verdict("incorrect") == "incorrect"
    assert parse_verdict("correct!") is None
    assert parse_verdict("") is None

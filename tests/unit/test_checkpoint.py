"""A checkpoint's model folder is a complete HF directory: every tokenizer file the policy came
with, weights in shards when the model is large, and a round trip that restores it exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.trainer.algos.objective import LossSettings
from streamrl.trainer.checkpoint import load_checkpoint, read_weights, save_checkpoint
from streamrl.trainer.learner import Learner


def make_learner(model_dir: Path) -> Learner:
    return Learner(
        load_causal_lm(model_dir),
        pad_token_id=0,
        lr=1e-2,
        weight_decay=0.0,
        grad_clip=None,
        temperature=1.0,
        settings=LossSettings(),
    )


def test_a_checkpoint_carries_every_tokenizer_file_and_no_stale_weights(model_dir, tmp_path):
    policy = tmp_path / "policy"
    shutil.copytree(model_dir, policy)
    # Files a BPE or SentencePiece tokenizer, or a processor, come with; and weights in other
    # formats that must not shadow the checkpoint's own.
    extras = ("vocab.json", "merges.txt", "tokenizer.model", "preprocessor_config.json")
    for name in extras:
        (policy / name).write_text("{}")
    (policy / "pytorch_model.bin").write_bytes(b"stale")
    (policy / "model.safetensors.index.json").write_text("{}")
    learner = make_learner(policy)
    ckpt = save_checkpoint(tmp_path / "run", 3, learner, policy, {"cursor": 3})
    saved = {p.name for p in (ckpt / "model").iterdir()}
    assert set(extras) <= saved
    assert "pytorch_model.bin" not in saved and "model.safetensors.index.json" not in saved
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= saved
    tokenizer = load_tokenizer(ckpt / "model")
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )


def test_sharded_weights_are_read_whole_and_restore_the_model(model_dir, tmp_path):
    learner = make_learner(model_dir)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.5)
    ckpt = save_checkpoint(tmp_path / "run", 5, learner, model_dir, {})
    # Re-save as shards, as save_pretrained does for models larger than its shard size.
    shards = tmp_path / "sharded"
    learner.model.save_pretrained(str(shards), max_shard_size="20KB")
    assert len(list(shards.glob("*.safetensors"))) > 1
    for old in (ckpt / "model").glob("*.safetensors"):
        old.unlink()
    for part in shards.glob("*.safetensors*"):
        shutil.copy(part, ckpt / "model" / part.name)
    assert set(read_weights(ckpt / "model")) == set(read_weights(shards))
    restored = make_learner(model_dir)
    state = load_checkpoint(ckpt, restored)
    assert state["next_step"] == 5
    for (name, a), b in zip(
        learner.model.named_parameters(), restored.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name

"""The built-in tiny model: a standard Qwen3ForCausalLM with a small config.

Because it is an ordinary Hugging Face architecture saved with `save_pretrained`, the same
directory loads in transformers, vLLM and other libraries, so every comparison is like for like.
The weights start random (seeded); the warm start (`streamrl.trainer.sft`) makes them partly right.
"""

from __future__ import annotations

from pathlib import Path

from streamrl.models.tokenizer import build_tokenizer


def tiny_qwen3_config(vocab_size: int, *, hidden_size: int, num_layers: int, num_heads: int):
    """Return a `Qwen3Config` for a tiny model with `vocab_size` tokens (padded to 128)."""
    from transformers import Qwen3Config

    padded_vocab = ((vocab_size + 127) // 128) * 128
    head_dim = hidden_size // num_heads
    return Qwen3Config(
        vocab_size=padded_vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=head_dim,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )


def build_tiny_model_dir(
    out_dir: Path, *, hidden_size: int, num_layers: int, num_heads: int, seed: int
) -> Path:
    """Create a randomly initialised tiny Qwen3 model plus tokenizer in `out_dir` (HF format)."""
    import torch
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = tiny_qwen3_config(
        len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads
    )
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir

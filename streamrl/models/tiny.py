"""The built-in tiny model: a standard Qwen3ForCausalLM (or Qwen3MoeForCausalLM) with a small config.

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


def tiny_qwen3_moe_config(
    vocab_size: int,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_experts: int,
    experts_per_token: int,
):
    """Return a `Qwen3MoeConfig` shaped like `tiny_qwen3_config`'s model, with a router and
    `num_experts` experts in every layer, each half the dense MLP's width (so top-2 routing
    computes what the dense model does per token)."""
    from transformers import Qwen3MoeConfig

    dense = tiny_qwen3_config(
        vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads
    )
    keep = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
        "num_key_value_heads head_dim max_position_embeddings rope_parameters tie_word_embeddings"
    ).split()
    return Qwen3MoeConfig(
        **{key: getattr(dense, key) for key in keep},
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=dense.intermediate_size // 2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        torch_dtype="float32",
    )


def build_tiny_model_dir(
    out_dir: Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    seed: int,
    num_experts: int = 0,
    experts_per_token: int = 2,
) -> Path:
    """Create a randomly initialised tiny Qwen3 model (a Qwen3-MoE with `num_experts` > 0) plus
    tokenizer in `out_dir` (HF format)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    shape = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads)
    if num_experts:
        config = tiny_qwen3_moe_config(
            len(tokenizer), num_experts=num_experts, experts_per_token=experts_per_token, **shape
        )
    else:
        config = tiny_qwen3_config(len(tokenizer), **shape)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir

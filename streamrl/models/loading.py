"""Loading a causal LM and its tokenizer from a local Hugging Face directory.

Nothing is fetched from a hub: `local_files_only=True` makes a missing directory a clear error
instead of a download attempt.
"""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """Return the tokenizer saved in `model_dir`, left-padding (what batched decoding needs)."""
    from transformers import AutoTokenizer

    _check_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(model_dir: str | Path, *, dtype: str = "float32"):
    """Return the causal LM in `model_dir` on CPU, in `dtype`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _check_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=getattr(torch, dtype)
    )
    model.eval()
    return model


def _check_dir(model_dir: str | Path) -> None:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no config.json: expected a local Hugging Face model "
            "directory (streamrl never downloads weights at run time)"
        )

"""Loading a causal LM and its tokenizer from a local Hugging Face directory.

Nothing is fetched from a hub: `local_files_only=True` makes a missing directory a clear error
instead of a download attempt.
"""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.config.derived import MULTIMODAL_CONFIG_KEYS, model_config

# The prefix of a Qwen2.5-Omni directory's thinker weights, and the speech output's speaker
# table, which the Omni model's loading reads (an empty one for a thinker-only model).
THINKER_PREFIX = "thinker."
SPEAKERS_FILE = "spk_dict.pt"

# Tokenizer classes that are the `tokenizers` library's tokenizer itself, with no class of their
# own: `AutoTokenizer` would build this very class (the built-in model's tokenizer is one).
_PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str | Path):
    """Return the tokenizer saved in `model_dir`, left-padding (what batched decoding needs).

    A plain `tokenizers` tokenizer is built by its class directly: importing `AutoTokenizer`
    costs about 2.5 CPU-s more on a small CPU (its registry of every model's tokenizer), paid by
    every role process of a run; any other tokenizer goes through `AutoTokenizer`."""
    _check_dir(model_dir)
    if _tokenizer_class(model_dir) in _PLAIN_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    tok = tokenizer_class.from_pretrained(str(model_dir), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def policy_tokenizer(ctx):
    """The policy's tokenizer of the run `ctx` (an `api.run.RunContext`): loaded at the first
    call, then kept in the context (`cached_tokenizer`), so the roles built from one context in
    one process share one tokenizer. Every role gets its tokenizer through here."""
    if ctx.cached_tokenizer is None:
        tokenizer = load_tokenizer(ctx.policy_dir)
        # Roles in threads of their own share it. A fast tokenizer whose file sets padding or
        # truncation clears them at its first encode, a change two threads cannot make at once
        # ("Already borrowed"): one encode here settles that state before any thread shares it.
        tokenizer("")
        ctx.cached_tokenizer = tokenizer
    return ctx.cached_tokenizer


def load_causal_lm(model_dir: str | Path, *, dtype: str = "float32"):
    """Return the causal LM in `model_dir` on CPU, in `dtype`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _check_dir(model_dir)
    if (Path(model_dir) / "adapter_config.json").is_file():  # a LoRA run's checkpoint
        return _load_merged(model_dir, getattr(torch, dtype)).eval()
    auto = AutoModelForCausalLM
    if is_omni_dir(model_dir):  # the thinker alone (its weights are the Omni model's thinker.*)
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration as auto
    elif is_multimodal_dir(model_dir):  # a vision-language model (Qwen-VL): its own auto class
        from transformers import AutoModelForImageTextToText as auto
    model = auto.from_pretrained(str(model_dir), local_files_only=True, dtype=getattr(torch, dtype))
    model.eval()
    return model


def is_multimodal_dir(model_dir: str | Path) -> bool:
    """Whether the model in `model_dir` takes images, video or audio (its config has a vision
    tower, or is a Qwen2.5-Omni thinker's)."""
    return any(key in model_config(model_dir) for key in MULTIMODAL_CONFIG_KEYS)


def is_omni_dir(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a Qwen2.5-Omni model (its config a `thinker_config`): the
    roles run its thinker."""
    return "thinker_config" in model_config(model_dir)


def save_model(model, out_dir: str | Path) -> None:
    """`model.save_pretrained(out_dir)`; a Qwen2.5-Omni thinker is saved as a whole Omni model
    without speech output (config `thinker_config`, weights `thinker.*`, an empty speaker
    table), the layout vLLM reads and `load_causal_lm` loads the thinker from, like the
    directory the run started from."""
    from streamrl.models.vision import is_omni_thinker

    model.save_pretrained(str(out_dir))
    if not is_omni_thinker(model):
        return
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5OmniConfig

    out = Path(out_dir)
    weights = {}
    for path in sorted(out.glob("*.safetensors")):
        weights.update({THINKER_PREFIX + k: v for k, v in load_file(str(path)).items()})
        path.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    thinker = model.config.to_dict()
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    config.save_pretrained(str(out))
    torch.save({}, out / SPEAKERS_FILE)


def base_model_dir(model_dir: str | Path) -> Path:
    """The base model's directory of a LoRA checkpoint's model folder, or `model_dir` itself."""
    config = Path(model_dir) / "adapter_config.json"
    if not config.is_file():
        return Path(model_dir)
    return Path(json.loads(config.read_text())["base_model_name_or_path"])


def _load_merged(model_dir: str | Path, dtype):
    """The model a LoRA run's checkpoint folder holds: its base with the adapter merged in
    (`trainer/lora.py` writes such folders)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = base_model_dir(model_dir)
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} holds a LoRA adapter whose base model directory {str(base_dir)!r} "
            "(base_model_name_or_path in its adapter_config.json) has no config.json"
        )
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True, dtype=dtype)
    return PeftModel.from_pretrained(base, str(model_dir)).merge_and_unload()


def _tokenizer_class(model_dir: str | Path) -> str | None:
    """The `tokenizer_class` of the directory's tokenizer_config.json, if it says one."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def _check_dir(model_dir: str | Path) -> None:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no config.json: expected a local Hugging Face model "
            "directory (streamrl never downloads weights at run time)"
        )


def set_threads(num: int) -> None:
    """torch's intra-op threads of this process (and of the calling thread's OpenMP pool)."""
    import torch

    torch.set_num_threads(num)


def resolve_device(key: str, device: str) -> str:
    """A device setting (`key` names it in errors) resolved: `auto` is a GPU when torch sees one."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{key}=cuda, but torch sees no GPU; use {key}=cpu")
    return device


def load_policy_model(
    ctx, device_key: str = "trainer.device", *, onednn: bool = True, dtype: str | None = None
):
    """The policy model of the run `ctx` (an `api.run.RunContext`), on the device the setting
    `device_key` names (the trainer, reference and pi_old models use `trainer.device`, the
    builtin engine `rollout.device`). Every role loads its model through here. `onednn=False`
    keeps PyTorch's own linears whatever `model.onednn_linears` says (a compiled or
    mixed-precision trainer). `dtype` overrides `model.dtype` (a mixed-precision trainer's
    fp32 master weights)."""
    from streamrl.models.onednn import configure_linears

    section, field = device_key.split(".")
    device = resolve_device(device_key, getattr(getattr(ctx.cfg, section), field))
    model = load_causal_lm(ctx.policy_dir, dtype=dtype or ctx.cfg.model.dtype).to(device)
    if onednn:
        configure_linears(model, ctx.cfg.model.onednn_linears)
    return model

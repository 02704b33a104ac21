"""LoRA training through `peft`: adapters on chosen modules of the policy, the base frozen.

    load_causal_lm(dir) ──> apply_lora(model, trainer.lora) ──> LoraLearner(model, ...)
                            │ peft wraps the target linears:         │ optimizer: adapters only
                            │ y = W x + (alpha/r) B A dropout(x)     │ named_weights(): merged
                            ▼                                        ▼
    engines and weight channels receive W + (alpha/r) B A under the base model's own names,
    so every engine (builtin, vLLM, SGLang) and channel loads an ordinary full model.

- **Weights to the engines.** `merged_weights` adds each adapter's delta (peft's own
  `get_delta_weight`) to a copy of its base weight, the same sum `merge_and_unload` makes, and
  names every tensor as the base model names it (`...q_proj.weight`, not
  `...q_proj.base_layer.weight`). The training model is never changed: merging in place and
  unmerging would not give the base weights back bit for bit.
- **Reference log-probs.** With a KL term in the loss, `LoraLearner` scores each micro-batch a
  second time with the adapters disabled (`disable_adapter()`): that is exactly the initial
  policy, so the run loads no reference model and deploys no reference role
  (`api/registry.py`, `runtime/sync.py`). The KL in the reward is refused (`config/schema.py`):
  the advantages are taken before the trainer sees the rows.
- **Checkpoints** hold the adapter only: `PeftModel.save_pretrained` writes
  `adapter_model.safetensors` and `adapter_config.json` (whose `base_model_name_or_path` is
  the policy directory) and the optimizer state covers the adapter's parameters alone. A
  resumed run loads the base from the policy directory and the adapter from the checkpoint.
  `models/loading.py` loads such a folder as the merged model (`streamrl eval`, `model.path=`).
- **Evaluation** runs the builtin engine over the base model with the merged weights swapped
  in for its duration (`merged_in_place`); the original parameters are put back afterwards.

- **FSDP2 ranks** (`trainer.world_size > 1`, `trainer/ranks.py`): rank 0 adds the adapters to the
  model it loads, every rank adds them to its meta-device build before sharding, and rank 0
  sends the ranks their shards of both (so every rank starts from rank 0's A). The ranks train
  `ShardedLoraLearner`s; rank 0 merges the gathered weights in its unsharded copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from streamrl.api import fields as F
from streamrl.trainer.learner import Learner

if TYPE_CHECKING:
    from streamrl.config.schema import LoraConfig

log = logging.getLogger(__name__)


def apply_lora(
    model: torch.nn.Module, lora: LoraConfig, *, seed: int | None = None
) -> torch.nn.Module:
    """`model` with LoRA adapters on `lora.target_modules` (a `peft.PeftModel`): only the
    adapters require gradients. `seed`: draw the adapters' A from it (B starts at zero), so
    one process and FSDP2 ranks start from the same adapters. Logs the number of trainable
    parameters."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if seed is not None:
        torch.manual_seed(seed)

    settings = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, settings)
    trainable, total = num_parameters(model)
    log.info(
        "trainer: LoRA rank %d on %s: %d trainable parameters of %d (%.2f%%)",
        lora.rank,
        lora.target_modules,
        trainable,
        total,
        100 * trainable / total,
    )
    return model


def num_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts of `model`."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def is_lora(model: Any) -> bool:
    """Whether `model` is a `peft` model (without importing peft where it is not one)."""
    return type(model).__module__.startswith("peft.")


def _lora_layers(model) -> dict[str, Any]:
    """The modules with adapters, by their name in the base model (`model.layers.0.mlp.up_proj`)."""
    from peft.tuners.lora import LoraLayer

    return {
        name: module
        for name, module in model.get_base_model().named_modules()
        if isinstance(module, LoraLayer)
    }


def _merged(layer) -> torch.Tensor:
    """`layer`'s base weight plus its active adapters' deltas, as `merge_and_unload` sums them."""
    weight = layer.get_base_layer().weight.detach()
    for adapter in layer.active_adapters:
        # Summed in the promoted dtype, then rounded, as peft's in-place `+=` does (fp32
        # adapters over a bf16 base).
        weight = (weight + layer.get_delta_weight(adapter)).to(weight.dtype)
    return weight


def base_name(peft_name: str) -> str:
    """A base-model parameter's name as the unwrapped model names it."""
    return peft_name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_weights(model) -> dict[str, torch.Tensor]:
    """Copies (on the CPU) of the full weights with the adapters merged in, keyed and shaped
    like the base model's own `named_parameters()`; the training model is left as it is."""
    adapted = {f"{name}.weight": layer for name, layer in _lora_layers(model).items()}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.get_base_model().named_parameters():
        if any(part.startswith("lora_") for part in name.split(".")):
            continue  # an adapter's own A or B
        key = base_name(name)
        layer = adapted.get(key)
        if layer is not None and layer.active_adapters:  # a new tensor already: not copied again
            out[key] = _merged(layer).to("cpu")
        else:
            out[key] = p.detach().to("cpu", copy=True)
    return out


@contextmanager
def merged_in_place(model) -> Iterator[None]:
    """For its duration, each adapted layer's base weight is the merged weight (a new tensor);
    the original parameters are put back afterwards, unchanged. For `evaluation_model`."""
    if not is_lora(model):
        yield
        return
    originals = {}
    with torch.no_grad():
        for name, layer in _lora_layers(model).items():
            base = layer.get_base_layer()
            originals[name] = (base, base.weight)
            base.weight = torch.nn.Parameter(_merged(layer), requires_grad=False)
    try:
        yield
    finally:
        for base, weight in originals.values():
            base.weight = weight


def evaluation_model(model):
    """What held-out evaluation runs its engine over: the model itself, or for a LoRA model its
    base (whose adapted layers hold the merged weights under `merged_in_place`)."""
    return model.get_base_model() if is_lora(model) else model


def evaluation_weights(model):
    """A context in which `evaluation_model(model)` computes with the trained weights."""
    return merged_in_place(model) if is_lora(model) else nullcontext()


class LoraLearner(Learner):
    """A `Learner` over a LoRA model (`apply_lora`): the optimizer holds the adapters only (the
    base learner passes it the parameters that require gradients), and what leaves the trainer
    is the merged model (weights) or the adapter (checkpoints)."""

    def accumulate(
        self, rows: Sequence[Mapping[str, Any]], *, num_skipped_tokens: float = 0.0
    ) -> None:
        if rows and self.settings.kl_in_loss and F.REF_LOGPROBS not in rows[0]:
            refs = self.reference_logprobs(rows)
            rows = [{**r, F.REF_LOGPROBS: ref} for r, ref in zip(rows, refs, strict=True)]
        super().accumulate(rows, num_skipped_tokens=num_skipped_tokens)

    def reference_logprobs(self, rows: Sequence[Mapping[str, Any]]) -> list[np.ndarray]:
        """Each row's response log-probs under the base model (the adapters disabled): the
        initial policy's, as the reference role would compute them, in eval mode."""
        self.model.eval()
        try:
            with self.model.disable_adapter():
                return self._detached_logprobs(rows)
        finally:
            self.model.train()

    def named_weights(self) -> dict[str, torch.Tensor]:
        return merged_weights(self.model)

    def load_weights_and_optimizer(
        self,
        weights: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any],
        directory: Any = None,
    ) -> None:
        """Restore a checkpoint: `weights` are the adapter's, as `save_pretrained` wrote them."""
        load_adapter(self.model, weights, directory)
        self.optimizer.load_state_dict(optimizer_state)


def load_adapter(model, weights: Mapping[str, torch.Tensor], directory: Any = None) -> None:
    """Load a checkpoint's adapter (`weights` as `save_pretrained` wrote them) into the LoRA
    `model`; refuse a full model's weights or an adapter of another shape."""
    from peft import set_peft_model_state_dict

    if not any(".lora_" in name for name in weights):
        raise ValueError(
            f"checkpoint {directory} holds no LoRA adapter (a full model's weights?): resume "
            "it with trainer.lora.rank=0, or start a new LoRA run"
        )
    result = set_peft_model_state_dict(model, dict(weights))
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"the checkpoint's adapter does not match trainer.lora: missing {missing}, "
            f"unexpected {result.unexpected_keys}"
        )

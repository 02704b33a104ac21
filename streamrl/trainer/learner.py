"""The policy learner: a model and its optimizer, fed micro-batches as they stream in.

`accumulate` runs forward and backward on one micro-batch and adds its gradient (as a loss *sum*);
`step` divides the accumulated gradient by the step's global normaliser, clips, and applies it.
So a step's gradient does not depend on how its samples were split into micro-batches or in
which order they arrived. The trainer role and the synchronous loop both drive this class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamrl.trainer.algos.grpo import LossSettings, loss_normaliser, policy_loss_sum
from streamrl.trainer.logprobs import pack, response_logprobs


class Learner:
    def __init__(
        self,
        model,
        *,
        pad_token_id: int,
        lr: float,
        weight_decay: float,
        grad_clip: float | None,
        temperature: float,
        settings: LossSettings,
        lr_schedule: str = "constant",
        total_steps: int = 1,
        min_lr_ratio: float = 0.1,
    ):
        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}")
        self.model = model
        self.lr = lr
        self.lr_schedule = lr_schedule
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.pad_token_id = pad_token_id
        self.grad_clip = grad_clip
        self.temperature = temperature
        self.settings = settings
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99)
        )
        self.version = 0
        self._reset_step()

    def lr_at(self, version: int) -> float:
        """Learning rate of the step that makes version+1: a function of the version alone, so
        a resumed run continues the schedule with no extra state."""
        if self.lr_schedule == "constant" or self.total_steps <= 1:
            return self.lr
        progress = min(version / (self.total_steps - 1), 1.0)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)

    def _reset_step(self) -> None:
        self._normaliser = 0.0
        self._loss_sum = 0.0
        self._stats: dict[str, float] = {}

    def accumulate(
        self, rows: Sequence[Mapping[str, Any]], *, num_skipped_tokens: float = 0.0
    ) -> None:
        """Forward and backward one micro-batch; `num_skipped_tokens` counts rows left out of it
        (zero advantage) that still belong in the normaliser."""
        self._normaliser += num_skipped_tokens
        if not rows:
            return
        self.model.train()
        batch = pack(
            [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], self.pad_token_id
        )
        mask_bt = batch.response_mask_br
        logprobs_bt = response_logprobs(self.model, batch, self.temperature)
        rollout_bt = _pad_like(mask_bt, [r["rollout_logprobs"] for r in rows])
        advantages_b = torch.tensor([float(r["advantages"]) for r in rows])
        ref_bt = None
        if self.settings.kl_coef > 0:
            ref_bt = _pad_like(mask_bt, [r["ref_logprobs"] for r in rows])
        loss_sum, stats = policy_loss_sum(
            logprobs_bt, rollout_bt, advantages_b, mask_bt, self.settings, ref_bt
        )
        loss_sum.backward()
        self._normaliser += loss_normaliser(mask_bt, self.settings.loss_agg)
        self._loss_sum += float(loss_sum.detach())
        for key, value in stats.items():
            weight = stats["num_tokens"] if key.endswith("_mean") or key.endswith("_frac") else 1.0
            self._stats[key] = self._stats.get(key, 0.0) + value * weight

    def step(self) -> dict[str, float]:
        """Apply the accumulated gradient; returns the step's loss and statistics."""
        scale = 1.0 / max(self._normaliser, 1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        grad_norm = 0.0
        if self.grad_clip is not None:
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            )
        lr = self.lr_at(self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        tokens = max(self._stats.get("num_tokens", 0.0), 1.0)
        out = {
            "loss": self._loss_sum * scale,
            "grad_norm": grad_norm,
            "is_weight_mean": self._stats.get("is_weight_mean", 0.0) / tokens,
            "is_truncated_frac": self._stats.get("is_truncated_frac", 0.0) / tokens,
            "kl_mean": self._stats.get("kl_mean", 0.0) / tokens,
            "logprob_mismatch": self._stats.get("mismatch_abs_sum", 0.0) / tokens,
            "trained_tokens": self._stats.get("num_tokens", 0.0),
            "lr": lr,
        }
        self._reset_step()
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the parameters, keyed like the engine's model (for weight sync)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])


def _pad_like(mask_bt: torch.Tensor, seqs: Sequence[Any]) -> torch.Tensor:
    out = torch.zeros_like(mask_bt)
    for i, s in enumerate(seqs):
        values = torch.tensor(np.asarray(s, dtype=np.float32))  # a copy: Ray arrays are read-only
        out[i, : len(values)] = values
    return out

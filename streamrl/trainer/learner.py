"""The policy learner: a model and its optimizer, fed micro-batches as they stream in.

`accumulate` runs forward and backward on one micro-batch and adds its gradient (as a loss *sum*);
`step` divides the accumulated gradient by the step's global normaliser, clips, and applies it.
So a step's gradient does not depend on how its samples were split into micro-batches or in
which order they arrived. The trainer role and the synchronous loop both drive this class, through
`service.BatchTrainer`, which makes one such update per batch or, with PPO mini-batches and
epochs, several (`step(ends_version=False)` for all but the last).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamrl.api import fields as F
from streamrl.media.prepare import row_media
from streamrl.metrics.memory import process_peak_bytes
from streamrl.models import moe
from streamrl.trainer.algos.losses import batch_normaliser
from streamrl.trainer.algos.objective import LossSettings, policy_loss_sum
from streamrl.trainer.logprobs import pack, response_logprobs
from streamrl.trainer.microbatch import padding_free_logprobs
from streamrl.trainer.schedule import scheduled_lr

log = logging.getLogger(__name__)

# Statistics reported per step as means over the step's tokens.
STAT_MEANS = (
    "is_weight_mean",
    "is_truncated_frac",
    "clip_frac",
    "approx_kl",
    "kl_mean",
    "entropy_mean",
    "stale_masked_frac",
)


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
        warmup_steps: int = 0,
        total_steps: int = 1,
        min_lr_ratio: float = 0.1,
        padding_free: bool = False,
        compile: bool = False,
        mixed_precision: bool = False,
        router_aux_loss_coef: float = 0.0,
    ):
        scheduled_lr(0, lr=lr, schedule=lr_schedule, total_steps=total_steps)  # checks it
        self.model = model
        # What the training forward calls: the model, or a compiled view of it sharing its
        # parameters (evaluation and the engine keep calling the model itself).
        self.forward_model = compile_for_training(model) if compile else model
        if mixed_precision:  # bf16 compute over fp32 master weights (and so fp32 AdamW state)
            self.forward_model = BF16Compute(self.forward_model)
        self.lr = lr
        self.lr_schedule = lr_schedule
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.pad_token_id = pad_token_id
        self.grad_clip = grad_clip
        self.temperature = temperature
        self.settings = settings
        self.padding_free = padding_free
        self.router_aux_loss_coef = router_aux_loss_coef
        self.device = next(model.parameters()).device
        # The parameters that train: all of them, or a LoRA model's adapters (`lora.py`).
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=lr,
            weight_decay=weight_decay,
            betas=(0.9, 0.99),
        )
        self.version = 0
        self._reset_step()

    def lr_at(self, version: int) -> float:
        """Learning rate of every optimizer update of the batch that makes version+1: a
        function of the version alone (the schedule counts generated batches, not updates), so a
        resumed run continues the schedule with no extra state (`schedule.scheduled_lr`)."""
        return scheduled_lr(
            version,
            lr=self.lr,
            schedule=self.lr_schedule,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def _reset_step(self) -> None:
        self._normaliser = 0.0
        self._loss_sum = 0.0
        self._stats: dict[str, float] = {}

    def accumulate(
        self, rows: Sequence[Mapping[str, Any]], *, num_skipped_tokens: float = 0.0
    ) -> None:
        """Forward and backward one micro-batch; `num_skipped_tokens` is the normaliser share of
        rows left out of it (zero advantage) that still belong in the normaliser."""
        self._normaliser += num_skipped_tokens
        if not rows:
            return
        s = self.settings
        with_entropy = s.entropy_coef > 0
        with moe.recording(self.forward_model) as record:
            mask_bt, out = self._forward(rows, with_entropy=with_entropy)
        logprobs_bt, entropy_bt = out if with_entropy else (out, None)
        # The proximal policy: computed by the trainer before the step's first update
        # (`prox_logprobs`, several updates per batch), the pi_old role's (`old_logprobs`), or
        # None: this forward itself with its gradient stopped.
        prox_key = next((k for k in ("prox_logprobs", "old_logprobs") if k in rows[0]), None)
        loss_sum, stats = policy_loss_sum(
            logprobs_bt,
            _pad_like(mask_bt, [r["rollout_logprobs"] for r in rows]),
            _advantages(mask_bt, [r["advantages"] for r in rows]),
            mask_bt,
            s,
            prox_bt=_pad_like(mask_bt, [r[prox_key] for r in rows]) if prox_key else None,
            ref_bt=_pad_like(mask_bt, [r["ref_logprobs"] for r in rows]) if s.kl_in_loss else None,
            entropy_bt=entropy_bt,
            versions_bt=_pad_like(mask_bt, [r["versions"] for r in rows])
            if "versions" in rows[0]
            else None,
            trainer_version=self.version,
        )
        normaliser = batch_normaliser(mask_bt, s.loss.agg, s.agg_constant)
        if record is not None:  # a mixture-of-experts model: its router's loss and loads
            loss_sum = loss_sum + self._router_loss(record, normaliser, stats)
        loss_sum.backward()
        self._normaliser += normaliser
        self._loss_sum += float(loss_sum.detach())
        for key, value in stats.items():
            self._stats[key] = self._stats.get(key, 0.0) + value

    def _router_loss(self, record, normaliser: float, stats: dict[str, float]):
        """The load-balancing loss of a micro-batch's routing, as a loss sum (times its share
        `normaliser` of the step's normaliser, so the step's loss holds its token-weighted
        mean times `router_aux_loss_coef`); adds the routing statistics to `stats`, weighted by
        the micro-batch's tokens like the others."""
        router = moe.router_taps(self.model).routers[0]
        aux = moe.load_balancing_loss(record, router.num_experts, router.top_k)
        tokens = stats["num_tokens"]
        stats["moe/aux_loss"] = float(aux.detach()) * tokens
        for layer, counts in enumerate(moe.expert_counts(record, router.num_experts)):
            for expert, count in enumerate(counts):
                stats[f"moe/count/l{layer}/e{expert}"] = count
        stats["moe/replay_agreed"] = float(record.agreed)
        stats["moe/replay_compared"] = float(record.compared)
        return self.router_aux_loss_coef * aux * normaliser

    def _forward(self, rows: Sequence[Mapping[str, Any]], *, with_entropy: bool):
        self.model.train()
        return training_forward(
            self.forward_model,
            rows,
            pad_token_id=self.pad_token_id,
            temperature=self.temperature,
            padding_free=self.padding_free,
            with_entropy=with_entropy,
        )

    def logprobs(self, rows: Sequence[Mapping[str, Any]]) -> list[np.ndarray]:
        """Each row's response log-probs under the current weights, by the training forward,
        without a gradient. A step with several optimizer updates calls it on the whole batch
        before the first one: these are its proximal (pi_old) log-probs."""
        self.model.train()
        return self._detached_logprobs(rows)

    def _detached_logprobs(self, rows: Sequence[Mapping[str, Any]]) -> list[np.ndarray]:
        """`detached_logprobs` of the forward model as it is now (its mode set by the caller)."""
        return detached_logprobs(
            self.forward_model,
            rows,
            pad_token_id=self.pad_token_id,
            temperature=self.temperature,
            padding_free=self.padding_free,
        )

    def step(self, *, ends_version: bool = True) -> dict[str, float]:
        """Apply the accumulated gradient as one optimizer update; returns its loss and
        statistics. `ends_version=False` for every update of a batch but its last (PPO
        mini-batches and epochs): the version, and with it the learning rate, stays.

        Under data parallelism the normaliser is summed over ranks, and the gradients were
        averaged over ranks by the data-parallel wrapper (the DDP and FSDP2 default), so the
        scale is world_size / global normaliser: every rank ends with the full-batch gradient."""
        normaliser, world = self._normaliser, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            total = torch.tensor([normaliser], dtype=torch.float64)
            torch.distributed.all_reduce(total)
            normaliser, world = float(total), torch.distributed.get_world_size()
        scale = world / normaliser if normaliser > 0 else 0.0
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.grad_clip if self.grad_clip is not None else math.inf
            )
        )
        lr = self.lr_at(self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        skipped = not math.isfinite(grad_norm)
        if skipped:  # one bad batch must not poison the weights: skip the update, say so
            log.warning("non-finite gradient norm at version %d: update skipped", self.version)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if ends_version:
            self.version += 1
        tokens = max(self._stats.get("num_tokens", 0.0), 1.0)
        out = {
            "loss": self._loss_sum * scale / world,  # this rank's share of the loss
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped_nonfinite": float(skipped),
            "trained_tokens": self._stats.get("num_tokens", 0.0),
            "logprob_mismatch": self._stats.get("mismatch_abs_sum", 0.0) / tokens,
        }
        for key in STAT_MEANS:
            out[key] = self._stats.get(key, 0.0) / tokens
        out.update(routing_stats(self._stats, tokens))
        self._reset_step()
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the parameters, keyed like the engine's model (for weight sync)."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def optimizer_state_dict(self, directory: Any = None) -> dict[str, Any]:
        """What a checkpoint keeps of the optimizer (`load_weights_and_optimizer` reads it).
        `directory` is the checkpoint being written (sharded learners put their shards there)."""
        return self.optimizer.state_dict()

    def load_weights_and_optimizer(
        self,
        weights: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any],
        directory: Any = None,
    ) -> None:
        """Restore a checkpoint: `weights` as `save_pretrained` wrote them (tied ones absent)."""
        if "format" in optimizer_state:
            raise ValueError(
                "this checkpoint's optimizer state was written by sharded trainer ranks "
                "(trainer.world_size > 1); resume it with trainer.world_size > 1"
            )
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"}
        if set(missing) - tied or unexpected:
            raise RuntimeError(
                f"the checkpoint does not match the model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        self.optimizer.load_state_dict(optimizer_state)

    def close(self) -> None:
        """Nothing to release in one process (`RankedLearner` stops its ranks here)."""

    def peak_memory_bytes(self) -> list[int]:
        """Peak memory of each trainer rank so far (`process_peak_bytes`): this process's own in
        one process; sharded learners report every rank's."""
        return [process_peak_bytes(self.device.type)]

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


def routing_stat_keys(model) -> tuple[str, ...]:
    """The `moe/*` statistics `Learner.accumulate` sums for `model` (none for a dense one)."""
    taps = moe.router_taps(model)
    if taps is None:
        return ()
    counts = (
        f"moe/count/l{layer}/e{expert}"
        for layer in range(len(taps.routers))
        for expert in range(taps.routers[0].num_experts)
    )
    return ("moe/aux_loss", *counts, "moe/replay_agreed", "moe/replay_compared")


def routing_stats(sums: Mapping[str, float], tokens: float) -> dict[str, float]:
    """A step's `moe/*` metrics from its sums over micro-batches (none for a dense model):
    `moe/aux_loss`, `moe/expert_load_max/l<layer>` and, with routing replay,
    `moe/replay_agreement`, the share of replayed (token, layer) decisions the trainer's router
    would have made the same way."""
    if "moe/aux_loss" not in sums:
        return {}
    out = {"moe/aux_loss": sums["moe/aux_loss"] / tokens}
    counts: dict[str, list[float]] = {}
    for key, value in sums.items():
        if key.startswith("moe/count/"):
            counts.setdefault(key.split("/")[2], []).append(value)
    for layer, per_expert in counts.items():
        total = max(sum(per_expert), 1.0)
        out[f"moe/expert_load_max/{layer}"] = max(per_expert) / total * len(per_expert)
    if sums.get("moe/replay_compared"):
        out["moe/replay_agreement"] = sums["moe/replay_agreed"] / sums["moe/replay_compared"]
    return out


def training_forward(
    model,
    rows: Sequence[Mapping[str, Any]],
    *,
    pad_token_id: int,
    temperature: float,
    padding_free: bool,
    with_entropy: bool = False,
):
    """(response mask `[B, T]`, log-probs `[B, T]`, or (log-probs, entropies) with
    `with_entropy`) of `rows` under `model`, laid out as the learner trains them."""
    prompts = [r["prompt_ids"] for r in rows]
    responses = [r["response_ids"] for r in rows]
    device = next(model.parameters()).device
    routes = [r[F.ROUTED_EXPERTS] for r in rows] if F.ROUTED_EXPERTS in rows[0] else None
    media = row_media(rows)
    batch = pack(prompts, responses, pad_token_id, None if padding_free else routes, media)
    batch = batch.to(device)
    if padding_free:  # the rows end to end in one sequence: no compute on padding
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        forced = None if routes is None else moe.padded_routes(routes, starts, sum(lengths))
        with moe.replaying(model, None if forced is None else forced.to(device)):
            out = padding_free_logprobs(
                model, prompts, responses, temperature, with_entropy=with_entropy
            )
    else:
        out = response_logprobs(model, batch, temperature, with_entropy=with_entropy)
    return loss_mask(batch.response_mask_br, rows), out


def loss_mask(response_mask_br, rows: Sequence[Mapping[str, Any]]):
    """The response mask, narrowed to the tokens the model sampled where a row says which (an
    agent episode's `loss_mask`: tool output and template tokens are not trained)."""
    if all(r.get("loss_mask") is None for r in rows):
        return response_mask_br
    mask_br = response_mask_br.clone()
    for i, r in enumerate(rows):
        if r.get("loss_mask") is not None:
            sampled = torch.tensor(np.asarray(r["loss_mask"]), dtype=mask_br.dtype)  # a copy
            mask_br[i, : len(sampled)] *= sampled.to(mask_br.device)
    return mask_br


def detached_logprobs(model, rows: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[np.ndarray]:
    """Each row's response log-probs (float32, one array per row) by `training_forward`, without
    a gradient."""
    if not rows:
        return []
    with torch.no_grad():
        _, logprobs_bt = training_forward(model, rows, **kwargs)
    logprobs_bt = logprobs_bt.float().cpu()
    return [logprobs_bt[i, : len(r["response_ids"])].numpy().copy() for i, r in enumerate(rows)]


def _advantages(mask_bt: torch.Tensor, values: Sequence[Any]) -> torch.Tensor:
    """`[B]` when every advantage is a float, else `[B, T]` (per-token advantages)."""
    if all(np.ndim(v) == 0 for v in values):
        return torch.tensor([float(v) for v in values], device=mask_bt.device)
    return _pad_like(
        mask_bt,
        [
            np.full(int(m.sum()), v) if np.ndim(v) == 0 else v
            for v, m in zip(values, mask_bt, strict=True)
        ],
    )


def _pad_like(mask_bt: torch.Tensor, seqs: Sequence[Any]) -> torch.Tensor:
    out = torch.zeros_like(mask_bt)
    for i, s in enumerate(seqs):
        # A copy (Ray's arrays are read-only), on the batch's device.
        values = torch.tensor(np.asarray(s, dtype=np.float32), device=mask_bt.device)
        out[i, : len(values)] = values
    return out


class BF16Compute(torch.nn.Module):
    """`model` called under `torch.autocast` in bf16 (`trainer.mixed_precision`): matmuls and
    attention run in bf16 while the parameters, their gradients and so the optimizer state stay
    in the model's fp32. The logits come back in bf16; the log-prob code upcasts them before
    the softmax."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        dtypes = {p.dtype for p in model.parameters()}
        if dtypes != {torch.float32}:
            raise ValueError(
                f"trainer.mixed_precision keeps fp32 master weights, but the trainer's model "
                f"holds {sorted(str(d) for d in dtypes)}; load it in float32"
            )
        self.model = model
        self.device_type = next(model.parameters()).device.type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def compile_for_training(model):
    """`model` through `torch.compile` (inductor, dynamic shapes): a module that shares its
    parameters. Where compilation fails (no C++ compiler, an op inductor cannot lower), dynamo
    warns and runs that part eagerly instead of failing the run."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    log.info("trainer: compiling forward and backward (torch.compile); the first step is slower")
    return torch.compile(model, dynamic=True)

"""The critic role: a value model for PPO, scoring responses and learning from GAE returns.

Its model and optimizer are saved in the run directory at the same batch boundaries as the
trainer's checkpoints: `critic/step-<k>.pt` holds the critic once it has trained every batch
before k (k a multiple of `trainer.checkpoint_every`; batches past k it had already trained
are listed in the file). So each role restores the state that matches what it is given:

- restarted by the supervisor mid-run, the critic loads its newest file. In Ray mode with
  in-place recovery (the default) it acks a trained batch only once a file holds it, so the
  batches trained after that file are handed back and trained again: nothing lost or repeated.
- in a run resumed from the trainer's checkpoint k (`streamrl train --resume`), it loads
  `step-k`, the critic that had trained exactly the batches the policy had, and trains batch k
  on (a warning says how far off it is when that file is missing).

The value model is the policy's own architecture with a one-output token-classification head
(`AutoModelForTokenClassification`, `num_labels=1`), initialised from the policy directory with
the head zeroed, so every value starts at 0. Values use the same packing as the trainer's
log-probs: the value of response token t is read at the position that predicts it (the state
before the token was generated).

One role, two loops on the bus: it writes `values` for every new response (consumer `critic`),
and trains on whole batches whose `returns` the advantage role has written (consumer
`critic_train`), one optimizer step per batch with the clipped value loss.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForTokenClassification

from streamrl.api import fields as F
from streamrl.api.role import RoleBase
from streamrl.bus.batches import BatchCollector, BatchKey
from streamrl.trainer.algos.losses import value_loss
from streamrl.trainer.checkpoint import fsync_dir
from streamrl.trainer.logprobs import pack

log = logging.getLogger(__name__)

CONSUMER = "critic"
TRAIN_CONSUMER = "critic_train"


def load_value_model(policy_dir, dtype: str = "float32"):
    model = AutoModelForTokenClassification.from_pretrained(
        policy_dir, num_labels=1, dtype=getattr(torch, dtype)
    )
    head = model.score if hasattr(model, "score") else model.classifier
    torch.nn.init.zeros_(head.weight)
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    return model


def response_values(model, prompts, responses, pad_token_id: int) -> tuple[torch.Tensor, Any]:
    """Values `[B, R]` of each response token (zeros on padding), and the packed batch."""
    batch = pack(prompts, responses, pad_token_id)
    position_ids = (batch.attention_mask_bt.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=batch.input_ids_bt,
        attention_mask=batch.attention_mask_bt,
        position_ids=position_ids,
    ).logits[..., 0]
    start = batch.prompt_width - 1
    width = batch.response_ids_br.shape[1]
    return out[:, start : start + width].float() * batch.response_mask_br, batch


class Critic:
    """The value model and its optimizer; `values` for scoring, `accumulate`/`step` to train."""

    def __init__(self, model, *, pad_token_id: int, lr: float, value_clip, grad_clip):
        self.model = model
        self.pad_token_id = pad_token_id
        self.value_clip = value_clip
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
        self._loss_sum = 0.0
        self._tokens = 0.0
        self.steps = 0

    @torch.no_grad()
    def values(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        self.model.eval()
        values_br, _ = response_values(
            self.model,
            [r[F.PROMPT_IDS] for r in rows],
            [r[F.RESPONSE_IDS] for r in rows],
            self.pad_token_id,
        )
        return {
            r["sample_id"]: {
                F.VALUES: values_br[i, : len(r[F.RESPONSE_IDS])].numpy().astype(np.float32)
            }
            for i, r in enumerate(rows)
        }

    def accumulate(self, rows: Sequence[Mapping[str, Any]]) -> None:
        rows = [r for r in rows if r.get(F.RETURNS) is not None and len(r[F.RESPONSE_IDS])]
        if not rows:
            return
        self.model.train()
        values_br, batch = response_values(
            self.model,
            [r[F.PROMPT_IDS] for r in rows],
            [r[F.RESPONSE_IDS] for r in rows],
            self.pad_token_id,
        )
        mask = batch.response_mask_br
        old = _pad(mask, [r[F.VALUES] for r in rows])
        returns = _pad(mask, [r[F.RETURNS] for r in rows])
        loss_sum = value_loss(values_br, old, returns, mask, clip=self.value_clip)
        loss_sum.backward()
        self._loss_sum += float(loss_sum.detach())
        self._tokens += float(mask.sum())

    def step(self) -> dict[str, float]:
        scale = 1.0 / self._tokens if self._tokens else 0.0
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        out = {"critic/value_loss": self._loss_sum * scale}
        self._loss_sum, self._tokens = 0.0, 0.0
        return out

    def save(self, path: Path, **meta: Any) -> None:
        """Model, optimizer, steps taken and `meta`, written atomically and flushed to disk (a
        crash leaves the old file)."""
        tmp = path.with_suffix(".tmp")
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "meta": meta,
        }
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fsync_dir(path.parent)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore from `path`; return the `meta` it was saved with."""
        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        return dict(state.get("meta", {}))


class CriticSnapshots:
    """`critic/step-<k>.pt` files: the critic before batch k, the newest `KEEP` of them."""

    KEEP = 4  # the trainer keeps 2 checkpoints; the critic may run a batch or two ahead of it

    def __init__(self, root: Path):
        self.root = root

    def save(self, critic: Critic, boundary: int, ahead: list[int]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"step-{boundary:06d}.pt"
        critic.save(path, next_batch=boundary, ahead=ahead)
        for old in self._all()[: -self.KEEP]:
            old[1].unlink(missing_ok=True)
        return path

    def pick(self, resume_step: int | None) -> tuple[int, Path] | None:
        """The newest snapshot (None), else the one before batch `resume_step`, or the nearest
        below it, or the oldest above it."""
        found = self._all()
        if not found:
            return None
        if resume_step is None:
            return found[-1]
        below = [f for f in found if f[0] <= resume_step]
        return below[-1] if below else found[0]

    def _all(self) -> list[tuple[int, Path]]:
        return sorted((int(p.stem.split("-")[1]), p) for p in self.root.glob("step-*.pt"))


def _pad(mask_bt: torch.Tensor, seqs: Sequence[Any]) -> torch.Tensor:
    out = torch.zeros_like(mask_bt)
    for i, s in enumerate(seqs):
        values = torch.tensor(np.asarray(s, dtype=np.float32))
        out[i, : len(values)] = values
    return out


class CriticRole(RoleBase):
    def __init__(
        self,
        bus,
        weights,
        critic: Critic,
        *,
        groups_per_batch: int,
        max_staleness: int,
        max_rows: int,
        lease_s: float,
        state_dir: Path | None = None,
        save_every: int = 0,
        start_batch: int = 0,
        resume_step: int | None = None,
        defer_acks: bool = False,
    ):
        self.bus = bus
        self.critic = critic
        # With `defer_acks`, trained batches are acked only once a state file holds them.
        self.snapshots = CriticSnapshots(state_dir) if state_dir is not None else None
        self.save_every = save_every
        self.saving = self.snapshots is not None and save_every > 0
        # Every batch before `next_batch` is trained; `ahead` holds those trained past it.
        self.next_batch = start_batch
        self.ahead: set[int] = set()
        if self.snapshots is not None:
            restarted = bus.stats()["acked"].get(TRAIN_CONSUMER, 0) > 0
            self._restore(self.snapshots, None if restarted else resume_step)
        self.max_rows = max_rows
        self.lease_s = lease_s
        self.busy_s = 0.0
        self.last_loss = float("nan")
        self.batches = BatchCollector(
            bus,
            weights,
            consumer=TRAIN_CONSUMER,
            fields=(F.PROMPT_IDS, F.RESPONSE_IDS, F.VALUES, F.RETURNS),
            groups_per_batch=groups_per_batch,
            max_staleness=max_staleness,
            max_rows=max_rows,
            lease_s=lease_s,
            defer_acks=defer_acks and self.saving,
        )

    def step(self) -> bool:
        scored = self._score_new()
        trained = self._train(wait_s=0.0 if scored else self.long_poll_s)
        return scored or trained

    def _score_new(self) -> bool:
        lease = self.bus.claim(
            CONSUMER, (F.PROMPT_IDS, F.RESPONSE_IDS), self.max_rows, lease_s=self.lease_s
        )
        if lease is None:
            return False
        start = time.perf_counter()
        self.bus.ack(lease.lease_id, writes=self.critic.values(lease.rows))
        self.busy_s += time.perf_counter() - start
        return True

    def _train(self, wait_s: float) -> bool:
        """One optimizer step per complete batch (its micro-batches accumulate)."""
        complete = self.batches.poll(wait_s=wait_s)
        if complete is None:
            return self.batches.claimed
        start = time.perf_counter()
        b, rows = complete
        for lo in range(0, len(rows), self.max_rows):
            self.critic.accumulate(rows[lo : lo + self.max_rows])
        self.last_loss = self.critic.step()["critic/value_loss"]
        self.batches.ack_batch(b)  # with defer_acks: acked by the commit after the next save
        boundary = self._trained(b)
        if self.saving and boundary is not None:
            assert self.snapshots is not None
            ahead = [*range(boundary, self.next_batch), *sorted(self.ahead)]
            path = self.snapshots.save(self.critic, boundary, ahead)
            self.batches.commit()
            log.info(
                "critic: saved before batch %d (%d steps, ahead: %s) to %s",
                boundary,
                self.critic.steps,
                ahead,
                path,
            )
        self.busy_s += time.perf_counter() - start
        return True

    def _trained(self, b: BatchKey) -> int | None:
        """Note batch `b` trained; return the save boundary (a multiple of `save_every`) that
        `next_batch` just passed, if any. Refill rounds (b[1] > 0) count with their batch."""
        if b[1] != 0 or b[0] < self.next_batch:
            return None
        before = self.next_batch
        self.ahead.add(b[0])
        self._advance()
        if self.save_every <= 0 or self.next_batch // self.save_every == before // self.save_every:
            return None
        return self.next_batch // self.save_every * self.save_every

    def _advance(self) -> None:
        while self.next_batch in self.ahead:
            self.ahead.discard(self.next_batch)
            self.next_batch += 1

    def _restore(self, snapshots: CriticSnapshots, resume_step: int | None) -> None:
        """The newest snapshot (a fresh start or a restart), or the one for `resume_step`."""
        found = snapshots.pick(resume_step)
        if found is None:
            if resume_step is not None and resume_step > 0:
                log.warning(
                    "critic: no saved state to resume from at batch %d; it starts untrained",
                    resume_step,
                )
            return
        boundary, path = found
        meta = self.critic.load(path)
        ahead = {int(k) for k in meta.get("ahead", [])}
        if resume_step is None:
            self.next_batch, self.ahead = boundary, ahead
            self._advance()
        elif boundary != resume_step or ahead:
            log.warning(
                "critic: resuming at batch %d from %s (the critic trained on the batches before "
                "%d, and on %s): its training differs from the policy's by those batches",
                resume_step,
                path.name,
                boundary,
                sorted(ahead) or "none after",
            )
        log.info("critic: restored %s (%d steps)", path, self.critic.steps)

    def stats(self) -> dict[str, Any]:
        return {"busy_s": self.busy_s, "metrics": {"critic/value_loss": self.last_loss}}

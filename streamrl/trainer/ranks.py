"""The trainer role over several data-parallel FSDP2 ranks on its node (`trainer.world_size`).

Rank 0 lives in the trainer role's own process and is what the role, the synchronous loop, the
hooks and the checkpoint code hold: a `RankedLearner`, which answers to everything a `Learner`
does. It starts ranks 1..N-1 as worker processes. Only rank 0 reads the checkpoint (the full
copy below); every rank builds the model on the meta device from the directory's config, shards
it with FSDP2 and receives its shards from rank 0 (`load_sharded_model`), then follows rank 0 in
lockstep:

    rank 0 (role process)                        ranks 1..N-1 (workers)
    accumulate(rows) ── broadcast command ──────> wait for a command
                     ── broadcast rows (safetensors blob, no pickle) ──> decode the rows
                        (a vision-language row's `media` is its key and store: each rank
                         reads the tensors from the media store itself, `row_media`)
    plan_step(rows): the same micro-batch plan on every rank (a pure function of the lengths)
    FSDPLearner.accumulate(own micro-batches)    FSDPLearner.accumulate(own micro-batches)
    step() / named_weights() / state: the same command, then the same collectives

Everything between ranks goes through the torch.distributed group (gloo on CPU; on GPUs the
group also has NCCL for the FSDP collectives, and commands and rows stay on gloo).

Rank 0 also keeps an unsharded copy of the model (`model`, on CPU: the one it loaded and sent the
ranks their shards from), refreshed from the gathered full weights whenever `named_weights` runs
(after every step, for weight sync). Held-out evaluation,
`save_pretrained` checkpoints and pi_old log-probs in the synchronous loop read that copy, so
they need no collectives. In a checkpoint, the HF model directory comes from that copy and
every rank writes its own shard of model and optimizer (torch.distributed.checkpoint, in
`sharded/`), so a run resumes at any world size > 1 and no rank gathers the optimizer state.

Worker processes exit when rank 0 sends stop, and on their own when rank 0's process dies (the
group's connections close, and a watchdog sees the parent go).
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist

from streamrl.config.schema import TrainerConfig
from streamrl.models.loading import load_causal_lm
from streamrl.models.vision import freeze_vision
from streamrl.trainer.fsdp import (
    FSDPLearner,
    data_parallel_mesh,
    init_distributed,
    load_sharded_model,
)
from streamrl.trainer.learner import detached_logprobs
from streamrl.trainer.lora import LoraLearner, apply_lora, is_lora, load_adapter, merged_weights
from streamrl.trainer.microbatch import plan_step

log = logging.getLogger(__name__)

# Row fields the learner reads (see `Learner.accumulate`); the others stay on rank 0.
LEARNER_FIELDS = (
    "prompt_ids",
    "response_ids",
    "rollout_logprobs",
    "advantages",
    "old_logprobs",
    "prox_logprobs",
    "ref_logprobs",
    "versions",
    "routed_experts",
    "loss_mask",
)
MEDIA_FIELD = "media"  # a vision-language row's {key, store} (`media.prepare.bus_value`): JSON
_ACCUMULATE, _STEP, _WEIGHTS, _SAVE, _LOAD, _SET_VERSION, _STOP = range(7)
OPTIMIZER_FORMAT = "fsdp-dcp"  # `optimizer_state_dict`'s marker: the state is in SHARDED_DIR
SHARDED_DIR = "sharded"  # in a checkpoint: every rank's shard of model and optimizer (DCP)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its learner; sent to local worker processes at start."""

    model_dir: str
    dtype: str
    learner_kwargs: dict[str, Any]
    """`Learner` keyword arguments (pad_token_id, lr, settings, ...)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The `trainer` section: `mixed_precision`, `activation_checkpointing` and `lora` (how the
    model is built and sharded), `max_tokens_per_micro_batch` (the token budget of a micro-batch, padded [B, T]
    size; None splits each batch of rows into about one micro-batch per rank)."""
    device: str = "cpu"
    """Where the ranks' models live (`trainer.device` resolved)."""
    freeze_vision: bool = False
    """`model.freeze_vision`: the vision tower's parameters stay fixed on every rank."""
    num_threads: int = 1
    seed: int = 0


def encode_rows(rows: Sequence[Mapping[str, Any]]) -> torch.Tensor:
    """The learner's fields of `rows` as one safetensors blob (uint8 tensor). Rows that carry a
    `media` field (a vision-language policy's) keep it on every row, as JSON bytes (null for a
    text row): the ranks read the media by key, the pixels do not travel."""
    tensors: dict[str, torch.Tensor] = {}
    with_media = any(MEDIA_FIELD in row for row in rows)
    for i, row in enumerate(rows):
        for name in LEARNER_FIELDS:
            if name in row and row[name] is not None:
                tensors[f"{i}/{name}"] = torch.from_numpy(np.array(row[name]))
        if with_media:
            tensors[f"{i}/{MEDIA_FIELD}"] = _text_blob(json.dumps(row.get(MEDIA_FIELD)))
    tensors["num_rows"] = torch.tensor(len(rows))
    blob = safetensors.torch.save(tensors)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def decode_rows(blob: torch.Tensor) -> list[dict[str, Any]]:
    """Inverse of `encode_rows`: scalars come back as floats, sequences as numpy arrays."""
    tensors = safetensors.torch.load(blob.numpy().tobytes())
    rows: list[dict[str, Any]] = [{} for _ in range(int(tensors.pop("num_rows")))]
    for key, value in tensors.items():
        index, name = key.split("/", 1)
        if name == MEDIA_FIELD:
            rows[int(index)][name] = json.loads(_blob_text(value))
        else:
            rows[int(index)][name] = float(value) if value.dim() == 0 else value.numpy()
    return rows


def micro_batch_plan(
    rows: Sequence[Mapping[str, Any]], world_size: int, max_tokens: int | None
) -> list[list[list[int]]]:
    """`[rank][k]`: the rows each rank trains in its k-th micro-batch (equal counts per rank)."""
    prompt_lens = [len(r["prompt_ids"]) for r in rows]
    response_lens = [max(len(r["response_ids"]), 1) for r in rows]
    if max_tokens is None:  # about one micro-batch per rank
        longest = max(p + r for p, r in zip(prompt_lens, response_lens, strict=True))
        total = sum(prompt_lens) + sum(response_lens)
        budget = max(longest, -(-total // world_size))
        return plan_step(prompt_lens, response_lens, budget, world_size, padded=False)
    return plan_step(prompt_lens, response_lens, max_tokens, world_size)


def build_rank_learner(spec: RankSpec, full_model: torch.nn.Module | None) -> FSDPLearner:
    """This rank's sharded model and learner (the process group must be initialised): rank 0
    passes the model it loaded (with LoRA, its adapters added: `load_rank0_model`), the other
    ranks None (they read only config.json)."""
    torch.manual_seed(spec.seed)
    lora = spec.trainer.lora
    model = load_sharded_model(
        spec.model_dir,
        data_parallel_mesh(spec.device),
        full_model,
        dtype=spec.dtype,
        device=spec.device,
        wrap=functools.partial(_wrap, spec=spec),
        mixed_precision=spec.trainer.mixed_precision,
        activation_checkpointing=spec.trainer.activation_checkpointing,
    )
    return (ShardedLoraLearner if lora.rank else FSDPLearner)(model, **spec.learner_kwargs)


def _wrap(model: torch.nn.Module, *, spec: RankSpec) -> torch.nn.Module:
    """What every rank does to the model built from config.json before sharding it: LoRA
    adapters, and `requires_grad` off on a frozen vision tower (so the sharded parameters and
    the optimizer leave it out)."""
    if spec.freeze_vision:
        freeze_vision(model)
    return apply_lora(model, lora=spec.trainer.lora) if spec.trainer.lora.rank else model


def load_rank0_model(spec: RankSpec) -> torch.nn.Module:
    """Rank 0's unsharded CPU copy: the policy, with LoRA its adapters added (from the run's
    seed, as in one process; the ranks receive them from this copy)."""
    model = load_causal_lm(spec.model_dir, dtype=spec.dtype)
    if spec.freeze_vision:
        freeze_vision(model)
    return apply_lora(model, spec.trainer.lora, seed=spec.seed) if spec.trainer.lora.rank else model


class ShardedLoraLearner(LoraLearner, FSDPLearner):
    """A LoRA learner on one FSDP2 rank: `LoraLearner`'s reference log-probs (adapters disabled)
    and checkpoint handling over `FSDPLearner`'s collectives. Its `named_weights` are the
    gathered unmerged weights (peft's names) on rank 0; `RankedLearner` merges them in its copy."""

    named_weights = FSDPLearner.named_weights

    def accumulate(
        self, rows: Sequence[Mapping[str, Any]], *, num_skipped_tokens: float = 0.0
    ) -> None:
        if not rows and self.settings.kl_in_loss:
            # The peers score their rows' reference log-probs first: join that forward's
            # all-gathers with a one-token forward of our own, as the zero pass joins theirs.
            pad = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
            with torch.no_grad(), self.model.disable_adapter():
                self.model(input_ids=pad, use_cache=False)
        super().accumulate(rows, num_skipped_tokens=num_skipped_tokens)


def _command(code: int, arg: int = 0) -> None:
    dist.broadcast(torch.tensor([code, arg], dtype=torch.int64), src=0)


def _broadcast_blob(blob: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's blob on every rank (two broadcasts: its size, then its bytes)."""
    size = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0)
    if blob is None:
        blob = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(blob, src=0)
    return blob


def _train_share(
    learner: FSDPLearner, rows: list[dict[str, Any]], spec: RankSpec, skipped: float
) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for k, indices in enumerate(
        micro_batch_plan(rows, world, spec.trainer.max_tokens_per_micro_batch)[rank]
    ):
        learner.accumulate([rows[i] for i in indices], num_skipped_tokens=skipped if k == 0 else 0)


def _text_blob(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def _blob_text(blob: torch.Tensor) -> str:
    return blob.numpy().tobytes().decode()


def _worker_main(spec: RankSpec, rank: int, world_size: int, init_method: str) -> None:
    """Ranks 1..N-1: build the learner, then follow rank 0's commands until told to stop."""
    parent = os.getppid()

    def watch_parent() -> None:  # rank 0 gone without a stop: do not linger
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    # A terminal's Ctrl-C reaches this process too; rank 0 decides (a graceful stop of the run,
    # after which it stops these ranks), so it must not kill a rank mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    init_distributed(rank, world_size, init_method, device=_backend_device(spec.device))
    learner = build_rank_learner(spec, None)
    while True:
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0)
        code, arg = int(header[0]), int(header[1])
        if code == _ACCUMULATE:
            _train_share(learner, decode_rows(_broadcast_blob(None)), spec, 0.0)
        elif code == _STEP:
            learner.step(ends_version=bool(arg))
        elif code == _WEIGHTS:
            learner.named_weights()
        elif code == _SAVE:
            learner.save_checkpoint(_blob_text(_broadcast_blob(None)))
        elif code == _LOAD:
            learner.load_checkpoint(_blob_text(_broadcast_blob(None)))
        elif code == _SET_VERSION:
            learner.version = arg
        elif code == _STOP:
            break
    dist.destroy_process_group()


def _backend_device(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankedLearner:
    """Rank 0 of the trainer's FSDP2 ranks, driven exactly like a `Learner`.

    Starting it starts the other ranks (a few seconds: rank 0 loads the model, every rank builds
    and shards it and receives its shards); call `close` at the end (the trainer role and the
    sync loop do)."""

    def __init__(self, spec: RankSpec, world_size: int, *, start_timeout_s: float = 300.0):
        if world_size < 2:
            raise ValueError(f"RankedLearner needs world_size >= 2, got {world_size}")
        self.spec = spec
        self.world_size = world_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        self._workers = [
            context.Process(
                target=_worker_main,
                args=(spec, rank, world_size, init_method),
                name=f"trainer-rank{rank}",
                daemon=True,
            )
            for rank in range(1, world_size)
        ]
        for process in self._workers:
            process.start()
        init_distributed(0, world_size, init_method, device=_backend_device(spec.device))
        # The unsharded copy on rank 0 (CPU): the ranks' shards come from it; then evaluation,
        # save_pretrained and pi_old log-probs read it.
        self.model = load_rank0_model(spec)
        self.local = build_rank_learner(spec, self.model)
        self._copy_is_current = False  # `model` holds the ranks' weights (see `named_weights`)
        self.settings = self.local.settings
        self._closed = False
        log.info("trainer: %d FSDP2 ranks on %s", world_size, spec.device)

    # -- the Learner interface ------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.local.version

    @version.setter
    def version(self, value: int) -> None:
        _command(_SET_VERSION, value)
        self.local.version = value

    @property
    def grad_clip(self) -> float | None:
        return self.local.grad_clip

    def accumulate(
        self, rows: Sequence[Mapping[str, Any]], *, num_skipped_tokens: float = 0.0
    ) -> None:
        if not rows:  # nothing to run on any rank; the skipped tokens still count
            self.local._normaliser += num_skipped_tokens
            return
        _command(_ACCUMULATE)
        decoded = decode_rows(_broadcast_blob(encode_rows(rows)))
        _train_share(self.local, decoded, self.spec, num_skipped_tokens)

    def step(self, *, ends_version: bool = True) -> dict[str, float]:
        _command(_STEP, int(ends_version))
        self._copy_is_current = False
        return self.local.step(ends_version=ends_version)

    def peak_memory_bytes(self) -> list[int]:
        """Every rank's peak memory as of the last step (rank 0's process holds the unsharded
        copy too)."""
        return self.local.peak_memory_bytes()

    def logprobs(self, rows: Sequence[Mapping[str, Any]]) -> list[np.ndarray]:
        """`Learner.logprobs` on rank 0's unsharded copy (no collectives), refreshed first when
        an update since the last `named_weights` left it behind the ranks."""
        if not self._copy_is_current:
            self.named_weights()
        local = self.local
        return detached_logprobs(
            self.model.train(),
            rows,
            pad_token_id=local.pad_token_id,
            temperature=local.temperature,
            padding_free=local.padding_free,
        )

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (CPU), gathered from the ranks; also refreshes `model`."""
        _command(_WEIGHTS)
        full = self.local.named_weights()
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in full.items():
                params[name].copy_(value)
        self._copy_is_current = True
        if is_lora(self.model):  # the engines get the adapters merged in (peft's names gone)
            return merged_weights(self.model)
        # The gathered tensors are fresh and held nowhere else (the copy took their values), so
        # they are published as they are: a clone would be one more full model on rank 0.
        return full

    def optimizer_state_dict(self, directory: str | Path | None = None) -> dict[str, Any]:
        """Every rank writes its shard of model and optimizer into `directory`/SHARDED_DIR
        (torch.distributed.checkpoint, loadable at another world size); returns the marker
        that `load_weights_and_optimizer` reads back."""
        if directory is None:
            raise TypeError("sharded ranks save their state into a checkpoint directory")
        _command(_SAVE)
        path = str(Path(directory) / SHARDED_DIR)
        _broadcast_blob(_text_blob(path))
        self.local.save_checkpoint(path)
        return {"format": OPTIMIZER_FORMAT, "dir": SHARDED_DIR}

    def load_weights_and_optimizer(
        self,
        weights: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any],
        directory: str | Path | None = None,
    ) -> None:
        """Restore a checkpoint: every rank reads its shard from `directory`; `weights` (as
        `save_pretrained` wrote them) refresh rank 0's unsharded copy."""
        if optimizer_state.get("format") != OPTIMIZER_FORMAT or directory is None:
            raise ValueError(
                "this checkpoint's optimizer state was written by a single-process trainer "
                "(trainer.world_size=1); resume it with trainer.world_size=1"
            )
        if is_lora(self.model):  # `weights` are the adapter's
            load_adapter(self.model, weights, directory)
        else:
            self.model.load_state_dict(weights, strict=False)  # tied weights are absent
        _command(_LOAD)
        path = str(Path(directory) / optimizer_state["dir"])
        _broadcast_blob(_text_blob(path))
        self.local.load_checkpoint(path)
        self._copy_is_current = False

    def close(self) -> None:
        """Stop the worker ranks and leave the process group."""
        if self._closed:
            return
        self._closed = True
        _command(_STOP)
        for process in self._workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        dist.destroy_process_group()

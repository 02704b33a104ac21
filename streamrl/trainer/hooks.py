"""What the trainer does around optimizer steps: the trained-samples log, the sample record
(`run.record_samples`), held-out evaluation and checkpoints.

Runs in the trainer's own process (it holds the model), in every mode. Steps in records and
metrics count policy versions: the initial evaluation is step 0 and the record of the k-th
optimizer step is step k. A step's sample ids are appended to `trained_samples.jsonl` before
any checkpoint that includes the step is written, so the log never lags a checkpoint; so is the
step's sample record (`record.py`). A trainer that starts from a checkpoint removes the record of
the steps after it, which it trains (and records) again.

A stop asked for from outside (`streamrl stop RUN_DIR`) makes the step just trained the last:
it is evaluated and checkpointed as the planned last step would be, and `stopped` tells the
driver loop to end.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from streamrl.api.run import RunContext
from streamrl.control import stop_requested
from streamrl.trainer.checkpoint import save_checkpoint
from streamrl.trainer.evaluate import Evaluator, report_ks
from streamrl.trainer.lora import evaluation_model, evaluation_weights
from streamrl.trainer.record import (
    record_bytes,
    record_dir,
    recorded_steps,
    truncate_record,
    write_step,
)

log = logging.getLogger(__name__)

SAMPLES_LOG = "trained_samples.jsonl"


class TrainerHooks:
    def __init__(self, ctx: RunContext, learner, bus_state=None):
        self.ctx = ctx
        self.learner = learner
        # A LoRA model is evaluated as its base with the adapters merged in (`lora.py`).
        self.evaluator = Evaluator(ctx, evaluation_model(learner.model))
        self.bus_state = bus_state  # callable returning the bus's state dict, or None
        self.stopped = False  # a stop was asked for: the last step is done
        # The steps after the one this trainer starts from are trained again: so recorded again.
        truncate_record(ctx.run_dir, learner.version + 1 if learner.version else 0)

    def initial_record(self) -> dict[str, Any]:
        return {"step": self.learner.version, "metrics": self._evaluate(), "trained_ids": []}

    def _evaluate(self) -> dict[str, float]:
        with evaluation_weights(self.learner.model):
            return self._evaluate_model()

    def _evaluate_model(self) -> dict[str, float]:
        start = time.perf_counter()
        result = self.evaluator.evaluate()
        metrics = {
            "eval/accuracy": result.accuracy,
            "eval/unscored": sum(result.unscored.values()),
        }
        t = self.ctx.cfg.trainer
        if t.eval_samples:
            temperature = t.eval_temperature or self.ctx.cfg.rollout.temperature
            sampled = self.evaluator.sample(t.eval_samples, temperature)
            metrics.update(
                {f"eval/pass@{k}": sampled.pass_at(k) for k in report_ks(sampled.samples)}
            )
            metrics["eval/unscored"] += sum(sampled.unscored.values())
        metrics["time/eval_s"] = time.perf_counter() - start
        return metrics

    def after_step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Called after optimizer step; adds eval results, writes a checkpoint when due."""
        t = self.ctx.cfg.trainer
        version = self.learner.version
        record["step"] = version
        rows, events = record.pop("sample_events", ((), ()))
        if self.ctx.cfg.run.record_samples:
            record["metrics"]["record/bytes"] = self._record(version, rows, events, record)
        line = {
            "step": version,
            "ids": record["trained_ids"],
            "digest": record.get("samples_digest"),
        }
        with (self.ctx.run_dir / SAMPLES_LOG).open("a") as f:
            f.write(json.dumps(line) + "\n")
        last = version >= t.steps
        if not last and stop_requested(self.ctx.run_dir):
            log.info("trainer: stop requested; ending after step %d with a checkpoint", version)
            self.stopped = last = True
        if last or (t.eval_every and version % t.eval_every == 0):
            record["metrics"].update(self._evaluate())
        if last or (t.checkpoint_every and version % t.checkpoint_every == 0):
            start = time.perf_counter()
            extra = {"bus": self.bus_state() if self.bus_state else {}}
            save_checkpoint(self.ctx.run_dir, version, self.learner, self.ctx.policy_dir, extra)
            record["metrics"]["time/checkpoint_s"] = time.perf_counter() - start
            if self.ctx.cfg.run.record_samples:
                total, steps = record_bytes(self.ctx.run_dir), recorded_steps(self.ctx.run_dir)
                log.info(
                    "trainer: sample record (%s): %d steps, %.1f KiB (%.1f KiB a step)",
                    record_dir(self.ctx.run_dir),
                    len(steps),
                    total / 1024,
                    total / 1024 / max(len(steps), 1),
                )
        return record

    def _record(self, version: int, rows, events, record: dict[str, Any]) -> int:
        """Write step `version`'s sample record; return its size in bytes."""
        import torch

        train = record["metrics"]
        meta = {
            "loss": train.get("train/loss"),
            "grad_norm": train.get("train/grad_norm"),
            "lr": train.get("train/lr"),
            "trained_tokens": train.get("train/trained_tokens"),
            # What else the step's figures depend on, which replay takes from here.
            "num_threads": torch.get_num_threads(),
            "dtype": self.ctx.cfg.model.dtype,
            "total_steps": getattr(self.learner, "total_steps", None),
            "max_staleness": self.ctx.cfg.rollout.max_staleness,
            "torch": torch.__version__,
        }
        return write_step(self.ctx.run_dir, version, rows, events, meta)

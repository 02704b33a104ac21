"""The controller: prepares a run, starts its roles in the chosen mode, and reports.

It owns everything around the roles: the run directory and its saved config, the warm start,
resume from the latest checkpoint, metrics (console, JSONL, TensorBoard, W&B), the progress bar,
peak memory of the whole process tree, and the end-of-run summary, plot and table. It never
trains or generates itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import yaml

from streamrl.api.registry import load_plugins, pacing_role
from streamrl.config import Config, ConfigError, dump_yaml
from streamrl.control import RunDirInUse, clear_stop, hold_run_dir, stop_on_interrupt
from streamrl.metrics import (
    MetricsTracker,
    PeakMemorySampler,
    RunProgress,
    WandbRun,
    phase,
    plot_run,
    print_summary,
    read_metrics,
    write_summary,
)
from streamrl.metrics.stats import SlowerSide, reward_trend
from streamrl.runtime.context import make_run_dir, prepare
from streamrl.runtime.errors import (
    BusLost,
    RoleError,
    RoleFailed,
    RunFailed,
    TrainerLost,
    one_line,
)
from streamrl.runtime.logs import (
    CONTROLLER,
    attach_controller_log,
    detach,
    log_failure,
    log_path,
)
from streamrl.runtime.preflight import check_same_data
from streamrl.runtime.roles import base_role
from streamrl.trainer.checkpoint import latest_checkpoint, latest_model_dir, read_state
from streamrl.trainer.hooks import SAMPLES_LOG
from streamrl.trainer.sft import cached_policy_dir, ensure_policy_dir

log = logging.getLogger(__name__)


class RecordSink:
    """Turns trainer records into metrics lines, the trained-samples log and progress updates."""

    def __init__(self, run_dir: Path, tracker: MetricsTracker, progress: RunProgress):
        self.run_dir = run_dir
        self.tracker = tracker
        self.progress = progress
        self.first_eval: float | None = None
        self.last_eval: float | None = None
        self.total_tokens = 0
        self.trainer_busy_s = 0.0
        self.steps_done = 0
        self.last_step = 0  # the policy version of the latest record
        self.dropped: dict[str, int] = {}
        self._last_time: float | None = None
        self._role_totals: dict[tuple[str, str], float] = {}
        self.slower_side: SlowerSide | None = None  # from the first record on
        # (step, its reward/mean and reward_components/*) of every training step, for the summary
        self.step_rewards: list[tuple[int, dict[str, float]]] = []
        # memory/trainer_rank<i>_peak_gib as last reported (high-water marks: the run's peaks)
        self.trainer_peak_gib: dict[str, float] = {}

    def _share(self, role: str, key: str, total: float) -> float:
        """This step's share of a role's cumulative counter (a restarted role counts anew)."""
        before = self._role_totals.get((role, key), 0.0)
        self._role_totals[role, key] = total
        return total - before if total >= before else total

    def _add_to_slower_side(self, step: int, trainer_busy: float, record, metrics, now) -> None:
        """Feed this step's busy time per side; a record that carries the other roles'
        counters (the last of each drain) may end a window: both sides were read then."""
        rollouts = [r for r in record.get("roles", {}) if base_role(r) == "rollout"]
        # Loading new weights is the rollout's own work, as publishing them is the trainer's.
        shares = [
            metrics.get(f"time/{r}_busy_s", 0.0) + metrics.get(f"time/{r}_weights_s", 0.0)
            for r in rollouts
        ]
        busy = {"trainer": trainer_busy}
        if shares:  # replicas share the work: the side is as busy as its average replica
            busy["rollout"] = sum(shares) / len(shares)
        assert self.slower_side is not None
        self.slower_side.add_step(step, busy)
        if "roles" in record:
            self.slower_side.close(now)

    def rewind(self, step: int) -> None:
        """The trainer resumes in place from the checkpoint of `step`: forget what came after."""
        rewind_logs(self.run_dir, self.tracker, step)
        self._last_time = None
        self.step_rewards = [(s, r) for s, r in self.step_rewards if s <= step]

    def __call__(self, record: dict[str, Any]) -> None:
        step, metrics = record["step"], dict(record["metrics"])
        self.last_step = step
        now = time.perf_counter()
        if self.slower_side is None:
            self.slower_side = SlowerSide(start=now)
        role_tokens: dict[str, float] = {}
        for role, stats in record.get("roles", {}).items():  # cumulative -> this step's share
            if stats.get("busy_s") is not None:
                metrics[f"time/{role}_busy_s"] = self._share(role, "busy_s", stats["busy_s"])
            if stats.get("weights_s") is not None:  # engines: fetching and loading weights
                metrics[f"time/{role}_weights_s"] = self._share(
                    role, "weights_s", stats["weights_s"]
                )
            if stats.get("tokens") is not None:  # engines: tokens generated
                role_tokens[role] = self._share(role, "tokens", stats["tokens"])
            metrics.update({k: v for k, v in stats.get("metrics", {}).items() if v == v})  # not NaN
        if "eval/accuracy" in metrics:
            self.last_eval = metrics["eval/accuracy"]
            if self.first_eval is None:
                self.first_eval = self.last_eval
        if "response/tokens" in metrics:  # a training step (not the initial evaluation)
            self.steps_done += 1
            self.total_tokens += metrics["response/tokens"]
            # The trainer's own work: training, publishing the new weights, and the evaluations
            # and checkpoints it runs. Idle is the rest: waiting for samples.
            working = metrics.get("time/trainer_busy_s", 0.0) + metrics.get(
                "time/weight_publish_s", 0.0
            )
            busy = working + metrics.get("time/eval_s", 0.0) + metrics.get("time/checkpoint_s", 0.0)
            if self._last_time is not None:
                wall = now - self._last_time
                metrics["throughput/tokens_per_s"] = metrics["response/tokens"] / max(wall, 1e-9)
                for role, tokens in role_tokens.items():  # e.g. each rollout replica's rate
                    metrics[f"throughput/{role}_tokens_per_s"] = tokens / max(wall, 1e-9)
            if "time/step_s" in metrics:  # the trainer's own clock: not when records arrive here
                step_s = max(metrics["time/step_s"], 1e-9)
                metrics["trainer/idle_frac"] = max(0.0, 1.0 - working / step_s)
            elif self._last_time is not None:
                metrics["trainer/idle_frac"] = max(0.0, 1.0 - busy / max(wall, 1e-9))
            self.trainer_busy_s += busy
            self._add_to_slower_side(step, busy, record, metrics, now)
            rewards = {
                key: float(value)
                for key, value in metrics.items()
                if (key == "reward/mean" or key.startswith("reward_components/"))
                and value is not None
            }
            self.step_rewards.append((step, rewards))
            for key, value in metrics.items():
                if key.startswith("samples/dropped_"):
                    reason = key.removeprefix("samples/dropped_")
                    self.dropped[reason] = self.dropped.get(reason, 0) + int(value)
        self.trainer_peak_gib.update(
            {k: v for k, v in metrics.items() if k.startswith("memory/trainer_rank")}
        )
        self._last_time = now
        self.tracker.log(step, metrics)
        self.progress.update(step, metrics)


def rewind_logs(run_dir: Path, tracker: MetricsTracker, step: int) -> None:
    """Forget what the run logged after the checkpoint of `step`: metrics and trained sample
    ids from step + 1 on, or everything at step 0 (a trainer starting anew evaluates step 0
    again)."""
    keep_below = step + 1 if step else 0
    tracker.truncate_from(keep_below)
    truncate_samples_log(run_dir, keep_below)


def truncate_samples_log(run_dir: Path, from_step: int) -> None:
    path = run_dir / SAMPLES_LOG
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] < from_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def train(cfg: Config, *, resume: Path | None = None) -> dict[str, Any]:
    """Run (or resume) a training job; returns the summary also written to summary.json."""
    started = time.time()
    run_dir = resume if resume is not None else make_run_dir(cfg)
    if resume is None and (run_dir / "config.yaml").exists():
        raise ConfigError(
            f"run.run_dir = {str(run_dir)!r} already holds a run: `streamrl train --resume "
            f"{run_dir}` continues it; for a new run choose another run.run_dir (or delete it)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = hold_run_dir(run_dir)
    except RunDirInUse as e:
        raise ConfigError(str(e)) from None
    try:
        with _open_wandb(cfg, run_dir) as wandb_run:  # None unless run.wandb
            summary = _train(cfg, run_dir, resume, started, wandb_run)
            if wandb_run is not None:
                wandb_run.finish(summary)
            return summary
    finally:
        lock.close()


def _open_wandb(cfg: Config, run_dir: Path) -> WandbRun | nullcontext[None]:
    """The run's W&B run (config.yaml's config: secrets left out), or a stand-in when off."""
    if not cfg.run.wandb:
        return nullcontext()
    return WandbRun(
        run_dir,
        project=cfg.run.wandb_project,
        mode=cfg.run.wandb_mode,
        config=yaml.safe_load(dump_yaml(cfg)),
    )


def _train(
    cfg: Config, run_dir: Path, resume: Path | None, started: float, wandb_run: WandbRun | None
) -> dict[str, Any]:
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    clear_stop(run_dir)  # a stop asked of an earlier run in this directory is spent
    run_log = attach_controller_log(run_dir)  # logs/controller.log; roles log beside it
    log.info("run %s: mode %s", run_dir, cfg.runtime.mode)
    load_plugins(cfg.run.plugins)  # roles and engines of the user's own, before anything is built
    memory = PeakMemorySampler(interval_s=0.5)
    memory.start()
    try:
        policy_dir = cached_policy_dir(cfg)
        if policy_dir is None:
            with phase(
                "warm start: SFT on a noisy teacher (cached for later runs)",
                cfg.warm_start.steps,
                enabled=cfg.run.progress,
            ) as advance:
                policy_dir = ensure_policy_dir(cfg, progress=lambda _desc, _total: advance)
        _ensure_judge(cfg)
        checkpoint = latest_checkpoint(run_dir) if resume is not None else None
        if resume is not None and checkpoint is None:
            log.warning("no checkpoint in %s: starting from step 0", run_dir)
        first_start = read_state(checkpoint)["next_step"] if checkpoint else 0
        trainer_restarts = 0
        # Bus shards lost (each restarts every role), and the restarts in place of attempts
        # that ended so, for the summary.
        bus_restarts: dict[str, int] = {}
        earlier_restarts: dict[str, int] = {}
        recovering: BusLost | None = None
        sink: RecordSink | None = None
        while True:
            start_step = read_state(checkpoint)["next_step"] if checkpoint else 0
            ctx = prepare(cfg, policy_dir, run_dir, checkpoint)
            restarted = trainer_restarts or bus_restarts  # every role, from a checkpoint
            if not restarted:  # the data a run starts on, or a resumed run goes on with
                check_same_data(cfg, run_dir, ctx.train_rows, resuming=checkpoint is not None)
            tracker = MetricsTracker(
                run_dir,
                tensorboard=cfg.run.tensorboard,
                wandb=wandb_run,
                console_every=cfg.run.log_every,
            )
            if resume is not None or restarted:  # what came after the checkpoint
                rewind_logs(run_dir, tracker, start_step)
            progress = RunProgress(
                cfg.trainer.steps,
                enabled=cfg.run.progress,
                start_step=start_step,
                description=f"RL ({cfg.runtime.mode})",
            )
            if sink is None:
                sink = RecordSink(run_dir, tracker, progress)
                # A resumed run's accuracy before RL is the first run's step-0 evaluation.
                sink.first_eval = next(
                    (m["eval/accuracy"] for m in read_metrics(run_dir) if "eval/accuracy" in m),
                    None,
                )
            else:  # after a restart of every role: keep the first evaluation and the counters
                sink.tracker, sink.progress, sink._last_time = tracker, progress, None
                sink.step_rewards = [(s, r) for s, r in sink.step_rewards if s <= start_step]
            try:
                with progress, stop_on_interrupt(run_dir):
                    role_stats = _run_mode(ctx, sink, start_step, recovering, bus_restarts)
                break
            except BusLost as e:
                tracker.close()
                _add_counts(earlier_restarts, e.restarts or {})
                used = bus_restarts.get(e.process, 0)
                if used >= cfg.runtime.ray.max_restarts:
                    raise RoleFailed(
                        f"{e}; restart budget (runtime.ray.max_restarts={cfg.runtime.ray.max_restarts}) "
                        "spent"
                    ) from e
                bus_restarts[e.process] = used + 1
                recovering = e
                checkpoint = latest_checkpoint(run_dir)
                log.warning(
                    "%s: every role restarts from %s (restart %d/%d of %s)",
                    e,
                    checkpoint or "the start",
                    used + 1,
                    cfg.runtime.ray.max_restarts,
                    e.process,
                )
            except TrainerLost as e:
                tracker.close()
                _add_counts(earlier_restarts, e.restarts or {})
                recovering = None
                if trainer_restarts >= cfg.runtime.ray.max_restarts:
                    raise RoleFailed(
                        f"{e}; restart budget (runtime.ray.max_restarts={cfg.runtime.ray.max_restarts}) "
                        "spent",
                        log=log_path(run_dir, pacing_role(cfg)),
                    ) from e
                trainer_restarts += 1
                checkpoint = latest_checkpoint(run_dir)
                log.warning(
                    "%s: resuming from %s (trainer restart %d/%d)",
                    e,
                    checkpoint or "the start",
                    trainer_restarts,
                    cfg.runtime.ray.max_restarts,
                )
        start_step = first_start
        # Restarts of every role (trainer_restarts) plus the trainer's own in place, if any.
        if bus_restarts or earlier_restarts:
            restarts = role_stats.setdefault("restarts", {})
            _add_counts(restarts, earlier_restarts)
            _add_counts(restarts, bus_restarts)
        in_place = role_stats.get("restarts", {}).get(pacing_role(cfg), 0)
        role_stats["trainer_restarts"] = trainer_restarts + in_place
        rl_wall = role_stats["train_wall_s"]  # from roles ready to the last step
        tracker.close()
    except KeyboardInterrupt:
        log.warning(
            "interrupted; `streamrl train --resume %s` continues from its latest checkpoint",
            run_dir,
        )
        raise
    except RoleError as e:
        log_failure(run_log, "the run failed")  # the traceback, in logs/controller.log only
        if e.log is None:  # not in a role's own log
            e.log = log_path(run_dir, CONTROLLER)
        if isinstance(e, RoleFailed):  # the budget is per run: a resume starts it afresh
            e.resume = run_dir
        raise
    except ConfigError:
        raise
    except Exception as e:  # no raw traceback on the console: one line, and what to do
        log_failure(run_log, "the run failed")
        raise RunFailed(
            f"the run failed: {one_line(e)}", log=log_path(run_dir, CONTROLLER), resume=run_dir
        ) from e
    finally:
        memory.stop()
        detach(run_log)
    summary = _summary(
        cfg,
        run_dir,
        sink,
        role_stats,
        started,
        rl_wall,
        memory.peak_bytes,
        start_step,
        ctx,
    )
    write_summary(run_dir, summary)
    plot_run(
        read_metrics(run_dir), run_dir / "reward_accuracy.png", title=f"streamrl {cfg.runtime.mode}"
    )
    if cfg.run.progress or cfg.run.log_every:
        print_summary(summary)
    return summary


def _add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, count in counts.items():
        into[name] = into.get(name, 0) + count


def _run_mode(
    ctx,
    sink: RecordSink,
    start_step: int,
    recovering: BusLost | None = None,
    bus_restarts: dict[str, int] | None = None,
) -> dict[str, Any]:
    mode = ctx.cfg.runtime.mode
    if mode == "sync":
        from streamrl.models.loading import set_threads
        from streamrl.runtime.sync import run_sync

        set_threads(ctx.cfg.runtime.sync_threads or os.cpu_count() or 1)
        return run_sync(ctx, sink, start_step=start_step)
    if mode == "inline":
        from streamrl.runtime.inline import run_inline

        return run_inline(ctx, sink, start_step=start_step)
    if mode == "threads":
        from streamrl.runtime.threads import run_threads

        return run_threads(ctx, sink, start_step=start_step)
    from streamrl.runtime.ray_runtime import run_ray

    return run_ray(
        ctx,
        sink,
        start_step=start_step,
        on_rewind=sink.rewind,
        recovering=recovering,
        service_restarts=bus_restarts,
    )


def _ensure_judge(cfg) -> None:
    """Build the built-in judge before any role starts (once: it is cached like the warm start)."""
    judge = cfg.reward.judge
    if not judge.enabled or judge.model is not None:
        return
    from streamrl.judge.role import judge_dir

    if judge_dir(cfg, cached_only=True) is not None:
        return
    with phase(
        "judge: SFT on right and wrong worked answers (cached for later runs)",
        judge.build.steps,
        enabled=cfg.run.progress,
    ) as advance:
        judge_dir(cfg, progress=lambda _desc, _total: advance)


def _judge_summary(cfg, role_stats) -> dict[str, Any]:
    """The judge's held-out verdict accuracy (the built-in judge's build measured it) and
    throughput, for the summary."""
    if not cfg.reward.judge.enabled:
        return {}
    from streamrl.judge.model import read_judge_eval
    from streamrl.judge.role import judge_dir

    model_dir = judge_dir(cfg)
    measured = read_judge_eval(model_dir) or {}
    judge = role_stats.get("judge", {})
    busy, judged = judge.get("busy_s"), judge.get("judged")
    return {
        "judge_model_dir": str(model_dir),
        "judge_verdict_accuracy": measured.get("verdict_accuracy"),
        "judge_samples_per_s": judged / busy if busy and judged else None,
    }


def _summary(
    cfg, run_dir, sink: RecordSink, role_stats, started, rl_wall, peak_bytes, start_step, ctx
) -> dict[str, Any]:
    rollout = role_stats.get("rollout", {})
    rollout_busy, rollout_wait = rollout.get("busy_s"), rollout.get("wait_s")
    sync = cfg.runtime.mode == "sync" or sink.slower_side is None
    if not sync:
        sink.slower_side.finish()
    return {
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
        "mode": cfg.runtime.mode,
        "max_staleness": cfg.rollout.max_staleness,
        "initial_eval_accuracy": sink.first_eval,
        "final_eval_accuracy": sink.last_eval,
        "num_steps": sink.last_step,
        # Asked to end early (`streamrl stop`); `streamrl train --resume` goes on to the rest.
        "stopped_early": sink.last_step < cfg.trainer.steps,
        "resumed_from_step": start_step,
        "wall_time_s": time.time() - started,
        "rl_wall_time_s": rl_wall,
        "rl_steps_per_s": (sink.last_step - start_step) / max(rl_wall, 1e-9),
        "tokens_per_s": sink.total_tokens / max(rl_wall, 1e-9),
        "peak_memory_bytes": peak_bytes,
        # Each trainer rank's own peak (its process's high-water mark; on GPU torch's allocations)
        **{k.removeprefix("memory/"): v for k, v in sink.trainer_peak_gib.items()},
        "num_samples_dropped": dict(sink.dropped),
        **reward_trend([rewards for _, rewards in sink.step_rewards]),
        "num_malformed_dataset_rows": ctx.num_malformed_rows,
        "num_overlong_prompts": ctx.num_overlong_prompts,
        "trainer_idle_fraction": max(0.0, 1.0 - sink.trainer_busy_s / max(rl_wall, 1e-9)),
        "rollout_busy_fraction": (rollout_busy / rl_wall) if rollout_busy is not None else None,
        # Per 10-step window the busier of trainer and rollout sets the pace: how busy it was
        # (the synchronous loop runs them in turn, so there it means nothing).
        "slower_side_busy_fraction": None if sync else sink.slower_side.fraction(),
        "slower_side": None if sync else sink.slower_side.describe(),
        # The rollout held back by max_staleness, waiting for the trainer's next version.
        "rollout_wait_fraction": (rollout_wait / rl_wall) if rollout_wait is not None else None,
        "role_restarts": role_stats.get("restarts", {}),
        "trainer_restarts": role_stats.get("trainer_restarts", 0),
        # The trained policy as a Hugging Face directory (model, tokenizer, chat template).
        "final_model_dir": str(model) if (model := latest_model_dir(run_dir)) else None,
        **_judge_summary(cfg, role_stats),
    }

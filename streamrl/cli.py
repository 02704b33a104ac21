"""The `streamrl` command line.

    streamrl train [CONFIG.yaml ...] [key=value ...] [--resume RUN_DIR]
    streamrl status RUN_DIR
    streamrl logs RUN_DIR [ROLE] [-n N]
    streamrl scale RUN_DIR ROLE=N
    streamrl stop RUN_DIR
    streamrl eval RUN_DIR|MODEL_DIR [key=value ...] [--show N] [--samples K [--temperature T]] [--json]
    streamrl replay RUN_DIR --from-step K [--steps N] | --inspect STEP
    streamrl config show [CONFIG.yaml ...] [key=value ...]

`streamrl train` with no arguments runs the embedded default: the built-in tiny model, warm
started, trained with async GRPO on the built-in arithmetic task, on this machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from streamrl.config import ConfigError, dump_yaml, load_config
from streamrl.runtime.preflight import check_paths, check_same_data_order, finished


def exit_at_once(code: int) -> None:
    """End the process now, after Ray (if this process started it) and the logs. A second
    Ctrl-C can arrive while role threads (threads mode) are still inside torch kernels; letting
    the interpreter finalize under them made the process abort (C++ "terminate called without
    an active exception", exit -6) instead of exiting with `code`."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl", description="Asynchronous, streaming RL post-training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run (or resume) a training job")
    train.add_argument(
        "args", nargs="*", help="YAML config files and dotted key=value overrides, applied in order"
    )
    train.add_argument(
        "--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint"
    )
    status = sub.add_parser(
        "status",
        help="whether a run is running, how far it got, and (Ray mode) where each role runs, "
        "its health and its restarts",
    )
    status.add_argument("run_dir", metavar="RUN_DIR")
    logs = sub.add_parser(
        "logs", help="the last lines of each role's log (RUN_DIR/logs/<role>.log), or of one role"
    )
    logs.add_argument("run_dir", metavar="RUN_DIR")
    logs.add_argument(
        "role", nargs="?", help="rollout, rollout#1, trainer, controller, ... (default: all)"
    )
    logs.add_argument("-n", type=int, default=20, metavar="N", help="lines per file (default 20)")
    scale = sub.add_parser("scale", help="change the replicas of a role of a running job")
    scale.add_argument("run_dir", metavar="RUN_DIR")
    scale.add_argument("request", metavar="ROLE=N", help="for example rollout=3")
    stop = sub.add_parser(
        "stop",
        help="end a running job after its current step, with a checkpoint "
        "(`streamrl train --resume RUN_DIR` continues it)",
    )
    stop.add_argument("run_dir", metavar="RUN_DIR")
    evaluate = sub.add_parser(
        "eval",
        help="held-out greedy accuracy of a run's trained model (as the run measured it) or "
        "of any model directory; pass@k with --samples K",
    )
    evaluate.add_argument("target", metavar="RUN_DIR|MODEL_DIR")
    evaluate.add_argument(
        "args", nargs="*", help="dotted key=value overrides (data.eval_file=..., data.num_eval=N)"
    )
    evaluate.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="also print the first N prompts answered wrong: response and reward verdict",
    )
    evaluate.add_argument(
        "--samples",
        type=int,
        default=0,
        metavar="K",
        help="also sample K answers a prompt and report pass@1 (mean accuracy of a sample) "
        "up to pass@K",
    )
    evaluate.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="sampling temperature of --samples (default: the run's rollout.temperature)",
    )
    evaluate.add_argument(
        "--json",
        action="store_true",
        help="print the figures as one JSON object (accuracy, pass_at, ...) instead of text",
    )
    replay = sub.add_parser(
        "replay",
        help="train a run's recorded steps (run.record_samples=true) again from a checkpoint, "
        "without engines, and check each step's loss and gradient norm bit for bit",
    )
    replay.add_argument("run_dir", metavar="RUN_DIR")
    replay.add_argument(
        "--from-step",
        type=int,
        metavar="K",
        help="restore checkpoint K (checkpoints/step-K) and replay steps K+1..",
    )
    replay.add_argument(
        "--steps", type=int, metavar="N", help="steps to replay (default: every recorded one)"
    )
    replay.add_argument(
        "--inspect",
        type=int,
        metavar="STEP",
        help="print step STEP's recorded samples and per-token figures instead",
    )
    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show", help="print the resolved config with every field's documentation"
    )
    show.add_argument("args", nargs="*", help="YAML config files and dotted key=value overrides")
    return parser


def format_status(run_dir: Path) -> str:
    """Whether the run's job lives, how far it got, and (Ray mode) where each role runs, its
    health and restarts, from `roles.json`, which the supervisor keeps current."""
    import time

    from streamrl.control import check_run_dir, live_job, stop_requested
    from streamrl.metrics.tracker import read_metrics
    from streamrl.runtime.status import STATUS_FILE, read_status
    from streamrl.trainer.checkpoint import latest_checkpoint

    check_run_dir(run_dir)
    ray_mode = (run_dir / STATUS_FILE).is_file()
    steps = load_config([str(run_dir / "config.yaml")]).trainer.steps
    pid = live_job(run_dir)
    summary = run_dir / "summary.json"
    if pid is not None:
        state = f"running (pid {pid})"
        if stop_requested(run_dir):
            state += ", stop requested (it ends after its current step)"
    elif summary.is_file():
        state = "stopped early" if json.loads(summary.read_text())["stopped_early"] else "finished"
    else:
        last = latest_checkpoint(run_dir, checksums=False)
        state = (
            "not running, and it did not finish (it failed or was killed: the end of "
            f"logs/controller.log says which); `streamrl train --resume {run_dir}` continues it "
            f"from {last.name if last else 'step 0'}"
        )
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    trained = [r["step"] for r in records if "train/loss" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    progress = f"step {trained[-1] if trained else 0}/{steps}"
    if evals:
        progress += f", held-out accuracy {evals[-1][1]:.3f} at step {evals[-1][0]}"
        if len(evals) > 1:
            progress += f" ({evals[0][1]:.3f} at step {evals[0][0]})"
    lines = [f"{run_dir}: {state}; {progress}"]
    if ray_mode:
        status = read_status(run_dir)
        age = time.time() - status["updated"]
        lines.append(
            f"roles ({'updated' if pid is not None else 'as last recorded'} {age:.0f}s ago):"
        )
        lines.append(f"{'role':10} {'node':15} {'pid':>7} {'health':8} {'restarts':8} log")
        for name, info in status["roles"].items():
            health = "ok" if info["healthy"] else "down"
            lines.append(
                f"{name:10} {info['node']:15} {info['pid']:>7} {health:8} "
                f"{info['restarts']:<8} {info.get('log', '')}"
            )
        for name, info in status.get("services", {}).items():  # bus shards, weight store
            health = "ok" if info["healthy"] else "down"
            lines.append(
                f"{name:10} {'':15} {info['pid']:>7} {health:8} {info['restarts']:<8} "
                "(events.jsonl)"
            )
    where = (
        f"logs of every role and the controller: {run_dir}/logs (`streamrl logs {run_dir} ROLE`)"
    )
    if ray_mode:
        where += f"; failures and restarts: {run_dir}/events.jsonl"
    lines.append(where)
    return "\n".join(lines)


def format_logs(run_dir: Path, role: str | None, num_lines: int) -> str:
    """The tail of one role's log file, or of every log file of the run."""
    from streamrl.runtime.logs import list_logs, log_path, tail

    if role is not None:
        path = log_path(run_dir, role.replace("-", "#"))
        if not path.is_file():
            known = ", ".join(p.stem for p in list_logs(run_dir)) or "none"
            raise FileNotFoundError(f"no log for {role!r} in {run_dir}/logs; logs: {known}")
        return "\n".join(tail(path, num_lines))
    paths = list_logs(run_dir)
    if not paths:
        raise FileNotFoundError(f"{run_dir}/logs has no log files: is it a streamrl run directory?")
    return "\n\n".join("\n".join([f"==> {p} <==", *tail(p, num_lines)]) for p in paths)


def replay_command(args: argparse.Namespace) -> int:
    """`streamrl replay`: 0 when every replayed step matched its record, 1 when one did not."""
    from rich.console import Console

    from streamrl.trainer.replay import inspect_step, replay, replay_table

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir}: no config.yaml there; is it a streamrl run directory?")
    # Whole floats in the table also when printed to a file or pipe (rich's width there is 80).
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    if args.inspect is not None:
        inspect_step(run_dir, args.inspect, console=console)
        return 0
    if args.from_step is None:
        raise ConfigError("streamrl replay needs --from-step K (a checkpoint) or --inspect STEP")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    results = replay(
        run_dir,
        args.from_step,
        args.steps,
        on_step=lambda r: console.print(
            f"step {r.step}: loss {r.replayed_loss!r}, grad_norm {r.replayed_grad_norm!r}, "
            + ("equal" if r.equal else "DIFFERENT")
        ),
    )
    console.print(replay_table(results))
    bad = [r.step for r in results if not r.equal]
    if bad:
        console.print(f"replay: steps {bad} differ from the record")
        return 1
    console.print(f"replay: all {len(results)} steps equal the record bit for bit")
    return 0


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. Overrides may follow options (`streamrl eval RUN --json
    data.num_eval=8`): argparse fills a list of positionals from their first stretch only and
    calls the rest unrecognized, so those are added to it here, in the order given."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and isinstance(getattr(args, "args", None), list):
        if not any(arg.startswith("-") for arg in rest):
            args.args += rest
            return args
    if rest:
        parser.parse_args(argv)  # exits with argparse's own message for what it does not know
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(argv)
    # User code named by a dotted path (`reward.function=my_rewards:score`) is looked up in the
    # directory the command runs in first, as `python -m` and `python script.py` users expect
    # (a console script's path holds only its own directory).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # A run starts Ray itself (`ensure_ray`), never by accident: a Ray call from a thread left
    # running after `ray.shutdown()` would otherwise start a new local instance whose processes
    # die with that thread, and Ray then ends this process a minute later. Read by Ray at import.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # inherited by every role process
    try:
        if args.command == "config":
            print(dump_yaml(load_config(args.args)))
            return 0
        if args.command == "scale":
            from streamrl.control import set_replicas

            role, sep, count = args.request.partition("=")
            if not sep or not count.isdigit():
                raise ValueError(f"expected ROLE=N (for example rollout=3), got {args.request!r}")
            set_replicas(Path(args.run_dir), role, int(count))
            print(
                f"asked {args.run_dir} for {count} {role} replica(s); `streamrl status` shows them"
            )
            return 0
        if args.command == "stop":
            from streamrl.control import check_run_dir, live_job, request_stop

            run_dir = Path(args.run_dir)
            check_run_dir(run_dir)
            if live_job(run_dir) is None:
                print(f"streamrl: {run_dir} is not running; nothing to stop", file=sys.stderr)
                return 1
            request_stop(run_dir)
            print(
                f"asked {args.run_dir} to stop after its current step; it writes a checkpoint "
                f"and its summary, and `streamrl train --resume {args.run_dir}` continues it"
            )
            return 0
        if args.command == "status":
            print(format_status(Path(args.run_dir)))
            return 0
        if args.command == "logs":
            print(format_logs(Path(args.run_dir), args.role, args.n))
            return 0
        if args.command == "replay":
            return replay_command(args)
        if args.command == "eval":
            from streamrl.runtime.evaluation import evaluate

            evaluation = evaluate(
                Path(args.target),
                list(args.args),
                samples=args.samples,
                temperature=args.temperature,
            )
            if args.json:
                print(json.dumps(evaluation.as_dict()))
                return 0
            if args.show:
                print(evaluation.misses(args.show))
            print(evaluation.report())
            return 0
        resume = Path(args.resume) if args.resume else None
        overrides = list(args.args)
        if resume is not None:
            saved = resume / "config.yaml"
            if not saved.is_file():
                raise ConfigError(
                    f"--resume {resume}: no config.yaml there; is it a streamrl run directory?"
                )
            overrides = [str(saved), *overrides, f"run.run_dir={resume}"]
        cfg = load_config(overrides)
        if resume is not None:
            check_same_data_order(load_config([str(resume / "config.yaml")]), cfg, resume)
        check_paths(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"streamrl: {e}", file=sys.stderr)
        return 2
    if resume is not None and finished(resume, cfg.trainer.steps):
        print(
            f"streamrl: {resume} has trained all {cfg.trainer.steps} steps; nothing to do (to "
            f"train on: streamrl train --resume {resume} trainer.steps=N with N larger)",
            file=sys.stderr,
        )
        return 0
    from streamrl.runtime.controller import train
    from streamrl.runtime.errors import RoleError

    try:
        train(cfg, resume=resume)
    except KeyboardInterrupt:  # a second Ctrl-C; the controller said how to resume
        exit_at_once(130)
    except RoleError as e:  # its traceback is in the role's log and logs/controller.log
        print(f"streamrl: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # found once the model is known (say, data that cannot fit it)
        print(f"streamrl: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

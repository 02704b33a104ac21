"""Preparing a run's context (`api/run.py:RunContext`) once, in the controller.

`prepare` resolves the policy directory (building and warm-starting the built-in model on first
use), loads the datasets, and fixes the run directory. The result is small and plain, so it can
be passed to Ray actors, which rebuild their heavy objects (model, tokenizer) from it.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

from streamrl.api.run import RunContext
from streamrl.config import ConfigError
from streamrl.config.derived import multimodal
from streamrl.config.schema import Config
from streamrl.data.dataset import PromptRow, builtin_rows, format_prompts, load_rows
from streamrl.data.prompts import CONVERSATION_NEEDS_TEMPLATE

log = logging.getLogger(__name__)


def make_run_dir(cfg: Config) -> Path:
    """`run.run_dir`, or a new `runs/<timestamp>` folder: created here, with a suffix when jobs
    started in the same second (a sweep) would otherwise share one."""
    if cfg.run.run_dir is not None:
        return Path(cfg.run.run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path("runs").mkdir(exist_ok=True)
    n = 0
    while True:
        path = Path("runs") / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()  # atomic: of two jobs, one gets it
            return path
        except FileExistsError:
            n += 1


def load_datasets(cfg: Config) -> tuple[list[PromptRow], list[PromptRow], int]:
    d = cfg.data
    skipped = 0
    if d.train_file:
        report = load_rows(d.train_file, d.prompt_key, d.answer_key)
        train, skipped = report.rows, report.num_skipped
    else:
        train = builtin_rows(5_000, digits=d.digits, seed=d.seed, split="train", task=d.task)
    if d.eval_file:
        report = load_rows(d.eval_file, d.prompt_key, d.answer_key)
        evals, skipped = report.rows[: d.num_eval], skipped + report.num_skipped
    elif d.train_file:  # the built-in task's problems would say nothing about this data
        train, evals = hold_out(train, d.num_eval, d.seed)
        log.info(
            "data.eval_file not set: %d of the %d rows of %s held out for evaluation",
            len(evals),
            len(train) + len(evals),
            d.train_file,
        )
    else:
        evals = builtin_rows(d.num_eval, digits=d.digits, seed=d.seed, split="eval", task=d.task)
    train, evals = (
        format_prompts(rows, template=d.prompt_template, system=d.system_prompt)
        for rows in (train, evals)
    )
    if not d.chat_template:
        conversations = sum(isinstance(row.prompt, list) for row in train + evals)
        if conversations:
            raise ValueError(f"{conversations} row(s): {CONVERSATION_NEEDS_TEMPLATE}")
    with_media = sum(bool(row.media) for row in train + evals)
    if with_media and not multimodal(cfg):
        raise ValueError(
            f"{with_media} row(s) hold images, videos or audio, but the policy takes text only: "
            "set model.path to a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or a "
            "Qwen2.5-Omni model (docs/multimodal.md)"
        )
    return train, evals, skipped


def hold_out(
    rows: list[PromptRow], num_eval: int, seed: int
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Split `rows` into training rows and held-out rows: min(num_eval, a tenth of them), at
    least one, picked by `seed`; each part keeps the file's order."""
    if len(rows) < 2:
        raise ValueError(
            f"data.train_file has {len(rows)} usable row(s): need two or more to hold some out "
            "for evaluation, or set data.eval_file"
        )
    num = max(1, min(num_eval, len(rows) // 10))
    held = set(random.Random(f"{seed}-eval").sample(range(len(rows)), num))
    train = [row for i, row in enumerate(rows) if i not in held]
    return train, [row for i, row in enumerate(rows) if i in held]


def prepare(
    cfg: Config, policy_dir: Path, run_dir: Path, checkpoint: Path | None = None
) -> RunContext:
    train, evals, skipped = load_datasets(cfg)
    overlong = 0
    if cfg.data.train_file or cfg.data.eval_file:  # the built-in task's prompts are short
        train, evals, overlong = drop_overlong_prompts(cfg, policy_dir, train, evals)
    return RunContext(cfg, policy_dir, run_dir, train, evals, skipped, checkpoint, overlong)


def context_length(cfg: Config, policy_dir: Path) -> int | None:
    """The most tokens (prompt + response) the rollout engine takes for one sample."""
    if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.max_model_len:
        return cfg.rollout.vllm.max_model_len
    model = json.loads((Path(policy_dir) / "config.json").read_text())
    model = model.get("text_config", model)  # multimodal configs nest the language model's
    return model.get("max_position_embeddings")


def drop_overlong_prompts(
    cfg: Config, policy_dir: Path, train: list[PromptRow], evals: list[PromptRow]
) -> tuple[list[PromptRow], list[PromptRow], int]:
    """Leave out the rows whose prompt, with `rollout.max_new_tokens` of response, would not
    fit in the model's context: an engine refuses them (vLLM) or runs past the positions the
    model knows (the builtin engine). Each kept list keeps its order; both must keep a row."""
    from streamrl.data.prompts import prompt_lengths_over
    from streamrl.models.loading import load_tokenizer

    context = context_length(cfg, policy_dir)
    if context is None:
        return train, evals, 0
    limit = context - cfg.rollout.max_new_tokens
    if limit < 1:
        raise ConfigError(
            f"rollout.max_new_tokens = {cfg.rollout.max_new_tokens} leaves no room for a prompt "
            f"in the model's context of {context} tokens"
        )
    tokenizer = load_tokenizer(policy_dir)
    kept_lists, dropped = [], 0
    for name, rows in (("training", train), ("evaluation", evals)):
        over = prompt_lengths_over(
            tokenizer, [row.prompt for row in rows], limit, chat_template=cfg.data.chat_template
        )
        if over:
            log.warning(
                "%d of the %d %s prompts left out: longer than %d tokens (the context of %d "
                "minus rollout.max_new_tokens = %d); the longest has %d",
                len(over),
                len(rows),
                name,
                limit,
                context,
                cfg.rollout.max_new_tokens,
                max(over.values()),
            )
        if len(over) == len(rows):
            raise ConfigError(
                f"every {name} prompt is longer than {limit} tokens (the model's context of "
                f"{context} minus rollout.max_new_tokens = {cfg.rollout.max_new_tokens})"
            )
        kept_lists.append([row for i, row in enumerate(rows) if i not in over])
        dropped += len(over)
    return kept_lists[0], kept_lists[1], dropped

"""The warm start: a short supervised run on a noisy teacher, cached on disk by its settings.

RL needs a policy that is partly right. The warm start trains the built-in tiny model on answers
from a teacher that forgets every carry in a fraction of its answers (see `streamrl.data.arith`),
so the policy learns the format and carry-free sums but prefers wrong answers to carry problems.
The result is an ordinary HF model directory, reused by every later run with the same settings.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from streamrl.config.derived import AUDIO_TASKS, multimodal
from streamrl.config.schema import Config
from streamrl.data import arith, calculator, vision_tasks
from streamrl.data.prompts import encode_prompt, encode_response
from streamrl.models.loading import load_causal_lm, load_tokenizer, save_model
from streamrl.models.tiny import build_tiny_model_dir

log = logging.getLogger(__name__)


# Each built-in task's teacher settings; the other tasks' are left out of a warm start's cache
# key (a new task's settings leave the existing tasks' keys as they were).
_TEACHERS = {
    "arith": {"teacher_forget_carry"},
    "calculator": {"teacher_tool_use", "teacher_miscopy"},
    "shapes": {"teacher_miscount"},
    "motion": {"teacher_reverse"},
    "tones": {"teacher_ear"},
}
_OTHER_TASKS_TEACHER = {
    task: set().union(*_TEACHERS.values()) - mine for task, mine in _TEACHERS.items()
}


def warm_start_key(cfg: Config) -> str:
    relevant = {
        # How the products are computed changes only their rounding, not what is trained; the
        # warm start trains and saves in fp32 whatever `model.dtype` the RL run loads it in.
        "model": {**cfg.model.model_dump(exclude=_unused_model_keys(cfg)), "dtype": "float32"},
        "warm_start": cfg.warm_start.model_dump(exclude=_OTHER_TASKS_TEACHER[cfg.data.task]),
        "digits": cfg.data.digits,
        "seed": cfg.run.seed,
        "format": 4,
    }
    if cfg.data.task != "arith":
        relevant["task"] = cfg.data.task
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:12]


def _unused_model_keys(cfg: Config) -> set[str]:
    """Model settings that do not change the built model (a dense model's MoE settings)."""
    unused = {"onednn_linears", "freeze_vision"}  # freezing is for RL; the warm start trains all
    if not cfg.model.num_experts:
        unused |= {"num_experts", "experts_per_token"}
    if cfg.model.vision_family == "qwen2_5_vl":  # the default: keys cached before it existed
        unused.add("vision_family")
    return unused


def cached_policy_dir(cfg: Config) -> Path | None:
    """The policy directory if it needs no work (a user's model, or a cached warm start)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    out = Path(cfg.run.cache_dir) / f"policy-{warm_start_key(cfg)}"
    return out if (out / "config.json").is_file() else None


def ensure_policy_dir(
    cfg: Config, progress: Callable[[str, int], Callable[[int], None]] | None = None
) -> Path:
    """Return the HF directory RL starts from: `model.path`, or the cached warm-started tiny model."""
    cached = cached_policy_dir(cfg)
    if cached is not None:
        return cached
    cache = Path(cfg.run.cache_dir)
    out = cache / f"policy-{warm_start_key(cfg)}"
    cache.mkdir(parents=True, exist_ok=True)
    # Jobs started together with the same settings build it once: the others wait here.
    with open(cache / f".lock-{out.name}", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another job is building the warm start %s; waiting for it", out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        return cached_policy_dir(cfg) or _build_policy_dir(cfg, out, progress)


def _build_policy_dir(cfg: Config, out: Path, progress) -> Path:
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"  # `out` appears only when complete
    shutil.rmtree(tmp, ignore_errors=True)
    build = build_tiny_model_dir
    if cfg.data.task in AUDIO_TASKS:  # the tiny Qwen2.5-Omni thinker (an audio tower)
        from streamrl.models.tiny_omni import build_tiny_omni_model_dir as build
    elif multimodal(cfg):  # a built-in vision task: the tiny model with a vision tower
        from streamrl.models.tiny_vl import build_tiny_vl_model_dir

        build = functools.partial(build_tiny_vl_model_dir, family=cfg.model.vision_family)
    build(
        tmp,
        hidden_size=cfg.model.hidden_size,
        num_layers=cfg.model.num_layers,
        num_heads=cfg.model.num_heads,
        seed=cfg.run.seed,
        **moe_shape(cfg),
    )
    if cfg.warm_start.enabled and cfg.warm_start.steps > 0:
        run_sft(tmp, cfg, progress)
    tmp.rename(out)
    return out


def moe_shape(cfg: Config) -> dict[str, int]:
    """The built-in model's expert settings (none for a dense or vision-language one)."""
    if not cfg.model.num_experts:
        return {}
    return {"num_experts": cfg.model.num_experts, "experts_per_token": cfg.model.experts_per_token}


def run_sft(model_dir: Path, cfg: Config, progress=None) -> None:
    """Train the model in `model_dir` on the noisy teacher and save it back in place."""
    import torch  # here: a run whose warm start is cached never needs it in the driver

    from streamrl.models.onednn import configure_linears

    ws = cfg.warm_start
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    configure_linears(model, cfg.model.onednn_linears)
    model.train()
    rng = random.Random(cfg.run.seed)
    if cfg.data.task in vision_tasks.MEDIA_TASKS:
        batches = vision_teacher_batches(cfg, model_dir, rng)
    else:
        batches = teacher_batches(cfg, tokenizer, rng)
    advance = progress("warm start (SFT on a noisy teacher)", ws.steps) if progress else None
    train_supervised(
        model,
        batches,
        steps=ws.steps,
        lr=ws.lr,
        pad_token_id=tokenizer.pad_token_id,
        advance=advance,
    )
    save_model(model, model_dir)


def train_supervised(
    model,
    batches: Iterator[list[Example]],
    *,
    steps: int,
    lr: float,
    pad_token_id: int,
    advance: Callable[[int], None] | None = None,
) -> None:
    """`steps` AdamW steps on `model` in place, one batch of `batches` each: the mean negative
    log-likelihood of the target tokens under their mask, with gradients clipped to norm 1 and
    the learning rate warmed up over 20 steps, then cosine-decayed to zero at `steps`.
    `advance(1)` is called after every step (a progress bar). Shared by the warm start and the
    built-in judge (`streamrl.judge.model`)."""
    import torch

    from streamrl.trainer.logprobs import pack, response_logprobs

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    for _ in range(steps):
        batch = next(batches)
        prompts, targets, masks = zip(*(example[:3] for example in batch), strict=True)
        media = [example[3] for example in batch] if len(batch[0]) > 3 else None
        packed = pack(prompts, targets, pad_token_id, media=media)
        mask = packed.response_mask_br.clone()
        for i, target_mask in enumerate(masks):  # tool output is shown, not imitated
            mask[i, : len(target_mask)] *= torch.tensor(target_mask, dtype=mask.dtype)
        logp = response_logprobs(model, packed)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if advance:
            advance(1)


# (prompt ids, target ids, target mask), and a multimodal prompt's processor tensors.
Example = tuple[list[int], list[int], list[int]] | tuple[list[int], list[int], list[int], dict]


def vision_teacher_batches(cfg: Config, model_dir: Path, rng: random.Random):
    """Endless batches of a built-in media task's noisy teacher (`streamrl.data.vision_tasks`),
    each picture or clip processed once by the model's processor."""
    from streamrl.media.cache import MediaCache
    from streamrl.media.load import MediaLimits
    from streamrl.media.prepare import load_prepared, prepare_prompt
    from streamrl.media.refs import MultimodalPrompt
    from streamrl.models.processors import load_processor

    ws, task = cfg.warm_start, cfg.data.task
    num_problems = 1024  # processed once: about 50 MB of pixel values
    processor, limits = load_processor(model_dir), MediaLimits()
    store = MediaCache(None, memory_entries=num_problems)
    examples = []
    for problem in vision_tasks.sample(task, num_problems, seed=cfg.run.seed + 1, split="train"):
        prompt = MultimodalPrompt(problem.messages, (problem.medium,))
        prepared = prepare_prompt(prompt, processor, store, limits=limits)
        examples.append((problem, list(prepared.prompt_ids), prepared.media_key))
    tokenizer = processor.tokenizer
    while True:
        batch = []
        for problem, prompt_ids, key in rng.sample(examples, ws.batch_size):
            answer = vision_tasks.teacher_solution(task, problem, rng, ws)
            target = encode_response(tokenizer, answer)
            batch.append((prompt_ids, target, [1] * len(target), load_prepared(store, key)[0]))
        yield batch


def teacher_batches(cfg: Config, tokenizer, rng: random.Random) -> Iterator[list[Example]]:
    """Endless batches of (prompt ids, target ids, target mask) of the noisy teacher of
    `data.task`; the mask is 0 on tokens the model is shown but does not write (an agent's tool
    output)."""
    ws, seed, digits = cfg.warm_start, cfg.run.seed, cfg.data.digits
    if cfg.data.task == "calculator":
        products = calculator.sample_products(20_000, digits=digits, seed=seed + 1, split="train")
        while True:
            batch = []
            for problem in rng.sample(products, ws.batch_size):
                episode = calculator.teacher_episode(
                    problem, rng, tool_use=ws.teacher_tool_use, miscopy=ws.teacher_miscopy
                )
                prompt = encode_prompt(tokenizer, problem.prompt)
                batch.append((prompt, *episode_target(tokenizer, episode)))
            yield batch
    problems = arith.sample_problems(20_000, digits=digits, seed=seed + 1, split="train")
    while True:
        batch = []
        for p in rng.sample(problems, ws.batch_size):
            target = encode_response(
                tokenizer, arith.teacher_solution(p, rng, ws.teacher_forget_carry)
            )
            batch.append((encode_prompt(tokenizer, p.prompt), target, [1] * len(target)))
        yield batch


def episode_target(tokenizer, episode: calculator.TeacherEpisode) -> tuple[list[int], list[int]]:
    """The teacher's turns as the ledger of an episode holds them: its turns (mask 1) and the
    tool's result rendered between them by the built-in chat format (mask 0)."""
    from streamrl.agents.chat import ToolCall, chat_format

    chat = chat_format("streamrl")
    ids, mask = [], []
    for k, turn in enumerate(episode.turns):
        if k:
            call = ToolCall("calculate", {}, "call_0")
            shown = tokenizer(
                chat.continuation([chat.tool_message(call, episode.tool_result or "")]),
                add_special_tokens=False,
            )["input_ids"]
            ids, mask = ids + shown, mask + [0] * len(shown)
        written = encode_response(tokenizer, turn)
        ids, mask = ids + written, mask + [1] * len(written)
    return ids, mask

"""The warm start: a short supervised run on a noisy teacher, cached on disk by its settings.

RL needs a policy that is partly right. The warm start trains the built-in tiny model on answers
from a teacher that forgets every carry in a fraction of its answers (see `streamrl.data.arith`),
so the policy learns the format and carry-free sums but prefers wrong answers to carry problems.
The result is an ordinary HF model directory, reused by every later run with the same settings.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

from streamrl.config.schema import Config
from streamrl.data import arith
from streamrl.data.prompts import encode_prompt, encode_response
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.models.tiny import build_tiny_model_dir

log = logging.getLogger(__name__)


def warm_start_key(cfg: Config) -> str:
    relevant = {
        # How the products are computed changes only their rounding, not what is trained; the
        # warm start trains and saves in fp32 whatever `model.dtype` the RL run loads it in.
        "model": {**cfg.model.model_dump(exclude={"onednn_linears"}), "dtype": "float32"},
        "warm_start": cfg.warm_start.model_dump(),
        "digits": cfg.data.digits,
        "seed": cfg.run.seed,
        "format": 4,
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:12]


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
    build_tiny_model_dir(
        tmp,
        hidden_size=cfg.model.hidden_size,
        num_layers=cfg.model.num_layers,
        num_heads=cfg.model.num_heads,
        seed=cfg.run.seed,
    )
    if cfg.warm_start.enabled and cfg.warm_start.steps > 0:
        run_sft(tmp, cfg, progress)
    tmp.rename(out)
    return out


def run_sft(model_dir: Path, cfg: Config, progress=None) -> None:
    """Train the model in `model_dir` on the noisy teacher and save it back in place."""
    import torch  # here: a run whose warm start is cached never needs it in the driver

    from streamrl.models.onednn import configure_linears
    from streamrl.trainer.logprobs import pack, response_logprobs

    ws = cfg.warm_start
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    configure_linears(model, cfg.model.onednn_linears)
    model.train()
    rng = random.Random(cfg.run.seed)
    problems = arith.sample_problems(
        20_000, digits=cfg.data.digits, seed=cfg.run.seed + 1, split="train"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / ws.steps))
    )
    advance = progress("warm start (SFT on a noisy teacher)", ws.steps) if progress else None
    for _ in range(ws.steps):
        batch = rng.sample(problems, ws.batch_size)
        prompts = [encode_prompt(tokenizer, p.prompt) for p in batch]
        targets = [
            encode_response(tokenizer, arith.teacher_solution(p, rng, ws.teacher_forget_carry))
            for p in batch
        ]
        packed = pack(prompts, targets, tokenizer.pad_token_id)
        logp = response_logprobs(model, packed)
        loss = -logp.sum() / packed.response_mask_br.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if advance:
            advance(1)
    model.save_pretrained(str(model_dir))

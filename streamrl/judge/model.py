"""The built-in judge: the tiny model fine-tuned to grade arithmetic responses, cached on disk.

A generative reward model reads the task's prompt, the policy's response and the reference
answer, and writes a verdict. For the CPU demo streamrl builds its own: the built-in tiny Qwen3
(`streamrl.models.tiny`) trained by the warm start's supervised loop
(`streamrl.trainer.sft.train_supervised`) to read `BUILTIN_TEMPLATE` as its user turn and
write `correct` or `incorrect` (`streamrl.judge.data`). After training it is graded on
held-out problems by greedy generation, and the result is saved beside the weights
(`judge_eval.json`). Like the warm start, the directory is built once per settings under the
cache directory (`judge-<key>`), also when several jobs ask for it at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamrl.judge.data import BUILTIN_TEMPLATE, VERDICTS, JudgeExample, judge_examples
from streamrl.judge.data import render as render_template

log = logging.getLogger(__name__)

EVAL_FILE = "judge_eval.json"
# Training threads: the tiny model's products are too small to gain from more, and a 2-core
# machine runs the build beside other work.
BUILD_THREADS = 2
# A verdict is one word and EOS; a few tokens more show what an undertrained judge writes.
MAX_VERDICT_TOKENS = 12
# Bumped when what a build produces changes for the same settings (data, training, evaluation).
_FORMAT = 1

Progress = Callable[[str, int], Callable[[int], None]]


@dataclass(frozen=True)
class JudgeBuild:
    """How the built-in judge is built; every field is part of its cache key."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    steps: int = 1500
    """Supervised steps, each on `batch_size` fresh examples of the train split."""
    batch_size: int = 64
    lr: float = 1.5e-3
    seed: int = 0
    init_scale: float = 4.0
    """Every weight matrix (embeddings included) starts this many times larger than Qwen3's
    default initialisation (std 0.02): see `widen_init`."""
    qk_norm_gain: float = 2.0
    """Starting gain of the attention's query and key norms (1 in Qwen3's initialisation)."""
    digits: int = 2
    """Operands of up to this many digits, as `data.digits` of the arithmetic task."""
    eval_examples: int = 400
    """Held-out examples (eval split) the verdict accuracy in `judge_eval.json` is measured on."""


def judge_key(build: JudgeBuild) -> str:
    """12 hex digits naming the judge `build` makes: a hash of its settings and the format."""
    relevant = {**asdict(build), "format": _FORMAT}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:12]


def cached_judge_dir(build: JudgeBuild, cache_dir: str | Path) -> Path | None:
    """The judge's directory if it is already built, else None."""
    out = Path(cache_dir) / f"judge-{judge_key(build)}"
    return out if (out / EVAL_FILE).is_file() else None


def ensure_judge_dir(
    build: JudgeBuild, cache_dir: str | Path, progress: Progress | None = None
) -> Path:
    """Return the HF directory of the judge `build` makes, building it the first time.

    `progress(description, total)`, when given, is called once before training and returns a
    function called with the number of steps done since its last call."""
    cached = cached_judge_dir(build, cache_dir)
    if cached is not None:
        return cached
    cache = Path(cache_dir)
    out = cache / f"judge-{judge_key(build)}"
    cache.mkdir(parents=True, exist_ok=True)
    # Jobs started together with the same settings build it once: the others wait here.
    with open(cache / f".lock-{out.name}", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another job is building the judge %s; waiting for it", out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        return cached_judge_dir(build, cache_dir) or _build_judge_dir(build, out, progress)


def read_judge_eval(model_dir: str | Path) -> dict[str, Any] | None:
    """The held-out evaluation saved with a built judge, or None for a directory without one
    (a judge that was not built here)."""
    path = Path(model_dir) / EVAL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _build_judge_dir(build: JudgeBuild, out: Path, progress: Progress | None) -> Path:
    import torch

    from streamrl.models.tiny import build_tiny_model_dir

    started = time.perf_counter()
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"  # `out` appears only when complete
    shutil.rmtree(tmp, ignore_errors=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, BUILD_THREADS))
    try:
        build_tiny_model_dir(
            tmp,
            hidden_size=build.hidden_size,
            num_layers=build.num_layers,
            num_heads=build.num_heads,
            seed=build.seed,
        )
        model, tokenizer = _train(tmp, build, progress)
        examples = judge_examples(
            build.eval_examples, digits=build.digits, seed=build.seed, split="eval"
        )
        scores = evaluate_judge(model, tokenizer, examples)
    finally:
        torch.set_num_threads(threads)
    scores.update(steps=build.steps, build_s=round(time.perf_counter() - started, 1))
    (tmp / EVAL_FILE).write_text(json.dumps(scores, indent=2) + "\n")
    tmp.rename(out)
    log.info(
        "built the judge %s in %.0f s: held-out verdict accuracy %.3f",
        out,
        scores["build_s"],
        scores["verdict_accuracy"],
    )
    return out


def _train(model_dir: Path, build: JudgeBuild, progress: Progress | None):
    """Train the judge in `model_dir` on the train split and save it in place; returns the
    trained model (in eval mode) and its tokenizer."""
    import torch

    from streamrl.models.loading import load_causal_lm, load_tokenizer
    from streamrl.models.onednn import configure_linears
    from streamrl.trainer.sft import train_supervised

    torch.manual_seed(build.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    widen_init(model, build.init_scale, build.qk_norm_gain)
    configure_linears(model, "auto")
    model.train()
    examples = judge_examples(
        build.steps * build.batch_size, digits=build.digits, seed=build.seed, split="train"
    )
    advance = progress("judge (SFT on verdicts)", build.steps) if progress else None
    train_supervised(
        model,
        _batches(examples, tokenizer, build.batch_size),
        steps=build.steps,
        lr=build.lr,
        pad_token_id=tokenizer.pad_token_id,
        advance=advance,
    )
    model.eval()
    model.save_pretrained(str(model_dir))
    return model, tokenizer


def widen_init(model, scale: float, qk_norm_gain: float) -> None:
    """Multiply `model`'s weight matrices by `scale` and its query/key norm gains by
    `qk_norm_gain`, in place.

    The verdict hinges on whether two numbers are equal digit by digit, a product of two
    inputs that no single input predicts; from Qwen3's small initial weights the tiny model
    learns it only after a long plateau (held-out verdict accuracy stuck near 0.84, the share
    the response's steps alone give away, for 1,000 steps at batch 64). Larger weights, and
    sharper attention from the start, end the plateau within a few hundred steps."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(scale)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(qk_norm_gain)


def _batches(
    examples: list[JudgeExample], tokenizer, batch_size: int
) -> Iterator[list[tuple[list[int], list[int], list[int]]]]:
    """(prompt ids, verdict ids closed by EOS, all-ones mask) of consecutive `batch_size`
    examples."""
    from streamrl.data.prompts import encode_response

    for start in range(0, len(examples), batch_size):
        batch = []
        for e in examples[start : start + batch_size]:
            target = encode_response(tokenizer, e.label)
            batch.append((_prompt_ids(tokenizer, e), target, [1] * len(target)))
        yield batch


def _prompt_ids(tokenizer, example: JudgeExample) -> list[int]:
    from streamrl.data.prompts import encode_prompt

    turn = render_template(
        BUILTIN_TEMPLATE,
        prompt=example.prompt,
        response=example.response,
        answer=example.answer,
    )
    return encode_prompt(tokenizer, turn)


def parse_verdict(text: str) -> str | None:
    """The verdict a judge wrote (`correct` or `incorrect`, the whole text but for surrounding
    whitespace), or None for anything else."""
    text = text.strip()
    return text if text in VERDICTS else None


def evaluate_judge(model, tokenizer, examples: list[JudgeExample]) -> dict[str, Any]:
    """Greedy verdicts of `model` on `examples` with the builtin engine: the fraction right
    overall and on the correct and the incorrect examples separately (an unparsable verdict is
    wrong)."""
    from streamrl.api.engine import GenerationRequest, SamplingParams
    from streamrl.rollout.builtin_engine import BuiltinEngine

    if not examples:
        raise ValueError("evaluate_judge needs at least one example, got none")
    engine = BuiltinEngine(
        model,
        tokenizer=tokenizer,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    requests = [
        GenerationRequest(str(i), _prompt_ids(tokenizer, e)) for i, e in enumerate(examples)
    ]
    results = engine.generate(
        requests, SamplingParams(max_new_tokens=MAX_VERDICT_TOKENS, temperature=0.0)
    )
    right = {label: [] for label in VERDICTS}
    for e, r in zip(examples, results, strict=True):
        text = tokenizer.decode(r.response_ids, skip_special_tokens=True)
        right[e.label].append(parse_verdict(text) == e.label)

    def fraction(hits: list[bool]) -> float | None:
        return round(sum(hits) / len(hits), 4) if hits else None

    return {
        "verdict_accuracy": fraction(right["correct"] + right["incorrect"]),
        "accuracy_on_correct": fraction(right["correct"]),
        "accuracy_on_incorrect": fraction(right["incorrect"]),
        "examples": len(examples),
    }

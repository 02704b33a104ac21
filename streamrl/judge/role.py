"""The judge role: claims generated responses, has the judge model write its verdicts, writes
them as the `judge` field, which the reward role adds into the sample's reward.

A stateless transform role like the reward role: a restarted judge takes up the rows its lost
lease held, so a crash loses and repeats no verdict. Its metrics (`judge/*`, logged with each
training step): samples judged a second of its work, seconds a batch, responses waiting for a
verdict, and the share of each verdict among the last batches.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from streamrl.api import fields as F
from streamrl.api.run import RunContext
from streamrl.bus.transform import TransformRole
from streamrl.config.schema import Config
from streamrl.models.loading import load_tokenizer, policy_tokenizer
from streamrl.reward.judge import Judge, JudgeItem

CONSUMER = "judge"
WINDOW = 8  # batches the rates and the verdict shares are taken over
MAX_REPORTED = 5  # distinct failure reasons logged; later ones are only counted

log = logging.getLogger(__name__)


def judge_dir(cfg: Config, progress=None, *, cached_only: bool = False) -> Path | None:
    """The judge's model directory: `reward.judge.model`, or the built-in judge (built on first
    use, cached under `run.cache_dir`; with `cached_only`, None when it is not built yet)."""
    judge = cfg.reward.judge
    if judge.model is not None:
        return Path(judge.model)
    from streamrl.judge.model import JudgeBuild, cached_judge_dir, ensure_judge_dir

    b = judge.build
    build = JudgeBuild(
        hidden_size=b.hidden_size,
        num_layers=b.num_layers,
        num_heads=b.num_heads,
        steps=b.steps,
        batch_size=b.batch_size,
        lr=b.lr,
        seed=cfg.run.seed,
        digits=cfg.data.digits,
        eval_examples=b.eval_examples,
    )
    if cached_only:
        return cached_judge_dir(build, Path(cfg.run.cache_dir))
    return ensure_judge_dir(build, Path(cfg.run.cache_dir), progress)


def make_judge_engine(ctx: RunContext, model_dir: Path, tokenizer, max_batch: int):
    """The judge's own engine (`reward.judge.engine`) over `model_dir`; weights never change."""
    cfg, judge = ctx.cfg, ctx.cfg.reward.judge
    if judge.engine == "vllm":
        from streamrl.rollout.vllm_engine import VllmEngine

        return VllmEngine(
            model_dir,
            eos_token_id=tokenizer.eos_token_id,
            config=judge.vllm,
            model_dtype=judge.dtype,
            max_num_seqs=max_batch,
            seed=cfg.run.seed,
        )
    if judge.engine == "sglang":
        from streamrl.rollout.sglang_engine import SglangEngine

        return SglangEngine(
            model_dir,
            eos_token_id=tokenizer.eos_token_id,
            config=judge.sglang,
            model_dtype=judge.dtype,
            max_running_requests=max_batch,
            default_weights_dir=Path(ctx.run_dir) / "sglang-judge",
        )
    from streamrl.models.loading import load_causal_lm, resolve_device
    from streamrl.models.onednn import resolve_onednn
    from streamrl.rollout.builtin_engine import BuiltinEngine

    device = resolve_device("reward.judge.device", judge.device)
    model = load_causal_lm(model_dir, dtype=judge.dtype).to(device)
    return BuiltinEngine(
        model,
        tokenizer=tokenizer,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_batch_size=max_batch,
        use_onednn=resolve_onednn(cfg.model.onednn_linears),
    )


def make_judge(ctx: RunContext) -> Judge:
    judge = ctx.cfg.reward.judge
    model_dir = judge_dir(ctx.cfg)
    tokenizer = load_tokenizer(model_dir)
    max_batch = judge.batch_size * (
        judge.verdict.opponents if judge.verdict.kind == "pairwise" else 1
    )
    engine = make_judge_engine(ctx, model_dir, tokenizer, max_batch)
    return Judge(engine, tokenizer, judge, seed=ctx.cfg.run.seed)


def judge_items(rows, policy_tokenizer) -> list[JudgeItem]:
    """The rows as the judge reads them: the prompt and the response as text (an agent
    episode's final answer, not its transcript), the reference answer."""
    episodes = [r.get(F.EPISODE) for r in rows]
    prompts = policy_tokenizer.batch_decode(
        [list(r[F.PROMPT_IDS]) for r in rows], skip_special_tokens=True
    )
    responses = policy_tokenizer.batch_decode(
        [list(r[F.RESPONSE_IDS]) for r in rows], skip_special_tokens=True
    )
    return [
        JudgeItem(
            r["sample_id"],
            prompt,
            episode["final_text"] if episode else response,
            "" if r.get(F.ANSWER) is None else str(r[F.ANSWER]),
            r.get("group_id", ""),
        )
        for r, prompt, response, episode in zip(rows, prompts, responses, episodes, strict=True)
    ]


def judge_fields(judge: Judge, rows, policy_tokenizer) -> dict[str, dict[str, Any]]:
    """{sample_id: {"judge": verdict}} for the rows."""
    verdicts = judge.judge(judge_items(rows, policy_tokenizer))
    return {
        row["sample_id"]: {F.JUDGE: v.as_field()} for row, v in zip(rows, verdicts, strict=True)
    }


class JudgeRole(TransformRole):
    consumer = CONSUMER
    consumes = (F.PROMPT_IDS, F.RESPONSE_IDS, F.ANSWER)

    def __init__(
        self, bus, judge: Judge, tokenizer, *, max_rows: int, lease_s: float, episodes: bool
    ):
        super().__init__(bus, max_rows=max_rows, lease_s=lease_s)
        if judge.pairwise:  # a sample is compared with others of its group: whole groups
            self.sampler = "group"
        if episodes:
            self.consumes = (*self.consumes, F.EPISODE)
        self.judge = judge
        self.tokenizer = tokenizer
        self._batches: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (samples, seconds)
        self._verdicts: deque[Counter[str]] = deque(maxlen=WINDOW)
        self._queue_depth = float("nan")
        self._reported: set[str] = set()
        self.judged = 0

    def compute(self, rows):
        started = time.perf_counter()
        fields = judge_fields(self.judge, rows, self.tokenizer)
        self._batches.append((len(rows), time.perf_counter() - started))
        verdicts = [values[F.JUDGE] for values in fields.values()]
        self._verdicts.append(Counter(v["verdict"] for v in verdicts))
        self.judged += len(rows)
        for v in verdicts:
            if v["status"] != "ok" and v["reason"] not in self._reported:
                self._report(v)
        self._queue_depth = float(self.bus.stats().get("ready", {}).get(self.consumer, 0))
        return fields

    def _report(self, verdict: dict[str, Any]) -> None:
        """Log the first few distinct reasons a verdict failed (each is also counted:
        `judge/verdict_invalid`, `samples/dropped_<status>`)."""
        if len(self._reported) >= MAX_REPORTED:
            return
        self._reported.add(verdict["reason"])
        log.warning(
            "judge: no verdict (%s): %s; the sample is dropped from training and counted "
            "(each distinct reason is logged once)",
            verdict["status"],
            verdict["reason"],
        )

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "judged": self.judged, "metrics": self.metrics()}

    def close(self) -> None:
        self.judge.close()

    def metrics(self) -> dict[str, float]:
        """The role's latest metrics (NaN before its first batch)."""
        samples = sum(n for n, _ in self._batches)
        seconds = sum(s for _, s in self._batches)
        counts = sum(self._verdicts, Counter())
        total = sum(counts.values())
        out = {
            "judge/samples_per_s": samples / seconds if seconds else float("nan"),
            "judge/batch_latency_s": seconds / len(self._batches)
            if self._batches
            else float("nan"),
            "judge/queue_depth": self._queue_depth,
        }
        if not self.judge.pairwise and self.judge.config.verdict.kind == "label":
            for label in self.judge.config.verdict.label_rewards:
                out[f"judge/verdict_{label}"] = counts[label] / total if total else float("nan")
        if total:
            out["judge/verdict_invalid"] = counts["invalid"] / total
        return out


def build(ctx: RunContext, bus, weights, *, start_step: int) -> JudgeRole:
    cfg = ctx.cfg
    return JudgeRole(
        bus,
        make_judge(ctx),
        policy_tokenizer(ctx),
        # pairwise verdicts claim whole groups
        max_rows=max(cfg.reward.judge.batch_size, cfg.rollout.group_size),
        lease_s=cfg.runtime.lease_s,
        episodes=cfg.agent.enabled,
    )

"""Held-out evaluation: the eval prompts decoded greedily (or sampled several times for pass@k),
scored by the run's reward function.

The reward is user code seeing model output, here as in training: it runs in the reward sandbox
(`streamrl.reward.sandbox`), so one that hangs or raises on some response costs that response
`reward.timeout_s` at most and counts it as not correct, reported, instead of stalling the
trainer that evaluates.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamrl.agents.episode import Task
from streamrl.agents.runner import agent_runner
from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams
from streamrl.api.reward import RewardResult
from streamrl.api.run import RunContext
from streamrl.data.dataset import PromptRow
from streamrl.data.prompts import encode_prompt
from streamrl.data.role import media_preparer
from streamrl.media.prepare import row_media
from streamrl.media.refs import MultimodalPrompt
from streamrl.models.loading import policy_tokenizer
from streamrl.reward.role import make_eval_scorer
from streamrl.reward.sandbox import ScoreTask
from streamrl.reward.service import score_tasks
from streamrl.rollout.engines import builtin_engine

log = logging.getLogger(__name__)

# Results that are not a score of the response (an invalid output is one: not correct).
UNSCORED = ("timeout", "infra_error", "turn_timeout", "rewritten")


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    """Fraction of the rows whose greedy answer is correct (`is_correct`; exact match for the
    built-in task)."""
    unscored: dict[str, int] = field(default_factory=dict)
    """Responses the reward could not score, by status (`timeout`, `infra_error`): counted as
    not correct."""
    first_reason: str = ""
    """Why the first of them was not scored."""
    misses: list[tuple[int, str, RewardResult]] = field(default_factory=list)
    """(row index, response, reward result) of every response not counted correct, in row
    order: what `streamrl eval --show N` prints."""

    def unscored_text(self) -> str:
        """`N not scored (timeout 2, infra_error 1; the first: REASON)`, or '' if none."""
        return _unscored_text(self.unscored, self.first_reason) if self.unscored else ""


def is_correct(score: RewardResult, correct_at: float = 1.0) -> bool:
    """Whether a scored response counts as correct: its reward is at least `correct_at`, or,
    when the reward reports an `acc` component (veRL's rewards do, beside a `score` that may add
    format bonuses or length penalties), that is 1. Not scored is not correct."""
    if score.status != "ok":
        return False
    if "acc" in score.components:
        return score.components["acc"] >= 1.0
    return score.value is not None and score.value >= correct_at


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `n` samples of which `c` are correct: the chance that `k`
    of them drawn without replacement hold at least one correct, 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021), computed as a product so that large `n` does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def report_ks(n: int) -> list[int]:
    """The k of pass@k worth printing for n samples: powers of two up to n, and n."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    return ks if ks[-1] == n else [*ks, n]


@dataclass(frozen=True)
class SampledResult:
    samples: int
    """Samples drawn per prompt."""
    temperature: float
    correct: list[int]
    """Correct samples of each prompt, in row order."""
    unscored: dict[str, int] = field(default_factory=dict)
    """Samples the reward could not score, by status: counted as not correct."""
    first_reason: str = ""

    def pass_at(self, k: int) -> float:
        """pass@k over the prompts (pass@1 is the mean accuracy of a sample)."""
        return sum(pass_at_k(self.samples, c, k) for c in self.correct) / max(len(self.correct), 1)

    def text(self) -> str:
        """`pass@1 0.8125, pass@2 0.9010, ... (8 samples a prompt at temperature 1.0)`."""
        figures = ", ".join(f"pass@{k} {self.pass_at(k):.4f}" for k in report_ks(self.samples))
        line = f"{figures} ({self.samples} samples a prompt at temperature {self.temperature:g})"
        if self.unscored:
            line += "; " + self.unscored_text()
        return line

    def unscored_text(self) -> str:
        """`N not scored (timeout 2, ...; the first: REASON)`, or '' if none."""
        return _unscored_text(self.unscored, self.first_reason) if self.unscored else ""


def _unscored_text(unscored: dict[str, int], first_reason: str) -> str:
    counts = ", ".join(f"{status} {n}" for status, n in sorted(unscored.items()))
    return f"{sum(unscored.values())} not scored ({counts}; the first: {first_reason})"


@dataclass
class HeldOut:
    """The held-out prompts (encoded), the engine that answers them and the scorer (a
    `SandboxedScorer`) that judges the answers."""

    engine: Any
    tokenizer: Any
    rows: Sequence[PromptRow]
    prompt_ids: Sequence[list[int]]
    scorer: Any
    max_new_tokens: int
    correct_at: float = 1.0
    """The reward at which an answer counts as correct (`is_correct`)."""
    agents: Any = None
    """An agent run's `AgentRunner` over `engine`: each prompt is an episode, and its final
    answer (or its status, when it could not finish) is what is scored."""
    media: Sequence[Any] | None = None
    """A vision-language policy's: each prompt's media as the engine takes them (None: text)."""

    def _requests(self, suffix: str = "") -> list[GenerationRequest]:
        media = self.media or [None] * len(self.prompt_ids)
        return [
            GenerationRequest(f"eval-{i}{suffix}", ids, m)
            for i, (ids, m) in enumerate(zip(self.prompt_ids, media, strict=True))
        ]

    def _generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Any]:
        if self.agents is None:
            return self.engine.generate(requests, params)
        tasks = [
            Task(r.request_id, r.prompt_ids, row.answer, row.extra)
            for r, row in zip(requests, self.rows, strict=True)
        ]
        return [episode_answer(done) for done in self.agents.run(tasks, params)]

    def greedy(self) -> EvalResult:
        """Greedy answers to every row, scored."""
        requests = self._requests()
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0)
        tasks, scores, hit = self._scored(self._generate(requests, params))
        failed = [s for s in scores if s.status in UNSCORED]
        return EvalResult(
            accuracy=sum(hit) / max(len(self.rows), 1),
            unscored=dict(Counter(s.status for s in failed)),
            first_reason=failed[0].reason if failed else "",
            misses=[
                (i, task.response, score)
                for i, (task, score, ok) in enumerate(zip(tasks, scores, hit, strict=True))
                if not ok
            ],
        )

    def sampled(
        self,
        samples: int,
        temperature: float,
        *,
        seed: int = 0,
        advance: Callable[[int], None] = lambda n: None,
    ) -> SampledResult:
        """`samples` answers to every row drawn at `temperature`, scored; one round (every
        prompt once) at a time, calling `advance(1)` after each."""
        if samples < 1 or temperature <= 0:
            raise ValueError(
                "sampled evaluation needs samples >= 1 and temperature > 0; got "
                f"samples={samples}, temperature={temperature}"
            )
        params = SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=temperature, seed=seed
        )
        correct = [0] * len(self.rows)
        failed: list[RewardResult] = []
        for k in range(samples):
            # The request id seeds a request's sampling noise: a different one for every sample.
            requests = self._requests(f"-{k}")
            _, scores, hit = self._scored(self._generate(requests, params))
            correct = [c + h for c, h in zip(correct, hit, strict=True)]
            failed += [s for s in scores if s.status in UNSCORED]
            advance(1)
        return SampledResult(
            samples=samples,
            temperature=temperature,
            correct=correct,
            unscored=dict(Counter(s.status for s in failed)),
            first_reason=failed[0].reason if failed else "",
        )

    def _scored(self, results) -> tuple[list[ScoreTask], list[RewardResult], list[bool]]:
        """(tasks, scores, hit) of one response per row; hit: correct (`is_correct`)."""
        episodes = [res.extra.get("episode") for res in results]
        tasks = [
            ScoreTask(
                episode["final_text"]  # an agent episode's final answer, not its transcript
                if episode
                else self.tokenizer.decode(res.response_ids, skip_special_tokens=True),
                row.answer,
                row.extra,
            )
            for row, res, episode in zip(self.rows, results, episodes, strict=True)
        ]
        scores = score_tasks(self.scorer, tasks, episodes)
        hit = [is_correct(s, self.correct_at) for s in scores]
        return tasks, scores, hit


def episode_answer(done) -> GenerationResult:
    """An evaluated episode as a result: its outcome (final answer, status) in `extra`."""
    seg = done.client.ledger.current
    return GenerationResult(
        done.task.sample_id,
        seg.ids,
        seg.logprobs,
        seg.versions,
        done.client.finish_reason,
        extra={"episode": done.outcome()},
    )


def held_out_media(ctx: RunContext) -> tuple[list[PromptRow], list[Any] | None]:
    """The held-out rows and, for a vision-language policy, each one's prepared media (with
    `ids`, its prompt's token ids); rows whose media cannot be used are left out, with a
    warning naming each."""
    preparer = media_preparer(ctx)
    if preparer is None:
        return list(ctx.eval_rows), None
    rows, media = [], []
    for i, row in enumerate(ctx.eval_rows):
        if not row.media:
            rows.append(row)
            media.append(None)
            continue
        prompt = MultimodalPrompt(row.prompt, row.media)
        prepared = preparer.prepare(prompt, f"held-out prompt {i} ({row.origin})")
        if prepared is not None:
            (entry,) = row_media([{F.MEDIA: preparer.bus_value(prepared)}])
            rows.append(row)
            media.append({**entry, "ids": prepared.prompt_ids})
    if not rows:
        raise ValueError("no held-out prompt has usable media")
    return rows, media


class Evaluator:
    """Held-out accuracy of a model (greedy, or pass@k of sampled answers), with its own engine
    over the same model object."""

    def __init__(self, ctx: RunContext, model):
        tokenizer = policy_tokenizer(ctx)
        chat = ctx.cfg.data.chat_template
        engine = builtin_engine(ctx, model)
        rows, media = held_out_media(ctx)
        self.held_out = HeldOut(
            engine=engine,
            tokenizer=tokenizer,
            rows=rows,
            prompt_ids=[
                list(m["ids"]) if m else encode_prompt(tokenizer, r.prompt, chat_template=chat)
                for r, m in zip(rows, media or [None] * len(rows), strict=True)
            ],
            media=media,
            scorer=make_eval_scorer(ctx),  # its worker process starts at the first evaluation
            max_new_tokens=ctx.cfg.rollout.max_new_tokens,
            correct_at=ctx.cfg.trainer.eval_correct_at,
            agents=agent_runner(ctx.cfg, engine, tokenizer),
        )
        self.seed = ctx.cfg.run.seed

    def evaluate(self) -> EvalResult:
        self.held_out.engine.model.eval()
        result = self.held_out.greedy()
        self._warn_unscored(len(self.held_out.rows), result.unscored_text())
        return result

    @staticmethod
    def _warn_unscored(num: int, unscored_text: str) -> None:
        if unscored_text:
            log.warning(
                "held-out evaluation of %d responses: %s; counted as not correct",
                num,
                unscored_text,
            )

    def sample(self, samples: int, temperature: float, advance=lambda n: None) -> SampledResult:
        """pass@k of the held-out prompts from `samples` answers each at `temperature`."""
        self.held_out.engine.model.eval()
        result = self.held_out.sampled(samples, temperature, seed=self.seed, advance=advance)
        self._warn_unscored(samples * len(self.held_out.rows), result.unscored_text())
        return result

    def accuracy(self) -> float:
        return self.evaluate().accuracy

    def close(self) -> None:
        """Stop the reward sandbox's worker (it also ends with this process)."""
        self.held_out.scorer.close()

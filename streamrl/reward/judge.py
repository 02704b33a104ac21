"""A generative reward model (an LLM judge): it reads a response and writes a verdict.

The judge is a model behind an engine of its own (builtin, vLLM or SGLang; the rollout engine
protocol, `api/engine.py`), its weights frozen. For every response it is shown `template` with
the task's prompt, the response and the reference answer filled in (and, for pairwise verdicts,
another response of the same group), and its reply is read by `reward/verdict.py`. All the
responses handed to `judge` go to the engine in one call, so the engine batches them.

What can go wrong, and what the sample gets (never a silent 0):
- the reply holds no verdict: `invalid_output` with the reply quoted (dropped and counted: the
  judge's failure, not the response's, so `reward.invalid_output_penalty` does not apply);
- the rendered prompt is longer than `max_prompt_tokens`: `infra_error`;
- a pairwise comparison with no other response in the group: `infra_error`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.api.reward import RewardResult
from streamrl.config.reward_schema import JudgeConfig
from streamrl.data.prompts import encode_prompt
from streamrl.reward.verdict import parse, render


@dataclass(frozen=True)
class JudgeItem:
    """One response to judge, as text."""

    sample_id: str
    prompt: str
    response: str
    answer: str
    group_id: str = ""


@dataclass(frozen=True)
class Verdict:
    result: RewardResult
    verdict: str
    """The label or score read from the reply(ies), "invalid" when there was none."""
    reply: str
    """The judge's reply (its first, for pairwise verdicts)."""

    def as_field(self) -> dict[str, Any]:
        """The `judge` field's value on the bus."""
        r = self.result
        return {
            "value": r.value,
            "status": r.status,
            "reason": r.reason,
            "verdict": self.verdict,
            "reply": self.reply,
        }


def verdict_of(field: dict[str, Any]) -> RewardResult:
    """The `judge` field back as a reward result."""
    return RewardResult(field["value"], field["status"], field.get("reason") or "")


class Judge:
    """Verdicts of one judge model (`config`: `reward.judge`) behind `engine`."""

    def __init__(self, engine, tokenizer, config: JudgeConfig, *, seed: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.params = SamplingParams(
            max_new_tokens=config.max_new_tokens, temperature=config.temperature, seed=seed
        )
        self.pairwise = config.verdict.kind == "pairwise"

    def prompt_ids(self, item: JudgeItem, other: str = "") -> list[int]:
        """The token ids the judge reads for `item` (and `other`, pairwise)."""
        text = render(
            self.config.template,
            prompt=item.prompt,
            response=item.response,
            answer=item.answer,
            other=other,
        )
        system = self.config.system_prompt
        if not self.config.chat_template:
            return encode_prompt(
                self.tokenizer, f"{system}\n{text}" if system else text, chat_template=False
            )
        turns = [{"role": "system", "content": system}] if system else []
        return encode_prompt(self.tokenizer, [*turns, {"role": "user", "content": text}])

    def judge(self, items: Sequence[JudgeItem]) -> list[Verdict]:
        """One verdict for each item, in order, from one engine call."""
        asks = self._asks(items)  # (item index, request) for each question put to the judge
        limit = self.config.max_prompt_tokens
        runnable = [(i, req) for i, req in asks if len(req.prompt_ids) <= limit]
        results = (
            self.engine.generate([req for _, req in runnable], self.params) if runnable else []
        )
        replies: dict[int, list[str]] = {i: [] for i in range(len(items))}
        for (i, _), res in zip(runnable, results, strict=True):
            replies[i].append(self.tokenizer.decode(res.response_ids, skip_special_tokens=True))
        too_long = {i: len(req.prompt_ids) for i, req in asks if len(req.prompt_ids) > limit}
        out = []
        for i in range(len(items)):
            if i in too_long:
                reason = (
                    f"judge prompt of {too_long[i]} tokens is longer than "
                    f"reward.judge.max_prompt_tokens={limit}"
                )
                out.append(Verdict(RewardResult(None, "infra_error", reason), "invalid", ""))
            elif not replies[i]:
                reason = "pairwise verdict: no other response of its group to compare with"
                out.append(Verdict(RewardResult(None, "infra_error", reason), "invalid", ""))
            else:
                out.append(self._verdict(replies[i]))
        return out

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def _asks(self, items: Sequence[JudgeItem]) -> list[tuple[int, GenerationRequest]]:
        if not self.pairwise:
            return [
                (i, GenerationRequest(f"judge-{item.sample_id}", self.prompt_ids(item)))
                for i, item in enumerate(items)
            ]
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(item.group_id, []).append(i)
        asks = []
        for members in groups.values():
            opponents = min(self.config.verdict.opponents, len(members) - 1)
            for k, i in enumerate(members):
                for step in range(1, opponents + 1):
                    other = items[members[(k + step) % len(members)]].response
                    ids = self.prompt_ids(items[i], other)
                    asks.append((i, GenerationRequest(f"judge-{items[i].sample_id}-{step}", ids)))
        return asks

    def _verdict(self, replies: list[str]) -> Verdict:
        """One item's verdict from its replies (several for pairwise: the mean of their
        rewards; any unreadable one makes the item's)."""
        parsed = [parse(reply, self.config.verdict) for reply in replies]
        for (result, _), reply in zip(parsed, replies, strict=True):
            if result.status != "ok":
                return Verdict(result, "invalid", reply)
        if len(parsed) == 1:
            (result, verdict), reply = parsed[0], replies[0]
            return Verdict(result, verdict, reply)
        value = sum(float(r.value) for r, _ in parsed) / len(parsed)
        wins = ",".join(v for _, v in parsed)
        return Verdict(RewardResult.ok(value), wins, replies[0])

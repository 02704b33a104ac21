"""The model-based and remote parts of the `reward` section: a judge (a generative reward model
served by an engine of its own, `reward.judge`) and a reward service reached over HTTP
(`reward.remote`). Part of `streamrl.config.schema`, which re-exports every name here. Imports
no torch.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from streamrl.config.engine_schema import SglangConfig, VllmConfig
from streamrl.config.section import Section

BUILTIN_JUDGE_TEMPLATE = "{prompt}{response}|{answer}"
"""What the built-in judge reads: the problem, the policy's worked answer and the reference."""
LABEL_VERDICTS = {"correct": 1.0, "incorrect": 0.0}
PAIRWISE_VERDICTS = {"A": 1.0, "B": 0.0}
PLACEHOLDERS = ("{prompt}", "{response}", "{answer}", "{other}")


class VerdictConfig(Section):
    """How a judge's reply becomes a reward (`streamrl.reward.verdict`)."""

    kind: Literal["label", "score", "pairwise"] = "label"
    """label: the reply is one of `labels` (case-insensitive), mapped to its reward. score: the
    reply holds a number in `score_range`. pairwise: the judge is shown the sample (A) and
    another response of its group (B) and names the better one with a label of `labels`
    ({"A": 1.0, "B": 0.0} unless set); the sample's reward is its mean over `opponents`
    comparisons. A reply that cannot be read is `invalid_output`, never a 0."""
    labels: dict[str, float] | None = None
    """Label -> reward; None: {"correct": 1.0, "incorrect": 0.0} (label), {"A": 1.0, "B": 0.0}
    (pairwise)."""
    pattern: str | None = None
    """A regular expression whose first group is the verdict (e.g. `Verdict: (\\w+)`); None: the
    whole reply (label, pairwise), or its last number (score)."""
    score_range: tuple[float, float] = (0.0, 10.0)
    """score: the lowest and highest score the judge is told to give; a score outside is
    `invalid_output`."""
    normalize: bool = True
    """score: map `score_range` onto [0, 1] (else the score itself is the reward)."""
    opponents: int = Field(1, ge=1)
    """pairwise: the responses of its group each sample is compared with (the next ones in the
    group, at most group size - 1)."""

    @model_validator(mode="after")
    def _check(self) -> VerdictConfig:
        lo, hi = self.score_range
        if not lo < hi:
            raise ValueError(f"score_range: {self.score_range}; the first must be below the second")
        if self.pattern is not None:
            try:
                compiled = re.compile(self.pattern)
            except re.error as e:
                raise ValueError(
                    f"pattern {self.pattern!r} is not a regular expression: {e}"
                ) from None
            if compiled.groups < 1:
                raise ValueError(
                    f"pattern {self.pattern!r}: needs a group, (...), around the verdict"
                )
        if self.labels is not None and not self.labels:
            raise ValueError("labels: give at least one label")
        return self

    @property
    def label_rewards(self) -> dict[str, float]:
        """`labels`, or the kind's default."""
        if self.labels is not None:
            return dict(self.labels)
        return dict(PAIRWISE_VERDICTS if self.kind == "pairwise" else LABEL_VERDICTS)


class JudgeBuildConfig(Section):
    """The built-in judge (`reward.judge.model` unset): the built-in architecture fine-tuned on
    generated right and wrong worked answers of the built-in task, built once and cached."""

    steps: int = Field(1500, ge=1)
    """Supervised steps of the build."""
    batch_size: int = Field(64, ge=1)
    """Examples a step."""
    lr: float = Field(1.5e-3, gt=0)
    """Learning rate (AdamW, cosine decay)."""
    hidden_size: int = Field(128, ge=16)
    """Hidden width of the judge."""
    num_layers: int = Field(4, ge=1)
    """Transformer layers of the judge."""
    num_heads: int = Field(4, ge=1)
    """Attention heads of the judge."""
    eval_examples: int = Field(400, ge=1)
    """Held-out examples its verdict accuracy is measured on (`summary.json`: judge_accuracy)."""


class JudgeConfig(Section):
    """A generative reward model (an LLM judge) as a role of its own: it reads the prompt, the
    response and the reference answer through `template` and writes a verdict (docs/rewards.md)."""

    enabled: bool = False
    """Score every response with the judge too; its reward enters the sum with `weight`."""
    model: str | None = None
    """Local Hugging Face directory of the judge; None builds the built-in judge (built-in
    arithmetic task only, cached like the warm start)."""
    engine: Literal["builtin", "vllm", "sglang"] = "builtin"
    """The judge's engine (the same engines as rollout, its own instance; weights frozen)."""
    weight: float = 1.0
    """Weight of the judge's reward in the sum with the other rewards."""
    template: str = BUILTIN_JUDGE_TEMPLATE
    """The user turn the judge reads: `{prompt}`, `{response}` and `{answer}` (the reference
    answer, "" when the data has none) are filled in, and `{other}` (another response of the
    group) for pairwise verdicts."""
    system_prompt: str | None = None
    """A system turn before it (None: none)."""
    chat_template: bool = True
    """Send the turns through the judge's chat template (False: `template` as plain text)."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest verdict."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the judge (0: greedy, the same verdict for the same input)."""
    batch_size: int = Field(64, ge=1)
    """Responses the judge claims and scores in one engine call."""
    max_prompt_tokens: int = Field(4096, ge=1)
    """A rendered judge prompt longer than this is not judged (`infra_error`, counted)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the builtin engine runs the judge."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The judge's dtype (builtin engine; vLLM and SGLang: their own `dtype`, auto follows this)."""
    verdict: VerdictConfig = VerdictConfig()
    """How the reply becomes a reward."""
    build: JudgeBuildConfig = JudgeBuildConfig()
    """The built-in judge's build (when `model` is unset)."""
    vllm: VllmConfig = VllmConfig()
    """`engine=vllm`: the judge's vLLM settings."""
    sglang: SglangConfig = SglangConfig()
    """`engine=sglang`: the judge's SGLang server."""

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if "{response}" not in self.template:
            raise ValueError(
                f"template {self.template!r} never shows the response: put {{response}} in it"
            )
        if self.verdict.kind == "pairwise" and "{other}" not in self.template:
            raise ValueError(
                "verdict.kind=pairwise compares two responses: the template needs {other} (the "
                "response B it is compared with) beside {response} (A)"
            )
        return self


class RemoteRewardConfig(Section):
    """A reward service someone else runs, reached over HTTP (`streamrl.reward.remote` has the
    JSON it receives and must answer)."""

    url: str | None = None
    """The service's endpoint (http:// or https://); None: no remote reward."""
    token_env: str = "STREAMRL_REWARD_TOKEN"
    """Environment variable holding the token sent as `Authorization: Bearer <token>` (unset:
    no header); the token itself is never written in a config."""
    weight: float = 1.0
    """Weight of its reward in the sum with the other rewards."""
    timeout_s: float = Field(10.0, gt=0)
    """Longest wait for one HTTP request."""
    max_retries: int = Field(3, ge=0)
    """Retries of a request that failed for the infrastructure (connection, timeout, 5xx, 408,
    429), with exponential backoff; other 4xx are never retried."""
    backoff_s: float = Field(0.5, gt=0)
    """First retry's wait; doubled each retry, up to `max_backoff_s`."""
    max_backoff_s: float = Field(8.0, gt=0)
    """Longest wait between retries."""
    concurrency: int = Field(4, ge=1)
    """Most requests in flight at once."""
    batch_size: int = Field(32, ge=1)
    """Samples a request."""

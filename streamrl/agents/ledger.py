"""The token ledger of a multi-turn sample: what the model sampled, verbatim, and what it was shown.

A sample of an agent episode is one prompt followed by spans:

    prompt ids | sampled turn 1 | tool / environment text | sampled turn 2 | ...
                 mask 1           mask 0                    mask 1

The model's tokens are appended exactly as the engine returned them, with their log-probs and
the policy version of each token (an in-flight weight update can land inside a turn, or between
turns). Everything else (tool results, environment observations, the tokens the chat template
puts around them and the opening of the next assistant turn) is appended as *context*: tokens
the model did not sample, mask 0, log-prob 0, and the version of the last sampled token before
them (so the oldest version of a sample is that of its oldest sampled token). Nothing already in
the ledger is ever tokenised again from text: that is what keeps the trained tokens bit-identical
to the sampled ones, the usual source of train/rollout mismatch in agent RL.

With routing replay (mixture-of-experts models), a segment also keeps the experts the engine
routed each of its positions to, every position's from the latest turn that ran it.

A conversation that stops being an append-only extension of the ledger (a client that rewrites
or drops earlier turns) cannot continue it: `restart` closes the current segment and opens a new
one on the new prompt. Each segment is its own training sample; the count of such splits is
reported, never hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from streamrl.api import fields as F
from streamrl.models.moe import merge_routes


@dataclass
class Segment:
    """One training sample: a prompt and the spans after it."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: np.ndarray | None = None
    """Mixture-of-experts routing replay: the experts of each position from the prompt's first
    on, as the engine ran them (`streamrl.models.moe`); None when not captured."""

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)


@dataclass
class TokenLedger:
    """The growing token record of one episode (see the module docstring)."""

    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.segments:
            self.segments.append(Segment(list(self.prompt_ids)))

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    @property
    def num_splits(self) -> int:
        """How many times the conversation broke off from the ledger (segments - 1)."""
        return len(self.segments) - 1

    def all_ids(self) -> list[int]:
        """The current segment's tokens: what the next generation request continues."""
        return self.current.prompt_ids + self.current.ids

    def add_sampled(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        routes: np.ndarray | None = None,
    ) -> None:
        """Append tokens the engine sampled, with their log-probs and policy versions (mask 1),
        and the experts the engine routed the turn's positions to (`routes`, from the
        segment's first position on; they replace an earlier turn's for the positions both
        ran, `streamrl.models.moe.merge_routes`)."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"sampled tokens, log-probs and versions differ in length: {len(ids)}, "
                f"{len(logprobs)}, {len(versions)}"
            )
        seg = self.current
        if routes is not None:  # positions fed to the model: all but the new last token's
            ran = len(seg.prompt_ids) + len(seg.ids) + len(ids) - 1
            seg.routes = merge_routes(seg.routes, np.asarray(routes)[:ran])
        seg.ids += [int(t) for t in ids]
        seg.mask += [1] * len(ids)
        seg.logprobs += [float(x) for x in logprobs]
        seg.versions += [int(v) for v in versions]

    def add_context(self, ids: Sequence[int], version: int | None = None) -> None:
        """Append tokens the model did not sample (tool output, template tokens): mask 0. They
        carry the version of the last sampled token (`version` when nothing was sampled yet)."""
        seg = self.current
        last = seg.versions[-1] if seg.versions else (0 if version is None else version)
        seg.ids += [int(t) for t in ids]
        seg.mask += [0] * len(ids)
        seg.logprobs += [0.0] * len(ids)
        seg.versions += [last] * len(ids)

    def restart(self, prompt_ids: Sequence[int]) -> None:
        """Close the current segment and start a new training sample on `prompt_ids`."""
        self.segments.append(Segment([int(t) for t in prompt_ids]))

    def extends(self, ids: Sequence[int]) -> bool:
        """Whether `ids` starts with the current segment's tokens (an append-only extension)."""
        have = self.all_ids()
        return len(ids) >= len(have) and list(ids[: len(have)]) == have

    @property
    def num_response_tokens(self) -> int:
        """Tokens after the prompt in the current segment (sampled and context)."""
        return len(self.current.ids)

    def sample(self, prompt_ids: Sequence[int]) -> Segment | None:
        """The current segment as the training sample of a row whose prompt is `prompt_ids`.
        After a restart the segment's own prompt may extend the row's (a client that added a
        system message after it, say): the extra tokens become context ahead of its spans, so
        the trained sequence is exactly the one the model was shown. None: the segment does not
        start with the row's prompt and cannot be trained as that row."""
        seg = self.current
        prompt = [int(t) for t in prompt_ids]
        if seg.prompt_ids == prompt:
            return seg
        if seg.prompt_ids[: len(prompt)] != prompt:
            return None
        lead = seg.prompt_ids[len(prompt) :]
        version = min(seg.versions) if seg.versions else 0
        return Segment(
            prompt,
            lead + seg.ids,
            [0] * len(lead) + seg.mask,
            [0.0] * len(lead) + seg.logprobs,
            [version] * len(lead) + seg.versions,
            seg.routes,  # positions count from the first prompt token either way
        )

    def oldest_version(self) -> int | None:
        """The oldest policy version of a sampled token in the current segment (None: none yet)."""
        seg = self.current
        sampled = [v for v, m in zip(seg.versions, seg.mask, strict=True) if m]
        return min(sampled) if sampled else None


def segment_fields(seg: Segment) -> dict[str, np.ndarray]:
    """A segment as the rollout's bus fields (response_ids .. versions, and the loss mask)."""
    fields = {
        F.RESPONSE_IDS: np.asarray(seg.ids, dtype=np.int64),
        F.ROLLOUT_LOGPROBS: np.asarray(seg.logprobs, dtype=np.float32),
        F.VERSIONS: np.asarray(seg.versions, dtype=np.int64),
        F.LOSS_MASK: np.asarray(seg.mask, dtype=np.int8),
    }
    if seg.routes is not None:
        fields[F.ROUTED_EXPERTS] = seg.routes
    return fields

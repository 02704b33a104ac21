"""Sampling controls every engine shares: the truncated distribution and where a response stops.

Truncation (`SamplingParams.min_p`, `top_k`, `top_p`) follows vLLM's order, which the builtin
engine copies so that both sample from the same distribution: on the temperature-scaled logits,
min-p drops the tokens less likely than `min_p` times the most likely one; top-k keeps the k
largest logits (ties with the k-th all stay); top-p then keeps, of what is left and renormalised,
the most likely tokens whose mass reaches p (always at least one). A token's behaviour log-prob is
its log-prob under that truncated, renormalised distribution: the distribution it was drawn from.

Stops: a response ends at the first token whose id is EOS or in `stop_token_ids`, or whose text
completes a stop string: the decoded text of the response so far (special tokens skipped, as
the reward decodes it) contains the string, and did not one token earlier. That token is the
response's last. `StopStrings` checks the tail of a response, which is enough when called after
every token (the builtin engine), and scans a whole response (`first_stop`) where an engine's own
check may have missed a string, such as one split across the two attempts of a request resumed
after an in-flight weight update (vLLM and SGLang match stop strings within one request only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamrl.api.engine import SamplingParams

# Tokens decoded beyond the longest stop string's characters: a token that decodes to no text
# (a special token, or a byte that opens a multi-byte character) does not hide a match.
_WINDOW_SLACK = 8


def truncate_logits(logits_bv: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logits_bv` (temperature-scaled) with -inf at every token the truncation controls drop;
    log_softmax of the result is the distribution sampled from. A new tensor when anything is
    dropped, else `logits_bv` itself."""
    if params.min_p > 0:
        probs_bv = torch.softmax(logits_bv, dim=-1)
        floor_b1 = params.min_p * probs_bv.max(dim=-1, keepdim=True).values
        logits_bv = logits_bv.masked_fill(probs_bv < floor_b1, float("-inf"))
    if 0 < params.top_k < logits_bv.shape[-1]:
        kth_b1 = logits_bv.topk(params.top_k, dim=-1).values[:, -1:]
        logits_bv = logits_bv.masked_fill(logits_bv < kth_b1, float("-inf"))
    if params.top_p < 1.0:
        sorted_bv, order_bv = logits_bv.sort(dim=-1)  # ascending
        # A token goes when the mass of it and every less likely token is at most 1 - p, i.e.
        # when the more likely tokens alone reach p; the most likely token always stays.
        below_bv = torch.softmax(sorted_bv, dim=-1).cumsum(dim=-1) <= 1.0 - params.top_p
        below_bv[:, -1] = False
        sorted_bv = sorted_bv.masked_fill(below_bv, float("-inf"))
        logits_bv = torch.empty_like(logits_bv).scatter_(-1, order_bv, sorted_bv)
    return logits_bv


def stop_token_set(params: SamplingParams, eos_token_id: int | None) -> set[int]:
    """Every token id that ends a response."""
    ids = set(params.stop_token_ids)
    if eos_token_id is not None:
        ids.add(eos_token_id)
    return ids


class StopStrings:
    """Where a response's text completes one of `stops`, decoded with `tokenizer`."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        if not stops:
            raise ValueError("StopStrings needs at least one stop string")
        if tokenizer is None:
            raise ValueError(
                f"stop strings {list(stops)!r} need the model's tokenizer to decode responses, "
                "and this engine was given none"
            )
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.window = max(len(s) for s in stops) + _WINDOW_SLACK

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def ends_here(self, ids: Sequence[int]) -> bool:
        """Whether the text of the last tokens of `ids` holds a stop string. Called after every
        token, a match can only end in the newest one: an earlier call would have stopped."""
        text = self._text(ids[-self.window :])
        return any(s in text for s in self.stops)

    def first_stop(self, ids: Sequence[int]) -> int | None:
        """The length of the shortest prefix of `ids` whose text holds a stop string (the
        response cut there ends with the token that completes it); None if there is none."""
        text = self._text(ids)
        if not any(s in text for s in self.stops):
            return None
        for n in range(1, len(ids) + 1):
            if self.ends_here(ids[:n]):
                return n
        return len(ids)  # the whole text matches but no window does (decoding across tokens)


def cut_at_stop(
    ids: list[int], params: SamplingParams, eos_token_id: int | None, stops: StopStrings | None
) -> int | None:
    """The length `ids` keeps when a stop (EOS, a stop token id, a stop string) falls inside it,
    else None: where an engine that resumes requests must end a response its own checks ran on
    in pieces."""
    stop_ids = stop_token_set(params, eos_token_id)
    cut = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), None)
    if stops is not None:
        by_text = stops.first_stop(ids if cut is None else ids[:cut])
        if by_text is not None:
            cut = by_text
    return cut

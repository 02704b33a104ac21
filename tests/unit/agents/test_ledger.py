"""The token ledger: sampled tokens verbatim with mask 1, context tokens with mask 0."""

from __future__ import annotations

import pytest

from streamrl.agents.ledger import TokenLedger, segment_fields
from streamrl.api import fields as F


def test_sampled_and_context_spans_keep_their_tokens_mask_and_versions() -> None:
    ledger = TokenLedger([1, 2, 3])
    ledger.add_sampled([7, 8], [-0.5, -0.25], [4, 5])
    ledger.add_context([9, 9, 9])
    ledger.add_sampled([6], [-1.0], [6])
    seg = ledger.current
    assert ledger.all_ids() == [1, 2, 3, 7, 8, 9, 9, 9, 6]
    assert seg.mask == [1, 1, 0, 0, 0, 1]
    assert seg.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    # Context tokens carry the last sampled version: the oldest version is a sampled token's.
    assert seg.versions == [4, 5, 5, 5, 5, 6]
    assert ledger.oldest_version() == 4
    fields = segment_fields(seg)
    assert fields[F.LOSS_MASK].tolist() == seg.mask
    assert fields[F.RESPONSE_IDS].tolist() == seg.ids


def test_a_history_that_is_no_extension_starts_a_new_sample() -> None:
    ledger = TokenLedger([1, 2])
    ledger.add_sampled([3], [-0.1], [0])
    assert ledger.extends([1, 2, 3, 4]) and not ledger.extends([1, 5, 3])
    ledger.restart([1, 5, 3])
    assert ledger.num_splits == 1
    assert ledger.all_ids() == [1, 5, 3] and ledger.oldest_version() is None
    assert ledger.segments[0].ids == [3]  # the first sample is kept as it was


def test_sampled_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        TokenLedger([1]).add_sampled([1, 2], [-0.1], [0, 0])


def test_sample_on_the_row_prompt_after_a_restart():
    ledger = TokenLedger([1, 2])
    ledger.add_sampled([5], [-0.5], [3])
    ledger.restart([1, 2, 9, 9])  # a client that added two tokens after the row's prompt
    ledger.add_sampled([6, 7], [-0.1, -0.2], [4, 4])
    sample = ledger.sample([1, 2])
    assert sample.prompt_ids + sample.ids == [1, 2, 9, 9, 6, 7]
    assert sample.mask == [0, 0, 1, 1]
    assert sample.logprobs == [0.0, 0.0, -0.1, -0.2]
    assert sample.versions == [4, 4, 4, 4]
    assert ledger.sample([1, 3]) is None  # the row's prompt is not where the segment starts
    ledger.restart([1, 2])
    assert ledger.sample([1, 2]) is ledger.current

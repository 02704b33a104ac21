"""Samplers: pure functions that pick which ready rows a claim hands out.

A claim first finds the candidate rows (all requested fields written, not acked and not leased
by the consumer, matching ``where``) and passes them, in creation order, to the sampler chosen
by name from ``SAMPLERS``. The sampler returns the sample ids to lease.

Samplers never see field payloads, which may be large tensors or, in the Ray bus, object
references. They see a ``RowView``: the row's meta plus a small ``summary`` of the fields that
samplers rank by, computed once when the field is written (``summarize``): the smallest policy
version in ``versions`` and the lengths of ``prompt_ids`` and ``response_ids``.

Signature: ``sampler(rows, max_rows, **options) -> list[str]`` where ``rows`` is an iterable of
``RowView`` in creation order. Samplers that can stop early (``fifo``, ``token_budget``) read
only as many candidates as they need.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RowView:
    """What a sampler knows about one candidate row.

    ``group_pending`` is how many rows of this row's group the consumer still has to consume
    (live rows it has not acked, plus rows of the group not yet added): a group is whole for
    the consumer when that many of its rows are candidates.
    """

    sample_id: str
    group_id: str
    group_size: int
    batch_index: int
    seq: int
    group_pending: int
    summary: Mapping[str, Any]


Sampler = Callable[..., list[str]]


def _min_version(versions: Any) -> int | None:
    # Works for lists, numpy arrays and torch tensors without importing either library.
    if len(versions) == 0:
        return None
    if hasattr(versions, "min"):
        return int(versions.min())
    return int(min(versions))


#: Field name -> function computing the small value samplers rank by.
SUMMARIES: dict[str, Callable[[Any], Any]] = {
    "versions": _min_version,
    "prompt_ids": len,
    "response_ids": len,
}


def summarize(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Summaries of the sampler-relevant fields among ``fields`` (others are skipped)."""
    return {name: SUMMARIES[name](value) for name, value in fields.items() if name in SUMMARIES}


def min_version(row: RowView) -> float:
    """Oldest policy version among the row's tokens; +inf when it has no ``versions``."""
    version = row.summary.get("versions")
    return math.inf if version is None else version


def num_tokens(row: RowView) -> int:
    """len(prompt_ids) + len(response_ids), counting whichever are present."""
    return row.summary.get("prompt_ids", 0) + row.summary.get("response_ids", 0)


def _whole_groups(rows: Iterable[RowView]) -> list[list[RowView]]:
    """Candidate groups that are whole for the consumer, in creation order."""
    groups: dict[str, list[RowView]] = {}
    for row in rows:
        groups.setdefault(row.group_id, []).append(row)
    return [members for members in groups.values() if len(members) >= members[0].group_pending]


def _take_groups(groups: list[list[RowView]], max_rows: int, max_tokens: float) -> list[str]:
    """Whole groups in order while both running totals fit; the first group always goes."""
    chosen: list[str] = []
    total_tokens = 0
    for members in groups:
        group_tokens = sum(num_tokens(row) for row in members)
        if chosen and (
            len(chosen) + len(members) > max_rows or total_tokens + group_tokens > max_tokens
        ):
            break
        chosen.extend(row.sample_id for row in members)
        total_tokens += group_tokens
    return chosen


def fifo(rows: Iterable[RowView], max_rows: int) -> list[str]:
    """The ``max_rows`` oldest candidates, in creation order."""
    return [row.sample_id for row in itertools.islice(rows, max_rows)]


def group(rows: Iterable[RowView], max_rows: int) -> list[str]:
    """Whole groups only, oldest first, while the row total stays <= max_rows.

    The first whole group is returned even if it alone is larger than ``max_rows``, so a
    consumer whose ``max_rows`` is smaller than the group size still makes progress.
    """
    return _take_groups(_whole_groups(rows), max_rows, math.inf)


def oldest_version(rows: Iterable[RowView], max_rows: int) -> list[str]:
    """The ``max_rows`` rows with the smallest ``min(versions)``; ties by creation order."""
    ranked = sorted(rows, key=lambda row: (min_version(row), row.seq))
    return [row.sample_id for row in ranked[:max_rows]]


def token_budget(rows: Iterable[RowView], max_rows: int, *, max_tokens: int) -> list[str]:
    """FIFO, stopping before ``num_tokens`` summed over the rows would exceed ``max_tokens``.

    Always returns at least one row, however long, so an oversized sample is not stuck.
    """
    chosen: list[str] = []
    total_tokens = 0
    for row in itertools.islice(rows, max_rows):
        row_tokens = num_tokens(row)
        if chosen and total_tokens + row_tokens > max_tokens:
            break
        chosen.append(row.sample_id)
        total_tokens += row_tokens
    return chosen


def group_token_budget(rows: Iterable[RowView], max_rows: int, *, max_tokens: int) -> list[str]:
    """Whole groups like ``group``, also stopping before the token total exceeds
    ``max_tokens``; the first whole group is always returned."""
    return _take_groups(_whole_groups(rows), max_rows, max_tokens)


SAMPLERS: dict[str, Sampler] = {
    "fifo": fifo,
    "group": group,
    "oldest_version": oldest_version,
    "token_budget": token_budget,
    "group_token_budget": group_token_budget,
}


def get_sampler(name: str) -> Sampler:
    """The sampler registered under ``name``; ValueError listing the valid names otherwise."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; expected one of {sorted(SAMPLERS)}")
    return SAMPLERS[name]


@functools.lru_cache(maxsize=64)
def _signature(sampler: Sampler) -> inspect.Signature:
    """The sampler's signature, computed once (every claim checks its options against it)."""
    return inspect.signature(sampler)


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise ValueError when ``options`` do not fit the sampler's keyword arguments."""
    signature = _signature(get_sampler(name))
    try:
        signature.bind([], 1, **options)
    except TypeError as err:
        params = signature.parameters.values()
        accepted = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        raise ValueError(
            f"bad sampler_options {dict(options)!r} for sampler {name!r} ({err}); "
            f"it takes {accepted or 'no options'}"
        ) from None


def select(
    name: str, rows: Iterable[RowView], max_rows: int, options: Mapping[str, Any] | None = None
) -> list[str]:
    """Run the sampler ``name`` over ``rows`` and return the chosen sample ids."""
    options = dict(options or {})
    check_options(name, options)
    return SAMPLERS[name](rows, max_rows, **options)

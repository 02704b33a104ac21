"""What the bus accepts from its callers: rows to add, field names to write, claim filters.

Shared by the in-process store (`streamrl.bus.local`), the Ray shard (`streamrl.bus.shard`) and
the Ray bus client (`streamrl.bus.ray_bus`), so that every layout refuses the same input with the
same message before it touches any state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from streamrl.api.bus import ROW_META_KEYS, WHERE_OPS

_WHERE_FUNCS: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: a == b,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
}
assert set(_WHERE_FUNCS) == set(WHERE_OPS)

_ROW_KEYS = frozenset({"sample_id", "group_id", "group_size", "batch_index", "fields"})

Predicate = tuple[str, Callable[[Any, Any], bool], Any]
"""(row meta key, comparison, value) of one `where` condition of a claim."""


def parse_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """`row` of an `add_rows` call, checked, with `batch_index` and `fields` filled in."""
    extra = set(row) - _ROW_KEYS
    if extra:
        raise ValueError(f"row has unknown keys {sorted(extra)}; allowed: {sorted(_ROW_KEYS)}")
    missing = {"sample_id", "group_id", "group_size"} - set(row)
    if missing:
        raise ValueError(f"row {dict(row)!r} lacks required keys {sorted(missing)}")
    sample_id, group_id = row["sample_id"], row["group_id"]
    group_size, batch_index = row["group_size"], row.get("batch_index", 0)
    if not isinstance(sample_id, str) or not sample_id:
        raise ValueError(f"sample_id must be a non-empty string, got {sample_id!r}")
    if not isinstance(group_id, str) or not group_id:
        raise ValueError(f"group_id of {sample_id!r} must be a non-empty string, got {group_id!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size of {sample_id!r} must be an int >= 1, got {group_size!r}")
    if not isinstance(batch_index, int):
        raise ValueError(f"batch_index of {sample_id!r} must be an int, got {batch_index!r}")
    fields = row.get("fields") or {}
    check_field_names(fields)
    return {
        "sample_id": sample_id,
        "group_id": group_id,
        "group_size": group_size,
        "batch_index": batch_index,
        "fields": fields,
    }


def check_field_names(values: Mapping[str, Any]) -> None:
    """Refuse field names that are row meta (`ROW_META_KEYS`)."""
    reserved = set(values) & set(ROW_META_KEYS)
    if reserved:
        raise ValueError(
            f"field names {sorted(reserved)} are reserved for row meta {list(ROW_META_KEYS)}; "
            "rename the fields"
        )


def where_predicates(
    where: Mapping[str, tuple[str, Any]] | None,
) -> list[Predicate]:
    """The checked conditions of a claim's `where` filter."""
    predicates = []
    for key, condition in (where or {}).items():
        if key not in ROW_META_KEYS:
            raise ValueError(f"where key {key!r} is not row meta; expected one of {ROW_META_KEYS}")
        if not isinstance(condition, tuple | list) or len(condition) != 2:
            raise ValueError(
                f"where[{key!r}] must be an (op, value) pair such as ('<=', 3), got {condition!r}"
            )
        op, value = condition
        if op not in _WHERE_FUNCS:
            raise ValueError(f"where[{key!r}] has unknown op {op!r}; expected one of {WHERE_OPS}")
        predicates.append((key, _WHERE_FUNCS[op], value))
    return predicates

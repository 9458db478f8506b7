"""LlamaIndex ``MetadataFilters`` -> the Kalos filter language. Pure, no I/O.

Every :class:`~llama_index.core.vector_stores.types.FilterOperator` maps onto one operator of
:mod:`kalos_retrievers.filters`, evaluated in the sidecar as the true top-k among matching rows:

=========================  =============  ===============================================
LlamaIndex                 Kalos          matches when the metadata value ...
=========================  =============  ===============================================
``EQ`` ``NE``              ``$eq $ne``    equals / does not equal (``NE`` also matches a
                                          missing key, as LlamaIndex's own store does)
``GT GTE LT LTE``          ``$gt ...``    compares (numbers with numbers, strings with strings)
``IN`` ``NIN``             ``$in $nin``   is / is not one of the values (``NIN``: or missing)
``CONTAINS``               ``$contains``  is a list holding the value
``ANY`` ``ALL``            ``$any $all``  is a list holding any / all of the values
``TEXT_MATCH``             ``$like``      is a string containing the value
``TEXT_MATCH_INSENSITIVE`` ``$ilike``     same, ignoring case
``IS_EMPTY``               ``$empty``     is missing, null, ``""`` or ``[]``
=========================  =============  ===============================================

Conditions: ``AND`` -> ``$and``, ``OR`` -> ``$or``, ``NOT`` -> ``$not`` of ``$or`` ("none of
the filters matches", the meaning LlamaIndex's ``build_metadata_filter_fn`` gives it). Nested
``MetadataFilters`` nest. Unlike LlamaIndex's in-memory evaluation, booleans never equal numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)

__all__ = ["NODE_ID_KEY", "to_kalos_filter"]

#: The top-level metadata key under which the store keeps each node's id, so that a query can
#: be restricted to ``node_ids`` inside the sidecar.
NODE_ID_KEY = "_node_id"

_SIMPLE = {
    FilterOperator.EQ: "$eq",
    FilterOperator.NE: "$ne",
    FilterOperator.GT: "$gt",
    FilterOperator.GTE: "$gte",
    FilterOperator.LT: "$lt",
    FilterOperator.LTE: "$lte",
    FilterOperator.CONTAINS: "$contains",
    FilterOperator.TEXT_MATCH: "$like",
    FilterOperator.TEXT_MATCH_INSENSITIVE: "$ilike",
}
_LISTS = {
    FilterOperator.IN: "$in",
    FilterOperator.NIN: "$nin",
    FilterOperator.ANY: "$any",
    FilterOperator.ALL: "$all",
}


def to_kalos_filter(
    filters: MetadataFilters | None,
    *,
    node_ids: Sequence[str] | None = None,
    doc_ids: Sequence[str] | None = None,
) -> dict[str, Any] | None:
    """Translate ``filters`` plus id restrictions into one Kalos filter (None: no filter).

    Args:
        filters: LlamaIndex metadata filters; None or an empty list means none.
        node_ids: keep only these nodes; None or ``[]`` means no restriction (a
            ``VectorStoreQuery`` with ``node_ids=[]`` searches everything).
        doc_ids: keep only nodes whose ``ref_doc_id`` is one of these; None or ``[]``: no
            restriction.

    Raises:
        ValueError: an operator with a value it cannot take (e.g. ``EQ`` with a list); the
            message names the filter.
    """
    parts: list[dict[str, Any]] = []
    if filters is not None:
        f = _filters(filters, "filters")
        if f is not None:
            parts.append(f)
    if node_ids:
        parts.append({NODE_ID_KEY: {"$in": _str_list(node_ids, "node_ids")}})
    if doc_ids:
        parts.append({"ref_doc_id": {"$in": _str_list(doc_ids, "doc_ids")}})
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else {"$and": parts}


def _str_list(ids: Sequence[str], argument: str) -> list[str]:
    if isinstance(ids, str):
        raise TypeError(f"{argument} must be a list of strings, not one string")
    return [str(i) for i in ids]


def _nothing() -> dict[str, Any]:
    """A filter no row matches (a new one each time: the caller may change what it gets)."""
    return {NODE_ID_KEY: {"$in": []}}


def _filters(filters: MetadataFilters, path: str) -> dict[str, Any] | None:
    """``filters`` as a Kalos filter; None where it matches every row. An empty
    ``MetadataFilters`` (whatever its condition: no filter, as at the top level of a query)
    matches every row, nested too: an AND drops it, an OR with it matches every row, and a
    NOT over it matches none."""
    parts = []
    everything = False  # an operand matches every row (a nested, empty MetadataFilters)
    for i, f in enumerate(filters.filters):
        p = f"{path}.filters[{i}]"
        part = _filters(f, p) if isinstance(f, MetadataFilters) else _one(f, p)
        if part is None:
            everything = True
        else:
            parts.append(part)
    condition = filters.condition or FilterCondition.AND
    if condition not in (FilterCondition.AND, FilterCondition.OR, FilterCondition.NOT):
        raise ValueError(f"{path}.condition={condition!r} is not and/or/not")
    if not parts:  # no operands (no filter), or only ones that match everything
        return _nothing() if everything and condition == FilterCondition.NOT else None
    if condition == FilterCondition.AND:
        return parts[0] if len(parts) == 1 else {"$and": parts}
    if everything:  # OR over everything is everything; NOT of it, nothing
        return None if condition == FilterCondition.OR else _nothing()
    any_of = parts[0] if len(parts) == 1 else {"$or": parts}
    return any_of if condition == FilterCondition.OR else {"$not": any_of}


def _one(f: MetadataFilter, path: str) -> dict[str, Any]:
    op, value = f.operator, f.value
    if not f.key or f.key.startswith("$"):
        raise ValueError(
            f"{path}: metadata key {f.key!r} cannot be filtered in Kalos (an empty key, or one "
            "starting with '$', which names an operator there); rename the key when you store it"
        )
    if op == FilterOperator.IS_EMPTY:
        return {f.key: {"$empty": True}}
    if op in _LISTS:
        # LlamaIndex lets IN take a single value; it means a one-element list (so for NIN, ANY, ALL).
        values = list(value) if isinstance(value, list | tuple) else [value]
        return {f.key: {_LISTS[op]: values}}
    if op in _SIMPLE:
        if isinstance(value, list):
            raise ValueError(
                f"{path}: operator {op.name} compares with one value, got the list {value!r}; "
                "use IN, NIN, ANY or ALL for lists"
            )
        if op in (FilterOperator.TEXT_MATCH, FilterOperator.TEXT_MATCH_INSENSITIVE) and not (
            isinstance(value, str)
        ):
            raise ValueError(f"{path}: {op.name} needs a string value, got {value!r}")
        return {f.key: {_SIMPLE[op]: value}}
    raise ValueError(f"{path}: operator {op!r} is not supported by Kalos")

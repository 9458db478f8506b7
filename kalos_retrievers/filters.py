"""Metadata filters: one language for every adapter, validated on the client, evaluated in the
sidecar. Pure Python, no I/O.

The language is the MongoDB-style dict that LangChain's vector stores (Chroma, Pinecone,
Qdrant's adapters, the in-memory store) accept::

    {"topic": "billing"}                                 # equality
    {"year": {"$gte": 2020, "$lt": 2025}}                # several operators on a field: AND
    {"$or": [{"topic": "billing"}, {"tags": {"$contains": "urgent"}}]}
    {"$and": [...]}, {"$not": {...}}                     # several top-level keys: AND

Field operators:

=============== ===========================================================================
``$eq $ne``      equal / not equal (``$ne`` also matches rows without the field, as in MongoDB)
``$gt $gte``     ordered comparisons between numbers, or between strings; other pairs never match
``$lt $lte``
``$in $nin``     value in / not in a list (``$nin`` matches rows without the field)
``$exists``      the field is present (``true``) or absent (``false``)
``$contains``    the field is a list holding the value
``$any $all``    the field is a list holding any / all of the values
``$like``        the field is a string containing the value as a substring (``$ilike``: ignoring
                 case); no SQL wildcards: ``%`` and ``_`` are characters like any other, so
                 PGVector's ``{"$like": "%Ada%"}`` is ``{"$like": "Ada"}`` here
``$empty``       the field is absent, null, ``""`` or ``[]`` (``true``), or the opposite
=============== ===========================================================================

Booleans never equal numbers (``True`` is not ``1`` here, unlike in Python). A filter names
fields of the stored metadata only; namespaces are a separate argument. Edge cases, pinned by
tests:

* ``{"f": None}`` (``$eq`` null) matches a stored null, not a missing field; ``$ne`` null
  matches a missing one. For "missing or null" use ``{"$empty": true}`` or ``$exists``.
* ``$all: []`` matches every list, the empty one too (and nothing else); ``$any: []`` and
  ``$in: []`` match nothing; ``$nin: []`` matches every row.
* A ``set`` is taken for a list, but Python has merged ``1``, ``1.0`` and ``True`` in it
  before Kalos sees it (``{1, True}`` is ``{1}``): pass a list to keep them apart.
* Fields are top-level metadata keys, read literally: ``"a.b"`` is a key with a dot, not a
  nested field. A key that is empty or starts with ``$`` can be stored but not filtered on
  (``$`` names an operator).
* Filters nest up to 32 levels of ``$and``/``$or``/``$not`` and hold up to 1,024 conditions
  (each field operator and each ``$and``/``$or``/``$not`` counts one; a list of values
  given to ``$in`` counts once): the sidecar evaluates a filter on its one dispatcher thread.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any, Final

from .protocol import JSON_CONVERTED, json_value

__all__ = ["FIELD_OPERATORS", "LOGICAL_OPERATORS", "matches", "validate_filter"]

FIELD_OPERATORS: Final = frozenset(
    {
        "$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists", "$contains",
        "$any", "$all", "$like", "$ilike", "$empty",
    }
)  # fmt: skip
LOGICAL_OPERATORS: Final = frozenset({"$and", "$or", "$not"})
_LIST_OPS: Final = frozenset({"$in", "$nin", "$any", "$all"})
_BOOL_OPS: Final = frozenset({"$exists", "$empty"})
_MAX_DEPTH: Final = 32
#: conditions (field operators and $and/$or/$not) in one filter: a request's filter is
#: evaluated by the sidecar's one dispatcher thread, which no other client's call passes
#: meanwhile (a review's 15,000 ``$like`` terms over 4,000 rows held it 20 s)
MAX_CONDITIONS: Final = 1024


def validate_filter(flt: Any, argument: str = "filter") -> dict[str, Any] | None:
    """Check a filter and return it in normal form (every field condition as ``{op: value}``).

    ``None`` and ``{}`` mean "no filter" and return ``None``.

    Raises:
        TypeError: a callable was given (LangChain's in-memory store accepts one; a filter that
            runs in another process cannot).
        ValueError: unknown operator, wrong value type, non-finite number; the message names
            the path to the offending part, e.g. ``filter['$or'][1]['year']``.
    """
    if flt is None:
        return None
    if callable(flt):
        raise TypeError(
            f"{argument} is a callable; Kalos evaluates filters in the sidecar process, so pass "
            "a dict such as {'topic': {'$in': ['a', 'b']}} instead"
        )
    if not isinstance(flt, Mapping):
        raise TypeError(f"{argument} must be a dict of conditions, got {type(flt).__name__}")
    if not flt:
        return None
    out = _normalize(flt, argument, 0)
    if (n := _conditions(out)) > MAX_CONDITIONS:
        raise ValueError(
            f"{argument} has {n} conditions, more than {MAX_CONDITIONS}; for many values of one "
            "field use one {'$in': [...]} (or $nin, $any, $all), which counts once"
        )
    return out


def _conditions(flt: Mapping[str, Any]) -> int:
    """How many conditions a normal-form filter holds (a list operator counts once)."""
    n = 0
    for key, value in flt.items():
        if key in ("$and", "$or"):
            n += 1 + sum(_conditions(f) for f in value)
        elif key == "$not":
            n += 1 + _conditions(value)
        else:
            n += len(value)
    return n


def _normalize(flt: Mapping[str, Any], path: str, depth: int) -> dict[str, Any]:
    if depth > _MAX_DEPTH:
        raise ValueError(f"{path} nests deeper than {_MAX_DEPTH} levels")
    if not isinstance(flt, Mapping) or not flt:
        raise ValueError(f"{path} must be a non-empty dict of conditions")
    out: dict[str, Any] = {}
    for key, value in flt.items():
        p = f"{path}[{key!r}]"
        if not isinstance(key, str) or not key:
            raise ValueError(f"{p}: field names must be non-empty strings")
        _utf8(key, p)
        if key in ("$and", "$or"):
            if not isinstance(value, list | tuple) or not value:
                raise ValueError(f"{p} must be a non-empty list of filters")
            out[key] = [_normalize(v, f"{p}[{i}]", depth + 1) for i, v in enumerate(value)]
        elif key == "$not":
            out[key] = _normalize(value, p, depth + 1)
        elif key.startswith("$"):
            raise ValueError(
                f"{p}: unknown logical operator {key!r}; use $and, $or or $not at this level, "
                f"or one of {sorted(FIELD_OPERATORS)} under a field name"
            )
        elif isinstance(value, Mapping) and any(str(k).startswith("$") for k in value):
            out[key] = _field_ops(value, p)
        elif isinstance(value, Mapping) and value:  # (a value cannot be a dict: an operator lost its $?)
            raise ValueError(
                f"{p} is a dict without an operator (keys {sorted(map(str, value))}); write a "
                f"condition as {{'$eq': value}}, {{'$in': [...]}}...: {', '.join(sorted(FIELD_OPERATORS))}"
            )
        else:
            out[key] = {"$eq": _scalar(value, p)}
    return out


def _field_ops(ops: Mapping[str, Any], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op, value in ops.items():
        p = f"{path}[{op!r}]"
        if op not in FIELD_OPERATORS:
            raise ValueError(
                f"{p}: unknown filter operator {op!r}; supported: {', '.join(sorted(FIELD_OPERATORS))}"
            )
        if op in _LIST_OPS:
            if not isinstance(value, list | tuple | set | frozenset):
                raise ValueError(f"{p} must be a list of values")
            out[op] = [_scalar(v, f"{p}[{i}]") for i, v in enumerate(value)]
        elif op in _BOOL_OPS:
            if not isinstance(value, bool):
                raise ValueError(f"{p} must be true or false")
            out[op] = value
        elif op in ("$like", "$ilike"):
            if not isinstance(value, str):
                raise ValueError(f"{p} must be a string")
            out[op] = _utf8(value, p)
        else:
            out[op] = _scalar(value, p)
    return out


def _utf8(s: str, path: str) -> str:
    """Lone surrogates cannot be encoded: refuse them here, naming the path, rather than as a
    bare UnicodeEncodeError when the filter is serialized."""
    try:
        s.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 text (lone surrogate at {e.start})") from None
    return s


def _scalar(value: Any, path: str) -> Any:
    if isinstance(value, str):
        return _utf8(value, path)
    if isinstance(value, JSON_CONVERTED):
        return _scalar(json_value(value), path)  # (as metadata stores them: ISO strings, numbers)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > sys.float_info.max:
            raise ValueError(f"{path} is an integer beyond float64's range; filters take smaller numbers")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} is {value}; filters take finite numbers only")
        return value
    raise ValueError(
        f"{path} is a {type(value).__name__}; filter values must be str, int, float, bool or None "
        "(or a datetime/date/time, compared as its ISO string, or a numpy number)"
    )


# --------------------------------------------------------------------------------------------
# Reference evaluation, one row at a time. The sidecar evaluates the same semantics over
# columns; tests compare the two on random filters.

_MISSING: Final = object()


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def values_equal(a: Any, b: Any) -> bool:
    """Equality with booleans kept apart from numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def ordered(a: Any, b: Any) -> int | None:
    """-1/0/1 comparing ``a`` to ``b`` when both are numbers or both strings, else None."""
    if (_is_number(a) and _is_number(b)) or (isinstance(a, str) and isinstance(b, str)):
        return (a > b) - (a < b)
    return None


def _field_match(op: str, arg: Any, v: Any) -> bool:
    present = v is not _MISSING
    if op == "$eq":
        return present and values_equal(v, arg)
    if op == "$ne":
        return not (present and values_equal(v, arg))
    if op in ("$gt", "$gte", "$lt", "$lte"):
        c = ordered(v, arg) if present else None
        if c is None:
            return False
        return {"$gt": c > 0, "$gte": c >= 0, "$lt": c < 0, "$lte": c <= 0}[op]
    if op == "$in":
        return present and any(values_equal(v, a) for a in arg)
    if op == "$nin":
        return not (present and any(values_equal(v, a) for a in arg))
    if op == "$exists":
        return present == arg
    if op == "$empty":
        empty = (not present) or v is None or v == "" or (isinstance(v, list) and not v)
        return empty == arg
    if op == "$like":
        return isinstance(v, str) and arg in v
    if op == "$ilike":
        return isinstance(v, str) and arg.casefold() in v.casefold()
    lst = v if isinstance(v, list) else None
    if lst is None:
        return False
    if op == "$contains":
        return any(values_equal(x, arg) for x in lst)
    if op == "$any":
        return any(values_equal(x, a) for a in arg for x in lst)
    if op == "$all":
        return all(any(values_equal(x, a) for x in lst) for a in arg)
    raise AssertionError(op)  # validate_filter admits no other operator


def matches(flt: Mapping[str, Any] | None, metadata: Mapping[str, Any]) -> bool:
    """Whether one row's metadata satisfies a *normalized* filter (see :func:`validate_filter`)."""
    if not flt:
        return True
    for key, cond in flt.items():
        if key == "$and":
            ok = all(matches(f, metadata) for f in cond)
        elif key == "$or":
            ok = any(matches(f, metadata) for f in cond)
        elif key == "$not":
            ok = not matches(cond, metadata)
        else:
            v = metadata.get(key, _MISSING)
            ok = all(_field_match(op, arg, v) for op, arg in cond.items())
        if not ok:
            return False
    return True

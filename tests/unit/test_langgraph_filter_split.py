"""KalosStore's filters split into what the sidecar evaluates and what is checked in process
(kalos_retrievers/langgraph.py, ``_split_filter``): for every one- and two-operator condition on
a field, the sidecar's part (evaluated by the filter language's reference, ``filters.matches``)
and the residual together agree with the in-process LangGraph comparison, ``_compare``, where a
missing field reads as None (as in LangGraph's ``InMemoryStore``)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("langgraph")

from kalos_retrievers.filters import matches, validate_filter
from kalos_retrievers.langgraph import _compare, _split_filter

# (booleans and the numbers Python's == equates with them, 0, 1 and 1.0, on both sides)
VALUES = [None, "a", "b", 1, 2, True, False, 0, 1.0]
ITEMS = [{}, {"f": None}, {"f": "a"}, {"f": "b"}, {"f": 1}, {"f": 2}, {"f": [1]}, {"g": 1},
         {"f": True}, {"f": False}, {"f": 0}, {"f": 1.0}, {"f": 0.5}]  # fmt: skip
OPS = (
    [("$eq", v) for v in VALUES]
    + [("$ne", v) for v in VALUES]
    + [("$in", v) for v in ([None], [None, "a"], ["a"], [1, "b"], [True], [None, 0], [False, 2])]
    + [("$nin", v) for v in ([None], [None, "a"], ["a"], [1], [None, True])]
    + [("$gt", 1), ("$lte", 1), ("$gte", True), ("$lt", False), ("$gt", 0), ("$lte", 0.5)]
)  # (not ordered comparisons of strings: the sidecar orders them, InMemoryStore's float() cannot; docs/memory.md)
CONDS = [dict(c) for n in (1, 2) for c in itertools.combinations(OPS, n) if len(dict(c)) == n]


@pytest.mark.parametrize("cond", CONDS, ids=repr)
def test_the_split_agrees_with_the_in_process_comparison(cond: dict) -> None:
    sidecar, residual = _split_filter({"f": cond})
    norm = validate_filter(sidecar)
    for item in ITEMS:
        got = matches(norm, item) and all(_compare(item.get(k), v) for k, v in residual.items())
        assert got == _compare(item.get("f"), cond), item


def test_plain_values_and_several_fields() -> None:
    sidecar, residual = _split_filter({"f": None, "g": {"$ne": None}, "h": {"k": 1}})
    assert residual == {"h": {"k": 1}}
    norm = validate_filter(sidecar)
    assert matches(norm, {"g": 0}) and not matches(norm, {"f": 1, "g": 0}) and not matches(norm, {})


def test_an_unknown_operator_is_refused_before_any_search() -> None:
    with pytest.raises(ValueError, match=r"Unsupported operator: \$eqq"):
        _split_filter({"f": {"$eqq": 1}})

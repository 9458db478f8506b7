"""MetadataFilters -> Kalos filters: each operator by hand, and agreement with LlamaIndex's own
evaluation (``build_metadata_filter_fn``) on random flat filters."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)
from llama_index.core.vector_stores.utils import build_metadata_filter_fn

from kalos_retrievers.filters import matches, validate_filter
from kalos_retrievers.llama_index import to_kalos_filter
from kalos_retrievers.llama_index.filters import NODE_ID_KEY

F = FilterOperator


def mf(*filters: Any, condition: str = "and") -> MetadataFilters:
    return MetadataFilters(filters=list(filters), condition=FilterCondition(condition))


@pytest.mark.parametrize(
    ("op", "value", "expected"),
    [
        (F.EQ, "a", {"$eq": "a"}),
        (F.NE, 3, {"$ne": 3}),
        (F.GT, 1.5, {"$gt": 1.5}),
        (F.GTE, 2, {"$gte": 2}),
        (F.LT, 2, {"$lt": 2}),
        (F.LTE, 2, {"$lte": 2}),
        (F.IN, ["a", "b"], {"$in": ["a", "b"]}),
        (F.IN, "a", {"$in": ["a"]}),
        (F.NIN, [1, 2], {"$nin": [1, 2]}),
        (F.ANY, ["x"], {"$any": ["x"]}),
        (F.ALL, ["x", "y"], {"$all": ["x", "y"]}),
        (F.CONTAINS, "x", {"$contains": "x"}),
        (F.TEXT_MATCH, "ab", {"$like": "ab"}),
        (F.TEXT_MATCH_INSENSITIVE, "Ab", {"$ilike": "Ab"}),
        (F.IS_EMPTY, None, {"$empty": True}),
    ],
)
def test_each_operator(op: FilterOperator, value: Any, expected: dict[str, Any]) -> None:
    out = to_kalos_filter(mf(MetadataFilter(key="k", value=value, operator=op)))
    assert out == {"k": expected}
    assert validate_filter(out) == out  # the client would accept it as is


def test_every_operator_is_covered() -> None:
    # A new FilterOperator in a future LlamaIndex must be mapped on purpose, not by accident.
    for op in FilterOperator:
        value: Any = ["v"] if op in (F.IN, F.NIN, F.ANY, F.ALL) else "v"
        assert to_kalos_filter(mf(MetadataFilter(key="k", value=value, operator=op))) is not None


def test_conditions_and_nesting() -> None:
    a = MetadataFilter(key="a", value=1)
    b = MetadataFilter(key="b", value=2, operator=F.GT)
    c = MetadataFilter(key="c", value="x", operator=F.NE)
    assert to_kalos_filter(mf(a, b)) == {"$and": [{"a": {"$eq": 1}}, {"b": {"$gt": 2}}]}
    assert to_kalos_filter(mf(a, b, condition="or")) == {
        "$or": [{"a": {"$eq": 1}}, {"b": {"$gt": 2}}]
    }
    # NOT: none of the filters matches (LlamaIndex's build_metadata_filter_fn semantics)
    assert to_kalos_filter(mf(a, b, condition="not")) == {
        "$not": {"$or": [{"a": {"$eq": 1}}, {"b": {"$gt": 2}}]}
    }
    nested = mf(a, mf(b, mf(c, condition="not"), condition="or"))
    assert to_kalos_filter(nested) == {
        "$and": [
            {"a": {"$eq": 1}},
            {"$or": [{"b": {"$gt": 2}}, {"$not": {"c": {"$ne": "x"}}}]},
        ]
    }


def test_empty_filters_and_id_restrictions() -> None:
    assert to_kalos_filter(None) is None
    assert to_kalos_filter(mf()) is None
    assert to_kalos_filter(None, node_ids=[], doc_ids=[]) is None  # empty list: no restriction
    assert to_kalos_filter(None, node_ids=["n1"]) == {NODE_ID_KEY: {"$in": ["n1"]}}
    assert to_kalos_filter(mf(MetadataFilter(key="a", value=1)), doc_ids=["d"]) == {
        "$and": [{"a": {"$eq": 1}}, {"ref_doc_id": {"$in": ["d"]}}]
    }
    with pytest.raises(TypeError, match="node_ids"):
        to_kalos_filter(None, node_ids="n1")  # type: ignore[arg-type]


def test_an_empty_nested_filters_matches_every_row() -> None:
    """An empty MetadataFilters is no filter (every row matches, as at a query's top level),
    nested too: AND drops it, OR with it matches every row, NOT over it matches none (it was
    dropped from all three, which turned OR(x, everything) into x and NOT into NOT(x))."""
    x = MetadataFilter(key="tag", value="x")
    rows = [{"tag": "x", NODE_ID_KEY: "a"}, {"tag": "y", NODE_ID_KEY: "b"}, {NODE_ID_KEY: "c"}, {}]

    def ids(filters: MetadataFilters) -> list[int]:
        flt = to_kalos_filter(filters)
        return [i for i, r in enumerate(rows) if flt is None or matches(validate_filter(flt), r)]

    assert ids(mf(x, mf())) == [0]  # AND
    assert ids(mf(x, mf(), condition="or")) == [0, 1, 2, 3]
    assert ids(mf(x, mf(), condition="not")) == []
    assert ids(mf(mf(), condition="not")) == [] and ids(mf(mf(condition="not"), condition="not")) == []
    assert ids(mf(mf(), condition="or")) == ids(mf(condition="not")) == [0, 1, 2, 3]  # (top level: no filter)
    assert ids(mf(x, mf(mf(), condition="or"), condition="or")) == [0, 1, 2, 3]
    assert ids(mf(x, condition="not")) == [1, 2, 3]  # (the control: a NOT over x alone)
    first = to_kalos_filter(mf(x, mf(), condition="not"))
    assert first is not None
    first[NODE_ID_KEY]["$in"].append("a")  # (a caller's change to one answer is its own)
    assert to_kalos_filter(mf(x, mf(), condition="not")) == {NODE_ID_KEY: {"$in": []}}


def test_bad_values_name_the_filter() -> None:
    with pytest.raises(ValueError, match=r"filters\.filters\[0\].*EQ.*list"):
        to_kalos_filter(mf(MetadataFilter(key="a", value=["x"], operator=F.EQ)))
    with pytest.raises(ValueError, match="TEXT_MATCH needs a string"):
        to_kalos_filter(mf(MetadataFilter(key="a", value=3, operator=F.TEXT_MATCH)))
    # a key Kalos's language would read as an operator: refused in LlamaIndex's terms
    with pytest.raises(ValueError, match=r"filters\.filters\[1\]: metadata key '\$price' cannot be filtered"):
        to_kalos_filter(mf(MetadataFilter(key="a", value=1), MetadataFilter(key="$price", value=3)))
    with pytest.raises(ValueError, match="metadata key '' cannot be filtered"):
        to_kalos_filter(mf(MetadataFilter(key="", value=3, operator=F.IN)))


def test_list_operators_take_a_single_value_as_a_list() -> None:
    for op, name in ((F.IN, "$in"), (F.NIN, "$nin"), (F.ANY, "$any"), (F.ALL, "$all")):
        assert to_kalos_filter(mf(MetadataFilter(key="t", value="x", operator=op))) == {"t": {name: ["x"]}}


# ---------------------------------------------------------------------------------------------
# Differential: our translation, evaluated by the reference evaluator of kalos_retrievers.filters
# (the semantics the sidecar implements), against LlamaIndex's own in-memory evaluation. Keys
# have one type each, as LlamaIndex's evaluator raises on mixed comparisons.

WORDS = st.sampled_from(["alpha", "Beta", "gamma", "al", "", "BETA"])
NUMS = st.one_of(st.integers(-3, 3), st.sampled_from([-1.5, 0.0, 2.5]))
TAGS = st.lists(st.sampled_from(["x", "y", "z"]), max_size=3)

metadata_st = st.fixed_dictionaries({}, optional={"n": NUMS, "s": WORDS, "l": TAGS})

filter_st = st.one_of(
    st.builds(MetadataFilter, key=st.just("n"), value=NUMS,
              operator=st.sampled_from([F.EQ, F.NE, F.GT, F.GTE, F.LT, F.LTE])),
    st.builds(MetadataFilter, key=st.just("n"), value=st.lists(st.integers(-3, 3), max_size=3),
              operator=st.sampled_from([F.IN, F.NIN])),
    st.builds(MetadataFilter, key=st.just("s"), value=WORDS,
              operator=st.sampled_from([F.EQ, F.NE, F.GT, F.LT, F.TEXT_MATCH,
                                        F.TEXT_MATCH_INSENSITIVE])),
    st.builds(MetadataFilter, key=st.just("s"), value=st.lists(WORDS, max_size=3),
              operator=st.sampled_from([F.IN, F.NIN])),
    st.builds(MetadataFilter, key=st.just("l"), value=st.sampled_from(["x", "y"]),
              operator=st.just(F.CONTAINS)),
    st.builds(MetadataFilter, key=st.just("l"), value=st.lists(st.sampled_from(["x", "y"]),
              min_size=1, max_size=2), operator=st.sampled_from([F.ANY, F.ALL])),
    st.builds(MetadataFilter, key=st.sampled_from(["n", "s", "l"]), value=st.none(),
              operator=st.just(F.IS_EMPTY)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    filters=st.lists(filter_st, min_size=1, max_size=3),
    condition=st.sampled_from(["and", "or", "not"]),
    rows=st.lists(metadata_st, min_size=1, max_size=6),
)
def test_agrees_with_llama_index_evaluation(
    filters: list[MetadataFilter], condition: str, rows: list[dict[str, Any]]
) -> None:
    f = mf(*filters, condition=condition)
    ours = validate_filter(to_kalos_filter(f))
    theirs = build_metadata_filter_fn(lambda i: rows[int(i)], f)
    for i, row in enumerate(rows):
        assert matches(ours, row) == theirs(str(i)), (row, f)

"""Filter language: validation messages, and the sidecar's column evaluation against the
row-at-a-time reference on random metadata and random filters."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kalos_retrievers.sidecar import metadata as metadata_module
from kalos_retrievers.sidecar.metadata import MetadataColumns

from kalos_retrievers.filters import matches, validate_filter


def test_normal_form() -> None:
    assert validate_filter(None) is None and validate_filter({}) is None
    assert validate_filter({"a": 1}) == {"a": {"$eq": 1}}
    assert validate_filter({"a": {"$in": (1, "x")}, "$or": [{"b": True}]}) == {
        "a": {"$in": [1, "x"]},
        "$or": [{"b": {"$eq": True}}],
    }


@pytest.mark.parametrize(
    ("flt", "err", "match"),
    [
        (lambda d: True, TypeError, "callable"),
        ([("a", 1)], TypeError, "must be a dict"),
        ({"a": {"$regex": "x"}}, ValueError, r"filter\['a'\]\['\$regex'\]: unknown filter operator"),
        ({"$nor": []}, ValueError, "unknown logical operator"),
        ({"$or": []}, ValueError, "non-empty list"),
        ({"$or": [{"a": {"$in": 3}}]}, ValueError, r"filter\['\$or'\]\[0\]\['a'\]\['\$in'\] must be a list"),
        ({"a": {"$exists": 1}}, ValueError, "true or false"),
        ({"a": float("nan")}, ValueError, "finite"),
        ({"a": {"$gt": [1]}}, ValueError, "must be str, int, float, bool or None"),
        ({"": 1}, ValueError, "non-empty strings"),
    ],
)
def test_errors_name_the_offending_part(flt: Any, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        validate_filter(flt)


def test_documented_edge_cases() -> None:
    """The edge cases the module docstring states (null against missing, empty lists, dotted
    and $ keys, sets, depth)."""
    def ok(f: Any, m: dict[str, Any]) -> bool:
        return matches(validate_filter(f), m)

    assert ok({"f": None}, {"f": None}) and not ok({"f": None}, {})
    assert ok({"f": {"$ne": None}}, {}) and not ok({"f": {"$ne": None}}, {"f": None})
    assert ok({"f": {"$empty": True}}, {}) and ok({"f": {"$empty": True}}, {"f": None})
    assert [ok({"t": {"$all": []}}, m) for m in ({"t": []}, {"t": [1]}, {"t": "x"}, {})] == [True, True, False, False]
    assert not any(ok({"t": {op: []}}, {"t": [1]}) for op in ("$any", "$in"))
    assert ok({"t": {"$nin": []}}, {}) and ok({"t": {"$nin": []}}, {"t": 1})
    assert ok({"a.b": 1}, {"a.b": 1}) and not ok({"a.b": 1}, {"a": {"b": 1}})
    with pytest.raises(ValueError, match=r"unknown logical operator '\$price'"):
        validate_filter({"$price": 3})
    assert validate_filter({"t": {"$in": frozenset((1, True))}}) == {"t": {"$in": [1]}}  # (Python merged them)
    deep: dict[str, Any] = {"a": 1}
    for _ in range(32):
        deep = {"$not": deep}
    assert validate_filter(deep) is not None
    with pytest.raises(ValueError, match="nests deeper than 32 levels"):
        validate_filter({"$not": deep})
    wide = {"$or": [{"s": {"$like": f"q{j}"}} for j in range(1023)]}  # (1,024 with the $or)
    assert validate_filter(wide) is not None
    assert validate_filter({"s": {"$in": [f"q{j}" for j in range(50_000)]}}) is not None  # (one)
    with pytest.raises(ValueError, match=r"filter has 1025 conditions, more than 1024; .*\$in"):
        validate_filter({"$or": [*wide["$or"], {"t": 1}]})
    with pytest.raises(ValueError, match="1025 conditions"):
        validate_filter({f"k{j}": {"$gt": 0, "$lt": 9} for j in range(512)} | {"z": 1})


def test_semantics_spot_checks() -> None:
    m = {"n": 3, "s": "Apple pie", "b": True, "l": ["x", 2], "z": None, "e": ""}
    yes = [{"n": 3}, {"n": 3.0}, {"n": {"$gt": 2, "$lte": 3}}, {"s": {"$like": "pie"}},
           {"s": {"$ilike": "APPLE"}}, {"l": {"$contains": 2}}, {"l": {"$any": ["q", "x"]}},
           {"l": {"$all": ["x", 2]}}, {"missing": {"$ne": 1}}, {"missing": {"$nin": [1]}},
           {"z": None}, {"e": {"$empty": True}}, {"missing": {"$empty": True}},
           {"$not": {"n": 4}}, {"$or": [{"n": 4}, {"b": True}]}, {"s": {"$gt": "Apple"}}]  # fmt: skip
    no = [{"n": True}, {"b": 1}, {"n": {"$gt": "2"}}, {"l": {"$all": ["x", 3]}}, {"missing": 1},
          {"n": {"$exists": False}}, {"s": {"$contains": "pie"}}, {"l": {"$empty": True}}]  # fmt: skip
    for f in yes:
        assert matches(validate_filter(f), m), f
    for f in no:
        assert not matches(validate_filter(f), m), f


def _dense(capacity: int) -> int:  # (patched in for sparse_max: every key's column dense)
    return 0


BIG = [2**53, 2**53 + 1, 2**60, 2**60 + 1, 2.0**60]  # beyond float precision: ints that share a float64
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 2.0, -1.5, *BIG]),
                    st.sampled_from(["", "a", "b", "ab", "B", "ba"]))  # fmt: skip
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3))
KEYS = st.sampled_from(["k1", "k2", "k3"])
METAS = st.dictionaries(KEYS, VALUES, max_size=3)


def field_cond() -> st.SearchStrategy:
    return st.one_of(
        st.builds(lambda v: {"$eq": v}, SCALARS),
        st.builds(lambda v: {"$ne": v}, SCALARS),
        st.builds(lambda o, v: {o: v}, st.sampled_from(["$gt", "$gte", "$lt", "$lte"]), SCALARS),
        st.builds(lambda o, v: {o: v}, st.sampled_from(["$in", "$nin", "$any", "$all"]),
                  st.lists(SCALARS, max_size=3)),  # fmt: skip
        st.builds(lambda o, v: {o: v}, st.sampled_from(["$exists", "$empty"]), st.booleans()),
        st.builds(lambda o, v: {o: v}, st.sampled_from(["$like", "$ilike"]), st.sampled_from(["a", "B", ""])),
        st.builds(lambda v: {"$contains": v}, SCALARS),
    )


FILTERS = st.recursive(
    st.dictionaries(KEYS, field_cond(), min_size=1, max_size=2),
    lambda inner: st.one_of(
        st.builds(lambda fs: {"$and": fs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda fs: {"$or": fs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda f: {"$not": f}, inner),
    ),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(st.lists(METAS, min_size=1, max_size=25), FILTERS)
def test_columns_agree_with_the_reference(metas: list[dict], flt: dict) -> None:
    norm = validate_filter(flt)
    cols = MetadataColumns(capacity=4)
    cols.grow(len(metas) + 3)
    for r, m in enumerate(metas):
        cols.set(r + 2, m)  # rows need not start at 0
    rows = np.arange(2, 2 + len(metas))
    got = cols.evaluate(norm, rows)
    want = np.array([matches(norm, m) for m in metas])
    assert np.array_equal(got, want), (flt, metas)


@settings(max_examples=300, deadline=None)
@given(st.lists(METAS, min_size=1, max_size=25), FILTERS, st.integers(0, 3))
def test_columns_agree_with_the_reference_past_the_string_dictionarys_bound(metas: list[dict], flt: dict,
                                                                            bound: int) -> None:  # fmt: skip
    """A column codes only its first MAX_CODES strings (here 0-3): rows holding the others are
    compared by value, and rows rewritten, cleared and moved keep their codes straight. (Dense
    columns: sparse ones, of few rows, have no codes.)"""
    norm = validate_filter(flt)
    with (
        mock.patch.object(metadata_module, "MAX_CODES", bound),
        mock.patch.object(metadata_module, "sparse_max", _dense),
    ):
        cols = MetadataColumns(capacity=4)
        cols.grow(2 * len(metas) + 3)
        for r, m in enumerate(metas):  # written once elsewhere, then moved, then rewritten
            cols.set(len(metas) + 2 + r, metas[-1 - r])
            cols.move(len(metas) + 2 + r, r + 2)
            cols.set(r + 2, m)
        cols.clear(len(metas) + 2)
    got = cols.evaluate(norm, np.arange(2, 2 + len(metas)))
    want = np.array([matches(norm, m) for m in metas])
    assert np.array_equal(got, want), (flt, metas, bound)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "clear", "move"]), st.integers(0, 6), st.integers(0, 6), METAS),
                min_size=1, max_size=40), FILTERS)  # fmt: skip
def test_a_keys_column_lives_while_a_row_holds_the_key(ops: list[tuple[str, int, int, dict]], flt: dict) -> None:
    """Through random writes, deletes and moves of 7 rows: there is a column for exactly the
    keys some row holds, each counting its rows, and filters still agree with the reference
    (a key's column, gone with its last row and made again, starts empty)."""
    norm = validate_filter(flt)
    cols = MetadataColumns(capacity=4)
    cols.grow(7)
    held: dict[int, dict] = {}
    for op, a, b, m in ops:
        if op == "set":
            cols.set(a, m)
            held[a] = m
        elif op == "clear":
            cols.clear(a)
            held.pop(a, None)
        elif a != b:  # (compaction moves a live row into a free one)
            if b in held:
                cols.clear(b)
                held.pop(b)
            cols.move(a, b)
            if a in held:
                held[b] = held.pop(a)
        counts: dict[str, int] = {}
        for meta in held.values():
            for key in meta:
                counts[key] = counts.get(key, 0) + 1
        assert {k: c.held for k, c in cols.cols.items()} == counts, (op, a, b)
    rows = np.array(sorted(held), dtype=np.int64)
    got = cols.evaluate(norm, rows)
    assert np.array_equal(got, np.array([matches(norm, held[r]) for r in rows], bool)), (flt, held)


def test_keys_written_once_and_deleted_leave_no_columns() -> None:
    """A hundred keys each written to a row and deleted (an item per LangGraph key, say): no
    column stays (each cost ~21 bytes per row of capacity, for good); an overwrite keeping a
    key keeps its column (no new one made per write)."""
    cols = MetadataColumns(capacity=1 << 14)
    for i in range(100):
        cols.set(7, {"shared": 1, f"only-{i}": i})
        cols.clear(7)
    assert cols.cols == {}
    cols.set(3, {"a": 1, "b": "x"})
    col = cols.cols["a"]
    cols.set(3, {"a": 2})
    assert cols.cols["a"] is col and "b" not in cols.cols and col.held == 1


@mock.patch.object(metadata_module, "sparse_max", _dense)
def test_string_equality_compares_codes_not_values() -> None:
    """$eq / $in on strings read the codes: values swapped behind the codes' back are not
    looked at (the negative control of the code path: comparing values would see them)."""
    cols = MetadataColumns(capacity=4)
    for r, u in enumerate(["u1", "u2", "u1", 7]):
        cols.set(r, {"user_id": u})
    rows = np.arange(4)
    f = validate_filter({"user_id": "u1"})
    assert cols.evaluate(f, rows).tolist() == [True, False, True, False]
    cols.cols["user_id"].obj[:] = "u1"  # (never done by the sidecar: only to see what is read)
    assert cols.evaluate(f, rows).tolist() == [True, False, True, False]
    f_in = validate_filter({"user_id": {"$in": ["u2", "zz"]}})
    assert cols.evaluate(f_in, rows).tolist() == [False, True, False, False]
    assert cols.evaluate(validate_filter({"user_id": "zz"}), rows).tolist() == [False] * 4


def test_a_full_string_dictionary_is_rebuilt_from_the_rows_own_strings() -> None:
    """Values that come and go (one row rewritten with ever new strings) free their codes when
    the dictionary fills, so a later string is coded again; a column of distinct live strings
    stops being rebuilt (saturated) and compares the rest by value; long strings are never
    coded. Every answer against the reference."""
    with mock.patch.object(metadata_module, "MAX_CODES", 8), mock.patch.object(metadata_module, "sparse_max", _dense):
        cols = MetadataColumns(capacity=16)
        cols.set(0, {"s": "user1"})
        for i in range(100):  # churn in row 1: 100 distinct strings through 8 codes
            cols.set(1, {"s": f"session-{i}"})
        col = cols.cols["s"]
        assert len(col.codes) <= 8 and not col.saturated and not col.uncoded
        cols.set(2, {"s": "user2"})
        assert col.code[2] != metadata_module.UNCODED  # coded: the dead sessions' codes were freed
        for r in range(3, 12):  # nine more distinct live strings: past the bound for good
            cols.set(r, {"s": f"live-{r}"})
        assert col.saturated and col.uncoded and len(col.codes) <= 8
        cols.set(12, {"s": "x" * 300})  # long: compared by value
        assert col.code[12] == metadata_module.UNCODED
        metas = [{"s": "user1"}, {"s": "session-99"}, {"s": "user2"}, *({"s": f"live-{r}"} for r in range(3, 12)),
                 {"s": "x" * 300}]  # fmt: skip
        rows = np.arange(13)
        for want_s in ("user1", "session-99", "live-11", "live-3", "x" * 300, "session-5", "nobody"):
            for flt in ({"s": want_s}, {"s": {"$in": [want_s, "user2"]}}, {"s": {"$ne": want_s}}):
                norm = validate_filter(flt)
                want = np.array([matches(norm, m) for m in metas])
                assert np.array_equal(cols.evaluate(norm, rows), want), flt


def test_columns_follow_set_clear_and_move() -> None:
    cols = MetadataColumns(capacity=8)
    cols.set(0, {"a": 1, "b": "x"})
    cols.set(1, {"a": 2})
    cols.set(0, {"b": "y"})  # overwrite drops the old "a"
    f = validate_filter({"a": {"$exists": True}})
    assert cols.evaluate(f, np.array([0, 1])).tolist() == [False, True]
    cols.move(1, 5)
    assert cols.evaluate(f, np.array([1, 5])).tolist() == [False, True]
    cols.clear(5)
    assert cols.evaluate(f, np.array([5])).tolist() == [False]


def test_a_dict_without_operators_is_named_as_such() -> None:
    """A field's dict whose keys are not $-operators (an operator that lost its $, say) is
    refused with what it lacks, not as "a dict is not a value"; mem0's spelling is translated
    and its unknown operators named (KalosMemory)."""
    from kalos_retrievers.memory import _translate_filter

    with pytest.raises(ValueError, match=r"filter\['topic'\] is a dict without an operator \(keys \['eq'\]\)"):
        validate_filter({"topic": {"eq": "x"}})
    assert _translate_filter({"topic": {"eq": "x", "$ne": "y"}}) == {"topic": {"$eq": "x", "$ne": "y"}}
    with pytest.raises(ValueError, match=r"filters\['topic'\]: unknown operator 'foo'; mem0's are contains"):
        _translate_filter({"topic": {"foo": "x"}})


@pytest.mark.parametrize(
    ("flt", "want"),
    [
        ({"k": 2**53}, [False, True]),
        ({"k": {"$in": [2**53, 7]}}, [False, True]),
        ({"k": {"$nin": [2**53]}}, [True, False]),
        ({"k": {"$gt": 2**53}}, [True, False]),
        ({"k": {"$lte": 2**53}}, [False, True]),
        ({"k": 2.0**53}, [False, True]),
        ({"k": {"$in": [2**53 + 1]}}, [True, False]),
    ],
)
def test_ints_beyond_float_precision_compare_exactly(flt: dict, want: list[bool]) -> None:
    """2**53 + 1 and 2**53 share a float64: the columns compare the stored ints themselves."""
    cols = MetadataColumns(capacity=4)
    cols.set(0, {"k": 2**53 + 1})
    cols.set(1, {"k": 2**53})
    norm = validate_filter(flt)
    assert cols.evaluate(norm, np.array([0, 1])).tolist() == want
    assert [matches(norm, m) for m in ({"k": 2**53 + 1}, {"k": 2**53})] == want


@pytest.mark.parametrize(
    "flt",
    [{"t": {"$any": ["a", 2]}}, {"t": {"$any": [1]}}, {"t": {"$any": [True]}}, {"t": {"$all": ["a", 2]}},
     {"t": {"$all": [1, True]}}, {"t": {"$contains": 2.0}}, {"t": {"$contains": "x"}}, {"t": {"$any": []}},
     {"t": {"$all": []}}],
    ids=repr,
)
def test_list_operators_with_mixed_and_unhashable_elements(flt: dict) -> None:
    """The set-based $any / $all / $contains (sidecar/metadata.py) agree with the reference on
    lists holding objects and lists (unhashable), and booleans beside 0/1 (equal in a set)."""
    metas = [{"t": [1, True, {"x": 1}]}, {"t": [True]}, {"t": ["a", [1], 2]}, {"t": [2, "a"]}, {"t": []},
             {"t": "a"}, {}]  # fmt: skip
    cols = MetadataColumns(capacity=8)
    for r, m in enumerate(metas):
        cols.set(r, m)
    norm = validate_filter(flt)
    assert cols.evaluate(norm, np.arange(len(metas))).tolist() == [matches(norm, m) for m in metas]


def test_ints_beyond_float64_are_refused_in_filters_and_tolerated_in_columns() -> None:
    """Such an int has no float64 column value: filters refuse it; a column (a store written
    before upserts refused them) holds it as +-inf and compares it exactly."""
    with pytest.raises(ValueError, match="beyond float64's range"):
        validate_filter({"k": 10**400})
    cols = MetadataColumns(capacity=4)
    cols.set(0, {"k": 10**400})
    cols.set(1, {"k": -(10**400)})
    cols.set(2, {"k": 5})
    rows = np.arange(3)
    assert cols.evaluate(validate_filter({"k": {"$gt": 10**300}}), rows).tolist() == [True, False, False]
    assert cols.evaluate(validate_filter({"k": {"$lt": 6}}), rows).tolist() == [False, True, True]


def test_dates_and_numpy_numbers_in_filters_are_their_stored_forms() -> None:
    """As metadata stores them (docs/client.md): a datetime, date or time as its ISO string, a
    numpy number as the Python one, in any operator and inside lists; a NaN still refused."""
    import datetime

    when = datetime.datetime(2026, 12, 7, 8, 30, tzinfo=datetime.UTC)
    assert validate_filter({"at": {"$gte": when}, "d": datetime.date(2026, 1, 2), "t": datetime.time(4, 5),
                            "n": {"$in": [np.int64(3), np.float32(0.5), np.bool_(True)]}}) == {  # fmt: skip
        "at": {"$gte": "2026-12-07T08:30:00+00:00"}, "d": {"$eq": "2026-01-02"}, "t": {"$eq": "04:05:00"},
        "n": {"$in": [3, 0.5, True]}}  # fmt: skip
    assert type(validate_filter({"n": np.int64(3)})["n"]["$eq"]) is int  # type: ignore[index]
    assert validate_filter({"x": np.longdouble(1.5)}) == {"x": {"$eq": 1.5}}  # (its .item() is a longdouble)
    with pytest.raises(ValueError, match="finite"):
        validate_filter({"x": np.float32("nan")})
    with pytest.raises(ValueError, match=r"filter\['x'\] is a datetime64"):
        validate_filter({"x": np.datetime64("2026-12-07")})

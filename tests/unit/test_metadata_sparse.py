"""Sparse metadata columns (``sidecar/metadata.py``): a key few rows hold keeps its values by row
(a dict), and becomes a dense column once more than ``sparse_max(capacity)`` rows hold it.
Filters agree with the row-at-a-time reference (:func:`kalos_retrievers.filters.matches`) with
every key dense, every key sparse, and keys crossing the threshold both ways through writes,
deletes, moves and growths; rows each carrying a key of their own cost memory linear in the
rows, not keys x capacity (the old code's 1.4 GB at 8k rows)."""

from __future__ import annotations

import contextlib
import random
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kalos_retrievers.sidecar import metadata as metadata_module
from kalos_retrievers.sidecar.metadata import MetadataColumns

from kalos_retrievers.filters import FIELD_OPERATORS, matches, validate_filter

BIG = [2**53, 2**53 + 1, 2**60, 2**60 + 1, 2.0**60]  # beyond float precision: ints that share a float64
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0.5, 2.0, -1.5, *BIG]),
    st.sampled_from(["", "a", "b", "ab", "B", "ba"]),
)
# stored values also include what a filter cannot name: objects, ints beyond float64, long strings
STORED = st.one_of(SCALARS, st.sampled_from([10**400, -(10**400), {"x": 1}, "a" * 300]))
VALUES = st.one_of(STORED, st.lists(st.one_of(STORED, st.lists(SCALARS, max_size=1)), max_size=3))
KEYS = st.sampled_from(["k1", "k2", "k3", "k4"])
METAS = st.dictionaries(KEYS, VALUES, max_size=3)
ARGS: dict[str, st.SearchStrategy] = {
    **dict.fromkeys(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$contains"], SCALARS),
    **dict.fromkeys(["$in", "$nin", "$any", "$all"], st.lists(SCALARS, max_size=3)),
    **dict.fromkeys(["$exists", "$empty"], st.booleans()),
    **dict.fromkeys(["$like", "$ilike"], st.sampled_from(["a", "B", "", "aa"])),
}
assert set(ARGS) == FIELD_OPERATORS  # every operator the filter language has
FIELD_COND = st.sampled_from(sorted(ARGS)).flatmap(lambda op: ARGS[op].map(lambda v: {op: v}))
FILTERS = st.recursive(
    st.dictionaries(KEYS, FIELD_COND, min_size=1, max_size=2),
    lambda inner: st.one_of(
        st.builds(lambda fs: {"$and": fs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda fs: {"$or": fs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda f: {"$not": f}, inner),
    ),
    max_leaves=6,
)


@contextlib.contextmanager
def threshold(mode: str) -> Iterator[None]:
    """``dense``: every key's column dense; ``sparse``: none ever; ``mixed``: dense past 2 rows;
    ``grown``: the real sparse_max with SPARSE_MIN 1 and SPARSE_SHARE 4, so a growth raises the
    threshold (1 at 4 rows' capacity, 2 at 8, 4 at 16...)."""
    if mode == "grown":
        with mock.patch.object(metadata_module, "SPARSE_MIN", 1), mock.patch.object(metadata_module, "SPARSE_SHARE", 4):
            yield
        return
    rows = {"dense": 0, "mixed": 2, "sparse": 10**9}[mode]
    with mock.patch.object(metadata_module, "sparse_max", return_value=rows):
        yield


def check_structure(cols: MetadataColumns, held: dict[int, dict], dense: set[str]) -> set[str]:
    """A column for exactly the keys rows hold, each counting its rows, dense exactly when the
    model says (past the threshold at a write, until its last row lets go); the new model."""
    counts = Counter(k for m in held.values() for k in m)
    limit = metadata_module.sparse_max(cols.capacity)
    dense = {k for k in dense if k in counts} | {k for k, n in counts.items() if n > limit}
    assert {k: c.held for k, c in cols.cols.items()} == dict(counts)
    kinds = {k: type(c).__name__ for k, c in cols.cols.items()}
    assert kinds == {k: "_Column" if k in dense else "_Sparse" for k in counts}
    assert cols.dense == {k: cols.cols[k] for k in dense}  # (set's way to the dense ones)
    for k in dense:
        c = cols.cols[k]
        assert {len(c.kind), len(c.num), len(c.obj), len(c.code)} == {cols.capacity}
        for r, m in held.items():  # (a dense column holds a row's value exactly when it holds the key)
            assert (c.kind[r] != metadata_module.MISSING) == (k in m)
    for k in set(counts) - dense:
        assert cols.cols[k].vals == {r: m[k] for r, m in held.items() if k in m}  # type: ignore[union-attr]
    return dense


def check_filters(cols: MetadataColumns, held: dict[int, dict], flts: list[dict], rnd: random.Random) -> None:
    """Every row of the table, in a random order (rows holding nothing answer as ``{}``), and
    the rows held in order."""
    everyone = list(range(cols.capacity))
    rnd.shuffle(everyone)
    for rows in (np.array(everyone, np.int64), np.array(sorted(held), np.int64)):
        for flt in flts:
            norm = validate_filter(flt)
            got = cols.evaluate(norm, rows)
            want = np.array([matches(norm, held.get(r, {})) for r in rows.tolist()], bool)
            assert np.array_equal(got, want), (flt, {r: held[r] for r in rows.tolist() if r in held})


OPS = st.lists(
    st.tuples(st.sampled_from(["set", "set", "set", "clear", "move", "grow"]), st.integers(0, 15),
              st.integers(0, 15), METAS),
    min_size=1,
    max_size=40,
)  # fmt: skip


@pytest.mark.parametrize("mode", ["dense", "mixed", "grown", "sparse"])
@settings(max_examples=150, deadline=None)
@given(ops=OPS, flts=st.lists(FILTERS, min_size=1, max_size=3), rnd=st.randoms(use_true_random=False))
def test_columns_agree_with_the_reference_through_writes_deletes_moves_and_growths(
    mode: str, ops: list[tuple[str, int, int, dict]], flts: list[dict], rnd: random.Random
) -> None:
    """Random sets, clears, moves and growths of up to 16 rows, starting at 4 rows' capacity:
    after each, the columns' keys, counts and representations are as the model says; halfway
    and at the end every filter agrees with the reference on every row."""
    with threshold(mode):
        cols = MetadataColumns(capacity=4)
        held: dict[int, dict] = {}
        dense: set[str] = set()
        for i, (op, ra, rb, m) in enumerate(ops):
            a, b = ra % cols.capacity, rb % cols.capacity
            if op == "set":
                cols.set(a, m)
                held[a] = m
            elif op == "clear":
                cols.clear(a)
                held.pop(a, None)
            elif op == "grow":
                cols.grow(min(64, cols.capacity * 2))
            elif a != b and a in held:  # (compaction moves a live row into a free one)
                if b in held:
                    cols.clear(b)
                    del held[b]
                cols.move(a, b)
                held[b] = held.pop(a)
            dense = check_structure(cols, held, dense)
            if i == len(ops) // 2:
                check_filters(cols, held, flts, rnd)
        check_filters(cols, held, flts, rnd)


def test_sparse_max_is_1024_rows_or_a_256th_of_the_table() -> None:
    sm = metadata_module.sparse_max
    assert [sm(c) for c in (0, 1024, 1 << 18, (1 << 18) + 256, 1 << 20, 1 << 24)] == [1024, 1024, 1024, 1025,
                                                                                       4096, 65536]  # fmt: skip


EQ_FILTERS = [{"k": 2}, {"k": {"$ne": 2}}, {"k": {"$gte": 1}}, {"k": {"$in": [0, "x"]}}, {"k": {"$exists": True}},
              {"k": {"$exists": False}}, {"k": {"$empty": True}}, {"k": "x"}, {"k": {"$like": "x"}}]  # fmt: skip


def agree(cols: MetadataColumns, held: dict[int, dict]) -> None:
    check_filters(cols, held, EQ_FILTERS, random.Random(0))


def test_a_key_at_exactly_the_threshold_stays_sparse_one_more_row_makes_it_dense() -> None:
    with threshold("mixed"):  # (2 rows)
        cols = MetadataColumns(capacity=8)
        held = {0: {"k": 0}, 1: {"k": 1}}
        for r, m in held.items():
            cols.set(r, m)
        sparse = cols.cols["k"]
        assert type(sparse).__name__ == "_Sparse" and sparse.held == 2
        cols.set(1, {"k": 2})  # an overwrite: no new holder, still sparse
        held[1] = {"k": 2}
        assert cols.cols["k"] is sparse and sparse.held == 2
        agree(cols, held)
        cols.set(5, {"k": "x"})  # the third holder: dense, with every holder's value
        held[5] = {"k": "x"}
        col = cols.cols["k"]
        assert type(col).__name__ == "_Column" and col.held == 3
        agree(cols, held)
        cols.clear(5)  # back at the threshold: dense all the same (no going back)
        del held[5]
        assert cols.cols["k"] is col and col.held == 2
        agree(cols, held)


def test_a_dense_keys_rows_all_cleared_then_one_set_again_starts_sparse() -> None:
    """The dense column goes with its last row; the key written again starts a sparse column,
    which sees none of the old rows' values (they answer as missing)."""
    with threshold("mixed"):
        cols = MetadataColumns(capacity=8)
        for r in range(4):
            cols.set(r, {"k": 2, "other": r})
        assert type(cols.cols["k"]).__name__ == "_Column"
        for r in range(4):  # an overwrite without the key, or a delete
            if r % 2:
                cols.set(r, {"other": r})
            else:
                cols.clear(r)
        assert "k" not in cols.cols
        cols.set(6, {"k": "x"})
        assert type(cols.cols["k"]).__name__ == "_Sparse" and cols.cols["k"].held == 1
        agree(cols, {1: {"other": 1}, 3: {"other": 3}, 6: {"k": "x"}})


def test_moves_carry_sparse_and_dense_values() -> None:
    with threshold("mixed"):
        cols = MetadataColumns(capacity=8)
        held = {0: {"k": 2, "rare": "x"}, 1: {"k": 1}, 2: {"k": 0}, 3: {"rare2": 1}}
        for r, m in held.items():
            cols.set(r, m)
        assert type(cols.cols["k"]).__name__ == "_Column" and type(cols.cols["rare"]).__name__ == "_Sparse"
        cols.clear(3)  # (a move's destination is free: compaction)
        del held[3]
        assert "rare2" not in cols.cols
        cols.move(0, 3)
        held[3] = held.pop(0)
        assert cols.cols["rare"].vals == {3: "x"}  # type: ignore[union-attr]
        agree(cols, held)
        check_filters(cols, held, [{"rare": "x"}, {"rare": {"$exists": False}}], random.Random(1))


def test_a_densification_out_of_memory_leaves_the_key_sparse_and_whole() -> None:
    """Building the dense column fails part-way (MemoryError at its second row): the key's
    column is still the sparse one, holding every row (the new one too); the next new holder
    densifies it."""
    real_put = metadata_module._Column.put
    calls = [0]

    def put_failing_at_the_second(self: Any, row: int, v: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError
        real_put(self, row, v)

    with threshold("mixed"):
        cols = MetadataColumns(capacity=8)
        held = {0: {"k": 0}, 1: {"k": 1}}
        for r, m in held.items():
            cols.set(r, m)
        sparse = cols.cols["k"]
        with mock.patch.object(metadata_module._Column, "put", put_failing_at_the_second):
            cols.set(2, {"k": 2})
        held[2] = {"k": 2}
        assert calls[0] == 2 and cols.cols["k"] is sparse and sparse.vals == {0: 0, 1: 1, 2: 2}  # type: ignore[union-attr]
        agree(cols, held)
        cols.set(3, {"k": "x"})
        held[3] = {"k": "x"}
        assert type(cols.cols["k"]).__name__ == "_Column" and cols.cols["k"].held == 4
        agree(cols, held)


def test_a_growth_out_of_memory_leaves_dense_and_sparse_columns_as_they_were() -> None:
    with threshold("mixed"):
        cols = MetadataColumns(capacity=8)
        held = {r: {"k": r, **({"rare": "x"} if r == 1 else {})} for r in range(4)}
        for r, m in held.items():
            cols.set(r, m)
        real_full = np.full
        calls = [0]

        def oom_on_the_second(*a: Any, **kw: Any) -> np.ndarray:
            calls[0] += 1
            if calls[0] == 2:
                raise MemoryError
            return real_full(*a, **kw)

        with mock.patch.object(metadata_module.np, "full", oom_on_the_second), pytest.raises(MemoryError):
            cols.grow(64)
        assert cols.capacity == 8 and len(cols.row_keys) == 8 and len(cols.cols["k"].kind) == 8  # type: ignore[union-attr]
        agree(cols, held)
        cols.grow(64)
        assert len(cols.cols["k"].kind) == 64 and len(cols.row_keys) == 64  # type: ignore[union-attr]
        cols.set(40, {"k": "x", "rare": "x"})
        held[40] = {"k": "x", "rare": "x"}
        agree(cols, held)
        check_filters(cols, held, [{"rare": "x"}], random.Random(2))


def test_a_sparse_filter_asks_each_holder_once_never_each_row() -> None:
    """Over 1M rows in any order (repeats too), a sparse key's filter calls ``_field_match``
    once for the missing rows' answer and once per holder asked: the rows themselves are
    matched to holders by numpy."""
    cap = 1 << 20
    cols = MetadataColumns(capacity=cap)
    held = {5: {"k": "x"}, 77_777: {"k": "y"}, cap - 1: {"k": "x"}}
    for r, m in held.items():
        cols.set(r, m)
    real = metadata_module._field_match
    calls = [0]

    def counted(op: str, arg: Any, v: Any) -> bool:
        calls[0] += 1
        return real(op, arg, v)

    rows = np.random.default_rng(0).permutation(cap)
    rows = np.concatenate([rows, [5, 5, 77_777]])
    norm = validate_filter({"k": {"$ne": "x"}})
    with mock.patch.object(metadata_module, "_field_match", counted):
        got = cols.evaluate(norm, rows)
    assert calls[0] == 1 + 3
    want = np.ones(len(rows), bool)
    want[np.isin(rows, [5, cap - 1])] = False
    assert np.array_equal(got, want)
    calls[0] = 0
    with mock.patch.object(metadata_module, "_field_match", counted):
        assert cols.evaluate(norm, np.array([9, 77_777, 5], np.int64)).tolist() == [True, True, False]
    assert calls[0] == 1 + 2  # (holders not among the rows are not asked)


def test_rows_each_with_a_key_of_their_own_cost_memory_linear_in_the_rows() -> None:
    """3,000 rows at 65,536 rows' capacity, each with a key no other row has and one key they
    all share: the rare keys stay sparse (~0.5 kB each), the shared one goes dense (21 bytes x
    capacity = 1.4 MB). Under 6 MB in all, checked every 250 rows; the old code's columns
    (four arrays of the capacity per key) held 340 MB after the first 250 rows and 4 GB at the
    end."""
    cap, n = 65_536, 3_000
    cols = MetadataColumns(capacity=cap)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for r in range(n):
            cols.set(r, {"user": "u1", f"dyn-{r}": r})
            if r % 250 == 249:
                used = tracemalloc.get_traced_memory()[0] - base
                assert used < 2_000_000 + 1_000 * r, f"{used / 1e6:.1f} MB after {r + 1} rows"
    finally:
        tracemalloc.stop()
    assert len(cols.cols) == n + 1
    dense = {k for k, c in cols.cols.items() if type(c).__name__ == "_Column"}
    assert dense == {"user"}
    assert sum(getattr(cols.cols["user"], a).nbytes for a in ("kind", "num", "obj", "code")) == 21 * cap
    assert cols.evaluate(validate_filter({"dyn-7": 7}), np.arange(cap)).nonzero()[0].tolist() == [7]
    for r in range(n):
        cols.clear(r)
    assert cols.cols == {}

"""Metadata columns: filters evaluated over all candidate rows at once.

For each metadata key the sidecar keeps four aligned arrays over the rows: a kind code
(missing, null, bool, number, string, list, object), a float64 (the number, the bool as 0/1, or
a list's length), a string's code (an int32 naming it in the column's dictionary of strings)
and the Python value itself. The common operators then become numpy comparisons over a
namespace's rows (``$eq``/``$in`` on strings compare codes: an agent memory store's
``{"user_id": ...}`` over 100k rows took 2.3 ms comparing the strings themselves; ``$gt`` on
numbers is one vector compare), and only string ordering and the list and substring operators
look at values one by one. A column codes up to :data:`MAX_CODES` distinct strings of at most
:data:`CODE_MAX_LEN` characters (rebuilt from the rows' own strings when full); rows holding
others (a column of unique strings, long texts) are compared by value. The semantics are those of
:func:`kalos_retrievers.filters.matches`, which the tests use as the reference.

Those arrays cost ~21 bytes per row of the table's *capacity*, whoever holds the key: rows that
each carry a key no other row has (an agent's dynamic keys; the LangGraph store makes a value's
top-level keys metadata) cost keys x capacity, quadratic (90 / 356 / 1,416 MB at 2,048 / 4,096 /
8,192 rows with a key each; a sidecar out of memory after a commit could not restart: it reloads
the same rows). So a key starts *sparse* (:class:`_Sparse`: its holders' values in a dict, row ->
value; ~0.5 kB for a key of one row, all told) and becomes a dense column (:class:`_Column`,
built whole from the dict, then swapped in) once more than :func:`sparse_max` rows hold it:
``max(SPARSE_MIN, capacity // SPARSE_SHARE)``, 1,024 rows, or 1/256 of the capacity past
262,144 rows. Memory is then linear in the rows' key-holdings: a rare key costs its holders'
entries, and a column made dense costs at most 21 x 256 = ~5.4 kB per row holding the key then
(the floor of 1,024 keeps that bound at small capacities too). A common key keeps numpy's speed;
a sparse key's filter costs one :func:`~kalos_retrievers.filters._field_match` per holder among
the rows asked (at most ``sparse_max`` calls: ~8 ms for 4,096 holders among 1M rows asked, about
a dense column's time there), found among those rows through a bitmap of the table, vectorized.
A dense column does not go back to sparse (it goes with its last row, as sparse ones do).
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from kalos_retrievers.filters import _MISSING, _field_match, values_equal

MISSING: Final = 0
NULL: Final = 1
BOOL: Final = 2
NUMBER: Final = 3
STRING: Final = 4
LIST: Final = 5
OBJECT: Final = 6
_CMP: Final = {"$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le}
#: Distinct strings a column codes (its dictionary's bound). When it fills, it is rebuilt from
#: the strings rows hold then (see _Column.code_of); past it, and for a string longer than
#: CODE_MAX_LEN, a row's code is UNCODED and its value is compared instead.
MAX_CODES: Final = 1 << 16
CODE_MAX_LEN: Final = 256
UNCODED: Final = -1
#: A key held by more than sparse_max(capacity) rows gets a dense column (module docstring).
SPARSE_MIN: Final = 1024
SPARSE_SHARE: Final = 256


def sparse_max(capacity: int) -> int:
    """The most rows a key's column keeps sparse at a table of ``capacity`` rows."""
    return max(SPARSE_MIN, capacity // SPARSE_SHARE)


def _kind(v: Any) -> int:
    if v is None:
        return NULL
    if isinstance(v, bool):
        return BOOL
    if isinstance(v, int | float):
        return NUMBER
    if isinstance(v, str):
        return STRING
    if isinstance(v, list):
        return LIST
    return OBJECT


class _Sparse:
    """A key few rows hold (at most :func:`sparse_max`): each holder's value, by row."""

    __slots__ = ("vals",)

    def __init__(self) -> None:
        self.vals: dict[int, Any] = {}

    @property
    def held(self) -> int:
        return len(self.vals)

    def dense(self, capacity: int) -> _Column:
        """The same rows as a dense column, built whole (a MemoryError leaves nothing half made:
        the caller swaps it in only once built)."""
        col = _Column(capacity)
        for row, v in self.vals.items():
            col.put(row, v)
        col.held = len(self.vals)
        return col

    def field(self, op: str, arg: Any, rows: np.ndarray, capacity: int) -> np.ndarray:
        """``op``'s answer for each of ``rows`` (rows of a table of ``capacity``): ``_field_match``
        on the value of each holder among them (once per holder), every other row answering as
        a missing field does. The holders among ``rows`` are found through a bitmap of the table
        (calloc'd, only the holders' pages written): ~2.5 ms over 1M rows in any order, where
        ``np.searchsorted`` of the rows among 4,096 holders took 80 ms and ``np.isin`` 11 ms."""
        out = np.full(len(rows), _field_match(op, arg, _MISSING), bool)
        if not len(rows):
            return out
        holders = np.fromiter(self.vals, np.int64, len(self.vals))
        holders.sort()
        bitmap = np.zeros(capacity, bool)
        bitmap[holders] = True
        pos = np.flatnonzero(bitmap[rows])  # positions in ``rows`` of rows holding the key
        if len(pos):
            which = np.searchsorted(holders, rows[pos])  # their holders (indices into ``holders``)
            asked = np.unique(which)  # (each asked once, were a row given twice)
            answer = np.zeros(len(holders), bool)
            vals = self.vals
            answer[asked] = [_field_match(op, arg, vals[r]) for r in holders[asked].tolist()]
            out[pos] = answer[which]
        return out


class _Column:
    __slots__ = ("code", "codes", "held", "kind", "num", "obj", "saturated", "uncoded")
    _ARRAYS: Final = ("kind", "num", "obj", "code")

    def __init__(self, capacity: int) -> None:
        self.held = 0  # rows holding the key (the column goes when none does: MetadataColumns)
        self.kind = np.zeros(capacity, np.int8)
        self.num = np.zeros(capacity, np.float64)
        self.obj = np.empty(capacity, object)
        self.code = np.full(capacity, UNCODED, np.int32)  # a STRING row's code (others: unread)
        self.codes: dict[str, int] = {}  # string -> code (at most MAX_CODES; see code_of)
        self.uncoded = False  # whether a row may hold an UNCODED string
        self.saturated = False  # the rows' own strings fill half the dictionary: not rebuilt again

    def put(self, row: int, v: Any) -> None:
        """``row``'s value ``v`` (``held`` is the caller's to count)."""
        k = _kind(v)
        self.obj[row] = v  # (the value, then its kind: a rebuild of the codes in code_of reads both)
        self.num[row] = _as_float(v) if k in (BOOL, NUMBER) else (len(v) if k == LIST else 0.0)
        self.kind[row] = k
        self.code[row] = self.code_of(v) if k == STRING else UNCODED

    def grown(self, capacity: int) -> dict[str, np.ndarray]:
        """The column's arrays at ``capacity`` rows (not yet in place: see MetadataColumns.grow)."""
        n = len(self.kind)
        out = {}
        for name in self._ARRAYS:
            old = getattr(self, name)
            fill = UNCODED if name == "code" else 0
            new = np.empty(capacity, object) if old.dtype == object else np.full(capacity, fill, old.dtype)
            new[:n] = old
            out[name] = new
        return out

    def code_of(self, s: str) -> int:
        """``s``'s code, given one now if the dictionary has room (else UNCODED: a string
        longer than CODE_MAX_LEN, or no room). A full dictionary is first rebuilt from the
        strings the rows hold (:meth:`recode`): a column whose values come and go (session ids)
        frees the codes of strings no row holds any more."""
        c = self.codes.get(s)
        if c is not None:
            return c
        if len(s) <= CODE_MAX_LEN:
            if len(self.codes) >= MAX_CODES and not self.saturated:
                self.recode()
                c = self.codes.get(s)
                if c is not None:
                    return c
            if len(self.codes) < MAX_CODES:
                c = self.codes[s] = len(self.codes)
                return c
        self.uncoded = True
        return UNCODED

    def recode(self) -> None:
        """Rebuild the dictionary from the strings rows hold now, and every string row's code.
        When those strings alone fill half of it (a column of distinct values), it is not
        rebuilt again: later strings past the bound stay UNCODED. One pass over the column's
        string rows, at most once per MAX_CODES / 2 new strings."""
        rows = np.flatnonzero(self.kind == STRING)
        codes: dict[str, int] = {}
        new = np.full(len(rows), UNCODED, np.int32)
        uncoded = False
        for j, v in enumerate(self.obj[rows].tolist()):
            c = codes.get(v)
            if c is None:
                if len(v) > CODE_MAX_LEN or len(codes) >= MAX_CODES:
                    uncoded = True
                    continue
                c = codes[v] = len(codes)
            new[j] = c
        self.code[rows] = new
        self.codes, self.uncoded = codes, uncoded
        self.saturated = len(codes) >= MAX_CODES // 2

    def strings_match(self, kind: np.ndarray, rows: np.ndarray, strs: set[str]) -> np.ndarray:
        """Which of ``rows`` (``kind`` their kinds) hold one of the strings ``strs``: their
        codes compared (one gather, one compare), and the values of uncoded rows."""
        code = self.code[rows]
        want = [c for c in (self.codes.get(x) for x in strs) if c is not None]
        if len(want) == 1:
            m = code == want[0]
        else:  # (none coded: only an uncoded row can match)
            m = np.isin(code, np.array(want, np.int32)) if want else np.zeros(len(rows), bool)
        m &= kind == STRING  # (a row's code is stale once it holds no string)
        if self.uncoded:  # (strings past the dictionary's bound, or long ones): compared by value
            unc = np.flatnonzero((kind == STRING) & (code == UNCODED))
            if len(unc):
                m[unc] = [v in strs for v in self.obj[rows[unc]]]
        return m


def _as_float(v: Any) -> float:
    """A number as its column's float64: an int beyond float64's range (which a store written
    before upserts refused them may hold) is +-inf there, and compared exactly (``_exact``)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _list_matches(op: str, arg: Any, lists: Any) -> list[bool]:
    """``$contains`` / ``$any`` / ``$all`` on each list of ``lists``, by set operations: a row
    costs one pass over its list, not one per value asked (``$any`` of 100 values over 300k
    lists took ~20 s). Python's sets equate True with 1 and False with 0, which the filter
    language keeps apart (``values_equal``): when that can matter, or a list holds something
    unhashable, the row is decided by ``_field_match``."""
    wanted = [arg] if op == "$contains" else arg
    if any(isinstance(a, bool) or (isinstance(a, int | float) and a in (0, 1)) for a in wanted):
        return [_field_match(op, arg, v) for v in lists]  # (a set could equate True and 1)
    keys = set(wanted)
    out = []
    for v in lists:
        try:
            hit = keys <= set(v) if op == "$all" else not keys.isdisjoint(v)
        except TypeError:  # (an object or a list in the list)
            hit = _field_match(op, arg, v)
        out.append(hit)
    return out


def _exact(m: np.ndarray, col: _Column, rows: np.ndarray, num: np.ndarray, equal: Any) -> None:
    """Re-check ``m``'s numeric matches beyond float precision (|x| >= 2**53, where distinct
    ints share a float64) on the stored values themselves: 2**53 + 1 does not equal 2**53."""
    sel = np.flatnonzero(m & (np.abs(num) >= 2.0**53))
    if len(sel):
        m[sel] = [bool(equal(v)) for v in col.obj[rows[sel]]]


class MetadataColumns:
    """A column per metadata key some row holds now: sparse (:class:`_Sparse`) while at most
    :func:`sparse_max` rows hold the key, dense (:class:`_Column`, four arrays as long as the row
    table, ~21 bytes a row) past that, for good. A key's column goes when its last row lets go
    of it, by a delete, an overwrite without the key, or a move. (They were kept for good: a key
    written once and deleted cost 1.7 MB at 100k rows' capacity until a restart, and a LangGraph
    store whose values carry keys of their own grew by as much per key.) An overwrite keeping a
    key keeps its column."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self.cols: dict[str, _Column | _Sparse] = {}
        self.dense: dict[str, _Column] = {}  # the dense ones among cols (set's way to them)
        self.row_keys: list[tuple[str, ...] | None] = [None] * capacity

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        # every dense column's arrays first, then in place together: a MemoryError part-way
        # leaves every column as it was (not some grown and some not, or one's arrays of two
        # lengths). Sparse columns are keyed by row: nothing to grow.
        grown = [(c, c.grown(capacity)) for c in self.dense.values()]
        pad: list[None] = [None] * (capacity - self.capacity)
        for c, arrays in grown:
            for name, a in arrays.items():
                setattr(c, name, a)
        self.row_keys.extend(pad)
        self.capacity = capacity

    def set(self, row: int, metadata: Mapping[str, Any]) -> None:
        old = self.row_keys[row]
        dense = self.dense
        for key, v in metadata.items():
            col = dense.get(key)
            if col is None:
                self._set_sparse(key, row, v)
                continue
            if old is None or col.kind[row] == MISSING:  # (kinds of rows not holding the key are MISSING)
                col.held += 1
            k = _kind(v)  # (col.put(row, v), inlined: the hot path of every write)
            col.obj[row] = v  # (the value, then its kind: a rebuild of the codes in code_of reads both)
            col.num[row] = _as_float(v) if k in (BOOL, NUMBER) else (len(v) if k == LIST else 0.0)
            col.kind[row] = k
            col.code[row] = col.code_of(v) if k == STRING else UNCODED
        if old:  # (after the new keys: a key kept keeps its column)
            for key in old:
                if key not in metadata:
                    self._let_go(key, row)
        self.row_keys[row] = tuple(metadata)

    def _set_sparse(self, key: str, row: int, v: Any) -> None:
        """``row``'s value of ``key``, whose column is not dense (or not yet made). Past
        sparse_max holders, the column is made dense: built whole, then swapped in. Without the
        memory for it, the key stays sparse (every answer the same, only slower), tried again at
        its next new holder."""
        col = self.cols.get(key)
        if col is None:
            col = self.cols[key] = _Sparse()
        assert type(col) is _Sparse
        col.vals[row] = v
        if len(col.vals) > sparse_max(self.capacity):
            with contextlib.suppress(MemoryError):
                self.cols[key] = self.dense[key] = col.dense(self.capacity)

    def clear(self, row: int) -> None:
        keys = self.row_keys[row]
        if keys:
            for key in keys:
                self._let_go(key, row)
        self.row_keys[row] = None

    def _let_go(self, key: str, row: int) -> None:
        """``row`` no longer holds ``key``; the key's column goes with its last row."""
        col = self.cols[key]
        if type(col) is _Sparse:
            del col.vals[row]
            if not col.vals:
                del self.cols[key]
            return
        col.kind[row] = MISSING
        col.obj[row] = None
        col.held -= 1
        if col.held <= 0:
            del self.cols[key], self.dense[key]

    def move(self, src: int, dst: int) -> None:
        keys = self.row_keys[src]
        self.clear(dst)
        if keys:
            for key in keys:
                c = self.cols[key]
                if type(c) is _Sparse:
                    c.vals[dst] = c.vals.pop(src)
                    continue
                c.kind[dst], c.num[dst], c.obj[dst], c.code[dst] = c.kind[src], c.num[src], c.obj[src], c.code[src]
                c.kind[src], c.obj[src] = MISSING, None
        self.row_keys[dst], self.row_keys[src] = keys, None

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, flt: Mapping[str, Any] | None, rows: np.ndarray) -> np.ndarray:
        """Boolean mask over ``rows``: which satisfy the (normalized) filter."""
        if not flt:
            return np.ones(len(rows), bool)
        mask = np.ones(len(rows), bool)
        for key, cond in flt.items():
            if key == "$and":
                for f in cond:
                    mask &= self.evaluate(f, rows)
            elif key == "$or":
                m = np.zeros(len(rows), bool)
                for f in cond:
                    m |= self.evaluate(f, rows)
                mask &= m
            elif key == "$not":
                mask &= ~self.evaluate(cond, rows)
            else:
                for op, arg in cond.items():
                    mask &= self._field(key, op, arg, rows)
        return mask

    def _field(self, key: str, op: str, arg: Any, rows: np.ndarray) -> np.ndarray:
        col = self.cols.get(key)
        if col is None:  # no row has this key: every row answers as "missing" does
            return np.full(len(rows), _field_match(op, arg, _MISSING), bool)
        if type(col) is _Sparse:
            return col.field(op, arg, rows, self.capacity)
        kind = col.kind[rows]
        if op == "$eq":
            return self._eq(col, kind, arg, rows)
        if op == "$ne":
            return ~self._eq(col, kind, arg, rows)
        if op == "$in":
            return self._in(col, kind, arg, rows)
        if op == "$nin":
            return ~self._in(col, kind, arg, rows)
        if op == "$exists":
            return (kind != MISSING) == arg
        if op in ("$gt", "$gte", "$lt", "$lte"):
            return self._order(col, kind, op, arg, rows)
        if op == "$empty":
            num = col.num[rows]
            empty = (kind == MISSING) | (kind == NULL) | ((kind == LIST) & (num == 0))
            s = kind == STRING
            if s.any():
                empty[s] = col.obj[rows[s]] == ""
            return empty == arg
        # $like $ilike $contains $any $all: one value at a time, on the rows of the right kind
        want = STRING if op in ("$like", "$ilike") else LIST
        out = np.zeros(len(rows), bool)
        sel = np.flatnonzero(kind == want)
        if len(sel):
            vals = col.obj[rows[sel]]
            out[sel] = [_field_match(op, arg, v) for v in vals] if want == STRING else _list_matches(op, arg, vals)
        return out

    @classmethod
    def _in(cls, col: _Column, kind: np.ndarray, arg: Any, rows: np.ndarray) -> np.ndarray:
        """``_eq`` of any value of ``arg``, in one pass per kind rather than one per value (a
        list of 100k ids against 40k rows: one ``isin`` and one set, not 100k comparisons of
        every row)."""
        nums: list[Any] = []
        strs: set[str] = set()
        rest: list[Any] = []  # null and booleans: _eq one at a time
        for a in arg:
            if isinstance(a, str):
                strs.add(a)
            elif isinstance(a, int | float) and not isinstance(a, bool):
                nums.append(a)
            else:
                rest.append(a)
        m = np.zeros(len(rows), bool)
        if nums:
            num = col.num[rows]
            m |= (kind == NUMBER) & np.isin(num, np.array([float(a) for a in nums]))
            _exact(m, col, rows, num, lambda v: any(values_equal(v, a) for a in nums))
        if strs:
            m |= col.strings_match(kind, rows, strs)
        for a in rest:
            m |= cls._eq(col, kind, a, rows)
        return m

    @staticmethod
    def _eq(col: _Column, kind: np.ndarray, arg: Any, rows: np.ndarray) -> np.ndarray:
        if arg is None:
            return kind == NULL
        if isinstance(arg, bool):
            return (kind == BOOL) & (col.num[rows] == float(arg))
        if isinstance(arg, int | float):
            num = col.num[rows]
            m = (kind == NUMBER) & (num == float(arg))
            _exact(m, col, rows, num, lambda v: values_equal(v, arg))
            return m
        return col.strings_match(kind, rows, {arg})

    @staticmethod
    def _order(col: _Column, kind: np.ndarray, op: str, arg: Any, rows: np.ndarray) -> np.ndarray:
        if isinstance(arg, bool) or arg is None:
            return np.zeros(len(rows), bool)
        if isinstance(arg, int | float):
            num = col.num[rows]
            m = (kind == NUMBER) & _CMP[op](num, float(arg))
            if abs(float(arg)) >= 2.0**53:  # (near the argument, floats may tie distinct ints)
                sel = np.flatnonzero((kind == NUMBER) & (np.abs(num) >= 2.0**53))
                if len(sel):
                    m[sel] = [bool(_CMP[op](v, arg)) for v in col.obj[rows[sel]]]
            return m
        m = kind == STRING
        sel = np.flatnonzero(m)
        if len(sel):
            m[sel] = _CMP[op](col.obj[rows[sel]], arg)
        return m

"""What each operation does, independent of how requests arrive.

The dispatcher decodes a slot into arguments and calls one of these methods; the methods talk
to the store of record first (a write is acknowledged only after its commit), then to the row
table and the index. Argument checks here repeat the client's: the sidecar trusts nothing it
reads from shared memory. Errors are raised as :class:`~kalos_retrievers.protocol.Invalid`
with the status the client will see.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kalos_retrievers.filters import validate_filter
from kalos_retrievers.protocol import (
    MAX_METADATA_DEPTH,
    Invalid,
    Metric,
    Status,
    encode_doc,
    encode_json,
    encode_recall_args,
    nests_deeper,
)

from .index import (
    NS_ANY,
    NS_NONE,
    BellScope,
    FatalDeviceError,
    Index,
    IndexCapacityError,
    IndexOutOfStep,
    SlotSpec,
    normalize_rows,
)
from .rows import RowTable
from .store import NullStore, SqliteStore, StoredRow

log = logging.getLogger("kalos.sidecar")

MAX_ID_BYTES = 512


_ORDERS_KEPT = 16  # namespaces whose scan order is kept
_SCOPES_KEPT = 64  # filters whose candidate rows are kept (Service.eligible_for)
_SCOPE_ROWS_KEPT = 1 << 22  # their candidate rows in all, at most (32 MiB of int64)
_SCOPE_KEY_KEPT = 4096  # the longest args kept as a key (a long $in list: evaluated each time)
# scopes whose last noting Service.bell_recent counts (more than any kernel's table holds), and
# refused scopes remembered (Service.bell_refused)
_BELL_SEEN_MAX = 64
_REFRESH_MAX = 256  # changes a kept answer follows one by one at least (Service._refreshed)
_FLOAT_MAX = int(sys.float_info.max)  # a metadata int beyond it has no float64 column value

#: Seconds between two failed commits logged with their traceback (those between are counted).
_COMMIT_LOG_EVERY = 60.0

class Service:
    def __init__(self, index: Index, store: SqliteStore | NullStore, *, dim: int, metric: int) -> None:
        self.index = index
        self.store = store
        self.dim = dim
        self.metric = metric
        self.rows = RowTable()
        self.index.reserve(self.rows.capacity)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # ns id -> (its version, scan order)
        # a recall's args -> (ns id, its version, eligible()'s answer, the row table's change_seq
        # then): see eligible_for
        self._scopes: dict[bytes, tuple[int, int, tuple[int, np.ndarray | None, bool, int], int]] = {}
        self._scope_rows = 0  # the candidate rows _scopes holds
        self.scope_refreshes = 0  # kept answers brought up to date from the rows changes touched
        # note_bell_space's, oldest first: (namespace, filter or None) by the recalls' args;
        # None: noted by note_bell_args, not decoded yet
        self._bell_spaces: OrderedDict[bytes, tuple[str, Any] | None] = OrderedDict()
        # when each scope was last noted (monotonic ns), those dropped since too, the
        # _BELL_SEEN_MAX most recent; and the scopes forget_bell_space dropped (refused)
        self._bell_seen: OrderedDict[bytes, int] = OrderedDict()
        self._bell_refused: OrderedDict[bytes, None] = OrderedDict()
        self._commit_logged = -math.inf  # when a failed commit was last logged (_commit)
        self._commit_quiet = 0  # failed commits not logged since

    # ------------------------------------------------------------------ start-up
    def load(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Rebuild the index from the store of record; return the number of rows loaded."""
        total = self.store.count()
        # room for every stored row at once (growing by doubling as the batches came copied the
        # vectors and the row table several times over), and as much again as doubling would
        # have left, so the first writes after a start do not grow the index; exactly the rows
        # stored where that much does not fit (a GPU's memory limit)
        cap = max(self.rows.capacity, 1024)
        while cap < total:
            cap *= 2
        try:
            self.index.reserve(cap)
        except IndexCapacityError:
            self.index.reserve(total)  # (too many for the index: raised, and the start fails)
        self.rows.grow(cap)
        done = 0
        for batch in self.store.load(self.dim):
            self._apply(batch)
            done += len(batch)
            if progress:
                progress(done, total)
        return done

    # ------------------------------------------------------------------ writes
    def upsert(self, args: Mapping[str, Any], vectors: np.ndarray) -> int:
        namespace = _namespace(args.get("namespace", ""))
        ids, texts, metas = args.get("ids"), args.get("texts"), args.get("metadatas")
        n = len(vectors)
        for name, lst in (("ids", ids), ("texts", texts), ("metadatas", metas)):
            if not isinstance(lst, list) or len(lst) != n:
                raise Invalid(Status.BAD_REQUEST, f"{name} must be a list of {n} entries")
        assert ids is not None and texts is not None and metas is not None
        meta_json = []
        for i in range(n):
            if not isinstance(ids[i], str) or not ids[i] or len(_utf8(ids[i], f"ids[{i}]")) > MAX_ID_BYTES:
                raise Invalid(Status.BAD_REQUEST, f"ids[{i}] must be a non-empty string <= 512 bytes")
            if not isinstance(texts[i], str):
                raise Invalid(Status.BAD_REQUEST, f"texts[{i}] must be a string")
            if texts[i]:
                _utf8(texts[i], f"texts[{i}]")  # (JSON may carry a lone surrogate; UTF-8 may not)
            if not isinstance(metas[i], dict):
                raise Invalid(Status.BAD_REQUEST, f"metadatas[{i}] must be an object")
            for key, value in metas[i].items():
                if type(value) is int and not -_FLOAT_MAX <= value <= _FLOAT_MAX:
                    raise Invalid(Status.BAD_REQUEST, f"metadatas[{i}][{key!r}] is an integer beyond float64's range")
            if nests_deeper(metas[i]):
                raise Invalid(Status.BAD_REQUEST, f"metadatas[{i}] nests deeper than {MAX_METADATA_DEPTH} levels")
            try:  # (a number JSON read as infinity, 1e400; a lone surrogate in a key or a string)
                meta_json.append(encode_json(metas[i]) if metas[i] else b"{}")  # (b"{}": encode_json({}))
            except ValueError as e:
                raise Invalid(Status.BAD_REQUEST, f"metadatas[{i}] cannot be stored: {e}") from None
        # Copy out of the shared slot first, then check the copy: the client can rewrite the
        # slot at any moment, and a check made on the slot says nothing about a later read.
        vecs = np.array(vectors, dtype=np.float32)
        if not np.all(np.isfinite(vecs)):
            raise Invalid(Status.BAD_REQUEST, "vectors contain NaN or infinity")
        if self.metric == Metric.COSINE:
            zero = ~vecs.any(axis=1)  # (a tiny nonzero component still has a direction)
            if zero.any():
                raise Invalid(Status.BAD_REQUEST, f"vectors[{int(np.argmax(zero))}] is all zeros")
            vecs = normalize_rows(vecs)
        ns_id = self.rows.ns_id(namespace)
        # (an id given twice is one row: the last wins)
        new_keys = len(set(ids)) if ns_id is None else sum(self.rows.lookup(ns_id, i) is None for i in set(ids))
        try:  # room first: running out of memory must happen before anything is committed
            self.index.reserve(self.rows.high + len(self.rows.free) + new_keys)
            self.rows.reserve(new_keys)
        except IndexCapacityError as e:
            raise Invalid(Status.CAPACITY, str(e)) from None
        except MemoryError:
            raise Invalid(Status.CAPACITY, f"out of host memory for {new_keys} more rows") from None
        now = time.time()
        batch = []
        for i in range(n):
            row = self.rows.lookup(ns_id, ids[i]) if ns_id is not None else None
            created = float(self.rows.created[row]) if row is not None else now
            batch.append(StoredRow(namespace, ids[i], texts[i], meta_json[i], vecs[i], created, now))
        self._commit(lambda: self.store.upsert(batch))
        self._after_commit(lambda: self._apply(batch, metas))
        return n

    def _after_commit(self, apply: Callable[[], None]) -> None:
        """Run ``apply``, which brings the row table and the index in step with a write the
        store has committed. Anything it raises leaves them behind the store: IndexOutOfStep,
        which ends the sidecar so that its restart reloads them (before: the client was told
        INTERNAL while the store held the write, and a deleted row could stay listed)."""
        try:
            apply()
        except FatalDeviceError:
            raise
        except Exception as e:
            log.critical("a committed write could not be applied to the index", exc_info=True)
            raise IndexOutOfStep(
                f"a write the store committed could not be applied to the index ({type(e).__name__}: {e})"
            ) from None

    def _apply(self, batch: Sequence[StoredRow], metas: Sequence[dict[str, Any]] | None = None) -> None:
        """Put committed rows into the row table and the index."""
        rows = np.empty(len(batch), np.int64)
        ns = np.empty(len(batch), np.int32)
        for i, r in enumerate(batch):
            ns_id = self.rows.ns_id(r.namespace, create=True)
            assert ns_id is not None
            row = self.rows.lookup(ns_id, r.id)
            if row is None:
                row = self.rows.allocate()
            if metas is not None:
                meta = metas[i]
            else:  # (a start-up's reload: most rows of a bulk load carry no metadata)
                meta = {} if r.metadata_json == b"{}" else json.loads(r.metadata_json)
            doc = encode_doc(r.id, r.text, r.metadata_json, r.created_at, r.updated_at)
            self.rows.set(row, ns_id, r.id, doc, meta, r.created_at)
            rows[i], ns[i] = row, ns_id
        if len(batch):
            # rows may repeat (same id twice in one batch): the last write wins in both places
            self.index.set_rows(rows, np.stack([r.vector for r in batch]), ns)

    def delete(self, args: Mapping[str, Any]) -> int:
        namespace = _namespace(args.get("namespace", ""))
        every = args.get("all") is True
        flt = ids = None
        if not every:  # (checked whatever the namespace holds: a bad request is bad everywhere)
            flt = _filter(args.get("filter"))
            ids = args.get("ids")
            if ids is None and flt is None:
                raise Invalid(Status.BAD_REQUEST, "delete needs ids, a filter, or all=true")
            if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
                raise Invalid(Status.BAD_REQUEST, "ids must be a list of strings")
        ns_id = self.rows.ns_id(namespace)
        if ns_id is None:
            return 0
        if every:
            rows = self.rows.rows_of(ns_id)
        else:
            if ids is not None:
                found = (self.rows.lookup(ns_id, i) for i in ids)
                rows = np.array(sorted({r for r in found if r is not None}), np.int64)
            else:
                rows = self.rows.rows_of(ns_id)
            if flt is not None and len(rows):
                rows = rows[self.rows.meta.evaluate(flt, rows)]
        if not len(rows):
            return 0
        ids_del = [self.rows.ids[r] for r in rows]
        self._commit(lambda: self.store.delete(namespace, ids_del))  # type: ignore[arg-type]
        self._after_commit(lambda: self._remove(rows))
        return len(rows)

    def _remove(self, rows: np.ndarray) -> None:
        self.index.clear_rows(rows)
        for r in rows:
            self.rows.remove(int(r))

    def _commit(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:
            # with its traceback once a minute, counted between: a full disk fails every write
            # (hundreds a second), and a traceback each filled the log too
            now = time.monotonic()
            if now - self._commit_logged >= _COMMIT_LOG_EVERY:
                more = f" ({self._commit_quiet} more since the last report)" if self._commit_quiet else ""
                log.exception("store commit failed%s", more)
                self._commit_logged, self._commit_quiet = now, 0
            else:
                self._commit_quiet += 1
            raise Invalid(Status.STORE, f"the store of record failed to commit: {e}") from None

    # ------------------------------------------------------------------ reads
    def eligible(self, namespace: str, flt: Any, listed: bool = False) -> tuple[int, np.ndarray | None, bool, int]:
        """(ns_id, candidate rows or None, dense, how many rows are eligible) for a search.
        ``listed``: a namespace without a filter is given as its rows too, unless it holds
        every row (dense)."""
        ns_id = self.rows.ns_id(namespace)
        if ns_id is None or self.rows.ns_count[ns_id] == 0:
            return -1, None, False, 0
        if flt is None and not (listed and not self.rows.dense(ns_id)):
            return ns_id, None, self.rows.dense(ns_id), self.rows.ns_count[ns_id]
        rows = self.rows.rows_of(ns_id)
        if flt is None:
            return ns_id, rows, False, len(rows)
        cands = rows[self.rows.meta.evaluate(flt, rows)]
        return ns_id, cands, False, len(cands)

    def eligible_for(self, namespace: str, flt: Any, key: bytes | None = None,
                     ) -> tuple[int, np.ndarray | None, bool, int]:  # fmt: skip
        """:meth:`eligible` of a filter as a request carries it (decoded JSON), validated
        first. ``key``: the request's args (:func:`encode_recall_args` of ``namespace`` and
        the filter, which they name exactly): a filter's candidate rows are kept under it, so
        that an agent recalling again and again with the same filter (``{"user_id": ...}``)
        does not pay for the filter per recall (~260 µs over a 100k-row namespace on the
        development VM). Once a row of the namespace changes (its ``ns_version``), the kept
        rows are brought up to date by evaluating only the rows the changes since touched
        (``RowTable.touched_since``: an agent's write between two recalls is one row), or afresh
        after more changes than that is worth (:meth:`_refreshed`).
        At most :data:`_SCOPES_KEPT` answers are kept, the least recently used dropped first,
        holding :data:`_SCOPE_ROWS_KEPT` rows in all, under keys of at most
        :data:`_SCOPE_KEY_KEPT` bytes. The rows kept are read-only: the searches only read them.

        Raises:
            Invalid: a filter :func:`~kalos_retrievers.filters.validate_filter` refuses
                (BAD_REQUEST, its message).
        """
        bare = flt is None or (isinstance(flt, Mapping) and not flt)  # no filter: the namespace alone
        if key is None or len(key) > _SCOPE_KEY_KEPT or (bare and not self._lists_rows(namespace)):
            if bare:
                self._drop_scope(key)  # (a namespace's list kept while it was listed: stale now)
            return self.eligible(namespace, _filter(flt))
        hit = self.kept(key)
        if hit is not None:
            return hit
        got = self._refreshed(key, flt)
        if got is None:
            got = self.eligible(namespace, _filter(flt), listed=True)
        self._drop_scope(key)  # (stale: replaced, or dropped if this is not kept)
        cands = got[1]
        ns_id = self.rows.ns_id(namespace)
        if ns_id is None or cands is None or len(cands) > _SCOPE_ROWS_KEPT:
            return got
        while self._scopes and (len(self._scopes) >= _SCOPES_KEPT or self._scope_rows + len(cands) > _SCOPE_ROWS_KEPT):
            gone = self._scopes.pop(next(iter(self._scopes)))  # (the least recently used)
            self._scope_rows -= len(gone[2][1])  # type: ignore[arg-type]
        cands.flags.writeable = False
        self._scopes[key] = (ns_id, self.rows.ns_version[ns_id], got, self.rows.change_seq)
        self._scope_rows += len(cands)
        return got

    def _lists_rows(self, namespace: str) -> bool:
        """Whether a search of ``namespace`` without a filter is best given the namespace's
        rows (the index's :meth:`~sidecar.index.Index.wants_rows`): it holds rows, not every
        row below the high-water mark."""
        ns_id = self.rows.ns_id(namespace)
        if ns_id is None:
            return False
        count, high = self.rows.ns_count[ns_id], self.rows.high
        return 0 < count < high and self.index.wants_rows(count, high)

    def _drop_scope(self, key: bytes | None) -> None:
        """Forget the answer kept under ``key``, if any."""
        old = self._scopes.pop(key, None) if key is not None else None
        if old is not None:
            self._scope_rows -= len(old[2][1])  # type: ignore[arg-type]

    def _refreshed(self, key: bytes, flt: Any) -> tuple[int, np.ndarray | None, bool, int] | None:
        """The answer kept under ``key`` brought up to date with the changes since it was kept:
        the rows they touched dropped from it, and those of them now in its namespace that pass
        the filter added (ascending, as :meth:`eligible` gives them). None when there is no
        such answer, the namespace is empty now, or more changes came since than are worth
        following one by one (more than :data:`_REFRESH_MAX` or a 64th of the namespace's rows,
        whichever is more: on the development VM a fresh evaluation of 100k rows took ~0.4 ms,
        following 300 touched rows ~0.19 and 3,000 ~0.65, a review's measurements), or than the
        row table remembers."""
        old = self._scopes.get(key)
        if old is None:
            return None
        ns_id, _, (_, cands, _, _), seq = old
        rt = self.rows
        count = rt.ns_count[ns_id]
        if not count or cands is None or rt.change_seq - seq > max(_REFRESH_MAX, count // 64):
            return None
        touched = rt.touched_since(seq)
        if touched is None:
            return None
        # (rows below the table's capacity, removed ones too; a few, usually: sorted in Python,
        # where numpy's unique and set operations cost ~30 µs a call even for one row)
        if len(touched) <= _REFRESH_MAX:
            touched = np.array(sorted(set(touched.tolist())), np.int64)
        else:
            touched = np.unique(touched)
        mine = touched[rt.ns_of[touched] == ns_id]
        f = _filter(flt)  # (None: no filter, or one of no condition: the namespace's rows)
        now = mine[rt.meta.evaluate(f, mine)] if len(mine) and f is not None else mine
        # both sorted: the touched rows found in the kept ones dropped, those that pass put in
        pos = np.searchsorted(cands, touched)
        found = pos < len(cands)
        found[found] = cands[pos[found]] == touched[found]
        rows = np.delete(cands, pos[found]) if found.any() else cands
        if len(now):
            rows = np.insert(rows, np.searchsorted(rows, now), now)
        self.scope_refreshes += 1
        return ns_id, rows, False, len(rows)

    def kept(self, key: bytes) -> tuple[int, np.ndarray | None, bool, int] | None:
        """The answer :meth:`eligible_for` keeps under ``key`` (a recall's args, which name its
        namespace and filter), if no row of that namespace changed since; else None. (A
        namespace's id is never reused, so the key alone finds it: the caller need not decode
        the args first.)"""
        hit = self._scopes.get(key)
        if hit is None or hit[1] != self.rows.ns_version[hit[0]]:
            return None
        self._scopes[key] = self._scopes.pop(key)  # the most recently used last: evicted last
        return hit[2]

    def recall_slots(self, specs: list[SlotSpec], k: int, namespace: str, flt: Any,
                     check_finite: bool = True, key: bytes | None = None) -> int:  # fmt: skip
        """Answer requests in place (results written into each spec's rows/scores); returns
        k' = min(k, eligible rows), the number of valid results per query.

        ``check_finite=False``: the caller checked each request's queries itself (a batch must
        not fail as a whole because one member's queries are not finite). ``key``: the
        request's args, as :meth:`eligible_for` takes them."""
        kk = self.launch_recall(specs, k, namespace, flt, check_finite, key=key)
        self.finish()
        return kk

    def finish(self) -> None:
        """Wait until the oldest search :meth:`launch_recall` left running has written its
        results."""
        self.index.finish_slots()

    def queues_behind(self, k: int, n: int) -> bool:
        """Whether a recall of ``n`` queries in the default namespace, without a filter, can be
        launched with ``behind=True`` now (see :meth:`Index.queues_behind`)."""
        _, cands, _, eligible = self.eligible("", None)
        kk = min(k, eligible)
        return kk > 0 and cands is None and self.index.queues_behind(n, kk, self.rows.high)

    def launch_recall(self, specs: list[SlotSpec], k: int, namespace: str, flt: Any,
                      check_finite: bool = True, behind: bool = False, key: bytes | None = None) -> int:  # fmt: skip
        """:meth:`recall_slots` without waiting: the results are in the slots after
        :meth:`finish` (a backend that cannot search asynchronously has finished already).
        Nothing may change rows in between. ``behind``: queued behind the search left running
        (:meth:`queues_behind` must have said it can be); :meth:`finish` then finishes the
        older one first."""
        ns_id, cands, dense, n = self.eligible_for(namespace, flt, key)
        kk = min(k, n)
        if kk and check_finite:
            for sp in specs:
                if not np.isfinite(sp.queries).all():
                    raise Invalid(Status.BAD_REQUEST, "queries contain NaN or infinity")
        if kk and behind:
            self.index.launch_slots(specs, kk, self.rows.high, ns_id, cands, dense, behind=True)
        elif kk:
            self.index.launch_slots(specs, kk, self.rows.high, ns_id, cands, dense)
        return kk

    def launch_queued(self, slots: list[int], table: np.ndarray, k: int) -> int:
        """:meth:`launch_recall` with ``behind=True`` of one query per slot of ``slots`` in the
        default namespace without a filter (the dispatcher's batch-1 members, their queries
        checked already), through the index's ``launch_behind_slots``: each slot's addresses
        are row ``slot`` of ``table``, so no spec is made before the launch. Returns k'."""
        ns_id, _, dense, n = self.eligible("", None)
        kk = min(k, n)
        if kk:
            self.index.launch_behind_slots(slots, table, kk, self.rows.high, NS_ANY if dense else ns_id)
        return kk

    def doorbell_useful(self) -> bool:
        """Whether starting the index's resident kernel now could answer anything: it has one,
        it is stopped, and the default namespace, or the namespace of a scope it would serve
        (:meth:`note_bell_space`), has rows (it declines every recall of an empty one, each a
        round trip back to the sidecar)."""
        idx = self.index
        if not idx.doorbell_k or idx.doorbell_running:
            return False
        noted = self._bell_spaces.values()
        return self.holds_rows("") or any(sc is not None and self.holds_rows(sc[0]) for sc in noted)

    def note_bell_space(self, namespace: str, flt: Any = None, key: bytes | None = None) -> bool:
        """A scope recalled in alone (the dispatcher's lone recalls): ``namespace``, with the
        filter ``flt`` (decoded JSON, valid) if any, whose recalls' args are ``key`` (exactly as
        clients write them: the kernel compares them byte for byte; by default
        :func:`encode_recall_args` of the namespace alone). The resident kernel serves the
        index's ``doorbell_spaces`` most recent of them, from its next start, besides the
        default namespace. Returns whether it was noted already."""
        if key is None:
            key = encode_recall_args(namespace, None)
        spaces = self._bell_spaces
        was = key in spaces
        spaces[key] = (namespace, flt)
        self._seen_now(key)
        if was:
            spaces.move_to_end(key)
            return True
        self._trim_bell_spaces()
        return False

    def _trim_bell_spaces(self) -> None:
        spaces = self._bell_spaces
        while len(spaces) > self.index.doorbell_spaces:
            spaces.popitem(last=False)

    def _seen_now(self, key: bytes) -> None:
        seen = self._bell_seen
        seen[key] = time.monotonic_ns()
        seen.move_to_end(key)
        if len(seen) > _BELL_SEEN_MAX:
            seen.popitem(last=False)

    def note_bell_args(self, key: bytes) -> bool:
        """:meth:`note_bell_space` of a scope known by its args alone, not decoded: a scope
        recalled once, or one of more than the kernel serves recalled in turn, is never
        decoded (a filter's JSON decoded and checked cost ~10 µs a recall on the development
        VM). Returns whether it was noted already (its :meth:`bell_scope` then says whether
        it was decoded since)."""
        spaces = self._bell_spaces
        self._seen_now(key)
        if key in spaces:
            return True
        spaces[key] = None
        self._trim_bell_spaces()
        return False

    def bell_known(self) -> frozenset[bytes]:
        """The args of the noted scopes that are decoded (recalled more than once): those the
        resident kernel serves from its next start, where their namespaces hold rows."""
        return frozenset(k for k, v in self._bell_spaces.items() if v is not None)

    def bell_noted(self, key: bytes) -> bool:
        """Whether a scope is noted under ``key`` (decoded or not)."""
        return key in self._bell_spaces

    def bell_recent(self, since_ns: int) -> int:
        """How many scopes were noted (:meth:`note_bell_space`, :meth:`note_bell_args`) at or
        after ``since_ns`` (monotonic ns), those dropped since for newer ones too (up to
        :data:`_BELL_SEEN_MAX`): the scopes handed to the sidecar alone lately, which compete
        for the kernel's table (those the kernel answers never reach it)."""
        return sum(1 for t in self._bell_seen.values() if t >= since_ns)

    def bell_refused(self, key: bytes) -> bool:
        """Whether :meth:`forget_bell_space` dropped the scope ``key`` (of the last
        :data:`_BELL_SEEN_MAX` it dropped)."""
        return key in self._bell_refused

    def forget_bell_space(self, key: bytes) -> None:
        """Drop the scope noted under ``key`` (args that do not decode, or a filter refused),
        and remember it was (:meth:`bell_refused`)."""
        self._bell_spaces.pop(key, None)
        refused = self._bell_refused
        refused[key] = None
        refused.move_to_end(key)
        if len(refused) > _BELL_SEEN_MAX:
            refused.popitem(last=False)

    def bell_scope(self, key: bytes) -> tuple[str, Any] | None:
        """(namespace, filter) of the scope noted under ``key``, if it is noted and decoded:
        its args need not be decoded and checked again."""
        return self._bell_spaces.get(key)

    def holds_rows(self, namespace: str) -> bool:
        """Whether ``namespace`` has live rows now."""
        ns = self.rows.ns_id(namespace)
        return ns is not None and bool(self.rows.ns_count[ns])

    def bell_spaces(self) -> list[BellScope]:
        """The noted scopes (:meth:`note_bell_space`) whose namespace holds rows now, the most
        recent first: a filter's with the rows it keeps now (:meth:`eligible_for`, its kept
        answer: read-only, the same array while no row of the namespace changes)."""
        out = []
        for key in reversed(self._bell_spaces):
            scope = self._bell_spaces[key]
            if scope is None:  # (seen once: not served before it is recalled again)
                continue
            namespace, flt = scope
            ns = self.rows.ns_id(namespace)
            if ns is None or not self.rows.ns_count[ns]:
                continue
            try:
                _, rows, _, _ = self.eligible_for(namespace, flt, key)
            except Invalid:  # (noted valid: a filter the rows cannot answer now goes to the sidecar)
                continue
            # (rows None: the namespace alone, no filter or one of no condition, ``{}``; without a
            # filter, rows are the namespace's where the index wants them: Index.wants_rows)
            out.append(BellScope(key, ns) if rows is None else BellScope(key, ns, rows, self.rows.change_seq, not flt))
        return out

    def resume_doorbell(self) -> None:
        """Restart the index's resident kernel, if it has one, over the default namespace as
        the rows are now (the kernel is stopped whenever they change), and the noted scopes
        (:meth:`note_bell_space`) whose namespaces hold rows (:meth:`bell_spaces`)."""
        idx = self.index
        if not idx.doorbell_k or idx.doorbell_running:
            return
        ns = self.rows.ns_id("")
        if ns is None or not self.rows.ns_count[ns]:
            ns_arg = NS_NONE
        elif self.rows.dense(ns):
            ns_arg = NS_ANY
        else:
            ns_arg = ns
        idx.resume_doorbell(self.rows.high, ns_arg, self.bell_spaces(), self.rows.touched_since)

    def compact(self, max_moves: int = 4096) -> int:
        """Move up to ``max_moves`` live rows from the tail into holes left by deletes, so the
        scanned range [0, high) stays dense. Returns how many rows moved."""
        rt = self.rows
        holes: list[int] = []
        while rt.free and len(holes) < max_moves:
            h = heapq.heappop(rt.free)
            if h < rt.high and rt.ns_of[h] < 0:
                holes.append(h)
        src: list[int] = []
        r = rt.high - 1
        for h in holes:
            while r > h and rt.ns_of[r] < 0:
                r -= 1
            if r <= h:
                break
            src.append(r)
            r -= 1
        dst = holes[: len(src)]
        for h in holes[len(src) :]:
            heapq.heappush(rt.free, h)
        if not src:
            return 0
        self.index.move_rows(np.array(src, np.int64), np.array(dst, np.int64))
        for a, b in zip(src, dst, strict=True):
            rt.move(a, b)
        rt.trim()
        return len(src)

    def fragmentation(self) -> int:
        """Empty rows below the high-water mark (what a compaction could reclaim)."""
        return self.rows.high - self.rows.live

    def recall(self, queries: np.ndarray, k: int, namespace: str, flt: Any) -> tuple[np.ndarray, np.ndarray]:
        """Rows (q, k') and scores (q, k') with k' = min(k, eligible rows)."""
        ns_id, cands, dense, n = self.eligible_for(namespace, flt)
        kk = min(k, n)
        if kk == 0:
            return np.empty((len(queries), 0), np.int32), np.empty((len(queries), 0), np.float32)
        if not np.all(np.isfinite(queries)):
            raise Invalid(Status.BAD_REQUEST, "queries contain NaN or infinity")
        return self.index.search(queries, kk, self.rows.high, ns_id, cands, dense)

    def docs(self, rows: np.ndarray) -> list[bytes]:
        d = self.rows.docs
        return [d[r] for r in rows.reshape(-1).tolist()]  # type: ignore[misc]

    def get(self, args: Mapping[str, Any]) -> np.ndarray:
        namespace = _namespace(args.get("namespace", ""))
        ids = args.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise Invalid(Status.BAD_REQUEST, "ids must be a list of strings")
        ns_id = self.rows.ns_id(namespace)
        if ns_id is None:
            return np.empty(0, np.int64)
        found = [self.rows.lookup(ns_id, i) for i in ids]
        return np.array([r for r in found if r is not None], np.int64)

    def scan(self, args: Mapping[str, Any]) -> np.ndarray:
        namespace = _namespace(args.get("namespace", ""))
        flt = _filter(args.get("filter"))
        limit, offset = args.get("limit", 100), args.get("offset", 0)
        if not (type(limit) is int and type(offset) is int and limit >= 0 and offset >= 0):  # (true is no limit)
            raise Invalid(Status.BAD_REQUEST, "limit and offset must be ints >= 0")
        ns_id = self.rows.ns_id(namespace)
        if ns_id is None:
            return np.empty(0, np.int64)
        order = self._scan_order(ns_id)
        if flt is not None:
            order = order[self.rows.meta.evaluate(flt, order)]
        return order[offset : offset + limit].copy()

    def _scan_order(self, ns_id: int) -> np.ndarray:
        """A namespace's rows oldest first (by created_at, then id), kept until one of its rows
        changes: paging through 300k rows sorted them all again for every page (~75 ms a page
        on the development VM)."""
        version = self.rows.ns_version[ns_id]
        hit = self._orders.get(ns_id)
        if hit is not None and hit[0] == version:
            return hit[1]
        rows, ids, created = self.rows.rows_of(ns_id), self.rows.ids, self.rows.created
        order = np.array(sorted(rows.tolist(), key=lambda r: (created[r], ids[r])), np.int64)
        if len(self._orders) >= _ORDERS_KEPT:
            del self._orders[next(iter(self._orders))]  # (the oldest kept)
        self._orders[ns_id] = (version, order)
        return order

    def count(self, args: Mapping[str, Any]) -> int:
        namespace = args.get("namespace")
        flt = _filter(args.get("filter"))
        if namespace is None:
            if flt is not None:
                raise Invalid(Status.BAD_REQUEST, "a count with a filter needs a namespace")
            return self.rows.live
        ns_id = self.rows.ns_id(_namespace(namespace))
        if ns_id is None:
            return 0
        if flt is None:
            return self.rows.ns_count[ns_id]
        rows = self.rows.rows_of(ns_id)
        return int(self.rows.meta.evaluate(flt, rows).sum())

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        if not len(rows):
            return np.empty((0, self.dim), np.float32)
        return self.index.vectors(rows.reshape(-1))


def _namespace(ns: Any) -> str:
    if not isinstance(ns, str) or len(_utf8(ns, "namespace")) > 255:
        raise Invalid(Status.BAD_REQUEST, "namespace must be a string of at most 255 bytes")
    return ns


def _utf8(s: str, what: str) -> bytes:
    """``s`` as UTF-8; a string JSON decoded with a lone surrogate (``"\\ud800"``) has none,
    and is refused as the request's fault (not an internal error, nor a failed commit)."""
    try:
        return s.encode()
    except UnicodeEncodeError as e:
        raise Invalid(Status.BAD_REQUEST, f"{what} is not valid Unicode (a lone surrogate at {e.start})") from None


def _filter(flt: Any) -> dict[str, Any] | None:
    try:
        return validate_filter(flt)
    except (TypeError, ValueError) as e:
        raise Invalid(Status.BAD_REQUEST, str(e)) from None

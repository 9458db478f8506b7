"""Row bookkeeping on the host, shared by every index backend.

The index (CPU or GPU) stores vectors by *row number*; this table knows what each row is: its
namespace, id, pre-encoded document (the bytes a recall copies into the response) and
metadata (as filter columns). Deleted rows go on a free list and are reused by later inserts,
so the scanned range stays dense; the GPU backend additionally compacts the tail.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kalos_retrievers.arena import ArenaWriter

from .metadata import MetadataColumns

log = logging.getLogger("kalos.sidecar")

# The rows touched by the last CHANGES_KEPT changes (RowTable.touched_since), so that a filter's
# kept candidates can be brought up to date by evaluating those rows alone (Service.eligible_for)
CHANGES_KEPT = 1 << 16


def _doubled(capacity: int, need: int) -> int:
    """The capacity the table grows to for ``need`` rows: doubled (1,024 at least) until they fit."""
    while capacity < need:
        capacity = max(1024, 2 * capacity)
    return capacity


class RowTable:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self.ns_of = np.full(capacity, -1, np.int32)  # -1: empty row
        self.ids: list[str | None] = [None] * capacity
        self.docs: list[bytes | None] = [None] * capacity
        self.created = np.zeros(capacity, np.float64)
        self.meta = MetadataColumns(capacity)
        self.key_row: dict[tuple[int, str], int] = {}
        self.ns_ids: dict[str, int] = {}
        self.ns_names: list[str] = []
        self.ns_count: list[int] = []
        # per namespace, bumped by every change of its rows (a scan's cached order is as old)
        self.ns_version: list[int] = []
        self.free: list[int] = []
        # every row a change touched (set, remove, both ends of a move), in a ring of
        # CHANGES_KEPT: change number c touched row changes[c % CHANGES_KEPT]
        self.changes = np.zeros(CHANGES_KEPT, np.int64)
        self.change_seq = 0  # changes so far
        self.high = 0  # rows >= high are all empty
        self.live = 0
        # the document arena clients read (kalos_retrievers.arena), kept in step with `docs`;
        # on_arena_moved(version) runs when it moved to a new version
        self.arena: ArenaWriter | None = None
        self.on_arena_moved: Callable[[int], None] = lambda version: None

    # ------------------------------------------------------------------ namespaces
    def ns_id(self, name: str, create: bool = False) -> int | None:
        i = self.ns_ids.get(name)
        if i is None and create:
            i = self.ns_ids[name] = len(self.ns_names)
            self.ns_names.append(name)
            self.ns_count.append(0)
            self.ns_version.append(0)
        return i

    def namespaces(self) -> dict[str, int]:
        return {n: c for n, c in zip(self.ns_names, self.ns_count, strict=True) if c}

    # ------------------------------------------------------------------ rows
    def lookup(self, ns: int, id_: str) -> int | None:
        return self.key_row.get((ns, id_))

    def allocate(self) -> int:
        """A free row (the lowest one), growing the table when none is free."""
        while self.free:
            row = heapq.heappop(self.free)
            if row < self.high and self.ns_of[row] < 0:
                return row
        if self.high == self.capacity:
            self.grow(_doubled(self.capacity, self.capacity + 1))
        self.high += 1
        return self.high - 1

    def reserve(self, new_rows: int) -> None:
        """Grow now as :meth:`allocate` would for ``new_rows`` more rows (before a commit: a
        MemoryError then refuses the write rather than following it). Only the holes below
        ``high`` count as free: a trim can leave rows at or above it in the free list, which
        allocate discards."""
        holes = min(len(self.free), self.high - self.live)
        self.grow(_doubled(self.capacity, self.high + max(0, new_rows - holes)))

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        extra = capacity - self.capacity
        # every new array first, then all of them at once: a MemoryError part-way (answered
        # CAPACITY, the sidecar serving on) must leave the table as it was, not its arrays of
        # different lengths, which failed every later growth
        ns_of = np.concatenate([self.ns_of, np.full(extra, -1, np.int32)])
        created = np.concatenate([self.created, np.zeros(extra)])
        pad: list[None] = [None] * extra
        self.meta.grow(capacity)  # (all or nothing itself)
        self.ns_of, self.created = ns_of, created
        self.ids.extend(pad)
        self.docs.extend(pad)
        self.capacity = capacity

    def set(self, row: int, ns: int, id_: str, doc: bytes, metadata: Mapping[str, Any],
            created_at: float) -> None:  # fmt: skip
        if self.ns_of[row] < 0:
            self.live += 1
            self.ns_count[ns] += 1
        elif self.ns_of[row] != ns:  # never happens: a key keeps its row
            raise AssertionError("row reassigned across namespaces")
        self.ns_of[row] = ns
        self.ns_version[ns] += 1
        self._touch(row)
        self.ids[row] = id_
        self.docs[row] = doc
        if self.arena is not None:
            self._in_arena(self.arena.put, row, doc)
        self.created[row] = created_at
        self.meta.set(row, metadata)
        self.key_row[(ns, id_)] = row

    def _in_arena(self, change: Callable[..., bool | None], *args: Any) -> None:
        """Apply one change to the arena. The arena is a copy for clients: if it cannot follow
        (no room left in /dev/shm for a larger version), it is dropped, never the row table's
        own change; recalls then carry their documents in the response again."""
        arena = self.arena
        assert arena is not None
        try:
            if change(*args):
                self.on_arena_moved(arena.version)
        except Exception:
            log.exception("the document arena cannot follow the row table; dropping it")
            self.arena = None
            try:  # first, while it is still mapped: the GPU backend unregisters its row table
                self.on_arena_moved(0)
            except Exception:
                log.exception("dropping the document arena")
            arena.close()

    def remove(self, row: int) -> None:
        ns = int(self.ns_of[row])
        if ns < 0:
            return
        id_ = self.ids[row]
        del self.key_row[(ns, id_)]  # type: ignore[arg-type]
        self.ns_of[row] = -1
        self.ns_version[ns] += 1
        self._touch(row)
        self.ids[row] = None
        self.docs[row] = None
        if self.arena is not None:
            self._in_arena(self.arena.clear, row)
        self.meta.clear(row)
        self.ns_count[ns] -= 1
        self.live -= 1
        if row == self.high - 1:
            self.high -= 1
            self.trim()
        else:
            heapq.heappush(self.free, row)

    def trim(self) -> None:
        # keep `high` tight so scans skip the empty tail; free rows above it are dropped
        # lazily by allocate()
        while self.high > 0 and self.ns_of[self.high - 1] < 0:
            self.high -= 1

    def move(self, src: int, dst: int) -> None:
        """Move a live row to an empty one (compaction)."""
        ns = int(self.ns_of[src])
        assert ns >= 0 and self.ns_of[dst] < 0
        self.ns_of[dst], self.ns_of[src] = ns, -1
        self.ns_version[ns] += 1
        self._touch(src)
        self._touch(dst)
        self.ids[dst], self.ids[src] = self.ids[src], None
        self.docs[dst], self.docs[src] = self.docs[src], None
        if self.arena is not None:
            self._in_arena(self.arena.move, src, dst)
        self.created[dst] = self.created[src]
        self.meta.move(src, dst)
        self.key_row[(ns, self.ids[dst])] = dst  # type: ignore[index]

    def _touch(self, row: int) -> None:
        self.changes[self.change_seq % CHANGES_KEPT] = row
        self.change_seq += 1

    def touched_since(self, seq: int) -> np.ndarray | None:
        """The rows the changes since ``change_seq`` was ``seq`` touched (in any namespace;
        a row once per change, so possibly repeated), or None when more than CHANGES_KEPT
        changes came since (the caller then looks at every row)."""
        n = self.change_seq - seq
        if n < 0 or n > CHANGES_KEPT:
            return None
        i, j = seq % CHANGES_KEPT, self.change_seq % CHANGES_KEPT
        if i < j or n == 0:
            return self.changes[i:j].copy()
        return np.concatenate([self.changes[i:], self.changes[:j]])

    def rows_of(self, ns: int) -> np.ndarray:
        """Live rows of a namespace, ascending."""
        return np.flatnonzero(self.ns_of[: self.high] == ns).astype(np.int64)

    def dense(self, ns: int) -> bool:
        """True when rows [0, high) all belong to ``ns`` (no mask needed to search it)."""
        return self.ns_count[ns] == self.high

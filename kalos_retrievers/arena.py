"""The document arena: every row's encoded document in shared memory, readable by clients.

A recall answered by the GPU's resident kernel (see ``docs/gpu-notes.md``) has no sidecar
Python on its path, so nobody copies the hits' documents into the response. Instead the
sidecar keeps each row's document (the same bytes a response blob carries: id, text,
metadata) in a second segment, ``/kalos-NAME-docs.V``, and the response names, next to each
hit's row, where its document is; the client reads the document itself, and never returns
one the search did not see.

Layout (all little-endian)::

    [ header 64 B ][ row table: rows_cap x 16 B ][ heap: heap_size B ]

    header   magic "KALOSDOC", u32 version (= ARENA_VERSION), u32 pad, u64 rows_cap,
             u64 heap_size, u64 heap_used, u64 live_bytes, 16 B reserved
    entry    u64 offset (into the heap), u32 length, u32 gen

A response names each hit's document in one of two ways. Protocol v1.3 clients ask for the
hit's whole entry (flag ARENA_ENTRIES): the answer carries the arena version and a copy of
each entry, made while nothing wrote to the arena (:meth:`ArenaView.entry_docs`), and the
client copies the bytes it points to. Older clients ask for generations: an entry is a
seqlock (the writer makes ``gen`` odd, writes offset and length, then makes it even again),
and a reader takes the entry only if it read the same even ``gen`` before and after, and that
``gen`` is the one the response named (:meth:`ArenaView.docs`); a row rewritten after the
answer shows another generation, and the client asks again through the sidecar. Document
bytes are appended to the heap and never rewritten in place, so bytes an entry points to
never change (an entries answer therefore keeps naming the document the search saw, even
after its row is rewritten). When the heap or the table
is full the sidecar writes a larger arena (live documents only) under the next version ``V+1``,
publishes ``V+1`` in the main segment's header and unlinks the old name; clients map the new
one when they see the version change (an old mapping stays readable, and its generations no
longer match rows rewritten since, so nothing stale is returned).

x86-64 store ordering makes the seqlock safe without fences in Python; elsewhere the client
does not use the arena (it asks for documents in the response instead).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Sequence
from typing import Final

import numpy as np

from .protocol import DocViews

ARENA_MAGIC: Final = b"KALOSDOC"
ARENA_VERSION: Final = 1
ARENA_HEADER: Final = struct.Struct("<8sIIQQQQ16x")  # magic version pad rows_cap heap_size heap_used live_bytes
ARENA_HEADER_SIZE: Final = 64
ENTRY: Final = struct.Struct("<QII")  # offset length gen
ENTRY_SIZE: Final = 16
ENTRY_DTYPE: Final = np.dtype([("off", "<u8"), ("len", "<u4"), ("gen", "<u4")])
assert ENTRY_DTYPE.itemsize == 16 and ENTRY_DTYPE.fields["gen"][1] == 12  # (ArenaWriter.refs slices these)
_GEN: Final = struct.Struct("<I")
_VERSION: Final = struct.Struct("<Q")  # an ARENA_ENTRIES answer's first 8 bytes
_ENTRIES: dict[int, struct.Struct] = {}  # n -> n entries (offset, length, gen) after the version
_GEN_AT: Final = 12  # byte offset of gen inside an entry
SMALL_READ: Final = 32  # a recall's hits up to this many are checked one by one (ArenaView.docs)


def arena_name(name: str, version: int) -> str:
    """The shared-memory name of version ``version`` of sidecar ``name``'s arena."""
    return f"/kalos-{name}-docs.{version}"


def arena_size(rows_cap: int, heap_size: int) -> int:
    """Bytes of an arena segment: whole pages (the GPU backend registers its row table)."""
    return -(-(ARENA_HEADER_SIZE + ENTRY_SIZE * rows_cap + heap_size) // 4096) * 4096


def heap_offset(rows_cap: int) -> int:
    return ARENA_HEADER_SIZE + ENTRY_SIZE * rows_cap


def _ints(xs: np.ndarray | Sequence[int]) -> list[int]:
    return xs.tolist() if isinstance(xs, np.ndarray) else [int(x) for x in xs]


class ArenaView:
    """Reads documents from a mapped arena (the client's side). Pure: it is given the bytes."""

    __slots__ = ("_buf", "_copy", "_heap", "_heap_size", "_table", "fast", "rows_cap", "version")

    def __init__(self, buf: mmap.mmap | memoryview | bytearray, version: int) -> None:
        magic, v, _, rows_cap, heap_size, _, _ = ARENA_HEADER.unpack_from(buf, 0)
        if magic != ARENA_MAGIC or v != ARENA_VERSION:
            raise ValueError(f"not a Kalos document arena (magic {magic!r}, version {v})")
        if len(buf) < arena_size(rows_cap, heap_size):
            raise ValueError("document arena is shorter than its header says")
        self._buf = mv = memoryview(buf)
        # slicing an mmap gives bytes in one step (copies of small documents: 0.04 us, not 0.1);
        # other buffers (tests) through the view (bound to `mv`, not `self`: no reference cycle)
        self._copy = buf.__getitem__ if isinstance(buf, mmap.mmap) else lambda s: bytes(mv[s])
        self._heap = heap_offset(rows_cap)
        self._heap_size = heap_size
        self._table = np.frombuffer(self._buf, ENTRY_DTYPE, count=rows_cap, offset=ARENA_HEADER_SIZE)
        self.rows_cap = rows_cap
        self.version = version
        # what the client's C path (_fastpath.recall1) needs to copy documents as entry_docs does
        self.fast = (mv, (self._heap, heap_size, version))

    def get(self, row: int, gen: int) -> bytes | None:
        """Row ``row``'s document (a copy) if its generation is ``gen`` (and no write is under
        way); else None: the row changed since the answer named it, or is being written."""
        docs = self._docs_one_by_one([row], [gen])
        return None if docs is None else docs[0]

    def docs(self, rows: np.ndarray | Sequence[int], gens: np.ndarray | Sequence[int]) -> DocViews | list[bytes] | None:
        """The documents of ``rows`` at generations ``gens`` (a recall's hits, in order), or
        None if any one of them changed since (see :meth:`get`).

        The bytes an entry points to never change (the heap is append-only, and a new version
        is a new segment), so once an entry has been read between two equal even reads of its
        generation, its bytes are the document the answer named, at any later time. Up to
        ``SMALL_READ`` hits (a batch-1 recall) are checked one by one and copied (a list of
        bytes), so that the result holds no reference to the arena. More are checked in three
        vectorized passes (every generation, every offset and length, every generation again,
        which keeps the seqlock's order row by row) and returned as views into the arena: 24 us
        instead of 190 for 640 hits on the development VM. Such a result keeps its arena
        version mapped until it is dropped, after the sidecar has moved to a newer one.
        """
        if len(rows) != len(gens):
            raise ValueError(f"{len(rows)} rows but {len(gens)} generations")
        if len(rows) <= SMALL_READ:
            return self._docs_one_by_one(_ints(rows), _ints(gens))
        r = np.asarray(rows, np.int64)
        if int(r.min()) < 0 or int(r.max()) >= self.rows_cap:
            return None
        gen = self._table["gen"]
        g1 = gen[r]  # the three passes in this order: see the seqlock in the module docstring
        off, length = self._table["off"][r], self._table["len"][r]
        g2 = gen[r]
        if not (np.array_equal(g1, gens) and np.array_equal(g2, g1)) or (g1 & 1).any() or not length.all():
            return None
        starts = off + np.uint64(self._heap)
        return DocViews(self._buf, starts.tolist(), (starts + length).tolist())

    def entry_docs(self, blob: bytes | memoryview, n: int) -> DocViews | list[bytes] | None:
        """The documents an ARENA_ENTRIES answer names (protocol v1.3), or None.

        ``blob`` is the arena version the answer was made from (u64), then ``n`` entries
        (offset, length, generation), copied from that version's row table while nothing
        wrote to it: the resident kernel runs only while the sidecar writes nothing, and the
        sidecar's own answers are made by the writer itself. The heap of a version is never
        rewritten, so an entry alone locates its document, now and later: no read of the row
        table and no seqlock (~1.6 us less per batch-1 recall of 10 hits than :meth:`docs` on
        the development VM). Up to ``SMALL_READ`` documents are copied, more are views (as in
        :meth:`docs`).

        None: the answer names another version than this view's (the caller maps the current
        one and asks it), or an entry that holds no document (a row the arena does not cover
        yet: the caller asks again with documents inline). An entry pointing outside the heap
        is not a valid answer either (None: nothing is read there).

        Raises:
            ValueError: ``blob`` is not ``8 + 16 * n`` bytes.
        """
        if len(blob) != 8 + ENTRY_SIZE * n:
            raise ValueError(f"{len(blob)} bytes are not an arena version and {n} entries")
        if not n:
            return []
        if _VERSION.unpack_from(blob)[0] != self.version:
            return None
        heap, size = self._heap, self._heap_size
        if n <= SMALL_READ:
            unpack = _ENTRIES.get(n)
            if unpack is None:
                unpack = _ENTRIES[n] = struct.Struct("<" + "QII" * n)
            vals = unpack.unpack_from(blob, 8)
            copy, out = self._copy, []
            for i in range(0, 3 * n, 3):
                off, length = vals[i], vals[i + 1]
                if not length or off + length > size or vals[i + 2] & 1:
                    return None
                out.append(copy(slice(heap + off, heap + off + length)))
            return out
        e = np.frombuffer(blob, ENTRY_DTYPE, n, 8)
        off, length = e["off"], e["len"]
        if not length.all() or (e["gen"] & 1).any() or int(off.max()) > size:
            return None
        starts = off + np.uint64(heap)  # (off <= size: no wrap-around)
        ends = starts + length
        if int(ends.max()) > heap + size:
            return None
        return DocViews(self._buf, starts.tolist(), ends.tolist())

    def current_docs(self, rows: Sequence[int]) -> list[bytes] | None:
        """The documents ``rows`` hold now (copies), each read under its entry's seqlock (gen
        read, even, then offset and length, then gen again, unchanged); None if a row is out of
        range, has no document, is being written, or names bytes outside the heap. For an
        answer whose rows cannot have changed since it was made (the carousel's direct
        answers: the sidecar stops the kernel, and says so in the header, before it writes
        rows; the caller checks that after this read), where no generation came with the
        answer. (The client's C reader, ``_fastpath.car_answer1``, does the same.)"""
        buf, heap, hsize, cap, copy = self._buf, self._heap, self._heap_size, self.rows_cap, self._copy
        entry, gen_of = ENTRY.unpack_from, _GEN.unpack_from
        out = []
        for row in rows:
            if not 0 <= row < cap:
                return None
            at = ARENA_HEADER_SIZE + ENTRY_SIZE * row
            g0 = gen_of(buf, at + _GEN_AT)[0]  # (before the entry: with no generation to compare, the
            off, length, _ = entry(buf, at)  # seqlock's both reads are needed; x86-64 keeps loads in order)
            if g0 & 1 or not length or off + length > hsize or gen_of(buf, at + _GEN_AT)[0] != g0:
                return None
            out.append(copy(slice(heap + off, heap + off + length)))
        return out

    def _docs_one_by_one(self, rows: list[int], gens: list[int]) -> list[bytes] | None:
        # per row the seqlock of the module docstring: offset, length and gen read together,
        # then gen again (rewritten while we read the entry?)
        buf, heap, hsize, cap, copy = self._buf, self._heap, self._heap_size, self.rows_cap, self._copy
        entry, gen_of = ENTRY.unpack_from, _GEN.unpack_from
        out = []
        for row, gen in zip(rows, gens, strict=True):
            if not 0 <= row < cap:
                return None
            at = ARENA_HEADER_SIZE + ENTRY_SIZE * row
            off, length, g1 = entry(buf, at)
            if g1 != gen or g1 & 1 or not length or off + length > hsize or gen_of(buf, at + _GEN_AT)[0] != g1:
                return None
            out.append(copy(slice(heap + off, heap + off + length)))
        return out


class ArenaWriter:
    """Keeps the arena (the sidecar's side): one writer, any number of readers.

    ``open_segment(version, size)`` creates the segment of that version and returns a writable
    buffer over it (the sidecar's makes ``/kalos-NAME-docs.V``, mode 0600); ``unlink(version)``
    removes an old one. Tests pass bytearrays.
    """

    def __init__(self, open_segment, unlink, rows_cap: int = 1024, heap_size: int = 1 << 20) -> None:  # type: ignore[no-untyped-def]
        self._open, self._unlink = open_segment, unlink
        self.version = 0
        self.buf: mmap.mmap | bytearray | None = None
        self.rows_cap = 0
        self.heap_size = 0
        self.heap_used = 0
        self.live_bytes = 0
        self._off = self._len = self._gen = np.zeros(0, np.uint32)
        self._table = np.zeros(0, ENTRY_DTYPE)
        self._table_b = memoryview(self._table.view(np.uint8))  # the table's bytes (refs of a few rows)
        self._retired: mmap.mmap | bytearray | None = None  # the last version, still mapped
        # bumped by every change to the row table: the GPU backend copies the table to the
        # device for its resident kernel, and only when this moved since the last copy
        self.changes = 0
        self._remap(max(16, rows_cap), max(4096, heap_size))

    # ------------------------------------------------------------------ reading back
    def gens(self, rows: np.ndarray | list[int]) -> np.ndarray:
        """The current generation of each row (uint32)."""
        return self._gen[np.asarray(rows, np.int64)]

    @property
    def table_bytes(self) -> memoryview:
        """The row table's bytes (``rows_cap`` entries of 16 bytes), as :meth:`refs` slices
        them: the sidecar's C answer path (sidecar/_hotpath.c) reads its rows' entries here."""
        return self._table_b

    def refs(self, rows: np.ndarray | list[int], entries: bool) -> bytes:
        """What an ARENA_DOCS answer's blob carries for ``rows`` (all below ``rows_cap``):
        their generations (u32 each) or, with ``entries`` (flag ARENA_ENTRIES), this version
        (u64) and then their whole entries (16 bytes each: see :meth:`ArenaView.entry_docs`).

        ``rows`` as a list (a batch-1 answer, a few rows): sliced from the table's bytes in
        Python, with no numpy call, which after a CPU sidecar's scan has evicted the caches
        costs several µs to dispatch (benchmarks/dispatcher_batch.py --cold). Rows must then
        be non-negative, as the dispatcher checks."""
        if isinstance(rows, list):
            t = self._table_b
            if entries:
                return _VERSION.pack(self.version) + b"".join([t[16 * r : 16 * r + 16] for r in rows])
            return b"".join([t[16 * r + 12 : 16 * r + 16] for r in rows])  # gen: the entry's last u32
        r = np.asarray(rows, np.int64)
        if entries:
            return _VERSION.pack(self.version) + self._table[r].tobytes()
        return self._gen[r].tobytes()

    def refs_each(self, rows: np.ndarray, entries: bool) -> list[bytes]:
        """:meth:`refs` of each row of the 2-D ``rows`` (the members of a batch), gathered
        in one pass."""
        if entries:
            version = _VERSION.pack(self.version)
            return [version + t.tobytes() for t in self._table[rows]]
        return [g.tobytes() for g in self._gen[rows]]

    def held(self, rows: np.ndarray) -> bool:
        """Whether every one of ``rows`` (all below ``rows_cap``) holds a document."""
        return bool(self._len[rows].all())

    def held_rows(self, rows: np.ndarray) -> np.ndarray:
        """Per row of the 2-D ``rows`` (all below ``rows_cap``): whether each of its rows holds
        a document."""
        return self._len[rows].all(axis=1)

    def get(self, row: int) -> bytes | None:
        """Row ``row``'s document as stored (None: no document)."""
        if row >= self.rows_cap or not self._len[row]:
            return None
        h = heap_offset(self.rows_cap) + int(self._off[row])
        return bytes(self.buf[h : h + int(self._len[row])])  # type: ignore[index]

    # ------------------------------------------------------------------ writing
    def put(self, row: int, doc: bytes) -> bool:
        """Store row ``row``'s document; True when that moved the arena to a new version."""
        moved = self._fit(row, len(doc))
        off = self.heap_used
        h = heap_offset(self.rows_cap) + off
        self.buf[h : h + len(doc)] = doc  # type: ignore[index]
        self.heap_used += len(doc)
        self.live_bytes += len(doc) - int(self._len[row])
        self._entry(row, off, len(doc))
        self._sync_header()
        return moved

    def clear(self, row: int) -> None:
        if row >= self.rows_cap or not self._len[row]:
            return
        self.live_bytes -= int(self._len[row])
        self._entry(row, 0, 0)
        self._sync_header()

    def move(self, src: int, dst: int) -> bool:
        """Row ``src``'s document now belongs to row ``dst`` (compaction); True when the arena
        moved to a new version."""
        moved = self._fit(max(src, dst), 0)
        off, length = int(self._off[src]), int(self._len[src])
        self.live_bytes -= int(self._len[dst])
        self._entry(dst, off, length)
        self._entry(src, 0, 0)
        self._sync_header()
        return moved

    def close(self, unlink: bool = True) -> None:
        self._off = self._len = self._gen = np.zeros(0, np.uint32)
        self._table = np.zeros(0, ENTRY_DTYPE)
        self._table_b = memoryview(self._table.view(np.uint8))
        _close(self.buf)
        _close(self._retired)
        self.buf = self._retired = None
        if unlink and self.version:
            self._unlink(self.version)
            self.version = 0

    # ------------------------------------------------------------------ internals
    def _entry(self, row: int, off: int, length: int) -> None:
        """Rewrite one entry under its seqlock (odd generation while the words change)."""
        self.changes += 1
        g = int(self._gen[row]) + 1
        self._gen[row] = g
        self._off[row] = off
        self._len[row] = length
        self._gen[row] = g + 1

    def _sync_header(self) -> None:
        ARENA_HEADER.pack_into(self.buf, 0, ARENA_MAGIC, ARENA_VERSION, 0, self.rows_cap,  # type: ignore[arg-type]
                               self.heap_size, self.heap_used, self.live_bytes)  # fmt: skip

    def _fit(self, row: int, nbytes: int) -> bool:
        rows_cap, heap = self.rows_cap, self.heap_size
        if row < rows_cap and self.heap_used + nbytes <= heap:
            return False
        while row >= rows_cap:
            rows_cap *= 2
        while heap < 2 * (self.live_bytes + nbytes):  # written compacted: room for as much again
            heap *= 2
        self._remap(rows_cap, heap)
        return True

    def _remap(self, rows_cap: int, heap_size: int) -> None:
        """Write version V+1 with the live documents packed, publish it, unlink version V.
        V stays mapped until the next move: whoever registered it with a device (the GPU
        backend's resident kernel reads the row table) unregisters it first."""
        old_buf, old_version, old_cap = self.buf, self.version, self.rows_cap
        _close(self._retired)
        self._retired = None
        version = self.version + 1
        buf = self._open(version, arena_size(rows_cap, heap_size))
        try:
            self._fill(buf, rows_cap, heap_size, old_buf, old_cap)
        except BaseException:  # the new version is not published: remove it
            _close(buf)
            self._unlink(version)
            raise
        self.buf, self.version = buf, version
        self.rows_cap, self.heap_size = rows_cap, heap_size
        self._sync_header()
        self._retired = old_buf
        if old_version:
            self._unlink(old_version)

    def _fill(self, buf, rows_cap: int, heap_size: int, old_buf, old_cap: int) -> None:  # type: ignore[no-untyped-def]
        """Write the live documents of the current version into ``buf``, packed."""
        table = np.ndarray((rows_cap,), ENTRY_DTYPE, buf, ARENA_HEADER_SIZE)
        table[:] = 0
        off, length, gen = table["off"], table["len"], table["gen"]
        # generations carry over: a reader holding an answer's generations finds the same
        # documents in the new version
        gen[:old_cap] = self._gen
        used = 0
        if old_buf is not None:
            h, oh = heap_offset(rows_cap), heap_offset(old_cap)
            for row in np.flatnonzero(self._len).tolist():
                o, n = int(self._off[row]), int(self._len[row])
                buf[h + used : h + used + n] = old_buf[oh + o : oh + o + n]
                off[row], length[row] = used, n
                used += n
        self._off, self._len, self._gen, self._table = off, length, gen, table
        self._table_b = memoryview(table.view(np.uint8))
        self.heap_used = used
        self.changes += 1


def _close(buf: object) -> None:
    """Close a mapping (bytearrays have nothing to close; a view still held keeps it open)."""
    if buf is not None and hasattr(buf, "close"):
        with contextlib.suppress(BufferError):
            buf.close()

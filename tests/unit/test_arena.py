"""The document arena: what a reader may take, and what survives the arena moving to a new
version (pure: bytearrays stand in for the segments)."""

from __future__ import annotations

import numpy as np
import pytest

from kalos_retrievers.arena import ARENA_HEADER_SIZE, ENTRY_SIZE, SMALL_READ, ArenaView, ArenaWriter


class _Segments:
    """Named versions as bytearrays; unlink drops the name (a reader's reference stays)."""

    def __init__(self) -> None:
        self.live: dict[int, bytearray] = {}

    def open(self, version: int, size: int) -> bytearray:
        assert version not in self.live
        self.live[version] = buf = bytearray(size)
        return buf

    def unlink(self, version: int) -> None:
        del self.live[version]


def writer(rows_cap: int = 16, heap: int = 4096) -> tuple[ArenaWriter, _Segments]:
    segs = _Segments()
    return ArenaWriter(segs.open, segs.unlink, rows_cap, heap), segs


def view(w: ArenaWriter) -> ArenaView:
    assert w.buf is not None
    return ArenaView(w.buf, w.version)  # type: ignore[arg-type]


def test_a_reader_takes_a_document_only_at_the_generation_it_was_given() -> None:
    w, _ = writer()
    w.put(3, b"three")
    g = int(w.gens([3])[0])
    v = view(w)
    assert bytes(v.get(3, g)) == b"three"  # type: ignore[arg-type]
    assert v.get(3, g + 2) is None and v.get(3, g - 2) is None
    w.put(3, b"THREE, rewritten")
    g2 = int(w.gens([3])[0])
    assert g2 > g
    assert v.get(3, g) is None  # the answer named the old document: not returned
    assert bytes(v.get(3, g2)) == b"THREE, rewritten"  # type: ignore[arg-type]
    w.clear(3)
    assert v.get(3, g2) is None and v.get(3, int(w.gens([3])[0])) is None  # no document
    assert v.get(99, 0) is None and v.get(-1, 0) is None  # outside the table


@pytest.mark.parametrize("many", [False, True], ids=["one-by-one", "vectorized"])
def test_a_recalls_documents_come_whole_or_not_at_all(many: bool) -> None:
    """``docs``: every hit's document at the generation the answer named, or None if any one
    changed (the client then asks for them inline). Documents taken before a rewrite keep the
    old bytes (the heap is append-only). ``many``: more hits than SMALL_READ, checked in
    vectorized passes instead of one by one, and returned as views into the arena instead of
    copies."""
    w, _ = writer(rows_cap=128, heap=1 << 16)
    for r, doc in ((1, b"one"), (4, b"four"), (7, b"seven")):
        w.put(r, doc)
    filler = list(range(20, 20 + SMALL_READ)) if many else []
    for r in filler:
        w.put(r, f"filler {r}".encode())
    rows = [7, 1, 4, *filler]
    want = [b"seven", b"one", b"four", *(f"filler {r}".encode() for r in filler)]
    v = view(w)
    gens = [int(x) for x in w.gens(rows)]
    for rs, gs in ((rows, gens), (np.array(rows, np.int32), np.array(gens, np.uint32))):
        got = v.docs(rs, gs)
        assert got is not None and list(got) == want and len(got) == len(rows)
        # a batch-1 recall's few hits are copied: its result holds no reference to the arena;
        # many are views into it
        assert all(type(d) is (memoryview if many else bytes) for d in got)
        assert all(d.obj is w.buf for d in got) if many else True
        assert [bytes(d) for d in got[1:3]] == want[1:3] and len(got) == len(rows)
    assert list(v.docs([], [])) == []  # type: ignore[arg-type]
    w.put(1, b"one, rewritten")
    assert v.docs(rows, gens) is None  # one hit changed: none are returned
    assert got[1] == b"one"  # a view taken before still reads what it named
    bad = [*rows[:-1], 99] if many else [7, 99]
    assert v.docs(bad, gens[: len(bad)]) is None and v.docs([-1], [0]) is None  # outside the table
    assert v.docs([*rows[:-1], -1], gens) is None
    gens[1] = int(w.gens([1])[0])
    assert list(v.docs(rows, gens)) == [want[0], b"one, rewritten", *want[2:]]  # type: ignore[arg-type]
    at = ARENA_HEADER_SIZE + ENTRY_SIZE * 4 + 12
    w.buf[at : at + 4] = (gens[2] + 1).to_bytes(4, "little")  # type: ignore[index]  # being written
    assert v.docs(rows, gens) is None and v.docs([4], [gens[2]]) is None
    w.clear(7)  # no document: refused even at the generation it now has
    gens[0] = int(w.gens([7])[0])
    w.buf[at : at + 4] = gens[2].to_bytes(4, "little")  # type: ignore[index]
    assert v.docs(rows, gens) is None
    with pytest.raises(ValueError, match="generations"):
        v.docs(rows, gens[:-1])


@pytest.mark.parametrize("many", [False, True], ids=["copies", "views"])
def test_entries_name_the_documents_of_their_version_for_good(many: bool) -> None:
    """``entry_docs`` (protocol v1.3, ARENA_ENTRIES): the answer carries the arena version and
    each hit's entry, taken while nothing wrote. The documents are those entries' bytes, even
    after their rows are rewritten (the heap of a version is never rewritten); an answer from
    another version, an entry without a document, or one pointing outside the heap gives None
    (the client asks again), whatever the row table says now."""
    w, segs = writer(rows_cap=128, heap=1 << 16)
    filler = list(range(20, 20 + SMALL_READ)) if many else []
    rows = [7, 1, 4, *filler]
    want = [b"seven", b"one", b"four", *(f"filler {r}".encode() for r in filler)]
    for r, doc in zip(rows, want, strict=True):
        w.put(r, doc)
    v = view(w)
    blob = w.refs(rows, entries=True)
    assert len(blob) == 8 + 16 * len(rows) and int.from_bytes(blob[:8], "little") == w.version
    assert w.refs(rows, entries=False) == w.gens(rows).tobytes()
    got = v.entry_docs(blob, len(rows))
    assert got is not None and [bytes(d) for d in got] == want
    assert all(type(d) is (memoryview if many else bytes) for d in got)
    w.put(1, b"one, rewritten")  # after the answer: the answer's document is still the old one
    w.clear(4)
    again = v.entry_docs(blob, len(rows))
    assert again is not None and [bytes(d) for d in again] == want
    fresh = w.refs(rows[:2], entries=True)
    assert [bytes(d) for d in v.entry_docs(fresh, 2)] == [b"seven", b"one, rewritten"]  # type: ignore[union-attr]
    assert v.entry_docs(w.refs([4], entries=True), 1) is None  # cleared: no document, ask inline
    assert v.entry_docs(w.refs([], entries=True), 0) == []  # no hits: nothing to read
    assert w.refs_each(np.array([rows[:2], rows[1:3]]), entries=True) == [
        w.refs(rows[:2], entries=True), w.refs(rows[1:3], entries=True)]  # fmt: skip
    assert w.refs_each(np.array([rows[:2]]), entries=False) == [w.gens(rows[:2]).tobytes()]

    def forged(i: int, off: int, length: int, gen: int = 2) -> bytes:
        b = bytearray(blob)
        b[8 + 16 * i : 24 + 16 * i] = (off.to_bytes(8, "little") + length.to_bytes(4, "little")
                                        + gen.to_bytes(4, "little"))  # fmt: skip
        return bytes(b)

    size = w.heap_size
    for bad in (forged(1, size - 2, 3), forged(1, 2**64 - 4, 8), forged(len(rows) - 1, 0, 0), forged(0, 0, 5, gen=3)):
        assert v.entry_docs(bad, len(rows)) is None
    assert v.entry_docs(forged(1, size - 3, 3), len(rows)) is not None  # up to the heap's end is fine
    other = bytearray(blob)
    other[:8] = (w.version + 1).to_bytes(8, "little")
    assert v.entry_docs(bytes(other), len(rows)) is None  # another version's answer
    with pytest.raises(ValueError, match="entries"):
        v.entry_docs(blob[:-1], len(rows))
    # growth: a new version; an answer made from it is read through a view of it, and an
    # answer from the old version through the old view (still mapped here, though unlinked)
    old_version = w.version
    for r in range(100, 128):
        w.put(r, b"x" * 3000)
    assert w.version > old_version and old_version not in segs.live
    new_blob = w.refs(rows[:1], entries=True)
    assert v.entry_docs(new_blob, 1) is None
    assert [bytes(d) for d in view(w).entry_docs(new_blob, 1)] == [b"seven"]  # type: ignore[union-attr]
    assert [bytes(d) for d in v.entry_docs(blob, len(rows))] == want  # type: ignore[union-attr]


def test_the_writer_says_whether_rows_hold_documents() -> None:
    w, _ = writer()
    w.put(2, b"two")
    w.put(5, b"five")
    assert w.held(np.array([2, 5])) and w.held(np.array([], np.int64))
    assert not w.held(np.array([2, 3]))
    w.clear(5)
    assert not w.held(np.array([5]))


def test_an_entry_being_written_is_not_read() -> None:
    w, _ = writer()
    w.put(5, b"five")
    g = int(w.gens([5])[0])
    v = view(w)
    at = ARENA_HEADER_SIZE + ENTRY_SIZE * 5 + 12
    w.buf[at : at + 4] = (g + 1).to_bytes(4, "little")  # type: ignore[index]  # the writer's odd mark
    assert v.get(5, g) is None and v.get(5, g + 1) is None
    w.buf[at : at + 4] = g.to_bytes(4, "little")  # type: ignore[index]
    assert bytes(v.get(5, g)) == b"five"  # type: ignore[arg-type]


def test_growth_moves_to_a_new_version_keeping_documents_and_generations() -> None:
    w, segs = writer(rows_cap=16, heap=4096)
    rng = np.random.default_rng()
    want: dict[int, bytes] = {}
    old_view = view(w)
    moved = 0
    for i in range(2000):
        row = int(rng.integers(0, 700))
        doc = bytes(rng.integers(0, 256, int(rng.integers(1, 97)), dtype=np.uint8))
        moved += w.put(row, doc)
        want[row] = doc
        if i % 7 == 0:
            gone = int(rng.integers(0, 700))
            w.clear(gone)
            want.pop(gone, None)
    assert moved >= 3 and w.version == moved + 1 and list(segs.live) == [w.version]  # old names unlinked
    v = view(w)
    gens = w.gens(list(want))
    for (row, doc), g in zip(want.items(), gens, strict=True):
        assert bytes(v.get(row, int(g))) == doc  # type: ignore[arg-type]
    assert w.live_bytes == sum(map(len, want.values()))
    # a reader still holding version 1 reads only what is unchanged since, never a wrong doc
    for row, doc in want.items():
        got = old_view.get(row, int(w.gens([row])[0]))
        assert got is None or bytes(got) == doc


def test_refs_of_a_list_equal_refs_of_an_array_across_versions() -> None:
    """The batch-1 refs (a list of rows, sliced in Python) are byte for byte the numpy path's,
    for generations and for entries, after growth has moved the arena (its table replaced)."""
    w, _ = writer(rows_cap=16, heap=4096)
    rng = np.random.default_rng()
    checked = 0
    for i in range(600):
        row = int(rng.integers(0, 333))
        w.put(row, bytes(int(rng.integers(1, 61))))
        if i % 5 == 0:
            w.clear(int(rng.integers(0, 333)))
        if i % 37 == 0:
            rows = [int(r) for r in rng.integers(0, w.rows_cap, int(rng.integers(1, 12)))]
            for entries in (False, True):
                got = w.refs(rows, entries)
                assert got == w.refs(np.array(rows), entries), (i, entries)
                checked += 1
            assert w.refs(rows, False) == w.gens(rows).astype("<u4").tobytes()  # the negative check's anchor
    assert w.version > 2 and checked == 2 * len(range(0, 600, 37))


def test_move_hands_the_document_to_the_new_row() -> None:
    w, _ = writer()
    w.put(9, b"nine")
    w.put(2, b"two")
    g9 = int(w.gens([9])[0])
    w.clear(2)
    w.move(9, 2)
    v = view(w)
    assert v.get(9, g9) is None and v.get(9, int(w.gens([9])[0])) is None
    assert bytes(v.get(2, int(w.gens([2])[0]))) == b"nine"  # type: ignore[arg-type]
    assert w.get(2) == b"nine" and w.get(9) is None


def test_every_change_to_the_row_table_moves_the_change_counter() -> None:
    """The GPU backend copies the row table to the device when ``changes`` moved since its last
    copy: every way an entry changes must move it (a copy left stale names old documents)."""
    w, _ = writer(rows_cap=16, heap=4096)
    seen = [w.changes]

    def moved() -> bool:
        seen.append(w.changes)
        return seen[-1] != seen[-2]

    w.put(3, b"three")
    assert moved()
    w.put(3, b"three again")  # a rewrite
    assert moved()
    w.clear(3)
    assert moved()
    w.clear(3)  # nothing held: nothing changed
    assert not moved()
    w.put(5, b"five")
    w.move(5, 7)
    assert moved()
    w.put(40, b"past the table")  # a new version, the table rewritten
    assert moved() and w.version == 2
    assert not moved()  # the negative control: reads change nothing
    w.refs([40], True)
    w.get(40)
    assert not moved()


def test_a_buffer_that_is_not_an_arena_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Kalos document arena"):
        ArenaView(bytearray(4096), 1)


def test_a_failing_arena_is_dropped_and_the_row_table_keeps_its_change() -> None:
    """The arena is a copy for clients: if it cannot follow (no room for a larger version),
    the row table drops it and says so (version 0), and its own write still happens."""
    from kalos_retrievers.sidecar.rows import RowTable

    segs = _Segments()
    w = ArenaWriter(segs.open, segs.unlink, rows_cap=16, heap_size=4096)
    rows = RowTable()
    moved: list[int] = []
    still_open: list[bool] = []

    def on_moved(version: int) -> None:  # the sidecar unregisters the old row table here:
        moved.append(version)  # its map must still be there (a range unregistered after
        still_open.append(w.buf is not None and w.version > 0)  # it went could stay pinned)

    rows.arena, rows.on_arena_moved = w, on_moved
    ns = rows.ns_id("", create=True)
    assert ns is not None
    rows.set(rows.allocate(), ns, "a", b"doc a", {}, 0.0)
    assert w.get(0) == b"doc a" and moved == []

    def no_room(version: int, size: int) -> bytearray:
        raise OSError("no space left in /dev/shm")

    w._open = no_room  # the next version cannot be created
    row = rows.allocate()
    rows.set(row, ns, "b", b"x" * 10_000, {}, 0.0)  # needs a larger heap
    assert rows.arena is None and moved == [0]  # dropped, and the sidecar is told
    assert still_open == [True]  # before the arena was closed
    assert rows.docs[row] == b"x" * 10_000 and rows.lookup(ns, "b") == row  # the write stands
    assert segs.live == {}  # its segment was removed
    rows.remove(row)  # and later changes do not touch it
    assert rows.live == 1


def test_a_version_that_fails_half_written_is_removed_and_the_old_one_stays() -> None:
    w, segs = writer(rows_cap=16, heap=4096)
    w.put(1, b"one")
    g = int(w.gens([1])[0])

    def broken(*_a, **_k):  # type: ignore[no-untyped-def]
        raise MemoryError("while copying")

    w._fill = broken  # type: ignore[method-assign]
    with pytest.raises(MemoryError):
        w.put(2, b"y" * 10_000)  # needs version 2
    assert list(segs.live) == [1] and w.version == 1  # version 2 is gone, 1 is still current
    assert bytes(view(w).get(1, g)) == b"one"  # type: ignore[arg-type]


class _Map:
    def __init__(self) -> None:
        self.closed = False


class _Seg:
    def __init__(self) -> None:
        self.mm = _Map()


def test_the_server_keeps_a_moved_versions_map_until_the_next_move() -> None:
    """Which arena segments the sidecar closes when the writer unlinks a version (server.py):
    after a move the old version stays mapped (the GPU backend unregisters its row table after
    the unlink, and a registered range must still be mapped then) and the ones before it go;
    when the writer closed the version itself (closed, dropped, or a new version that failed
    half-written) that version and any other closed one go, never the one still in use."""
    from kalos_retrievers.sidecar.server import arena_segments_to_close as to_close

    segs = {v: _Seg() for v in (3, 4, 5)}  # 5 current, 4 retired (mapped), 3 retired before it
    segs[3].mm.closed = True  # the writer closed 3's map as it moved from 4 to 5
    assert to_close(segs, 4) == [3]  # 4 was unlinked by the move: it stays, 3 goes
    segs6 = {**segs, 6: _Seg()}
    segs6[6].mm.closed = True  # version 6 failed half-written: the writer closed and unlinks it
    assert to_close(segs6, 6) == [3, 6]  # 4 and 5 (in use) stay
    segs[4].mm.closed = segs[5].mm.closed = True  # the arena closed (or dropped): all maps closed
    assert to_close(segs, 5) == [3, 4, 5]
    assert to_close({}, 1) == []


def test_current_docs_reads_each_rows_document_as_it_is_now_or_none() -> None:
    """The direct carousel's read (no generation came with the answer): every row's document
    as the table holds it now, or None for a row outside the table, one with no document, one
    being written, or an entry that names bytes past the heap (corrupt: nothing read there; the
    C reader, _fastpath.car_answer1, refuses the same)."""
    import struct

    w, _ = writer(rows_cap=16, heap=256)
    for r in (1, 4, 9):
        w.put(r, f"doc {r}".encode())
    v = view(w)
    assert v.current_docs([9, 1, 4, 1]) == [b"doc 9", b"doc 1", b"doc 4", b"doc 1"]
    assert v.current_docs([]) == []
    w.put(4, b"four, rewritten")
    assert v.current_docs([4]) == [b"four, rewritten"]
    for rows in ([1, 16], [-1], [1, 2]):  # outside the table; row 2 has no document
        assert v.current_docs(rows) is None
    assert w.buf is not None
    at = ARENA_HEADER_SIZE + ENTRY_SIZE * 9
    off, length, gen = struct.unpack_from("<QII", w.buf, at)
    struct.pack_into("<I", w.buf, at + 12, gen + 1)  # being written (odd)
    assert v.current_docs([1, 9]) is None
    struct.pack_into("<QII", w.buf, at, v.fast[1][1] - 3, length, gen)  # past the heap's end (its size: 3 bytes on)
    assert v.current_docs([9]) is None and v.get(9, gen) is None
    struct.pack_into("<QII", w.buf, at, off, length, gen)  # (the control: as written)
    assert v.current_docs([9]) == [b"doc 9"] and v.get(9, gen) == b"doc 9"

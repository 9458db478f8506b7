"""The client's batch-1 recall to a resident GPU kernel in C (``kalos_retrievers._fastpath``),
in process: a thread stands in for the kernel, an anonymous map for the segment, and a
bytearray arena for the sidecar's. What the C code handles (an OK answer, read whole with its
documents) and what it leaves to the client's Python path, untouched (everything else)."""

from __future__ import annotations

import mmap
import struct
import threading
import time
from collections.abc import Callable

import kalos_testing
import numpy as np
import pytest

from kalos_retrievers.protocol import (
    CTL_OFFSETS,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    RESPONSE_OFFSET,
    RESPONSE_STRUCT,
    Flag,
    Layout,
    Op,
    Request,
    RespFlag,
    SlotState,
    Status,
    align8,
    decode_recall_args,
    encode_recall_args,
    validate_request,
)

fp = pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")

DIM, K, ROWS = 13, 5, 41
FLAGS = Flag.ARENA_DOCS | Flag.ARENA_ENTRIES
BELL_WORD = 3  # the header word standing in for doorbell_k


class Rig:
    """A slot, a header and an arena holding ROWS documents; ``kernel`` answers in a thread."""

    def __init__(self) -> None:
        self.lay = Layout(n_slots=1, dim=DIM, max_k=64, payload_size=1 << 12, blob_size=1 << 12)
        self.mm = mmap.mmap(-1, self.lay.segment_size)
        off = self.lay.slot_offset(0)
        self.slot = memoryview(self.mm)[off : off + self.lay.slot_size]
        self.state = self.slot.cast("I")
        self.state[0] = SlotState.CLAIMED
        self.hdr = bytearray(64)
        struct.pack_into("<I", self.hdr, 4 * BELL_WORD, K)  # the kernel runs
        self.arena_w, self.arena = kalos_testing.bytearray_arena(ROWS)
        lay = self.lay
        self.layout = (DIM, lay.payload_offset, lay.rows_offset, lay.scores_offset, lay.blob_offset,
                       lay.blob_size, int(FLAGS), BELL_WORD)  # fmt: skip
        self.seen: list[tuple] = []

    def kernel(self, answer: Callable[[tuple, np.ndarray], None], *, after_s: float = 0.0) -> threading.Thread:
        """A thread that waits for DOORBELL, records the request words and the query, then
        (after ``after_s``) calls ``answer(request, query)``."""

        def run() -> None:
            end = time.monotonic() + 5
            while self.state[0] != SlotState.DOORBELL:
                if time.monotonic() > end:
                    return
            req = REQUEST_STRUCT.unpack_from(self.slot, REQUEST_OFFSET)
            q = np.frombuffer(self.slot, np.float32, DIM, self.lay.payload_offset).copy()
            self.seen.append((req, q))
            time.sleep(after_s)
            answer(req, q)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def respond(self, seq: int, rows: list[int], *, status: int = Status.OK, flags: int | None = None,
                blob: bytes | None = None, n: int | None = None, state: int = SlotState.RESPONSE) -> None:  # fmt: skip
        """Write an answer as the kernel does: rows, scores, blob, the response words, then state."""
        lay = self.lay
        np.frombuffer(self.slot, np.int32, len(rows), lay.rows_offset)[:] = rows
        np.frombuffer(self.slot, np.float32, len(rows), lay.scores_offset)[:] = [1.0 - i / 8 for i in range(len(rows))]
        if blob is None:
            blob = self.arena_w.refs(rows, True)
        self.slot[lay.blob_offset : lay.blob_offset + len(blob)] = blob
        if flags is None:
            flags = RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES
        RESPONSE_STRUCT.pack_into(self.slot, RESPONSE_OFFSET, seq, status, len(rows) if n is None else n,
                                  len(blob), flags)  # fmt: skip
        self.state[0] = state

    def call(self, q: np.ndarray, seq: int = 77, *, spin_ns: int = 2_000_000_000, deadline_ns: int = 0,
             arena: bool = True) -> object:  # fmt: skip
        buf, info = self.arena.fast
        return fp.recall1(self.slot, q, self.layout, seq, K, deadline_ns, spin_ns, self.hdr,
                          buf if arena else None, info)  # fmt: skip


def query() -> np.ndarray:
    return np.random.default_rng().standard_normal(DIM).astype(np.float32)


def test_the_modules_control_word_offsets_are_the_protocols() -> None:
    assert {name: CTL_OFFSETS[name] for name in fp.CTL_OFFSETS} == fp.CTL_OFFSETS
    assert set(fp.CTL_OFFSETS) >= {"state", "seq", "deadline_ns", "resp_seq", "resp_flags"}


def test_the_modules_header_words_are_the_clients() -> None:
    """bell1 reads the header through the client's view of its first words (``hdr_all``):
    the C module's count is the client's (a header field added on one side only, as
    doorbell_args in v1.6, would be read short or past the view)."""
    from kalos_retrievers import _conn

    assert fp.BELL_WORDS["header_words"] == _conn._HEADER_WORDS == 1 + _conn._DOORBELL_ARGS_WORD


def test_an_ok_answer_comes_back_whole_with_its_documents_and_the_slot_claimed_again() -> None:
    rig = Rig()
    q = query()
    rows = [7, 3, 40, 0, 12]
    t = rig.kernel(lambda req, _: rig.respond(req[0], rows))
    out = rig.call(q, seq=2**63 + 5, deadline_ns=time.monotonic_ns() + 10**10)
    t.join()
    (req, got_q), = rig.seen
    # the request as the Python path writes it
    assert req[:7] == (2**63 + 5, Op.RECALL, int(FLAGS), K, 1, 4 * DIM, 0) and req[7] > 0
    assert np.array_equal(got_q, q)
    assert type(out) is tuple
    waited, n, rflags, rb, sb, blob, docs = out
    assert n == len(rows) and rflags == RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES and waited > 0
    assert np.frombuffer(rb, np.int32).tolist() == rows
    assert np.allclose(np.frombuffer(sb, np.float32), [1.0 - i / 8 for i in range(len(rows))])
    assert blob == rig.arena_w.refs(rows, True)
    assert docs == [f"document {r}".encode() for r in rows] == rig.arena.entry_docs(blob, len(rows))
    assert rig.state[0] == SlotState.CLAIMED


def test_fewer_results_than_k_and_no_documents_asked_for() -> None:
    rig = Rig()
    t = rig.kernel(lambda req, _: rig.respond(req[0], [4, 9], flags=0, blob=b""))
    out = rig.call(query())
    t.join()
    assert type(out) is tuple
    _, n, _, rb, sb, blob, docs = out
    assert (n, len(rb), len(sb), blob, docs) == (2, 8, 8, b"", None)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "strided", "float64", "int32", "short"])
def test_a_query_it_does_not_take_is_left_to_python_with_nothing_written(bad: str) -> None:
    rig = Rig()
    before = bytes(rig.slot)
    q = query()
    if bad == "nan":
        q[DIM // 2] = np.nan
    elif bad == "inf":
        q[-1] = np.inf
    elif bad == "-inf":
        q[0] = -np.inf
    elif bad == "strided":
        q = np.repeat(q, 2)[::2]
        assert not q.flags.c_contiguous
    elif bad == "float64":
        q = q.astype(np.float64)[: DIM // 2]  # (fewer bytes: DIM is odd)
    elif bad == "int32":
        q = q.astype(np.int32)  # as many bytes as DIM float32: the buffer's format says no
    else:
        q = q[:-1]
    assert rig.call(q) is None
    assert bytes(rig.slot) == before


def test_no_answer_within_the_spin_leaves_the_request_to_python_saying_how_long_it_spun() -> None:
    rig = Rig()
    t0 = time.monotonic()
    out = rig.call(query(), seq=9, spin_ns=20_000_000)
    took = time.monotonic() - t0
    assert type(out) is int and 20_000_000 <= out <= took * 1e9  # (the client counts it as waited)
    assert took < 2
    assert rig.state[0] == SlotState.DOORBELL  # still the kernel's
    assert REQUEST_STRUCT.unpack_from(rig.slot, REQUEST_OFFSET)[0] == 9


def test_the_spin_ends_at_the_requests_deadline() -> None:
    rig = Rig()
    t0 = time.monotonic()
    assert type(rig.call(query(), deadline_ns=time.monotonic_ns() + 20_000_000)) is int
    assert time.monotonic() - t0 < 1  # not the 2 s spin


def test_a_request_handed_back_to_the_sidecar_is_left_to_python_at_once() -> None:
    rig = Rig()
    t = rig.kernel(lambda req, _: rig.state.__setitem__(0, SlotState.REQUEST), after_s=0.01)
    t0 = time.monotonic()
    assert type(rig.call(query())) is int
    t.join()
    assert time.monotonic() - t0 < 1 and rig.state[0] == SlotState.REQUEST


@pytest.mark.parametrize("stopped", [True, False])
def test_a_stopped_kernel_is_noticed_while_spinning(stopped: bool) -> None:
    """The header's doorbell word is read every 50 µs; the negative control spins on."""
    rig = Rig()

    def stop() -> None:
        time.sleep(0.01)
        if stopped:
            struct.pack_into("<I", rig.hdr, 4 * BELL_WORD, 0)

    threading.Thread(target=stop, daemon=True).start()
    t0 = time.monotonic()
    assert type(rig.call(query(), spin_ns=300_000_000)) is int
    took = time.monotonic() - t0
    assert took < 0.2 if stopped else took >= 0.29
    assert rig.state[0] == SlotState.DOORBELL


@pytest.mark.parametrize("what", ["error status", "error state", "other seq", "more", "n over k", "blob too long"])
def test_an_answer_it_does_not_take_is_left_to_python_unread(what: str) -> None:
    rig = Rig()

    def answer(req: tuple, _: np.ndarray) -> None:
        seq = req[0]
        if what == "error status":
            rig.respond(seq, [1], status=Status.BAD_REQUEST)
        elif what == "error state":
            rig.respond(seq, [1], state=SlotState.ERROR)
        elif what == "other seq":
            rig.respond(seq + 1, [1])
        elif what == "more":
            rig.respond(seq, [1], flags=RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES | RespFlag.MORE)
        elif what == "n over k":
            rig.respond(seq, [1, 2, 3], n=K + 1)
        else:
            rig.respond(seq, [1])
            struct.pack_into("<Q", rig.slot, CTL_OFFSETS["resp_len"], rig.lay.blob_size + 1)

    t = rig.kernel(answer)
    assert type(rig.call(query())) is int
    t.join()
    assert rig.state[0] in (SlotState.RESPONSE, SlotState.ERROR)  # for the Python path to read


@pytest.mark.parametrize("what", ["odd generation", "empty entry", "past the heap", "other version", "no arena",
                                  "short blob"])  # fmt: skip
def test_documents_whose_entries_do_not_check_come_back_as_none(what: str) -> None:
    rig = Rig()
    rows = [5, 6]
    blob = bytearray(rig.arena_w.refs(rows, True))
    if what == "odd generation":
        struct.pack_into("<I", blob, 8 + 16 + 12, 3)
    elif what == "empty entry":
        struct.pack_into("<I", blob, 8 + 8, 0)
    elif what == "past the heap":
        struct.pack_into("<Q", blob, 8 + 16, rig.arena.fast[1][1])
    elif what == "other version":
        struct.pack_into("<Q", blob, 0, rig.arena.version + 1)
    elif what == "short blob":
        blob = blob[:-1]
    t = rig.kernel(lambda req, _: rig.respond(req[0], rows, blob=bytes(blob)))
    out = rig.call(query(), arena=what != "no arena")
    t.join()
    assert type(out) is tuple and out[-1] is None and out[-2] == bytes(blob)
    assert rig.state[0] == SlotState.CLAIMED


# -- request1 / answer1: a REQUEST for the sidecar written in C, its answer read in C after the
# -- Python wait (the batch-1 recall when no resident kernel takes it)


def request(rig: Rig, q: np.ndarray, seq: int = 31, deadline_ns: int = 123_456_789) -> object:
    return fp.request1(rig.slot, q, rig.layout, seq, K, deadline_ns)


def answer(rig: Rig, seq: int = 31, waited: int = 4321, arena: bool = True) -> object:
    buf, info = rig.arena.fast
    return fp.answer1(rig.slot, rig.layout, seq, K, waited, buf if arena else None, info)


def test_recall1_with_a_short_header_still_leaves_a_query_it_does_not_take_to_python() -> None:
    """The query's format and length are checked before the bounds (a wrong query: None, as
    always), the bounds (the header's included) before the finiteness."""
    rig = Rig()
    buf, info = rig.arena.fast
    short = bytearray(4 * BELL_WORD)  # the doorbell word just past its end
    for q in (query().astype(np.float64)[: DIM // 2], query()[:-1]):
        assert fp.recall1(rig.slot, q, rig.layout, 1, K, 0, 0, short, buf, info) is None
    nan = query()
    nan[0] = np.nan
    with pytest.raises(ValueError, match="the query, the slot or the header does not fit"):
        fp.recall1(rig.slot, nan, rig.layout, 1, K, 0, 0, short, buf, info)


def test_request1_writes_the_request_words_and_query_then_request_state() -> None:
    rig, q = Rig(), query()
    assert request(rig, q, seq=2**64 - 3) is True
    assert rig.state[0] == SlotState.REQUEST
    assert REQUEST_STRUCT.unpack_from(rig.slot, REQUEST_OFFSET) == (
        2**64 - 3, Op.RECALL, int(FLAGS), K, 1, 4 * DIM, 0, 123_456_789)  # fmt: skip
    assert np.array_equal(np.frombuffer(rig.slot, np.float32, DIM, rig.lay.payload_offset), q)


def test_request1_writes_a_scoped_recalls_args_after_the_query() -> None:
    """With args (a namespace, a filter): copied to the query's 8-byte-aligned end, args_len
    set, a request the sidecar's Python validates and decodes as it would the general path's;
    args that do not fit the payload: ValueError, nothing written."""
    rig, q = Rig(), query()
    args = encode_recall_args("memory/ünïcode", b'{"user":{"$in":[1,2]}}')
    assert fp.request1(rig.slot, q, rig.layout, 9, K, 77, args) is True
    assert rig.state[0] == SlotState.REQUEST
    words = REQUEST_STRUCT.unpack_from(rig.slot, REQUEST_OFFSET)
    assert words == (9, Op.RECALL, int(FLAGS), K, 1, 4 * DIM, len(args), 77)
    validate_request(Request(*words), rig.lay)
    at = rig.lay.payload_offset + align8(4 * DIM)
    assert decode_recall_args(bytes(rig.slot[at : at + len(args)])) == ("memory/ünïcode", {"user": {"$in": [1, 2]}})
    assert np.array_equal(np.frombuffer(rig.slot, np.float32, DIM, rig.lay.payload_offset), q)
    rig.state[0] = SlotState.CLAIMED  # empty args: the default namespace's request, args_len 0
    assert fp.request1(rig.slot, q, rig.layout, 10, K, 77, b"") is True
    assert REQUEST_STRUCT.unpack_from(rig.slot, REQUEST_OFFSET)[6] == 0
    rig.state[0] = SlotState.CLAIMED
    room = rig.lay.payload_size - align8(4 * DIM)
    before = bytes(rig.slot)
    with pytest.raises(ValueError, match="do not fit the slot's payload"):
        fp.request1(rig.slot, q, rig.layout, 11, K, 77, bytes(room + 1))
    assert bytes(rig.slot) == before
    assert fp.request1(rig.slot, q, rig.layout, 11, K, 77, bytes(room)) is True  # exactly full: written


def test_recall1_rings_the_kernel_with_a_namespaces_args_after_the_query() -> None:
    """With args (a namespace, for a kernel that serves namespaces): copied to the query's
    8-byte-aligned end and args_len set, before DOORBELL; the answer read as for the default
    namespace. Args that do not fit the payload: ValueError, nothing written (the control: a
    call without args writes args_len 0)."""
    rig, q = Rig(), query()
    args = encode_recall_args("memory/ünï", None)
    rows = [4, 0, 33]
    seen: list[bytes] = []

    def answer(req: tuple, _: np.ndarray) -> None:
        at = rig.lay.payload_offset + align8(4 * DIM)
        seen.append(bytes(rig.slot[at : at + req[6]]))
        rig.respond(req[0], rows)

    t = rig.kernel(answer)
    buf, info = rig.arena.fast
    out = fp.recall1(rig.slot, q, rig.layout, 21, K, 0, 2_000_000_000, rig.hdr, buf, info, args)
    t.join()
    (req, got_q), = rig.seen
    assert req[:7] == (21, Op.RECALL, int(FLAGS), K, 1, 4 * DIM, len(args)) and np.array_equal(got_q, q)
    assert seen == [args] and decode_recall_args(seen[0]) == ("memory/ünï", None)
    assert type(out) is tuple and np.frombuffer(out[3], np.int32).tolist() == rows
    assert rig.state[0] == SlotState.CLAIMED
    rig.seen.clear()
    t = rig.kernel(lambda req, _: rig.respond(req[0], rows))
    assert type(rig.call(q, seq=22)) is tuple  # without args: args_len 0
    t.join()
    assert rig.seen[0][0][6] == 0
    room = rig.lay.payload_size - align8(4 * DIM)
    before = bytes(rig.slot)
    with pytest.raises(ValueError, match="do not fit the slot's payload"):
        fp.recall1(rig.slot, q, rig.layout, 23, K, 0, 0, rig.hdr, buf, info, bytes(room + 1))
    assert bytes(rig.slot) == before


def test_request1_writes_what_recall1_writes() -> None:
    """The same request words and query as the DOORBELL path (only the state differs)."""
    a, b, q = Rig(), Rig(), query()
    assert request(a, q, seq=5, deadline_ns=77) is True
    assert type(b.call(q, seq=5, deadline_ns=77, spin_ns=0)) is int
    a.state[0] = b.state[0] = 0
    end = a.lay.payload_offset + 4 * DIM
    assert bytes(a.slot[:end]) == bytes(b.slot[:end])


@pytest.mark.parametrize("bad", ["nan", "inf", "strided", "float64", "int32", "short"])
def test_request1_leaves_a_query_it_does_not_take_to_python_with_nothing_written(bad: str) -> None:
    rig, q = Rig(), query()
    before = bytes(rig.slot)
    if bad == "nan":
        q[3] = np.nan
    elif bad == "inf":
        q[-1] = np.inf
    elif bad == "strided":
        q = np.repeat(q, 2)[::2]
    elif bad == "float64":
        q = q.astype(np.float64)[: DIM // 2]
    elif bad == "int32":
        q = q.astype(np.int32)
    else:
        q = q[:-1]
    assert request(rig, q) is None
    assert bytes(rig.slot) == before


def test_answer1_reads_an_ok_answer_as_recall1_does_and_claims_the_slot() -> None:
    rig, rows = Rig(), [7, 3, 40, 0, 12]
    assert request(rig, query()) is True
    rig.respond(31, rows)
    out = answer(rig, waited=98765)
    assert type(out) is tuple
    waited, n, rflags, rb, sb, blob, docs = out
    assert (waited, n, rflags) == (98765, 5, RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES)
    assert np.frombuffer(rb, np.int32).tolist() == rows
    assert np.allclose(np.frombuffer(sb, np.float32), [1.0 - i / 8 for i in range(5)])
    assert blob == rig.arena_w.refs(rows, True)
    assert docs == [f"document {r}".encode() for r in rows]
    assert rig.state[0] == SlotState.CLAIMED
    # documents whose entries do not check are left to Python (None), the answer still read
    assert request(rig, query(), seq=32) is True
    bad = bytearray(rig.arena_w.refs(rows, True))
    struct.pack_into("<I", bad, 8 + 12, 3)  # an odd generation: a row being rewritten
    rig.respond(32, rows, blob=bytes(bad))
    out = answer(rig, seq=32)
    assert type(out) is tuple and out[-1] is None and out[-2] == bytes(bad)


@pytest.mark.parametrize("what", ["not answered", "busy", "error status", "error state", "other seq", "more",
                                  "n over k", "blob too long"])  # fmt: skip
def test_answer1_leaves_any_other_answer_to_python_untouched(what: str) -> None:
    rig = Rig()
    assert request(rig, query()) is True
    if what == "busy":
        rig.state[0] = SlotState.BUSY
    elif what == "error status":
        rig.respond(31, [1], status=Status.BAD_REQUEST)
    elif what == "error state":
        rig.respond(31, [1], state=SlotState.ERROR)
    elif what == "other seq":
        rig.respond(30, [1])
    elif what == "more":
        rig.respond(31, [1], flags=RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES | RespFlag.MORE)
    elif what == "n over k":
        rig.respond(31, [1, 2, 3], n=K + 1)
    elif what == "blob too long":
        rig.respond(31, [1])
        struct.pack_into("<Q", rig.slot, CTL_OFFSETS["resp_len"], rig.lay.blob_size + 1)
    before = bytes(rig.slot)
    assert answer(rig) is None
    assert bytes(rig.slot) == before  # the state too: Python reads it


def test_request1_and_answer1_refuse_a_slot_the_layout_does_not_fit_and_a_bad_k() -> None:
    rig = Rig()
    small = memoryview(bytearray(rig.lay.payload_offset + 4 * DIM - 1))
    with pytest.raises(ValueError, match="does not fit"):
        fp.request1(small, query(), rig.layout, 1, K, 0)
    with pytest.raises(ValueError, match="does not fit"):
        fp.answer1(memoryview(bytearray(rig.lay.blob_offset)), rig.layout, 1, K, 0, None, rig.arena.fast[1])
    # a slot shorter than its control words, with a layout whose areas would fit in it: refused,
    # not read (the answer's words lie in the first 128 bytes)
    tiny = (4, 0, 0, 0, 0, 0, 0, 3)
    for slot_len in (8, 127):
        with pytest.raises(ValueError, match="does not fit"):
            fp.answer1(memoryview(bytearray(slot_len)), tiny, 1, 1, 0, None, rig.arena.fast[1])
    with pytest.raises(ValueError, match="does not fit"):  # areas inside the control words
        fp.answer1(rig.slot, (DIM, *[rig.layout[1]] * 1, 64, *rig.layout[3:]), 1, K, 0, None, rig.arena.fast[1])
    for k in (0, -1, 2**31):
        with pytest.raises(ValueError, match="k must be positive"):
            fp.request1(rig.slot, query(), rig.layout, 1, k, 0)
        with pytest.raises(ValueError, match="k must be positive"):
            fp.answer1(rig.slot, rig.layout, 1, k, 0, None, rig.arena.fast[1])
    with pytest.raises(TypeError, match="takes 6 or 7 arguments"):
        fp.request1(rig.slot, query(), rig.layout, 1, K)
    with pytest.raises(TypeError, match="takes 7 arguments"):
        fp.answer1(rig.slot, rig.layout, 1, K, 0, None)

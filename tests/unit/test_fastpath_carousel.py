"""The direct carousel recall's C half (``_fastpath.car_request1`` / ``car_answer1``, protocol
v1.4), in process: an anonymous map stands in for the carousel's segment and a bytearray arena
for the sidecar's. What the request writes, in which order, and when it writes nothing; which
answers it reads whole with their documents, and which it leaves to the usual path (None)."""

from __future__ import annotations

import mmap
import struct

import kalos_testing
import numpy as np
import pytest

from kalos_retrievers.arena import ARENA_HEADER_SIZE, ENTRY_SIZE
from kalos_retrievers.protocol import (
    CAR_DONE,
    CAR_ERROR,
    CAR_HEAD,
    CAR_IDLE,
    CAR_KMAX,
    CAR_REQUEST,
    CAR_TAKEN,
    W_ELIGIBLE,
    W_K,
    W_RESP_SEQ,
    W_RESULTS,
    W_SEQ,
    W_STATE,
    CarouselLayout,
    Metric,
    car_bounds,
    car_takes,
)

fp = pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")

DIM, ROWS, SLOTS = 97, 41, 3
LAY = CarouselLayout.of(DIM)
COS = car_bounds(Metric.COSINE)


class Rig:
    """A carousel segment of SLOTS slots and an arena of ROWS documents (rows_cap 64)."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, SLOTS * LAY.slot_bytes)
        self.arena_w, self.arena = kalos_testing.bytearray_arena(ROWS)

    def words(self, i: int) -> np.ndarray:
        return np.frombuffer(self.mm, np.uint32, CAR_HEAD // 4, i * LAY.slot_bytes)

    def query_in(self, i: int) -> np.ndarray:
        return np.frombuffer(self.mm, np.float32, DIM, i * LAY.slot_bytes + CAR_HEAD)

    def request(self, i: int, q: object, seq: int = 0x1_0000_0007, k: int = 10, bounds=COS) -> object:  # type: ignore[no-untyped-def]
        return fp.car_request1(self.mm, i * LAY.slot_bytes, q, DIM, seq, k, *bounds)

    def answer(self, i: int, rows: list[int], *, seq: int = 7, eligible: int = ROWS, n: int | None = None,
               state: int = CAR_DONE) -> None:  # fmt: skip
        """Write an answer as the kernel does: rows, scores, the words, then the state."""
        at = i * LAY.slot_bytes
        np.frombuffer(self.mm, np.int32, len(rows), at + LAY.rows_off)[:] = rows
        np.frombuffer(self.mm, np.float32, len(rows), at + LAY.scores_off)[:] = [1 - j / 64 for j in range(len(rows))]
        w = self.words(i)
        w[W_RESULTS], w[W_RESP_SEQ], w[W_ELIGIBLE] = len(rows) if n is None else n, seq, eligible
        w[W_STATE] = state

    def read(self, i: int, seq: int = 0x1_0000_0007, k: int = 10) -> object:
        buf, info = self.arena.fast
        return fp.car_answer1(self.mm, i * LAY.slot_bytes, LAY.rows_off, LAY.scores_off, seq, k, buf, info)

    def entry(self, row: int) -> int:
        return ARENA_HEADER_SIZE + ENTRY_SIZE * row


def query(scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng().standard_normal(DIM) * scale).astype(np.float32)


def test_the_modules_carousel_words_are_the_protocols() -> None:
    assert fp.CAR_WORDS == {
        "state": W_STATE, "k": W_K, "seq": W_SEQ, "results": W_RESULTS, "resp_seq": W_RESP_SEQ,
        "eligible": W_ELIGIBLE, "head": CAR_HEAD, "request": CAR_REQUEST, "taken": CAR_TAKEN, "done": CAR_DONE,
        "kmax": CAR_KMAX, "arena_header": ARENA_HEADER_SIZE, "entry_size": ENTRY_SIZE,
    }  # fmt: skip


def test_a_request_writes_the_query_its_words_and_the_state_and_leaves_the_sidecars_words() -> None:
    rig = Rig()
    w = rig.words(1)
    w[2], w[W_ELIGIBLE] = 5, 123  # the namespace and the row count: the sidecar's
    q = query()
    assert rig.request(1, q, seq=0x1_0000_0007, k=13) is True
    np.testing.assert_array_equal(rig.query_in(1), q)
    assert (w[W_STATE], w[W_K], w[W_SEQ], w[W_RESULTS]) == (CAR_REQUEST, 13, 7, 0xFFFFFFFF)
    assert (w[2], w[W_ELIGIBLE]) == (5, 123)
    assert not rig.words(0).any() and not rig.words(2).any()  # the neighbours untouched


@pytest.mark.parametrize(
    "bad", ["busy", "taken", "nan", "inf", "nan_tail", "inf_tail", "float64", "short", "long", "k0", "k33", "tiny",
            "huge_ip", "huge_ip_tail", "strided"]
)  # fmt: skip
def test_a_request_it_does_not_take_writes_nothing(bad: str) -> None:
    """(``_tail``: the value in the last element, which DIM = 97 leaves to the scalar loop
    after the four-wide one.)"""
    rig = Rig()
    q, k, bounds = query(), 10, COS
    w = rig.words(1)
    at = DIM - 1 if bad.endswith("_tail") else DIM // 2
    bad = bad.removesuffix("_tail")
    if bad in ("busy", "taken"):
        w[W_STATE] = CAR_REQUEST if bad == "busy" else CAR_TAKEN  # an earlier request given up
    elif bad in ("nan", "inf"):
        q[at] = np.nan if bad == "nan" else -np.inf
    elif bad == "float64":
        q = q.astype(np.float64)[:DIM]
    elif bad == "short":
        q = q[:-1].copy()
    elif bad == "long":
        q = np.append(q, np.float32(1))
    elif bad in ("k0", "k33"):
        k = 0 if bad == "k0" else CAR_KMAX + 1
    elif bad == "tiny":
        q = query(1e-20)  # a cosine query the kernel's float32 norm would lose
    elif bad == "huge_ip":
        q[at], bounds = -70000.0, car_bounds(Metric.IP)  # not a float16
    elif bad == "strided":
        q = np.repeat(q, 2)[::2]
    before = bytes(rig.mm)
    assert rig.request(1, q, k=k, bounds=bounds) is None
    assert bytes(rig.mm) == before


def test_the_bounds_are_car_takes() -> None:
    """The C check takes exactly the queries car_takes takes, at the bounds' edges too."""
    rig = Rig()
    for metric in (Metric.COSINE, Metric.IP, Metric.L2):
        lo, hi = car_bounds(metric)
        for amax in (0.0, lo, np.nextafter(np.float32(lo), np.float32(0)), 1.0, 65504.0, 65536.0, hi, 6e16):
            for at in (5, DIM - 1):  # (the four-wide loop's part, and the scalar tail's)
                q = np.zeros(DIM, np.float32)
                q[at] = -np.float32(amax)
                rig.words(0)[W_STATE] = CAR_IDLE
                got = rig.request(0, q, bounds=(lo, hi)) is True
                assert got == car_takes(metric, float(np.abs(q).max())), (metric, amax, at)


def test_a_request_whose_place_is_outside_the_segment_is_an_error() -> None:
    rig = Rig()
    with pytest.raises(ValueError, match="does not fit"):
        fp.car_request1(rig.mm, len(rig.mm) - CAR_HEAD - 4 * DIM + 4, query(), DIM, 1, 10, *COS)
    with pytest.raises(ValueError, match="multiple of 4"):
        fp.car_request1(rig.mm, 2, query(), DIM, 1, 10, *COS)
    with pytest.raises(ValueError, match="does not fit"):  # (sizes whose sums would overflow)
        fp.car_request1(rig.mm, 0, query(), 2**61, 1, 10, *COS)
    with pytest.raises(ValueError, match="does not fit"):
        fp.car_request1(rig.mm, 2**62, query(), DIM, 1, 10, *COS)


def test_an_answer_comes_back_with_its_rows_scores_and_documents() -> None:
    rig = Rig()
    rows = [40, 3, 17, 0, 9, 22, 31, 8, 5, 11]
    rig.answer(2, rows)
    out = rig.read(2)
    assert out is not None
    rows_b, scores_b, docs = out  # type: ignore[misc]
    assert np.frombuffer(rows_b, np.int32).tolist() == rows
    np.testing.assert_array_equal(np.frombuffer(scores_b, np.float32), [1 - j / 64 for j in range(10)])
    assert docs == [f"document {r}".encode() for r in rows]
    assert rig.words(2)[W_STATE] == CAR_DONE  # (left as it is: the next request overwrites it)


def test_an_answer_capped_by_the_namespaces_rows_and_an_empty_one() -> None:
    rig = Rig()
    rig.answer(0, [4, 2, 6], eligible=3)  # fewer rows than k
    assert rig.read(0) is not None
    rig.answer(0, [], eligible=0)
    assert rig.read(0) == (bytearray(), bytearray(), [])


@pytest.mark.parametrize("what", ["idle", "taken", "error", "seq", "short", "long", "row", "negative",
                                  "no_doc", "writing", "past_heap", "heap_small", "heap_big"])  # fmt: skip
def test_an_answer_that_does_not_check_is_left_to_the_usual_path(what: str) -> None:
    rig = Rig()
    rows = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    kw: dict = {}
    if what in ("idle", "taken", "error"):
        kw["state"] = {"idle": CAR_IDLE, "taken": CAR_TAKEN, "error": CAR_ERROR}[what]
    elif what == "seq":
        kw["seq"] = 8
    elif what == "short":  # a kernel that lost rows: fewer than min(k, the namespace's rows)
        rows = rows[:9]
    elif what == "long":
        kw["eligible"] = 9
    elif what == "row":
        rows[4] = 64  # past the arena's row table
    elif what == "negative":
        rows[4] = -1
    elif what == "no_doc":
        rows[4] = ROWS + 2  # in the table, never given a document
    elif what == "writing":
        struct.pack_into("<I", rig.arena_w.buf, rig.entry(rows[4]) + 12, 7)  # an odd gen: being written
    elif what == "past_heap":  # a corrupt entry: its bytes run past the heap's end
        heap_size = rig.arena.fast[1][1]
        struct.pack_into("<QI", rig.arena_w.buf, rig.entry(rows[4]), heap_size - 4, 100)
    rig.answer(1, rows, **kw)
    buf, (heap, heap_size, version) = rig.arena.fast
    if what == "heap_small":  # arena_info that does not fit the arena's buffer: nothing read
        heap = ARENA_HEADER_SIZE - 16
    elif what == "heap_big":
        heap_size = len(buf) - heap + 1
    info = (heap, heap_size, version)
    assert fp.car_answer1(rig.mm, LAY.slot_bytes, LAY.rows_off, LAY.scores_off, 0x1_0000_0007, 10, buf, info) is None


def test_the_answers_reader_refuses_bad_offsets() -> None:
    rig = Rig()
    buf, info = rig.arena.fast
    with pytest.raises(ValueError, match="does not fit"):
        fp.car_answer1(rig.mm, SLOTS * LAY.slot_bytes, LAY.rows_off, LAY.scores_off, 7, 10, buf, info)
    with pytest.raises(ValueError, match="bad offsets or k"):
        fp.car_answer1(rig.mm, 0, LAY.rows_off, LAY.scores_off, 7, CAR_KMAX + 1, buf, info)
    for at, rows_off in ((2**62, LAY.rows_off), (0, 2**62)):  # (sums that would overflow)
        with pytest.raises(ValueError, match="does not fit"):
            fp.car_answer1(rig.mm, at, rows_off, LAY.scores_off, 7, 10, buf, info)
    with pytest.raises(TypeError, match="arena_info"):
        fp.car_answer1(rig.mm, 0, LAY.rows_off, LAY.scores_off, 7, 10, buf, (1, 2))


def test_the_wait_spins_until_a_final_state_or_its_end_with_the_gil_released() -> None:
    """car_wait1: a final state (DONE, ERROR, IDLE) ends it at once; REQUEST or TAKEN, at
    ``until``; and while it spins another Python thread runs (the GIL released): the thread
    that answers the slot 20 ms in ends a spin meant to last 3 s (with the GIL held it could
    not run until the spin had ended)."""
    import threading
    import time

    rig = Rig()
    w = rig.words(2)
    at = 2 * LAY.slot_bytes
    for st in (CAR_DONE, CAR_ERROR, CAR_IDLE):
        w[W_STATE] = st
        assert fp.car_wait1(rig.mm, at, time.monotonic_ns() + 10**9) == st
    for st in (CAR_REQUEST, CAR_TAKEN):
        w[W_STATE] = st
        t0 = time.monotonic_ns()
        assert fp.car_wait1(rig.mm, at, t0 + 5_000_000) == st
        assert time.monotonic_ns() - t0 >= 5_000_000
    w[W_STATE] = CAR_TAKEN
    answer = threading.Timer(0.02, lambda: w.__setitem__(W_STATE, CAR_DONE))
    t0 = time.monotonic()
    answer.start()
    try:
        assert fp.car_wait1(rig.mm, at, time.monotonic_ns() + 3 * 10**9) == CAR_DONE
    finally:
        answer.cancel()
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(ValueError, match="not inside"):
        fp.car_wait1(rig.mm, len(rig.mm) - 2, 0)

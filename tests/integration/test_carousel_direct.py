"""Recalls written straight into the carousel's slots (protocol v1.4, KALOS_CAROUSEL=direct),
against a real CPU sidecar whose clients are told a carousel runs (the header's carousel words,
written here) and a process standing in for the kernel (``kalos_testing.carousel_stand_in``).
The client must take the direct path only while the epoch is odd, give what the usual path
gives (rows, scores and documents), and fall back to the usual path, losing nothing, whenever
the kernel refuses, the sidecar sweeps, the epoch moves before the documents are read, or an
earlier request still holds the slot. What the kernel computes is tests/gpu/test_carousel.py's;
the sidecar's own part (epochs, the stop's wait, the sweep) is tests/unit's."""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import struct
from collections.abc import Iterator
from types import SimpleNamespace

import kalos_testing
import numpy as np
import posix_ipc
import pytest

import kalos_retrievers.client as client_module
from kalos_retrievers import SidecarTimeout
from kalos_retrievers.protocol import (
    CAR_REQUEST,
    HEADER_OFFSETS,
    W_ELIGIBLE,
    W_STATE,
    CarouselLayout,
    carousel_segment_name,
)

pytestmark = pytest.mark.timeout(120)
if not client_module._X86:
    pytest.skip("the direct path is x86-64 only", allow_module_level=True)

DIM, K, N = 11, 7, 157


class StandIn(kalos_testing.StandInProcess):
    """``kalos_testing.carousel_stand_in`` running while in the ``with`` block."""

    def __init__(self, name: str, mode: str) -> None:
        self.answered = mp.get_context("spawn").Value("i", 0)
        super().__init__(kalos_testing.carousel_stand_in, name, DIM, mode, self.answered)


@contextlib.contextmanager
def carousel_segment(name: str) -> Iterator[None]:
    """The carousel's slots, as a GPU sidecar with KALOS_CAROUSEL=direct makes them."""
    lay = CarouselLayout.of(DIM)
    seg = posix_ipc.SharedMemory(carousel_segment_name(name), flags=posix_ipc.O_CREX, mode=0o600,
                                 size=lay.segment_size())  # fmt: skip
    with mmap.mmap(seg.fd, lay.segment_size()) as mm:  # each slot's W_ELIGIBLE: the namespace's rows, N
        words = np.frombuffer(mm, np.uint32).reshape(-1, lay.slot_bytes // 4)
        words[:, W_ELIGIBLE] = N
        del words
    seg.close_fd()
    try:
        yield
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):  # (a test may have removed it)
            posix_ipc.unlink_shared_memory(carousel_segment_name(name))


def set_epoch(c, epoch: int, slots: int = 64) -> None:  # type: ignore[no-untyped-def]
    struct.pack_into("<QI", c._conn.seg.mm, HEADER_OFFSETS["carousel_epoch"], epoch, slots)


@pytest.fixture(params=["c", "python"])
def rig(request, start_sidecar, monkeypatch):  # type: ignore[no-untyped-def]
    """A CPU sidecar with N rows and texts, a client asking for arena documents and one asking
    for inline ones (the reference), the carousel's segment; each test twice: the direct path
    in C (``_fastpath.car_request1`` / ``car_answer1``) and in Python."""
    read_in_c = []
    if request.param == "python":
        monkeypatch.setattr(client_module, "_fastpath", None)
    elif client_module._fastpath is None:
        pytest.skip("the C extension is not built here")
    else:
        real = client_module._fastpath

        def car_answer1(*args):  # type: ignore[no-untyped-def]
            out = real.car_answer1(*args)
            read_in_c.append(out is not None)
            return out

        monkeypatch.setattr(client_module, "_fastpath", SimpleNamespace(**{n: getattr(real, n) for n in dir(real)
                                                                          if not n.startswith("_")}))  # fmt: skip
        monkeypatch.setattr(client_module._fastpath, "car_answer1", car_answer1)
    monkeypatch.setenv("KALOS_ARENA", "1")
    sc = start_sidecar(dim=DIM)
    rng = np.random.default_rng()
    with sc.client(arena_docs=True) as c, sc.client(arena_docs=False) as plain, carousel_segment(sc.name):
        c.upsert([f"m{i}" for i in range(N)], rng.standard_normal((N, DIM)).astype(np.float32),
                 texts=[f"memory {i} " * (1 + i % 4) for i in range(N)])  # fmt: skip
        c.ping()
        yield sc, c, plain, rng
        if request.param == "c":  # every direct answer kept was read by the C code (and some
            assert sum(read_in_c) >= c.direct_recalls  # it read were dropped after: the epoch moved)


def same(got, ref) -> None:  # type: ignore[no-untyped-def]
    assert list(got.ids) == list(ref.ids)
    assert [h.text for h in got] == [h.text for h in ref]
    np.testing.assert_array_equal(got.rows, ref.rows)
    np.testing.assert_allclose(got.scores, ref.scores, rtol=1e-6)


def test_direct_recalls_while_the_epoch_is_odd_only(rig) -> None:  # type: ignore[no-untyped-def]
    sc, c, plain, rng = rig
    queries = rng.standard_normal((13, DIM)).astype(np.float32)
    with StandIn(sc.name, "answer") as s:
        set_epoch(c, 2)  # even: the usual path (the negative control)
        for q in queries[:4]:
            same(c.recall(q, K), plain.recall(q, K))
        assert c.direct_recalls == 0 and s.answered.value == 0
        set_epoch(c, 3)
        for q in queries:
            same(c.recall(q, K), plain.recall(q, K))
        assert c.direct_recalls == len(queries) == s.answered.value
        same(c.recall(queries[0], 40), plain.recall(queries[0], 40))  # k above the kernel's 32: usual path
        set_epoch(c, 3, slots=0)  # no slot of ours may write: usual path
        same(c.recall(queries[1], K), plain.recall(queries[1], K))
        assert c.direct_recalls == len(queries) == s.answered.value


@pytest.mark.parametrize("mode", ["refuse", "sweep", "epoch", "drain", "short"])
def test_a_request_the_kernel_does_not_answer_for_good_is_asked_again_the_usual_way(rig, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Refused, swept, answered with fewer results than the namespace holds (a kernel that lost
    rows), or answered but read after a whole stop (the epoch 3 on: rows may have changed):
    asked again the usual way. Answered and read after a stop has only begun (the epoch 1 on:
    the rows cannot have changed): kept (the negative control)."""
    sc, c, plain, rng = rig
    set_epoch(c, 5)
    with StandIn(sc.name, mode) as s:
        for q in rng.standard_normal((5, DIM)).astype(np.float32):
            same(c.recall(q, K), plain.recall(q, K))
            if mode in ("epoch", "drain"):  # (the stand-in moved it on: odd again for the next one)
                set_epoch(c, 5)
        assert c.direct_recalls == (5 if mode == "drain" else 0)
        assert s.answered.value == (5 if mode in ("epoch", "drain", "short") else 0)


def test_queries_the_kernel_would_score_otherwise_than_the_sidecar_go_the_usual_way(rig) -> None:  # type: ignore[no-untyped-def]
    """A cosine query too small for the kernel's float32 normalization (its sum of squares
    underflows: the kernel would answer wrongly, not refuse) is asked the usual way; a normal
    one, the same direction, goes direct (the control)."""
    sc, c, plain, rng = rig
    set_epoch(c, 9)
    q = rng.standard_normal(DIM).astype(np.float32)
    with StandIn(sc.name, "answer") as s:
        same(c.recall(q * np.float32(1e-20), K), plain.recall(q, K))
        assert c.direct_recalls == 0 and s.answered.value == 0
        same(c.recall(q, K), plain.recall(q, K))
        assert c.direct_recalls == 1


def test_the_documents_come_from_the_arena_version_the_header_names_after_the_epoch(rig) -> None:  # type: ignore[no-untyped-def]
    """The arena moves to a new version (writes past its heap's room) between two direct
    recalls: the second's document is read from the new version (the one the header names
    after the epoch was read), with the row's new text."""
    sc, c, plain, rng = rig
    set_epoch(c, 11)
    q = rng.standard_normal(DIM).astype(np.float32)
    with StandIn(sc.name, "answer"):
        before = c._conn.arena()
        top = plain.recall(q, 1).ids[0]
        big = "x" * 200_000
        for j in range(12):  # (texts past the heap's room: the arena moves to a bigger version)
            plain.upsert([top], plain.get([top], with_vectors=True)[0].vector[None], texts=[big + str(j)])
        assert c._conn.arena() is not before  # (moved)
        res = c.recall(q, 1)
        assert c.direct_recalls == 1 and res.ids == [top] and res[0].text == big + "11"


def test_a_carousel_segment_removed_from_outside_leaves_new_clients_on_the_usual_path(rig) -> None:  # type: ignore[no-untyped-def]
    """``/kalos-NAME-car`` unlinked by someone else (a /dev/shm cleanup) while the carousel
    runs: a client that maps it from then on cannot, and asks the usual way, losing nothing; a
    client that had mapped it keeps writing into the same memory, which the kernel (here its
    stand-in) still maps, and goes direct as before (the control)."""
    sc, c, plain, rng = rig
    set_epoch(c, 17)
    q = rng.standard_normal((3, DIM)).astype(np.float32)
    with StandIn(sc.name, "answer") as s:
        same(c.recall(q[0], K), plain.recall(q[0], K))
        assert c.direct_recalls == 1
        posix_ipc.unlink_shared_memory(carousel_segment_name(sc.name))
        with sc.client(arena_docs=True) as late:
            same(late.recall(q[1], K), plain.recall(q[1], K))
            assert late.direct_recalls == 0 and late._conn._car is None
        same(c.recall(q[2], K), plain.recall(q[2], K))
        assert c.direct_recalls == 2 == s.answered.value


def test_a_recall_past_its_deadline_leaves_its_slot_to_the_kernel_and_the_next_goes_the_usual_way(rig) -> None:  # type: ignore[no-untyped-def]
    sc, c, plain, rng = rig
    set_epoch(c, 7)
    q = rng.standard_normal(DIM).astype(np.float32)
    with StandIn(sc.name, "silent"):
        with pytest.raises(SidecarTimeout):
            c.recall(q, K, timeout=0.05)
        car = c._conn._car
        assert car is not None and int(car.words[:, W_STATE].max()) == CAR_REQUEST  # still the kernel's
        same(c.recall(q, K), plain.recall(q, K))  # the slot is not written again: the usual path answers
        assert c.direct_recalls == 0


def test_the_arena_is_mapped_after_the_epoch_is_read(rig, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The order that keeps a direct answer's documents current: the epoch read (E), then the
    arena version the header names mapped, then, after the answer, the epoch again (rows and
    the arena change only after E + 3). An arena mapped before E could be a version the
    sidecar has since left, with a row's old document."""
    sc, c, plain, rng = rig
    set_epoch(c, 13)
    calls: list[str] = []
    arena, epoch = client_module._Conn.arena, client_module._Conn.carousel_epoch
    monkeypatch.setattr(client_module._Conn, "arena", lambda self: calls.append("arena") or arena(self))
    monkeypatch.setattr(client_module._Conn, "carousel_epoch", lambda self: calls.append("epoch") or epoch(self))
    q = rng.standard_normal(DIM).astype(np.float32)
    with StandIn(sc.name, "answer"):
        same(c.recall(q, K), plain.recall(q, K))
    assert c.direct_recalls == 1
    first = calls.index("epoch")
    assert "arena" in calls[first:] and calls[-1] == "epoch", calls


def test_a_direct_recall_learns_within_milliseconds_that_the_sidecar_died(rig, start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of the sidecar while a direct recall waits on a kernel that never answers: the
    recall raises SidecarUnavailable within a second (its wait checks the sidecar's lock every
    millisecond), far before its 20 s deadline (the silent kernel alone ends in SidecarTimeout:
    the deadline test above)."""
    import signal
    import threading
    import time

    from kalos_retrievers import SidecarUnavailable

    sc, c, _, rng = rig
    set_epoch(c, 15)
    q = rng.standard_normal(DIM).astype(np.float32)
    got: list[BaseException | None] = []

    def recall() -> None:
        try:
            c.recall(q, K, timeout=20)
            got.append(None)
        except BaseException as e:  # (checked below)
            got.append(e)

    with StandIn(sc.name, "silent"):
        t = threading.Thread(target=recall, daemon=True)
        t.start()
        kalos_testing.until(lambda: c._conn._car is not None and c._conn._car.words[:, W_STATE].max() == CAR_REQUEST)
        t0 = time.monotonic()
        sc.kill(signal.SIGKILL)
        t.join(10)
        assert not t.is_alive() and time.monotonic() - t0 < 1.0
    assert len(got) == 1 and isinstance(got[0], SidecarUnavailable), got
    sc.proc.wait(10)
    start_sidecar(name=sc.name, dim=DIM)  # (removes what the killed one left; stopped at teardown)

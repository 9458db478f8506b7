"""``KalosClient.recall`` whole in C (``_fastpath.bell1``, session 43) against a real CPU
sidecar whose header says a resident kernel runs (its doorbell_k word written here, as a GPU
sidecar writes it), with ``kalos_testing.doorbell_stand_in`` answering each DOORBELL request as
the kernel does. bell1 must give what the Python path and the sidecar give, hand what it does
not read whole to the Python path (losing nothing, the deadline kept), and decline, writing
nothing and taking no slot, whenever anything is unusual: then the Python path runs, which
checks everything again and says what is wrong."""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

import kalos_testing
import numpy as np
import pytest

import kalos_retrievers.client as client_module
from kalos_retrievers import KalosClient, SidecarTimeout
from kalos_retrievers import _conn as conn_module
from kalos_retrievers.protocol import SlotState

pytestmark = pytest.mark.timeout(120)
fastpath = pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")
if not client_module._X86:
    pytest.skip("the arena and the doorbell path are x86-64 only", allow_module_level=True)
if not hasattr(fastpath, "bell1"):
    pytest.skip("the C extension predates bell1 (rebuild it)", allow_module_level=True)

DIM, K, N = 13, 7, 211
BELL_K = conn_module._DOORBELL_K_WORD


def stand_in(name: str, hand_back: bool) -> kalos_testing.DoorbellStandIn:
    """``kalos_testing.doorbell_stand_in`` for this module's dimension, while in the ``with`` block."""
    return kalos_testing.DoorbellStandIn(name, DIM, hand_back)


class Paths:
    """Counts, on client ``c``, the recalls bell1 declined (``_recall_one`` ran) and those it
    wrote but left to Python (``_bell_rest`` ran)."""

    def __init__(self, c: KalosClient) -> None:
        self.c, self.declined, self.rest = c, 0, 0
        one, rest = c._recall_one, c._bell_rest

        def recall_one(*a: Any) -> Any:
            self.declined += 1
            return one(*a)

        def bell_rest(*a: Any) -> Any:
            self.rest += 1
            return rest(*a)

        c._recall_one, c._bell_rest = recall_one, bell_rest  # type: ignore[method-assign]

    def close(self) -> None:
        del self.c._recall_one, self.c._bell_rest


@pytest.fixture
def kernel_side(start_sidecar, monkeypatch) -> Iterator[tuple[KalosClient, KalosClient, np.ndarray]]:
    """A CPU sidecar with N rows (texts, metadata) in its arena; a client ``c`` told a resident
    kernel takes k <= 64; ``plain`` (inline documents, never the bell path); the rows. The C
    spin is 5 s, not 1 ms: the stand-in's answers (a search through the sidecar, on two busy
    cores) come later than a kernel's, and those past the spin would go the Python way."""
    monkeypatch.setenv("KALOS_ARENA", "1")
    monkeypatch.setattr(client_module, "_FAST_SPIN_NS", 5_000_000_000)
    sc = start_sidecar(dim=DIM)
    rng = np.random.default_rng()
    data = rng.standard_normal((N, DIM)).astype(np.float32)
    with sc.client(arena_docs=True) as c, sc.client(arena_docs=False) as plain:
        c.upsert([f"m{i}" for i in range(N)], data, texts=[f"memory {i} " * (1 + i % 4) for i in range(N)],
                 metadatas=[{"i": i} for i in range(N)])  # fmt: skip
        c.ping()
        hdr = c._conn._hdr32
        hdr[BELL_K] = 64  # "a resident kernel answers k <= 64"
        try:
            yield c, plain, data
        finally:
            hdr[BELL_K] = 0


def same(r: Any, w: Any) -> None:
    assert r.ids == w.ids
    assert np.allclose(r.scores, w.scores)
    assert [h.text for h in r] == [h.text for h in w]
    assert [h.metadata for h in r] == [h.metadata for h in w]
    assert r.rows.dtype == np.int32 and r.scores.dtype == np.float32


def test_bell1_answers_what_the_python_path_and_the_sidecar_answer(kernel_side, monkeypatch) -> None:
    """Every recall after the first (which makes the plan on the Python path) is answered by
    bell1 whole. Negative control: with ``_BELL1`` off, every one goes the Python way."""
    c, plain, data = kernel_side
    rng = np.random.default_rng()
    queries = [data[rng.integers(N)] + 0.01 * rng.standard_normal(DIM).astype(np.float32) for _ in range(29)]
    ks = [1 + j % K for j in range(len(queries))]
    got: dict[bool, list[Any]] = {}
    counts: dict[bool, tuple[int, int]] = {}
    with stand_in(c.name, hand_back=False) as kernel:
        for on in (True, False):
            monkeypatch.setattr(client_module, "_BELL1", on)
            c._bell = None
            paths = Paths(c)
            try:
                got[on] = [c.recall(queries[0], ks[0])]
                c._typical_wait_ns = 0
                got[on] += [c.recall(q, k) for q, k in zip(queries[1:], ks[1:], strict=True)]
            finally:
                paths.close()
            counts[on] = (paths.declined, paths.rest)
            if on:
                assert c._typical_wait_ns > 0  # bell1 keeps the wait's average, as recall1's path does
        assert kernel.answered.value == 2 * len(queries)
    assert counts[True] == (1, 0)  # the first made the plan; bell1 read every other one whole
    assert counts[False] == (len(queries), 0)
    for on in (True, False):
        for r, q, k in zip(got[on], queries, ks, strict=True):
            same(r, plain.recall(q, k))


def test_an_answer_handed_back_is_carried_on_in_python(kernel_side) -> None:
    """The kernel hands each request back (REQUEST: a crowd): bell1 leaves it to the Python
    path, which posts the sidecar's bell and reads its answer. Nothing lost, slots all back.
    (The sidecar's answer posts the slot's semaphore; a post the wait did not take, and
    ``_bell_rest`` found not there yet, makes the next bell1 on that slot decline: such a
    recall goes the usual way, so not every one is counted in ``rest``.)"""
    c, plain, data = kernel_side
    with stand_in(c.name, hand_back=True) as kernel:
        c.recall(data[0], K)  # (the plan)
        plan = c._bell
        assert plan is not None
        calls = []
        c._bell = (*plan[:12], lambda *a: calls.append(1) or plan[12](*a))
        paths = Paths(c)
        try:
            got = [c.recall(data[i], K) for i in range(1, 18)]
        finally:
            paths.close()
        assert kernel.handed_back.value == 18 and kernel.answered.value == 0
    assert len(calls) == 17  # every one offered to bell1, which wrote and handed over, or declined
    # (or, rarely, read whole: the sidecar, still awake, answered the handed-back request
    # before bell1's spin, descheduled on these two busy cores, saw it handed back)
    assert paths.rest >= 1 and paths.declined + paths.rest <= 17
    for i, r in zip(range(1, 18), got, strict=True):
        same(r, plain.recall(data[i], K))
    conn = c._conn
    assert conn is not None and len(conn.free) == len(conn.owned)


def test_no_answer_raises_at_the_clients_timeout(kernel_side) -> None:
    """No kernel answers (no stand-in): bell1 spins its millisecond and hands over; the Python
    wait raises SidecarTimeout at the client's timeout, not later."""
    c, _, data = kernel_side
    client_module._FAST_SPIN_NS = 1_000_000  # (the fixture's monkeypatch puts it back)
    with stand_in(c.name, hand_back=False):
        c.recall(data[0], K)  # (the plan, with the 1 ms spin)
    c.timeout = 0.4
    paths = Paths(c)
    t0 = time.monotonic()
    try:
        with pytest.raises(SidecarTimeout):
            c.recall(data[1], K)
    finally:
        paths.close()
    assert 0.35 < time.monotonic() - t0 < 3.0
    assert (paths.declined, paths.rest) == (0, 1)  # bell1 wrote it; the Python wait timed out


def _plan(c: KalosClient, data: np.ndarray) -> tuple[Any, ...]:
    with stand_in(c.name, hand_back=False):
        c.recall(data[0], K)
    assert c._bell is not None and struct.unpack("<13q", c._bell[6])[9] == client_module._FAST_SPIN_NS
    return c._bell


def _untouched(c: KalosClient, call: Any, conn: Any = None) -> None:
    """``call()`` returns None, and no slot of ``conn`` (default: the client's) was taken or written."""
    conn = conn or c._conn
    assert conn is not None
    free = list(conn.free)
    before = [(s.seq, s.state[0], bytes(s.ctl)) for s in free]
    assert call() is None
    assert conn.free == free
    assert [(s.seq, s.state[0], bytes(s.ctl)) for s in free] == before
    assert all(s.state[0] == SlotState.CLAIMED for s in free)


def _bad_queries() -> dict[str, Any]:
    q = np.ones(DIM, np.float32)
    nan = q.copy()
    nan[2] = np.nan
    wide = np.ones((3, 2 * DIM), np.float32)
    return {
        "list": q.tolist(),
        "float64": q.astype(np.float64),
        "big-endian": q.astype(">f4"),
        "one row, 2-D": q.reshape(1, DIM),
        "strided": wide[0, ::2],
        "short": q[:-1],
        "NaN": nan,
        "infinity": np.full(DIM, np.inf, np.float32),
    }


@pytest.mark.parametrize("what", list(_bad_queries()))
def test_a_query_bell1_does_not_take_is_declined_untouched(kernel_side, what: str) -> None:
    c, _, data = kernel_side
    plan = _plan(c, data)
    q = _bad_queries()[what]
    _untouched(c, lambda: fastpath.bell1(c, plan, q, K))


def _conditions() -> list[str]:
    return ["k past the kernel", "k 0", "k past max_k", "k a bool", "k a float", "kernel stopped", "carousel runs",
            "new arena version", "connection dropped", "another connection", "a thread waits", "no free slot",
            "semaphore posted", "arena_docs False", "forked"]  # fmt: skip


@pytest.mark.parametrize("what", _conditions())
def test_anything_unusual_is_declined_untouched(kernel_side, what: str) -> None:
    """Each condition bell1 checks, made true on a working plan: bell1 returns None, taking and
    writing nothing (and the recall then goes the Python way)."""
    c, _, data = kernel_side
    plan = _plan(c, data)
    conn = c._conn
    assert conn is not None
    q = data[3].copy()
    k: Any = K
    hdr, restore = conn._hdr32, []
    if what == "k past the kernel":
        hdr[BELL_K] = K - 1
    elif what == "k 0":
        k = 0
    elif what == "k past max_k":
        k = conn.header.max_k + 1
    elif what == "k a bool":
        k = True
    elif what == "k a float":
        k = 7.0
    elif what == "kernel stopped":
        hdr[BELL_K] = 0
    elif what == "carousel runs":
        epoch = conn_module._CAROUSEL_EPOCH_WORD
        hdr[epoch] = hdr[epoch] | 1
        restore.append(lambda: hdr.__setitem__(epoch, hdr[epoch] & ~1 & 0xFFFFFFFF))
    elif what == "new arena version":
        v = struct.unpack("<13q", plan[6])
        plan = (*plan[:6], struct.pack("<13q", *v[:10], v[10] + 1, *v[11:]), *plan[7:])
    elif what == "connection dropped":
        conn.dead = True
        restore.append(lambda: setattr(conn, "dead", False))
    elif what == "another connection":
        c._conn = None
        restore.append(lambda: setattr(c, "_conn", conn))
    elif what == "a thread waits":
        c._waiters = 1
        restore.append(lambda: setattr(c, "_waiters", 0))
    elif what == "no free slot":
        held = list(conn.free)
        conn.free.clear()
        restore.append(lambda: conn.free.extend(held))
    elif what == "semaphore posted":
        sem = conn.free[-1].sem
        sem.release()
        restore.append(lambda: sem.acquire(0))
    elif what == "arena_docs False":
        c.arena_docs = False
        restore.append(lambda: setattr(c, "arena_docs", True))
    try:
        if what == "forked":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: the parent's plan is not used
                try:
                    c._conn = conn  # (the client forgot it at the fork: only the fork count is left to check)
                    out = fastpath.bell1(c, plan, q, k)
                    os.write(w, b"none" if out is None else b"used")
                finally:
                    os._exit(0)
            os.close(w)
            assert os.read(r, 8) == b"none"
            os.close(r)
            os.waitpid(pid, 0)
        else:
            _untouched(c, lambda: fastpath.bell1(c, plan, q, k), conn)
    finally:
        for undo in restore:
            undo()
        hdr[BELL_K] = 64


def test_the_control_a_working_plan_is_used(kernel_side) -> None:
    """The negative control of the declines: the same plan, nothing unusual, is used (bell1
    returns the result, the slot given back, none leaked)."""
    c, plain, data = kernel_side
    plan = _plan(c, data)
    conn = c._conn
    assert conn is not None
    n_free = len(conn.free)
    q = data[5].copy()
    # what bell1 takes buffers of (a leaked buffer holds a reference), and what it reads
    held = (plan[2], plan[4], q, conn.free[-1].mem, conn.free[-1], conn, plan[3], plan[5])
    refs = [sys.getrefcount(x) for x in held]
    with stand_in(c.name, hand_back=False):
        for _ in range(300):
            got = fastpath.bell1(c, plan, q, K)
            assert type(got) is client_module.RecallResult, got
    same(got, plain.recall(q, K))
    del got
    assert len(conn.free) == n_free
    assert [sys.getrefcount(x) for x in held] == refs


def test_while_the_carousel_runs_a_k_past_its_reach_still_goes_to_the_kernel(kernel_side) -> None:
    """The carousel takes k <= 32 only: with its epoch odd, bell1 declines k 7 (the client's
    path writes into the carousel's slots then) but takes k 33 to the kernel, as the Python
    path would (it used to decline every k, and each such recall then paid for both paths)."""
    c, plain, data = kernel_side
    plan = _plan(c, data)
    conn = c._conn
    assert conn is not None
    hdr, epoch = conn._hdr32, conn_module._CAROUSEL_EPOCH_WORD
    hdr[epoch] = hdr[epoch] | 1
    try:
        _untouched(c, lambda: fastpath.bell1(c, plan, data[4], 7))
        with stand_in(c.name, hand_back=False):
            got = fastpath.bell1(c, plan, data[4], 33)
        assert type(got) is client_module.RecallResult
        same(got, plain.recall(data[4], 33))
    finally:
        hdr[epoch] = hdr[epoch] & ~1 & 0xFFFFFFFF


def test_a_plan_does_not_keep_an_old_arena_mapped(kernel_side) -> None:
    """A write that moves the sidecar's arena to a new version drops the client's mapping of
    the old one (``_Conn.drop_stale_arena``), and the plan with it: the plan would keep the old
    version's memory mapped until the next recall. Control: a write that leaves the version
    as it is keeps the plan."""
    c, _, data = kernel_side
    plan = _plan(c, data)
    conn = c._conn
    assert conn is not None
    version = plan[3].version
    c.upsert(["small"], data[:1], texts=["s"])
    assert conn._hdr32[conn_module._ARENA_VERSION_WORD] == version and c._bell is plan
    rng = np.random.default_rng()
    for j in range(20):  # (the arena grows into a new version within a few of these)
        c.upsert([f"big{j}-{i}" for i in range(500)], rng.standard_normal((500, DIM)).astype(np.float32),
                 texts=["y" * 2000] * 500)  # fmt: skip
        if conn._hdr32[conn_module._ARENA_VERSION_WORD] != version:
            break
    assert conn._hdr32[conn_module._ARENA_VERSION_WORD] != version
    assert conn.mapped_arena() is None and c._bell is None


def test_a_plan_with_a_negative_layout_value_is_refused(kernel_side) -> None:
    c, _, data = kernel_side
    plan = _plan(c, data)
    v = list(struct.unpack("<13q", plan[6]))
    for i in (5, 7, 9):  # the blob's size, the doorbell word, the spin
        w = v.copy()
        w[i] = -1
        bad = (*plan[:6], struct.pack("<13q", *w), *plan[7:])
        with pytest.raises(ValueError, match="negative"):
            fastpath.bell1(c, bad, data[0], K)


def test_a_wrong_plan_is_a_type_error(kernel_side) -> None:
    c, _, data = kernel_side
    plan = _plan(c, data)
    with pytest.raises(TypeError, match="plan"):
        fastpath.bell1(c, plan[:-1], data[0], K)
    with pytest.raises(TypeError, match="plan"):
        fastpath.bell1(c, (*plan[:6], b"short", *plan[7:]), data[0], K)
    with pytest.raises(TypeError, match="4 arguments"):
        fastpath.bell1(c, plan, data[0])

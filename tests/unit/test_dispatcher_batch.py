"""The dispatcher answering several waiting recalls with one search, in process (an anonymous
map stands in for the segment): each member gets its own answer, and a member whose query is
not finite gets an error without failing its neighbours."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import time
import warnings
from typing import Any, NamedTuple

import numpy as np
import pytest
from kalos_retrievers.sidecar import dispatcher as dispatcher_module
from kalos_retrievers.sidecar.dispatcher import Dispatcher, Invalid
from kalos_retrievers.sidecar.index import NS_ANY, CpuIndex, SlotSpec
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore
from kalos_testing import PostCounter as _Sem

from kalos_retrievers.arena import ArenaView, ArenaWriter
from kalos_retrievers.protocol import (
    CTL_SIZE,
    HEADER_SIZE,
    METRICS,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    Flag,
    Layout,
    Op,
    Request,
    RespFlag,
    Response,
    SlotState,
    Status,
    align8,
    decode_docs_blob,
    decode_recall_args,
    encode_recall_args,
)


def _write_scoped_recall(mm: Any, lay: Layout, slot: int, seq: int, k: int, dim: int, namespace: str,
                         flt: bytes | None, state: int = SlotState.REQUEST) -> None:  # fmt: skip
    """Write a batch-1 recall of ``k`` with documents from the arena, in ``namespace`` with the
    filter ``flt`` (JSON bytes), into ``slot`` (its query left as it is), and set its state."""
    off = lay.slot_offset(slot)
    args = encode_recall_args(namespace, flt)
    a = off + lay.payload_offset + align8(4 * dim)
    mm[a : a + len(args)] = args
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, Op.RECALL, Flag.ARENA_DOCS | Flag.ARENA_ENTRIES,
                             k, 1, 4 * dim, len(args), 0)  # fmt: skip
    np.frombuffer(mm, "<u4", 1, off)[0] = state


def _ip_service(dim: int, rows: int) -> tuple[Service, np.ndarray]:
    """A CPU service (inner product) holding ``rows`` random rows with ids r0, r1, ..."""
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    data = np.random.default_rng().standard_normal((rows, dim)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [""] * rows,
                "metadatas": [{} for _ in range(rows)]}, data)  # fmt: skip
    return svc, data


def test_batched_members_get_their_own_answers_and_a_nan_member_only_an_error() -> None:
    n_slots, dim, k, rows = 7, 13, 3, 301
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    svc, data = _ip_service(dim, rows)
    rng = np.random.default_rng()
    sems = [_Sem() for _ in range(n_slots)]
    stats = Stats()
    d = Dispatcher(mm, lay, sems, svc, stats, max_batch=64, describe=lambda: {})
    q = rng.standard_normal((n_slots, dim)).astype(np.float32)
    q[4, 5] = np.nan  # slot 4: a client that skipped validation
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    for i in range(n_slots):
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q[i]
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 100 + i, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
    states[:] = SlotState.REQUEST
    assert d.poll() == n_slots
    d.settle()  # the batch may still be in flight after poll()
    assert stats.batches == 1 and stats.batched_queries == n_slots - 1  # one search for the rest
    for i in range(n_slots):
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert resp.seq == 100 + i and sems[i].posts == 1
        if i == 4:
            assert states[i] == SlotState.ERROR and resp.status == Status.BAD_REQUEST
            blob = bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])
            assert b"NaN" in blob
            continue
        assert states[i] == SlotState.RESPONSE and resp.status == Status.OK and resp.n_results == k
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset)
        want = np.argsort(-(data @ q[i]), kind="stable")[:k]
        assert sorted(got.tolist()) == sorted(want.tolist())


@pytest.mark.parametrize("bad", [[np.nan], [np.inf], [-np.inf], [np.inf, -np.inf], None])
def test_a_lone_recall_is_refused_exactly_when_its_query_is_not_finite(
    bad: list[float] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request alone in its pass takes the one-dot finiteness check: NaN, infinities and
    +inf with -inf (whose dot warns) are refused with the batch path's message; huge and tiny
    finite queries (the negative control, ``None``) are answered. (The Python path's check:
    the C path's, which takes such a recall first where it is built, is tested in
    test_hotpath.py.)"""
    monkeypatch.setattr(dispatcher_module, "_hotpath", None)
    dim, k, rows = 29, 3, 101
    lay = Layout(n_slots=3, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    svc, data = _ip_service(dim, rows)
    stats = Stats()
    d = Dispatcher(mm, lay, [_Sem() for _ in range(3)], svc, stats, max_batch=64, describe=lambda: {})
    states = np.ndarray((3,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    off = lay.slot_offset(1)
    dots: list[float] = []  # the one-dot check ran (not the batch path's gather)
    real_isfinite = dispatcher_module.math.isfinite
    monkeypatch.setattr(dispatcher_module.math, "isfinite", lambda x: dots.append(x) or real_isfinite(x))
    queries = [np.float32(s) * data[7] for s in (1.0, 1e-30, 1e36)]
    if bad is not None:
        q = data[7].copy()
        q[3 : 3 + len(bad)] = bad
        queries = [q]
    for seq, q in enumerate(queries):
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 50 + seq, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
        states[1] = SlotState.REQUEST
        with warnings.catch_warnings():
            # numpy warns of +inf with -inf ("invalid value"); as an error it takes the except
            warnings.simplefilter("error")
            assert d.poll() == 1
            d.settle()
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert resp.seq == 50 + seq
        if bad is None:
            assert states[1] == SlotState.RESPONSE and resp.status == Status.OK and resp.n_results == k
            assert np.frombuffer(mm, np.int32, 1, off + lay.rows_offset)[0] == int(np.argmax(data @ q))
        else:
            assert states[1] == SlotState.ERROR and resp.status == Status.BAD_REQUEST
            assert b"NaN or infinity" in bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])
    assert stats.requests[("recall", "ok" if bad is None else "bad_request")] == len(queries)
    assert len(dots) == len(queries) or (bad == [np.inf, -np.inf] and not dots)  # (that one raised)


class _Watch(_Sem):
    """A semaphore that notes, at each post, which slots already hold their answer."""

    def __init__(self, states: np.ndarray, seen: list[int]) -> None:
        super().__init__()
        self.states, self.seen = states, seen

    def release(self) -> None:
        super().release()
        self.seen.append(int((self.states == SlotState.RESPONSE).sum()))


def test_a_batch_is_answered_whole_before_the_first_wake_up() -> None:
    """Every member's answer is written before any member's semaphore is posted (a post can
    hand the core to the woken client; the rest of the batch must not wait behind it). With
    posts as each answer is written, the first post would see one answer, not all."""
    n_slots, dim, k = 9, 5, 2
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 12, blob_size=1 << 12)
    mm = mmap.mmap(-1, lay.segment_size)
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    rng = np.random.default_rng()
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(31)], "texts": [""] * 31,
                "metadatas": [{} for _ in range(31)]}, rng.standard_normal((31, dim)).astype(np.float32))  # fmt: skip
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    seen: list[int] = []
    sems = [_Watch(states, seen) for _ in range(n_slots)]
    d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {})
    for i in range(n_slots):
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = rng.standard_normal(dim)
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 7 + i, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
    states[:] = SlotState.REQUEST
    assert d.poll() == n_slots
    d.settle()
    assert seen == [n_slots] * n_slots


def test_a_failed_batch_search_answers_each_member_once() -> None:
    """When the batched search itself fails, the members still waiting get its error, and the
    one already refused for NaN is not answered a second time."""
    from kalos_retrievers.protocol import Invalid

    n_slots, dim = 4, 6
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    svc.upsert({"namespace": "", "ids": ["a"], "texts": [""], "metadatas": [{}]}, np.ones((1, dim), np.float32))

    def broken(*_a, **_k):  # type: ignore[no-untyped-def]
        raise Invalid(Status.BAD_REQUEST, "the search refused the batch")

    svc.recall_slots = svc.launch_recall = broken  # type: ignore[method-assign]
    sems = [_Sem() for _ in range(n_slots)]
    d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    for i in range(n_slots):
        off = lay.slot_offset(i)
        q = np.full(dim, np.nan if i == 2 else 1.0, np.float32)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 50 + i, Op.RECALL, 0, 1, 1, 4 * dim, 0, 0)
    states[:] = SlotState.REQUEST
    assert d.poll() == n_slots
    assert [s.posts for s in sems] == [1] * n_slots
    for i in range(n_slots):
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        blob = bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])
        assert states[i] == SlotState.ERROR and resp.status == Status.BAD_REQUEST
        assert (b"NaN" if i == 2 else b"refused the batch") in blob


class _DeferredIndex(CpuIndex):
    """A CPU index that behaves like an asynchronous device: launch_slots only records the
    work; its results (and the poison before them) land in the slots at finish_slots."""

    defers = True  # type: ignore[assignment]

    def __init__(self, dim: int, metric: int, log: list[str]) -> None:
        super().__init__(dim, metric)
        self.log = log
        self._pending: tuple | None = None
        self.during_search: list = []  # callables run while the "device" searches (once each)

    def launch_slots(self, specs, k, high, ns, candidates, dense) -> None:  # type: ignore[no-untyped-def]
        self.finish_slots()
        for s in specs:
            s.rows[:, :k] = -7  # what an unfinished device search would leave: out of range
        self.log.append(f"launch {len(specs)}")
        self._pending = (specs, k, high, ns, candidates, dense)

    def finish_slots(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            while self.during_search:
                self.during_search.pop(0)()
            self.search_slots(*pending)
            self.log.append("finish")


def test_pipelined_batches_answer_only_finished_searches_and_settle_before_writes() -> None:
    n_slots, dim, k, rows = 7, 5, 2, 50
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    log: list[str] = []
    svc = Service(_DeferredIndex(dim, METRICS["ip"], log), NullStore(), dim=dim, metric=METRICS["ip"])
    rng = np.random.default_rng()
    data = rng.standard_normal((rows, dim)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [""] * rows,
                "metadatas": [{} for _ in range(rows)]}, data)  # fmt: skip
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=3, describe=lambda: {})
    sem_posts = lambda: [s.posts for s in d.sems]  # noqa: E731
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    q = rng.standard_normal((n_slots, dim)).astype(np.float32)

    def request(i: int, seq: int) -> None:
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q[i]
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
        states[i] = SlotState.REQUEST

    def check_answered(i: int) -> None:
        off = lay.slot_offset(i)
        assert states[i] == SlotState.RESPONSE, (i, states[i], log)
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset)
        assert sorted(got.tolist()) == sorted(np.argsort(-(data @ q[i]))[:k].tolist())

    for i in range(n_slots):
        request(i, 10 + i)
    assert d.poll() == n_slots  # chunks of 3, 3, 1
    # each chunk was launched before the one before it was answered; the last stays in flight
    assert log == ["launch 3", "finish", "launch 3", "finish", "launch 1"], log
    for i in range(6):
        check_answered(i)
    assert states[6] == SlotState.BUSY and sem_posts()[6] == 0
    assert d.settle() == 1 and log[-1] == "finish"
    check_answered(6)
    assert d.settle() == 0

    # a write arriving while a batch is in flight: the batch is answered first
    request(0, 30)
    assert d.poll() == 1 and states[0] == SlotState.BUSY
    vec = rng.standard_normal(dim).astype(np.float32)
    args = b'{"namespace":"","ids":["new"],"texts":["t"],"metadatas":[{}]}'
    off = lay.slot_offset(1)
    np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = vec
    at = off + lay.payload_offset + align8(4 * dim)  # args follow the vectors, 8-byte aligned
    mm[at : at + len(args)] = args
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 31, Op.UPSERT, 0, 0, 1, 4 * dim, len(args), 0)
    states[1] = SlotState.REQUEST
    assert d.poll() == 1
    check_answered(0)  # answered from the rows as they were before the upsert
    assert states[1] == SlotState.RESPONSE and svc.rows.live == rows + 1


def _deferred_setup(n_slots: int, dim: int, rows: int, cls: type = _DeferredIndex):  # type: ignore[no-untyped-def]
    """A segment of ``n_slots`` slots and a service over a :class:`_DeferredIndex` (or
    ``cls``; inner product) holding ``rows`` random rows with ids r0, r1, ...; returns
    (layout, segment, the index's log, index, service, rng, rows)."""
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    log: list[str] = []
    index = cls(dim, METRICS["ip"], log)
    svc = Service(index, NullStore(), dim=dim, metric=METRICS["ip"])
    rng = np.random.default_rng()
    data = rng.standard_normal((rows, dim)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [""] * rows,
                "metadatas": [{} for _ in range(rows)]}, data)  # fmt: skip
    return lay, mm, log, index, svc, rng, data


def test_requests_arriving_during_a_search_join_the_next_batch() -> None:
    """With a batch in flight, the dispatcher picks up what waits, then waits for the search
    before launching, so requests that arrive while the device searches are launched together
    with those that were already waiting: one pass over the rows for all of them, not one for
    each wave."""
    n_slots, dim, k, rows = 6, 5, 2, 40
    lay, mm, log, index, svc, rng, data = _deferred_setup(n_slots, dim, rows)
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    q = rng.standard_normal((n_slots, dim)).astype(np.float32)

    def request(i: int) -> None:
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q[i]
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 70 + i, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
        states[i] = SlotState.REQUEST

    request(0)
    assert d.poll() == 1 and log == ["launch 1"]
    request(1)
    request(2)
    seen: list[list[int]] = []
    index.during_search += [lambda: seen.append(states[:5].tolist()),  # while slot 0's search runs
                            lambda: request(3), lambda: request(4)]  # fmt: skip
    assert d.poll() == 4
    assert log == ["launch 1", "finish", "launch 4"], log  # 1-4 in one batch, not 1-2 then 3-4
    # 1 and 2 were picked up (BUSY) while the device searched, not after: the device then idles
    # only for the pickup of 3 and 4
    assert seen == [[SlotState.BUSY] * 3 + [SlotState.FREE] * 2], seen
    assert states[0] == SlotState.RESPONSE
    assert all(states[i] == SlotState.BUSY for i in range(1, 5))
    assert d.settle() == 4
    for i in range(5):
        off = lay.slot_offset(i)
        assert states[i] == SlotState.RESPONSE
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset)
        assert sorted(got.tolist()) == sorted(np.argsort(-(data @ q[i]))[:k].tolist())


class _Returning(_Sem):
    """A response semaphore whose client, once posted, reads its answer (``on_post``), then
    sends its next request at once (as a client process does, some µs later)."""

    def __init__(self, on_post) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.on_post = on_post

    def release(self) -> None:
        super().release()
        self.on_post()


def _gather_rig(n_slots: int, cls: type = _DeferredIndex):  # type: ignore[no-untyped-def]
    dim, k, rows = 5, 2, 40
    lay, mm, log, index, svc, rng, data = _deferred_setup(n_slots, dim, rows, cls)
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    q = rng.standard_normal((n_slots, dim)).astype(np.float32)
    seqs = [0] * n_slots
    answered: list[tuple[int, int, list[int]]] = []  # (slot, seq, rows) as each client read it

    def request(i: int) -> None:
        seqs[i] += 1
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q[i]
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seqs[i], Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
        states[i] = SlotState.REQUEST

    def read(i: int, added: np.ndarray | None = None) -> None:
        """Check slot ``i``'s answer against the rows (and the rows ``added`` since, if any)."""
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert states[i] == SlotState.RESPONSE and resp.seq == seqs[i], (i, states[i], resp)
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset).tolist()
        rows = data if added is None else np.vstack([data, added])
        assert sorted(got) == sorted(np.argsort(-(rows @ q[i]))[:k].tolist())
        answered.append((i, seqs[i], got))

    return lay, mm, svc, index, log, states, request, read, answered


@pytest.mark.parametrize("gather_us", [0, 1_000_000])
def test_gathering_launches_the_returning_clients_with_those_already_waiting(gather_us: int) -> None:
    """With ``gather_us``, the dispatcher answers the batch in flight before launching the
    requests that waited for it, and takes the clients it answered into the same launch when
    they come back: one pass over the rows for all. Without (the negative control), those
    clients' next requests wait for a pass of their own."""
    lay, mm, svc, _index, log, _states, request, read, answered = _gather_rig(4)
    back = lambda i: lambda: (read(i), request(i))  # noqa: E731 - a client that recalls again at once
    sems = [_Returning(back(0)), _Sem(), _Sem(), _Sem()]
    d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {}, gather_us=gather_us)
    request(0)
    assert d.poll() == 1 and log == ["launch 1"]
    request(1)
    request(2)
    if gather_us:
        assert d.poll() == 3  # 1 and 2, then 0 again
        assert log == ["launch 1", "finish", "launch 3"], log
        assert answered == [(0, 1, answered[0][2])]  # slot 0's first answer, read before the launch
    else:
        assert d.poll() == 2
        assert log == ["launch 1", "finish", "launch 2"], log
        assert d.poll() == 1 and log[-1] == "launch 1", log  # slot 0's second request: its own pass
    sems[0].on_post = lambda: read(0)  # the client stops
    assert d.settle() == (3 if gather_us else 1)
    for i in (1, 2):
        read(i)
    assert [a[:2] for a in answered] == [(0, 1), (0, 2), (1, 1), (2, 1)]


def test_gathering_waits_at_most_half_the_search_for_clients_that_do_not_come_back() -> None:
    lay, mm, svc, index, log, states, request, _read, _answered = _gather_rig(3)
    sems = [_Sem() for _ in range(3)]
    d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {}, gather_us=10_000_000)
    request(0)
    assert d.poll() == 1
    request(1)
    index.during_search.append(lambda: time.sleep(0.02))  # the search in flight takes 20 ms
    t0 = time.monotonic()
    assert d.poll() == 1  # slot 0 answered, its client never returns: slot 1 launched alone
    waited = time.monotonic() - t0
    assert 0.02 <= waited < 2.0, waited  # the search and up to half of it again, not 10 s
    assert log == ["launch 1", "finish", "launch 1"], log
    assert states[0] == SlotState.RESPONSE and sems[0].posts == 1
    assert d.settle() == 1 and states[1] == SlotState.RESPONSE


class _QueueingIndex(_DeferredIndex):
    """A deferred index that can queue a batch behind the one left running, as the GPU index
    does for float16 batches: ``launch_slots(behind=True)`` logs "queue n" and leaves the
    earlier search pending; ``finish_slots`` finishes the oldest. ``pending_done`` says the
    device is done with the oldest after ``done_after`` questions, and runs one of
    ``arrivals`` (a request arriving) at each question before that."""

    def __init__(self, dim: int, metric: int, log: list[str]) -> None:
        super().__init__(dim, metric, log)
        self.queue: list[tuple] = []
        self.can_queue = True
        self.done_after = 1_000_000
        self.asked = 0
        self.arrivals: list = []
        self.max_n = 64  # the most queries a queued batch may have (a device's shared memory)
        # "fresh": each queued launch stamps behind_stamps as the GPU index does with
        # KALOS_BATCH_TIMING; "stale": stamps left from some earlier launch; None: none
        self.stamps: str | None = None
        self.behind_stamps: tuple[int, int, int] | None = None
        self.slot_launches: list[list[int]] = []  # the slots of each launch_behind_slots
        self.segment = (0, 0)  # (start, size) of the segment its slots' addresses must lie in
        self.refuse_slots = False  # launch_behind_slots raises

    def launch_slots(self, specs, k, high, ns, candidates, dense, behind=False) -> None:  # type: ignore[no-untyped-def]
        if behind:
            t_in = time.perf_counter_ns()
            assert self.queues_behind(sum(len(s.queries) for s in specs), k, high)
            if self.stamps == "fresh":
                t_cuda = time.perf_counter_ns()
                time.sleep(0.002)  # the "CUDA calls": the longest part, so that its share shows
                self.behind_stamps = (t_in, t_cuda, time.perf_counter_ns())
            elif self.stamps == "stale":
                self.behind_stamps = (1, 2, 3)
        while self.queue and not behind:
            self.finish_slots()
        for s in specs:
            s.rows[:, :k] = -7
        self.log.append(f"{'queue' if behind else 'launch'} {len(specs)}")
        self.queue.append((specs, k, high, ns, candidates, dense))
        self.asked = 0

    queues_from_slots = True  # type: ignore[assignment]  # (as the GPU index with its C launch)

    def launch_behind_slots(self, slots, table, k, high, ns) -> None:  # type: ignore[no-untyped-def]
        """As the GPU index: each slot's query read, and its results written, at the addresses
        in its row of ``table`` (checked to lie in the segment, ``self.segment``: (start, size))."""
        self.slot_launches.append(list(slots))
        if self.refuse_slots:
            raise RuntimeError("the device refused the queued launch")
        start, size = self.segment
        specs = []
        for i in slots:
            q, r, s = (int(a) for a in table[i])
            assert all(start <= a and a + 4 * max(self.dim, k) <= start + size for a in (q, r, s)), (i, table[i])
            at = lambda a, ct, n: np.ctypeslib.as_array((ct * n).from_address(a)).reshape(1, n)  # noqa: E731
            specs.append(SlotSpec(at(q, ctypes.c_float, self.dim), at(r, ctypes.c_int32, k), at(s, ctypes.c_float, k),
                                  q, r, s))  # fmt: skip
        self.launch_slots(specs, k, high, ns, None, ns == NS_ANY, behind=True)

    def finish_slots(self) -> None:
        if self.queue:
            self.search_slots(*self.queue.pop(0))
            self.log.append("finish")
            self.asked = 0

    def queues_behind(self, n: int, k: int, high: int) -> bool:
        return self.can_queue and len(self.queue) == 1 and n <= self.max_n

    def pending_done(self) -> bool:
        self.asked += 1
        if self.asked > self.done_after:
            return True
        if self.arrivals:
            self.arrivals.pop(0)()
        return False


def _queue_rig(n_slots: int, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """_gather_rig over a :class:`_QueueingIndex`, every slot's client seen once (a first
    batch of all of them, answered) so the dispatcher knows the cohort (seen "lately" for as
    long as the test takes: a slow host must not make the clients drop out of the count)."""
    monkeypatch.setattr(dispatcher_module, "COHORT_WINDOW_NS", 10**15)
    rig = _gather_rig(n_slots, _QueueingIndex)
    lay, mm, svc, index, log, _states, request, read, answered = rig
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=64, describe=lambda: {})
    index.segment = (d.base_addr, lay.segment_size)
    for i in range(n_slots):
        request(i)
    index.done_after = 0  # (nothing to wait for: every client's request is there)
    assert d.poll() == n_slots and d.settle() == n_slots
    index.done_after = 1_000_000
    for i in range(n_slots):
        read(i)
    log.clear()
    answered.clear()
    return d, rig


@pytest.mark.parametrize("can_queue", [True, False])
def test_a_returning_cohort_is_queued_behind_the_batch_in_flight(
    can_queue: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two cohorts take turns: while the device searches one (slots 0-2), the other (3-5)
    comes back. The dispatcher takes them as they arrive until the whole cohort waits (slot 5
    arrives while it waits), then queues their batch behind the one in flight before it
    finishes and answers that one: the device goes from one pass to the next with no host gap.
    The negative control (an index that cannot queue) finishes the batch in flight first."""
    d, (_lay, _mm, _svc, index, log, states, request, read, answered) = _queue_rig(6, monkeypatch)
    index.can_queue = can_queue
    for i in (0, 1, 2):
        request(i)
    assert d.poll() == 3 and log == ["launch 3"], log
    request(3)
    request(4)
    index.arrivals.append(lambda: request(5))
    if can_queue:
        assert d.poll() == 3
        assert log == ["launch 3", "queue 3", "finish"], log  # 3-5 together, queued, then 0-2 answered
        assert [states[i] for i in range(6)] == [SlotState.RESPONSE] * 3 + [SlotState.BUSY] * 3
    else:
        assert d.poll() == 2
        assert log == ["launch 3", "finish", "launch 2"], log
        request(5)  # (no index question brought it meanwhile)
        assert d.poll() == 1 and log[-2:] == ["finish", "launch 1"], log  # too late for 3-4: a pass of its own
    for i in (0, 1, 2):
        read(i)
    assert d.settle() == (3 if can_queue else 1)
    if not can_queue:
        assert states[3] == states[4] == SlotState.RESPONSE
    for i in (3, 4, 5):
        read(i)
    assert sorted(a[:2] for a in answered) == [(i, 2) for i in range(6)]


@pytest.mark.parametrize(("hot", "from_slots"), [(True, True), (True, False), (False, True)])
def test_a_queued_batch_of_taken_members_is_launched_from_their_slot_numbers(
    hot: bool, from_slots: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members that _hotpath.take took (batch-1 recalls in the default namespace, checked) are
    queued through Service.launch_queued where the index prefers it (``queues_from_slots``: the
    GPU index with its C launch): the index gets their slot numbers and the dispatcher's table
    of slot addresses, no specs (their specs are made after the launch, for the answers). The
    answers are each client's own. Without the C take, or where the index does not prefer it
    (the negative controls), the specs' way, as before."""
    if not hot:
        monkeypatch.setattr(dispatcher_module, "_hotpath", None)
    elif dispatcher_module._hotpath is None:
        pytest.skip("the C extension is not built here")
    d, (_lay, _mm, _svc, index, log, _states, request, read, _answered) = _queue_rig(7, monkeypatch)
    index.queues_from_slots = from_slots
    for i in (0, 1, 2):
        request(i)
    assert d.poll() == 3
    for i in (5, 3, 6, 4):
        request(i)
    assert d.poll() == 4
    assert log == ["launch 3", "queue 4", "finish"], log
    assert index.slot_launches == ([[3, 4, 5, 6]] if hot and from_slots else []), index.slot_launches
    assert d.settle() == 4
    for i in range(7):
        read(i)
    assert d._inflight is None and not d._taken


@pytest.mark.parametrize("refuse", [True, False])
def test_a_failed_launch_from_slot_numbers_fails_its_members_only(
    refuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch from slot numbers that raises answers its members INTERNAL with the error's
    message; the batch in flight is still answered, and the next batch launches as usual.
    The control: the same launch not refused answers everyone."""
    if dispatcher_module._hotpath is None:
        pytest.skip("the C extension is not built here")
    d, (lay, mm, _svc, index, _log, states, request, read, _answered) = _queue_rig(5, monkeypatch)
    index.refuse_slots = refuse
    for i in (0, 1):
        request(i)
    assert d.poll() == 2
    for i in (2, 3, 4):
        request(i)
    assert d.poll() == 3
    assert index.slot_launches == [[2, 3, 4]]
    for i in (0, 1):
        read(i)
    assert d.settle() == (0 if refuse else 3)
    for i in (2, 3, 4):
        if not refuse:
            read(i)
            continue
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        blob = bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])
        assert states[i] == SlotState.ERROR and resp.status == Status.INTERNAL and b"refused" in blob, resp
    request(2)
    assert d.poll() == 1 and d.settle() == 1
    read(2)


def test_a_queued_launch_waits_no_longer_than_the_search_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client of the other cohort that does not come back is not waited for past the end of
    the search in flight: the device being done with it launches whoever is waiting."""
    d, (_lay, _mm, _svc, index, log, _states, request, read, _answered) = _queue_rig(5, monkeypatch)
    for i in (0, 1):
        request(i)
    assert d.poll() == 2
    request(2)  # 3 and 4 stay away
    index.done_after = 3
    assert d.poll() == 1
    assert log == ["launch 2", "queue 1", "finish"], log
    assert index.asked == 0  # (reset by the finish) it asked until the device was done
    assert d.settle() == 1
    for i in (0, 1, 2):
        read(i)


@pytest.mark.parametrize(("timing", "back"), [(True, True), (True, False), (False, True)])
def test_a_queued_launch_is_timed_by_what_ended_its_wait(
    timing: bool, back: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the diagnostics on (``KALOS_BATCH_TIMING=1``), a batch queued behind another records
    how long the dispatcher waited for its cohort, as "cohort_wait" when the whole cohort came
    back and "device_wait" when the device's end cut the wait short, and its launch as
    "queue_launch". Off (the negative control), none of them."""
    d, (_lay, _mm, _svc, index, log, _states, request, read, _answered) = _queue_rig(5, monkeypatch)
    d.timing = timing
    for i in (0, 1):
        request(i)
    assert d.poll() == 2
    request(2)
    if back:
        index.arrivals += [lambda: request(3), lambda: request(4)]
    else:
        index.done_after = 3  # 3 and 4 stay away
    assert d.poll() == (3 if back else 1)
    assert log == ["launch 2", f"queue {3 if back else 1}", "finish"], log
    phases = d.stats.phases
    assert ("cohort_wait" in phases) == (timing and back), phases.keys()
    assert ("device_wait" in phases) == (timing and not back), phases.keys()
    assert ("queue_launch" in phases) == timing, phases.keys()
    if timing:
        wait = phases["cohort_wait" if back else "device_wait"]
        assert wait.count == 1 and phases["queue_launch"].count == 1
    assert d.settle() == (3 if back else 1)
    for i in range(5 if back else 3):
        read(i)


@pytest.mark.parametrize("queued", [True, False])
def test_a_launched_batch_is_booked_after_the_answers_of_the_batch_ahead(
    queued: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bookkeeping of a batch launched while another waits to be answered (queued behind
    it, or launched after it finished: the pipeline) waits until that batch's answers are
    posted: its stats, its clients counted as seen, its pickup phase. Those clients are the
    next cohort, and the host's time before their answers is on their way back. Booked at the
    launch, as before (the negative control, checked by hand), the batch was counted before
    the first of those posts."""
    d, (_lay, _mm, _svc, index, log, _states, request, read, _answered) = _queue_rig(4, monkeypatch)
    index.can_queue = queued
    for i in (0, 1):
        request(i)
    assert d.poll() == 2
    before = d.stats.batches  # slots 0-1 counted (nothing was answered after their launch)
    at_posts: list[tuple[int, bool]] = []

    class Noting(_Sem):
        def release(self) -> None:
            super().release()
            at_posts.append((d.stats.batches, 2 in d._seen and d._seen[2] > seen_2))

    seen_2 = d._seen[2]  # (from the rig's first batch of every slot)
    for i in (0, 1):
        d.sems[i] = Noting()
    request(2)
    if queued:
        index.arrivals.append(lambda: request(3))
    else:
        request(3)
    assert d.poll() == 2
    assert log == ["launch 2", "queue 2", "finish"] if queued else ["launch 2", "finish", "launch 2"], log
    assert at_posts == [(before, False), (before, False)]  # 2-3 not booked yet when 0-1 were posted
    assert d.stats.batches == before + 1 and d._seen[2] > seen_2  # booked once they were
    assert d.stats.phases["pickup"].count == 3  # the rig's batch, 0-1, 2-3
    assert d.settle() == 2
    assert d.stats.batches == before + 1 and d.stats.phases["pickup"].count == 3  # (once)
    for i in range(4):
        read(i)


@pytest.mark.parametrize("stamps", ["fresh", "stale", None])
def test_a_timed_queued_launch_is_split_where_the_index_stamped_it(
    stamps: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the index stamped the queued launch (``behind_stamps``, the GPU index with
    ``KALOS_BATCH_TIMING``), "queue_launch" is split into its parts: "ql_dispatch" up to the
    index, "ql_prep" and "ql_cuda" inside it, "ql_after" once it returned; they add up to the
    whole. Stamps of some earlier launch, or none (negative controls): no parts."""
    d = _two_cohorts_of_two(None, monkeypatch, timing=True, stamps=stamps)
    phases = d.stats.phases
    parts = ("ql_dispatch", "ql_prep", "ql_cuda", "ql_after")
    assert all((p in phases) == (stamps == "fresh") for p in parts), phases.keys()
    if stamps == "fresh":
        assert all(phases[p].count == 1 for p in (*parts, "queue_launch"))
        total = phases["queue_launch"].sum_us
        assert phases["ql_cuda"].sum_us >= 2000  # the index's "CUDA calls" slept 2 ms
        assert sum(phases[p].sum_us for p in parts) == pytest.approx(total, abs=1.0)


def _two_cohorts_of_two(profile, monkeypatch: pytest.MonkeyPatch, timing: bool = False,  # type: ignore[no-untyped-def]
                        stamps: str | None = None) -> Dispatcher:  # fmt: skip
    """Slots 0-1 launched, then 2-3 queued behind them with ``profile`` as the dispatcher's
    profiler, ``timing`` its diagnostics and ``stamps`` the index's (_QueueingIndex), every
    answer checked; the dispatcher after."""
    d, (_lay, _mm, _svc, index, log, _states, request, read, _answered) = _queue_rig(4, monkeypatch)
    d.profile = profile
    d.timing = timing
    index.stamps = stamps
    for i in (0, 1):
        request(i)
    assert d.poll() == 2
    request(2)
    index.arrivals.append(lambda: request(3))
    assert d.poll() == 2 and log == ["launch 2", "queue 2", "finish"], log
    assert d.settle() == 2
    for i in range(4):
        read(i)
    return d


@pytest.mark.parametrize("profiled", [True, False])
def test_a_queued_launch_runs_under_the_profiler_when_asked(profiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Dispatcher.profile`` (the sidecar sets it with ``KALOS_PROFILE``) is enabled around each
    launch of a batch queued behind another, and only there: its statistics hold the launch
    and not the wait for the cohort. Without one (the negative control) nothing is profiled."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    _two_cohorts_of_two(prof if profiled else None, monkeypatch)
    if not profiled:
        with pytest.raises(TypeError):  # (an empty profile has no statistics)
            pstats.Stats(prof)
        return
    names = {fn[2] for fn in pstats.Stats(prof).stats}  # type: ignore[attr-defined]
    assert "_launch_batch" in names and "launch_slots" in names, names
    assert "pending_done" not in names and "waiting" not in names, names


def test_a_profiler_that_cannot_start_leaves_the_queued_batch_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profiler whose ``enable`` fails (another profiler holds Python 3.12's slot) is dropped
    with a warning; the batch it was to profile is launched and answered all the same."""

    class Refusing:
        def enable(self) -> None:
            raise ValueError("another profiling tool is already active")

        def disable(self) -> None:
            raise AssertionError("never enabled")

    assert _two_cohorts_of_two(Refusing(), monkeypatch).profile is None


def test_an_empty_batch_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    d, (_lay, _mm, _svc, _index, log, _states, _request, _read, _answered) = _queue_rig(2, monkeypatch)
    assert d._launch_batch([], 2, 0) is None and log == []


def test_a_batch_in_flight_stays_so_while_the_device_searches_and_nothing_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With nothing waiting, a pass leaves the batch in flight while the device still searches
    it (the next cohort can then be queued behind it), and answers it once the device is done:
    it never answers a search the device has not finished."""
    d, (_lay, _mm, _svc, index, log, states, request, read, _answered) = _queue_rig(3, monkeypatch)
    request(0)
    assert d.poll() == 1 and log == ["launch 1"]
    index.done_after = 2
    assert d.poll() == 0 and d.poll() == 0  # still searching: nothing answered
    assert states[0] == SlotState.BUSY and log == ["launch 1"]
    assert d.poll() == 1 and log == ["launch 1", "finish"]  # done: answered by the empty pass
    read(0)


def test_a_write_arriving_while_a_cohort_gathers_is_answered_after_the_batch_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upsert that arrives while the dispatcher waits for a cohort settles the batch in
    flight first (answered from the rows as they were), and the cohort's batch then takes the
    usual path, over the rows with the write."""
    d, (lay, mm, svc, index, log, states, request, read, _answered) = _queue_rig(4, monkeypatch)
    for i in (0, 1):
        request(i)
    assert d.poll() == 2
    request(2)
    dim = svc.dim

    def upsert() -> None:
        off = lay.slot_offset(3)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = 1.0
        args = b'{"namespace":"","ids":["new"],"texts":["t"],"metadatas":[{}]}'
        at = off + lay.payload_offset + align8(4 * dim)
        mm[at : at + len(args)] = args
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 99, Op.UPSERT, 0, 0, 1, 4 * dim, len(args), 0)
        states[3] = SlotState.REQUEST

    index.arrivals.append(upsert)
    rows_before = svc.rows.live
    assert d.poll() == 2
    assert states[3] == SlotState.RESPONSE and svc.rows.live == rows_before + 1
    assert log == ["launch 2", "finish", "launch 1"], log  # settled for the write, then the usual path
    for i in (0, 1):
        read(i)
    assert d.settle() == 1
    read(2, added=np.ones((1, dim), np.float32))  # over the rows with the write (row 40 may rank)


def test_a_queued_launch_counts_queries_not_members(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a batch can be queued is asked for its queries, not its members: members of
    three queries each, two of them over what the index can queue (4 queries here), take the
    usual path and are answered, not refused."""
    d, (lay, mm, svc, index, log, states, request, read, _answered) = _queue_rig(4, monkeypatch)
    index.max_n = 4
    request(0)
    assert d.poll() == 1 and log == ["launch 1"]
    dim = svc.dim
    q3 = np.random.default_rng().standard_normal((3, dim)).astype(np.float32)
    for i in (1, 2):
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, 3 * dim, off + lay.payload_offset)[:] = q3.ravel()
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 50 + i, Op.RECALL, 0, 2, 3, 12 * dim, 0, 0)
        states[i] = SlotState.REQUEST
    index.done_after = 1
    assert d.poll() == 2
    assert log == ["launch 1", "finish", "launch 2"], log  # 6 queries: not queued
    read(0)
    assert d.settle() == 2
    for i in (1, 2):
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert states[i] == SlotState.RESPONSE and resp.status == Status.OK, (i, resp)


class _BrokenSem(_Sem):
    def release(self) -> None:
        super().release()
        raise RuntimeError("sem_post failed")


@pytest.mark.parametrize("gather_us", [0, 1_000_000])
def test_a_failure_answering_the_batch_in_flight_leaves_no_request_picked_up_unanswered(gather_us: int) -> None:
    """Answering the batch in flight fails (here its member's semaphore post): the requests
    picked up while it searched are answered all the same, once the serve loop has logged the
    failed pass and settled the batch in flight, as it does. Without gathering (the control)
    they were launched before the failure; gathering answers the batch in flight first, and
    before the fix the failure left them picked up (BUSY) and never launched: never answered."""
    lay, mm, svc, _index, log, states, request, read, _answered = _gather_rig(3)
    sems = [_BrokenSem(), _Sem(), _Sem()]
    d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {}, gather_us=gather_us)
    request(0)
    assert d.poll() == 1
    request(1)
    request(2)
    with contextlib.suppress(RuntimeError):  # as the serve loop: the failed pass logged, then settle
        d.poll()
    d.settle()
    assert states[0] == SlotState.RESPONSE and sems[0].posts == 1
    for i in (1, 2):
        read(i)
        assert sems[i].posts == 1
    assert log == ["launch 1", "finish", "launch 2", "finish"], log


def test_a_failure_answering_the_batch_in_flight_leaves_the_queued_batch_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """Answering the batch in flight fails after the next batch was queued behind it (here its
    member's semaphore post): the queued batch stays in flight, so the serve loop's settle
    answers it; before the fix it was launched and then forgotten, its clients BUSY forever.
    Its bookkeeping, which waited for those answers, is made once, before its own answers
    (``_answer_batch`` books a batch its caller did not)."""
    d, (_lay, _mm, _svc, _index, log, _states, request, read, _answered) = _queue_rig(3, monkeypatch)
    d.sems[0] = _BrokenSem()
    request(0)
    assert d.poll() == 1
    request(1)
    request(2)
    batches, pickups = d.stats.batches, d.stats.phases["pickup"].count
    with contextlib.suppress(RuntimeError):  # as the serve loop: the failed pass logged, then settle
        d.poll()
    assert log[-3:] == ["launch 1", "queue 2", "finish"], log
    assert d.stats.batches == batches  # (the failure came before the queued batch's bookkeeping)
    assert d.settle() == 2
    assert d.stats.batches == batches + 1 and d.stats.phases["pickup"].count == pickups + 1
    for i in (1, 2):
        read(i)


@pytest.mark.parametrize("timing", [True, False])
def test_return_timing_measures_each_clients_way_back(timing: bool) -> None:
    """With the diagnostics on, each batched member's pickup records how long after its slot's
    previous answer was posted it came back (the "return" phase; the client here sleeps
    ~20 ms between its recalls); off (the control), nothing is recorded."""
    lay, mm, svc, _index, _log, _states, request, read, _answered = _gather_rig(2)
    stats = Stats()
    d = Dispatcher(mm, lay, [_Sem(), _Sem()], svc, stats, max_batch=64, describe=lambda: {},
                   return_timing=timing)  # fmt: skip
    request(0)
    assert d.poll() == 1 and d.settle() == 1
    read(0)
    time.sleep(0.02)
    request(0)
    assert d.poll() == 1 and d.settle() == 1
    read(0)
    if timing:
        ret = stats.phases["return"].summary()
        assert ret["count"] == 1 and 20_000 <= ret["p50_us"] < 2_000_000, ret
    else:
        assert "return" not in stats.phases


def test_gather_us_must_not_be_negative() -> None:
    lay = Layout(n_slots=2, dim=4, payload_size=1 << 12, blob_size=1 << 12)
    mm = mmap.mmap(-1, lay.segment_size)
    svc = Service(CpuIndex(4, METRICS["ip"]), NullStore(), dim=4, metric=METRICS["ip"])
    with pytest.raises(ValueError, match="gather_us must be >= 0"):
        Dispatcher(mm, lay, [_Sem(), _Sem()], svc, Stats(), describe=lambda: {}, gather_us=-1)


class _ArenaRig(NamedTuple):
    lay: Layout
    mm: mmap.mmap
    svc: Service
    arena: ArenaWriter
    d: Dispatcher
    states: np.ndarray
    data: np.ndarray


def _arena_rig(n_slots: int, dim: int, rows: int) -> _ArenaRig:
    """A dispatcher over an anonymous map, its service holding ``rows`` random rows (ip metric,
    texts ``t<row>``, empty metadata) and keeping a document arena, as a GPU sidecar does."""
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    bufs: dict[int, bytearray] = {}
    arena = ArenaWriter(lambda v, size: bufs.setdefault(v, bytearray(size)), bufs.pop)
    svc.rows.arena = arena
    data = np.random.default_rng().standard_normal((rows, dim)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [f"t{i}" for i in range(rows)],
                "metadatas": [{} for _ in range(rows)]}, data)  # fmt: skip
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    return _ArenaRig(lay, mm, svc, arena, d, states, data)


def assert_refs(resp: Response, blob: bytes, got: np.ndarray, arena: ArenaWriter, flags: int) -> None:
    """The answer names the documents of rows ``got`` as asked: by generation (ARENA_DOCS), or
    by the arena's version and each row's entry (with ARENA_ENTRIES); either way a client's
    view of the arena finds exactly those rows' documents."""
    got = np.asarray(got).ravel()
    entries = bool(flags & Flag.ARENA_ENTRIES)
    assert resp.resp_flags & (RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES) == (
        RespFlag.ARENA_DOCS | (RespFlag.ARENA_ENTRIES if entries else 0))  # fmt: skip
    view = ArenaView(arena.buf, arena.version)  # type: ignore[arg-type]
    if entries:
        assert len(blob) == resp.resp_len == 8 + 16 * len(got)
        docs = view.entry_docs(blob, len(got))
    else:
        assert len(blob) == resp.resp_len == 4 * len(got)
        assert np.array_equal(np.frombuffer(blob, "<u4"), arena.gens(got))
        docs = view.docs(got, np.frombuffer(blob, "<u4"))
    assert docs is not None and [bytes(x) for x in docs] == [arena.get(int(r)) for r in got]


ARENA_FLAGS = pytest.mark.parametrize("flags", [Flag.ARENA_DOCS, Flag.ARENA_DOCS | Flag.ARENA_ENTRIES],
                                      ids=["generations", "entries"])  # fmt: skip


@ARENA_FLAGS
def test_doorbell_slots_are_ours_only_while_no_resident_kernel_runs(flags: int) -> None:
    """A DOORBELL request (meant for a GPU's resident kernel) is answered by the dispatcher
    when no kernel runs, with the hits' arena generations (ARENA_DOCS) or entries (and
    ARENA_ENTRIES), and left alone while one runs."""
    k = 4
    lay, mm, svc, arena, d, states, data = _arena_rig(n_slots=3, dim=5, rows=60)
    index, dim = svc.index, 5
    q = np.random.default_rng().standard_normal(dim).astype(np.float32)
    off = lay.slot_offset(0)
    np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 9, Op.RECALL, flags, k, 1, 4 * dim, 0, 0)
    states[0] = SlotState.DOORBELL

    index.doorbell_k = 16  # type: ignore[misc]  # the index offers a resident kernel,
    index.doorbell_running = True  # type: ignore[misc]  # which has it
    assert d.poll() == 0 and states[0] == SlotState.DOORBELL
    np.frombuffer(mm, np.float32, dim, lay.slot_offset(1) + lay.payload_offset)[:] = q

    def request(flags: int) -> None:  # slot 1: the same recall as a REQUEST
        REQUEST_STRUCT.pack_into(mm, lay.slot_offset(1) + REQUEST_OFFSET, 3, Op.RECALL, flags, k, 1, 4 * dim, 0, 0)
        states[1] = SlotState.REQUEST
        assert d.poll() == 1
        d.settle()

    request(flags)  # ours even while the kernel runs; one the kernel could take
    assert d.lone == 1 and states[0] == SlotState.DOORBELL
    request(0)  # documents inline: never the kernel's, so not a reason to start it
    assert d.lone == 0
    request(flags)
    index.doorbell_running = False  # type: ignore[misc]  # stopped: the slot is ours
    assert d.poll() == 1
    assert d.lone == 2  # lone recalls in a row: the serve loop starts the kernel after a few
    d.settle()
    resp = Response.unpack(mm[off : off + CTL_SIZE])
    assert states[0] == SlotState.RESPONSE and resp.status == Status.OK and resp.n_results == k
    got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset).tolist()
    assert sorted(got) == sorted(np.argsort(-(data @ q))[:k].tolist())
    assert_refs(resp, bytes(mm[off + lay.blob_offset :][: resp.resp_len]), got, arena, flags)
    # a crowd of DOORBELL requests is not a client recalling alone: no prompt restart
    for i in (0, 2):
        np.frombuffer(mm, np.float32, dim, lay.slot_offset(i) + lay.payload_offset)[:] = q
        REQUEST_STRUCT.pack_into(mm, lay.slot_offset(i) + REQUEST_OFFSET, 20 + i, Op.RECALL, flags, k, 1,
                                 4 * dim, 0, 0)  # fmt: skip
        states[i] = SlotState.DOORBELL
    assert d.poll() == 2 and d.lone == 0
    d.settle()
    assert states[0] == states[2] == SlotState.RESPONSE


def test_a_lone_recall_from_a_synchronous_index_is_answered_after_the_serve_loops_start() -> None:
    """An index that searches synchronously (int8 rows on a GPU: the host re-scores) but has a
    resident kernel: the answer of a lone recall the kernel could take waits for the serve
    loop, which tells clients the kernel runs before it answers (its settle). Answered inside
    poll(), the client's next request was often already waiting when the serve loop came to
    start the kernel, which it then skipped: 20 lone recalls in a row once left the kernel
    stopped (S10-6). A recall with its documents inline, never the kernel's, is answered at once."""
    k, dim = 3, 5
    lay, mm, svc, _, d, states, data = _arena_rig(n_slots=2, dim=dim, rows=40)
    assert not svc.index.defers
    svc.index.doorbell_k = 16  # type: ignore[misc]  # the index offers a resident kernel (stopped)
    q = np.random.default_rng().standard_normal(dim).astype(np.float32)
    off = lay.slot_offset(0)
    np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q

    def request(seq: int, flags: int) -> None:
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, Op.RECALL, flags, k, 1, 4 * dim, 0, 0)
        states[0] = SlotState.REQUEST

    request(1, Flag.ARENA_DOCS | Flag.ARENA_ENTRIES)
    assert d.poll() == 1 and d.lone == 1
    assert states[0] == SlotState.BUSY and d.sems[0].posts == 0  # not yet: the serve loop's
    assert d.settle() == 1 and states[0] == SlotState.RESPONSE and d.sems[0].posts == 1
    got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset).tolist()
    assert sorted(got) == sorted(np.argsort(-(data @ q))[:k].tolist())
    request(2, 0)  # documents inline
    assert d.poll() == 1 and d.lone == 0
    assert states[0] == SlotState.RESPONSE and d.sems[0].posts == 2  # at once
    d2 = _arena_rig(n_slots=1, dim=dim, rows=10)  # an index without a kernel (the CPU's): at once
    np.frombuffer(d2.mm, np.float32, dim, d2.lay.slot_offset(0) + d2.lay.payload_offset)[:] = q
    REQUEST_STRUCT.pack_into(d2.mm, d2.lay.slot_offset(0) + REQUEST_OFFSET, 1, Op.RECALL,
                             Flag.ARENA_DOCS, k, 1, 4 * dim, 0, 0)  # fmt: skip
    d2.states[0] = SlotState.REQUEST
    assert d2.d.poll() == 1 and d2.d.lone == 0 and d2.states[0] == SlotState.RESPONSE


@ARENA_FLAGS
def test_a_batchs_documents_come_as_arena_generations_checked_in_numpy(flags: int) -> None:
    """A multi-query recall asking for arena documents is answered with one generation per hit
    (no documents in the blob), for the rows the search returned; inline it gets documents.
    Rows the index should never return (out of range, or holding no document) are refused
    with INTERNAL instead of naming garbage."""
    dim, k, rows, nq = 7, 3, 47, 5
    lay, mm, svc, arena, d, states, data = _arena_rig(n_slots=2, dim=dim, rows=rows)
    off = lay.slot_offset(0)
    qs = np.random.default_rng().standard_normal((nq, dim)).astype(np.float32)
    np.frombuffer(mm, np.float32, nq * dim, off + lay.payload_offset)[:] = qs.ravel()
    want = np.argsort(-(qs @ data.T), axis=1)[:, :k]

    def ask(flags: int, seq: int) -> tuple[Response, np.ndarray, bytes]:
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, Op.RECALL, flags, k, nq, 4 * nq * dim, 0, 0)
        states[0] = SlotState.REQUEST
        assert d.poll() == 1
        d.settle()
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert states[0] == SlotState.RESPONSE and resp.status == Status.OK and resp.n_results == k
        got = np.frombuffer(mm, np.int32, nq * k, off + lay.rows_offset).copy()
        return resp, got, bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])

    resp, got, blob = ask(flags, 5)
    assert np.array_equal(np.sort(got.reshape(nq, k), axis=1), np.sort(want, axis=1))
    assert_refs(resp, blob, got, arena, flags)
    resp, got_inline, blob = ask(0, 6)  # inline: the documents themselves
    assert not resp.resp_flags & RespFlag.ARENA_DOCS and np.array_equal(got_inline, got)
    views, _ = decode_docs_blob(blob, dim, False)
    assert [bytes(v) for v in views] == [arena.get(int(r)) for r in got]

    # what the index must never return: the numpy path refuses it
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 7, Op.RECALL, flags, k, nq, 4 * nq * dim, 0, 0)
    req = Request.unpack(mm, off + REQUEST_OFFSET)
    spec = d._spec(0, req)
    for bad, why in ((rows, "out of range"), (-1, "out of range"), (None, "hold no memory")):
        spec.rows[:] = got.reshape(nq, k)
        if bad is None:
            svc.rows.arena.clear(int(got[4]))  # type: ignore[union-attr]  # (the table and arena part ways)
        else:
            spec.rows[2, 1] = bad
        try:
            d._write_hits(0, req, spec, k, flags, 0)
        except Invalid as e:
            assert e.status == Status.INTERNAL and why in str(e)
        else:
            raise AssertionError(f"row {bad} was answered")


@ARENA_FLAGS
def test_batch1_members_reading_the_arena_are_answered_together_member_by_member_faults(flags: int) -> None:
    """Several batch-1 recalls asking for arena documents, batched: each member gets its own
    rows and their generations; a member whose rows the index got wrong (out of range, or a
    row with no document) gets INTERNAL alone."""
    n_slots, dim, k, rows = 6, 9, 4, 83
    lay, mm, svc, arena, d, states, data = _arena_rig(n_slots, dim, rows)
    rng = np.random.default_rng()
    qs = rng.standard_normal((n_slots, dim)).astype(np.float32)
    corrupt: dict[int, int] = {}
    real_finish = svc.finish

    def finish() -> None:  # the index writes a wrong row into some members' results
        real_finish()
        for i, row in corrupt.items():
            np.frombuffer(mm, np.int32, k, lay.slot_offset(i) + lay.rows_offset)[1] = row

    svc.finish = finish  # type: ignore[method-assign]

    def one_by_one(*_a, **_k) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("answered member by member, not together")

    d._write_hits = one_by_one  # type: ignore[method-assign]

    def run(seq: int) -> list[Response]:
        for i in range(n_slots):
            off = lay.slot_offset(i)
            np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = qs[i]
            REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, Op.RECALL, flags, k, 1, 4 * dim, 0, 0)
        states[:] = SlotState.REQUEST
        assert d.poll() == n_slots
        d.settle()
        assert (states != SlotState.BUSY).all()
        return [Response.unpack(mm[lay.slot_offset(i) : lay.slot_offset(i) + CTL_SIZE]) for i in range(n_slots)]

    for i, resp in enumerate(run(3)):
        off = lay.slot_offset(i)
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset)
        assert resp.status == Status.OK
        assert sorted(got.tolist()) == sorted(np.argsort(-(data @ qs[i]))[:k].tolist())
        assert_refs(resp, bytes(mm[off + lay.blob_offset :][: resp.resp_len]), got, arena, flags)
    # a row without a document (the arena and the row table part ways), outside every true
    # top-k, so that only the member given it is affected (row 7 was once in another's)
    others = {r for i in range(n_slots) for r in np.argsort(-(data @ qs[i]))[:k].tolist()}
    orphan = min(set(range(rows)) - others)
    arena.clear(orphan)
    corrupt.update({1: rows + 5, 3: -2, 4: orphan})
    resps = run(4)
    assert [r.status == Status.INTERNAL for r in resps] == [False, True, False, True, True, False]
    assert all(r.status == Status.OK for j, r in enumerate(resps) if j not in corrupt)
    assert b"out of range" in bytes(mm[lay.slot_offset(3) + lay.blob_offset :][: resps[3].resp_len])
    assert b"hold no memory" in bytes(mm[lay.slot_offset(4) + lay.blob_offset :][: resps[4].resp_len])


@pytest.mark.parametrize("members", [1, 2])
def test_a_recall_voids_the_rest_of_an_abandoned_answer_in_its_slot(members: int) -> None:
    """The rest of a long answer (kept for CONTINUE requests) belongs to the request that made
    it: once its slot asks anything else, a CONTINUE has nothing to continue. Recalls, batched
    or alone, go through the batch path rather than ``_one``, which already drops it; a client
    that abandoned a long answer and then recalled could otherwise be handed the old rest."""
    n_slots, dim, k, rows = 3, 11, 2, 37
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    svc, _ = _ip_service(dim, rows)
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    d.pending[0] = (b"the rest of an answer slot 0 abandoned", 1, 0, 19)  # as _respond leaves it
    rng = np.random.default_rng()
    for i in range(members):
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = rng.standard_normal(dim)
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 10 + i, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
        states[i] = SlotState.REQUEST
    assert d.poll() == members
    d.settle()
    off = lay.slot_offset(0)
    assert Response.unpack(mm[off : off + CTL_SIZE]).status == Status.OK
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 20, Op.CONTINUE, 0, 0, 0, 0, 0, 0)
    states[0] = SlotState.REQUEST
    assert d.poll() == 1
    resp = Response.unpack(mm[off : off + CTL_SIZE])
    assert resp.seq == 20 and resp.status == Status.BAD_REQUEST
    assert bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len]) == b"nothing to continue"


def test_the_rest_of_an_answer_goes_only_to_its_own_continue() -> None:
    """An answer in parts (a SCAN of 11 texts of 3,000 bytes through 4 KiB blobs) is continued
    only by the CONTINUE that follows its seq by one (another process that claimed the slot
    cannot read it), and its rest is dropped once its slot is given back (FREE), not kept
    until the slot asks anew: clients that stopped reading SCANs kept a copy each (a review:
    500 MiB for seven)."""
    n_slots, dim = 3, 5
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 12, blob_size=1 << 12)
    mm = mmap.mmap(-1, lay.segment_size)
    svc, _ = _ip_service(dim, 7)
    svc.upsert({"namespace": "long", "ids": [f"t{i}" for i in range(11)], "texts": ["x" * 3000] * 11,
                "metadatas": [{} for _ in range(11)]}, np.ones((11, dim), np.float32))  # fmt: skip
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    off = lay.slot_offset(1)
    scan = b'{"namespace":"long","limit":100}'

    def ask(seq: int, op: int) -> Response:
        args = scan if op == Op.SCAN else b""
        mm[off + lay.payload_offset : off + lay.payload_offset + len(args)] = args
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, op, 0, 0, 0, 0, len(args), 0)
        states[1] = SlotState.REQUEST
        assert d.poll() == 1
        return Response.unpack(mm[off : off + CTL_SIZE])

    first = ask(40, Op.SCAN)
    assert first.status == Status.OK and first.resp_flags & RespFlag.MORE and 1 in d.pending
    wrong = ask(45, Op.CONTINUE)  # (not 41: another claimer's request)
    assert wrong.status == Status.BAD_REQUEST and 1 not in d.pending
    assert ask(50, Op.SCAN).resp_flags & RespFlag.MORE
    right = ask(51, Op.CONTINUE)
    assert right.status == Status.OK and right.seq == 51 and right.resp_len > 0
    assert ask(60, Op.SCAN).resp_flags & RespFlag.MORE and 1 in d.pending
    states[1] = SlotState.FREE  # (its client gave the slot back without reading on)
    assert d.reclaim(-1) == 0 and 1 not in d.pending
    assert ask(61, Op.CONTINUE).status == Status.BAD_REQUEST  # (even in seq: nothing kept)


def test_a_doorbell_left_where_no_resident_kernel_was_offered_is_reclaimed(tmp_path: Any) -> None:
    """A client that died after writing DOORBELL into its slot, on a sidecar that never offered
    a resident kernel (a CPU one): nothing would ever answer it, and a slot left so (or every
    FREE slot set so by a foreign process) stayed lost until a restart, new clients finding
    the sidecar busy. Reclaimed now, where its lock is free; a REQUEST is still answered
    first (the control), and a DOORBELL is left to the kernel once one was offered."""
    n_slots, dim = 4, 3
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 12, blob_size=1 << 12)
    mm = mmap.mmap(-1, lay.segment_size)
    svc, _ = _ip_service(dim, 5)
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    with open(tmp_path / "locks", "wb+") as f:  # (the slot locks are free: their clients are gone)
        states[1], states[2] = SlotState.DOORBELL, SlotState.REQUEST
        assert d.reclaim(f.fileno()) == 1
        assert states[1] == SlotState.FREE and states[2] == SlotState.REQUEST
        d._bells = True  # (once a kernel was offered, a DOORBELL is its to answer)
        states[1] = SlotState.DOORBELL
        assert d.reclaim(f.fileno()) == 0 and states[1] == SlotState.DOORBELL


def _stranded_rig(n_slots: int = 9, dim: int = 11, k: int = 4, rows: int = 97):  # type: ignore[no-untyped-def]
    """A dispatcher whose every slot holds a recall; slot 5's query is NaN and its semaphore
    post fails. Returns (dispatcher, layout, map, states, semaphores, rows, request), where
    ``request(seq0, queries)`` writes a recall into every slot."""
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 12, blob_size=1 << 12)
    mm = mmap.mmap(-1, lay.segment_size)
    svc, data = _ip_service(dim, rows)
    sems = [_Sem() for _ in range(n_slots)]
    sems[5] = _BrokenSem()
    d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))

    def request(seq0: int, q: np.ndarray) -> None:
        for i in range(n_slots):
            off = lay.slot_offset(i)
            np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q[i]
            REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq0 + i, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
        states[:] = SlotState.REQUEST

    q = np.random.default_rng().standard_normal((n_slots, dim)).astype(np.float32)
    q[5, 2] = np.nan
    request(200, q)
    return d, lay, mm, states, sems, data, request


def _assert_stranded_answered(lay: Layout, mm: mmap.mmap, states: np.ndarray, sems: list[_Sem],
                              slots: list[int]) -> None:  # fmt: skip
    for i in slots:
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        blob = bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])
        assert states[i] == SlotState.ERROR and resp.status == Status.INTERNAL and resp.seq == 200 + i
        assert b"dropped by a failed pass (RuntimeError: sem_post failed)" in blob and sems[i].posts == 1


@pytest.mark.parametrize("recover", [True, False], ids=["answered", "control"])
def test_a_pass_that_fails_before_its_launch_leaves_no_request_busy(recover: bool) -> None:
    """Slot 5's query is NaN and its semaphore post fails: the batch's finiteness check
    answers it BAD_REQUEST, and that answer's post raises out of the pass before the other
    eight recalls, picked up (BUSY) and grouped with it, were launched. The serve loop
    (emulated: the failed pass, then settle, then answer_stranded) answers those eight
    INTERNAL, each posted once, and the next pass serves new requests in every slot as usual.
    Control: without answer_stranded the eight stay BUSY, unposted (before the fix their
    clients waited out their timeouts, and the slots stayed BUSY while the clients lived)."""
    d, lay, mm, states, sems, data, request = _stranded_rig()
    n_slots, k = len(states), 4
    with pytest.raises(RuntimeError, match="sem_post failed") as failed:
        d.poll()
    others = [i for i in range(n_slots) if i != 5]
    assert states[5] == SlotState.ERROR and sems[5].posts == 1  # (written, then its post raised)
    assert (states[others] == SlotState.BUSY).all()
    d.settle()
    if not recover:  # the control
        assert (states[others] == SlotState.BUSY).all() and all(sems[i].posts == 0 for i in others)
        return
    assert d.answer_stranded(failed.value) == len(others)
    _assert_stranded_answered(lay, mm, states, sems, others)
    assert d.answer_stranded(RuntimeError("again")) == 0  # nothing BUSY is left
    d.sems[5] = _Sem()
    q = np.random.default_rng().standard_normal((n_slots, lay.dim)).astype(np.float32)
    request(300, q)
    assert d.poll() == n_slots
    d.settle()
    for i in range(n_slots):
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert states[i] == SlotState.RESPONSE and resp.status == Status.OK and resp.seq == 300 + i
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset)
        assert sorted(got.tolist()) == sorted(np.argsort(-(data @ q[i]), kind="stable")[:k].tolist())


def test_stranded_requests_are_answered_once_the_resident_kernel_is_stopped() -> None:
    """The same failed pass on a GPU sidecar whose resident kernel runs (it hands REQUEST
    slots back; the dispatcher picks them up itself): the kernel is stopped first (it marks
    the DOORBELL slots it takes BUSY, and a stop waits for the one it holds), then the eight
    are answered. Before this, they were left BUSY whenever the kernel ran. And with a batch
    still in flight nothing is done (its members are BUSY until it is answered)."""
    d, lay, mm, states, sems, _data, _request = _stranded_rig()
    index = d.service.index
    stops: list[int] = []

    def pause_doorbell() -> None:
        stops.append(int((states == SlotState.BUSY).sum()))  # nothing answered before the stop
        index.doorbell_running = False  # type: ignore[misc]

    index.doorbell_running = True  # type: ignore[misc]
    index.pause_doorbell = pause_doorbell  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="sem_post failed") as failed:
        d.poll()
    d.settle()
    others = [i for i in range(len(states)) if i != 5]
    d._inflight = object()  # type: ignore[assignment]  # a batch in flight: its members are its own
    assert d.answer_stranded(failed.value) == 0 and not stops and (states[others] == SlotState.BUSY).all()
    d._inflight = None
    assert d.answer_stranded(failed.value) == len(others)
    assert stops == [len(others)] and not index.doorbell_running
    _assert_stranded_answered(lay, mm, states, sems, others)


def test_a_failed_pass_whose_exception_cannot_be_printed_is_answered_all_the_same() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    d, lay, mm, states, _sems, _data, _request = _stranded_rig()
    with pytest.raises(RuntimeError):
        d.poll()
    d.settle()
    assert d.answer_stranded(Unprintable()) == len(states) - 1
    off = lay.slot_offset(0)
    resp = Response.unpack(mm[off : off + CTL_SIZE])
    assert states[0] == SlotState.ERROR and resp.status == Status.INTERNAL
    assert bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len]).endswith(b"(Unprintable)")


def test_a_namespaces_lone_recall_counts_for_the_kernel_and_is_noted_for_it() -> None:
    """With an index whose resident kernel serves namespaces (``doorbell_spaces``), a lone
    batch-1 recall in a namespace without a filter is noted for the kernel (Service.bell_spaces:
    it serves the namespace from its next start), and from its second time on counts towards
    that start, as the default namespace's does. Nothing that would only stop the kernel again
    counts: a filter, a name too long for the kernel's comparison, a namespace without rows, a
    recall of a namespace the running kernel serves (a client that does not ring it), or an
    index whose kernel serves the default namespace only (the negative controls); every one of
    them is answered all the same."""
    k, dim = 3, 5
    lay, mm, svc, _, d, states, _ = _arena_rig(n_slots=2, dim=dim, rows=40)
    rng = np.random.default_rng()
    long_name = "n" * 59  # args of 65 bytes: past DOORBELL_ARGS_MAX
    for ns, n in (("notes", 23), ("ünï-名前", 7), (long_name, 5)):
        svc.upsert({"namespace": ns, "ids": [f"{ns}{i}" for i in range(n)], "texts": [f"{ns} t{i}" for i in range(n)],
                    "metadatas": [{"u": i % 2} for i in range(n)]},
                   rng.standard_normal((n, dim)).astype(np.float32))  # fmt: skip
    svc.index.doorbell_k = 16  # type: ignore[misc]  # the index offers a resident kernel (stopped)
    svc.index.doorbell_spaces = 8  # type: ignore[misc]  # which serves namespaces
    q = rng.standard_normal(dim).astype(np.float32)
    off = lay.slot_offset(0)
    np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q
    seq = 0

    def ask(namespace: str, flt: bytes | None = None, state: int = SlotState.REQUEST) -> int:
        nonlocal seq
        seq += 1
        _write_scoped_recall(mm, lay, 0, seq, k, dim, namespace, flt, state)
        assert d.poll() == 1
        d.settle()
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert states[0] == SlotState.RESPONSE and resp.status == Status.OK and resp.seq == seq
        return resp.n_results

    assert ask("notes") == k and d.lone == 0  # noted; not counted the first time
    assert ask("notes") == k and d.lone == 1
    assert ask("ünï-名前") == k and d.lone == 0
    assert ask("ünï-名前") == k and d.lone == 1
    assert ask("", None) == k and d.lone == 2  # the default namespace: counts, as before
    def names() -> list[str]:
        # (namespaces without a filter: with their rows where the index wants them, as the CPU index does)
        return [decode_recall_args(sc.args)[0] for sc in svc.bell_spaces() if sc.rows is None or sc.whole]

    assert names() == ["ünï-名前", "notes"]  # the most recent first
    assert ask("notes", b'{"u": 1}') == k and d.lone == 0  # a filter: the sidecar's
    assert ask("notes", state=SlotState.DOORBELL) == k and d.lone == 1  # rung while it was stopped
    assert names() == ["notes", "ünï-名前"]
    assert ask(long_name) == k and d.lone == 0  # too long to compare: the sidecar's
    assert ask("notes") == k and d.lone == 1
    assert ask("nowhere") == 0 and ask("nowhere") == 0 and d.lone == 0  # no rows: never counted
    assert names() == ["notes", "ünï-名前"]
    svc.index.doorbell_running = True  # type: ignore[misc]  # the kernel runs and serves "notes":
    svc.index.bell_served_spaces = (encode_recall_args("notes", None),)  # type: ignore[misc]  # a REQUEST for it is a client
    assert ask("notes") == k and d.lone == 0  # that does not ring it
    assert ask("ünï-名前") == k and d.lone == 1  # (one it handed back, or sent while it ran)
    svc.index.doorbell_running = False  # type: ignore[misc]
    svc.index.doorbell_spaces = 0  # type: ignore[misc]  # a kernel for the default namespace only
    assert ask("notes") == k and d.lone == 0


def test_a_filters_lone_recall_counts_for_the_kernel_where_it_serves_filters() -> None:
    """With an index whose resident kernel serves filters too (``doorbell_args``, v1.6), a lone
    batch-1 recall with a filter is noted for the kernel under its exact args, with the rows the
    filter keeps (Service.bell_spaces), and from its second time on counts towards its start.
    Never counted: a filter the sidecar refuses (answered BAD_REQUEST), args longer than
    ``doorbell_args``, a filter the running kernel serves (a client that does not ring it), or
    an index that serves namespaces without filters (the negative control, v1.5's rule)."""
    k, dim = 3, 5
    lay, mm, svc, _, d, _states, _ = _arena_rig(n_slots=2, dim=dim, rows=40)
    rng = np.random.default_rng()
    n = 23
    svc.upsert({"namespace": "mem", "ids": [f"m{i}" for i in range(n)], "texts": [f"t{i}" for i in range(n)],
                "metadatas": [{"user": f"u{i % 3}"} for i in range(n)]},
               rng.standard_normal((n, dim)).astype(np.float32))  # fmt: skip
    svc.index.doorbell_k = 16  # type: ignore[misc]  # the index offers a resident kernel (stopped)
    svc.index.doorbell_spaces = 8  # type: ignore[misc]  # which serves namespaces
    svc.index.doorbell_args = 128  # type: ignore[misc]  # and filters
    np.frombuffer(mm, np.float32, dim, lay.slot_offset(0) + lay.payload_offset)[:] = rng.standard_normal(dim)
    off, seq = lay.slot_offset(0), 0

    def ask(namespace: str, flt: bytes | None) -> tuple[int, int]:
        nonlocal seq
        seq += 1
        _write_scoped_recall(mm, lay, 0, seq, k, dim, namespace, flt, SlotState.REQUEST)
        assert d.poll() == 1
        d.settle()
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert resp.seq == seq
        return resp.status, resp.n_results

    u1 = b'{"user":"u1"}'
    assert ask("mem", u1) == (Status.OK, k) and d.lone == 0  # noted; not counted the first time
    assert ask("mem", u1) == (Status.OK, k) and d.lone == 1
    # the default namespace's 40 rows have no "user": a scope of no rows, noted all the same
    assert ask("", u1) == (Status.OK, 0) and d.lone == 0
    assert [sc.args for sc in svc.bell_spaces()] == [encode_recall_args("mem", u1)]  # (seen once: not yet)
    assert ask("", u1) == (Status.OK, 0) and d.lone == 1
    dflt, sc = svc.bell_spaces()  # the most recent first
    assert dflt.args == encode_recall_args("", u1) and dflt.rows is not None and len(dflt.rows) == 0
    assert sc.args == encode_recall_args("mem", u1) and sc.ns_id == svc.rows.ns_id("mem")
    assert sc.rows is not None and sorted(svc.rows.ids[r] for r in sc.rows) == sorted(f"m{i}" for i in range(1, n, 3))
    assert ask("mem", b'{"user":{"$bogus":1}}')[0] == Status.BAD_REQUEST and d.lone == 0
    assert ask("mem", b'{"user":{"$bogus":1}}')[0] == Status.BAD_REQUEST and d.lone == 0  # never counted
    long = b'{"user":"' + b"x" * 120 + b'"}'  # args of 140 bytes
    assert ask("mem", long) == (Status.OK, 0) and ask("mem", long) == (Status.OK, 0) and d.lone == 0
    assert ask("mem", u1) == (Status.OK, k) and d.lone == 1
    assert [sc.args for sc in svc.bell_spaces()] == [encode_recall_args("mem", u1), encode_recall_args("", u1)]
    svc.index.doorbell_running = True  # type: ignore[misc]  # the kernel runs and serves it:
    svc.index.bell_served_spaces = (encode_recall_args("mem", u1),)  # type: ignore[misc]
    assert ask("mem", u1) == (Status.OK, k) and d.lone == 0  # a client that does not ring it
    svc.index.doorbell_running = False  # type: ignore[misc]
    u2 = b'{"user":"u2"}'
    svc.index.doorbell_args = 0  # type: ignore[misc]  # namespaces without filters only (v1.5)
    assert ask("mem", u2) == (Status.OK, k) and ask("mem", u2) == (Status.OK, k) and d.lone == 0
    svc.index.doorbell_args = 128  # type: ignore[misc]  # (the control's own control: noted now,
    assert ask("mem", u2) == (Status.OK, k) and ask("mem", u2) == (Status.OK, k) and d.lone == 1  # counted next)


def _scoped_bell_rig(monkeypatch: pytest.MonkeyPatch, dim: int,
                     ) -> tuple[Any, Any, Any, Any, dict[str, int], dict[str, int]]:  # fmt: skip
    """The back-off tests' rig: an arena rig whose index stands in for one with a resident
    kernel serving 8 scopes with filters (``doorbell_spaces`` 8, ``doorbell_args`` 128), 9 rows
    of three users in namespace "mem", the kernel's answer count ``served["n"]`` (0: every run a
    short one), the dispatcher's clock ``clock["ns"]``, and a query in slot 0. Returns
    ``(lay, mm, svc, d, served, clock)``."""
    import kalos_retrievers.sidecar.dispatcher as dmod

    lay, mm, svc, _, d, _states, _ = _arena_rig(n_slots=2, dim=dim, rows=40)
    rng = np.random.default_rng()
    svc.upsert({"namespace": "mem", "ids": [f"m{i}" for i in range(9)], "texts": ["t"] * 9,
                "metadatas": [{"user": f"u{i % 3}"} for i in range(9)]},
               rng.standard_normal((9, dim)).astype(np.float32))  # fmt: skip
    idx = svc.index
    idx.doorbell_k, idx.doorbell_spaces, idx.doorbell_args = 16, 8, 128  # type: ignore[misc]
    served = {"n": 0}
    idx.doorbell_served = lambda: served["n"]  # type: ignore[method-assign]
    clock = {"ns": 10**12}
    monkeypatch.setattr(dmod.time, "monotonic_ns", lambda: clock["ns"])
    np.frombuffer(mm, np.float32, dim, lay.slot_offset(0) + lay.payload_offset)[:] = rng.standard_normal(dim)
    return lay, mm, svc, d, served, clock


def test_a_kernel_stopped_by_scoped_recalls_it_does_not_take_is_started_less_eagerly(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The back-off of the kernel's start (Dispatcher.lone_enough): a scoped recall that comes
    as a REQUEST while the kernel runs (handed back, or from a client that does not ring it)
    stops it; after a run of fewer than BELL_RUN_MIN answers the next start waits for twice the
    lone recalls, up to BELL_BACKOFF_MAX. A run that answered BELL_RUN_MIN, or a second with no
    such stop, ends it. The controls: a default namespace's REQUEST, a DOORBELL the stopped
    kernel left and a write while the kernel runs are not such stops."""
    import kalos_retrievers.sidecar.dispatcher as dmod

    k, dim = 3, 5
    lay, mm, svc, d, served, clock = _scoped_bell_rig(monkeypatch, dim)
    idx = svc.index
    off, seq = lay.slot_offset(0), 0

    def ask(flt: bytes | None, namespace: str = "mem", state: int = SlotState.REQUEST, running: bool = True) -> None:
        nonlocal seq
        seq += 1
        _write_scoped_recall(mm, lay, 0, seq, k, dim, namespace, flt, state)
        idx.doorbell_running = running  # type: ignore[misc]  # (the CPU index's pause leaves it so)
        assert d.poll() == 1
        d.settle()
        assert Response.unpack(mm[off : off + CTL_SIZE]).seq == seq

    def needs() -> int:
        """The fewest lone recalls lone_enough(LONE_RECALLS) takes now."""
        for n in range(dmod.BELL_BACKOFF_MAX + 1):
            d.lone = n
            if d.lone_enough(dmod.LONE_RECALLS):
                return n
        raise AssertionError("never enough")

    d.kernel_started()
    assert needs() == dmod.LONE_RECALLS
    # the controls: none of these stops the kernel for a scope it does not take
    ask(None, "")  # the default namespace, sent as a REQUEST
    ask(b'{"user":"u1"}', state=SlotState.DOORBELL, running=False)  # rung as the kernel stopped
    svc.upsert({"namespace": "mem", "ids": ["w"], "texts": ["t"], "metadatas": [{}]},
               np.random.default_rng().standard_normal((1, dim)).astype(np.float32))  # fmt: skip
    assert d.kernel_declines == 0 and needs() == dmod.LONE_RECALLS and not d.backing_off()
    for user in (b'{"user":"u1"}', b'{"user":"u2"}'):  # each scope's first decline: a new user's, not
        d.kernel_started()  # a sign of too many scopes (test_declines_while_the_kernels_table_fills_up_do_not_back_off)
        ask(user)
    assert d.kernel_learns == 2 and d.kernel_declines == 0 and needs() == dmod.LONE_RECALLS
    want = dmod.LONE_RECALLS
    for _ in range(8):  # short runs: each doubles it, to the cap
        d.kernel_started()
        served["n"] += dmod.BELL_RUN_MIN - 1
        ask(b'{"user":"u1"}')
        want = min(2 * want, dmod.BELL_BACKOFF_MAX)
        assert needs() == want
    assert want == dmod.BELL_BACKOFF_MAX and d.kernel_declines == 8 and d.backing_off()
    clock["ns"] += dmod.BELL_BACKOFF_NS + 1  # a second without such a stop: over
    assert needs() == dmod.LONE_RECALLS and not d.backing_off()
    d.kernel_started()
    idx.bell_served_spaces = (encode_recall_args("mem", b'{"user":"u2"}'),)  # type: ignore[misc]
    ask(b'{"user":"u2"}')  # a client that does not ring a filter the kernel serves
    assert needs() == 2 * dmod.LONE_RECALLS
    d.kernel_started()
    served["n"] += dmod.BELL_RUN_MIN  # a run long enough: over
    ask(b'{"user":"u2"}')
    assert needs() == dmod.LONE_RECALLS and d.kernel_declines == 10


def test_declines_while_the_kernels_table_fills_up_do_not_back_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A scoped recall the running kernel hands back after a short run backs its start off (the
    test above) unless its table is filling up (Dispatcher._learned): the scope was not in the
    table at the kernel's start, and the scopes handed to the sidecar alone in the last second,
    it included, fit the table. A new user's first search (its scope decoded, noted and counted
    as lone at once, served from the next start) then counts as ``kernel_learns``, not
    ``kernel_declines`` (which cancel the starts on idle); so does a new scope once those the
    table holds are not recalled any more.
    Negative controls: the scope declined again once it was in the table at the start; a table
    with no room left after the noting, or full; a scope the kernel serves, sent unrung."""
    import kalos_retrievers.sidecar.dispatcher as dmod

    k, dim = 3, 5
    lay, mm, svc, d, _, clock = _scoped_bell_rig(monkeypatch, dim)
    idx = svc.index
    seq = 0

    def ask(user: str, running: bool = True) -> None:
        nonlocal seq
        seq += 1
        _write_scoped_recall(mm, lay, 0, seq, k, dim, "mem", b'{"user":"%s"}' % user.encode(), SlotState.REQUEST)
        idx.doorbell_running = running  # type: ignore[misc]
        assert d.poll() == 1
        d.settle()

    def backs_off() -> bool:
        lone, d.lone = d.lone, dmod.LONE_RECALLS
        try:
            return not d.lone_enough(dmod.LONE_RECALLS)
        finally:
            d.lone = lone

    def over() -> None:  # a second without a decline: any back-off over
        clock["ns"] += dmod.BELL_BACKOFF_NS + 1
        assert not backs_off()

    d.kernel_started()
    ask("u1")  # a new user's first search, handed back: decoded and noted at once, lone, no back-off
    assert (d.kernel_learns, d.kernel_declines, d.lone) == (1, 0, 1) and not backs_off()
    assert svc.bell_known() == {encode_recall_args("mem", b'{"user":"u1"}')}
    d.kernel_started()  # (with u1 in its table)
    ask("u1")  # declined again although served from this start: the back-off's
    assert (d.kernel_learns, d.kernel_declines) == (1, 1) and backs_off()
    over()
    idx.doorbell_spaces = 3  # type: ignore[misc]  # a table of three
    for user in ("u1", "u2", "u2"):  # (u1 and u2 recalled again: noted lately, decoded)
        ask(user, running=False)
    d.kernel_started()
    ask("u0")  # a third scope lately: the table holds them all
    assert (d.kernel_learns, d.kernel_declines) == (2, 1) and not backs_off()
    ask("u4")  # a fourth: more scopes lately than the table holds (and u1 dropped for it)
    assert (d.kernel_learns, d.kernel_declines) == (2, 2) and backs_off()
    assert encode_recall_args("mem", b'{"user":"u1"}') not in svc.bell_known()
    over()  # a second later: the scopes noted are no longer recalled lately
    d.kernel_started()
    ask("u7")  # the table full of scopes no one recalls now: learned
    assert (d.kernel_learns, d.kernel_declines) == (3, 2) and not backs_off()
    idx.doorbell_spaces = 8  # type: ignore[misc]
    d.kernel_started()
    idx.bell_served_spaces = (encode_recall_args("mem", b'{"user":"u6"}'),)  # type: ignore[misc]
    ask("u6")  # room, but a scope the kernel serves (a client that does not ring it)
    assert (d.kernel_learns, d.kernel_declines) == (3, 3) and backs_off()
    over()
    ask("u1")  # room, and u1 (dropped above) not in the table: learned again
    assert (d.kernel_learns, d.kernel_declines) == (4, 3) and not backs_off()
    for j in range(70):  # (the times kept: the 64 scopes noted most recently)
        ask(f"v{j}", running=False)
    assert len(svc._bell_seen) == 64 and svc.bell_recent(0) == 64


def test_the_lone_scoped_recall_that_starts_the_kernel_is_answered_after_the_header_says_it_runs(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """A lone scoped recall is answered within its pass; the serve loop starts the kernel after
    the pass. The recall that completes the lone count must find ``on_start_due`` called (the
    server's: the header says the kernel runs) *before* its answer is written, or its client's
    next recall reads the kernel stopped and comes as a REQUEST just after the start: a decline
    of a scope the kernel serves, which doubled the back-off at every start (S55-1: a new scope
    unanswered by the kernel for 2,200 back-to-back recalls). Controls: the recalls before it
    do not call the hook; nor does any recall while the start is backed off further, nor where
    a start would answer nothing (``Service.doorbell_useful`` false)."""
    import kalos_retrievers.sidecar.dispatcher as dmod

    k, dim = 3, 5
    lay, mm, svc, d, _, clock = _scoped_bell_rig(monkeypatch, dim)
    idx = svc.index
    off, seq = lay.slot_offset(0), 0
    calls: list[tuple[int, int, int]] = []  # (the recall's seq, its slot's state, the seq answered) at the hook
    d.on_start_due = lambda: calls.append((seq, int(d.states[0]), Response.unpack(mm[off : off + CTL_SIZE]).seq))

    def ask() -> None:
        nonlocal seq
        seq += 1
        _write_scoped_recall(mm, lay, 0, seq, k, dim, "mem", b'{"user":"u1"}', SlotState.REQUEST)
        idx.doorbell_running = False  # type: ignore[misc]  # (stopped: the recalls are the sidecar's)
        assert d.poll() == 1
        d.settle()
        assert Response.unpack(mm[off : off + CTL_SIZE]).seq == seq and d.states[0] == SlotState.RESPONSE

    d.kernel_started()
    while not d.lone_enough(dmod.LONE_RECALLS):
        ask()
        assert seq <= dmod.LONE_RECALLS + 1, "lone recalls of a noted scope never started the kernel"
    # the hook came once, at the recall that made lone_enough hold, its slot still BUSY and the
    # previous recall's answer the last written
    assert calls == [(seq, SlotState.BUSY, seq - 1)], calls
    ask()  # (lone_enough still holds: the serve loop would have started the kernel already)
    assert len(calls) == 2
    calls.clear()
    d.lone, d._lone_need, d._declined_ns = 0, dmod.BELL_BACKOFF_MAX, clock["ns"]  # backed off to the most
    for _ in range(2 * dmod.LONE_RECALLS):
        ask()
    assert calls == [] and not d.lone_enough(dmod.LONE_RECALLS)
    d._lone_need = 0
    ask()
    assert len(calls) == 1 and d.lone_enough(dmod.LONE_RECALLS)  # (the back-off over: the hook again)
    calls.clear()
    monkeypatch.setattr(svc, "doorbell_useful", lambda: False)  # a start would answer nothing
    ask()
    assert calls == [] and d.lone_enough(dmod.LONE_RECALLS)


def test_declines_of_scopes_the_kernel_could_not_serve_back_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The negative controls of Dispatcher._learned for scopes the kernel's table could never
    hold: args longer than ``doorbell_args`` (never rung, never noted), a filter where the
    kernel serves none (``doorbell_args`` 0), a filter the sidecar refuses (decoded at once, as
    a declined scope is, and remembered as refused: never noted again), a namespace without
    rows. Each of them, declined after a short run, backs the start off."""
    import kalos_retrievers.sidecar.dispatcher as dmod

    k, dim = 3, 5
    lay, mm, svc, d, _, clock = _scoped_bell_rig(monkeypatch, dim)
    idx = svc.index
    seq = 0

    def declined(namespace: str, flt: bytes | None) -> tuple[int, int]:
        """(learns, declines) after the running kernel handed back a recall of this scope, a
        second after the last (no back-off left), the kernel having started just before."""
        nonlocal seq
        seq += 1
        clock["ns"] += dmod.BELL_BACKOFF_NS + 1
        d.kernel_started()
        _write_scoped_recall(mm, lay, 0, seq, k, dim, namespace, flt, SlotState.REQUEST)
        idx.doorbell_running = True  # type: ignore[misc]
        assert d.poll() == 1
        d.settle()
        assert Response.unpack(mm[lay.slot_offset(0) : lay.slot_offset(0) + CTL_SIZE]).seq == seq
        return d.kernel_learns, d.kernel_declines

    long = b'{"user":"' + b"x" * 120 + b'"}'  # args of 140 bytes
    assert declined("mem", long) == (0, 1) and d.backing_off()
    idx.doorbell_args = 0  # type: ignore[misc]  # filters not served
    assert declined("mem", b'{"user":"u1"}') == (0, 2) and d.backing_off()
    idx.doorbell_args = 128  # type: ignore[misc]
    bogus = b'{"user":{"$bogus":1}}'
    assert declined("mem", bogus) == (0, 3) and d.backing_off()  # refused (decoded at once)
    assert declined("mem", bogus) == (0, 4) and d.backing_off()  # remembered as refused:
    assert not svc.bell_noted(encode_recall_args("mem", bogus))  # not noted again
    assert declined("nowhere", b'{"user":"u1"}') == (0, 5) and d.backing_off()  # no rows
    assert declined("nowhere", b'{"user":"u1"}') == (0, 6) and d.backing_off()
    assert declined("mem", b'{"user":"u1"}') == (1, 6) and not d.backing_off()  # the control: learned
    bogus2 = b'{"user":{"$nope":2}}'
    for _ in range(3):  # with the kernel stopped: noted, then refused at its second time, then never
        seq += 1
        _write_scoped_recall(mm, lay, 0, seq, k, dim, "mem", bogus2, SlotState.REQUEST)
        idx.doorbell_running = False  # type: ignore[misc]
        assert d.poll() == 1
        d.settle()
    assert not svc.bell_noted(encode_recall_args("mem", bogus2)) and svc.bell_refused(encode_recall_args("mem", bogus2))


def test_scopes_seen_once_in_turn_are_never_decoded_for_the_kernel(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A lone filtered recall counts for the kernel only from its scope's second time; its first
    is noted by its args alone, so more filters in turn than the kernel serves (12 for 8) cost
    no decoding of their JSON for it, and never count. A scope seen again is decoded once, and
    not again after. (The pickup decodes each recall for its answer, in any case.)"""
    k, dim = 3, 5
    lay, mm, svc, _, d, _states, _ = _arena_rig(n_slots=2, dim=dim, rows=40)
    rng = np.random.default_rng()
    svc.upsert({"namespace": "mem", "ids": [f"m{i}" for i in range(24)], "texts": ["t"] * 24,
                "metadatas": [{"user": f"u{i % 12}"} for i in range(24)]},
               rng.standard_normal((24, dim)).astype(np.float32))  # fmt: skip
    svc.index.doorbell_k, svc.index.doorbell_spaces, svc.index.doorbell_args = 16, 8, 128  # type: ignore[misc]
    import kalos_retrievers.sidecar.dispatcher as dmod

    decoded: list[object] = []  # the filters the lone count decoded and checked
    check = dmod.validate_filter

    def counting(flt: object) -> object:
        decoded.append(flt)
        return check(flt)

    monkeypatch.setattr(dmod, "validate_filter", counting)

    np.frombuffer(mm, np.float32, dim, lay.slot_offset(0) + lay.payload_offset)[:] = rng.standard_normal(dim)
    off, seq = lay.slot_offset(0), 0

    def ask(user: int) -> None:
        nonlocal seq
        seq += 1
        _write_scoped_recall(mm, lay, 0, seq, k, dim, "mem", f'{{"user":"u{user}"}}'.encode(), SlotState.REQUEST)
        assert d.poll() == 1
        d.settle()
        assert Response.unpack(mm[off : off + CTL_SIZE]).status == Status.OK

    for _ in range(3):
        for u in range(12):
            ask(u)
            assert d.lone == 0
    assert decoded == [] and svc.bell_spaces() == []
    ask(0)  # (out of the 8 most recent since: seen for the first time again)
    assert decoded == [] and d.lone == 0
    ask(0)
    assert len(decoded) == 1 and d.lone == 1
    ask(0)
    assert len(decoded) == 1 and d.lone == 2
    assert [sc.args for sc in svc.bell_spaces()] == [encode_recall_args("mem", b'{"user":"u0"}')]

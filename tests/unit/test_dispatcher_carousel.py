"""The dispatcher with an index that has a carousel (sidecar/crowd.py; KALOS_CAROUSEL=1 on a GPU),
in process: a CPU index whose carousel is a thread answering its slots as the kernel does
(tests/carousel_fakes.py). A crowd's batch-1 recalls go to the carousel and each gets its own
exact answer; the carousel starts for a crowd only, and stops when it has gone or sits idle;
nothing else touches the "device" while it runs (the real one holds every SM), so writes,
recalls it cannot take and every other request wait until it is drained and stopped."""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
from carousel_fakes import CarouselCpuIndex, FakeCupy
from carousel_fakes import top_ip as _top
from kalos_retrievers.sidecar import carousel
from kalos_retrievers.sidecar import dispatcher as dispatcher_module
from kalos_retrievers.sidecar.carousel import Slots
from kalos_retrievers.sidecar.crowd import CrowdLane
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.index import FatalDeviceError
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore
from kalos_testing import PostCounter

from kalos_retrievers.arena import ArenaWriter
from kalos_retrievers.protocol import (
    CTL_SIZE,
    HEADER_SIZE,
    METRICS,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    Flag,
    Layout,
    Op,
    Response,
    SlotState,
    Status,
    decode_docs_blob,
    encode_json,
    encode_recall_args,
)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(dispatcher_module._hotpath is None, reason="sidecar/_hotpath.c is not built"),
]


class Rig(NamedTuple):
    d: Dispatcher
    index: CarouselCpuIndex
    svc: Service
    mm: mmap.mmap
    lay: Layout
    states: np.ndarray
    sems: list[PostCounter]
    data: np.ndarray
    arena: ArenaWriter


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``rig(n_slots, rows, dim=11)``: a dispatcher over an anonymous map and a service over a
    CarouselCpuIndex holding ``rows`` random rows (ids r<row>, texts t<row>) and an arena; the
    clients seen "lately" for as long as a test takes (a slow host must not thin the crowd)."""
    monkeypatch.setattr(dispatcher_module, "COHORT_WINDOW_NS", 10**15)
    made: list[CarouselCpuIndex] = []

    def make(n_slots: int, rows: int, dim: int = 11, metric: str = "ip") -> Rig:
        lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
        mm = mmap.mmap(-1, lay.segment_size)
        index = CarouselCpuIndex(dim, METRICS[metric])
        made.append(index)
        svc = Service(index, NullStore(), dim=dim, metric=METRICS[metric])
        bufs: dict[int, bytearray] = {}
        arena = ArenaWriter(lambda v, size: bufs.setdefault(v, bytearray(size)), bufs.pop)
        svc.rows.arena = arena
        data = np.random.default_rng().standard_normal((rows, dim)).astype(np.float32)
        svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [f"t{i}" for i in range(rows)],
                    "metadatas": [{} for _ in range(rows)]}, data)  # fmt: skip
        index.log.clear()
        sems = [PostCounter() for _ in range(n_slots)]
        d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {})
        d.crowd_min = 4
        states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
        return Rig(d, index, svc, mm, lay, states, sems, data, arena)

    yield make
    for index in made:
        index.close()


def _ask(r: Rig, i: int, q: np.ndarray, k: int, seq: int, flags: int = 0, args: bytes = b"") -> None:
    off = r.lay.slot_offset(i)
    np.frombuffer(r.mm, np.float32, r.lay.dim, off + r.lay.payload_offset)[:] = q
    if args:
        start = off + r.lay.payload_offset + 4 * r.lay.dim
        start += -start % 8
        r.mm[start : start + len(args)] = args
    REQUEST_STRUCT.pack_into(r.mm, off + REQUEST_OFFSET, seq, Op.RECALL, flags, k, 1, 4 * r.lay.dim, len(args), 0)
    r.states[i] = SlotState.REQUEST


def _ask_all(r: Rig, q: np.ndarray, k: int, n: int, seq0: int = 0) -> None:
    """Slots 0 .. n-1 ask for the top ``k`` of their query ``q[i]`` (seq ``seq0 + i``)."""
    for i in range(n):
        _ask(r, i, q[i], k, seq=seq0 + i)


def _answered(r: Rig, slots: list[int], timeout: float = 10.0) -> None:
    """Poll until every slot of ``slots`` holds an answer."""
    end = time.monotonic() + timeout
    while not all(r.states[i] in (SlotState.RESPONSE, SlotState.ERROR) for i in slots):
        assert time.monotonic() < end, [int(r.states[i]) for i in slots]
        r.d.poll()


def _rows(r: Rig, i: int, n: int) -> list[int]:
    off = r.lay.slot_offset(i)
    resp = Response.unpack(r.mm[off : off + CTL_SIZE])
    assert r.states[i] == SlotState.RESPONSE and resp.status == Status.OK, (i, resp)
    assert resp.n_results == n
    return np.frombuffer(r.mm, np.int32, n, off + r.lay.rows_offset).tolist()


def test_a_crowds_recalls_ride_the_carousel_each_with_its_own_answer(rig: Any) -> None:
    """Seven clients, three rounds each (k 1 to 32, odd sizes): every recall is answered from
    the carousel, exactly, its documents inline, its semaphore posted once; nothing else ran
    on the "device"."""
    r = rig(7, 301)
    rng = np.random.default_rng()
    for rnd in range(3):
        qs = rng.standard_normal((7, r.lay.dim)).astype(np.float32)
        ks = [1 + (7 * rnd + i) * 5 % 32 for i in range(7)]
        for i in range(7):
            _ask(r, i, qs[i], ks[i], seq=10 * rnd + i)
        _answered(r, list(range(7)))
        for i in range(7):
            assert _rows(r, i, ks[i]) == _top(r.data, qs[i], ks[i]), (rnd, i)
            off = r.lay.slot_offset(i)
            resp = Response.unpack(r.mm[off : off + CTL_SIZE])
            assert resp.seq == 10 * rnd + i
            views, _ = decode_docs_blob(bytes(r.mm[off + r.lay.blob_offset : off + r.lay.blob_offset + resp.resp_len]),
                                        r.lay.dim, False)  # fmt: skip
            assert [bytes(v) for v in views] == [r.arena.get(j) for j in _top(r.data, qs[i], ks[i])]
    assert r.index.crowd.boarded == 21 and r.index.cond.answered == 21
    assert r.index.log == ["start 301"], r.index.log
    assert [s.posts for s in r.sems] == [3] * 7
    snap = r.d.stats.snapshot({})
    assert snap["requests"]["recall/ok"] == 21
    # where the crowd's cycle went: each answer's lane time, and the kernel's (1000 ns a request)
    assert snap["phases"]["crowd_lane"]["count"] == 21 and snap["phases"]["crowd_aboard"]["count"] == 21
    assert snap["phases"]["crowd_aboard"]["p50_us"] == pytest.approx(1.0, rel=0.1)


def test_fewer_clients_than_a_crowd_never_start_it(rig: Any) -> None:
    """The negative control: three clients (crowd_min 4) are answered the usual way."""
    r = rig(3, 97)
    q = np.random.default_rng().standard_normal((3, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 5, 3)
    _answered(r, [0, 1, 2])
    r.d.settle()
    assert [_rows(r, i, 5) for i in range(3)] == [_top(r.data, q[i], 5) for i in range(3)]
    assert r.index.crowd.boarded == 0 and "search" in r.index.log and not r.index.carousel_running


@pytest.mark.parametrize("others", ["none", "gone", "lately"])
def test_a_client_recalling_alone_is_not_checked_for_boarding(others: str, rig: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """With the carousel stopped and fewer clients lately than a crowd (crowd_min 4), a lone
    recall goes the usual way without its query checked for boarding or the namespace looked
    up (11.5 µs a pass on the development VM, benchmarks/lone_armed.py): with no other slot
    seen ("none"), and with three seen long before the window ("gone": a crowd that has
    left, then forgotten). The negative control: the same three seen lately ("lately") make the same recall
    a crowd's; it is checked, and it boards."""
    r = rig(5, 97)
    checked: list[int] = []
    boards = r.d._boards
    monkeypatch.setattr(r.d, "_boards", lambda i: checked.append(i) or boards(i))
    q = np.random.default_rng().standard_normal((3, r.lay.dim)).astype(np.float32)
    for n in range(3):
        now = time.perf_counter_ns()
        at = {"none": None, "gone": now - 2 * dispatcher_module.COHORT_WINDOW_NS, "lately": now}[others]
        r.d._seen = {} if at is None else dict.fromkeys(range(1, 4), at)
        _ask(r, 0, q[n], 5, seq=n)
        _answered(r, [0])
        r.d.settle()
        assert _rows(r, 0, 5) == _top(r.data, q[n], 5)
        if others != "lately":
            assert not checked and not r.index.carousel_running and r.index.crowd.boarded == 0
            assert not set(r.d._seen) & {1, 2, 3}  # (gone: forgotten, the next pass stops at poll's count)
            continue
        assert checked and r.index.carousel_running and r.index.crowd.boarded == n + 1
    assert others == "lately" or "search" in r.index.log


def test_a_write_waits_for_the_carousel_to_drain_and_stop(rig: Any) -> None:
    """An upsert arriving while the crowd's recalls are aboard: they are answered from the
    rows as they were, the carousel stops, then the write runs; the next crowd starts it
    again over the new rows."""
    r = rig(6, 53)
    rng = np.random.default_rng()
    q = rng.standard_normal((6, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 5)
    r.d.poll()  # boarded
    assert r.index.carousel_running and r.index.crowd.in_flight
    new = q[:1] * 100  # a row that wins slot 0's recall
    args = encode_json({"namespace": "", "ids": ["big"], "texts": ["big"], "metadatas": [{}]})
    off = r.lay.slot_offset(5)
    np.frombuffer(r.mm, np.float32, r.lay.dim, off + r.lay.payload_offset)[:] = new[0]
    start = off + r.lay.payload_offset + 4 * r.lay.dim
    start += -start % 8
    r.mm[start : start + len(args)] = args
    REQUEST_STRUCT.pack_into(r.mm, off + REQUEST_OFFSET, 99, Op.UPSERT, 0, 0, 1, 4 * r.lay.dim, len(args), 0)
    r.states[5] = SlotState.REQUEST
    _answered(r, list(range(6)))
    assert r.index.log[-2:] == ["stop", "write"], r.index.log
    for i in range(5):
        assert _rows(r, i, 3) == _top(r.data, q[i], 3)  # the rows before the write
    both = np.vstack([r.data, new])
    for rnd in (1, 2):  # right after the write the carousel is held off (the usual path), then it starts again
        if rnd == 2:
            r.d._car_holdoff = 0
        for i in range(5):
            _ask(r, i, q[i], 3, seq=10 * rnd + i)
        _answered(r, list(range(5)))
        for i in range(5):
            got = _rows(r, i, 3)
            assert got == _top(both, q[i], 3) and (i or got[0] == 53)
        assert r.index.log.count("start 54") == rnd - 1, r.index.log
    assert r.index.crowd.boarded == 10 and r.index.log[3] == "search", r.index.log


@pytest.mark.parametrize("odd", ["k above the carousel's", "vectors", "a filter", "a huge ip query"])
def test_a_recall_the_carousel_cannot_take_waits_for_it_to_stop(odd: str, rig: Any) -> None:
    """A crowd aboard, and one recall the carousel cannot answer: the crowd is answered, the
    carousel stopped, and that recall searched the usual way, with its own right answer."""
    r = rig(6, 211)
    rng = np.random.default_rng()
    q = rng.standard_normal((6, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 4, 5)
    r.d.poll()
    assert r.index.carousel_running
    k, flags, args = 4, 0, b""
    if odd == "k above the carousel's":
        k = carousel.KMAX + 3
    elif odd == "vectors":
        flags = Flag.WITH_VECTORS
    elif odd == "a filter":
        args = encode_recall_args("", encode_json({"absent": 1}))  # (no row has it)
    else:
        q[5] *= 1e6  # float16 cannot hold it: the kernel would refuse it
    _ask(r, 5, q[5], k, seq=5, flags=flags, args=args)
    _answered(r, list(range(6)))
    r.d.settle()
    for i in range(5):
        assert _rows(r, i, 4) == _top(r.data, q[i], 4)
    if odd == "a filter":
        assert _rows(r, 5, 0) == []
    else:
        assert _rows(r, 5, k) == _top(r.data, q[5], k)
    assert "stop" in r.index.log and r.index.crowd.boarded == 5


def test_deleted_rows_are_never_returned(rig: Any) -> None:
    """With holes in the rows the carousel is asked for the default namespace's id, not every
    row (NS_ANY would take the tombstones)."""
    r = rig(5, 64)
    gone = list(range(0, 64, 3))
    r.svc.delete({"namespace": "", "ids": [f"r{j}" for j in gone]})
    keep = np.ones(64, bool)
    keep[gone] = False
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 32, 5)
    _answered(r, list(range(5)))
    for i in range(5):
        got = _rows(r, i, 32)
        assert got == _top(r.data, q[i], 32, keep) and not set(got) & set(gone)
    assert r.index.crowd.boarded == 5


def test_the_carousel_stops_when_the_crowd_thins_and_when_idle(rig: Any) -> None:
    r = rig(6, 77)
    q = np.random.default_rng().standard_normal((6, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 2, 6)
    _answered(r, list(range(6)))
    assert r.index.carousel_running
    # idle: stopped by housekeeping once nothing has boarded for the idle time
    r.d.stop_idle_carousel(0, 10)  # (notes the count)
    assert r.index.carousel_running
    r.d.stop_idle_carousel(100, 10)
    assert not r.index.carousel_running and r.index.log[-1] == "stop"
    # a crowd again, then one client alone once the others have not been seen for a window
    _ask_all(r, q, 2, 6, 10)
    _answered(r, list(range(6)))
    assert r.index.carousel_running and r.index.log.count("start 77") == 2
    r.d._seen = {0: time.perf_counter_ns()}  # (the others' last recalls long ago)
    _ask(r, 0, q[0], 2, seq=20)
    _answered(r, [0])
    assert not r.index.carousel_running and r.index.log[-2:] == ["stop", "search"], r.index.log
    assert _rows(r, 0, 2) == _top(r.data, q[0], 2)


def test_a_ping_amid_a_crowd_is_answered_without_waiting_for_it(rig: Any) -> None:
    """A ping needs neither the device nor the rows: answered at once while the crowd's
    recalls are still aboard (a turn takes 0.5 s here), the carousel left running; the crowd
    is answered by later passes."""
    r = rig(6, 40)
    r.index.turn = 0.5
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 5)
    r.d.poll()
    REQUEST_STRUCT.pack_into(r.mm, r.lay.slot_offset(5) + REQUEST_OFFSET, 7, Op.PING, 0, 0, 0, 0, 0, 0)
    r.states[5] = SlotState.REQUEST
    r.d.poll()
    assert r.states[5] == SlotState.RESPONSE
    assert r.index.carousel_running and r.index.crowd.in_flight == 5
    _answered(r, list(range(5)))
    assert [_rows(r, i, 3) for i in range(5)] == [_top(r.data, q[i], 3) for i in range(5)]


def test_reclaim_leaves_a_slot_whose_request_is_aboard(rig: Any, tmp_path: Any) -> None:
    """A client that died with its recall aboard: its slot is not freed under the carousel
    (its answer would land in a slot someone else may own by then); once answered, it is.
    (A plain file's lock bytes are free: every slot's owner looks gone.)"""
    r = rig(5, 40)
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 5)
    r.d.poll()
    assert r.index.carousel_running
    r.index.cond.pause.set()
    with open(tmp_path / "locks", "w+b") as f:
        f.truncate(4096)
        assert r.d.reclaim(f.fileno()) == 0  # every slot BUSY, its request aboard
        r.index.cond.pause.clear()
        _answered(r, list(range(5)))
        assert r.d.reclaim(f.fileno()) == 5


@pytest.mark.parametrize("kernel", ["alive", "dead", "dead after two answers"])
def test_stopping_answers_the_crowd_or_refuses_it_when_the_kernel_is_gone(kernel: str, rig: Any) -> None:
    """refuse_all (the sidecar stopping) with recalls aboard and waiting: a live carousel answers
    them all first; one that has stopped answering (its stop fails) leaves each with an error
    (INTERNAL: the carousel failed), none unanswered; what it answered before it died is
    answered."""
    r = rig(7, 60)
    r.index.strict = False
    q = np.random.default_rng().standard_normal((7, r.lay.dim)).astype(np.float32)
    r.index.slots.close()  # two carousel slots only: a backlog
    r.index.slots = Slots(FakeCupy(), 2, r.lay.dim)
    r.index.crowd = lane = CrowdLane(r.index.slots)
    _ask_all(r, q, 3, 7)
    r.d._seen = dict.fromkeys(range(7), time.perf_counter_ns())  # (a crowd: the carousel starts)
    r.index.start_carousel = lambda high, ns, n, f=r.index.start_carousel: (f(high, ns, n), r.index.cond.pause.set())  # type: ignore[method-assign]
    r.d.poll()
    assert r.index.carousel_running and lane.in_flight == 7 and lane.boarded == 2
    answered: list[int] = []
    if kernel == "dead after two answers":
        r.index.cond.pause.clear()
        while r.index.cond.answered < 2:
            time.sleep(0.001)
        r.index.cond.pause.set()
        answered = [i for i in range(7) if r.index.cond.answered and i in _boarded(lane)]
    if kernel == "alive":
        r.index.cond.pause.clear()
    else:
        lane.alive = lambda: (_ for _ in ()).throw(RuntimeError("the kernel is gone"))
    r.d.refuse_all(Status.STOPPING, "the sidecar is stopping")
    assert all(r.states[i] in (SlotState.RESPONSE, SlotState.ERROR) for i in range(7))
    for i in range(7):
        if kernel == "alive" or i in answered:
            assert _rows(r, i, 3) == _top(r.data, q[i], 3)
        else:  # refused by settle's drain, which found the carousel failed
            resp = Response.unpack(r.mm[r.lay.slot_offset(i) : r.lay.slot_offset(i) + CTL_SIZE])
            assert r.states[i] == SlotState.ERROR and resp.status == Status.INTERNAL
    assert [s.posts for s in r.sems] == [1] * 7 and lane.in_flight == 0
    assert len(answered) == (2 if kernel == "dead after two answers" else 0)


def _boarded(lane: CrowdLane) -> set[int]:
    """The protocol slots of the requests in the carousel's slots (tokens: request, t0, slot)."""
    return {held[0][2] for held in lane._aboard.values()}


def test_a_pass_with_nothing_waiting_harvests_and_never_waits_for_the_carousel(rig: Any) -> None:
    """While the crowd's recalls are aboard (a 1 s turn here), a pass that finds nothing
    waiting returns at once: the serve loop keeps taking new requests meanwhile."""
    r = rig(5, 40)
    r.index.turn = 1.0
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 4)
    r.d._seen = dict.fromkeys(range(5), time.perf_counter_ns())
    r.d.poll()
    assert r.index.crowd.in_flight == 4 and r.d.crowd_in_flight()
    t = time.monotonic()
    assert r.d.poll() == 0
    _ask(r, 4, q[4], 3, seq=4)
    assert r.d.poll() == 1 and r.index.crowd.in_flight == 5  # boarded while the others ride
    assert time.monotonic() - t < 0.5
    _answered(r, list(range(5)))
    assert not r.d.crowd_in_flight()


def test_the_carousel_stops_for_a_thin_crowd_and_when_idle_only_after_a_drain(rig: Any) -> None:
    """With requests aboard (a 50 ms turn), a stop for a crowd that thinned and one for
    idleness each answer them first (the index's stop fails on a request aboard)."""
    r = rig(6, 77)
    r.index.turn = 0.05
    q = np.random.default_rng().standard_normal((6, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 2, 6)
    r.d.poll()
    assert r.index.crowd.in_flight == 6
    r.d.stop_idle_carousel(0, 10)
    r.d.stop_idle_carousel(100, 10)  # nothing boarded since: stopped, after its six are answered
    assert not r.index.carousel_running and all(r.states[i] == SlotState.RESPONSE for i in range(6))
    r.d._car_holdoff = 0
    _ask_all(r, q, 2, 6, 10)
    _answered(r, list(range(6)))
    assert r.index.carousel_running
    _ask(r, 1, q[1], 2, seq=21)  # one recall aboard (the crowd still counted)
    r.d.poll()
    assert r.index.crowd.in_flight == 1
    r.d._seen = {}  # then the crowd is gone, and a lone client's recall comes while that one rides
    _ask(r, 0, q[0], 2, seq=20)
    _answered(r, [0, 1])
    assert not r.index.carousel_running and r.index.log[-2:] == ["stop", "search"], r.index.log
    assert [_rows(r, i, 2) for i in range(6)] == [_top(r.data, q[i], 2) for i in range(6)]


def test_without_the_c_path_nothing_boards_and_the_carousel_never_starts(rig: Any) -> None:
    """Only requests _hotpath.take checked can board: without it (KALOS_HOTPATH=0, or not
    built) a crowd is answered the usual way and the carousel is never started (it would be
    started and stopped for nothing, pass after pass)."""
    r = rig(6, 50)
    r.d.hot = None
    q = np.random.default_rng().standard_normal((6, r.lay.dim)).astype(np.float32)
    for rnd in range(3):
        for i in range(6):
            _ask(r, i, q[i], 3, seq=10 * rnd + i)
        _answered(r, list(range(6)))
        r.d.settle()
    assert [_rows(r, i, 3) for i in range(6)] == [_top(r.data, q[i], 3) for i in range(6)]
    assert r.index.crowd.boarded == 0 and not any(e.startswith("start") for e in r.index.log), r.index.log


def test_fewer_rows_than_k_and_a_kernel_that_loses_rows(rig: Any) -> None:
    """Five rows and k 10: the carousel's five are the answer. A kernel that answers fewer
    than it should is an INTERNAL error for that recall alone, never a short answer."""
    r = rig(5, 5)
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 10, 5)
    _answered(r, list(range(5)))
    assert [_rows(r, i, 5) for i in range(5)] == [_top(r.data, q[i], 10) for i in range(5)]
    r.index.cond.short = 4
    _ask_all(r, q, 10, 5, 10)
    _answered(r, list(range(5)))
    for i in range(5):
        off = r.lay.slot_offset(i)
        resp = Response.unpack(r.mm[off : off + CTL_SIZE])
        blob = bytes(r.mm[off + r.lay.blob_offset : off + r.lay.blob_offset + resp.resp_len])
        assert r.states[i] == SlotState.ERROR and resp.status == Status.INTERNAL and b"4 of 5" in blob


def test_a_wrong_echo_fails_that_recall_only(rig: Any) -> None:
    r = rig(5, 30)
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 5)
    r.d._seen = dict.fromkeys(range(5), time.perf_counter_ns())
    start = r.index.start_carousel
    r.index.start_carousel = lambda high, ns, n: (start(high, ns, n), setattr(r.index.cond, "wrong_seq", True))  # type: ignore[method-assign]
    r.d.poll()
    _answered(r, list(range(5)))
    for i in range(5):
        off = r.lay.slot_offset(i)
        resp = Response.unpack(r.mm[off : off + CTL_SIZE])
        assert r.states[i] == SlotState.ERROR and resp.status == Status.INTERNAL
    r.index.cond.wrong_seq = False
    _ask_all(r, q, 3, 5, 10)
    _answered(r, list(range(5)))
    assert [_rows(r, i, 3) for i in range(5)] == [_top(r.data, q[i], 3) for i in range(5)]


def test_the_pass_that_starts_the_carousel_counts_no_lone_recall(rig: Any) -> None:
    """With a resident kernel on offer, a lone recall in a pass counts towards starting it;
    the pass whose recall starts the carousel must not (the serve loop would stop the
    carousel for the resident kernel, and the crowd would ring that from then on)."""
    r = rig(5, 30)
    r.index.doorbell_k = 10  # (offered: the dispatcher counts lone recalls)
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    r.d.lone = 3
    r.d._seen = dict.fromkeys(range(5), time.perf_counter_ns())
    _ask(r, 0, q[0], 3, seq=1, flags=Flag.ARENA_DOCS)
    r.d.poll()
    assert r.index.carousel_running and r.d.lone == 0
    _answered(r, [0])


def test_a_recall_on_the_carousel_voids_the_rest_of_an_abandoned_answer(rig: Any) -> None:
    """A slot whose client abandoned an answer in parts (its rest pending) asks anew: once
    that recall boards, a CONTINUE finds nothing to continue (as after a batch)."""
    r = rig(5, 30)
    r.d.pending[0] = (b"the rest of an old answer", 1, 0, 8)
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 5)
    _answered(r, list(range(5)))
    assert r.index.crowd.boarded == 5
    REQUEST_STRUCT.pack_into(r.mm, r.lay.slot_offset(0) + REQUEST_OFFSET, 9, Op.CONTINUE, 0, 0, 0, 0, 0, 0)
    r.states[0] = SlotState.REQUEST
    r.d.poll()
    resp = Response.unpack(r.mm[r.lay.slot_offset(0) : r.lay.slot_offset(0) + CTL_SIZE])
    assert r.states[0] == SlotState.ERROR and resp.status == Status.BAD_REQUEST


class _FailingSem(PostCounter):
    """A response semaphore whose posts fail (``fail``: how many more will)."""

    fail = 0

    def release(self) -> None:
        if _FailingSem.fail:
            _FailingSem.fail -= 1
            raise OSError("sem_post failed")
        super().release()


def test_a_failed_post_while_the_carousel_yields_the_device_strands_nobody(rig: Any) -> None:
    """A recall the carousel cannot take arrives while five ride it (50 ms turns); the
    carousel's answers are written, and the first of their posts fails: every other client of
    the crowd is still posted, and the recall that asked for the device gets an answer (an
    error) instead of staying BUSY."""
    r = rig(6, 90)
    for j in range(6):
        r.sems[j] = _FailingSem()
    r.d.sems = r.sems
    r.index.turn = 0.05
    q = np.random.default_rng().standard_normal((6, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 5)
    r.d.poll()
    _ask(r, 5, q[5], carousel.KMAX + 1, seq=5)
    _FailingSem.fail = 1
    r.d.poll()
    assert all(r.states[i] in (SlotState.RESPONSE, SlotState.ERROR) for i in range(6))
    assert sum(s.posts for s in r.sems) == 5  # every post but the failed one
    assert [_rows(r, i, 3) for i in range(5)] == [_top(r.data, q[i], 3) for i in range(5)]


def test_a_carousel_that_answers_nothing_is_a_device_fault_and_its_recalls_refused(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that runs but never answers: a pass finds it stalled (0.2 s here) and raises
    FatalDeviceError (the sidecar exits and is restarted), every recall it held refused."""
    monkeypatch.setattr(dispatcher_module, "CAROUSEL_STALL_S", 0.2)
    r = rig(5, 40)
    r.index.turn = 30.0
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    _ask_all(r, q, 3, 5)
    r.d.poll()
    assert r.d.poll() == 0  # (not yet stalled)
    time.sleep(0.3)
    with pytest.raises(FatalDeviceError, match="answered none"):
        r.d.poll()
    for i in range(5):
        resp = Response.unpack(r.mm[r.lay.slot_offset(i) : r.lay.slot_offset(i) + CTL_SIZE])
        assert r.states[i] == SlotState.ERROR and resp.status == Status.INTERNAL
    assert r.index.crowd.in_flight == 0 and [s.posts for s in r.sems] == [1] * 5
    r.index.cond.stop.set()  # (the fixture's stop: the "kernel" still holds them)
    r.index.carousel_running = False


@pytest.mark.parametrize(
    ("metric", "scale", "boards"),
    [("cosine", 1.0, True), ("cosine", 1e-20, False), ("cosine", 1e18, False), ("ip", 1e3, True),
     ("ip", 1e5, False), ("l2", 1e5, False)],
)  # fmt: skip
def test_only_queries_the_kernel_takes_board(metric: str, scale: float, boards: bool, rig: Any) -> None:
    """A cosine query whose float32 squared norm underflows or overflows, and an ip / L2 query
    beyond float16, stay off the carousel (the kernel would refuse them, or lose the tiny one
    to zeros); the usual path answers them."""
    r = rig(5, 40, metric=metric)
    q = np.random.default_rng().standard_normal((5, r.lay.dim)).astype(np.float32)
    q[0] *= np.float32(scale)
    _ask_all(r, q, 3, 5)
    _answered(r, list(range(5)))
    assert r.index.crowd.boarded == (5 if boards else 4)

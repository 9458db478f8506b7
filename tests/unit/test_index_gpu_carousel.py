"""The GPU index's carousel methods (``GpuIndex.start_carousel`` / ``stop_carousel`` /
``check_carousel``) without a GPU: CuPy stood in for by host memory (tests/carousel_fakes.py),
and the kernel's launch by a thread that answers its slots as carousel_topk does until the host
sets its stop word, its stream "done" once that thread has returned. What the kernel computes
is for tests/gpu/test_carousel.py; here: that a start points the kernel at the index's rows as
they are now, a stop abandons nothing, and a kernel that ends by itself is a device fault."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from carousel_fakes import CarouselKernel, Conductor, param_names, patch_kernels
from carousel_fakes import top_ip as _top
from kalos_retrievers.sidecar import carousel
from kalos_retrievers.sidecar.index import NS_ANY, FatalDeviceError
from kalos_retrievers.sidecar.index_gpu import GpuIndex
from kalos_testing import until
from kernel_fakes import dev

from kalos_retrievers.protocol import W_ELIGIBLE

pytestmark = pytest.mark.timeout(60)


class _KernelThread(Conductor):
    """carousel_topk "running": answers the slots until the host's stop word (hctl[0])."""

    def __init__(self, slots: Any, data: np.ndarray, ns: np.ndarray, n_rows: int, hctl: np.ndarray) -> None:
        super().__init__(slots, data, ns, n_rows)
        self.hctl = hctl
        self.die = threading.Event()  # (a fault: the kernel ends by itself)

    def run(self) -> None:
        watcher = threading.Thread(target=self._watch, daemon=True)
        watcher.start()
        super().run()

    def _watch(self) -> None:
        while not self.hctl[0] and not self.die.is_set():
            time.sleep(0.0002)
        self.stop.set()


class _Stream:
    """A CuPy stream whose work is the kernel thread launched on it (done once it returned)."""

    def __init__(self) -> None:
        self.kernel: _KernelThread | None = None
        self.synced = 0

    @property
    def done(self) -> bool:
        return self.kernel is None or not self.kernel.is_alive()

    def __enter__(self) -> _Stream:
        _Stream.current = self
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        self.synced += 1

    def record(self) -> object:
        return self

    def wait_event(self, event: object) -> None:
        return None


class _Launching(CarouselKernel):
    """The launch checked against the kernel's parameters, then run as a _KernelThread."""

    slots: Any = None

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        super().__call__(grid, block, args, shared_mem)
        a = dict(zip(param_names("carousel_topk"), args, strict=True))
        hctl = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint32 * 8).from_address(int(a["hctl"])))
        data = np.asarray(a["data"]).astype(np.float32)
        k = _KernelThread(self.slots, data, np.asarray(a["ns"]), int(a["nrows"]), hctl)
        _Stream.current.kernel = k
        k.start()


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A GpuIndex made without CuPy (the attributes its carousel methods use), holding 53 rows
    of 16-d float16 in namespace 0, row 7 deleted; its rows' arrays are grown once, as a
    capacity change does, between the tests' launches if they ask."""
    cp, log, kern = patch_kernels(monkeypatch)
    launching = _Launching("carousel_topk", log)
    launching.num_regs = kern.num_regs
    monkeypatch.setattr(carousel.kernels, "get_kernel", lambda name, *t: launching)
    cp.cuda.Stream = lambda non_blocking=True: _Stream()
    cp.cuda.get_current_stream = _Stream
    cp.cuda.memory = SimpleNamespace(OutOfMemoryError=MemoryError)
    cp.cuda.runtime.CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})
    idx = GpuIndex.__new__(GpuIndex)
    rng = np.random.default_rng()
    rows = rng.standard_normal((64, 16)).astype(np.float16)
    ns = np.zeros(64, np.int32)
    ns[7] = -1
    ns[53:] = -1
    idx.__dict__.update(cp=cp, dim=16, metric=1, name="cuda:0", device=_NullContext(),
                        carousel_k=carousel.KMAX, carousel_running=False, carousel_launches=0, _car=None,
                        crowd=None, _closed=False, doorbell_running=False, _pending=deque(), stream=_Stream(),
                        _car_fault="", _direct=None, _car_answered=0, _masks_kept=OrderedDict(),
                        data=dev(rows), ns=dev(ns), sqnorm=dev(np.zeros(64, np.float32)))  # fmt: skip
    calls: list[str] = []
    idx.__dict__["_finish_all"] = lambda: calls.append("finish_all")
    yield idx, launching, calls
    if idx._car is not None and idx.carousel_running:
        idx._car.hctl[0] = 1
        idx._car.stream.kernel.join(5)
    idx._closed = True  # (no close() at collection: nothing of CuPy to release)


class _NullContext:
    """The index's CuPy device: a context that does nothing, and a count of its synchronizations."""

    synced = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        self.synced += 1


def _start(idx: Any, launching: _Launching, high: int, ns: int = NS_ANY, eligible: int = 0) -> None:
    # the kernel thread needs the slots, made by the first start: handed over as the launch happens
    real = carousel.Slots

    def slots(*a: Any, **kw: Any) -> Any:
        s = real(*a, **kw)
        launching.slots = s
        return s

    carousel.Slots, saved = slots, carousel.Slots
    try:
        idx.start_carousel(high, ns, eligible)
    finally:
        carousel.Slots = saved


def test_a_started_carousel_answers_over_the_rows_in_use_and_a_stop_abandons_nothing(index: Any) -> None:
    idx, launching, calls = index
    _start(idx, launching, 53)
    assert idx.carousel_running and idx.carousel_launches == 1 and calls == ["finish_all"]
    assert idx.device.synced == 1  # (every stream idle, the rows' copies done, before the launch)
    data = np.asarray(idx.data).astype(np.float32)
    keep = (np.asarray(idx.ns) == 0) & (np.arange(64) < 53)
    rng = np.random.default_rng()
    qs = rng.standard_normal((80, 16)).astype(np.float32)
    lane = idx.crowd
    for j in range(80):  # more than the 64 slots: a backlog
        lane.board(j, qs[j], 10, 0)
    idx.stop_carousel()  # quiesces: every request answered before the stop
    assert not idx.carousel_running and not lane.busy()
    got = {x.token: x for x in lane.harvest()}
    assert sorted(got) == list(range(80))
    assert all(got[j].rows.tolist() == _top(data, qs[j], 10, keep) for j in range(80))
    # a second start: the same carousel pointed at the rows as they are now (grown, more in use)
    idx.data = dev(np.vstack([np.asarray(idx.data), np.ones((8, 16), np.float16)]))
    ns = np.zeros(72, np.int32)
    ns[7] = -1
    idx.ns = dev(ns)
    car = idx._car
    _start(idx, launching, 72)
    assert idx._car is car and car.n_rows == 72 and car.data is idx.data and idx.carousel_launches == 2
    lane.board("ones", np.ones(16, np.float32), 8, NS_ANY)
    assert sorted(lane.drain()[0].rows.tolist()) == list(range(64, 72))  # the new rows win
    idx.stop_carousel()


def test_a_kernel_that_ends_by_itself_is_a_device_fault(index: Any) -> None:
    """The carousel ends only when stopped: one that has ended is reported as FatalDeviceError
    by check_carousel (housekeeping) and by the lane's wait for an answer; the negative control
    is the running carousel, which check_carousel leaves alone."""
    idx, launching, _ = index
    _start(idx, launching, 53)
    idx.check_carousel()  # running: nothing to say
    assert idx.carousel_running
    kernel = idx._car.stream.kernel
    kernel.pause.set()
    idx.crowd.board("x", np.ones(16, np.float32), 3, 0)
    kernel.die.set()
    kernel.join(5)
    with pytest.raises(FatalDeviceError, match="ended without being stopped"):
        idx.crowd.drain(timeout=5)
    assert not idx.carousel_running
    with pytest.raises(FatalDeviceError, match="ended without"):  # said again, at once, by every check
        idx.check_doorbell()
    t = time.monotonic()
    with pytest.raises(FatalDeviceError, match="ended without"):
        idx.crowd.quiesce(timeout=5)  # (a drain after the fault does not wait for the timeout)
    assert time.monotonic() - t < 1


def test_there_is_no_carousel_without_the_switch(index: Any) -> None:
    idx, launching, _ = index
    idx.carousel_k = 0
    with pytest.raises(RuntimeError, match="unless KALOS_CAROUSEL=0"):
        _start(idx, launching, 53)
    idx.stop_carousel()  # (nothing to stop)


@pytest.mark.parametrize(("value", "mode"), [(None, (True, True)), ("", (True, True)), (" direct ", (True, True)),
                                             ("1", (True, False)), ("0", (False, False))])  # fmt: skip
def test_the_switch_is_direct_unless_told_otherwise(value: str | None, mode: tuple[bool, bool]) -> None:
    """KALOS_CAROUSEL: unset or empty is "direct" (session 40's default), "1" the lane, "0" off."""
    from kalos_retrievers.sidecar.index_gpu import carousel_mode

    assert carousel_mode(value) == mode


@pytest.mark.parametrize("value", ["2", "on", "Direct", "off"])
def test_an_unknown_switch_is_refused_by_name(value: str) -> None:
    from kalos_retrievers.sidecar.index_gpu import carousel_mode

    with pytest.raises(ValueError, match=f"KALOS_CAROUSEL='{value}'.*expected 0"):
        carousel_mode(value)


def test_pausing_the_resident_kernel_stops_the_carousel_with_nothing_abandoned(index: Any) -> None:
    """pause_doorbell (before any other device work) stops the carousel too, once the backlog
    has been through it."""
    idx, launching, _ = index
    _start(idx, launching, 53)
    lane = idx.crowd
    for j in range(70):
        lane.board(j, np.ones(16, np.float32), 2, 0)
    idx.pause_doorbell()
    assert not idx.carousel_running and sorted(x.token for x in lane.harvest()) == list(range(70))


def test_a_carousel_that_will_not_stop_is_a_fault_and_its_memory_stays_registered(
    index: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel ignores its stop word: the stop fails with FatalDeviceError (and says so
    again at every check), and close() leaves the slots it still reads registered (the
    negative control: a stopped carousel's slots are unregistered)."""
    from kalos_retrievers.sidecar import index_gpu

    idx, launching, _ = index
    monkeypatch.setattr(index_gpu, "_DOORBELL_STOP_S", 0.2)
    _start(idx, launching, 53)
    kernel = idx._car.stream.kernel
    kernel.hctl = np.ones(8, np.uint32) * 0  # (its own copy of the stop word: never set)
    with pytest.raises(FatalDeviceError, match="did not stop"):
        idx.stop_carousel()
    assert idx.carousel_running
    with pytest.raises(FatalDeviceError, match="did not stop"):
        idx.check_carousel()
    registered = idx.cp.registered
    slots_addr = idx.crowd.slots.addr
    assert slots_addr in registered
    idx.__dict__.update(exact=None, desc_addr=0, cand_addr=0, _bell_addr=0, _arena_table=(0,), graphs={}, seg_addr=0)
    idx.detach_segment = lambda: None
    GpuIndex.close(idx)
    assert slots_addr in registered  # (left registered: the kernel still reads it)
    kernel.die.set()
    kernel.join(5)


def test_closing_a_stopped_carousel_unregisters_its_memory(index: Any) -> None:
    idx, launching, _ = index
    _start(idx, launching, 53)
    idx.stop_carousel()
    registered = idx.cp.registered
    slots_addr, hctl_addr = idx.crowd.slots.addr, idx._car._haddr
    assert {slots_addr, hctl_addr} <= set(registered)
    idx.__dict__.update(exact=None, desc_addr=0, cand_addr=0, _bell_addr=0, _arena_table=(0,), graphs={}, seg_addr=0)
    idx.detach_segment = lambda: None
    GpuIndex.close(idx)
    assert not {slots_addr, hctl_addr} & set(registered)


def _ask(slots: Any, i: int, q: np.ndarray, k: int, seq: int) -> None:
    """A direct client's request in carousel slot ``i``, written as KalosClient._recall_direct
    writes it (the namespace word is the sidecar's)."""
    slots.queries[i] = q
    w = slots.words[i]
    w[carousel.W_K], w[carousel.W_SEQ], w[carousel.W_RESULTS] = k, seq, 0xFFFFFFFF
    w[carousel.W_STATE] = carousel.REQUEST


def test_direct_clients_write_their_own_slots_between_an_odd_and_an_even_epoch(index: Any) -> None:
    """KALOS_CAROUSEL=direct: the slots live in the map the server gives (the shared segment),
    the direct clients' namespace word is written before the launch, the epoch is published odd
    once the kernel runs and even before it stops; the lane boards above the direct slots; a
    stop answers the direct requests asked before it (the kernel slow, a turn of 5 ms), and a
    request asked after the stop is turned back to IDLE by the sweep, which leaves a running
    carousel's requests alone (the negative control)."""
    import mmap

    from kalos_retrievers.protocol import CarouselLayout

    idx, launching, _ = index
    mm = mmap.mmap(-1, CarouselLayout.of(16).segment_size())
    published: list[tuple[int, int, bool]] = []  # (epoch, direct slots, the kernel running then)
    stuck_then: list[int] = []  # direct requests left in flight when each epoch was published

    def on_carousel(e: int, n: int) -> None:
        published.append((e, n, idx._car.running))
        st = idx._car.slots.words[:n, carousel.W_STATE]
        stuck_then.append(int(((st == carousel.REQUEST) | (st == carousel.TAKEN)).sum()))

    idx.__dict__.update(carousel_direct=5, carousel_map=lambda size: mm, on_carousel=on_carousel)
    _start(idx, launching, 53, ns=0, eligible=52)
    slots, lane = idx._car.slots, idx.crowd
    assert slots._mm is mm and published == [(1, 5, True)]
    assert (slots.words[:5, carousel.W_NS].view(np.int32) == 0).all()
    assert (slots.words[:5, W_ELIGIBLE] == 52).all()  # (the namespace's rows: what a direct answer's count must be)
    assert lane.first == 5 and min(lane._free) == 5
    assert idx.carousel_active() == 5 and idx.carousel_active() == 0  # (looked at during the first launch too)
    data = np.asarray(idx.data).astype(np.float32)
    keep = (np.asarray(idx.ns) == 0) & (np.arange(64) < 53)
    rng = np.random.default_rng()
    q = rng.standard_normal((4, 16)).astype(np.float32)
    _ask(slots, 2, q[0], 9, 41)
    until(lambda: slots.state(2) == carousel.DONE)
    assert slots.words[2, carousel.W_RESP_SEQ] == 41 and slots.rows[2, :9].tolist() == _top(data, q[0], 9, keep)
    lane.board("lane", q[1], 5, 0)
    assert next(iter(lane._aboard)) >= 5  # (the lane's own slots)
    _ask(slots, 4, q[2], 3, 43)
    until(lambda: slots.state(4) != carousel.REQUEST)
    assert idx.sweep_carousel() == 0 and slots.state(4) in (carousel.TAKEN, carousel.DONE)  # running: left alone
    kernel = idx._car.stream.kernel
    kernel.delay = 0.005  # (a turn: requests stay aboard while the stop begins; the stop waits up to 50 ms)
    kernel.hold.set()  # (taken and kept aboard until just before the stop: TAKEN seen however late we poll)
    _ask(slots, 3, q[3], 6, 42)
    until(lambda: slots.state(3) == carousel.TAKEN)
    kernel.hold.clear()
    idx.stop_carousel()
    # E + 1 while the kernel still runs (answers still good), E + 3 once it has stopped and its
    # slots were swept (nothing in flight by then)
    assert published == [(1, 5, True), (2, 5, True), (4, 5, False)] and not idx.carousel_running
    assert stuck_then[-1] == 0
    assert slots.state(3) == carousel.DONE and slots.rows[3, :6].tolist() == _top(data, q[3], 6, keep)
    assert [x.token for x in lane.harvest()] == ["lane"]
    _ask(slots, 1, q[0], 9, 44)  # after the stop: no kernel will take it
    assert idx.sweep_carousel() == 1 and slots.state(1) == carousel.IDLE
    assert idx.sweep_carousel() == 0
    # a second launch: its epoch the next odd one, its words written again (another namespace
    # and count: the launch's, as for every launch), its slots' request numbers looked at afresh
    slots.words[:5, W_ELIGIBLE] = 0
    _start(idx, launching, 53, ns=0, eligible=49)
    assert published[-1] == (5, 5, True)
    assert (slots.words[:5, W_ELIGIBLE] == 49).all() and (slots.words[5:, W_ELIGIBLE] == 0).all()
    assert idx.carousel_active() == 5  # (the first look after a launch: every slot counts)
    assert idx.carousel_active() == 0  # nothing sent since
    _ask(slots, 0, q[1], 4, 45)
    until(lambda: slots.state(0) == carousel.DONE)
    assert idx.carousel_active() == 1  # slot 0's request number moved
    idx.stop_carousel()
    assert published[-2:] == [(6, 5, True), (8, 5, False)]


def test_a_failed_stop_tried_again_keeps_the_epochs_parity(index: Any) -> None:
    """A stop whose kernel would not stop (an error after E + 1 was published) and a second
    stop: the epoch goes to E + 3, not E + 2 (odd would invite direct requests to a kernel
    that is stopping or gone)."""
    import mmap

    from kalos_retrievers.protocol import CarouselLayout

    idx, launching, _ = index
    mm = mmap.mmap(-1, CarouselLayout.of(16).segment_size())
    published: list[int] = []
    idx.__dict__.update(carousel_direct=3, carousel_map=lambda size: mm, on_carousel=lambda e, n: published.append(e))
    _start(idx, launching, 53, ns=0)
    car = idx._car
    real_stop = car.stop
    car.stop = lambda timeout=10.0: (_ for _ in ()).throw(RuntimeError("stuck"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="stuck"):
        idx.stop_carousel()
    assert published == [1, 2] and idx.carousel_running
    car.stop = real_stop  # type: ignore[method-assign]
    idx.stop_carousel()
    assert published == [1, 2, 2, 4] and not idx.carousel_running


def test_a_stop_does_not_wait_for_ever_on_a_direct_request_and_sweeps_it(index: Any) -> None:
    """A direct request the kernel holds and does not answer (it hangs on that one) is given up
    after the stop's short wait: the slot is turned back to IDLE (its client asks again), and
    the stop completes; with the wait long enough it would have been answered (above)."""
    import mmap

    from kalos_retrievers.protocol import CarouselLayout

    idx, launching, _ = index
    mm = mmap.mmap(-1, CarouselLayout.of(16).segment_size())
    idx.__dict__.update(carousel_direct=3, carousel_map=lambda size: mm, on_carousel=lambda e, n: None)
    _start(idx, launching, 53, ns=0)
    slots = idx._car.slots
    kernel = idx._car.stream.kernel
    kernel.delay = 30.0  # taken, never answered in time
    _ask(slots, 0, np.ones(16, np.float32), 4, 7)
    until(lambda: slots.state(0) == carousel.TAKEN)
    t = time.monotonic()
    idx.stop_carousel()
    assert time.monotonic() - t < 2.0 and not idx.carousel_running
    assert slots.state(0) == carousel.IDLE


def test_a_carousel_segment_that_cannot_be_made_leaves_the_lane_alone(index: Any) -> None:
    """KALOS_CAROUSEL=direct with /dev/shm full: the carousel still starts, its slots in the
    sidecar's own memory, every slot the lane's, no epoch published, and the index says it has
    no direct slots (so the dispatcher judges the crowd as the lane's). With a map that works,
    the slots below carousel_direct are the clients' (the test above)."""
    import errno

    idx, launching, _ = index
    published: list[int] = []

    def full(size: int) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    idx.__dict__.update(carousel_direct=5, carousel_map=full, on_carousel=lambda e, n: published.append(e))
    _start(idx, launching, 53, ns=0, eligible=52)
    assert idx.carousel_running and idx.crowd.first == 0 and min(idx.crowd._free) == 0
    assert idx.carousel_direct == 0 and idx.carousel_direct_slots == 0 and idx.carousel_active() == 0
    idx.stop_carousel()
    assert published == [] and idx.sweep_carousel() == 0

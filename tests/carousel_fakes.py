"""Stand-ins for the carousel on the CPU (sidecar/carousel.py): what its Slots and Carousel use
of CuPy, over host memory, and a thread that answers the slots as ``carousel_topk``'s conductor
and blocks together do (an exact top-k in numpy, by inner product). What the kernel computes
is for the GPU tests (tests/gpu/test_carousel.py)."""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import carousel, cuda_kernels
from kalos_retrievers.sidecar.carousel import DONE, ERROR, REQUEST, TAKEN, Slots
from kalos_retrievers.sidecar.crowd import CrowdLane
from kalos_retrievers.sidecar.direct import DirectSlots
from kalos_retrievers.sidecar.index import NS_ANY, CpuIndex
from kernel_fakes import SOURCE, DevArray, FakeKernel, dev


def param_names(name: str) -> list[str]:
    """The parameter names of ``name(...)`` in kernels/recall.cu."""
    m = re.search(rf"^{name}\((.*?)\)\s*{{", SOURCE, re.S | re.M)
    assert m is not None
    return [re.findall(r"\w+", p)[-1] for p in m.group(1).split(",")]


def top_ip(data: np.ndarray, q: np.ndarray, k: int, keep: np.ndarray | None = None) -> list[int]:
    """The Conductor's answer: the rows of the top ``k`` inner products (among ``keep``), best
    first, ties to the smaller row."""
    sc = data @ q
    if keep is not None:
        sc = np.where(keep, sc, -np.inf)
    top = np.argsort(-sc, kind="stable")[:k]
    return top[np.isfinite(sc[top])].tolist()


class CarouselKernel(FakeKernel):
    """The launch checked, and then ``started`` of its scanning blocks reported started, as the
    conductor does (hctl[4], host memory)."""

    started: int | None = None  # None: all of them

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        super().__call__(grid, block, args, shared_mem)
        hctl = dict(zip(param_names("carousel_topk"), args, strict=True))["hctl"]
        words = np.ctypeslib.as_array((ctypes.c_uint32 * 8).from_address(int(hctl)))
        words[4] = grid[0] - 1 if self.started is None else self.started


def patch_kernels(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCupy, list, CarouselKernel]:
    """A FakeCupy, and cuda_kernels' compile and get_kernel patched to give a CarouselKernel
    (its launches recorded in the list returned)."""
    log: list = []
    kern = CarouselKernel("carousel_topk", log)
    kern.num_regs = 114  # what ptxas reports for sm_90 (nvcc -Xptxas -v)
    monkeypatch.setattr(cuda_kernels, "compile_kernels", lambda names: None)
    monkeypatch.setattr(cuda_kernels, "get_kernel", lambda name, *t: kern)
    return FakeCupy(), log, kern


class FakeCupy:
    """What Carousel and Slots use of CuPy, over host memory."""

    float16, uint32, int32, uint64 = np.float16, np.uint32, np.int32, np.uint64

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        runtime = SimpleNamespace(
            hostRegister=lambda addr, size, flags: self.registered.__setitem__(addr, size),
            hostUnregister=self.registered.pop,
            getDeviceProperties=lambda ordinal: {
                "multiProcessorCount": 132,
                "regsPerMultiprocessor": 65536,
                "sharedMemPerMultiprocessor": 233472,
                "maxThreadsPerMultiProcessor": 2048,
                "reservedSharedMemPerBlock": 1024,
            },  # fmt: skip
        )
        self.cuda = SimpleNamespace(runtime=runtime, Device=lambda: SimpleNamespace(id=0),
                                    Stream=lambda non_blocking=True: _Stream(), get_current_stream=_Stream)  # fmt: skip

    @staticmethod
    def zeros(shape: Any, dtype: Any) -> DevArray:
        return dev(np.zeros(shape, dtype))


class _Stream:
    done = True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record(self) -> object:
        return self

    def wait_event(self, event: object) -> None:
        self.waited = event


class Conductor(threading.Thread):
    """Answers the slots as carousel_topk does (the exact top-k by inner product in numpy, ties
    to the smaller row; past the results -1 and -inf) over the first ``n_rows`` rows of
    ``data`` (all by default), until stopped. A request naming a namespace id takes the rows
    whose id in ``ns`` is that one; NS_ANY, every row; one naming a namespace without ``ns``,
    or with k outside [1, KMAX], is refused (ERROR). ``pause`` stops it answering (a kernel
    that hangs); ``wrong_seq`` makes it echo the wrong sequence number; ``delay`` (s) holds each
    request that long before answering it (a turn of the rows, so that a request is still
    aboard when the host does something else); ``hold`` keeps every request it has taken
    aboard while set, answering each ``delay`` after it is cleared (so a test can see TAKEN
    however late its thread runs: a 5 ms window alone was missed on a loaded 2-core CI
    machine); ``short`` answers that many results at most (a kernel that loses rows)."""

    def __init__(self, slots: Slots, data: np.ndarray, ns: np.ndarray | None = None,
                 n_rows: int | None = None) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.slots, self.data, self.ns = slots, data, ns
        self.n_rows = len(data) if n_rows is None else n_rows
        self.stop = threading.Event()
        self.pause = threading.Event()
        self.hold = threading.Event()
        self.wrong_seq = False
        self.delay = 0.0
        self.short: int | None = None
        self.answered = 0

    def run(self) -> None:
        s = self.slots
        due: dict[int, float] = {}  # slot -> when its request (TAKEN) is answered
        while not self.stop.is_set():
            if self.pause.is_set():
                time.sleep(0.001)
                continue
            now = time.monotonic()
            for i in np.flatnonzero(s.words[:, 0] == REQUEST):
                s.words[i, 0] = TAKEN
                due[int(i)] = now + self.delay
            if self.hold.is_set():  # aboard until the hold ends, then `delay` more
                due = dict.fromkeys(due, now + self.delay)
                time.sleep(0.0001)
                continue
            for i in [i for i, t in due.items() if t <= now]:
                del due[i]
                w = s.words[i]
                k, want = int(w[1]), int(w[2].view(np.int32))
                if not 1 <= k <= carousel.KMAX or (want != NS_ANY and self.ns is None):
                    w[4], w[5] = 0, w[3]
                    w[0] = ERROR
                    continue
                sc = self.data[: self.n_rows] @ s.queries[i]
                if want != NS_ANY:
                    sc = np.where(self.ns[: self.n_rows] == want, sc, -np.inf)
                top = np.argsort(-sc, kind="stable")[:k]
                top = top[np.isfinite(sc[top])][: self.short]
                s.rows[i, :k] = -1
                s.scores[i, :k] = -np.inf
                s.rows[i, : len(top)] = top
                s.scores[i, : len(top)] = sc[top]
                w[4], w[5], w[6] = len(top), w[3] + self.wrong_seq, 1000
                self.answered += 1  # (before DONE, as a test reads the count once it sees the answer)
                w[0] = DONE
            time.sleep(0.0001)


class CarouselCpuIndex(CpuIndex):
    """A CPU index (inner product) with a carousel: a Conductor over its rows, started and
    stopped as GpuIndex does. Every other use of the "device" while the carousel runs fails,
    and so does a stop while it holds a request (a real stop abandons it). With
    ``carousel_map`` set (the server's, KALOS_CAROUSEL=direct) the slots are made in that map
    at the first start, and the direct clients' epoch, namespace words, stop and sweep follow
    GpuIndex's (sidecar/index_gpu.py)."""

    host_search = False  # (as a GPU index: no short path for lone recalls)
    carousel_k = carousel.KMAX

    def __init__(self, dim: int, metric: int) -> None:
        super().__init__(dim, metric)
        self.slots = Slots(FakeCupy(), carousel.MAX_SLOTS, dim)
        self.crowd = CrowdLane(self.slots)
        self.cond: Conductor | None = None
        self.log: list[str] = []
        self.launches = 0
        # a stop must find nothing aboard (the dispatcher drained it); False: quiesce first, as GpuIndex
        self.strict = True
        self.turn = 0.0  # the conductor's delay: how long a request stays aboard (s)

    def _device(self, what: str) -> None:
        assert not self.carousel_running, f"{what} while the carousel runs (it holds every SM)"
        self.log.append(what)

    direct_slots: DirectSlots | None = None  # (made at the first start with carousel_map, as GpuIndex's)

    @property
    def direct(self) -> int:
        return self.direct_slots.n if self.direct_slots is not None else 0

    @property
    def epoch(self) -> int:
        return self.direct_slots.epoch if self.direct_slots is not None else 0

    def start_carousel(self, high: int, ns: int = NS_ANY, eligible: int = 0) -> None:
        self._device(f"start {high}")
        if self.carousel_map is not None and not self.direct and not self.launches:
            self.slots.close()
            size = carousel.proto.CarouselLayout.of(self.dim).segment_size()
            self.slots = Slots(FakeCupy(), carousel.MAX_SLOTS, self.dim, self.carousel_map(size))
            assert self.on_carousel is not None  # (the server's: set before it serves)
            self.direct_slots = DirectSlots(self.slots.words, self.carousel_direct, self.on_carousel)
            self.crowd = CrowdLane(self.slots, first=self.direct)
        if self.direct_slots is not None:
            self.direct_slots.launch(ns, eligible)
        self.launches += 1
        self.cond = Conductor(self.slots, self.data, self.ns, n_rows=high)
        self.cond.delay = self.turn
        self.cond.start()
        self.carousel_running = True
        if self.direct_slots is not None:
            self.direct_slots.publish(1)

    def stop_carousel(self) -> None:
        if not self.carousel_running:
            return
        if self.direct_slots is not None:
            self.direct_slots.publish(2)
            self.crowd.settle_direct(0.05)
        if not self.strict:
            self.crowd.quiesce(1.0)  # (as GpuIndex: a stop from the index's side abandons nothing)
        assert not self.crowd.busy(), "the carousel stopped with requests aboard"
        assert self.cond is not None
        self.cond.stop.set()
        self.cond.join()
        self.carousel_running = False
        self.log.append("stop")
        if self.direct_slots is not None:
            self.sweep_carousel()
            self.direct_slots.publish(3)

    def sweep_carousel(self) -> int:
        if self.direct_slots is None or self.carousel_running:
            return 0
        return self.direct_slots.sweep()

    @property
    def carousel_answered(self) -> int:
        return self.cond.answered if self.cond is not None else 0

    def carousel_active(self) -> int:  # (as GpuIndex's)
        return self.direct_slots.active() if self.direct_slots is not None else 0

    def pause_doorbell(self) -> None:
        self.stop_carousel()

    def search(self, *a: Any, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        self._device("search")
        return super().search(*a, **kw)

    def set_rows(self, *a: Any) -> None:
        self._device("write")
        super().set_rows(*a)

    def clear_rows(self, rows: np.ndarray) -> None:
        self._device("delete")
        super().clear_rows(rows)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "carousel_running": self.carousel_running,
                "carousel_boarded": self.crowd.boarded, "carousel_launches": self.launches}  # fmt: skip

    def close(self) -> None:
        if self.cond is not None:
            self.cond.stop.set()
            self.cond.join()
        with contextlib.suppress(BufferError):
            self.slots.close()

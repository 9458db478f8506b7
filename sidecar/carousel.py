"""The carousel: a resident scan that queries board wherever it is.

A GPU sidecar with float16 rows runs it while a crowd recalls (``KALOS_CAROUSEL``: ``direct``, the
default since session 40, the clients write into its slots; ``1``, sidecar/crowd.py is its lane;
``0``, off). ``benchmarks/carousel_probe.py`` measures it in process and ``tests/gpu/test_carousel.py``
checks its answers; docs/gpu-notes.md (sessions 34-36) says why it exists and how it measured.

Why: with 32 client processes at 1M rows, the sidecar's queued batches settle into two cohorts,
and each cohort pays a whole pass over the rows. A client answered at the end of one pass
cannot be in the next one, which was launched behind it, so every recall costs two passes
(~2 x 385 µs on the H200). 32 clients then cannot pass ~41.5k recalls/s; the table measured
36.6k. In the carousel the rows are read round and round by a resident grid, and a query
boards wherever the scan is. It is answered one full turn later, so a client's cycle is one
turn plus its own way back. ``carousel_topk`` in kernels/recall.cu describes the kernel: its
conductor block, its scanning blocks, the per-block lists and the memory order.

Here: :class:`Slots`, request slots in host memory registered with the device (mapped) in the
kernel's own small layout (not the sidecar's protocol slots: sidecar/crowd.py copies each
query in), and :class:`Carousel`, which compiles, sizes and launches the kernel over float16
rows already on the device, and stops it.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import numpy as np

from kalos_retrievers import protocol as proto

# slot words (u32): [0] state [1] k [2] namespace [3] seq; out: [4] results [5] seq [6] ns aboard;
# [7] the namespace's rows (direct slots; the kernel does not read it)
from kalos_retrievers.protocol import W_K, W_NS, W_NS_ABOARD, W_RESP_SEQ, W_RESULTS, W_SEQ, W_STATE

from . import cuda_kernels as kernels
from .index import NS_ANY

# The slots' states, words and layout are protocol v1.4's (kalos_retrievers/protocol.py): with
# KALOS_CAROUSEL=direct the clients write these slots themselves.
IDLE: Final = proto.CAR_IDLE
REQUEST: Final = proto.CAR_REQUEST  # written by the client, after everything else
TAKEN: Final = proto.CAR_TAKEN  # the conductor has the request
DONE: Final = proto.CAR_DONE  # answered: results and words are in
# refused: k outside [1, KMAX], a query not finite (or beyond float16 for ip / L2), a namespace without ns
ERROR: Final = proto.CAR_ERROR

KMAX: Final = proto.CAR_KMAX  # CAR_KMAX in recall.cu: the largest k
HEAD: Final = proto.CAR_HEAD  # CAR_HEAD_BYTES: the slot's words before the query
PINFO: Final = 8  # CAR_PINFO: ints per position in pinfo
POSITIONS: Final = 32  # 8 * NT for the instantiation used (NT = 4)
MAX_SLOTS: Final = proto.CAR_MAX_SLOTS  # the conductor polls up to 64 slots (two per lane of a warp)
NT: Final = 4  # carousel_topk<NT>: 8 * NT positions
_STEP_ROWS: Final = kernels.BLOCK // 32 * 32  # CAR_STEP_ROWS
_CAP: Final = 2 * _STEP_ROWS + KMAX  # CAR_CAP: a block's list per position (u64 each)
_HOST_MODE: Final = 3  # BELL_LDCV | BELL_STWT: host memory as the resident kernel touches it (its FENCE bit is its own)


class Slots:
    """``n`` request slots for queries of ``dim`` floats, in anonymous shared memory (or ``mm``,
    a map of the carousel's shared segment: KALOS_CAROUSEL=direct, whose clients write their
    own requests) registered with the device (mapped), so the kernel reads and writes them in
    place. The layout is protocol v1.4's :class:`~kalos_retrievers.protocol.CarouselLayout`.

    A client writes its query, k, namespace and seq, then the state word REQUEST
    (:meth:`send`); the kernel sets TAKEN, then DONE (or ERROR) after the results. x86-64
    keeps a thread's stores in order, so the state word, written last, is seen last.
    """

    def __init__(self, cp: Any, n: int, dim: int, mm: mmap.mmap | None = None) -> None:
        if not 1 <= n <= MAX_SLOTS:
            raise ValueError(f"slots: 1 to {MAX_SLOTS}, not {n}")
        lay = proto.CarouselLayout.of(dim)
        self.cp = cp
        self.n, self.dim = n, dim
        self.rows_off, self.scores_off, self.slot_bytes = lay.rows_off, lay.scores_off, lay.slot_bytes
        if mm is None:
            mm = mmap.mmap(-1, lay.segment_size(n))
        elif len(mm) < n * self.slot_bytes:
            raise ValueError(f"a map of {len(mm)} bytes cannot hold {n} slots of {self.slot_bytes}")
        self._mm = mm  # (with KALOS_CAROUSEL=direct, the shared segment the clients map too)
        self.buf = np.frombuffer(self._mm, np.uint8)
        self.addr = self.buf.ctypes.data
        cp.cuda.runtime.hostRegister(self.addr, len(self._mm), 3)  # portable | mapped
        self._registered = True
        stride = self.slot_bytes // 4

        def view(dtype: Any, off: int, count: int) -> np.ndarray:  # [n, count] at byte off of each slot
            return np.frombuffer(self._mm, dtype, n * stride).reshape(n, stride)[:, off // 4 : off // 4 + count]

        self.words = np.frombuffer(self._mm, np.uint32, n * stride).reshape(n, stride)
        self.queries = view(np.float32, HEAD, dim)
        self.rows = view(np.int32, self.rows_off, KMAX)
        self.scores = view(np.float32, self.scores_off, KMAX)

    def send(self, i: int, query: np.ndarray, k: int, ns: int = NS_ANY, seq: int = 0, poison: bool = True) -> None:
        """Ask slot ``i``'s question (the slot must not hold a request in flight). With
        ``poison`` the results area is poisoned first, so an element the kernel did not write
        shows (the tests'; the sidecar's lane checks the count the kernel writes instead)."""
        if self.words[i, W_STATE] in (REQUEST, TAKEN):
            raise RuntimeError(f"slot {i} still has a request in flight")
        if poison:
            self.rows[i] = -7
            self.scores[i] = np.nan
        self.queries[i] = query
        w = self.words[i]
        w[W_K] = k
        w[W_NS] = np.int32(ns).view(np.uint32)
        w[W_SEQ] = seq & 0xFFFFFFFF
        w[W_RESULTS] = 0xFFFFFFFF
        w[W_STATE] = REQUEST  # last

    def state(self, i: int) -> int:
        return int(self.words[i, W_STATE])

    def result(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot ``i``'s answer (state DONE): rows and scores, best first, the whole k written
        (past the results: -1 and -inf)."""
        k = int(self.words[i, W_K])
        return self.rows[i, :k].copy(), self.scores[i, :k].copy()

    def close(self) -> None:
        if self._registered:
            self.cp.cuda.runtime.hostUnregister(self.addr)
            self._registered = False
        del self.words, self.queries, self.rows, self.scores, self.buf
        with contextlib.suppress(BufferError):  # a caller still holds a view: the map goes with the last one
            self._mm.close()


class Carousel:
    """``carousel_topk`` over float16 rows ``data`` (a CuPy array [n_rows, ld], ld a multiple
    of 8 with zeros past ``dim``), answering the requests written into ``slots``.

    ``ns``: the rows' namespace ids (int32 on the device) for requests that name one; None when
    every request asks NS_ANY. ``sqnorm``: the rows' squared norms (float32), for ``metric`` 2
    (L2). The grid is every block the device can hold at once (all must be resident: the
    blocks wait on each other), at most ``per_sm`` per SM and ``max_blocks`` in all (tests: few
    blocks make long turns, whose lists are cut many times); block 0 is the conductor.
    ``n_rows``: scan only the first ``n_rows`` rows of ``data`` (all by default; a GPU index's
    rows in use, below its capacity). :meth:`retarget` points a stopped carousel at other rows.
    """

    def __init__(self, cp: Any, data: Any, dim: int, metric: int, slots: Slots, *, ns: Any = None,
                 sqnorm: Any = None, per_sm: int = 2, max_blocks: int | None = None,
                 stream: Any = None, n_rows: int | None = None) -> None:  # fmt: skip
        if slots.dim != dim:
            raise ValueError(f"slots hold {slots.dim}-d queries, not {dim}")
        self.cp, self.dim, self.metric, self.slots = cp, dim, metric, slots
        self.running = False
        self.retarget(data, n_rows, ns, sqnorm)
        self.lds = self.ld + (32 - self.ld % 64) % 64  # mma_filter's padded stride
        name = kernels.expression("carousel_topk", NT, metric)
        kernels.compile_kernels([name])
        self.kernel = kern = kernels.get_kernel("carousel_topk", NT, metric)
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        sms = int(props["multiProcessorCount"])
        from .index_gpu import SmLimits, resident_blocks_per_sm

        limits = SmLimits(int(props.get("regsPerMultiprocessor", 65536)),
                          int(props.get("sharedMemPerMultiprocessor", 48 * 1024)),
                          int(props.get("maxThreadsPerMultiProcessor", 1024)),
                          int(props.get("reservedSharedMemPerBlock", 1024)))  # fmt: skip
        regs = int(getattr(kern, "num_regs", 0) or 255)
        static = int(getattr(kern, "shared_size_bytes", 0) or 8192)
        # the scanning blocks' queries (the conductor stages a boarding query in half as much)
        self.smem = POSITIONS * self.lds * 2
        # (the default allows 48 KB less the static shared memory: compared with 48 KB, a dynamic
        # size just under it would not be raised, and the launch would fail)
        kern.max_dynamic_shared_size_bytes = max(kern.max_dynamic_shared_size_bytes, self.smem)
        fit = resident_blocks_per_sm(per_sm, regs, kernels.BLOCK, self.smem, static, limits)
        if fit < 1:
            raise RuntimeError(f"carousel_topk does not fit on an SM ({regs} registers, {self.smem + static} bytes)")
        self.grid = fit * sms if max_blocks is None else min(fit * sms, max_blocks)
        if self.grid < 2:
            raise ValueError(f"the carousel needs a conductor and a scanning block, not a grid of {self.grid}")
        self.scanners = self.grid - 1
        self.stream = stream or cp.cuda.Stream(non_blocking=True)
        with self.stream:
            self.dctl = cp.zeros(2 + 2 * POSITIONS, cp.uint32)
            self.pinfo = cp.zeros(PINFO * POSITIONS, cp.int32)
            self.pos_q = cp.zeros(POSITIONS * self.ld, cp.float16)
            self.lists = cp.zeros(self.scanners * POSITIONS * _CAP, cp.uint64)
            self.res = cp.zeros(POSITIONS * self.scanners * KMAX, cp.uint64)
        self._hmm = mmap.mmap(-1, mmap.PAGESIZE)
        self.hctl = np.frombuffer(self._hmm, np.uint32)
        self._haddr = self.hctl.ctypes.data
        cp.cuda.runtime.hostRegister(self._haddr, mmap.PAGESIZE, 3)

    def retarget(self, data: Any, n_rows: int | None = None, ns: Any = None, sqnorm: Any = None) -> None:
        """Scan the first ``n_rows`` (all by default) of ``data`` from the next :meth:`start`
        (float16 [rows, ld], ld a multiple of 8 and at least dim, the same ld as before), with
        the rows' namespace ids ``ns`` and squared norms ``sqnorm`` (as in the constructor).

        Raises:
            RuntimeError: the carousel is running.
            ValueError: rows it cannot scan.
        """
        cp = self.cp
        if self.running:
            raise RuntimeError("the carousel is running: stop() it before pointing it at other rows")
        if data.dtype != cp.float16 or data.ndim != 2 or data.shape[1] % 8 or data.shape[1] < self.dim:
            raise ValueError("data must be float16 [n_rows, ld] with ld a multiple of 8 and at least dim")
        if getattr(self, "ld", data.shape[1]) != data.shape[1]:
            raise ValueError(f"data's rows are {data.shape[1]} wide, not {self.ld}")
        n = int(data.shape[0]) if n_rows is None else int(n_rows)
        if not 0 <= n <= data.shape[0]:
            raise ValueError(f"n_rows must be within the {data.shape[0]} rows of data, not {n_rows}")
        if self.metric == 2 and sqnorm is None:
            raise ValueError("the L2 metric needs the rows' squared norms (sqnorm)")
        self.data, self.n_rows, self.ld = data, n, int(data.shape[1])
        self.ns, self.sqnorm = ns, sqnorm

    def args(self) -> tuple[Any, ...]:
        """The kernel's arguments, in carousel_topk's order (tests/unit/test_carousel.py checks
        them against the kernel's parameter list in recall.cu)."""
        s = self.slots
        return (self.data, np.int32(self.ld), np.int32(self.lds), np.int32(self.n_rows),
                self.ns if self.ns is not None else np.uint64(0),
                self.sqnorm if self.sqnorm is not None else np.uint64(0), np.int32(self.dim),
                np.uint64(s.addr), np.int32(s.slot_bytes), np.int32(s.n), np.int32(s.rows_off),
                np.int32(s.scores_off), np.int32(_HOST_MODE), np.uint64(self._haddr), self.dctl,
                self.pinfo, self.pos_q, self.lists, self.res)  # fmt: skip

    def start(self, timeout: float = 5.0) -> None:
        """Launch the kernel (it runs until :meth:`stop`) behind the work queued so far on the
        current stream (the rows' and namespaces' copies), and wait until every scanning block
        has started: a block that is not resident would never finish a turn.

        Raises:
            RuntimeError: not every block started within ``timeout`` s (the kernel is stopped).
        """
        if self.running:
            raise RuntimeError("the carousel is running already: stop() it first")
        cp = self.cp
        self.hctl[:] = 0
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with self.stream:
            self.dctl.fill(0)
            self.kernel((self.grid,), (kernels.BLOCK,), self.args(), shared_mem=self.smem)
        self.running = True
        end = time.monotonic() + timeout
        while int(self.hctl[4]) != self.scanners:
            if time.monotonic() > end:
                started = int(self.hctl[4])
                self.stop()
                raise RuntimeError(f"only {started} of the carousel's {self.scanners} scanning blocks started: "
                                   "they must all be resident at once")  # fmt: skip
            time.sleep(0.0001)

    @property
    def answered(self) -> int:
        """Answers since the launch (counted by the conductor as it frees their positions, a few
        µs after each answer's state)."""
        return int(self.hctl[2:4].view(np.uint64)[0])

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the kernel to stop and wait for it, at most ``timeout`` s (requests still aboard
        are abandoned: their slots stay TAKEN).

        Raises:
            TimeoutError: the kernel did not return: the device is stuck with it, and only the
                process's exit frees it.
        """
        if not self.running:
            return
        self.hctl[0] = 1
        end = time.monotonic() + timeout
        while not self.stream.done:
            if time.monotonic() > end:
                raise TimeoutError(f"carousel_topk did not stop within {timeout} s")
            time.sleep(0.0005)
        self.stream.synchronize()  # (raises the kernel's error, if it had one)
        self.running = False

    def close(self) -> None:
        self.stop()
        if self._haddr:
            self.cp.cuda.runtime.hostUnregister(self._haddr)
            self._haddr = 0
            del self.hctl
            self._hmm.close()


class Answer(NamedTuple):
    """One request's outcome (:func:`drive`)."""

    j: int  # the request's number
    slot: int  # the slot (client) that sent it
    state: int  # DONE or ERROR
    sent_ns: int  # perf_counter_ns at its send
    seen_ns: int  # perf_counter_ns when the driver saw the answer
    aboard_ns: int  # the kernel's time from boarding to answer (GPU clock)
    n: int  # results
    rows: np.ndarray | None  # all k (None unless kept)
    scores: np.ndarray | None


def drive(slots: Slots, next_request: Callable[[int], tuple[np.ndarray, int, int] | None], *,
          clients: int | None = None, until: float | None = None, return_ns: int = 0, timeout: float = 30.0,
          keep: Callable[[int], bool] = lambda j: True) -> list[Answer]:  # fmt: skip
    """Clients in one thread: each slot (the first ``clients``; all by default) is a client that
    sends request j = 0, 1, 2, ...
    (``next_request(j)``: query, k, namespace; None: no more) and, ``return_ns`` after each
    answer, the next one. Ends when the requests are done (or ``until``, a perf_counter time,
    has passed: no more sends) and every request sent has its answer.

    Raises:
        TimeoutError: a request had no answer ``timeout`` s after its send.
    """
    n = slots.n if clients is None else clients
    if not 1 <= n <= slots.n:
        raise ValueError(f"clients: 1 to {slots.n}, not {clients}")
    sent = np.zeros(n, np.int64)
    due = np.zeros(n, np.int64)
    job = np.full(n, -1, np.int64)
    words = slots.words[:n]
    out: list[Answer] = []
    j = 0
    more = True
    limit = int(timeout * 1e9)
    while True:
        now = time.perf_counter_ns()
        inflight = job >= 0
        st = words[:, W_STATE]
        for i in np.flatnonzero(inflight & ((st == DONE) | (st == ERROR))):
            w = words[i]
            if int(w[W_RESP_SEQ]) != int(job[i]) & 0xFFFFFFFF:
                raise RuntimeError(f"slot {i}: an answer for request {int(w[W_RESP_SEQ])}, not {int(job[i])}")
            r = s = None
            if keep(int(job[i])):
                r, s = slots.result(i)
            out.append(Answer(int(job[i]), int(i), int(w[W_STATE]), int(sent[i]), now, int(w[W_NS_ABOARD]),
                              int(w[W_RESULTS]), r, s))  # fmt: skip
            job[i] = -1
            due[i] = now + return_ns
        if until is not None and time.perf_counter() >= until:
            more = False
        idle = job < 0
        if more:
            for i in np.flatnonzero(idle & (due <= now)):
                req = next_request(j)
                if req is None:
                    more = False
                    break
                q, k, ns = req
                slots.send(int(i), q, k, ns, seq=j)
                sent[i] = time.perf_counter_ns()
                job[i] = j
                j += 1
        elif idle.all():
            return out
        late = (job >= 0) & (now - sent > limit)
        if late.any():
            raise TimeoutError(f"requests {sorted(job[late].tolist())} had no answer within {timeout} s "
                               f"({len(out)} answered)")  # fmt: skip

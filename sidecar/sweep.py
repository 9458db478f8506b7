"""The sweep: float16 batches that join a running scan of the rows at chunk boundaries.

Why (issue 3, 32 client processes at 1M rows). A batch queued behind the one the device is
searching (``GpuIndex.queues_behind``) starts its pass when that pass ends, so a client that
comes back while a pass runs waits for the rest of that pass and then a whole pass of its own:
two passes (~2 x 405 µs at 16 queries) per round trip however fast it is. 32 clients then make
at most 32 / 810 µs = 39.5k recalls/s (measured: 35.6k).

The sweep splits the rows into ``chunks`` ranges and keeps scanning them in turn, one pass
(``mma_filter`` over one range) for every query in its pool at once. A batch joins at the next
range not yet launched and leaves once it has scanned every range: one scan's worth of passes
after it joined, wherever that was. A returning client then waits for the next range (a
fraction of a pass) instead of a whole pass, and the rows are still read once for all the
queries in the pool. The answer is the same as a whole pass: each query's threshold comes from
a sample of rows (``tau_scores``, as the mma path), each range appends the rows at or above it
to the query's candidate list, and the list's top-k is selected after the last range.

Pieces (``Sweep`` holds the device side, the rest is pure and tested on the CPU):

* ``Positions``: which pool positions each batch holds (contiguous, lowest first: a pass
  costs more with every 8 positions it covers).
* ``Plan``: the order of the ranges, which batches join the next pass and which leave after
  it.
* ``Sweep``: the device buffers (the pool's queries, thresholds and candidate lists; each
  batch's own parameters, descriptor and sample), and the launches: a batch's prep, sample and
  thresholds on a side stream as it joins (its thresholds held aside, and entered into the
  pool by ``sweep_enter`` on the index's stream just before its first pass: a pass already
  running must not see them mid-range), each pass on the index's stream, and after a batch's
  last pass its thresholds set to NaN (no score reaches NaN: no later pass appends for it)
  and its selection on a second side stream. A free position holds a NaN threshold too.

Opt-in (``KALOS_SWEEP=1``) until measured on the GPU.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from . import cuda_kernels as kernels
from .index import FatalDeviceError
from .index_gpu import _MMA_NT, _PARAMS_SIZE, CAND_CAP, SELECT_GATHER, SIDE_RESERVE, TAU_SAMPLE_MAX

POOL: Final = 64  # query positions (KALOS_MAXQ: a Params holds that many per query)
LANES: Final = 8  # batches in the sweep at once
IN_FLIGHT: Final = 2  # passes on the index's stream at once: one running, one queued
ROW_ALIGN: Final = 32  # a range's rows start at a multiple of this (two m16 tiles)
_PARAMS_NS: Final = 12  # byte offsets in struct Params (kernels/recall.cu): ns_id
_PARAMS_QNORM2: Final = 32 + 16 * POOL  # qnorm2[], after the head and out_rows/out_scores
_DESC_STRIDE: Final = 2048  # each lane's descriptor in the sweep's registered page
_OVERFLOW_AT: Final = LANES * _DESC_STRIDE  # the lanes' overflow flags, 4 bytes each


def _env_int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    """``env[name]`` as an integer from ``lo`` to ``hi``; ``default`` when unset or blank.

    Raises:
        ValueError: anything else (named, with the range).
    """
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = lo - 1
    if not lo <= n <= hi:
        raise ValueError(f"{name}={raw!r}: expected an integer from {lo} to {hi}")
    return n


def sweep_chunks(env: Mapping[str, str]) -> int:
    """``KALOS_SWEEP_CHUNKS``: ranges per scan (default 4). More ranges: a returning batch waits
    less for the next one, and each pass pays its launch and its tail once more."""
    return _env_int(env, "KALOS_SWEEP_CHUNKS", 4, 1, 64)


def sweep_lead_us(env: Mapping[str, str]) -> int:
    """``KALOS_SWEEP_LEAD_US``: how long before the running pass is expected to end the next
    is launched (default 0: as soon as fewer than two are on the stream, a whole pass ahead).
    See ``Sweep.pump``."""
    return _env_int(env, "KALOS_SWEEP_LEAD_US", 0, 0, 10_000)


def chunk_bounds(high: int, chunks: int) -> list[tuple[int, int]]:
    """The row ranges one scan of rows [0, ``high``) takes, in order: ``chunks`` of them (fewer
    when ``high`` is small), each starting at a multiple of ``ROW_ALIGN``, none empty."""
    if high <= 0:
        return []
    step = -(-high // chunks)
    step = -(-step // ROW_ALIGN) * ROW_ALIGN
    return [(r, min(r + step, high)) for r in range(0, high, step)]


class Positions:
    """Contiguous ranges of ``size`` pool positions, each taken at the lowest place it fits."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._used: dict[int, int] = {}  # start -> count

    def take(self, n: int) -> int | None:
        """The start of ``n`` free positions, now taken; None when no gap holds them."""
        if not 1 <= n <= self.size:
            raise ValueError(f"n={n} must be from 1 to {self.size}")
        at = 0
        for start in sorted(self._used):
            if start - at >= n:
                break
            at = start + self._used[start]
        if self.size - at < n:
            return None
        self._used[at] = n
        return at

    def give(self, start: int) -> None:
        """Free the range taken at ``start``."""
        if self._used.pop(start, None) is None:
            raise ValueError(f"no range taken at {start}")

    @property
    def high(self) -> int:
        """One past the highest position taken (0 when none is): what a pass must cover."""
        return max((s + n for s, n in self._used.items()), default=0)

    @property
    def free(self) -> int:
        return self.size - sum(self._used.values())


class Member:
    """A batch in the sweep: ``n`` queries at pool positions [``start``, ``start + n``),
    ``left`` ranges still to scan (all of them until its first pass), ``lane`` (its
    parameters and descriptor), ``token`` (the caller's)."""

    __slots__ = ("first", "joined", "k", "lane", "left", "n", "start", "token")

    def __init__(self, token: Any, start: int, n: int, k: int, lane: int) -> None:
        self.token, self.start, self.n, self.k, self.lane = token, start, n, k, lane
        self.left = 0
        self.joined = False
        self.first = -1  # the range it joined at (tests)


class Plan:
    """The order of a sweep's ranges and who scans which: pure bookkeeping.

    ``add`` a member; ``next_pass`` says which range the next pass scans, the members that
    join with it (added since the last pass) and the members whose last range it is. Every
    member scans each of the ``chunks`` ranges exactly once, in order from the one it joined
    at, wrapping around."""

    def __init__(self, chunks: int) -> None:
        if chunks < 1:
            raise ValueError(f"chunks={chunks} must be >= 1")
        self.chunks = chunks
        self.cursor = 0  # the range the next pass scans
        self.members: list[Member] = []

    def add(self, m: Member) -> None:
        m.left, m.joined = self.chunks, False
        self.members.append(m)

    def peek(self, ready: Callable[[Member], bool] | None = None) -> tuple[int, list[Member], list[Member]]:
        """(range, joining, leaving) of the next pass, the plan unchanged (``advance`` with it
        once the pass is launched: a launch that fails leaves the plan as it was). A member
        added since the last pass joins if ``ready`` says so (default: all do); one that does
        not waits for a later pass."""
        joining = [m for m in self.members if not m.joined and (ready is None or ready(m))]
        leaving = [m for m in self.members if (m.joined or m in joining) and m.left == 1]
        return self.cursor, joining, leaving

    def advance(self, step: tuple[int, list[Member], list[Member]]) -> tuple[int, list[Member], list[Member]]:
        """Move past the pass ``peek`` described (``step``); returns it."""
        c, joining, leaving = step
        assert c == self.cursor
        self.cursor = (c + 1) % self.chunks
        for m in joining:
            m.joined, m.first = True, c
        for m in self.members:
            if m.joined:
                m.left -= 1
        if leaving:
            self.members = [m for m in self.members if m.left]
        return step

    def next_pass(self, ready: Callable[[Member], bool] | None = None) -> tuple[int, list[Member], list[Member]]:
        """``advance(peek(ready))``: the next pass, and the plan past it."""
        return self.advance(self.peek(ready))

    def scanning(self, ready: Callable[[Member], bool] | None = None) -> bool:
        """Whether the next pass would scan for anyone (a member joined, or one ready to)."""
        return any(m.joined or ready is None or ready(m) for m in self.members)

    def restart(self) -> None:
        """Back to range 0 (the sweep is empty: a new scan may have other bounds)."""
        if self.members:
            raise RuntimeError("restart with members in the sweep")
        self.cursor = 0


class Sweep:
    """The device side of the sweep, for one ``GpuIndex`` (float16 rows, a registered segment).

    The caller (the dispatcher) ``join``s batches, calls ``pump`` often (every ~50 µs while
    the sweep is busy: it launches the next pass when fewer than ``IN_FLIGHT`` are on the
    stream) and takes the batches that are answered from ``finished``. Before rows change it
    ``settle``s. One thread only."""

    def __init__(self, idx: Any, chunks: int, lead_us: int = 0) -> None:
        cp = idx.cp
        self.idx, self.cp = idx, cp
        self.plan = Plan(chunks)
        self.positions = Positions(POOL)
        self.high = -1  # the rows the sweep scans (fixed while it has members)
        self.ns = 0
        self.bounds: list[tuple[int, int]] = []
        self._lanes_free = list(range(LANES - 1, -1, -1))
        self._passes: deque[tuple[Any, Any]] = deque()  # (start, end) events of the passes on the stream
        self._leaving: deque[tuple[Member, Any]] = deque()  # (member, its selection's end)
        self._answered: list[tuple[Any, Exception | None]] = []  # settled, not yet taken by finished()
        self.lead_ns = 1000 * lead_us
        self.pass_us = 0.0  # the passes' mean duration on the device (an average over the last ~8)
        self._since = 0  # when the pass now running started (about)
        self.passes = 0
        self.positions_sum = 0  # positions the passes covered (their mean: what they cost)
        self.batches = 0
        self.overflows = 0
        ld, cap = idx.ld, CAND_CAP
        self.chunks = chunks
        with idx.device:
            self.qbuf_h = cp.zeros((POOL, ld), cp.float16)
            self.tau = cp.full(POOL, np.nan, cp.float32)  # NaN: a free position (no score reaches it)
            self.cand_k = cp.empty(POOL * cap, cp.float32)
            self.cand_v = cp.empty(POOL * cap, cp.int32)
            self.cand_count = cp.zeros(POOL, cp.int32)
            self.params = cp.zeros(_PARAMS_SIZE, cp.uint8)  # the passes' (ns, qnorm2 per position)
            self.off = cp.full(POOL, np.nan, cp.float32)
            self.sample = cp.empty(POOL * TAU_SAMPLE_MAX, cp.float32)
            self.lane_params = [cp.zeros(_PARAMS_SIZE, cp.uint8) for _ in range(LANES)]
            self.lane_qbuf = cp.zeros((POOL, ld), cp.float32)  # prep's float32 copy (unused here)
            self.lane_qbuf_i8 = cp.zeros((POOL, ld), cp.int8)
            self.lane_tau = cp.zeros(LANES * POOL, cp.float32)  # each lane's thresholds, held aside
            # the fills ran on the current stream (the legacy one here), which the index's
            # non-blocking streams do not wait for (cand_count must read 0 and tau NaN at the
            # first pass); not the whole device: a resident kernel never ends on its own
            cp.cuda.get_current_stream().synchronize()
            # the joining batches' front work and the leaving batches' selections on streams
            # of their own: a front queued behind a selection would wait for the pass that
            # selection waits for, and the next pass for that front
            self.side = cp.cuda.Stream(non_blocking=True, priority=-5)
            self.side_sel = cp.cuda.Stream(non_blocking=True, priority=-5)
            ev = lambda: cp.cuda.Event(block=False, disable_timing=True)  # noqa: E731
            self._front = [ev() for _ in range(LANES)]
            self._done = [ev() for _ in range(LANES)]
        self._page = mmap.mmap(-1, _OVERFLOW_AT + 4096)
        self._page_np = np.frombuffer(self._page, np.uint8)
        self.page_addr = self._page_np.ctypes.data
        idx._check(lambda: cp.cuda.runtime.hostRegister(self.page_addr, len(self._page), 3))
        self._overflow = np.frombuffer(self._page, np.int32, LANES, _OVERFLOW_AT)

    # -- what the caller asks ------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether any batch is in the sweep (joined, scanning or being selected)."""
        return bool(self.plan.members or self._leaving)

    @property
    def pending(self) -> bool:
        """Whether batches are in the sweep, or answered and not yet taken by ``finished``."""
        return self.busy or bool(self._answered)

    def can_join(self, n: int, k: int, high: int, ns: int) -> bool:
        """Whether ``join`` would take ``n`` queries (``k`` results, rows below ``high``,
        namespace ``ns``) now: room in the pool and a free lane, the same rows and namespace as
        the batches in the sweep, a threshold sample that fits, and the queries in shared
        memory."""
        idx = self.idx
        if not self._lanes_free or not 1 <= n <= POOL or high <= 0:
            return False
        if self.busy and (high != self.high or ns != self.ns):
            return False
        if idx._tau_sample(k, high) is None or not idx._mma_smem_ok(POOL):
            return False
        at = self.positions.take(n)
        if at is None:
            return False
        self.positions.give(at)
        return True

    def join(self, specs: list[Any], k: int, high: int, ns: int, token: Any) -> None:
        """Launch the batch's prep, sample and thresholds on the side stream; it joins the
        next pass ``pump`` launches. ``can_join`` must have said yes."""
        idx = self.idx
        qs, rows, scores, out_ld = idx._addresses(specs)
        n = len(qs)
        if not self.busy:
            self._start(high, ns)
        start = self.positions.take(n)
        if start is None or not self._lanes_free:
            raise RuntimeError("Sweep.join without room (ask can_join first)")
        lane = self._lanes_free.pop()
        m = Member(token, start, n, k, lane)
        off = lane * _DESC_STRIDE
        idx._write_desc(k, high, ns, 0, qs, rows, scores, out_ld, off, page=self._page)
        self._overflow[lane] = 0
        side = self.side

        def launch() -> None:
            launches = self._front_launches(m, high)
            with idx.device:
                with side:
                    for fn in launches:
                        fn()
                self._front[lane].record(side)

        try:
            idx._check(launch)
        except BaseException:  # nothing joined: the positions and the lane are free again
            self.positions.give(start)
            self._lanes_free.append(lane)
            raise
        self.plan.add(m)
        self.batches += 1

    def pump(self) -> int:
        """Launch the next pass when it is due; return how many were launched (0 or 1, or 2
        when the stream was empty).

        With ``lead_us`` 0: whenever fewer than ``IN_FLIGHT`` passes are on the stream, so the
        next is queued a whole pass ahead, with every batch that joined by then (its front
        work may still be running: the pass waits for it). With a lead: the next pass is
        launched only ``lead_us`` before the running one is expected to end (the passes'
        measured mean), with the batches whose front work is done by then: a batch that
        comes during a pass joins the next one instead of the one after."""
        q = self._passes
        now = time.perf_counter_ns()
        while q and q[0][1].done:
            t0, t1 = q.popleft()
            ms = self.cp.cuda.get_elapsed_time(t0, t1)
            self.pass_us += (1000 * ms - self.pass_us) / 8 if self.pass_us else 1000 * ms
            if q:
                self._since = now  # the next one runs from (about) now
        launched = 0
        ready = self._front_done if self.lead_ns else None
        while len(q) < IN_FLIGHT and self.plan.scanning(ready):
            if q and self.lead_ns and now < self._since + int(1000 * self.pass_us) - self.lead_ns:
                break  # not due yet
            if not q:
                self._since = now
            self.idx._check(lambda: self._launch_pass(ready))
            launched += 1
        return launched

    def _front_done(self, m: Member) -> bool:
        return bool(self._front[m.lane].done)

    def finished(self) -> list[tuple[Any, Exception | None]]:
        """(token, None) for each batch whose answers are written since the last call (in the
        order they left), (token, error) for one that could not be answered; their positions
        and lanes are free again. A batch whose candidate list overflowed is answered here by
        the exact path first."""
        out, self._answered = self._answered, []
        try:
            while self._leaving and self._leaving[0][1].done:
                m, _ = self._leaving.popleft()
                out.append((m.token, self._release(m)))
        except BaseException:  # (a fatal device error) nothing collected is dropped
            self._answered = out + self._answered
            raise
        return out

    def settle(self) -> None:
        """Scan until every batch in the sweep is answered (``finished`` then returns them):
        before rows change, or another kind of search uses the device."""
        while self.plan.members:
            if not self.pump() and self._passes:
                self.idx._check(self._passes[0][1].synchronize)
            elif not self._passes:  # (nothing due: the fronts are still running)
                self.idx._check(self._front[self.plan.members[-1].lane].synchronize)
        while self._leaving:
            m, end = self._leaving[0]
            self.idx._check(end.synchronize)
            self._leaving.popleft()
            self._answered.append((m.token, self._release(m)))
        self._passes.clear()

    def close(self) -> None:
        with self.idx.device:
            self.idx.device.synchronize()
        with contextlib.suppress(Exception):  # the context may be gone
            self.cp.cuda.runtime.hostUnregister(self.page_addr)

    def describe(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "lead_us": self.lead_ns // 1000, "pass_us": round(self.pass_us, 1),
                "batches": self.batches, "passes": self.passes,
                "positions_mean": round(self.positions_sum / max(1, self.passes), 2),
                "overflows": self.overflows, "in_sweep": len(self.plan.members) + len(self._leaving)}  # fmt: skip

    # -- the launches --------------------------------------------------------------------------

    def _start(self, high: int, ns: int) -> None:
        """A new scan: its rows, namespace and ranges (the sweep is empty)."""
        self.plan.restart()
        self.high, self.ns = high, ns
        self.bounds = chunk_bounds(high, self.chunks)
        self.plan.chunks = len(self.bounds)
        idx = self.idx
        with idx.device, idx.stream:
            self.params[_PARAMS_NS : _PARAMS_NS + 4] = self.cp.asarray(np.array([ns], np.int32).view(np.uint8))

    def _front_launches(self, m: Member, high: int) -> list[Callable[[], None]]:
        idx = self.idx
        n, lane, s0 = m.n, m.lane, m.start
        sample = idx._tau_sample(m.k, high)
        nt = _nt(n)
        mma = kernels.get_kernel("mma_filter", nt, idx.metric)
        prep = kernels.get_kernel("prep_queries", idx.metric)
        tau = kernels.get_kernel("tau_scores", idx.metric)
        smem = 8 * nt * idx.lds * 2
        for kern, need in ((mma, smem), (tau, sample * 8)):
            if need > max(48 * 1024, kern.max_dynamic_shared_size_bytes):
                kern.max_dynamic_shared_size_bytes = need
        warps = kernels.BLOCK // 32
        dump_rows = min(sample, idx.capacity)
        dump_grid = max(1, -(-dump_rows // (16 * warps)))
        params = self.lane_params[lane]
        qh = self.qbuf_h[s0:]  # positions s0 ... (a view: prep and the sample start there)
        smp = self.sample[s0 * TAU_SAMPLE_MAX :]
        ltau = self.lane_tau[lane * POOL :]
        desc = np.uint64(self.page_addr + lane * _DESC_STRIDE)
        u0 = np.uint64(0)
        return [
            lambda: prep((n,), (kernels.BLOCK,), (desc, params, self.lane_qbuf, qh, self.lane_qbuf_i8,
                                                  np.int32(idx.dim), np.int32(idx.ld), u0, u0, u0)),
            lambda: mma((dump_grid,), (kernels.BLOCK,), (idx.data, np.int32(idx.ld), np.int32(idx.lds),
                                                         np.int32(dump_rows), idx.ns, idx.sqnorm, params, qh,
                                                         ltau, self.cand_k, self.cand_v, self.cand_count,
                                                         np.int32(CAND_CAP), smp, np.int32(sample),
                                                         np.int32(0), np.int32(0)), shared_mem=smem),
            lambda: tau((n,), (kernels.BLOCK,), (smp, np.int32(sample), idx.ns, idx.sqnorm, params,
                                                 np.int32(sample), ltau), shared_mem=sample * 8),
        ]  # fmt: skip

    def _launch_pass(self, ready: Callable[[Member], bool] | None = None) -> None:
        """The next pass: the joining batches enter the pool after their front work
        (``sweep_enter``: thresholds, L2 norms, empty lists), the pass over the next range for
        every position in use; then for each batch whose last range it was: its thresholds
        to NaN and its selection on the selection stream (a batch whose selection cannot be
        launched is reported failed)."""
        idx, cp = self.idx, self.cp
        step = self.plan.peek(ready)
        c, joining, leaving = step
        main = idx.stream
        enter = kernels.get_kernel("sweep_enter")
        with idx.device:
            for m in joining:
                main.wait_event(self._front[m.lane])
                qn2_in = np.uint64(self.lane_params[m.lane].data.ptr + _PARAMS_QNORM2)
                qn2_out = np.uint64(self.params.data.ptr + _PARAMS_QNORM2 + 4 * m.start)
                with main:
                    enter((1,), (kernels.BLOCK,), (self.lane_tau[m.lane * POOL :], self.tau[m.start :], qn2_in,
                                                   qn2_out, self.cand_count[m.start :], np.int32(m.n)))  # fmt: skip
            nq = self.positions.high
            nt = _nt(nq)
            mma = kernels.get_kernel("mma_filter", nt, idx.metric)
            smem = 8 * nt * idx.lds * 2
            if smem > max(48 * 1024, mma.max_dynamic_shared_size_bytes):
                mma.max_dynamic_shared_size_bytes = smem
            r0, r1 = self.bounds[c]
            start = cp.cuda.Event(block=False)
            start.record(main)
            with main:
                mma((self._grid(mma, smem),), (kernels.BLOCK,),
                    (idx.data, np.int32(idx.ld), np.int32(idx.lds), np.int32(r1), idx.ns, idx.sqnorm,
                     self.params, self.qbuf_h, self.tau, self.cand_k, self.cand_v, self.cand_count,
                     np.int32(CAND_CAP), np.uint64(0), np.int32(0), np.int32(r0), np.int32(nq)),
                    shared_mem=smem)  # fmt: skip
            end = cp.cuda.Event(block=False)
            end.record(main)
        self.plan.advance(step)  # the pass is on the stream: its members have scanned range c
        self._passes.append((start, end))
        self.passes += 1
        self.positions_sum += nq
        for m in leaving:
            try:
                idx._check(lambda m=m: self._leave(m, end))
            except FatalDeviceError:
                raise
            except Exception as e:  # not selected: its answers are not written
                self._free(m)
                self._answered.append((m.token, e))

    def _leave(self, m: Member, end: Any) -> None:
        """``m``'s last pass is ``end``: no later pass appends for it, and its selection
        follows that pass on the selection stream."""
        cp, main, sel = self.cp, self.idx.stream, self.side_sel
        with self.idx.device:
            cp.cuda.runtime.memcpyAsync(self.tau.data.ptr + 4 * m.start, self.off.data.ptr, 4 * m.n,
                                        3, main.ptr)  # fmt: skip  # (3: device to device)
            sel.wait_event(end)
            self._select(m)
            done = self._done[m.lane]
            done.record(sel)
        self._leaving.append((m, done))

    def _select(self, m: Member) -> None:
        idx = self.idx
        cap = CAND_CAP
        sel = kernels.get_kernel("select_cands", idx.metric)
        sel_smem = (cap + SELECT_GATHER) * 8
        if sel_smem > max(48 * 1024, sel.max_dynamic_shared_size_bytes):
            sel.max_dynamic_shared_size_bytes = sel_smem
        with self.side_sel:
            sel((m.n,), (kernels.BLOCK,),
                (self.cand_k[m.start * cap :], self.cand_v[m.start * cap :], self.cand_count[m.start :],
                 np.int32(cap), self.lane_params[m.lane], np.uint64(self.page_addr + _OVERFLOW_AT + 4 * m.lane)),
                shared_mem=sel_smem)  # fmt: skip

    def _grid(self, mma: Any, smem: int) -> int:
        """Blocks of a pass: every SM filled once (as GpuIndex._mma_launches), less the slots
        left to the side streams' kernels (whatever the pool's size: batches join and leave
        beside every pass)."""
        idx = self.idx
        by_regs = 65536 // (max(1, mma.num_regs) * kernels.BLOCK)
        by_smem = idx.smem_per_sm // (smem + 1024 + 1024)
        grid = max(1, min(by_regs, by_smem, 8)) * idx.sms
        return max(idx.sms, grid - SIDE_RESERVE)

    def _release(self, m: Member) -> Exception | None:
        """A batch's selection is done: run the exact path if its list overflowed, then free
        its positions and lane. The exact path's error, if it failed (its answers are then not
        written); a fatal device error is raised."""
        err = None
        try:
            if self._overflow[m.lane]:
                self.overflows += 1
                idx = self.idx
                idx.threshold_overflows += 1
                # every search still running finishes first: the exact path uses the index's
                # own buffers and stream
                idx._check(idx.device.synchronize)
                desc = self.page_addr + m.lane * _DESC_STRIDE
                wait = idx._check(lambda: idx._gemm_topk(m.n, m.k, self.high, threshold=False, desc_addr=desc))
                idx._check(wait)
        except FatalDeviceError:
            raise
        except Exception as e:
            err = e
        finally:
            self._free(m)
        return err

    def _free(self, m: Member) -> None:
        self._overflow[m.lane] = 0
        self.positions.give(m.start)
        self._lanes_free.append(m.lane)

def _nt(n: int) -> int:
    """The mma_filter instantiation (n-tiles of 8 queries) for ``n`` positions."""
    return next(t for t in _MMA_NT if 8 * t >= n)

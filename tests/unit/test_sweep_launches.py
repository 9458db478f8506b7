"""The sweep's device side (``sidecar/sweep.py``'s ``Sweep``) run on the CPU against a stand-in
for CuPy: CI has no GPU, and this code had not run anywhere before its first GPU session.
Every kernel launch is checked against the kernel's parameter list read from kernels/recall.cu
(count, and pointer / integer / 64-bit kinds); device memory is host memory here, so the
copies the sweep enqueues (``memcpyAsync``) really happen and their effects are checked (a
batch's thresholds set to NaN when it leaves); and the bookkeeping is followed through joins,
passes, leaving, the exact fallback's report and settling. The default float16 batch path's
launches (``GpuIndex._mma_launches``) are checked the same way: ``mma_filter`` took two
parameters for the sweep. What it cannot check is what the kernels compute: the GPU tests
(tests/gpu/test_gpu_index.py) do."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import cuda_kernels, index_gpu, sweep
from kalos_retrievers.sidecar.index import SlotSpec
from kalos_retrievers.sidecar.index_gpu import GpuIndex

SOURCE = cuda_kernels.packaged_source()


def kernel_params(name: str) -> list[str]:
    """The parameter kinds of ``__global__ ... name(...)`` in recall.cu: "ptr", "i32", "u64",
    "f32" (template parameters aside)."""
    m = re.search(rf"(?:__global__[^;{{]*?\b|^){name}\((.*?)\)\s*{{", SOURCE, re.S | re.M)
    assert m is not None, f"kernel {name} not found in recall.cu"
    kinds = []
    for raw in m.group(1).split(","):
        p = " ".join(raw.split())
        if "*" in p:
            kinds.append("ptr")
        elif re.match(r"(const )?int\b", p):
            kinds.append("i32")
        elif re.match(r"(const )?(u64|unsigned long long)\b", p):
            kinds.append("u64")
        elif re.match(r"(const )?float\b", p):
            kinds.append("f32")
        else:
            raise AssertionError(f"{name}: cannot read the parameter {p!r}")
    return kinds


def test_the_parameter_reader_reads_the_kernels_the_sweep_launches() -> None:
    assert kernel_params("sweep_enter") == ["ptr", "ptr", "ptr", "ptr", "ptr", "i32"]
    assert kernel_params("select_cands") == ["ptr", "ptr", "ptr", "i32", "ptr", "ptr"]
    assert len(kernel_params("mma_filter")) == 17 and kernel_params("mma_filter")[-2:] == ["i32", "i32"]
    assert len(kernel_params("prep_queries")) == 10 and len(kernel_params("tau_scores")) == 7


def test_the_launch_check_refuses_a_wrong_argument_list() -> None:
    """The negative control of the checks below: a launch with an argument missing, or an
    integer where a pointer goes, fails."""
    log: list = []
    sel = FakeKernel("select_cands", log)
    ptr = _dev(np.zeros(4, np.float32))
    good = (ptr, ptr, ptr, np.int32(8), ptr, np.uint64(1))
    sel((1,), (256,), good)
    with pytest.raises(AssertionError):
        sel((1,), (256,), good[:-1])
    with pytest.raises(AssertionError, match="argument 0"):
        sel((1,), (256,), (np.int32(0), *good[1:]))
    assert len(log) == 1


# ------------------------------------------------------------------ a stand-in for CuPy


class DevArray(np.ndarray):
    """Device memory stood in for by host memory: ``.data.ptr`` is the address."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.ctypes.data)


def _dev(a: np.ndarray) -> DevArray:
    return np.ascontiguousarray(a).view(DevArray)


class FakeStream:
    def __init__(self, non_blocking: bool = False, priority: int = 0) -> None:
        self.ptr = id(self)
        self.waits: list[Any] = []

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait_event(self, ev: Any) -> None:
        self.waits.append(ev)

    def synchronize(self) -> None:
        pass


class FakeEvent:
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self.recorded_on: Any = None
        self.done = True

    def record(self, stream: Any) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        pass


def _memcpy(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    assert kind == 3 and size > 0
    ctypes.memmove(dst, src, size)


class FakeKernel:
    """A kernel launch checked against recall.cu's parameter list, then recorded."""

    def __init__(self, name: str, log: list[tuple[str, tuple]]) -> None:
        self.name, self.log = name, log
        self.kinds = kernel_params(name)
        self.max_dynamic_shared_size_bytes = 48 * 1024
        self.num_regs = 64

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        assert len(args) == len(self.kinds), (self.name, len(args), len(self.kinds))
        for i, (a, kind) in enumerate(zip(args, self.kinds, strict=True)):
            ok = {"ptr": isinstance(a, (DevArray, np.uint64)), "i32": isinstance(a, np.int32),
                  "u64": isinstance(a, np.uint64), "f32": isinstance(a, np.float32)}[kind]  # fmt: skip
            assert ok, f"{self.name} argument {i}: {type(a).__name__} for a {kind} parameter"
        assert shared_mem <= max(48 * 1024, self.max_dynamic_shared_size_bytes), (self.name, shared_mem)
        assert all(isinstance(x, int) and x > 0 for x in grid + block), (self.name, grid, block)
        self.log.append((self.name, args))


def fake_cupy() -> Any:
    null = FakeStream()
    cuda = SimpleNamespace(
        Stream=FakeStream, Event=FakeEvent, get_current_stream=lambda: null,
        get_elapsed_time=lambda a, b: 0.1,  # ms: every pass took 100 µs
        runtime=SimpleNamespace(memcpyAsync=_memcpy, hostRegister=lambda *a: None, hostUnregister=lambda *a: None),
    )  # fmt: skip
    cuda.Stream.null = null  # type: ignore[attr-defined]
    return SimpleNamespace(
        cuda=cuda, float16=np.float16, float32=np.float32, int32=np.int32, int8=np.int8, uint8=np.uint8,
        zeros=lambda shape, dtype: _dev(np.zeros(shape, dtype)),
        empty=lambda shape, dtype: _dev(np.zeros(shape, dtype)),
        full=lambda shape, value, dtype: _dev(np.full(shape, value, dtype)),
        asarray=lambda a: _dev(np.asarray(a)),
    )  # fmt: skip


class FakeIndex:
    """What Sweep reads of a GpuIndex, over host memory; _addresses and _write_desc are the
    real ones."""

    _addresses = GpuIndex._addresses
    _write_desc = GpuIndex._write_desc
    _mma_smem_ok = lambda self, n: True  # noqa: E731

    def __init__(self, dim: int, rows: int) -> None:
        self.cp = fake_cupy()
        self.dim, self.ld, self.lds, self.metric = dim, dim, dim + 8, 0
        self.capacity, self.sms, self.smem_per_sm = rows, 132, 228 * 1024
        self.data = _dev(np.zeros((rows, dim), np.float16))
        self.ns, self.sqnorm = _dev(np.zeros(rows, np.int32)), _dev(np.zeros(rows, np.float32))
        self.device = SimpleNamespace(__enter__=None)
        self.stream = FakeStream()
        self.threshold_overflows = 0
        self.fallbacks: list[tuple] = []
        self.fallback_error: Exception | None = None

    def _check(self, fn: Any) -> Any:
        return fn()

    def _tau_sample(self, k: int, high: int) -> int | None:
        return GpuIndex._tau_sample(self, k, high)  # type: ignore[arg-type]

    def _gemm_topk(self, n: int, k: int, high: int, threshold: bool = True, desc_addr: int = 0) -> Any:
        if self.fallback_error is not None:
            raise self.fallback_error
        self.fallbacks.append((n, k, high, threshold, desc_addr))
        return lambda: None


class _Device:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    log: list[tuple[str, tuple]] = []
    kernels: dict[str, FakeKernel] = {}

    def get_kernel(name: str, *targs: object) -> FakeKernel:
        if name not in kernels:
            kernels[name] = FakeKernel(name, log)
        return kernels[name]

    monkeypatch.setattr(sweep.kernels, "get_kernel", get_kernel)
    dim, rows, k = 16, 5003, 10
    idx = FakeIndex(dim, rows)
    idx.device = _Device()  # type: ignore[assignment]
    per = -(-(4 * dim + 8 * k) // 128) * 128
    mm = mmap.mmap(-1, 64 * per)
    base = np.frombuffer(mm, np.uint8).ctypes.data
    specs = []
    for j in range(64):
        off = j * per
        specs.append(SlotSpec(np.frombuffer(mm, np.float32, dim, off).reshape(1, dim),
                              np.frombuffer(mm, np.int32, k, off + 4 * dim).reshape(1, k),
                              np.frombuffer(mm, np.float32, k, off + 4 * dim + 4 * k).reshape(1, k),
                              base + off, base + off + 4 * dim, base + off + 4 * dim + 4 * k))  # fmt: skip
    sw = sweep.Sweep(idx, 4)
    return sw, idx, specs, log, rows, k, mm


def _names(log: list[tuple[str, tuple]]) -> list[str]:
    return [name for name, _ in log]


def test_a_batch_enters_scans_every_range_and_leaves(rig) -> None:  # type: ignore[no-untyped-def]
    sw, idx, specs, log, rows, k, _mm = rig
    sw.join(specs[:3], k, rows, -2, "a")
    assert _names(log) == ["prep_queries", "mma_filter", "tau_scores"]  # its front, on the side stream
    prep, sample, tau = (args for _, args in log)
    assert int(prep[0]) == sw.page_addr  # lane 0's descriptor (the first lane taken)
    assert tau[-1].data.ptr == sw.lane_tau.data.ptr  # its thresholds held aside, not in the pool yet
    assert sample[-2:] == (np.int32(0), np.int32(0)) and int(sample[3]) == min(idx._tau_sample(k, rows), rows)
    # the descriptor the prep reads: 3 queries, k, the rows, the namespace, the slots' addresses
    head = index_gpu._DESC_HEAD.unpack_from(sw._page, 0)
    assert head[:4] == (3, k, rows, -2)
    q_addr = np.frombuffer(sw._page, np.uint64, 3, index_gpu._DESC_Q)
    assert q_addr.tolist() == [s.q_addr for s in specs[:3]]
    log.clear()
    assert sw.pump() == sweep.IN_FLIGHT
    names = _names(log)
    assert names == ["sweep_enter", "mma_filter", "mma_filter"], names
    enter, pass0, pass1 = (args for _, args in log)
    assert int(enter[-1]) == 3
    # the passes: rows [row0, end) of the first two ranges, every position in use (3)
    bounds = sweep.chunk_bounds(rows, 4)
    assert [(int(p[15]), int(p[3])) for p in (pass0, pass1)] == bounds[:2]
    assert int(pass0[16]) == 3 and int(pass0[13]) == 0  # no dump: a pass, not a sample
    assert idx.stream.waits == [sw._front[0]]  # the first pass waits for the front work
    log.clear()
    assert sw.pump() == 2  # (every fake event is done at once: the next pump launches two more)
    assert [(int(a[15]), int(a[3])) for n, a in log if n == "mma_filter"] == bounds[2:]
    assert sw.pump() == 0  # its four ranges scanned: nothing left to launch
    assert "select_cands" in _names(log)
    sel = next(a for n, a in log if n == "select_cands")
    assert int(sel[-1]) == sw.page_addr + sweep._OVERFLOW_AT  # lane 0's flag
    assert np.isnan(sw.tau[:3]).all()  # it left: its thresholds NaN (copied for real)
    assert sw.finished() == [("a", None)]
    assert sw.positions.high == 0 and sorted(sw._lanes_free) == list(range(sweep.LANES)) and not sw.busy
    assert sw.passes == 4 and sw.batches == 1


def test_an_overflow_is_answered_by_the_fallback_or_reported_failed(rig) -> None:  # type: ignore[no-untyped-def]
    """Batches leave in the order they joined; one whose list overflowed (its flag set, as
    select_cands sets it) is answered by the exact path from its own descriptor; one whose
    exact path fails is reported with the error; either way its lane and positions are free."""
    sw, idx, specs, _log, rows, k, _mm = rig
    sw.join(specs[:2], k, rows, -2, "a")
    sw.join(specs[2:7], k, rows, -2, "b")
    assert sw.positions.high == 7
    while sw.plan.members:
        sw.pump()
    lanes = {m.token: m.lane for m, _ in sw._leaving}
    sw._overflow[lanes["b"]] = 1
    got = sw.finished()
    assert got == [("a", None), ("b", None)], got
    assert idx.fallbacks == [(5, k, rows, False, sw.page_addr + lanes["b"] * sweep._DESC_STRIDE)]
    assert sw.overflows == 1 and idx.threshold_overflows == 1
    sw.join(specs[:3], k, rows, -2, "h")
    while sw.plan.members:
        sw.pump()
    sw._overflow[sw._leaving[0][0].lane] = 1
    idx.fallback_error = RuntimeError("no memory for the scores")
    ((tok, err),) = sw.finished()
    assert tok == "h" and isinstance(err, RuntimeError)
    assert sw.positions.high == 0 and len(sw._lanes_free) == sweep.LANES and sw._overflow.sum() == 0


def test_joins_are_refused_without_room_and_give_back_what_a_failed_launch_took(rig) -> None:  # type: ignore[no-untyped-def]
    sw, _idx, specs, _log, rows, k, _mm = rig
    for j in range(sweep.LANES):
        assert sw.can_join(1, k, rows, -2)
        sw.join(specs[j : j + 1], k, rows, -2, j)
    assert not sw.can_join(1, k, rows, -2)  # every lane taken
    sw.settle()
    assert [t for t, _ in sw.finished()] == list(range(sweep.LANES))
    sw.join(specs[:32], k, rows, -2, "big")
    assert sw.can_join(32, k, rows, -2) and not sw.can_join(33, k, rows, -2)
    assert not sw.can_join(1, k, rows + 1, -2) and not sw.can_join(1, k, rows, 0)  # other rows, other namespace
    free = len(sw._lanes_free)

    def broken(*a: object, **kw: object) -> None:
        raise RuntimeError("launch failed")

    sw._front_launches = lambda m, high: [broken]  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="launch failed"):
        sw.join(specs[32:40], k, rows, -2, "lost")
    assert len(sw._lanes_free) == free and sw.positions.high == 32 and len(sw.plan.members) == 1


def test_with_a_lead_the_next_pass_waits_until_due_and_takes_only_ready_batches(rig, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``lead_us``: with one pass running, the next is launched only ``lead_us`` before the
    running one is expected to end (the passes' measured 100 µs here), not a pass ahead; a
    batch whose front work is not done by then waits for a later pass, and joins one once it
    is."""
    sw, _idx, specs, log, rows, k, _mm = rig
    clock = [0]
    monkeypatch.setattr(sweep.time, "perf_counter_ns", lambda: clock[0])
    sw.lead_ns = 25_000
    sw.join(specs[:2], k, rows, -2, "a")
    assert sw.pump() == 2  # nothing measured yet: two on the stream, as without a lead
    sw._passes[1][1].done = False  # the first pass has ended at t = 0 (measured: 100 µs), the second runs
    sw.join(specs[2:5], k, rows, -2, "b")
    sw._front[sw.plan.members[-1].lane].done = False  # b's front work still runs
    log.clear()
    assert sw.pump() == 0 and sw.pass_us == 100.0  # the second runs from t = 0; one on the stream
    clock[0] = 60_000
    assert sw.pump() == 0  # due at 100 - 25 = 75 µs
    clock[0] = 80_000
    assert sw.pump() == 1  # due: launched, without b (its front is not done)
    assert [n for n, _ in log] == ["mma_filter"] and int(log[0][1][16]) == 5  # (positions 0-4 covered)
    assert not sw.plan.members[-1].joined
    sw._front[sw.plan.members[-1].lane].done = True
    for ev in sw._passes:
        ev[1].done = True
    log.clear()
    clock[0] = 200_000
    sw.pump()
    assert [n for n, _ in log][:2] == ["sweep_enter", "mma_filter"] and sw.plan.members[-1].joined
    sw.settle()
    assert [t for t, _ in sw.finished()] == ["a", "b"]


def test_the_mma_paths_launches_match_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched float16 path's five launches (``GpuIndex._mma_launches``: what every
    float16 batch runs, and what a queued batch runs in its lane) against recall.cu's
    parameter lists: mma_filter's took two more parameters (row0, nq_arg) for the sweep."""
    log: list[tuple[str, tuple]] = []
    monkeypatch.setattr(index_gpu.kernels, "get_kernel", lambda name, *t: FakeKernel(name, log))
    idx = FakeIndex(16, 5003)
    ptr = _dev(np.zeros(8, np.float32))
    lane = SimpleNamespace(desc_addr=1 << 20, params=ptr, qbuf=ptr, qbuf_h=ptr, qbuf_i8=ptr, tau=ptr, cand_k=ptr,
                           cand_v=ptr, cand_count=ptr, sample_buf=ptr, overflow_addr=1 << 21)  # fmt: skip
    launches = GpuIndex._mma_launches(idx, 16, 10, 1024, lane, 32)  # type: ignore[arg-type]
    assert launches is not None
    assert [stage for stage, _ in launches] == ["prep", "sample", "tau", "pass", "select"]
    for _, launch in launches:
        launch()
    assert [name for name, _ in log] == ["prep_queries", "mma_filter", "tau_scores", "mma_filter", "select_cands"]
    sample, pas = log[1][1], log[3][1]
    assert int(sample[3]) == 1024 and int(pas[3]) == -1  # the sample's rows; the pass: prep's row count
    assert (int(pas[15]), int(pas[16])) == (0, 0)  # from row 0, p->n_queries: as before the sweep


def test_one_query_slots_lay_out_aligned_slots_in_a_registered_map() -> None:
    """The slots the GPU benchmarks and tests hand to launch_slots (sidecar/bench.py):
    registered as the segment, 128-byte aligned, each spec's addresses its own views', the
    queries written in turn."""
    from kalos_retrievers.sidecar.bench import one_query_slots

    attached: list = []
    idx = SimpleNamespace(attach_segment=attached.append)
    q = np.arange(2 * 97, dtype=np.float32).reshape(2, 97)
    mm, specs = one_query_slots(idx, 5, 97, 11, q)
    assert attached == [mm] and len(specs) == 5
    for j, sp in enumerate(specs):
        assert sp.q_addr % 128 == 0 and sp.q_addr == sp.queries.ctypes.data
        assert sp.rows_addr == sp.rows.ctypes.data and sp.scores_addr == sp.scores.ctypes.data
        assert sp.rows.shape == (1, 11) and sp.scores.shape == (1, 11)
        assert (sp.queries[0] == q[j % 2]).all()
    ends = sorted((sp.q_addr, sp.scores_addr + 4 * 11) for sp in specs)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))  # no two slots overlap

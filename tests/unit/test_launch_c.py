"""A queued batch's launch in C (``kalos_retrievers.sidecar._launch``), on the CPU.

``desc`` must write, byte for byte, the descriptor and overflow flag the Python writer writes
(``GpuIndex._write_desc_slots`` both ways), and refuse, having written nothing, what does not
fit. ``run`` must make the plan's calls in order, with their handles, through the function
pointers at its head: here ctypes callbacks that record them stand in for the CUDA driver,
and the plan is ``GpuIndex._queue_plan``'s, so the order checked is the one the queued launch
makes. What the GPU does with them: tests/gpu/test_gpu_index.py (chains through both ways)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from kalos_retrievers.sidecar import index_gpu
from kalos_retrievers.sidecar.index_gpu import GpuIndex

launch_c = pytest.importorskip("kalos_retrievers.sidecar._launch", reason="the C extension is not built here")

N_SLOTS = 23


def _page_index() -> SimpleNamespace:
    """What _write_desc and _write_desc_slots use of a GpuIndex: the descriptor page."""
    mm = mmap.mmap(-1, 4096)
    mm.write(b"\xa5" * 4096)  # poison: every byte the writers leave shows
    idx = SimpleNamespace(_desc_mm=mm, _desc_u64=np.frombuffer(mm, np.uint64))
    idx._write_desc = lambda *a: GpuIndex._write_desc(idx, *a)
    return idx


def _table(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(1, 2**47, (N_SLOTS, 3), dtype=np.uint64)


def test_constants_match_the_python_layout() -> None:
    c = launch_c.CONSTANTS
    assert c["DESC_HEAD"] == index_gpu._DESC_Q == index_gpu._DESC_HEAD.size
    assert index_gpu._DESC_ROWS == index_gpu._DESC_Q + 8 * index_gpu.MAXQ


@pytest.mark.parametrize("lane", [0, 1])
@pytest.mark.parametrize("slots", [[7], [0, 22, 5, 11, 3], list(range(N_SLOTS))[::-1]])
def test_desc_writes_what_the_python_writer_writes(lane: int, slots: list[int]) -> None:
    """Both lanes, one slot to all of them in any order: the same bytes over the whole page
    (the head, the three address arrays, nothing past the n-th entry, the overflow flag)."""
    rng = np.random.default_rng()
    table = _table(rng)
    k, high, ns = 37, 1_000_003, -2
    pages = []
    for c in (True, False):
        page = _page_index()
        struct.pack_into("<i", page._desc_mm, index_gpu._LANE_OVERFLOW[lane], 1)
        GpuIndex._write_desc_slots(page, lane, k, high, ns, slots, table, c)
        pages.append(bytes(page._desc_mm))
    assert pages[0] == pages[1]
    got = pages[0]
    off = index_gpu._LANE_DESC[lane]
    assert struct.unpack_from("<iiiiQii", got, off) == (len(slots), k, high, ns, 0, k, 0)
    q = np.frombuffer(got, np.uint64, len(slots), off + index_gpu._DESC_Q)
    assert q.tolist() == table[slots, 0].tolist()
    r = np.frombuffer(got, np.uint64, len(slots), off + index_gpu._DESC_ROWS)
    assert r.tolist() == table[slots, 1].tolist()
    s = np.frombuffer(got, np.uint64, len(slots), off + index_gpu._DESC_SCORES)
    assert s.tolist() == table[slots, 2].tolist()
    assert struct.unpack_from("<i", got, index_gpu._LANE_OVERFLOW[lane]) == (0,)
    assert struct.unpack_from("<i", got, index_gpu._LANE_OVERFLOW[1 - lane]) == (-1515870811,)  # untouched


def _desc_args(mm, **over):  # type: ignore[no-untyped-def]
    args = {"page": mm, "off": 2048, "k": 10, "high": 99, "ns": 0, "out_ld": 10, "slots": [1, 2],
            "table": np.zeros((N_SLOTS, 3), np.uint64), "overflow_off": 4004, "maxq": 64}  # fmt: skip
    args.update(over)
    return list(args.values())


@pytest.mark.parametrize(
    ("over", "err"),
    [
        ({"slots": [1, N_SLOTS]}, ValueError),  # a slot past the table
        ({"slots": [-1]}, ValueError),
        ({"slots": []}, ValueError),
        ({"slots": list(range(65))}, ValueError),  # more than maxq
        ({"slots": (1, 2)}, TypeError),
        ({"slots": [1, "2"]}, TypeError),
        ({"off": 2044}, ValueError),  # not 8-aligned
        ({"off": 4096 - 32}, ValueError),  # past the page
        ({"overflow_off": 2048 + 40}, ValueError),  # inside the descriptor
        ({"overflow_off": 4094}, ValueError),
        ({"table": np.zeros(30, np.uint64)}, ValueError),  # not (n, 3)
        ({"table": np.zeros((N_SLOTS, 3), np.int64).view(np.float64)}, ValueError),  # not uint64
        ({"table": np.zeros((N_SLOTS, 3), np.uint32)}, ValueError),
        ({"table": np.zeros((N_SLOTS, 3), np.int64)}, ValueError),
        ({"table": np.zeros((3, N_SLOTS), np.uint64).T}, ValueError),  # not C-contiguous
        ({"table": b"\0" * 24 * N_SLOTS}, ValueError),  # bytes: no shape
        ({"ns": 2**31}, ValueError),
        ({"out_ld": 0}, ValueError),
        ({"maxq": 0}, ValueError),
        ({"maxq": 1025}, ValueError),
        ({"k": 0}, ValueError),
        ({"high": -1}, ValueError),
        ({"high": 2**31}, ValueError),
        ({"page": b"\0" * 4096}, BufferError),  # read-only
    ],
)
def test_desc_refuses_what_does_not_fit_and_writes_nothing(over: dict, err: type) -> None:
    mm = mmap.mmap(-1, 4096)
    mm.write(b"\xa5" * 4096)
    with pytest.raises(err):
        launch_c.desc(*_desc_args(mm, **over))
    assert bytes(mm) == b"\xa5" * 4096
    launch_c.desc(*_desc_args(mm))  # (the control: the same call with every value fitting writes)
    assert bytes(mm) != b"\xa5" * 4096


class _Driver:
    """Stand-ins for cuGraphLaunch, cuEventRecord and cuStreamWaitEvent: ctypes callbacks that
    record each call, and return ``fail`` at call number ``fail_at``."""

    def __init__(self, fail_at: int = -1, fail: int = 0) -> None:
        self.calls: list[tuple] = []
        self.fail_at, self.fail = fail_at, fail
        two = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        three = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
        self._fns = (two(lambda a, b: self._call("graph", a, b)), two(lambda a, b: self._call("record", a, b)),
                     three(lambda a, b, f: self._call("wait", a, b, f)))  # fmt: skip

    def _call(self, *what: object) -> int:
        self.calls.append(what)
        return self.fail if len(self.calls) - 1 == self.fail_at else 0

    @property
    def addresses(self) -> tuple[int, int, int]:
        return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns)  # type: ignore[return-value]


def _plan(driver: _Driver, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, dict[str, int]]:
    """GpuIndex._queue_plan over stand-in graphs, streams and events with distinct handles."""
    monkeypatch.setattr(index_gpu, "_driver_calls", lambda: driver.addresses)
    monkeypatch.setattr(index_gpu, "QUEUE_C", True)
    h = {name: 0x1000 * (j + 1) for j, name in enumerate(("front", "pass", "sel", "side", "main", "fd", "pd", "done"))}
    graphs = [SimpleNamespace(graphExec=h[g]) for g in ("front", "pass", "sel")]
    lane = SimpleNamespace(side=SimpleNamespace(ptr=h["side"]), front_done=SimpleNamespace(ptr=h["fd"]),
                           pass_done=SimpleNamespace(ptr=h["pd"]), done=SimpleNamespace(ptr=h["done"]))  # fmt: skip
    idx = SimpleNamespace(stream=SimpleNamespace(ptr=h["main"]), _check=lambda fn: fn(),
                          device=contextlib.nullcontext())  # fmt: skip
    plan = GpuIndex._queue_plan(idx, graphs, lane)
    assert plan is not None
    return plan, h


def test_run_makes_the_queued_launchs_calls_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front on the side stream and its end recorded; the index's stream waits for it, runs
    the pass and records its end; the side stream waits for that, runs the selection and
    records lane.done: the order of GpuIndex._launch_behind's CuPy calls."""
    driver = _Driver()
    plan, h = _plan(driver, monkeypatch)
    assert launch_c.run(plan) is None
    assert driver.calls == [
        ("graph", h["front"], h["side"]), ("record", h["fd"], h["side"]), ("wait", h["main"], h["fd"], 0),
        ("graph", h["pass"], h["main"]), ("record", h["pd"], h["main"]), ("wait", h["side"], h["pd"], 0),
        ("graph", h["sel"], h["side"]), ("record", h["done"], h["side"]),
    ]  # fmt: skip


@pytest.mark.parametrize("at", [0, 3, 7])
def test_run_stops_at_the_first_failing_call(at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _Driver(fail_at=at, fail=700)
    plan, _ = _plan(driver, monkeypatch)
    assert launch_c.run(plan) == (700, at)
    assert len(driver.calls) == at + 1  # none after it


def test_no_plan_without_the_c_path_or_an_executable_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """KALOS_QUEUE_C=0, no driver functions, or a graph without its executable handle: None
    (the CuPy calls); the control, all there, makes a plan."""
    driver = _Driver()
    _plan(driver, monkeypatch)
    lane = SimpleNamespace(side=SimpleNamespace(ptr=1), front_done=SimpleNamespace(ptr=2),
                           pass_done=SimpleNamespace(ptr=3), done=SimpleNamespace(ptr=4))  # fmt: skip
    idx = SimpleNamespace(stream=SimpleNamespace(ptr=5), _check=lambda fn: fn(), device=contextlib.nullcontext())
    graphs = [SimpleNamespace(graphExec=g) for g in (6, 7, 8)]
    assert GpuIndex._queue_plan(idx, graphs, lane) is not None
    assert GpuIndex._queue_plan(idx, [*graphs[:2], SimpleNamespace(graphExec=0)], lane) is None
    instantiated = []
    lazy = SimpleNamespace(graphExec=9, _ensure_instantiate=lambda: instantiated.append(1))
    assert GpuIndex._queue_plan(idx, [*graphs[:2], lazy], lane) is not None and instantiated == [1]
    monkeypatch.setattr(index_gpu, "_driver_calls", lambda: None)
    assert GpuIndex._queue_plan(idx, graphs, lane) is None
    monkeypatch.setattr(index_gpu, "_driver_calls", lambda: driver.addresses)
    monkeypatch.setattr(index_gpu, "QUEUE_C", False)
    assert GpuIndex._queue_plan(idx, graphs, lane) is None


@pytest.mark.parametrize(
    "plan",
    [
        b"",
        np.array([1, 2, 3, 1, 1, 0], np.uint64).tobytes(),  # one call of two words
        np.array([1, 2, 3, 2, 1, 0, 0], np.uint64).tobytes(),  # says two calls, has one
        np.array([1, 2, 3, 1, 4, 0, 0], np.uint64).tobytes(),  # code 4
        np.array([0, 2, 3, 1, 1, 0, 0], np.uint64).tobytes(),  # no cuGraphLaunch
        np.zeros(4 + 3 * 65, np.uint64).tobytes(),
    ],
)
def test_run_refuses_a_malformed_plan_before_any_call(plan: bytes) -> None:
    with pytest.raises(ValueError):
        launch_c.run(plan)


def test_a_failing_first_call_turns_the_c_calls_off_and_a_later_one_is_fatal() -> None:
    """(GpuIndex._queue_call_failed) nothing enqueued: logged, the CuPy calls from then on;
    the batch's work half enqueued, or a sticky error: FatalDeviceError."""
    idx = SimpleNamespace(name="cuda:0", _queue_c_failed=False)
    GpuIndex._queue_call_failed(idx, 201, 0)
    assert idx._queue_c_failed
    for rc, at in ((1, 3), (700, 0)):
        with pytest.raises(index_gpu.FatalDeviceError):
            GpuIndex._queue_call_failed(SimpleNamespace(name="cuda:0", _queue_c_failed=False), rc, at)

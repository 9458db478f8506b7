"""How a start's kernels are compiled (``cuda_kernels.compile_kernels``), without a GPU: split
into up to ``KALOS_COMPILE_THREADS`` modules of about equal cost, the resident kernel's builds
apart, compiled at once on as many threads, each under the index's device; one module where
one thread is asked for; a compile error the first failed module's log; kernels compiled
already not again. CuPy is stood in for by a module whose ``RawModule`` records what it was
asked and under which device, and waits at a barrier that only concurrent builds pass. What
NVRTC makes of the groups is for the GPU tier (every GPU test's sidecar compiles this way)."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest
from kalos_retrievers.sidecar import cuda_kernels
from kalos_retrievers.sidecar.cuda_kernels import compile_groups, compile_threads

pytestmark = pytest.mark.timeout(60)

# float16 cosine's instantiations, as GpuIndex._compile lists them (with lists)
START = [
    "prep_queries<1>", "topk_scores<1>", "tau_scores<1>", "filter_scores<1>", "select_cands<1>",
    "set_rows<__half>", "move_rows<__half>", "get_rows<__half>", "fault_kernel",
    *(f"{scan}<__half, 4, {qb}, 1>" for scan in ("scan_topk", "scan_list") for qb in (1, 2, 4, 8)),
    "doorbell_topk<__half, 4, 1, false>", "doorbell_topk<__half, 4, 1, true>",
    "mma_filter<2, 1>", "mma_filter<4, 1>", "mma_filter<8, 1>",
    "mma_filter<2, 1, true>", "mma_filter<4, 1, true>", "mma_filter<8, 1, true>", "carousel_topk<4, 1>",
]  # fmt: skip


def test_the_thread_count_by_default_and_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    d = cuda_kernels.COMPILE_THREADS_DEFAULT
    assert compile_threads(None, 16) == d and compile_threads("", 16) == d and compile_threads(None, None) == 1
    monkeypatch.setattr(cuda_kernels, "COMPILE_THREADS_DEFAULT", 4)
    assert compile_threads(None, 16) == 4 and compile_threads("", 2) == 2
    assert compile_threads("1", 16) == 1 and compile_threads(" 8 ", 1) == 8
    for bad in ("0", "33", "two", "-1"):
        with pytest.raises(ValueError, match="KALOS_COMPILE_THREADS"):
            compile_threads(bad, 4)


def test_a_starts_kernels_split_into_groups_of_about_equal_cost() -> None:
    groups = compile_groups(START, 4)
    assert len(groups) == 4 and sorted(e for g in groups for e in g) == sorted(START)
    (bell,) = [g for g in groups if "doorbell_topk<__half, 4, 1, false>" in g]
    assert not any(e.startswith("doorbell_topk<__half, 4, 1, true") for e in bell)  # the costliest apart
    cost = [sum(cuda_kernels._cost(e) for e in g) for g in groups]
    assert max(cost) - min(cost) <= cuda_kernels._cost("scan_topk<__half, 4, 1, 1>"), cost  # about equal
    assert all(g == [e for e in START if e in g] for g in groups)  # each in the order given
    assert compile_groups(START, 4) == groups  # the same split again: CuPy's disk cache finds each module
    assert compile_groups(START, 1) == [START] and compile_groups(START[:2], 8) == [[START[0]], [START[1]]]


class _Cupy:
    """CuPy's part compile_kernels uses: ``RawModule`` builds record (name expressions, the
    current device, the thread) and wait at ``barrier`` (None: no wait); ``Device`` sets the
    thread's current device (``cuda.Device``); ``fail``: a name whose module fails to compile."""

    def __init__(self, barrier: threading.Barrier | None = None, fail: str = "") -> None:
        self.builds: list[tuple[tuple[str, ...], int, str]] = []
        self.local = threading.local()
        self.barrier, self.fail = barrier, fail
        outer = self

        class CompileException(Exception):
            pass

        class Device:
            def __init__(self, n: int) -> None:
                self.n = n

            def __enter__(self) -> None:
                self.prev = getattr(outer.local, "device", 0)
                outer.local.device = self.n

            def __exit__(self, *exc: object) -> None:
                outer.local.device = self.prev

        class RawModule:
            def __init__(self, code: str, options: tuple, name_expressions: list[str]) -> None:
                assert "doorbell_topk" in code and "-std=c++17" in options
                self.names = list(name_expressions)

            def get_function(self, e: str) -> tuple[str, int]:
                if e == self.names[0]:  # (the first name's lookup forces the build)
                    outer.builds.append((tuple(self.names), getattr(outer.local, "device", 0),
                                         threading.current_thread().name))  # fmt: skip
                    if outer.barrier is not None:
                        outer.barrier.wait(timeout=10)
                    if outer.fail and outer.fail in self.names:
                        raise CompileException(f"error: in {outer.fail}")
                return (e, id(self))

        self.RawModule = RawModule
        self.current = 0  # the calling thread's device (cuda.runtime.getDevice)
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=lambda: self.current),
            Device=Device,
            compiler=types.SimpleNamespace(CompileException=CompileException),
        )


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No kernels compiled yet; ``install(fake)`` makes ``fake`` the cupy module imported."""
    monkeypatch.setattr(cuda_kernels, "_modules", [])
    monkeypatch.setattr(cuda_kernels, "_kernels", {})
    monkeypatch.setattr(cuda_kernels, "_module_of", {})
    return lambda fake: monkeypatch.setitem(sys.modules, "cupy", fake)


def test_the_groups_are_compiled_at_once_each_under_the_index_device(fresh: Any) -> None:
    """Four groups, four builds on worker threads under device 3, each past a barrier of four
    (serial builds would time out at it); every kernel then found, in its group's module."""
    fake = _Cupy(threading.Barrier(4))
    fresh(fake)
    cuda_kernels.compile_kernels(START, 3, threads=4)
    assert len(fake.builds) == 4 and {d for _, d, _ in fake.builds} == {3}
    assert all(t.startswith("kalos-compile") for _, _, t in fake.builds)
    assert sorted(e for names, _, _ in fake.builds for e in names) == sorted(START)
    for e in START:
        name, targs = e.split("<", 1)[0], e[len(e.split("<", 1)[0]) + 1 : -1].split(", ") if "<" in e else []
        fn = cuda_kernels.get_kernel(name, *targs)
        assert fn[0] == e and id(cuda_kernels.module_of(name, *targs)) == fn[1]
    assert len(cuda_kernels._modules) == 4
    cuda_kernels.compile_kernels(START[:5], 3, threads=4)  # compiled already: not again
    assert len(fake.builds) == 4


def test_without_a_device_the_workers_compile_under_the_callers(fresh: Any) -> None:
    """No device named: the split's workers compile under the calling thread's current device
    (a worker thread's is 0 until it says otherwise)."""
    fake = _Cupy(threading.Barrier(4))
    fake.current = 2
    fresh(fake)
    cuda_kernels.compile_kernels(START, threads=4)
    assert len(fake.builds) == 4 and {d for _, d, _ in fake.builds} == {2}


def test_one_thread_builds_one_module_in_the_callers_thread(fresh: Any) -> None:
    """The control: with one thread, one module of every kernel, built where it was asked,
    under the caller's current device when none is named."""
    fake = _Cupy()
    fresh(fake)
    cuda_kernels.compile_kernels(START, threads=1)
    assert fake.builds == [(tuple(START), 0, threading.current_thread().name)]


def test_a_compile_error_is_reported_with_the_failed_modules_log(fresh: Any) -> None:
    fake = _Cupy(fail="mma_filter<4, 1>")
    fresh(fake)
    with pytest.raises(cuda_kernels.KernelCompileError, match=r"recall\.cu failed:\nerror: in mma_filter<4, 1>"):
        cuda_kernels.compile_kernels(START, 0, threads=4)
    assert cuda_kernels._kernels == {}  # nothing half-registered

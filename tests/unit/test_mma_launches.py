"""The batched float16 path's kernel launches (``GpuIndex._mma_launches``: what every
float16 batch runs, and what a queued batch runs in its lane) run on the CPU against a
stand-in for CuPy's kernels: each launch is checked against the kernel's parameter list read
from kernels/recall.cu (count, and pointer / integer / 64-bit / float kinds), so that a
kernel whose parameters change without its launch fails CI, which has no GPU. What it cannot
check is what the kernels compute: the GPU tests (tests/gpu/test_gpu_index.py) do."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from kalos_retrievers.sidecar import cuda_kernels, index_gpu
from kalos_retrievers.sidecar.index_gpu import GpuIndex
from kernel_fakes import DevArray, FakeKernel, kernel_params
from kernel_fakes import dev as _dev

SOURCE = cuda_kernels.packaged_source()


def test_the_parameter_reader_reads_the_kernels_the_mma_path_launches() -> None:
    assert kernel_params("select_cands") == ["ptr", "ptr", "ptr", "i32", "ptr", "ptr"]
    assert len(kernel_params("mma_filter")) == 15 and kernel_params("mma_filter")[-2:] == ["ptr", "i32"]
    assert len(kernel_params("prep_queries")) == 10 and len(kernel_params("tau_scores")) == 8


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


class FakeIndex:
    """What ``_mma_launches`` reads of a GpuIndex, over host memory."""

    _mma_smem_ok = lambda self, n: True  # noqa: E731

    def __init__(self, dim: int, rows: int) -> None:
        self.dim, self.ld, self.lds, self.metric = dim, dim, dim + 8, 0
        self.capacity, self.sms, self.smem_per_sm = rows, 132, 228 * 1024
        self.data = _dev(np.zeros((rows, dim), np.float16))
        self.ns, self.sqnorm = _dev(np.zeros(rows, np.int32)), _dev(np.zeros(rows, np.float32))


def test_the_mma_paths_launches_match_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched float16 path's five launches (``GpuIndex._mma_launches``: what every
    float16 batch runs, and what a queued batch runs in its lane) against recall.cu's
    parameter lists."""
    log: list[tuple[str, tuple]] = []
    builds: list[tuple] = []  # the template arguments of each launch's kernel, in order

    class Build(FakeKernel):
        def __init__(self, name: str, *targs: object) -> None:
            super().__init__(name, log)
            self.targs = targs

        def __call__(self, *a: object, **kw: object) -> None:
            super().__call__(*a, **kw)  # type: ignore[arg-type]
            builds.append(self.targs)

    monkeypatch.setattr(index_gpu.kernels, "get_kernel", Build)
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
    sample, tau, pas = log[1][1], log[2][1], log[3][1]
    assert int(sample[3]) == 1024 and int(pas[3]) == -1  # the sample's rows; the pass: prep's row count
    assert isinstance(sample[13], DevArray) and pas[13] == np.uint64(0)  # only the sample dumps scores
    assert int(tau[1]) == 1024 and int(tau[-1]) == 1  # tau reads the dump by sample index
    # the sample through the dump's build (its rows spread over the index), the pass through the plain one
    assert builds == [(0,), (2, 0, "true"), (0,), (2, 0), (0,)]


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

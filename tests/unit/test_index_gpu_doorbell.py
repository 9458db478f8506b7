"""``GpuIndex.resume_doorbell``'s host side without a GPU: CuPy's arrays stood in for by host
memory (tests/kernel_fakes.py) and the kernel's launch checked against ``doorbell_topk``'s
parameters and recorded. What the kernel does with its settings is for
tests/gpu/test_gpu_doorbell.py and test_gpu_doorbell_spaces.py; here: that each start hands it
the rows, the default namespace and the namespaces it serves as the host line
(``struct BellCtl``) and the namespace table (``struct BellSpaces``) say, in the device memory
it reads them from. (A name clash in this code once failed every start that named a namespace,
on the GPU only: session 48.)"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import index_gpu
from kalos_retrievers.sidecar.index_gpu import GpuIndex, SmLimits, bell_spaces_table
from kernel_fakes import DevArray, FakeKernel

from kalos_retrievers.protocol import Layout

pytestmark = pytest.mark.timeout(60)


class _Dev(DevArray):
    """A device array whose ``set`` and ``fill`` write its host memory."""

    def set(self, arr: np.ndarray, stream: object = None) -> None:
        self.view(np.ndarray)[...] = np.asarray(arr).reshape(self.shape)

    def fill(self, value: int) -> None:
        self.view(np.ndarray).fill(value)


def _dev(a: np.ndarray) -> _Dev:
    return np.ascontiguousarray(a).view(_Dev)


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A GpuIndex made without CuPy, with what resume_doorbell reads: 24 rows of 16-d float16,
    a 3-slot segment, an empty arena, and the kernel's launch recorded in ``log``."""
    log: list[tuple[str, tuple]] = []
    kern = FakeKernel("doorbell_topk", log)
    kern.num_regs = 80
    kern.shared_size_bytes = 5888
    monkeypatch.setattr(index_gpu.kernels, "get_kernel", lambda name, *t: kern)
    idx = GpuIndex.__new__(GpuIndex)
    u8 = np.uint8
    bell_mm = mmap.mmap(-1, 4096)
    idx.__dict__.update(
        cp=None, dim=16, ld=16, metric=0, name="cuda:0", ctype="__half", tpr=2, device=_Null(), bstream=_Null(),
        stream=_Null(), doorbell_running=False, doorbell_k=64, doorbell_spaces=index_gpu.BELL_SPACES_MAX,
        bell_served_spaces=(), doorbell_launches=0, doorbell_mode=index_gpu.DOORBELL_MODE, seg_addr=1 << 40,
        _closed=False, _bell_layout=Layout(n_slots=3, dim=16), _arena_table=(1 << 41, 0, 0, 7), exact=None,
        _exact_reg=0, rescore_factor=1, _bell_mm=bell_mm, _bell_addr=np.frombuffer(bell_mm, u8).ctypes.data,
        bell_cfg=_dev(np.zeros(index_gpu._BELL_SERVED, u8)),
        bell_spaces=_dev(np.zeros(index_gpu._BELL_SPACES.size, u8)),
        bell_words=_dev(np.zeros(index_gpu._BELL_WORDS, np.uint32)), bell_cand=_dev(np.zeros(4, np.int32)),
        data=_dev(np.zeros((24, 16), np.float16)), ns=_dev(np.zeros(24, np.int32)),
        sqnorm=_dev(np.zeros(24, np.float32)),
        rowscale=None, params=_dev(np.zeros(4096, u8)), qbuf=_dev(np.zeros(16, np.float32)),
        qbuf_i8=_dev(np.zeros(16, np.int8)), scratch_k=_dev(np.zeros(64, np.float32)),
        scratch_v=_dev(np.zeros(64, np.int32)), sync=_dev(np.zeros(64, np.uint32)), bell_per_sm=3,
        sm_limits=SmLimits(65536, 233472, 2048, 1024), sms=132, max_grid=4096, on_doorbell=None,
        stop_carousel=lambda: None, _finish_all=lambda: None, _check=lambda fn: fn(),
    )  # fmt: skip
    return idx, log


def host_line(idx: Any) -> tuple:
    """The settings the kernel was started with: its device copy of the host line."""
    return index_gpu._BELL_CTL.unpack_from(bytes(idx.bell_cfg.view(np.ndarray)))


def test_a_start_names_the_namespaces_it_serves_in_the_kernels_table(index: Any) -> None:
    idx, log = index
    spaces = [("notes", 5), ("ünï-名前", 9), ("x" * 59, 11)]  # the last one's args are too long
    idx.resume_doorbell(21, 3, spaces)
    assert idx.doorbell_running and idx.doorbell_launches == 1 and len(log) == 1
    line = host_line(idx)
    assert line[1:3] == (21, 3)  # n_rows, the default namespace's id
    assert line[-2:] == (2, idx.bell_spaces.data.ptr)  # n_spaces, where the table is
    table, names = bell_spaces_table(spaces)
    assert names == idx.bell_served_spaces == ("notes", "ünï-名前")
    assert bytes(idx.bell_spaces.view(np.ndarray)) == table  # copied to the device before the launch


def test_no_namespaces_leaves_the_table_unread(index: Any) -> None:
    """The controls: no namespaces asked, and an index that serves none (KALOS_BELL_SPACES=0),
    start the kernel with n_spaces 0 and no table."""
    idx, log = index
    idx.resume_doorbell(21, 3)
    assert host_line(idx)[-2:] == (0, 0) and idx.bell_served_spaces == ()
    idx.doorbell_running = False
    idx.doorbell_spaces = 0
    idx.resume_doorbell(21, 3, [("notes", 5)])
    assert host_line(idx)[-2:] == (0, 0) and idx.bell_served_spaces == () and len(log) == 2
    assert not idx.bell_spaces.view(np.ndarray).any()


def test_a_running_kernel_is_not_started_again(index: Any) -> None:
    idx, log = index
    idx.resume_doorbell(21, 3, [("notes", 5)])
    idx.resume_doorbell(21, 3, [("other", 6)])
    assert len(log) == 1 and idx.bell_served_spaces == ("notes",)

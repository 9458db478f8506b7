"""When the GPU backend copies the arena's row table to the device for its resident kernel
(``GpuIndex._arena_on_device``), without a GPU: a stand-in for CuPy records the allocations and
copies. The copy must be redone whenever the table may have changed (a stale copy names old
documents; the GPU test of that is test_gpu_doorbell's stale-document test), made on the
index's device, and not redone when nothing changed (each copy of a 1M-row table is 16 MB)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kalos_retrievers.sidecar.index_gpu import ARENA_HEADER_SIZE, ENTRY_SIZE, GpuIndex


class _FakeCupy:
    """empty() and cuda.runtime.memcpy, noting which device was current for each."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.allocs: list[tuple[int, int | None]] = []  # (bytes, device)
        self.copies: list[tuple[int, int, int, int | None]] = []  # (dst, src, bytes, device)
        self.fail_copy = False
        self.uint8 = "uint8"
        self.cuda = SimpleNamespace(runtime=SimpleNamespace(memcpy=self._memcpy))
        self._next = 0x1000

    def empty(self, n: int, dtype: Any) -> Any:
        self.allocs.append((n, self.current))
        self._next += 0x100000
        return SimpleNamespace(nbytes=n, data=SimpleNamespace(ptr=self._next))

    def _memcpy(self, dst: int, src: int, n: int, kind: int) -> None:
        assert kind == 1  # host to device
        if self.fail_copy:
            raise RuntimeError("copy failed")
        self.copies.append((dst, src, n, self.current))

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        before, self.current = self.current, device
        try:
            yield
        finally:
            self.current = before


def _index(cp: _FakeCupy, device: int = 3) -> Any:
    """The attributes _arena_on_device uses, on a stand-in for a GpuIndex on ``device``."""
    return SimpleNamespace(cp=cp, device=cp.on(device), _arena=SimpleNamespace(changes=0), _arena_dev=None,
                           _arena_dev_of=(), _check=lambda fn: fn())  # fmt: skip


def _copy(idx: Any, table: int, rows: int, version: int = 1) -> int:
    idx.device = idx.cp.on(3)  # (a context manager is good for one `with`)
    return GpuIndex._arena_on_device(idx, table, rows, version)


def test_the_table_is_copied_on_the_indexs_device_and_only_when_it_may_have_changed() -> None:
    cp = _FakeCupy()
    idx = _index(cp)
    ptr = _copy(idx, 0x7000, 100)
    assert cp.allocs == [(100 * ENTRY_SIZE, 3)]  # on the index's device, not the thread's current one
    assert cp.copies == [(ptr, 0x7000 + ARENA_HEADER_SIZE, 100 * ENTRY_SIZE, 3)]
    assert _copy(idx, 0x7000, 100) == ptr and len(cp.copies) == 1  # nothing changed: no copy
    idx._arena.changes += 1  # an entry written (the kernel was stopped for it)
    assert _copy(idx, 0x7000, 100) == ptr and len(cp.copies) == 2
    _copy(idx, 0x9000, 100, version=2)  # a new version of the arena (a new table)
    assert len(cp.copies) == 3 and cp.copies[-1][1] == 0x9000 + ARENA_HEADER_SIZE
    ptr2 = _copy(idx, 0x9000, 300, version=3)  # a larger table: a larger copy
    assert ptr2 != ptr and cp.allocs[-1] == (300 * ENTRY_SIZE, 3) and cp.copies[-1][2] == 300 * ENTRY_SIZE
    assert len(cp.allocs) == 2
    _copy(idx, 0x9000, 200, version=4)  # smaller: the copy fits the memory it has
    assert len(cp.allocs) == 2 and cp.copies[-1][2] == 200 * ENTRY_SIZE


def test_a_failed_copy_is_made_again_at_the_next_start() -> None:
    cp = _FakeCupy()
    idx = _index(cp)
    cp.fail_copy = True
    with pytest.raises(RuntimeError):
        _copy(idx, 0x7000, 100)
    assert idx._arena_dev_of == ()  # not taken for a whole copy
    cp.fail_copy = False
    _copy(idx, 0x7000, 100)
    assert len(cp.copies) == 1


def test_without_a_change_counter_the_table_is_always_copied() -> None:
    cp = _FakeCupy()
    idx = _index(cp)
    idx._arena = None  # (no arena object known: nothing says it did not change)
    _copy(idx, 0x7000, 100)
    _copy(idx, 0x7000, 100)
    assert len(cp.copies) == 2

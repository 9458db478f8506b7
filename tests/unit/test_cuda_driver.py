"""cuda_driver: the two capture calls CuPy does not wrap, with the flags that make them graph
nodes (their effect on a real device: tests/gpu/test_gpu_index.py's queued-pass tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kalos_retrievers.sidecar import cuda_driver


def test_record_external_passes_the_external_flag_and_checks_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    status = [0]

    def fake(event: int, stream: int, flags: int) -> int:
        calls.append((event, stream, flags))
        return status[0]

    monkeypatch.setattr(cuda_driver, "_driver", lambda: fake)
    assert cuda_driver.available()
    cuda_driver.record_external(SimpleNamespace(ptr=11), SimpleNamespace(ptr=22))
    assert calls == [(11, 22, cuda_driver.EVENT_RECORD_EXTERNAL)]
    status[0] = 900  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    with pytest.raises(RuntimeError, match="CUresult 900"):
        cuda_driver.record_external(SimpleNamespace(ptr=11), SimpleNamespace(ptr=22))


def test_record_external_without_the_driver_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "_driver", lambda: None)
    assert not cuda_driver.available()
    with pytest.raises(RuntimeError, match="libcuda"):
        cuda_driver.record_external(SimpleNamespace(ptr=1), SimpleNamespace(ptr=2))


def test_wait_external_passes_the_external_flag() -> None:
    calls = []
    runtime = SimpleNamespace(streamWaitEvent=lambda s, e, f: calls.append((s, e, f)))
    cuda_driver.wait_external(SimpleNamespace(ptr=5), SimpleNamespace(ptr=6), runtime)
    assert calls == [(5, 6, cuda_driver.EVENT_WAIT_EXTERNAL)]

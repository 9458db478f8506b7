"""Two CUDA calls CuPy does not wrap, for stream capture across graphs.

A batch queued behind the pass on the device is launched as one CUDA graph
(:meth:`GpuIndex._launch_behind`). Its pass must follow the pass ahead, which ran in another
graph or on another stream: the graph holds an *external* wait on an event the pass ahead
recorded, and records one itself at its own pass's end for the batch after it. Inside a stream
capture, a plain record or wait only links the captured streams to each other; the external
flags make them graph nodes that act on the event at each launch, as the stream calls would.

CuPy's ``runtime.streamWaitEvent`` takes the flags; the record with flags
(``cuEventRecordWithFlags``) comes from the driver library through ctypes. Both are called
while a graph is captured (once per graph shape), never per launch.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Final

EVENT_RECORD_EXTERNAL: Final = 0x1  # CU_EVENT_RECORD_EXTERNAL / cudaEventRecordExternal
EVENT_WAIT_EXTERNAL: Final = 0x1  # CU_EVENT_WAIT_EXTERNAL / cudaEventWaitExternal


@functools.cache
def _driver() -> Any:
    """The driver library's cuEventRecordWithFlags (None where it cannot be loaded)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuEventRecordWithFlags
    except (OSError, AttributeError):  # no driver library here, or one older than CUDA 11.1
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """Whether :func:`record_external` can be called here."""
    return _driver() is not None


def record_external(event: Any, stream: Any) -> None:
    """Record CuPy ``event`` on ``stream`` as an external event record node of the graph being
    captured on ``stream`` (each launch of the graph records it when the work before it in
    the graph is done)."""
    fn = _driver()
    if fn is None:
        raise RuntimeError("cuEventRecordWithFlags is not available (libcuda.so.1)")
    status = fn(event.ptr, stream.ptr, EVENT_RECORD_EXTERNAL)
    if status != 0:
        raise RuntimeError(f"cuEventRecordWithFlags failed: CUresult {status}")


def wait_external(stream: Any, event: Any, runtime: Any) -> None:
    """Make the graph being captured on ``stream`` wait, at each of its launches, for ``event``'s
    latest record before that launch (an external event wait node; ``runtime``: CuPy's
    ``cupy.cuda.runtime``)."""
    runtime.streamWaitEvent(stream.ptr, event.ptr, EVENT_WAIT_EXTERNAL)

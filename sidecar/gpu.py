"""Finding a usable GPU. Importing this module never imports CuPy; opening the index does.

Client processes never import this module: only the sidecar pays for CuPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .index import Index


class GpuUnavailable(Exception):
    """No GPU backend here: CuPy missing, no device, or the driver refused."""


def open_gpu_index(dim: int, metric: int, ordinal: int, dtype: str) -> Index:
    """A :class:`~.index_gpu.GpuIndex` on device ``ordinal``.

    Raises:
        GpuUnavailable: CuPy is not installed, sees no device, or ``ordinal`` is out of range.
    """
    try:
        import cupy
    except ImportError as e:
        raise GpuUnavailable(
            "CuPy is not installed (the cuda12 or cuda13 extra: pip install '.[cuda12]' in a Kalos "
            "checkout, or cupy-cuda12x / cupy-cuda13x)"
        ) from e
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver, among others
        raise GpuUnavailable(f"CUDA runtime unavailable: {e}") from e
    if n == 0:
        raise GpuUnavailable("CuPy sees no CUDA device")
    if not 0 <= ordinal < n:
        raise GpuUnavailable(f"device cuda:{ordinal} does not exist (this machine has {n})")
    from .index_gpu import GpuIndex

    return GpuIndex(dim, metric, ordinal, dtype)

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
            "CuPy is not installed (the cuda12 or cuda13 extra: pip install "
            "'kalos-retrievers[cuda12]', or '.[cuda12]' in a Kalos checkout)"
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

    try:
        return GpuIndex(dim, metric, ordinal, dtype)
    except (RuntimeError, OSError) as e:
        if not _missing_library(e):
            raise
        raise GpuUnavailable(
            f"a CUDA library CuPy needs is missing ({e}): the sidecar compiles its kernels with "
            "NVRTC and runs cuBLAS, which a driver alone does not provide. Install them with CuPy "
            "(pip install 'cupy-cuda12x[ctk]', or cupy-cuda13x[ctk]; the cuda12 / cuda13 extras "
            "do) or install the CUDA Toolkit"
        ) from e


def _missing_library(e: BaseException) -> bool:
    """Whether ``e`` is CuPy's failure to load one of the CUDA toolkit's shared libraries
    (``CuPy failed to load libnvrtc.so.12: OSError: ...``), which a machine with only the
    NVIDIA driver lacks, rather than a fault of the index."""
    text = str(e)
    return ("failed to load" in text or "cannot open shared object file" in text) and any(
        lib in text for lib in ("nvrtc", "cublas", "libcu"))

"""The one place CUDA sources are read and compiled.

``kernels/recall.cu`` ships as package data of ``kalos_retrievers.sidecar.kernels``. The GPU
backend names, at start, every template instantiation it will launch; :func:`compile_kernels`
builds them all in one NVRTC module right away (``RawModule`` would otherwise compile lazily on
the first query), so a compile error fails the sidecar's start with the compiler's log instead
of failing a user's recall later. :func:`get_kernel` is the memoized lookup the backend uses.
CuPy caches the compiled module on disk, so later starts skip the compiler.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

KERNEL_FILES = ("recall.cu",)
BLOCK = 256  # KALOS_BLOCK in recall.cu

_modules: list[Any] = []
_kernels: dict[str, Any] = {}


class KernelCompileError(Exception):
    """NVRTC rejected the kernels; the message holds the compiler's log."""


def kernel_dir() -> Path:
    """Where the .cu files are: inside the installed package, or the repository's kernels/."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):
        if (cand / KERNEL_FILES[0]).is_file():
            return cand
    raise FileNotFoundError(
        f"CUDA sources {KERNEL_FILES} not found next to {here}; the installation is incomplete "
        "(they ship as package data of kalos_retrievers.sidecar.kernels)"
    )


def packaged_source() -> str:
    """The CUDA source this version ships."""
    return "\n".join((kernel_dir() / f).read_text() for f in KERNEL_FILES)


def source() -> str:
    """The CUDA source to compile: :func:`packaged_source`, or the file ``KALOS_KERNEL_SOURCE``
    names (diagnostics: an A/B of two versions of the kernels in one process or one lease, as
    ``KALOS_KERNEL_OPTIONS`` compares builds of one version; the host side stays this version,
    so the other must keep its layouts).

    Raises:
        FileNotFoundError: ``KALOS_KERNEL_SOURCE`` names no file.
    """
    override = os.environ.get("KALOS_KERNEL_SOURCE")
    if not override:
        return packaged_source()
    path = Path(override)
    if not path.is_file():
        raise FileNotFoundError(f"KALOS_KERNEL_SOURCE={override!r} is not a file")
    return path.read_text()


def expression(name: str, *targs: object) -> str:
    """``expression("scan_topk", "__half", 8, 1, 0)`` -> ``"scan_topk<__half, 8, 1, 0>"``."""
    return f"{name}<{', '.join(map(str, targs))}>" if targs else name


def extra_options() -> tuple[str, ...]:
    """Compiler options from ``KALOS_KERNEL_OPTIONS`` (diagnostics: benchmarks compare builds,
    e.g. ``-DKALOS_DYNAMIC_ROWS=0``); none by default."""
    return tuple(shlex.split(os.environ.get("KALOS_KERNEL_OPTIONS", "")))


def compile_kernels(expressions: list[str]) -> None:
    """Compile every listed kernel now (one module).

    Raises:
        KernelCompileError: with NVRTC's log.
    """
    import cupy

    if all(e in _kernels for e in expressions):
        return  # an earlier index of this process compiled them
    try:
        mod = cupy.RawModule(
            code=source(),
            options=("-std=c++17", f"-DKALOS_BLOCK={BLOCK}", *extra_options()),
            name_expressions=list(expressions),
        )
        kernels = {e: mod.get_function(e) for e in expressions}  # forces the compile
    except cupy.cuda.compiler.CompileException as e:
        raise KernelCompileError(f"compiling kernels/{KERNEL_FILES[0]} failed:\n{e}") from None
    # Keep every module alive for as long as its kernels are used; a second index in the same
    # process (other metric or dtype) adds its instantiations instead of replacing the first's.
    _modules.append(mod)
    _kernels.update(kernels)


def get_kernel(name: str, *targs: object) -> Any:
    """The compiled kernel ``name<targs...>``; it must have been listed at start."""
    e = expression(name, *targs)
    try:
        return _kernels[e]
    except KeyError:
        raise KeyError(f"kernel {e} was not compiled at start (listed: {sorted(_kernels)})") from None

"""The one place CUDA sources are read and compiled.

``kernels/recall.cu`` ships as package data of ``kalos_retrievers.sidecar.kernels``. The GPU
backend names, at start, every template instantiation it will launch; :func:`compile_kernels`
builds them all right away (``RawModule`` would otherwise compile lazily on the first query),
so a compile error fails the sidecar's start with the compiler's log instead of failing a
user's recall later. :func:`get_kernel` is the memoized lookup the backend uses. CuPy caches
the compiled modules on disk, so later starts skip the compiler.

A first start compiles for seconds (NVRTC: one dtype and metric's kernels took ~16 s of one
core on the development VM's nvcc, the resident kernel's two builds ~7 s of it), so the
instantiations can be split into up to :data:`COMPILE_THREADS` modules (:func:`compile_groups`,
the heaviest apart) compiled at once on as many threads: CuPy's ``compileProgram`` releases
the GIL around NVRTC, which compiles separate programs concurrently. The modules share no
state: the kernels pass everything through their arguments (the two ``__device__`` arrays in
recall.cu are diagnostics' stamps, each module with its own; :func:`module_of` finds the one
a kernel's is in).
"""

from __future__ import annotations

import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from .knobs import knob

KERNEL_FILES = ("recall.cu",)
BLOCK = 256  # KALOS_BLOCK in recall.cu

_modules: list[Any] = []
_kernels: dict[str, Any] = {}
_module_of: dict[str, Any] = {}  # each compiled kernel's module


def compile_threads(value: str | None, cpus: int | None) -> int:
    """``KALOS_COMPILE_THREADS``' value (None or empty: :data:`COMPILE_THREADS_DEFAULT`, at most
    one per CPU of ``cpus``; a value set is taken as it is): how many modules a start's kernels
    are split into and compiled at once; 1 compiles them as one.

    >>> compile_threads("4", 16), compile_threads("1", 16), compile_threads(None, None)
    (4, 1, 1)

    Raises:
        ValueError: not a whole number from 1 to 32.
    """
    if value is None or not value.strip():
        return max(1, min(COMPILE_THREADS_DEFAULT, cpus or 1))
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= 32:
        raise ValueError(f"KALOS_COMPILE_THREADS={value!r}: expected a whole number from 1 to 32 "
                         "(the kernels compiled at once; 1: as one module)")  # fmt: skip
    return n


# 4 since session 54: on an H100 host (16 cores, float16 cosine, an empty cache) a start's
# compile took 15.3 s as one module and 5.5 s as four (benchmarks/kernel_compile.py, S54-1), and
# the GPU tier passed with the split; at most one per CPU
COMPILE_THREADS_DEFAULT = 4


def _cpus() -> int | None:
    """The CPUs this process may run on (its affinity: a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on every platform)
        return os.cpu_count()


COMPILE_THREADS = knob("KALOS_COMPILE_THREADS", lambda value: compile_threads(value, _cpus()),
                       compile_threads(None, _cpus()))  # fmt: skip

# What an instantiation costs to compile, relative (the development VM's nvcc, float16 cosine:
# each doorbell_topk build ~2.1-3 s over the source's ~0.9 s alone (the one with lists ~6.7
# before it held one scan body, session 54), scan_topk or scan_list ~0.8 each, the rest ~0.1-0.4)
_COST = {"doorbell_topk": 20, "scan_topk": 8, "scan_list": 8, "carousel_topk": 4, "mma_filter": 1}


def _cost(expression: str) -> int:
    return _COST.get(expression.split("<", 1)[0], 1)


def compile_groups(expressions: list[str], n: int) -> list[list[str]]:
    """``expressions`` split into at most ``n`` groups of about equal compile cost, the
    costliest first into the cheapest group so far (each group in the order given; no group
    empty; the same split for the same list, so CuPy's disk cache finds each module again).

    >>> compile_groups(["a", "doorbell_topk<__half, 4, 0, true>", "scan_topk<__half, 4, 1, 0>", "b"], 2)
    [['doorbell_topk<__half, 4, 0, true>'], ['a', 'scan_topk<__half, 4, 1, 0>', 'b']]
    >>> compile_groups(["a", "b"], 1)
    [['a', 'b']]
    """
    n = max(1, min(n, len(expressions)))
    bins: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(expressions)), key=lambda i: (-_cost(expressions[i]), i)):
        b = min(range(n), key=lambda j: (load[j], j))
        bins[b].append(i)
        load[b] += _cost(expressions[i])
    return [[expressions[i] for i in sorted(b)] for b in bins if b]


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
    so the other must keep its layouts: every struct both sources define must be the same,
    comments and spacing aside, or the host would write fields where the kernels read others).

    Raises:
        FileNotFoundError: ``KALOS_KERNEL_SOURCE`` names no file.
        ValueError: it lays out a struct the host shares with the kernels otherwise.
    """
    override = os.environ.get("KALOS_KERNEL_SOURCE")
    if not override:
        return packaged_source()
    path = Path(override)
    if not path.is_file():
        raise FileNotFoundError(f"KALOS_KERNEL_SOURCE={override!r} is not a file")
    text = path.read_text()
    ours, theirs = _structs(packaged_source()), _structs(text)
    differ = sorted(name for name in ours.keys() & theirs.keys() if ours[name] != theirs[name])
    if differ:
        raise ValueError(f"KALOS_KERNEL_SOURCE={override!r} lays out {', '.join(differ)} otherwise than this "
                         "version's kernels/recall.cu, which the host writes: compare kernels of the same layouts")
    return text


def _structs(text: str) -> dict[str, str]:
    """Each ``struct Name { ... };`` at the start of a line in ``text``: its body without
    comments or whitespace."""
    return {m.group(1): re.sub(r"\s+", "", re.sub(r"//[^\n]*", "", m.group(2)))
            for m in re.finditer(r"^struct (\w+) \{[^\n]*\n(.*?)^\};", text, re.M | re.S)}  # fmt: skip


def expression(name: str, *targs: object) -> str:
    """``expression("scan_topk", "__half", 8, 1, 0)`` -> ``"scan_topk<__half, 8, 1, 0>"``."""
    return f"{name}<{', '.join(map(str, targs))}>" if targs else name


def extra_options() -> tuple[str, ...]:
    """Compiler options from ``KALOS_KERNEL_OPTIONS`` (diagnostics: benchmarks compare builds,
    e.g. ``-DKALOS_DYNAMIC_ROWS=0``); none by default."""
    return tuple(shlex.split(os.environ.get("KALOS_KERNEL_OPTIONS", "")))


def compile_kernels(expressions: list[str], device: int | None = None, threads: int | None = None) -> None:
    """Compile every listed kernel now, for ``device`` (an ordinal; None: the current one),
    in up to ``threads`` modules at once (default :data:`COMPILE_THREADS`; see the module's
    docstring). Kernels compiled already (an earlier index of this process) are not again.

    Raises:
        KernelCompileError: with NVRTC's log (the first failed module's).
    """
    import cupy

    todo = [e for e in dict.fromkeys(expressions) if e not in _kernels]
    if not todo:
        return  # an earlier index of this process compiled them
    code, options = source(), ("-std=c++17", f"-DKALOS_BLOCK={BLOCK}", *extra_options())

    def build(group: list[str]) -> tuple[Any, dict[str, Any]]:
        # (a worker thread's current device is 0 until it says otherwise: the arch compiled
        # for and the context the module is loaded into are the device's)
        with cupy.cuda.Device(device) if device is not None else nullcontext():
            mod = cupy.RawModule(code=code, options=options, name_expressions=group)
            return mod, {e: mod.get_function(e) for e in group}  # forces the compile and the load

    groups = compile_groups(todo, COMPILE_THREADS if threads is None else threads)
    if device is None and len(groups) > 1:
        device = cupy.cuda.runtime.getDevice()  # (the calling thread's: the workers' is 0)
    try:
        if len(groups) == 1:
            built = [build(groups[0])]
        else:
            with ThreadPoolExecutor(len(groups), thread_name_prefix="kalos-compile") as pool:
                built = list(pool.map(build, groups))
    except cupy.cuda.compiler.CompileException as e:
        raise KernelCompileError(f"compiling kernels/{KERNEL_FILES[0]} failed:\n{e}") from None
    # Keep every module alive for as long as its kernels are used; a second index in the same
    # process (other metric or dtype) adds its instantiations instead of replacing the first's.
    for mod, kernels in built:
        _modules.append(mod)
        _kernels.update(kernels)
        _module_of.update(dict.fromkeys(kernels, mod))


def module_of(name: str, *targs: object) -> Any:
    """The module the compiled kernel ``name<targs...>`` is in (diagnostics read its
    ``__device__`` arrays through ``get_global``)."""
    e = expression(name, *targs)
    try:
        return _module_of[e]
    except KeyError:
        raise KeyError(f"kernel {e} was not compiled at start (listed: {sorted(_kernels)})") from None


def get_kernel(name: str, *targs: object) -> Any:
    """The compiled kernel ``name<targs...>``; it must have been listed at start."""
    e = expression(name, *targs)
    try:
        return _kernels[e]
    except KeyError:
        raise KeyError(f"kernel {e} was not compiled at start (listed: {sorted(_kernels)})") from None

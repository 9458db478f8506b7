"""How many threads numpy's BLAS uses for the CPU index's matrix products (``--threads``).

A sidecar shares its machine with the application it serves. By default OpenBLAS starts one
thread per core, and after each product its idle workers keep spinning for a while before they
sleep: on a 16-core host, a CPU sidecar and an application that also calls numpy, alternating
call by call, slowed each other's products 3-4x that way (docs/benchmarks.md). Capping the
pool leaves cores to the application, at a cost: on that host 4 threads made a 100k x 384
recall ~1.6x slower than 16.

The thread count can be fixed by ``OPENBLAS_NUM_THREADS`` before numpy is imported, but the
sidecar's package imports numpy first; so this module finds the OpenBLAS library numpy loaded
(``/proc/self/maps``) and calls its ``*_set_num_threads`` through ctypes, as threadpoolctl does.
Only OpenBLAS is handled (numpy's wheels bundle it); elsewhere :func:`set_threads` returns None
and the caller says how to set it through the environment.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping
from functools import cache
from typing import Final

import numpy as np  # noqa: F401 - loads the BLAS library this module looks for

# (setter, getter): numpy >= 2 wheels bundle scipy-openblas (64-bit ints, prefixed symbols);
# older wheels and distribution builds export the plain names.
_SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


@cache
def _openblas() -> tuple[str, ctypes.CDLL, str, str] | None:
    """(path, library, setter name, getter name) of the OpenBLAS loaded in this process."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so[\w.]*)", f.read())))
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for setter, getter in _SYMBOLS:
            if hasattr(lib, setter) and hasattr(lib, getter):
                return path, lib, setter, getter
    return None


def get_threads() -> int | None:
    """OpenBLAS's current thread count, or None when numpy does not use OpenBLAS."""
    found = _openblas()
    if found is None:
        return None
    _, lib, _, getter = found
    return int(getattr(lib, getter)())


def pool_threads() -> int | None:
    """The pool products above :data:`SMALL_PRODUCT` use (what ``--threads`` set, or the
    library's count), where :func:`get_threads` says what OpenBLAS is set to now: 1 after a
    small product (:func:`threads_for`). None when numpy does not use OpenBLAS."""
    return _threads.pool if _threads.pool is not None else get_threads()


def set_threads(n: int) -> str | None:
    """Use ``n`` threads for later products; returns the library's path, or None when numpy
    does not use an OpenBLAS this module can find (set ``OPENBLAS_NUM_THREADS``, or
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` for other libraries, before starting)."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    found = _openblas()
    if found is None:
        return None
    path, lib, setter, getter = found
    getattr(lib, setter)(ctypes.c_int(n))
    # what it took: OpenBLAS caps the count at what it was built for (--threads 1000: 64)
    _threads.pool = _threads.current = int(getattr(lib, getter)())
    return path


# On a host of at least this many cores, a sidecar started without --threads (and without a
# thread count in its environment) leaves a quarter of them to its clients: see default_threads.
MANY_CORES: Final = 8
_THREAD_ENV: Final = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def default_threads(cores: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """The BLAS pool a sidecar takes when not told (None: leave the library's default).

    OpenBLAS starts one thread per core, and its idle workers spin for a while after each
    product; the sidecar's own thread and the clients that wait for the answer (they spin
    across the expected answer) then compete with them for the cores. On the 16-core H200
    host, 100k x 384 recalls (S7-1 ... S7-4, docs/benchmarks.md): one client's p99 1.0-2.3 ms
    with 12 threads against 2.7-2.9 ms with 16, and two client processes 858-1,312 recalls/s
    (p99 2.2-2.7 ms) against 568-818 (p99 6.4-6.6 ms); the product of those rows is bound by
    memory bandwidth, which 12 threads still fill. On smaller hosts
    every thread is needed for the scan (on 2 cores one thread doubled it), so below
    MANY_CORES the default stays. A count set in the environment is respected.
    """
    env = os.environ if environ is None else environ
    if any(env.get(v) for v in _THREAD_ENV):
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    if cores < MANY_CORES:
        return None
    return cores - cores // 4


# Products smaller than this many elements (rows x dim x queries) run on one thread. OpenBLAS
# spreads even a 1k-row product over all its threads, and its idle workers then spin for a
# while: on the 2-core dev VM the client, the sidecar's main thread and a spinning worker
# shared two cores, and a recall over 1k rows of 768 took 430 µs instead of 90 (3k rows: 460
# against 153 µs); from ~10k rows the pool pays for itself (663 against 913 µs). See
# docs/benchmarks.md, session 4.
SMALL_PRODUCT: Final = 4_000_000


class _Threads:
    pool: int | None = None  # the pool size products above SMALL_PRODUCT use
    current: int | None = None  # what OpenBLAS is set to now


_threads = _Threads()


def threads_for(elements: int) -> None:
    """Before a product over ``elements`` elements: one thread if it is small, else the pool."""
    found = _openblas()
    if found is None:
        return
    _, lib, setter, getter = found
    t = _threads
    if t.pool is None:
        t.pool = t.current = int(getattr(lib, getter)())
    want = 1 if elements < SMALL_PRODUCT else t.pool
    if want != t.current:
        getattr(lib, setter)(ctypes.c_int(want))
        t.current = want

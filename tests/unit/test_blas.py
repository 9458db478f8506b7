"""``--threads``: setting numpy's OpenBLAS thread count after numpy is imported."""

from __future__ import annotations

import os

import numpy as np
import pytest
from kalos_retrievers.sidecar import blas


def test_set_threads_changes_what_openblas_uses_and_products_stay_right() -> None:
    before = blas.get_threads()
    # numpy's Linux wheels bundle OpenBLAS; a build without it is not what we ship against
    assert before is not None, "numpy's OpenBLAS was not found in /proc/self/maps"
    rng = np.random.default_rng()
    m = rng.standard_normal((2003, 97)).astype(np.float32)
    q = rng.standard_normal(97).astype(np.float32)
    want = m.astype(np.float64) @ q.astype(np.float64)
    try:
        for n in (1, 3):
            assert blas.set_threads(n) is not None
            assert blas.get_threads() == n
            np.testing.assert_allclose(m @ q, want, rtol=1e-4, atol=1e-4)
    finally:
        blas.set_threads(before)
    assert blas.get_threads() == before


def test_set_threads_refuses_zero() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        blas.set_threads(0)


def test_small_products_run_on_one_thread_and_large_ones_on_the_pool() -> None:
    """A CPU index's search over few rows must not wake OpenBLAS's workers (they then spin and
    take the cores the client and the sidecar need); a large one uses the whole pool."""
    before = blas.get_threads()
    assert before is not None, "numpy's OpenBLAS was not found in /proc/self/maps"
    try:
        blas.set_threads(2)
        blas.threads_for(1000 * 768)
        assert blas.get_threads() == 1
        blas.threads_for(100_000 * 384)
        assert blas.get_threads() == 2  # the pool as configured
        blas.threads_for(blas.SMALL_PRODUCT - 1)
        assert blas.get_threads() == 1
    finally:
        blas.set_threads(before)


def test_the_cpu_index_searches_a_small_table_on_one_thread() -> None:
    from kalos_retrievers.sidecar.index import CpuIndex

    from kalos_retrievers.protocol import Metric

    before = blas.get_threads()
    assert before is not None, "numpy's OpenBLAS was not found in /proc/self/maps"
    try:
        blas.set_threads(2)
        idx = CpuIndex(16, Metric.IP)
        rng = np.random.default_rng()
        data = rng.standard_normal((301, 16)).astype(np.float32)
        idx.set_rows(np.arange(301), data, np.zeros(301, np.int32))
        q = rng.standard_normal((1, 16)).astype(np.float32)
        rows, _ = idx.search(q, 5, 301, 0, None, True)
        assert blas.get_threads() == 1
        assert sorted(rows[0].tolist()) == sorted(np.argsort(-(data @ q[0]))[:5].tolist())
    finally:
        blas.set_threads(before)


def test_a_sidecar_leaves_a_quarter_of_a_large_hosts_cores_to_its_clients() -> None:
    assert blas.default_threads(16, {}) == 12
    assert blas.default_threads(8, {}) == 6
    assert blas.default_threads(7, {}) is None  # small hosts: the library's default (all)
    assert blas.default_threads(2, {}) is None
    assert blas.default_threads(64, {"OPENBLAS_NUM_THREADS": "3"}) is None  # the environment wins
    assert blas.default_threads(64, {"OMP_NUM_THREADS": "5"}) is None
    assert blas.default_threads(64, {"OPENBLAS_NUM_THREADS": ""}) == 48
    n = len(os.sched_getaffinity(0))  # this machine's, by default
    assert blas.default_threads(None, {}) == (n - n // 4 if n >= 8 else None)

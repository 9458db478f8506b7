"""``--threads``: setting numpy's OpenBLAS thread count after numpy is imported."""

from __future__ import annotations

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

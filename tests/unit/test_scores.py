"""Relevance from raw scores (kalos_retrievers.scores), the same in every adapter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kalos_retrievers.scores import relevance, relevance_fn


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_relevance_is_monotone_in_the_unit_interval_and_nan_reads_zero(metric: str) -> None:
    s = np.concatenate([-np.logspace(-8, 30, 200)[::-1], [0.0], np.logspace(-8, 30, 200)])
    if metric == "l2":
        s = s[s <= 0]  # (a distance is never negative)
    r = [relevance(metric, float(x)) for x in s]
    assert all(0.0 <= v <= 1.0 for v in r) and r == sorted(r)
    for bad in (math.nan, -math.inf):
        assert relevance(metric, bad) == 0.0, bad
    if metric != "l2":
        assert relevance(metric, math.inf) == 1.0


def test_unit_vectors_read_the_same_under_cosine_and_ip() -> None:
    """ip over unit vectors is cosine: its relevance is too. (The logistic it replaced gave a
    row identical to the query 0.731, so a threshold of 0.8 kept nothing.)"""
    rng = np.random.default_rng()
    v = rng.standard_normal((50, 7))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    for s in [1.0, *(v @ v[0]).tolist()]:
        assert relevance("ip", s) == relevance("cosine", s)
    assert relevance("ip", 1.0) == 1.0 and relevance("ip", 0.0) == 0.5 and relevance("ip", -1.0) == 0.0


def test_what_a_threshold_means() -> None:
    """As documented: a threshold t keeps cosine s >= 2t - 1, and an L2 distance <= 1/t - 1."""
    assert relevance("cosine", 0.6) == pytest.approx(0.8)
    assert relevance("l2", -0.25) == pytest.approx(0.8)
    assert relevance("l2", 0.0) == 1.0
    with pytest.raises(ValueError, match="unknown metric"):
        relevance_fn("dot")

"""The threshold top-k's sample size (``index_gpu.tau_sample``): how many rows give each query
its threshold, and so how often its candidate list overflows into the exact fallback. The
overflow probability is computed exactly here (binomial), not from the Poisson bound the
sidecar uses, over row counts and k from 1 to 1024; the rule before session 28 (3k) is the
negative control."""

from __future__ import annotations

import math

import pytest
from kalos_retrievers.sidecar.index_gpu import CAND_CAP, OVERFLOW_P, TAU_SAMPLE_MAX, TAU_SAMPLE_MIN, _pow2, tau_sample

HIGHS = [9_001, 20_011, 33_333, 77_777, 100_003, 200_003, 400_009, 1_000_000, 2_000_003, 5_000_011, 9_000_001]
KS = [*range(1, 21), 24, 32, 37, 50, 64, 100, 128, 256, 512, 1024]


def overflow_p(sample: int, k: int, high: int) -> float:
    """P(more than CAND_CAP of ``high`` rows in no particular order reach the k-th best score
    of the first ``sample``): P(Binomial(sample, CAND_CAP / high) < k)."""
    p = CAND_CAP / high
    if sample >= high or p >= 1:
        return 0.0  # the sample is every row (the threshold is exact), or every row fits
    lp, lq = math.log(p), math.log1p(-p)
    lc = lambda j: math.lgamma(sample + 1) - math.lgamma(j + 1) - math.lgamma(sample - j + 1)  # noqa: E731
    return sum(math.exp(lc(j) + j * lp + (sample - j) * lq) for j in range(min(k, sample + 1)))


def three_k(k: int, high: int) -> int | None:
    """The sample before session 28: about CAND_CAP / 3 candidates expected per query."""
    s = _pow2(max(2, -(-3 * k * high // CAND_CAP)))
    return None if s > TAU_SAMPLE_MAX else min(s, _pow2(high))


def test_overflows_stay_below_the_bound_wherever_the_sample_fits() -> None:
    worst = 0.0
    for high in HIGHS:
        for k in KS:
            s = tau_sample(k, high)
            if s is None:
                continue
            p = overflow_p(s, k, high)
            if s < TAU_SAMPLE_MAX:  # (capped by shared memory: as large as it may be)
                assert p <= OVERFLOW_P, (high, k, s, p)
            worst = max(worst, p)
    assert worst > 0  # the grid has samples smaller than their rows


def test_the_rule_before_overflowed_one_k1_query_in_67_at_1m_rows() -> None:
    """The negative control: the check above fails the 3k rule."""
    assert overflow_p(three_k(1, 1_000_000), 1, 1_000_000) == pytest.approx(1 / 67.5, rel=0.01)  # type: ignore[arg-type]
    assert max(overflow_p(three_k(k, h), k, h) for h in HIGHS for k in KS if three_k(k, h)) > 0.01  # type: ignore[arg-type]


def test_the_sample_only_grows_and_only_for_small_k_or_to_its_floor() -> None:
    """Never smaller than the 3k rule, None exactly where it was None (the mma path is taken
    where it was), and from k = 13 on the same or raised to TAU_SAMPLE_MIN (32 of its runs of
    32 rows, since session 56) or every row."""
    for high in HIGHS:
        for k in KS:
            s, before = tau_sample(k, high), three_k(k, high)
            assert (s is None) == (before is None), (high, k)
            if s is not None and before is not None:
                floor = min(TAU_SAMPLE_MIN, _pow2(high))
                assert s >= max(before, floor) and (k < 13 or s == max(before, floor)), (high, k, s, before)

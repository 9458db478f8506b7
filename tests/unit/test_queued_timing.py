"""queued_timing: the summary of KALOS_BATCH_TIMING's records of batches queued behind another."""

import math

import pytest
from kalos_retrievers.sidecar.index_gpu import queued_timing

NAN = float("nan")


def test_no_batches_reports_only_the_count() -> None:
    assert queued_timing([]) == {"batches": 0}


def test_figures_come_from_the_batches_whose_pass_ahead_was_timed() -> None:
    # (queries, pass, front, lead, gap): the third followed an untimed search
    times = [(16, 400.0, 40.0, 100.0, 0.5), (15, 410.0, 45.0, -20.0, 30.0), (16, 405.0, 300.0, NAN, NAN)]
    out = queued_timing(times)
    assert out["batches"] == 3 and out["followed"] == 2
    assert out["queries_mean"] == pytest.approx(47 / 3, abs=0.01)
    assert out["pass_p50_us"] == 405.0 and out["front_mean_us"] == pytest.approx(128.3, abs=0.05)
    assert out["lead_p50_us"] == 40.0 and out["gap_mean_us"] == 15.2
    assert out["period_mean_us"] == pytest.approx((400.5 + 440.0) / 2, abs=0.1)
    assert out["late_share"] == 0.5  # the 30 µs gap, not the 0.5
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in out.values())


def test_no_timed_pass_ahead_leaves_lead_and_gap_out() -> None:
    out = queued_timing([(7, 100.0, 20.0, NAN, NAN)])
    assert out["followed"] == 0 and "gap_p50_us" not in out and "late_share" not in out
    assert out["pass_mean_us"] == 100.0

"""The sidecar's diagnostics switched on from its environment, in a real sidecar process:
``KALOS_BATCH_TIMING=1`` (or ``host``) times its garbage collections among the stats' phases, and
``KALOS_PROFILE=FILE`` leaves a cProfile file when it stops (docs/deployment.md)."""

from __future__ import annotations

import os
import pstats
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)


def _churn(sc) -> dict:  # type: ignore[no-untyped-def]
    """Enough upserts and recalls that the sidecar's collector runs; its stats after."""
    rng = np.random.default_rng()
    with sc.client() as c:
        for j in range(30):
            n = 101
            c.upsert([f"r{j}-{i}" for i in range(n)], rng.standard_normal((n, 5)).astype(np.float32),
                     texts=["t"] * n, metadatas=[{"j": j, "i": i} for i in range(n)])  # fmt: skip
        for _ in range(200):
            c.recall(rng.standard_normal(5).astype(np.float32), 3)
        return c.stats()


@pytest.mark.parametrize("timing", ["1", "host", None])
def test_batch_timing_times_the_sidecars_garbage_collections(start_sidecar, monkeypatch, timing: str | None) -> None:
    """With the timing on ("1", or "host": the host's clock only), each collection is a phase
    "gc<generation>"; off (the negative control), the stats have none."""
    if timing:
        monkeypatch.setenv("KALOS_BATCH_TIMING", timing)
    else:
        monkeypatch.delenv("KALOS_BATCH_TIMING", raising=False)
    phases = _churn(start_sidecar(dim=5))["phases"]
    gcs = {name: p["count"] for name, p in phases.items() if name.startswith("gc")}
    if timing:
        assert gcs.get("gc0", 0) >= 1, phases.keys()
    else:
        assert gcs == {}, gcs


def test_profile_is_written_when_the_sidecar_stops(start_sidecar, monkeypatch, tmp_path) -> None:
    """``KALOS_PROFILE``: the file appears when the sidecar stops (a CPU sidecar never queues a
    batch behind another, so it holds no launches; the GPU's were read in S30-4)."""
    out = tmp_path / "launches.prof"
    monkeypatch.setenv("KALOS_PROFILE", str(out))
    sc = start_sidecar(dim=5)
    _churn(sc)
    assert not out.exists()  # written at the stop, not before
    sc.stop()
    assert out.exists()
    with pytest.raises(TypeError):  # (an empty profile: pstats finds no statistics in it)
        pstats.Stats(str(out))


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no per-thread schedstat here")
def test_stats_report_the_serve_loops_scheduler_figures(start_sidecar) -> None:
    """``stats()["serve_thread"]``: the serve loop's CPU time and switches, growing as it
    answers."""
    sc = start_sidecar(dim=5)
    with sc.client() as c:
        first = c.stats()["serve_thread"]
    second = _churn(sc)["serve_thread"]
    assert set(first) == {"cpu_ns", "runqueue_ns", "timeslices", "voluntary_switches", "involuntary_switches"}
    assert second["cpu_ns"] > first["cpu_ns"] > 0
    # a loop with a core of its own may answer the churn without once leaving it (CI saw 10 and
    # 10 timeslices); idle past its spin window it blocks on the doorbell: a voluntary switch
    assert second["timeslices"] >= first["timeslices"]
    time.sleep(0.1)
    with sc.client() as c:
        third = c.stats()["serve_thread"]
    assert third["voluntary_switches"] > first["voluntary_switches"]
    assert third["timeslices"] > first["timeslices"]

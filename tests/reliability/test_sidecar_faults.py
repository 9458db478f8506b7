"""Scenario 3: the sidecar is killed (SIGKILL) or paused (SIGSTOP) while retrievers query it.

Retrievers here are KalosClient behind the adapters' degradation path (:class:`Degrader`),
in separate processes, calling back to back so that the fault lands mid-query.

Pass: every call returns (empty context while the sidecar is away) within its deadline + 10 ms
at p99, no error escapes the retriever, and after a restart (or SIGCONT) every retriever gets
answers again by itself.

Negative controls: ``on_error="raise"`` (no degradation) lets errors escape, and a client whose
waits overshoot their deadline by 40 ms breaks the p99 bound: the harness reports both.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reliability._harness import Counters, figure, fork_worker, scale, wait_until
from reliability._workers import ERR, HONEST_STRIDE, OK, WRONG, degrading_caller

from kalos_retrievers import Sidecar, _ipc

pytestmark = pytest.mark.reliability

DIM, N = 8, 200
TIMEOUT = 0.25
SLACK = 0.010  # the bound: deadline + 10 ms at p99
EPISODES = scale(3, 20)
CALLERS = 3
STOP_AT = 60


def run_faults(sc: Sidecar, restart: Callable[[], Sidecar], fault: str, episodes: int,
               seed: int, on_error: str = "empty") -> dict[str, Any]:  # fmt: skip
    rng = np.random.default_rng(seed)
    counters = Counters()
    bases = [k * HONEST_STRIDE for k in range(CALLERS)]
    callers = [fork_worker(degrading_caller, sc.name, DIM, N, counters, b, STOP_AT, TIMEOUT,
                           seed + b, on_error) for b in bases]  # fmt: skip
    violations: list[str] = []
    recovery: list[float] = []
    try:
        for b in bases:
            assert wait_until(lambda b=b: counters[b + OK] >= 20, 10.0), "a caller never got going"
        for e in range(episodes):
            time.sleep(float(rng.uniform(0, 0.05)))  # random point in the callers' queries
            errs = [counters[b + ERR] + counters[b + WRONG] for b in bases]  # failed calls
            if fault == "kill":
                sc.kill(signal.SIGKILL)
                assert sc.proc is not None
                sc.proc.wait()
            else:
                sc.kill(signal.SIGSTOP)
            try:
                # hold the fault until every caller has degraded at least twice
                seen = wait_until(lambda errs=errs: all(counters[b + ERR] + counters[b + WRONG] >= x + 2
                                                        for b, x in zip(bases, errs, strict=True)),
                                  10 * TIMEOUT + 3)  # fmt: skip
                if not seen:
                    violations.append(f"episode {e}: not every caller saw the fault")
            finally:
                if fault == "kill":
                    sc = restart()
                else:
                    sc.kill(signal.SIGCONT)
            t_back = time.monotonic()
            oks = [counters[b + OK] for b in bases]
            back = wait_until(lambda oks=oks: all(counters[b + OK] > x
                                                  for b, x in zip(bases, oks, strict=True)), 5.0)  # fmt: skip
            dt = time.monotonic() - t_back
            if not back:
                violations.append(f"episode {e}: callers did not recover within 5 s")
            recovery.append(dt)
    finally:
        counters[STOP_AT] = 1
        if fault == "stop":
            sc.kill(signal.SIGCONT)
        results = [w.result(30) for w in callers]
    degraded_s = np.array([d[1] for r in results for d in r["degraded"]], float) / 1e6
    ok_s = np.array([x for r in results for x in r["ok_us"]], float) / 1e6
    all_s = np.concatenate([degraded_s, ok_s])
    escaped = sum(r["n_escaped"] for r in results)
    if escaped:
        violations.append(f"{escaped} errors escaped the retrievers: "
                          f"{[r['escaped'] for r in results if r['escaped']][:2]}")  # fmt: skip
    p99_all = float(np.percentile(all_s, 99)) if len(all_s) else 0.0
    p99_deg = float(np.percentile(degraded_s, 99)) if len(degraded_s) else 0.0
    if p99_all > TIMEOUT + SLACK or p99_deg > TIMEOUT + SLACK:
        violations.append(f"p99 call time {p99_all * 1e3:.1f} ms (degraded calls: "
                          f"{p99_deg * 1e3:.1f} ms) exceeds the deadline {TIMEOUT * 1e3:.0f} ms "
                          f"+ {SLACK * 1e3:.0f} ms")  # fmt: skip
    if not escaped and not len(degraded_s):
        violations.append("no call degraded: the fault was never observed")
    return {
        "fault": fault, "episodes": episodes, "violations": violations, "calls": len(all_s),
        "degraded_calls": len(degraded_s), "p99_ms": round(p99_all * 1e3, 2),
        "p99_degraded_ms": round(p99_deg * 1e3, 2),
        "max_degraded_ms": round(float(degraded_s.max()) * 1e3, 2) if len(degraded_s) else None,
        "deadline_ms": TIMEOUT * 1e3, "recovery_max_s": round(max(recovery), 3) if recovery else None,
        "episodes_seen": [r["episodes"] for r in results],
    }  # fmt: skip


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_sidecar_fault_mid_query(launch: Callable[..., Sidecar], fault: str) -> None:
    sc = launch()
    out = run_faults(sc, lambda: launch(name=sc.name), fault, EPISODES, seed=3)
    figure(f"3 sidecar {fault} mid-query", **out)
    assert not out["violations"], out["violations"]
    assert all(n >= EPISODES for n in out["episodes_seen"]), out


def test_sidecar_fault_negative_control_no_degradation(launch: Callable[..., Sidecar]) -> None:
    sc = launch()
    out = run_faults(sc, lambda: launch(name=sc.name), "kill", 1, seed=4, on_error="raise")
    assert any("escaped the retrievers" in v for v in out["violations"]), out


def test_sidecar_fault_negative_control_overshooting_client(
    launch: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_wait = _ipc.wait
    monkeypatch.setattr(_ipc, "wait", lambda sem, timeout: real_wait(sem, timeout + 0.04))
    sc = launch()
    out = run_faults(sc, lambda: launch(name=sc.name), "stop", 1, seed=5)
    assert any("exceeds the deadline" in v for v in out["violations"]), out

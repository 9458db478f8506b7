"""Scenario 1: clients killed with SIGKILL at random points of a request.

Pass: each dead client's slot is reclaimed within 1 s (the free-slot count is back to its
baseline), an honest client keeps being served throughout (a success after every kill, no error,
no wrong answer), and the sidecar counts the reclaimed slots.

Negative control: the same harness against a sidecar whose reclaim is switched off fails.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reliability._harness import Counters, SegmentView, figure, fork_worker, scale, wait_until
from reliability._workers import (
    ERR,
    OK,
    WRONG,
    honest_recaller,
    kill_victim,
    load_dataset,
)

from kalos_retrievers import KalosClient, Sidecar
from kalos_retrievers.protocol import SlotState

pytestmark = pytest.mark.reliability

DIM, N = 8, 200
KILLS = scale(25, 200)
STOP_AT = 60  # counter index of the honest client's stop flag
STATE_NAMES = {v: k for k, v in vars(SlotState).items() if k.isupper()}


def run_client_kills(sc: Sidecar, n_kills: int, seed: int, reclaim_within: float = 1.0) -> dict[str, Any]:
    """Kill ``n_kills`` clients; return figures and the list of violations."""
    rng = np.random.default_rng(seed)
    violations: list[str] = []
    with KalosClient(sc.name, dim=DIM, spin_us=0) as admin:
        if admin.count(namespace="") == 0:
            load_dataset(admin, N, DIM)
        reclaimed0 = admin.stats()["reclaimed_slots"]
    counters = Counters()
    honest = fork_worker(honest_recaller, sc.name, DIM, N, counters, 0, seed, STOP_AT)
    view = SegmentView(sc.name)
    times: list[float] = []
    at_death: Counter[str] = Counter()
    try:
        assert wait_until(lambda: counters[OK] >= 20, 10.0), "the honest client never got going"
        baseline = view.free_slots()
        assert baseline == view.layout.n_slots - 1, f"baseline {baseline} free slots"
        for j in range(n_kills):
            r, w = os.pipe()
            victim = fork_worker(kill_victim, sc.name, DIM, N, seed * 1000 + j, w)
            os.close(w)
            ready, _, _ = select.select([r], [], [], 10.0)
            os.close(r)
            assert ready, f"kill {j}: the victim never connected"
            time.sleep(float(rng.uniform(0, 0.02)))  # the random kill point
            victim.kill(signal.SIGKILL)
            victim.wait()
            t_kill = time.monotonic()
            for i in view.slots_of(victim.pid):
                at_death[STATE_NAMES.get(int(view.states[i]), str(int(view.states[i])))] += 1
            ok_at_kill = counters[OK]
            back = wait_until(lambda: view.free_slots() == baseline, reclaim_within + 0.5)
            dt = time.monotonic() - t_kill
            if not back or dt > reclaim_within:
                violations.append(f"kill {j}: free slots {view.free_slots()} != baseline {baseline} "
                                  f"after {dt:.3f} s")  # fmt: skip
            else:
                times.append(dt)
            if not wait_until(lambda n=ok_at_kill: counters[OK] > n, 1.0):
                violations.append(f"kill {j}: the honest client was not served within 1 s")
            if sc.proc is not None and sc.proc.poll() is not None:
                violations.append(f"kill {j}: the sidecar exited ({sc.proc.returncode})")
                break
    finally:
        counters[STOP_AT] = 1
        honest_out = honest.result()
        view.close()
    if counters[ERR] or counters[WRONG]:
        violations.append(f"honest client: {counters[ERR]} errors {honest_out['errors'][:3]}, "
                          f"{counters[WRONG]} wrong answers")  # fmt: skip
    reclaimed = None
    if sc.proc is not None and sc.proc.poll() is None:
        with KalosClient(sc.name, dim=DIM, spin_us=0) as admin:
            reclaimed = admin.stats()["reclaimed_slots"] - reclaimed0
        if reclaimed < n_kills:
            violations.append(f"stats counted {reclaimed} reclaimed slots for {n_kills} kills")
    return {
        "kills": n_kills,
        "violations": violations,
        "reclaim_p50_s": float(np.percentile(times, 50)) if times else None,
        "reclaim_max_s": max(times) if times else None,
        "slot_state_at_death": dict(at_death),
        "honest_ok": counters[OK],
        "reclaimed_counted": reclaimed,
    }


def test_client_kill9_slots_reclaimed(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=8)
    out = run_client_kills(sc, KILLS, seed=1)
    figure("1 client kill -9", **out)
    assert not out["violations"], out["violations"]
    # the kills really landed inside requests (a request or an unread answer in the slot), not
    # only between them
    in_request = sum(v for k, v in out["slot_state_at_death"].items() if k != "CLAIMED")
    assert in_request > 0, out["slot_state_at_death"]


def test_client_kill9_negative_control_without_reclaim(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=8, patch="no_reclaim")
    out = run_client_kills(sc, 2, seed=2)
    assert any("!= baseline" in v for v in out["violations"]), out
    assert any("reclaimed slots" in v for v in out["violations"]), out

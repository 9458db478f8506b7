"""Scenario 7: the segment or semaphores are removed from outside while the sidecar runs (what
systemd's ``RemoveIPC=yes`` does when the service user's last session ends).

Pass, for each kind of removal (the segment, the doorbell, every semaphore, one response
semaphore, everything): the sidecar notices within 1 s and re-publishes (a new segment, the full
set of semaphores, ``stats()["republished"]`` counts it); retrievers degrade to empty context
meanwhile (no error escapes) and recover by themselves; a fresh client can use every slot; the
data is untouched.

Negative control: a sidecar that never notices (``_removed_from_outside`` switched off) fails
the same harness.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reliability._harness import (
    Counters,
    expected_ipc_objects,
    figure,
    fork_worker,
    ipc_objects,
    scale,
    segment_inode,
    wait_until,
)
from reliability._workers import HONEST_STRIDE, OK, dataset, degrading_caller, load_dataset

from kalos_retrievers import KalosClient, Sidecar

pytestmark = pytest.mark.reliability

DIM, N, SLOTS = 8, 200, 6
CYCLES = scale(2, 25)
STOP_AT = 60
KINDS = ["segment", "doorbell", "semaphores", "one-response-semaphore", "everything"]


def remove(name: str, kind: str, rng: np.random.Generator) -> list[str]:
    objs = sorted(ipc_objects(name))
    if kind == "segment":
        victims = [f"kalos-{name}"]
    elif kind == "doorbell":
        victims = [f"sem.kalos-{name}-bell"]
    elif kind == "semaphores":
        victims = [o for o in objs if o.startswith("sem.")]
    elif kind == "one-response-semaphore":
        victims = [f"sem.kalos-{name}-r{int(rng.integers(SLOTS))}"]
    else:
        victims = objs
    for v in victims:
        os.unlink(f"/dev/shm/{v}")
    return victims


def every_slot_usable(name: str, n: int) -> bool:
    """Fresh clients holding all ``n`` free slots at once: each one's slot and semaphore work."""
    data = dataset(N, DIM)
    clients = [KalosClient(name, dim=DIM, spin_us=0, timeout=2.0) for _ in range(n)]
    try:
        return all(c.recall(data[i], k=1).ids == [str(i)] for i, c in enumerate(clients))
    finally:
        for c in clients:
            c.close()


def run_removals(sc: Sidecar, kinds: list[str], cycles: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    name = sc.name
    with KalosClient(name, dim=DIM, spin_us=0) as c:
        load_dataset(c, N, DIM)
    counters = Counters()
    bases = [0, HONEST_STRIDE]
    callers = [fork_worker(degrading_caller, name, DIM, N, counters, b, STOP_AT, 0.25, seed + b)
               for b in bases]  # fmt: skip
    violations: list[str] = []
    detect: list[float] = []
    recover: list[float] = []
    done = 0
    try:
        for b in bases:
            assert wait_until(lambda b=b: counters[b + OK] >= 20, 10.0)
        for _ in range(cycles):
            for kind in kinds:
                inode0 = segment_inode(name)
                gone = remove(name, kind, rng)
                t0 = time.monotonic()
                back = wait_until(lambda inode0=inode0: ipc_objects(name) == expected_ipc_objects(name, SLOTS)
                                  and segment_inode(name) not in (None, inode0), 2.0)  # fmt: skip
                dt = time.monotonic() - t0
                if not back or dt > 1.0:
                    violations.append(f"{kind} ({gone[:2]}...): not re-published within 1 s "
                                      f"(/dev/shm: {sorted(ipc_objects(name))[:3]}...)")  # fmt: skip
                    continue
                detect.append(dt)
                oks = [counters[b + OK] for b in bases]
                t1 = time.monotonic()
                moved = wait_until(lambda oks=oks: all(counters[b + OK] > x
                                                       for b, x in zip(bases, oks, strict=True)), 3.0)  # fmt: skip
                if not moved:
                    violations.append(f"{kind}: the retrievers did not recover within 3 s")
                recover.append(time.monotonic() - t1)
                if not every_slot_usable(name, SLOTS - len(bases)):
                    violations.append(f"{kind}: a fresh client got a wrong answer")
                done += 1
    finally:
        counters[STOP_AT] = 1
        results = [w.result(30) for w in callers]
    escaped = sum(r["n_escaped"] for r in results)
    if escaped:
        violations.append(f"{escaped} errors escaped the retrievers: {results[0]['escaped']}")
    if sc.proc is not None and sc.proc.poll() is None:
        try:
            with KalosClient(name, dim=DIM, spin_us=0, timeout=2.0) as c:
                st = c.stats()
                if c.count() != N:
                    violations.append(f"{c.count()} rows after re-publishing, {N} before")
            if st["republished"] != done:
                violations.append(f"stats counted {st['republished']} re-publications, {done} happened")
        except Exception as e:
            violations.append(f"no sidecar to ask at the end: {e!r}")
    return {
        "removals": cycles * len(kinds), "violations": violations,
        "detect_max_s": round(max(detect), 3) if detect else None,
        "recover_max_s": round(max(recover), 3) if recover else None,
        "degraded_calls": sum(r["degraded_calls"] for r in results),
        "episodes": [r["episodes"] for r in results],
    }  # fmt: skip


def test_removed_ipc_is_republished(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=SLOTS)
    out = run_removals(sc, KINDS, CYCLES, seed=21)
    figure("7 IPC removed from outside", **out)
    assert not out["violations"], out["violations"]


def test_removed_ipc_negative_control_never_noticed(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=SLOTS, patch="no_republish")
    out = run_removals(sc, ["segment"], 1, seed=22)
    assert any("not re-published" in v for v in out["violations"]), out

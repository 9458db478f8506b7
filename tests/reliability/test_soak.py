"""Scenario 13: soak.

Mixed load (16 client processes: checked recalls, upserts, gets, deletes, counts) for the
configured time, then N connect/recall/close cycles.

Pass: zero errors and zero wrong answers; the sidecar's RSS and open descriptors (from
/proc/PID/status and /proc/PID/fd) at the end at most 5% above their level after warm-up (a
leak grows; one descriptor in use at the warm-up sample and closed by the end is not one); the
cycling client's own descriptors and RSS the same way; /dev/shm holds exactly the sidecar's
objects throughout and nothing once it stopped.

Negative controls: a client that never closes (``_Conn.close`` switched off) and a sidecar that
keeps every response (a deliberate leak) both fail the same harness.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from reliability._harness import (
    Counters,
    expected_ipc_objects,
    figure,
    fork_worker,
    ipc_objects,
    proc_fds,
    proc_rss_kb,
    scale,
)
from reliability._workers import (
    ERR,
    HONEST_STRIDE,
    OK,
    WRONG,
    connect_cycles,
    load_dataset,
    mixed_client,
)

from kalos_retrievers import KalosClient, Sidecar
from kalos_retrievers.client import _Conn

pytestmark = pytest.mark.reliability

DIM, N, SLOTS, CLIENTS = 8, 200, 24, 16
DURATION = scale(12.0, 600.0)
CYCLES = scale(1000, 10_000)
TOLERANCE = 0.05
STOP_AT = 200


def _within(base: float, end: float) -> bool:
    """Whether ``end`` grew at most TOLERANCE above ``base``."""
    return end - base <= TOLERANCE * base


def run_soak(sc: Sidecar, duration: float, cycles: int, seed: int, cycle_timeout: float = 5.0) -> dict[str, Any]:
    assert sc.pid is not None
    pid, name = sc.pid, sc.name
    bad: list[str] = []
    with KalosClient(name, dim=DIM, spin_us=0) as c:
        load_dataset(c, N, DIM)
    want_shm = expected_ipc_objects(name, SLOTS)
    counters = Counters(256)
    bases = [w * HONEST_STRIDE for w in range(CLIENTS)]
    workers = [fork_worker(mixed_client, name, DIM, N, w, counters, b, STOP_AT, seed + w)
               for w, b in enumerate(bases)]  # fmt: skip
    samples: list[tuple[float, int, int]] = []
    t0 = time.monotonic()
    base = None
    try:
        while time.monotonic() - t0 < duration:
            time.sleep(0.25)  # the sampling period, not a synchronisation
            samples.append((time.monotonic() - t0, proc_rss_kb(pid), proc_fds(pid)))
            if base is None and time.monotonic() - t0 >= max(1.0, 0.2 * duration):
                base = samples[-1]
            if ipc_objects(name) != want_shm:
                bad.append(f"/dev/shm changed under load: {sorted(ipc_objects(name) ^ want_shm)}")
                break
    finally:
        counters[STOP_AT] = 1
        outs = [w.result(60) for w in workers]
    errs = sum(counters[b + ERR] for b in bases)
    wrong = sum(counters[b + WRONG] for b in bases)
    ops = sum(counters[b + OK] for b in bases)
    if errs or wrong:
        bad.append(f"mixed load: {errs} errors {[o['errors'][:1] for o in outs if o['errors']][:3]}, "
                   f"{wrong} wrong answers")  # fmt: skip
    cyc = fork_worker(connect_cycles, name, DIM, N, cycles, seed, cycle_timeout).result(60 + cycles)
    if cyc["n_errors"] or cyc["wrong"]:
        bad.append(f"connect cycles: {cyc['n_errors']} errors {cyc['errors'][:2]}, {cyc['wrong']} wrong")
    (cf0, cf1), (cr0, cr1) = cyc["fds"], cyc["rss_kb"]
    if not _within(cf0, cf1) or not _within(cr0, cr1):
        bad.append(f"the cycling client grew: fds {cf0} -> {cf1}, RSS {cr0} -> {cr1} kB")
    assert base is not None
    end = (time.monotonic() - t0, proc_rss_kb(pid), proc_fds(pid))
    if not _within(base[1], end[1]):
        bad.append(f"sidecar RSS {base[1]} kB after warm-up, {end[1]} kB at the end")
    if not _within(base[2], end[2]):
        bad.append(f"sidecar fds {base[2]} after warm-up, {end[2]} at the end")
    if ipc_objects(name) != want_shm:
        bad.append(f"/dev/shm after the cycles: {sorted(ipc_objects(name) ^ want_shm)}")
    return {
        "duration_s": duration, "clients": CLIENTS, "mixed_ops": ops, "cycles": cycles,
        "violations": bad, "sidecar_rss_kb": (base[1], end[1], max(s[1] for s in samples)),
        "sidecar_fds": (base[2], end[2]), "client_fds": cyc["fds"], "client_rss_kb": cyc["rss_kb"],
    }  # fmt: skip


def test_soak_mixed_load_then_connect_cycles(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=SLOTS)
    out = run_soak(sc, DURATION, CYCLES, seed=41)
    sc.stop()
    leftover = ipc_objects(sc.name)
    figure("13 soak", **out, leftover_shm=sorted(leftover))
    assert not out["violations"], out["violations"]
    assert not leftover, leftover


def test_soak_negative_control_client_never_closes(
    launch: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    sc = launch(slots=SLOTS)
    monkeypatch.setattr(_Conn, "close", lambda self: None)  # inherited by the forked workers
    out = run_soak(sc, 1.5, 36, seed=42, cycle_timeout=0.2)
    assert any("the cycling client grew" in v for v in out["violations"]), out
    assert any("connect cycles" in v for v in out["violations"]), out


def test_soak_negative_control_sidecar_leaks(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=SLOTS, patch="leak_responses")
    out = run_soak(sc, 4.0, 50, seed=43)
    assert any("sidecar RSS" in v for v in out["violations"]), out

"""Waiting for long answers: the client sleeps through most of the expected wait and spins across
the expected answer; the sidecar sleeps between requests. Correctness, deadlines, death
detection and idle CPU, against a real sidecar process.

A client's expected wait is learnt from its recalls; the tests set it (``_typical_wait_ns``)
before each call to force one path or the other on a small, fast index.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kalos_retrievers import KalosClient, SidecarTimeout, SidecarUnavailable

DIM = 16
MS = 1_000_000


def loaded(sc, n: int = 500) -> tuple[KalosClient, np.ndarray]:
    data = np.random.default_rng(0).standard_normal((n, DIM)).astype(np.float32)
    c = KalosClient(sc.name, dim=DIM, spin_us=300, timeout=5.0)
    c.upsert([str(i) for i in range(n)], data)
    return c, data


def best(data: np.ndarray, q: np.ndarray) -> str:
    d = data / np.linalg.norm(data, axis=1, keepdims=True)
    return str(int(np.argmax(d @ q)))


def test_an_early_answer_wakes_a_client_sleeping_through_a_long_expected_wait(start_sidecar) -> None:
    c, data = loaded(start_sidecar(dim=DIM))
    took = []
    with c:
        for i in range(30):
            c._typical_wait_ns = 50 * MS  # expects 50 ms: would sleep ~49 ms if nothing woke it
            t0 = time.monotonic()
            assert c.recall(data[i], k=1).ids == [best(data, data[i])]
            took.append(time.monotonic() - t0)
    assert np.median(took) < 0.02, took


def test_answers_seen_by_spinning_leave_no_confusion_behind(start_sidecar) -> None:
    """Spinning across the expected answer sees it before its semaphore post is taken: the post
    stays behind and the next call must drain it, not mistake it for its own answer."""
    c, data = loaded(start_sidecar(dim=DIM))
    with c:
        c._margin_ns = lambda typical: typical  # type: ignore[method-assign]  # wake at once, spin
        for i in range(200):
            c._typical_wait_ns = 50 * MS if i % 3 else 0  # mix the long-wait and short-spin paths
            q = data[(7 * i) % len(data)]
            assert c.recall(q, k=1).ids == [best(data, q)]
        assert all(s.sem.value <= 1 for s in c._conn.owned)


def test_sleeping_through_an_expected_wait_keeps_the_deadline(start_sidecar) -> None:
    sc = start_sidecar(dim=DIM)
    c, data = loaded(sc)
    with c:
        os.kill(sc.pid, signal.SIGSTOP)
        try:
            c._typical_wait_ns = 10_000 * MS  # expects 10 s, far past the deadline
            t0 = time.monotonic()
            with pytest.raises(SidecarTimeout):
                c.recall(data[0], k=1, timeout=0.25)
            assert 0.24 <= time.monotonic() - t0 < 0.25 + 0.1
        finally:
            os.kill(sc.pid, signal.SIGCONT)
        assert c.recall(data[1], k=1, timeout=2).ids == [best(data, data[1])]


def test_a_sidecar_killed_while_the_client_sleeps_is_noticed_at_once(start_sidecar) -> None:
    sc = start_sidecar(dim=DIM)
    c, data = loaded(sc)
    with c:
        os.kill(sc.pid, signal.SIGSTOP)  # the request stays unanswered...
        killer = threading.Timer(0.15, lambda: sc.kill(signal.SIGKILL))  # ...until it dies
        c._typical_wait_ns = 10_000 * MS  # the client expects to sleep 10 s
        t0 = time.monotonic()
        killer.start()
        try:
            with pytest.raises(SidecarUnavailable):
                c.recall(data[0], k=1, timeout=5)
        finally:
            killer.join()
        assert 0.15 <= time.monotonic() - t0 < 0.6  # by the lock, not at the deadline nor at 10 s
    assert sc.proc is not None and sc.proc.wait(5) == -signal.SIGKILL
    start_sidecar(dim=DIM, name=sc.name)  # removes what the killed sidecar left in /dev/shm


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_sidecar_sleeps_after_paced_and_back_to_back_traffic(start_sidecar) -> None:
    sc = start_sidecar(dim=DIM)
    c, data = loaded(sc)
    with c:
        for i in range(60):  # a client that thinks 5 ms between recalls: the sidecar learns it
            c.recall(data[i], k=1)
            time.sleep(0.005)
        for i in range(500):
            c.recall(data[i], k=1)
        time.sleep(0.5)
        cpu0, t0 = _cpu_seconds(sc.pid), time.monotonic()
        time.sleep(1.0)
        share = (_cpu_seconds(sc.pid) - cpu0) / (time.monotonic() - t0)
    assert share < 0.1, f"idle sidecar used {100 * share:.0f}% of a core"

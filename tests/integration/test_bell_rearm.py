"""The serve loop's starts of the resident kernel on idle (``KALOS_BELL_REARM_MS``; the policy
itself: tests/unit/test_doorbell_policy.py), through the real loop, its passes and its sleep.

In process (``serving``): a CPU sidecar whose index stands in for one with a resident kernel
(a capability, a running flag, starts recorded, a write stopping it as the GPU index's does).
Its clients ask for documents inline, so they never ring the stand-in, which answers nothing.
The GPU test of the same is tests/gpu/test_gpu_doorbell.py
(``test_a_write_between_recalls_leaves_the_kernel_running_for_the_next``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import serving, unique_name
from kalos_retrievers.sidecar.server import ServeConfig, Server

from kalos_retrievers import KalosClient

pytestmark = pytest.mark.timeout(60)

DIM, ROWS = 11, 37


def stand_in(srv: Server) -> list[float]:
    """Make ``srv``'s CPU index look like one with a resident kernel, running; returns the list
    its starts are appended to (their time.monotonic())."""
    idx: Any = srv.service.index  # type: ignore[union-attr]
    starts: list[float] = []
    set_rows = idx.set_rows

    def resume(*_: object) -> None:
        starts.append(time.monotonic())
        idx.doorbell_running = True

    def pause() -> None:
        idx.doorbell_running = False

    def write(*a: object) -> None:  # (the GPU index stops its kernel before rows change)
        idx.pause_doorbell()
        set_rows(*a)

    idx.resume_doorbell, idx.pause_doorbell, idx.set_rows = resume, pause, write
    idx.doorbell_served = lambda: 0
    idx.doorbell_k = 16
    idx.doorbell_running = True
    return starts


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The sidecar; ``spin_us`` from the test's parameter ``spin_us`` if it has one (0: the loop
    never spins, so between requests it sleeps its longest, 50 ms, unless cut short)."""
    spin = getattr(request, "param", 1000.0)
    cfg = ServeConfig(name=unique_name("rearm"), dim=DIM, metric="ip", device="cpu", slots=4, spin_us=spin)
    with serving(cfg) as srv:
        yield srv


@pytest.mark.parametrize("server", [0.0], indirect=True)
@pytest.mark.parametrize("rearm_ms", [1.0, 0.0], ids=["rearm", "control"])
def test_a_write_that_stops_the_kernel_is_followed_by_a_start_a_millisecond_later(
    server: Server, monkeypatch: pytest.MonkeyPatch, rearm_ms: float
) -> None:
    """A write's pass stops the kernel; once the sidecar has been idle 1 ms the loop starts it
    again: within a few ms, not at the end of the loop's sleep (a loop that does not spin
    sleeps 50 ms: the sleep is cut short for it). Control: ``KALOS_BELL_REARM_MS=0``, no
    start in 200 ms."""
    import kalos_retrievers.sidecar.server as server_module

    monkeypatch.setattr(server_module, "BELL_REARM_NS", int(rearm_ms * 1e6))
    rng = np.random.default_rng()
    with KalosClient(server.cfg.name, dim=DIM, arena_docs=False) as c:
        c.upsert([str(i) for i in range(ROWS)], rng.standard_normal((ROWS, DIM)).astype(np.float32))
        time.sleep(0.1)  # (the loop asleep, as between an agent's turns)
        starts = stand_in(server)
        c.upsert(["w"], rng.standard_normal((1, DIM)).astype(np.float32))  # stops the kernel
        t_write = time.monotonic()
        time.sleep(0.2)
    if not rearm_ms:
        assert starts == []
        return
    assert len(starts) == 1, starts  # once (one stop)
    assert starts[0] - t_write < 0.02, f"started {1000 * (starts[0] - t_write):.1f} ms after the write"


def test_writes_alone_restart_a_kernel_that_answers_nothing_once(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes alone, each after a pause, to a kernel that answers nothing: the first stop is
    followed by a start (the kernel might have been about to answer), the later ones not: two
    runs in a row answered nothing (BELL_FRUITLESS_MAX)."""
    import kalos_retrievers.sidecar.server as server_module

    monkeypatch.setattr(server_module, "BELL_REARM_NS", 1_000_000)
    rng = np.random.default_rng()
    with KalosClient(server.cfg.name, dim=DIM, arena_docs=False) as c:
        c.upsert([str(i) for i in range(ROWS)], rng.standard_normal((ROWS, DIM)).astype(np.float32))
        time.sleep(0.05)
        starts = stand_in(server)
        for i in range(5):
            c.upsert([f"w{i}"], rng.standard_normal((1, DIM)).astype(np.float32))
            time.sleep(0.03)
    assert server_module.BELL_FRUITLESS_MAX == 2 and len(starts) == 1, starts


def test_the_stats_count_the_kernels_declines_and_learns(server: Server) -> None:
    """The index's stats show the dispatcher's counts of scoped recalls the resident kernel
    handed back (``doorbell_declines``, which its start's back-off counted, and
    ``doorbell_learns``, while its table filled up) where the index offers a kernel; a CPU
    index, which offers none, shows neither (the negative control)."""
    with KalosClient(server.cfg.name, dim=DIM, arena_docs=False) as c:
        assert "doorbell_declines" not in c.stats()["index"] and "doorbell_learns" not in c.stats()["index"]
        stand_in(server)
        d: Any = server.dispatcher
        d.kernel_declines, d.kernel_learns = 3, 5
        idx = c.stats()["index"]
        assert (idx["doorbell_declines"], idx["doorbell_learns"]) == (3, 5)

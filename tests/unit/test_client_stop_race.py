"""A sidecar that stops answers what it holds, then says so (header state STOPPING). A client
thread that was between its wait and its "is the sidecar alive?" check when that happened must
take the answer in its slot, not report the recall lost ("stopped during the call"). On a
loaded 2-core host tests/integration/test_crowd_serve.py failed 2-4 runs in 10 that way
(session 41). Here the interleaving is forced: the wait gives up (or the check comes) and
the answer and the stop land before the check.

Each case has its negative control: the same stop with no answer written raises
SidecarUnavailable, as before."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kalos_retrievers.client as client_module
from kalos_retrievers.client import KalosClient
from kalos_retrievers.errors import SidecarUnavailable
from kalos_retrievers.protocol import CAR_DONE, CAR_TAKEN, W_STATE, SlotState

pytestmark = pytest.mark.timeout(30)


def _client() -> KalosClient:
    return KalosClient("kalos-unit-stoprace", dim=4, spin_us=0, lazy=True)


def _conn(alive: list[bool]) -> Any:
    return SimpleNamespace(dead=False, closing=False, sidecar_alive=lambda: alive[0], carousel_epoch=lambda: 1,
                           wait_slot=lambda slot, timeout: client_module._ipc.wait(slot.sem, timeout))  # fmt: skip


@pytest.mark.parametrize("answered", [True, False])
def test_an_answer_written_as_the_wait_gives_up_and_the_sidecar_stops_is_taken(
        answered: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``_block``: the semaphore wait times out; meanwhile the sidecar answered the slot (its
    post came too late for the wait) and said it stops."""
    slot = SimpleNamespace(state=np.array([SlotState.BUSY], np.uint32), sem=object(), pending=0)
    alive = [True]

    def wait(sem: object, timeout: float) -> bool:
        if answered:
            slot.state[0] = SlotState.RESPONSE
        alive[0] = False
        return False

    monkeypatch.setattr(client_module._ipc, "wait", wait)
    c = _client()
    try:
        conn = _conn(alive)
        if answered:
            assert c._block(conn, slot, 7, time.monotonic() + 10) is True
            assert slot.pending == 0
        else:
            with pytest.raises(SidecarUnavailable, match="stopped during the call"):
                c._block(conn, slot, 7, time.monotonic() + 10)
            slot.seq = 7  # (the caller's _release marks the slot; _block leaves it to it)
            c._release(SimpleNamespace(free=[]), slot)  # type: ignore[arg-type]
            assert slot.pending == 7
    finally:
        c.close()


@pytest.mark.parametrize("answered", [True, False])
def test_a_direct_answer_written_before_the_sidecar_said_it_stops_is_returned(
        answered: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``_wait_direct``: the slot read TAKEN; before the check of the sidecar's life the
    carousel answered (DONE) and the sidecar said it stops."""
    w = np.zeros(8, np.uint32)
    w[W_STATE] = CAR_TAKEN
    alive = [True]

    def check() -> bool:
        if answered:
            w[W_STATE] = CAR_DONE
        alive[0] = False
        return False

    conn = SimpleNamespace(dead=False, sidecar_alive=check, carousel_epoch=lambda: 1)
    c = _client()
    try:
        t_sent = time.monotonic_ns() - 10 * client_module._DIRECT_CHECK_NS  # (the check is due at once)
        if answered:
            assert c._wait_direct(conn, w, 1, time.monotonic() + 10, t_sent) == CAR_DONE
        else:
            with pytest.raises(SidecarUnavailable, match="stopped during the call"):
                c._wait_direct(conn, w, 1, time.monotonic() + 10, t_sent)
    finally:
        c.close()

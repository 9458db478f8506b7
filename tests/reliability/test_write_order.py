"""A client's writes are done in the order it made them, also after one was left unanswered.

A write left by an interrupt (or given up at its deadline once the sidecar took it) stays in
its slot, in the sidecar's hands; the sidecar takes waiting slots in slot order, so the client's
next write, in a lower slot, was done first: an upsert interrupted (Ctrl-C) during a pause, then
a delete of its id, and after the pause the id was back. A write now waits for the client's
earlier ones to be answered (or raises ``SidecarTimeout`` without being sent). Each test pins
the order that showed the bug (the interrupted write in the higher slot) and runs against the
old behaviour as its control (``_await_earlier_writes`` replaced by a no-op).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kalos_retrievers.client as client_module
from kalos_retrievers import KalosClient, Sidecar, SidecarTimeout, _ipc

pytestmark = pytest.mark.timeout(120)

V = np.array([[1.0, 0.5, 0.25]], np.float32)


@pytest.fixture(params=["fixed", "control"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "control":  # the old client: a write is sent whatever waits before it
        monkeypatch.setattr(client_module.KalosClient, "_await_earlier_writes", lambda *a: None)
    return str(request.param)


@pytest.fixture
def two_slots(start_sidecar: Callable[..., Sidecar]) -> Iterator[tuple[Sidecar, KalosClient]]:
    """A sidecar of two slots and a client holding both, the next call taking slot 1."""
    sc = start_sidecar(dim=3, slots=2)
    c = sc.client(timeout=5.0)
    c.upsert(["a"], V, texts=["first"])
    conn = c._conn
    assert conn is not None
    while len(conn.owned) < 2:
        slot = conn.claim()
        assert slot is not None
        conn.free.append(slot)
    conn.free.sort(key=lambda s: s.index)  # (pop() takes the last: slot 1, then slot 0)
    try:
        yield sc, c
    finally:
        os.kill(sc.pid, signal.SIGCONT)  # type: ignore[arg-type]
        c.close()


def _interrupt_an_upsert(sc: Sidecar, c: KalosClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the sidecar paused, an upsert of "a" interrupted (KeyboardInterrupt, as Ctrl-C's)
    right after its request was written: left in slot 1 with its deadline seconds away."""
    real = _ipc.post

    def interrupted(sem: object) -> None:
        monkeypatch.setattr(_ipc, "post", real)
        raise KeyboardInterrupt

    os.kill(sc.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    monkeypatch.setattr(_ipc, "post", interrupted)
    with pytest.raises(KeyboardInterrupt):
        c.upsert(["a"], V, texts=["interrupted"])
    assert c._conn is not None and [s.index for s in c._conn.owned if s.pending] == [1]


def test_a_delete_after_an_interrupted_upsert_is_done_after_it(
    two_slots: tuple[Sidecar, KalosClient], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sc, c = two_slots
    _interrupt_an_upsert(sc, c, monkeypatch)
    threading.Timer(0.4, os.kill, (sc.pid, signal.SIGCONT)).start()
    assert c.delete(["a"]) == 1  # (asked during the pause; answered after it)
    time.sleep(0.3)  # (the control: the upsert, taken after the delete, is done by now)
    got = [r.text for r in c.get(["a"])]
    assert got == ([] if mode == "fixed" else ["interrupted"])  # the control: the deleted id is back


def test_a_write_not_sent_in_time_says_so(
    two_slots: tuple[Sidecar, KalosClient], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sc, c = two_slots
    _interrupt_an_upsert(sc, c, monkeypatch)
    match = r"delete: not sent: 1 earlier write\(s\) of this client" if mode == "fixed" else "deadline"
    with pytest.raises(SidecarTimeout, match=match):
        c.delete(["a"], timeout=0.3)
    os.kill(sc.pid, signal.SIGCONT)  # type: ignore[arg-type]
    time.sleep(0.3)
    assert [r.text for r in c.get(["a"])] == ["interrupted"]  # (the control's delete expired unread)

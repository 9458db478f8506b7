"""A client gives back the slots it claimed for calls made at once, or that a stall held up,
once they sit idle (``client._trim_idle``), so that other processes (and ``kalos-sidecar
status``) find free slots without waiting for that client's next call. Each test has a
negative control: with the trim put off (``_TRIM_AFTER`` of an hour) the slots stay held and
another process's call finds none."""

from __future__ import annotations

import mmap
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import posix_ipc
import pytest

import kalos_retrievers.client as client_module
from kalos_retrievers import KalosClient, Sidecar, SidecarBusy, SidecarTimeout
from kalos_retrievers.protocol import HEADER_SIZE, SlotState, decode_header, segment_name

pytestmark = pytest.mark.timeout(120)


def _states(name: str) -> list[int]:
    shm = posix_ipc.SharedMemory(segment_name(name))
    try:
        mm = mmap.mmap(shm.fd, shm.size)
        lay = decode_header(mm[:HEADER_SIZE], shm.size).layout
        out = [int.from_bytes(mm[lay.slot_offset(i) : lay.slot_offset(i) + 4], "little") for i in range(lay.n_slots)]
        mm.close()
        return out
    finally:
        shm.close_fd()


def _until(cond: Callable[[], bool], within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _others_can_take(name: str, n: int) -> bool:
    """Whether a client of its own (another process's, as far as the segment is concerned)
    can claim ``n`` slots: the most calls it could have in flight at once."""
    with KalosClient(name, timeout=0.5, max_slots=n) as other:
        other.ping()  # (connected, holding one)
        conn = other._conn
        assert conn is not None
        with other._lock:
            while len(conn.owned) < n and conn.claim() is not None:
                pass
        return len(conn.owned) >= n


@pytest.mark.parametrize("trim", ["on", "off (control)"])
def test_slots_claimed_for_concurrent_calls_go_back_once_idle(
    launch: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch, trim: str
) -> None:
    """Five threads recall at once through one client of a 7-slot sidecar (it claims five
    slots); once they are done and the client idles, it keeps one and gives four back: five
    calls at once from another client all find slots."""
    if trim != "on":
        monkeypatch.setattr(client_module, "_TRIM_AFTER", 3600.0)
    sc = launch(slots=7)
    with KalosClient(sc.name, timeout=5, max_slots=5) as c:
        c.upsert([f"r{i}" for i in range(9)], np.eye(9, 8, dtype=np.float32) + 0.1)
        barrier = threading.Barrier(5)
        hold = threading.Event()

        def busy() -> None:
            barrier.wait()
            c.recall(np.ones(8, np.float32), k=3)

        orig_release = c._release

        def slow_release(conn, slot):  # type: ignore[no-untyped-def]
            hold.wait(5)  # (every call holds its slot until all five have claimed one)
            orig_release(conn, slot)

        c._release = slow_release  # type: ignore[method-assign]
        threads = [threading.Thread(target=busy) for _ in range(5)]
        for t in threads:
            t.start()
        assert _until(lambda: c._conn is not None and len(c._conn.owned) == 5, 10)
        hold.set()
        for t in threads:
            t.join()
        c._release = orig_release  # type: ignore[method-assign]
        assert c._conn is not None
        if trim == "on":
            assert _until(lambda: len(c._conn.owned) == 1, 3), len(c._conn.owned)  # type: ignore[union-attr]
            assert _states(sc.name).count(SlotState.FREE) == 6
            assert _others_can_take(sc.name, 5)
            assert c.recall(np.ones(8, np.float32), k=2).ids  # (its one slot still works)
        else:
            time.sleep(0.6)
            assert len(c._conn.owned) == 5 and _states(sc.name).count(SlotState.FREE) == 2
            assert not _others_can_take(sc.name, 5)


@pytest.mark.parametrize("trim", ["on", "off (control)"])
def test_slots_a_stall_held_up_go_back_without_another_call(
    launch: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch, trim: str
) -> None:
    """Six recalls at once time out on a paused sidecar (each leaves its slot held up, its
    request unanswered); the sidecar resumes and answers them; the client makes no other
    call, yet within a second it holds one slot and the segment's others are free."""
    if trim != "on":
        monkeypatch.setattr(client_module, "_TRIM_AFTER", 3600.0)
    sc = launch(slots=7)
    with KalosClient(sc.name, timeout=5, max_slots=6) as c:
        c.upsert(["a"], np.ones((1, 8), np.float32))
        sc.kill(signal.SIGSTOP)
        try:
            errors: list[BaseException] = []

            def stalled() -> None:
                try:
                    c.recall(np.ones(8, np.float32), k=1, timeout=0.3)
                except SidecarTimeout as e:
                    errors.append(e)

            threads = [threading.Thread(target=stalled) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(errors) == 6 and c._conn is not None and len(c._conn.owned) == 6
        finally:
            sc.kill(signal.SIGCONT)
        conn = c._conn
        if trim == "on":
            assert _until(lambda: len(conn.owned) == 1, 5), len(conn.owned)
            assert _until(lambda: _states(sc.name).count(SlotState.FREE) == 6, 2), _states(sc.name)
            assert _others_can_take(sc.name, 6)
        else:
            time.sleep(1.0)
            assert len(conn.owned) == 6 and not _others_can_take(sc.name, 6)
        assert c.recall(np.ones(8, np.float32), k=1).ids == ["a"]


def test_a_client_out_of_its_own_slots_says_max_slots(launch: Callable[..., Sidecar]) -> None:
    """SidecarBusy names the limit that was hit: this client's max_slots (the segment had free
    slots), not the sidecar's --slots (said when the segment had none: the control)."""
    sc = launch(slots=5)
    with KalosClient(sc.name, timeout=5, max_slots=1) as c, KalosClient(sc.name, timeout=5, max_slots=5) as other:
        c.ping()
        slot = c._acquire(c._conn, time.monotonic() + 1)  # type: ignore[arg-type]  # (its only slot, held)
        with pytest.raises(SidecarBusy, match=r"hold all of its max_slots=1 slots"):
            c.ping(timeout=0.2)
        c._release(c._conn, slot)  # type: ignore[arg-type]
        other.ping()
        with other._lock:
            while other._conn.claim() is not None:  # type: ignore[union-attr]
                pass
        grab = other._conn.free.pop()  # type: ignore[union-attr]  # (every slot of the segment now taken)
        with KalosClient(sc.name, timeout=0.3) as third, pytest.raises(SidecarBusy, match=r"5 slots are all in use"):
            third.ping()
        other._conn.free.append(grab)  # type: ignore[union-attr]


def test_a_call_that_claims_a_slot_when_no_thread_can_start_still_answers(
    launch: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle timer is a thread; where none can start (at interpreter exit, a thread
    limit), a call claiming a second slot answers all the same (no RuntimeError in its
    place, no slot lost), and the client just keeps its slots."""
    sc = launch(slots=5)
    with KalosClient(sc.name, timeout=5) as c:
        c.upsert(["a"], np.ones((1, 8), np.float32))

        def no_thread(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Timer, "start", no_thread)
        held = c._acquire(c._conn, time.monotonic() + 1)  # type: ignore[arg-type]  # (the first slot, busy)
        assert c.recall(np.ones(8, np.float32), k=1).ids == ["a"]  # (claims a second: arms, fails, answers)
        c._release(c._conn, held)  # type: ignore[arg-type]
        assert c._trim is None and len(c._conn.owned) == 2  # type: ignore[union-attr]


def test_a_call_waiting_for_a_slot_when_its_client_closes_says_closed_not_gone(
    launch: Callable[..., Sidecar],
) -> None:
    """A call waiting for one of its client's slots when another thread closes the client
    ends with "closed during the call" (KalosError), not SidecarUnavailable ("went away"),
    which adapters count as an outage of the sidecar; the sidecar is fine meanwhile."""
    from kalos_retrievers import KalosError, SidecarUnavailable

    sc = launch(slots=5)
    c = KalosClient(sc.name, timeout=5, max_slots=1)
    c.ping()
    held = c._acquire(c._conn, time.monotonic() + 1)  # type: ignore[arg-type]  # (its one slot, busy)
    got: list[BaseException] = []

    def waiting() -> None:
        try:
            c.ping(timeout=3)
        except KalosError as e:
            got.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(0.2)
    c.close()
    t.join(5)
    assert len(got) == 1 and not isinstance(got[0], SidecarUnavailable), got
    assert "closed during the call" in str(got[0])
    del held
    with KalosClient(sc.name) as other:
        assert other.ping() > 0

"""A stopping signal that lands while the sidecar creates its IPC objects (a supervisor's stop,
``Sidecar(startup_timeout=...)`` giving up) leaves none of them behind: each is created and
recorded where ``Server.close`` finds it with the signal held (``Server.signals_held``).

Each case runs ``kalos-sidecar serve`` in a child process that sends itself SIGTERM during the
segment's reservation (``Segment.create`` removes what it made), right after the segment is
made, after a semaphore is, or after the document arena is; the negative control runs the
last three with the hold turned off and finds the object left in /dev/shm.
"""

from __future__ import annotations

import glob
import subprocess
import sys
from collections.abc import Callable

import pytest
from reliability._harness import cleanup_ipc

pytestmark = pytest.mark.reliability

SCRIPT = r"""
import contextlib, os, signal, sys
from kalos_retrievers import _ipc
from kalos_retrievers.sidecar import cli, server

name, where, hold = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if where == "reserve":
    real = os.posix_fallocate
    def falloc(fd, off, size):
        os.kill(os.getpid(), signal.SIGTERM)  # during the reservation: Segment.create undoes it
        return real(fd, off, size)
    _ipc.os.posix_fallocate = falloc
elif where in ("segment", "arena"):
    real_create = _ipc.Segment.create
    def create(seg_name, size):
        seg = real_create(seg_name, size)
        if where == "segment" or "-docs." in seg_name:
            os.kill(os.getpid(), signal.SIGTERM)  # made, not yet recorded as the server's
        return seg
    _ipc.Segment.create = create
    if where == "arena":
        os.environ["KALOS_ARENA"] = "1"  # (a CPU sidecar makes its document arena then)
else:
    real_sem, made = _ipc.create_semaphore, []
    def create_semaphore(sem_name):
        sem = real_sem(sem_name)
        made.append(sem)
        if len(made) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return sem
    _ipc.create_semaphore = create_semaphore
if not hold:
    server.Server.signals_held = lambda self: contextlib.nullcontext()
sys.exit(cli.main(["serve", "--name", name, "--dim", "8", "--device", "cpu", "--slots", "5"]))
"""


def _left(name: str) -> list[str]:
    return sorted(p for p in glob.glob("/dev/shm/*") if name in p)


@pytest.mark.parametrize("where", ["reserve", "segment", "semaphore", "arena"])
def test_a_stop_while_the_ipc_objects_are_made_leaves_none(where: str, make_name: Callable[[], str]) -> None:
    name = make_name()
    try:
        p = subprocess.run([sys.executable, "-P", "-c", SCRIPT, name, where, "1"], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
        assert "stopped while starting" in p.stderr
        assert _left(name) == []
    finally:
        cleanup_ipc(name)


@pytest.mark.parametrize("where", ["segment", "semaphore", "arena"])
def test_control_without_the_hold_an_object_is_left(where: str, make_name: Callable[[], str]) -> None:
    name = make_name()
    try:
        p = subprocess.run([sys.executable, "-P", "-c", SCRIPT, name, where, "0"], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert "stopped while starting" in p.stderr
        assert _left(name), p.stderr[-2000:]
    finally:
        cleanup_ipc(name)


def test_a_stop_signal_landing_inside_the_first_ones_handler_is_ignored() -> None:
    """A second SIGTERM that lands while the first one's handler is inside ``Event.set()``
    runs the handler again on the same thread; its ``set()`` waited forever for the lock the
    first held (a burst of 200 SIGTERMs 20 µs apart hung 17 sidecars of 20). The handler now
    returns at once after the first. The event below runs the handler again from inside
    ``set()``, as such a signal would, and fails if ``set()`` is entered twice."""
    import signal
    import threading

    from kalos_retrievers.sidecar.server import Server

    server = Server.__new__(Server)
    entered: list[int] = []

    class Reentered(threading.Event):
        def set(self) -> None:
            assert not entered, "Event.set() entered again while the first held its lock"
            entered.append(1)
            server._on_signal(signal.SIGTERM, None)  # (the second signal, mid-set)
            super().set()

    server._stop, server.bell, server._signalled = Reentered(), None, False
    server._on_signal(signal.SIGTERM, None)
    assert server._stop.is_set() and entered == [1]

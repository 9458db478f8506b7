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

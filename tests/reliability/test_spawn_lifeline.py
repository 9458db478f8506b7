"""A sidecar started through :class:`kalos_retrievers.Sidecar` lives exactly as long as the
process that started it (its "lifeline", kalos_retrievers/spawn.py):

* started from a thread that then exits (an executor running ``afrom_texts``), it keeps
  serving. Negative control: a parent-death signal (``PR_SET_PDEATHSIG``, the mechanism before
  the lifeline) stops it as soon as that thread is gone;
* when the starting process is killed with SIGKILL, the sidecar stops cleanly (its segment
  removed). Negative control: ``die_with_parent=False`` leaves it serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest
from reliability._harness import cleanup_ipc

from kalos_retrievers import KalosClient, Sidecar, SidecarUnavailable, _ipc
from kalos_retrievers.protocol import segment_name

pytestmark = pytest.mark.timeout(120)


def _stopped_within(name: str, seconds: float) -> bool:
    """Whether the sidecar named ``name`` removed its segment (a clean stop) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _ipc.segment_inode(segment_name(name)) is None:
            return True
        time.sleep(0.05)
    return False


def _answers(name: str) -> bool:
    try:
        with KalosClient(name, timeout=2.0, spin_us=0) as c:
            c.ping()
            return True
    except SidecarUnavailable:
        return False


@pytest.mark.parametrize("how", ["lifeline", "pdeathsig-control"])
def test_a_sidecar_started_from_a_thread_outlives_the_thread(make_name: Callable[[], str], monkeypatch,
                                                              how: str) -> None:  # fmt: skip
    name = make_name()
    sc = Sidecar(name, dim=8, device="cpu", slots=4, spin_us=50, startup_timeout=60.0,
                 die_with_parent=how == "lifeline")  # fmt: skip
    if how == "pdeathsig-control":
        real_popen = subprocess.Popen

        def with_pdeathsig(*a, **kw):  # type: ignore[no-untyped-def]
            return real_popen(*a, **kw, preexec_fn=lambda: ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM))

        monkeypatch.setattr(subprocess, "Popen", with_pdeathsig)
    errors: list[BaseException] = []

    def starter() -> None:
        try:
            sc.start()
        except BaseException as e:  # (reported below)
            errors.append(e)

    t = threading.Thread(target=starter)
    t.start()
    t.join()
    monkeypatch.undo()
    try:
        assert not errors, errors
        if how == "lifeline":
            time.sleep(0.5)  # (a parent-death signal would have come by now)
            assert sc.proc is not None and sc.proc.poll() is None, sc.log_tail()
            assert _answers(name)
        else:
            assert _stopped_within(name, 10.0), "the control's sidecar outlived its starting thread"
            assert sc.proc is not None and sc.proc.wait(10) == 0
    finally:
        sc.stop()
        cleanup_ipc(name)


_STARTER = textwrap.dedent(
    """
    import sys, time
    from kalos_retrievers import Sidecar
    sc = Sidecar(sys.argv[1], dim=8, device="cpu", slots=4, spin_us=50, startup_timeout=60.0,
                 die_with_parent=sys.argv[2] == "1").start()
    print(sc.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("die_with_parent", [True, False], ids=["lifeline", "control"])
def test_a_sidecar_stops_when_its_starter_is_killed(make_name: Callable[[], str], die_with_parent: bool) -> None:
    name = make_name()
    starter = subprocess.Popen([sys.executable, "-P", "-c", _STARTER, name, "1" if die_with_parent else "0"],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    pid = 0
    try:
        assert starter.stdout is not None
        pid = int(starter.stdout.readline())
        assert _answers(name)
        starter.kill()
        starter.wait(10)
        if die_with_parent:
            assert _stopped_within(name, 15.0), "the sidecar outlived the process that started it"
        else:
            assert not _stopped_within(name, 2.0) and _answers(name)
    finally:
        starter.kill()
        starter.wait(10)
        if pid and not _stopped_within(name, 0):  # (the control's sidecar, or a failed test's)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            _stopped_within(name, 15.0)
        cleanup_ipc(name)


def test_starting_a_running_sidecar_again_is_refused(start_sidecar: Callable[..., Sidecar]) -> None:
    """start() on a running Sidecar replaced it (its in-memory rows lost, its process left
    unreaped); it is refused now, and after stop() it starts again (the control)."""
    from kalos_retrievers import SidecarStartError

    sc = start_sidecar(dim=8)
    with sc.client() as c:
        c.upsert(["a"], [[1.0] * 8])
    pid = sc.proc.pid
    with pytest.raises(SidecarStartError, match="already running"):
        sc.start()
    assert sc.proc.pid == pid
    with sc.client() as c:
        assert c.count() == 1
    sc.stop()
    sc.start()
    with sc.client() as c:
        assert c.count() == 0 and sc.proc.pid != pid


@pytest.mark.parametrize("dropped", ["collected", "kept (control)"])
def test_a_spawned_sidecar_stops_when_its_client_is_dropped_unclosed(dropped: str) -> None:
    """``KalosClient.spawn`` returns a client that owns its sidecar; dropped without
    ``close()`` and collected, its lifeline closes and the sidecar stops cleanly (it served on,
    with its 33 MiB segment, until the program ended). The control keeps the client: the
    sidecar serves on."""
    import gc

    client = KalosClient.spawn(dim=5, device="cpu", startup_timeout=60)
    name, proc, log = client.name, client._process.proc, client._process.log_path
    try:
        client.ping()
        if dropped == "collected":
            del client
            gc.collect()
            assert _stopped_within(name, 15)
            assert proc.wait(10) == 0
        else:
            assert not _stopped_within(name, 1.5)
            client.ping()
    finally:
        if dropped != "collected":
            client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cleanup_ipc(name)
        log.unlink(missing_ok=True)  # (stop() removes it; a dropped client's sidecar leaves it)

"""A foreign process of the sidecar's uid that ignores the protocol (docs/protocol.md: the
locks are advisory). What cannot be prevented must at least be told: a segment shrunk under
the sidecar kills it with SIGBUS, and its log then says so with Python's traceback instead of
ending at "ready"; a sidecar started again under the name serves."""

from __future__ import annotations

import signal
import time
from typing import Any

import numpy as np
import posix_ipc
import pytest

from kalos_retrievers.protocol import segment_name

pytestmark = pytest.mark.timeout(60)


def test_a_segment_shrunk_by_another_process_ends_the_sidecar_with_a_traceback(start_sidecar: Any) -> None:
    sc = start_sidecar(dim=5)
    with sc.client() as c:
        c.upsert(["a"], np.ones((1, 5)))
    # a common way to write "open the segment", which on an existing one truncates it
    seg = posix_ipc.SharedMemory(segment_name(sc.name), posix_ipc.O_CREAT, size=4096)
    seg.close_fd()
    end = time.monotonic() + 20
    while sc.proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    assert sc.proc.returncode == -signal.SIGBUS, (sc.proc.returncode, sc.log_tail(40))
    assert "Fatal Python error: Bus error" in sc.log_tail(80), sc.log_tail(80)
    again = start_sidecar(dim=5, name=sc.name)  # (over the leftovers: a stale segment)
    with again.client() as c:
        assert c.count() == 0 and c.ping() > 0

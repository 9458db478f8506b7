"""The log file of a :class:`kalos_retrievers.Sidecar`: named at construction, made by the first
``start`` (owner-only, appended to by later starts), refused where a link was planted at its name.

No sidecar process runs here: ``subprocess.Popen`` is replaced by a stand-in that writes one line
to the log it is handed, and ``wait_ready`` by a no-op.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kalos_retrievers import Sidecar
from kalos_retrievers.spawn import SidecarStartError


class _Proc:
    """Enough of a ``Popen`` for ``start``: writes a line to its stdout, has exited with 0."""

    pid = 4242
    returncode = 0

    def __init__(self, argv: list[str], *, stdout: Any, **kwargs: Any) -> None:
        stdout.write(b"started\n")

    def poll(self) -> int:
        return 0


@pytest.fixture
def no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "Popen", _Proc)
    monkeypatch.setattr(Sidecar, "wait_ready", lambda self, timeout: None)


def test_a_sidecar_never_started_leaves_no_log_file() -> None:
    sc = Sidecar(dim=4, device="cpu")
    assert not sc.log_path.exists()  # (made at construction before: a file per unstarted Sidecar)
    assert sc.stop() is None and not sc.log_path.exists()
    assert sc.log_tail() == "(no log)"


def test_the_first_start_makes_the_log_owner_only_and_later_starts_append(no_process: None) -> None:
    sc = Sidecar(dim=4, device="cpu", die_with_parent=False)
    try:
        sc.start()
        assert stat.S_IMODE(sc.log_path.stat().st_mode) == 0o600
        sc.start()  # (the stand-in has exited: a second start is allowed, as after a crash)
        assert sc.log_path.read_bytes() == b"started\nstarted\n"
        assert sc.log_tail() == "started\nstarted"
    finally:
        sc.log_path.unlink(missing_ok=True)


def test_a_link_planted_at_the_logs_name_is_refused_not_followed(no_process: None, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    sc = Sidecar(dim=4, device="cpu")
    os.symlink(target, sc.log_path)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(SidecarStartError, match="cannot open its log"):
            sc.start()
        assert target.read_bytes() == b"" and sc.proc is None
        assert len(os.listdir("/proc/self/fd")) == fds  # (the lifeline's pipe closed again)
    finally:
        sc.log_path.unlink(missing_ok=True)

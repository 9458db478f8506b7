"""Scenario 10: permissions.

Pass: the segment, the semaphores and the store's files are mode 0600 (the data directory 0700)
whatever the umask the sidecar starts under, and owned by the sidecar's user (a sidecar run as
``nobody`` owns its objects as ``nobody``); a client running as another uid gets
:class:`kalos_retrievers.PermissionDenied` with a message that says so; a name pre-created by
another user (the segment, or one of the semaphores) is refused with exit code 6 and left alone.

The machine's Python lives under /root (mode 0700), so another user cannot exec it: sidecars and
clients "as nobody" are forked from the test process (every module already imported) and drop
their privileges before running the same code paths.

Negative controls: a file loosened to 0644 after start, a client whose permission error is not
mapped, and a sidecar that ignores who owns a name all fail the harness.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import kalos_retrievers.sidecar.server  # noqa: F401 - imported before dropping privileges
import numpy as np
import posix_ipc
import pytest
from kalos_retrievers.sidecar import cli
from reliability._harness import cleanup_ipc, ipc_objects, wait_until

from kalos_retrievers import KalosClient, Sidecar, SidecarStartError, _ipc
from kalos_retrievers.protocol import doorbell_name, segment_name

pytestmark = pytest.mark.reliability

NOBODY = 65534
EXIT_PERMISSION = 6


def drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def files_of(name: str, data_dir: Path | None) -> dict[str, Path]:
    out = {o: Path("/dev/shm") / o for o in ipc_objects(name)}
    if data_dir is not None:
        out["data dir"] = data_dir
        out |= {p.name: p for p in data_dir.iterdir()}
    return out


def permission_violations(files: dict[str, Path], uid: int) -> list[str]:
    bad = []
    for what, p in files.items():
        st = p.stat()
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_IMODE(st.st_mode) != want:
            bad.append(f"{what} has mode {stat.S_IMODE(st.st_mode):o}, not {want:o}")
        if st.st_uid != uid:
            bad.append(f"{what} is owned by uid {st.st_uid}, not the sidecar's {uid}")
    return bad


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def nobody_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kalos-rel-nobody-"))
    os.chown(d, NOBODY, NOBODY)
    try:
        yield d
    finally:
        for p in sorted(d.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() else p.rmdir()
        d.rmdir()


class ForkedSidecar:
    """``kalos-sidecar serve`` run as ``nobody`` in a forked child (no exec)."""

    def __init__(self, name: str, log: Path, *args: str) -> None:
        self.name = name
        self.log = log
        log.touch()
        log.chmod(0o666)
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_APPEND)
                os.dup2(fd, 2)
                os.dup2(fd, 1)
                sys.stdout = sys.stderr = open(fd, "w", buffering=1)  # noqa: SIM115 - until _exit
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                logging.root.handlers.clear()  # pytest's capture handlers: let the CLI set up its own
                drop_to_nobody()
                os.umask(0)  # the sidecar must not depend on a careful umask
                code = cli.main(["serve", "--name", name, "--dim", "8", "--device", "cpu",
                                 "--slots", "4", "--payload-kb", "64", "--blob-kb", "64", *args])  # fmt: skip
            finally:
                os._exit(code)
        self.status: int | None = None

    def exit_code(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = st
                return os.waitstatus_to_exitcode(st)
            time.sleep(0.01)
        return None

    def ready(self, timeout: float = 30.0) -> bool:
        def up() -> bool:
            try:
                with KalosClient(self.name, spin_us=0, timeout=1.0) as c:
                    c.ping()
                    return c.header.sidecar_pid == self.pid
            except Exception:
                return False

        return bool(wait_until(up, timeout, 0.02))

    def stop(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            if self.exit_code(15) is None:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)


def test_modes_0600_regardless_of_umask(launch: Callable[..., Sidecar], tmp_path: Path) -> None:
    data = tmp_path / "data"
    with umask(0):
        sc = launch(data_dir=data)
    with sc.client(spin_us=0) as c:
        c.upsert(["a"], np.ones((1, 8)), texts=["x"])  # the WAL exists now
    files = files_of(sc.name, data)
    assert {"kalos.sqlite3", "kalos.sqlite3-wal", "kalos.lock", f"kalos-{sc.name}"} <= set(files)
    assert not permission_violations(files, os.getuid()), permission_violations(files, os.getuid())


def test_modes_negative_control_loosened_file_is_detected(launch: Callable[..., Sidecar], tmp_path: Path) -> None:
    sc = launch(data_dir=tmp_path / "data")
    (tmp_path / "data" / "kalos.sqlite3").chmod(0o644)
    Path(f"/dev/shm/kalos-{sc.name}").chmod(0o666)
    bad = permission_violations(files_of(sc.name, tmp_path / "data"), os.getuid())
    assert any("kalos.sqlite3 has mode 644" in b for b in bad) and any("mode 666" in b for b in bad), bad


def test_sidecar_as_nobody_owns_its_objects(make_name: Callable[[], str], tmp_path: Path) -> None:
    name = make_name()
    with nobody_dir() as d:
        sc = ForkedSidecar(name, tmp_path / "log", "--data-dir", str(d / "data"))
        try:
            assert sc.ready(), sc.log.read_text()[-1000:]
            with KalosClient(name, dim=8, spin_us=0) as c:  # root may still use it
                c.upsert(["a"], np.ones((1, 8)), texts=["x"])
            bad = permission_violations(files_of(name, d / "data"), NOBODY)
            assert not bad, bad
        finally:
            sc.stop()
    assert not ipc_objects(name)


def _client_as_nobody(name: str, patch_mapping: bool) -> tuple[str, str]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if patch_mapping:  # the fault: posix_ipc's permission error is not mapped
                class NotIt(Exception):
                    pass

                _ipc.posix_ipc = type("P", (), {**vars(posix_ipc), "PermissionsError": NotIt})  # type: ignore[assignment]
            drop_to_nobody()
            try:
                KalosClient(name, spin_us=0, timeout=1.0).close()
                out = "connected|"
            except BaseException as e:
                out = f"{type(e).__module__}.{type(e).__name__}|{e}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    cls, _, msg = b"".join(chunks).decode().partition("|")
    return cls, msg


def client_as_nobody_violations(name: str, patch_mapping: bool = False) -> list[str]:
    cls, msg = _client_as_nobody(name, patch_mapping)
    bad = []
    if cls != "kalos_retrievers.errors.PermissionDenied":
        bad.append(f"a client running as nobody got {cls}: {msg}")
    elif "another user" not in msg or str(NOBODY) not in msg or name not in msg:
        bad.append(f"unclear permission error: {msg}")
    return bad


def test_client_as_nobody_gets_permission_denied(launch: Callable[..., Sidecar]) -> None:
    sc = launch()
    assert not client_as_nobody_violations(sc.name), client_as_nobody_violations(sc.name)
    with sc.client(spin_us=0) as c:  # the sidecar is unaffected
        c.ping()


def test_client_as_nobody_negative_control_unmapped_error(launch: Callable[..., Sidecar]) -> None:
    sc = launch()
    assert any("got posix_ipc" in b for b in client_as_nobody_violations(sc.name, patch_mapping=True))


def _precreate_as_nobody(path_name: str, kind: str) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            drop_to_nobody()
            if kind == "segment":
                posix_ipc.SharedMemory(path_name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
            else:
                posix_ipc.Semaphore(path_name, posix_ipc.O_CREX, mode=0o600).close()
            code = 0
        finally:
            os._exit(code)
    _, st = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(st) == 0


def precreated_violations(launch: Callable[..., Sidecar], name: str, kind: str,
                          patch: str | None = None) -> list[str]:  # fmt: skip
    obj = segment_name(name) if kind == "segment" else doorbell_name(name)
    _precreate_as_nobody(obj, kind)
    path = Path("/dev/shm") / (obj.lstrip("/") if kind == "segment" else "sem." + obj.lstrip("/"))
    inode = path.stat().st_ino
    bad = []
    sc = launch(name=name, start=False, patch=patch)
    try:
        sc.start()
        bad.append(f"a {kind} pre-created by another user was not refused")
    except SidecarStartError:
        assert sc.proc is not None
        if sc.proc.returncode != EXIT_PERMISSION:
            bad.append(f"exit code {sc.proc.returncode}, not {EXIT_PERMISSION}: {sc.log_tail()[-400:]}")
        if "another user" not in sc.log_tail():
            bad.append(f"unclear refusal: {sc.log_tail()[-400:]}")
    if not path.exists() or path.stat().st_ino != inode or path.stat().st_uid != NOBODY:
        bad.append(f"the other user's {kind} was touched")
    return bad


@pytest.mark.parametrize("kind", ["segment", "semaphore"])
def test_name_precreated_by_another_user_is_refused(launch: Callable[..., Sidecar], make_name, kind: str) -> None:
    name = make_name()
    try:
        bad = precreated_violations(launch, name, kind)
    finally:
        cleanup_ipc(name)
    assert not bad, bad


def test_precreated_negative_control_sidecar_ignoring_owner(launch: Callable[..., Sidecar], make_name) -> None:
    name = make_name()
    try:
        bad = precreated_violations(launch, name, "segment", patch="ignore_live_owner")
    finally:
        cleanup_ipc(name)
    assert any("was not refused" in b for b in bad), bad


def test_nobody_sidecar_refuses_a_name_root_precreated(make_name: Callable[[], str], tmp_path: Path) -> None:
    name = make_name()
    shm = posix_ipc.SharedMemory(segment_name(name), posix_ipc.O_CREX, mode=0o600, size=4096)
    try:
        sc = ForkedSidecar(name, tmp_path / "log")
        code = sc.exit_code(30)
        if code is None:
            sc.stop()
        log = sc.log.read_text()
        assert code == EXIT_PERMISSION, log[-800:]
        assert "another user" in log and "Traceback" not in log, log[-800:]
        assert os.fstat(shm.fd).st_uid == 0 and Path(f"/dev/shm/kalos-{name}").exists()
    finally:
        shm.close_fd()
        cleanup_ipc(name)

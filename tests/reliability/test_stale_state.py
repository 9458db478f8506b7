"""Scenario 6: stale state and name conflicts.

Pass: after a ``kill -9`` the next start removes the dead sidecar's segment and every one of its
semaphores (also those beyond its own slot count, when it restarts with fewer slots) and serves;
a second sidecar started with a live one's name is refused with exit code 3 and a message naming
the running pid, and the live one keeps serving; of two sidecars started at once, exactly one
serves and the other exits with a clear message.

Negative controls: a sidecar that never clears stale state cannot restart, and one that ignores
a live owner's lock takes the name over: the harness reports both.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from reliability._harness import (
    expected_ipc_objects,
    figure,
    ipc_objects,
    scale,
    segment_inode,
    wait_until,
)

from kalos_retrievers import KalosClient, Sidecar, SidecarStartError, SidecarUnavailable

pytestmark = pytest.mark.reliability

EXIT_NAME_IN_USE = 3
RACES = scale(6, 40)


def _kill9(sc: Sidecar) -> None:
    sc.kill()
    assert sc.proc is not None
    sc.proc.wait()


def run_stale_restart(launch: Callable[..., Sidecar], patch: str | None = None,
                      drop_segment: bool = False) -> list[str]:  # fmt: skip
    """kill -9 a 6-slot sidecar, restart the name with 3 slots, check what /dev/shm holds."""
    bad: list[str] = []
    old = launch(slots=6)
    name = old.name
    old_inode = segment_inode(name)
    _kill9(old)
    left = ipc_objects(name)
    want_left = expected_ipc_objects(name, 6)
    assert left == want_left, f"kill -9 left {left}"
    if drop_segment:  # e.g. killed between unlinking the segment and the semaphores
        Path(f"/dev/shm/kalos-{name}").unlink()
    try:
        new = launch(name=name, slots=3, patch=patch)
    except SidecarStartError as e:
        return [f"restart after kill -9 failed: {str(e)[-300:]}"]
    have = ipc_objects(name)
    if have != expected_ipc_objects(name, 3):
        bad.append(f"after the restart /dev/shm holds {sorted(have - expected_ipc_objects(name, 3))} "
                   "of the dead sidecar")  # fmt: skip
    if segment_inode(name) == old_inode:
        bad.append("the dead sidecar's segment is still published")
    with KalosClient(name, spin_us=0) as c:
        c.ping()
        if c.header.sidecar_pid != new.pid:
            bad.append("the new sidecar is not the one serving")
    new.stop()
    if ipc_objects(name):
        bad.append(f"a clean stop left {sorted(ipc_objects(name))}")
    return bad


@pytest.mark.parametrize("drop_segment", [False, True], ids=["all-left", "semaphores-only"])
def test_next_start_removes_dead_sidecars_objects(launch: Callable[..., Sidecar], drop_segment: bool) -> None:
    bad = run_stale_restart(launch, drop_segment=drop_segment)
    assert not bad, bad


def test_stale_negative_control_keep_stale(launch: Callable[..., Sidecar]) -> None:
    bad = run_stale_restart(launch, patch="keep_stale")
    assert any("restart after kill -9 failed" in b for b in bad), bad


def run_second_with_live_name(launch: Callable[..., Sidecar], patch: str | None = None) -> list[str]:
    bad: list[str] = []
    first = launch()
    inode = segment_inode(first.name)
    second = launch(name=first.name, start=False, patch=patch)
    try:
        second.start()
        bad.append("a second sidecar with a live one's name was not refused")
    except SidecarStartError:
        assert second.proc is not None
        if second.proc.returncode != EXIT_NAME_IN_USE:
            bad.append(f"refused with exit code {second.proc.returncode}, not {EXIT_NAME_IN_USE}")
        msg = second.log_tail()
        if f"already running (pid {first.pid})" not in msg:
            bad.append(f"unclear refusal: {msg[-300:]}")
    if segment_inode(first.name) != inode:
        bad.append("the live sidecar lost its segment")
    try:
        with KalosClient(first.name, spin_us=0, timeout=1.0) as c:
            c.ping()
            if c.header.sidecar_pid != first.pid:
                bad.append("the live sidecar no longer serves its name")
    except SidecarUnavailable as e:
        bad.append(f"the live sidecar's clients cannot connect: {e}")
    return bad


def test_second_sidecar_with_live_name_is_refused(launch: Callable[..., Sidecar]) -> None:
    bad = run_second_with_live_name(launch)
    assert not bad, bad


def test_second_sidecar_negative_control_ignores_live_owner(launch: Callable[..., Sidecar]) -> None:
    bad = run_second_with_live_name(launch, patch="ignore_live_owner")
    assert any("was not refused" in b for b in bad), bad


def run_races(launch: Callable[..., Sidecar], make_name: Callable[[], str], rounds: int,
              data_dir: Path | None = None, patch: str | None = None,
              settle: float = 20.0) -> dict[str, Any]:  # fmt: skip
    bad: list[str] = []
    losers: dict[int, int] = {}
    for r in range(rounds):
        name = make_name()
        pair = [launch(name=name, start=False, patch=patch,
                       data_dir=None if data_dir is None else data_dir / f"r{r}")
                for _ in range(2)]  # fmt: skip
        for sc in pair:  # as close together as two Popen calls get
            with open(sc.log_path, "ab") as log:
                sc.proc = subprocess.Popen(sc.argv, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT)  # fmt: skip
        exited = wait_until(lambda pair=pair: [sc for sc in pair if sc.proc.poll() is not None], settle)
        survivors = [sc for sc in pair if sc.proc.poll() is None]
        if len(survivors) != 1 or len(exited) != 1:
            bad.append(f"round {r}: {len(survivors)} sidecars alive after both started")
            for sc in pair:
                sc.stop()
            continue
        winner, loser = survivors[0], next(sc for sc in pair if sc is not survivors[0])
        losers[loser.proc.returncode] = losers.get(loser.proc.returncode, 0) + 1
        if loser.proc.returncode not in (EXIT_NAME_IN_USE, 4):
            bad.append(f"round {r}: the loser exited with {loser.proc.returncode}: {loser.log_tail()[-300:]}")
        elif not any(w in loser.log_tail() for w in ("already running", "gives way", "in use")):
            bad.append(f"round {r}: unclear message from the loser: {loser.log_tail()[-300:]}")
        try:
            winner.wait_ready(20.0)
            with KalosClient(name, spin_us=0) as c:
                c.ping()
                if c.header.sidecar_pid != winner.pid:
                    bad.append(f"round {r}: the surviving process is not the one serving")
        except (SidecarStartError, SidecarUnavailable) as e:
            bad.append(f"round {r}: nobody serves: {e}")
        winner.stop()
    return {"rounds": rounds, "violations": bad, "loser_exit_codes": losers}


def test_two_started_at_once_exactly_one_serves(launch: Callable[..., Sidecar], make_name) -> None:
    out = run_races(launch, make_name, RACES)
    figure("6 two sidecars at once", **out)
    assert not out["violations"], out["violations"]


def test_two_started_at_once_sharing_a_data_dir(launch: Callable[..., Sidecar], make_name, tmp_path: Path) -> None:
    """Same name and same --data-dir: still exactly one serves (the other loses the name or the
    store's lock: exit 3 or 4)."""
    out = run_races(launch, make_name, max(2, RACES // 3), data_dir=tmp_path)
    assert not out["violations"], out["violations"]


def test_two_at_once_negative_control_ignoring_the_lock(launch: Callable[..., Sidecar], make_name) -> None:
    out = run_races(launch, make_name, 3, patch="ignore_live_owner", settle=3.0)
    assert out["violations"], out


@pytest.mark.parametrize("size", [100, 8191])
def test_a_foreign_segment_under_the_name_is_reported_and_never_removed(
        launch: Callable[..., Sidecar], make_name, size: int) -> None:  # fmt: skip
    """Another program's shared memory under a Kalos name (its first bytes neither Kalos's
    magic nor zeros, no sidecar lock held): a client raises ``ProtocolError`` ("not a Kalos
    segment"), and ``serve`` refuses the name with exit code 3 and leaves the segment as it
    was. Control: the zeros a sidecar that died before writing its header leaves are stale,
    removed by the next start, which serves."""
    from kalos_retrievers import ProtocolError

    name = make_name()
    path = Path(f"/dev/shm/kalos-{name}")
    content = (b"NOTKALOS" + bytes(range(256)) * (size // 256 + 1))[:size]
    path.write_bytes(content)
    try:
        with pytest.raises(ProtocolError, match="not a Kalos segment"), KalosClient(name, spin_us=0) as c:
            c.ping()
        sc = launch(name=name, start=False)
        with pytest.raises(SidecarStartError):
            sc.start()
        assert sc.proc is not None and sc.proc.returncode == EXIT_NAME_IN_USE
        assert "is not a Kalos segment" in sc.log_tail()
        assert path.read_bytes() == content  # untouched
        # control: zeros are a dead sidecar's, not another program's
        path.write_bytes(bytes(size))
        with pytest.raises(SidecarUnavailable, match="stale"), KalosClient(name, spin_us=0) as c:
            c.ping()
        new = launch(name=name)
        with KalosClient(name, spin_us=0) as c:
            c.ping()
            assert c.header.sidecar_pid == new.pid
        new.stop()
    finally:
        path.unlink(missing_ok=True)

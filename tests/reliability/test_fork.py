"""Scenario 2: a client process forks after connecting.

Pass: the child never uses the parent's slot (it connects again: its slots are disjoint from the
parent's and marked with its own pid), parent and child calling at the same time both get the
right answers, the parent keeps working afterwards, and when the parent dies first its slot is
reclaimed although the child still holds a copy of its descriptors.

Negative control: with ``KalosClient._forget_after_fork`` (the ``os.register_at_fork`` hook)
switched off, the same harness reports the shared slot and the kept locks.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reliability._harness import SegmentView, figure, fork_worker, scale, wait_until
from reliability._workers import dataset, load_dataset

from kalos_retrievers import KalosClient, KalosError, Sidecar

pytestmark = pytest.mark.reliability

DIM, N = 8, 200
ROUNDS = scale(5, 50)
CALLS = scale(300, 2000)


def self_recalls(c: KalosClient, n_calls: int, seed: int) -> dict[str, Any]:
    data = dataset(N, DIM)
    rng = np.random.default_rng(seed)
    wrong, errors = 0, []
    for _ in range(n_calls):
        i = int(rng.integers(N))
        try:
            if c.recall(data[i], k=1).ids[0] != str(i):
                wrong += 1
        except KalosError as e:
            errors.append(repr(e))
    return {"wrong": wrong, "errors": errors[:5], "n_errors": len(errors)}


def _child_body(c: KalosClient, name: str, parent_slots: list[int], seed: int) -> dict[str, Any]:
    out = self_recalls(c, CALLS, seed)
    conn = c._conn
    mine = sorted(s.index for s in conn.owned) if conn is not None else []
    with SegmentView(name) as view:
        out["owner_ok"] = all(int(view.owners[i]) == os.getpid() for i in mine)
    out["slots"] = mine
    out["shared"] = sorted(set(mine) & set(parent_slots))
    return out


def run_fork_rounds(sc: Sidecar, rounds: int) -> dict[str, Any]:
    violations: list[str] = []
    with KalosClient(sc.name, dim=DIM, spin_us=0, timeout=5.0) as c:
        if c.count(namespace="") == 0:
            load_dataset(c, N, DIM)
        for r in range(rounds):
            c.ping()
            assert c._conn is not None
            parent_slots = sorted(s.index for s in c._conn.owned)
            child = fork_worker(_child_body, c, sc.name, parent_slots, seed=100 + r)
            mine = self_recalls(c, CALLS, seed=200 + r)  # concurrently with the child
            got = child.result(60)
            if got["shared"] or not got["slots"]:
                violations.append(f"round {r}: the child used slots {got['slots']}, the parent "
                                  f"holds {parent_slots}")  # fmt: skip
            if not got["owner_ok"]:
                violations.append(f"round {r}: the child's slots are not marked with its pid")
            for who, res in (("child", got), ("parent", mine)):
                if res["wrong"] or res["n_errors"]:
                    violations.append(f"round {r}: {who}: {res['wrong']} wrong answers, "
                                      f"{res['n_errors']} errors {res['errors']}")  # fmt: skip
            if sorted(s.index for s in c._conn.owned) != parent_slots:
                violations.append(f"round {r}: the parent's slots changed")
        after = self_recalls(c, 50, seed=999)
        if after["wrong"] or after["n_errors"]:
            violations.append(f"parent after the children: {after}")
    return {"rounds": rounds, "calls_each": CALLS, "violations": violations}


def _parent_that_dies(name: str, ready_w: int) -> None:
    """Connect, fork a child that keeps running, report the parent's slot, die by SIGKILL."""
    c = KalosClient(name, dim=DIM, spin_us=0)
    c.ping()
    assert c._conn is not None
    slot = c._conn.owned[0].index
    pid = os.fork()
    if pid == 0:  # the grandchild: uses the client once, then just lives on
        try:
            c.ping()
            os.write(ready_w, f"{slot} {os.getpid()}\n".encode())
            time.sleep(30)
        finally:
            os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def run_parent_dies_first(sc: Sidecar) -> dict[str, Any]:
    r, w = os.pipe()
    parent = fork_worker(_parent_that_dies, sc.name, w)
    os.close(w)
    line = b""
    deadline = time.monotonic() + 10
    while not line.endswith(b"\n") and time.monotonic() < deadline:
        line += os.read(r, 100)
    os.close(r)
    parent.wait()
    slot, grandchild = map(int, line.split())
    violations = []
    try:
        with SegmentView(sc.name) as view:
            t0 = time.monotonic()
            ok = wait_until(lambda: not view.slot_locked(slot) and int(view.states[slot]) == 0, 1.5)
            dt = time.monotonic() - t0
            if not ok or dt > 1.0:
                violations.append(f"the dead parent's slot {slot} was not reclaimed while its child "
                                  f"lives (locked={view.slot_locked(slot)})")  # fmt: skip
    finally:
        os.kill(grandchild, signal.SIGKILL)
    return {"violations": violations}


def test_fork_after_connect(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=8)
    out = run_fork_rounds(sc, ROUNDS)
    out2 = run_parent_dies_first(sc)
    figure("2 fork after connect", **out, parent_dies_first=out2)
    assert not out["violations"], out["violations"]
    assert not out2["violations"], out2["violations"]


def test_fork_negative_control_without_at_fork_hook(
    launch: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    sc = launch(slots=8)
    monkeypatch.setattr(KalosClient, "_forget_after_fork", lambda self: None)
    out = run_fork_rounds(sc, 1)
    assert any("the child used slots" in v for v in out["violations"]), out
    out2 = run_parent_dies_first(sc)
    assert any("was not reclaimed" in v for v in out2["violations"]), out2


def _close_in_child(c: KalosClient) -> dict[str, Any]:
    c.close()
    return {"closed": True}


def test_a_forked_child_closing_a_spawned_client_leaves_the_parents_sidecar() -> None:
    """A child inherits a spawned client (its ``Sidecar``): its ``close()`` stopped nothing
    there (the sidecar is not its child) but read the parent's process as exited with 0 and
    deleted the parent's sidecar log. The child does not own the sidecar: its close releases
    only its own state. Control: the parent's close does stop the sidecar."""
    c = KalosClient.spawn(dim=DIM, device="cpu")
    try:
        c.upsert(["a"], np.ones((1, DIM), np.float32))
        sc = c._process
        assert sc is not None and sc.log_path.exists()
        assert fork_worker(_close_in_child, c).result() == {"closed": True}
        assert sc.proc.poll() is None and sc.log_path.exists()
        assert c.recall(np.ones(DIM, np.float32), k=1).ids == ["a"]
    finally:
        c.close()
    assert sc.proc.poll() is not None  # control: the owner's close stops it

"""Compaction under steady load: a sidecar whose rows are mostly deleted while clients keep
recalling (never 50 ms idle, the usual condition for compaction) compacts all the same, a step
per housekeeping tick, so recalls stop reading the holes. Negative control: without the
under-load step the holes stay for as long as the load lasts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import serving, unique_name
from kalos_retrievers.sidecar.server import ServeConfig, Server

from kalos_retrievers import KalosClient

pytestmark = pytest.mark.timeout(120)

DIM = 13


@pytest.fixture
def server() -> Iterator[Server]:
    with serving(ServeConfig(name=unique_name("compact"), dim=DIM, metric="ip", device="cpu", slots=8)) as srv:
        yield srv


def _top1_ok(got: list[str], data: np.ndarray, rows: np.ndarray | None, q: np.ndarray) -> bool:
    """``got`` is the best for ``q`` of the rows where ``rows`` (a mask) is true (None: of all),
    by inner product, up to float32 rounding (the sidecar's and numpy's sums round
    differently: a near tie may go either way)."""
    best = float((data @ q if rows is None else data[rows] @ q).max())
    return (len(got) == 1 and (rows is None or bool(rows[int(got[0])]))
            and float(data[int(got[0])] @ q) >= best - 1e-4)  # fmt: skip


@pytest.mark.parametrize("under_load", [True, False], ids=["steps", "control"])
def test_holes_are_compacted_while_clients_keep_recalling(server: Server, monkeypatch, under_load: bool) -> None:
    """The load runs before the delete and throughout, so the sidecar is never idle for 50 ms
    (before session 42 the load started after the delete: a housekeeping tick in between
    compacted the holes away before they were counted, ~1 run in 4, and an idle moment there
    could have compacted the control's). The holes counted are those the delete made; a recall
    that began before the delete returned may see either the old rows or the new."""
    if not under_load:
        monkeypatch.setattr(Server, "_badly_fragmented", lambda self: False)
    rng = np.random.default_rng()
    n = 20_011
    data = rng.standard_normal((n, DIM)).astype(np.float32)
    keep = np.arange(n) % 10 == 9  # every tenth row stays, up to the top: holes everywhere below
    stop, deleted = threading.Event(), threading.Event()
    recalled = [0, 0]
    errors: list[BaseException] = []
    with KalosClient(server.cfg.name, dim=DIM, timeout=30) as c:
        for s in range(0, n, 5000):
            c.upsert([str(i) for i in range(s, min(n, s + 5000))], data[s : s + 5000])

        def load(j: int) -> None:  # recalls back to back, each checked
            try:
                with KalosClient(server.cfg.name, dim=DIM, timeout=30) as lc:
                    while not stop.is_set():
                        q = rng.standard_normal(DIM).astype(np.float32)
                        after_delete = deleted.is_set()
                        got = lc.recall(q, 1).ids
                        ok = _top1_ok(got, data, keep, q) or (not after_delete and _top1_ok(got, data, None, q))
                        if not ok:
                            raise AssertionError(
                                f"{got}: not the best for its query (after the delete? {after_delete})"
                            )
                        recalled[j] += 1
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=load, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while min(recalled) < 20 and not errors:  # (both clients recalling: the sidecar is busy from here)
                assert time.monotonic() < deadline, recalled
                time.sleep(0.005)
            high = server.service.rows.high  # type: ignore[union-attr]
            c.delete([str(i) for i in np.flatnonzero(~keep)])
            deleted.set()
            assert high == n  # (nothing compacted before the delete)
            before = int((~keep[: np.flatnonzero(keep)[-1] + 1]).sum())  # its holes below the highest row kept
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and server.service.fragmentation() * 2 >= before:  # type: ignore[union-attr]
                time.sleep(0.05)
            after = server.service.fragmentation()  # type: ignore[union-attr]
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert not errors, errors
    if under_load:
        assert after * 2 < before, (before, after)
    else:
        assert after * 2 >= before, (before, after)

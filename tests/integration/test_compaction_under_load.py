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
from conftest import unique_name
from kalos_retrievers.sidecar.server import ServeConfig, Server

from kalos_retrievers import KalosClient

pytestmark = pytest.mark.timeout(120)

DIM = 13


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server(ServeConfig(name=unique_name("compact"), dim=DIM, metric="ip", device="cpu", slots=8))
    srv.start()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(30)


@pytest.mark.parametrize("under_load", [True, False], ids=["steps", "control"])
def test_holes_are_compacted_while_clients_keep_recalling(server: Server, monkeypatch, under_load: bool) -> None:
    if not under_load:
        monkeypatch.setattr(Server, "_badly_fragmented", lambda self: False)
    rng = np.random.default_rng()
    n = 20_011
    data = rng.standard_normal((n, DIM)).astype(np.float32)
    keep = np.arange(n) % 10 == 9  # every tenth row stays, up to the top: holes everywhere below
    stop = threading.Event()
    errors: list[BaseException] = []
    with KalosClient(server.cfg.name, dim=DIM, timeout=30) as c:
        for s in range(0, n, 5000):
            c.upsert([str(i) for i in range(s, min(n, s + 5000))], data[s : s + 5000])

        def load() -> None:  # recalls back to back, each checked
            try:
                with KalosClient(server.cfg.name, dim=DIM, timeout=30) as lc:
                    while not stop.is_set():
                        q = rng.standard_normal(DIM).astype(np.float32)
                        want = str(np.flatnonzero(keep)[np.argmax(data[keep] @ q)])
                        got = lc.recall(q, 1).ids
                        if got != [want]:
                            raise AssertionError(f"{got} != {[want]}")
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=load) for _ in range(2)]
        c.delete([str(i) for i in np.flatnonzero(~keep)])
        for t in threads:
            t.start()
        try:
            before = server.service.fragmentation()  # type: ignore[union-attr]
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and server.service.fragmentation() * 2 >= before:  # type: ignore[union-attr]
                time.sleep(0.05)
            after = server.service.fragmentation()  # type: ignore[union-attr]
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert not errors, errors
    assert before >= 17_000
    if under_load:
        assert after * 2 < before, (before, after)
    else:
        assert after * 2 >= before, (before, after)

"""A serve-loop pass that fails with a bug (here: the launch of its batch raises once) answers
what it had picked up: the client gets the sidecar's internal error at once, not a timeout, and
the next call is served as usual. Negative control: without the serve loop's answer to the
stranded requests, the client waits out its whole timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import serving, unique_name
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.server import ServeConfig, Server

from kalos_retrievers import KalosClient, KalosError, SidecarTimeout

pytestmark = pytest.mark.timeout(60)

DIM, ROWS, TIMEOUT = 19, 211, 3.0


@pytest.fixture
def server() -> Iterator[Server]:
    with serving(ServeConfig(name=unique_name("failpass"), dim=DIM, metric="ip", device="cpu", slots=4)) as srv:
        yield srv


@pytest.mark.parametrize("recover", [True, False], ids=["answered", "control"])
def test_a_failed_pass_answers_what_it_picked_up(server: Server, monkeypatch: pytest.MonkeyPatch,
                                                 recover: bool) -> None:  # fmt: skip
    rng = np.random.default_rng()
    data = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    q = rng.standard_normal((3, DIM)).astype(np.float32)
    with KalosClient(server.cfg.name, dim=DIM, timeout=TIMEOUT) as c:
        c.upsert([str(i) for i in range(ROWS)], data)
        fail = [1]
        real = Dispatcher._pipeline

        def pipeline(self: Dispatcher, *a: object, **kw: object) -> None:
            if fail and fail.pop():
                raise RuntimeError("a bug in the launch")
            real(self, *a, **kw)

        monkeypatch.setattr(Dispatcher, "_pipeline", pipeline)
        if not recover:
            monkeypatch.setattr(Dispatcher, "answer_stranded", lambda self, e: 0)
        t0 = time.monotonic()
        if recover:
            with pytest.raises(KalosError, match=r"internal error.*dropped by a failed pass.*a bug in the launch"):
                c.recall_batch(q, k=5)
            assert time.monotonic() - t0 < TIMEOUT / 2
        else:
            with pytest.raises(SidecarTimeout):
                c.recall_batch(q, k=5)
            assert time.monotonic() - t0 >= TIMEOUT * 0.9
            return
        assert not fail  # the failure came once
        got = c.recall_batch(q, k=5)
        want = np.argsort(-(q @ data.T), axis=1, kind="stable")[:, :5]
        assert [sorted(map(int, r.ids)) for r in got] == [sorted(w.tolist()) for w in want]

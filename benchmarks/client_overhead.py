"""The client library's own Python per recall, with an instant responder (issue 3).

    python -P benchmarks/client_overhead.py [--k 10] [--batch 1] [--calls 20000] [--profile] [--no-c] [--inline]

On the H200 machine a batch-1 recall at 1M rows took ~420 µs end to end through
``KalosClient.recall`` while the resident kernel's round trip, driven by a bare Python loop in
one process, took ~388 µs (``doorbell_probe.py``, S8-2): the difference is the client's Python
before the request is written and after the answer is seen. This measures that Python alone.

A CPU sidecar (768-d, 1,000 rows with short texts and metadata, ``KALOS_ARENA=1``) answers one
real recall of ``--batch`` queries through the document arena; its answer (rows, scores, the
arena generations) is kept, and the client's wait is then replaced by a function that writes
that answer into the slot at once. Every other step is the real client: argument checks, the
request, the copy of rows and scores, the arena reads of the documents, the result objects.
(The request still posts the sidecar's doorbell, as batches do; batch-1 recalls to a GPU
kernel post nothing. The sidecar is stopped, SIGSTOP, while the calls are timed: awake it
would take the requests too, and its late answers overwrite the slot's words under the
client, whose C path reads them back from the slot.) Printed: p50 per call in µs, for a numpy
query and, at batch 1, the same query as a list of floats (what an ``Embeddings`` returns),
and reading every hit's text.
A batch-1 recall's request is written and its answer read by the client's C extension
(``_fastpath.request1`` / ``answer1``) where it is built; ``--no-c`` times the Python path.
``--inline``: the client asks for its documents inline (what a CPU sidecar without an arena,
its default, answers), decoded by Python from the answer's blob.
``--bell`` (batch 1): the resident GPU kernel's path instead, where one C call
(``_fastpath.recall1``) writes the request, spins and reads the answer and its documents: the
client is told a resident kernel takes k <= 32, and ``recall1`` returns at once what
``answer1`` read from a real answer. What is timed is the Python around that one call (3.0 µs
on the development VM, session 42), with ``_fastpath.bell1`` set aside: since session 43 a
client makes that whole call in C, which ``fastpath_overhead.py`` times against a responder
process (its ``recall_py`` is this path).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

os.environ["KALOS_ARENA"] = "1"  # the spawned sidecar keeps a document arena

import kalos_retrievers.client as client_module
from kalos_retrievers import KalosClient
from kalos_retrievers.protocol import RESPONSE_OFFSET, RESPONSE_STRUCT, Response, SlotState

DIM, ROWS = 768, 1000


def p50_us(fn: Callable[[], Any], calls: int) -> float:
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return round(statistics.median(ts) / 1000, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-c", action="store_true", help="the client's Python path (its C extension not used)")
    ap.add_argument("--inline", action="store_true", help="documents inline in the answer, not from the arena")
    ap.add_argument("--bell", action="store_true", help="the resident kernel's path: the Python around recall1")
    a = ap.parse_args()
    if a.bell and (a.batch != 1 or a.no_c or a.inline):
        ap.error("--bell times batch 1 through the C extension with documents from the arena")
    if a.no_c:
        client_module._fastpath = None
    k, b = a.k, a.batch
    rng = np.random.default_rng(0)
    v = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    with KalosClient.spawn(dim=DIM, device="cpu") as owner, KalosClient(owner.name, arena_docs=not a.inline) as c:
        owner.upsert([f"id{i}" for i in range(ROWS)], v, texts=[f"text {i} " * 5 for i in range(ROWS)],
                     metadatas=[{"i": i, "topic": "t"} for i in range(ROWS)])  # fmt: skip
        queries = v[:b] + 0.01
        c.recall_batch(queries, k)
        slot = c._conn.free[-1]  # the slot that answered: keep its answer
        rows, scores = slot.rows[: k * b].copy(), slot.scores[: k * b].copy()
        resp = Response.unpack(slot.ctl)
        blob = bytes(slot.blob[: resp.resp_len])

        def instant(conn: Any, s: Any, seq: int, deadline: float, *, recall: bool, doorbell: bool = False,
                    check: bool = True) -> Response | None:  # fmt: skip
            s.rows[: k * b], s.scores[: k * b] = rows, scores
            s.blob[: len(blob)] = blob
            RESPONSE_STRUCT.pack_into(s.ctl, RESPONSE_OFFSET, seq, resp.status, resp.n_results, resp.resp_len,
                                      resp.resp_flags)  # fmt: skip
            s.state[0] = SlotState.RESPONSE
            return Response(seq, resp.status, resp.n_results, resp.resp_len, resp.resp_flags) if check else None

        c._wait = instant  # type: ignore[method-assign]
        sidecar = owner._process
        assert sidecar is not None
        sidecar.kill(signal.SIGSTOP)  # it holds its lock (alive to the client) and answers nothing
        try:
            if a.bell:  # (with the sidecar stopped: awake, it takes the first recall's request too)
                bell_path(c, queries[0], k)
            timed(a, c, queries, k, b)
        finally:
            sidecar.kill(signal.SIGCONT)  # (stopped, it would not stop when asked)


def bell_path(c: KalosClient, q: np.ndarray, k: int) -> None:
    """Put ``c`` on the resident kernel's path: one recall through ``request1``, the instant
    responder and ``answer1`` keeps ``answer1``'s result; from then on the header is read as
    if a resident kernel took k <= 32 and ``recall1`` returns that result at once."""
    real = client_module._fastpath
    assert real is not None, "--bell needs the client's C extension"
    kept: list[Any] = []
    bells = [0]

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def answer1(*args: Any) -> Any:
            kept.append(real.answer1(*args))
            return kept[-1]

        @staticmethod
        def recall1(*args: Any) -> Any:
            bells[0] += 1
            return kept[-1]

    client_module._fastpath = Recording()  # type: ignore[assignment]
    client_module._BELL1 = False  # (bell1's own exchange would not call this recall1: fastpath_overhead.py times it)
    c.recall(q, k)
    assert kept and kept[-1] is not None and kept[-1][6] is not None, "answer1 did not read the documents"
    conn = c._conn
    assert conn is not None
    conn.doorbell_k = conn.doorbell_cap = lambda: 32  # type: ignore[method-assign]
    assert len(c.recall(q, k)) == k and bells[0] == 1, "not on the resident kernel's path"


def timed(a: argparse.Namespace, c: KalosClient, queries: np.ndarray, k: int, b: int) -> None:
    """Time the calls (and profile them, with ``--profile``); print the figures."""
    n = a.calls if b == 1 else max(1, a.calls // 10)
    if b == 1:
        q, ql = queries[0], queries[0].tolist()
        figures = {"recall (numpy query)": lambda: c.recall(q, k), "recall (list query)": lambda: c.recall(ql, k),
                   "recall + read every hit's text": lambda: [h.text for h in c.recall(q, k)]}  # fmt: skip
    else:
        figures = {f"recall_batch({b})": lambda: c.recall_batch(queries, k),
                   f"recall_batch({b}) + read each first hit's text":
                       lambda: [r[0].text for r in c.recall_batch(queries, k)]}  # fmt: skip
    for name, fn in figures.items():
        p50_us(fn, n // 10)  # warm-up
        print(f"{name}: p50 {p50_us(fn, n)} us")
    if a.profile:
        fn = next(iter(figures.values()))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()

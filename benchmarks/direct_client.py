"""The client's own time per direct recall (protocol v1.4, KALOS_CAROUSEL=direct), in process, no GPU.

    python -P benchmarks/direct_client.py [--dim 768] [--k 10] [--calls 20000] [--no-c]

A direct recall (``KalosClient._recall_direct``) writes the query and the request words into the
carousel's slot, waits for the kernel's answer, then copies the rows and scores and reads each
hit's document from the arena (``ArenaView.current_docs``) under the carousel's epoch. This times
that method whole, with the wait replaced by the kernel's answer written at once (rows, scores,
count, seq echo, DONE), so the figure is the client's Python around the wait: what a crowd's
client spends per recall besides the turn itself. Over an anonymous map and an arena of 2,000
documents of 200 bytes; prints the median and p90 over the last 90% of the calls. The request is
written and the answer read by the client's C extension (``_fastpath.car_request1`` /
``car_answer1``) where it is built; ``--no-c`` times the Python path.
"""

from __future__ import annotations

import argparse
import mmap
import time
from types import SimpleNamespace

import numpy as np

from kalos_retrievers import _conn
from kalos_retrievers import client as client_module
from kalos_retrievers.arena import ArenaView, ArenaWriter
from kalos_retrievers.protocol import (
    CAR_DONE,
    W_ELIGIBLE,
    W_RESP_SEQ,
    W_RESULTS,
    W_SEQ,
    W_STATE,
    CarouselLayout,
    Metric,
    car_bounds,
)

ROWS = 2000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--no-c", action="store_true", help="the Python path (as without the C extension)")
    args = ap.parse_args()
    if args.no_c:
        client_module._fastpath = None
    path = "Python" if client_module._fastpath is None else "C"
    dim, k = args.dim, args.k
    car = _conn._CarouselView(mmap.mmap(-1, CarouselLayout.of(dim).segment_size()), dim, 48)
    car.words[:, W_ELIGIBLE] = ROWS  # (as the sidecar writes at the launch: the namespace's rows)
    maps: dict[int, mmap.mmap] = {}
    writer = ArenaWriter(lambda v, size: maps.setdefault(v, mmap.mmap(-1, size)), maps.pop, rows_cap=4096,
                         heap_size=1 << 22)  # fmt: skip
    for r in range(ROWS):
        writer.put(r, bytes(200))
    arena = ArenaView(maps[writer.version], writer.version)
    conn = SimpleNamespace(header=SimpleNamespace(dim=dim, metric=int(Metric.COSINE)),
                           tiny=np.full(dim, 2.0**-100, np.float32), carousel_epoch=lambda: 1,
                           arena=lambda: arena, car_bounds=car_bounds(Metric.COSINE))  # fmt: skip
    rng = np.random.default_rng(0)
    top = rng.choice(ROWS, k, replace=False).astype(np.int32)
    top_scores = np.linspace(1, 0.5, k, dtype=np.float32)

    def answer(conn, w, epoch, deadline, t_sent, spin=None):  # type: ignore[no-untyped-def]
        """The kernel's answer, written at once (the wait itself is not timed here; these few
        stores, ~1 µs, are)."""
        i = slot.index
        car.rows[i, :k] = top
        car.scores[i, :k] = top_scores
        w[W_RESULTS], w[W_RESP_SEQ], w[W_STATE] = k, w[W_SEQ], CAR_DONE
        return CAR_DONE

    c = client_module.KalosClient("kalos-bench-lazy", dim=dim, lazy=True)
    c._wait_direct = answer  # type: ignore[method-assign]
    slot = SimpleNamespace(index=3, seq=0)
    q = rng.standard_normal(dim).astype(np.float32)
    took = np.empty(args.calls)
    try:
        for j in range(args.calls):
            t0 = time.perf_counter_ns()
            res = c._recall_direct(conn, car, slot, q, k, time.monotonic() + 10)  # type: ignore[arg-type]
            took[j] = time.perf_counter_ns() - t0
            assert res is not None and res.rows.tolist() == top.tolist(), (res, j)
    finally:
        c.close()
    rest = took[args.calls // 10 :] / 1000
    print(f"direct recall ({path} path), {dim}-d, k {k}: the client's own time per call p50 {np.median(rest):.2f} µs, "
          f"p90 {np.percentile(rest, 90):.2f} µs ({args.calls} calls, the kernel's wait not included)")  # fmt: skip


if __name__ == "__main__":
    main()

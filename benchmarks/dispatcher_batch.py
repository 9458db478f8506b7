"""The sidecar's Python per answered slot, in process (no GPU, no other process).

    python -P benchmarks/dispatcher_batch.py [--slots 24] [--queries 1] [--rounds 400] [--arena] [--profile]
        [--cold MB]

With 32 client processes at 1M rows the H200 sidecar answered batches of ~24 recalls, each
costing pickup 175 µs + search 925 µs + answer 362 µs (docs/benchmarks.md): the Python around
the search, per slot, caps throughput. This measures that Python alone: a ``Dispatcher`` over
an anonymous map (standing in for the segment) with ``--slots`` batch-1 recalls waiting at
once, answered from a CPU index of 500 rows (dim 768, top-10, short texts, small metadata), so
the search is small. Prints the poll time and the sidecar's pickup / search / answer phases
(means per poll); ``--arena`` gives the service a document arena and the recalls its flag
(ARENA_DOCS: answers carry generations; with ``--entries`` arena entries, as for clients of a
GPU sidecar since protocol v1.3); ``--profile`` adds
a cProfile of the answering. ``--cold MB`` reads MB megabytes before each poll and inside
each search, as a CPU sidecar's scan of 100k x 384 rows (150 MB) does: the phases then run
with the caches the real ones find (issue 2: the CPU sidecar's pickup and answer after a scan).
"""

from __future__ import annotations

import argparse
import cProfile
import mmap
import pstats
import time
from typing import Any

import numpy as np
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.arena import ArenaWriter
from kalos_retrievers.protocol import HEADER_SIZE, METRICS, REQUEST_OFFSET, REQUEST_STRUCT, Flag, Layout, Op, SlotState

DIM, K, ROWS = 768, 10, 500


_MARKS = {"search_end": 0, "first_post": 0}


class _Sem:
    """A response semaphore (no client waits in this process): notes the first post after a
    search."""

    def release(self) -> None:
        if not _MARKS["first_post"]:
            _MARKS["first_post"] = time.perf_counter_ns()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--queries", type=int, default=1, help="queries per request (64: one recall_batch(64))")
    ap.add_argument("--arena", action="store_true")
    ap.add_argument("--entries", action="store_true", help="with --arena: answers carry arena entries (v1.3)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cold", type=int, default=0, metavar="MB",
                    help="read MB megabytes before each poll and in each search")  # fmt: skip
    a = ap.parse_args()
    big = np.ones(a.cold << 18, np.float32) if a.cold else None

    def evict() -> None:
        if big is not None:
            big.sum()

    n = a.slots
    nq = a.queries
    lay = Layout(n_slots=n, dim=DIM, payload_size=max(1 << 16, 4 * DIM * nq + 8192), blob_size=1 << 16)
    mm = mmap.mmap(-1, lay.segment_size)
    index = CpuIndex(DIM, METRICS["cosine"])
    if big is not None:  # (search: what both the batch path and the lone short path call)
        search = index.search

        def evicting_search(*args: Any, **kw: Any) -> Any:
            evict()
            out = search(*args, **kw)
            _MARKS["search_end"], _MARKS["first_post"] = time.perf_counter_ns(), 0
            return out

        index.search = evicting_search  # type: ignore[method-assign]
    svc = Service(index, NullStore(), dim=DIM, metric=METRICS["cosine"])
    flags = 0
    if a.arena:
        bufs: dict[int, bytearray] = {}
        svc.rows.arena = ArenaWriter(lambda v, size: bufs.setdefault(v, bytearray(size)), bufs.pop)
        flags = Flag.ARENA_DOCS | (Flag.ARENA_ENTRIES if a.entries else 0)
    rng = np.random.default_rng(0)
    svc.upsert({"namespace": "", "ids": [str(i) for i in range(ROWS)],
                "texts": [f"memory {i}" for i in range(ROWS)], "metadatas": [{"i": i} for i in range(ROWS)]},
               rng.standard_normal((ROWS, DIM)).astype(np.float32))  # fmt: skip
    stats = Stats()
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n)], svc, stats, max_batch=64, describe=lambda: {})
    q = rng.standard_normal((n, nq * DIM)).astype(np.float32)
    states = np.ndarray((n,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))

    def arm(seq: int) -> None:  # every slot: a recall of nq queries waiting
        for i in range(n):
            off = lay.slot_offset(i)
            np.frombuffer(mm, np.float32, nq * DIM, off + lay.payload_offset)[:] = q[i]
            REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, Op.RECALL, flags, K, nq, 4 * DIM * nq, 0, 0)
        states[:] = SlotState.REQUEST

    for s in range(50):
        arm(s + 1)
        d.poll()
        d.settle()  # a batch may stay in flight after poll(): answer it
    stats.phases.clear()
    ts, to_post = [], []
    for s in range(a.rounds):
        arm(s + 100)
        evict()
        t0 = time.perf_counter_ns()
        answered = d.poll()
        d.settle()
        ts.append(time.perf_counter_ns() - t0)
        if big is not None:
            to_post.append(_MARKS["first_post"] - _MARKS["search_end"])
        assert answered == n and (states == SlotState.RESPONSE).all()
    ph = {p: round(h.sum_us / h.count, 1) for p, h in stats.phases.items()}
    p50 = float(np.median(ts)) / 1000
    print(f"{n} slots: poll p50 {p50:.1f} us ({p50 / n:.2f} us per slot); phase means per poll (us): {ph}"
          + (f"; search end to first post p50 {np.median(to_post) / 1000:.1f} us" if to_post else ""))
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for s in range(a.rounds):
            arm(s + 10_000)
            d.poll()
            d.settle()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

"""The sidecar's host time per recall on the carousel's lane (sidecar/crowd.py), in process, no GPU.

    python -P benchmarks/crowd_host.py [--slots 32] [--rounds 2000] [--k 10] [--inline]

With ``KALOS_CAROUSEL=1`` a GPU sidecar hands a crowd's batch-1 recalls to the carousel: per
recall the dispatcher picks it up (``_hotpath.take``), boards it (the query copied into one of
the kernel's slots), and, once the kernel has answered, harvests it (rows and scores copied
back into the protocol slot, the answer written by ``_hotpath.answer1``, the semaphore
posted). Session 35's prediction of the crowd's rate assumed ~15 µs of host time to board and
~20 to answer and post. This times those two passes of ``Dispatcher.poll`` alone: ``--slots``
recalls (768-d, top ``--k``, documents from an arena unless ``--inline``) waiting at once, a
pass that boards them, then the kernel's answers written into its slots by this process (as
``carousel_topk`` writes them: rows, scores, count, seq, state DONE) and a pass that harvests
and answers them, with real POSIX semaphores posted. Prints each pass's median per recall.
The index behind it is a CPU index whose carousel never scans (the answers are made up): the
figures are the host's share only.
"""

from __future__ import annotations

import argparse
import mmap
import time
from types import SimpleNamespace

import numpy as np
from kalos_retrievers.sidecar import carousel
from kalos_retrievers.sidecar.carousel import DONE, REQUEST, W_RESP_SEQ, W_RESULTS, W_SEQ, W_STATE, Slots
from kalos_retrievers.sidecar.crowd import CrowdLane
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.dispatcher import _hotpath as hotpath
from kalos_retrievers.sidecar.index import NS_ANY, CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers import _ipc
from kalos_retrievers.arena import ArenaWriter
from kalos_retrievers.protocol import HEADER_SIZE, METRICS, REQUEST_OFFSET, REQUEST_STRUCT, Flag, Layout, Op, SlotState

DIM, ROWS = 768, 2000
_HOST = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(hostRegister=lambda *a: None,
                                                                     hostUnregister=lambda *a: None)))  # fmt: skip


class _LaneIndex(CpuIndex):
    """A CPU index whose carousel is always running and never scans: the benchmark writes its
    answers."""

    host_search = False
    carousel_k = carousel.KMAX

    def __init__(self, dim: int, metric: int) -> None:
        super().__init__(dim, metric)
        self.slots = Slots(_HOST, carousel.MAX_SLOTS, dim)
        self.crowd = CrowdLane(self.slots)

    def start_carousel(self, high: int, ns: int = NS_ANY, eligible: int = 0) -> None:
        self.carousel_running = True


def _answer_all(slots: Slots, k: int, rows: np.ndarray, scores: np.ndarray) -> int:
    """Write an answer into every carousel slot holding a request, as the kernel does."""
    w = slots.words
    ready = np.flatnonzero(w[:, W_STATE] == REQUEST)
    for c in ready.tolist():
        slots.rows[c, :k] = rows
        slots.scores[c, :k] = scores
        w[c, W_RESULTS] = k
        w[c, W_RESP_SEQ] = w[c, W_SEQ]
        w[c, W_STATE] = DONE
    return len(ready)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--inline", action="store_true", help="documents inline (default: from the arena)")
    args = ap.parse_args()
    if hotpath is None:
        raise SystemExit("sidecar/_hotpath.c is not built: the lane takes only recalls it checked")
    n, k = args.slots, args.k
    lay = Layout(n_slots=n, dim=DIM, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    index = _LaneIndex(DIM, METRICS["cosine"])
    svc = Service(index, NullStore(), dim=DIM, metric=METRICS["cosine"])
    if not args.inline:
        bufs: dict[int, bytearray] = {}
        svc.rows.arena = ArenaWriter(lambda v, size: bufs.setdefault(v, bytearray(size)), bufs.pop)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(ROWS)], "texts": [f"memory {i}" for i in range(ROWS)],
                "metadatas": [{"i": i} for i in range(ROWS)]}, data)  # fmt: skip
    prefix = f"kalos-crowdbench-{time.monotonic_ns() % 10**9}"
    sems = [_ipc.create_semaphore(f"/{prefix}-{i}") for i in range(n)]
    try:
        d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {})
        d.crowd_min = 2
        d._seen = dict.fromkeys(range(n), time.perf_counter_ns() + 10**15)  # (a crowd, "seen" throughout)
        states = np.ndarray((n,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
        flags = 0 if args.inline else Flag.ARENA_DOCS | Flag.ARENA_ENTRIES
        qs = rng.standard_normal((n, DIM)).astype(np.float32)
        for i in range(n):
            np.frombuffer(mm, np.float32, DIM, lay.slot_offset(i) + lay.payload_offset)[:] = qs[i]
        top = rng.choice(ROWS, k, replace=False).astype(np.int32)
        top_scores = np.sort(rng.random(k).astype(np.float32))[::-1].copy()
        board_us, answer_us = [], []
        for r in range(args.rounds):
            for i in range(n):
                REQUEST_STRUCT.pack_into(mm, lay.slot_offset(i) + REQUEST_OFFSET, r, Op.RECALL, flags, k, 1, 4 * DIM,
                                         0, 0)  # fmt: skip
            states[:] = SlotState.REQUEST
            t0 = time.perf_counter_ns()
            d.poll()
            t1 = time.perf_counter_ns()
            assert index.crowd.in_flight == n and _answer_all(index.slots, k, top, top_scores) == n
            t2 = time.perf_counter_ns()
            assert d.poll() == n
            t3 = time.perf_counter_ns()
            assert (states == SlotState.RESPONSE).all()
            for s in sems:
                _ipc.drain(s)
            board_us.append((t1 - t0) / 1000 / n)
            answer_us.append((t3 - t2) / 1000 / n)
        skip = args.rounds // 10
        print(f"{n} recalls a pass, k {k}, documents {'inline' if args.inline else 'from the arena (entries)'}, "
              f"{args.rounds} rounds: per recall, pickup + board p50 {np.median(board_us[skip:]):.2f} µs, "
              f"harvest + answer + post p50 {np.median(answer_us[skip:]):.2f} µs")  # fmt: skip
    finally:
        for i, s in enumerate(sems):
            _ipc.close_semaphore(s)
            _ipc.unlink_semaphore(f"/{prefix}-{i}")
        index.slots.close()


if __name__ == "__main__":
    main()

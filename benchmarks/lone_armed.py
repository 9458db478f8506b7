"""What an armed, stopped carousel costs a lone recall on the sidecar's batched path, in process, no GPU.

    python -P benchmarks/lone_armed.py [--calls 20000] [--rows 61] [--k 10] [--gone 0] [--crowd-min N]

On a GPU sidecar with float16 rows the carousel is armed by default (``KALOS_CAROUSEL`` unset:
the index's ``carousel_k`` is 32) and starts only for a crowd. A client recalling alone is
answered by the resident kernel once it runs. Until then, and always with ``KALOS_DOORBELL=0``
or flags the kernel does not take, each of its batch-1 recalls goes through
``Dispatcher.poll``'s batched path. That path first offers the recall to the carousel
(``_to_carousel``).

This times one ``poll`` per recall of one client: 768-d cosine, documents from an arena. The
index is a CPU index over ``--rows`` rows, which makes the search itself short. It takes the
batched path (``host_search`` False), as a GPU index does. Blocks of 200 calls alternate between
``carousel_k`` 0 (off, as ``KALOS_CAROUSEL=0``) and 32 (armed, never started). Prints each
side's median per call and the difference of the block medians, with its standard error.
``--gone N``: N other slots were seen long ago, as after a crowd that has left. The dispatcher
forgets such slots the first time it counts a crowd, which happens in the warm-up blocks, so
this shows the state after that. The index refuses to start the carousel; a run where a lone
client started it anyway fails rather than printing.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import numpy as np
from kalos_retrievers.sidecar import carousel
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.dispatcher import _hotpath as hotpath
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers import _ipc
from kalos_retrievers.arena import ArenaWriter
from kalos_retrievers.protocol import HEADER_SIZE, METRICS, REQUEST_OFFSET, REQUEST_STRUCT, Flag, Layout, Op, SlotState

DIM, BLOCK = 768, 200


class _BatchedIndex(CpuIndex):
    """A CPU index searched on the batched path, as a GPU index is; its carousel never starts."""

    host_search = False
    starts = 0  # calls of start_carousel (the dispatcher logs the error and serves without it)

    def start_carousel(self, high: int, ns: int = 0, eligible: int = 0) -> None:
        self.starts += 1
        raise RuntimeError("a lone client started the carousel")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--rows", type=int, default=61)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--gone", type=int, default=0, help="other slots seen long ago (a crowd that has left)")
    ap.add_argument("--crowd-min", type=int, default=None,
                    help="clients that make a crowd (default: the dispatcher's; 1 makes the lone client one, "
                         "and the run fails: its test's negative control)")  # fmt: skip
    args = ap.parse_args()
    if hotpath is None:
        raise SystemExit("sidecar/_hotpath.c is not built: nothing would be offered to the carousel")
    lay = Layout(n_slots=max(4, args.gone + 1), dim=DIM, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    index = _BatchedIndex(DIM, METRICS["cosine"])
    svc = Service(index, NullStore(), dim=DIM, metric=METRICS["cosine"])
    bufs: dict[int, bytearray] = {}
    svc.rows.arena = ArenaWriter(lambda v, size: bufs.setdefault(v, bytearray(size)), bufs.pop)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((args.rows, DIM)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(args.rows)],
                "texts": [f"memory {i}" for i in range(args.rows)],
                "metadatas": [{"i": i} for i in range(args.rows)]}, data)  # fmt: skip
    name = f"/kalos-lonearmed-{time.monotonic_ns() % 10**9}"
    sem = _ipc.create_semaphore(name)
    try:
        d = Dispatcher(mm, lay, [sem] * lay.n_slots, svc, Stats(), max_batch=64, describe=lambda: {})
        if args.crowd_min is not None:
            d.crowd_min = args.crowd_min
        for i in range(1, 1 + args.gone):
            d._seen[i] = 0  # (long before any window)
        states = np.ndarray((lay.n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
        np.frombuffer(mm, np.float32, DIM, lay.slot_offset(0) + lay.payload_offset)[:] = data[7] + 0.1
        flags = Flag.ARENA_DOCS | Flag.ARENA_ENTRIES
        times: dict[int, list[float]] = {0: [], carousel.KMAX: []}
        blocks: dict[int, list[float]] = {0: [], carousel.KMAX: []}
        seq = 0
        for b in range(2 * (args.calls // (2 * BLOCK))):
            ck = (0, carousel.KMAX)[b % 2]
            index.carousel_k = ck
            block = []
            for _ in range(BLOCK):
                seq += 1
                REQUEST_STRUCT.pack_into(mm, lay.slot_offset(0) + REQUEST_OFFSET, seq, Op.RECALL, flags, args.k, 1,
                                         4 * DIM, 0, 0)  # fmt: skip
                states[0] = SlotState.REQUEST
                t0 = time.perf_counter_ns()
                d.poll()
                while states[0] not in (SlotState.RESPONSE, SlotState.ERROR):
                    d.poll()
                block.append((time.perf_counter_ns() - t0) / 1000)
                if states[0] != SlotState.RESPONSE:
                    raise SystemExit(f"recall {seq} was answered with an error, not results")
                _ipc.drain(sem)
            if b >= 2:  # (the first pair warms up)
                times[ck] += block
                blocks[ck].append(statistics.median(block))
        if index.starts:
            raise SystemExit(f"a lone client started the carousel {index.starts} time(s): no figures")
        diffs = [a - o for o, a in zip(blocks[0], blocks[carousel.KMAX], strict=True)]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        print(f"one client ({args.gone} gone), {args.rows} rows x {DIM}, k {args.k}, documents from the arena, "
              f"{sum(map(len, times.values()))} calls: per recall p50 off {statistics.median(times[0]):.2f} µs, "
              f"armed {statistics.median(times[carousel.KMAX]):.2f} µs; armed - off "
              f"{statistics.mean(diffs):+.2f} ± {se:.2f} µs ({len(diffs)} block pairs)")  # fmt: skip
    finally:
        _ipc.close_semaphore(sem)
        _ipc.unlink_semaphore(name)


if __name__ == "__main__":
    main()

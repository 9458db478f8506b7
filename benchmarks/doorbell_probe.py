"""Where a resident-kernel recall's time goes, in process: no client library, no sidecar.

    python -P benchmarks/doorbell_probe.py --rows 1000,100000 [--calls 2000] [--dtype int8] [--slots 4]

(The sidecar runs the resident kernel unless ``KALOS_DOORBELL=0``; this script turns it on for
its in-process index whatever the environment says.)

For each row count: a GpuIndex (768-d, float16 or ``--dtype int8``, cosine) with a document arena, an anonymous map
standing in for the segment (``--slots``, default 4; the kernel polls every slot's state word, and
``gpu_recall.py``'s sidecars have 40), the resident kernel enabled. Measured:

* ``cycle_2ms`` / ``cycle_20ms``: start the resident kernel, leave it idle 2 or 20 ms, stop it:
  the host's ``resume_us`` and ``pause_us`` (what every write, and every request the sidecar's
  Python serves, adds), and the kernel's own clock: from block 0's start to the stop seen (the
  idle time, if it started at once), from the stop seen to the last block's return, and its
  polls before the stop;
* ``roundtrip``: Python writes a query and a DOORBELL request into slot 0 as a client would
  and spins on the state word until RESPONSE; percentiles over ``--calls`` calls;
* ``kernel``: the kernel's own clock (%globaltimer) per call: request taken (since session 18:
  after its words and query were read; before, ahead of the query's read) -> blocks started
  (prep), -> merge done (scan + merge), -> (int8) candidates re-scored (``rescore``: the
  hand-out, the blocks' loads until the last score is in, ``rescore_counted``; then the order by exact
  score and the rows written, ``rescore_order``), -> answered (response);
  the rest of the round trip is the poll's detection and the host's writes and reads;
* ``graph``: the same search through the sidecar's batch-1 path (the slot's CUDA graph,
  launched and synchronized from Python), for comparison.

Each of ``--modes`` (how the kernel loads and stores host memory: BELL_* in kernels/recall.cu)
is measured on the same index. Top-1 of each call is checked against the stored row the query
was copied from. One JSON line per row count and mode; all results in ``DIR/doorbell_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

DIM, K = 768, 10


def pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs)
    return {"p50": round(float(np.percentile(a, 50)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "mean": round(float(a.mean()), 1)}  # fmt: skip


def one_mode(idx: Any, svc: Any, seg: mmap.mmap, lay: Any, keep: np.ndarray, calls: int) -> dict[str, Any]:
    """Stop/start costs and the ping-pong through slot 0 with the kernel in ``idx.doorbell_mode``."""
    from kalos_retrievers.protocol import REQUEST_OFFSET, REQUEST_STRUCT, Flag, Op, SlotState

    out: dict[str, Any] = {}
    for gap_ms in (2, 20):  # the kernel left idle this long before the stop
        rs, ps, entry_seen, seen_exit, polls = [], [], [], [], []
        for _ in range(10):
            t0 = time.perf_counter_ns()
            svc.resume_doorbell()
            t1 = time.perf_counter_ns()
            time.sleep(gap_ms / 1000)
            t2 = time.perf_counter_ns()
            idx.pause_doorbell()
            t3 = time.perf_counter_ns()
            rs.append((t1 - t0) / 1000)
            ps.append((t3 - t2) / 1000)
            st = idx.doorbell_stamps()
            entry_seen.append((st[6] - st[8]) / 1000)  # ~gap_ms if the kernel began at once
            seen_exit.append((st[9] - st[6]) / 1000)  # the stop seen -> the last block returned
            polls.append(st[7])
        out[f"cycle_{gap_ms}ms"] = {"resume_us": pct(rs), "pause_us": pct(ps),
                                    "gpu_began_to_stop_seen_us": pct(entry_seen),
                                    "gpu_stop_seen_to_exit_us": pct(seen_exit), "polls": pct(polls)}  # fmt: skip
    off = lay.slot_offset(0)
    state = np.ndarray((1,), np.uint32, seg, off)
    q = np.ndarray((DIM,), np.float32, seg, off + lay.payload_offset)
    rows = np.ndarray((K,), np.int32, seg, off + lay.rows_offset)
    deadline = time.monotonic() + 60

    def ping(c: int) -> float | None:
        """One recall through slot 0, as a client would: its round trip in us (None: no answer)."""
        t0 = time.perf_counter_ns()
        q[:] = keep[c % len(keep)]
        REQUEST_STRUCT.pack_into(seg, off + REQUEST_OFFSET, c + 1, Op.RECALL, Flag.ARENA_DOCS, K, 1, 4 * DIM, 0, 0)
        state[0] = SlotState.DOORBELL
        while state[0] != SlotState.RESPONSE:
            if time.monotonic() > deadline:
                return None
        t1 = time.perf_counter_ns()
        state[0] = SlotState.CLAIMED
        return (t1 - t0) / 1000

    firsts = []  # the first recall right after a start: does the kernel begin at once?
    for c in range(10):
        svc.resume_doorbell()
        firsts.append(ping(c))
        idx.pause_doorbell()
    if None in firsts:
        return {**out, "stuck": True, "state": int(state[0])}
    out["first_after_start_us"] = pct(firsts)  # type: ignore[arg-type]
    svc.resume_doorbell()
    ts, wrong = [], 0
    parts: dict[str, list[float]] = {"prep": [], "scan_merge": [], "respond": [], "outside": [], "polling": [],
                                     "polls": []}  # fmt: skip
    for c in range(calls):
        rt = ping(c)
        if rt is None:
            idx.pause_doorbell()
            return {**out, "stuck": True, "state": int(state[0]), "calls_done": c}
        wrong += int(rows[0] != c % len(keep))
        if c >= 100:
            ts.append(rt)
            st = idx.doorbell_stamps()
            a, b, m, e, p0, npoll = st[:6]
            parts["prep"].append((b - a) / 1000)
            parts["scan_merge"].append((m - b) / 1000)
            if idx.exact is not None:  # int8: the candidates' exact scores, between merge and response
                parts.setdefault("rescore", []).append((st[10] - m) / 1000)
                # of which: hand-out, the blocks' loads of their rows, the last score seen ...
                parts.setdefault("rescore_counted", []).append((st[11] - m) / 1000)
                # ... then the order by exact score and the rows and scores written
                parts.setdefault("rescore_order", []).append((st[10] - st[11]) / 1000)
                m = st[10]
            parts["respond"].append((e - m) / 1000)
            parts["outside"].append(rt - (e - a) / 1000)
            parts["polling"].append((a - p0) / 1000)  # polling began (after the last answer) -> taken
            parts["polls"].append(npoll)
    out["roundtrip_us"] = pct(ts)
    out["kernel_us"] = {k: pct(v) for k, v in parts.items()}
    out["top1_wrong"] = wrong
    idx.pause_doorbell()
    return out


def probe(n: int, calls: int, modes: list[int], dtype: str = "float16", slots: int = 4) -> dict[str, Any]:
    os.environ["KALOS_DOORBELL"] = "1"  # read at import below
    from kalos_retrievers.sidecar.bench import normalized_chunks
    from kalos_retrievers.sidecar.index import SlotSpec
    from kalos_retrievers.sidecar.index_gpu import GpuIndex
    from kalos_retrievers.sidecar.service import Service
    from kalos_retrievers.sidecar.store import NullStore

    from kalos_retrievers.arena import ArenaWriter
    from kalos_retrievers.protocol import Layout, Metric

    idx = GpuIndex(DIM, Metric.COSINE, 0, dtype)
    svc = Service(idx, NullStore(), dim=DIM, metric=Metric.COSINE)
    maps: dict[int, mmap.mmap] = {}

    def open_segment(version: int, size: int) -> mmap.mmap:
        maps[version] = mmap.mmap(-1, size)
        return maps[version]

    arena = ArenaWriter(open_segment, lambda v: maps.pop(v, None))
    svc.rows.arena = arena
    svc.rows.on_arena_moved = lambda v: idx.arena_moved(arena)
    keep = []
    start = 0
    for chunk in normalized_chunks(n, DIM, 0, 65536):
        m = len(chunk)
        svc.upsert({"namespace": "", "ids": [str(i) for i in range(start, start + m)],
                    "texts": [f"memory {i}" for i in range(start, start + m)],
                    "metadatas": [{}] * m}, chunk)  # fmt: skip
        if start == 0:
            keep = chunk[:1024].copy()
        start += m
    lay = Layout(n_slots=slots, dim=DIM, payload_size=1 << 16, blob_size=1 << 16)
    seg = mmap.mmap(-1, lay.segment_size)
    idx.attach_segment(seg)
    assert idx.enable_doorbell(lay, arena) > 0
    out: dict[str, Any] = {"rows": n, "dtype": dtype, "slots": slots, "modes": {}}
    for mode in modes:
        idx.doorbell_mode = mode
        out["modes"][mode] = r = one_mode(idx, svc, seg, lay, keep, calls)
        print(json.dumps({"rows": n, "mode": mode, **r}), flush=True)
    # the sidecar's batch-1 path on slot 1: graph launch + synchronize from Python
    off1 = lay.slot_offset(1)
    q1 = np.ndarray((1, DIM), np.float32, seg, off1 + lay.payload_offset)
    r1 = np.ndarray((1, K), np.int32, seg, off1 + lay.rows_offset)
    s1 = np.ndarray((1, K), np.float32, seg, off1 + lay.scores_offset)
    spec = SlotSpec(q1, r1, s1, q1.ctypes.data, r1.ctypes.data, s1.ctypes.data)
    gs = []
    for c in range(calls):
        q1[0] = keep[c % len(keep)]
        t0 = time.perf_counter_ns()
        idx.search_slots([spec], K, svc.rows.high, 0, None, True)
        if c >= 100:
            gs.append((time.perf_counter_ns() - t0) / 1000)
    out["graph_search_slots_us"] = pct(gs)
    idx.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1000,100000")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--modes", default="0,7", help="BellCtl::mode values to compare (BELL_* bits in kernels/recall.cu)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "int8"))
    ap.add_argument("--slots", type=int, default=4, help="slots in the stand-in segment (at least 2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.slots < 2:
        ap.error("--slots: at least 2 (slot 1 times the sidecar's batch-1 path)")
    res = []
    for n in (int(x) for x in a.rows.split(",")):
        r = probe(n, a.calls, [int(m) for m in a.modes.split(",")], a.dtype, a.slots)
        print(json.dumps(r), flush=True)
        res.append(r)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "doorbell_probe.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Session 58's question: where does a listed filter's batch spend its time? At 1,005,000 rows
(S58, scoped_recall.py --batch 16/32/48) a batch through a 5,000-row list cost ~15 µs a query
(~115 µs a launch of 8 queries) where the rows' read is ~2.5 µs and the list's grid is small
(64 blocks). This times ``search_slots`` in process (one registered buffer, no client) for
batches of 1, 8, 16 and 48 with the list's grid scaled (x4 ... /32, within the index's bounds)
and with launches of 1, 2 and 4 queries instead of 8 (FUSED_MAX_Q; 1 takes the batch-1 slot
graphs, whose merge is ll_merge, not merge_appended), for lists of 2,500 and 10,000 rows of
300,011, against the masks (FILTER_LIST 0) and the default namespace. Each case: p50/p90 of
the host's call, then one traced call (the device's time from each launch's "graph start" to
its "graph end", summed), and its answers against the case's first (rows written; scores
within 2e-3: the mask's batch rounds queries to float16 in mma_filter).

    python -P list_grid.py [--rows 300011] [--calls 200] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import time

import numpy as np
from kalos_retrievers.sidecar import index_gpu
from kalos_retrievers.sidecar.index import SlotSpec
from kalos_retrievers.sidecar.index_gpu import GpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import METRICS

SCALES = (1, 4, 2, 0.5, 0.25, 0.125, 1 / 32)  # the list's grid times this (the first: as it is)
BATCHES = (1, 8, 16, 48)
FUSED = (1, 2, 4)  # FUSED_MAX_Q other than 8: queries a fused launch takes (at the undivided grid)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=300_011)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dim, n = 768, a.rows
    rng = np.random.default_rng(58)
    idx = GpuIndex(dim, METRICS["cosine"], 0, "float16")
    svc = Service(idx, NullStore(), dim=dim, metric=METRICS["cosine"])
    t0 = time.perf_counter()
    for s in range(0, n, 50_000):
        e = min(n, s + 50_000)
        v = rng.standard_normal((e - s, dim)).astype(np.float32)
        svc.upsert({"namespace": "", "ids": [str(i) for i in range(s, e)], "texts": [""] * (e - s),
                    "metadatas": [{"g": i % 120, "h": i % 30} for i in range(s, e)]}, v)  # fmt: skip
    print(f"loaded {n} rows in {time.perf_counter() - t0:.1f} s; tpr {idx.tpr}, max_grid {idx.max_grid}", flush=True)
    bmax = max(BATCHES)
    nbytes = 4 * (bmax * (dim + 20) + 64)
    mm = mmap.mmap(-1, -(-nbytes // 4096) * 4096)
    buf = np.frombuffer(mm, np.float32)
    idx._check(lambda: idx.cp.cuda.runtime.hostRegister(buf.ctypes.data, len(mm), 3))
    idx.seg_addr = buf.ctypes.data
    orig = GpuIndex._grid
    scale = [1.0]

    def grid(self: GpuIndex, high: int, kp: int, listed: bool = False) -> int:
        g = orig(self, high, kp, listed)
        return max(1, min(self.max_grid, 16384 // kp, int(g * scale[0]))) if listed else g

    GpuIndex._grid = grid  # type: ignore[method-assign]
    out: list[dict] = []
    for name, flt in (("list 2,500", {"g": 7}), ("list 10,000", {"h": 3}), ("default", None)):
        ns, cands, dense, kept = svc.eligible_for("", flt)
        if cands is not None:
            cands.flags.writeable = False  # a kept answer: its device list or mask uploaded once
        for b in BATCHES:
            q = buf[: b * dim].reshape(b, dim)
            rows = buf[b * dim : b * (dim + 10)].view(np.int32).reshape(b, 10)
            scores = buf[b * (dim + 10) : b * (dim + 20)].reshape(b, 10)
            spec = SlotSpec(q, rows, scores, q.ctypes.data, rows.ctypes.data, scores.ctypes.data)
            q[:] = rng.standard_normal((b, dim)).astype(np.float32)
            lists_cases = [(x, 16, 8) for x in SCALES] + [(1, 16, f) for f in FUSED if f < b] + [(1, 0, 8)]
            want = None
            for x, fl, fused in lists_cases if cands is not None else [(1, 16, 8)]:
                scale[0], index_gpu.FILTER_LIST, index_gpu.FUSED_MAX_Q = x, fl, fused
                lists = idx.filter_lists
                t = []
                for i in range(20 + a.calls):
                    t0 = time.perf_counter_ns()
                    idx.search_slots([spec], 10, svc.rows.high, ns, cands, dense)
                    if i >= 20:
                        t.append(time.perf_counter_ns() - t0)
                listed = idx.filter_lists - lists
                rows.fill(-1)  # the traced call's answer must be written, not the last one's
                scores.fill(np.nan)
                idx.trace = []
                idx.search_slots([spec], 10, svc.rows.high, ns, cands, dense)
                trace, idx.trace = idx.trace, None
                ends = [ev for st, ev, _ in trace if st == "graph end"]
                starts = [ev for st, ev, _ in trace if st == "graph start"]
                for ev in ends:
                    ev.synchronize()
                dev_ms = sum(idx.cp.cuda.get_elapsed_time(s0, e0) for s0, e0 in zip(starts, ends, strict=False))
                got = (np.sort(rows, axis=1).copy(), -np.sort(-scores, axis=1))
                written = bool((rows >= 0).all() and np.isfinite(scores).all())
                if want is None:
                    want = got
                same_rows = int((got[0] == want[0]).all(axis=1).sum())
                gap = float(np.abs(got[1] - want[1]).max()) if written else float("inf")
                grid_used = idx._grid(kept, 16, True) if cands is not None and fl else 0
                r = {"case": name, "batch": b, "scale": x, "fused_max_q": fused, "filter_list": fl, "grid": grid_used,
                     "listed": listed, "p50_us": float(np.percentile(t, 50)) / 1e3,
                     "p90_us": float(np.percentile(t, 90)) / 1e3, "launches": len(starts),
                     "device_us": round(1e3 * dev_ms, 1), "written": written, "queries_same_rows": same_rows,
                     "max_score_gap": gap, "same_as_first": written and gap <= 2e-3}  # fmt: skip
                out.append(r)
                print(json.dumps(r), flush=True)
                if a.out:  # after every case: a run cut short keeps what it measured
                    with open(a.out, "w") as f:
                        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

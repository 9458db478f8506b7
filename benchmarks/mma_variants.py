"""Where ``mma_filter``'s time goes: the batched pass timed alone, in variants (issue 3).

    python -P benchmarks/mma_variants.py [--rows 1000000] [--batches 8,16,24,32,64] --out DIR

At 1M rows x 768 (float16) the whole batched graph took 428 / 502 / 475 / 728 µs for 8 / 16 /
24 / 64 queries on the H200 (S6-5), against ~365 µs to read the rows once at copy bandwidth
and ~380 µs for the batch-1 scan. This script separates the pass from the rest of the graph
(prep, the sample, the thresholds, the selection) and finds what bounds it. It fills an
in-process GpuIndex with random unit rows (cosine, k = 10), runs one batch of each size
through the normal path (so the device holds that batch's parameters, float16 queries and
thresholds), then times ``mma_filter`` alone, launched on its own between CUDA events (median
of 25, the candidate counters zeroed before each launch), compiled once per variant of the
macros in kernels/recall.cu:

* ``prod``: what the sidecar runs (2 steps of 32 halves per round of loads, m16 tiles per warp
  by batch size: two for 17-32 queries, else one; 2 blocks per SM for the register cap);
* ``steps1`` / ``steps4``: 1 or 4 steps per round (bytes in flight per warp);
* ``mt1`` / ``mt2``: one or two m16 tiles per warp at every batch size (one: fewer registers,
  the query fragments loaded twice as often);
* ``minb1`` / ``minb3``: the compiler's register cap for 1 or 3 blocks per SM;
* ``no_mma``: the loads feed a cheap sum instead of the tensor cores (memory alone);
* ``no_loads``: the tensor cores run on register values (compute and shared memory alone).

For each it prints µs, the grid, the registers, and the candidates appended (equal across the
variants that compute real scores: a check that they agree). Also per batch size: the whole
graph as the sidecar runs it (wall and GPU), and a device-to-device copy of the rows (the
bandwidth floor: bytes read + written over time). Results go to ``DIR/mma_variants.json``.
Probe variants return wrong answers; they exist only to be timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_recall import DIM, K, enumerate_chunks, make_data

VARIANTS = {
    "prod": (),
    "steps1": ("-DKALOS_MMA_STEPS=1",),
    "steps4": ("-DKALOS_MMA_STEPS=4",),
    "mt1": ("-DKALOS_MMA_MT=1",),
    "mt2": ("-DKALOS_MMA_MT=2",),
    "minb1": ("-DKALOS_MMA_MINB=1",),
    "minb3": ("-DKALOS_MMA_MINB=3",),
    "no_mma": ("-DKALOS_MMA_PROBE=1",),
    "no_loads": ("-DKALOS_MMA_PROBE=2",),
}
PROBE_VARIANTS = {"no_mma", "no_loads"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batches", default="8,16,24,32,64")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import cupy as cp
    from kalos_retrievers.sidecar import cuda_kernels as kern
    from kalos_retrievers.sidecar import index_gpu
    from kalos_retrievers.sidecar.index_gpu import GpuIndex
    from kalos_retrievers.sidecar.service import Service
    from kalos_retrievers.sidecar.store import NullStore

    from kalos_retrievers.protocol import Metric

    src = kern.source()
    names = [v for v in args.variants.split(",") if v]
    mods: dict[str, dict[int, Any]] = {}
    for name in names:
        exprs = [kern.expression("mma_filter", nt, 0) for nt in index_gpu._MMA_NT]
        mod = cp.RawModule(code=src, options=("-std=c++17", f"-DKALOS_BLOCK={kern.BLOCK}", *VARIANTS[name]),
                           name_expressions=exprs)  # fmt: skip
        mods[name] = {nt: mod.get_function(e) for nt, e in zip(index_gpu._MMA_NT, exprs, strict=True)}

    n = args.rows
    idx = GpuIndex(DIM, Metric.COSINE, 0, "float16")
    svc = Service(idx, NullStore(), dim=DIM, metric=Metric.COSINE)
    for start, chunk in enumerate_chunks(n):
        svc.upsert({"namespace": "", "ids": [str(i) for i in range(start, start + len(chunk))],
                    "texts": [""] * len(chunk), "metadatas": [{}] * len(chunk)}, chunk)  # fmt: skip
    high = svc.rows.high
    s = idx.stream

    def events(fn: Any, reps: int = 25) -> float:
        ts = []
        for i in range(reps + 3):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            fn()
            e1.record(s)
            e1.synchronize()
            if i >= 3:
                ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1000)
        return round(float(np.median(ts)), 1)

    out: dict[str, Any] = {"rows": high, "dim": DIM, "k": K, "device": idx.device_name, "batches": {}}
    with idx.device, s:
        src_rows = idx.data[:high]
        dst_rows = cp.empty_like(src_rows)
        t = events(lambda: cp.copyto(dst_rows, src_rows))
        out["copy_us"], out["copy_tbs"] = t, round(2 * dst_rows.nbytes / (t * 1e-6) / 1e12, 3)
        dst_rows = src_rows = None
    for b in [int(x) for x in args.batches.split(",")]:
        q = make_data(b, DIM, 7 + b)
        walls = []
        for i in range(13):  # the sidecar's path: leaves this batch's params, queries, thresholds
            t0 = cp.cuda.Event()
            t0.record(s)
            idx.trace = []
            idx.search(q, K, high, 0, None, True)
            tr, idx.trace = idx.trace, None
            if i >= 3 and len(tr) >= 2:
                tr[-1][1].synchronize()
                walls.append(((tr[-1][2] - tr[0][2]) / 1000, cp.cuda.get_elapsed_time(tr[0][1], tr[-1][1]) * 1000))
        row: dict[str, Any] = {"graph_host_us": round(float(np.median([w[0] for w in walls])), 1),
                               "graph_gpu_us": round(float(np.median([w[1] for w in walls])), 1),
                               "mma_batches": idx.mma_batches, "overflows": idx.threshold_overflows}  # fmt: skip
        nt = next(t for t in index_gpu._MMA_NT if 8 * t >= b)
        smem = 8 * nt * idx.lds * 2
        for name in names:
            f = mods[name][nt]
            if smem > max(48 * 1024, f.max_dynamic_shared_size_bytes):
                f.max_dynamic_shared_size_bytes = smem
            by_regs = 65536 // (max(1, f.num_regs) * kern.BLOCK)
            grid = max(1, min(by_regs, idx.smem_per_sm // (smem + 2048), 8)) * idx.sms
            fargs = (idx.data, np.int32(idx.ld), np.int32(idx.lds), np.int32(-1), idx.ns, idx.sqnorm, idx.params,
                     idx.qbuf_h, idx.tau, idx.cand_k, idx.cand_v, idx.cand_count, np.int32(index_gpu.CAND_CAP),
                     np.uint64(0), np.int32(0))  # fmt: skip

            def go(f: Any = f, grid: int = grid, fargs: tuple = fargs, smem: int = smem) -> None:
                idx.cand_count.fill(0)
                f((grid,), (kern.BLOCK,), fargs, shared_mem=smem)

            with idx.device, s:
                us = events(go)
                appended = int(idx.cand_count[:b].sum())
                idx.cand_count.fill(0)  # select_cands expects zeros
                s.synchronize()
            row[name] = {"us": us, "grid": grid, "regs": int(f.num_regs), "appended": appended,
                         "gbs": round(high * idx.ld * 2 / (us * 1e-6) / 1e9, 1)}  # fmt: skip
        real = {row[v]["appended"] for v in names if v not in PROBE_VARIANTS}
        row["variants_agree"] = len(real) <= 1
        out["batches"][str(b)] = row
        print(json.dumps({"batch": b, **row}), flush=True)
    Path(args.out, "mma_variants.json").write_text(json.dumps(out, indent=1))
    print(f"rows {high}, copy {out['copy_us']} us ({out['copy_tbs']} TB/s read + write); mma_filter alone, us:")
    print("batch | graph gpu | " + " | ".join(names))
    for b, r in out["batches"].items():
        print(f"{b} | {r['graph_gpu_us']} | " + " | ".join(f"{r[v]['us']} ({r[v]['regs']}r)" for v in names))
    idx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

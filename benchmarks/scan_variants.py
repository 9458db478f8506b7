"""Where the batch-1 scan's time goes: ``scan_topk`` with parts of it switched off.

    python -P benchmarks/scan_variants.py --rows 100000,1000000 --out DIR

The batch-1 graph at 100k rows takes ~88 us against a ~36 us streaming floor, and ~418 us at 1M
(floor ~364 us): a fixed cost of ~50 us that does not scale with the rows. This script compiles
``kernels/recall.cu`` once per ``KALOS_PROBE`` value (bits defined there: no offers, no tail, no
namespace read, no per-round sync, empty), for several threads-per-row and grid sizes, and
times each scan launched on its own against an in-process GpuIndex's rows (768-d float16, or
``--dtype int8``: the int8 scan, which takes ``rescore_factor`` x k candidates for exact
re-scoring; cosine, k = 10) with CUDA events:

* ``single``: one launch between two events, synchronized each time (the hot path's shape:
  launch latency + the kernel);
* ``chained``: 20 launches back to back between two events, per launch (the kernel alone).

Results go to ``DIR/scan_variants.json`` and print as a table. Variants with a probe bit set
return wrong answers; they exist only to be timed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_recall import DIM, K, enumerate_chunks, make_data

PROBES = {"full": 0, "no_merge": 64, "no_append": 32, "no_tail": 2, "no_ns": 4, "no_offers": 1,
          "stream_only": 1 | 2 | 4 | 8, "empty": 16}


def build(n: int, dtype: str = "float16") -> tuple[Any, Any, Any]:
    from kalos_retrievers.sidecar.index import SlotSpec
    from kalos_retrievers.sidecar.index_gpu import GpuIndex
    from kalos_retrievers.sidecar.service import Service
    from kalos_retrievers.sidecar.store import NullStore

    from kalos_retrievers.protocol import Metric

    idx = GpuIndex(DIM, Metric.COSINE, 0, dtype)
    svc = Service(idx, NullStore(), dim=DIM, metric=Metric.COSINE)
    for start, chunk in enumerate_chunks(n):
        svc.upsert({"namespace": "", "ids": [str(i) for i in range(start, start + len(chunk))],
                    "texts": [""] * len(chunk), "metadatas": [{}] * len(chunk)}, chunk)  # fmt: skip
    mm = mmap.mmap(-1, 1 << 20)
    buf = np.frombuffer(mm, np.float32)
    q = buf[:DIM].reshape(1, DIM)
    rows = buf[1024 : 1024 + K].view(np.int32).reshape(1, K)
    scores = buf[2048 : 2048 + K].reshape(1, K)
    q[:] = make_data(1, DIM, 99)
    idx.attach_segment(mm)
    spec = SlotSpec(q, rows, scores, q.ctypes.data, rows.ctypes.data, scores.ctypes.data)
    idx.search_slots([spec], K, svc.rows.high, 0, None, True)  # prep's outputs are in place now
    return idx, svc, (mm, spec)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="100000,1000000")
    ap.add_argument("--tpr", default="4,8,16,32")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dtype", default="float16", choices=["float16", "int8"])
    args = ap.parse_args()
    import cupy as cp
    from kalos_retrievers.sidecar import cuda_kernels as kern
    from kalos_retrievers.sidecar import index_gpu

    src = kern.source()
    tprs = [int(t) for t in args.tpr.split(",")]
    mods = {}
    for name, bits in PROBES.items():
        exprs = [kern.expression("scan_topk", index_gpu._CTYPE[args.dtype], t, 1, 0) for t in tprs]
        mod = cp.RawModule(code=src, options=("-std=c++17", f"-DKALOS_BLOCK={kern.BLOCK}", f"-DKALOS_PROBE={bits}",
                                                  *kern.extra_options()),
                           name_expressions=exprs)  # fmt: skip
        mods[name] = {t: mod.get_function(e) for t, e in zip(tprs, exprs, strict=True)}
    results: list[dict[str, Any]] = []
    for n in [int(x) for x in args.rows.split(",")]:
        idx, svc, keep = build(n, args.dtype)
        int8 = args.dtype == "int8"  # k = 10 hits, RESCORE_FACTOR x 10 candidates for re-scoring
        buf = idx._buf(index_gpu._pow2(idx.rescore_factor * K) if int8 else 16)
        smem = idx._smem(1, buf)
        rs = idx.rowscale if int8 else np.uint64(0)
        sargs = (idx.data, idx.ns, idx.sqnorm, rs, idx.params, idx.qbuf, idx.qbuf_i8, np.int32(idx.ld),
                 np.int32(buf), idx.scratch_k, idx.scratch_v, idx.sync)  # fmt: skip
        s = idx.stream

        def timed(fn: Any, reps: int, s: Any = s) -> float:
            ts = []
            for i in range(30):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                for _ in range(reps):
                    fn()
                e1.record(s)
                e1.synchronize()
                if i >= 5:
                    ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / reps)
            return round(float(np.median(ts)), 1)

        with idx.device, s:
            for tpr in tprs:
                for grid in sorted({idx.sms, 2 * idx.sms, 4 * idx.sms, 8 * idx.sms}):
                    row = {"dtype": args.dtype, "rows": n, "tpr": tpr, "grid": grid, "rows_per_block": -(-n // grid)}
                    for name, fns in mods.items():
                        f = fns[tpr]
                        f.max_dynamic_shared_size_bytes = max(f.max_dynamic_shared_size_bytes, smem)

                        def go(f: Any = f, grid: int = grid, sargs: tuple = sargs, smem: int = smem) -> None:
                            f((grid,), (kern.BLOCK,), sargs, shared_mem=smem)

                        row[name] = timed(go, 1)
                        row[name + "_chained"] = timed(go, 20)
                    results.append(row)
                    print(json.dumps(row), flush=True)
        idx.close()
        del svc, keep
    Path(args.out, "scan_variants.json").write_text(json.dumps(results, indent=1))
    cols = list(PROBES)
    print("rows tpr grid | " + " | ".join(f"{c} (single/chained us)" for c in cols))
    for r in results:
        print(f"{r['rows']} {r['tpr']} {r['grid']} | " + " | ".join(f"{r[c]}/{r[c + '_chained']}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

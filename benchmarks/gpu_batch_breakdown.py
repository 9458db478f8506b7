"""Where a batched recall's time goes on the GPU (issue 3): mma_filter or GEMM, top-k, syncs.

    python benchmarks/gpu_batch_breakdown.py [--rows 1000000] [--batch 64]

In process, on random normalized 768-d float16 rows: times (CUDA events, median of 30) the
cuBLAS GEMM alone (float32 and float16 scores), a device copy of the score matrix (what one
pass over it costs), the whole search call (wall clock, with its synchronizations and Python),
and torch's ``mm`` + ``topk`` on the same rows for reference. Then the sidecar's own path:
``search_slots`` over a registered segment with one query per slot (``--batch`` slots answered
together, as dynamic batching does, and 1 slot: the fused graph), with ``GpuIndex.trace`` on:
per stage, the GPU time (CUDA events between marks) and the host time (perf_counter), medians
over the runs; float16 batches take mma_filter (one stage, "mma end"), so the slot path runs
again with cuBLAS (``slot_path_cublas``), and both paths' rows for the batch are compared.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

import numpy as np
from kalos_retrievers.sidecar.bench import make_data

from kalos_retrievers.protocol import Metric


def slot_path(idx: Any, q: np.ndarray, nb: int, k: int, n: int, reps: int = 30) -> dict[str, Any]:
    """``search_slots`` for ``nb`` slots of one query each, in a registered segment: wall time,
    and the traced stages (GPU and host microseconds from the previous mark, medians)."""
    import cupy as cp
    from kalos_retrievers.sidecar.bench import one_query_slots

    _mm, specs = one_query_slots(idx, nb, q.shape[1], k, q)
    walls, stages = [], {}
    for i in range(reps + 3):
        idx.trace = []
        t0 = time.perf_counter_ns()
        idx.search_slots(specs, k, n, 0, None, True)
        t1 = time.perf_counter_ns()
        tr, idx.trace = idx.trace, None
        if i < 3:
            continue
        tr[-1][1].synchronize()  # the last mark may be recorded after the final sync
        walls.append((t1 - t0) / 1000)
        for (_, e0, h0), (name, e1, h1) in itertools.pairwise(tr):
            g = stages.setdefault(name, ([], []))
            g[0].append(cp.cuda.get_elapsed_time(e0, e1) * 1000)
            g[1].append((h1 - h0) / 1000)
    idx.detach_segment()
    med = lambda v: round(float(np.median(v)), 1)  # noqa: E731
    return {"wall_us": med(walls),
            "stages_gpu_host_us": {name: [med(g), med(h)] for name, (g, h) in stages.items()}}  # fmt: skip


def main() -> None:
    import cupy as cp
    from cupy_backends.cuda.libs import cublas
    from kalos_retrievers.sidecar import index_gpu
    from kalos_retrievers.sidecar.index_gpu import GpuIndex

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    n, b, dim, k = a.rows, a.batch, 768, 10
    idx = GpuIndex(dim, Metric.COSINE, 0, "float16")
    data = make_data(n, dim, 3)
    for s in range(0, n, 65536):
        chunk = data[s : s + 65536]
        idx.set_rows(np.arange(s, s + len(chunk)), chunk, np.zeros(len(chunk), np.int32))
    q = make_data(b, dim, 4)
    out: dict = {"rows": n, "batch": b}

    def ev(fn, reps: int = 30) -> float:
        ts = []
        for i in range(reps + 3):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(idx.stream)
            fn()
            e1.record(idx.stream)
            e1.synchronize()
            if i >= 3:
                ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1000)
        return round(float(np.median(ts)), 1)

    # the whole path, wall clock (includes prep, syncs, allocation, Python)
    ts = []
    for i in range(33):
        t0 = time.perf_counter_ns()
        idx.search(q, k, n, 0, None, True)
        if i >= 3:
            ts.append((time.perf_counter_ns() - t0) / 1000)
    out["search_wall_us"] = round(float(np.median(ts)), 1)
    # GEMM alone on the index's stream
    with idx.device, idx.stream:
        scores = cp.empty((b, n), cp.float32)
        s16 = cp.empty((b, n), cp.float16)
        handle = cp.cuda.device.get_cublas_handle()
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)

        def gemm(out_arr: Any, out_type: int) -> None:  # float16 rows and queries; CUDA_R_32F=0, 16F=2
            cublas.setStream(handle, idx.stream.ptr)
            cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, b, idx.ld,
                          one.ctypes.data, idx.data.data.ptr, 2, idx.ld, idx.qbuf_h.data.ptr, 2,
                          idx.ld, zero.ctypes.data, out_arr.data.ptr, out_type, n,
                          cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)  # fmt: skip

        out["gemm_us"] = ev(lambda: gemm(scores, 0))
        out["gemm_stream_is_ours"] = cublas.getStream(handle) == idx.stream.ptr
        out["gemm_fp16_out_us"] = ev(lambda: gemm(s16, 2))
        out["copy_scores_us"] = ev(scores.copy)
    import torch

    m = torch.from_numpy(data).to("cuda", torch.float16)
    tq = torch.from_numpy(q).to("cuda", torch.float16)
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        tt = []
        for i in range(33):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            s = tq @ m.T
            e1.record()
            e1.synchronize()
            if i >= 3:
                tt.append(e0.elapsed_time(e1) * 1000)
        out["torch_mm_us"] = round(float(np.median(tt)), 1)
        tt = []
        for i in range(33):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.topk(s, k, dim=1)
            e1.record()
            e1.synchronize()
            if i >= 3:
                tt.append(e0.elapsed_time(e1) * 1000)
        out["torch_topk_us"] = round(float(np.median(tt)), 1)
    out["gemm_path_enabled"] = index_gpu.USE_GEMM
    sizes = sorted({1, 8, 16, 24, b})
    out["slot_path"] = {str(nb): slot_path(idx, q, nb, k, n) for nb in sizes}
    out["mma_batches"], out["threshold_overflows"] = idx.mma_batches, idx.threshold_overflows
    # the same slots through cuBLAS (KALOS_MMA=0), and whether both paths found the same rows
    mma_rows, mma_scores = idx.search(q, k, n, 0, None, True)
    index_gpu.USE_MMA = False
    out["slot_path_cublas"] = {str(nb): slot_path(idx, q, nb, k, n) for nb in sizes if nb > 1}
    blas_rows, blas_scores = idx.search(q, k, n, 0, None, True)
    index_gpu.USE_MMA = True
    out["mma_vs_cublas"] = {
        "row_sets_differ": int(sum(set(a) != set(c) for a, c in zip(mma_rows.tolist(), blas_rows.tolist(),
                                                                     strict=True))),
        "max_score_diff": float(np.abs(mma_scores - blas_scores).max()),
    }
    print(json.dumps(out))
    idx.close()


if __name__ == "__main__":
    main()

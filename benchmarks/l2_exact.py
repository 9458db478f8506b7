"""What the CPU index's exact L2 re-ranking (session 66, ``CpuIndex._exact_l2``) costs, in
process (no shared memory, no client).

    python -P benchmarks/l2_exact.py [--rows 200000] [--dim 384] [--calls 5]

Per case, the mean time of one ``CpuIndex.search`` of k=10 (ms) with the re-ranking and
without it (the float32 ``|q|² - 2q·x + |x|²`` answer as before session 66), for: unit rows;
the same with one row scaled to norm 1,000 (it widens the all-rows error bound, so the
shortlist is narrowed by each row's own); a batch of 16 of those; and every row offset by 30
(norms ~590, neighbours ~1.4 apart: float32's expansion cannot tell them apart, so every row
is rescored). Queries are rows plus 1% noise.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kalos_retrievers.sidecar.index import CpuIndex

from kalos_retrievers.protocol import Metric


def _time(data: np.ndarray, q: np.ndarray, calls: int, exact: bool) -> float:
    idx = CpuIndex(data.shape[1], Metric.L2)
    idx.set_rows(np.arange(len(data)), data, np.zeros(len(data), np.int32))
    if not exact:  # (the answer before the re-ranking: the approximate top-k as it stands)
        idx._exact_l2 = lambda q, k, s, i, v, u: ((i if u is None else u[i]).astype(np.int32), v.astype(np.float32))  # type: ignore[method-assign]
    idx.search(q, 10, len(data), 0, None, True)
    t = time.perf_counter()
    for _ in range(calls):
        idx.search(q, 10, len(data), 0, None, True)
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--calls", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    data = rng.standard_normal((a.rows, a.dim)).astype(np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    far = data.copy()
    far[-1] *= 1000
    cases = [("unit rows", data, 1), ("one row of norm 1,000", far, 1), ("the same, a batch of 16", far, 16),
             ("every row offset by 30", data + np.float32(30), 1)]  # fmt: skip
    print(f"{a.rows} x {a.dim} float32, L2, k=10, {a.calls} calls each: ms per search")
    print("| case | queries | exact (since session 66) | float32 only (before) |")
    print("|---|---|---|---|")
    for label, d, nq in cases:
        q = d[:nq] + 0.01 * rng.standard_normal((nq, a.dim)).astype(np.float32)
        print(f"| {label} | {nq} | {_time(d, q, a.calls, True):.1f} | {_time(d, q, a.calls, False):.1f} |", flush=True)


if __name__ == "__main__":
    main()

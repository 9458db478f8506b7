"""Recall latency right after deleting 90% of the rows while a client keeps recalling (one
recall every 20 ms, so the sidecar is never idle for 50 ms): the median per second, through
the client. 100k x 384 float32 rows, inner product, a CPU sidecar.

    python -P benchmarks/compaction_under_load.py
"""

from __future__ import annotations

import time

import numpy as np

from kalos_retrievers import KalosClient


def main() -> None:
    n, dim = 100_000, 384
    rng = np.random.default_rng(0)
    v = rng.standard_normal((n, dim)).astype(np.float32)
    with KalosClient.spawn(dim=dim, device="cpu", metric="ip") as c:
        for s in range(0, n, 5000):
            c.upsert([str(i) for i in range(s, s + 5000)], v[s : s + 5000])
        c.delete([str(i) for i in range(n) if i % 10 != 9])
        q = rng.standard_normal(dim).astype(np.float32)
        t0 = time.perf_counter()
        out: list[tuple[float, float]] = []
        while time.perf_counter() - t0 < 4:
            a = time.perf_counter()
            c.recall(q, 10)
            out.append((a - t0, time.perf_counter() - a))
            time.sleep(0.02)
    for sec in range(4):
        ts = [d for t, d in out if sec <= t < sec + 1]
        print(f"second {sec}: median recall {np.median(ts) * 1000:.2f} ms ({len(ts)} recalls)")


if __name__ == "__main__":
    main()

"""The CPU index's search paths, timed in process (no shared memory, no client).

    python -P benchmarks/cpu_search_paths.py [--rows 100000] [--dim 384] [--calls 10]

100k x 384 float32 rows, cosine: 98% in the default namespace (with a metadata field ``h``
that half of them have at 1) and 2% in namespace ``small``, interleaved. Printed: the mean
time of ``Service.recall`` for a recall in the small namespace, in the big one, with a filter
matching half the rows, and for batches of 2 and 3 queries (ms). Compare two trees by running
it in each.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import METRICS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    n, dim = a.rows, a.dim
    rng = np.random.default_rng(0)
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = Service(CpuIndex(dim, METRICS["cosine"]), NullStore(), dim=dim, metric=METRICS["cosine"])
    for s in range(0, n, 10_000):
        part = np.arange(s, min(n, s + 10_000))
        for ns, sel in (("small", part[part % 50 == 0]), ("", part[part % 50 != 0])):
            svc.upsert({"namespace": ns, "ids": [str(i) for i in sel], "texts": ["t"] * len(sel),
                        "metadatas": [{"h": int(i % 2)} for i in sel]}, data[sel])  # fmt: skip

    def ms(f: Callable[[], object]) -> float:
        f()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            f()
        return round((time.perf_counter() - t0) / a.calls * 1000, 2)

    q = rng.standard_normal((3, dim)).astype(np.float32)
    figures = {
        "small namespace (2%), batch 1": lambda: svc.recall(q[:1], 10, "small", None),
        "big namespace (98%), batch 1": lambda: svc.recall(q[:1], 10, "", None),
        "filter matching half, batch 1": lambda: svc.recall(q[:1], 10, "", {"h": 1}),
        "batch 2": lambda: svc.recall(q[:2], 10, "", None),
        "batch 3": lambda: svc.recall(q, 10, "", None),
    }
    for name, f in figures.items():
        print(f"{name}: {ms(f)} ms")


if __name__ == "__main__":
    main()

"""A filter's kept candidates after a write, in process (no sidecar, no client).

    python -P benchmarks/scope_refresh.py [--rows 100000] [--users 100] [--calls 200]

``Service.eligible_for`` of ``{"user_id": "u7"}`` right after a one-row upsert into a namespace
of ``--rows`` rows spread over ``--users`` users (the agent memory store's shape: an agent
learns a fact, then recalls): the kept answer brought up to date from the rows the write
touched (``RowTable.touched_since``, session 48), against the same answer made afresh, as
before (``touched_since`` forced to None). Every answer is checked against a fresh evaluation.
Printed: the median and p90 of each, in µs, in three runs (afresh between two up-to-date ones).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import METRICS, encode_json, encode_recall_args

DIM, NS = 8, "memory/agent"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--users", type=int, default=100)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    if a.rows < a.users or a.users < 8 or a.calls < 1:
        p.error("--users must be at least 8, --rows at least --users, --calls at least 1")
    svc = Service(CpuIndex(DIM, METRICS["cosine"]), NullStore(), dim=DIM, metric=METRICS["cosine"])
    rng = np.random.default_rng(0)
    for lo in range(0, a.rows, 10_000):
        hi = min(lo + 10_000, a.rows)
        ids = [f"m{i}" for i in range(lo, hi)]
        metas = [{"user_id": f"u{i % a.users}"} for i in range(lo, hi)]
        svc.upsert({"namespace": NS, "ids": ids, "texts": ids, "metadatas": metas},
                   rng.standard_normal((hi - lo, DIM)).astype(np.float32))  # fmt: skip
    flt = {"user_id": "u7"}
    key = encode_recall_args(NS, encode_json(flt))
    svc.eligible_for(NS, flt, key)
    vec = rng.standard_normal((1, DIM)).astype(np.float32)

    def run(label: str) -> None:
        ts = []
        for j in range(a.calls):
            svc.upsert({"namespace": NS, "ids": [f"w{j % 50}"], "texts": ["x"], "metadatas": [{"user_id": "u7"}]}, vec)
            t = time.perf_counter_ns()
            got = svc.eligible_for(NS, flt, key)
            ts.append(time.perf_counter_ns() - t)
            fresh = svc.eligible_for(NS, flt)  # (no key: evaluated afresh)
            assert got[3] == fresh[3] and np.array_equal(got[1], fresh[1]), label
        print(f"{label:28s} median {np.median(ts) / 1000:7.1f} µs, p90 {np.percentile(ts, 90) / 1000:7.1f} µs "
              f"({got[3]} rows eligible)")  # fmt: skip

    before = svc.scope_refreshes
    run("up to date from the touched")
    assert svc.scope_refreshes - before == a.calls  # (the path timed is the one meant)
    real = svc.rows.touched_since
    svc.rows.touched_since = lambda seq: None  # type: ignore[method-assign]
    run("made afresh (as before)")
    svc.rows.touched_since = real  # type: ignore[method-assign]
    run("up to date from the touched")
    print(f"{a.rows} rows of {a.users} users in one namespace, a one-row upsert before each of {a.calls} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())

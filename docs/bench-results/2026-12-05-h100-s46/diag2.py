"""S46-1 probe (run as is on the H100 lease): ``Service.recall_slots`` of one query in process
over a GpuIndex (100k x 768 float16 rows; then as many again in a second namespace), by scope:
the non-resident search a GPU sidecar's scoped recall pays."""

import time

import numpy as np
from kalos_retrievers.sidecar.bench import make_data, normalized_chunks, one_query_slots
from kalos_retrievers.sidecar.index_gpu import GpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import METRICS, encode_json, encode_recall_args

D, N = 768, 100_000
for two in (False, True):
    idx = GpuIndex(D, METRICS["cosine"], 0, "float16")
    svc = Service(idx, NullStore(), dim=D, metric=METRICS["cosine"])
    for ns in ("", "scoped") if two else ("",):
        at = 0
        for ch in normalized_chunks(N, D, 0, chunk=16384):
            n = len(ch)
            svc.upsert({"namespace": ns, "ids": [str(i) for i in range(at, at + n)], "texts": [""] * n,
                        "metadatas": [{"user": i % 2} for i in range(at, at + n)]}, ch)  # fmt: skip
            at += n
    mm, specs = one_query_slots(idx, 1, D, 10, make_data(4, D, 1))
    sp = specs[0]
    cases = [("", None)] + ([("scoped", None), ("scoped", {"user": 1})] if two else [("", {"user": 1})])
    for ns, flt in cases:
        key = encode_recall_args(ns, encode_json(flt) if flt else None) or None

        def one(svc=svc, sp=sp, ns: str = ns, flt: dict | None = flt, key: bytes | None = key) -> None:
            svc.recall_slots([sp], 10, ns, flt, key=key)

        for _ in range(200):
            one()
        ts = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            one()
            ts.append(time.perf_counter_ns() - t0)
        e = svc.eligible_for(ns, flt, key)
        p50 = np.median(ts) / 1e3
        print(f"two={two} {ns!r} {flt} dense={e[2]} n={e[3]}: recall_slots p50 {p50:.1f} us", flush=True)
    idx.close()

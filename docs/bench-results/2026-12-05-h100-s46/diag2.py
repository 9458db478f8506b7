import time, numpy as np
from kalos_retrievers.sidecar.index_gpu import GpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore
from kalos_retrievers.sidecar.bench import normalized_chunks, make_data, one_query_slots
from kalos_retrievers.protocol import METRICS, encode_recall_args, encode_json
D=768; N=100_000
for two in (False, True):
    idx = GpuIndex(D, METRICS["cosine"], 0, "float16")
    svc = Service(idx, NullStore(), dim=D, metric=METRICS["cosine"])
    for ns in (("", "scoped") if two else ("",)):
        at=0
        for ch in normalized_chunks(N, D, 0, chunk=16384):
            n=len(ch); svc.upsert({"namespace": ns, "ids": [str(i) for i in range(at,at+n)], "texts": [""]*n, "metadatas": [{"user": i%2} for i in range(at,at+n)]}, ch); at+=n
    mm, specs = one_query_slots(idx, 1, D, 10, make_data(4, D, 1))
    sp = specs[0]
    cases = [("", None)] + ([("scoped", None), ("scoped", {"user": 1})] if two else [("", {"user": 1})])
    for ns, flt in cases:
        key = encode_recall_args(ns, encode_json(flt) if flt else None) or None
        f = lambda: svc.recall_slots([sp], 10, ns, flt, key=key)
        for _ in range(200): f()
        ts=[]
        for _ in range(2000):
            t0=time.perf_counter_ns(); f(); ts.append(time.perf_counter_ns()-t0)
        e = svc.eligible_for(ns, flt, key)
        print(f"two={two} {ns!r} {flt} dense={e[2]} n={e[3]}: recall_slots p50 {np.median(ts)/1e3:.1f} us", flush=True)
    idx.close()

"""S46-1 probe (run as is on the H100 lease): a GPU sidecar with 100k x 768 float16 rows in
each of two namespaces; 2000 batch-1 recalls per case, with the resident kernel's counters
(``stats()["index"]``: how many launches each case caused) and the sidecar's phases."""

import json

from kalos_retrievers.sidecar.bench import make_data, normalized_chunks, time_calls

from kalos_retrievers import Sidecar

D, N = 768, 100_000
sc = Sidecar(dim=D, device="cuda", dtype="float16", log_level="WARNING", startup_timeout=300)
with sc, sc.client(timeout=30) as c:
    for ns in ("", "scoped"):
        at = 0
        for ch in normalized_chunks(N, D, 0, chunk=8192):
            n = len(ch)
            metas = [{"user": i % 2} for i in range(at, at + n)]
            c.upsert([str(i) for i in range(at, at + n)], ch, None, metas, namespace=ns, timeout=600)
            at += n
    q = make_data(1024, D, 1)
    cases = (("default", {}), ("namespace", {"namespace": "scoped"}), ("filter", {"filter": {"user": 1}}),
             ("default2", {}))  # fmt: skip
    for name, kw in cases:
        s0 = c.stats()
        t = time_calls(lambda i, kw=kw: c.recall(q[i & 1023], 10, **kw), 2000, 200)
        s1 = c.stats()
        idx0, idx1 = s0.get("index", {}), s1.get("index", {})
        moved = {k: v - idx0.get(k, 0) for k, v in idx1.items() if type(v) in (int, float) and v != idx0.get(k, 0)}
        print(name, t["p50_us"], t["p99_us"], json.dumps(moved), json.dumps(s1.get("phases")), flush=True)

import json, time, numpy as np
from kalos_retrievers import Sidecar
from kalos_retrievers.sidecar.bench import normalized_chunks, make_data, time_calls
D=768; N=100_000
sc = Sidecar(dim=D, device="cuda", dtype="float16", log_level="WARNING", startup_timeout=300)
with sc, sc.client(timeout=30) as c:
    for ns in ("", "scoped"):
        at=0
        for ch in normalized_chunks(N, D, 0, chunk=8192):
            n=len(ch); c.upsert([str(i) for i in range(at,at+n)], ch, None, [{"user": i%2} for i in range(at,at+n)], namespace=ns, timeout=600); at+=n
    q = make_data(1024, D, 1)
    for name, kw in (("default", {}), ("namespace", {"namespace": "scoped"}), ("filter", {"filter": {"user": 1}}), ("default2", {})):
        s0 = c.stats()
        t = time_calls(lambda i: c.recall(q[i & 1023], 10, **kw), 2000, 200)
        s1 = c.stats()
        idx0, idx1 = s0.get("index", {}), s1.get("index", {})
        d = {k: idx1[k] - idx0.get(k, 0) for k in idx1 if isinstance(idx1[k], int | float) and not isinstance(idx1[k], bool)}
        print(name, t["p50_us"], t["p99_us"], json.dumps({k: v for k, v in d.items() if v}), json.dumps(s1.get("phases")), flush=True)

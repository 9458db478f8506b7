# ruff: noqa  (a record of the script as it ran on the device)
"""Session 51: where KalosMemory.search's time goes on a GPU sidecar, by phase, in scenarios
(back to back, a pause, a stats call, an add, an add and a pause before each search)."""
import sys, time
import numpy as np
from kalos_retrievers import Sidecar
from kalos_retrievers.embeddings import HashingEmbeddings
from kalos_retrievers.memory import KalosMemory, _item

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 600
with Sidecar(dim=384, device=dev, dtype=None if dev == "cpu" else "float16", log_level="WARNING", startup_timeout=300) as sc:
    m = KalosMemory(sc.name, embedding=HashingEmbeddings(dim=384), timeout=30)
    per = 200
    for u in range(100):
        m.add([f"user {u} fact {j}: likes topic {(u * 7 + j) % 50}" for j in range(per)], user_id=f"u{u}")
    rng = np.random.default_rng(5)
    for b in range(0, 20000, 2000):
        m.client.upsert([f"p{j}" for j in range(b, b + 2000)], rng.standard_normal((2000, 384)).astype(np.float32),
                        [f"plain {j}" for j in range(b, b + 2000)], [{"a": j % 2} for j in range(b, b + 2000)])
    qs = [f"what topic {i % 50} does the user like" for i in range(64)]
    c = m.client
    served = lambda: int(c.stats()["index"].get("doorbell_served", 0))
    for i in range(50):
        m.search(qs[i & 63], user_id="u7", limit=5)
    def scen(name, before, plain=False):
        ph = np.zeros((N, 5))
        s0 = served()
        for i in range(N):
            user = f"u{i % 3}"
            before(i, user)
            t0 = time.perf_counter_ns()
            vec = m.embedder.query(qs[i & 63])
            t1 = time.perf_counter_ns()
            flt = m._scoped_filter(user, None, None, None)
            t2 = time.perf_counter_ns()
            if plain:
                hits = c.recall(vec, 5)
            else:
                hits = c.recall(vec, 5, namespace=m.namespace, filter=flt)
            t3 = time.perf_counter_ns()
            items = [_item(h, h.score) for h in hits]
            t4 = time.perf_counter_ns()
            ph[i] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
            assert items
        k = served() - s0
        p = np.percentile(ph, 50, axis=0) / 1000
        p9 = np.percentile(ph[:, 2], 90) / 1000
        print(f"{name:28s} embed {p[0]:6.1f} filter {p[1]:5.1f} recall {p[2]:7.1f} (p90 {p9:7.1f}) items {p[3]:6.1f} "
              f"total {p[4]:7.1f} us p50; kernel answered {k}/{N} (incl. stats' own reads: 0)", flush=True)
    nothing = lambda i, u: None
    pause = lambda i, u: time.sleep(0.002)
    stats = lambda i, u: c.stats()
    add = lambda i, u: m.add([f"user {u} learned fact {i}"], user_id=u)
    def addp(i, u):
        add(i, u); time.sleep(0.002)
    def upsert_plain(i, u):
        c.upsert([f"x{i}"], np.random.default_rng(i).standard_normal((1, 384)).astype(np.float32), [f"t{i}"], [{"a": 1}])
    for rnd in range(2):
        scen(f"[{rnd}] back to back", nothing)
        scen(f"[{rnd}] 2 ms pause", pause)
        scen(f"[{rnd}] stats before", stats)
        scen(f"[{rnd}] add before", add)
        scen(f"[{rnd}] add + 2 ms pause", addp)
        scen(f"[{rnd}] plain recall b2b", nothing, plain=True)
        scen(f"[{rnd}] plain recall 2 ms pause", pause, plain=True)
        scen(f"[{rnd}] plain, upsert + pause", lambda i, u: (upsert_plain(i, u), time.sleep(0.002)), plain=True)
    m.close()

# ruff: noqa
"""Session 51: which of KalosMemory.search's searches after an add and a pause the kernel misses,
and why: running when the search began (the header's doorbell_k) or not; answered or not."""
import sys
import time

import numpy as np

from kalos_retrievers import Sidecar
from kalos_retrievers.embeddings import HashingEmbeddings
from kalos_retrievers.memory import KalosMemory

N = int(sys.argv[1]) if len(sys.argv) > 1 else 600
with Sidecar(dim=384, device="cuda", dtype="float16", log_level="WARNING", startup_timeout=300) as sc:
    m = KalosMemory(sc.name, embedding=HashingEmbeddings(dim=384), timeout=30)
    for u in range(100):
        m.add([f"user {u} fact {j}: likes topic {(u * 7 + j) % 50}" for j in range(200)], user_id=f"u{u}")
    qs = [f"what topic {i % 50} does the user like" for i in range(64)]
    c = m.client

    def served() -> int:
        return int(c.stats()["index"].get("doorbell_served", 0))

    for i in range(50):
        m.search(qs[i & 63], user_id="u7", limit=5)
    for pause in (2, 5, 2):
        codes, us = [], np.empty(N)
        s = served()
        for i in range(N):
            user = f"u{i % 3}"
            m.add([f"user {user} learned fact {i}"], user_id=user)
            t_add = time.perf_counter_ns()
            time.sleep(pause / 1000)
            running = c._conn.doorbell_k() > 0
            slept = (time.perf_counter_ns() - t_add) / 1e6
            t0 = time.perf_counter_ns()
            m.search(qs[i & 63], user_id=user, limit=5)
            us[i] = (time.perf_counter_ns() - t0) / 1000
            now = served()
            codes.append(("R" if running else "s") + ("k" if now > s else "h") + (f"{slept:.1f}" if slept > pause + 0.3 else ""))
            s = now
        kinds = {k: sum(1 for c_ in codes if c_[:2] == k) for k in ("Rk", "Rh", "sk", "sh")}
        for k in kinds:
            sel = np.array([c_[:2] == k for c_ in codes])
            p = f"p50 {np.percentile(us[sel], 50):.1f} µs" if sel.any() else "-"
            print(f"pause {pause} ms: {k} (R running at the search / s stopped; k kernel's answer / h host's): {kinds[k]}, {p}")
        print("  first 120:", " ".join(codes[:120]))
        late = [c_ for c_ in codes if len(c_) > 2]
        print(f"  pauses over {pause + 0.3} ms: {len(late)}")
    st = c.stats()["index"]
    print({k: v for k, v in st.items() if "bell" in k or "doorbell" in k})
    m.close()

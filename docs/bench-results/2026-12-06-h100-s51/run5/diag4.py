# ruff: noqa  (a record of the script as it ran on the device)
"""Session 51: what a 2 ms pause costs an in-process search too (torch on the GPU: M @ q, topk,
host query to host result; and the embedding alone), b2b against a pause before each."""
import time
import numpy as np
import torch
from kalos_retrievers.embeddings import HashingEmbeddings

rng = np.random.default_rng(3)
for rows in (20000, 100000):
    M = torch.from_numpy(rng.standard_normal((rows, 384)).astype(np.float32)).cuda()
    M = torch.nn.functional.normalize(M, dim=1).half()
    qs = rng.standard_normal((64, 384)).astype(np.float32)
    def search(i):
        q = torch.from_numpy(qs[i & 63]).cuda().half()
        s, r = torch.topk(M @ q, 5)
        return r.cpu().numpy(), s.float().cpu().numpy()
    for i in range(300):
        search(i)
    for pause in (0, 2, 0, 2):
        t = np.empty(1500)
        for i in range(1500):
            if pause:
                time.sleep(pause / 1000)
            t0 = time.perf_counter_ns(); search(i); t[i] = (time.perf_counter_ns() - t0) / 1000
        print(f"torch {rows} rows x 384 float16, {pause} ms pause before each: p50 {np.percentile(t, 50):.1f} µs, p90 {np.percentile(t, 90):.1f}", flush=True)
e = HashingEmbeddings(dim=384)
for pause in (0, 2, 0, 2):
    t = np.empty(1500)
    for i in range(1500):
        if pause:
            time.sleep(pause / 1000)
        t0 = time.perf_counter_ns(); e.embed_query(f"what topic {i % 50} does the user like"); t[i] = (time.perf_counter_ns() - t0) / 1000
    print(f"HashingEmbeddings.embed_query, {pause} ms pause before each: p50 {np.percentile(t, 50):.1f} µs", flush=True)

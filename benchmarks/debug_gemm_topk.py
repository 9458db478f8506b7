"""Debug aid: compare the GEMM + topk_scores path with the fused path on the same queries and,
for a query where they differ, show where the missing row was lost."""

from __future__ import annotations

import numpy as np
from kalos_retrievers.sidecar.index_gpu import GpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import Metric

rng = np.random.default_rng(5)
n, dim, k = 200_003, 97, 10
data = rng.standard_normal((n, dim)).astype(np.float32)
idx = GpuIndex(dim, Metric.COSINE, 0, "float32")
svc = Service(idx, NullStore(), dim=dim, metric=Metric.COSINE)
svc.upsert({"namespace": "", "ids": [str(i) for i in range(n)], "texts": [""] * n,
            "metadatas": [{}] * n}, data)  # fmt: skip
q = rng.standard_normal((64, dim)).astype(np.float32)
rg, sg = svc.recall(q, k, "", None)  # 64 > 8: GEMM path
rf = np.concatenate([svc.recall(q[i : i + 8], k, "", None)[0] for i in range(0, 64, 8)])
bad = [j for j in range(64) if set(rg[j]) != set(rf[j])]
print("queries differing:", len(bad), bad[:10])
if bad:
    j = bad[0]
    lost = sorted(set(rf[j]) - set(rg[j]))
    print("query", j, "lost rows", lost, "gemm", rg[j].tolist(), sg[j].tolist())
    grid = max(1, min(idx.max_grid // 2, -(-n // (4 * 4 * 256)), 16384 // 16))
    sk = idx.scratch_k[: 64 * grid * k].get().reshape(64, grid, k)
    sv = idx.scratch_v[: 64 * grid * k].get().reshape(64, grid, k)
    bound = sk[j, :, k - 1].max()
    for r in lost:
        b = (r % (grid * 256)) // 256
        print(f"row {r}: block {b}, block list rows {sv[j, b].tolist()} scores {np.round(sk[j, b], 5).tolist()}")
    print("bound", bound, "blocks whose k-th > true k-th:", int((sk[j, :, k - 1] > sg[j].min()).sum()))
    # duplicates inside block lists?
    dups = sum(len(set(sv[j, b])) < k for b in range(grid))
    print("block lists with duplicate rows:", dups)
idx.close()

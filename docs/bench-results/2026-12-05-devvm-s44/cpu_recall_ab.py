"""Session 44's CPU batch-1 recall A/B: ``python -P cpu_recall_ab.py ROOT`` prints µs per
``Service.recall`` (best of 5 repeats) at 1,000 and 10,000 rows x 768, cosine, k 10, with the
sidecar and library of the source tree ROOT."""

import json
import sys
import timeit

sys.path.insert(0, sys.argv[1])

import numpy as np

from kalos_retrievers.protocol import METRICS
from sidecar.index import CpuIndex
from sidecar.service import Service
from sidecar.store import NullStore

rng = np.random.default_rng(1)
out = {}
for n in (1000, 10000):
    svc = Service(CpuIndex(768, METRICS["cosine"]), NullStore(), dim=768, metric=METRICS["cosine"])
    rows = {"ids": [str(i) for i in range(n)], "texts": [""] * n, "metadatas": [{} for _ in range(n)]}
    svc.upsert(rows, rng.standard_normal((n, 768)).astype(np.float32))
    q = rng.standard_normal((1, 768)).astype(np.float32)
    num = 2000 if n == 1000 else 300
    timed = timeit.repeat(lambda s=svc, q=q: s.recall(q, 10, "", None), number=num, repeat=5)
    out[n] = min(timed) / num * 1e6
print(json.dumps(out))

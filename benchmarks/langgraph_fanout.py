"""``KalosStore.search`` under a prefix that holds many namespaces: what a search over every
user's memories costs (one recall and one read of the candidates' items per namespace with a
query, one read of the items per namespace without).

    python -P benchmarks/langgraph_fanout.py [--namespaces 100,1000] [--dim 64] [--repeat 5]
        [--device cpu]

For each count N, a fresh sidecar holds N namespaces ``("users", "uI")`` of one item each
(``{"text": ...}``, embedded by ``HashingEmbeddings``), and ``search(("users",), query=...,
limit=10)`` and ``search(("users",), limit=10)`` are timed ``--repeat`` times each (the
store's timeout 600 s, so none degrades). Printed: the best and the median time of each, and
the best per namespace, in ms. Every search is checked to return 10 items, all scored with a
query (a search whose recalls found nothing would fall back to listing items, and time that).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kalos_retrievers import Sidecar
from kalos_retrievers.embeddings import HashingEmbeddings
from kalos_retrievers.langgraph import KalosStore


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--namespaces", default="100,1000")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    print(f"{'namespaces':>10} {'search':>9} {'best ms':>9} {'median ms':>10} {'ms / namespace':>15}")
    for n in (int(x) for x in a.namespaces.split(",")):
        with Sidecar(dim=a.dim, device=a.device, startup_timeout=120.0) as sc:
            index = {"dims": a.dim, "embed": HashingEmbeddings(dim=a.dim), "fields": ["text"]}
            store = KalosStore(sc.name, index=index, timeout=600.0)
            for i in range(n):
                store.put(("users", f"u{i}"), "note", {"text": f"note {i} about tea and trains"})
            for label, query in (("query", "tea"), ("no query", None)):
                times = []
                for _ in range(a.repeat):
                    t0 = time.perf_counter()
                    got = store.search(("users",), query=query, limit=10)
                    times.append((time.perf_counter() - t0) * 1e3)
                    scored = all(i.score is not None for i in got) if query else True
                    if len(got) != min(10, n) or not scored:
                        print(f"error: the {label} search over {n} namespaces returned {len(got)} items"
                              f"{'' if scored else ', some unscored'}", file=sys.stderr)  # fmt: skip
                        return 1
                best, med = min(times), statistics.median(times)
                print(f"{n:>10} {label:>9} {best:>9.1f} {med:>10.1f} {best / n:>15.3f}")
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a namespace and a filter cost a batch-1 recall, through the client and a real sidecar.

    python -P benchmarks/scoped_recall.py [--device cpu|cuda] [--rows 100000] [--dim 768]
        [--calls 3000] [--rounds 3] [--batch 1] [--out DIR]

The adapters scope their recalls: the agent memory store (``KalosMemory``) always recalls in
its collection's namespace, usually with a filter on the user or the agent; the LangGraph
store recalls in a namespace per item prefix; a ``KalosRetriever`` or vector store may be given
a namespace. The figures elsewhere (``gpu_recall.py``) are all in the default namespace
without a filter: the path built for speed on both sides (the client's C request, the
sidecar's C pickup, a GPU sidecar's resident kernel). This times the others beside it.

One sidecar holds ``--rows`` random unit rows twice: once in the default namespace and once in
namespace ``scoped``, each row with metadata ``{"user": i % 2, "tenant": i % 100}``; and a
100th as many again in namespace ``small`` (the agent memory store's collection beside a
large store of documents). Cases, each
``client.recall`` of k = 10, timed in turn for ``--rounds`` rounds of ``--calls`` calls (the same
queries):

* ``default``: no namespace, no filter (half of the store's rows);
* ``namespace``: ``namespace="scoped"`` (the other half: as many rows);
* ``namespace+filter``: ``namespace="scoped", filter={"user": 1}`` (a quarter);
* ``filter``: ``filter={"user": 1}`` in the default namespace;
* ``namespace+1% filter``: ``namespace="scoped", filter={"tenant": 7}`` (a 200th of the rows:
  one tenant's, the agent memory store's usual shape; a GPU sidecar scans a list of its rows
  since session 52, ``KALOS_FILTER_LIST=0`` compares the mask it scanned before; since
  session 54 only in an index of at least ``KALOS_LIST_MIN_ROWS`` rows, 262,144 unless set:
  ``--rows`` 131,000 and more, or set it 0 to compare lists on fewer);
* ``small namespace``: ``namespace="small"`` (a 201st of the rows; since session 53 the sidecar
  keeps a list of its rows: a GPU sidecar scans it as a filter's list, a CPU one no longer
  finds the namespace's rows at every recall).

With ``--batch B`` above 1 each call is ``client.recall_batch`` of ``B`` queries instead (a GPU
sidecar answers a batch with a listed filter by fused scans of up to 8 queries a launch, one
with a mask by the GEMM over every row: ``KALOS_FILTER_LIST=0`` compares the two).

Printed: each case's median over rounds of its p50 and p99 (µs), and the sidecar's phases
(pickup / search / answer) per path from ``stats()``. ``DIR/scoped_recall.json`` holds every
round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from kalos_retrievers.sidecar.bench import machine, make_data, normalized_chunks, time_calls

from kalos_retrievers import Sidecar

CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "namespace": {"namespace": "scoped"},
    "namespace+filter": {"namespace": "scoped", "filter": {"user": 1}},
    "filter": {"filter": {"user": 1}},
    "namespace+1% filter": {"namespace": "scoped", "filter": {"tenant": 7}},
    "small namespace": {"namespace": "small"},
}


def load(client: Any, rows: int, dim: int, seed: int, namespace: str) -> float:
    """``rows`` unit rows (``bench.normalized_chunks``: the same for both namespaces) with
    metadata ``{"user": i % 2, "tenant": i % 100}``; returns the seconds taken."""
    t0 = time.perf_counter()
    at = 0
    for chunk in normalized_chunks(rows, dim, seed, chunk=8192):
        n = len(chunk)
        ids = [str(i) for i in range(at, at + n)]
        metas = [{"user": i % 2, "tenant": i % 100} for i in range(at, at + n)]
        client.upsert(ids, chunk, None, metas, namespace=namespace, timeout=600)
        at += n
    return time.perf_counter() - t0


def served(client: Any) -> int:
    """Recalls the sidecar's resident kernel has answered (``doorbell_served``; 0 without one)."""
    return int(client.stats()["index"].get("doorbell_served", 0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="queries a call (above 1: recall_batch)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.rows < 20 or a.dim < 1 or a.calls < 1 or a.rounds < 1 or not 1 <= a.batch <= 1024:
        p.error("--rows must be at least 20; --dim, --calls and --rounds at least 1; --batch 1 to 1024")
    queries = make_data(1024, a.dim, 1)

    def call(c: Any, i: int, kw: dict[str, Any]) -> list[Any]:
        """The call timed: one query's hits (``--batch 1``) or a batch's results, one list of
        hits per query."""
        if a.batch == 1:
            return [c.recall(queries[i & 1023], 10, **kw)]
        at = (i * a.batch) % (1024 - a.batch + 1)
        return c.recall_batch(queries[at : at + a.batch], 10, **kw)

    dtype = None if a.device == "cpu" else "float16"
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
                           "rows_per_namespace": a.rows, "dim": a.dim, "device": a.device, "batch": a.batch,
                           "rounds": {}}  # fmt: skip
    sc = Sidecar(dim=a.dim, device=a.device, dtype=dtype, log_level="WARNING", startup_timeout=300)
    with sc, sc.client(timeout=30) as c:
        out["load_s"] = [round(load(c, a.rows, a.dim, 0, ns), 2) for ns in ("", "scoped")]
        out["load_s"].append(round(load(c, max(a.rows // 100, 10), a.dim, 1, "small"), 2))
        for name, kw in CASES.items():  # every case's answer checked once: its rows are in scope
            results = call(c, 0, kw)
            assert len(results) == a.batch, (name, len(results))
            for res in results:
                assert len(res) == 10, (name, len(res))
                for key, want in kw.get("filter", {}).items():
                    assert all(h.metadata[key] == want for h in res), name
                assert all(h.namespace == kw.get("namespace", "") for h in res), name
        for r in range(a.rounds):
            for name, kw in CASES.items():
                before = served(c)
                t = time_calls(lambda i, kw=kw: call(c, i, kw), a.calls, min(200, a.calls))
                # the recalls a GPU's resident kernel answered, warm-up included (0 on a CPU)
                t["kernel_answered"] = served(c) - before
                out["rounds"].setdefault(name, []).append(t)
                print(f"round {r} {name:20s} p50 {t['p50_us']:8.2f}  p99 {t['p99_us']:8.2f} µs"
                      f"  (the resident kernel answered {t['kernel_answered']})", file=sys.stderr)  # fmt: skip
        st = c.stats()
        out["sidecar"] = {"latency": st["latency"].get("recall"), "phases": st.get("phases"),
                          "backend": c.header.backend}  # fmt: skip
    med = {name: {q: round(float(np.median([t[q] for t in ts])), 2) for q in ("p50_us", "p99_us")}
           for name, ts in out["rounds"].items()}  # fmt: skip
    out["median"] = med
    shape = "batch 1" if a.batch == 1 else f"recall_batch of {a.batch}"
    backend = out["sidecar"]["backend"]
    print(f"{a.rows} rows x {a.dim} per namespace on {a.device} ({backend}), {shape}; {out['machine']}")
    print("| case | p50 (µs) | p99 (µs) |\n|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['p50_us']} | {m['p99_us']} |")
    print("sidecar phases:", json.dumps(out["sidecar"]["phases"]))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "scoped_recall.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

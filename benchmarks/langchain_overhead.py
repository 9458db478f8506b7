"""What the LangChain adapter adds to a recall (issue 4).

    python benchmarks/langchain_overhead.py                      # 1k, 10k and 100k rows
    python benchmarks/langchain_overhead.py --rows 10000 --calls 3000 --json out.json

For each row count, on one CPU sidecar holding N random unit vectors (dim 384, cosine, top-4)
with short texts, batch-1 latency over the same queries of:

* ``recall``   ``KalosClient.recall(query, k)``: the floor; its documents are decoded lazily,
  on first access, so this figure does not include them;
* ``bare``     ``BaseRetriever.invoke`` of a retriever that returns ``[]``: LangChain's own
  per-call cost (callback manager, run start and end), paid by every retriever;
* ``bare+recall``       one call doing both, back to back;
* ``bare+recall+hits``  the same, also reading the k hits (ids, texts, metadata) from the
  result, which is what a direct client user pays to get the texts;
* ``kalos``    ``KalosRetriever.invoke``;
* ``inmem``    ``InMemoryVectorStore.as_retriever().invoke`` on the same vectors and texts;

and, from the medians, what the adapter adds to LangChain's and the client's own costs:

* ``adapter = kalos - (bare+recall+hits)``: the embedding lookup, argument and dimension
  checks, the deadline, the degradation bookkeeping and building k ``Document`` objects;
* ``kalos - (bare+recall)``: the same plus the client's decoding of the k hits, which
  ``recall`` defers until they are read.

The composites are timed as single calls, because LangChain's code runs slower right after a
recall (cold caches after the wait) than in a loop of its own: subtracting the separately
timed ``bare`` median would charge that to the adapter.

The embedding model is a dict of precomputed vectors (``PrecomputedEmbeddings``: a lookup
returning the stored list of floats), so embedding cost is excluded from every figure; the
``recall`` baseline is given the same list of floats. The three Kalos figures are measured in
interleaved rounds (recall, bare, kalos, recall, ...) so that drift of the machine affects
them alike. Timing uses ``perf_counter_ns`` around each call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from kalos_retrievers.sidecar.bench import machine, make_data
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import InMemoryVectorStore

from kalos_retrievers import KalosClient, Sidecar
from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore

DIM = 384
K = 4
N_QUERIES = 256


class PrecomputedEmbeddings(Embeddings):
    """Embeddings that look vectors up by text: embedding cost is excluded from the timings."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.table[t] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.table[text]


class EmptyRetriever(BaseRetriever):
    """LangChain's own per-call overhead: a retriever that does nothing."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return []


def median_us(samples: list[float]) -> float:
    return round(float(np.median(samples)), 1)


def interleaved(fns: dict[str, Callable[[int], Any]], calls: int, rounds: int) -> dict[str, Any]:
    """Per-call latencies (us) of each fn, measured in ``rounds`` interleaved rounds."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    per = max(1, calls // rounds)
    for r in range(rounds):
        for name, fn in fns.items():
            lat = out[name]
            for i in range(r * per, (r + 1) * per):
                t0 = time.perf_counter_ns()
                fn(i)
                lat.append((time.perf_counter_ns() - t0) / 1000)
    return {name: {"p50_us": median_us(v), "p99_us": round(float(np.percentile(v, 99)), 1),
                   "calls": len(v)} for name, v in out.items()}  # fmt: skip


def timed(fn: Callable[[int], Any], budget_s: float, max_calls: int) -> dict[str, Any]:
    """Latency of a slow fn: as many calls as fit in ``budget_s`` (at least 5)."""
    fn(0)
    lat: list[float] = []
    end = time.perf_counter() + budget_s
    i = 0
    while i < max_calls and (i < 5 or time.perf_counter() < end):
        t0 = time.perf_counter_ns()
        fn(i)
        lat.append((time.perf_counter_ns() - t0) / 1000)
        i += 1
    return {"p50_us": median_us(lat), "calls": len(lat)}


def bench_rows(n: int, calls: int, warmup: int, inmem_budget: float) -> dict[str, Any]:
    print(f"{n} rows: loading", file=sys.stderr, flush=True)
    data = make_data(n, DIM, seed=n)
    texts = [f"memory {i}" for i in range(n)]
    rng = np.random.default_rng(7)
    picks = rng.choice(n, size=min(N_QUERIES, n), replace=False)
    noise = rng.standard_normal((len(picks), DIM)).astype(np.float32) * 0.01
    queries = data[picks] + noise
    query_texts = [f"query {j}" for j in range(len(picks))]
    table = {t: v.tolist() for t, v in zip(texts, data, strict=True)}
    table.update({t: v.tolist() for t, v in zip(query_texts, queries, strict=True)})
    emb = PrecomputedEmbeddings(table)
    q_lists = [table[t] for t in query_texts]
    nq = len(query_texts)

    with Sidecar(dim=DIM, device="cpu", log_level="WARNING") as sc:
        with KalosClient(sc.name, timeout=30) as loader:
            loader.upsert([str(i) for i in range(n)], data, texts=texts, timeout=600)
        client = KalosClient(sc.name, timeout=10)
        retriever = KalosRetriever(vectorstore=KalosVectorStore(emb, client=client), k=K)
        bare = EmptyRetriever()
        fns: dict[str, Callable[[int], Any]] = {
            "recall": lambda i: client.recall(q_lists[i % nq], K),
            "bare": lambda i: bare.invoke(query_texts[i % nq]),
            "bare+recall": lambda i: (
                bare.invoke(query_texts[i % nq]),
                client.recall(q_lists[i % nq], K),
            ),
            "bare+recall+hits": lambda i: (
                bare.invoke(query_texts[i % nq]),
                list(client.recall(q_lists[i % nq], K)),
            ),
            "kalos": lambda i: retriever.invoke(query_texts[i % nq]),
        }
        got = retriever.invoke(query_texts[0])
        if len(got) != K or got[0].page_content != texts[picks[0]]:
            raise RuntimeError(f"wrong answer from the sidecar: {got}")
        for fn in fns.values():
            for i in range(warmup):
                fn(i)
        res = interleaved(fns, calls, rounds=10)
        client.close()

    inmem = InMemoryVectorStore(emb)
    inmem.add_texts(texts, ids=[str(i) for i in range(n)])
    inmem_ret = inmem.as_retriever(search_kwargs={"k": K})
    if inmem_ret.invoke(query_texts[0])[0].page_content != texts[picks[0]]:
        raise RuntimeError("wrong answer from InMemoryVectorStore")
    res["inmem"] = timed(lambda i: inmem_ret.invoke(query_texts[i % nq]), inmem_budget, calls)
    kalos = res["kalos"]["p50_us"]
    res["adapter_us"] = round(kalos - res["bare+recall+hits"]["p50_us"], 1)
    res["over_recall_us"] = round(kalos - res["bare+recall"]["p50_us"], 1)
    res["rows"] = n
    return res


def markdown(results: list[dict[str, Any]]) -> str:
    head = ("rows", "recall", "bare BaseRetriever", "bare + recall", "bare + recall + read hits",
            "KalosRetriever", "adapter adds (target <= 20)", "incl. hit decoding",
            "InMemoryVectorStore retriever")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        ok = "yes" if r["adapter_us"] <= 20 else "no"
        lines.append(
            f"| {r['rows']:,} | {r['recall']['p50_us']} | {r['bare']['p50_us']} | "
            f"{r['bare+recall']['p50_us']} | {r['bare+recall+hits']['p50_us']} | "
            f"{r['kalos']['p50_us']} | {r['adapter_us']} ({ok}) | "
            f"{r['over_recall_us']} | {r['inmem']['p50_us']:,} ({r['inmem']['calls']} calls) |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    p.add_argument("--calls", type=int, default=5_000, help="calls per Kalos figure")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--inmem-budget", type=float, default=10.0, help="seconds per in-memory run")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = [bench_rows(n, args.calls, args.warmup, args.inmem_budget) for n in args.rows]
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "dim": DIM, "k": K,
            "command": "python " + " ".join(sys.argv)}  # fmt: skip
    print(f"{meta['date']}, {meta['machine']}, dim {DIM}, k {K}, CPU sidecar; p50 in us")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

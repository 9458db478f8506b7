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

and what the adapter adds to LangChain's and the client's own costs, as the median (and
interquartile range) of per-call differences:

* ``adapter = kalos - (bare+recall+hits)``: the embedding lookup, argument and dimension
  checks, the deadline, the degradation bookkeeping and building k ``Document`` objects;
* ``kalos - (bare+recall)``: the same plus the client's decoding of the k hits, which
  ``recall`` defers until they are read.

The composites are timed as single calls, because LangChain's code runs slower right after a
recall (cold caches after the wait) than in a loop of its own: subtracting the separately
timed ``bare`` median would charge that to the adapter.

The embedding model is a dict of precomputed vectors (``PrecomputedEmbeddings``: a lookup
returning the stored list of floats), so embedding cost is excluded from every figure; the
``recall`` baseline is given the same list of floats. The Kalos figures are measured round
robin (call i of each, then call i + 1 of each), so that each difference compares calls made
at the same moment with the same query; at 100k rows one recall takes milliseconds and its
jitter is larger than the adapter's cost, which a difference of medians would not survive.
Timing uses ``perf_counter_ns`` around each call.

Placement (``--no-pin`` turns it off): the sidecar runs with ``OPENBLAS_NUM_THREADS=1`` and is
pinned to the last core, this process to the first, and the client spins through the whole
recall (``--spin-us``) instead of sleeping on its semaphore. On a 2-core VM the sidecar's
multi-threaded matrix product otherwise takes both cores, and code running right after a
multi-millisecond sleep runs cold; either swamps a difference of microseconds. The
``InMemoryVectorStore`` run gets all cores back.
"""

from __future__ import annotations

import argparse
import json
import os
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


def round_robin(fns: dict[str, Callable[[int], Any]], calls: int) -> dict[str, np.ndarray]:
    """Per-call latencies (us): call i of every fn, in turn, then call i + 1 of every fn."""
    out = {name: np.empty(calls) for name in fns}
    for i in range(calls):
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            fn(i)
            out[name][i] = (time.perf_counter_ns() - t0) / 1000
    return out


def paired(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Median and interquartile range of the per-call differences ``a - b`` (same query, same
    moment): steadier than a difference of medians when one recall takes milliseconds."""
    q1, q2, q3 = np.percentile(a - b, [25, 50, 75])
    return {"p50_us": round(float(q2), 1), "iqr_us": round(float(q3 - q1), 1)}


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


def bench_rows(
    n: int, *, calls: int, warmup: int, inmem_budget: float, pin: bool, spin_us: float,
    device: str = "cpu",
) -> dict[str, Any]:  # fmt: skip
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

    with Sidecar(dim=DIM, device=device, log_level="WARNING") as sc:
        cores = sorted(os.sched_getaffinity(0))
        if pin and len(cores) >= 2 and sc.pid is not None:
            # the sidecar on one core, this process on another: neither steals the other's
            # core or caches (with OPENBLAS_NUM_THREADS=1, set in main, the sidecar's matrix
            # products stay on its core)
            for tid in os.listdir(f"/proc/{sc.pid}/task"):
                os.sched_setaffinity(int(tid), {cores[-1]})
            os.sched_setaffinity(0, {cores[0]})
        with KalosClient(sc.name, timeout=30) as loader:
            loader.upsert([str(i) for i in range(n)], data, texts=texts, timeout=600)
        # Spin through the whole recall rather than sleep on the semaphore: on this VM, code
        # that runs right after a wait of milliseconds runs cold, 2-5x slower, which would
        # swamp differences of microseconds at 100k rows. Both sides use this one client.
        client = KalosClient(sc.name, timeout=10, spin_us=spin_us)
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
        lat = round_robin(fns, calls)
        client.close()
        os.sched_setaffinity(0, cores)
    res: dict[str, Any] = {
        name: {"p50_us": median_us(list(v)), "p99_us": round(float(np.percentile(v, 99)), 1),
               "calls": len(v)}
        for name, v in lat.items()
    }  # fmt: skip

    inmem = InMemoryVectorStore(emb)
    inmem.add_texts(texts, ids=[str(i) for i in range(n)])
    inmem_ret = inmem.as_retriever(search_kwargs={"k": K})
    if inmem_ret.invoke(query_texts[0])[0].page_content != texts[picks[0]]:
        raise RuntimeError("wrong answer from InMemoryVectorStore")
    res["inmem"] = timed(lambda i: inmem_ret.invoke(query_texts[i % nq]), inmem_budget, calls)
    res["adapter"] = paired(lat["kalos"], lat["bare+recall+hits"])
    res["with_hit_decoding"] = paired(lat["kalos"], lat["bare+recall"])
    res["rows"] = n
    return res


def markdown(results: list[dict[str, Any]]) -> str:
    head = ("rows", "recall", "bare BaseRetriever", "bare + recall", "bare + recall + read hits",
            "KalosRetriever", "adapter adds (target <= 20 us)", "adapter + hit decoding",
            "InMemoryVectorStore retriever")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        a, h = r["adapter"], r["with_hit_decoding"]
        ok = "yes" if a["p50_us"] <= 20 else "no"
        lines.append(
            f"| {r['rows']:,} | {r['recall']['p50_us']} | {r['bare']['p50_us']} | "
            f"{r['bare+recall']['p50_us']} | {r['bare+recall+hits']['p50_us']} | "
            f"{r['kalos']['p50_us']} | {a['p50_us']} (IQR {a['iqr_us']}) {ok} | "
            f"{h['p50_us']} (IQR {h['iqr_us']}) | "
            f"{r['inmem']['p50_us']:,} ({r['inmem']['calls']} calls) |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    p.add_argument("--calls", type=int, default=5_000, help="calls per Kalos figure")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--inmem-budget", type=float, default=10.0, help="seconds per in-memory run")
    p.add_argument("--no-pin", action="store_true", help="leave CPU placement to the scheduler")
    p.add_argument("--spin-us", type=float, default=50_000, help="client spin before blocking")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cpu", help="the sidecar's --device (cuda: GPU sidecar)")
    args = p.parse_args()
    if not args.no_pin:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # inherited by the sidecars started below
    results = [
        bench_rows(n, calls=args.calls, warmup=args.warmup, inmem_budget=args.inmem_budget,
                   pin=not args.no_pin, spin_us=args.spin_us, device=args.device)
        for n in args.rows
    ]  # fmt: skip
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "dim": DIM, "k": K,
            "device": args.device, "command": "python " + " ".join(sys.argv)}  # fmt: skip
    print(f"{meta['date']}, {meta['machine']}, dim {DIM}, k {K}, {args.device} sidecar; p50 in us")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

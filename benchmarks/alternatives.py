"""Kalos against what its users would do instead, on the same rows and the same queries.

    python -P benchmarks/alternatives.py [--rows 100000] [--dim 384] [--k 10] [--calls 2000]
        [--device cpu] [--budget-s 20] [--only kalos,numpy,faiss] [--json out.json]

One query at a time (batch 1), top-``k`` by cosine similarity over ``--rows`` random unit
vectors, from a query vector in this process to the ``k`` ids and scores in this process (no
embedding: every system gets the same float32 vectors). The systems, each used as its own
documentation shows:

* ``kalos``     ``KalosClient.recall(q, k)`` and its ``.ids``, against a sidecar process on
  ``--device`` (float16 rows on a GPU, float32 on the CPU): the query and the answer cross
  processes through shared memory;
* ``numpy``     in process: ``M @ q``, ``argpartition``, then the k sorted;
* ``torch``     in process on ``--device``: ``M @ q`` then ``torch.topk``, the query copied in
  and the answer copied out (float16 rows on a GPU, as Kalos's);
* ``cupy``      in process on a GPU: ``M @ q`` (float16 rows), ``argpartition``, the k sorted,
  the answer copied out;
* ``faiss``     ``faiss.IndexFlatIP`` (exact; faiss-cpu) in process;
* ``inmemory``  LangChain's ``InMemoryVectorStore.similarity_search_with_score_by_vector``;
* ``chroma``    a ``chromadb.EphemeralClient`` collection (HNSW, cosine: approximate; its
  ``ef_search`` Chroma's default unless ``--chroma-ef-search``) queried with
  ``query_embeddings``. Random unit vectors are the hardest case for a graph index: its
  recall on real embeddings, which cluster, is higher at the same settings;
* ``qdrant``    ``qdrant_client.QdrantClient(":memory:")``, Qdrant's local mode (in process,
  exact; not the Qdrant server, which needs a service this benchmark does not start).

A system whose package is missing is reported as such, not timed (the ``compare`` extra,
``pip install -e ".[compare]"``, brings the last three). Each system is built and warmed up (50
calls or 3 s), then timed for ``--calls`` calls or about ``--budget-s`` seconds, whichever ends
first. On a CPU (``--rounds`` 8) every system is built first and the timing is interleaved:
each system in turn (the order rotated) for an eighth of its calls and its time, after 3
untimed calls, at least one call a round, so that a shared machine whose speed drifts is sampled at the same moments for
every system. With a GPU (``--rounds`` 1) each system is timed alone and dropped before the
next is built: Kalos's resident kernel keeps every SM polling for 5 s after its last recall,
which would slow torch's and CuPy's kernels in the rounds after Kalos's. Recall@k is measured
against the exact answer (float64) over the first 200 queries: 1.0 for the exact systems (up
to float16 rounding on a GPU), below for HNSW. Printed: one table (load time, p50, p99, calls,
recall@k and how many queries it rests on, and each p50 as a multiple of Kalos's). A system
that answers fewer than k is reported as wrong, not timed further.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np
from kalos_retrievers.sidecar.bench import machine, make_data

SYSTEMS = ("kalos", "numpy", "torch", "cupy", "faiss", "inmemory", "chroma", "qdrant")
N_QUERIES = 256
N_CHECK = 200
WARMUP = 50  # calls, or WARMUP_S seconds (at least one call), whichever ends first
WARMUP_S = 3.0
REWARM = 3  # untimed calls at the start of each round's block
ROUNDS = 8

# A system's search: query number -> the k ids (ints, best first). Built by a maker, which
# returns it with a closer (None: nothing to close).
Search = Callable[[int], list[int]]
Made = tuple[Search, Callable[[], None] | None]


class Missing(Exception):
    """The system's package is not installed."""


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as e:
        raise Missing(f"{name} is not installed ({e})") from None


# ------------------------------------------------------------------------------ the systems
def make_kalos(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    from kalos_retrievers.sidecar.bench import load

    from kalos_retrievers import KalosClient, Sidecar

    device = opts.device
    dtype = None if device == "cpu" else "float16"
    sc = Sidecar(dim=data.shape[1], metric="cosine", device=device, dtype=dtype, log_level="WARNING",
                 startup_timeout=600)  # fmt: skip
    sc.start()
    try:
        c = KalosClient(sc.name, dim=data.shape[1], timeout=60)
        load(c, data, progress=False)
    except BaseException:
        sc.stop()
        raise

    def search(i: int) -> list[int]:
        return [int(x) for x in c.recall(queries[i % N_QUERIES], k).ids]

    def close() -> None:
        c.close()
        sc.stop()

    return search, close


def make_numpy(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    def search(i: int) -> list[int]:
        s = data @ queries[i % N_QUERIES]
        top = np.argpartition(s, -k)[-k:]
        return top[np.argsort(-s[top])].tolist()

    return search, None


def make_torch(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    torch = _import("torch")
    dev = torch.device(opts.device)
    m = torch.from_numpy(data).to(dev, torch.float16 if dev.type == "cuda" else torch.float32)

    def search(i: int) -> list[int]:
        q = torch.from_numpy(queries[i % N_QUERIES]).to(dev, m.dtype)
        _, idx = torch.topk(m @ q, k)
        return idx.cpu().tolist()

    return search, None


def make_cupy(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    cp = _import("cupy")
    if not opts.device.startswith("cuda"):
        raise Missing("cupy runs on a GPU only (--device cuda)")
    cp.cuda.Device(int(opts.device.partition(":")[2] or 0)).use()
    m = cp.asarray(data.astype(np.float16))

    def search(i: int) -> list[int]:
        s = m @ cp.asarray(queries[i % N_QUERIES], cp.float16)
        top = cp.argpartition(-s, k - 1)[:k]  # (the k largest: kth counted from the front)
        return top[cp.argsort(-s[top])].get().tolist()

    return search, None


def make_faiss(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    faiss = _import("faiss")
    index = faiss.IndexFlatIP(data.shape[1])
    index.add(data)

    def search(i: int) -> list[int]:
        _, idx = index.search(queries[i % N_QUERIES][None, :], k)
        return idx[0].tolist()

    return search, None


def make_inmemory(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import InMemoryVectorStore

    vectors = data.tolist()

    class Stored(Embeddings):  # the store asks its embedding for the rows' vectors: handed over
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return [vectors[int(t)] for t in texts]

        def embed_query(self, text: str) -> list[float]:
            raise AssertionError("searched by vector only")

    store = InMemoryVectorStore(Stored())
    n = len(data)
    for start in range(0, n, 10_000):
        ids = [str(j) for j in range(start, min(n, start + 10_000))]
        store.add_texts(ids, ids=ids)
    qs = queries.tolist()

    def search(i: int) -> list[int]:
        hits = store.similarity_search_with_score_by_vector(qs[i % N_QUERIES], k=k)
        return [int(doc.id) for doc, _ in hits]

    return search, None


def make_chroma(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    chromadb = _import("chromadb")
    client = chromadb.EphemeralClient()
    hnsw: dict[str, Any] = {"space": "cosine"}
    if opts.chroma_ef_search:
        hnsw["ef_search"] = opts.chroma_ef_search
    coll = client.create_collection(f"kalos_bench_{time.monotonic_ns()}", configuration={"hnsw": hnsw},
                                    embedding_function=None)  # fmt: skip
    n, step = len(data), client.get_max_batch_size()
    for start in range(0, n, step):
        end = min(n, start + step)
        coll.add(ids=[str(j) for j in range(start, end)], embeddings=data[start:end])

    def search(i: int) -> list[int]:
        got = coll.query(query_embeddings=queries[i % N_QUERIES][None, :], n_results=k, include=["distances"])
        return [int(x) for x in got["ids"][0]]

    return search, None


def make_qdrant(data: np.ndarray, queries: np.ndarray, k: int, opts: argparse.Namespace) -> Made:
    _import("qdrant_client")
    from qdrant_client import QdrantClient, models

    client = QdrantClient(":memory:")
    client.create_collection("bench", vectors_config=models.VectorParams(size=data.shape[1],
                                                                         distance=models.Distance.COSINE))  # fmt: skip
    client.upload_collection("bench", vectors=data, ids=range(len(data)), batch_size=4096)
    qs = queries.tolist()

    def search(i: int) -> list[int]:
        got = client.query_points("bench", query=qs[i % N_QUERIES], limit=k)
        return [int(p.id) for p in got.points]

    return search, None


MAKERS: dict[str, Callable[..., Made]] = {
    "kalos": make_kalos, "numpy": make_numpy, "torch": make_torch, "cupy": make_cupy, "faiss": make_faiss,
    "inmemory": make_inmemory, "chroma": make_chroma, "qdrant": make_qdrant,
}  # fmt: skip


# ------------------------------------------------------------------------------ measuring
def exact_topk(data: np.ndarray, queries: np.ndarray, k: int) -> list[set[int]]:
    """The exact top-k of each of the first N_CHECK queries (float64 scores), a block of rows
    at a time (1M x 768 rows in float64 would be 6 GB)."""
    q = queries[:N_CHECK].astype(np.float64).T
    cand_i, cand_s = [], []
    for start in range(0, len(data), 65536):
        s = data[start : start + 65536].astype(np.float64) @ q  # (rows, queries)
        kk = min(k, len(s))
        top = np.argpartition(s, -kk, axis=0)[-kk:]
        cand_i.append(top + start)
        cand_s.append(np.take_along_axis(s, top, 0))
    rows, scores = np.concatenate(cand_i), np.concatenate(cand_s)
    best = np.take_along_axis(rows, np.argpartition(scores, -k, axis=0)[-k:], 0)
    return [set(best[:, j].tolist()) for j in range(best.shape[1])]


class Timed:
    """One system's calls: latencies, and its answers to the first N_CHECK queries checked."""

    def __init__(self, search: Search, truth: list[set[int]], k: int) -> None:
        self.search, self.truth, self.k = search, truth, k
        self.lat: list[float] = []
        self.found = self.checked = 0
        self.i = 0  # the next query number (the same sequence for every system)

    def block(self, calls: int, budget_s: float, rewarm: int = 0) -> None:
        """Up to ``calls`` calls, stopping once ``budget_s`` has passed (at least one call),
        after ``rewarm`` untimed ones (the caches the other systems' rounds took back)."""
        search, lat, k = self.search, self.lat, self.k
        for j in range(min(rewarm, calls)):
            search(self.i + j)
        end = time.perf_counter() + budget_s
        for _ in range(calls):
            i = self.i
            t0 = time.perf_counter_ns()
            got = search(i)
            lat.append((time.perf_counter_ns() - t0) / 1000)
            self.i = i + 1
            if i < N_CHECK:
                if len(got) != k:
                    raise AssertionError(f"query {i}: {len(got)} results, not {k}")
                self.found += len(self.truth[i].intersection(got))
                self.checked += 1
            if time.perf_counter() >= end:
                break

    def result(self) -> dict[str, Any]:
        us = np.array(self.lat)
        return {"calls": len(us), "p50_us": round(float(np.percentile(us, 50)), 1),
                "p99_us": round(float(np.percentile(us, 99)), 1),
                "recall_at_k": round(self.found / (self.checked * self.k), 4) if self.checked else None,
                "checked": self.checked}  # fmt: skip


def table(res: dict[str, dict[str, Any]], k: int) -> str:
    base = res.get("kalos", {}).get("p50_us")
    head = f"| system | load (s) | p50 (µs) | p99 (µs) | calls | recall@{k} | queries checked | p50 / Kalos p50 |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | | | |")
            continue
        ratio = f"{r['p50_us'] / base:.1f}x" if base else "—"
        lines.append(f"| {name} | {r['load_s']:.1f} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['calls']} | "
                     f"{r['recall_at_k']} | {r['checked']} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--budget-s", type=float, default=20.0, help="about this long at most timing one system")
    p.add_argument("--device", default="cpu", help="kalos's and torch's device: cpu, cuda, cuda:N")
    p.add_argument("--only", default=",".join(SYSTEMS), help=f"a comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--seed", type=int, default=None, help="the data's seed (default: fresh each run)")
    p.add_argument("--chroma-ef-search", type=int, default=0,
                   help="chroma's HNSW ef_search (0: Chroma's default); higher: better recall, slower")  # fmt: skip
    p.add_argument("--rounds", type=int, default=0,
                   help="interleaved rounds (default 8 on a CPU, 1 with a GPU: see the docstring)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SYSTEMS))
    if unknown:
        p.error(f"--only: unknown system(s) {unknown}; choose from {','.join(SYSTEMS)}")
    if a.rows < 1 or not 1 <= a.k <= min(a.rows, 1024) or a.dim < 1 or a.calls < 20 or a.rounds < 0:
        p.error("--rows and --dim must be positive, --k in [1, min(rows, 1024)], --calls at least 20, "
                "--rounds not negative")
    seed = a.seed if a.seed is not None else int(np.random.default_rng().integers(1 << 31))
    data = make_data(a.rows, a.dim, seed)
    queries = make_data(N_QUERIES, a.dim, seed + 1)
    truth = exact_topk(data, queries, a.k)
    rounds = a.rounds or (ROUNDS if a.device == "cpu" else 1)
    res: dict[str, dict[str, Any]] = {}
    timed: dict[str, Timed] = {}
    closers: list[Callable[[], None]] = []

    def build(name: str) -> Timed | None:
        print(f"{name}: building", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            search, close = MAKERS[name](data, queries, a.k, a)
        except Missing as e:
            res[name] = {"error": f"not run: {e}"}
            return None
        if close is not None:
            closers.append(close)
        res[name] = {"load_s": round(time.perf_counter() - t0, 2)}
        end = time.perf_counter() + WARMUP_S
        for i in range(WARMUP):
            search(i)
            if time.perf_counter() >= end:
                break
        return Timed(search, truth, a.k)

    def timed_block(name: str, calls: int, budget_s: float, rewarm: int = 0) -> None:
        """A block of ``name``'s calls; a wrong answer (too few results) is that system's
        error, reported in its row, and it is timed no further."""
        try:
            timed[name].block(calls, budget_s, rewarm)
        except AssertionError as e:
            del timed[name]
            res[name] = {"error": f"wrong answer: {e}"}

    try:
        if rounds == 1:  # one system at a time, each dropped (its sidecar stopped) before the next
            for name in only:
                t = build(name)
                if t is not None:
                    timed[name] = t
                    timed_block(name, a.calls, a.budget_s)
                    t.search = None  # type: ignore[assignment]  # (its rows, on a GPU too, go now)
                while closers:
                    closers.pop()()
        else:
            # Rounds: each system in turn (the order rotated) for its share of the calls and
            # the time, so that a machine whose speed drifts (a shared VM's memory bandwidth)
            # is sampled at the same moments for every system.
            for name in only:
                t = build(name)
                if t is not None:
                    timed[name] = t
            for r in range(rounds):
                names = list(timed)
                for name in names[r % len(names) :] + names[: r % len(names)] if names else []:
                    calls = a.calls * (r + 1) // rounds - a.calls * r // rounds
                    timed_block(name, calls, a.budget_s / rounds, REWARM)
        for name, t in timed.items():
            res[name].update(t.result())
            print(f"{name}: {res[name]}", file=sys.stderr, flush=True)
    finally:
        for close in closers:
            close()
    out = table(res, a.k)
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine()}; {a.rows} x {a.dim} float32 unit vectors "
          f"(seed {seed}), cosine, top-{a.k}, batch 1; kalos and torch on {a.device}"
          + (f"; chroma ef_search {a.chroma_ef_search}" if a.chroma_ef_search else ""))  # fmt: skip
    print(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": a.rows, "dim": a.dim, "k": a.k, "device": a.device, "seed": seed,
                       "chroma_ef_search": a.chroma_ef_search, "machine": machine(), "results": res},
                      f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

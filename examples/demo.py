"""The README's demo: start a sidecar, store memories, recall them, show results and latency.

    ./run demo                 # CPU sidecar (or the GPU when CuPy sees one)
    ./run demo --device cpu    # force the CPU backend

Runs offline: texts are embedded with Kalos's lexical hashing embedder (no model download).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kalos_retrievers import KalosClient, Sidecar
from kalos_retrievers.embeddings import HashingEmbeddings

MEMORIES = [
    ("pref-1", "Ada prefers tea over coffee, with oat milk.", {"kind": "preference", "who": "ada"}),
    ("pref-2", "Ada's favourite editor is Emacs; she finds Vim confusing.", {"kind": "preference", "who": "ada"}),
    ("fact-1", "The staging database runs PostgreSQL 16 on port 5433.", {"kind": "fact", "topic": "infra"}),
    ("fact-2", "Deploys to production happen on Tuesdays and Thursdays after 2pm.", {"kind": "fact", "topic": "infra"}),
    ("fact-3", "The refund window for annual plans is 30 days from purchase.", {"kind": "fact", "topic": "billing"}),
    ("fact-4", "Invoices are emailed on the first business day of each month.", {"kind": "fact", "topic": "billing"}),
    ("task-1", "Ada asked to be reminded to renew the TLS certificate before March 3.", {"kind": "task", "who": "ada"}),
    ("task-2", "Bob is on call for the payments service this week.", {"kind": "fact", "who": "bob"}),
    ("pref-3", "Bob likes short answers with links to the runbook.", {"kind": "preference", "who": "bob"}),
    ("fact-5", "The payments service retries failed webhooks five times with exponential backoff.", {"kind": "fact", "topic": "payments"}),
]  # fmt: skip

QUESTIONS = [
    ("What does Ada like to drink?", None),
    ("When can we deploy to production?", None),
    ("How long is the refund window?", {"topic": "billing"}),
    ("What should I remind Ada about?", {"who": "ada"}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto (GPU if CuPy sees one), cpu, cuda")
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    emb = HashingEmbeddings(dim=args.dim)

    print(f"Starting a Kalos sidecar (device={args.device}, dim={args.dim}) ...")
    with Sidecar(dim=args.dim, device=args.device, log_level="WARNING") as sc:
        client: KalosClient = sc.client()
        print(f"  sidecar {sc.name!r} is up: backend {client.header.backend}, pid {sc.pid}\n")

        ids, texts, metas = zip(*MEMORIES, strict=True)
        t0 = time.perf_counter()
        client.upsert(list(ids), emb.embed_documents(list(texts)), list(texts), list(metas))
        print(f"Stored {client.count()} memories in {1000 * (time.perf_counter() - t0):.1f} ms "
              "(acknowledged after the sidecar committed them)\n")  # fmt: skip

        for question, flt in QUESTIONS:
            q = emb.vector(question)
            t0 = time.perf_counter()
            hits = client.recall(q, k=2, filter=flt)
            us = (time.perf_counter() - t0) * 1e6
            where = f"  filter={flt}" if flt else ""
            print(f"Q: {question}{where}   [{us:.0f} us]")
            for h in hits:
                print(f"   {h.score:+.3f}  {h.text}  {h.metadata}")
            print()

        # latency of the recall itself, over many calls (embedding excluded)
        q = emb.vector(QUESTIONS[0][0])
        for _ in range(200):
            client.recall(q, k=3)
        lat = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            client.recall(q, k=3)
            lat.append((time.perf_counter_ns() - t0) / 1000)
        p50, p99 = np.percentile(lat, [50, 99])
        print(f"Recall latency over 2000 calls (client -> sidecar -> client): p50 {p50:.0f} us, "
              f"p99 {p99:.0f} us")  # fmt: skip
        client.close()
    print("Sidecar stopped; its shared memory is gone.")


if __name__ == "__main__":
    main()

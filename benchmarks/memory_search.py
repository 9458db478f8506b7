"""``KalosMemory.search`` end to end: an agent's recall of a user's memories, as an application
makes it (the query embedded, the recall in the collection's namespace with the user's filter,
the results as mem0-style dicts).

    python -P benchmarks/memory_search.py [--memories 20000] [--users 100] [--calls 600]
        [--device cpu] [--add-every N] [--pause-ms MS] [--active 3] [--split]

The store holds ``--memories`` memories spread over ``--users`` users (with their history
events beside them, as ``add`` writes them), embedded by ``HashingEmbeddings(dim=384)`` (no
model download); each call searches one of three users' memories for 5 results. With
``--add-every N``, every Nth search is preceded by an ``add`` of one memory for that user (not
timed), as an agent that learns between recalls: the search after it finds its namespace
changed. Printed: p50 and p90 of the calls, in µs. Every answer is checked to belong to the
user asked for. ``--active N``: the searches go to N users in turn (3 by default; more than
the 8 scopes a GPU sidecar's resident kernel serves shows what its back-off does).
``--pause-ms MS``: a pause before each search, after its add if any (not timed): the model's
turn of an agent, during which a GPU sidecar may start its resident kernel again after a write.
``--split``: after each search (not timed) the sidecar's count of the resident kernel's answers
is read, and p50 / p90 printed for the searches the kernel answered and for the others apart
(a GPU sidecar only; the read is one more request between a search and the next add).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kalos_retrievers import Sidecar
from kalos_retrievers.embeddings import HashingEmbeddings
from kalos_retrievers.memory import KalosMemory


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memories", type=int, default=20_000)
    p.add_argument("--users", type=int, default=100)
    p.add_argument("--calls", type=int, default=600)
    p.add_argument("--device", default="cpu")
    p.add_argument("--add-every", type=int, default=0, help="an add before every Nth search (0: none)")
    p.add_argument("--active", type=int, default=3, help="users searched in turn (default 3)")
    p.add_argument("--pause-ms", type=float, default=0.0, help="a pause before each search (ms, not timed)")
    p.add_argument("--split", action="store_true", help="p50 of the kernel's answers and of the others apart")
    a = p.parse_args()
    if (a.users < 3 or a.memories < a.users or a.calls < 1 or a.add_every < 0 or not 1 <= a.active <= a.users
            or a.pause_ms < 0):  # fmt: skip
        p.error("--users must be at least 3, --memories at least --users, --calls at least 1, --add-every >= 0, "
                "--active between 1 and --users, --pause-ms >= 0")
    dtype = None if a.device == "cpu" else "float16"
    with Sidecar(dim=384, device=a.device, dtype=dtype, log_level="WARNING", startup_timeout=300) as sc:
        m = KalosMemory(sc.name, embedding=HashingEmbeddings(dim=384), timeout=30)
        per = a.memories // a.users
        for u in range(a.users):
            m.add([f"user {u} fact {j}: likes topic {(u * 7 + j) % 50}" for j in range(per)], user_id=f"u{u}")
        queries = [f"what topic {i % 50} does the user like" for i in range(64)]
        for i in range(50):
            m.search(queries[i & 63], user_id="u7", limit=5)
        us = np.empty(a.calls)
        by_kernel = np.zeros(a.calls, bool)  # (--split) answered by the resident kernel
        served = _served(m) if a.split else 0
        for i in range(a.calls):
            user = f"u{i % a.active}"
            if a.add_every and i % a.add_every == 0:
                m.add([f"user {user} learned fact {i}: likes topic {i % 50}"], user_id=user)
            if a.pause_ms:
                time.sleep(a.pause_ms / 1000)
            t0 = time.perf_counter_ns()
            got = m.search(queries[i & 63], user_id=user, limit=5)
            us[i] = (time.perf_counter_ns() - t0) / 1000
            if a.split:
                now = _served(m)
                by_kernel[i], served = now > served, now
            if not got or any(x["user_id"] != user for x in got):
                raise AssertionError(f"search for {user} returned {got[:1]}")
        idx = m.client.stats()["index"]
        m.close()
    adds = f", an add before every {a.add_every}" if a.add_every else ""
    adds += f", a {a.pause_ms:g} ms pause before each" if a.pause_ms else ""
    kernel = (f"; resident kernel: {idx['doorbell_launches']} starts, {idx['doorbell_served']} answers"
              if "doorbell_launches" in idx else "")  # fmt: skip
    print(f"{per * a.users} memories of {a.users} users on {a.device}: KalosMemory.search p50 "
          f"{np.percentile(us, 50):.1f} µs, p90 {np.percentile(us, 90):.1f} µs ({a.calls} calls, "
          f"{a.active} users in turn{adds}{kernel})")  # fmt: skip
    if a.split:
        for name, part in (("answered by the kernel", us[by_kernel]), ("by the sidecar's host", us[~by_kernel])):
            fig = f"p50 {np.percentile(part, 50):.1f} µs, p90 {np.percentile(part, 90):.1f} µs" if len(part) else "-"
            print(f"  {name}: {len(part)} searches, {fig}")
    return 0


def _served(m: KalosMemory) -> int:
    """The sidecar's count of the resident kernel's answers (0 without one)."""
    return int(m.client.stats()["index"].get("doorbell_served", 0))


if __name__ == "__main__":
    sys.exit(main())

"""Two client packages, interleaved against one sidecar: which client is faster (issue 3).

    python -P benchmarks/ab_clients.py --a /tmp/site_old --b /tmp/site_new [--rows 1000000]
        [--rounds 8] [--calls 2000] [--device cuda] --out DIR

A and B are directories that hold an installed ``kalos_retrievers`` (``pip install --no-deps
--target DIR``). One sidecar (this process's package, ``--device``, resident kernel on as by
default) holds ``--rows`` random unit vectors (768-d float16, cosine). Each round runs one
client process per side, A then B or B then A (alternating), each with its directory first on
``PYTHONPATH``: it times ``--calls`` batch-1 recalls of top-10 (after 300 of warm-up, which also
start the resident kernel) and then ``--calls // 10`` calls of ``recall_batch(64)``, and prints
its p50s. Printed: per-side medians over the rounds and the mean per-round difference B - A
with its standard error; written: ``DIR/ab_clients.json``.

Why: lease-to-lease variance on the H200 machine is larger than a client change (a batch-1
recall at 1M rows measured 420 and 460 µs on two leases with the same code, S8-2 / S8-4),
so a client change is measured against the old client on the same lease, the same sidecar
and the same rows, in alternating rounds. A v1.2 client talking to a v1.3 sidecar asks for
generations (ARENA_DOCS) and a v1.3 client for entries: both formats are served.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DIM, K, BATCH = 768, 10, 64


def worker(name: str, calls: int) -> None:
    """One side of one round (run in a subprocess whose PYTHONPATH picks the package)."""
    import kalos_retrievers
    from kalos_retrievers import KalosClient

    rng = np.random.default_rng(int(time.time_ns() % 2**32))
    qs = rng.standard_normal((256, DIM)).astype(np.float32)
    qs /= np.linalg.norm(qs, axis=1, keepdims=True)
    out = {"package": str(Path(kalos_retrievers.__file__).parent)}
    with KalosClient(name) as c:
        for i in range(300):
            c.recall(qs[i % 256], K)
        ts = []
        for i in range(calls):
            t0 = time.perf_counter_ns()
            c.recall(qs[i % 256], K)
            ts.append(time.perf_counter_ns() - t0)
        out["batch1_p50_us"] = statistics.median(ts) / 1000
        out["batch1_p99_us"] = float(np.percentile(ts, 99)) / 1000
        for _ in range(10):
            c.recall_batch(qs[:BATCH], K)
        ts = []
        for i in range(max(20, calls // 10)):
            q = qs[(i * 7) % 192 : (i * 7) % 192 + BATCH]
            t0 = time.perf_counter_ns()
            c.recall_batch(q, K)
            ts.append(time.perf_counter_ns() - t0)
        out["batch64_p50_us"] = statistics.median(ts) / 1000
    print(json.dumps(out))


def run_side(path: str, name: str, calls: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(path).resolve()), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-P", __file__, "--worker", name, "--calls", str(calls)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        raise RuntimeError(f"client from {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a")
    ap.add_argument("--b")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=".")
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.calls)
        return
    from kalos_retrievers.sidecar.bench import load, machine, make_data

    from kalos_retrievers import Sidecar

    rows = make_data(a.rows, DIM, seed=1)
    with Sidecar(dim=DIM, device=a.device, log_level="WARNING", startup_timeout=300).start() as sc:
        with sc.client() as c:
            load(c, rows, progress=False)
        per: dict[str, list[dict]] = {"a": [], "b": []}
        for r in range(a.rounds):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for side in order:
                per[side].append(run_side(a.a if side == "a" else a.b, sc.name, a.calls))
            last = {s: per[s][-1] for s in ("a", "b")}
            print(f"round {r}: " + ", ".join(f"{s} {x['batch1_p50_us']:.1f} / {x['batch64_p50_us']:.1f}"
                                             for s, x in last.items()), flush=True)  # fmt: skip
    result: dict = {"machine": machine(), "rows": a.rows, "rounds": a.rounds, "calls": a.calls,
                    "a": a.a, "b": a.b, "per_round": per}  # fmt: skip
    for fig in ("batch1_p50_us", "batch1_p99_us", "batch64_p50_us"):
        xa = np.array([x[fig] for x in per["a"]])
        xb = np.array([x[fig] for x in per["b"]])
        d = xb - xa
        result[fig] = {"a_median": float(np.median(xa)), "b_median": float(np.median(xb)),
                       "diff_mean": float(d.mean()), "diff_stderr": float(d.std(ddof=1) / np.sqrt(len(d)))}  # fmt: skip
        s = result[fig]
        print(f"{fig}: A {s['a_median']:.1f}  B {s['b_median']:.1f}  "
              f"B-A {s['diff_mean']:+.1f} ± {s['diff_stderr']:.1f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "ab_clients.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

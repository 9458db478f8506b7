"""Two sidecar packages, interleaved on one machine: which dispatcher is faster (issue 3).

    python -P benchmarks/ab_sidecars.py --a /tmp/site_main --b /tmp/site_branch [--rows 1000000]
        [--rounds 6] [--procs 32] [--duration 3] [--device cuda] [--env-a K=V ...] [--env-b K=V ...]
        [--client-env-a K=V ...] [--client-env-b K=V ...]
        [--sidecar-cpus-a LIST] [--sidecar-cpus-b LIST] [--client-cpus-a LIST] [--client-cpus-b LIST]
        [--client-a DIR] [--client-b DIR] --out DIR

A and B are directories that hold an installed ``kalos_retrievers`` (``pip install --no-deps
--target DIR``); each sidecar process runs with its directory first on ``PYTHONPATH``, while
the clients (this process and the throughput workers) run whatever package this process
imported: the comparison is of the sidecars alone. Both sidecars hold the same rows (random
unit vectors, 768-d float16, cosine) at once, and the rounds alternate between them (A B, B A,
A B ...), each round timing ``recall_batch(64)`` (200 calls after 20) and ``--procs`` client
processes issuing batch-1 recalls for ``--duration`` seconds. Session 7 compared main and a
branch in separate runs, main always first, and could not tell the order from the branch.

Both sidecars run with ``KALOS_DOORBELL=0``: a resident kernel left running by one sidecar
would hold every SM while the other one searched. The figures are therefore those of the
batched path (which is what 32 processes and batches use anyway). With ``--doorbell`` they keep
their resident kernels, and before each side's turn the other side is sent a batch of two
queries, which stops its kernel (a batch does; checked in its ``stats``); each turn then also
times 2,000 batch-1 recalls (``batch1_p50_us``: the resident kernel's path once it has started).
A side whose ``--env`` does not set ``KALOS_CAROUSEL=0`` (the crowd on the carousel, direct by
default; sidecar/crowd.py) leaves its carousel running after its turn, so the other side is
quiesced before each turn in the same way. Prints per-side medians and the mean per-round
difference B - A with its standard error; writes ``DIR/ab_sidecars.json``.
``--env-a`` / ``--env-b`` set environment variables for one side's sidecar process (the same
package on both sides then compares two settings), and ``--client-env-a`` / ``--client-env-b``
those of the clients while that side is timed (``KALOS_SPIN_US=0``: clients that block on
their semaphores instead of spinning); each side's ``index.batch_timing`` and
``index.queued_timing`` (the batches queued behind another: pass, front, lead and gap, see
``index_gpu.queued_timing``) from its ``stats`` (``KALOS_BATCH_TIMING=1``) are printed and
saved at the end, and with them the dispatcher's "return" phase among the phases: per
batched member, the time from its slot's previous answer to its next request's pickup (how
long the clients take to come back), and each serve loop's scheduler figures over all the
rounds (``serve_thread``, Linux: how long it waited runnable for a CPU, how often it was
preempted; its own side's turns, the other side's while it idles, and the ``recall_batch``
timing together). With ``--arena-docs`` both sidecars keep a document
arena (``KALOS_ARENA=1``) and the throughput clients read their documents from it, as
clients of a sidecar with a resident kernel do (``gpu_recall.py``'s 32 processes); without,
the documents come inline in each answer. ``--client-a`` / ``--client-b`` (a directory holding
an installed ``kalos_retrievers``, as ``--a``) give the throughput workers that client library
while that side is timed (``bench.throughput``'s ``client_path``): the same sidecar package on
both sides then compares two client libraries; this process's own timing of
``recall_batch(64)`` keeps its own library. ``--sidecar-cpus-a`` / ``--sidecar-cpus-b`` (a CPU
list such as ``15`` or ``0-14``) start that side's sidecar with that CPU affinity (its process
and its children inherit it, as under ``taskset -c``), and ``--client-cpus-a`` /
``--client-cpus-b`` give this process and the throughput workers that affinity while that side
is timed: a sidecar on a core of its own, and the clients kept off it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from kalos_retrievers.sidecar.bench import load, machine, make_data, throughput, time_calls
from kalos_retrievers.sidecar.index_gpu import carousel_mode  # (no CuPy needed to import it)

from kalos_retrievers import Sidecar

DIM, K, BATCH = 768, 10, 64
# what sidecar.bench.throughput says of the clients' CPU, per recall (Linux with schedstat)
CLIENT_KEYS = ("client_cpu_us_per_recall", "client_runqueue_us_per_recall", "client_cores")


def cpu_list(text: str) -> set[int]:
    """The CPUs of a list such as ``0-14`` or ``3,5,7-9``."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


@contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """This process's CPU affinity set to ``cpus`` inside the block (None: unchanged); the
    processes it starts meanwhile keep it."""
    if cpus is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


@contextmanager
def environ(env: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``env`` set (a value of None: removed) inside the block; restored
    after. Processes started inside (a sidecar, the spawned throughput workers) inherit it."""
    saved = {v: os.environ.get(v) for v in env}
    try:
        for v, value in env.items():
            if value is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = value
        yield
    finally:
        for v, value in saved.items():
            if value is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = value


def start(path: str, device: str, rows: np.ndarray, env: dict[str, str] | None = None,
          doorbell: bool = False, cpus: set[int] | None = None) -> Sidecar:  # fmt: skip
    """A sidecar whose process imports the package under ``path``, loaded with ``rows``, with
    ``env`` added to its environment (and its resident kernel off unless ``doorbell``), run on
    ``cpus`` (None: any)."""
    pythonpath = os.pathsep.join(p for p in (str(Path(path).resolve()), os.environ.get("PYTHONPATH")) if p)
    with (environ({"PYTHONPATH": pythonpath, "KALOS_DOORBELL": None if doorbell else "0", **(env or {})}),
          affinity(cpus)):  # fmt: skip
        sc = Sidecar(dim=DIM, device=device, slots=40, max_batch=64, payload_kb=8192,
                     log_level="WARNING", startup_timeout=300).start()  # fmt: skip
    assert sc.proc is not None
    proc_env = Path(f"/proc/{sc.proc.pid}/environ").read_bytes().split(b"\0")
    got = next((e.decode().split("=", 1)[1] for e in proc_env if e.startswith(b"PYTHONPATH=")), "")
    assert got.startswith(str(Path(path).resolve())), got  # the sidecar runs package ``path``
    assert cpus is None or os.sched_getaffinity(sc.proc.pid) == cpus, os.sched_getaffinity(sc.proc.pid)
    with sc.client(timeout=600) as c:
        load(c, rows, progress=False)
        assert c.count() == len(rows)
    return sc


def quiesce(sc: Sidecar, queries: np.ndarray) -> None:
    """Stop ``sc``'s resident kernel and its carousel (a batch stops both) so that neither holds
    an SM while the other side runs; raise if one still runs."""
    with sc.client(timeout=30) as c:
        c.recall_batch(queries[:2], K)
        index = c.stats().get("index", {})
    for what in ("doorbell", "carousel"):
        if index.get(f"{what}_running"):
            raise RuntimeError(f"sidecar {sc.name}'s {what} kernel still runs after a batch")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="directory holding package A (e.g. main)")
    ap.add_argument("--b", required=True, help="directory holding package B (e.g. a branch)")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--procs", type=int, default=32)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--env-a", nargs="*", default=[], metavar="K=V", help="environment of A's sidecar")
    ap.add_argument("--env-b", nargs="*", default=[], metavar="K=V", help="environment of B's sidecar")
    ap.add_argument("--client-env-a", nargs="*", default=[], metavar="K=V",
                    help="environment of the clients while A is timed (e.g. KALOS_SPIN_US=0)")  # fmt: skip
    ap.add_argument("--client-env-b", nargs="*", default=[], metavar="K=V",
                    help="environment of the clients while B is timed")  # fmt: skip
    for side in ("a", "b"):
        ap.add_argument(f"--sidecar-cpus-{side}", type=cpu_list, metavar="LIST",
                        help=f"CPUs of {side.upper()}'s sidecar (e.g. 15)")  # fmt: skip
        ap.add_argument(f"--client-cpus-{side}", type=cpu_list, metavar="LIST",
                        help=f"CPUs of the clients while {side.upper()} is timed (e.g. 0-14)")  # fmt: skip
        ap.add_argument(f"--client-{side}", metavar="DIR",
                        help=f"client library of the throughput workers while {side.upper()} is timed "
                             "(an installed package's directory; default: this process's)")  # fmt: skip
    ap.add_argument("--arena-docs", action="store_true", help="clients read documents from the arena")
    ap.add_argument("--doorbell", action="store_true",
                    help="keep the resident kernels (one side's stopped while the other runs)")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    envs = {"a": dict(e.split("=", 1) for e in args.env_a), "b": dict(e.split("=", 1) for e in args.env_b)}
    client_envs = {"a": dict(e.split("=", 1) for e in args.client_env_a),
                   "b": dict(e.split("=", 1) for e in args.client_env_b)}  # fmt: skip
    if args.arena_docs:
        for env in envs.values():
            env.setdefault("KALOS_ARENA", "1")
    # a side with the carousel (KALOS_CAROUSEL unset, 1 or direct: every side but one with 0) leaves it
    # running after its turn, holding every SM until it idles out: the other side is quiesced before
    # each turn, as with --doorbell
    carousel = any(carousel_mode(env.get("KALOS_CAROUSEL"))[0] for env in envs.values())
    rows = make_data(args.rows, DIM, 2)
    queries = make_data(16 * BATCH, DIM, 3)
    res: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv), "a": args.a, "b": args.b,
                           "rows": args.rows, "procs": args.procs, "env": envs,
                           "client_env": client_envs, "arena_docs": args.arena_docs,
                           "cpus": {f"{who}_{side}": sorted(c) for who in ("sidecar", "client") for side in "ab"
                                    if (c := getattr(args, f"{who}_cpus_{side}")) is not None},
                           "client_pkg": {"a": args.client_a, "b": args.client_b},
                           "doorbell": args.doorbell, "rounds": []}  # fmt: skip
    with ExitStack() as stack:
        sides = {}
        for label, path in (("a", args.a), ("b", args.b)):
            sc = start(path, args.device, rows, envs[label], args.doorbell, getattr(args, f"sidecar_cpus_{label}"))
            stack.callback(sc.stop)
            sides[label] = sc
        sched0 = {}  # each serve loop's scheduler figures before the rounds (see thread_sched)
        for label, sc in sides.items():
            with sc.client(timeout=30) as c:
                sched0[label] = c.stats().get("serve_thread")
        for r in range(args.rounds):
            rnd: dict[str, Any] = {}
            for label in ("a", "b") if r % 2 == 0 else ("b", "a"):
                sc = sides[label]
                if args.doorbell or carousel:
                    quiesce(sides["b" if label == "a" else "a"], queries)
                cpus = getattr(args, f"client_cpus_{label}")
                with affinity(cpus), environ(client_envs[label]), sc.client(timeout=30) as c:
                    b64 = time_calls(lambda i: c.recall_batch(queries[(i % 16) * BATCH : (i % 16 + 1) * BATCH], K),
                                     200, 20)  # fmt: skip
                    b1 = None
                    if args.doorbell:
                        b1 = time_calls(lambda i: c.recall(queries[i % len(queries)], K), 2000, 200)
                with affinity(cpus), environ(client_envs[label]):
                    thr = throughput(sc.name, DIM, K, args.procs, args.duration, True if args.arena_docs else None,
                                     getattr(args, f"client_{label}"))  # fmt: skip
                rnd[label] = {"batch64_p50_us": b64["p50_us"], "procs_per_s": thr["recalls_per_s"],
                              "procs_p99_us": thr["p99_us"]}  # fmt: skip
                for key in CLIENT_KEYS:  # the clients' CPU per recall (where schedstat is kept)
                    if key in thr:
                        rnd[label][key] = thr[key]
                if b1 is not None:
                    rnd[label]["batch1_p50_us"] = b1["p50_us"]
                if "client_package" in thr:  # (a worker of an older package does not say)
                    rnd[label]["client_package"] = thr["client_package"]
            res["rounds"].append(rnd)
            print(json.dumps({"round": r, **rnd}), flush=True)
        for label, sc in sides.items():
            with sc.client(timeout=30) as c:
                st = c.stats()
            ix = st.get("index", {})
            res[f"stats_{label}"] = {"phases": st.get("phases"), "index": ix.get("batch_timing"),
                                     "queued": ix.get("queued_timing")}  # fmt: skip
            s0, s1 = sched0[label], st.get("serve_thread")
            if s0 and s1:  # the serve loop during the rounds: how long it waited for a CPU
                res[f"stats_{label}"]["serve_thread"] = {key: s1[key] - s0[key] for key in s1}
            print(label, json.dumps(res[f"stats_{label}"]), flush=True)
    summary = {}
    keys = ["batch64_p50_us", "procs_per_s", "procs_p99_us", *(("batch1_p50_us",) if args.doorbell else ())]
    keys += [key for key in CLIENT_KEYS if all(key in rd[s] for rd in res["rounds"] for s in "ab")]
    for key in keys:
        a = np.array([rd["a"][key] for rd in res["rounds"]])
        b = np.array([rd["b"][key] for rd in res["rounds"]])
        d = b - a
        se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
        summary[key] = {"a_median": float(np.median(a)), "b_median": float(np.median(b)),
                        "b_minus_a_mean": round(float(d.mean()), 2), "stderr": round(se, 2)}  # fmt: skip
        print(f"{key}: A {np.median(a):.1f}, B {np.median(b):.1f}; B - A {d.mean():+.1f} ± {se:.1f}")
    res["summary"] = summary
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ab_sidecars.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

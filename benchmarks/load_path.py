"""The sidecar's write path and start-up reload, in process: µs per row (issue 3, item 6).

    python -P benchmarks/load_path.py [--rows 100000] [--rounds 3] [--root DIR ...]
                                      [--index cpu|gpu] [--profile N]

``gpu_recall.py --only durable`` times a bulk load of 1M rows through the client and the
restart that reloads them (on the GPU machine, ~1-1.5 minutes). Most of both is host work that
does not depend on the card: the service's checks and normalization, the row table, the SQLite
store of record (its CRCs and commits) and, at start-up, reading and checking every stored row.
This times those parts alone, with the CPU index, so a change to them can be measured on any
machine, against another version of the code, alternating:

* ``memory``: ``Service.upsert`` in chunks of 8,192 rows (the client's chunk at the bench's
  payload) with no store;
* ``durable``: the same with a SQLite store (``synchronous=FULL``, as the sidecar's default);
* ``reload``: a new ``Service`` over that store, ``load()`` (what a start does before serving).

Each ``--root`` is a source tree (the project's root, or a ``git archive`` of another commit
with its compiled ``.so`` files); the first is this checkout. Rows are random unit 768-d
vectors with ids and no text or metadata, as ``gpu_recall.py`` loads them. The store goes to
``$KALOS_BENCH_DIR`` (default ``/tmp``): its disk matters for ``durable``.

``--index gpu`` puts a ``GpuIndex`` (float16, device 0) under the service instead, as the GPU
sidecar has: what the index's own growth and row writes add to the host work. ``--profile N``
runs each part once more under ``cProfile`` (this checkout only) and prints its N costliest
functions by own time, to find where the time goes on a given host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import cProfile, io, json, pstats, sys, tempfile, time
root, bench_dir, kind = sys.argv[1], sys.argv[4], sys.argv[5]
n, dim, top = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[6])
sys.path.insert(0, root)
from kalos_retrievers.protocol import Metric
from sidecar.bench import make_data
from sidecar.index import CpuIndex
from sidecar.service import Service
from sidecar.store import NullStore, SqliteStore

def index():
    if kind == "cpu":
        return CpuIndex(dim, Metric.COSINE)
    from sidecar.gpu import open_gpu_index
    return open_gpu_index(dim, Metric.COSINE, 0, "float16")

def timed(mode, fn):
    if not top:
        t0 = time.perf_counter()
        fn()
        out[mode] = (time.perf_counter() - t0) / n * 1e6
        return
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    out[mode] = (time.perf_counter() - t0) / n * 1e6
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"== {mode}: {out[mode]:.2f} us per row under cProfile", file=sys.stderr)
    print("\n".join(buf.getvalue().strip().splitlines()[-top - 2:]), file=sys.stderr)

data = make_data(n, dim, 2)
out = {}
for mode in ("memory", "durable"):
    with tempfile.TemporaryDirectory(dir=bench_dir) as d:
        store = SqliteStore(d, dim=dim, metric="cosine", synchronous="FULL") if mode == "durable" else NullStore()
        svc = Service(index(), store, dim=dim, metric=Metric.COSINE)
        def load():
            for s in range(0, n, 8192):
                e = min(n, s + 8192)
                svc.upsert({"ids": [str(i) for i in range(s, e)], "texts": [""] * (e - s),
                            "metadatas": [{} for _ in range(s, e)]}, data[s:e])
        timed(mode, load)
        svc.index.close()
        if mode == "durable":
            del svc
            again = Service(index(), store, dim=dim, metric=Metric.COSINE)
            def reload():
                assert again.load() == n
            timed("reload", reload)
            again.index.close()
            store.close()
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", action="append", default=[], help="another source tree to compare")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--index", choices=("cpu", "gpu"), default="cpu", help="the index under the service")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile each part once (this checkout) and print its N costliest functions")
    args = ap.parse_args()
    roots = [str(ROOT), *args.root]
    bench_dir = os.environ.get("KALOS_BENCH_DIR", tempfile.gettempdir())
    got: dict[str, list[dict[str, float]]] = {r: [] for r in roots}
    for rnd in range(args.rounds):
        for r in roots:  # each in a fresh process: nothing of one version's imports in another's
            res = subprocess.run([sys.executable, "-P", "-c", CHILD, r, str(args.rows), str(args.dim), bench_dir,
                                  args.index, "0"], capture_output=True, text=True, check=True)  # fmt: skip
            got[r].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {rnd + 1} {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in got[r][-1].items()),
                  file=sys.stderr, flush=True)  # fmt: skip
    print(f"µs per row, {args.rows} rows x {args.dim}, {args.index} index, median of {args.rounds} rounds")
    print(f"| tree | {' | '.join(('memory', 'durable', 'reload'))} |")
    print("|---|---|---|---|")
    summary = {}
    for r in roots:
        med = {k: statistics.median(x[k] for x in got[r]) for k in ("memory", "durable", "reload")}
        summary[r] = {"rounds": got[r], "median": med}
        print(f"| {r} | " + " | ".join(f"{v:.2f}" for v in med.values()) + " |")
    if args.profile:
        res = subprocess.run([sys.executable, "-P", "-c", CHILD, roots[0], str(args.rows), str(args.dim), bench_dir,
                              args.index, str(args.profile)], capture_output=True, text=True, check=True)  # fmt: skip
        print(res.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": args.rows, "dim": args.dim, "trees": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

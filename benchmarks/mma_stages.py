"""Where a batched recall's device time goes, stage by stage, and what two batches back to back
cost (issue 3: 32 processes at 1M rows).

    python -P benchmarks/mma_stages.py [--rows 1000000] [--batches 8,16,24,32] --out DIR

With 32 client processes the sidecar answers two cohorts of ~16 queries in turn, each with one
float16 batch through ``mma_filter`` (the captured graph of ``GpuIndex._mma_launches``: prep,
the sample's scores, the thresholds, the pass over every row, the selection). This script fills
an in-process GpuIndex with random unit rows (cosine, k = 10, one query per slot of a registered
segment, as the sidecar's slots), runs each batch size through the normal path, then times on
the index's stream (CUDA events, medians of ``--reps``):

* ``stages``: each launch of the graph issued on its own, an event after each (the gaps
  between kernels count towards the later stage);
* ``graph``: the captured graph alone;
* ``two_graphs``: the same graph launched twice in a row, an event between: what a second
  batch costs right behind the first, with no host gap between them;
* ``pass_reserve``: the pass alone with 0 and with ``SIDE_RESERVE`` of its block slots left
  free (what a queued batch's side kernels run in);
* ``serial_us`` / ``queued_us``: wall time per batch over ``--chain`` batches, each launched and
  finished before the next (``serial``), or each queued behind the one before
  (``launch_slots(behind=True)``, the oldest finished after each launch, as the dispatcher
  does with two cohorts): how much of a batch's time the queueing takes off;
* ``queued_trace``: the queued chain again with events on both streams (medians over its
  batches): ``gap`` from one pass's end to the next one's start, ``front_lead`` how long before
  the previous pass ended this batch's prep and thresholds were done (negative: the pass
  waited for them), ``pass``, ``front``, and ``select`` from the pass's end to the selection's;
  then the same with every kernel of the path asking for the largest shared-memory carveout
  (``--carveout``, ``carveout100``: an experiment, so that an SM running the pass never has to
  drain before a side kernel's shared memory fits; S26-3: the pass then took 519 µs, not 383);
* ``copy_us``: a device-to-device copy of the rows (read + write), the bandwidth floor.

Prints one JSON line per batch size and writes ``DIR/mma_stages.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batches", default="8,16,24,32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--carveout", action="store_true", help="also the chain with the largest carveout")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import cupy as cp
    from kalos_retrievers.sidecar.bench import make_data, one_query_slots
    from kalos_retrievers.sidecar.index_gpu import SIDE_RESERVE, GpuIndex

    from kalos_retrievers.protocol import Metric

    n, dim, k = args.rows, 768, 10
    batches = [int(x) for x in args.batches.split(",") if x]
    idx = GpuIndex(dim, Metric.COSINE, 0, "float16")
    for s0 in range(0, n, 65536):
        chunk = make_data(min(65536, n - s0), dim, 3 + s0)
        idx.set_rows(np.arange(s0, s0 + len(chunk)), chunk, np.zeros(len(chunk), np.int32))
    nb = max(batches)
    q = make_data(nb, dim, 4)
    _mm, specs = one_query_slots(idx, nb, dim, k, q)
    s = idx.stream
    med = lambda v: round(float(np.median(v)), 1)  # noqa: E731

    def timed(fns: list[Any], reps: int) -> list[float]:
        """Run ``fns`` in order on the stream, an event before the first and after each;
        the medians of the gaps between consecutive events."""
        gaps: list[list[float]] = [[] for _ in fns]
        for i in range(reps + 3):
            evs = [cp.cuda.Event()]
            evs[0].record(s)
            for fn in fns:
                fn()
                ev = cp.cuda.Event()
                ev.record(s)
                evs.append(ev)
            evs[-1].synchronize()
            if i >= 3:
                for j in range(len(fns)):
                    gaps[j].append(cp.cuda.get_elapsed_time(evs[j], evs[j + 1]) * 1000)
        return [med(g) for g in gaps]

    def traced_chain(part: list[Any], m: int) -> dict[str, float]:
        idx.search_slots(part, k, n, 0, None, True)
        idx.trace = []
        idx.launch_slots(part, k, n, 0, None, True)
        for _ in range(m - 1):
            idx.launch_slots(part, k, n, 0, None, True, behind=True)
            idx.finish_slots()
        idx.finish_slots()
        tr, idx.trace = idx.trace, None
        names = ("front start", "front end", "pass start", "pass end", "select end")
        marks = [ev for name, ev, _ in tr if name in names]
        per = [dict(zip(names, marks[i : i + 5], strict=True)) for i in range(0, len(marks) - 4, 5)]
        us = lambda a, b: cp.cuda.get_elapsed_time(a, b) * 1000  # noqa: E731
        rows = []
        for prev, cur in itertools.pairwise(per):
            rows.append({"gap": us(prev["pass end"], cur["pass start"]),
                         "front_lead": us(cur["front end"], prev["pass end"]),
                         "pass": us(cur["pass start"], cur["pass end"]),
                         "front": us(cur["front start"], cur["front end"]),
                         "select": us(cur["pass end"], cur["select end"])})  # fmt: skip
        return {key: med([r[key] for r in rows]) for key in rows[0]} if rows else {}

    def carveout(value: int) -> str:
        from kalos_retrievers.sidecar import cuda_kernels as kern
        from kalos_retrievers.sidecar.index_gpu import _MMA_NT

        fns = [kern.get_kernel("mma_filter", nt, idx.metric, *d) for d in ((), ("true",)) for nt in _MMA_NT]
        fns += [kern.get_kernel(name, idx.metric) for name in ("prep_queries", "tau_scores", "select_cands")]
        try:
            for f in fns:
                f.preferred_shared_memory_carveout = value
        except (AttributeError, TypeError) as e:
            return f"not settable: {e}"
        idx.graphs.clear()
        return "set"

    def chains(part: list[Any], m: int) -> tuple[float, float]:
        walls = []
        for behind in (False, True, False, True):
            idx.search_slots(part, k, n, 0, None, True)
            t0 = time.perf_counter_ns()
            if behind:
                idx.launch_slots(part, k, n, 0, None, True)
                for _ in range(m - 1):
                    idx.launch_slots(part, k, n, 0, None, True, behind=True)
                    idx.finish_slots()
                idx.finish_slots()
            else:
                for _ in range(m):
                    idx.search_slots(part, k, n, 0, None, True)
            walls.append((time.perf_counter_ns() - t0) / 1000 / m)
        return round(min(walls[0], walls[2]), 1), round(min(walls[1], walls[3]), 1)

    out: dict[str, Any] = {"rows": n, "dim": dim, "k": k, "device": idx.device_name, "batches": {}}
    with idx.device, s:
        pair = (cp.empty_like(idx.data[:n]), idx.data[:n])
        t = timed([lambda p=pair: cp.copyto(*p)], args.reps)[0]
        out["copy_us"], out["copy_tbs"] = t, round(2 * pair[1].nbytes / (t * 1e-6) / 1e12, 3)
        pair = None
    for b in batches:
        part = specs[:b]
        before = idx.mma_batches
        for _ in range(5):  # the sidecar's path: writes the descriptor, captures the graph
            idx.search_slots(part, k, n, 0, None, True)
        sample = idx._tau_sample(k, n)
        launches = idx._mma_launches(b, k, sample, idx._lane(0), SIDE_RESERVE)
        graph = idx._mma_graph(b, k, sample)
        row: dict[str, Any] = {"mma_batches": idx.mma_batches - before, "sample": sample}
        with idx.device, s:
            names = [name for name, _ in launches]
            st = timed([fn for _, fn in launches], args.reps)
            row["stages"] = dict(zip(names, st, strict=True))
            row["stages_sum"] = round(sum(st), 1)
            go = graph.launch
            row["graph"] = timed([lambda: go(s)], args.reps)[0]  # noqa: B023 (used in this pass only)
            row["two_graphs"] = timed([lambda: go(s), lambda: go(s)], args.reps)  # noqa: B023
            row["pass_reserve"] = {}
            for r in (0, SIDE_RESERVE):
                lr = idx._mma_launches(b, k, sample, idx._lane(0), r)
                row["pass_reserve"][r] = timed([fn for _, fn in lr], args.reps)[3]
        row["serial_us"], row["queued_us"] = chains(part, args.chain)
        row["queued_trace"] = traced_chain(part, args.chain)
        row["carveout100"] = carveout(100) if args.carveout else "not run"
        if row["carveout100"] == "set":
            row["queued_us_carveout100"] = chains(part, args.chain)[1]
            row["queued_trace_carveout100"] = traced_chain(part, args.chain)
            carveout(-1)
        row["overflows"] = idx.threshold_overflows
        row["queued_batches"] = idx.queued_batches
        got = np.array([sp.rows[0] for sp in part])
        ref_rows, _ = idx.search(q[:b], k, n, 0, None, True)
        row["rows_match_search"] = bool((np.sort(got, 1) == np.sort(ref_rows, 1)).all())
        out["batches"][str(b)] = row
        print(json.dumps({"batch": b, **row}), flush=True)
    idx.detach_segment()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "mma_stages.json").write_text(json.dumps(out, indent=1))
    print(f"rows {n}: copy {out['copy_us']} us ({out['copy_tbs']} TB/s read + write)")
    for b, r in out["batches"].items():
        print(f"batch {b}: graph {r['graph']} us, two in a row {r['two_graphs']}, stages {r['stages']}, "
              f"pass by reserve {r['pass_reserve']}, per batch serial {r['serial_us']} / queued {r['queued_us']} us, "
              f"queued trace {r['queued_trace']}, carveout 100: {r.get('queued_us_carveout100')} "
              f"{r.get('queued_trace_carveout100', r['carveout100'])}")
    idx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The sweep in process, with clients that come back a fixed time after each answer (issue 3).

    python -P benchmarks/sweep_model.py [--rows 1000000] [--clients 32] [--chunks 3,4,6]
        [--return-us 0,150,300] [--lead-us 0,25] [--duration 2] --out DIR

An in-process GpuIndex holds ``--rows`` random unit rows (768-d float16, cosine, k = 10) and
a registered segment with one one-query slot per client. ``--clients`` virtual clients recall
through the sweep (sidecar/sweep.py) as the dispatcher drives it: each loop joins every
client that is ready as one batch (at most 32 queries), keeps the scan going and takes the
batches it finished; a client answered at t is ready again at t + ``--return-us`` (the
wake-up and the client's own work, which the real sidecar's clients take). For each number of
ranges, lead (``KALOS_SWEEP_LEAD_US``) and return time it reports recalls/s, the latency from
join to answer (p50 / p99),
passes per second and the mean pool positions a pass covered, and checks that the last
answers match ``GpuIndex.search``. What the sweep can do with the sidecar's Python and the
clients' processes taken out; ``ab_sidecars.py --env-b KALOS_SWEEP=1`` measures it with them.

Prints one JSON line per setting and writes ``DIR/sweep_model.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--chunks", default="3,4,6")
    ap.add_argument("--return-us", default="0,150,300")
    ap.add_argument("--lead-us", default="0,25")
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from kalos_retrievers.sidecar import index_gpu
    from kalos_retrievers.sidecar.bench import make_data, one_query_slots
    from kalos_retrievers.sidecar.index_gpu import GpuIndex

    from kalos_retrievers.protocol import Metric

    index_gpu.SWEEP = True  # type: ignore[misc]  # (off by default: this is its benchmark)
    n, dim, k, nc = args.rows, 768, 10, args.clients
    idx = GpuIndex(dim, Metric.COSINE, 0, "float16")
    for s0 in range(0, n, 65536):
        chunk = make_data(min(65536, n - s0), dim, 3 + s0)
        idx.set_rows(np.arange(s0, s0 + len(chunk)), chunk, np.zeros(len(chunk), np.int32))
    q = make_data(nc, dim, 4)
    _mm, specs = one_query_slots(idx, nc, dim, k, q)
    ref_rows, _ = idx.search(q, k, n, 0, None, True)

    def run(chunks: int, lead_us: int, ret_us: float) -> dict[str, Any]:
        idx._sweep_chunks, idx._sweep_lead_us = chunks, lead_us
        if idx._sweep is not None:  # a new sweep for this number of ranges
            idx._sweep.close()
            idx._sweep = None
        ret = int(ret_us * 1000)
        ready_at = [0] * nc
        busy = [False] * nc
        t_join = [0] * nc
        lat: list[float] = []
        answered = 0
        joins = 0
        t_end = time.perf_counter_ns() + int(args.duration * 1e9)
        t_start = None
        while True:
            now = time.perf_counter_ns()
            if now >= t_end:
                break
            ready = [i for i in range(nc) if not busy[i] and ready_at[i] <= now][:32]
            if ready and idx.sweep_can_join(len(ready), k, n, 0, True):
                for i in ready:
                    specs[i].rows.fill(-1)
                    busy[i], t_join[i] = True, now
                idx.sweep_join([specs[i] for i in ready], k, n, 0, True, tuple(ready))
                joins += 1
            idx.sweep_pump()
            done = idx.sweep_finished()
            if done:
                t = time.perf_counter_ns()
                if t_start is None:
                    t_start = t  # (the first answers: the pool is filling up before)
                    answered = 0
                    lat.clear()
                for tok, err in done:
                    if err is not None:
                        raise err
                    for i in tok:
                        busy[i], ready_at[i] = False, t + ret
                        lat.append((t - t_join[i]) / 1000)
                        answered += 1
        idx.sweep_settle()
        idx.sweep_finished()
        span = (time.perf_counter_ns() - (t_start or 0)) / 1e9
        sw = idx.describe()["sweep"]
        got = np.array([sp.rows[0] for sp in specs])
        return {"chunks": chunks, "lead_us": lead_us, "return_us": ret_us, "pass_us": sw["pass_us"],
                "recalls_per_s": round(answered / span, 1),
                "latency_p50_us": round(float(np.median(lat)), 1) if lat else None,
                "latency_p99_us": round(float(np.percentile(lat, 99)), 1) if lat else None,
                "joins": joins, "passes_per_s": round(sw["passes"] / span, 1),
                "positions_mean": sw["positions_mean"], "overflows": sw["overflows"],
                "rows_match_search": bool((np.sort(got, 1) == np.sort(ref_rows, 1)).all())}  # fmt: skip

    out: dict[str, Any] = {"rows": n, "dim": dim, "k": k, "clients": nc, "device": idx.device_name, "runs": []}
    for chunks in [int(x) for x in args.chunks.split(",") if x]:
        for lead_us in [int(x) for x in args.lead_us.split(",") if x]:
            for ret_us in [float(x) for x in args.return_us.split(",") if x]:
                r = run(chunks, lead_us, ret_us)
                out["runs"].append(r)
                print(json.dumps(r), flush=True)
    idx.detach_segment()
    idx.close()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "sweep_model.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The carousel in process: how many recalls per second a crowd gets from a scan that queries
board wherever it is (issue 3: 32 processes at 1M rows, >= 40k/s; sidecar/carousel.py).

    python -P benchmarks/carousel_probe.py [--rows 1000000] [--clients 32] \\
        [--return-us 0,150,300] [--duration 2] --out DIR

Random unit float16 rows (cosine, 768-d, k = 10) on the device; ``carousel_topk`` launched over
them; then, for each ``--return-us`` R, ``--clients`` clients in this process's one thread
(sidecar.carousel.drive: each slot a client that sends its next query R µs after its answer)
for ``--duration`` s. A client of the sidecar comes back ~100-120 µs after its answer is
posted (p50, S28-2/S32-4, tail to ~0.5 ms), so R = 150 is the crowd's case; R = 0 is the
carousel's own ceiling. Then one client alone (R = 0): the turn's length with one query
aboard.

For each: the rate, the host's latency (send to answer seen, p50/p99), the kernel's own
(boarding to answer, GPU clock), and clients / (its p50 + R): what the kernel alone would
allow. Every answer of the first ``--check`` requests of each run is compared with an exact
top-k over the same float16 rows (float32 scores from cuBLAS, tie-tolerant; computed before
the launch: the running carousel holds every SM, so nothing else would run on the device
until it stops): the count of mismatches is printed and must be 0. The bandwidth floor of one
turn (a device copy of the rows, read + write) is printed beside it.

The queued batches this would replace cannot pass 32 / (2 x pass): measure the pass in the same
call with ``benchmarks/mma_stages.py --batches 16`` (``queued_us``).

Prints one JSON line per run, a table last, and writes ``DIR/carousel_probe.json``.

``--profile`` builds the kernel with ``-DKALOS_CAR_PROFILE`` (its clock stamped per stage; see
``car_prof`` in recall.cu), restarts it around each timed run, and adds to the run's line where
the scanning blocks' cycles went (shares of: a step's start and boarding, the tiles, the step's
end, the cuts and closing selections, the done counts, the merges; idle), the merges' spread
over the blocks (a convoy: one block merging most answers; all 0 with the conductor merging,
the default: its own figures are under "conductor") and the conductor's rounds. Shares are of
the stamped time (each step's first barrier and the stamps' own stores are not stamped), and
µs come from the nominal clock (``clockRate``): under load the SMs may run slower, so wall
time per step is longer (the steps' count over the run's seconds says by how much).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


def _pct(v: list[float], p: float) -> float:
    return round(float(np.percentile(v, p)), 1) if v else float("nan")


# car_prof's columns (recall.cu: CP_* for a scanning block, CC_* for the conductor, block 0)
_CP = ["steps", "start", "idle", "scan", "end", "cut", "done", "merge", "n_merge", "n_cut", "n_final", "list_n",
       "aboard", "n_idle", "smid", "tiles"]  # fmt: skip
_CC = ["rounds", "poll", "merge", "board", "n_board", "n_merge", "select"]


def _profile(p: np.ndarray, khz: int) -> dict[str, Any]:
    """Where the cycles went (``p``: car_prof's rows for the grid, block 0 the conductor)."""
    sc = {name: p[1:, i].astype(np.float64) for i, name in enumerate(_CP)}
    stages = ["start", "idle", "scan", "end", "cut", "done", "merge"]
    total = sum(sc[s].sum() for s in stages)
    steps = max(sc["steps"].sum(), 1.0)
    us = 1000.0 / khz  # µs per cycle
    merges = sc["n_merge"]
    top = np.argsort(-merges)[:3]
    cond = {name: float(p[0, i]) for i, name in enumerate(_CC)}
    rounds = max(cond["rounds"], 1.0)
    # each block's busy time per step (not idle): a turn ends when its slowest block is done
    busy = sum(sc[s] for s in stages if s != "idle") / np.maximum(sc["steps"], 1.0) * us
    slow = np.argsort(-busy)[:3]
    c_sm = int(p[0, _CP.index("smid")])

    def block(b: int) -> list[Any]:  # [block, SM, busy µs a step, steps, tiles]
        return [b + 1, int(sc["smid"][b]), round(float(busy[b]), 2), int(sc["steps"][b]), int(sc["tiles"][b])]

    return {
        "share": {s: round(float(sc[s].sum() / total), 4) for s in stages} if total else {},
        "us_per_step": {s: round(float(sc[s].sum() / steps * us), 3) for s in stages},
        "steps_per_block": round(float(steps / len(merges)), 1),
        "aboard_per_step": round(float(sc["aboard"].sum() / steps), 2),
        "cuts": int(sc["n_cut"].sum()), "finals": int(sc["n_final"].sum()),
        "list_n_mean": round(float(sc["list_n"].sum() / max(sc["n_cut"].sum() + sc["n_final"].sum(), 1)), 1),
        "merges": int(merges.sum()), "blocks_merging": int((merges > 0).sum()),
        "top_mergers": [[int(b) + 1, int(merges[b])] for b in top],
        "us_per_merge": round(float(sc["merge"].sum() / max(merges.sum(), 1) * us), 3),
        "busy_us_per_step_median": round(float(np.median(busy)), 2),
        "slowest": [block(int(b)) for b in slow],
        "conductor_sm": c_sm,
        "conductor_neighbours": [block(int(b)) for b in np.flatnonzero(sc["smid"] == c_sm)],
        "conductor": {"rounds": int(cond["rounds"]), "poll_us": round(cond["poll"] / rounds * us, 3),
                      "board_us": round(cond["board"] / rounds * us, 3), "merges": int(cond["n_merge"]),
                      "us_per_merge": round(cond["merge"] / max(cond["n_merge"], 1) * us, 3),
                      "us_per_select": round(cond["select"] / max(cond["n_merge"], 1) * us, 3),
                      "boarded": int(cond["n_board"])},
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--return-us", default="0,150,300")
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--check", type=int, default=300, help="answers checked exactly per run")
    ap.add_argument("--per-sm", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="stamp the kernel's stages (-DKALOS_CAR_PROFILE)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.profile:
        os.environ["KALOS_KERNEL_OPTIONS"] = (
            os.environ.get("KALOS_KERNEL_OPTIONS", "") + " -DKALOS_CAR_PROFILE"
        ).strip()
    import cupy as cp
    from kalos_retrievers.sidecar.carousel import DONE, Carousel, Slots, drive
    from kalos_retrievers.sidecar.index import NS_ANY

    n, dim, k = args.rows, args.dim, args.k
    ld = -(-dim // 8) * 8
    rng = cp.random.default_rng(7)
    data = cp.zeros((n, ld), cp.float16)
    for s0 in range(0, n, 131072):  # unit rows, normalized in float32, stored as float16
        x = rng.standard_normal((min(131072, n - s0), dim), dtype=cp.float32)
        x /= cp.linalg.norm(x, axis=1, keepdims=True)
        data[s0 : s0 + len(x), :dim] = x.astype(cp.float16)
    cp.cuda.Device().synchronize()
    qs = np.random.default_rng(8).standard_normal((1024, dim)).astype(np.float32)
    qs16 = cp.asarray(qs / np.linalg.norm(qs, axis=1, keepdims=True)).astype(cp.float16)

    # the floor: a device copy of the rows (bytes read + written), median of 10
    dst = cp.empty_like(data)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    copies = []
    for _ in range(12):
        ev0.record()
        dst[...] = data
        ev1.record()
        ev1.synchronize()
        copies.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1000)
    del dst
    copy_us = float(np.median(copies[2:]))
    read_floor_us = copy_us / 2  # one read of the rows
    out: dict[str, Any] = {"rows": n, "dim": dim, "k": k, "clients": args.clients, "copy_us": round(copy_us, 1),
                           "read_floor_us": round(read_floor_us, 1), "runs": []}  # fmt: skip
    print(json.dumps({"copy_us": out["copy_us"], "read_floor_us": out["read_floor_us"]}), flush=True)

    # The references, all before the launch: while the carousel runs it holds every SM (its
    # blocks never end), so a matrix product or a sort launched then would never start.
    data32 = data[:, :dim].astype(cp.float32)  # (float16 products are exact in float32)
    refs = {}
    for j in range(min(args.check, len(qs))):  # each run checks its requests j < --check
        sc = data32 @ qs16[j].astype(cp.float32)
        top = cp.argsort(-sc)[: k + 8]
        refs[j] = (cp.asnumpy(top), cp.asnumpy(sc[top]))
    del data32, sc
    cp.cuda.Device().synchronize()

    def mismatches(answers: list[Any]) -> int:
        bad = 0
        for a in answers:
            if a.rows is None:
                continue
            if a.state != DONE or a.n != k:
                bad += 1
                continue
            ref_rows, ref_s = refs[a.j % len(qs)]
            kth = ref_s[k - 1]
            # scores: the reference's best k in order (2e-4: float32 sums in another order);
            # rows: those above the k-th's tie band must be the reference's
            ok = np.allclose(a.scores, ref_s[:k], atol=2e-4, rtol=0)
            sure = set(ref_rows[:k][ref_s[:k] > kth + 2e-4].tolist())
            ok = ok and sure <= set(a.rows.tolist()) and len(set(a.rows.tolist())) == k
            bad += not ok
        return bad

    slots = Slots(cp, max(args.clients, 1), dim)
    car = Carousel(cp, data, dim, 0, slots, per_sm=args.per_sm)
    out["grid"] = car.grid
    out["kernel_options"] = os.environ.get("KALOS_KERNEL_OPTIONS", "")
    prof = None
    if args.profile:
        from kalos_retrievers.sidecar import carousel, cuda_kernels

        mod = cuda_kernels.module_of("carousel_topk", carousel.NT, 0)  # (the Carousel's metric above: 0)
        prof = cp.ndarray((1024, 16), cp.uint64, memptr=mod.get_global("car_prof"))
        khz = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"])
    car.start()
    try:
        plan = [(r, args.clients) for r in (float(x) for x in args.return_us.split(",") if x)] + [(0.0, 1)]
        for r_us, clients in plan:
            ask = lambda j: (qs[j % len(qs)], k, NS_ANY)  # noqa: E731
            drive(slots, ask, clients=clients, until=time.perf_counter() + 0.3)  # warm-up
            gc.collect()
            gc.disable()  # (no collection pausing the clients' thread while it is timed)
            if prof is not None:  # the stamps of this run alone
                car.stop()
                prof.fill(0)
                car.start()
            try:
                t0 = time.perf_counter()
                answers = drive(slots, ask, clients=clients, until=t0 + args.duration, return_ns=int(r_us * 1000),
                                keep=lambda j: j < args.check)  # fmt: skip
                wall = time.perf_counter() - t0
            finally:
                gc.enable()
            done = [a for a in answers if a.state == DONE]
            lat = [(a.seen_ns - a.sent_ns) / 1000 for a in done]
            aboard = [a.aboard_ns / 1000 for a in done]
            # what the kernel alone would allow these clients: each back R µs after its answer
            ceiling = clients / ((_pct(aboard, 50) + r_us) / 1e6) if done else float("nan")
            run = {"return_us": r_us, "clients": clients, "answers": len(done), "refused": len(answers) - len(done),
                   "recalls_per_s": round(len(done) / wall, 1), "p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99),
                   "aboard_p50_us": _pct(aboard, 50), "aboard_p99_us": _pct(aboard, 99),
                   "kernel_ceiling_per_s": round(ceiling, 1),
                   "mismatches": mismatches(answers), "checked": min(args.check, len(answers))}  # fmt: skip
            if prof is not None:
                car.stop()
                raw = cp.asnumpy(prof[: car.grid])
                run["profile"] = _profile(raw, khz)
                car.start()
            out["runs"].append(run)
            print(json.dumps(run), flush=True)
            if prof is not None:
                run["profile_raw"] = raw.tolist()  # (the JSON file's only)
    finally:
        car.close()
        slots.close()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "carousel_probe.json").write_text(json.dumps(out, indent=1))
    print(f"\ncarousel, {n} rows x {dim}, k = {k}, grid {out['grid']}, one read of the rows {read_floor_us:.1f} µs")
    print("| clients | return µs | recalls/s | clients / (aboard p50 + return) | p50 µs | p99 µs | aboard p50 | "
          "aboard p99 | mismatches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["runs"]:
        print(f"| {r['clients']} | {r['return_us']:.0f} | {r['recalls_per_s']:,.0f} | "
              f"{r['kernel_ceiling_per_s']:,.0f} | {r['p50_us']} | {r['p99_us']} | "
              f"{r['aboard_p50_us']} | {r['aboard_p99_us']} | {r['mismatches']} of {r['checked']} |")  # fmt: skip
    return 1 if any(r["mismatches"] for r in out["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())

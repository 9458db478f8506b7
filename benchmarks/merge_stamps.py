"""Where the batch-1 scan's tail goes: %globaltimer stamps of the last block (issue 3).

    python -P benchmarks/merge_stamps.py [--rows 100000,1000000] [--out DIR]

``scan_variants.py`` (S9-2) put the last block's merge at ~12-14 µs of a batch-1 scan at 100k
and at 1M rows (full kernel against the one without the merge), and two changes aimed at its
loads and its shared-memory atomics did not move it (S9-3, S9-4). This builds ``scan_topk``
with ``-DKALOS_STAMPS`` (kernels/recall.cu: stamps compiled out of the sidecar's kernels) and
reads, after each of 40 launches per configuration (768-d float16 rows, cosine, k = 10, 4
threads per row; grids of 2, 3 and 4 blocks per SM), the stamps of the block that merged.
With the appended lists (k above 32, or grids above 512 - k blocks): when its scan loop
ended, when its append ended, when it learned it was last, and the merge's phases (bound and
count read, the first pass over the appended keys, the k-th select, the final sort, the
output), plus the first and the last loop end of any block and the counts (appended entries,
survivors of the bound, entries after the select). With the tagged lists (ll_merge, k <= 32
and grids up to 512 - k): when the last head and the last list were written, block 0's head,
its two rounds of heads (and how many were missing at the first), the k-th head, the lists
read, the final selection, the output. Prints medians in µs; writes ``DIR/merge_stamps.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scan_variants import build

NSTAMPS = 24  # kalos_stamps' length in kernels/recall.cu
PHASES = {  # name: (from stamp, to stamp): the appended lists (k > 32, or grids above 512 - k)
    "blocks' loop ends, first to last": (12, 13),
    "last loop end -> merging block's loop end": (13, 0),
    "loop end -> append done": (0, 1),
    "append done -> knows it is last": (1, 2),
    "bound and count read": (2, 3),
    "first pass over the appended keys": (3, 4),
    "k-th select (when survivors > 2k)": (4, 5),
    "final sort (compact)": (5, 6),
    "output and reset": (6, 7),
    "merging block, loop end -> done": (0, 7),
}
COUNTS = {"appended": 8, "survivors of the bound": 9, "after the select": 10}
# the tagged lists merged by block 0 (ll_merge; the kernel sets stamp 15 to 1): 16 and 14 are
# the last block's head and list written, 0 and 1 block 0's loop end and head, 2 the first
# round's heads read, 5 and 11 the second round's start and its last head (when some heads were
# missing at the first round: count 17), 3 the k-th head. A phase marked "r2" is the median of
# the scans that had a second round, "r1" of those that had not; a stamp a build does not set
# (16 without KALOS_LL_HEAD_FIRST) leaves its phases out.
PHASES_LL = {
    "blocks' loop ends, first to last": (12, 13, None),
    "last loop end -> last head written": (13, 16, None),
    "last loop end -> last list written": (13, 14, None),
    "block 0's loop end -> its head written": (0, 1, None),
    "block 0's head -> the heads in read": (1, 2, None),
    "the k-th head, one round (selection)": (2, 3, "r1"),
    "first round's selection": (2, 5, "r2"),
    "the last heads waited for": (5, 11, "r2"),
    "last head written -> block 0 has every head": (16, 11, "r2"),
    "second round's selection": (11, 3, "r2"),
    "block 0's loop end -> the k-th head": (0, 3, None),
    "the lists at or above it read": (3, 4, None),
    "final selection": (4, 6, None),
    "output and reset": (6, 7, None),
    "last loop end -> done": (13, 7, None),
}
COUNTS_LL = {"lists read (block 0's own too)": 8, "entries at or above the k-th head": 9, "results": 10,
             "heads missing at the first round": 17}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="100000,1000000")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    import cupy as cp
    from kalos_retrievers.sidecar import cuda_kernels as kern
    from kalos_retrievers.sidecar import index_gpu

    expr = kern.expression("scan_topk", index_gpu._CTYPE["float16"], 4, 1, 0)
    opts = ("-std=c++17", f"-DKALOS_BLOCK={kern.BLOCK}", "-DKALOS_STAMPS", *kern.extra_options())
    mod = cp.RawModule(code=kern.source(), options=opts,
                       name_expressions=[expr])  # fmt: skip
    f = mod.get_function(expr)
    stamps = cp.ndarray((NSTAMPS,), cp.uint64, mod.get_global("kalos_stamps"))
    results: list[dict[str, Any]] = []
    for n in [int(x) for x in a.rows.split(",")]:
        idx, svc, keep = build(n)
        buf = idx._buf(16)
        smem = idx._smem(1, buf)
        f.max_dynamic_shared_size_bytes = max(f.max_dynamic_shared_size_bytes, smem)
        sargs = (idx.data, idx.ns, idx.sqnorm, np.uint64(0), idx.params, idx.qbuf, idx.qbuf_i8, np.int32(idx.ld),
                 np.int32(buf), idx.scratch_k, idx.scratch_v, idx.sync)  # fmt: skip
        with idx.device, idx.stream:
            for grid in (2 * idx.sms, 3 * idx.sms, 4 * idx.sms):
                got = []
                for i in range(45):
                    init = np.zeros(NSTAMPS, np.uint64)
                    init[12] = np.iinfo(np.uint64).max
                    stamps.set(init, stream=idx.stream)
                    f((grid,), (kern.BLOCK,), sargs, shared_mem=smem)
                    idx.stream.synchronize()
                    if i >= 5:
                        got.append(stamps.get().astype(np.int64))
                s = np.array(got)
                ll = bool(s[0, 15] == 1)
                row: dict[str, Any] = {"rows": n, "grid": grid, "merge": "tagged lists" if ll else "appended lists"}
                if ll:
                    r2 = s[:, 17] > 0
                    row["scans with a second round"] = round(float(np.mean(r2)), 2)
                    for name, (x, y, only) in PHASES_LL.items():
                        sel = (s[:, x] > 0) & (s[:, y] > 0) & {None: True, "r2": r2, "r1": ~r2}[only]
                        if np.any(sel):
                            row[name] = round(float(np.median(s[sel, y] - s[sel, x])) / 1000, 2)
                else:
                    for name, (x, y) in PHASES.items():
                        row[name] = round(float(np.median(s[:, y] - s[:, x])) / 1000, 2)
                for name, i in (COUNTS_LL if ll else COUNTS).items():
                    row[name] = float(np.median(s[:, i]))
                results.append(row)
                print(json.dumps(row), flush=True)
        idx.close()
        del svc, keep
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "merge_stamps.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

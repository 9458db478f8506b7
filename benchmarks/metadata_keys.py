"""What the sidecar's metadata columns hold and cost (``sidecar/metadata.py``), in process.

    python -P benchmarks/metadata_keys.py [--rows 100000] [--keys 100] [--set-rows 200000]

Memory: a table of ``rows`` capacity, one row written with a key of its own and deleted,
``keys`` times (an item per LangGraph key, say): the columns left and their bytes (each
column is four arrays as long as the table; since session 67 a key's column goes with its
last row). Time: ``MetadataColumns.set`` of ``set-rows`` rows with three keys each, new and
then overwritten (best of 3).
"""

from __future__ import annotations

import argparse
import time

from kalos_retrievers.sidecar.metadata import MetadataColumns


def _column_bytes(cols: MetadataColumns) -> int:
    return sum(getattr(c, n).nbytes for c in cols.dense.values() for n in ("kind", "num", "obj", "code"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--set-rows", type=int, default=200_000)
    args = ap.parse_args()
    cols = MetadataColumns(capacity=args.rows)
    for i in range(args.keys):
        cols.set(7, {"shared": 1, f"only-{i}": i})
        cols.clear(7)
    print(f"{args.keys} keys written once and deleted at {args.rows:,} rows' capacity: {len(cols.cols)} columns "
          f"left, {_column_bytes(cols) / 1e6:.1f} MB")  # fmt: skip
    n = args.set_rows
    metas = [{"user_id": f"u{i % 100}", "topic": "t", "n": i} for i in range(n)]
    best_new = best_over = float("inf")
    for _ in range(3):
        cols = MetadataColumns(capacity=n)
        t0 = time.perf_counter()
        for r, m in enumerate(metas):
            cols.set(r, m)
        t1 = time.perf_counter()
        for r, m in enumerate(metas):
            cols.set(r, m)
        t2 = time.perf_counter()
        best_new, best_over = min(best_new, t1 - t0), min(best_over, t2 - t1)
    print(f"set() of {n:,} rows x 3 keys: new {best_new:.3f} s, overwritten {best_over:.3f} s (best of 3)")


if __name__ == "__main__":
    main()

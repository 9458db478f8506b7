"""What a first start's kernel compile costs, in one module or split over threads.

    python -P benchmarks/kernel_compile.py [--threads 1,4] [--dtype float16] [--metric cosine]
        [--dim 768] [--repeat 1] [--out DIR]

A GPU sidecar compiles its kernels (NVRTC, through CuPy) when its index is made, and CuPy
caches the modules on disk, so only a machine's first start for a dtype and metric pays for
the compiler (a container without the cache pays at every start). This makes that index in a
fresh process with an empty cache (``CUPY_CACHE_DIR`` a new directory) once per
``KALOS_COMPILE_THREADS`` value in ``--threads``, in turn for ``--repeat`` rounds, and prints
the seconds each took; then, with the last cache filled, the start that finds it (no
compile). Needs CuPy and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, time
t0 = time.perf_counter()
from kalos_retrievers.protocol import METRICS
from kalos_retrievers.sidecar.index_gpu import GpuIndex
t1 = time.perf_counter()
GpuIndex(int(sys.argv[1]), METRICS[sys.argv[2]], 0, sys.argv[3])
print(time.perf_counter() - t1, t1 - t0)
"""


def start(threads: int, cache: str, a: argparse.Namespace) -> tuple[float, float]:
    """(seconds to make the index, seconds to import) in a fresh process."""
    env = dict(os.environ, CUPY_CACHE_DIR=cache, KALOS_COMPILE_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-P", "-c", CHILD, str(a.dim), a.metric, a.dtype], check=False, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if out.returncode:
        raise SystemExit(f"the index failed to start with {threads} thread(s):\n{out.stderr[-3000:]}")
    make, imp = map(float, out.stdout.split()[-2:])
    return make, imp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,4")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--metric", default="cosine")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    threads = [int(t) for t in a.threads.split(",") if t]
    res: dict[str, list[float]] = {}
    cache = ""
    for r in range(a.repeat):
        for n in threads:
            cache = tempfile.mkdtemp(prefix=f"kalos-cc{n}-")
            make, _ = start(n, cache, a)
            res.setdefault(f"cold_{n}", []).append(round(make, 2))
            print(f"round {r}: {n} thread(s), an empty cache: {make:.2f} s", file=sys.stderr)
    make, _ = start(threads[-1], cache, a)
    res["warm"] = [round(make, 2)]
    print(f"{threads[-1]} thread(s), the cache filled: {make:.2f} s", file=sys.stderr)
    print(json.dumps(res))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        doc = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "cpus": os.cpu_count(), "seconds": res}
        (Path(a.out) / "kernel_compile.json").write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

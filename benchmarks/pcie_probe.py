"""How long the GPU takes to read a row of registered host memory: int8's re-scoring reads
its candidates' float16 rows (1.5 KB at 768-d) and their arena entries (16 bytes) this way.

    python -P benchmarks/pcie_probe.py [--rows 1000000] [--reps 4000] [--out DIR]

A kernel reads rows of a host buffer registered with the device (``hostRegister``, mapped),
each with one 16-byte uncached load (``ld.volatile``) per thread, and stamps each read with
%globaltimer: from before its loads to after the block has summed them. Cases:

* buffers: anonymous memory with ``MADV_NOHUGEPAGE`` (4 KiB pages) and with ``MADV_HUGEPAGE``
  (transparent huge pages, where the system grants them: ``AnonHugePages`` says how much it
  did), and a POSIX shared-memory file in /dev/shm (what the arena's row table is);
* the row read: a random row of the buffer each time (``random``: the re-scoring's pattern,
  a new page nearly every time) or the same row every time (``same``: the page's
  translations cached);
* one block reading one row after another (``"grid": 1``: the latency of one read) or 20
  blocks at once (``"grid": 20``: the re-scoring's 20 candidates of top-10, one per block).

One JSON line per case, everything in ``DIR/pcie_probe.json``. No sidecar, no index: a
reference for what the re-scoring's loads cost, and whether huge pages change it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

SRC = r"""
extern "C" __global__ void rows_read(unsigned long long base, const int* __restrict__ rows, int reps,
                                     int row_bytes, unsigned long long* __restrict__ t,
                                     float* __restrict__ sink) {
    __shared__ float s[32];
    const int chunks = row_bytes / 16;
    for (int j = blockIdx.x; j < reps; j += gridDim.x) {
        const int r = rows[j];
        __syncthreads();
        unsigned long long t0, t1;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        float acc = 0.f;
        for (int ch = threadIdx.x; ch < chunks; ch += blockDim.x) {
            const unsigned long long a = base + (unsigned long long)r * row_bytes + 16ull * ch;
            unsigned int x, y, z, w;
            asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(a) : "memory");
            acc += __uint_as_float(x ^ y ^ z ^ w);
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            float tot = 0.f;
            for (int i = 0; i < (int)(blockDim.x / 32); i++) tot += s[i];
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
            t[j] = t1 - t0;
            sink[j] = tot;
        }
    }
}
"""


def anon_huge_kb(addr: int) -> int | None:
    """``AnonHugePages`` (KiB) of the mapping holding ``addr`` in /proc/self/smaps."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def thp_settings() -> dict[str, str]:
    out = {}
    for name in ("enabled", "defrag", "shmem_enabled"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError:
            out[name] = "?"
    return out


def pct(a: np.ndarray) -> dict[str, float]:
    return {"p50": round(float(np.percentile(a, 50)) / 1000, 3), "p90": round(float(np.percentile(a, 90)) / 1000, 3),
            "mean": round(float(a.mean()) / 1000, 3)}  # fmt: skip


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--row-bytes", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=4000)
    ap.add_argument("--shm-mb", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    kern = cp.RawKernel(SRC, "rows_read")
    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = [{"thp": thp_settings()}]
    print(json.dumps(results[0]), flush=True)

    def run(name: str, addr: int, n_rows: int, row_bytes: int) -> None:
        for pattern in ("random", "same"):
            if pattern == "random":
                rows = rng.integers(0, n_rows, a.reps).astype(np.int32)
            else:
                rows = np.full(a.reps, n_rows // 2, np.int32)
            d_rows = cp.asarray(rows)
            t = cp.zeros(a.reps, cp.uint64)
            sink = cp.zeros(a.reps, cp.float32)
            for grid in (1, 20):
                args = (np.uint64(addr), d_rows, np.int32(a.reps), np.int32(row_bytes), t, sink)
                kern((grid,), (256,), args)  # warm-up: the same rows again below
                cp.cuda.Device().synchronize()
                if pattern == "random":  # fresh rows for the measured run
                    d_rows[:] = cp.asarray(rng.integers(0, n_rows, a.reps).astype(np.int32))
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record()
                kern((grid,), (256,), args)
                e1.record()
                e1.synchronize()
                ms = cp.cuda.get_elapsed_time(e0, e1)
                r = {"buffer": name, "row_bytes": row_bytes, "pattern": pattern, "grid": grid,
                     "read_us": pct(cp.asnumpy(t).astype(np.float64)),
                     "kernel_us_per_read_wave": round(ms * 1000 / (a.reps / grid), 3)}  # fmt: skip
                results.append(r)
                print(json.dumps(r), flush=True)

    size = a.rows * a.row_bytes
    for advice in ("MADV_NOHUGEPAGE", "MADV_HUGEPAGE"):
        mm = mmap.mmap(-1, size)
        mm.madvise(getattr(mmap, advice))
        arr = np.frombuffer(mm, np.uint8)
        arr[::4096] = 1  # touch every page (huge pages are granted at the first fault)
        addr = arr.ctypes.data
        huge = anon_huge_kb(addr)
        cp.cuda.runtime.hostRegister(addr, size, 3)
        results.append({"buffer": advice, "bytes": size, "anon_huge_kb": huge})
        print(json.dumps(results[-1]), flush=True)
        run(advice, addr, a.rows, a.row_bytes)
        run(advice + "/16B", addr, size // 16, 16)
        cp.cuda.runtime.hostUnregister(addr)
        del arr
        mm.close()
    try:
        import posix_ipc

        shm_size = a.shm_mb << 20
        shm = posix_ipc.SharedMemory(f"/kalos-pcie-probe-{os.getpid()}", posix_ipc.O_CREX, size=shm_size)
        try:
            mm = mmap.mmap(shm.fd, shm_size)
            arr = np.frombuffer(mm, np.uint8)
            arr[::4096] = 1
            addr = arr.ctypes.data
            cp.cuda.runtime.hostRegister(addr, shm_size, 3)
            run("dev_shm/16B", addr, shm_size // 16, 16)
            run("dev_shm", addr, shm_size // a.row_bytes, a.row_bytes)
            cp.cuda.runtime.hostUnregister(addr)
            del arr
            mm.close()
        finally:
            shm.close_fd()
            shm.unlink()
    except ImportError:
        print("posix_ipc missing: the /dev/shm case skipped", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pcie_probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

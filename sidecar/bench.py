"""``kalos-sidecar bench``: recall latency and throughput, next to the in-process baseline.

It starts its own sidecar, loads N synthetic normalized vectors through the client (chunked
upserts), then measures:

* batch-1 recall latency from the Python client to numpy results: p50 / p99 / p99.9 over
  ``--calls`` calls after ``--warmup`` calls, with queries drawn from a pool of random vectors;
* aggregate throughput and p99 with ``--procs`` concurrent client processes;
* in the same run, the in-process baseline a user would write instead: numpy ``M @ q`` plus
  ``argpartition`` (and on a GPU, see benchmarks/gpu_recall.py for PyTorch and CuPy), and what
  the sidecar adds over it: blocks of Kalos calls and blocks of numpy calls alternate for
  ``--rounds`` rounds, and the figure is the mean of the per-round differences of the blocks'
  medians (see :func:`blocked`; the call-by-call paired median is reported beside it).

It prints a table and writes everything as JSON (``--json``). Time is measured with
``perf_counter_ns`` around each call; nothing is timed by the wall clock.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np


def _at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(text)
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


def _seconds(text: str) -> float:
    v = float(text)
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=_at_least(1), default=100_000)
    p.add_argument("--dim", type=_at_least(1), default=384)
    p.add_argument("--k", type=_at_least(1), default=10, help="at most --rows and 1024")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--calls", type=_at_least(1), default=10_000)
    p.add_argument("--warmup", type=_at_least(0), default=500)
    p.add_argument("--procs", type=_at_least(1), default=4, help="client processes for the throughput run")
    p.add_argument("--duration", type=_seconds, default=5.0, help="seconds of the throughput run")
    p.add_argument("--threads", type=_at_least(1), default=None, help="the sidecar's --threads (CPU backend)")
    p.add_argument("--rounds", type=_at_least(2), default=16, help="rounds of the blocked Kalos/numpy comparison")
    p.add_argument("--block", type=_at_least(1), default=200, help="calls per side per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")


# ------------------------------------------------------------------------------ data
def normalized_chunks(n: int, dim: int, seed: int, chunk: int = 65536) -> Iterator[np.ndarray]:
    """N random unit vectors (float32), generated chunk by chunk (1M x 768 is 3 GB)."""
    rng = np.random.default_rng(seed)
    for start in range(0, n, chunk):
        x = rng.standard_normal((min(chunk, n - start), dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        yield x


def make_data(n: int, dim: int, seed: int) -> np.ndarray:
    return np.concatenate(list(normalized_chunks(n, dim, seed))) if n else np.zeros((0, dim), np.float32)


def load(client: Any, data: np.ndarray, *, chunk: int = 8192, progress: bool = True) -> float:
    """Upsert ``data`` (ids "0".."n-1", no text) through the client; return the seconds taken."""
    t0 = time.perf_counter()
    n = len(data)
    last = t0
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        client.upsert([str(i) for i in range(start, end)], data[start:end], timeout=600)
        now = time.perf_counter()
        if progress and (now - last > 2 or end == n):
            last = now
            print(f"  loaded {end}/{n} rows ({now - t0:.1f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------ timing
def percentiles(us: np.ndarray) -> dict[str, float]:
    return {
        "calls": len(us),
        "mean_us": round(float(us.mean()), 2),
        "p50_us": round(float(np.percentile(us, 50)), 2),
        "p99_us": round(float(np.percentile(us, 99)), 2),
        "p999_us": round(float(np.percentile(us, 99.9)), 2),
    }


def one_query_slots(idx: Any, n: int, dim: int, k: int, queries: np.ndarray | None = None) -> tuple[Any, list[Any]]:
    """``n`` one-query slots (the query, then ``k`` rows and ``k`` scores; 128-byte aligned,
    as the sidecar's payloads are) in an anonymous map registered with ``idx`` as the
    sidecar's segment is (``attach_segment``): what the GPU benchmarks and tests hand to
    ``launch_slots``. ``queries`` (one row per slot, reused in turn) are written in. Returns
    (the map, one ``SlotSpec`` per slot); the map must outlive the specs."""
    import mmap

    from .index import SlotSpec

    per = -(-(4 * dim + 8 * k) // 128) * 128
    mm = mmap.mmap(-1, -(-n * per // 4096) * 4096)
    idx.attach_segment(mm)
    base = np.frombuffer(mm, np.uint8).ctypes.data
    specs = []
    for j in range(n):
        off = j * per
        qv = np.frombuffer(mm, np.float32, dim, off).reshape(1, dim)
        if queries is not None:
            qv[:] = queries[j % len(queries)]
        rows = np.frombuffer(mm, np.int32, k, off + 4 * dim).reshape(1, k)
        scores = np.frombuffer(mm, np.float32, k, off + 4 * dim + 4 * k).reshape(1, k)
        specs.append(SlotSpec(qv, rows, scores, base + off, base + off + 4 * dim, base + off + 4 * dim + 4 * k))
    return mm, specs


def time_calls(fn: Callable[[int], Any], calls: int, warmup: int) -> dict[str, float]:
    """Time ``fn(i)`` per call (perf_counter_ns); returns percentiles in microseconds."""
    for i in range(warmup):
        fn(i)
    out = np.empty(calls, np.float64)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn(i)
        out[i] = (time.perf_counter_ns() - t0) / 1000
    return percentiles(out)


def _throughput_worker(name: str, dim: int, k: int, seed: int, duration: float, start_at: float,
                       out: Any, arena_docs: bool | None = None) -> None:  # fmt: skip
    from kalos_retrievers.client import KalosClient

    from .stats import thread_sched

    qs = make_data(256, dim, seed)
    lat: list[float] = []
    tid = threading.get_native_id()
    with KalosClient(name, dim=dim, timeout=10, arena_docs=arena_docs) as c:
        for i in range(20):
            c.recall(qs[i], k)
        while time.time() < start_at:  # all workers start together (wall clock across procs)
            time.sleep(0.001)
        end = time.perf_counter() + duration
        s0 = thread_sched(tid)
        i = 0
        while True:
            t0 = time.perf_counter_ns()
            c.recall(qs[i & 255], k)
            t1 = time.perf_counter_ns()
            lat.append((t1 - t0) / 1000)
            i += 1
            if t1 / 1e9 > end:
                break
        s1 = thread_sched(tid)
    sched = None if s0 is None or s1 is None else (s1["cpu_ns"] - s0["cpu_ns"], s1["runqueue_ns"] - s0["runqueue_ns"])
    out.put((np.asarray(lat, np.float64), sched, os.path.dirname(sys.modules[KalosClient.__module__].__file__ or "")))


def _results(q: Any, ps: list[Any], end: float) -> list[Any]:
    """One result from each of the processes ``ps``, from ``q``; a process that exits with an
    error before reporting (an import error, no sidecar) fails the run at once, not at the end
    of a long timeout (monotonic ``end``)."""
    got: list[Any] = []
    while len(got) < len(ps):
        try:
            got.append(q.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        failed = sorted({p.exitcode for p in ps if p.exitcode not in (None, 0)})
        if failed:
            raise RuntimeError(f"a client process exited with {failed} before reporting ({len(got)} of "
                               f"{len(ps)} reported): see its traceback above")  # fmt: skip
        if time.monotonic() > end:
            raise TimeoutError(f"{len(ps) - len(got)} of {len(ps)} client processes did not report in time")
    return got


def throughput(name: str, dim: int, k: int, procs: int, duration: float,
               arena_docs: bool | None = None, client_path: str | None = None) -> dict[str, float]:  # fmt: skip
    """``procs`` client processes issuing batch-1 recalls back to back for ``duration`` s
    (``arena_docs``: the clients' setting, see :class:`KalosClient`).

    ``client_path``: a directory holding an installed ``kalos_retrievers`` (``pip install
    --no-deps --target DIR``) that the client processes import instead of this process's own,
    so that two client libraries can be compared against one sidecar. A spawned process takes
    its parent's ``sys.path`` at its start (``PYTHONPATH`` would not reach it), so the
    directory is put first on this process's path while they start, and taken off after.
    Everything the workers import comes from there: this function's ``_throughput_worker``
    (which must take the same arguments) and the main script's own imports, which a spawned
    process runs again.

    Besides the latencies and the rate: where the kernel keeps per-thread schedstat (Linux),
    the clients' CPU time per recall (``client_cpu_us_per_recall``: their Python, their spins,
    their system calls), how many cores that kept busy (``client_cores``), and how long per
    recall they waited runnable for a core (``client_runqueue_us_per_recall``): with more
    client processes than cores, whether the clients' side is what holds the rate. And the
    directory the clients' library was imported from (``client_package``)."""
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    start_at = time.time() + 3.0 + 0.1 * procs
    ps = [ctx.Process(target=_throughput_worker, args=(name, dim, k, 1000 + i, duration, start_at, q, arena_docs))
          for i in range(procs)]  # fmt: skip
    saved = list(sys.path)
    if client_path is not None:
        if not (Path(client_path) / "kalos_retrievers" / "client.py").is_file():
            raise ValueError(f"client_path={client_path!r} holds no installed kalos_retrievers")
        sys.path.insert(0, str(Path(client_path).resolve()))
    try:
        for p in ps:
            p.start()
    finally:
        sys.path[:] = saved
    got = _results(q, ps, time.monotonic() + (start_at - time.time()) + duration + 120)
    for p in ps:
        p.join(30)
    allv = np.concatenate([g[0] for g in got])
    res = percentiles(allv)
    res["procs"] = procs
    res["recalls_per_s"] = round(len(allv) / duration, 1)
    scheds = [g[1] for g in got]
    # where the clients' library came from (a worker of an older package reports nothing)
    pkgs = sorted({g[2] for g in got if len(g) > 2})
    if pkgs:
        res["client_package"] = pkgs[0] if len(pkgs) == 1 else pkgs  # type: ignore[assignment]
    if len(allv) and all(sc is not None for sc in scheds):
        cpu, runq = (sum(sc[j] for sc in scheds) for j in (0, 1))  # type: ignore[index]
        res["client_cpu_us_per_recall"] = round(cpu / len(allv) / 1000, 2)
        res["client_runqueue_us_per_recall"] = round(runq / len(allv) / 1000, 2)
        res["client_cores"] = round(cpu / 1e9 / duration, 2)
    return res


def numpy_recall(data: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """In-process numpy: scores = M @ q, argpartition, sort the k (what a user would write)."""
    s = data @ q
    top = np.argpartition(-s, k)[:k]
    return top[np.argsort(-s[top])]


def numpy_baseline(data: np.ndarray, queries: np.ndarray, k: int, calls: int, warmup: int) -> dict[str, float]:
    return time_calls(lambda i: numpy_recall(data, queries[i % len(queries)], k), calls, warmup)


def paired(fa: Callable[[int], Any], fb: Callable[[int], Any], calls: int, warmup: int) -> dict[str, float]:
    """Alternate ``fa(i)`` and ``fb(i)`` and return the percentiles of the per-pair differences
    (a - b), so that drift on a shared machine affects both sides of each pair alike."""
    for i in range(warmup):
        fa(i)
        fb(i)
    a = np.empty(calls)
    b = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fa(i)
        t1 = time.perf_counter_ns()
        fb(i)
        t2 = time.perf_counter_ns()
        a[i], b[i] = (t1 - t0) / 1000, (t2 - t1) / 1000
    d = a - b
    out = percentiles(d)
    out["iqr_us"] = round(float(np.percentile(d, 75) - np.percentile(d, 25)), 2)
    # Each side's own median: waiting that slows the other side (a process spinning on a core
    # the other one needs) shows here, not in the differences.
    out["a_p50_us"] = round(float(np.median(a)), 2)
    out["b_p50_us"] = round(float(np.median(b)), 2)
    return out


def blocked(fa: Callable[[int], Any], fb: Callable[[int], Any], rounds: int, block: int,
            settle_s: float = 0.25) -> dict[str, float]:  # fmt: skip
    """Alternate *blocks* of ``block`` calls of ``fa`` and of ``fb`` for ``rounds`` rounds; per
    round, the difference of the two blocks' medians (a - b). Returns their mean, its standard
    error, and the spread.

    Why blocks and not call-by-call pairs: alternating single calls keeps both processes' math
    libraries busy at once. With a multi-threaded BLAS each side's thread pool is still
    spinning (OpenBLAS workers spin for a while after each product) when the other side's
    product starts: measured on a 16-core host, numpy's own p50 went from 1.19 ms alone to
    4.0 ms in the call-by-call alternation, so the paired difference mostly measured two
    thread pools fighting. Blocks let each side run as it would in an application that uses
    it, while rounds still spread drift over both sides. Before each block the benchmark
    sleeps ``settle_s`` (0.25 s since session 7; before, it only made ``block // 10`` warm-up
    calls, ~20 ms, while the other side's workers were still spinning).
    """
    diffs, a_med, b_med = [], [], []
    for r in range(rounds):
        order = (fa, fb) if r % 2 == 0 else (fb, fa)  # neither side always goes first
        meds = {}
        for fn in order:
            # settle: the other side's BLAS workers spin for ~0.1 s after its last product
            # (OpenBLAS's default thread timeout) on cores this side's product wants; wait
            # them out, then warm this side up
            time.sleep(settle_s)
            for i in range(block // 10):
                fn(i)
            t = np.empty(block)
            for i in range(block):
                t0 = time.perf_counter_ns()
                fn(r * block + i)
                t[i] = (time.perf_counter_ns() - t0) / 1000
            meds[fn] = float(np.median(t))
        a_med.append(meds[fa])
        b_med.append(meds[fb])
        diffs.append(meds[fa] - meds[fb])
    d = np.array(diffs)
    return {
        "rounds": rounds, "block": block,
        "mean_us": round(float(d.mean()), 2),
        "stderr_us": round(float(d.std(ddof=1) / np.sqrt(len(d))), 2) if len(d) > 1 else 0.0,
        "median_us": round(float(np.median(d)), 2),
        "a_p50_us": round(float(np.median(a_med)), 2),
        "b_p50_us": round(float(np.median(b_med)), 2),
    }  # fmt: skip


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def table(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("figure", "target", "measured", "pass")
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|", *map(line, rows)])


# ------------------------------------------------------------------------------ main
def run(args: argparse.Namespace) -> int:
    from kalos_retrievers.spawn import Sidecar

    if args.k > min(args.rows, 1024):
        print(f"kalos-sidecar bench: error: --k {args.k} must be at most --rows ({args.rows}) and 1024",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"bench: {args.rows} x {args.dim} rows on {args.device}; {machine()}", file=sys.stderr)
    data = make_data(args.rows, args.dim, args.seed)
    queries = make_data(1024, args.dim, args.seed + 1)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "rows": args.rows,
        "dim": args.dim, "k": args.k, "device": args.device, "sidecar_threads": args.threads,
        "command": " ".join(sys.argv),
    }  # fmt: skip
    with Sidecar(dim=args.dim, device=args.device, dtype=args.dtype, slots=max(16, args.procs + 4),
                 payload_kb=4096, threads=args.threads, log_level="WARNING") as sc:  # fmt: skip
        with sc.client(timeout=30) as c:
            results["load_s"] = round(load(c, data), 2)
            results["backend"] = c.header.backend
            results["kalos"] = time_calls(lambda i: c.recall(queries[i & 1023], args.k),
                                          args.calls, args.warmup)  # fmt: skip
            results["kalos_ping"] = time_calls(lambda i: c.ping(), args.calls, args.warmup)
            kalos_fn = lambda i: c.recall(queries[i & 1023], args.k)  # noqa: E731
            numpy_fn = lambda i: numpy_recall(data, queries[i & 1023], args.k)  # noqa: E731
            results["added_over_numpy"] = blocked(kalos_fn, numpy_fn, args.rounds, args.block)
            results["added_over_numpy_paired"] = paired(kalos_fn, numpy_fn, min(args.calls, 2000), 50)
            st = c.stats()  # where the sidecar's time went, over all the recalls above
            results["sidecar"] = {"recall": st["latency"].get("recall"), "phases": st.get("phases")}
        results["numpy"] = numpy_baseline(data, queries, args.k, min(args.calls, 2000), 50)
        if args.procs:
            results["throughput"] = throughput(sc.name, args.dim, args.k, args.procs, args.duration)
    kp, npy, add = results["kalos"], results["numpy"], results["added_over_numpy"]
    pair = results["added_over_numpy_paired"]
    added = add["mean_us"]
    rows = [
        ("Kalos recall p50 / p99 / p99.9 (us)", "", f"{kp['p50_us']} / {kp['p99_us']} / {kp['p999_us']}", ""),
        ("numpy M@q + argpartition p50 (us)", "", f"{npy['p50_us']}", ""),
        (f"sidecar added over numpy: blocks of {add['block']}, {add['rounds']} rounds, mean of "
         "per-round median differences (us)", "<= 50 at 100k x 384",
         f"{added:.1f} ± {add['stderr_us']}", "yes" if added <= 50 else "no"),
        ("  the same, call-by-call alternation: median of paired differences (us)", "",
         f"{pair['p50_us']:.1f} (IQR {pair['iqr_us']})", ""),
        ("ping round trip p50 (us)", "", f"{results['kalos_ping']['p50_us']}", ""),
    ]  # fmt: skip
    if "throughput" in results:
        t = results["throughput"]
        rows.append((f"throughput, {t['procs']} procs (recalls/s), p99 (us)", "",
                     f"{t['recalls_per_s']}, {t['p99_us']}", ""))  # fmt: skip
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0

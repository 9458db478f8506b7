"""Where a batch-1 recall's time goes between the client library and a resident kernel.

    python -P benchmarks/client_phases.py --rows 100000 [--dtype float16|int8] [--slots 40]
        [--sidecar-path DIR] [--rounds 4] [--calls 2000] --out DIR

One GPU sidecar (768-d, cosine, the resident kernel on; with ``--sidecar-path`` its process
imports the package installed under DIR, as in ``ab_sidecars.py``), loaded with random unit
rows; random unit queries (``gpu_recall.py``'s). Each of ``--rounds`` rounds times, in turn:

* ``client``: ``KalosClient.recall(q, 10)`` per call, as ``gpu_recall.py`` times it (through
  the C path, ``kalos_retrievers._fastpath``, where it is built: ``fastpath`` in the JSON);
* ``client_python``: the same through the client's Python path (None without the C path);
* ``wait``: the same with each call's wait recorded (``wait_p50_us``: from the request written
  to the answer seen; the call's p50 minus it is roughly the library's own Python), through
  the path without ``_fastpath.bell1`` (session 43), whose steps are Python methods to record;
* ``no_gc``: ``client`` with the cyclic garbage collector off;
* ``parts``: ``client`` with its parts timed (see :func:`with_parts`), bell1 set aside too;
* ``bare``: the doorbell exchange alone, from this process, through a slot of the client's
  connection: the query and the request words written, DOORBELL set, the state word polled
  until RESPONSE, the ten rows read; what ``doorbell_probe.py`` times in process, here against
  the real sidecar and its segment.

``bare`` against ``doorbell_probe.py``'s round trip (same rows, same slot count) says what the
sidecar's process and segment add to the exchange; ``client`` against ``bare``, what the
client library adds. Per-round percentiles and their medians go to ``DIR/client_phases.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from kalos_retrievers.sidecar.bench import load, machine, make_data, percentiles, time_calls

import kalos_retrievers.client as client_module
from kalos_retrievers import KalosClient, Sidecar, _ipc
from kalos_retrievers.protocol import REQUEST_OFFSET, REQUEST_STRUCT, Op, SlotState

DIM, K = 768, 10


def start(path: str | None, device: str, dtype: str, slots: int) -> Sidecar:
    """A GPU sidecar, its process importing the package under ``path`` when given."""
    saved = os.environ.get("PYTHONPATH")
    if path:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(path).resolve()), saved) if p)
    try:
        sc = Sidecar(dim=DIM, device=device, dtype=dtype if device != "cpu" else None, slots=slots, max_batch=64,
                     payload_kb=8192, log_level="WARNING", startup_timeout=300).start()  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return sc


def bare_calls(c: KalosClient, queries: np.ndarray, calls: int, warmup: int) -> dict[str, Any] | None:
    """The doorbell exchange through one of ``c``'s slots, with none of the library around it
    (None: no resident kernel is running). A request the kernel hands back to the sidecar (it
    sets REQUEST) is answered by the sidecar and counted in ``handed_back``."""
    c.ping()  # connected
    conn = c._conn
    if conn is None or conn.doorbell_k() < K:
        return None
    slot = conn.free.pop()
    state, payload = slot.state, slot.payload_f32
    done = (SlotState.RESPONSE, SlotState.ERROR)
    flags = conn.arena_flags
    out = np.empty(calls, np.float64)
    errors = handed_back = 0
    try:
        for i in range(warmup + calls):
            q = queries[i & 1023]
            t0 = time.perf_counter_ns()
            payload[:DIM] = q
            slot.seq = (slot.seq + 1) & 0xFFFFFFFFFFFFFFFF
            REQUEST_STRUCT.pack_into(slot.ctl, REQUEST_OFFSET, slot.seq, Op.RECALL, flags, K, 1, 4 * DIM, 0,
                                     int((time.monotonic() + 10) * 1e9))  # fmt: skip
            state[0] = SlotState.DOORBELL
            end = time.monotonic_ns() + 10_000_000_000
            while state[0] not in done:
                if state[0] == SlotState.REQUEST:
                    handed_back += 1
                    _ipc.post(conn.bell)
                    while state[0] == SlotState.REQUEST:
                        pass
                if time.monotonic_ns() > end:
                    raise RuntimeError(f"no answer in 10 s (state {int(state[0])})")
            rows = slot.rows[:K].copy()
            t1 = time.perf_counter_ns()
            errors += int(state[0] != SlotState.RESPONSE or rows[0] < 0)
            state[0] = SlotState.CLAIMED
            if slot.sem.value:  # a request handed back to the sidecar posts it
                slot.sem.acquire(0)
            if i >= warmup:
                out[i - warmup] = (t1 - t0) / 1000
    finally:
        c._release(conn, slot)
    return {**percentiles(out), "errors": errors, "handed_back": handed_back}


def without_bell1(fn: Any) -> Any:
    """``fn(c, ...)`` with ``_fastpath.bell1`` set aside (``client._BELL1`` False and no plan):
    bell1 makes the whole call in C, so its wait and its parts cannot be recorded from Python."""

    def run(c: KalosClient, *a: Any) -> Any:
        saved, client_module._BELL1 = client_module._BELL1, False
        c._bell = None
        try:
            return fn(c, *a)
        finally:
            client_module._BELL1 = saved
            c._bell = None  # (made again by the next recall)

    return run


@without_bell1
def with_waits(c: KalosClient, queries: np.ndarray, calls: int, warmup: int) -> dict[str, Any]:
    """``client`` plus ``wait_p50_us``: each call's wait for its answer, as the client measures
    it for its own use (``_observe_wait``: from the request written to the answer seen; the C
    path measures it in C)."""
    waits: list[int] = []
    inner = c._observe_wait

    def observed(waited_ns: int) -> None:
        waits.append(waited_ns)
        inner(waited_ns)

    c._observe_wait = observed  # type: ignore[method-assign]
    try:
        out = time_calls(lambda i: c.recall(queries[i & 1023], K), calls, warmup)
    finally:
        del c._observe_wait
    out["wait_p50_us"] = round(float(np.median(waits[warmup:])) / 1000, 2) if len(waits) > warmup else None
    return out


@without_bell1
def with_parts(c: KalosClient, queries: np.ndarray, calls: int, warmup: int) -> dict[str, Any]:
    """The call timed with its parts: the client's methods on the batch-1 path (``_arena``;
    ``_recall_fast``, the C path's exchange, or ``_roundtrip`` and, inside it, ``_wait``;
    ``_release``; ``_split_one`` and, inside it, ``ArenaView.entry_docs``, where Python reads
    the answer) each wrapped in a timer (which adds ~0.2-0.4 µs per part to the call). p50 of
    each part per call; ``rest``: the call minus its top-level parts (the checks of the query
    and k, the deadline, the slot taken, the query copied into it on the Python path)."""
    from kalos_retrievers.arena import ArenaView

    log: list[tuple[str, int]] = []

    def timer(name: str, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                log.append((name, time.perf_counter_ns() - t0))

        return timed

    names = ("_arena", "_recall_fast", "_roundtrip", "_wait", "_release", "_split_one")
    for n in names:
        setattr(c, n, timer(n, getattr(c, n)))
    entry_docs = ArenaView.entry_docs
    ArenaView.entry_docs = timer("entry_docs", entry_docs)  # type: ignore[method-assign]
    per: dict[str, list[int]] = {n: [] for n in (*names, "entry_docs", "call", "rest")}
    try:
        for i in range(warmup + calls):
            log.clear()
            t0 = time.perf_counter_ns()
            c.recall(queries[i & 1023], K)
            total = time.perf_counter_ns() - t0
            if i < warmup:
                continue
            sums = dict.fromkeys(per, 0)
            for n, dt in log:
                sums[n] += dt
            sums["call"] = total
            exchange = sums["_recall_fast"] or sums["_roundtrip"]  # (the C path's fallback: inside)
            sums["rest"] = total - exchange - sum(sums[n] for n in ("_arena", "_release", "_split_one"))
            for n, v in sums.items():
                per[n].append(v)
    finally:
        ArenaView.entry_docs = entry_docs  # type: ignore[method-assign]
        for n in names:
            delattr(c, n)
    return {n: round(float(np.median(v)) / 1000, 2) for n, v in per.items()}


def python_path(c: KalosClient, queries: np.ndarray, calls: int, warmup: int) -> dict[str, Any] | None:
    """``client`` through the client's Python path (``_fastpath`` set aside), or None when the
    C path is not there to set aside (then ``client`` is the Python path)."""
    if client_module._fastpath is None:
        return None
    saved, client_module._fastpath = client_module._fastpath, None
    c._bell = None  # (bell1's plan holds the C call itself: without this the "Python path" is bell1)
    try:
        return time_calls(lambda i: c.recall(queries[i & 1023], K), calls, warmup)
    finally:
        client_module._fastpath = saved


def without_gc(c: KalosClient, queries: np.ndarray, calls: int, warmup: int) -> dict[str, Any]:
    """``client`` with Python's cyclic garbage collector off while it runs."""
    gc.disable()
    try:
        return time_calls(lambda i: c.recall(queries[i & 1023], K), calls, warmup)
    finally:
        gc.enable()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dtype", default="float16", choices=("float16", "int8"))
    ap.add_argument("--slots", type=int, default=40)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no bare exchange)")
    ap.add_argument("--sidecar-path", default=None, help="directory holding the sidecar's package")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    queries = make_data(1024, DIM, 7)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                           "fastpath": client_module._fastpath is not None,
                           "command": " ".join([sys.executable, *sys.argv]), "rows": a.rows, "dtype": a.dtype,
                           "slots": a.slots, "sidecar_path": a.sidecar_path, "rounds": []}  # fmt: skip
    with start(a.sidecar_path, a.device, a.dtype, a.slots) as sc, sc.client(timeout=60) as c:
        load(c, make_data(a.rows, DIM, 1), progress=False)
        c.recall(queries[0], K)
        for r in range(a.rounds):
            rnd = {"client": time_calls(lambda i: c.recall(queries[i & 1023], K), a.calls, 200),
                   "client_python": python_path(c, queries, a.calls, 200),
                   "wait": with_waits(c, queries, a.calls, 200),
                   "bare": bare_calls(c, queries, a.calls, 200),
                   "no_gc": without_gc(c, queries, a.calls, 200),
                   "parts": with_parts(c, queries, a.calls, 200)}  # fmt: skip
            print(json.dumps({"round": r, **rnd}), flush=True)
            res["rounds"].append(rnd)
        st = c.stats()
        res["doorbell_served"] = st.get("index", {}).get("doorbell_served")
    def med(part: str, key: str) -> float | None:
        xs = [x[part][key] for x in res["rounds"] if x[part] is not None and x[part][key] is not None]
        return round(float(np.median(xs)), 2) if xs else None

    res["median"] = {"client_p50_us": med("client", "p50_us"), "client_p99_us": med("client", "p99_us"),
                     "client_python_p50_us": med("client_python", "p50_us"),
                     "client_python_p99_us": med("client_python", "p99_us"),
                     "wait_call_p50_us": med("wait", "p50_us"), "wait_p50_us": med("wait", "wait_p50_us"),
                     "bare_p50_us": med("bare", "p50_us"), "bare_p99_us": med("bare", "p99_us"),
                     "no_gc_p50_us": med("no_gc", "p50_us"),
                     "parts_p50_us": {n: med("parts", n) for n in res["rounds"][0]["parts"]}}  # fmt: skip
    print(json.dumps(res["median"]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "client_phases.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

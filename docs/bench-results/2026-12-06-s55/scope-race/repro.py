"""Reproduce benchmarks/scoped_recall.py's round-0 pattern without a GPU.

The real Server + Dispatcher + serve loop run on a CPU index (in this process, loop in a
thread). The index is made to look like the GPU one with a resident kernel serving 8 scopes
with filters (doorbell_k 16, doorbell_spaces 8, doorbell_args 128): resume_doorbell writes
the scope table (args of Service.bell_spaces(), the first 8) into shared memory and starts a
"kernel" process (emulator) that answers DOORBELL slots whose args are empty or in the table
(an empty answer, 0 hits) and hands every other one back (state REQUEST), as kernels/recall.cu
does; pause_doorbell stops it (after the request in hand) and publishes doorbell_k 0 first.
A client process runs the benchmark's sequence: load, one check recall per case, then
--rounds rounds of the 6 cases, each 200+N back-to-back recalls; prints per case how many the
emulated kernel answered, and the dispatcher's learns/declines.

usage (from the repository's root, KALOS_BELL_REARM_MS=0: on a loaded 2-core machine the 1 ms
start on idle otherwise starts the kernel first and hides the race):
    KALOS_BELL_REARM_MS=0 python -P docs/bench-results/2026-12-06-s55/scope-race/repro.py
        [--calls 2000] [--rounds 2] [--rows 3000] [--patch none|nofix]
``--patch nofix``: the negative control, the header's "runs" before the lone scoped answer
switched off (Dispatcher._starts_after always False; the server's side of 251b765 kept: a
DOORBELL waiting does not put a start off).
Written by session 55's review helper (there with the fix as a monkeypatch, since made).
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "tests"))
sys.path.insert(0, HERE)

DIM = 16
CASES = {
    "default": {},
    "namespace": {"namespace": "scoped"},
    "namespace+filter": {"namespace": "scoped", "filter": {"user": 1}},
    "filter": {"filter": {"user": 1}},
    "namespace+1% filter": {"namespace": "scoped", "filter": {"tenant": 7}},
    "small namespace": {"namespace": "small"},
}


def kernel_proc(name, run, state, table, tlens, ntab, served, handed, quit_) -> None:
    from kalos_retrievers import KalosClient
    from kalos_retrievers.protocol import RESPONSE_OFFSET, RESPONSE_STRUCT, RespFlag, SlotState, Status, align8

    with KalosClient(name, arena_docs=True) as own:
        own.ping()
        conn = own._conn
        lay = conn.layout
        mm = conn.seg.mm
        states = np.ndarray((lay.n_slots,), "<u4", mm, lay.slot_offset(0), (lay.slot_size,))
        while not quit_.value:
            state.value = 1
            if not run.value:
                state.value = 0
                time.sleep(0.00005)
                continue
            ready = np.flatnonzero(states == SlotState.DOORBELL).tolist()
            if not ready:
                continue
            if len(ready) > 1:  # a crowd: all back to the sidecar
                for i in ready:
                    states[i] = SlotState.REQUEST
                    handed.value += 1
                continue
            i = ready[0]
            off = lay.slot_offset(i)
            args_len = int(np.frombuffer(mm, "<u8", 1, off + 40)[0])
            at = off + lay.payload_offset + align8(4 * DIM)
            args = bytes(mm[at : at + args_len])
            tab = {bytes(table[j * 128 : j * 128 + tlens[j]]) for j in range(ntab.value)}
            if args_len and args not in tab:
                states[i] = SlotState.REQUEST  # handed back
                handed.value += 1
                continue
            states[i] = SlotState.BUSY
            seq = int(np.frombuffer(mm, "<u8", 1, off + 8)[0])
            arena = conn.arena()
            blob = arena.version.to_bytes(8, "little")
            mm[off + lay.blob_offset : off + lay.blob_offset + len(blob)] = blob
            RESPONSE_STRUCT.pack_into(mm, off + RESPONSE_OFFSET, seq, Status.OK, 0, len(blob),
                                      RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES)
            states[i] = SlotState.RESPONSE
            served.value += 1
        state.value = 0  # (gone: the sidecar's pause at its stop must not wait for it)


def client_proc(name, rows, calls, rounds, served, out) -> None:
    from kalos_retrievers import KalosClient

    rng = np.random.default_rng(1)
    qs = rng.standard_normal((1024, DIM)).astype(np.float32)
    with KalosClient(name, arena_docs=True) as c:
        for ns, n in (("", rows), ("scoped", rows), ("small", max(rows // 100, 10))):
            c.upsert([str(i) for i in range(n)], rng.standard_normal((n, DIM)).astype(np.float32),
                     metadatas=[{"user": i % 2, "tenant": i % 100} for i in range(n)], namespace=ns)
        for kw in CASES.values():  # the benchmark's check phase: one recall each
            c.recall(qs[0], 10, **kw)
        for r in range(rounds):
            line = []
            for name_, kw in CASES.items():
                before = served.value
                t0 = time.perf_counter()
                for i in range(200 + calls):
                    c.recall(qs[i & 1023], 10, **kw)
                dt = time.perf_counter() - t0
                c.stats()
                line.append(f"{served.value - before}/{200 + calls}")
                print(f"round {r} {name_:20s} kernel answered {served.value - before:5d} of {200 + calls}"
                      f"  ({1e6 * dt / (200 + calls):.0f} us/call)", flush=True)
            out.append(" ".join(line))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--patch", default="none")
    a = p.parse_args()
    os.environ["KALOS_ARENA"] = "1"
    from conftest import unique_name
    from kalos_retrievers.sidecar import dispatcher as dmod
    from kalos_retrievers.sidecar.server import ServeConfig, Server
    declines_log: list[tuple[int, bool]] = []
    orig_declined = dmod.Dispatcher._kernel_declined

    def logged(self, base):
        from kalos_retrievers.protocol import SlotState
        ii = np.flatnonzero(self.states == SlotState.REQUEST).tolist()
        served_scope = None
        if len(ii) == 1:
            words = dmod.REQUEST_STRUCT.unpack_from(self.mm, self.slot_off[ii[0]] + dmod.REQUEST_OFFSET)
            req = dmod.Request._make(words)
            served_scope = self._args(ii[0], req) in self.service.index.bell_served_spaces
        declines_log.append((self.kernel_answers(), self._lone_need, served_scope,
                             round((time.monotonic() - starts[-1][0]) * 1e6)))
        return orig_declined(self, base)

    dmod.Dispatcher._kernel_declined = logged
    if a.patch == "nofix":
        import nofix_patch  # noqa: F401

    ctx = mp.get_context("spawn")
    run, state, quit_ = ctx.RawValue(ctypes.c_int, 0), ctx.RawValue(ctypes.c_int, 0), ctx.RawValue(ctypes.c_int, 0)
    table, tlens = ctx.RawArray(ctypes.c_char, 8 * 128), ctx.RawArray(ctypes.c_int, 8)
    ntab = ctx.RawValue(ctypes.c_int, 0)
    served, handed = ctx.RawValue(ctypes.c_long, 0), ctx.RawValue(ctypes.c_long, 0)
    cfg = ServeConfig(name=unique_name("r55"), dim=DIM, metric="ip", device="cpu", slots=4)
    srv = Server(cfg)
    srv.start()
    idx = srv.service.index
    starts: list[tuple[float, tuple[bytes, ...]]] = []
    set_rows = idx.set_rows

    def resume(high, ns, spaces=(), touched=None) -> None:
        names = tuple(sc.args for sc in spaces if sc.args and len(sc.args) <= 128)[:8]
        for j, n in enumerate(names):
            table[j * 128 : j * 128 + len(n)] = n
            tlens[j] = len(n)
        ntab.value = len(names)
        starts.append((time.monotonic(), names))
        idx.doorbell_running = True
        idx.bell_served_spaces = names
        srv._publish_doorbell()
        run.value = 1

    def pause() -> None:
        if not idx.doorbell_running:
            return
        srv._publish_doorbell(False)  # clients stop ringing first
        run.value = 0
        while state.value:
            pass
        idx.doorbell_running = False

    def write(*x):
        idx.pause_doorbell()
        set_rows(*x)

    idx.resume_doorbell, idx.pause_doorbell, idx.set_rows = resume, pause, write
    idx.doorbell_served = lambda: served.value
    idx.doorbell_k, idx.doorbell_spaces, idx.doorbell_args = 16, 8, 128
    idx.doorbell_running = False
    srv._publish_doorbell()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    kp = ctx.Process(target=kernel_proc, args=(cfg.name, run, state, table, tlens, ntab, served, handed, quit_))
    kp.start()
    mgr = ctx.Manager()
    out = mgr.list()
    cp = ctx.Process(target=client_proc, args=(cfg.name, a.rows, a.calls, a.rounds, served, out))
    cp.start()
    cp.join()
    quit_.value = 1
    run.value = 0
    kp.join(10)
    d = srv.dispatcher
    print("summary:", " | ".join(out))
    print(f"kernel starts {len(starts)}, learns {d.kernel_learns}, declines {d.kernel_declines}, "
          f"handed back {handed.value}")
    print("declines (kernel answers in run, back-off before, scope in table, us since start):", declines_log[:40])
    if os.environ.get("R55_STARTS"):
        from kalos_retrievers.protocol import decode_recall_args
        t0 = starts[0][0]
        for ts, names in starts:
            print(f"  start +{ts - t0:7.3f}s table={[decode_recall_args(n) for n in names]}")
    srv.stop()
    t.join(30)
    mgr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

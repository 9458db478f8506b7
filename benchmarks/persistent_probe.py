"""The floor of a persistent-kernel design on this machine (issue 3's next step).

    python -P benchmarks/persistent_probe.py [--rounds 20000]

A resident kernel (``doorbell_probe`` in kernels/recall.cu) spins on a doorbell word in
registered, mapped host memory and answers on another word; Python rings and busy-polls the
answer, as a client would. The median round trip is what a persistent kernel costs per request
on top of its scan, against a graph launch + stream synchronization (timed here too, for an
empty one-kernel graph). Prints one JSON line. A kernel that never sees the doorbell is released
after a deadline and reported, not left spinning.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time

import numpy as np


def main() -> None:
    import cupy as cp
    from kalos_retrievers.sidecar import cuda_kernels as kern

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20_000)
    ap.add_argument("--variants", action="store_true",
                    help="also the ping-pong beside 263 other blocks (returning, spinning, sleeping), "
                         "with a request's 12 words read per round, and the time to stop each")  # fmt: skip
    a = ap.parse_args()
    kern.compile_kernels(["doorbell_probe", "fault_kernel", "doorbell_probe_blocks"])
    mm = mmap.mmap(-1, 4096)
    words = np.frombuffer(mm, np.int32)
    bell, done = words[0:1], words[16:17]
    addr = words.ctypes.data
    cp.cuda.runtime.hostRegister(addr, 4096, 3)
    stream = cp.cuda.Stream(non_blocking=True)
    out: dict = {"rounds": a.rounds}
    with stream:
        kern.get_kernel("doorbell_probe")((1,), (32,), (np.uint64(addr), np.uint64(addr + 64), np.int32(a.rounds)))
    ts = []
    deadline = time.monotonic() + 60
    stuck = False
    for i in range(1, a.rounds + 1):
        t0 = time.perf_counter_ns()
        bell[0] = i
        while done[0] < i:
            if time.monotonic() > deadline:
                stuck = True
                break
        if stuck:
            bell[0] = a.rounds + 1  # release the kernel
            break
        ts.append(time.perf_counter_ns() - t0)
    out["stuck"] = stuck
    if stuck:  # the kernel may never see host writes: do not wait on it, leave (the context goes)
        print(json.dumps(out), flush=True)
        os._exit(1)
    stream.synchronize()
    if ts:
        t = np.array(ts[100:] or ts) / 1000
        out.update(doorbell_p50_us=round(float(np.median(t)), 2), doorbell_p99_us=round(float(np.percentile(t, 99)), 2))
    # the alternative it would replace: launch one (trivial) kernel in a graph and synchronize
    fk = kern.get_kernel("doorbell_probe")
    with stream:
        stream.begin_capture()
        fk((1,), (32,), (np.uint64(addr), np.uint64(addr + 64), np.int32(0)))
        g = stream.end_capture()
    ls = []
    for i in range(3000):
        t0 = time.perf_counter_ns()
        g.launch(stream)
        stream.synchronize()
        if i >= 100:
            ls.append(time.perf_counter_ns() - t0)
    out["graph_launch_sync_p50_us"] = round(float(np.median(ls)) / 1000, 2)
    if a.variants:
        out["variants"] = variants(cp, kern, words, addr, stream, min(a.rounds, 5000))
    cp.cuda.runtime.hostUnregister(addr)
    print(json.dumps(out))


LDCV, STWT, FENCE, SYS, SAME = 1, 2, 4, 8, 16  # BELL_* and PROBE_SAME_WORD in kernels/recall.cu


def variants(cp, kern, words: np.ndarray, addr: int, stream, rounds: int) -> list[dict]:  # type: ignore[no-untyped-def]
    """doorbell_topk saw requests ~80 us late and took ~14 ms to stop (docs/gpu-notes.md,
    session 4), where the one-block probe above answers in ~2 us. Each variant changes one
    thing toward doorbell_topk: the number of blocks and what the others do while they wait,
    the 12 request words block 0 reads per round, the answer written into the polled word
    itself (as the slot's state word), no system fence after it; and the candidate fixes: loads
    with ld.global.cv, stores with st.global.wt, ld/st.relaxed.sys, the fence. (Session 5's
    first run also had the GPU write on the stop word's line: no effect, 1.6 us, dropped.)"""
    k = kern.get_kernel("doorbell_probe_blocks")
    bell, done, stop = words[0:1], words[16:17], words[32:33]  # stop on its own 128-byte line
    req = addr + 2048  # 12 words standing for a request's control words
    with cp.cuda.Device():
        dev = cp.zeros(4, cp.uint32)
    res = []
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    for name, grid, block, mode, nwords, flags in [
        ("1 block", 1, 32, 0, 0, FENCE),
        ("1 block, no fence", 1, 32, 0, 0, 0),
        ("1 block, answer in the polled word", 1, 32, 0, 0, SAME | FENCE),
        ("1 block, answer in the polled word, no fence (S4)", 1, 32, 0, 0, SAME),
        ("  + ldcv", 1, 32, 0, 0, SAME | LDCV),
        ("  + ldcv + stwt + fence", 1, 32, 0, 0, SAME | LDCV | STWT | FENCE),
        ("  + relaxed.sys + fence", 1, 32, 0, 0, SAME | SYS | FENCE),
        ("2/SM, others spin on L2", 2 * sms, 32, 1, 0, FENCE),
        ("1 block, 12 request words", 1, 32, 0, 12, FENCE),
        ("  + ldcv", 1, 32, 0, 12, FENCE | LDCV),
        ("  + relaxed.sys", 1, 32, 0, 12, FENCE | SYS),
        ("as doorbell_topk in S4: 2/SM x 256, spin, 12 words, polled word, no fence", 2 * sms, 256, 1, 12, SAME),
        ("  + ldcv + stwt + fence", 2 * sms, 256, 1, 12, SAME | LDCV | STWT | FENCE),
        ("  + relaxed.sys + fence", 2 * sms, 256, 1, 12, SAME | SYS | FENCE),
    ]:
        bell[0] = done[0] = stop[0] = 0
        dev.fill(0)
        stream.synchronize()
        with stream:
            ptrs = [np.uint64(a) for a in (addr, addr + 64, addr + 128, req)]
            k((grid,), (block,), (*ptrs, np.int32(nwords), np.int32(rounds), np.int32(mode), np.int32(flags), dev))
        ts, deadline, stuck = [], time.monotonic() + 10, False
        for i in range(1, rounds + 1):
            t0 = time.perf_counter_ns()
            bell[0] = i
            if flags & SAME:
                while bell[0] != -i:
                    if time.monotonic() > deadline:
                        stuck = True
                        break
            else:
                while done[0] < i:
                    if time.monotonic() > deadline:
                        stuck = True
                        break
            if stuck:
                break
            ts.append(time.perf_counter_ns() - t0)
        time.sleep(0.002)
        t0 = time.perf_counter_ns()
        stop[0] = 1
        while not stream.done:
            if time.monotonic() > deadline + 10:
                break
        t_stop = (time.perf_counter_ns() - t0) / 1000
        t = np.array(ts[100:] or ts or [0]) / 1000
        r = {"variant": name, "p50_us": round(float(np.median(t)), 2), "p99_us": round(float(np.percentile(t, 99)), 2),
             "stop_us": round(t_stop, 1), "stuck": stuck, "stopped": bool(stream.done)}  # fmt: skip
        print(json.dumps(r), flush=True)
        res.append(r)
        if not stream.done:  # the kernel never saw the stop: nothing more can run on this context
            break
    return res


if __name__ == "__main__":
    main()

"""The client's batch-1 C path against a stand-in resident kernel: the library's own cost (issue 3).

    python -P benchmarks/fastpath_overhead.py [--calls 20000] [--rounds 3] [--out DIR]

On the H200 a 100k-row recall through ``KalosClient.recall`` took ~62.7 µs p50 where the bare
exchange with the same sidecar took ~57.2 (``client_phases.py``, S22-2): the library's ~5.5 µs
are host work before the request is written and after the answer is seen, and need no GPU to
measure. ``client_overhead.py`` measures the Python path with an instant responder; this
measures the C path (``kalos_retrievers._fastpath.recall1``), which is what a client uses when a
resident kernel runs.

A CPU sidecar (768-d, 1,000 rows with short texts, ``KALOS_ARENA=1``) answers one real recall
through the document arena; its answer (rows, scores, the hits' arena entries) is kept. The
header's ``doorbell_k`` word is then set, as a running resident kernel would, so the client
sends DOORBELL requests, which this CPU sidecar leaves alone; a responder process spins on the
slot's state word and answers each DOORBELL with the kept answer and the request's sequence
number. Timed, alternating in each round (p50 µs per call):

* ``recall``: ``KalosClient.recall(q, 10)``, the whole library (``_fastpath.bell1``: the
  whole call in C, session 43);
* ``recall_py``: the same with ``bell1`` set aside (``client._BELL1`` False): the Python
  around ``recall1``, as before session 43;
* ``recall1``: ``_fastpath.recall1`` called directly with the arguments ``_recall_fast`` builds;
* ``bare``: the exchange in a few lines of Python (the query and the request words written,
  DOORBELL set, the state word polled until RESPONSE, ten rows read), as
  ``client_phases.py``'s ``bare``.

``recall - bare`` is what the library costs beyond the exchange; ``recall_py - recall``, what
``bell1`` saves. The responder's own latency is in all three. The development VM has
two cores: the responder takes one, so run nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ["KALOS_ARENA"] = "1"  # the spawned sidecar keeps a document arena

from kalos_retrievers import KalosClient, _conn
from kalos_retrievers import client as client_module
from kalos_retrievers.protocol import (
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    RESPONSE_OFFSET,
    RESPONSE_STRUCT,
    Flag,
    Op,
    Response,
    SlotState,
)

DIM, ROWS, K = 768, 1000, 10


def respond(name: str, off: int, answer: str) -> None:
    """The responder (run in its own process): answer every DOORBELL in the slot at ``off``
    with the kept answer (a JSON file: the response words), until the parent exits."""
    from kalos_retrievers import _ipc
    from kalos_retrievers.protocol import segment_name

    a = json.loads(Path(answer).read_text())
    seg = _ipc.Segment.open(segment_name(name), name)
    mm = seg.mm
    state = memoryview(mm)[off : off + 4].cast("I")
    seq_at = off + REQUEST_OFFSET
    resp_at = off + RESPONSE_OFFSET
    status, n, rlen, rflags = a["status"], a["n_results"], a["resp_len"], a["resp_flags"]
    pack, unpack = RESPONSE_STRUCT.pack_into, struct.Struct("<Q").unpack_from
    doorbell, response = int(SlotState.DOORBELL), int(SlotState.RESPONSE)
    parent = os.getppid()
    polls = 0
    while True:
        while state[0] != doorbell:
            polls += 1
            if not polls & 0xFFFFF and os.getppid() != parent:
                return
        pack(mm, resp_at, unpack(mm, seq_at)[0], status, n, rlen, rflags)
        state[0] = response


def answered_in_c(c: KalosClient, q: np.ndarray) -> bool:
    """Whether ``c.recall(q)`` is answered by ``bell1`` whole (what ``recall`` times): neither
    :meth:`KalosClient._recall_one` (the path when bell1 declines) nor ``_bell_rest`` (an
    answer bell1 left to Python) is called."""
    calls = []
    for name in ("_recall_one", "_bell_rest"):
        real = getattr(c, name)
        setattr(c, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    try:
        got = c.recall(q, K)
    finally:
        del c._recall_one, c._bell_rest
    return not calls and len(got) == K


def p50_us(ts: list[int]) -> float:
    return round(statistics.median(ts) / 1000, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--respond", nargs=3, metavar=("NAME", "OFFSET", "ANSWER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.respond:
        respond(a.respond[0], int(a.respond[1]), a.respond[2])
        return
    if client_module._fastpath is None:
        sys.exit("the client's C path (kalos_retrievers._fastpath) is not built")
    rng = np.random.default_rng(0)
    v = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    with KalosClient.spawn(dim=DIM, device="cpu") as owner, KalosClient(owner.name, arena_docs=True) as c:
        owner.upsert([f"id{i}" for i in range(ROWS)], v, texts=[f"text {i} " * 5 for i in range(ROWS)])
        q = v[7].copy()
        first = c.recall(q, K)  # the Python path (no resident kernel yet): a real answer
        conn = c._conn
        slot = conn.free[-1]  # the slot that answered, and the one the next call takes
        resp = Response.unpack(slot.ctl)
        if not resp.resp_flags & Flag.ARENA_ENTRIES:
            sys.exit(f"the sidecar did not answer with arena entries (flags {resp.resp_flags:#x})")
        answer = Path(f"/tmp/kalos-fastpath-{os.getpid()}.json")
        answer.write_text(json.dumps(resp._asdict()))
        off = conn.layout.slot_offset(slot.index)
        responder = subprocess.Popen([sys.executable, "-P", __file__, "--respond", owner.name, str(off), str(answer)])
        try:
            conn._hdr32[_conn._DOORBELL_K_WORD] = 32  # "a resident kernel answers k <= 32"
            time.sleep(0.5)  # the responder is spinning
            got = c.recall(q, K)
            assert [h.id for h in got] == [h.id for h in first], "the stand-in's answer differs"
            if not answered_in_c(c, q):
                sys.exit("a recall did not go through the C path (recall1 did not return the answer)")
            results = run_rounds(c, conn, q, a.calls, a.rounds)
        finally:
            conn._hdr32[_conn._DOORBELL_K_WORD] = 0
            responder.kill()
            responder.wait()
            answer.unlink(missing_ok=True)
    med = {k: round(statistics.median(r[k] for r in results), 2) for k in results[0]}
    med["recall - bare"] = round(med["recall"] - med["bare"], 2)
    med["recall_py - recall"] = round(med["recall_py"] - med["recall"], 2)
    print(json.dumps({"rounds": results, "median": med}))
    if a.out:
        Path(a.out, "fastpath_overhead.json").write_text(json.dumps({"rounds": results, "median": med}, indent=1))


def run_rounds(c: KalosClient, conn: Any, q: np.ndarray, calls: int, rounds: int) -> list[dict[str, float]]:
    slot = conn.free[-1]
    fast = client_module._fastpath
    arena = c._arena()
    assert arena is not None
    buf, info = arena.fast
    mm = conn.seg.mm
    off = conn.layout.slot_offset(slot.index)
    state = slot.state
    payload = slot.payload_f32[:DIM]
    rows = slot.rows
    doorbell, response, claimed = SlotState.DOORBELL, SlotState.RESPONSE, SlotState.CLAIMED

    def recall() -> None:
        c.recall(q, K)

    def recall_py() -> None:  # (run with client._BELL1 False and no plan: see below)
        c.recall(q, K)

    def recall1() -> None:
        slot.seq = seq = (slot.seq + 1) & 0xFFFFFFFFFFFFFFFF
        deadline = int((time.monotonic() + 5) * 1e9)
        out = fast.recall1(slot.mem, q, conn.fast_layout, seq, K, deadline, 1_000_000, conn.hdr, buf, info)
        assert type(out) is tuple

    def bare() -> None:
        slot.seq = seq = (slot.seq + 1) & 0xFFFFFFFFFFFFFFFF
        payload[:] = q
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seq, Op.RECALL, conn.arena_flags, K, 1, 4 * DIM, 0, 0)
        state[0] = doorbell
        while state[0] != response:
            pass
        rows[:K].copy()
        state[0] = claimed

    out = []
    kinds = {"recall": recall, "recall_py": recall_py, "recall1": recall1, "bare": bare}
    for r in range(rounds):
        res: dict[str, float] = {}
        for name in kinds if r % 2 == 0 else reversed(list(kinds)):
            fn = kinds[name]
            client_module._BELL1 = name != "recall_py"
            c._bell = None  # (made again at the next recall, while _BELL1)
            for _ in range(calls // 10):
                fn()
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                fn()
                ts.append(time.perf_counter_ns() - t0)
            res[name] = p50_us(ts)
        out.append(res)
        print(json.dumps({"round": r, **res}), flush=True)
    return out


if __name__ == "__main__":
    main()

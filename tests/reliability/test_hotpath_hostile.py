"""The sidecar's C request path (``_hotpath.take``) against request words rewritten while it reads
them.

A forked process plays a hostile client: it rewrites its slot's request words without pause,
each round a valid batch-1 recall and then the same recall with one word made invalid (another
op, two queries, args, a bad length, k 0 or too large, unknown flags, ARENA_ENTRIES alone). The
sidecar side sets the state REQUEST and calls ``take`` over and over. Whatever mixture of the
two writes ``take`` happens to copy, it checks its copy and returns that copy, so every tuple it
returns is a request ``protocol.validate_request`` accepts and the batch-1 conditions hold; it
never crashes.

Run in a subprocess, so that a crash is a failed test. The scenario shows it exercises the race
by counting both outcomes (taken and left). Negative control: the same scenario against a take
written in Python that checks the slot's words and then reads them again to return them (the
bug the copy prevents) returns words that fail the check.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.reliability
pytest.importorskip("kalos_retrievers.sidecar._hotpath", reason="the C extension is not built here")

# Both scenarios: a forked writer that runs write_round(0), write_round(1), ... until killed.
FORK_WRITER = r'''
import os, signal

def fork_writer(write_round):
    pid = os.fork()
    if pid == 0:  # the writer, killed with its parent (a crashed parent must not leave it spinning)
        try:
            import ctypes
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:
                os._exit(0)
            i = 0
            while True:
                write_round(i)
                i += 1
        finally:
            os._exit(0)
    return pid
'''

SCENARIO = r'''
import json, mmap, os, signal, sys
import numpy as np
from kalos_retrievers.sidecar import _hotpath as hp
from kalos_retrievers.protocol import (REQUEST_OFFSET, REQUEST_STRUCT, Flag, Invalid, Layout, Op, Request,
                                       SlotState, validate_request)

DIM, CALLS, TWICE = 11, int(os.environ["CALLS"]), os.environ.get("TWICE") == "1"
lay = Layout(n_slots=1, dim=DIM, max_k=64, payload_size=1 << 12, blob_size=1 << 12)
mm = mmap.mmap(-1, lay.segment_size)  # shared with the forked writer
off = lay.slot_offset(0)
slot = memoryview(mm)[off : off + lay.slot_size]
state = slot.cast("I")
np.frombuffer(slot, np.float32, DIM, lay.payload_offset)[:] = 0.5
layout = (lay.dim, lay.payload_offset, lay.rows_offset, lay.scores_offset, lay.blob_offset, lay.blob_size,
          lay.max_k, lay.max_results)
good = Request(7, Op.RECALL, int(Flag.ARENA_DOCS), 10, 1, 4 * DIM, 0, 0)
bad = [good._replace(op=Op.UPSERT), good._replace(n_items=2), good._replace(args_len=8),
       good._replace(vec_len=4 * DIM + 4), good._replace(top_k=0), good._replace(top_k=65),
       good._replace(flags=16), good._replace(flags=int(Flag.ARENA_ENTRIES))]
packed = [REQUEST_STRUCT.pack(*good), *[REQUEST_STRUCT.pack(*b) for b in bad]]

def take_twice(view, layout):
    """The bug the C copy prevents: check the slot's words, then read them again to return."""
    req = Request._make(REQUEST_STRUCT.unpack_from(view, REQUEST_OFFSET))
    try:
        validate_request(req, lay)
    except Invalid:
        return None
    if req.n_items != 1 or req.args_len:
        return None
    return tuple(REQUEST_STRUCT.unpack_from(view, REQUEST_OFFSET))

take = take_twice if TWICE else hp.take
def write_round(i):
    slot[REQUEST_OFFSET : REQUEST_OFFSET + REQUEST_STRUCT.size] = packed[0]
    slot[REQUEST_OFFSET : REQUEST_OFFSET + REQUEST_STRUCT.size] = packed[1 + i % len(bad)]

pid = fork_writer(write_round)
got = {"taken": 0, "left": 0, "wrong": 0}
try:
    for _ in range(CALLS):
        state[0] = SlotState.REQUEST
        words = take(slot, layout)
        if words is None:
            got["left"] += 1
            continue
        got["taken"] += 1
        req = Request(*words)
        try:
            validate_request(req, lay)
            ok = req.op == Op.RECALL and req.n_items == 1 and req.args_len == 0 and req.vec_len == 4 * DIM
        except Invalid:
            ok = False
        got["wrong"] += not ok
finally:
    os.kill(pid, signal.SIGKILL)
print(json.dumps(got))
'''


def _run(scenario: str, calls: int, twice: bool) -> dict[str, int]:
    env = {"CALLS": str(calls), "PATH": "", "TWICE": "1" if twice else "0"}
    r = subprocess.run([sys.executable, "-P", "-c", FORK_WRITER + scenario], capture_output=True, text=True,
                       timeout=240, env=env)  # fmt: skip
    assert r.returncode == 0, f"the scenario ended with {r.returncode}: {r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _scenario(calls: int, twice: bool) -> dict[str, int]:
    return _run(SCENARIO, calls, twice)


def test_request_words_rewritten_while_taken_never_yield_an_invalid_request() -> None:
    calls = 200_000
    got = _scenario(calls, twice=False)
    assert got["wrong"] == 0, got
    assert got["taken"] + got["left"] == calls
    # both outcomes: the writer did rewrite the words while they were taken
    assert got["taken"] > 0 and got["left"] > 0, got


def test_the_scenario_catches_a_take_that_reads_the_words_twice() -> None:
    """The negative control: the same race against a take that checks, then reads again."""
    got = _scenario(200_000, twice=True)
    assert got["wrong"] > 0, got


# ------------------------------------------------------------------ answer1 over the slot's rows
ANSWER_SCENARIO = r'''
import json, mmap, os, signal, struct, sys
import numpy as np
from kalos_retrievers.sidecar import _hotpath as hp
from kalos_retrievers.arena import ArenaWriter
from kalos_retrievers.protocol import (RESPONSE_OFFSET, RESPONSE_STRUCT, Flag, Layout, SlotState,
                                       decode_docs_blob)

DIM, K, HIGH, CALLS, TWICE = 11, 10, 50, int(os.environ["CALLS"]), os.environ.get("TWICE") == "1"
ENTRIES = int(Flag.ARENA_DOCS | Flag.ARENA_ENTRIES)
lay = Layout(n_slots=1, dim=DIM, max_k=64, payload_size=1 << 12, blob_size=1 << 12)
mm = mmap.mmap(-1, lay.segment_size)  # shared with the forked writer
off = lay.slot_offset(0)
slot = memoryview(mm)[off : off + lay.slot_size]
state = slot.cast("I")
layout = (lay.dim, lay.payload_offset, lay.rows_offset, lay.scores_offset, lay.blob_offset, lay.blob_size,
          lay.max_k, lay.max_results)
rows = np.frombuffer(slot, np.int32, K, lay.rows_offset)  # the slot's own areas, as a batch's member
scores = np.frombuffer(slot, np.float32, K, lay.scores_offset)
bufs = {}
arena = ArenaWriter(lambda v, size: bufs.setdefault(v, bytearray(size)), bufs.pop, 64)
docs = [(b"document %d" % r) * (1 + r % 3) for r in range(HIGH)]
doc_set = set(docs)
for r, d in enumerate(docs):
    arena.put(r, d)
table = bytes(arena.table_bytes)
entries = {table[16 * r : 16 * r + 16] for r in range(HIGH)}  # (the slot's rows start as 0s: row 0's)
arena_arg = (arena.table_bytes, arena.rows_cap, arena.version)
good = np.arange(1, 1 + K, dtype=np.int32).tobytes()
bad = np.full(K, 2**31 - 1, np.int32).tobytes()  # far past the table and the documents

def answer_twice(slot, layout, seq, flags, rows, scores, high, docs, arena):
    """The bug the C copy prevents: check the slot's rows, then read them again to answer."""
    if not ((rows >= 0) & (rows < high)).all():
        return False
    blob = struct.pack("<Q", arena[2]) + b"".join(bytes(arena[0][16 * r : 16 * r + 16]) for r in rows.tolist())
    slot[lay.blob_offset : lay.blob_offset + len(blob)] = blob
    RESPONSE_STRUCT.pack_into(slot, RESPONSE_OFFSET, seq, 0, K, len(blob), 12)
    return True

answer1 = answer_twice if TWICE else hp.answer1
def write_round(i):
    slot[lay.rows_offset : lay.rows_offset + 4 * K] = good
    slot[lay.rows_offset : lay.rows_offset + 4 * K] = bad

pid = fork_writer(write_round)
got = {"answered": 0, "left": 0, "wrong": 0}
try:
    for n in range(CALLS):
        flags = ENTRIES if TWICE or n % 2 else 0
        state[0] = SlotState.BUSY
        if not answer1(slot, layout, n, flags, rows, scores, HIGH, docs, arena_arg):
            got["left"] += 1
            continue
        got["answered"] += 1
        resp = RESPONSE_STRUCT.unpack_from(slot, RESPONSE_OFFSET)
        blob = bytes(slot[lay.blob_offset : lay.blob_offset + resp[3]])
        if flags:  # the arena's version, then K entries of rows in range
            ok = len(blob) == 8 + 16 * K and blob[:8] == struct.pack("<Q", arena.version) and all(
                blob[8 + 16 * i : 24 + 16 * i] in entries for i in range(K))
        else:  # K documents inline, each a row's in range
            views, _ = decode_docs_blob(blob, DIM, False)
            ok = len(views) == K and all(bytes(v) in doc_set for v in views)
        got["wrong"] += not (ok and resp[:3] == (n, 0, K))
finally:
    os.kill(pid, signal.SIGKILL)
print(json.dumps(got))
'''


def _answer_scenario(calls: int, twice: bool) -> dict[str, int]:
    return _run(ANSWER_SCENARIO, calls, twice)


def test_rows_rewritten_in_the_slot_while_answered_never_yield_a_wrong_answer() -> None:
    """answer1 given the slot's own rows area (a batch's member: the device wrote its results
    there) while a forked client rewrites it, rows in range and then far out of range: each
    row is read once into answer1's copy and only the copy is checked and used, so every answer
    given names rows in range (their arena entries, or their documents inline), and nothing is
    read outside the table or the documents."""
    calls = 200_000
    got = _answer_scenario(calls, twice=False)
    assert got["wrong"] == 0, got
    assert got["answered"] + got["left"] == calls
    assert got["answered"] > 0 and got["left"] > 0, got  # the writer did rewrite the rows meanwhile


def test_the_scenario_catches_an_answer_that_reads_the_rows_twice() -> None:
    """The negative control: the same race against an answer that checks the slot's rows, then
    reads them again to name their entries."""
    got = _answer_scenario(200_000, twice=True)
    assert got["wrong"] > 0, got

"""The client's C path (``_fastpath.recall1``) against an answer rewritten while it is read.

A forked process plays a sidecar that answers each DOORBELL request with 32 valid arena entries
and then, until the client has taken the answer, rewrites the last entry's offset back and
forth between its real value and one 16 TiB past the arena. Whatever the C code reads, it
reads from memory it may read: the answer's words once, the entries from its own copy of the
blob. So each call returns that copy with the documents it names, or no documents when the copy
holds the bad offset, and never a document from anywhere else, nor a crash.

Run in a subprocess, so that a crash is a failed test. Negative control: this scenario against
the C code before the entries were parsed from the copy (6bddc6a's, built by hand) ended in
SIGSEGV (rc -11) in 3 of 3 runs. The scenario shows it exercises the race by counting both
outcomes (documents, and none for a copy holding the bad offset).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.reliability
pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")

SCENARIO = r'''
import json, mmap, os, signal, struct
import numpy as np
from kalos_retrievers import _fastpath as fp
from kalos_retrievers.arena import ArenaView, ArenaWriter
from kalos_retrievers.protocol import RESPONSE_OFFSET, RESPONSE_STRUCT, Flag, Layout, RespFlag, SlotState

DIM, K, CALLS = 8, 32, int(os.environ["CALLS"])
lay = Layout(n_slots=1, dim=DIM, max_k=64, payload_size=1 << 12, blob_size=1 << 12)
mm = mmap.mmap(-1, lay.segment_size)  # shared with the forked writer
off = lay.slot_offset(0)
slot = memoryview(mm)[off : off + lay.slot_size]
state = slot.cast("I")
state[0] = SlotState.CLAIMED
hdr = bytearray(64)
struct.pack_into("<I", hdr, 12, K)
segs = {}
def open_segment(v, size):
    segs[v] = bytearray(size)
    return segs[v]
aw = ArenaWriter(open_segment, segs.pop, 64, 4096)
for r in range(K):
    aw.put(r, b"doc%d" % r)
arena = ArenaView(aw.buf, aw.version)
flags = int(Flag.ARENA_DOCS | Flag.ARENA_ENTRIES)
layout = (DIM, lay.payload_offset, lay.rows_offset, lay.scores_offset, lay.blob_offset, lay.blob_size, flags, 3)
rows = list(range(K))
blob = aw.refs(rows, True)
last = 8 + 16 * (K - 1)
good, bad = blob[last : last + 8], struct.pack("<Q", 1 << 44)
at = lay.blob_offset + last
pid = os.fork()
if pid == 0:  # the writer, killed with its parent (a crashed parent must not leave it spinning)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(0)
        while True:
            while state[0] != SlotState.DOORBELL:
                pass
            seq = struct.unpack_from("<Q", slot, 8)[0]
            np.frombuffer(slot, np.int32, K, lay.rows_offset)[:] = rows
            slot[lay.blob_offset : lay.blob_offset + len(blob)] = blob
            RESPONSE_STRUCT.pack_into(slot, RESPONSE_OFFSET, seq, 0, K, len(blob),
                                      RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES)
            state[0] = SlotState.RESPONSE
            while state[0] == SlotState.RESPONSE:
                slot[at : at + 8] = bad
                slot[at : at + 8] = good
    finally:
        os._exit(0)
buf, info = arena.fast
q = np.ones(DIM, np.float32)
got = {"docs": 0, "none": 0, "wrong": 0}
try:
    for i in range(CALLS):
        out = fp.recall1(slot, q, layout, i + 1, K, 0, 10**9, hdr, buf, info)
        docs, copy = out[-1], out[-2]
        if docs is None:
            got["none"] += 1
            got["wrong"] += copy[last : last + 8] == good  # a good copy's documents are read
        else:
            got["docs"] += 1
            got["wrong"] += copy[last : last + 8] != good or docs != [b"doc%d" % r for r in rows]
finally:
    os.kill(pid, signal.SIGKILL)
print(json.dumps(got))
'''


def test_an_answer_rewritten_while_read_never_sends_a_read_outside_the_arena() -> None:
    calls = 20_000
    r = subprocess.run([sys.executable, "-P", "-c", SCENARIO], capture_output=True, text=True, timeout=240,
                       env={"CALLS": str(calls), "PATH": ""})  # fmt: skip
    assert r.returncode == 0, f"the scenario ended with {r.returncode}: {r.stderr[-2000:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["wrong"] == 0, got
    assert got["docs"] + got["none"] == calls
    # both outcomes: the writer did rewrite the entry while answers were read
    assert got["docs"] > 0 and got["none"] > 0, got

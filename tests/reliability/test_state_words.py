"""A slot's state word is never seen FREE while its request is in flight.

The sidecar wrote state words with ``struct.Struct("<I").pack_into``, which zeroes the field
before writing it: a client reading the word in between saw FREE (0), took the request for
answered, and reused the slot ("response sequence ... does not match"; a review counted 162,149
zeros in 7.9M reads). The dispatcher now stores them through its ``states`` view, one aligned
store; and the client takes FREE in an owned slot for a request in flight (an older sidecar).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time

import numpy as np
import pytest

from kalos_retrievers.protocol import SlotState

pytestmark = pytest.mark.timeout(60)


def _zeros_seen(write: str, seconds: float = 0.7) -> tuple[int, int]:
    """(reads, reads that saw 0) of a word another process sets to BUSY and REQUEST in turn,
    read as the client reads it (a memoryview cast to "I")."""
    mm = mmap.mmap(-1, 4096)
    state = memoryview(mm)[:8].cast("I")
    state[0] = SlotState.REQUEST
    pid = os.fork()
    if pid == 0:  # the sidecar
        try:
            end = time.monotonic() + seconds + 0.2
            if write == "struct":
                word = struct.Struct("<I")
                while time.monotonic() < end:
                    word.pack_into(mm, 0, SlotState.BUSY)
                    word.pack_into(mm, 0, SlotState.REQUEST)
            else:  # the dispatcher's way: its states view (one word per slot, strided)
                states = np.ndarray((1,), np.uint32, mm, 0, (4096,))
                while time.monotonic() < end:
                    states[0] = SlotState.BUSY
                    states[0] = SlotState.REQUEST
        finally:
            os._exit(0)
    reads = zeros = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for _ in range(1000):
                zeros += state[0] == 0
            reads += 1000
    finally:
        os.waitpid(pid, 0)
        del state
        mm.close()
    return reads, zeros


def test_the_dispatchers_state_store_is_never_seen_half_written() -> None:
    reads, zeros = _zeros_seen("numpy")
    assert reads > 100_000 and zeros == 0


def test_negative_control_struct_pack_into_is_seen_as_zero() -> None:
    reads, zeros = _zeros_seen("struct")
    assert zeros > 0, f"no zero in {reads} reads"


def test_the_client_keeps_a_slot_it_sees_free_out_of_circulation() -> None:
    """``_release`` of an owned slot whose word reads FREE marks it pending (waits for its
    answer) rather than putting it back on the free list."""
    from types import SimpleNamespace

    from kalos_retrievers.client import KalosClient

    client = KalosClient.__new__(KalosClient)
    client._lock = threading.Condition(threading.RLock())
    client._trim = None
    client._waiters = 0
    client._bell = None
    client._arm_trim = lambda after: None  # type: ignore[method-assign]
    for word, pending in ((SlotState.FREE, True), (SlotState.REQUEST, True), (SlotState.CLAIMED, False)):
        slot = SimpleNamespace(pending=0, seq=41, state=np.array([word], np.uint32))
        conn = SimpleNamespace(free=[], recover=False)
        client._release(conn, slot)  # type: ignore[arg-type]
        assert bool(slot.pending) is pending and (slot in conn.free) is not pending, word

"""The carousel's direct slots, the sidecar's side (protocol v1.4, ``KALOS_CAROUSEL=direct``).

The holders of protocol slots 0 .. n - 1 write their batch-1 recalls into carousel slots
0 .. n - 1 themselves while the header's ``carousel_epoch`` is odd, and read the kernel's
answer there (kalos_retrievers/client.py, ``_recall_direct``); docs/protocol.md has the whole
exchange. The sidecar owns three things of theirs, kept here:

* **the epoch** (:meth:`DirectSlots.publish`): a launch makes it the next odd value E (clients
  may write); a stop's beginning E + 1 (no new requests; answers still stand: the rows do not
  change while the kernel runs); the stop's end, the kernel stopped and its slots swept, E + 3
  (the rows may change now, and an answer sent under E read after this is dropped). Each phase
  is set from E, so a stop tried twice (the first one failed) cannot make the epoch odd.
* **the words a launch fixes** (:meth:`DirectSlots.launch`): every direct slot's namespace id
  (word 2, which the kernel reads) and the namespace's row count (word 7, which the client
  checks an answer's count against).
* **the slots' end** (:meth:`DirectSlots.sweep`): with the kernel stopped, a request no kernel
  will answer turned back to IDLE, so its client asks the usual way.

And :meth:`DirectSlots.active`, what the housekeeping's thinning rule counts. GpuIndex
(sidecar/index_gpu.py) and the tests' stand-in index (tests/carousel_fakes.py) both keep
their direct slots through this class, so the tests exercise the sidecar's own epoch logic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final

import numpy as np

from kalos_retrievers.protocol import W_ELIGIBLE, W_NS, W_SEQ, W_STATE

from .carousel import IDLE, REQUEST, TAKEN

_FENCE: Final = threading.Lock()  # taken and released once after each publication: a full fence


class DirectSlots:
    """Slots ``[0, n)`` of the carousel whose u32 ``words`` (one row per slot) are given, and the
    header's carousel epoch, which ``publish(epoch, n)`` writes (the server's
    ``_publish_carousel``; None: nothing to publish, as in unit tests)."""

    def __init__(self, words: np.ndarray, n: int, publish: Callable[[int, int], None] | None) -> None:
        if not 0 < n <= len(words):
            raise ValueError(f"{n} direct slots of {len(words)}")
        self.n = n
        self.words = words[:n]
        self.epoch = 0  # the header's carousel_epoch: odd while the kernel takes direct requests
        self._run = -1  # E, the epoch of the current (or last) launch
        self._seqs: np.ndarray | None = None  # the seq words at the last look (active)
        self._publish = publish

    def launch(self, ns: int, eligible: int) -> None:
        """Before a launch: the namespace id ``ns`` the kernel answers the direct slots from,
        and its row count ``eligible``, into every direct slot; the next :meth:`active` counts
        every slot (the first look since the launch)."""
        self.words[:, W_NS] = np.int32(ns).view(np.uint32)
        self.words[:, W_ELIGIBLE] = eligible
        self._seqs = None

    def publish(self, phase: int) -> int:
        """Move the epoch to ``phase``'s (1: a launch, the kernel running; 2: a stop begins; 3:
        the stop has ended and the slots are swept), write it to the header, then a full fence
        (a stop's loads of the slots' states must come after its store: x86-64 may otherwise
        let a load pass an earlier store). Returns the new epoch."""
        if phase == 1:
            self._run = self.epoch + (1 if self.epoch % 2 == 0 else 2)  # (the next odd value)
            self.epoch = self._run
        elif phase in (2, 3):
            self.epoch = self._run + (1 if phase == 2 else 3)
        else:
            raise ValueError(f"phase {phase} (1, 2 or 3)")
        if self._publish is not None:
            self._publish(self.epoch, self.n)
        with _FENCE:  # (a lock's acquire is a locked instruction: a full fence on x86-64)
            pass
        return self.epoch

    def active(self) -> int:
        """How many direct slots moved since the last look: a new request sent (its seq word
        changed) or one held (REQUEST or TAKEN). The first look after a launch counts every
        slot: a crowd is not judged thin before it had a chance to show itself."""
        seqs, st = self.words[:, W_SEQ].copy(), self.words[:, W_STATE]
        last, self._seqs = self._seqs, seqs
        if last is None:
            return self.n
        return int(((seqs != last) | (st == REQUEST) | (st == TAKEN)).sum())

    def sweep(self) -> int:
        """With the kernel stopped (the caller's to ensure): the requests no kernel will answer
        (sent after the stop's beginning, or abandoned aboard) turned back to IDLE; their
        clients ask again the usual way. Returns how many."""
        st = self.words[:, W_STATE]
        stuck = (st == REQUEST) | (st == TAKEN)
        n = int(stuck.sum())
        if n:
            st[stuck] = IDLE
        return n

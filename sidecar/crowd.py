"""The crowd's lane: batch-1 recalls handed to the carousel and their answers taken back.

The carousel (``carousel_topk``, sidecar/carousel.py) answers requests written into its own
small slots (at most 64, 32 aboard at once). Unless ``KALOS_CAROUSEL=0`` a GPU sidecar runs it
while a crowd of clients recalls (docs/gpu-notes.md, sessions 35-36), and :class:`CrowdLane` is
the dispatcher's side of it, with no device code of its own:

* :meth:`CrowdLane.board` takes a request the dispatcher picked up (the protocol slot marked
  BUSY, its query checked finite): the query is copied into a free carousel slot (768
  floats, ~0.3 µs) with its k, namespace id and a sequence number, then the slot's state
  REQUEST; with no carousel slot free it waits in a backlog, boarded as slots come free.
* :meth:`CrowdLane.harvest` returns the answers written since the last call (the kernel's
  DONE or ERROR), each checked against the sequence number sent, and frees their slots.
* :meth:`CrowdLane.drain` harvests until nothing is aboard or waiting: before anything that
  changes the rows, and before the kernel is stopped (a stop abandons what is aboard).
* :meth:`CrowdLane.quiesce` is the index's side of a stop: it runs the backlog through the
  kernel and waits for every answer, keeping them for the next :meth:`CrowdLane.harvest`, so a
  stop from anywhere (not only after the dispatcher's drain) abandons nothing.

Why the kernel reads its own slots rather than the protocol's (session 34's plan): the
kernel, its tests and its three reviews stayed as they were until a device measured them, and
the copy (~5 µs of host time a recall with the rest of the boarding, benchmarks/crowd_host.py)
costs far less than the turn it waits for (565-626 µs with 32 aboard on the H200, S36-3). With
that turn the carousel passes 40k recalls/s in process but not yet through the sidecar, whose
serve loop is the lane. With KALOS_CAROUSEL=direct (protocol v1.4) the clients holding the
lowest protocol slots write into the kernel's slots below :attr:`CrowdLane.first` themselves,
with no host on their way; the lane keeps the slots above for the recalls that still come the
usual way (docs/gpu-notes.md, session 37).

Not thread-safe: the dispatcher's serve thread alone calls it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .carousel import DONE, ERROR, REQUEST, TAKEN, W_NS_ABOARD, W_RESP_SEQ, W_RESULTS, W_STATE, Slots


class Landed(NamedTuple):
    """One request's outcome from the carousel."""

    token: Any  # what the caller boarded it with
    ok: bool  # DONE (False: the kernel refused it, ERROR)
    n: int  # results found (the kernel's count; the rest of the k are -1 / -inf)
    rows: np.ndarray  # all k, best first (a copy)
    scores: np.ndarray
    why: str = ""  # not ok: why (the kernel refused it, or its answer echoed another request)
    lane_ns: int = 0  # host time from its copy into the carousel's slot to its harvest
    aboard_ns: int = 0  # the kernel's time from its boarding to its answer (GPU clock; 0: not ok)


class CrowdLane:
    """Requests in flight on the carousel whose slots are ``slots``.

    ``alive``: called while :meth:`drain` waits; it raises if the kernel can no longer answer
    (it ended, or faulted), so a drain never waits for answers that will not come.
    """

    def __init__(self, slots: Slots, alive: Callable[[], None] = lambda: None, first: int = 0) -> None:
        if not 0 <= first < slots.n:
            raise ValueError(f"the lane's first slot must be within the {slots.n} slots, not {first}")
        self.slots = slots
        self.alive = alive
        self.first = first  # the lane uses slots [first, n); those below are the direct clients'
        self._free = list(range(slots.n - 1, first - 1, -1))  # carousel slots with nothing aboard (a stack)
        self._aboard: dict[int, tuple[Any, int, int]] = {}  # carousel slot -> (token, seq sent, perf_counter_ns)
        self._backlog: deque[tuple[Any, np.ndarray, int, int]] = deque()  # (token, query, k, ns)
        self._landed: list[Landed] = []  # answers taken by quiesce, for the next harvest
        self._seq = 0
        self._progress = time.monotonic()  # the last answer, or the first boarding onto an empty lane
        self.boarded = 0  # requests written into a carousel slot (diagnostics and tests)

    @property
    def in_flight(self) -> int:
        """Requests boarded or waiting to board and not harvested yet."""
        return len(self._aboard) + len(self._backlog) + len(self._landed)

    def board(self, token: Any, query: np.ndarray, k: int, ns: int) -> None:
        """Hand one query (float32 [dim]; read now, or when it boards from the backlog: the
        caller keeps it unchanged until :meth:`harvest` returns ``token``) to the carousel."""
        if self._free:
            self._send(self._free.pop(), token, query, k, ns)
        else:
            self._backlog.append((token, query, k, ns))

    def _send(self, c: int, token: Any, query: np.ndarray, k: int, ns: int) -> None:
        if not self._aboard:
            self._progress = time.monotonic()
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        t = time.perf_counter_ns()
        self.slots.send(c, query, k, ns, seq=self._seq, poison=False)
        self._aboard[c] = (token, self._seq, t)
        self.boarded += 1

    def harvest(self) -> list[Landed]:
        """The answers written since the last call (none is returned twice), their slots freed
        and given to the backlog.

        An answer that echoes another request's sequence number (the kernel and the lane
        disagree about its slot) comes back not ok, its rows not to be trusted.
        """
        out, self._landed = self._landed, []
        return out + self._take()

    def _take(self) -> list[Landed]:
        """The answers written since the last look, their slots freed and given to the backlog."""
        if not self._aboard:
            return []
        words = self.slots.words
        st = words[self.first :, W_STATE]  # (the lane's slots: those below are the direct clients')
        out: list[Landed] = []
        now = time.perf_counter_ns()
        for c in (np.flatnonzero((st == DONE) | (st == ERROR)) + self.first).tolist():
            held = self._aboard.pop(c, None)
            if held is None:
                continue  # (an answer harvested before: the slot stays DONE until its next send)
            token, seq, sent = held
            w = words[c]
            rows, scores = self.slots.result(c)
            if int(w[W_RESP_SEQ]) != seq:
                why = f"carousel slot {c} answered request {int(w[W_RESP_SEQ])}, not {seq}"
                out.append(Landed(token, False, 0, rows, scores, why, now - sent))
            elif int(w[W_STATE]) == DONE:
                out.append(Landed(token, True, int(w[W_RESULTS]), rows, scores, "", now - sent, int(w[W_NS_ABOARD])))
            else:
                out.append(Landed(token, False, 0, rows, scores, "the kernel refused it", now - sent))
            self._free.append(c)
        if out:
            self._progress = time.monotonic()
        while self._backlog and self._free:
            self._send(self._free.pop(), *self._backlog.popleft())
        return out

    def stalled(self, timeout: float) -> bool:
        """Whether the kernel holds requests and has answered none for ``timeout`` s."""
        return bool(self._aboard) and time.monotonic() - self._progress > timeout

    def drain(self, timeout: float = 5.0) -> list[Landed]:
        """Harvest until nothing is aboard or waiting; return every answer harvested.

        Raises:
            TimeoutError: an answer did not come within ``timeout`` s of the last one (what did
                come is kept for the next :meth:`harvest`, as when ``alive`` raises).
        """
        self.quiesce(timeout)
        return self.harvest()

    def quiesce(self, timeout: float = 5.0) -> None:
        """Wait until the kernel holds no request and none waits to board (the backlog sent as
        slots come free), keeping the answers for the next :meth:`harvest`: after this the
        kernel can be stopped without abandoning anything.

        Raises:
            TimeoutError: an answer did not come within ``timeout`` s of the last one.
        """
        last = time.monotonic()
        while self._backlog or self.busy():
            got = self._take()
            if got:
                self._landed += got
                last = time.monotonic()
                continue
            self.alive()
            if time.monotonic() - last > timeout:
                raise TimeoutError(f"the carousel answered none of its {self.in_flight} requests within {timeout} s")
            time.sleep(0)

    def abandon(self) -> list[Any]:
        """Forget every request not harvested yet (the kernel is gone); return their tokens, for
        the caller to answer with an error."""
        tokens = [a[0] for a in self._aboard.values()] + [b[0] for b in self._backlog] + [x.token for x in self._landed]
        self._aboard.clear()
        self._backlog.clear()
        self._landed = []
        st = self.slots.words[:, W_STATE]  # (a slot a kernel still holds is never sent to again)
        self._free = [c for c in range(self.slots.n - 1, self.first - 1, -1) if st[c] not in (REQUEST, TAKEN)]
        return tokens

    def busy(self) -> bool:
        """Whether any of the lane's carousel slots still holds a request the kernel has not
        answered (the kernel may not be stopped then: a stop abandons it)."""
        st = self.slots.words[self.first :, W_STATE]
        return bool(((st == REQUEST) | (st == TAKEN)).any())

    def settle_direct(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` s, until none of the direct clients' slots (below
        :attr:`first`) holds a request the kernel has not answered: with the header's epoch
        even, those asked before their clients saw it are answered, not abandoned, by the
        stop that follows (a turn or two). Meanwhile the lane's answers are kept for the next
        :meth:`harvest`. True when none is left; False: the stop abandons the rest (its sweep
        turns them back to IDLE and their clients ask again the usual way).
        """
        st = self.slots.words[: self.first, W_STATE]
        end = time.monotonic() + timeout
        while ((st == REQUEST) | (st == TAKEN)).any():
            self.alive()
            if time.monotonic() > end:
                return False
            self._landed += self._take()
            time.sleep(0)
        return True

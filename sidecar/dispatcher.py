"""The dispatcher: find REQUEST slots, answer them, batch what can be batched.

One thread runs :meth:`Dispatcher.poll` in a loop. Each pass reads every slot's state word at
once (a strided numpy view over the segment), copies each waiting request's control words
exactly once, validates them, and answers. Recalls in the default namespace with no filter
that wait together are answered by one batched search (dynamic batching); everything else is
answered one request at a time.

Nothing read from a slot is trusted: the copied control words are validated against the
layout before any offset is used, args are decoded defensively, and a request that fails
gets an error status and message in its own slot. The dispatcher writes only inside the slot
it answers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import numpy as np

from kalos_retrievers import _ipc
from kalos_retrievers.filters import validate_filter
from kalos_retrievers.protocol import (
    HEADER_SIZE,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    RESPONSE_OFFSET,
    RESPONSE_STRUCT,
    Flag,
    Invalid,
    Layout,
    Op,
    Request,
    RespFlag,
    SlotState,
    Status,
    align8,
    car_takes,
    decode_json_args,
    decode_recall_args,
    encode_docs_blob,
    encode_json,
    ringable_args,
    validate_request,
)

from .crowd import Landed
from .index import NS_ANY, FatalDeviceError, SlotSpec
from .knobs import knob, whole
from .service import Service
from .stats import HOST_TIMING, Stats

try:  # the batch-1 recall's take and arena answer in C (sidecar/_hotpath.c); optional
    from . import _hotpath
except ImportError:  # not compiled here: the Python path does the same
    _hotpath = None  # type: ignore[assignment]
if os.environ.get("KALOS_HOTPATH", "1") == "0":  # diagnostics: the Python path only
    _hotpath = None  # type: ignore[assignment]

log = logging.getLogger("kalos.sidecar")

# How long (µs) the dispatcher may hold a launch to gather the clients of the batch it has just
# answered (Dispatcher._gather); 0, the default: never.
GATHER_US: Final = knob("KALOS_GATHER_US", whole(0), 0)

# Batched recalls queued behind the batch in flight (Dispatcher._queue_behind) wait for the
# clients seen this recently (ns) that are not in that batch: a cohort of client processes
# that recall in turn. Never past the device's end of the batch in flight; a client that
# stopped recalling drops out of the count this long after its last recall.
COHORT_WINDOW_NS: Final = 5_000_000

# Diagnostics (KALOS_BATCH_TIMING=1 or "host", as the GPU index's batch timing; the sidecar then
# also times its garbage collections, stats.time_gc, and _queue_behind its waits and launches):
# the "return" phase, per
# member of a batched recall, from the post of its slot's previous answer to the pickup of
# this request: how long a client took to come back (its wake-up and its own work between two
# recalls), which decides whether it makes the next batch queued behind the running one
# (session 26: ~14 queries per batch with 32 processes where 16 would give 40k/s).
RETURN_TIMING: Final = HOST_TIMING

# The carousel (an index's ``carousel_k``: the GPU index unless KALOS_CAROUSEL=0): started when this
# many clients (slots) have recalled within COHORT_WINDOW_NS, the request in hand included, and
# stopped when fewer than half as many have while at most one of its requests is in flight (a
# client recalling alone is served sooner by the resident kernel or a graph: docs/gpu-notes.md,
# session 35). KALOS_CAROUSEL_MIN sets it.
CAROUSEL_MIN: Final = knob("KALOS_CAROUSEL_MIN", whole(2), 8)
# After other device work stopped the carousel (a recall it cannot take, a write), it is not
# started again for this long: a crowd that mixes such recalls in would otherwise pay a drain,
# a stop and a start for each.
CAROUSEL_HOLDOFF_NS: Final = 20_000_000
# A carousel that holds requests and answers none of them for this long has failed (a device fault).
CAROUSEL_STALL_S: Final = 5.0

# ops answered from host state alone: they run beside the index's resident kernel
_HOST_ONLY: Final = frozenset({Op.PING, Op.STATS, Op.COUNT, Op.NAMESPACES, Op.CONTINUE})

# The answer path reads result rows with struct, not numpy: right after a scan that evicted the
# caches, each numpy call's dispatch code runs cold (on a 16-core host the CPU backend's whole
# answer phase took ~120 us p50), a struct call touches far less. State words are written by one
# aligned store (``self.states[i] = ...``, a scalar store, no ufunc), never with
# ``struct.pack_into``: struct zeroes the field before writing it, and a client reading the word
# then saw FREE (0) in a slot whose request was in flight (a review counted 162,149 zeros in 7.9M
# reads of a word only ever set to REQUEST and BUSY), took the request for answered and reused
# the slot ("response sequence ... does not match").
_ROWS: dict[int, struct.Struct] = {}


def _rows_struct(k: int) -> struct.Struct:
    st = _ROWS.get(k)
    if st is None:
        st = _ROWS[k] = struct.Struct(f"<{k}i")
    return st


# the flags of a recall the resident kernel can take (the client rings it for these): documents
# from the arena, named by generations (v1.2 clients) or by entries (v1.3)
_KERNEL_FLAGS: Final = (Flag.ARENA_DOCS, Flag.ARENA_DOCS | Flag.ARENA_ENTRIES)
LONE_RECALLS: Final = 4  # lone batch-1 recalls in a row after which the resident kernel is started
# the back-off of that start while scoped recalls the kernel does not take keep stopping it
# (Dispatcher.lone_enough): runs of fewer answers than BELL_RUN_MIN double the count, up to
# BELL_BACKOFF_MAX; it ends a second after the last such stop
BELL_RUN_MIN: Final = 16
BELL_BACKOFF_MAX: Final = 256
BELL_BACKOFF_NS: Final = 1_000_000_000


def _arena_resp_flags(flags: int) -> int:
    """The response flags of an answer naming arena documents, for a request's ``flags``."""
    return RespFlag.ARENA_DOCS | (RespFlag.ARENA_ENTRIES if flags & Flag.ARENA_ENTRIES else 0)


@dataclass
class _Batch:
    """A batched search launched and not answered yet."""

    part: list[tuple[int, Request, int]]  # (slot, request, picked up at)
    specs: list[SlotSpec]
    kk: int  # results per query
    flags: int
    t_launch: int  # launch started
    t_launched: int  # launch returned (the device may still be searching)
    picked_from: int  # the "pickup" phase's start (its first request, or the work before it)
    finished: bool = False  # the device is done with it (answers not written yet)
    booked: bool = False  # its bookkeeping is done (Dispatcher._book)


class Dispatcher:
    def __init__(self, mm: Any, layout: Layout, resp_sems: list[Any], service: Service,
                 stats: Stats, *, max_batch: int = 64, describe: Callable[[], dict[str, Any]],
                 gather_us: int = GATHER_US, return_timing: bool = RETURN_TIMING) -> None:  # fmt: skip
        if gather_us < 0:
            raise ValueError(f"gather_us must be >= 0, got {gather_us}")
        self.gather_ns = gather_us * 1000
        self.mm = mm
        self.layout = layout
        self.sems = resp_sems
        self.service = service
        self.stats = stats
        self.max_batch = max_batch
        self.describe = describe
        self.states = np.ndarray((layout.n_slots,), np.uint32, mm, HEADER_SIZE, (layout.slot_size,))
        # slot -> (rest, n_results, flags, seq of the part sent): the rest of an answer in parts
        self.pending: dict[int, tuple[memoryview, int, int, int]] = {}
        self._busy_until = 0
        self._inflight: _Batch | None = None
        # While a batch is answered: the slots whose semaphores still need a post (see
        # _answer_batch); None: _respond posts at once.
        self._posts: list[int] | None = None
        self._bells = False  # the index has offered a resident kernel (clients may ring it)
        # How many passes in a row found one request, a batch-1 recall the resident kernel
        # (stopped) could have answered: a client recalling alone. The serve loop restarts the
        # kernel after a few (LONE_RECALLS); a crowd or any other request resets it, so batches,
        # writes and many processes keep the kernel stopped instead of stopping it for each
        # (S5-4: stopped and restarted around every request, 32 processes went 19.6k -> 5.8k/s).
        self.lone = 0
        # The back-off of that restart: a scoped recall the running kernel does not take (a
        # scope it does not serve, handed back; or a client that does not ring it) stops it.
        # With more scopes recalled in turn than it serves (9 users' filters for 8 entries),
        # each run would serve a few recalls and cost a stop and a start; so while runs end
        # that way after fewer than BELL_RUN_MIN answers, each doubles the lone recalls the
        # next start waits for (up to BELL_BACKOFF_MAX), and a second without such a stop, or
        # a run that answered BELL_RUN_MIN, ends the back-off (lone_enough).
        self._lone_need = 0  # the backed-off count (0: none)
        self._declined_ns = 0  # when a scoped recall last stopped the running kernel
        self._served_at_start = 0  # the kernel's answers when it last started (kernel_started)
        self.kernel_declines = 0
        # Declines while the kernel's table fills up (_learned): no sign of more scopes in turn
        # than it serves, so they neither back its start off nor cancel a start on idle.
        self.kernel_learns = 0
        self._known_at_start: frozenset[bytes] = frozenset()  # Service.bell_known() at kernel_started
        # Called (the server's: the header says the kernel runs) before the answer to a lone
        # scoped recall that makes the serve loop start the kernel after this pass; see
        # _starts_after.
        self.on_start_due: Callable[[], None] | None = None
        # slot -> when its last batched recall was picked up (see _queue_behind), or boarded the carousel
        self._seen: dict[int, int] = {}
        self.crowd_min = CAROUSEL_MIN
        self._car_idle = (0, 0)  # (the carousel's boardings, when that count last moved: ns)
        self._car_holdoff = 0  # perf_counter_ns before which the carousel is not started (_yield_device)
        self._car_lane: set[int] = set()  # slots the lane boarded since the last stop_idle_carousel
        self._next_sweep = 0  # perf_counter_ns of the next sweep of the direct slots (poll)
        # slot -> when its last batched answer was posted (RETURN_TIMING; None: off)
        self._posted: dict[int, int] | None = {} if return_timing else None
        self.timing = return_timing  # the diagnostics of RETURN_TIMING (also: _queue_behind's waits)
        self.profile: Any = None  # a cProfile.Profile enabled around each queued launch (KALOS_PROFILE)
        self._specs: dict[tuple[int, int, int], SlotSpec] = {}
        lay = layout
        base = np.frombuffer(mm, np.uint8)
        self.base_addr = base.ctypes.data
        self.slot_off = [lay.slot_offset(i) for i in range(lay.n_slots)]
        self._payload = [np.frombuffer(mm, "<f4", lay.payload_size // 4, o + lay.payload_offset)
                         for o in self.slot_off]  # fmt: skip
        # the first query row of every slot, as one strided (n_slots, dim) view
        self._first_query = np.ndarray((lay.n_slots, lay.dim), "<f4", mm, HEADER_SIZE + lay.payload_offset,
                                       (lay.slot_size, 4))  # fmt: skip
        # q . tiny is finite exactly when every element of q is (see _launch_batch)
        self._tiny = np.full(lay.dim, 2.0**-100, np.float32)
        # While a batch is answered: (op, status, ns since pickup) of each answer, recorded in the
        # stats after the posts (see _answer_batch); None: _respond records at once.
        self._records: list[tuple[int, int, int]] | None = None
        # phases (name, µs) measured and not yet recorded in the stats (see _flush_phases)
        self._phases_due: list[tuple[str, float]] = []
        self._rows = [np.frombuffer(mm, "<i4", lay.max_results, o + lay.rows_offset) for o in self.slot_off]
        self._scores = [np.frombuffer(mm, "<f4", lay.max_results, o + lay.scores_offset)
                        for o in self.slot_off]  # fmt: skip
        # The C path (None: the Python path only). After a CPU scan has evicted the caches,
        # taking a request and writing its answer in Python cost ~25-40 µs each on the H200
        # host (issue 2); _hotpath does the common batch-1 case on a few cache lines.
        self.hot = _hotpath
        view = memoryview(mm)
        self._slot_views = [view[o : o + lay.slot_size] for o in self.slot_off]
        self._hot_layout = (lay.dim, lay.payload_offset, lay.rows_offset, lay.scores_offset, lay.blob_offset,
                            lay.blob_size, lay.max_k, lay.max_results)  # fmt: skip
        # slots whose request _hotpath.take took (its words, deadline and finite query checked)
        self._taken: set[int] = set()
        # lone batch-1 recalls on a host index take the short path (see _lone), which reads
        # slot i's query as _lone_q[i]
        self._lone_path = self.hot is not None and service.index.host_search and not service.index.defers
        self._scopes: dict[bytes, tuple[str, Any]] = {}  # args -> (namespace, None): _recall_scope
        self._lone_q = [self._first_query[j : j + 1] for j in range(lay.n_slots)]
        # every slot's query, rows and scores addresses (u64, one row per slot): a batch queued
        # behind another is launched from its members' slot numbers (Service.launch_queued)
        self._slot_table = np.array([(self.base_addr + o + lay.payload_offset, self.base_addr + o + lay.rows_offset,
                                      self.base_addr + o + lay.scores_offset) for o in self.slot_off],
                                    np.uint64).reshape(-1, 3)  # fmt: skip

    # ------------------------------------------------------------------ main entry
    def requests_waiting(self) -> bool:
        """Whether a slot holds a REQUEST (a DOORBELL aside: the resident kernel takes those
        once it starts)."""
        return bool(np.count_nonzero(self.states == SlotState.REQUEST))

    def waiting(self) -> np.ndarray:
        """Slots with a request for us: REQUEST, and DOORBELL while no resident kernel runs
        (once the index has ever offered one: clients send DOORBELL only then)."""
        st = self.states
        idx = self.service.index
        if idx.doorbell_k:
            self._bells = True
        if idx.doorbell_running or not self._bells:
            return np.flatnonzero(st == SlotState.REQUEST)
        return np.flatnonzero((st == SlotState.REQUEST) | (st == SlotState.DOORBELL))

    def _lone_after(self, ready: np.ndarray) -> int:
        """``lone`` after a pass that found ``ready``: one more for a single request the
        resident kernel would take (a DOORBELL, or the same recall sent as a REQUEST because
        the kernel was stopped: batch 1, default namespace, documents from the arena; a client
        that asks for documents inline never counts); unchanged for a single host-only request
        (stats, ping, ...: served beside the kernel); 0 for anything else, or a crowd."""
        if len(ready) != 1:
            return 0
        i = int(ready[0])
        bell = self.states[i] == SlotState.DOORBELL
        idx = self.service.index
        if bell and not idx.doorbell_spaces:
            return self.lone + 1
        req = Request._make(REQUEST_STRUCT.unpack_from(self.mm, self.slot_off[i] + REQUEST_OFFSET))
        kernel = (req.op == Op.RECALL and req.n_items == 1 and req.flags in _KERNEL_FLAGS
                  and 0 < req.top_k <= idx.doorbell_k)  # fmt: skip
        # (handed back, or never rung: it stops the kernel)
        declined = bool(kernel and req.args_len and not bell and idx.doorbell_running)
        counts = kernel and (req.args_len == 0 or (idx.doorbell_spaces and self._bell_space(i, req, declined)))
        if declined:
            # (counted: a scope the kernel's table could hold, noted and checked; its args then
            # within the header's doorbell_args)
            if counts and self._learned(self._args(i, req)):
                self.kernel_learns += 1
            else:
                self._kernel_declined(LONE_RECALLS)
        if counts:
            return self.lone + 1
        if bell:  # (a DOORBELL the stopped kernel left: the client rang it as one it takes)
            return self.lone + 1
        return self.lone if req.op in _HOST_ONLY else 0

    def _starts_after(self) -> bool:
        """Whether the scoped recall :meth:`_one` answers now completes the lone recalls that
        start the resident kernel after this pass (the serve loop's ``lone_enough``, then
        ``Server._resume_doorbell_if_idle``). Its answer must then follow the header's "runs",
        as the default namespace's last lone recall's does: answered first, its client's next
        recall read the kernel stopped and came a few µs after the start as a REQUEST of a
        scope the kernel serves, a decline that doubled the back-off; each later start met the
        same race, and a new scope went unanswered by the kernel for thousands of back-to-back
        recalls (S55-1: 0 of 2,200 in most first rounds of ``scoped_recall.py``)."""
        return self.lone_enough(LONE_RECALLS) and self.service.doorbell_useful()

    def kernel_started(self) -> None:
        """The serve loop has (re)started the resident kernel: its lone count starts over, and
        the kernel's answers from here on count for the back-off (:meth:`lone_enough`)."""
        self.lone = 0
        self._served_at_start = self.service.index.doorbell_served()
        self._known_at_start = self.service.bell_known()

    def kernel_answers(self) -> int:
        """The resident kernel's answers since it last started (:meth:`kernel_started`)."""
        return self.service.index.doorbell_served() - self._served_at_start

    def backing_off(self) -> bool:
        """Whether the start waits for more lone recalls than usual (:meth:`lone_enough`):
        scoped recalls the kernel did not take stopped it after short runs, the last less than
        ``BELL_BACKOFF_NS`` ago."""
        return bool(self._lone_need) and time.monotonic_ns() - self._declined_ns < BELL_BACKOFF_NS

    def device_busy(self) -> bool:
        """Whether a batch's search or the carousel's recalls are in flight on the device (a
        start of the resident kernel would have to wait for them, or stop the carousel)."""
        return self._inflight is not None or self.crowd_in_flight()

    def lone_enough(self, base: int) -> bool:
        """Whether enough lone recalls came in a row to start the resident kernel: ``base``
        of them, or the back-off's count while scoped recalls the kernel did not take have
        been stopping it after short runs (the last less than a second ago)."""
        need = max(base, self._lone_need) if self.backing_off() else base
        return self.lone >= need

    def _kernel_declined(self, base: int) -> None:
        """A scoped recall the running kernel did not take: this pass stops the kernel to
        answer it. The back-off doubles after a run of fewer than BELL_RUN_MIN answers, and
        ends after a longer one."""
        served = self.kernel_answers()
        now = time.monotonic_ns()
        if now - self._declined_ns >= BELL_BACKOFF_NS:
            self._lone_need = 0  # (the last such stop was long ago: a back-off starts over)
        if served < BELL_RUN_MIN:
            self._lone_need = min(max(self._lone_need, base) * 2, BELL_BACKOFF_MAX)
        else:
            self._lone_need = 0
        self._declined_ns = now
        self.kernel_declines += 1

    def _learned(self, args: bytes) -> bool:
        """Whether the kernel's table is filling up, so that a recall of the scope ``args``,
        which the running kernel declined and :meth:`_bell_space` counted (a scope its table
        could hold), is no sign of more scopes in turn than it serves: the scope is neither in
        the table the kernel runs with nor among the scopes decoded for it at its start
        (:meth:`Service.bell_known`), and the scopes handed to the sidecar alone in the last
        ``BELL_BACKOFF_NS`` (:meth:`Service.bell_recent`, this one included) fit the table.
        A new user's first search is such a decline: it costs a stop and a start, with the
        scope in the table from then on, where the back-off would hand every user's searches
        to the sidecar for a second. (A scope declined although it was in the table is the
        back-off's; so is every scope :meth:`_bell_space` does not count: one the kernel serves
        sent unrung, args too long, a filter refused, a namespace without rows.) Recalls the
        kernel answers never reach the sidecar, so with more users than the table holds,
        recalling slowly enough that no more than it holds reach the sidecar in a second, each
        recall of a user outside the table is a learn too: the table follows the users, at a
        stop and a start per such recall."""
        svc = self.service
        if args in self._known_at_start:
            return False
        return svc.bell_recent(time.monotonic_ns() - BELL_BACKOFF_NS) <= svc.index.doorbell_spaces

    def _bell_space(self, i: int, req: Request, now: bool = False) -> bool:
        """Whether slot ``i``'s recall ``req`` (batch 1, with args) is one the resident kernel
        would answer from its next start, so that it counts towards that start: its args are
        ones a client may ring (:func:`ringable_args`: a namespace without a filter; a filter
        too where the index serves filters, ``doorbell_args``), its filter is valid, its
        namespace holds rows, and it was noted before (:meth:`Service.note_bell_space`, which
        this does now in any case): a scope recalled once, or one of more than the kernel's
        ``doorbell_spaces`` recalled in turn, would only stop the kernel again and again. And
        not while the kernel runs and serves it: that client does not ring it (a library
        before v1.5, or before v1.6 for a filter), and each of its recalls would stop the
        kernel. Never a scope refused before (:meth:`Service.bell_refused`). ``now``: a recall
        the running kernel handed back; a scope seen for the first time is decoded, checked and
        counted at once (its stop is paid anyway: a new user then costs the kernel one start)."""
        if req.vec_len != 4 * self.layout.dim:
            return False
        svc, idx = self.service, self.service.index
        # (without filters served, a filter's JSON is not decoded: the name's length says
        # whether there is one; decoded again by the pickup, it cost ~3 µs a recall on the
        # development VM)
        start = self.slot_off[i] + self.layout.payload_offset + align8(req.vec_len)
        name_len = int.from_bytes(self.mm[start : start + 2], "little")
        if not ringable_args(req.args_len, name_len, idx.doorbell_args):
            return False
        args = self._args(i, req)
        if svc.bell_refused(args):
            return False  # (refused before: not noted, decoded or checked again)
        if not svc.note_bell_args(args) and not now:
            return False  # seen for the first time: noted, not decoded (most never come again in time)
        noted = svc.bell_scope(args)  # (decoded and checked already: ~10 µs a filter)
        if noted is not None:
            namespace, flt = noted
        else:
            try:
                namespace, flt = self._recall_scope(args)
                if flt is not None:
                    validate_filter(flt)
            except (Invalid, ValueError, TypeError):
                svc.forget_bell_space(args)
                return False
        if (not namespace and flt is None) or not svc.holds_rows(namespace):
            return False
        if idx.doorbell_running and args in idx.bell_served_spaces:
            return False
        return svc.note_bell_space(namespace, flt, args)

    def poll(self) -> int:
        """Answer every request waiting now; return how many. The index's resident kernel (if
        any) is stopped before a request that uses the device or the rows (the serve loop
        starts it again before it sleeps); DOORBELL slots it left are answered by the next
        poll."""
        ready = self.waiting()
        idx = self.service.index
        crowd = idx.crowd
        if idx.carousel_direct and not idx.carousel_running:
            # a direct request asked as the kernel stopped (its client posts the bell): swept at
            # most once a millisecond (a few numpy calls, not on every pass)
            now = time.perf_counter_ns()
            if now >= self._next_sweep:
                self._next_sweep = now + 1_000_000
                idx.sweep_carousel()
        if not len(ready):
            if crowd is not None and crowd.in_flight:  # answers to take: never a drain here
                return self._harvest()
            b = self._inflight
            if b is not None and not b.finished and self._awaits_cohort():
                return 0  # the device still searches b: keep taking requests (see _queue_behind)
            return self.settle()
        take = True  # False: _hotpath.take has declined the lone request already (see _pick_up)
        if len(ready) == 1 and self._lone_path and not self._bells and self._inflight is None:
            if self._lone(int(ready[0])):
                return 1
            take = False
        if self._bells:
            self.lone = self._lone_after(ready)
        self._busy_until = 0  # end of the last answer of this pass (for the "pickup" phase)
        self._taken.clear()
        groups: dict[tuple[int, int], list[tuple[int, Request, int]]] = {}
        self._pick_up(ready, groups, take)
        n = len(ready)
        # (fewer slots remembered and waiting now than a crowd: nothing to offer, see _crowd_may_start)
        if groups and idx.carousel_k and (idx.carousel_running or len(self._seen) + n >= self.crowd_min):
            try:
                self._to_carousel(groups)
            except FatalDeviceError:
                raise
            except Exception:  # what did not board stays in groups: the usual path answers it
                log.exception("handing recalls to the carousel failed")
        if self.service.index.carousel_running:
            self.lone = 0  # (one request a pass is a crowd's usual arrival while it runs)
        if crowd is not None and crowd.in_flight:
            try:
                self._harvest()
            except FatalDeviceError:
                raise
            except Exception:  # (a post that failed): groups is still launched
                log.exception("answering the carousel's answers failed")
        b = self._inflight
        if b is not None and not b.finished and self.gather_ns and groups:
            n += self._gather(b, groups)
        elif b is not None and not b.finished and groups and self._queues(groups):
            n += self._queue_behind(b, groups)  # leaves groups empty if it launched them
        elif b is not None and not b.finished:
            # The requests waiting now were read, checked and marked BUSY above while the
            # device searched; wait for that search, then take those that arrived meanwhile
            # into the same groups: one pass over the rows serves them all (launched at once,
            # batches of 32 processes at 1M rows were ~12 queries, each paying a full pass),
            # and the device idles only for the late ones' pickup and the launch, not the
            # whole crowd's (S6-5: ~100 µs of Python per batch of ~16). The batch in flight
            # is answered after the next launch, while the device searches.
            self._finish(b)
            late = self.waiting()
            self._pick_up(late, groups)
            n += len(late)
        for (k, flags), members in groups.items():
            for j in range(0, len(members), self.max_batch):
                self._pipeline(members[j : j + self.max_batch], k, flags)
        if self._inflight is not None and self._inflight.finished:
            self.settle()  # finished above and nothing launched after it: answer it now
        self._flush_phases()
        return n

    def _gather(self, b: _Batch, groups: dict[tuple[int, int], list[tuple[int, Request, int]]]) -> int:
        """Wait for the batch in flight ``b`` and answer it, then take new requests into
        ``groups`` until as many have come as ``b`` answered (its clients coming back) or half
        of ``b``'s search time (at most ``gather_ns``) has passed; return how many.

        Without it (``KALOS_GATHER_US`` 0, the default), ``groups`` (picked up while ``b``
        searched) is launched at once and ``b`` answered during that search: with many
        clients the requests settle into two cohorts that each pay a whole pass over the rows
        (32 processes at 1M rows: two batches of ~16 at ~430 µs each). Gathering trades the
        device's idle time while the answers are written and their clients return for one pass
        that serves both: it pays only if that host time is well under a pass (S17-1/S17-2,
        with the answers and the pickup in Python: ~270-580 µs per cohort, no gain)."""
        self._finish(b)
        self._inflight = None
        budget = min(self.gather_ns, (time.perf_counter_ns() - b.t_launch) >> 1)
        try:
            self._answer_batch(b)
        except FatalDeviceError:
            raise
        except Exception:  # (a post that failed): ``groups`` is launched all the same
            # raised, the requests in ``groups`` (picked up, BUSY) would never be launched nor
            # answered: without gathering they are in flight by then, and the serve loop's
            # settle answers them
            log.exception("answering the batch in flight failed")
            return 0
        end = time.perf_counter_ns() + budget
        expect, got = len(b.part), 0
        while got < expect:
            late = self.waiting()
            if len(late):
                self._pick_up(late, groups)
                got += len(late)
            elif time.perf_counter_ns() >= end:
                break
        return got

    def _awaits_cohort(self) -> bool:
        """Whether the batch in flight may stay so while nothing waits: the next batch could be
        queued behind it, and the device is still searching it. (Otherwise an empty pass
        answers it at once: the serve loop sleeps only after that.)"""
        index = self.service.index
        return index.queues_behind(1, 1, self.service.rows.high) and not index.pending_done()

    def _queues(self, groups: dict[tuple[int, int], list[tuple[int, Request, int]]]) -> bool:
        """Whether ``groups`` is one batch the index can queue behind the one in flight."""
        if len(groups) != 1:
            return False
        (k, _), members = next(iter(groups.items()))
        n = sum(req.n_items for _, req, _ in members)  # queries, not members
        return len(members) <= self.max_batch and self.service.queues_behind(k, n)

    def _queue_behind(self, b: _Batch, groups: dict[tuple[int, int], list[tuple[int, Request, int]]]) -> int:
        """Launch ``groups`` (one batch, :meth:`_queues`) queued behind ``b``, which the
        device is still searching, then wait for ``b`` and answer it; return how many requests
        were picked up here.

        Before the launch it takes the requests that keep arriving until every client seen
        lately (``COHORT_WINDOW_NS``) and not in ``b`` has one waiting, or the device is done
        with ``b``: with 32 client processes at 1M rows, two cohorts take turns, and the
        cohort answered at the start of ``b``'s search comes back during it. Queued then, its
        pass starts the moment ``b``'s ends (prep and thresholds already done beside it), where
        launching after ``b`` ended left the device idle for the late pickups and the launch
        (~100 µs of each ~540 µs batch, S25-4); launching at the first arrival would split the
        cohort into batches that each pay a whole pass (session 3). If something else comes
        meanwhile (a write settles ``b``; another kind of recall), the usual path takes over."""
        (k, flags), members = next(iter(groups.items()))
        inflight = {i for i, _, _ in b.part}
        expect = min(sum(1 for i in self._lately(time.perf_counter_ns()) if i not in inflight), self.max_batch)
        got = 0
        index = self.service.index
        t_wait = time.perf_counter_ns()
        while len(members) < expect and not index.pending_done():
            late = self.waiting()
            if not len(late):
                continue
            self._pick_up(late, groups)
            got += len(late)
            if self._inflight is not b or len(groups) != 1 or (k, flags) not in groups:
                return got  # b was settled for a write, or another batch formed: the usual path
        if self._inflight is not b or not self._queues(groups):
            return got
        profile = self.profile
        if profile is not None:  # (before the batch leaves groups: enable may raise)
            try:
                profile.enable()
            except ValueError:  # another profiler holds the interpreter's (Python 3.12+)
                log.warning("KALOS_PROFILE: the profiler could not start; not profiling", exc_info=True)
                self.profile = profile = None
        del groups[(k, flags)]
        self._inflight = None
        c = None
        t_launch = time.perf_counter_ns()
        try:
            c = self._launch_batch(members, k, flags, behind=True)
        finally:  # b is answered even if this launch failed fatally
            if profile is not None:
                profile.disable()
            self._inflight = c  # first: c stays known (settled later) if answering b fails
            if self.timing:  # how long the cohort was waited for, by what ended the wait; the launch
                wait = "cohort_wait" if len(members) >= expect else "device_wait"
                self._phases_due.append((wait, (t_launch - t_wait) / 1000))
                self._time_launch(t_launch, c is not None)
            self._finish(b)
            self._answer_batch(b)
        if c is not None:
            self._book(c)
        return got

    def _time_launch(self, t_launch: int, launched: bool) -> None:
        """Note a queued launch that began at ``t_launch`` as the phase "queue_launch", and,
        where the index stamped it (``behind_stamps``: the GPU index with KALOS_BATCH_TIMING),
        its parts: "ql_dispatch" (the dispatcher and the service up to the index),
        "ql_prep" (the index's Python before its CUDA calls), "ql_cuda" (those calls, with the
        timing's own events) and "ql_after" (the way back to here; the batch's bookkeeping
        waits for the answers of the batch ahead, see _book)."""
        t_end = time.perf_counter_ns()
        due = self._phases_due
        due.append(("queue_launch", (t_end - t_launch) / 1000))
        st = getattr(self.service.index, "behind_stamps", None)
        if launched and st is not None and t_launch <= st[0] <= st[2] <= t_end:  # this launch's
            t_in, t_cuda, t_out = st
            due.append(("ql_dispatch", (t_in - t_launch) / 1000))
            due.append(("ql_prep", (t_cuda - t_in) / 1000))
            due.append(("ql_cuda", (t_out - t_cuda) / 1000))
            due.append(("ql_after", (t_end - t_out) / 1000))

    def _lone(self, i: int) -> bool:
        """Answer slot ``i``'s request the short way if it is a batch-1 recall (a CPU
        sidecar's every recall from one client): taken by _hotpath.take with its args (a
        namespace, a filter), searched, and answered by _hotpath.answer1 (the documents inline,
        from the arena, or none), with none of the batch machinery around it: that Python, run
        cold after a scan, was most of what the sidecar added to the search (issue 2;
        benchmarks/dispatcher_batch.py --cold). What answer1 leaves (vectors, an answer in
        parts, a row that fails a check) and an empty namespace go on from the slot's rows
        as usual; args that do not decode are answered BAD_REQUEST. False, having done
        nothing, for any other request (_hotpath.take declined it): the caller takes it the
        usual way, without asking take again."""
        t0 = time.perf_counter_ns()
        hot = self.hot
        if getattr(hot, "TAKE_ARGS", False):  # (take hands args over: not an extension built before session 46)
            words = hot.take(self._slot_views[i], self._hot_layout, True)
        else:
            words = hot.take(self._slot_views[i], self._hot_layout)
        if words is None:
            return False
        if self.pending:  # an abandoned answer's rest is void once its slot asks anew
            self.pending.pop(i, None)
        seq, _, flags, k = words[:4]
        svc = self.service
        t_search = t_answer = time.perf_counter_ns()
        answered = False
        try:
            args = words[8] if len(words) > 8 else b""
            if not args:
                ns, cands, dense, n = svc.eligible("", None)
            else:  # (a filter's answer kept: its args not even decoded)
                kept = svc.kept(args)
                ns, cands, dense, n = kept if kept is not None else svc.eligible_for(*self._recall_scope(args), args)
            kk = min(k, n)
            if kk:
                rows, scores = svc.index.search(self._lone_q[i], kk, svc.rows.high, ns, cands, dense)
                t_answer = time.perf_counter_ns()
                a = svc.rows.arena
                arena = None if a is None else (a.table_bytes, a.rows_cap, a.version)
                answered = self.hot.answer1(self._slot_views[i], self._hot_layout, seq, flags, rows, scores,
                                            svc.rows.high, svc.rows.docs, arena)  # fmt: skip
            else:
                t_answer = time.perf_counter_ns()
            if not answered:
                req = Request._make(words[:8])
                self._write_hits(i, req, self._spec(i, req), kk, flags, t0)
        except Invalid as e:
            self._error(i, Request._make(words[:8]), e.status, str(e), t0)
        except FatalDeviceError:
            raise
        except Exception as e:  # a bug must not take the sidecar down
            log.exception("internal error answering a recall")
            self._error(i, Request._make(words[:8]), Status.INTERNAL, f"{type(e).__name__}: {e}", t0)
        if answered:  # by answer1 (outside the try: an answer given is never overwritten by an error)
            _ipc.post(self.sems[i])
        t_done = time.perf_counter_ns()
        if answered:
            self.stats.record(Op.RECALL, Status.OK, (t_done - t0) / 1000)  # after the post
        self._lone_phases(t0, t_search, t_answer, t_done)
        return True

    def _recall_scope(self, args: bytes) -> tuple[str, Any]:
        """(namespace, filter) of a recall's args (:func:`decode_recall_args`), a namespace's
        without a filter kept: an agent's recalls name the same few namespaces again and again.

        Raises:
            Invalid: args that do not decode (BAD_REQUEST).
        """
        got = self._scopes.get(args)
        if got is None:
            got = decode_recall_args(args)
            # (a filter is decoded each time: Service.eligible_for keeps its answer; a
            # namespace the client would refuse, longer than 255 bytes, is not kept)
            if got[1] is None and len(args) <= 261:
                if len(self._scopes) >= 1024:
                    self._scopes.clear()
                self._scopes[args] = got
        return got

    def _lone_phases(self, t0: int, t_search: int, t_answer: int, t_done: int) -> None:
        self._busy_until = t_done
        phase = self.stats.phase
        phase("pickup", (t_search - t0) / 1000)
        phase("search", (t_answer - t_search) / 1000)
        phase("answer", (t_done - t_answer) / 1000)

    def _pick_up(self, ready: np.ndarray, groups: dict[tuple[int, int], list[tuple[int, Request, int]]],
                 take: bool = True) -> None:  # fmt: skip
        """Take the requests in ``ready``: mark each BUSY and check it; recalls without
        arguments join ``groups`` by (k, flags) for a batched search; anything else is
        answered now, after the batch in flight (rows could change). A batch-1 recall is taken
        and checked by _hotpath.take, a scoped one too (its args handed over, then answered by
        :meth:`_one`). ``take`` False: the Python way only (_hotpath.take has declined them
        already: :meth:`_lone`'s request, not read again for the same answer)."""
        hot = self.hot if take else None
        with_args = getattr(hot, "TAKE_ARGS", False)  # (as in _lone)
        for i in ready.tolist():
            t0 = time.perf_counter_ns()
            req, args = None, None
            if hot is not None:  # a batch-1 recall, checked in C (a scoped one too: answered below)
                view = self._slot_views[i]
                words = hot.take(view, self._hot_layout, True) if with_args else hot.take(view, self._hot_layout)
                if words is not None:
                    req = Request._make(words[:8])
                    if not req.args_len:
                        self._taken.add(i)
                        groups.setdefault((req.top_k, req.flags), []).append((i, req, t0))
                        continue
                    args = words[8]  # (copied once by take: _one does not read them again)
            self._taken.discard(i)
            if req is None:
                req = Request._make(REQUEST_STRUCT.unpack_from(self.mm, self.slot_off[i] + REQUEST_OFFSET))
                self.states[i] = SlotState.BUSY  # (one store: see _ROWS)
                try:
                    self._check(req)
                except Invalid as e:
                    self._error(i, req, e.status, str(e), t0)
                    continue
                if req.op == Op.RECALL and req.args_len == 0:
                    groups.setdefault((req.top_k, req.flags), []).append((i, req, t0))
                    continue
            host_only = req.op in _HOST_ONLY
            # nothing else runs while a search is in flight (rows could change); the carousel
            # keeps what it holds for host-only work
            try:
                self.settle(crowd=not host_only)
                if not host_only:
                    self._yield_device()
                    self.service.index.pause_doorbell()
                self._one(i, req, t0, args)
            except Invalid as e:
                self._error(i, req, e.status, str(e), t0)
            except FatalDeviceError:
                raise
            except Exception as e:  # a bug must not take the sidecar down
                log.exception("internal error answering %s", req)
                self._error(i, req, Status.INTERNAL, f"{type(e).__name__}: {e}", t0)
            finally:
                self._busy_until = time.perf_counter_ns()

    def _fail_all(self, part: list[tuple[int, Request, int]], e: Exception) -> None:
        """Answer every member of ``part`` with ``e`` (a bug is logged, and answered INTERNAL)."""
        if isinstance(e, Invalid):
            status, message = e.status, str(e)
        else:
            log.exception("internal error in a batched recall")
            status, message = Status.INTERNAL, f"{type(e).__name__}: {e}"
        for i, req, t0 in part:
            self._error(i, req, status, message, t0)

    # ------------------------------------------------------------------ the carousel
    def _to_carousel(self, groups: dict[tuple[int, int], list[tuple[int, Request, int]]]) -> None:
        """Hand the recalls in ``groups`` that the index's carousel can answer to it (starting
        it for a crowd, :data:`CAROUSEL_MIN`; stopping it when the crowd has gone): batch-1
        recalls in the default namespace that _hotpath.take took (their queries checked
        finite), k up to ``carousel_k``, without vectors, with a query whose squared norm is
        finite in float32 and, for ip and L2, that float16 can hold (the kernel refuses
        others). What it leaves stays in ``groups`` for the usual path, which drains the
        carousel and stops it before it launches. A member leaves ``groups`` as it boards, so
        an error part-way leaves each request in exactly one place."""
        svc = self.service
        idx = svc.index
        fits = [key for key in groups if key[0] <= idx.carousel_k and not key[1] & Flag.WITH_VECTORS]
        if not fits or not (idx.carousel_running or self._crowd_may_start(groups, fits)):
            return  # (a client recalling alone: its query is not checked for boarding)
        ns_id, _, dense, n = svc.eligible("", None)
        if not n:
            return  # (an empty default namespace: answered at once the usual way)
        board = {key: [m for m in groups[key] if self._boards(m[0])] for key in fits}
        ns_arg = NS_ANY if dense else ns_id
        if not any(board.values()) or not self._crowd_holds(board, ns_arg, n):
            return
        now = time.perf_counter_ns()
        lane, taken, seen, posted, pending = idx.crowd, self._taken, self._seen, self._posted, self.pending
        for key, members in board.items():
            if not members:
                continue
            group = groups[key]
            for m in members:
                i = m[0]
                lane.board((m[1], m[2], i), self._first_query[i], key[0], ns_arg)
                self._car_lane.add(i)
                group.remove(m)
                taken.discard(i)
                seen[i] = now
                if pending:  # an abandoned answer's rest is void once its slot asks anew (as _book)
                    pending.pop(i, None)
                if posted is not None:  # (diagnostics, see RETURN_TIMING)
                    t = posted.pop(i, None)
                    if t is not None:
                        self._phases_due.append(("return", (m[2] - t) / 1000))
            if not group:
                del groups[key]

    def _crowd_may_start(self, groups: dict[tuple[int, int], list[tuple[int, Request, int]]],
                         fits: list[tuple[int, int]]) -> bool:  # fmt: skip
        """Whether :meth:`_crowd_holds` could start the stopped carousel for the recalls of
        ``groups`` under the keys ``fits``: its count of clients, with every such recall taken
        to board (an upper bound: False only where it would say False too). :meth:`poll` asks
        nothing of the carousel at all while fewer slots are remembered (``_seen``) and wait
        now than make a crowd. A client recalling alone then pays neither the namespace's
        lookup nor its query's check: with the carousel armed, its batch-1 recall on the
        batched path took 11.5 µs more per pass than with it off, and 0.2 µs more with these
        two (``benchmarks/lone_armed.py``, development VM, session 41). Slots last seen before
        the window are forgotten here, so that after a crowd has left the next pass stops at
        :meth:`poll`'s count again."""
        slots = [m[0] for key in fits for m in groups[key]]
        if len(slots) >= self.crowd_min:
            return True
        # (the hold-off is left to _crowd_holds, whose clock is read later)
        return len(self._lately(time.perf_counter_ns()).union(slots)) >= self.crowd_min

    def _lately(self, now: int) -> set[int]:
        """The slots seen within :data:`COHORT_WINDOW_NS` before ``now`` (a batched recall
        booked, or boarded the carousel); the others are forgotten."""
        horizon, seen = now - COHORT_WINDOW_NS, self._seen
        for i in [i for i, t in seen.items() if t < horizon]:
            del seen[i]
        return set(seen)

    def _boards(self, i: int) -> bool:
        """Whether slot ``i``'s recall (in a group the carousel takes) can board: taken by
        _hotpath.take, and a query the kernel will not refuse (cosine: a float32 sum of
        squares that is a normal number; ip and L2: every value within float16's range)."""
        if i not in self._taken:
            return False
        # (finite: take checked the query; the kernel normalizes by rsqrt of a float32 sum of squares)
        return car_takes(self.service.metric, float(np.abs(self._first_query[i]).max()))

    def _crowd_holds(self, board: dict[tuple[int, int], list[tuple[int, Request, int]]], ns_arg: int,
                     eligible: int) -> bool:  # fmt: skip
        """Whether the carousel runs for the recalls in ``board`` (those that can board):
        started when :data:`CAROUSEL_MIN` clients have recalled lately and no other device
        work stopped it within :data:`CAROUSEL_HOLDOFF_NS`, stopped (drained first) when fewer
        than half as many have and at most one of its requests is still in flight (with direct
        clients, KALOS_CAROUSEL=direct, whose recalls this does not see: only by the
        housekeeping's :meth:`stop_idle_carousel`, which counts them). ``ns_arg``: the
        namespace id the direct clients' requests ask, ``eligible`` its rows. False: the usual
        path."""
        idx = self.service.index
        if idx.carousel_running and (idx.crowd.in_flight > 1 or idx.carousel_direct):
            return True  # (a crowd: not worth counting)
        now = time.perf_counter_ns()
        clients = self._lately(now)
        clients.update(m[0] for members in board.values() for m in members)
        if idx.carousel_running:
            if 2 * len(clients) >= self.crowd_min:
                return True
            self._stop_crowd()
            return False
        if len(clients) < self.crowd_min or now < self._car_holdoff:
            return False
        self.settle()  # the batch in flight answered first: the carousel takes every SM
        try:
            idx.start_carousel(self.service.rows.high, ns_arg, eligible)
        except FatalDeviceError:
            raise
        except Exception:  # (no room for its buffers, say): serve without it
            log.exception("the carousel could not start; serving without it")
            idx.carousel_k = 0
            return False
        return True

    def _stop_crowd(self) -> None:
        """Drain the carousel, answer what it held, and stop it (the usual path from here)."""
        self._drain_crowd()
        self.service.index.stop_carousel()

    def stop_carousel(self) -> None:
        """Before the sidecar says it stops: drain the carousel, stop it and answer what it
        held. Stopping it first tells the direct clients (the even epoch) and waits for what
        they asked before they saw it (``stop_carousel`` of the index): their answers come
        from the kernel, not from this loop, and a client that sees the sidecar stopping
        first gives its recall up."""
        if self.service.index.carousel_running:
            self._stop_crowd()
        self._drain_crowd()  # (the lane's answers the stop kept for a harvest)

    def _yield_device(self) -> None:
        """Before other device work: drain and stop the carousel if it runs, and keep it from
        starting again for :data:`CAROUSEL_HOLDOFF_NS` (a crowd that mixes in recalls it cannot
        take would otherwise stop and start it for each of them)."""
        if self.service.index.carousel_running:
            self._car_holdoff = time.perf_counter_ns() + CAROUSEL_HOLDOFF_NS
            self._stop_crowd()
        else:
            self._drain_crowd()

    def crowd_in_flight(self) -> bool:
        """Whether requests are on the carousel (the serve loop keeps polling, not sleeping:
        their answers are posted by this loop)."""
        crowd = self.service.index.crowd
        return crowd is not None and bool(crowd.in_flight)

    def _harvest(self) -> int:
        """Answer the carousel's requests it has answered since the last call; return how many.
        A carousel that has answered nothing for :data:`CAROUSEL_STALL_S` while it held
        requests is a device fault (FatalDeviceError, its requests refused)."""
        crowd = self.service.index.crowd
        if crowd is None:
            return 0
        n = self._answer_landed(crowd.harvest())
        if not n and crowd.stalled(CAROUSEL_STALL_S):
            self._fail_crowd(TimeoutError(f"the carousel answered none of its {crowd.in_flight} requests "
                                          f"within {CAROUSEL_STALL_S:.0f} s"))  # fmt: skip
        return n

    def _drain_crowd(self) -> int:
        """Wait for every request on the carousel and answer it; return how many. (A carousel
        that stops answering is a device fault: the sidecar exits.)"""
        crowd = self.service.index.crowd
        if crowd is None or not crowd.in_flight:
            return 0
        try:
            landed = crowd.drain(CAROUSEL_STALL_S)
        except Exception as e:
            self._fail_crowd(e)
        return self._answer_landed(landed)

    def _fail_crowd(self, e: Exception) -> NoReturn:
        """The carousel cannot answer (``e``): what it did answer is answered, every other
        request it held refused; raise FatalDeviceError (``e`` itself if it is not a device
        fault: a bug)."""
        crowd = self.service.index.crowd
        with contextlib.suppress(Exception):
            self._answer_landed(crowd.harvest())
        t = time.perf_counter_ns()
        for req, t0, i in crowd.abandon():
            self._error(i, req, Status.INTERNAL, f"the carousel failed: {e}", t0 or t)
        if isinstance(e, (FatalDeviceError, TimeoutError)):
            raise FatalDeviceError(str(e)) from None
        raise e

    def _answer_landed(self, landed: list[Landed]) -> int:
        """Write the answers of the carousel's requests ``landed``, then post them (as
        :meth:`_answer_batch`)."""
        if not landed:
            return 0
        t_answer = time.perf_counter_ns()
        rows = self.service.rows
        a = rows.arena
        arena = None if a is None else (a.table_bytes, a.rows_cap, a.version)
        eligible = self.service.eligible("", None)[3]
        self._posts, self._records = [], []
        due = self._phases_due
        for x in landed:  # where a crowd's cycle goes: the lane's send to harvest, the kernel's part
            if x.ok:
                due.append(("crowd_lane", x.lane_ns / 1000))
                due.append(("crowd_aboard", x.aboard_ns / 1000))
        try:
            for x in landed:
                self._land(x, eligible, rows.high, rows.docs, arena)
        finally:
            self._post_burst(t_answer, True)
        self._busy_until = time.perf_counter_ns()
        return len(landed)

    def _land(self, x: Landed, eligible: int, high: int, docs: Any, arena: Any) -> None:
        """One answer from the carousel: its rows and scores copied into the request's slot,
        then answered as a batch's batch-1 member is (_hotpath.answer1, else the Python path).
        ``eligible``: the default namespace's rows (the rows cannot change while requests are
        on the carousel: settle drains it first)."""
        req, t0, i = x.token
        try:
            kk = min(req.top_k, eligible)
            if not x.ok or x.n != kk:
                raise Invalid(Status.INTERNAL, f"the carousel answered {x.n} of {kk} results"
                              if x.ok else f"the carousel did not answer: {x.why}")  # fmt: skip
            spec = self._spec(i, req)
            spec.rows[0, :kk] = x.rows[:kk]
            spec.scores[0, :kk] = x.scores[:kk]
            answered = False
            if self.hot is not None and not req.flags & Flag.WITH_VECTORS:
                try:
                    answered = self.hot.answer1(self._slot_views[i], self._hot_layout, req.seq, req.flags,
                                                spec.rows[0, :kk], spec.scores[0, :kk], high, docs, arena)  # fmt: skip
                except Exception:  # a bug, in C or in its arguments: the Python path answers instead
                    log.exception("the C answer path failed; answering in Python")
            if answered:
                self._answered(i, req, Status.OK, t0)
            else:
                self._write_hits(i, req, spec, kk, req.flags, t0)
        except Invalid as e:
            self._error(i, req, e.status, str(e), t0)
        except FatalDeviceError:
            raise
        except Exception as e:
            log.exception("internal error answering a recall from the carousel")
            self._error(i, req, Status.INTERNAL, f"{type(e).__name__}: {e}", t0)

    def stop_idle_carousel(self, now: int, idle_ns: int) -> None:
        """Housekeeping: drain and stop a carousel that nothing has boarded for ``idle_ns``
        (it keeps every SM busy polling; the next crowd starts it again), or, with direct
        clients, one whose crowd has thinned: fewer than half of :data:`CAROUSEL_MIN` clients
        recalled since the last look (direct slots whose request number moved or that hold a
        request, and the slots the lane boarded) while at most one of the lane's requests is in
        flight, as :meth:`_crowd_holds` judges the lane's; it is then held off for
        :data:`CAROUSEL_HOLDOFF_NS`."""
        idx = self.service.index
        if not idx.carousel_running:
            return
        if idx.carousel_direct:
            lane, self._car_lane = len(self._car_lane), set()
            if idx.crowd.in_flight <= 1 and 2 * (idx.carousel_active() + lane) < self.crowd_min:
                self._car_holdoff = time.perf_counter_ns() + CAROUSEL_HOLDOFF_NS  # (not at once again)
                self._stop_crowd()
                return
        boarded = idx.crowd.boarded + idx.carousel_answered  # (direct clients board without the lane)
        if boarded != self._car_idle[0]:
            self._car_idle = (boarded, now)
        elif now - self._car_idle[1] > idle_ns:
            self._stop_crowd()

    # ------------------------------------------------------------------ batches in flight
    def _pipeline(self, part: list[tuple[int, Request, int]], k: int, flags: int) -> None:
        """Launch ``part``'s search, then answer the batch launched before it: the host encodes
        and posts one batch's answers while the device searches for the next, and picks up new
        requests while the last one runs (it stays in flight until the next :meth:`poll`).
        With an index that searches synchronously there is nothing to overlap: each batch is
        answered right after its search, as before, except a lone recall when the index has a
        resident kernel (``lone``: int8 rows on a GPU, re-scored on the host). That answer waits
        for the serve loop, which says the kernel runs before it answers (``settle``), as a
        deferring index's does: answered here, the client's next request was often already
        waiting when the serve loop came to start the kernel, so it did not (S10-6: 20 lone
        recalls in a row left it stopped)."""
        prev, self._inflight = self._inflight, None
        if prev is not None and not prev.finished:
            self._finish(prev)
        try:
            self._inflight = self._launch_batch(part, k, flags)
        finally:  # the previous batch is answered even if this launch failed fatally
            if prev is not None:
                self._answer_batch(prev)
        if self._inflight is not None:
            self._book(self._inflight)
        if not self.service.index.defers and not self.lone:
            self.settle()

    def settle(self, crowd: bool = True) -> int:
        """Finish and answer the batch in flight, if any, and every request on the carousel
        (``crowd``; False: leave the carousel's to their harvest, for work that needs neither
        the device nor the rows); return how many requests that was. Call before anything
        that changes rows or the segment."""
        drained = self._drain_crowd() if crowd else 0
        prev, self._inflight = self._inflight, None
        if prev is None:
            return drained
        if not prev.finished:
            self._finish(prev)
        self._answer_batch(prev)
        return drained + len(prev.part)

    def _finish(self, b: _Batch) -> None:
        """Wait for ``b``'s search. On failure its members get the error now and no answer
        later; a fatal device error is raised after that (the sidecar exits)."""
        t0 = time.perf_counter_ns()
        b.finished = True
        try:
            self.service.finish()
        except Exception as e:
            fatal = isinstance(e, FatalDeviceError)
            if not fatal:
                log.exception("internal error finishing a batched recall")
            for i, req, t in b.part:
                self._error(i, req, Status.INTERNAL, f"{type(e).__name__}: {e}", t)
            b.part = []
            if fatal:
                raise
        t1 = time.perf_counter_ns()
        self._busy_until = t1  # the wait is not the next batch's pickup
        # search: the launch plus the time the host was blocked waiting for it
        self._phases_due.append(("search", ((b.t_launched - b.t_launch) + (t1 - t0)) / 1000))

    def _check(self, req: Request) -> None:
        validate_request(req, self.layout)
        if req.deadline_ns and time.monotonic_ns() > req.deadline_ns:
            raise Invalid(Status.DEADLINE, "the request's deadline passed before it was picked up")

    # ------------------------------------------------------------------ reading a slot
    def _queries(self, i: int, req: Request) -> np.ndarray:
        return self._payload[i][: req.vec_len // 4].reshape(-1, self.layout.dim)

    def _spec(self, i: int, req: Request) -> SlotSpec:
        """Views of the request's queries and result areas (cached: the same slot keeps asking
        the same shape)."""
        key = (i, req.n_items, req.top_k)
        spec = self._specs.get(key)
        if spec is None:
            if len(self._specs) > 4 * self.layout.n_slots:
                self._specs.clear()
            spec = self._specs[key] = self._make_spec(i, req)
        return spec

    def _make_spec(self, i: int, req: Request) -> SlotSpec:
        n, k = req.n_items, req.top_k
        off = self.base_addr + self.slot_off[i]
        lay = self.layout
        return SlotSpec(
            self._queries(i, req),
            self._rows[i][: n * k].reshape(n, k),
            self._scores[i][: n * k].reshape(n, k),
            off + lay.payload_offset,
            off + lay.rows_offset,
            off + lay.scores_offset,
        )

    def _args(self, i: int, req: Request) -> bytes:
        start = self.slot_off[i] + self.layout.payload_offset + align8(req.vec_len)
        return bytes(self.mm[start : start + req.args_len])

    # ------------------------------------------------------------------ answering
    def _launch_batch(self, part: list[tuple[int, Request, int]], k: int, flags: int,
                      behind: bool = False) -> _Batch | None:  # fmt: skip
        """Launch ``part``'s search (``behind``: queued behind the one in flight, which the
        index must have said it can do) and return it as a batch in flight; None if no member
        is left to search or the launch failed (its members then have their answer). A queued
        batch whose members are all batch-1 recalls _hotpath.take took goes from their slot
        numbers where the index prefers it (Service.launch_queued, the GPU index's C launch),
        their specs made after the launch, while the device searches: per member, the specs
        and their addresses were ~20 µs of the ~37 µs of Python before a queued launch's CUDA
        calls with 32 client processes (S31-2)."""
        taken = self._taken
        slots = [i for i, _, _ in part]
        specs: list[SlotSpec] | None = None
        hot = bool(part) and taken.issuperset(slots)  # every query checked by _hotpath.take already
        if hot:
            taken.difference_update(slots)
        else:
            part = self._finite_members(part)
            if not part:
                return None
        svc, spec = self.service, self._spec
        if not (hot and behind and svc.index.queues_from_slots):
            specs = [spec(i, req) for i, req, _ in part]
        try:
            self._yield_device()  # (the carousel holds every SM)
        except FatalDeviceError:
            raise
        except Exception as e:  # (a post of the crowd's answers that failed): this batch still gets an answer
            self._fail_all(part, e)
            return None
        ts = time.perf_counter_ns()
        try:
            svc.index.pause_doorbell()
            if specs is None:
                kk = svc.launch_queued(slots, self._slot_table, k)
            else:
                kk = svc.launch_recall(specs, k, "", None, check_finite=False, behind=behind)
        except FatalDeviceError:
            raise
        except Exception as e:  # the members still waiting get it, not those _finite_members refused
            self._fail_all(part, e)
            return None
        t_launched = time.perf_counter_ns()
        if specs is None:
            specs = [spec(i, req) for i, req, _ in part]
        # from finding the request, or from the end of work this pass did before it
        picked_from = max(part[0][2], self._busy_until)
        return _Batch(part, specs, kk, flags, ts, t_launched, picked_from)

    def _book(self, b: _Batch) -> None:
        """The bookkeeping of launched batch ``b``, once: the rest of an abandoned answer in
        its slots voided, its clients noted as seen (the next cohort's count, _queue_behind),
        its stats and phases. The callers make it after the answers that follow the launch
        (the batch ahead's: its clients wait for them, and with 32 client processes the next
        cohort is theirs), :meth:`_answer_batch` before ``b``'s own at the latest."""
        if b.booked:
            return
        b.booked = True
        part = b.part
        if self.pending:  # an abandoned answer's rest is void once its slot asks anew (as in _one)
            for i, _, _ in part:
                self.pending.pop(i, None)
        seen, ts = self._seen, b.t_launch
        for i, _, _ in part:
            seen[i] = ts
        posted = self._posted
        if posted is not None:  # (diagnostics, see RETURN_TIMING)
            for i, _, t0 in part:
                t = posted.pop(i, None)
                if t is not None:
                    self._phases_due.append(("return", (t0 - t) / 1000))
        if len(part) > 1:
            self.stats.batches += 1
            self.stats.batched_queries += sum(req.n_items for _, req, _ in part)
        if part:
            self._phases_due.append(("pickup", (ts - b.picked_from) / 1000))

    def _finite_members(self, part: list[tuple[int, Request, int]]) -> list[tuple[int, Request, int]]:
        """``part`` less the members whose queries are not finite, each answered BAD_REQUEST;
        forgets which members _hotpath.take took (it checked theirs)."""
        # Members whose queries are not finite are refused one by one, not the whole batch
        # with them (a hostile client must not fail its neighbours' recalls). A client that
        # writes NaN after this check only spoils its own rows of the batched search.
        taken = self._taken
        # _hotpath.take checked these members' queries already
        single = [i for i, req, _ in part if req.n_items == 1 and i not in taken]
        taken.difference_update([i for i, _, _ in part])
        if len(part) == 1 and single:
            # one query (a CPU sidecar's every recall): q . 2^-100 is finite exactly when every
            # element of q is (the scaling is exact and no finite float32 overflows it; NaN
            # and infinities carry through; +inf with -inf makes NaN, and numpy's warning of
            # it, if raised, says the same). One dot product: after a CPU scan has evicted the
            # caches, the gather below took ~23 µs of the pickup on the development VM
            # (benchmarks/dispatcher_batch.py --cold), this ~2.
            try:
                finite = {single[0]: math.isfinite(self._first_query[single[0]].dot(self._tiny))}
            except (RuntimeWarning, FloatingPointError):
                finite = {single[0]: False}
        elif single:  # every single-query member at once: one gather from the slots' first query rows
            finite = dict(zip(single, np.isfinite(self._first_query[single]).all(axis=1).tolist(), strict=True))
        else:
            finite = {}
        keep = []
        for i, req, t0 in part:
            if req.n_items == 1:
                ok = finite.get(i, True)  # (absent: taken by _hotpath.take, which checked it)
            else:
                ok = bool(np.isfinite(self._queries(i, req)).all())
            if ok:
                keep.append((i, req, t0))
            else:
                self._error(i, req, Status.BAD_REQUEST, "queries contain NaN or infinity", t0)
        return keep

    def _answer_batch(self, b: _Batch) -> None:
        """Write every member's answer, then post their semaphores. A post wakes a blocked
        client, and on a busy host the woken client may take this core at once (wake-up
        preemption): posting as each answer is written left the rest of the batch waiting
        behind those wake-ups; written first, the answers are there for every client that
        spins, and the posts follow in one burst."""
        self._book(b)  # (where its caller has not: before its answers, which it may void)
        t_answer = time.perf_counter_ns()
        self._posts, self._records = [], []
        try:
            self._answer_members(b)
        finally:
            self._post_burst(t_answer, bool(b.part))
        self._busy_until = time.perf_counter_ns()

    def _post_burst(self, t_answer: int, timed: bool) -> None:
        """Post the semaphores of the answers written since ``_posts`` and ``_records`` were
        set (at ``t_answer``), then record them in the stats; ``timed``: note the "answer"
        phase."""
        # both lists let go first: a post that raises must not leave later answers
        # appending to a list nobody records
        posts, records = self._posts, self._records
        self._posts = self._records = None
        assert posts is not None and records is not None
        failed: Exception | None = None
        try:
            for i in posts:  # every one tried: a failed post must not leave the others' clients asleep
                try:
                    _ipc.post(self.sems[i])
                except Exception as e:
                    failed = failed or e
            if failed is not None:
                raise failed
        finally:
            t_posted = time.perf_counter_ns()
            if self._posted is not None:
                for i in posts:
                    self._posted[i] = t_posted
            if timed:
                self._phases_due.append(("answer", (t_posted - t_answer) / 1000))
            # the stats after the posts: no client waits for them
            for op, status, ns in records:
                self.stats.record(op, status, ns / 1000)
            self._flush_phases()

    def _flush_phases(self) -> None:
        """Record the phases noted since the last flush (kept until the answers are posted: on
        a CPU sidecar each record, run cold after a scan, cost the client ~5 µs)."""
        for name, us in self._phases_due:
            self.stats.phase(name, us)
        self._phases_due.clear()

    def _answer_members(self, b: _Batch) -> None:
        """Write each member's answer (posted and recorded by :meth:`_answer_batch`). The batch-1
        members first, each by _hotpath.answer1 (see :meth:`_answer_hot`); then, the Python
        way, what it left and every other member: all at once by :meth:`_answer_gens` where
        that applies, else one by one by :meth:`_write_hits`."""
        members = list(zip(b.part, b.specs, strict=False))
        if self.hot is not None and b.kk and not b.flags & Flag.WITH_VECTORS:
            members = self._answer_hot(b, members)
            if not members:
                return
        if self._answer_gens(b, members):
            return
        for (i, req, t0), spec in members:
            # One member's failure is that member's alone: an error here used to propagate to
            # the caller, which re-answered the whole batch with an error, overwriting answers
            # already given to other clients (a client rewriting its own result rows mid-answer
            # could make its neighbours' recalls fail).
            try:
                self._write_hits(i, req, spec, b.kk, b.flags, t0)
            except Invalid as e:
                self._error(i, req, e.status, str(e), t0)
            except FatalDeviceError:
                raise
            except Exception as e:
                log.exception("internal error answering a batched recall")
                self._error(i, req, Status.INTERNAL, f"{type(e).__name__}: {e}", t0)

    def _answer_hot(self, b: _Batch, members: list[tuple[tuple[int, Request, int], SlotSpec]]
                    ) -> list[tuple[tuple[int, Request, int], SlotSpec]]:  # fmt: skip
        """Answer ``b``'s batch-1 members with _hotpath.answer1, as :meth:`_lone` answers a lone
        recall: the documents inline, from the arena, or none, written in C from the rows the
        search left in the slot (answer1 reads each once and uses only its copy: the slot's
        owner may rewrite them). In Python, member by member, that answer cost ~120-130 µs per
        batch of ~16 on the H200 host with 32 clients (S19-5); on the development VM
        (benchmarks/dispatcher_batch.py --slots 16, warm) the answer phase of a batch of 16
        went from ~60 µs (arena references) and ~78 µs (documents inline) to ~21-23 µs (not
        measured on the H200 host yet). Return the members it left
        (other shapes, and what answer1 declines: a row that fails a check, an answer in
        parts), for the Python path to answer or refuse with its message. Nothing is left in
        ``pending`` by an answer that fits, as from :meth:`_respond` (:meth:`_book` cleared it)."""
        rows = self.service.rows
        a = rows.arena
        arena = None if a is None else (a.table_bytes, a.rows_cap, a.version)
        answer1, views, lay, high, docs = self.hot.answer1, self._slot_views, self._hot_layout, rows.high, rows.docs
        kk, flags = b.kk, b.flags
        left = []
        for m in members:
            (i, req, t0), spec = m
            if len(spec.rows) != 1:
                left.append(m)
                continue
            try:
                answered = answer1(views[i], lay, req.seq, flags, spec.rows[0, :kk], spec.scores[0, :kk], high,
                                   docs, arena)  # fmt: skip
            except Exception:  # a bug, in C or in its arguments: the Python path answers instead
                log.exception("the C answer path failed; answering in Python")
                answered = False
            if answered:
                self._answered(i, req, Status.OK, t0)
            else:
                left.append(m)
        return left

    def _answer1(self, i: int, req: Request, spec: SlotSpec, kk: int, t0: int) -> bool:
        """Answer a single recall of one query (a GPU sidecar's recall in a namespace or with
        a filter, which :meth:`_one` answers) with _hotpath.answer1, as :meth:`_lone` and
        :meth:`_answer_hot` answer theirs, from the rows the search left in the slot. False,
        having answered nothing, for what it leaves (no C path, several queries, no results,
        vectors, an answer in parts, a row that fails a check): the Python path answers."""
        hot = self.hot
        if hot is None or len(spec.rows) != 1 or not kk or req.flags & Flag.WITH_VECTORS:
            return False
        rows = self.service.rows
        a = rows.arena
        arena = None if a is None else (a.table_bytes, a.rows_cap, a.version)
        try:
            answered = hot.answer1(self._slot_views[i], self._hot_layout, req.seq, req.flags, spec.rows[0, :kk],
                                   spec.scores[0, :kk], rows.high, rows.docs, arena)  # fmt: skip
        except Exception:  # a bug, in C or in its arguments: the Python path answers instead
            log.exception("the C answer path failed; answering in Python")
            return False
        if answered:
            self._answered(i, req, Status.OK, t0)
        return bool(answered)

    def _answer_gens(self, b: _Batch, members: list[tuple[tuple[int, Request, int], SlotSpec]]) -> bool:
        """Answer a batch of batch-1 recalls whose clients read documents from the arena (32
        processes against a GPU sidecar) with numpy over all ``members`` at once: their rows
        gathered from the slots, checked, and their generations looked up in one pass (one by
        one, that took ~3 us of Python per member on the development VM). False, having
        answered nothing, where it does not apply; a member whose rows fail the checks gets
        INTERNAL, as from :meth:`_write_hits`. Whether it applies is asked of the whole batch
        (the members answered in C included, their rows read from their slots), so that
        ``members`` (all of it, or those _hotpath.answer1 left) get what the Python path gives
        them in that batch: here a row whose arena entry is empty is refused, where
        :meth:`_write_hits` of a batch-1 recall, which checks the row table's documents, would
        name it."""
        arena, kk = self.service.rows.arena, b.kk
        if (arena is None or len(b.part) < 2 or not b.flags & Flag.ARENA_DOCS
                or b.flags & (Flag.WITH_VECTORS | Flag.NO_DOCS) or kk < 1
                or any(len(spec.rows) != 1 for spec in b.specs[: len(b.part)])):  # fmt: skip
            return False
        r = np.array([spec.rows[0, :kk] for _, spec in members], np.int64)  # copies
        high, cap = self.service.rows.high, arena.rows_cap
        ok = ((r >= 0) & (r < high)).all(axis=1)
        if (r[ok] >= cap).any():
            return False  # rows the arena does not cover yet: documents inline, member by member
        if len(members) < len(b.part):
            # the members answered in C count too (read from their slots, as without the C
            # path): one whose rows the arena does not cover yet sends every member to
            # _write_hits, which checks the row table's documents, not the arena's entries
            every = np.array([spec.rows[0, :kk] for spec in b.specs[: len(b.part)]], np.int64)
            if (every[((every >= 0) & (every < high)).all(axis=1)] >= cap).any():
                return False
        held = np.zeros_like(ok)
        held[ok] = arena.held_rows(r[ok])
        entries = bool(b.flags & Flag.ARENA_ENTRIES)
        refs = arena.refs_each(np.where(ok[:, None], r, 0), entries)
        rflags = _arena_resp_flags(b.flags)
        for j, ((i, req, t0), _) in enumerate(members):
            if not ok[j]:
                self._error(i, req, Status.INTERNAL, "the index returned rows out of range", t0)
            elif not held[j]:
                self._error(i, req, Status.INTERNAL, "the index returned rows that hold no memory", t0)
            else:
                self._respond(i, req, Status.OK, kk, refs[j], rflags, t0)
        return True

    def _write_hits(self, i: int, req: Request, spec: SlotSpec, kk: int, flags: int, t0: int) -> None:
        blob, rflags = b"", 0
        arena = self.service.rows.arena
        if (len(spec.rows) > 1 and flags & Flag.ARENA_DOCS and arena is not None
                and not flags & (Flag.WITH_VECTORS | Flag.NO_DOCS)):  # fmt: skip
            # a batch whose client reads the documents from the arena: its rows checked and
            # their generations gathered by numpy (640 hits as Python lists took ~55 us on
            # the development VM, 140-280 on the H200 host)
            r = np.array(spec.rows[:, :kk], np.int64).ravel()  # a copy: the slot's owner may rewrite it
            if r.size and (int(r.min()) < 0 or int(r.max()) >= self.service.rows.high):  # trust nothing
                raise Invalid(Status.INTERNAL, "the index returned rows out of range")
            if not r.size or int(r.max()) < arena.rows_cap:
                if not arena.held(r):  # (the arena holds every row's document: rows.py)
                    raise Invalid(Status.INTERNAL, "the index returned rows that hold no memory")
                self._respond_refs(i, req, kk, arena.refs(r, bool(flags & Flag.ARENA_ENTRIES)), flags, t0)
                return
        if flags & (Flag.WITH_VECTORS | Flag.NO_DOCS) != Flag.NO_DOCS:
            if len(spec.rows) == 1:  # batch 1: its kk rows, straight from the segment
                flat = list(_rows_struct(kk).unpack_from(self.mm, spec.rows_addr - self.base_addr))
            else:
                flat = spec.rows[:, :kk].ravel().tolist()
            rows = self.service.rows
            if flat and (min(flat) < 0 or max(flat) >= rows.high):  # trust nothing
                raise Invalid(Status.INTERNAL, "the index returned rows out of range")
            docs = rows.docs
            hits = [docs[r] for r in flat]
            if None in hits:  # the rows were rewritten in the slot meanwhile
                raise Invalid(Status.INTERNAL, "the index returned rows that hold no memory")
            if (flags & Flag.ARENA_DOCS and arena is not None and not flags & Flag.WITH_VECTORS
                    and (not flat or max(flat) < arena.rows_cap)):  # fmt: skip
                # the client reads the documents from the arena: it gets their generations
                # (or entries)
                self._respond_refs(i, req, kk, arena.refs(flat, bool(flags & Flag.ARENA_ENTRIES)), flags, t0)
                return
            if flags & Flag.WITH_VECTORS:
                # the rows checked above, not the slot again (its owner may rewrite it)
                blob = encode_docs_blob(hits, self.service.vectors(np.array(flat, np.int64)))  # type: ignore[arg-type]
                rflags = RespFlag.HAS_VECTORS
            else:
                blob = encode_docs_blob(hits)  # type: ignore[arg-type]
        self._respond(i, req, Status.OK, kk, blob, rflags, t0)

    def _respond_refs(self, i: int, req: Request, kk: int, refs: bytes, flags: int, t0: int) -> None:
        """Answer with the hits' arena references (:meth:`ArenaWriter.refs`)."""
        self._respond(i, req, Status.OK, kk, refs, _arena_resp_flags(flags), t0)

    def _one(self, i: int, req: Request, t0: int, args: bytes | None = None) -> None:
        """Answer slot ``i``'s request ``req`` (BUSY, checked) alone. ``args``: a recall's
        args as _hotpath.take copied them (None: read from the slot here)."""
        op, svc = req.op, self.service
        if op != Op.CONTINUE:
            self.pending.pop(i, None)
        if op == Op.PING:
            self._respond(i, req, Status.OK, 0, b"", 0, t0)
        elif op == Op.RECALL:
            if args is None:
                args = self._args(i, req)
            ns, flt = decode_recall_args(args)
            spec = self._spec(i, req)
            kk = svc.recall_slots([spec], req.top_k, ns, flt, key=args)
            if self.on_start_due is not None and self._starts_after():
                self.on_start_due()
            if not self._answer1(i, req, spec, kk, t0):
                self._write_hits(i, req, spec, kk, req.flags, t0)
        elif op == Op.UPSERT:
            args = decode_json_args(self._args(i, req), op)
            n = svc.upsert(args, self._queries(i, req))
            self._respond(i, req, Status.OK, n, b"", 0, t0)
        elif op in (Op.GET, Op.SCAN):
            args = decode_json_args(self._args(i, req), op)
            rows = svc.get(args) if op == Op.GET else svc.scan(args)
            vecs = svc.vectors(rows) if req.flags & Flag.WITH_VECTORS else None
            blob = encode_docs_blob(svc.docs(rows), vecs)
            self._respond(i, req, Status.OK, len(rows), blob,
                          RespFlag.HAS_VECTORS if vecs is not None else 0, t0)  # fmt: skip
        elif op == Op.DELETE:
            n = svc.delete(decode_json_args(self._args(i, req), op))
            self._respond(i, req, Status.OK, n, b"", 0, t0)
        elif op == Op.COUNT:
            n = svc.count(decode_json_args(self._args(i, req), op))
            self._respond(i, req, Status.OK, 0, encode_json({"count": n}), 0, t0)
        elif op == Op.NAMESPACES:
            prefix = decode_json_args(self._args(i, req), op).get("prefix", "") if req.args_len else ""
            if not isinstance(prefix, str):
                raise Invalid(Status.BAD_REQUEST, "namespaces' prefix must be a string")
            spaces = svc.rows.namespaces()
            if prefix:
                spaces = {n: c for n, c in spaces.items() if n.startswith(prefix)}
            self._respond(i, req, Status.OK, 0, encode_json(spaces), 0, t0)
        elif op == Op.STATS:
            self._respond(i, req, Status.OK, 0, encode_json(self.stats.snapshot(self.describe())), 0, t0)
        elif op == Op.CONTINUE:
            pend = self.pending.pop(i, None)
            if pend is None:
                raise Invalid(Status.BAD_REQUEST, "nothing to continue")
            rest, n, flags, seq = pend
            if req.seq != (seq + 1) & 0xFFFFFFFFFFFFFFFF:  # (another claimer of the slot: not its answer)
                raise Invalid(Status.BAD_REQUEST, "nothing to continue: a CONTINUE's seq follows its answer's by one")
            self._respond(i, req, Status.OK, n, rest, flags, t0)
        else:  # validate_request admits no other op
            raise Invalid(Status.BAD_OP, f"op {op} not handled")

    def _respond(self, i: int, req: Request, status: int, n_results: int, blob: bytes | memoryview,
                 flags: int, t0: int) -> None:  # fmt: skip
        lay = self.layout
        size = lay.blob_size
        if len(blob) > size:  # (views: the rest is not copied again for each chunk it sends)
            mv = memoryview(blob)
            self.pending[i] = (mv[size:], n_results, flags, req.seq)
            blob, flags = mv[:size], flags | RespFlag.MORE
        off = self.slot_off[i]
        b0 = off + lay.blob_offset
        self.mm[b0 : b0 + len(blob)] = blob
        RESPONSE_STRUCT.pack_into(self.mm, off + RESPONSE_OFFSET, req.seq, status, n_results,
                                  len(blob), flags)  # fmt: skip
        self.states[i] = SlotState.RESPONSE if status == Status.OK else SlotState.ERROR  # (one store: see _ROWS)
        self._answered(i, req, status, t0)

    def _answered(self, i: int, req: Request, status: int, t0: int) -> None:
        """Slot ``i``'s answer is written: post its semaphore and record it in the stats (now,
        or after the batch's answers)."""
        if self._posts is not None:
            self._posts.append(i)
        else:
            _ipc.post(self.sems[i])
        if self._records is not None:
            self._records.append((req.op, status, time.perf_counter_ns() - t0))
        else:
            self.stats.record(req.op, status, (time.perf_counter_ns() - t0) / 1000)

    def _error(self, i: int, req: Request, status: int, message: str, t0: int) -> None:
        self.pending.pop(i, None)
        self._respond(i, req, status, 0, message.encode()[: self.layout.blob_size], 0, t0)

    # ------------------------------------------------------------------ housekeeping
    def reclaim(self, fd: int) -> int:
        """Free slots whose owner is gone (its lock is free) and whose state is not FREE; drop
        the rest of an answer in parts whose slot was given back (FREE: a client that stopped
        reading a SCAN kept a copy of the rest of its answer here until its slot asked anew,
        however many clients later)."""
        n = 0
        if self.pending:
            for i in [i for i in self.pending if self.states[i] == SlotState.FREE]:
                del self.pending[i]
        # a batch in flight (kept so while the next cohort comes, see _awaits_cohort) holds
        # its members BUSY until it is answered
        idx = self.service.index
        held = idx.doorbell_running or self._inflight is not None or (idx.crowd is not None and idx.crowd.in_flight)
        for i in np.flatnonzero(self.states != SlotState.FREE).tolist():
            st = self.states[i]
            # answer it first (the resident kernel or a batch may hold it); reclaim later. A
            # DOORBELL where no resident kernel was ever offered is no request (clients ring
            # only after the header offers one): nothing would answer it, so it is reclaimed.
            if st == SlotState.REQUEST or (st == SlotState.DOORBELL and self._bells) or (st == SlotState.BUSY and held):
                continue
            if _ipc.try_lock(fd, _ipc.slot_lock_byte(i)):
                try:
                    self.pending.pop(i, None)
                    self.states[i] = SlotState.FREE
                    n += 1
                finally:
                    _ipc.unlock(fd, _ipc.slot_lock_byte(i))
        return n

    def answer_stranded(self, e: BaseException) -> int:
        """After a pass that raised ``e`` (a bug, or a semaphore post that failed: :meth:`poll`
        answers the errors it expects itself), answer every request that pass left picked up
        and unanswered with INTERNAL, and return how many. Call it after :meth:`settle`.

        A pass marks each request BUSY as it takes it, then groups batch recalls to launch
        after its pickup: an exception escaping the pickup or the launches left the requests
        already grouped BUSY with nobody to answer them, and their clients waited out their
        timeouts (their slots, still BUSY, were never reclaimed while the client lived). Once
        the batch in flight is answered and the carousel drained, only the resident kernel
        answers a BUSY slot besides this thread (it marks the DOORBELL slots it takes BUSY):
        it is stopped first (a stop waits for the recall it holds), so every BUSY slot left is
        one the dispatcher took. A device fault in that stop is raised (FatalDeviceError)."""
        idx = self.service.index
        crowd = idx.crowd
        if self._inflight is not None or (crowd is not None and crowd.in_flight):
            return 0  # (not settled: those hold their BUSY slots, and answer them)
        if idx.doorbell_running:
            idx.pause_doorbell()  # (the serve loop starts it again when lone recalls come)
        stranded = np.flatnonzero(self.states == SlotState.BUSY).tolist()
        try:
            why = f"{type(e).__name__}: {e}"
        except Exception:  # (an exception whose str fails)
            why = type(e).__name__
        message = f"the request was dropped by a failed pass ({why})"
        for i in stranded:
            self._taken.discard(i)
            req = Request._make(REQUEST_STRUCT.unpack_from(self.mm, self.slot_off[i] + REQUEST_OFFSET))
            try:
                self._error(i, req, Status.INTERNAL, message, time.perf_counter_ns())
            except Exception:  # (its post failed: the state says ERROR all the same)
                log.exception("answering a stranded request failed")
        return len(stranded)

    def refuse_all(self, status: int, message: str) -> None:
        """Answer everything waiting with ``status`` (used when stopping); a batch in flight
        is answered normally first (or, if the device failed, with the error)."""
        with contextlib.suppress(Exception):  # DOORBELL slots are ours to refuse, too
            self.service.index.pause_doorbell()
        try:
            self.settle()
        except Exception:  # a fatal device error: its members were answered with it
            log.exception("finishing the batch in flight failed")
        for i in self.waiting().tolist():
            req = Request._make(REQUEST_STRUCT.unpack_from(self.mm, self.slot_off[i] + REQUEST_OFFSET))
            self._error(i, req, status, message, time.perf_counter_ns())

"""KalosClient: talk to a sidecar through its shared-memory segment.

A call borrows a slot, writes the request into it, rings the sidecar's doorbell, and waits for
the answer: first by spinning on the slot's state word for a bounded time (a round trip then
costs microseconds), then by blocking on the slot's semaphore, checking every few milliseconds
that the sidecar is still alive so that a killed sidecar is noticed at once rather than at the
deadline. When answers typically take milliseconds (a CPU index over many rows), it sleeps
through most of the expected wait and spins only across the expected answer (see ``_wait``).

Every call has a deadline (``timeout``). What can go wrong maps onto :mod:`.errors`:

* the sidecar is not there, or died mid-call: :class:`SidecarUnavailable` (at once);
* it is there but did not answer in time (paused, overloaded): :class:`SidecarTimeout`;
* it answered with an error: :class:`RequestRejected` and subclasses;
* you passed something wrong: ``ValueError``/``TypeError`` naming the argument, before anything
  is sent.

After a sidecar restart (a new boot epoch) the client reconnects by itself, with exponential
backoff between attempts while the sidecar stays away. A client is thread-safe: each thread in
flight uses a slot of its own (up to ``max_slots`` per client; beyond that, threads queue).
After ``os.fork`` the child never touches the parent's slots: it connects again on first use.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import random
import struct
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, NamedTuple, Self

import numpy as np

from . import _ipc
from ._conn import _CarouselView, _Conn, _Slot
from .arena import ENTRY_SIZE, ArenaView
from .errors import (
    CapacityError,
    KalosError,
    PermissionDenied,
    ProtocolError,
    RequestRejected,
    SidecarBusy,
    SidecarTimeout,
    SidecarUnavailable,
    StoreError,
)
from .filters import validate_filter
from .protocol import (
    CAR_DONE,
    CAR_KMAX,
    CAR_REQUEST,
    CAR_TAKEN,
    MAX_METADATA_DEPTH,
    METADATA_ENCODER,
    OP_NAMES,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    W_ELIGIBLE,
    W_K,
    W_RESP_SEQ,
    W_RESULTS,
    W_SEQ,
    W_STATE,
    DocViews,
    Flag,
    Header,
    Metric,
    Op,
    ProtocolDecodeError,
    RespFlag,
    Response,
    SlotState,
    Status,
    align8,
    car_takes,
    check_name,
    check_vectors,
    decode_doc,
    decode_docs_blob,
    encode_json,
    encode_recall_args,
    nests_deeper,
    ringable_args,
)
from .results import RecallResult, Record

try:  # the batch-1 recall in C (optional: see _fastpath.c, setup.py)
    from . import _fastpath
except ImportError:  # not compiled here: the Python path does the same
    _fastpath = None  # type: ignore[assignment]
if os.environ.get("KALOS_FASTPATH", "1") == "0":  # diagnostics: the Python path only
    _fastpath = None  # type: ignore[assignment]
# the whole common recall to a resident kernel in one C call (KalosClient._plan_bell; not in an
# extension built before it)
_BELL1 = _fastpath is not None and hasattr(_fastpath, "bell1")
# request1 writes a scoped recall's args (an extension built before session 46 does not)
_REQUEST1_ARGS = _fastpath is not None and hasattr(_fastpath, "REQUEST1_ARGS")
# recall1 writes a scope's args, for a resident kernel that serves namespaces (session 48) and filters (49)
_RECALL1_ARGS = _fastpath is not None and hasattr(_fastpath, "RECALL1_ARGS")

__all__ = ["KalosClient"]

_LIVENESS_TICK = 0.02  # seconds between "is the sidecar still alive?" checks while blocked
_F32: Final = np.dtype(np.float32)
# the answer's rows and scores as _fastpath returns them (a dtype object: np.frombuffer parses a
# string such as "<i4" on every call)
_I32LE: Final = np.dtype("<i4")
_F32LE: Final = np.dtype("<f4")
_KERNEL_FLAGS: Final = Flag.ARENA_DOCS | Flag.ARENA_ENTRIES  # (with or without ENTRIES) a recall the GPU kernel takes
_X86: Final = os.uname().machine in ("x86_64", "AMD64")  # the spin and arena paths rely on TSO
# how long _fastpath spins for a resident kernel's answer before the Python wait takes over
# (which checks the sidecar is alive every millisecond)
_FAST_SPIN_NS = 1_000_000
_MAX_MARGIN_SPINS = 2  # a long wait's spin around the expected answer: at most 2 x 2 spin windows
_SPIN_PROBE_EVERY = 8  # while long-wait spins do not pay, still try one call in this many
# A GPU sidecar's recall expected within this many spin windows is spun through, not slept
# through, while few requests wait (at most _SPIN_CROWD, ours included): see KalosClient._wait.
_FULL_SPIN_WINDOWS = 4
# A GPU sidecar's crowd (more requests waiting than cores) with KALOS_CROWD_WAIT=predict: sleep
# until this much before the expected answer and spin until this much after it (a sixteenth of the
# expected wait when that is more), instead of blocking through the wait. An experiment for the
# carousel, whose answers come one turn after each request (565-626 µs with 32 aboard, p99 within
# ~10% of p50, S36-3) rather than with whichever batch a request joins: docs/gpu-notes.md,
# session 37. A timed wait also wakes up to ~50 µs late (Linux's default timer slack), so the sleep
# ends that much earlier again.
_CROWD_MARGIN_NS = 40_000
_TIMER_SLACK_NS = 50_000
# A direct recall (the carousel's slots, protocol v1.4) late past its spin polls its state word
# between sleeps this long, and checks the deadline, the sidecar's life and the epoch each ms.
_DIRECT_POLL_S = 20e-6
_DIRECT_CHECK_NS = 1_000_000


def _default_spin_us(env: str | None) -> float:
    """``spin_us`` when the caller gives none: ``KALOS_SPIN_US`` from the environment (so a
    deployment can tune or stop the spin without touching code), else 300 on x86-64 and 0
    elsewhere (the spin path relies on x86-64's store ordering)."""
    if env is None or not env.strip():
        return 300.0 if _X86 else 0.0
    try:
        us = float(env)
    except ValueError:
        raise ValueError(f"KALOS_SPIN_US={env!r} must be a number of microseconds >= 0") from None
    if not 0 <= us < float("inf"):
        raise ValueError(f"KALOS_SPIN_US={env!r} must be a number of microseconds >= 0")
    return us


def _ewma_wait(typical: int, waited_ns: int) -> int:
    """``typical`` moved 1/8 of the way to ``waited_ns``, counted as at most twice ``typical``
    (see ``KalosClient._observe_wait``)."""
    if typical and waited_ns > 2 * typical:  # (not min(): a call, on every recall's path)
        waited_ns = 2 * typical
    return typical + ((waited_ns - typical) >> 3)


def _crowd_wait(env: str | None) -> bool:
    """Whether a GPU sidecar's crowd sleeps then spins (``KALOS_CROWD_WAIT=predict``) rather than
    blocks (``block``, the default: unset or empty) through its waits; see ``KalosClient._wait``."""
    value = (env or "").strip() or "block"
    if value not in ("block", "predict"):
        raise ValueError(f"KALOS_CROWD_WAIT={env!r} must be 'block' or 'predict'")
    return value == "predict"


def _cores_from(affinity: int, cpu_max: str | None) -> int:
    """The cores this process can keep busy: its CPU affinity (a container's cpuset), capped
    by a CFS quota (``cpu.max`` of cgroup v2: ``"<quota> <period>"`` or ``"max <period>"``;
    Kubernetes CPU limits are quotas) rounded up. Unreadable or malformed quota: no cap."""
    n = max(1, affinity)
    parts = (cpu_max or "").split()
    if len(parts) == 2 and parts[0] != "max":
        try:
            quota, period = int(parts[0]), int(parts[1])
        except ValueError:
            return n
        if quota > 0 and period > 0:
            n = min(n, max(1, -(-quota // period)))
    return n


def _usable_cores() -> int:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            cpu_max: str | None = f.read()
    except OSError:
        cpu_max = None
    return _cores_from(affinity, cpu_max)


_CORES: Final = _usable_cores()
_NO_ARENA: Final = (None, (0, 0, 0))  # _fastpath's arena and arena_info when documents come inline
_SPIN_CROWD: Final = max(1, _CORES // 4)
_HANDOVER_NS = 2_000_000  # a DOORBELL the stopped kernel left: block if the sidecar has not taken it by then
_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 2.0
MAX_ID_BYTES = 512
_FLOAT_MAX: Final = sys.float_info.max

_clients: weakref.WeakSet[KalosClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for c in list(_clients):
        c._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Reply(NamedTuple):
    status: int
    n_results: int
    resp_flags: int
    rows: np.ndarray | None
    scores: np.ndarray | None
    blob: bytes


# --------------------------------------------------------------------------------------------


class KalosClient:
    """A connection to the Kalos sidecar named ``name``.

    Args:
        name: the sidecar's ``--name``.
        dim: the vector dimension you will use; checked against the sidecar's on connect.
        timeout: default deadline of each call, in seconds.
        spin_us: how long a call busy-waits for the answer before blocking (microseconds).
            Spinning turns a ~12 µs semaphore wake-up into a ~1 µs memory read; it costs a
            core while it lasts. When recalls typically take longer than twice this, a call
            sleeps through most of the expected wait and spins across the expected answer
            instead, for at most 4 x ``spin_us``; except a GPU sidecar's recalls expected
            within 4 x ``spin_us`` while few other requests wait, which spin through the
            whole wait (the Python after a sleep ran up to 2x slower). While more requests wait
            on a GPU sidecar than this process has cores (ours included), a call whose answer
            is not expected within 2 x ``spin_us`` blocks outright. Default 300 on
            x86-64, 0 elsewhere (the spin path relies on x86-64's store ordering; 0 never
            spins), or ``KALOS_SPIN_US`` from the environment when set.
        max_slots: most slots this client holds at once (= its concurrent calls).
        lazy: don't connect now; connect on the first call. Adapters use this so that building
            a chain never fails because the sidecar is not up yet.
        arena_docs: read recalled documents from the sidecar's document arena instead of
            receiving them in the response (docs/protocol.md). None (default): when the
            sidecar runs the GPU's resident kernel (its answers carry no documents), for every
            recall that asks for documents without vectors. True: whenever the sidecar keeps
            an arena. False: never. A document whose row changed after the
            search answered is never returned: the call asks again with documents inline
            (counted in ``arena_retries``). x86-64 only; elsewhere documents come inline.

    Raises:
        SidecarUnavailable: (unless ``lazy``) no sidecar of that name is running.
        DimensionMismatch: ``dim`` is not the sidecar's (a subclass of IncompatibleVersion).
        IncompatibleVersion, PermissionDenied, ProtocolError: see their docs.

    Example:
        >>> with KalosClient.spawn(dim=4) as client:                        # doctest: +SKIP
        ...     client.upsert(["a"], [[1, 0, 0, 0]], texts=["alpha"])
        ...     client.recall([1, 0, 0, 0], k=1)[0].text
        'alpha'
    """

    def __init__(
        self,
        name: str,
        *,
        dim: int | None = None,
        timeout: float = 2.0,
        spin_us: float | None = None,
        max_slots: int = 8,
        lazy: bool = False,
        arena_docs: bool | None = None,
    ) -> None:
        self.name = check_name(name)
        if dim is not None and (not isinstance(dim, int) or dim <= 0):
            raise ValueError(f"dim={dim!r} must be a positive int")
        _check_timeout(timeout)
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots} must be >= 1")
        self._dim = dim
        self.timeout = float(timeout)
        if spin_us is None:
            spin_us = _default_spin_us(os.environ.get("KALOS_SPIN_US"))
        elif not isinstance(spin_us, numbers.Real) or not 0 <= spin_us < float("inf"):
            raise ValueError(f"spin_us={spin_us!r} must be a number >= 0")
        self.spin_ns = int(spin_us * 1000)
        self._typical_wait_ns = 0
        self._bell: tuple[Any, ...] | None = None  # _fastpath.bell1's plan for self._conn (_plan_bell)
        self._ns_args: dict[str, bytes] = {}  # a namespace's recall args without a filter (_scope_args)
        self._typical_car_ns = 0  # the same for recalls written into the carousel's slots
        self.direct_recalls = 0  # recalls the carousel answered through its own slots (KALOS_CAROUSEL=direct)
        self._spin_payoff = 1.0  # share of recent long-wait spins that caught their answer
        self._crowd_predict = _crowd_wait(os.environ.get("KALOS_CROWD_WAIT"))
        self._long_waits = 0
        self.max_slots = max_slots
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()  # (not _lock: a connect may hold that a while)
        if arena_docs not in (None, True, False):
            raise ValueError(f"arena_docs={arena_docs!r} must be None (auto), True or False")
        self.arena_docs = arena_docs
        self.arena_retries = 0  # recalls asked again because a hit's row changed meanwhile
        self.lost_slots = 0  # slots an interrupt took out of circulation, found again (_reclaim_lost)
        self._lock = threading.Condition(threading.RLock())
        self._waiters = 0
        self._trim: tuple[int, threading.Timer] | None = None  # (pid, timer): _arm_trim
        self._conn: _Conn | None = None
        self._closed = False
        self._pid = os.getpid()
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._last_error: KalosError | None = None
        self._process: Any = None  # a Sidecar this client started (spawn), stopped on close
        self.reconnects = 0
        _clients.add(self)
        if not lazy:
            with self._lock:
                self._connect_now()

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def spawn(cls, name: str | None = None, *, dim: int, **sidecar_options: Any) -> Self:
        """Start a sidecar process and return a client connected to it.

        The sidecar stops when the client is closed (``close()`` or leaving a ``with`` block).
        ``sidecar_options`` are :class:`kalos_retrievers.Sidecar`'s (``metric``, ``device``,
        ``data_dir``, ``slots``, ...). Without ``name`` a unique one is made up.
        """
        from .spawn import Sidecar

        sc = Sidecar(name, dim=dim, **sidecar_options).start()
        try:
            client = cls(sc.name, dim=dim)
        except BaseException:
            sc.stop()
            raise
        client._process = sc
        return client

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The threads the async adapters run this client's calls on (``max_slots`` of them,
        made at first use; see :mod:`kalos_retrievers._aio`): not the event loop's default
        executor, which calls blocked by a paused sidecar would take from the application."""
        with self._executor_lock:  # (taken on the event loop's thread: held only here)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_slots, thread_name_prefix=f"kalos-{self.name}")
            return self._executor

    def close(self) -> None:
        """Release the slots this client holds (and stop the sidecar if it spawned it)."""
        with self._executor_lock:
            if self._executor is not None and self._pid == os.getpid():
                self._executor.shutdown(wait=False)  # (calls running end by their deadlines)
            self._executor = None
        with self._lock:
            self._closed = True
            if self._trim is not None and self._trim[0] == os.getpid():
                self._trim[1].cancel()
            self._trim = None
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
            self._bell = None
            self._lock.notify_all()
        if self._process is not None:
            self._process.stop()
            self._process = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
        with contextlib.suppress(Exception):
            if self._process is not None and self._pid == os.getpid():
                # the sidecar this client spawned, never close()d: its lifeline closes, and it
                # stops on its own (it kept running, with its segment, until this process ended)
                self._process._close_lifeline()

    def _forget_after_fork(self) -> None:
        # The parent's slots and locks are the parent's: drop them without writing anything,
        # and close our copy of the descriptor so the parent's locks die with the parent.
        self._lock = threading.Condition(threading.RLock())
        self._executor = None  # (the parent's threads are not the child's)
        self._executor_lock = threading.Lock()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.seg.shm.close_fd()
        self._conn = None
        self._bell = None
        self._trim = None  # (the parent's timer: not the child's thread, never to be touched)
        self._pid = os.getpid()
        self._process = None  # the parent's sidecar: a child's close() must not stop it

    # ------------------------------------------------------------------ info
    @property
    def header(self) -> Header:
        """The sidecar's header as read at connect time (connects if needed)."""
        return self._ensure_conn(time.monotonic() + self.timeout).header

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = self.header.dim
        return self._dim

    @property
    def metric(self) -> str:
        return self.header.metric_name

    @property
    def connected(self) -> bool:
        c = self._conn
        return c is not None and not c.dead and c.sidecar_alive()

    # ------------------------------------------------------------------ public operations
    def ping(self, *, timeout: float | None = None) -> float:
        """Round-trip a no-op; return the seconds it took."""
        t0 = time.perf_counter()
        self._call(Op.PING, timeout=timeout)
        return time.perf_counter() - t0

    def recall(
        self,
        query: Any,
        k: int = 10,
        *,
        namespace: str = "",
        filter: Mapping[str, Any] | None = None,
        with_vectors: bool = False,
        docs: bool = True,
        timeout: float | None = None,
    ) -> RecallResult:
        """The ``k`` stored vectors most similar to ``query`` (best first).

        Args:
            query: one vector of the sidecar's dimension. (Under cosine an all-zero query
                has no direction: it scores 0 against every row, so which rows come back is
                arbitrary.)
            k: how many results; fewer come back when fewer rows match.
            namespace: search only this namespace.
            filter: metadata filter (see :mod:`kalos_retrievers.filters`); the result is the
                true top-k among matching rows.
            with_vectors: also return the stored vectors (for MMR re-ranking).
            docs: set False to skip documents and get only rows and scores.
            timeout: this call's deadline in seconds (default: the client's).

        Raises:
            ValueError: bad query, k, namespace or filter.
            SidecarUnavailable, SidecarTimeout: the sidecar is gone or too slow.
        """
        if not with_vectors and docs:
            plan = self._bell
            try:
                if namespace == "" and filter is None:
                    if plan is not None and timeout is None:  # the resident kernel's common recall, whole in C
                        got = plan[12](self, plan, query, k)  # (_fastpath.bell1)
                        if got is not None:
                            return got if type(got) is RecallResult else self._bell_rest(plan, query, k, *got)
                    res = self._recall_one(query, k, timeout)
                else:  # (a namespace or filter the general path would refuse goes there, to say why)
                    args = self._scope_args(namespace, filter)
                    res = None if args is None else self._recall_one(query, k, timeout, args, namespace)
            except _NotTaken as e:  # (a restart since the last call: asked again, of the sidecar there now)
                left = e.deadline - time.monotonic()
                if left <= 0:
                    raise
                res, timeout = None, left  # (the general path within what is left of the deadline)
            if res is not None:
                return res
        q = check_vectors(query, self.dim, "query")
        if q.shape[0] != 1:
            raise ValueError(f"query has {q.shape[0]} vectors; use recall_batch for several")
        return self._recall(q, k, namespace, filter, with_vectors, docs, timeout)[0]

    def _scope_args(self, namespace: str, flt: Mapping[str, Any] | None) -> bytes | None:
        """The args blob of a recall in ``namespace`` with filter ``flt``
        (:func:`encode_recall_args`, as :meth:`_recall` makes it), a namespace's without a
        filter kept; None when either is one the general path refuses (it says why)."""
        if flt is None and type(namespace) is str:
            got = self._ns_args.get(namespace)
            if got is not None:
                return got
        try:
            _check_namespace(namespace)
            f = None if flt is None else validate_filter(flt)
            args = encode_recall_args(namespace, encode_json(f) if f else None)
        except (TypeError, ValueError):
            return None
        if flt is None:
            if len(self._ns_args) >= 1024:  # (a bound for clients that recall in endless namespaces)
                self._ns_args.clear()
            self._ns_args[namespace] = args
        return args

    def _recall_one(self, query: Any, k: Any, timeout: float | None, args: bytes = b"",
                    namespace: str = "") -> RecallResult | None:  # fmt: skip
        """The common recall (one query, documents) in fewer steps than :meth:`_recall`;
        None when anything is unusual (no live connection yet, a fork, no free slot, a bad
        argument, ``args`` too long for a slot), and the caller takes the general path, which
        connects, waits for a slot, or raises the argument's error. ``args``: the recall's
        namespace and filter (:meth:`_scope_args`; empty for the default namespace without a
        filter, the only recalls the carousel takes). Args the sidecar's header lets a client ring
        (:func:`ringable_args`: a namespace without a filter where ``doorbell_spaces`` is
        nonzero, v1.5; any args up to ``doorbell_args`` bytes, a filter's too, v1.6) go to the
        resident kernel too (it hands back one it does not serve).

        Every check the general path makes on a good call is made here too, the same way:
        the query's dimension and finiteness, ``k``, the timeout, the response's sequence
        number, length and status, and the arena's generations or entries. What is left out
        is work a batch-1 call does not need: the batch split, chunking, per-chunk flag
        arithmetic, and a second connection lookup. On the development VM this took a recall
        against an instant responder from 13.7 to 10.8 µs, and to 9.35 µs with arena entries
        (``benchmarks/client_overhead.py``); on the H200, a 1M-row recall from 427.7 to 406.8
        µs p50 (both changes, ``benchmarks/ab_clients.py``, docs/benchmarks.md session 9).
        """
        conn = self._conn
        if conn is None or conn.dead or self._pid != os.getpid():
            return None
        if conn.recover:  # (slots left at a deadline: those answered since come back first)
            with self._lock:
                self._recover_pending(conn)
        header = conn.header
        dim = header.dim
        if type(k) is not int or not 0 < k <= header.max_k:
            return None
        arena = self._arena()
        # in C where it is built (the request written and the answer read; the resident
        # kernel's recalls, whose documents come from the arena, waited for there too): it
        # checks the query is finite. (x86-64 only, as the spin paths and the arena.)
        fast = _fastpath is not None and _X86 and (not args or _REQUEST1_ARGS)
        if args and align8(4 * dim) + len(args) > conn.layout.payload_size:
            return None  # (the general path says it does not fit)
        bell = fast and arena is not None and k <= conn.doorbell_k() and (not args or (
            _RECALL1_ARGS and conn.doorbell_spaces()
            and ringable_args(len(args), int.from_bytes(args[:2], "little"), conn.doorbell_args())))
        if (bell and not args and _BELL1 and not conn.recover
                and ((plan := self._bell) is None or plan[0] is not conn or plan[3] is not arena)):  # fmt: skip
            self._plan_bell(conn, arena)  # type: ignore[arg-type]
        if fast and type(query) is np.ndarray and query.ndim == 1 and query.dtype is _F32:
            # _fastpath checks the length and finiteness of a float32 vector (and writes
            # nothing, so the general path refuses a wrong one); other dtypes are converted
            # below first, so that they too take the C path
            q = query
        elif type(query) is np.ndarray and query.shape == (dim,) and query.dtype == _F32:
            # the sum of the elements times 2**-100 is finite exactly when every element is:
            # a NaN or an infinity carries through it, and no finite float32 can overflow it
            # (the scaling is exact; tiny products underflow to 0, which numpy does not warn
            # of by default). 0.3 µs against 1.1 for isfinite().all() on the dev VM. A
            # bad query (or np.seterr's "raise") goes to the general path, which says why
            # (one holding both +inf and -inf also gets numpy's "invalid value" warning).
            if not fast:
                try:
                    if not math.isfinite(query.dot(conn.tiny)):
                        return None
                except (RuntimeWarning, FloatingPointError):
                    return None
            q = query
        else:
            try:
                q2 = check_vectors(query, dim, "query")
            except ValueError:
                return None
            if q2.shape[0] != 1:
                return None
            q = q2[0]
        if timeout is not None:
            _check_timeout(timeout)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            slot = conn.free.pop()  # atomic under the GIL, as in _acquire
        except IndexError:
            return None
        try:
            if arena is not None and not args and k <= CAR_KMAX and self.spin_ns and _X86:
                car = conn.carousel(slot.index)
                if car is not None:
                    res = self._recall_direct(conn, car, slot, q, k, deadline)
                    if res is not None:
                        return res
            if fast:
                rep = self._recall_fast(conn, slot, q, k, deadline, arena, bell, args, namespace)  # type: ignore[arg-type]
                if rep is None:
                    return None  # nothing was written: the general path copies or refuses q
                if type(rep) is RecallResult:
                    return rep
            else:
                slot.payload_f32[:dim] = q
                if args:
                    a = align8(4 * dim)
                    slot.payload[a : a + len(args)] = args
                flags = conn.arena_flags if arena is not None else 0
                rep = self._roundtrip(conn, slot, Op.RECALL, flags, k, 1, 4 * dim, len(args), deadline)
            if rep.status != Status.OK:
                raise _status_error(rep.status, rep.blob, Op.RECALL)
        finally:
            self._release(conn, slot)
        return self._finish_one(conn, rep, q, k, deadline, arena, args, namespace)

    def _finish_one(self, conn: _Conn, rep: _Reply, q: np.ndarray, k: int, deadline: float,
                    arena: ArenaView | None, args: bytes = b"", namespace: str = "") -> RecallResult:  # fmt: skip
        """:meth:`_recall_one`'s result from an OK answer ``rep`` that Python reads."""
        res = self._split_one(rep, k, arena if self._conn is conn else None, namespace=namespace, conn=conn)
        if res is None:  # a hit's row was rewritten after the search: ask for it inline
            self.arena_retries += 1
            rep = self._call(Op.RECALL, vectors=q.reshape(1, conn.header.dim), args=args, top_k=k, n_items=1,
                             deadline=deadline)  # fmt: skip
            res = self._split_one(rep, k, None, namespace=namespace)
            assert res is not None
        return res

    def _plan_bell(self, conn: _Conn, arena: ArenaView) -> None:
        """Keep :func:`_fastpath.bell1`'s plan for ``conn`` and its arena: the connection's
        objects bell1 reads, the layout and limits packed (``BELL_WORDS``), and the fork count
        (a plan made before a fork is never used after it). bell1 checks on every call that
        it is still the client's connection, alive, with this arena version; when anything has
        changed it returns None and :meth:`_recall_one` makes a new plan. The plan holds bell1
        itself (its last item), which :meth:`recall` calls. Not made while ``_BELL1`` is False
        (benchmarks compare the path without it)."""
        bell1 = getattr(_fastpath, "bell1", None)  # (None: _fastpath set aside, or stood in for, by a test)
        if bell1 is None:
            self._bell = None
            return
        buf, info = arena.fast
        v = arena.version
        packed = struct.pack("<13q", *conn.fast_layout, conn.header.max_k, _FAST_SPIN_NS, v & 0xFFFFFFFF, v >> 32,
                             _fastpath.fork_gen())  # fmt: skip
        self._bell = (conn, conn.free, conn.hdr_all, arena, buf, info, packed, np.ndarray, np.frombuffer, _I32LE,
                      _F32LE, RecallResult, bell1)  # fmt: skip

    def _bell_rest(self, plan: tuple[Any, ...], q: np.ndarray, k: int, slot: _Slot, seq: int, deadline_ns: int,
                   out: Any) -> RecallResult:  # fmt: skip
        """A recall :func:`_fastpath.bell1` wrote and spun on but did not read whole (``out`` is
        what its recall1 returned), carried on as :meth:`_recall_one` carries on from
        :meth:`_recall_fast`: the slot is ours until this gives it back."""
        conn, arena = plan[0], plan[3]
        deadline = deadline_ns / 1e9
        try:
            rep = self._fast_reply(conn, slot, seq, k, deadline, out)
            if type(rep) is RecallResult:
                return rep
            if rep.status != Status.OK:
                raise _status_error(rep.status, rep.blob, Op.RECALL)
        finally:
            # an answer the sidecar gave (a request handed back) posts the slot's semaphore,
            # and a wait that saw it by spinning leaves the post: bell1 declines a slot with
            # one, so take it now (one that comes later costs the next recall the usual path)
            try:
                if not slot.pending and _ipc.posts(slot.sem):
                    conn.drain_slot(slot)
            except SidecarUnavailable:
                pass  # (the connection closed meanwhile: nothing to drain, and the slot is released)
            self._release(conn, slot)
        return self._finish_one(conn, rep, q, k, deadline, arena)

    def _recall_direct(self, conn: _Conn, car: _CarouselView, slot: _Slot, q: Any, k: int,
                       deadline: float) -> RecallResult | None:  # fmt: skip
        """:meth:`_recall_one` through the carousel's own slots (protocol v1.4: a GPU sidecar
        with KALOS_CAROUSEL=direct, while its carousel runs): the query and the request words
        written into carousel slot ``slot.index``, its state REQUEST last (x86-64 keeps the
        stores in order), then the kernel's answer waited for (:meth:`_wait_direct`) and its
        documents read from the arena as the rows hold them now. No sidecar Python on the way,
        and no semaphore: the kernel writes the answer and nothing wakes us.

        None when the usual path is to ask instead (nothing lost, only time): the query is not
        a finite float32 vector of the index's dimension or not one the kernel scores as the
        sidecar would (:func:`~kalos_retrievers.protocol.car_takes`), the slot still holds an
        earlier request (abandoned at its deadline: the kernel has yet to answer it), the
        kernel refused it, the sidecar stopped the carousel before answering it (the slot
        turned back to IDLE), the answer does not check (its seq; its count, min(k, the rows
        the sidecar wrote into the slot's W_ELIGIBLE word at the launch)), or the epoch had
        moved past the stop's beginning when the documents were read (rows may have been
        written since the answer).

        Raises:
            SidecarTimeout: no answer by ``deadline``.
            SidecarUnavailable: the sidecar died meanwhile.
        """
        if _fastpath is not None and hasattr(_fastpath, "car_wait1"):  # (not an extension built before these)
            return self._recall_direct_c(conn, car, slot, q, k, deadline)
        i = slot.index
        w = car.words[i]
        if w[W_STATE] in (CAR_REQUEST, CAR_TAKEN):
            return None
        if type(q) is not np.ndarray or q.shape != (conn.header.dim,) or q.dtype != _F32:
            return None
        try:
            if not math.isfinite(q.dot(conn.tiny)):  # (see _recall_one)
                return None
        except (RuntimeWarning, FloatingPointError):
            return None
        if not car_takes(conn.header.metric, float(np.abs(q).max())):
            return None
        epoch = conn.carousel_epoch()
        if not epoch & 1:
            return None
        # the arena as the header names it after the epoch was read: it moves to a new version
        # only with a write, which comes after the epoch has moved on (checked below)
        arena = conn.arena()
        if arena is None:
            return None
        slot.seq = (slot.seq + 1) & 0xFFFFFFFFFFFFFFFF
        seq = slot.seq & 0xFFFFFFFF
        car.queries[i] = q
        w[W_K] = k
        w[W_SEQ] = seq
        w[W_RESULTS] = 0xFFFFFFFF
        w[W_STATE] = CAR_REQUEST  # last
        t_sent = time.monotonic_ns()
        state = self._wait_direct(conn, w, epoch, deadline, t_sent)
        waited = time.monotonic_ns() - t_sent
        if state != CAR_DONE or w[W_RESP_SEQ] != seq:
            return None
        n = int(w[W_RESULTS])
        if n != min(k, int(w[W_ELIGIBLE])):  # (the sidecar's count of the namespace's rows, for this launch)
            return None
        rows, scores = car.rows[i, :n].copy(), car.scores[i, :n].copy()
        docs = arena.current_docs(rows.tolist())
        # the epoch after the documents (x86-64 keeps loads in order): the one sent under, or the
        # next (the stop has begun: the rows are written only once the kernel has stopped, +3)
        if docs is None or conn.carousel_epoch() - epoch > 1:
            return None
        self._typical_car_ns = _ewma_wait(self._typical_car_ns, waited)
        self.direct_recalls += 1
        return RecallResult(rows, scores, docs, None, "")

    def _recall_direct_c(self, conn: _Conn, car: _CarouselView, slot: _Slot, q: Any, k: int,
                         deadline: float) -> RecallResult | None:  # fmt: skip
        """:meth:`_recall_direct` with the request written and the answer and its documents
        read in C (``_fastpath.car_request1`` / ``car_answer1``: the same checks; the epoch is
        read and the arena mapped before the query's, which only costs a refused query that
        map; 11.2 -> 3.2 µs of the client's own time per recall at k 10 on the development VM,
        ``benchmarks/direct_client.py``); the wait is :meth:`_wait_direct` as there."""
        epoch = conn.carousel_epoch()
        if not epoch & 1:
            return None
        arena = conn.arena()  # (after the epoch: see _recall_direct)
        if arena is None:
            return None
        i, lay = slot.index, car.lay
        at = i * lay.slot_bytes
        seq = (slot.seq + 1) & 0xFFFFFFFFFFFFFFFF
        dim, (lo, hi) = conn.header.dim, conn.car_bounds
        sent = _fastpath.car_request1(car.buf, at, q, dim, seq & 0xFFFFFFFF, k, lo, hi)
        if sent is None and type(q) is np.ndarray and not q.flags.c_contiguous:  # a strided view: its copy
            sent = _fastpath.car_request1(car.buf, at, np.ascontiguousarray(q), dim, seq & 0xFFFFFFFF, k, lo, hi)
        if sent is None:
            return None
        slot.seq = seq
        t_sent = time.monotonic_ns()
        state = self._wait_direct(conn, car.words[i], epoch, deadline, t_sent, (car.buf, at))
        waited = time.monotonic_ns() - t_sent
        if state != CAR_DONE:
            return None
        buf, info = arena.fast
        out = _fastpath.car_answer1(car.buf, at, lay.rows_off, lay.scores_off, seq, k, buf, info)
        # the epoch after the documents, as in _recall_direct
        if out is None or conn.carousel_epoch() - epoch > 1:
            return None
        rows_b, scores_b, docs = out
        self._typical_car_ns = _ewma_wait(self._typical_car_ns, waited)
        self.direct_recalls += 1
        return RecallResult(np.frombuffer(rows_b, _I32LE), np.frombuffer(scores_b, _F32LE), docs, None, "")

    def _wait_direct(self, conn: _Conn, w: np.ndarray, epoch: int, deadline: float, t_sent: int,
                     spin: tuple[Any, int] | None = None) -> int:  # fmt: skip
        """Wait for the carousel's answer to the request in the slot whose words are ``w``;
        return the slot's final state (DONE, ERROR, or IDLE: the sidecar swept it).

        The carousel answers a request one turn after it boards (565-626 µs at 1M rows with 32
        aboard on the H200, p99 within ~10% of p50, S36-3), so the wait is predictable: sleep
        until the typical wait (:attr:`_typical_car_ns`) less a margin and the timed sleep's
        lateness, spin across the expected answer (:meth:`_crowd_margin`), then poll between
        short sleeps. Every millisecond of that: the carousel's epoch (changed: the sidecar is
        stopping the kernel; its doorbell is posted once, so that a sidecar asleep wakes and
        turns a request no kernel will take back to IDLE), the sidecar's life, the deadline.
        With ``spin`` (the carousel segment's buffer and the slot's byte offset) the spin is
        ``_fastpath.car_wait1``'s, the GIL released: other threads of the process run while
        this one spins.

        Raises:
            SidecarTimeout: no answer by ``deadline`` (the request stays in the slot; the
                kernel may still answer it, and the slot is not written again until it has).
            SidecarUnavailable: the sidecar died meanwhile.
        """
        typical = self._typical_car_ns
        if typical:
            margin, slack = self._crowd_margin(typical)
            wake, spin_until = t_sent + typical - margin - slack, t_sent + typical + margin
        else:
            wake, spin_until = t_sent, t_sent + self.spin_ns
        end = int(deadline * 1e9)
        next_check = t_sent + _DIRECT_CHECK_NS
        posted = False
        while True:
            state = w[W_STATE]
            if state not in (CAR_REQUEST, CAR_TAKEN):
                return int(state)
            now = time.monotonic_ns()
            if now >= next_check:
                next_check = now + _DIRECT_CHECK_NS
                if not posted and conn.carousel_epoch() != epoch:  # (first: a request given up still gets swept)
                    _ipc.post(conn.bell)
                    posted = True
                if not conn.sidecar_alive():
                    state = w[W_STATE]  # (the sidecar answers what is aboard, then says it stops)
                    if state not in (CAR_REQUEST, CAR_TAKEN):
                        return int(state)
                    self._drop_conn(conn)
                    raise SidecarUnavailable(f"sidecar {self.name!r} stopped during the call")
                if now > end:
                    raise SidecarTimeout(f"sidecar {self.name!r} did not answer a recall before the deadline "
                                         "(is it paused or overloaded? see `kalos-sidecar stats`)")  # fmt: skip
            if now < wake:
                time.sleep(min(wake - now, next_check - now) / 1e9)
            elif now > spin_until:
                time.sleep(_DIRECT_POLL_S)
            elif spin is not None:
                _fastpath.car_wait1(spin[0], spin[1], min(spin_until, next_check))

    def _recall_fast(
        self, conn: _Conn, slot: _Slot, q: np.ndarray, k: int, deadline: float, arena: ArenaView | None, bell: bool,
        args: bytes = b"", namespace: str = "",
    ) -> RecallResult | _Reply | None:
        """:meth:`_recall_one`'s exchange in C (the slot in hand, released by the caller).

        With ``bell`` (a resident kernel takes the recall), ``_fastpath.recall1`` writes the
        DOORBELL request and spins for the kernel's answer. Without, ``_fastpath.request1``
        writes a REQUEST, we post the sidecar's doorbell and wait as :meth:`_wait` decides
        (spin, sleep or block, the deadline and the sidecar's death checked as on the Python
        path), and ``_fastpath.answer1`` reads the answer: with ``arena``, its documents too;
        without, the answer's blob, whose inline documents Python decodes. (On the H200 host the
        Python steps around the wait cost ~10 µs more per recall than C's, S18-3; a crowd's
        clients take them between an answer and their next request.)

        A :class:`RecallResult` when the C code read the whole answer and its documents; the
        answer as a :class:`_Reply` when it was written and then read by Python (the answer not
        within the C spin, or one the C code leaves to Python: see _fastpath.c), for the
        caller to check and split; None when nothing was written (``q`` is not finite, or not
        one contiguous float32 vector). ``args``: the namespace and filter (with ``bell``, those
        :func:`ringable_args` allows), which recall1 or request1 writes after the query; ``namespace`` goes
        into the result."""
        if _ipc.posts(slot.sem):  # posts left by responses we saw by spinning (as in _roundtrip)
            conn.drain_slot(slot)
        slot.seq = seq = (slot.seq + 1) & 0xFFFFFFFFFFFFFFFF
        buf, info = arena.fast if arena is not None else _NO_ARENA
        layout, flags = (conn.fast_layout, conn.arena_flags) if arena is not None else (conn.fast_layout_inline, 0)
        deadline_ns = int(deadline * 1e9)
        if bell:
            words: tuple[Any, ...] = (conn.fast_layout, seq, k, deadline_ns, _FAST_SPIN_NS, conn.hdr, buf, info)
            if args:
                words += (args,)
            out = _fastpath.recall1(slot.mem, q, *words)
            if out is None and not q.flags.c_contiguous:  # a strided view: its copy, as on the Python path
                out = _fastpath.recall1(slot.mem, np.ascontiguousarray(q), *words)
        else:
            a = (args,) if args else ()  # (as an extension built before args takes them: 6)
            out = _fastpath.request1(slot.mem, q, layout, seq, k, deadline_ns, *a)
            if out is None and not q.flags.c_contiguous:
                out = _fastpath.request1(slot.mem, np.ascontiguousarray(q), layout, seq, k, deadline_ns, *a)
            if out is not None:
                _ipc.post(conn.bell)
                t_sent = time.monotonic_ns()
                self._wait(conn, slot, seq, deadline, recall=True, check=False)
                waited = time.monotonic_ns() - t_sent
                out = _fastpath.answer1(slot.mem, layout, seq, k, waited, buf, info)
                if out is None:  # an answer C leaves to Python: read (and continued) there, not waited for again
                    return self._roundtrip(conn, slot, Op.RECALL, flags, k, 1, 4 * conn.header.dim, len(args),
                                           deadline, sent=(seq, waited, False, True))  # fmt: skip
        if out is None:
            return None
        return self._fast_reply(conn, slot, seq, k, deadline, out, namespace, len(args))

    def _fast_reply(self, conn: _Conn, slot: _Slot, seq: int, k: int, deadline: float,
                    out: Any, namespace: str = "", args_len: int = 0) -> RecallResult | _Reply:  # fmt: skip
        """What :meth:`_recall_fast` makes of its C call's ``out`` (not None: the request was
        written; ``args_len`` bytes of args after the query)."""
        if type(out) is int:  # written (and spun on for `out` ns): Python waits for and reads the answer
            # (a DOORBELL request: the default namespace's without args, or a scope's with them)
            return self._roundtrip(conn, slot, Op.RECALL, conn.arena_flags, k, 1, 4 * conn.header.dim, args_len,
                                   deadline, sent=(seq, out, True, False))  # fmt: skip
        waited, n, rflags, rows_b, scores_b, blob, docs = out
        self._observe_wait(waited)
        rows, scores = np.frombuffer(rows_b, _I32LE), np.frombuffer(scores_b, _F32LE)  # (writable)
        if docs is not None and self._conn is conn:
            return RecallResult(rows, scores, docs, None, namespace)
        return _Reply(Status.OK, n, rflags, rows, scores, blob)

    def recall_batch(
        self,
        queries: Any,
        k: int = 10,
        *,
        namespace: str = "",
        filter: Mapping[str, Any] | None = None,
        with_vectors: bool = False,
        docs: bool = True,
        timeout: float | None = None,
    ) -> list[RecallResult]:
        """:meth:`recall` for many queries at once (one result per query, in order; none for
        an empty list).

        Large batches are split into as few requests as the slot allows; the sidecar answers a
        request's queries with one batched search.
        """
        if isinstance(queries, list | tuple) and not queries:
            return []  # (no queries; as an array, shape (0,) would not say its dimension)
        qs = check_vectors(queries, self.dim, "queries")
        if len(qs) == 0:
            return []
        return self._recall(qs, k, namespace, filter, with_vectors, docs, timeout)

    def _recall(
        self, qs: np.ndarray, k: int, namespace: str, filter: Mapping[str, Any] | None,
        with_vectors: bool, docs: bool, timeout: float | None,
    ) -> list[RecallResult]:  # fmt: skip
        deadline = self._deadline(timeout)
        header = self._ensure_conn(deadline).header
        _check_k(k, header.max_k)
        if namespace != "":
            _check_namespace(namespace)
        flt = None if filter is None else validate_filter(filter)
        args = encode_recall_args(namespace, encode_json(flt) if flt else None) if flt or namespace else b""
        flags = (Flag.WITH_VECTORS if with_vectors else 0) | (0 if docs else Flag.NO_DOCS)
        # (a long filter leaves room for fewer queries; with none left, _call says so)
        room = (header.payload_size - len(args) - 4) // (4 * header.dim)
        per_req = max(1, min(header.max_queries, header.max_results // k, room))
        out: list[RecallResult] = []
        for start in range(0, len(qs), per_req):
            chunk = qs[start : start + per_req]
            conn = self._conn
            arena = self._arena() if docs and not with_vectors else None
            f = flags | (conn.arena_flags if conn is not None and arena is not None else 0)
            rep = self._call(Op.RECALL, vectors=chunk, args=args, top_k=k, n_items=len(chunk),
                             flags=f, deadline=deadline)  # fmt: skip
            if arena is not None and self._conn is not conn:  # answered by a restarted sidecar:
                arena = None  # whose generations our old arena cannot vouch for
            res = self._split_recall(rep, len(chunk), k, with_vectors, docs, namespace, arena, conn)
            if res is None:  # a hit's row was rewritten after the search: ask for it inline
                self.arena_retries += 1
                rep = self._call(Op.RECALL, vectors=chunk, args=args, top_k=k, n_items=len(chunk),
                                 flags=flags, deadline=deadline)  # fmt: skip
                res = self._split_recall(rep, len(chunk), k, with_vectors, docs, namespace, None)
                assert res is not None
            out.extend(res)
        return out

    def _arena(self) -> ArenaView | None:
        """The arena to read this recall's documents from, if this client uses one: with
        ``arena_docs=None``, when the sidecar runs a resident GPU kernel (whose answers carry
        no documents; such a sidecar keeps an arena), with True whenever the sidecar keeps an
        arena; x86-64 only (the reads rely on its store ordering). A batch's documents come
        from the arena too: its answer then carries 4 bytes per hit instead of each document
        (the sidecar's encoding of 640 documents took 140-280 us on the H200 host, S7-2)."""
        if self.arena_docs is False or not _X86:
            return None
        conn = self._conn
        if conn is None or conn.dead or (self.arena_docs is None and not conn.doorbell_cap()):
            return None
        return conn.arena()

    def _split_recall(
        self, rep: _Reply, nq: int, k: int, with_vectors: bool, docs: bool, namespace: str,
        arena: ArenaView | None, conn: _Conn | None = None,
    ) -> list[RecallResult] | None:  # fmt: skip
        """The results of one RECALL reply; None when its documents are in the arena and one
        of them no longer is (its row changed since the search answered)."""
        if nq == 1 and not with_vectors:
            one = self._split_one(rep, k, arena, docs, namespace, conn)
            return None if one is None else [one]
        kk = rep.n_results
        if kk > k:
            raise ProtocolError(f"sidecar returned {kk} results per query for k={k}")
        assert rep.rows is not None and rep.scores is not None
        rows = rep.rows.reshape(nq, k)[:, :kk]
        scores = rep.scores.reshape(nq, k)[:, :kk]
        doc_views: DocViews | list[bytes] | None = None
        vectors = None
        if rep.resp_flags & RespFlag.ARENA_DOCS:
            doc_views = self._arena_docs(rep, rows.ravel(), arena, conn)
            if doc_views is None:
                return None
        elif docs or with_vectors:
            try:
                doc_views, vectors = decode_docs_blob(
                    rep.blob, self.dim, bool(rep.resp_flags & RespFlag.HAS_VECTORS)
                )
            except ProtocolDecodeError as e:
                raise ProtocolError(str(e)) from None
            if len(doc_views) != nq * kk:
                raise ProtocolError(f"sidecar returned {len(doc_views)} docs for {nq}x{kk} hits")
            if with_vectors and vectors is None:
                raise ProtocolError("sidecar did not return the vectors asked for")
        return RecallResult.batch(rows, scores, doc_views if docs else None, vectors, namespace)

    def _split_one(
        self, rep: _Reply, k: int, arena: ArenaView | None, docs: bool = True, namespace: str = "",
        conn: _Conn | None = None,
    ) -> RecallResult | None:  # fmt: skip
        """:meth:`_split_recall` of a one-query reply without vectors (no reshaping and no
        split: most recalls)."""
        kk = rep.n_results
        if kk > k:
            raise ProtocolError(f"sidecar returned {kk} results per query for k={k}")
        assert rep.rows is not None and rep.scores is not None
        doc_views: DocViews | list[bytes] | None = None
        if rep.resp_flags & RespFlag.ARENA_DOCS:
            doc_views = self._arena_docs(rep, rep.rows[:kk], arena, conn)
            if doc_views is None:
                return None
        elif docs:
            try:
                doc_views, _ = decode_docs_blob(rep.blob, self.dim, bool(rep.resp_flags & RespFlag.HAS_VECTORS))
            except ProtocolDecodeError as e:
                raise ProtocolError(str(e)) from None
            if len(doc_views) != kk:
                raise ProtocolError(f"sidecar returned {len(doc_views)} docs for 1x{kk} hits")
        return RecallResult(rep.rows[:kk], rep.scores[:kk], doc_views, None, namespace)

    def _arena_docs(
        self, rep: _Reply, rows: np.ndarray, arena: ArenaView | None, conn: _Conn | None
    ) -> DocViews | list[bytes] | None:
        """The documents of an answer that names them in the arena (flag ARENA_DOCS) by
        generation (per hit in ``rows``) or, with ARENA_ENTRIES, by entry; None when they are
        not there any more (see :meth:`ArenaView.docs`, :meth:`ArenaView.entry_docs`) or
        ``arena`` is None (the arena asked with is not the answering sidecar's): the caller
        asks again with the documents inline. ``conn`` is the connection that answered: an
        answer made from a newer arena version than ``arena`` is read through the version
        that connection's header names now (not through ``self._conn``, which another thread
        may have moved to a restarted sidecar, whose versions count from 1 again)."""
        n, blob = len(rows), rep.blob
        if rep.resp_flags & RespFlag.ARENA_ENTRIES:
            if len(blob) != 8 + ENTRY_SIZE * n:
                raise ProtocolError(f"sidecar returned {len(blob)} bytes of arena entries for {n} hits")
            if arena is None:
                return None
            docs = arena.entry_docs(blob, n)
            if docs is None and conn is not None and not conn.dead:  # answered from a newer version?
                newer = conn.arena()
                if newer is not None and newer is not arena:
                    docs = newer.entry_docs(blob, n)
            return docs
        if len(blob) != 4 * n:
            raise ProtocolError(f"sidecar returned {len(blob)} bytes of arena generations for {n} hits")
        if arena is None:
            return None
        return arena.docs(rows, np.frombuffer(blob, "<u4"))

    def upsert(
        self,
        ids: Sequence[str] | None,
        vectors: Any,
        texts: Sequence[str | None] | None = None,
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        namespace: str = "",
        timeout: float | None = None,
    ) -> list[str]:
        """Insert or overwrite memories; return their ids.

        Acknowledged (returned) only after the sidecar's store of record committed the write,
        so with ``--data-dir`` it survives ``kill -9``. Writes larger than one slot are split
        into chunks transparently; each chunk commits on its own. Every argument is checked
        before the first chunk is sent, so a ``ValueError`` or ``TypeError`` means nothing
        was written. A :class:`KalosError` (``SidecarUnavailable``, ``SidecarTimeout``, ...)
        raised by the write carries its ids as ``e.ids`` (the made-up ones included) and as
        ``e.committed`` how many of them, the first ones, were committed before the chunk
        that failed (whose rows may or may not have been): writing the same rows again with
        ``ids=e.ids`` is harmless, an existing id being overwritten; writing them again with
        ``ids=None`` would store the committed ones twice, under new ids.

        Args:
            ids: one id per vector (strings); None makes up UUIDs. An existing id in the
                namespace is overwritten (its ``created_at`` is kept).
            vectors: (n, dim) array-like.
            texts: the text of each memory (non-empty strings; a None entry is a vector-only
                row), or None for vector-only rows.
            metadatas: one JSON-serializable dict per vector (or None).
            namespace: where to store them.
            timeout: the deadline of each chunk's request, in seconds (None: the client's),
                so a large write is not cut short by a deadline sized for one recall.
        """
        vecs = check_vectors(vectors, self.dim, "vectors")
        n = len(vecs)
        if n == 0:  # nothing to send, but the same refusals as for rows (a zero-row test call)
            if timeout is not None:
                _check_timeout(timeout)
            _check_ids(ids, 0)
            _check_namespace(namespace)
            _check_texts(texts, 0)
            _encode_metadatas(metadatas, 0)
            return []
        if self.header.metric == Metric.COSINE:
            zero = np.flatnonzero(~np.any(vecs != 0, axis=1))
            if len(zero):
                raise ValueError(
                    f"vectors[{int(zero[0])}] is all zeros: it has no direction, so its cosine "
                    "similarity is undefined; use the 'ip' or 'l2' metric to store it"
                )
        if timeout is not None:
            _check_timeout(timeout)
        id_list = _check_ids(ids, n)
        requests = self._upsert_requests(id_list, texts, metadatas, namespace, n)
        for start, end, args in requests:
            try:
                self._call(Op.UPSERT, vectors=vecs[start:end], args=args, n_items=end - start,
                           timeout=timeout)  # fmt: skip
            except KalosError as e:
                e.ids, e.committed = id_list, start  # (for a retry that stores nothing twice)
                raise
        return id_list

    def _upsert_requests(
        self,
        id_list: list[str],
        texts: Sequence[str | None] | None,
        metadatas: Sequence[Mapping[str, Any] | None] | None,
        namespace: str,
        n: int,
    ) -> list[tuple[int, int, bytes]]:
        """Check an upsert's rows and split them into requests that each fit a slot:
        ``(start, end, args)`` of rows ``start .. end``. Raises before anything is sent."""
        _check_namespace(namespace)
        text_list = _check_texts(texts, n)
        meta_enc = _encode_metadatas(metadatas, n)
        ns_json = encode_json(namespace)
        id_enc = [encode_json(i) for i in id_list]
        text_enc = [encode_json(t) for t in text_list]
        lay = self.header.layout
        row_bytes = 4 * self.dim
        fixed = len(b'{"namespace":,"ids":[],"texts":[],"metadatas":[]}') + len(ns_json)
        out = []
        start = 0
        while start < n:
            size, end = fixed, start
            while end < n:
                rec = len(id_enc[end]) + len(text_enc[end]) + len(meta_enc[end]) + 3
                if align8((end - start + 1) * row_bytes) + size + rec > lay.payload_size:
                    break
                size += rec
                end += 1
            if end == start:
                raise ValueError(
                    f"texts/metadatas[{start}] is too large for one request: its id, text and metadata take "
                    f"{len(id_enc[start])}, {len(text_enc[start])} and {len(meta_enc[start])} bytes as "
                    f"JSON (escapes included: a control character takes 6), its vector {row_bytes}, and a "
                    f"slot's payload holds {lay.payload_size}; shorten it or start the sidecar with a "
                    "larger --payload-kb"
                )
            args = b"".join([
                b'{"namespace":', ns_json,
                b',"ids":[', b",".join(id_enc[start:end]),
                b'],"texts":[', b",".join(text_enc[start:end]),
                b'],"metadatas":[', b",".join(meta_enc[start:end]), b"]}",
            ])  # fmt: skip
            out.append((start, end, args))
            start = end
        return out

    def check_upsert(
        self,
        n: int,
        ids: Sequence[str] | None = None,
        texts: Sequence[str | None] | None = None,
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        namespace: str = "",
    ) -> None:
        """Raise what :meth:`upsert` of ``n`` rows with these ids, texts and metadatas would
        raise for them, without sending anything: for callers that write one large input in
        several upserts (embedding each part first) and want a bad entry refused before the
        first part is stored. Its indexes are those of these sequences."""
        self._upsert_requests(_check_ids(ids, n), texts, metadatas, namespace, n)

    def get(
        self,
        ids: Iterable[str],
        *,
        namespace: str = "",
        with_vectors: bool = False,
        timeout: float | None = None,
    ) -> list[Record]:
        """The stored records of ``ids`` in that order; ids not found are skipped. More ids
        than one request holds are asked for in as few requests as fit, each with a deadline
        of its own (as :meth:`delete`'s: ``timeout`` bounds one request, so 400k ids are not
        cut short by a deadline sized for a few)."""
        id_list = _check_ids(ids, None)
        _check_namespace(namespace)
        if timeout is not None:
            _check_timeout(timeout)
        if not id_list:
            return []
        head = b'{"namespace":' + encode_json(namespace) + b',"ids":['
        out: list[Record] = []
        for args in list(self._id_requests(head, id_list)):  # (every id checked before the first is sent)
            out += self._records(Op.GET, args, namespace, with_vectors, self._deadline(timeout))
        return out

    def scan(
        self,
        *,
        namespace: str = "",
        filter: Mapping[str, Any] | None = None,
        limit: int = 100,
        offset: int = 0,
        with_vectors: bool = False,
        timeout: float | None = None,
    ) -> list[Record]:
        """Records of a namespace matching ``filter``, oldest first (by ``created_at``, id)."""
        _check_namespace(namespace)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"limit={limit!r} must be an int >= 0")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset={offset!r} must be an int >= 0")
        flt = validate_filter(filter)
        args = encode_json({"namespace": namespace, "filter": flt, "limit": limit, "offset": offset})
        return self._records(Op.SCAN, args, namespace, with_vectors, self._deadline(timeout))

    def delete(
        self,
        ids: Iterable[str] | None = None,
        *,
        namespace: str = "",
        filter: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Delete by ids and/or by filter within a namespace; return how many were deleted.

        Acknowledged after the store commits. To empty a namespace use
        :meth:`delete_namespace` (a bare ``delete()`` refuses, to protect you from yourself).
        More ids than one request holds are deleted in as few requests as fit, each committed
        on its own, with a deadline of its own (as :meth:`upsert`'s chunks are: a deadline
        sized for one recall does not cut a large delete short); after an error, deleting the
        same ids again is harmless.
        """
        _check_namespace(namespace)
        flt = validate_filter(filter)
        if ids is None and flt is None:
            raise ValueError("delete() needs ids or a filter; use delete_namespace() to empty one")
        if timeout is not None:
            _check_timeout(timeout)
        if ids is None:
            args = encode_json({"namespace": namespace, "filter": flt})
            return self._call(Op.DELETE, args=args, deadline=self._deadline(timeout)).n_results
        id_list = _check_ids(ids, None)
        head = b'{"namespace":' + encode_json(namespace) + b',"filter":' + encode_json(flt) + b',"ids":['
        # every request built (every id checked against the payload) before the first is sent:
        # an id that cannot fit raised after earlier requests had deleted their rows
        requests = list(self._id_requests(head, id_list))
        return sum(self._call(Op.DELETE, args=args, deadline=self._deadline(timeout)).n_results for args in requests)

    def delete_namespace(self, namespace: str, *, timeout: float | None = None) -> int:
        """Delete every record of ``namespace``; return how many."""
        _check_namespace(namespace)
        args = encode_json({"namespace": namespace, "all": True})
        return self._call(Op.DELETE, args=args, deadline=self._deadline(timeout)).n_results

    def count(
        self,
        namespace: str | None = None,
        *,
        filter: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Rows in ``namespace`` (all namespaces when None) matching ``filter``."""
        if namespace is not None:
            _check_namespace(namespace)
        flt = validate_filter(filter)
        if flt is not None and namespace is None:
            raise ValueError("count(filter=...) needs a namespace ('' is the default one)")
        args = encode_json({"namespace": namespace, "filter": flt})
        rep = self._call(Op.COUNT, args=args, deadline=self._deadline(timeout))
        return int(json.loads(rep.blob)["count"])

    def namespaces(self, prefix: str = "", *, timeout: float | None = None) -> dict[str, int]:
        """Every non-empty namespace (whose name starts with ``prefix``) with its row count.

        The sidecar selects by ``prefix`` (one that predates it sends every namespace, and
        the client selects)."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, not {type(prefix).__name__}")
        args = encode_json({"prefix": prefix}) if prefix else b""
        rep = self._call(Op.NAMESPACES, args=args, deadline=self._deadline(timeout))
        spaces: dict[str, int] = json.loads(rep.blob)
        return {n: c for n, c in spaces.items() if n.startswith(prefix)} if prefix else spaces

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The sidecar's counters: rows, requests by op and status, latency percentiles..."""
        rep = self._call(Op.STATS, deadline=self._deadline(timeout))
        out: dict[str, Any] = json.loads(rep.blob)
        out["client"] = {"reconnects": self.reconnects}
        return out

    # ------------------------------------------------------------------ internals
    def _id_requests(self, head: bytes, id_list: list[str]) -> Iterator[bytes]:
        """The JSON arguments ``head`` + ids + ``]}`` of as few requests as hold ``id_list``
        (in order) within a slot's payload; at least one, even for no ids."""
        room = self.header.payload_size - len(head) - 2
        enc = [encode_json(i) for i in id_list]
        start = 0
        while True:
            end, size = start, 0
            while end < len(enc) and size + len(enc[end]) + (end > start) <= room:
                size += len(enc[end]) + (end > start)
                end += 1
            if end == start and end < len(enc):
                raise ValueError(
                    f"ids[{start}] does not fit in a request with this namespace and filter (a slot "
                    f"payload holds {self.header.payload_size} bytes); start the sidecar "
                    "with a larger --payload-kb"
                )
            yield head + b",".join(enc[start:end]) + b"]}"
            start = end
            if start >= len(enc):
                return

    def _records(self, op: int, args: bytes, namespace: str, with_vectors: bool, deadline: float) -> list[Record]:
        rep = self._call(op, args=args, flags=Flag.WITH_VECTORS if with_vectors else 0, deadline=deadline)
        try:
            views, vecs = decode_docs_blob(rep.blob, self.dim, bool(rep.resp_flags & RespFlag.HAS_VECTORS))
            docs = [decode_doc(v) for v in views]
        except ProtocolDecodeError as e:
            raise ProtocolError(str(e)) from None
        if with_vectors and vecs is None:
            raise ProtocolError("sidecar did not return the vectors asked for")
        return [
            Record.from_doc(d, namespace, None if vecs is None else vecs[i])
            for i, d in enumerate(docs)
        ]

    def _deadline(self, timeout: float | None) -> float:
        if timeout is None:
            timeout = self.timeout
        else:
            _check_timeout(timeout)
        return time.monotonic() + timeout

    def _connect_now(self) -> _Conn:
        """Connect (lock held). Raises what connecting raises and arms the backoff."""
        if self._closed:
            raise KalosError("this KalosClient is closed")
        try:
            conn = _Conn.connect(self.name, self._dim)
        except (SidecarUnavailable, ProtocolError, PermissionDenied) as e:
            self._backoff = min(max(2 * self._backoff, _BACKOFF_MIN), _BACKOFF_MAX)
            self._next_attempt = time.monotonic() + self._backoff * random.uniform(0.8, 1.2)
            self._last_error = e
            raise
        if self._dim is None:
            self._dim = conn.header.dim
        if self._conn is not None:
            self.reconnects += 1
        self._conn = conn
        self._backoff = 0.0
        self._last_error = None
        return conn

    def _ensure_conn(self, deadline: float) -> _Conn:
        conn = self._conn
        if conn is not None and not conn.dead and self._pid == os.getpid():
            return conn
        with self._lock:
            if self._pid != os.getpid():
                self._forget_after_fork()
            conn = self._conn
            if conn is not None and not conn.dead:
                return conn
            if conn is not None:
                conn.close()
            now = time.monotonic()
            if now < self._next_attempt and self._last_error is not None:
                raise type(self._last_error)(
                    f"{self._last_error} (next reconnect attempt in "
                    f"{1000 * (self._next_attempt - now):.0f} ms)"
                )
            return self._connect_now()

    def _drop_conn(self, conn: _Conn) -> None:
        with self._lock:
            conn.dead = True
            self._bell = None
            if self._conn is conn:
                # Reconnect on the next call right away: a restart may already be up.
                self._next_attempt = 0.0
            self._lock.notify_all()

    def _acquire(self, conn: _Conn, deadline: float) -> _Slot:
        try:  # fast path: list.pop is atomic under the GIL
            return conn.free.pop()
        except IndexError:
            pass
        with self._lock:
            while True:
                if conn.dead:
                    if self._closed:  # (not an outage: an adapter must not count it as one)
                        raise KalosError(f"this KalosClient was closed during the call to sidecar {self.name!r}")
                    raise SidecarUnavailable(f"sidecar {self.name!r} went away")
                if not conn.free and any(s.pending for s in conn.owned):
                    self._recover_pending(conn)  # answered since they were abandoned?
                if not conn.free:
                    self._reclaim_lost(conn)  # (before claiming another of the segment's)
                if conn.free:
                    return conn.free.pop()
                if len(conn.owned) < self.max_slots:
                    slot = conn.claim()
                    if slot is not None:
                        if len(conn.owned) > 1:
                            self._arm_trim(_TRIM_AFTER)
                        return slot
                remaining = deadline - time.monotonic()
                if remaining <= 0 and len(conn.owned) >= self.max_slots and all(s.pending for s in conn.owned):
                    raise SidecarTimeout(
                        f"sidecar {self.name!r} has not answered this client's earlier requests, given up at "
                        f"their deadlines, and they hold all of its {len(conn.owned)} slots (max_slots): is "
                        "the sidecar paused or overloaded? see `kalos-sidecar stats`"
                    )
                if remaining <= 0 and len(conn.owned) >= self.max_slots:
                    raise SidecarBusy(
                        f"no free slot of this client's before the deadline: its calls to sidecar "
                        f"{self.name!r} (and requests of earlier calls a stall held up) hold all of "
                        f"its max_slots={self.max_slots} slots; make fewer calls at once, or a "
                        "client with a larger max_slots"
                    )
                if remaining <= 0:
                    raise SidecarBusy(
                        f"no free slot on sidecar {self.name!r} before the deadline: "
                        f"{conn.layout.n_slots} slots are all in use; start it with more --slots "
                        f"or use fewer concurrent clients (this one holds {len(conn.owned)})"
                    )
                self._waiters += 1
                try:
                    self._lock.wait(min(remaining, 0.002))
                except BaseException:
                    # an exception a signal handler raised inside Condition.wait, after it gave
                    # the lock up and before its try: the lock is no longer ours, and leaving the
                    # `with` raised "cannot release un-acquired lock" in place of the caller's
                    # KeyboardInterrupt; taken back here first
                    if not self._lock._is_owned():  # type: ignore[attr-defined]
                        self._lock.acquire()
                    raise
                finally:
                    self._waiters -= 1

    def _release(self, conn: _Conn, slot: _Slot) -> None:
        if slot.pending:
            return  # (out of circulation already: _recover_pending brings it back)
        state = slot.state[0]
        if state not in _SETTLED:  # (FREE too: never an owned slot's, but a sidecar before session 68 wrote
            # its state words through struct, which zeroes them first: FREE seen mid-write)
            # a request written and its answer not read: the call ended at its deadline, or
            # was left by an exception (KeyboardInterrupt, a signal handler's) while the
            # sidecar may still answer it; back in circulation now, the next request written
            # over it would meet that answer ("response sequence ... does not match").
            # Marked here, by the caller, and not before: another thread's _recover_pending
            # may take it back from then on, not while its caller holds it; and only
            # _recover_pending brings it back (read again here, the mark could already have
            # been cleared by it, and the slot put on the free list twice: two threads then
            # wrote their requests into one slot).
            slot.pending = slot.seq
            conn.recover = True  # (the next call brings it back, or _trim_idle: _recover_pending)
            self._bell = None  # (bell1 never looks at pending slots: recalls go by _recall_one)
            with self._lock:
                self._arm_trim(_TRIM_AFTER)
            return
        if state in _ANSWERED:  # an answer not read (a ProtocolError on it): ours to reuse
            slot.state[0] = SlotState.CLAIMED
        conn.free.append(slot)
        if self._waiters:
            with self._lock:
                self._lock.notify()

    def _arm_trim(self, after: float) -> None:
        """Have :func:`_trim_idle` look at this client's slots in ``after`` s (lock held),
        unless it is to already."""
        pid = os.getpid()
        if self._trim is not None and self._trim[0] == pid:
            return
        timer = threading.Timer(after, _trim_idle, (weakref.ref(self), after))
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # (no new thread: at interpreter exit, or at a thread limit)
            return  # the slots stay until the next call's _recover_pending, as before
        self._trim = (pid, timer)

    def _reclaim_lost(self, conn: _Conn) -> None:
        """Give back (as :meth:`_release` would) the slots no call holds that are neither
        free nor pending (lock held): those an exception raised by a signal handler (Ctrl-C's
        KeyboardInterrupt, a timeout decorator's) took out of circulation by landing between
        a slot's leaving the free list and the ``try`` that returns it, or at the entry of
        ``_release`` itself. Python cannot close such windows; this finds what they lost.
        A call holding a slot holds a reference to it (a frame's, or ``_fastpath``'s own), so a
        slot that only ``conn.owned`` refers to is held by none (one that a kept traceback, an
        interactive session's last one, still refers to waits until it goes)."""
        free = conn.free
        for s in conn.owned:
            if s.pending or s in free or sys.getrefcount(s) > _LONE_REFS:
                continue
            self.lost_slots += 1
            self._release(conn, s)

    def _recover_pending(self, conn: _Conn) -> None:
        """Bring back the slots whose abandoned requests the sidecar has answered since (lock
        held). One goes on the free list; the others go back to the sidecar's segment: they
        were claimed only because the earlier ones were held up (a stall of the sidecar makes a
        client claim up to ``max_slots``), and kept, they would leave other processes no slot.
        ``conn.recover`` stays set while one still waits for its answer."""
        conn.recover = False
        for s in list(conn.owned):
            if not s.pending:
                continue
            answered = s.state[0] in (SlotState.RESPONSE, SlotState.ERROR)
            if answered and Response.unpack(s.ctl).seq == s.pending:
                s.pending = 0
                s.state[0] = SlotState.CLAIMED
                if conn.free:
                    conn.give_back(s)
                else:
                    conn.free.append(s)
            else:
                conn.recover = True

    def _await_earlier_writes(self, conn: _Conn, op: int, deadline: float) -> None:
        """Before a write is sent: wait, within its deadline, for this client's earlier writes
        still in the sidecar's hands (given up at their deadlines, or left by an interrupt) to
        be answered. The sidecar takes waiting slots in slot order, so a later write in another
        slot could be done first: an upsert interrupted (Ctrl-C), then a delete of its id, and
        the id was back. (One given up before the sidecar took it is refused by the sidecar at
        its deadline, and answered so.) Raises :class:`SidecarTimeout` (this write not sent) when they are
        still unanswered at the deadline; the sidecar gone, they are done or lost, and a new
        one cannot take them after this write."""
        pause, rang = 0.0002, 0.0
        while True:
            with self._lock:
                self._recover_pending(conn)
                earlier = sum(1 for s in conn.owned if s.pending and _request_op(s) in _WRITES)
            if not earlier or conn.dead or not conn.sidecar_alive():
                return
            now = time.monotonic()
            if now - rang > 0.05:  # (one left by an interrupt may not have been posted for)
                _ipc.post(conn.bell)
                rang = now
            if now >= deadline:
                raise SidecarTimeout(
                    f"{OP_NAMES.get(op, op)}: not sent: {earlier} earlier write(s) of this client (left "
                    f"by an interrupt, or given up at a deadline once taken) are still unanswered by sidecar "
                    f"{self.name!r}, and this write could be done before them; is the sidecar paused or "
                    "overloaded?"
                )
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, 0.005)

    def _call(
        self,
        op: int,
        *,
        vectors: np.ndarray | None = None,
        args: bytes = b"",
        top_k: int = 0,
        n_items: int = 0,
        flags: int = 0,
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> _Reply:
        """One request and its answer, sent again once, on a new connection, if the sidecar
        was gone before it took it (:class:`_NotTaken`: a restart since this client's last
        call; nothing of the request was done, a write included)."""
        if deadline is None:
            deadline = self._deadline(timeout)
        try:
            return self._call_once(op, vectors, args, top_k, n_items, flags, deadline)
        except _NotTaken:
            if time.monotonic() >= deadline:
                raise
            return self._call_once(op, vectors, args, top_k, n_items, flags, deadline)

    def _call_once(self, op: int, vectors: np.ndarray | None, args: bytes, top_k: int, n_items: int, flags: int,
                   deadline: float) -> _Reply:  # fmt: skip
        conn = self._ensure_conn(deadline)
        if flags & Flag.ARENA_ENTRIES and not conn.arena_flags & Flag.ARENA_ENTRIES:
            # asked with another connection's flags (a restart replaced it meanwhile) and this
            # sidecar is older than v1.3: generations, which it knows (the answer says which)
            flags &= ~Flag.ARENA_ENTRIES
        if conn.recover:
            with self._lock:
                self._recover_pending(conn)
        # (the slots themselves, not conn.recover: another thread's _recover_pending clears
        # that flag before it looks at them, so read without the lock it could say no pending
        # write while one was, and this write overtook it)
        if op in _WRITES and any(s.pending for s in conn.owned):
            self._await_earlier_writes(conn, op, deadline)
        vec_len = 0 if vectors is None else vectors.size * 4
        if align8(vec_len) + len(args) > conn.layout.payload_size:
            raise ValueError(
                f"this {OP_NAMES.get(op, op)} request needs {align8(vec_len) + len(args)} bytes "
                f"(vectors {vec_len}, arguments {len(args)}: the namespace, filter or ids), more "
                f"than a slot's payload of {conn.layout.payload_size}; shorten the filter, or start "
                "the sidecar with a larger --payload-kb"
            )
        slot = self._acquire(conn, deadline)
        try:
            if vectors is not None:
                slot.payload_f32[: vectors.size] = vectors.reshape(-1)
            a = align8(vec_len)
            if args:
                slot.payload[a : a + len(args)] = args
            rep = self._roundtrip(conn, slot, op, flags, top_k, n_items, vec_len, len(args), deadline)
            if rep.status != Status.OK:
                raise _status_error(rep.status, rep.blob, op)
        finally:
            self._release(conn, slot)
        if op != Op.RECALL:  # (a recall maps the current version itself, see _arena)
            conn.drop_stale_arena()
            if (plan := self._bell) is not None and plan[3] is not conn.mapped_arena():
                self._bell = None  # (the plan would keep the old version mapped)
        return rep

    def _roundtrip(
        self, conn: _Conn, slot: _Slot, op: int, flags: int, top_k: int, n_items: int,
        vec_len: int, args_len: int, deadline: float, sent: tuple[int, int, bool, bool] | None = None,
    ) -> _Reply:  # fmt: skip
        """Write the request (unless ``sent``: the sequence number of a request already
        written by ``_fastpath``, how long it has waited (ns), whether it was a DOORBELL one
        (a REQUEST one was posted for), and whether its answer is there already), wait for
        the answer, read it, and continue it while it says MORE."""
        chunks: list[bytes] = []
        rows = scores = None
        while True:
            waited, answered = 0, False
            if sent is not None:
                (seq, waited, bell, answered), sent = sent, None
            else:
                if _ipc.posts(slot.sem):  # posts left by responses we saw by spinning (sem_getvalue)
                    conn.drain_slot(slot)
                slot.seq = (slot.seq + 1) & 0xFFFFFFFFFFFFFFFF
                seq = slot.seq
                REQUEST_STRUCT.pack_into(slot.ctl, REQUEST_OFFSET, seq, op, flags, top_k, n_items,
                                         vec_len, args_len, int(deadline * 1e9))  # fmt: skip
                # the GPU's resident kernel takes batch-1 recalls of the default namespace whose
                # documents come from the arena, and of a namespace or a filter where the header
                # says it serves them (ringable_args, v1.5/v1.6; it hands back one it does not serve);
                # it polls the state word (no semaphore)
                bell = (op == Op.RECALL and flags | Flag.ARENA_ENTRIES == _KERNEL_FLAGS and n_items == 1
                        and top_k <= conn.doorbell_k())  # fmt: skip
                if bell and args_len:  # (the args' first two bytes: the name's length)
                    at = align8(vec_len)
                    name_len = int.from_bytes(slot.payload[at : at + 2], "little")
                    bell = bool(conn.doorbell_spaces()) and ringable_args(args_len, name_len, conn.doorbell_args())
                if bell:
                    slot.state[0] = SlotState.DOORBELL
                else:
                    slot.state[0] = SlotState.REQUEST
                    _ipc.post(conn.bell)
            t_sent = time.monotonic_ns() - waited
            resp = (self._check_seq(slot, seq) if answered
                    else self._wait(conn, slot, seq, deadline, recall=op == Op.RECALL, doorbell=bell))  # fmt: skip
            assert resp is not None  # (_wait with check=True: the words, checked)
            if op == Op.RECALL:  # writes wait for an fsync: they say nothing about recall times
                self._observe_wait(time.monotonic_ns() - t_sent)
            if resp.resp_len > conn.layout.blob_size:
                raise ProtocolError(f"response length {resp.resp_len} exceeds the slot")
            if rows is None and op == Op.RECALL and resp.status == Status.OK:
                m = n_items * top_k
                rows, scores = slot.rows[:m].copy(), slot.scores[:m].copy()
            chunks.append(bytes(slot.blob[: resp.resp_len]))
            slot.state[0] = SlotState.CLAIMED
            if not resp.resp_flags & RespFlag.MORE or resp.status != Status.OK:
                blob = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                return _Reply(resp.status, resp.n_results, resp.resp_flags, rows, scores, blob)
            op, flags, top_k, n_items, vec_len, args_len = Op.CONTINUE, 0, 0, 0, 0, 0
            if len(chunks) > 1 << 16:
                raise ProtocolError("response continues without end")

    def _wait(self, conn: _Conn, slot: _Slot, seq: int, deadline: float, *, recall: bool,
              doorbell: bool = False, check: bool = True) -> Response | None:  # fmt: skip
        """Wait for the answer to ``seq``, in up to three phases.

        * Answers that typically come within two spin windows (a ping, a GPU index): spin on
          the state word for ``spin_ns`` (for a GPU sidecar's recalls: or across the expected
          answer, whichever is longer), then block.
        * A GPU sidecar's recalls that typically come within ``_FULL_SPIN_WINDOWS`` spin
          windows (``recall_batch`` of 64 at 1M rows: ~750-930 µs), while at most
          ``_SPIN_CROWD`` requests wait (ours included; a quarter of the cores): spin across
          the expected answer too, plus a margin, then block. Sleeping through most of such a
          wait made the call's own Python after it (and the next call's before it) slow: on
          the H200 host a 64-query batch took 1044 µs p50 with a sleep and 889 µs spinning, of
          which the wait itself 749 and 742 µs (S11-4; four of five sessions' runs alike).
        * Recalls that typically take longer (a CPU index over many rows: milliseconds), and a
          GPU sidecar's while more than ``_SPIN_CROWD`` but at most ``_CORES`` requests wait:
          spinning through the whole wait would take a core from the sidecar, and blocking
          through it costs a wake-up when the answer comes (on a small VM ~0.1 ms p50, over
          1 ms p90). So block on the semaphore through most of the expected wait (a timed
          wait: an early answer still wakes us), spin across the expected completion for a
          bounded window, and block again if the answer is late (see ``_sleep_then_spin``).
          Other ops, whose duration the typical recall wait says nothing about, just block.
        * A GPU sidecar's crowd larger than the cores (more than ``_CORES`` requests waiting,
          ours included: if each spun, they would oversubscribe the cores), for answers not
          expected within two spin windows: block through the whole wait. The answer comes
          with whichever batch the request joins, a pass or two of the device later; no spin
          window placed around the typical wait catches it reliably, and 32 clients spinning
          around ~800 µs waits on 16 cores took the cores that the serve loop and the clients
          just woken needed (on the H200 host, clients spinning 50 µs around such waits
          instead of 300 made 32 processes' recalls ~1k/s faster and their p99 0.33 ms
          shorter, S32-4). A smaller crowd leaves cores to spin on and sleeps, then spins, as
          before; so do a CPU sidecar's clients, whose payoff rule already stops spins that
          miss (nothing measured there says blocking would be better).
        * With ``spin_ns == 0``: block only.

        Blocking always checks the deadline and, every few ms, that the sidecar is alive.
        Spinning is bounded: it never lasts more than ``_FULL_SPIN_WINDOWS + _MAX_MARGIN_SPINS``
        spin windows per call (the spin through an uncrowded GPU recall: the expected wait plus
        a margin; that spin's hits and misses do not move ``_spin_payoff``, which judges only
        the spins after a sleep). A response seen by spinning leaves its semaphore post behind; the next
        round trip drains it.

        Returns the response words, checked against ``seq``; with ``check=False`` None (the
        caller reads and checks them itself: ``_fastpath.answer1``).
        """
        t_sent = time.monotonic_ns()
        typical = self._typical_wait_ns
        if doorbell:
            answered = self._spin_doorbell(conn, slot, deadline)
        elif self.spin_ns and typical < 2 * self.spin_ns:
            # across the expected answer only when the search does not need our core: a CPU
            # sidecar's search runs on the cores a spinning client would take
            extend = recall and conn.header.backend != "cpu"
            answered = self._spin(slot, t_sent + self._short_spin_ns(typical, extend))
        elif self.spin_ns and recall and conn.header.backend == "cpu":
            answered = self._sleep_then_spin(conn, slot, seq, deadline, t_sent, typical)
        elif self.spin_ns and recall and (waiting := conn.waiting_requests()) <= _CORES:
            if waiting <= _SPIN_CROWD and typical <= _FULL_SPIN_WINDOWS * self.spin_ns:
                answered = self._spin(slot, min(t_sent + typical + self._margin_ns(typical), int(deadline * 1e9)))
            else:
                tight = self._crowd_margin(typical) if self._crowd_predict else ()
                answered = self._sleep_then_spin(conn, slot, seq, deadline, t_sent, typical, *tight)
        elif self.spin_ns and recall and self._crowd_predict and typical:  # a crowd, KALOS_CROWD_WAIT=predict
            answered = self._sleep_then_spin(conn, slot, seq, deadline, t_sent, typical, *self._crowd_margin(typical))
        else:  # other ops, spin_us=0, or a GPU sidecar's crowd larger than the cores: block
            answered = False
        if not answered:
            self._block(conn, slot, seq, deadline)
        return self._check_seq(slot, seq) if check else None

    def _short_spin_ns(self, typical_ns: int, extend: bool) -> int:
        """How long to spin for an answer expected within two spin windows: one window, or,
        with ``extend``, the expected wait plus an eighth when that is longer. (Spinning one
        window only, an answer expected at 1.7 windows, a 1M-row GPU recall, was always
        caught by the blocking wait's wake-up instead: ~75-100 µs late on the H200 host. Not
        for a CPU sidecar: on the 2-core dev VM the longer spin took a core from its search,
        and 1k-row recalls went from 430 to 750 µs.)"""
        if not extend:
            return self.spin_ns
        return max(self.spin_ns, typical_ns + (typical_ns >> 3))

    def _sleep_then_spin(self, conn: _Conn, slot: _Slot, seq: int, deadline: float, t_sent: int,
                         typical: int, margin: int | None = None, slack: int = 0) -> bool:  # fmt: skip
        """Sleep until ``margin`` (default :meth:`_margin_ns`) and ``slack`` (the timed wait's
        own lateness) before the expected answer, then spin until ``margin`` after it. True
        when the answer came; False: it is late, the caller blocks for it.

        The spin must pay: ``_spin_payoff`` is the share of recent spins that caught their
        answer (a moving average, 1/8 per spin). With several clients the answers come in
        batches whose timing a client cannot predict: the spins miss, and each miss took a
        core from the sidecar for nothing (measured: 4 client processes on 2 cores made 10%
        fewer recalls). Below one half the call blocks instead, trying a spin again every
        ``_SPIN_PROBE_EVERY`` calls to notice when spinning pays again.
        """
        self._long_waits += 1
        if self._spin_payoff < 0.5 and self._long_waits % _SPIN_PROBE_EVERY:
            return False
        if margin is None:
            margin = self._margin_ns(typical)
        if self._block(conn, slot, seq, deadline, until_ns=t_sent + typical - margin - slack):
            return True  # answered while we slept: early, but the spin cost nothing
        hit = self._spin(slot, min(t_sent + typical + margin, int(deadline * 1e9)))
        self._spin_payoff += ((1.0 if hit else 0.0) - self._spin_payoff) / 8
        return hit

    @staticmethod
    def _crowd_margin(typical_ns: int) -> tuple[int, int]:
        """KALOS_CROWD_WAIT=predict's margin either side of the expected answer and the timed
        wait's lateness to sleep short by (see :data:`_CROWD_MARGIN_NS`)."""
        return max(typical_ns >> 4, _CROWD_MARGIN_NS), _TIMER_SLACK_NS

    def _margin_ns(self, typical_ns: int) -> int:
        """How long before the expected answer to stop sleeping (and after it to keep spinning).

        An eighth of the expected wait, so that the usual jitter of a long search falls inside
        the spin, and at least one spin window (a timed sleep oversleeps by ~0.1 ms), but at most
        ``_MAX_MARGIN_SPINS`` spin windows: a slow answer is waited for by blocking.
        """
        return min(max(typical_ns >> 3, self.spin_ns), _MAX_MARGIN_SPINS * self.spin_ns)

    def _spin_doorbell(self, conn: _Conn, slot: _Slot, deadline: float) -> bool:
        """Wait for the GPU kernel's answer to a DOORBELL request by spinning (it posts no
        semaphore). False: the answer is not there yet and the caller blocks for it: the
        deadline passed, the sidecar is gone (checked every millisecond), or the request came
        back as a REQUEST (checked before each 50 µs of spinning: the kernel declined it), which the sidecar
        answers and posts for (we post its doorbell, since we did not). If the header says the
        kernel stopped while our request still waits for it, the sidecar answers it instead:
        we post its doorbell (it may be asleep), and block only if nobody has taken it ~2 ms
        later (while it is BUSY we spin on: the kernel may have taken it as it stopped, and
        the kernel posts nothing)."""
        state = slot.state
        done = (SlotState.RESPONSE, SlotState.ERROR)
        end = int(deadline * 1e9)
        next_check = time.monotonic_ns() + 1_000_000
        posted = 0
        while True:
            # checked before each spin, not only after: the C path hands over at once when the
            # kernel hands the request back or has stopped, and spinning first cost 50 µs
            if state[0] in done:
                return True
            if state[0] == SlotState.REQUEST:
                _ipc.post(conn.bell)
                return False
            if not posted and state[0] == SlotState.DOORBELL and not conn.doorbell_k():
                _ipc.post(conn.bell)
                posted = time.monotonic_ns()
            now = time.monotonic_ns()
            if posted and now - posted > _HANDOVER_NS and state[0] == SlotState.DOORBELL:
                return False
            if now >= end:
                return state[0] in done
            if now >= next_check:
                if not conn.sidecar_alive():
                    return state[0] in done
                next_check = now + 1_000_000
            if self._spin(slot, min(now + 50_000, end)):
                return True

    @staticmethod
    def _spin(slot: _Slot, until_ns: int) -> bool:
        """Busy-poll the slot's state word until ``until_ns``. True when the answer is there.

        (It does not ``sched_yield`` between polls: measured, yielding made recalls against a
        sidecar whose search uses every core ~0.8 ms slower, not faster.)"""
        state = slot.state
        done = (SlotState.RESPONSE, SlotState.ERROR)
        while True:
            if state[0] in done:
                return True
            if time.monotonic_ns() > until_ns:
                return False

    def _block(self, conn: _Conn, slot: _Slot, seq: int, deadline: float,
               until_ns: int | None = None) -> bool:  # fmt: skip
        """Block on the slot's semaphore until the answer is there (True) or, given
        ``until_ns``, until then (False). Raises SidecarTimeout at the deadline and
        SidecarUnavailable at once when the sidecar's lock is free (it died) or it says it
        stops. A stopping sidecar answers what it holds first, then says so: the slot is read
        again after that check, so that an answer written while this thread was between its
        wait and the check is not taken for a lost one (on a loaded host that lost a recall
        the carousel held to "stopped during the call", 2-4 runs in 10 of
        tests/integration/test_crowd_serve.py, session 41)."""
        state = slot.state
        done = (SlotState.RESPONSE, SlotState.ERROR)
        while True:
            remaining = deadline - time.monotonic()
            if state[0] in done:
                return True
            if remaining <= 0:
                alive = conn.sidecar_alive()
                if state[0] in done:  # (as below: answered just before it said it stops)
                    return True
                if not alive:
                    self._drop_conn(conn)
                    raise _gone(self.name, state[0], deadline)
                raise SidecarTimeout(
                    f"sidecar {self.name!r} did not answer {OP_NAMES.get(_op_of(slot), '?')} "
                    "before the deadline (is it paused or overloaded? see `kalos-sidecar stats`)"
                )
            tick = min(remaining, _LIVENESS_TICK)
            if until_ns is not None:
                left = (until_ns - time.monotonic_ns()) / 1e9
                if left <= 0:
                    return False
                tick = min(tick, left)
            got = conn.wait_slot(slot, tick)
            if got is None or (not got and conn.closing):  # (closed under this call: close(), a reconnect)
                if state[0] in done:
                    return True
                if self._closed:
                    raise KalosError(f"this KalosClient was closed during the call to sidecar {self.name!r}")
                raise _gone(self.name, state[0], deadline)  # (another thread's reconnect closed it)
            if not got and not conn.sidecar_alive():
                if state[0] in done:  # answered before it said it stops, posted after our wait gave up
                    return True
                self._drop_conn(conn)
                raise _gone(self.name, state[0], deadline)

    def _observe_wait(self, waited_ns: int) -> None:
        """Learn the typical recall wait: an exponential moving average (1/8 per answer).

        A sample is counted as at most twice the current average, so that one slow answer
        (a page fault, a descheduled sidecar) neither switches spinning off nor pushes the next
        wake-ups late; a lasting slowdown still shows within ~20 answers.
        """
        self._typical_wait_ns = _ewma_wait(self._typical_wait_ns, waited_ns)

    @staticmethod
    def _check_seq(slot: _Slot, seq: int) -> Response:
        resp = Response.unpack(slot.ctl)
        if resp.seq != seq:
            raise ProtocolError(f"response sequence {resp.seq} does not match request {seq}")
        return resp


def _lone_refs() -> int:
    """``sys.getrefcount`` of an object that only a list refers to, seen as
    :meth:`KalosClient._reclaim_lost` sees a slot (the count differs between versions)."""
    owned = [object()]
    for s in owned:
        return sys.getrefcount(s)
    raise AssertionError


_LONE_REFS: Final = _lone_refs()
_ANSWERED: Final = frozenset({SlotState.RESPONSE, SlotState.ERROR})
_SETTLED: Final = frozenset({SlotState.CLAIMED, *_ANSWERED})  # (an owned slot's states with no request in flight)
_WRITES: Final = frozenset({Op.UPSERT, Op.DELETE})


def _request_op(slot: _Slot) -> int:
    """The op of the request last written into ``slot``."""
    return int(REQUEST_STRUCT.unpack_from(slot.ctl, REQUEST_OFFSET)[1])


class _NotTaken(SidecarUnavailable):
    """The sidecar was gone before it took the request: its slot still says REQUEST or
    DOORBELL (the sidecar marks a request BUSY before it does anything with it), so nothing of
    it was done and it may be sent again, to whichever sidecar holds the name now, by
    ``deadline`` (the call's). What a client meets on its first call after a restart: its
    connection is to the old segment."""

    def __init__(self, message: str, deadline: float) -> None:
        super().__init__(message)
        self.deadline = deadline

    def __reduce__(self) -> tuple[Any, ...]:  # (copied and pickled with its deadline, as a degrader's last error)
        return (type(self), (str(self), self.deadline), self.__dict__)


def _gone(name: str, state: int, deadline: float) -> SidecarUnavailable:
    """The error for a sidecar found gone while a request waited in a slot in ``state``."""
    if state in (SlotState.REQUEST, SlotState.DOORBELL):
        return _NotTaken(f"sidecar {name!r} was gone before it took the request (stopped, or restarted)", deadline)
    return SidecarUnavailable(f"sidecar {name!r} stopped during the call")


def _op_of(slot: _Slot) -> int:
    return int(slot.state[4])  # the op word (byte 16)


def _status_error(status: int, blob: bytes, op: int) -> KalosError:
    msg = blob.decode(errors="replace") or f"status {status}"
    opname = OP_NAMES.get(op, str(op))
    if status == Status.CAPACITY:
        return CapacityError(f"{opname}: {msg}")
    if status == Status.STORE:
        return StoreError(f"{opname}: {msg}")
    if status == Status.DEADLINE:
        return SidecarTimeout(f"{opname}: {msg}")
    if status == Status.STOPPING:
        return SidecarUnavailable(f"{opname}: {msg}")
    if status == Status.INTERNAL:
        return KalosError(f"{opname}: sidecar internal error: {msg}")
    return RequestRejected(f"{opname}: {msg}")


# --------------------------------------------------------------------------------------------
# Argument checks (each names the argument it checks)


def _check_timeout(timeout: Any) -> None:
    # (finite: a deadline of inf cannot be a time in nanoseconds; a day is the longest)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= 86_400:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, at most 86400")


def _check_k(k: Any, max_k: int) -> None:
    if not isinstance(k, int | np.integer) or isinstance(k, bool) or not 1 <= k <= max_k:
        raise ValueError(f"k={k!r} must be an int in [1, {max_k}] (this sidecar's --max-k)")


def _check_namespace(namespace: Any) -> None:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    if len(namespace.encode("utf-8", "surrogatepass")) > 255:
        raise ValueError("namespace is longer than 255 bytes")
    _utf8(namespace, "namespace")


def _utf8(s: str, argument: str) -> bytes:
    try:
        return s.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{argument} is not valid UTF-8 text (lone surrogate at {e.start})") from None


def _check_ids(ids: Iterable[str] | None, n: int | None) -> list[str]:
    if ids is None:
        assert n is not None
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(ids, str):
        raise TypeError("ids must be a list of strings, not one string")
    id_list = list(ids)
    if n is not None and len(id_list) != n:
        raise ValueError(f"ids has {len(id_list)} entries but vectors has {n}")
    for i, x in enumerate(id_list):
        if not isinstance(x, str) or not x:
            raise ValueError(f"ids[{i}]={x!r} must be a non-empty string")
        if len(_utf8(x, f"ids[{i}]")) > MAX_ID_BYTES:
            raise ValueError(f"ids[{i}] is longer than {MAX_ID_BYTES} bytes")
    return id_list


def _check_texts(texts: Sequence[str | None] | None, n: int) -> list[str]:
    if texts is None:
        return [""] * n
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string")
    out = list(texts)
    if len(out) != n:
        raise ValueError(f"texts has {len(out)} entries but vectors has {n}")
    for i, t in enumerate(out):
        if t is None:  # a vector-only row (stored, and returned, as "")
            out[i] = ""
            continue
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be a str or None, got {type(t).__name__}")
        if not t:
            raise ValueError(
                f"texts[{i}] is empty; store text, or give None (or texts=None) for vector-only rows"
            )
        _utf8(t, f"texts[{i}]")
    return out


#: seconds a client's extra slots (all but one) may sit idle before it gives them back
_TRIM_AFTER: Final = 0.2


def _trim_idle(ref: weakref.ref[KalosClient], after: float) -> None:
    """A timer's look at a client holding more than one slot (claimed for calls made at once,
    or left with requests a stall held up): where none is in use, every free slot but one
    goes back to the sidecar's segment, and the held-up ones whose answers came meanwhile
    with them. Without it a client kept every slot it ever claimed until its next call (two
    idle clients after a burst of 8 held all 16 of a sidecar's slots: other processes, and
    ``kalos-sidecar status``, got SidecarBusy). While slots stay in use or held up it looks
    again, at growing intervals (up to 2 s)."""
    client = ref()
    if client is None:
        return
    with client._lock:
        client._trim = None
        conn = client._conn
        if conn is None or conn.dead or conn.closing or client._pid != os.getpid():
            return
        if conn.recover:
            client._recover_pending(conn)
        client._reclaim_lost(conn)
        held_up = sum(1 for s in conn.owned if s.pending)
        if len(conn.owned) - held_up == len(conn.free) and not client._waiters:  # (none in use)
            while len(conn.free) > 1:
                try:
                    slot = conn.free.pop(0)  # (the least recently used; atomic, as the calls' pops)
                except IndexError:
                    break
                conn.give_back(slot)
            if len(conn.owned) <= 1:
                return
            after = _TRIM_AFTER
        client._arm_trim(min(2 * after, 2.0))


def check_metadatas(metadatas: Sequence[Mapping[str, Any] | None] | None) -> None:
    """Raise what :meth:`KalosClient.upsert` raises for these metadatas (not JSON, a
    non-string key, an integer beyond float64), without a sidecar: for a caller about to start
    one for them."""
    if metadatas is not None:
        _encode_metadatas(metadatas, len(metadatas))


def as_stored(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``metadata`` as the sidecar returns it: through JSON, dates and numpy numbers converted
    (:func:`~kalos_retrievers.protocol.json_value`), tuples as lists. Raises what JSON
    encoding raises."""
    return json.loads(METADATA_ENCODER.encode(dict(metadata)))


def _encode_metadatas(metadatas: Sequence[Mapping[str, Any] | None] | None, n: int) -> list[bytes]:
    if metadatas is None:
        return [b"{}"] * n
    metas = list(metadatas)
    if len(metas) != n:
        raise ValueError(f"metadatas has {len(metas)} entries but vectors has {n}")
    out = []
    for i, m in enumerate(metas):
        if m is None:
            out.append(b"{}")
            continue
        if not isinstance(m, Mapping):
            raise TypeError(f"metadatas[{i}] must be a dict, got {type(m).__name__}")
        for key, value in m.items():
            if not isinstance(key, str):
                raise ValueError(f"metadatas[{i}] has a non-string key {key!r}")
            if type(value) is int and abs(value) > _FLOAT_MAX:  # (the sidecar's columns are float64)
                raise ValueError(f"metadatas[{i}][{key!r}] is an integer beyond float64's range")
        if nests_deeper(dict(m)):  # (any Mapping: the top level is a dict once sent)
            raise ValueError(f"metadatas[{i}] nests deeper than {MAX_METADATA_DEPTH} levels of dicts and lists")
        try:
            out.append(METADATA_ENCODER.encode(dict(m)).encode())
        except UnicodeEncodeError:  # (a ValueError: caught before the clause below)
            raise ValueError(f"metadatas[{i}] has text that is not valid UTF-8 (a lone surrogate)") from None
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"metadatas[{i}] is not JSON-serializable ({e}); store strings, numbers, "
                "booleans, None, lists and dicts of those (dates and numpy numbers are converted)"
            ) from None
    return out

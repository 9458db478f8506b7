"""Vector index backends: the interface, and the CPU (numpy) implementation.

An index stores one vector per *row* (rows are assigned by :class:`~.rows.RowTable`) plus the
row's namespace id, and answers exact top-k searches. Vectors arrive already normalized for
the cosine metric, so every backend computes inner products; L2 is derived from inner
products and norms. Scores are similarities, higher is better: cosine, inner product, or the
negated Euclidean distance.

The GPU backend (``index_gpu.py``) implements the same interface and adds a zero-copy path that
reads queries from, and writes results to, the shared-memory slot itself.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np

from kalos_retrievers.protocol import Metric

from . import blas


class IndexCapacityError(Exception):
    """The index cannot grow (out of host or device memory, or over its configured limit).
    Raised before anything is committed; the sidecar keeps serving."""


class FatalDeviceError(Exception):
    """The device is in a sticky error state: the sidecar must exit (non-zero) and be restarted;
    serving errors forever would be worse."""


class IndexOutOfStep(FatalDeviceError):
    """A write the store of record committed could not be applied to the row table or the
    index (out of memory, a bug): they no longer say what the store does, and serving on would
    answer from rows it has not got, or miss rows it has. The sidecar exits (1) so that a
    supervisor restarts it, and the index reloads from the store."""


@dataclass(frozen=True)
class SlotSpec:
    """Where one request's queries are and where its results go, inside the shared segment.

    The views are numpy arrays over the segment (for backends that compute on the host); the
    addresses are the same places as raw pointers (for backends that read and write them from
    the device, after the segment was registered with it). ``rows``/``scores`` are (n, k_req):
    query j's results start at column 0 of row j, whatever k' is finally returned.
    """

    queries: np.ndarray  # (n, dim) float32 view
    rows: np.ndarray  # (n, k_req) int32 view
    scores: np.ndarray  # (n, k_req) float32 view
    q_addr: int
    rows_addr: int
    scores_addr: int


class BellScope(NamedTuple):
    """A scope the resident kernel serves besides the default namespace: the args a client
    writes for its recalls (:func:`~kalos_retrievers.protocol.encode_recall_args` of a
    namespace and an optional filter, exactly as clients send them: the kernel compares them
    byte for byte), the namespace's id, and for a filter the rows it keeps (ascending, below
    the rows' high-water mark; None: no filter, the whole namespace) as they were after the row
    table's ``seq``-th change (-1: not said). ``whole``: there is no filter, and ``rows`` are
    the namespace's every row (:meth:`Index.wants_rows`): served as the namespace alone where
    the index makes no list of them."""

    args: bytes
    ns_id: int
    rows: np.ndarray | None = None
    seq: int = -1
    whole: bool = False


class Index(abc.ABC):
    """Exact top-k over rows [0, high). Not thread-safe: the dispatcher thread owns it."""

    name: str = "?"
    dtype: str = "float32"

    def __init__(self, dim: int, metric: int) -> None:
        self.dim = dim
        self.metric = metric
        self.capacity = 0

    @abc.abstractmethod
    def reserve(self, capacity: int) -> None:
        """Make room for rows [0, capacity)."""

    @abc.abstractmethod
    def set_rows(self, rows: np.ndarray, vectors: np.ndarray, ns: np.ndarray) -> None:
        """Store ``vectors[i]`` (float32) at ``rows[i]`` in namespace ``ns[i]``."""

    @abc.abstractmethod
    def clear_rows(self, rows: np.ndarray) -> None:
        """Tombstone rows: they are never returned again until set."""

    @abc.abstractmethod
    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move rows (compaction); ``dst`` rows are empty."""

    @abc.abstractmethod
    def search(
        self,
        queries: np.ndarray,
        k: int,
        high: int,
        ns: int,
        candidates: np.ndarray | None,
        dense: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` rows for each query, best first.

        Args:
            queries: (q, dim) float32 (raw: the backend normalizes them for cosine).
            k: results wanted; at most the number of eligible rows.
            high: rows >= high are empty.
            ns: namespace id; only rows of it are eligible.
            candidates: if given, only these rows (ascending, all in ``ns``) are eligible.
            dense: every row in [0, high) is in ``ns`` (lets the backend skip the check).

        Returns:
            rows (q, k) int32 and scores (q, k) float32.
        """

    @abc.abstractmethod
    def vectors(self, rows: np.ndarray) -> np.ndarray:
        """The stored vectors of ``rows`` as float32 (n, dim)."""

    def search_slots(
        self, specs: list[SlotSpec], k: int, high: int, ns: int,
        candidates: np.ndarray | None, dense: bool,
    ) -> None:  # fmt: skip
        """Answer several requests at once, reading queries from and writing results into their
        slots. This host implementation gathers the queries and calls :meth:`search`; the GPU
        backend overrides it with a zero-copy launch."""
        queries = specs[0].queries if len(specs) == 1 else np.concatenate([s.queries for s in specs])
        rows, scores = self.search(queries, k, high, ns, candidates, dense)
        at = 0
        for s in specs:
            n = len(s.queries)
            s.rows[:, :k] = rows[at : at + n]
            s.scores[:, :k] = scores[at : at + n]
            at += n

    def launch_slots(
        self, specs: list[SlotSpec], k: int, high: int, ns: int,
        candidates: np.ndarray | None, dense: bool, behind: bool = False,
    ) -> None:  # fmt: skip
        """:meth:`search_slots`, leaving the wait for the results to :meth:`finish_slots` where
        the backend can (a device search runs while the host answers the previous batch).
        This default searches synchronously. ``behind``: queue the search behind the one left
        running, without waiting for it (only where :meth:`queues_behind` said so)."""
        if behind:
            raise RuntimeError(f"{type(self).__name__} does not queue searches behind each other")
        self.search_slots(specs, k, high, ns, candidates, dense)

    # Whether a batch queued behind another is best launched from its members' slot numbers
    # (:meth:`launch_behind_slots`) than from their specs: the GPU index with its C launch.
    queues_from_slots = False

    def launch_behind_slots(self, slots: list[int], table: np.ndarray, k: int, high: int, ns: int) -> None:
        """:meth:`launch_slots` with ``behind=True`` for one query per slot of ``slots``, whose
        query, rows and scores addresses are row ``slot`` of ``table`` (u64); the rows below
        ``high`` in namespace ``ns`` (NS_ANY: all of them). Only where :meth:`queues_behind`
        said so; this default never queues."""
        raise RuntimeError(f"{type(self).__name__} does not queue searches behind each other")

    def finish_slots(self) -> None:  # noqa: B027 - optional hook
        """Wait until the oldest :meth:`launch_slots` left running has written its results."""

    def queues_behind(self, n: int, k: int, high: int) -> bool:
        """Whether a batch of ``n`` queries (``k`` results each over rows below ``high``, no
        filter mask) can be launched with ``behind=True`` now: queued behind the search left
        running, to start on the device the moment that one ends (no host gap between them).
        :meth:`finish_slots` then finishes the two in launch order. This default: never."""
        return False

    def pending_done(self) -> bool:
        """Whether the search left running has finished on the device (False where unknown)."""
        return False

    def wants_rows(self, count: int, high: int) -> bool:
        """Whether a search of a namespace that holds ``count`` of the rows below ``high`` (not
        all of them) is best given the namespace's rows as ``candidates`` rather than its id
        alone: the service then keeps that list between searches (``Service.eligible_for``)
        and hands it to every search of the namespace. This default: never."""
        return False

    @property
    def defers(self) -> bool:
        """Whether :meth:`launch_slots` of a batch returns before its search is done (so the
        dispatcher can answer the previous batch meanwhile)."""
        return False

    def attach_segment(self, mm: Any) -> None:  # noqa: B027 - optional hook
        """Called when a segment is published (GPU: register it with the device)."""

    def arena_moved(self, arena: Any) -> None:  # noqa: B027 - optional hook
        """The document arena moved to a new version (``arena``; None: it was dropped)."""

    # Whether searches run on the host, synchronously, with no device and no resident kernel:
    # the dispatcher then answers a lone batch-1 recall on its short path (Dispatcher._lone).
    host_search = False

    # A resident device kernel that answers batch-1 recalls itself (the GPU backend's
    # doorbell_topk); the CPU backend has none. doorbell_k: the largest k it answers (0: none).
    doorbell_k = 0
    doorbell_running = False
    # how many scopes besides the default namespace it can serve at once (0: the default one
    # only), the longest args it compares with theirs where it serves filters too (0: namespaces
    # alone, within protocol.DOORBELL_ARGS_MAX bytes), and the args of the scopes it serves
    # while it runs (or served when it last ran)
    doorbell_spaces = 0
    doorbell_args = 0
    bell_served_spaces: tuple[bytes, ...] = ()
    # called with True when the kernel has started and with False before it stops (the
    # server publishes it in the header: clients ring the kernel only while it runs)
    on_doorbell: Callable[[bool], None] | None = None

    def enable_doorbell(self, layout: Any, arena: Any) -> int:
        return 0

    def wants_arena(self) -> bool:
        """Whether this index will answer recalls whose documents clients read from the arena."""
        return False

    def pause_doorbell(self) -> None:  # noqa: B027 - optional hook
        """Stop the resident kernel before the host works on the device or the rows."""

    def resume_doorbell(self, high: int, ns: int, spaces: Sequence[BellScope] = (),  # noqa: B027
                        touched_since: Callable[[int], np.ndarray | None] | None = None) -> None:  # fmt: skip
        """Start the resident kernel again over rows [0, high) of namespace id ``ns`` (the
        default namespace's), serving also the scopes ``spaces`` (at most
        :attr:`doorbell_spaces` of them). ``touched_since(seq)``: the rows the changes since the
        row table's ``seq``-th touched, or None when it cannot say
        (:meth:`~sidecar.rows.RowTable.touched_since`), by which a filter's rows kept from an
        earlier start may be brought up to date instead of sent again."""

    def doorbell_served(self) -> int:
        """Recalls the resident kernel has answered, all launches together."""
        return 0

    def check_doorbell(self) -> None:  # noqa: B027 - optional hook
        """Raise the resident kernel's error (or the carousel's) if it ended without being
        stopped."""

    # The carousel (sidecar/carousel.py, the GPU backend unless KALOS_CAROUSEL=0): a resident
    # scan that a crowd's batch-1 recalls board wherever it is; the dispatcher hands them over
    # through ``crowd`` (a sidecar.crowd.CrowdLane) while it runs. carousel_k: the largest k it
    # answers (0: none). It holds every SM: :meth:`pause_doorbell` stops it too, and the
    # dispatcher drains ``crowd`` before any other device work.
    carousel_k = 0
    carousel_running = False
    crowd: Any = None
    # KALOS_CAROUSEL=direct (protocol v1.4): the clients holding protocol slots below
    # carousel_direct write their batch-1 recalls into the carousel's slots themselves, in the
    # shared segment that carousel_map(size) maps (the server creates it and sets both); the
    # index calls on_carousel(epoch, carousel_direct) to publish the header's carousel words
    # (an odd epoch: the kernel takes requests).
    carousel_direct = 0
    carousel_map: Callable[[int], Any] | None = None
    on_carousel: Callable[[int, int], None] | None = None

    def start_carousel(self, high: int, ns: int = -2, eligible: int = 0) -> None:  # (-2: NS_ANY, below)
        """Start the carousel over rows [0, high) (the resident kernel stopped first); ``ns``:
        the namespace id its direct clients' requests ask, ``eligible`` its rows."""
        raise NotImplementedError(f"{type(self).__name__} has no carousel")

    def stop_carousel(self) -> None:  # noqa: B027 - optional hook
        """Stop the carousel once it holds no request (answers not harvested stay in ``crowd``)."""

    def sweep_carousel(self) -> int:
        """With the carousel stopped: turn direct requests no kernel will answer back to IDLE
        (their clients ask again the usual way); return how many."""
        return 0

    @property
    def carousel_answered(self) -> int:
        """Answers of the carousel's current (or last) launch."""
        return 0

    def carousel_active(self) -> int:
        """How many direct slots have sent a request since the last call (their seq moved, or
        one is in flight); all of them at the first call after a launch."""
        return 0

    def detach_segment(self) -> None:  # noqa: B027 - optional hook
        """Called before a segment is unmapped."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "dtype": self.dtype, "capacity": self.capacity}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device resources."""


NS_ANY = -2  # namespace id meaning "every row below high" (NS_ANY in kernels/recall.cu)
NS_NONE = -3  # namespace id matching no row (the resident kernel's empty default namespace)


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Unit-length rows (float32); zero rows stay zero.

    The norm is computed in float64: in float32 the squares of large finite components (above
    ~1.8e19) overflow, the norm becomes inf and the row would silently turn into zeros (or NaN).
    One row and many rows take shorter routes to the same result (within a float32 rounding)
    when every norm is well inside float32's range; anything else goes the general way.
    """
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and len(x) == 1:
        # one query (a batch-1 recall on the CPU): its squared norm in float64 as one number,
        # 2-3 µs against ~7.5 for the general route below (768-d, the development VM)
        # (from the private float64 copy only: x may be a request slot its client rewrites)
        v = x[0].astype(np.float64)
        sq = float(v @ v)
        if 1e-60 < sq < 1e60:
            return (v * (1.0 / math.sqrt(sq))).astype(np.float32)[None, :]
    elif isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and len(x) >= _NORM_FAST_MIN:
        # many float32 rows (a bulk upsert): the squares summed in float64 without a float64
        # copy of the rows, then one float32 multiply per element; a row whose norm is zero or
        # so large or small that its reciprocal leaves float32's normal range takes the
        # float64 route below with the rest of its batch
        # x is read twice here: if it changed in between (a request slot its client rewrites),
        # a result that is not finite goes the general way, which reads it once
        n = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))
        if n.min() > 1e-30 and n.max() < 1e30:
            out = x * (1.0 / n).astype(np.float32)[:, None]
            if np.isfinite(out).all():
                return out
    x64 = np.asarray(x, np.float64)
    n = np.linalg.norm(x64, axis=1, keepdims=True)
    return (x64 / np.where(n == 0, 1, n)).astype(np.float32)


_NORM_FAST_MIN = 256  # rows; below it numpy's per-call overhead is most of the cost either way


# A threshold top-k beats ``argpartition`` over the whole score array (at 100k scores on the dev
# VM: 23 us against 153 us): the k-th largest of every SAMPLE_STRIDE-th score is a lower bound
# for the k-th largest of all, so the scores at or above it contain the true top-k; only those
# (about SAMPLE_STRIDE * k of them) are partitioned. Used when the candidates stay few.
# Below SAMPLE_MIN_N scores its few extra numpy calls cost more than they save.
SAMPLE_STRIDE = 32
SAMPLE_MIN_N = 16384


def _sampled(n: int, k: int) -> bool:
    """Whether the top-k of n scores goes through the sampled threshold."""
    return n >= SAMPLE_MIN_N and n >= 2 * SAMPLE_STRIDE * k


def _top1d(s: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of the 1-d ``s`` (k < len(s)), in no particular order."""
    n = len(s)
    if _sampled(n, k):
        sample = s[::SAMPLE_STRIDE]
        m = len(sample)
        bound = np.partition(sample, m - k)[m - k]
        cand = np.flatnonzero(s >= bound)  # NaN bound: nothing passes, and we fall back below
        # At least k pass (the sample's k largest do); many pass only when scores tie or the
        # bound is -inf (rows masked out), where the full partition is as cheap.
        if k <= len(cand) <= n // 4:
            sub = s[cand]
            return cand[np.argpartition(-sub, k - 1)[:k]] if k < len(cand) else cand
    return np.argpartition(-s, k - 1)[:k]


def topk_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``scores`` (q, n): indices and values of the k largest, largest first (ties in
    the order the selection leaves them)."""
    n = scores.shape[1]
    if not len(scores):
        return np.empty((0, min(k, n)), np.intp), np.empty((0, min(k, n)), scores.dtype)
    if k >= n:
        part = np.broadcast_to(np.arange(n), (scores.shape[0], n))
    elif len(scores) == 1 or _sampled(n, k):
        part = np.stack([_top1d(s, k) for s in scores])  # per row: the sampled threshold
    else:  # a small batch over few rows: one vectorized partition beats a loop of them
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    if scores.shape[0] == 1:  # batch 1, the common case: 1-d operations, no take_along_axis
        s, p = scores[0], part[0]
        top = p[np.argsort(-s[p], kind="stable")]
        return top[None, :], s[top][None, :]
    vals = np.take_along_axis(scores, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(vals, order, axis=1)


class CpuIndex(Index):
    """numpy, float32. The reference implementation, and the default on machines without a GPU."""

    name = "cpu"
    host_search = True

    def __init__(self, dim: int, metric: int) -> None:
        super().__init__(dim, metric)
        self.data = np.zeros((0, dim), np.float32)
        self.ns = np.zeros(0, np.int32)
        self.sqnorm = np.zeros(0, np.float32)  # for L2

    def reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        cap = max(capacity, 2 * self.capacity, 1024)
        data = np.zeros((cap, self.dim), np.float32)
        data[: self.capacity] = self.data[: self.capacity]
        ns = np.full(cap, -1, np.int32)
        ns[: self.capacity] = self.ns[: self.capacity]
        sq = np.zeros(cap, np.float32)
        sq[: self.capacity] = self.sqnorm[: self.capacity]
        self.data, self.ns, self.sqnorm, self.capacity = data, ns, sq, cap

    def set_rows(self, rows: np.ndarray, vectors: np.ndarray, ns: np.ndarray) -> None:
        if len(rows):
            self.reserve(int(rows.max()) + 1)
        self.data[rows] = vectors
        self.ns[rows] = ns
        self.sqnorm[rows] = np.einsum("ij,ij->i", vectors, vectors)

    def clear_rows(self, rows: np.ndarray) -> None:
        self.ns[rows] = -1

    def wants_rows(self, count: int, high: int) -> bool:
        """Where :meth:`search` would gather them (fewer than 1/_GATHER_BELOW of the rows):
        without them it finds a mixed namespace's rows itself on every call (a pass over
        ``high`` ids: ~33 µs at 100k rows, ~275 µs at 1M on the development VM) before it
        scores only those, where the service's kept list is brought up to date by the rows a
        write touched. A larger namespace is scored in place, a pass that costs far more than
        finding its rows, so its list would only take room from the filters' kept answers."""
        return count * _GATHER_BELOW < high

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.data[dst] = self.data[src]
        self.ns[dst] = self.ns[src]
        self.sqnorm[dst] = self.sqnorm[src]
        self.ns[src] = -1

    def search(
        self,
        queries: np.ndarray,
        k: int,
        high: int,
        ns: int,
        candidates: np.ndarray | None,
        dense: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top-k rows among ``candidates`` (or the namespace ``ns``'s rows, or all when
        ``dense``). Few rows are gathered and scored; many (an eighth of the rows or more) are
        scored in place, which reads the matrix once instead of copying most of it (a filter
        matching half of 300k x 384 rows: 82 -> ~20 ms on the development VM), and only their
        scores ranked. A namespace mixed with others takes the same choice by its size."""
        q = normalize_rows(queries) if self.metric == Metric.COSINE else queries
        if candidates is None and not dense:
            candidates = np.flatnonzero(self.ns[:high] == ns)
        if candidates is not None and len(candidates) * _GATHER_BELOW < high:  # (a small namespace among others too)
            return self._gathered(q, k, candidates)
        blas.threads_for(high * self.dim * len(q))
        scores = _products(self.data[:high], q)
        if self.metric == Metric.L2:
            scores = _neg_l2(scores, q, self.sqnorm[:high])
        if candidates is None:
            idx, vals = topk_rows(scores, k)
            if self.metric == Metric.L2:
                return self._exact_l2(q, k, scores, idx, vals, None)
            return idx.astype(np.int32), vals.astype(np.float32, copy=False)
        # many eligible rows: scored in place, then only theirs ranked (their scores gathered;
        # masking the others to -inf made argpartition slow, ~1.4 ms over 150k ties of 200k)
        scores = scores[:, candidates]
        idx, vals = topk_rows(scores, k)
        if self.metric == Metric.L2:
            return self._exact_l2(q, k, scores, idx, vals, candidates)
        return candidates[idx].astype(np.int32), vals.astype(np.float32, copy=False)

    def _gathered(self, q: np.ndarray, k: int, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blas.threads_for(len(candidates) * self.dim * len(q))
        scores = _products(self.data[candidates], q)
        if self.metric == Metric.L2:
            scores = _neg_l2(scores, q, self.sqnorm[candidates])
        idx, vals = topk_rows(scores, k)
        if self.metric == Metric.L2:
            return self._exact_l2(q, k, scores, idx, vals, candidates)
        return candidates[idx].astype(np.int32), vals.astype(np.float32, copy=False)

    def _exact_l2(
        self,
        q: np.ndarray,
        k: int,
        scores: np.ndarray,
        idx: np.ndarray,
        vals: np.ndarray,
        universe: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The L2 top-k and distances, exact: ``scores`` came from ``|q|² - 2q·x + |x|²`` in
        float32, which cancels for rows near the query (a stored row recalled by itself scored
        ``-0.0`` with 48 near-duplicates, in insertion order, and lost its place in the top 5;
        at norms ~1,000 a distance was off by 0.8). Each row's squared distance is within
        ``e(x) = (dim + 2) * eps32 * (|q|² + |x|²)`` of the true one. So the true k-th is at
        most ``T``, the largest of the approximate top-k's ``d² + e``, and every row of the true
        top-k has ``d² - e <= T``: those rows (usually a few more than k) are scored again from
        ``x - q`` in float64 and ranked by that (ties by row). They are found in one pass with
        the largest ``e`` of all rows, then, where that kept many (a far row's norm widened
        it: every row was rescored, 34 -> 420 ms at 200k rows), with each row's own.
        ``e`` has an absolute part too, for squares in float32's subnormal range (elements
        below ~1e-19). Where float32 may overflow (``2q·x`` can reach infinity with finite
        norms, and the clamp then read such a row as distance 0) every row is rescored.
        ``scores`` index ``universe`` (rows 0.. when None)."""
        out_i = (idx if universe is None else universe[idx]).astype(np.int32)
        out_v = vals.astype(np.float32)
        k = idx.shape[1]
        if not k:
            return out_i, out_v
        m = scores.shape[1]
        sq = self.sqnorm[:m] if universe is None else self.sqnorm[universe]
        c = (self.dim + 2) * float(np.finfo(np.float32).eps)
        a = (2 * self.dim + 4) * 2.0**-149  # (float32's smallest subnormal, per operation)
        max_sq = float(sq.max())
        for j in range(len(q)):
            qj = q[j].astype(np.float64)
            qn = float(qj @ qj)
            top2 = vals[j].astype(np.float64) ** 2
            if not (math.isfinite(max_sq) and 2.5 * (qn + max_sq) < _F32_MAX and np.isfinite(top2).all()):
                short = np.arange(m)  # (float32 may have overflowed: no bound holds)
            else:
                # (scores are float32 square roots: relative 1e-6 margins keep the comparisons safe)
                t = float(np.max(top2 * (1 + 1e-6) + c * (qn + sq[idx[j]].astype(np.float64)))) + a
                wide = -math.sqrt(t + c * (qn + max_sq) + a) * (1 + 1e-6)
                short = np.flatnonzero(scores[j] >= wide)  # (ascending)
                if len(short) > 4 * k + 64:
                    s2 = scores[j, short].astype(np.float64) ** 2
                    short = short[s2 * (1 - 1e-6) - c * (qn + sq[short].astype(np.float64)) - a <= t]
            rows = short if universe is None else universe[short]
            d2 = np.empty(len(rows))
            step = max(1, (1 << 22) // self.dim)  # (32 MiB of float64 at a time)
            for at in range(0, len(rows), step):  # (not ``a``: the bound's absolute part)
                diff = self.data[rows[at : at + step]].astype(np.float64) - qj
                d2[at : at + step] = np.einsum("ij,ij->i", diff, diff)
            if len(d2) > k:  # (those at most the k-th: a tie at the cut goes by row)
                keep = np.flatnonzero(d2 <= np.partition(d2, k - 1)[k - 1])
                rows, d2 = rows[keep], d2[keep]
            best = np.lexsort((rows, d2))[:k]
            out_i[j] = rows[best]
            with np.errstate(over="ignore"):  # (a distance past float32's range reads -inf, as before)
                out_v[j] = -np.sqrt(d2[best])
        return out_i, out_v

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        return self.data[rows].copy()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["host_bytes"] = int(self.data.nbytes + self.ns.nbytes + self.sqnorm.nbytes)
        return d


_F32_MAX: Final = float(np.finfo(np.float32).max)
_GATHER_BELOW: Final = 8  # candidates fewer than 1/8 of the rows are gathered, more are masked
_GEMV_UP_TO: Final = 3  # batches this small: one matrix-vector product per query


def _products(base: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``q @ base.T``. One query: a matrix-vector product (gemv), as users write it. Two or
    three: one gemv each; OpenBLAS's sgemm of so few columns took 18-19 ms where one gemv takes
    4.9 at 100k x 384 (two gemv: 10.2; from four queries on, sgemm is as fast or faster)."""
    if len(q) == 1:
        return (base @ q[0])[None, :]
    if len(q) <= _GEMV_UP_TO:
        return np.stack([base @ qi for qi in q])
    return q @ base.T


def _neg_l2(dots: np.ndarray, q: np.ndarray, sqnorm: np.ndarray) -> np.ndarray:
    qn = np.einsum("ij,ij->i", q, q)[:, None]
    return -np.sqrt(np.maximum(qn - 2 * dots + sqnorm[None, :], 0))

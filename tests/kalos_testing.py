"""Reference results and comparisons shared by the test tiers (importable as ``kalos_testing``).

The reference is float64 numpy. Comparisons are tie-tolerant in the manner of FAISS's
``check_ref_knn_with_draws``: scores must agree within a tolerance, and the ids must agree
except among results whose scores tie (within that tolerance) with the k-th score, where any
member of the tie group is acceptable.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class PostCounter:
    """A stand-in for a slot's response semaphore in dispatcher tests: counts its posts."""

    def __init__(self) -> None:
        self.posts = 0

    def release(self) -> None:
        self.posts += 1


def as_float16_stored(x: np.ndarray, metric: str) -> np.ndarray:
    """Vectors as a float16 GPU index's batched path multiplies them: normalized first for
    cosine, then rounded to float16 (rows when stored, queries by prep_queries), as float64.
    A reference over these (metric "ip" for cosine) is what that path must match within
    ~1e-3, where one over the float32 data differs in the 10th/11th neighbour now and then.
    For L2 the kernel takes the squared norms from the float32 vectors, not these (~1e-4
    apart: inside the tolerance)."""
    x = np.asarray(x, np.float64)
    if metric == "cosine":
        x = x / np.linalg.norm(x, axis=-1, keepdims=True)
    return x.astype(np.float16).astype(np.float64)


def reference_scores(data: np.ndarray, queries: np.ndarray, metric: str) -> np.ndarray:
    """(q, n) float64 similarity scores, as Kalos defines them (higher is better)."""
    d = np.asarray(data, np.float64)
    q = np.atleast_2d(np.asarray(queries, np.float64))
    if metric == "cosine":
        return normalize(q) @ normalize(d).T
    if metric == "ip":
        return q @ d.T
    sq = (q**2).sum(1)[:, None] + (d**2).sum(1)[None, :] - 2 * q @ d.T
    return -np.sqrt(np.maximum(sq, 0))


def reference_topk(
    data: np.ndarray, queries: np.ndarray, k: int, metric: str = "cosine",
    eligible: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Indices (into ``data``) and scores of the exact top-k, best first, among ``eligible``."""
    s = reference_scores(data, queries, metric)
    if eligible is not None:
        s[:, ~eligible] = -np.inf
        k = min(k, int(eligible.sum()))
    k = min(k, s.shape[1])
    idx = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(s, idx, 1)


def assert_topk_equal(
    got_ids: Sequence, got_scores: np.ndarray, ref_ids: Sequence, ref_scores: np.ndarray,
    *, atol: float = 1e-4, context: str = "",
) -> None:  # fmt: skip
    """One query: same length, scores within ``atol``, ids equal up to ties at the boundary."""
    got_ids, ref_ids = list(got_ids), list(ref_ids)
    got_scores = np.asarray(got_scores, np.float64)
    ref_scores = np.asarray(ref_scores, np.float64)
    assert len(got_ids) == len(ref_ids), f"{context}: {len(got_ids)} results, expected {len(ref_ids)}"
    if not ref_ids:
        return
    assert np.all(np.isfinite(got_scores)), f"{context}: non-finite scores {got_scores}"
    np.testing.assert_allclose(got_scores, ref_scores, atol=atol, rtol=0, err_msg=context)
    # Every id clearly above the k-th score (by more than atol) on one side must be among the
    # other side's results. (Comparing the two "clearly above" sets for equality was flaky:
    # a score within rounding of kth + atol counted on one side and not on the other.)
    kth = ref_scores[-1]
    missing = {i for i, s in zip(ref_ids, ref_scores, strict=True) if s > kth + atol} - set(got_ids)
    extra = {i for i, s in zip(got_ids, got_scores, strict=True) if s > kth + atol} - set(ref_ids)
    assert not missing, f"{context}: ids of the true top-k missing from the results: {missing}"
    assert not extra, f"{context}: ids above the k-th score that are not in the true top-k: {extra}"
    assert len(set(got_ids)) == len(got_ids), f"{context}: duplicate ids {got_ids}"


def is_top_k(scores: np.ndarray, got: Sequence[int], k: int, atol: float = 1e-5) -> bool:
    """``got`` (row indices) is the top ``k`` of ``scores`` (float64, one per row, higher is
    better): the exact order, or one that differs only among rows whose scores agree within
    ``atol``. The sidecar computes in float32 (and a batch through sgemm rounds otherwise than
    one query through gemv), so on unseeded random data two rows within an ulp of each other
    swap now and then (CI met it, 18e6380); a wrong or missing row still fails."""
    s = np.asarray(scores, np.float64)
    want = np.argsort(-s, kind="stable")[:k]
    got = np.asarray(list(got), np.intp)
    if len(got) != len(want) or len(set(got.tolist())) != len(got):
        return False
    return bool(np.array_equal(got, want) or np.allclose(s[got], s[want], rtol=0, atol=atol))


def recall_at_k(got: Sequence[Sequence], ref: Sequence[Sequence]) -> float:
    """Mean fraction of the reference ids found (for approximate storage: float16, int8)."""
    hits = sum(len(set(g) & set(r)) for g, r in zip(got, ref, strict=True))
    return hits / max(1, sum(len(r) for r in ref))


def recall_row_worker(name: str, dim: int, seed: int, n_calls: int, out: Any, rows: int = 4001,
                      start: Any = None, docs: bool = False) -> None:  # fmt: skip
    """Child process: recall stored vectors (``rows`` of them, ids "0".., data seed 0) by
    themselves and count answers that are not the query's own row (a misrouted response
    would be one); with ``start`` (a barrier), only once every party has reached it. With
    ``docs`` the recalls ask for documents (the common recall: only those go direct to a
    carousel, KALOS_CAROUSEL=direct), and the answer's id must be the row's too."""
    from kalos_retrievers import KalosClient

    rng = np.random.default_rng(seed)
    data = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    bad = 0
    with KalosClient(name, dim=dim) as c:
        if start is not None:
            start.wait()
        for _ in range(n_calls):
            i = int(rng.integers(len(data)))
            r = c.recall(data[i], k=1, docs=docs)
            bad += int(r.rows[0] != i or (docs and r.ids != [str(i)]))
    out.put(bad)


def stop_rider_worker(name: str, dim: int, seed: int, rows: int, out: Any, start: Any = None) -> None:
    """Child process: recall stored vectors (``rows`` of them, ids "0".., data seed 0) by
    themselves, with their documents (what goes direct to a carousel), back to back from
    ``start`` (a barrier) until a call raises or a minute has passed. Puts a dict on ``out``:

    * ``ok`` calls answered, ``bad`` answers that were not the query's own row, ``error`` (the
      exception's type and message, "" if none), ``direct`` (recalls the carousel answered
      through its own slots), ``t_end`` (``time.monotonic()`` when the loop ended: one clock
      for every process);
    * of the requests written into the carousel's slots while it took requests ("aboard"):
      ``given_up_at``, the ``time.monotonic()`` at which the wait for the answer began of one
      that raised (None: none did); ``swept`` how many were turned back to IDLE (abandoned by
      the sidecar, then asked the usual way) instead of answered;
    * ``late``: a request written just after the sidecar's stop turned the epoch even raised
      or was swept (nothing need answer it: the client's epoch read and its write were apart
      across the stop).

    Whether a request was aboard is read at the wait's start, just after the write: the epoch
    still the one it was sent under means it was. (A turn between the write and that read
    counts the request as late: a weaker check, never a false one.)"""
    from kalos_retrievers import KalosClient, KalosError
    from kalos_retrievers.protocol import CAR_IDLE

    rng = np.random.default_rng(seed)
    data = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    got: dict[str, Any] = {"ok": 0, "bad": 0, "error": "", "direct": 0, "given_up_at": None, "swept": 0,
                           "late": False}  # fmt: skip
    with KalosClient(name, dim=dim, timeout=30) as c:
        inner = c._wait_direct

        def wait_direct(conn: Any, w: Any, epoch: int, *a: Any, **kw: Any) -> Any:  # (shadows the method)
            t_in = time.monotonic()
            late = conn.carousel_epoch() != epoch
            try:
                state = inner(conn, w, epoch, *a, **kw)
            except KalosError:
                if late:
                    got["late"] = True
                else:
                    got["given_up_at"] = t_in
                raise
            if state == CAR_IDLE:
                if late:
                    got["late"] = True
                else:
                    got["swept"] += 1
            return state

        c._wait_direct = wait_direct  # type: ignore[method-assign]
        if start is not None:
            start.wait()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            i = int(rng.integers(rows))
            try:
                r = c.recall(data[i], k=1)
            except KalosError as e:
                got["error"] = f"{type(e).__name__}: {e}"
                break
            got["ok"] += 1
            got["bad"] += int(r.rows[0] != i or r.ids != [str(i)])
        got["direct"] = c.direct_recalls
    got["t_end"] = time.monotonic()
    out.put(got)


def exact_crowd_worker(name: str, dim: int, metric: str, seed: int, n_calls: int, rows: int, other_every: int,
                       out: Any, start: Any = None) -> None:  # fmt: skip
    """Child process: ``n_calls`` recalls of random queries (k 1, 10 and 32 in turn) in the
    default namespace of a GPU sidecar's float16 rows (``rows`` of them, ids "0".., data seed
    0; every ``other_every``-th in another namespace when nonzero), back to back. The float64
    references are computed first, then the worker waits at ``start`` (a barrier shared with
    the crowd's other workers, if given), so the crowd recalls at once. Puts the first
    mismatch's description on ``out`` (or "" when every answer was right, with
    KALOS_FASTPATH=0 the client's C extension was off as asked, and with KALOS_CAROUSEL=direct
    (inherited from the test, as the sidecar's) at least one of its recalls went direct).

    Two references: the batched paths and the carousel round the query to float16, the
    resident batch-1 kernel (a client alone, as the crowd thins) multiplies it in float32. At
    inner-product scores of ~100 the two differ by ~5e-3, past the 2e-3 tolerance, so an answer
    must match the one or the other (S36-2: one answer of 3,840, near the crowd's end, was 3-5e-3
    above the float16 query's reference on 7 of 10 scores, as a float32 query's would be)."""
    from kalos_retrievers import KalosClient

    rng = np.random.default_rng(seed)
    data = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    keep = np.ones(rows, bool)
    if other_every:
        keep[::other_every] = False
    qs = rng.standard_normal((n_calls, dim)).astype(np.float32)
    ks = [(1, 10, 32)[j % 3] for j in range(n_calls)]
    ref_metric = "ip" if metric == "cosine" else metric
    # every query's top 32 at once (stable order: a smaller k's answer is the prefix)
    rows16 = as_float16_stored(data, metric)
    q32 = np.asarray(qs, np.float64)
    if metric == "cosine":
        q32 = q32 / np.linalg.norm(q32, axis=1, keepdims=True)
    refs = [reference_topk(rows16, q, 32, ref_metric, keep) for q in (as_float16_stored(qs, metric), q32)]
    got = []
    with KalosClient(name, dim=dim, timeout=60) as c:
        if start is not None:
            start.wait()
        for j in range(n_calls):
            r = c.recall(qs[j], k=ks[j])
            got.append((r.ids, np.asarray(r.scores)))
        direct = c.direct_recalls
    try:
        for j, (ids, scores) in enumerate(got):
            k = ks[j]
            misses = []
            for how, (ref_i, ref_s) in zip(("float16 query", "float32 query"), refs, strict=True):
                try:
                    assert_topk_equal(ids, scores, [str(i) for i in ref_i[j, :k]], ref_s[j, :k], atol=2e-3,
                                      context=f"call {j} ({how})")  # fmt: skip
                    break
                except AssertionError as e:
                    misses.append(str(e))
            else:
                raise AssertionError("\n".join(misses))
    except AssertionError as e:
        out.put(str(e))
        return
    import kalos_retrievers.client as client_module

    if os.environ.get("KALOS_FASTPATH") == "0" and client_module._fastpath is not None:
        out.put("KALOS_FASTPATH=0 did not keep this worker's client to its Python path")
        return
    if os.environ.get("KALOS_CAROUSEL") == "direct" and not direct:
        out.put(f"KALOS_CAROUSEL=direct, yet none of this worker's {n_calls} recalls went direct")
        return
    out.put("")


def recall_id_worker(name: str, dim: int, seed: int, n_calls: int, out: Any) -> None:
    """Child process: recall stored vectors by themselves (ids "0".., data seed 0, 4001 rows)
    and count answers whose top id is not the query's own: a response routed to the wrong
    caller would be one. Puts (misrouted, errors) on ``out``."""
    from kalos_retrievers import KalosClient

    rng = np.random.default_rng(seed)
    data = np.random.default_rng(0).standard_normal((4001, dim)).astype(np.float32)
    bad = errors = 0
    with KalosClient(name, dim=dim, timeout=30) as c:
        for _ in range(n_calls):
            i = int(rng.integers(len(data)))
            try:
                bad += int(c.recall(data[i], k=1).ids[0] != str(i))
            except Exception:
                errors += 1
    out.put((bad, errors))


def busy_client(name: str, dim: int) -> None:
    """Child process: recall in a loop until killed (for kill -9 tests)."""
    from kalos_retrievers import KalosClient

    q = np.ones(dim, np.float32)
    with KalosClient(name, dim=dim, timeout=5) as c:
        while True:
            c.recall(q, k=3)


def load_interleaved(client: Any, rng: Any, dim: int, spaces: dict[str, int], chunk: int,
                     metadata: Callable[[int], dict]) -> dict[str, np.ndarray]:  # fmt: skip
    """Random rows, ``spaces[ns]`` of them per namespace, upserted in chunks of ``chunk`` that
    alternate between the namespaces (so their rows lie mixed in the index): ids
    ``"<ns>#<i>"``, texts ``"<ns> text <i>"``, metadata ``metadata(i)``. Returns each
    namespace's vectors by row."""
    data = {ns: rng.standard_normal((n, dim)).astype(np.float32) for ns, n in spaces.items()}
    at = dict.fromkeys(spaces, 0)
    while any(at[ns] < n for ns, n in spaces.items()):
        for ns, n in spaces.items():
            lo, hi = at[ns], min(at[ns] + chunk, n)
            if lo < hi:
                client.upsert([f"{ns}#{i}" for i in range(lo, hi)], data[ns][lo:hi],
                              texts=[f"{ns} text {i}" for i in range(lo, hi)],
                              metadatas=[metadata(i) for i in range(lo, hi)], namespace=ns)  # fmt: skip
                at[ns] = hi
    return data


def check_scoped(r: Any, ns: str, data: np.ndarray, q: np.ndarray, k: int, dtype: str,
                 keep: np.ndarray | None = None) -> None:  # fmt: skip
    """``r`` (a recall in namespace ``ns``, rows loaded by :func:`load_interleaved`) is the exact
    top-k of ``data`` (its vectors by row) among the rows ``keep`` (bool per row; None: all),
    with their texts. Cosine; float16 rows scored as stored (normalized, then rounded) against
    the float32 query, as the GPU's scans do, within 2e-3; float32 within 1e-4."""
    if dtype == "float32":
        ref_i, ref_s = reference_topk(data, q[None], k, eligible=keep)
        atol = 1e-4
    else:
        qn = q.astype(np.float64) / np.linalg.norm(q.astype(np.float64))
        ref_i, ref_s = reference_topk(as_float16_stored(data, "cosine"), qn[None], k, "ip", eligible=keep)
        atol = 2e-3
    assert_topk_equal(r.ids, r.scores, [f"{ns}#{i}" for i in ref_i[0]], ref_s[0], atol=atol, context=f"{ns!r} k={k}")
    assert r.namespace == ns
    assert all(hit.text == f"{ns} text {hit.id.split('#')[1]}" for hit in r)


def index_stats(client: Any) -> dict:
    """The sidecar's index stats (``stats()["index"]``): for a GPU sidecar, what its resident
    kernel serves (``doorbell_spaces``, ``doorbell_filters``) and has answered."""
    return client.stats()["index"]


def kernel_answers(client: Any) -> int:
    """Recalls the sidecar's resident kernel has answered, all its runs together: a GPU test
    reads it before and after a recall to know the kernel answered it, not the sidecar."""
    return int(index_stats(client)["doorbell_served"])


def until_kernel_serves(client: Any, ask: Callable[[], object], serves: Callable[[dict], bool], what: str) -> None:
    """``ask()`` (a lone recall) until the sidecar's resident kernel runs and ``serves(stats)``
    says it serves the scope meant (the sidecar notes a lone recall's scope, and starts the
    kernel after a few of them). Halfway, a second's wait: the start backs off after scoped
    recalls it did not take stopped it (Dispatcher.lone_enough), for a second."""
    for attempt in range(40):
        idx = index_stats(client)
        if idx["doorbell_running"] and serves(idx):
            return
        if attempt == 20:
            time.sleep(1.1)
        ask()
    raise AssertionError(f"the kernel does not serve {what}: {index_stats(client)}")


def poison(name: str) -> None:
    """Fill every slot's rows with 0x7f7f7f7f and scores with NaN, directly in the segment:
    a result element the sidecar (or the GPU) does not write reaches the caller as poison."""
    import mmap

    import posix_ipc

    from kalos_retrievers.protocol import HEADER_SIZE, decode_header, segment_name

    shm = posix_ipc.SharedMemory(segment_name(name))
    try:
        mm = mmap.mmap(shm.fd, shm.size)
        lay = decode_header(mm[:HEADER_SIZE], shm.size).layout
        for i in range(lay.n_slots):
            o = lay.slot_offset(i)
            np.frombuffer(mm, np.int32, lay.max_results, o + lay.rows_offset)[:] = 0x7F7F7F7F
            np.frombuffer(mm, np.float32, lay.max_results, o + lay.scores_offset)[:] = np.nan
        del lay
        mm.close()
    finally:
        shm.close_fd()


def doorbell_stand_in(name: str, dim: int, hand_back: bool, answered: Any, handed_back: Any, stop: Any,
                      ready: Any) -> None:  # fmt: skip
    """The GPU's resident kernel's part, for a CPU sidecar's clients told that one runs
    (tests/integration/test_fastpath_client.py): answer every DOORBELL request in the sidecar's
    slots with a recall through an ordinary client and the hits' arena entries, as the kernel
    answers, or (``hand_back``) hand it back to the sidecar, as the kernel does in a crowd. A
    request with args (a namespace, protocol v1.5; a filter, v1.6) is answered in that scope
    when they fit the 128 bytes a v1.6 kernel compares, as the kernel answers the scopes it
    serves, and handed back otherwise. In a process of its own: a thread of the test's process would wait for the GIL
    while the client's Python path spins."""
    from kalos_retrievers import KalosClient
    from kalos_retrievers.protocol import (
        RESPONSE_OFFSET,
        RESPONSE_STRUCT,
        RespFlag,
        SlotState,
        Status,
        align8,
        decode_recall_args,
    )

    with KalosClient(name, arena_docs=True) as own, KalosClient(name, arena_docs=False) as searcher:
        own.ping()
        conn = own._conn
        assert conn is not None
        lay = conn.layout
        mm = conn.seg.mm
        states = np.ndarray((lay.n_slots,), "<u4", mm, lay.slot_offset(0), (lay.slot_size,))
        ready.set()
        while not stop.is_set():
            for i in np.flatnonzero(states == SlotState.DOORBELL).tolist():
                off = lay.slot_offset(i)
                # Each count is made before the state that publishes it: a test reads the counts
                # once its recall has returned, and the client may return the moment it sees it.
                if hand_back:
                    handed_back.value += 1
                    states[i] = SlotState.REQUEST  # the kernel's hand-back: the client posts the bell
                    continue
                args_len = int(np.frombuffer(mm, "<u8", 1, off + 40)[0])
                at = off + lay.payload_offset + align8(4 * dim)
                namespace, flt = decode_recall_args(bytes(mm[at : at + args_len]))
                if args_len > 128:  # (DOORBELL_SCOPE_ARGS_MAX: the longest args a v1.6 kernel compares)
                    handed_back.value += 1
                    states[i] = SlotState.REQUEST
                    continue
                states[i] = SlotState.BUSY
                seq = int(np.frombuffer(mm, "<u8", 1, off + 8)[0])
                k = int(np.frombuffer(mm, "<u4", 1, off + 24)[0])
                q = np.frombuffer(mm, "<f4", dim, off + lay.payload_offset).copy()
                res = searcher.recall(q, k, namespace=namespace, filter=flt)
                rows = np.asarray(res.rows, np.int32)
                arena = conn.arena()
                assert arena is not None
                blob = arena.version.to_bytes(8, "little") + arena._table[rows].tobytes()
                np.frombuffer(mm, "<i4", len(rows), off + lay.rows_offset)[:] = rows
                np.frombuffer(mm, "<f4", len(rows), off + lay.scores_offset)[:] = res.scores
                mm[off + lay.blob_offset : off + lay.blob_offset + len(blob)] = blob
                RESPONSE_STRUCT.pack_into(mm, off + RESPONSE_OFFSET, seq, Status.OK, len(rows), len(blob),
                                          RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES)  # fmt: skip
                answered.value += 1
                states[i] = SlotState.RESPONSE


def carousel_stand_in(name: str, dim: int, mode: str, answered: Any, stop: Any, ready: Any) -> None:
    """The carousel kernel's part for direct clients (protocol v1.4), for a CPU sidecar whose
    clients are told a carousel runs (tests/integration/test_carousel_direct.py): every REQUEST
    in ``/kalos-NAME-car`` is taken (TAKEN), and then, by ``mode``: "answer" searches through
    an ordinary client and writes rows, scores, the count and the seq echo, then DONE, as
    carousel_topk does; "refuse" writes ERROR; "sweep" turns it back to IDLE, as the sidecar's
    sweep after a stop does; "epoch" answers as "answer" but first moves the header's epoch on
    by 3 (a whole stop: the rows may have changed since), "drain" by 1 (a stop begun: the rows
    have not); "short" answers one result fewer than it found; "silent" answers nothing.
    In a process of its own, as doorbell_stand_in."""
    import mmap as _mmap

    import posix_ipc

    from kalos_retrievers import KalosClient
    from kalos_retrievers import protocol as P

    lay = P.CarouselLayout.of(dim)
    shm = posix_ipc.SharedMemory(P.carousel_segment_name(name), flags=0)
    mm = _mmap.mmap(shm.fd, os.fstat(shm.fd).st_size)
    shm.close_fd()
    n, stride = len(mm) // lay.slot_bytes, lay.slot_bytes // 4
    words = np.frombuffer(mm, np.uint32, n * stride).reshape(n, stride)
    with KalosClient(name, arena_docs=False) as searcher:
        searcher.ping()
        hdr = searcher._conn.seg.mm
        ready.set()
        while not stop.is_set():
            for i in np.flatnonzero(words[:, P.W_STATE] == P.CAR_REQUEST).tolist():
                if mode == "silent":
                    continue
                w = words[i]
                w[P.W_STATE] = P.CAR_TAKEN
                if mode == "refuse":
                    w[P.W_STATE] = P.CAR_ERROR
                    continue
                if mode == "sweep":
                    w[P.W_STATE] = P.CAR_IDLE
                    continue
                k, seq = int(w[P.W_K]), int(w[P.W_SEQ])
                q = np.frombuffer(mm, np.float32, dim, i * lay.slot_bytes + P.CAR_HEAD).copy()
                res = searcher.recall(q, k)
                kk = len(res.rows) - (mode == "short")
                np.frombuffer(mm, np.int32, kk, i * lay.slot_bytes + lay.rows_off)[:] = res.rows[:kk]
                np.frombuffer(mm, np.float32, kk, i * lay.slot_bytes + lay.scores_off)[:] = res.scores[:kk]
                w[P.W_RESULTS] = kk
                w[P.W_RESP_SEQ] = seq
                if mode in ("epoch", "drain"):
                    at = P.HEADER_OFFSETS["carousel_epoch"]
                    epoch = struct.unpack_from("<Q", hdr, at)[0]
                    struct.pack_into("<Q", hdr, at, epoch + (3 if mode == "epoch" else 1))
                answered.value += 1  # (before DONE: the client may return, and the test read it, at once)
                w[P.W_STATE] = P.CAR_DONE
            time.sleep(0.0001)


def bytearray_arena(n_docs: int, rows_cap: int = 64, heap_size: int = 4096) -> tuple[Any, Any]:
    """A document arena in bytearrays (the sidecar's writer and a client's view of it) whose
    rows 0 .. n_docs - 1 hold b"document {row}": for the client's C readers' unit tests."""
    from kalos_retrievers.arena import ArenaView, ArenaWriter

    segs: dict[int, bytearray] = {}

    def open_segment(version: int, size: int) -> bytearray:
        segs[version] = bytearray(size)
        return segs[version]

    writer = ArenaWriter(open_segment, segs.pop, rows_cap, heap_size)
    for r in range(n_docs):
        writer.put(r, f"document {r}".encode())
    return writer, ArenaView(writer.buf, writer.version)


def until(cond: Any, timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll ``cond()`` every 0.5 ms until it holds; fail the test after ``timeout`` s."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} did not come within {timeout} s"
        time.sleep(0.0005)


class StandInProcess:
    """``target(*args, stop, ready)`` in a spawned process while in the ``with`` block (a stand-in
    for a GPU kernel: doorbell_stand_in, carousel_stand_in); ``stop`` is set on leaving, and the
    process must then end cleanly."""

    def __init__(self, target: Any, *args: Any) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.ctx = ctx
        self.stop, ready = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=target, args=(*args, self.stop, ready), daemon=True)
        self.proc.start()
        while not ready.wait(0.1):
            assert self.proc.is_alive(), f"the stand-in exited with {self.proc.exitcode}"

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(30)
        assert self.proc.exitcode == 0, f"the stand-in exited with {self.proc.exitcode}"


class DoorbellStandIn(StandInProcess):
    """``doorbell_stand_in`` for sidecar ``name`` (``dim``) while in the ``with`` block, with
    its counts: ``answered`` and ``handed_back``."""

    def __init__(self, name: str, dim: int, hand_back: bool) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.answered, self.handed_back = ctx.Value("i", 0), ctx.Value("i", 0)
        super().__init__(doorbell_stand_in, name, dim, hand_back, self.answered, self.handed_back)

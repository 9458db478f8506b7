"""GPU index against a float64 reference, in process (kernels, rows, growth, compaction).

Fresh random data every run. float32 storage must match exactly (recall 1.0, scores within
1e-4, ties tolerated); float16 and int8 must reach recall@10 >= 0.99. Results come back in
buffers poisoned before each call, so an element the kernels did not write fails the check.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kalos_retrievers.sidecar.index import NS_ANY
from kalos_testing import as_float16_stored as _as_stored  # (rows and queries as the float16 batched path sees them)
from kalos_testing import assert_topk_equal, recall_at_k, reference_topk

from kalos_retrievers.protocol import METRICS, Invalid, Status

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


_open: list = []


def make(dim: int, metric: str = "cosine", dtype: str = "float32", limit: int | None = None):
    from kalos_retrievers.sidecar.index_gpu import GpuIndex
    from kalos_retrievers.sidecar.service import Service
    from kalos_retrievers.sidecar.store import NullStore

    idx = GpuIndex(dim, METRICS[metric], 0, dtype, memory_limit=limit)
    _open.append(idx)
    return Service(idx, NullStore(), dim=dim, metric=METRICS[metric])


@pytest.fixture(autouse=True)
def _close_indexes():
    yield
    while _open:
        _open.pop().close()


def put(svc, vecs, ids=None, ns="", metas=None):
    n = len(vecs)
    ids = ids if ids is not None else [str(i) for i in range(n)]
    return svc.upsert({"namespace": ns, "ids": ids, "texts": [""] * n,
                       "metadatas": metas or [{} for _ in range(n)]}, np.asarray(vecs, np.float32))  # fmt: skip


def check(svc, data, queries, k, metric="cosine", eligible=None, id_of=None, atol=1e-4, ns="", flt=None):
    rows, scores = svc.recall(np.asarray(queries, np.float32), k, ns, flt)
    ref_i, ref_s = reference_topk(data, queries, k, metric, eligible)
    assert rows.shape == ref_i.shape, (rows.shape, ref_i.shape)
    for j in range(len(queries)):
        got = [svc.rows.ids[r] for r in rows[j]]  # raises on an unwritten (poisoned) row
        want = [id_of(i) if id_of else str(i) for i in ref_i[j]]
        assert_topk_equal(got, scores[j], want, ref_s[j], atol=atol, context=f"q{j} k={k}")


@pytest.mark.parametrize("dim", [3, 97, 768, 1536])
def test_float32_exact_odd_dims_all_k_and_batches(dim: int) -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((3001, dim)).astype(np.float32)
    svc = make(dim)
    put(svc, data)
    for k in (1, 10, 100, 1024):
        for b in (1, 11, 77):
            q = rng.standard_normal((b, dim)).astype(np.float32)
            check(svc, data, q, k)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dims_above_4096(dtype: str) -> None:
    """Above 4096 dims prep_queries loops over the rest of each query (4 float4 per thread of
    256 in its first pass), and the batched paths' shared memory may not hold a batch's
    queries (the path then falls back): batches of 1, 11 and 77, exact for float32, recall@10
    >= 0.99 for float16. (Added in session 7, after S7-4: not yet run on a GPU.)"""
    rng = np.random.default_rng()
    dim = 4099
    data = rng.standard_normal((2003, dim)).astype(np.float32)
    svc = make(dim, dtype=dtype)
    put(svc, data)
    for b in (1, 11, 77):
        q = rng.standard_normal((b, dim)).astype(np.float32)
        if dtype == "float32":
            check(svc, data, q, 10)
            continue
        rows, _ = svc.recall(q, 10, "", None)
        ref_i, _ = reference_topk(data, q, 10)
        got = [[int(svc.rows.ids[r]) for r in rr] for rr in rows]
        assert recall_at_k(got, ref_i.tolist()) >= 0.99, b


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_float32_other_metrics(metric: str) -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((5003, 97)).astype(np.float32)
    svc = make(97, metric)
    put(svc, data)
    for b in (1, 11, 77):
        check(svc, data, rng.standard_normal((b, 97)), 10, metric, atol=2e-3 if metric == "l2" else 1e-4)


def test_float32_many_rows_all_batch_sizes() -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((200_003, 97)).astype(np.float32)
    svc = make(97)
    put(svc, data)
    for b in (1, 8, 9, 64, 77):  # several fused launches beyond 8 queries
        check(svc, data, rng.standard_normal((b, 97)), 10)
    check(svc, data, rng.standard_normal((3, 97)), 1024)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_reduced_precision_recall(dtype: str) -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((50_021, 768)).astype(np.float32)
    svc = make(768, dtype=dtype)
    put(svc, data)
    q = rng.standard_normal((77, 768)).astype(np.float32)
    rows, scores = svc.recall(q, 10, "", None)
    ref_i, _ref_s = reference_topk(data, q, 10)
    got = [[int(svc.rows.ids[r]) for r in rr] for rr in rows]
    r = recall_at_k(got, ref_i.tolist())
    assert r >= 0.99, f"{dtype} recall@10 = {r}"
    assert np.all(np.isfinite(scores))
    # each returned score is that row's score, to the storage's precision
    exact = np.einsum("qd,qkd->qk", q / np.linalg.norm(q, axis=1, keepdims=True),
                      (data / np.linalg.norm(data, axis=1, keepdims=True))[rows.astype(np.int64)])  # fmt: skip
    assert np.abs(scores - exact).max() < (2e-3 if dtype == "float16" else 1e-4)


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_gemm_and_fused_paths_agree_and_are_exact(metric: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same batches through GEMM + topk_scores and through fused launches (the GEMM path
    once returned wrong rows when cuBLAS ran on another stream): both exact, run after run, with
    another index's work in between (the state that broke it was left by earlier tests)."""
    from kalos_retrievers.sidecar import index_gpu

    rng = np.random.default_rng()
    data = rng.standard_normal((200_003, 97)).astype(np.float32)
    svc = make(97, metric)
    put(svc, data)
    other = make(33)
    put(other, rng.standard_normal((1001, 33)).astype(np.float32))
    for rep in range(3):
        for gemm in (True, False):
            monkeypatch.setattr(index_gpu, "USE_GEMM", gemm)
            q = rng.standard_normal((2 + 31 * rep, 97)).astype(np.float32)
            check(svc, data, q, (10, 100, 1)[rep], metric, atol=2e-3 if metric == "l2" else 1e-4)
            other.recall(rng.standard_normal((9, 33)).astype(np.float32), 5, "", None)
    assert svc.index.describe()["gemm_path"] in (True, False)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_threshold_topk_overflow_falls_back_exactly(dtype: str) -> None:
    """The threshold top-k (cuBLAS for float32, mma_filter for float16) must stay exact when
    its candidate lists overflow: rows that all score the same (every row ties with the
    sample's k-th); then a namespace written after them (before session 56 the sample was the
    first rows, none of them its: the threshold -inf, the lists overflowing; the next test
    asserts that they no longer do)."""
    rng = np.random.default_rng()
    n, dim = 40_003, 64
    same = np.tile(rng.standard_normal((1, dim)).astype(np.float32), (n, 1))
    svc = make(dim, dtype=dtype)
    put(svc, same)
    q = rng.standard_normal((5, dim)).astype(np.float32)
    before, mma = svc.index.threshold_overflows, svc.index.mma_batches
    rows, scores = svc.recall(q, 10, "", None)
    assert svc.index.threshold_overflows > before  # the fallback ran
    assert svc.index.mma_batches == mma + (dtype == "float16")
    atol = 1e-4 if dtype == "float32" else 2e-3
    ref = (same[0] / np.linalg.norm(same[0])) @ (q / np.linalg.norm(q, axis=1, keepdims=True)).T
    assert np.allclose(scores, ref[:, None], atol=atol) and len({*rows.ravel().tolist()}) >= 10
    tail = rng.standard_normal((20_011, dim)).astype(np.float32)
    put(svc, tail, [f"t{i}" for i in range(len(tail))], ns="tail")
    check(svc, tail, q, 10, ns="tail", id_of=lambda i: f"t{i}", atol=atol)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_namespace_written_after_another_gets_a_threshold_from_the_sample(dtype: str) -> None:
    """The threshold's sample is runs of rows spread over the index (kernels/recall.cu,
    spread_start): a namespace written after another, and a filter in it, meet it, so their
    batches take the threshold top-k without overflowing into the exact fallback, and stay
    exact (batches of 7, 16, 24 and 33: mma_filter's warp tiles of 16 and 32 rows). Before
    session 56 the sample was the first S rows (1,024 here, TAU_SAMPLE_MIN), all the first
    namespace's: every batch in the second overflowed (S56-2 at 1M rows: 7.6 ms where 0.92
    unscoped). The control: the first namespace's batch, which met the sample then too."""
    rng = np.random.default_rng()
    dim, first, n = 97, 40_003, 20_011
    svc = make(dim, dtype=dtype)
    put(svc, rng.standard_normal((first, dim)).astype(np.float32))
    tail = rng.standard_normal((n, dim)).astype(np.float32)
    put(svc, tail, [f"t{i}" for i in range(n)], ns="tail", metas=[{"g": i % 2} for i in range(n)])
    stored = _as_stored(tail, "cosine") if dtype == "float16" else tail
    atol = 1e-3 if dtype == "float16" else 1e-4
    cases = (("", None, 10, 7), ("tail", None, 10, 7), ("tail", None, 1, 16), ("tail", None, 10, 24),
             ("tail", {"g": 1}, 10, 33))  # fmt: skip
    for ns, flt, k, b in cases:
        q = rng.standard_normal((b, dim)).astype(np.float32)
        before, mma = svc.index.threshold_overflows, svc.index.mma_batches
        rows, scores = svc.recall(q, k, ns, flt)
        assert svc.index.threshold_overflows == before, f"{ns!r} {flt}: the candidate lists overflowed"
        assert svc.index.mma_batches == mma + (dtype == "float16")
        if not ns:
            continue
        eligible = None if flt is None else np.arange(n) % 2 == 1
        qs = _as_stored(q, "cosine") if dtype == "float16" else q
        ref_i, ref_s = reference_topk(stored, qs, k, "cosine" if dtype == "float32" else "ip", eligible)
        for j in range(b):
            got = [svc.rows.ids[r] for r in rows[j]]  # raises on an unwritten (poisoned) row
            assert_topk_equal(got, scores[j], [f"t{i}" for i in ref_i[j]], ref_s[j], atol=atol, context=f"{ns} q{j}")


@pytest.mark.parametrize(("metric", "dim"), [("cosine", 768), ("ip", 97), ("l2", 768), ("cosine", 3)])
def test_mma_path_is_exact_at_float16_precision(metric: str, dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Float16 batches go through mma_filter (tensor cores, the threshold applied as rows are
    scored). Against a float64 reference over the float16-rounded rows and queries it must
    be exact (ties tolerated) for every query-tile count (16 / 32 / 64 queries per launch,
    and a 77-query batch split in two), k from 1 to 1024, a namespace and a filter; and agree
    with the cuBLAS path (KALOS_MMA=0) on the same batch."""
    from kalos_retrievers.sidecar import index_gpu

    rng = np.random.default_rng()
    n = 20_011
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim, metric, dtype="float16")
    put(svc, data, metas=[{"g": i % 3} for i in range(n)])
    other = rng.standard_normal((3001, dim)).astype(np.float32)
    put(svc, other, [f"o{i}" for i in range(len(other))], ns="other")
    ref_metric = "l2" if metric == "l2" else "ip"
    atol = 5e-3 if metric == "l2" else 1e-3
    stored = _as_stored(data, metric)

    def run(b: int, k: int, ns: str = "", flt=None, eligible=None, rows=stored, id_of=None) -> None:
        q = rng.standard_normal((b, dim)).astype(np.float32)
        before, overflows = svc.index.mma_batches, svc.index.threshold_overflows
        got_rows, got_scores = svc.recall(q, k, ns, flt)
        assert svc.index.mma_batches > before, "the batch did not take the mma path"
        # answered by it, not by the cuBLAS fallback after an overflow
        assert svc.index.threshold_overflows == overflows, "the mma path's candidate lists overflowed"
        ref_i, ref_s = reference_topk(rows, _as_stored(q, metric), k, ref_metric, eligible)
        assert got_rows.shape == ref_i.shape
        for j in range(b):
            got = [svc.rows.ids[r] for r in got_rows[j]]  # raises on an unwritten (poisoned) row
            want = [id_of(i) if id_of else str(i) for i in ref_i[j]]
            assert_topk_equal(got, got_scores[j], want, ref_s[j], atol=atol, context=f"b={b} q{j} k={k}")

    for b, k in ((2, 10), (16, 1), (17, 100), (33, 10), (64, 10), (77, 37), (5, 1024)):
        run(b, k)
    run(11, 10, flt={"g": 1}, eligible=np.arange(n) % 3 == 1)
    run(9, 10, ns="other", rows=_as_stored(other, metric), id_of=lambda i: f"o{i}")
    # the cuBLAS path on the same batch: the same rows, to rounding
    q = rng.standard_normal((21, dim)).astype(np.float32)
    a_rows, a_scores = svc.recall(q, 10, "", None)
    monkeypatch.setattr(index_gpu, "USE_MMA", False)
    before = svc.index.mma_batches
    b_rows, b_scores = svc.recall(q, 10, "", None)
    assert svc.index.mma_batches == before
    for j in range(len(q)):
        assert_topk_equal([svc.rows.ids[r] for r in a_rows[j]], a_scores[j],
                          [svc.rows.ids[r] for r in b_rows[j]], b_scores[j], atol=atol)  # fmt: skip


def _segment(idx, n_slots: int, dim: int, k: int):  # type: ignore[no-untyped-def]
    """``n_slots`` one-query slots (query, then k rows, then k scores) in an anonymous map
    registered with ``idx`` as the sidecar's segment is; returns (map, specs)."""
    from kalos_retrievers.sidecar.bench import one_query_slots

    return one_query_slots(idx, n_slots, dim, k)


def _poisoned_batches(specs, plan, rng, dim: int):  # type: ignore[no-untyped-def]
    """For each (queries, k) of ``plan``: random queries written into the next slots of
    ``specs``, their answers poisoned; returns [(slots, queries, k)]."""
    batches, at = [], 0
    for b, k in plan:
        part = specs[at : at + b]
        at += b
        q = rng.standard_normal((b, dim)).astype(np.float32)
        for sp, x in zip(part, q, strict=True):
            sp.queries[0] = x
            sp.rows.fill(0x7F7F7F7F)
            sp.scores.fill(np.nan)
        batches.append((part, q, k))
    return batches


def _check_batches(svc, batches, stored: np.ndarray, metric: str) -> None:  # type: ignore[no-untyped-def]
    """Every answer of ``batches`` (from _poisoned_batches) against the float16-rounded
    reference over ``stored`` (_as_stored rows); an unwritten (poisoned) row raises."""
    ref_metric = "l2" if metric == "l2" else "ip"
    atol = 5e-3 if metric == "l2" else 1e-3
    for j, (part, q, k) in enumerate(batches):
        ref_i, ref_s = reference_topk(stored, _as_stored(q, metric), k, ref_metric)
        for r, sp in enumerate(part):
            got = [svc.rows.ids[x] for x in sp.rows[0, :k]]
            assert_topk_equal(got, sp.scores[0, :k], [str(i) for i in ref_i[r]], ref_s[r], atol=atol,
                              context=f"batch {j} q{r} k={k}")  # fmt: skip


def _launch(svc, specs, q, k: int, behind: bool) -> None:  # type: ignore[no-untyped-def]
    """Write ``q`` into ``specs``' slots, poison their answers, launch them (``behind``:
    queued behind the search left running, which the index must say it can do)."""
    for sp, x in zip(specs, q, strict=True):
        sp.queries[0] = x
        sp.rows.fill(0x7F7F7F7F)
        sp.scores.fill(np.nan)
    ns, cands, dense, _ = svc.eligible("", None)
    idx, high = svc.index, svc.rows.high
    if behind:
        assert idx.queues_behind(len(q), k, high)
    idx.launch_slots(specs, k, high, ns, cands, dense, behind=behind)


@pytest.mark.parametrize(("metric", "dim", "n"), [("cosine", 768, 200_003), ("ip", 97, 400_009), ("l2", 384, 200_003)])
def test_batches_queued_behind_each_other_are_exact(metric: str, dim: int, n: int) -> None:
    """Float16 batches queued behind the one the device is still searching (each in the lane
    the other does not hold: their own descriptor, parameters, thresholds and candidate
    lists; prep and thresholds beside the earlier pass, the selection beside the next): a
    chain of them, of 1 to 33 queries and k from 1 to 100, each launched while the one before
    still searches (enough rows that a pass outlasts the host's launch; every answer checked
    after the chain), is exact against the float16-rounded reference, every element written.
    Every other batch goes the dispatcher's way for batch-1 members (launch_behind_slots: the
    descriptor from slot numbers and the CUDA calls in C, sidecar/_launch.c), the rest from
    their specs through CuPy: the two ways interleave in one chain."""
    from kalos_retrievers.sidecar import index_gpu

    assert index_gpu._launch is not None and index_gpu.QUEUE_C, "the C launch is built on the GPU machine"
    rng = np.random.default_rng()
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim, metric, dtype="float16")
    put(svc, data)
    idx = svc.index
    plan = [(3, 10), (11, 10), (16, 37), (1, 10), (7, 1), (16, 100), (2, 10), (33, 10), (5, 10), (16, 10)]
    _mm, specs = _segment(idx, sum(b for b, _ in plan), dim, 100)
    stored = _as_stored(data, metric)
    del data
    ns, cands, dense, _ = svc.eligible("", None)
    high = svc.rows.high
    batches = _poisoned_batches(specs, plan, rng, dim)  # every batch in its own slots, before the chain
    queued, overflows, in_c = idx.queued_batches, idx.threshold_overflows, idx.queued_c
    table = np.array([(s.q_addr, s.rows_addr, s.scores_addr) for s in specs], np.uint64)
    slot_of = {id(s): j for j, s in enumerate(specs)}
    # KALOS_BATCH_TIMING=host stamps each queued launch on the host's clock (no events); not
    # asked (the other metrics: the negative control), none, whatever the environment says
    idx.stamp_behind = metric == "ip"
    idx.batch_times = idx.queued_times = None
    idx.launch_slots(batches[0][0], batches[0][2], high, ns, cands, dense)
    for j, (part, q, k) in enumerate(batches[1:]):
        assert idx.queues_behind(len(q), k, high)
        t0 = time.perf_counter_ns()
        if j % 2:
            idx.launch_slots(part, k, high, ns, cands, dense, behind=True)
        else:
            idx.launch_behind_slots([slot_of[id(s)] for s in part], table, k, high, NS_ANY if dense else ns)
        st = idx.behind_stamps
        assert (st is not None) == idx.stamp_behind
        assert st is None or t0 <= st[0] <= st[1] <= st[2] <= time.perf_counter_ns()
        idx.finish_slots()  # the older one
    idx.finish_slots()
    assert idx.queued_batches == queued + len(plan) - 1
    assert idx.queued_c == in_c + len(plan) - 1  # both ways' CUDA calls made by _launch.run
    assert idx.threshold_overflows == overflows  # answered by the queued path, not the fallback
    _check_batches(svc, batches, stored, metric)
    idx.detach_segment()


def test_queued_batches_are_timed_when_asked() -> None:
    """With KALOS_BATCH_TIMING's lists in place, every batch queued behind another records
    its pass, its front and where it stood against the pass ahead (describe()'s
    queued_timing): the pass ahead timed each time, the stream never idle for less than
    nothing between two passes, and the answers still exact."""
    rng = np.random.default_rng()
    n, dim = 300_007, 768
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim, dtype="float16")
    put(svc, data)
    idx = svc.index
    idx.batch_times, idx.queued_times = [], []  # what KALOS_BATCH_TIMING=1 sets at start
    plan = [(5, 10), (16, 10), (9, 10), (13, 10)]
    _mm, specs = _segment(idx, sum(b for b, _ in plan), dim, 10)
    stored = _as_stored(data, "cosine")
    del data
    ns, cands, dense, _ = svc.eligible("", None)
    high = svc.rows.high
    batches = _poisoned_batches(specs, plan, rng, dim)
    idx.launch_slots(batches[0][0], batches[0][2], high, ns, cands, dense)
    ends = [idx._pass_end_ev]
    assert idx.behind_stamps is None  # (a launch not queued behind another is not stamped)
    for part, q, k in batches[1:]:
        assert idx.queues_behind(len(q), k, high)
        t0 = time.perf_counter_ns()
        idx.launch_slots(part, k, high, ns, cands, dense, behind=True)
        t1 = time.perf_counter_ns()
        ends.append(idx._pass_end_ev)  # each queued pass is the one the next follows
        # the host's clock in the launch: entered, began the CUDA calls, returned
        st = idx.behind_stamps
        assert st is not None and t0 <= st[0] <= st[1] <= st[2] <= t1, (t0, st, t1)
        idx.finish_slots()
    idx.finish_slots()
    assert all(e is not None for e in ends) and len({id(e) for e in ends}) == len(ends)
    _check_batches(svc, batches, stored, "cosine")
    assert [t[0] for t in idx.queued_times] == [16, 9, 13]
    for _, pass_us, front_us, lead_us, gap_us in idx.queued_times:
        assert 10.0 < pass_us < 50_000.0 and 0.0 < front_us < 50_000.0
        # a pass starts after both the pass ahead and its own front (events resolve ~0.5 µs)
        assert np.isfinite(lead_us) and gap_us >= -1.0 and gap_us >= front_us - lead_us - 2.0
    qt = idx.describe()["queued_timing"]
    assert qt["batches"] == 3 and qt["followed"] == 3 and qt["queries_mean"] == round(38 / 3, 2)
    idx.detach_segment()


def test_queued_batches_that_overflow_fall_back_exactly() -> None:
    """A queued batch whose candidate lists overflow (every row ties) is answered by the exact
    fallback from its own lane's descriptor, as is the batch it was queued behind."""
    rng = np.random.default_rng()
    n, dim = 40_003, 64
    same = np.tile(rng.standard_normal((1, dim)).astype(np.float32), (n, 1))
    svc = make(dim, dtype="float16")
    put(svc, same)
    idx = svc.index
    _mm, specs = _segment(idx, 16, dim, 10)
    qa = rng.standard_normal((5, dim)).astype(np.float32)
    qb = rng.standard_normal((3, dim)).astype(np.float32)
    before = idx.threshold_overflows, idx.queued_batches
    _launch(svc, specs[:5], qa, 10, behind=False)
    _launch(svc, specs[8:11], qb, 10, behind=True)
    idx.finish_slots()
    idx.finish_slots()
    assert idx.threshold_overflows == before[0] + 2 and idx.queued_batches == before[1] + 1
    unit = same[0] / np.linalg.norm(same[0])
    for part, q in ((specs[:5], qa), (specs[8:11], qb)):
        for sp, x in zip(part, q, strict=True):
            rows = sp.rows[0].tolist()
            assert len(set(rows)) == 10 and all(0 <= r < n for r in rows), rows
            assert np.allclose(sp.scores[0], unit @ (x / np.linalg.norm(x)), atol=2e-3), sp.scores
    idx.detach_segment()


@pytest.mark.parametrize("tied", [300, 3000])
def test_threshold_select_is_exact_with_ties_at_the_kth(tied: int) -> None:
    """select_cands finds the k-th candidate by radix select and sorts only what is at or above
    it: with 300 rows tied at the top that gather fits (a small sort), with 3000 it does not
    (the whole list is sorted). Neither may overflow into the fallback, and both stay exact."""
    rng = np.random.default_rng()
    n, dim = 100_003, 64
    data = rng.standard_normal((n, dim)).astype(np.float32)
    v = rng.standard_normal(dim).astype(np.float32)
    data[rng.choice(n, tied, replace=False)] = v  # identical rows: identical scores
    svc = make(dim)
    put(svc, data)
    q = np.stack([v, 2 * v, rng.standard_normal(dim).astype(np.float32)])
    before = svc.index.threshold_overflows
    for k in (10, 100):
        check(svc, data, q, k)
    assert svc.index.threshold_overflows == before  # the threshold path answered, not topk_scores


@pytest.mark.parametrize("tied", [0, 300, 3000])
def test_fused_merge_is_exact_with_long_lists_and_ties(tied: int) -> None:
    """Batch 1 (the fused scan): the last block's merge finds the k-th of the appended list by
    radix select over L2 and sorts only what is at or above it; with more ties at the top than
    its buffer holds (3000 rows, k = 10 and 100) it merges the list in rounds instead. Lists
    are long here (hundreds of blocks each appending k). Every regime stays exact."""
    rng = np.random.default_rng()
    n, dim = 200_003, 64
    data = rng.standard_normal((n, dim)).astype(np.float32)
    v = rng.standard_normal(dim).astype(np.float32)
    if tied:
        data[rng.choice(n, tied, replace=False)] = v
    svc = make(dim)
    put(svc, data)
    for q in (v, rng.standard_normal(dim).astype(np.float32)):
        for k in (10, 100, 1024):
            check(svc, data, q[None], k)


@pytest.mark.parametrize(("n", "dtype"), [(100_003, "float16"), (150_001, "float32"), (30_011, "float16")])
def test_batch1_answers_are_ordered_by_score_then_row_with_ties(n: int, dtype: str) -> None:
    """Batch 1 (the fused scan) answers in (score descending, row ascending) order, ties
    included: each block sorts its candidates at the end of its loop (up to 256 at 100k rows,
    up to 512 at 150k) and the merge sorts its survivors (k <= 32 or more), by sorting networks
    in registers (k <= 32, sort_select) or bitonic_desc, with one comparator. Rows are tied in groups of
    identical vectors (their scores equal exactly), so the order of ties is seen. Every answer
    must also be the exact top-k (tie-tolerant). (On the H200, negative controls with the tie rule reversed failed all
    three cases: S20-2's register sort, docs/experiments/2026-12-02-s20-register-sort.patch,
    S21-2's warp selection and S23-2's sort_select.)"""
    rng = np.random.default_rng()
    dim = 64
    base = rng.standard_normal((n // 7 + 1, dim)).astype(np.float32)
    data = base[rng.integers(0, len(base), n)]  # ~7 identical rows per vector, spread out
    v = data[rng.integers(0, n)]
    svc = make(dim, dtype=dtype)
    put(svc, data)
    stored = svc.index.vectors(np.arange(n)) if dtype != "float32" else data  # what the scan scores
    for q in (v, rng.standard_normal(dim).astype(np.float32)):
        for k in (1, 10, 33, 100):
            rows, scores = svc.recall(q[None], k, "", None)
            r, s = rows[0], scores[0]
            order = [(-float(a), int(b)) for a, b in zip(s, r, strict=True)]
            assert order == sorted(order), f"k={k}: not ordered by (score desc, row asc): {order[:12]}"
            assert len(set(r.tolist())) == k
            ref_i, ref_s = reference_topk(stored, q[None], k, "cosine")
            assert_topk_equal([svc.rows.ids[x] for x in r], s, [str(x) for x in ref_i[0]], ref_s[0],
                              atol=1e-3 if dtype == "float16" else 1e-4, context=f"k={k}")  # fmt: skip


def runs_of_hits(rng, n: int, dim: int, runs: int, length: int = 32) -> tuple[np.ndarray, list[int]]:
    """Random rows with ``runs`` runs of ``length`` consecutive near-copies of one vector each
    (cosine ~0.999 to it, far above any random row): one block scans a run's rows together, a
    round at a time, so its list holds several of a query's hits. One run is at the first rows
    and one at the last: the first round of a scan (forward or backward) is usually block 0's,
    whose own best the merge takes from its candidates rather than from a list."""
    data = rng.standard_normal((n, dim)).astype(np.float32)
    middle = rng.choice(np.arange(1, (n - 200) // 100), runs - 2, replace=False)
    starts = sorted([7, n - length - 7] + [int(x) * 100 + 7 for x in middle])
    for s in starts:
        data[s : s + length] = rng.standard_normal(dim) + 0.03 * rng.standard_normal((length, dim))
    return data, starts


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batch1_hits_held_by_few_blocks_are_all_found(dtype: str) -> None:
    """Batch 1 with k <= 32 and a grid of at most 480 blocks: every block writes its best k as
    a list of tagged records and block 0 reads whole lists only for the k best heads
    (kernels/recall.cu, ll_merge). Here every query's hits are a run of consecutive rows, so
    one or two lists hold all of them and the merge must read past their heads; the queries
    go from run to run and back, so a list left over from the scan before would show (each
    scan's lists carry its own tag). k = 33 takes the appended lists, as a comparison. The grid
    is checked to be one the tagged merge takes with more than one head per thread of block 0,
    and the lists' tag to move once per scan with k <= 32 and not for k = 33 (the path ran)."""
    from kalos_retrievers.sidecar.index_gpu import SYNC_TAG

    rng = np.random.default_rng()
    dim = 64
    svc = make(dim, dtype=dtype)
    groups = 256 // svc.index.tpr  # rows per block per round
    n = 2 * groups * 397 + 13  # -> a grid of 398 blocks for k <= 32 (with 100 SMs or more)
    if not 256 < svc.index._grid(n, 32) <= 480:  # (512 - k: the heads beside block 0's candidates)
        pytest.skip(f"a grid of 257-480 blocks needs 65+ SMs; this GPU gives {svc.index._grid(n, 32)}")
    data, starts = runs_of_hits(rng, n, dim, 5)
    put(svc, data)
    stored = svc.index.vectors(np.arange(n)) if dtype != "float32" else data  # what the scan scores

    def tag() -> int:
        svc.index.stream.synchronize()
        return int(svc.index.sync[SYNC_TAG])

    for s in starts + starts[::-1]:
        q = data[s + 11] + 0.01 * rng.standard_normal(dim).astype(np.float32)
        for k in (1, 10, 32, 33):
            before = tag()
            rows, scores = svc.recall(q[None], k, "", None)
            assert tag() - before == (1 if k <= 32 else 0), (s, k)
            ref_i, ref_s = reference_topk(stored, q[None], k)
            assert_topk_equal([svc.rows.ids[r] for r in rows[0]], scores[0], [str(x) for x in ref_i[0]], ref_s[0],
                              atol=1e-3 if dtype == "float16" else 1e-4, context=f"run {s} k={k}")  # fmt: skip
            assert {int(svc.rows.ids[r]) for r in rows[0][: min(k, 32)]} <= set(range(s, s + 32)), (s, k)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batch1_every_row_tied_takes_the_whole_lists(dtype: str) -> None:
    """Every row the same vector: every score ties, so the answer is the k lowest rows, and in
    the tagged merge (kernels/recall.cu, ll_merge) every head ties too: B is the k-th lowest
    head row, and the lists whose head reaches it hold ~(k - 1) x k entries at or above it (a
    block's k lowest rows lie below the next blocks' heads): with k = 32 ~990 of them, more
    than the final selection's sorting networks take (512), so the bitonic sort of the whole
    buffer answers. The lists' tag moves once per scan (the tagged merge ran). Built with that
    buffer cut to 512 entries (the negative control), the k = 32 answers miss rows."""
    from kalos_retrievers.sidecar.index_gpu import SYNC_TAG

    rng = np.random.default_rng()
    n, dim = 20_011, 64
    svc = make(dim, dtype=dtype)
    v = rng.standard_normal(dim).astype(np.float32)
    put(svc, np.repeat(v[None], n, axis=0))
    assert [svc.rows.ids[r] for r in range(n)] == [str(i) for i in range(n)]  # rows 0 .. n - 1 in order

    def tag() -> int:
        svc.index.stream.synchronize()
        return int(svc.index.sync[SYNC_TAG]) & 0xFFFFFFFF

    for q in (v, v + 0.5 * rng.standard_normal(dim).astype(np.float32)):
        for k in (32, 10, 1, 32):
            before = tag()
            rows, scores = svc.recall(q[None], k, "", None)
            assert tag() == (before + 1) & 0xFFFFFFFF, k
            assert rows[0].tolist() == list(range(k)), (k, rows[0].tolist())
            assert np.all(scores[0] == scores[0][0]), k


def test_batch1_lists_area_is_cleared_when_the_tag_wraps() -> None:
    """The tagged lists' records carry the scan's tag (kernels/recall.cu, ll_merge); when the
    tag wraps (0xffffffff -> 1), block 0 clears the whole area of heads and lists, so that no
    record left from the cycle before carries a tag the next cycle uses. Here every head and
    list entry is planted with tag 1 and a score no row has, the tag set two scans before its
    wrap: both scans stay exact (the planted records carry another tag), the tag reads 1 after
    the second, no record with tag 1 is left (the entries past k = 1 that no block rewrote
    included), and the next scans with k = 32 are exact. Built without the clearing (the
    negative control) the planted records past k = 1 are still there after the wrap."""
    import cupy as cp
    from kalos_retrievers.sidecar.index_gpu import SYNC_TAG, SYNC_WORDS

    rng = np.random.default_rng()
    n, dim = 20_011, 97
    svc = make(dim)
    data = rng.standard_normal((n, dim)).astype(np.float32)
    put(svc, data)
    area = svc.index.sync[SYNC_WORDS:].view(cp.uint32).reshape(-1, 4)  # {score, tag}, {row, tag}
    area[:, 0] = np.float32(10.0).view(np.uint32)
    area[:, 1] = 1
    area[:, 2] = 0
    area[:, 3] = 1
    svc.index.sync[SYNC_TAG] = np.uint32(0xFFFFFFFE).view(np.int32)
    cp.cuda.Device().synchronize()

    def tag() -> int:
        svc.index.stream.synchronize()
        return int(svc.index.sync[SYNC_TAG]) & 0xFFFFFFFF

    def check(k: int, expect_tag: int) -> None:
        q = rng.standard_normal((1, dim)).astype(np.float32)
        rows, scores = svc.recall(q, k, "", None)
        ref_i, ref_s = reference_topk(data, q, k)
        assert_topk_equal([svc.rows.ids[r] for r in rows[0]], scores[0], [str(x) for x in ref_i[0]], ref_s[0],
                          atol=1e-4, context=f"k={k} tag={expect_tag:#x}")  # fmt: skip
        assert tag() == expect_tag

    check(1, 0xFFFFFFFF)
    check(1, 1)  # the wrap
    left = area.get()
    stale = (left[:, 1] == 1) | (left[:, 3] == 1)
    assert not stale.any(), f"{int(stale.sum())} records with the next cycle's tag 1 left after the wrap"
    check(32, 2)
    check(32, 3)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_batch1_scans_alternate_direction_and_stay_exact(dtype: str) -> None:
    """KALOS_ALTERNATE: each batch-1 scan hands its rows out from the other end than the scan
    before it (so the rows L2 still holds are read first). The flag in ``sync`` flips on every
    scan, and both directions find the first row, the last row, a namespace held in the last
    rows only, and k above a namespace's rows. Built with -DKALOS_ALTERNATE=0 the flag never
    flips (the negative control); a wrong reversed row (n - r instead of n - 1 - r) fails the
    checks of row 0 or the namespace."""
    import cupy as cp
    from kalos_retrievers.sidecar.index_gpu import MAXQ

    rng = np.random.default_rng()
    n, dim = 100_003, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim, dtype=dtype)
    put(svc, data)
    tail = rng.standard_normal((5, dim)).astype(np.float32)
    put(svc, tail, [f"t{i}" for i in range(5)], ns="T")  # rows n .. n + 4: the last rows

    word = 3 * MAXQ + 1  # sync_dir

    def direction(d: int) -> None:
        svc.index.sync[word] = d
        cp.cuda.Device().synchronize()  # written before the index's stream reads it

    for j, k in [(0, 1), (n - 1, 10), (n // 2, 1024)]:
        for d in (0, 1):  # first to last, then last to first
            direction(d)
            rows, scores = svc.recall(data[j][None], k, "", None)
            assert int(svc.index.sync[word]) == 1 - d, (j, d)  # the scan flipped it for the next
            got = [svc.rows.ids[r] for r in rows[0]]
            assert got[0] == str(j), (j, d, got[:3])
            if dtype == "float32":
                ref_i, ref_s = reference_topk(data, data[j][None], k)
                assert_topk_equal(got, scores[0], [str(x) for x in ref_i[0]], ref_s[0], atol=1e-4,
                                  context=f"row {j} direction {d}")  # fmt: skip
    for i in range(5):
        for d in (0, 1):
            direction(d)
            rows, _ = svc.recall(tail[i][None], 10, "T", None)  # 5 rows < k: all of them, the queried first
            got = [svc.rows.ids[r] for r in rows[0]]
            assert got[0] == f"t{i}" and sorted(got) == [f"t{x}" for x in range(5)], (i, d, got)


def test_int8_l2_and_filter_against_exact() -> None:
    """int8 (dp4a against an int8 copy of the query, exact re-scoring) with L2 and a filter."""
    rng = np.random.default_rng()
    n = 30_011
    data = rng.standard_normal((n, 768)).astype(np.float32)
    svc = make(768, "l2", dtype="int8")
    put(svc, data, metas=[{"g": i % 3} for i in range(n)])
    q = rng.standard_normal((11, 768)).astype(np.float32)
    elig = np.arange(n) % 3 == 1
    rows, scores = svc.recall(q, 10, "", {"g": 1})
    ref_i, _ = reference_topk(data, q, 10, "l2", eligible=elig)
    got = [[int(svc.rows.ids[r]) for r in rr] for rr in rows]
    assert all(int(i) % 3 == 1 for rr in got for i in rr)
    assert recall_at_k(got, ref_i.tolist()) >= 0.99
    # the scores returned are the re-scored ones: -distance, to float16 precision
    exact = -np.linalg.norm(q[:, None, :] - data[np.array(got)], axis=2)
    assert np.abs(scores - exact).max() < 0.1


def test_empty_index_namespace_smaller_than_k_and_k_above_rows() -> None:
    rng = np.random.default_rng()
    svc = make(97)
    rows, _ = svc.recall(rng.standard_normal((1, 97)).astype(np.float32), 10, "", None)
    assert rows.shape == (1, 0)
    a = rng.standard_normal((37, 97)).astype(np.float32)
    b = rng.standard_normal((5, 97)).astype(np.float32)
    put(svc, a, [f"a{i}" for i in range(37)], ns="A")
    put(svc, b, [f"b{i}" for i in range(5)], ns="B")
    q = rng.standard_normal((11, 97)).astype(np.float32)
    check(svc, b, q, 10, ns="B", id_of=lambda i: f"b{i}")  # 5 rows < k
    check(svc, a, q, 1024, ns="A", id_of=lambda i: f"a{i}")  # k > rows


def test_delete_reinsert_filters_growth_and_compaction() -> None:
    rng = np.random.default_rng()
    n, dim = 20_011, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim)
    for start in range(0, n, 3001):  # several batches: capacity grows under the index
        span = range(start, min(n, start + 3001))
        put(svc, data[start : start + 3001], [str(i) for i in span],
            metas=[{"g": i % 7, "tag": "odd" if i % 2 else "even"} for i in span])  # fmt: skip
    alive = np.ones(n, bool)
    gone = rng.choice(n, n // 2, replace=False)
    svc.delete({"namespace": "", "ids": [str(i) for i in gone]})
    alive[gone] = False
    q = rng.standard_normal((11, dim)).astype(np.float32)
    check(svc, data, q, 100, eligible=alive)
    # filters: true top-k among matching rows
    g = np.arange(n) % 7
    check(svc, data, q, 10, eligible=alive & (g == 3), flt={"g": 3})
    check(svc, data, q, 10, eligible=alive & (g >= 5) & (np.arange(n) % 2 == 1),
          flt={"$and": [{"g": {"$gte": 5}}, {"tag": "odd"}]})  # fmt: skip
    # compaction moves tail rows into holes; answers must not change
    while svc.fragmentation() > 0 and svc.compact(4096):
        pass
    assert svc.rows.high == int(alive.sum())
    check(svc, data, q, 100, eligible=alive)
    # re-insert the deleted ones (and overwrite some live ones with new vectors)
    put(svc, data[gone], [str(i) for i in gone])
    alive[:] = True
    check(svc, data, q, 10)


def test_out_of_device_memory_is_a_clear_error_and_service_continues() -> None:
    rng = np.random.default_rng()
    svc = make(768, dtype="float16", limit=8 << 20)  # 8 MiB: about 5k rows
    data = rng.standard_normal((3000, 768)).astype(np.float32)
    put(svc, data)
    with pytest.raises(Invalid) as e:
        put(svc, rng.standard_normal((9000, 768)), [f"x{i}" for i in range(9000)])
    assert e.value.status == Status.CAPACITY and "device memory" in str(e.value)
    assert svc.rows.live == 3000  # nothing of the refused write went in
    rows, _ = svc.recall(data[:1], 1, "", None)
    assert svc.rows.ids[rows[0, 0]] == "0"



def test_a_kept_filters_device_mask_is_uploaded_once_and_never_stale() -> None:
    """A filter recalled again with its rows unchanged (the service's kept candidates,
    ``eligible_for`` with a key) reuses its device mask; a row written in its namespace (new
    candidates) or beside it (``high`` grows past the mask) makes a new one. Every answer is
    checked against the float32 reference over the filter's rows."""
    from kalos_retrievers.protocol import encode_json, encode_recall_args

    rng = np.random.default_rng()
    n, dim = 5003, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim)
    put(svc, data, metas=[{"g": i % 7} for i in range(n)])
    idx = svc.index
    _mm, specs = _segment(idx, 1, dim, 10)
    sp = specs[0]
    flt = {"g": 3}
    key = encode_recall_args("", encode_json(flt))

    def recall(q: np.ndarray) -> list[str]:
        sp.queries[0] = q
        sp.rows.fill(0x7F7F7F7F)
        sp.scores.fill(np.nan)
        kk = svc.recall_slots([sp], 10, "", flt, key=key)
        return [svc.rows.ids[r] for r in sp.rows[0, :kk]]

    def want(q: np.ndarray, extra: list[tuple[str, np.ndarray]] = ()) -> list[str]:  # type: ignore[assignment]
        keep = np.flatnonzero(np.arange(n) % 7 == 3)
        ids = [str(i) for i in keep] + [e[0] for e in extra]
        rows = np.concatenate([data[keep], *[e[1][None] for e in extra]])
        s = (rows @ q) / np.linalg.norm(rows, axis=1)
        return [ids[i] for i in np.argsort(-s, kind="stable")[:10]]

    q = rng.standard_normal(dim).astype(np.float32)
    assert recall(q) == want(q)
    first = idx._mask_kept
    assert first is not None and first[1] == svc.rows.high
    q2 = rng.standard_normal(dim).astype(np.float32)
    assert recall(q2) == want(q2) and idx._mask_kept[2] is first[2]  # uploaded once
    put(svc, rng.standard_normal((50, dim)), [f"o{i}" for i in range(50)], ns="other",
        metas=[{"g": 3}] * 50)  # fmt: skip  (beside it: high grows, the same candidates)
    assert recall(q2) == want(q2) and idx._mask_kept[2] is not first[2] and idx._mask_kept[1] == svc.rows.high
    close = (q2 / np.linalg.norm(q2) * 3).astype(np.float32)
    put(svc, close[None], ["new"], metas=[{"g": 3}])  # in it: a new candidate, the best
    got = recall(q2)
    assert got[0] == "new" and got == want(q2, [("new", close)])
    svc.recall_slots([sp], 10, "", flt)  # no key: a fresh (writable) answer is not kept
    assert idx._mask_kept is None


@pytest.mark.parametrize(("dim", "metric"), [(97, "cosine"), (768, "l2"), (1536, "ip")])
def test_selective_filters_scan_a_list_of_their_rows_exactly(dim: int, metric: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A filter that keeps at most 1/FILTER_LIST of the rows is searched through a list of its
    rows (scan_list; the index's ``filter_lists`` counts those searches): exact against the
    float32 reference over the rows it keeps, for batches of 1 and 11 (a launch of 8 queries
    and one of 3) and k from 1 to all the rows it keeps (the service clamps k to them), with
    deleted rows among them, in the default namespace and in another one. The control: with
    FILTER_LIST 0 the same recalls go through masks, count no list, and are exact too."""
    from kalos_retrievers.sidecar import index_gpu

    rng = np.random.default_rng()
    n, m = 40_009, 3001
    data = rng.standard_normal((n, dim)).astype(np.float32)
    other = rng.standard_normal((m, dim)).astype(np.float32)
    svc = make(dim, metric)
    g = np.arange(n) % 101  # g == 5: 396 rows, a 101st
    put(svc, data, metas=[{"g": int(x)} for x in g])
    put(svc, other, [f"o{i}" for i in range(m)], ns="N", metas=[{"g": i % 200} for i in range(m)])
    gone = rng.choice(np.flatnonzero(g == 5), 100, replace=False)
    svc.delete({"namespace": "", "ids": [str(i) for i in gone]})
    alive = np.ones(n, bool)
    alive[gone] = False
    keep, keep_n = alive & (g == 5), np.arange(m) % 200 == 7  # 296 and 15 rows
    atol = {"cosine": 1e-4, "l2": 2e-3, "ip": 1e-3}[metric]  # (ip at 1536-d: scores near 100, float32 sums)
    for fraction, listed in ((16, True), (0, False)):
        monkeypatch.setattr(index_gpu, "FILTER_LIST", fraction)
        before = svc.index.filter_lists
        for b in (1, 11):
            q = rng.standard_normal((b, dim)).astype(np.float32)
            for k in (1, 10, 300):
                check(svc, data, q, k, metric, eligible=keep, atol=atol, flt={"g": 5})
                check(svc, other, q, k, metric, eligible=keep_n, atol=atol, ns="N", flt={"g": 7},
                      id_of=lambda i: f"o{i}")  # fmt: skip
        assert (svc.index.filter_lists - before == 12) if listed else svc.index.filter_lists == before


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_listed_batch_the_mask_answers_for_less_takes_the_mask(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KALOS_LIST_LAUNCH_ROWS (session 59's rule, list_pays; the tests' conftest sets it 0):
    with it on, in an index this small every batch of a selective filter takes the mask's
    GEMM / mma pass (counted as ``lists_declined``, not ``filter_lists``) and a single query
    keeps the list; both answers exact (float32) or recall@10 >= 0.99 (float16), every row
    the filter's. The control: the rule off, the batch goes through the list."""
    from kalos_retrievers.sidecar import index_gpu

    rng = np.random.default_rng()
    n, dim = 20_011, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim, dtype=dtype)
    put(svc, data, metas=[{"g": i % 53} for i in range(n)])
    keep = np.arange(n) % 53 == 9  # 378 rows: a 53rd, so use_list says a list
    for launch_rows in (index_gpu.LIST_LAUNCH_ROWS_DEFAULT, 0):
        monkeypatch.setattr(index_gpu, "LIST_LAUNCH_ROWS", launch_rows)
        got_all, want_all = [], []  # float16: recall@10 over both calls' 12 queries
        for b in (1, 11):
            lists, declined = svc.index.filter_lists, svc.index.lists_declined
            q = rng.standard_normal((b, dim)).astype(np.float32)
            if dtype == "float32":
                check(svc, data, q, 10, eligible=keep, flt={"g": 9})
            else:
                rows, _ = svc.recall(q, 10, "", {"g": 9})
                got = [[int(svc.rows.ids[r]) for r in rr] for rr in rows]  # raises on an unwritten row
                assert all(i % 53 == 9 for rr in got for i in rr)
                got_all += got
                want_all += reference_topk(data, q, 10, eligible=keep)[0].tolist()
            to_mask = launch_rows > 0 and b > 1
            assert (svc.index.filter_lists - lists, svc.index.lists_declined - declined) == (
                (0, 1) if to_mask else (1, 0)), (launch_rows, b)  # fmt: skip
        if dtype == "float16":
            assert recall_at_k(got_all, want_all) >= 0.99, launch_rows


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_selective_filters_lists_in_reduced_precision(dtype: str) -> None:
    """float16 and int8 storage (int8: the list's scan finds candidates, re-scored exactly):
    a selective filter's recalls go through its list, every result is one of its rows, and
    recall@10 against the exact reference is at least 0.99."""
    rng = np.random.default_rng()
    n, dim = 30_011, 768
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim, dtype=dtype)
    put(svc, data, metas=[{"g": i % 37} for i in range(n)])
    q = rng.standard_normal((11, dim)).astype(np.float32)
    keep = np.arange(n) % 37 == 4
    before = svc.index.filter_lists
    rows, scores = svc.recall(q, 10, "", {"g": 4})
    assert svc.index.filter_lists == before + 1 and np.all(np.isfinite(scores))
    got = [[int(svc.rows.ids[r]) for r in rr] for rr in rows]
    assert all(i % 37 == 4 for rr in got for i in rr)
    ref_i, _ = reference_topk(data, q, 10, eligible=keep)
    assert recall_at_k(got, ref_i.tolist()) >= 0.99


def test_a_kept_selective_filters_list_is_uploaded_once_and_never_stale() -> None:
    """A selective filter recalled again with its rows unchanged (the service's kept answer)
    reuses its device list; a row written into it makes a new one, and the answer has it."""
    from kalos_retrievers.protocol import encode_json, encode_recall_args

    rng = np.random.default_rng()
    n, dim = 5003, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    svc = make(dim)
    put(svc, data, metas=[{"g": i % 41} for i in range(n)])
    idx = svc.index
    _mm, specs = _segment(idx, 1, dim, 10)
    sp = specs[0]
    flt = {"g": 3}
    key = encode_recall_args("", encode_json(flt))

    def recall(q: np.ndarray) -> list[str]:
        sp.queries[0] = q
        sp.rows.fill(0x7F7F7F7F)
        sp.scores.fill(np.nan)
        kk = svc.recall_slots([sp], 10, "", flt, key=key)
        return [svc.rows.ids[r] for r in sp.rows[0, :kk]]

    def want(q: np.ndarray, extra: list[tuple[str, np.ndarray]] = ()) -> list[str]:  # type: ignore[assignment]
        keep = np.flatnonzero(np.arange(n) % 41 == 3)
        ids = [str(i) for i in keep] + [e[0] for e in extra]
        rows = np.concatenate([data[keep], *[e[1][None] for e in extra]])
        s = (rows @ q) / np.linalg.norm(rows, axis=1)
        return [ids[i] for i in np.argsort(-s, kind="stable")[:10]]

    q = rng.standard_normal(dim).astype(np.float32)
    assert recall(q) == want(q)
    first = idx._mask_kept
    assert first is not None and first[3] and first[2].dtype == np.int32  # a list, not a mask
    q2 = rng.standard_normal(dim).astype(np.float32)
    assert recall(q2) == want(q2) and idx._mask_kept[2] is first[2]  # uploaded once
    close = (q2 / np.linalg.norm(q2) * 3).astype(np.float32)
    put(svc, close[None], ["new"], metas=[{"g": 3}])  # in it: a new row, the best
    got = recall(q2)
    assert got[0] == "new" and got == want(q2, [("new", close)]) and idx._mask_kept[2] is not first[2]

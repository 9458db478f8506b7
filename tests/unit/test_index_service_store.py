"""Sidecar internals without shared memory: rows, the CPU index against the float64 reference,
the service's write/read rules, and the SQLite store of record."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from kalos_retrievers.sidecar.index import CpuIndex, IndexCapacityError, IndexOutOfStep
from kalos_retrievers.sidecar.rows import RowTable
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore, SqliteStore, StoreInUse, StoreOpenError, StoreUnavailable
from kalos_testing import assert_topk_equal, reference_topk

from kalos_retrievers.protocol import METRICS, Invalid, Status


def svc_for(dim: int, metric: str = "cosine", store=None) -> Service:
    return Service(CpuIndex(dim, METRICS[metric]), store or NullStore(), dim=dim, metric=METRICS[metric])


def put(svc: Service, vecs, ids, ns: str = "", metas=None, texts=None) -> int:
    n = len(ids)
    return svc.upsert({"namespace": ns, "ids": list(ids), "texts": texts or ["t"] * n,
                       "metadatas": metas or [{} for _ in range(n)]}, np.asarray(vecs, np.float32))  # fmt: skip


def test_rowtable_reuses_lowest_hole_and_trims_the_tail() -> None:
    rt = RowTable(capacity=4)
    ns = rt.ns_id("", create=True)
    rows = []
    for i in range(7):  # grows past the initial capacity
        r = rt.allocate()
        rt.set(r, ns, str(i), b"d", {}, 0.0)
        rows.append(r)
    assert rows == list(range(7)) and rt.capacity >= 7 and rt.live == 7
    rt.remove(2)
    rt.remove(4)
    assert rt.allocate() == 2
    rt.set(2, ns, "2b", b"d", {}, 0.0)
    rt.remove(6)
    rt.remove(5)
    assert rt.high == 4  # rows 4..6 are empty: the tail is trimmed
    assert rt.allocate() == 4  # the next row up, whether it came from the free list or not
    rt.set(4, ns, "4b", b"d", {}, 0.0)
    assert rt.namespaces() == {"": 5} and rt.lookup(ns, "4b") == 4 and rt.lookup(ns, "4") is None


@pytest.mark.parametrize("dim", [3, 97])
@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_cpu_index_is_exact(dim: int, metric: str) -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((1013, dim)).astype(np.float32)
    svc = svc_for(dim, metric)
    put(svc, data, [str(i) for i in range(len(data))])
    for b, k in [(1, 1), (11, 10), (3, 1013), (2, 5000)]:
        q = rng.standard_normal((b, dim)).astype(np.float32)
        rows, scores = svc.recall(q, k, "", None)
        ref_i, ref_s = reference_topk(data, q, k, metric)
        for j in range(b):
            assert_topk_equal([svc.rows.ids[r] for r in rows[j]], scores[j],
                              [str(i) for i in ref_i[j]], ref_s[j], atol=1e-4, context=f"{metric} q{j}")  # fmt: skip


def test_namespaces_filters_and_deletes_give_true_top_k() -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((600, 7)).astype(np.float32)
    svc = svc_for(7)
    put(svc, data[:400], [str(i) for i in range(400)], metas=[{"g": i % 4} for i in range(400)])
    put(svc, data[400:], [str(i) for i in range(400, 600)], ns="other")
    svc.delete({"namespace": "", "ids": [str(i) for i in range(0, 400, 3)]})
    alive = np.zeros(600, bool)
    alive[:400] = True
    alive[0:400:3] = False
    g = np.arange(600) % 4
    q = rng.standard_normal((5, 7)).astype(np.float32)
    cases = [(None, alive), ({"g": 2}, alive & (g == 2)), ({"g": {"$in": [0, 3]}}, alive & np.isin(g, [0, 3]))]
    for flt, elig in cases:
        rows, scores = svc.recall(q, 25, "", flt)
        ref_i, ref_s = reference_topk(data, q, 25, eligible=elig)
        for j in range(5):
            assert_topk_equal([svc.rows.ids[r] for r in rows[j]], scores[j], [str(i) for i in ref_i[j]], ref_s[j])
    rows, _ = svc.recall(q[:1], 1000, "other", None)
    assert sorted(int(svc.rows.ids[r]) for r in rows[0]) == list(range(400, 600))
    assert svc.recall(q[:1], 5, "nope", None)[0].shape == (1, 0)


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_every_search_path_is_exact(metric: str) -> None:
    """The CPU index's paths, each against float64: a small namespace mixed with a big one
    (gathered) and the big one (masked), filters matching few rows (gathered) and many
    (masked), batches of 1 to 5 (one gemv per query up to 3, sgemm beyond)."""
    rng = np.random.default_rng()
    n, dim = 2003, 19
    data = rng.standard_normal((n, dim)).astype(np.float32)
    small = np.arange(n) % 17 == 3  # ~6% of the rows, interleaved with the big namespace's
    svc = svc_for(dim, metric)
    for start in range(0, n, 500):  # (written in turns: the namespaces' rows interleave)
        part = np.arange(start, min(n, start + 500))
        for ns, sel in (("small", part[small[part]]), ("", part[~small[part]])):
            put(svc, data[sel], [str(i) for i in sel], ns=ns, metas=[{"i": int(i)} for i in sel])
    few = {"i": {"$lt": 150}}  # ~7% of the rows: gathered
    many = {"i": {"$gte": 150}}  # ~93%: masked
    cases = [("small", None, small), ("", None, ~small), ("", few, ~small & (np.arange(n) < 150)),
             ("", many, ~small & (np.arange(n) >= 150)), ("small", many, small & (np.arange(n) >= 150))]
    for b in (1, 2, 3, 4, 5):
        q = rng.standard_normal((b, dim)).astype(np.float32)
        for ns, flt, elig in cases:
            for k in (1, 10, int(elig.sum())):
                rows, scores = svc.recall(q, k, ns, flt)
                ref_i, ref_s = reference_topk(data, q, k, metric, eligible=elig)
                for j in range(b):
                    assert_topk_equal([svc.rows.ids[r] for r in rows[j]], scores[j], [str(i) for i in ref_i[j]],
                                      ref_s[j], atol=1e-4, context=f"{ns!r} {flt} b{b} k{k} q{j}")  # fmt: skip


@pytest.mark.parametrize("dim", [3, 97])
def test_l2_ranks_near_neighbours_exactly(dim: int) -> None:
    """L2 from ``|q|² - 2q·x + |x|²`` in float32 cancels near the query: a stored row recalled
    by itself scored -0.0 among its near-duplicates and could miss the top 5. Far from the
    origin (norms ~1,000), 61 near-duplicates at distinct distances (1e-3 apart and more), in
    every search path: the default namespace scored in place, a filter over most rows
    (masked), a small namespace mixed with a big one (gathered). The order and the distances
    must be the float64 ones, from ``x - q``."""
    rng = np.random.default_rng()
    centre = rng.standard_normal(dim) * 1000 / np.sqrt(dim)
    offsets = rng.standard_normal((61, dim))
    offsets *= (np.arange(61) * 1e-3 + 1e-3)[:, None] / np.linalg.norm(offsets, axis=1, keepdims=True)
    near = (centre + offsets).astype(np.float32)
    far = (rng.standard_normal((3001, dim)) * 1000 / np.sqrt(dim)).astype(np.float32)
    svc = svc_for(dim, "l2")
    put(svc, far, [f"f{i}" for i in range(len(far))], metas=[{"near": 0}] * len(far))
    order = rng.permutation(61)  # (stored in a shuffled order: insertion order must not decide)
    put(svc, near[order], [f"n{i}" for i in order], metas=[{"near": 1}] * 61)
    put(svc, near[order], [f"s{i}" for i in order], ns="small")  # (61 of 3,183 rows: gathered)
    for target in (0, 7, 60):
        q = near[target][None, :]
        d = np.sqrt(((near.astype(np.float64) - q[0].astype(np.float64)) ** 2).sum(1))
        want = np.argsort(d, kind="stable")[:10]
        for ns, flt, prefix in (("", None, "n"), ("", {"near": {"$gte": 0}}, "n"), ("small", None, "s")):
            rows, scores = svc.recall(q, 10, ns, flt)
            got = [svc.rows.ids[r] for r in rows[0]]
            assert got == [f"{prefix}{i}" for i in want], (target, ns, flt, got, d[want])
            np.testing.assert_allclose(scores[0], -d[want], rtol=1e-6, atol=1e-6, err_msg=f"{target} {ns} {flt}")


def _exact_l2_rows(data: np.ndarray, q: np.ndarray, k: int) -> list[int]:
    d = ((data.astype(np.float64) - q.astype(np.float64)) ** 2).sum(1)
    return np.lexsort((np.arange(len(data)), d))[:k].tolist()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_l2_is_exact_at_float32s_extremes() -> None:
    """Subnormal squares (elements ~1e-21: each float32 operation off by a fixed amount the
    relative bound missed; a review found 1,486 wrong answers in 20,000 small cases) and
    ``2q·x`` overflowing with finite norms (the clamp read that row as distance 0 and the
    nearest was cut): the CPU index's L2 answer is float64's for both."""
    ix = CpuIndex(2, METRICS["l2"])
    far = np.array([[1.35e19, 1e19], [1.25e19, 0.0]], np.float32)
    ix.set_rows(np.arange(2), far, np.zeros(2, np.int32))
    rows, scores = ix.search(np.array([[1.3e19, 0.0]], np.float32), 1, 2, 0, None, True)
    assert rows[0].tolist() == [1] and scores[0, 0] == pytest.approx(-5e17, rel=1e-6)
    rng = np.random.default_rng()
    wrong = []
    for _ in range(2000):
        dim, n = int(rng.integers(1, 4)), int(rng.integers(2, 8))
        k = int(rng.integers(1, n))
        scale = 10.0 ** rng.uniform(-24, -19)
        base = rng.normal(size=dim) * scale
        data = (base + rng.normal(size=(n, dim)) * scale * 10.0 ** rng.uniform(-4, 0)).astype(np.float32)
        qs = (base + rng.normal(size=(3, dim)) * scale * 10.0 ** rng.uniform(-4, 0)).astype(np.float32)
        ix = CpuIndex(dim, METRICS["l2"])
        ix.set_rows(np.arange(n), data, np.zeros(n, np.int32))
        got = ix.search(qs, k, n, 0, None, True)[0]  # (a batch: each query's bound its own)
        for q, rows in zip(qs, got, strict=True):
            if rows.tolist() != _exact_l2_rows(data, q, k):
                wrong.append((data.tolist(), q.tolist(), k, rows.tolist()))
    assert not wrong, (len(wrong), wrong[:2])


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_rows_of_another_namespace_never_answer_when_scores_overflow(metric: str) -> None:
    """Vectors near float32's limits score -inf (or NaN for l2): a search that masks the
    other rows must not let a masked row (another namespace's) tie its way in."""
    svc = svc_for(2, metric)
    put(svc, np.ones((6, 2)) * [1, 0], [f"s{i}" for i in range(6)], ns="secret")
    put(svc, np.full((2, 2), 3e38), ["m0", "m1"], ns="mine", metas=[{"t": 1}] * 2)
    q = np.full((1, 2), -3e38, np.float32)
    for flt in (None, {"t": 1}):
        rows, _ = svc.recall(q, 2, "mine", flt)
        assert sorted(svc.rows.ids[r] for r in rows[0]) == ["m0", "m1"], flt


def test_overwrite_keeps_created_at_and_same_id_twice_in_one_call_keeps_the_last() -> None:
    svc = svc_for(3)
    put(svc, [[1, 0, 0]], ["a"], texts=["first"])
    created = float(svc.rows.created[svc.rows.lookup(0, "a")])
    time.sleep(0.01)
    put(svc, [[0, 1, 0], [0, 0, 1]], ["a", "a"], texts=["second", "third"])
    row = svc.rows.lookup(0, "a")
    assert svc.rows.live == 1 and float(svc.rows.created[row]) == created
    rows, _ = svc.recall(np.array([[0, 0, 1]], np.float32), 1, "", None)
    assert rows[0, 0] == row and b"third" in svc.rows.docs[row]


def test_scan_pages_follow_writes_deletes_and_compaction() -> None:
    """scan keeps a namespace's order between calls (sidecar/service.py, _scan_order); each
    write, delete and compaction move of that namespace's rows makes it anew, and another
    namespace's changes leave it be. Every page is checked against the order made from
    scratch (created_at, then id)."""
    rng = np.random.default_rng()
    svc = svc_for(3)

    def want(ns: str, flt=None) -> list[str]:  # type: ignore[no-untyped-def]
        ns_id = svc.rows.ns_id(ns)
        rows = [r for r in range(svc.rows.high) if svc.rows.ns_of[r] == ns_id]
        if flt is not None:
            rows = [r for r in rows if svc.rows.meta.evaluate(flt, np.array([r]))[0]]
        return [svc.rows.ids[r] for r in sorted(rows, key=lambda r: (svc.rows.created[r], svc.rows.ids[r]))]

    def pages(ns: str, flt=None, size: int = 7) -> list[str]:  # type: ignore[no-untyped-def]
        out: list[str] = []
        while True:
            page = svc.scan({"namespace": ns, "filter": flt, "limit": size, "offset": len(out)})
            out += [svc.rows.ids[r] for r in page]
            if len(page) < size:
                return out

    for batch in range(4):  # (one created_at per call: ties broken by id)
        put(svc, rng.standard_normal((25, 3)), [f"{batch}-{i:02d}" for i in rng.permutation(25)],
            metas=[{"b": batch}] * 25)  # fmt: skip
        put(svc, rng.standard_normal((5, 3)), [f"o{batch}-{i}" for i in range(5)], ns="other")
    assert pages("") == want("") and len(want("")) == 100
    assert pages("", {"b": {"$gte": 2}}) == want("", {"b": {"$gte": 2}})
    put(svc, rng.standard_normal((3, 3)), ["new-a", "new-b", "0-03"])  # new rows and an overwrite
    assert pages("") == want("") and "new-b" in pages("")
    put(svc, rng.standard_normal((2, 3)), ["o9-0", "o9-1"], ns="other")  # another namespace
    assert pages("") == want("")
    svc.delete({"namespace": "", "ids": [f"{b}-{i:02d}" for b in range(4) for i in range(0, 25, 2)]})
    assert pages("") == want("") and len(want("")) == 100 + 2 - 52
    while svc.compact(8):  # rows move into the holes: the kept order's row numbers are stale
        assert pages("") == want("")
    assert pages("") == want("") and pages("other") == want("other")


def test_compaction_moves_tail_rows_into_holes_without_changing_answers() -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((3001, 5)).astype(np.float32)
    svc = svc_for(5)
    put(svc, data, [str(i) for i in range(3001)])
    gone = rng.choice(3001, 2000, replace=False)
    svc.delete({"namespace": "", "ids": [str(i) for i in gone]})
    q = rng.standard_normal((4, 5)).astype(np.float32)
    before = svc.recall(q, 50, "", None)
    ids_before = [[svc.rows.ids[r] for r in rr] for rr in before[0]]
    assert svc.fragmentation() > 0
    while svc.compact(256):
        pass
    assert svc.fragmentation() == 0 and svc.rows.high == 1001
    after = svc.recall(q, 50, "", None)
    np.testing.assert_allclose(after[1], before[1])
    # tie-tolerant: two rows with the same float32 score (~0.1% of runs at 5-d) may swap, as
    # the search breaks ties by row position and compaction moves rows
    for j in range(4):
        assert_topk_equal([svc.rows.ids[r] for r in after[0][j]], after[1][j], ids_before[j], before[1][j],
                          atol=1e-6, context=f"q{j}")  # fmt: skip


@pytest.mark.parametrize(
    ("args", "vecs", "status", "match"),
    [
        ({"ids": ["a"], "texts": ["t"], "metadatas": [{}]}, [[0, 0, 0]], Status.BAD_REQUEST, "all zeros"),
        ({"ids": ["a"], "texts": ["t"], "metadatas": [{}]}, [[np.nan, 0, 1]], Status.BAD_REQUEST, "NaN"),
        ({"ids": ["a", "b"], "texts": ["t"], "metadatas": [{}]}, [[1, 0, 0]], Status.BAD_REQUEST,
         "ids must be a list of 1"),
        ({"ids": [""], "texts": ["t"], "metadatas": [{}]}, [[1, 0, 0]], Status.BAD_REQUEST, "non-empty"),
        ({"ids": ["a"], "texts": [3], "metadatas": [{}]}, [[1, 0, 0]], Status.BAD_REQUEST, "texts"),
        ({"ids": ["a"], "texts": ["t"], "metadatas": [[]]}, [[1, 0, 0]], Status.BAD_REQUEST, "metadatas"),
        ({"ids": ["a"], "texts": ["t"], "metadatas": [{}], "namespace": 7}, [[1, 0, 0]], Status.BAD_REQUEST,
         "namespace"),
        # what JSON can carry and UTF-8 or strict JSON cannot (a non-Python client's request):
        # a lone surrogate was an internal error, or "the store of record failed to commit"
        ({"ids": ["\ud800"], "texts": ["t"], "metadatas": [{}]}, [[1, 0, 0]], Status.BAD_REQUEST,
         r"ids\[0\] is not valid Unicode"),
        ({"ids": ["a", "b"], "texts": ["t", "x\udfff"], "metadatas": [{}, {}]}, [[1, 0, 0], [0, 1, 0]],
         Status.BAD_REQUEST, r"texts\[1\] is not valid Unicode"),
        ({"ids": ["a"], "texts": ["t"], "metadatas": [{}], "namespace": "n\ud800"}, [[1, 0, 0]], Status.BAD_REQUEST,
         "namespace is not valid Unicode"),
        ({"ids": ["a"], "texts": ["t"], "metadatas": [{"k\ud800": 1}]}, [[1, 0, 0]], Status.BAD_REQUEST,
         r"metadatas\[0\] cannot be stored"),
        ({"ids": ["a"], "texts": ["t"], "metadatas": [{"x": float("inf")}]}, [[1, 0, 0]], Status.BAD_REQUEST,
         r"metadatas\[0\] cannot be stored: Out of range float"),
    ],
)
def test_service_rechecks_what_it_reads(args, vecs, status, match, tmp_path: Path) -> None:
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    svc = svc_for(3, store=st)
    with pytest.raises(Invalid, match=match) as e:
        svc.upsert(args, np.asarray(vecs, np.float32))
    assert e.value.status == status and svc.rows.live == 0 and st.count() == 0
    assert svc.upsert({"ids": ["ok"], "texts": ["t é"], "metadatas": [{"k": 1.5}]},
                      np.ones((1, 3), np.float32)) == 1  # (control: the store takes a good one)
    st.close()


def test_deletes_and_counts_are_checked_whatever_the_namespace_holds() -> None:
    """A delete with nothing to delete by, or a bad filter, was answered 0 for a namespace that
    does not exist and refused for one that does; a count with a filter and no namespace
    ignored the filter. Both are refused alike now (the Python client never sends them: a
    non-Python client's request). Control: the good forms still answer."""
    svc = svc_for(3)
    put(svc, np.eye(3, dtype=np.float32), ["a", "b", "c"])
    for ns in ("", "nowhere"):
        bad = ({"namespace": ns}, {"namespace": ns, "filter": {"x": {"$bogus": 1}}}, {"namespace": ns, "ids": "a"})
        for args in bad:
            with pytest.raises(Invalid) as e:
                svc.delete(args)
            assert e.value.status == Status.BAD_REQUEST, (ns, args)
    with pytest.raises(Invalid, match="a count with a filter needs a namespace"):
        svc.count({"filter": {"x": 1}})
    assert svc.delete({"namespace": "nowhere", "ids": ["a"]}) == 0 and svc.count({}) == 3
    assert svc.count({"namespace": "", "filter": {"x": 1}}) == 0 and svc.delete({"namespace": "", "all": True}) == 3


# ------------------------------------------------------------------------------ store


def test_store_round_trip_and_rebuild(tmp_path: Path) -> None:
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    svc = svc_for(3, store=st)
    put(svc, [[1, 0, 0], [0, 1, 0], [0, 0, 1]], ["a", "b", "c"], ns="n",
        metas=[{"x": 1}, {"x": [1, "é"]}, {}], texts=["A", "B", "C"])  # fmt: skip
    svc.delete({"namespace": "n", "ids": ["b"]})
    st.close()
    st2 = SqliteStore(tmp_path, dim=3, metric="cosine")
    svc2 = svc_for(3, store=st2)
    assert svc2.load() == 2
    rows, _ = svc2.recall(np.array([[1, 0.1, 0]], np.float32), 5, "n", None)
    assert [svc2.rows.ids[r] for r in rows[0]] == ["a", "c"]
    assert oct((tmp_path / "kalos.sqlite3").stat().st_mode & 0o777) == "0o600"
    st2.close()


def test_failed_commits_are_logged_with_a_traceback_once_a_minute(monkeypatch, caplog) -> None:
    """A full disk fails every write: each logged a traceback (~500 in 20 s in a rehearsal).
    The first is logged, the next ones within a minute are counted and said with the next
    report. Every write still fails with STORE. Control: with the interval at 0 each is."""
    import logging

    from kalos_retrievers.sidecar import service as service_module

    caplog.set_level(logging.ERROR, "kalos_retrievers.sidecar")
    svc = svc_for(3, store=NullStore())

    def full(*a: object, **k: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(svc.store, "upsert", full)
    for interval, want in ((60.0, 1), (0.0, 5)):
        monkeypatch.setattr(service_module, "_COMMIT_LOG_EVERY", interval)
        svc._commit_logged, svc._commit_quiet = -float("inf"), 0
        caplog.clear()
        for i in range(5):
            with pytest.raises(Invalid, match="disk is full") as e:
                put(svc, [[1, 0, 0]], [f"x{i}"])
            assert e.value.status == Status.STORE
        logged = [r for r in caplog.records if "store commit failed" in r.getMessage()]
        assert len(logged) == want and logged[0].exc_info is not None
    monkeypatch.setattr(service_module, "_COMMIT_LOG_EVERY", 60.0)
    svc._commit_logged = time.monotonic() - 61  # a minute on: the next report counts the quiet ones
    svc._commit_quiet = 4
    caplog.clear()
    with pytest.raises(Invalid):
        put(svc, [[1, 0, 0]], ["y"])
    assert "(4 more since the last report)" in caplog.records[-1].getMessage()


def test_a_new_data_dir_is_fsynced_into_its_parent(tmp_path: Path, monkeypatch) -> None:
    """Every directory the store makes has its parent fsynced (else a power cut could lose the
    new data dir with the writes acknowledged in it); an existing one fsyncs nothing extra."""
    import kalos_retrievers.sidecar.store as store_mod

    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        with contextlib.suppress(OSError):
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if target.is_dir():
                synced.append(target)
        real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    st = SqliteStore(tmp_path / "a" / "b" / "data", dim=3, metric="l2")
    st.close()
    # (the data dir last: the new store's file was renamed into it)
    assert synced == [tmp_path, tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "data"]
    synced.clear()
    SqliteStore(tmp_path / "a" / "b" / "data", dim=3, metric="l2").close()  # (reopened)
    assert synced == []

    def refused(fd: int) -> None:  # (some FUSE and CIFS mounts refuse to fsync a directory)
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_dir():
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "fsync", refused)
    st = SqliteStore(tmp_path / "c" / "data", dim=3, metric="l2")  # opens all the same
    assert st.count() == 0
    st.close()


def page_size(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return int(db.execute("PRAGMA page_size").fetchone()[0])


def test_a_new_store_takes_large_pages_and_an_older_one_keeps_its_own(tmp_path: Path, monkeypatch) -> None:
    """A new store is made with ``PAGE_SIZE`` pages (on SQLite's default 4,096 every 768-d row
    spills onto an overflow page); a store made before, on the default pages, keeps them (SQLite
    fixes the page size when the file is first written) and its rows, and takes new writes."""
    import kalos_retrievers.sidecar.store as store_module

    new, old = tmp_path / "new", tmp_path / "old"
    st = SqliteStore(new, dim=3, metric="cosine")
    put(svc_for(3, store=st), [[1, 0, 0]], ["a"])
    st.close()
    assert page_size(new / "kalos.sqlite3") == store_module.PAGE_SIZE == 65536
    with monkeypatch.context() as m:  # (as the releases before made it: no page_size pragma)
        m.setattr(store_module, "PAGE_SIZE", 4096)
        st = SqliteStore(old, dim=3, metric="cosine")
        put(svc_for(3, store=st), [[1, 0, 0], [0, 1, 0]], ["a", "b"])
        st.close()
    assert page_size(old / "kalos.sqlite3") == 4096
    st = SqliteStore(old, dim=3, metric="cosine")
    svc = svc_for(3, store=st)
    assert svc.load() == 2
    put(svc, [[0, 0, 1]], ["c"])
    st.close()
    st = SqliteStore(old, dim=3, metric="cosine")
    assert svc_for(3, store=st).load() == 3
    st.close()
    assert page_size(old / "kalos.sqlite3") == 4096


def test_a_reload_keeps_each_rows_metadata_empty_or_not(tmp_path: Path) -> None:
    """Start-up rebuilds the filter columns from the stored metadata (rows stored with none
    take a shortcut): after a reload of more rows than the row table starts with, a filter
    matches exactly the rows it matched before."""
    st = SqliteStore(tmp_path, dim=3, metric="ip")
    svc = svc_for(3, "ip", store=st)
    n = 1031  # past the initial 1,024 rows
    vecs = np.random.default_rng(5).standard_normal((n, 3)).astype(np.float32)
    metas = [{"x": i % 3} if i % 2 else {} for i in range(n)]
    put(svc, vecs, [str(i) for i in range(n)], metas=metas)
    st.close()
    st2 = SqliteStore(tmp_path, dim=3, metric="ip")
    svc2 = svc_for(3, "ip", store=st2)
    assert svc2.load() == n
    for flt, want in (({"x": 1}, {str(i) for i in range(n) if i % 2 and i % 3 == 1}),
                      ({"x": {"$exists": False}}, {str(i) for i in range(0, n, 2)})):  # fmt: skip
        rows, _ = svc2.recall(np.array([[1, 0, 0]], np.float32), n, "", flt)
        assert {svc2.rows.ids[r] for r in rows[0]} == want, flt
    st2.close()


class _LimitedIndex(CpuIndex):
    """A CPU index that cannot grow past ``limit`` rows, as a GPU's memory limit."""

    def __init__(self, dim: int, limit: int) -> None:
        super().__init__(dim, METRICS["cosine"])
        self.limit = limit

    def reserve(self, capacity: int) -> None:
        if capacity > self.limit:
            raise IndexCapacityError(f"{capacity} rows over the limit of {self.limit}")
        super().reserve(capacity)


@pytest.mark.parametrize(("limit", "room"), [(None, True), (5000, True), (3100, False), (2999, None)])
def test_a_reload_leaves_room_for_the_next_writes_where_it_fits(tmp_path: Path, limit, room) -> None:
    """Start-up sizes the index once for the stored rows and as much again as growing by
    doubling would have left (so the first new row after a start does not copy the index);
    only the stored rows where that does not fit; a start that cannot hold them fails."""
    n = 3000
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    put(svc_for(3, store=st), np.random.default_rng(8).standard_normal((n, 3)), [str(i) for i in range(n)])
    st.close()
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    index = CpuIndex(3, METRICS["cosine"]) if limit is None else _LimitedIndex(3, limit)
    svc = Service(index, st, dim=3, metric=METRICS["cosine"])
    if room is None:
        with pytest.raises(IndexCapacityError):
            svc.load()
        st.close()
        return
    assert svc.load() == n
    assert index.capacity == (4096 if room else n) and svc.rows.capacity >= 4096
    put(svc, [[1, 2, 3]], ["new"])
    assert index.capacity == (4096 if room else 6000)  # (without room, the first new row grew it)
    st.close()


def test_row_crc_is_the_crc_of_the_fields_joined_by_nul() -> None:
    """The checksum's format is on disk in every store: it must not change with its code."""
    import struct
    import zlib

    from kalos_retrievers.sidecar.store import row_crc

    vec = np.arange(5, dtype="<f4").tobytes()
    joined = b"\x00".join([b"ns", "idé".encode(), b"text", b'{"a":1}', vec])
    assert row_crc("ns", "idé", "text", b'{"a":1}', vec) == zlib.crc32(joined)
    times = struct.pack("<dd", 1.5, 2.5)
    assert row_crc("ns", "idé", "text", b'{"a":1}', vec, 1.5, 2.5) == zlib.crc32(joined + b"\x00" + times)
    assert row_crc("ns", "idé", "text", b'{"a":1}', vec, 1.5, 2.25) != zlib.crc32(joined + b"\x00" + times)


def _norm_refused(*a, **k):
    raise AssertionError("the general route (np.linalg.norm) ran")


def test_normalize_rows_in_bulk_matches_float64_and_keeps_extreme_rows_right(monkeypatch) -> None:
    """Many float32 rows take a faster route than one or a few; both give unit rows, and a
    batch holding a row too large or too small for it (or a zero row) falls back whole."""
    from kalos_retrievers.sidecar.index import _NORM_FAST_MIN, normalize_rows

    rng = np.random.default_rng(11)
    x = rng.standard_normal((_NORM_FAST_MIN + 45, 97)) * rng.uniform(1e-3, 1e3, (_NORM_FAST_MIN + 45, 1))
    x = x.astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.linalg.norm(x64, axis=1, keepdims=True)
    with monkeypatch.context() as m:
        m.setattr(np.linalg, "norm", _norm_refused)  # the bulk route must be the one taken
        got = normalize_rows(x)
    assert got.dtype == np.float32 and np.abs(got - want).max() < 3e-7
    for extreme in (3e38, 1e-40, 0.0):
        y = x.copy()
        y[200] = extreme
        got = normalize_rows(y)
        norms = np.linalg.norm(got.astype(np.float64), axis=1)
        assert np.all(np.isfinite(got)), extreme
        if extreme:
            assert np.abs(norms - 1).max() < 1e-6, extreme
        else:
            assert norms[200] == 0 and np.abs(np.delete(norms, 200) - 1).max() < 1e-6


@pytest.mark.parametrize("scale", [1e-25, 1e-3, 1.0, 7e4, 1e25])
def test_normalize_rows_one_row_matches_float64(scale: float, monkeypatch) -> None:
    from kalos_retrievers.sidecar.index import normalize_rows

    x = (np.random.default_rng(int(np.log10(scale)) + 40).standard_normal((1, 769)) * scale).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.linalg.norm(x64)
    monkeypatch.setattr(np.linalg, "norm", _norm_refused)  # the one-row route must be the one taken
    got = normalize_rows(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.abs(got - want).max() < 3e-7


@pytest.mark.parametrize("value", [3e38, 1e-40, 0.0, 1e-45])
def test_normalize_rows_one_extreme_row_is_unit_or_zero(value: float) -> None:
    from kalos_retrievers.sidecar.index import normalize_rows

    x = np.full((1, 5), value, np.float32)
    x[0, 1] = -value
    norm = float(np.linalg.norm(normalize_rows(x).astype(np.float64)))
    assert norm == 0 if value == 0 else abs(norm - 1) < 1e-6


def test_a_zero_row_deep_in_a_bulk_upsert_is_named() -> None:
    svc = svc_for(4)
    vecs = np.ones((300, 4), np.float32)
    vecs[257] = -0.0
    with pytest.raises(Invalid, match=r"vectors\[257\] is all zeros"):
        put(svc, vecs, [str(i) for i in range(300)])
    vecs[257, 3] = 1e-45  # the smallest float32 above zero still has a direction
    assert put(svc, vecs, [str(i) for i in range(300)]) == 300


def test_store_refuses_a_second_sidecar_on_the_same_dir(tmp_path: Path) -> None:
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    with pytest.raises(StoreInUse, match="in use by another running sidecar"):  # (exit 3, not 4)
        SqliteStore(tmp_path, dim=3, metric="cosine")
    st.close()
    SqliteStore(tmp_path, dim=3, metric="cosine").close()  # released with the first


def test_store_refuses_other_settings_and_other_schema(tmp_path: Path) -> None:
    SqliteStore(tmp_path, dim=3, metric="cosine").close()
    with pytest.raises(StoreOpenError, match=r"dim=3 metric=cosine.*--dim 4"):
        SqliteStore(tmp_path, dim=4, metric="cosine")
    _sql(tmp_path, "UPDATE meta SET value='0' WHERE key='schema_version'")
    with pytest.raises(StoreOpenError, match="schema version 0"):
        SqliteStore(tmp_path, dim=3, metric="cosine")


def test_store_without_its_memories_table_is_refused_as_damaged(tmp_path: Path) -> None:
    """A Kalos meta table without the rows' table: refused at open (exit 4); it crashed the
    start with sqlite3.OperationalError (exit 1, which a supervisor restarts in a loop)."""
    SqliteStore(tmp_path, dim=3, metric="cosine").close()
    _sql(tmp_path, "DROP TABLE memories")
    with pytest.raises(StoreOpenError, match="no memories table: the store is damaged"):
        SqliteStore(tmp_path, dim=3, metric="cosine")


def _sql(data_dir: Path, statement: str) -> None:
    """One statement on a closed store's file, committed."""
    db = sqlite3.connect(data_dir / "kalos.sqlite3")
    db.execute(statement)
    db.commit()
    db.close()


def test_store_detects_a_flipped_byte_in_a_vector(tmp_path: Path) -> None:
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    put(svc_for(3, store=st), [[1, 2, 3]], ["a"], texts=["hello"])
    st.close()
    db = sqlite3.connect(tmp_path / "kalos.sqlite3")
    (vec,) = db.execute("SELECT vector FROM memories").fetchone()
    bad = bytearray(vec)
    bad[5] ^= 0x10
    db.execute("UPDATE memories SET vector=?", (bytes(bad),))
    db.commit()
    db.close()
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    with pytest.raises(StoreOpenError, match="fails its checksum"):
        svc_for(3, store=st).load()
    st.close()


def test_a_second_sidecar_is_refused_after_the_lock_file_was_removed(tmp_path: Path) -> None:
    """The data dir itself is locked too: removing kalos.lock (a "stale lock") while its
    holder runs let a second sidecar lock a new file and share the store."""
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    (tmp_path / "kalos.lock").unlink()
    with pytest.raises(StoreInUse, match="in use by another running sidecar"):
        SqliteStore(tmp_path, dim=3, metric="cosine")
    st.close()
    SqliteStore(tmp_path, dim=3, metric="cosine").close()  # (released with the first)


def test_a_data_dir_that_cannot_be_read_opens_on_the_lock_files_lock(tmp_path: Path, monkeypatch) -> None:
    """A directory this user may write but not read (mode 0300) cannot be opened to be locked:
    the lock file's lock holds alone, as before the directory's (which refused the store,
    exit 6)."""
    import kalos_retrievers.sidecar.store as store_mod

    real_open = os.open

    def no_read(path, flags, *a):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECTORY and Path(path) == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(store_mod.os, "open", no_read)
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    with pytest.raises(StoreInUse):
        SqliteStore(tmp_path, dim=3, metric="cosine")
    st.close()


@pytest.mark.parametrize("lost", ["emptied", "emptied, beside its log", "removed, beside its log"])
def test_a_lost_main_file_is_refused_not_made_anew(tmp_path: Path, lost: str) -> None:
    """SQLite opens an empty (or missing) main file as a new database, deleting a log beside
    it, which after a kill -9 holds the rows not yet checkpointed: the store is refused
    (exit 4) and the log kept. (Before: it started empty, the log gone.) The control: a
    missing file without a log is a new store."""
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    put(svc_for(3, store=st), [[1, 2, 3]], ["a"])
    st.close()
    main, wal = tmp_path / "kalos.sqlite3", tmp_path / "kalos.sqlite3-wal"
    if "log" in lost:
        wal.write_bytes(b"\x37\x7f\x06\x82" + b"\0" * 4096)  # (frames a kill -9 left)
    if lost.startswith("emptied"):
        main.write_bytes(b"")
    else:
        main.unlink()
    with pytest.raises(StoreOpenError, match=r"is (empty|missing)") as e:
        SqliteStore(tmp_path, dim=3, metric="cosine")
    assert not isinstance(e.value, StoreUnavailable)
    assert ("log" in lost) == wal.exists() and (lost.startswith("emptied")) == main.exists()
    for f in tmp_path.glob("kalos.sqlite3*"):
        f.unlink()
    SqliteStore(tmp_path, dim=3, metric="cosine").close()  # (the control: a new store)


def test_a_new_store_is_made_whole_and_put_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new store is written under a temporary name and renamed: a full disk (or a kill) at
    the first start leaves no empty kalos.sqlite3, which the next start would refuse as a
    truncated store (SQLite creates its file empty and writes the first page later). The
    start after it makes the store. Before: the 0-byte file stayed (and was served as new)."""
    import kalos_retrievers.sidecar.store as store_mod

    real = store_mod.SqliteStore._create

    def full(self: SqliteStore, dim: int, metric: str) -> None:
        e = sqlite3.OperationalError("database or disk is full")
        e.sqlite_errorcode, e.sqlite_errorname = 13, "SQLITE_FULL"
        raise e

    monkeypatch.setattr(store_mod.SqliteStore, "_create", full)
    with pytest.raises(StoreUnavailable, match="disk full"):
        SqliteStore(tmp_path, dim=3, metric="cosine")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kalos.lock"]
    monkeypatch.setattr(store_mod.SqliteStore, "_create", real)
    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    put(svc_for(3, store=st), [[1, 2, 3]], ["a"])
    assert st.count() == 1 and not (tmp_path / "kalos.sqlite3.new").exists()
    st.close()


def test_a_row_table_that_cannot_grow_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Running out of memory part-way through a growth (answered CAPACITY, the sidecar serving
    on) leaves every array at the old size: the next growth works. Before, a column's arrays of
    two lengths failed every later growth (ValueError, INTERNAL) until a restart."""
    import kalos_retrievers.sidecar.metadata as meta_mod

    monkeypatch.setattr(meta_mod, "sparse_max", lambda capacity: 0)  # (dense columns: the arrays to grow)
    svc = svc_for(3)
    put(svc, np.ones((5, 3)), [f"r{i}" for i in range(5)], metas=[{"k": i, "s": "x"} for i in range(5)])
    cap = svc.rows.capacity
    real_full = meta_mod.np.full
    calls = [0]

    def oom_on_the_third(*a, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError
        return real_full(*a, **kw)

    many = [f"n{i}" for i in range(cap)]
    with monkeypatch.context() as m:
        m.setattr(meta_mod.np, "full", oom_on_the_third)
        with pytest.raises(Invalid) as e:
            put(svc, np.ones((len(many), 3)), many)
        assert e.value.status == Status.CAPACITY
    assert svc.rows.capacity == cap
    lengths = {len(getattr(c, n)) for c in svc.rows.meta.cols.values() for n in ("kind", "num", "obj", "code")}
    assert lengths == {cap} and len(svc.rows.ns_of) == cap
    assert put(svc, np.ones((len(many), 3)), many) == len(many)  # (grows now)
    assert svc.count({"namespace": ""}) == cap + 5


def test_the_rows_reserved_before_a_commit_ignore_stale_free_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows a trim left in the free list at or above `high` are not rows the next write can
    take: the table is grown for it before the commit all the same. (Before, they were
    counted, and the growth came after the commit.)"""
    svc = svc_for(3)
    put(svc, np.ones((512, 3)), [f"a{i}" for i in range(512)], ns="A")
    put(svc, np.ones((512, 3)), [f"b{i}" for i in range(512)], ns="B")
    svc.delete({"namespace": "B", "all": True})
    assert svc.rows.high == 512 and len(svc.rows.free) > 0
    grown_after_commit: list[int] = []
    real_set = svc.rows.set

    def watch(*a, **kw):  # type: ignore[no-untyped-def]
        grown_after_commit.append(svc.rows.capacity)
        return real_set(*a, **kw)

    monkeypatch.setattr(svc.rows, "set", watch)
    cap_before_apply = []
    real_commit = svc._commit

    def commit(fn):  # type: ignore[no-untyped-def]
        real_commit(fn)
        cap_before_apply.append(svc.rows.capacity)

    monkeypatch.setattr(svc, "_commit", commit)
    put(svc, np.ones((1000, 3)), [f"c{i}" for i in range(1000)], ns="C")
    assert cap_before_apply[0] >= 1512 and set(grown_after_commit) == {cap_before_apply[0]}


@pytest.mark.parametrize(("code", "outside"), [(13, True), (4874, True), (14, True), (11, False), (26, False),
                                               (522, False)])  # fmt: skip
def test_an_error_from_outside_the_store_is_told_apart_from_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, outside: bool
) -> None:
    """A full disk (SQLITE_FULL 13, SQLITE_IOERR_SHMSIZE 4874 where the -shm file cannot be
    made), or a file that cannot be opened, is StoreUnavailable (exit 1: a restart may serve
    it); damage (CORRUPT 11, NOTADB 26, a short read 522) stays StoreOpenError (exit 4). Before,
    each was "the store is corrupt", exit 4."""
    SqliteStore(tmp_path, dim=3, metric="cosine").close()
    real = sqlite3.connect

    def failing(*a, **kw):  # type: ignore[no-untyped-def]
        e = sqlite3.OperationalError("as SQLite says it")
        e.sqlite_errorcode, e.sqlite_errorname = code, f"SQLITE_{code}"
        raise e

    monkeypatch.setattr(sqlite3, "connect", failing)
    with pytest.raises(StoreOpenError) as e:
        SqliteStore(tmp_path, dim=3, metric="cosine")
    assert isinstance(e.value, StoreUnavailable) == outside, e.value
    assert ("corrupt" in str(e.value)) != outside
    monkeypatch.setattr(sqlite3, "connect", real)
    SqliteStore(tmp_path, dim=3, metric="cosine").close()  # (and released)


def test_sqlite_s_cannot_open_is_told_by_its_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLITE_CANTOPEN comes from a permission or a directory in a file's place as well as
    from the disk: the cause is looked up. A file this user may not write is a PermissionError
    (exit 6, no restart), a directory at the -shm file's place a StoreOpenError (exit 4); a
    failed fsync while a new store is made is StoreUnavailable (exit 1), not a usage error.
    (Before: each read "free space or mend the disk", exit 1, restarted forever; the fsync, exit
    2.)"""
    import errno

    import kalos_retrievers.sidecar.store as store_mod

    SqliteStore(tmp_path, dim=3, metric="cosine").close()
    real_connect, real_open = sqlite3.connect, store_mod.os.open

    def cantopen(*a, **kw):  # type: ignore[no-untyped-def]
        e = sqlite3.OperationalError("unable to open database file")
        e.sqlite_errorcode, e.sqlite_errorname = 14, "SQLITE_CANTOPEN"
        raise e

    def refused(path, flags, *a):  # type: ignore[no-untyped-def]
        if Path(path).name == "kalos.sqlite3" and flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a)

    with monkeypatch.context() as m:
        m.setattr(sqlite3, "connect", cantopen)
        m.setattr(store_mod.os, "open", refused)
        with pytest.raises(PermissionError, match="may not read and write"):
            SqliteStore(tmp_path, dim=3, metric="cosine")
    (tmp_path / "kalos.sqlite3-shm").mkdir()
    with monkeypatch.context() as m:
        m.setattr(sqlite3, "connect", cantopen)
        with pytest.raises(StoreOpenError, match="is a directory") as e:
            SqliteStore(tmp_path, dim=3, metric="cosine")
        assert not isinstance(e.value, StoreUnavailable)
    (tmp_path / "kalos.sqlite3-shm").rmdir()
    assert real_connect is sqlite3.connect
    fresh = tmp_path / "fresh"
    real_fsync = store_mod.os.fsync

    def eio(fd: int) -> None:
        if not Path(os.readlink(f"/proc/self/fd/{fd}")).is_dir():
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(store_mod.os, "fsync", eio)
        with pytest.raises(StoreUnavailable, match="Input/output error"):
            SqliteStore(fresh, dim=3, metric="cosine")
    SqliteStore(fresh, dim=3, metric="cosine").close()


def test_a_write_sqlite_rolled_back_itself_raises_its_own_error(tmp_path: Path) -> None:
    """A full disk part-way through a large write: SQLite rolls the transaction back itself,
    and _tx's ROLLBACK then raised "cannot rollback - no transaction is active" in place of
    the real error; the next write still works."""
    st = SqliteStore(tmp_path, dim=3, metric="cosine")

    class Full(Exception):
        pass

    def write() -> None:
        with st._tx():
            st.db.execute("INSERT INTO meta VALUES ('x', 'y')")
            st.db.execute("ROLLBACK")  # (what SQLite does itself on SQLITE_FULL)
            raise Full

    with pytest.raises(Full):
        write()
    put(svc_for(3, store=st), [[1, 2, 3]], ["a"])
    assert st.count() == 1
    st.close()


def test_a_write_the_index_cannot_follow_after_the_commit_ends_the_sidecar(tmp_path: Path, monkeypatch) -> None:
    """Out of memory after the commit (a new metadata key's column, say) left the row in the
    store and half in the index (counted, not found; a deleted row still listed), the client
    told INTERNAL: now IndexOutOfStep (the sidecar exits 1 and reloads). The row table grows
    before the commit, so running out there refuses the write (CAPACITY) with nothing
    committed."""
    from kalos_retrievers.sidecar.index import FatalDeviceError
    from kalos_retrievers.sidecar.server import EXIT_CUDA_FAULT, EXIT_ERROR, Server, StartError

    st = SqliteStore(tmp_path, dim=3, metric="cosine")
    svc = svc_for(3, store=st)
    put(svc, [[1, 0, 0]], ["a"])

    def oom(*a, **kw):  # type: ignore[no-untyped-def]
        raise MemoryError

    with monkeypatch.context() as m:
        m.setattr(svc.rows.meta, "set", oom)
        with pytest.raises(IndexOutOfStep, match="MemoryError"):
            put(svc, [[0, 1, 0]], ["b"], metas=[{"new_key": 1}])
    assert st.count() == 2  # (committed: the restart's index will hold it)
    with monkeypatch.context() as m:
        m.setattr(svc.index, "clear_rows", oom)
        with pytest.raises(IndexOutOfStep):
            svc.delete({"namespace": "", "ids": ["a"]})
    with monkeypatch.context() as m:
        m.setattr(svc.rows, "grow", oom)
        many = [str(i) for i in range(svc.rows.capacity + 1)]
        with pytest.raises(Invalid) as e:
            put(svc, np.ones((len(many), 3)), many)
        assert e.value.status == Status.CAPACITY
    assert st.count() == 1  # (the delete committed; the refused write did not)
    server = Server.__new__(Server)
    for err, code in ((IndexOutOfStep("x"), EXIT_ERROR), (FatalDeviceError("y"), EXIT_CUDA_FAULT)):
        with pytest.raises(StartError) as ei:
            server._fatal_device(err)
        assert ei.value.exit_code == code
    st.close()


def test_store_refuses_garbage_file(tmp_path: Path) -> None:
    (tmp_path / "kalos.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreOpenError, match=r"not a readable SQLite database|integrity"):
        SqliteStore(tmp_path, dim=3, metric="cosine")


@pytest.mark.parametrize("k", [1, 7, 78, 1000])
def test_topk_rows_threshold_selection_matches_a_full_sort(k: int) -> None:
    """The sampled-threshold top-k (index._top1d) against a full sort, including the cases that
    must fall back: ties everywhere, most rows masked to -inf, and a bound that excludes all."""
    from kalos_retrievers.sidecar.index import topk_rows

    rng = np.random.default_rng()
    n = 70_001  # above SAMPLE_MIN_N: the sampled path runs
    base = rng.standard_normal((3, n)).astype(np.float32)
    ties = np.round(base * 2) / 2  # a few distinct values: the bound ties with many scores
    masked = base.copy()
    masked[:, rng.random(n) < 0.999] = -np.inf  # ~70 eligible rows, the sample sees mostly -inf
    flat = np.ones((1, n), np.float32)
    sizes: list[int] = []  # what each argpartition was given: the sampled path partitions few
    real = np.argpartition

    def spy(a, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(np.shape(a)[-1])
        return real(a, *args, **kwargs)

    import unittest.mock

    with unittest.mock.patch.object(np, "argpartition", spy):
        topk_rows(base[:1], k)
    if k <= 78:  # random scores, ~32 k candidates: few enough that the sampled path answers
        # (with exactly k candidates it partitions nothing: for k = 1, whenever the sample
        # holds the largest score; a full partition would show here as n)
        assert max(sizes, default=0) <= n // 4, sizes
    assert topk_rows(base[:0], k)[0].shape == (0, k)
    for scores in (base, ties, masked, flat, base[:1]):
        idx, vals = topk_rows(scores, k)
        assert idx.shape == vals.shape == (len(scores), k)
        want = -np.sort(-scores, axis=1)[:, :k]
        np.testing.assert_array_equal(vals, want)  # the k largest values, best first
        np.testing.assert_array_equal(np.take_along_axis(scores, idx, axis=1), vals)
        assert all(len(set(r.tolist())) == k for r in idx)  # k distinct rows


def test_a_host_index_never_queues_a_search_behind_another() -> None:
    """Queueing a batch behind the search in flight is a device index's option
    (``queues_behind``); a host index says it cannot, and refuses ``behind=True`` loudly
    instead of searching out of order."""
    from kalos_retrievers.sidecar.index import CpuIndex, SlotSpec

    dim = 7
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    data = np.random.default_rng().standard_normal((13, dim)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [str(i) for i in range(13)], "texts": [""] * 13,
                "metadatas": [{} for _ in range(13)]}, data)  # fmt: skip
    assert not svc.queues_behind(3, 2) and not svc.index.queues_behind(2, 3, 13)
    assert not svc.index.pending_done()
    q = data[:2].copy()
    rows, scores = np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32)
    spec = SlotSpec(q, rows, scores, 0, 0, 0)
    with pytest.raises(RuntimeError, match="does not queue"):
        svc.index.launch_slots([spec], 3, 13, 0, None, True, behind=True)
    with pytest.raises(RuntimeError, match="does not queue"):
        svc.launch_recall([spec], 3, "", None, behind=True)
    svc.index.launch_slots([spec], 3, 13, 0, None, True)
    assert sorted(rows[0].tolist()) == sorted(np.argsort(-(data @ q[0]))[:3].tolist())


def test_a_scan_refuses_booleans_for_limit_and_offset() -> None:
    """JSON ``true`` is no count (a raw request's ``"limit": true`` was read as 1)."""
    svc = svc_for(3)
    put(svc, np.ones((4, 3)), ["a", "b", "c", "d"])
    assert len(svc.scan({"namespace": "", "limit": 1})) == 1
    for bad in ({"limit": True}, {"offset": False}, {"limit": 2.0}, {"limit": -1}):
        with pytest.raises(Invalid, match="limit and offset must be ints"):
            svc.scan({"namespace": "", **bad})

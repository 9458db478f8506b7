"""Foundation, end to end: a real sidecar process (CPU backend) and the Python client."""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import posix_ipc
import pytest
from kalos_testing import assert_topk_equal, busy_client, recall_id_worker, reference_topk

from kalos_retrievers import (
    IncompatibleVersion,
    KalosClient,
    RequestRejected,
    SidecarTimeout,
    SidecarUnavailable,
)
from kalos_retrievers.protocol import HEADER_SIZE, Op, SlotState, decode_header, segment_name


def ids_of(res) -> list[str]:
    return list(res.ids)


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_results_equal_numpy_top_k(start_sidecar, metric: str) -> None:
    rng = np.random.default_rng()
    dim, n = 97, 3001
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, metric=metric)
    with sc.client() as c:
        assert c.recall(data[0], k=5).ids == []  # empty index: no results, no error
        c.upsert([str(i) for i in range(n)], data, metadatas=[{"m": i % 3} for i in range(n)])
        for b in (1, 11, 77):
            q = rng.standard_normal((b, dim)).astype(np.float32)
            res = c.recall_batch(q, 10)
            ref_i, ref_s = reference_topk(data, q, 10, metric)
            for j, r in enumerate(res):
                assert_topk_equal(ids_of(r), r.scores, [str(i) for i in ref_i[j]], ref_s[j], context=f"b={b}")
        # filter: the true top-k among matching rows (not top-k then filter)
        q = rng.standard_normal((3, dim)).astype(np.float32)
        res = c.recall_batch(q, 25, filter={"m": {"$ne": 1}})
        ref_i, ref_s = reference_topk(data, q, 25, metric, eligible=np.arange(n) % 3 != 1)
        for j, r in enumerate(res):
            assert_topk_equal(ids_of(r), r.scores, [str(i) for i in ref_i[j]], ref_s[j])
        assert len(c.recall(q[0], k=1000)) == 1000


def test_namespaces_k_above_rows_get_delete_count_scan(start_sidecar) -> None:
    sc = start_sidecar(dim=3)
    with sc.client() as c:
        c.upsert(["a", "b", "c"], [[1, 0, 0], [0, 1, 0], [0, 0, 1]], texts=["A", "B", "C"],
                 metadatas=[{"t": "x"}, {"t": "y"}, {"t": "x"}], namespace="n1")  # fmt: skip
        c.upsert(["a"], [[1, 1, 0]], texts=["other A"], namespace="n2")
        assert c.namespaces() == {"n1": 3, "n2": 1}
        assert c.namespaces("n2") == {"n2": 1} and c.namespaces("n") == {"n1": 3, "n2": 1} and c.namespaces("x") == {}
        # the sidecar selects (not only the client): the answer to a raw request is the subset
        assert json.loads(c._call(Op.NAMESPACES, args=b'{"prefix":"n1"}').blob) == {"n1": 3}
        with pytest.raises(RequestRejected, match="prefix"):
            c._call(Op.NAMESPACES, args=b'{"prefix":1}')
        assert c.count() == 4 and c.count("n1") == 3 and c.count("n1", filter={"t": "x"}) == 2
        r = c.recall([1, 0, 0], k=10, namespace="n1")  # k above the namespace's rows
        assert r.ids[0] == "a" and len(r) == 3 and r[0].text == "A" and r[0].metadata == {"t": "x"}
        assert c.recall([1, 0, 0], k=10, namespace="n2").ids == ["a"]
        assert c.recall([1, 0, 0], k=3, namespace="nope").ids == []
        got = c.get(["c", "missing", "a"], namespace="n1", with_vectors=True)
        assert [g.id for g in got] == ["c", "a"]
        np.testing.assert_allclose(got[1].vector, [1, 0, 0], atol=1e-6)
        assert [rec.id for rec in c.scan(namespace="n1", limit=2)] == ["a", "b"]
        assert [rec.id for rec in c.scan(namespace="n1", offset=2)] == ["c"]
        assert c.delete(filter={"t": "x"}, namespace="n1") == 2
        assert c.delete(["b", "zzz"], namespace="n1") == 1
        assert c.count("n1") == 0 and c.delete_namespace("n2") == 1 and c.count() == 0
        with pytest.raises(ValueError, match="delete_namespace"):
            c.delete(namespace="n1")


def test_dates_and_numpy_numbers_in_metadata_are_stored_as_iso_strings_and_numbers(start_sidecar) -> None:
    """A datetime, date or time is stored as its ISO 8601 string, a numpy integer, float or
    bool as the Python number, at any depth (LangChain's TimeWeightedVectorStoreRetriever
    writes datetimes; a pandas column gives numpy numbers); they read back as those and
    filter as those (same-zone ISO strings compare in time order). Other objects, a NaN
    among them, are still refused, naming the entry."""
    import datetime

    utc = datetime.UTC
    sc = start_sidecar(dim=3)
    with sc.client() as c:
        when = [datetime.datetime(2026, 12, 7, 9, 30, 15, 250, tzinfo=utc), datetime.datetime(2026, 12, 8, tzinfo=utc)]
        c.upsert(["early", "late"], [[1, 0, 0], [0, 1, 0]], metadatas=[
            {"at": when[0], "day": datetime.date(2026, 12, 7), "n": np.int64(7),
             "x": [np.float32(0.5), np.bool_(True)]},
            {"at": when[1], "nested": {"t": datetime.time(4, 5), "k": [np.uint8(255)]}, "n": np.int32(-3)},
        ])  # fmt: skip
        got = {r.id: r.metadata for r in c.get(["early", "late"])}
        assert got == {
            "early": {"at": "2026-12-07T09:30:15.000250+00:00", "day": "2026-12-07", "n": 7, "x": [0.5, True]},
            "late": {"at": "2026-12-08T00:00:00+00:00", "nested": {"t": "04:05:00", "k": [255]}, "n": -3},
        }
        assert type(got["early"]["n"]) is int and type(got["early"]["x"][1]) is bool
        assert c.recall([1, 0, 0], k=5, filter={"at": {"$gte": "2026-12-07T12:00"}}).ids == ["late"]
        assert c.count("", filter={"n": {"$gt": 0}}) == 1
        # filters take the same values, compared as stored
        assert c.recall([1, 0, 0], k=5, filter={"at": {"$gt": when[0]}}).ids == ["late"]
        assert c.recall([1, 0, 0], k=5, filter={"at": when[0], "day": datetime.date(2026, 12, 7)}).ids == ["early"]
        assert c.count("", filter={"n": {"$in": [np.int64(7), np.float32(2.5)]}}) == 1
        for bad, match in [({"at": {when[0]}}, "type set"), ({"x": np.float32("nan")}, "Out of range"),
                           ({"v": np.arange(3)}, "type ndarray"),
                           ({"d": np.datetime64("2026-12-07")}, "datetime64")]:  # fmt: skip
            with pytest.raises(ValueError, match=rf"^metadatas\[1\] is not JSON-serializable \(.*{match}"):
                c.upsert(["a", "b"], [[1, 0, 0], [0, 0, 1]], metadatas=[{}, bad])
        assert c.count() == 2


def test_upserts_larger_than_a_slot_and_responses_larger_than_the_blob(start_sidecar) -> None:
    rng = np.random.default_rng()
    dim, n = 97, 2003
    sc = start_sidecar(dim=dim, payload_kb=64, blob_kb=8)  # about 150 rows per upsert chunk
    data = rng.standard_normal((n, dim)).astype(np.float32)
    texts = [f"memory {i} " + "x" * (i % 300) for i in range(n)]
    with sc.client() as c:
        c.upsert([str(i) for i in range(n)], data, texts=texts, metadatas=[{"i": i} for i in range(n)])
        assert c.count() == n
        recs = c.get([str(i) for i in range(0, n, 3)])  # ~230 KB of documents: many chunks
        assert [r.text for r in recs] == texts[0::3] and [r.metadata["i"] for r in recs] == list(range(0, n, 3))
        r = c.recall(data[5], k=500, with_vectors=True)
        assert r.ids[0] == "5" and len(r) == 500 and r.vectors is not None and r.vectors.shape == (500, dim)
        assert all(h.text == texts[int(h.id)] for h in r)
        with pytest.raises(ValueError, match="too large"):
            c.upsert(["big"], data[:1], texts=["y" * 70_000])
        # what takes the room is said, as JSON encodes it: 12,000 NULs are 72,002 bytes there
        with pytest.raises(ValueError, match=r"metadata take 5, 72002 and 2 bytes as JSON \(escapes included"):
            c.upsert(["big"], data[:1], texts=["\x00" * 12_000])
        assert c.count() == n  # refused before anything was sent


def test_an_upsert_refused_by_a_late_row_stores_none_of_its_chunks(start_sidecar) -> None:
    """Every row is checked, and every chunk planned, before the first chunk is sent; a None
    text is a vector-only row beside texted ones."""
    rng = np.random.default_rng()
    dim, n = 97, 401
    sc = start_sidecar(dim=dim, payload_kb=64)  # about 150 rows per chunk
    data = rng.standard_normal((n, dim)).astype(np.float32)
    ids = [f"r{i}" for i in range(n)]
    texts: list[str | None] = [f"text {i}" if i % 3 else None for i in range(n)]
    with sc.client() as c:
        for bad_texts, bad_metas, match in [
            ([*texts[:-1], "y" * 70000], None, r"texts/metadatas\[400\] is too large"),
            (texts, [{}] * (n - 1) + [{"x": {1, 2}}], r"metadatas\[400\] is not JSON"),
            ([*texts[:-1], ""], None, r"texts\[400\] is empty"),
            ([*texts[:-1], b"bytes"], None, r"texts\[400\] must be a str or None"),
        ]:
            with pytest.raises((ValueError, TypeError), match=match):
                c.upsert(ids, data, texts=bad_texts, metadatas=bad_metas)
        assert c.count() == 0 and c.get(ids[:3]) == []
        c.upsert(ids, data, texts=texts)  # the control: the same rows, valid, are all stored
        recs = c.get(ids)
        assert [r.text for r in recs] == [t or "" for t in texts]
        with pytest.raises(ValueError, match="timeout"):
            c.upsert(ids[:1], data[:1], timeout=0)


def test_gets_deletes_and_filters_larger_than_a_slot(start_sidecar) -> None:
    """More ids than one request holds are split over requests (in order; the counts summed),
    a batch whose filter leaves room for fewer queries is split further, and a filter that
    alone outgrows the payload is refused by name before anything is sent."""
    rng = np.random.default_rng()
    dim, n = 13, 6007
    sc = start_sidecar(dim=dim, payload_kb=64)  # ids of ~26 bytes: ~2,500 per request
    data = rng.standard_normal((n, dim)).astype(np.float32)
    ids = [f"memory-{i:06d}-{'x' * (i % 11)}" for i in range(n)]
    with sc.client() as c:
        c.upsert(ids, data, metadatas=[{"i": i} for i in range(n)])
        order = list(rng.permutation(n))
        assert [r.id for r in c.get([ids[i] for i in order] + ["nope"])] == [ids[i] for i in order]
        assert [r.metadata["i"] for r in c.get(ids[:3], namespace="")] == [0, 1, 2]
        keep = list(range(0, n, 2))
        pad = (63_000 - len(json.dumps(keep, separators=(",", ":")))) // 11  # values no row has, 11 bytes each
        flt = {"i": {"$in": keep + [10**9 + j for j in range(pad)]}}  # ~63 KB: room for ~48 queries
        qs = data[1:155:2]  # 77 queries (4 KB): two requests
        before = c.stats()["requests"].get("recall/ok", 0)
        got = c.recall_batch(qs, k=3, filter=flt)
        assert c.stats()["requests"]["recall/ok"] - before == 2
        assert len(got) == len(qs)
        for q, r in zip(qs, got, strict=True):
            want, want_s = reference_topk(data[keep], q[None], 3, "cosine")
            assert_topk_equal(r.ids, r.scores, [ids[keep[j]] for j in want[0]], want_s[0], atol=1e-5)
        with pytest.raises(ValueError, match="--payload-kb"):
            c.recall(data[0], k=3, filter={"i": {"$in": list(range(20_000))}})
        assert c.delete([ids[i] for i in range(0, n, 2)] + ["nope"], filter={"i": {"$lt": n - 2}}) == (n - 1) // 2
        assert c.count() == n - (n - 1) // 2
        assert c.delete(ids) == n - (n - 1) // 2 and c.count() == 0


def test_a_delete_of_many_requests_gives_each_its_own_deadline(start_sidecar, monkeypatch) -> None:
    """As an upsert's chunks do: four requests that each take ~0.15 s (delayed before they are
    sent) all finish under a 0.3 s timeout, where one deadline for the whole delete cut it off
    after the second, leaving the rest stored. A bad timeout is refused before any request."""
    dim, n = 5, 2003
    sc = start_sidecar(dim=dim, payload_kb=16)  # ids of ~14 bytes: ~1,100 a request
    ids = [f"row-{i:06d}-{'y' * (i % 3)}" for i in range(2 * n)]
    data = np.random.default_rng().standard_normal((2 * n, dim)).astype(np.float32)
    with sc.client() as c:
        c.upsert(ids, data)
        real, calls = c._call, []

        def slow_call(op, **kw):  # type: ignore[no-untyped-def]
            if op == Op.DELETE:
                calls.append(kw["deadline"] - time.monotonic())
                time.sleep(0.15)
            return real(op, **kw)

        monkeypatch.setattr(c, "_call", slow_call)
        with pytest.raises(ValueError, match="timeout"):
            c.delete(ids, timeout=-1)
        assert calls == []
        assert c.delete(ids[::-1], timeout=0.3) == 2 * n
        assert len(calls) >= 4 and min(calls) > 0.25  # (each request's deadline counted afresh)
        assert c.count() == 0


def test_a_get_of_many_requests_gives_each_its_own_deadline(start_sidecar, monkeypatch) -> None:
    """As a delete's requests do: a get of ids over four requests that each take ~0.15 s all
    finish under a 0.3 s timeout (one deadline for the whole get raised SidecarTimeout on the
    third: 400k ids could not be read with the default 2 s)."""
    dim, n = 5, 4007
    sc = start_sidecar(dim=dim, payload_kb=16)  # ids of ~14 bytes: ~1,100 a request
    ids = [f"row-{i:06d}-{'y' * (i % 3)}" for i in range(n)]
    data = np.random.default_rng().standard_normal((n, dim)).astype(np.float32)
    with sc.client() as c:
        c.upsert(ids, data)
        real, calls = c._call, []

        def slow_call(op, **kw):  # type: ignore[no-untyped-def]
            if op == Op.GET:
                calls.append(kw["deadline"] - time.monotonic())
                time.sleep(0.15)
            return real(op, **kw)

        monkeypatch.setattr(c, "_call", slow_call)
        with pytest.raises(ValueError, match="timeout"):
            c.get(ids, timeout=0)
        assert calls == []
        assert [r.id for r in c.get(ids[::-1], timeout=0.3)] == ids[::-1]
        assert len(calls) >= 4 and min(calls) > 0.25


def test_an_id_that_cannot_fit_a_delete_is_refused_before_any_row_is_deleted(start_sidecar) -> None:
    """A delete by ids and a ~3 KB filter on 4 KB slots: the 21st id (512 backslashes, 1,026
    bytes as JSON) cannot fit beside the filter. Refused before the first request: the other
    20 rows were deleted first, and the call raised after."""
    sc = start_sidecar(dim=3, payload_kb=4)
    ids = [f"r{i}" for i in range(20)] + ["\\" * 512]
    with sc.client() as c:
        c.upsert(ids, np.eye(3, dtype=np.float32)[np.arange(21) % 3] + 0.1, metadatas=[{"i": i} for i in range(21)])
        flt = {"i": {"$in": list(range(800))}}  # ~3.1 KB of JSON
        with pytest.raises(ValueError, match=r"ids\[20\] does not fit"):
            c.delete(ids, filter=flt)
        assert c.count() == 21
        assert c.delete(ids[:20], filter=flt) == 20 and c.count() == 1


def test_sixteen_processes_never_get_each_others_answers(start_sidecar) -> None:
    dim = 33
    data = np.random.default_rng(0).standard_normal((4001, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, slots=20)
    with sc.client() as c:
        c.upsert([str(i) for i in range(len(data))], data)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=recall_id_worker, args=(sc.name, dim, s, 1000, out)) for s in range(16)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    assert sum(e for _, e in results) == 0
    assert sum(b for b, _ in results) == 0  # 16,000 recalls, each answered with its own row


def test_acknowledged_writes_survive_kill_9(start_sidecar, make_name, tmp_path) -> None:
    name, dim = make_name(), 16
    rng = np.random.default_rng()
    sc = start_sidecar(name=name, dim=dim, data_dir=tmp_path)
    acked: dict[str, np.ndarray] = {}
    stop = threading.Event()

    def writer() -> None:
        with KalosClient(name, dim=dim, timeout=5) as c:
            i = 0
            while not stop.is_set():
                ids = [f"w{i}-{j}" for j in range(7)]
                vecs = rng.standard_normal((7, dim)).astype(np.float32)
                try:
                    c.upsert(ids, vecs)
                except (SidecarUnavailable, SidecarTimeout):
                    return
                acked.update(zip(ids, vecs, strict=True))  # only after the ack
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.3 + rng.random() * 0.5)
    sc.kill(signal.SIGKILL)
    t.join(10)
    stop.set()
    assert acked, "nothing was acknowledged before the kill"
    again = start_sidecar(name=name, dim=dim, data_dir=tmp_path)  # also removes the stale segment
    with again.client() as c:
        got = {r.id: r.vector for r in c.get(list(acked), with_vectors=True)}
        assert set(got) == set(acked), f"{len(set(acked) - set(got))} acknowledged ids lost"
        for k, v in acked.items():
            np.testing.assert_allclose(got[k], v / np.linalg.norm(v), atol=1e-6)


@pytest.mark.parametrize("retry_with", ["e.ids", "None (control)"])
def test_an_upsert_cut_by_a_kill_says_its_ids_so_a_retry_stores_nothing_twice(
    start_sidecar, make_name, tmp_path, retry_with: str
) -> None:
    """A chunked ``upsert(None, ...)`` whose sidecar is SIGKILLed before its third chunk: the
    error carries every made-up id and how many rows were committed (the first two chunks,
    found again after a restart), so a retry with ``ids=e.ids`` leaves each row once. The
    control retries with ``ids=None``, as the docs once implied was harmless: the committed
    rows are then stored twice."""
    name, dim, n = make_name(), 16, 1001
    sc = start_sidecar(name=name, dim=dim, data_dir=tmp_path, payload_kb=16)  # ~140 rows a chunk
    data = np.random.default_rng().standard_normal((n, dim)).astype(np.float32)
    texts = [f"memory {i}" for i in range(n)]
    with KalosClient(name, dim=dim, timeout=5) as c:
        calls = []
        call = c._call

        def third_call_finds_the_sidecar_killed(*args, **kwargs):
            calls.append(args[0])
            if len(calls) == 3:
                sc.kill(signal.SIGKILL)
                sc.proc.wait(10)
            return call(*args, **kwargs)

        c._call = third_call_finds_the_sidecar_killed  # type: ignore[method-assign]
        with pytest.raises(SidecarUnavailable) as info:
            c.upsert(None, data, texts)
    again = start_sidecar(name=name, dim=dim, data_dir=tmp_path)  # (first: it removes the stale segment)
    e = info.value
    assert calls == [Op.UPSERT] * 3
    assert e.ids is not None and len(e.ids) == n == len(set(e.ids))
    assert 0 < e.committed < n
    with again.client() as c:
        stored = c.get(e.ids)
        assert [r.id for r in stored] == e.ids[: e.committed]  # what it said was committed, in order
        ids = c.upsert(e.ids if retry_with == "e.ids" else None, data, texts)
        if retry_with == "e.ids":
            assert ids == e.ids and c.count() == n
            assert [h.text for h in c.recall(data[0], k=2)][:1] == ["memory 0"]
            assert [h.text for h in c.recall(data[0], k=2)][1] != "memory 0"  # (one copy of it)
        else:
            assert c.count() == n + e.committed  # the committed rows twice, under new ids


def _slot_states(name: str) -> list[int]:
    shm = posix_ipc.SharedMemory(segment_name(name))
    try:
        mm = mmap.mmap(shm.fd, shm.size)
        lay = decode_header(mm[:HEADER_SIZE], shm.size).layout
        states = [int.from_bytes(mm[lay.slot_offset(i) : lay.slot_offset(i) + 4], "little")
                  for i in range(lay.n_slots)]  # fmt: skip
        mm.close()
        return states
    finally:
        shm.close_fd()


def test_killed_client_slot_is_reclaimed_and_others_are_unaffected(start_sidecar) -> None:
    sc = start_sidecar(dim=8, slots=5)
    with sc.client() as c:
        c.upsert(["a"], [np.ones(8)])
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=busy_client, args=(sc.name, 8))
        p.start()
        deadline = time.monotonic() + 30
        while _slot_states(sc.name).count(SlotState.FREE) > 3:  # ours + the child's
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        t0 = time.monotonic()
        while _slot_states(sc.name).count(SlotState.FREE) != 4:  # all but ours
            assert time.monotonic() - t0 < 1.0, _slot_states(sc.name)
            time.sleep(0.01)
        assert c.recall(np.ones(8), k=1).ids == ["a"]
        assert c.stats()["reclaimed_slots"] >= 1


def test_a_slot_released_as_its_late_answer_lands_goes_back_once(start_sidecar) -> None:
    """A call that timed out releases its slot (marked pending) while, in another thread, the
    late answer lands and the next call takes the slot back: the slot is on the free list once
    (it was there twice: two threads then wrote into one slot, and recalls failed with
    "response sequence ... does not match"). The interleaving is forced with a line tracer
    that holds the releasing thread just after it marks the slot. Control: the same
    recalls from two threads afterwards all answer, each with its own row."""
    import inspect
    import sys as _sys

    import kalos_retrievers.client as kc

    sc = start_sidecar(dim=8)
    n = 501
    data = np.random.default_rng().standard_normal((n, 8)).astype(np.float32)
    c = KalosClient(sc.name, dim=8, timeout=0.3, spin_us=0, max_slots=1)
    c.upsert([str(i) for i in range(n)], data)
    src, first = inspect.getsourcelines(kc.KalosClient._release)
    mark = first + next(j for j, line in enumerate(src) if line.strip() == "slot.pending = slot.seq")
    held, go = threading.Event(), threading.Event()

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code is not kc.KalosClient._release.__code__:
            return None

        def local(fr, ev, a):  # type: ignore[no-untyped-def]
            if ev == "line" and fr.f_lineno > mark and fr.f_locals["slot"].pending and not held.is_set():
                held.set()
                go.wait(10)
            return local

        return local

    errors: list[BaseException] = []

    def late() -> None:
        _sys.settrace(tracer)
        try:
            c.recall(data[0], k=1)
        except SidecarTimeout as e:
            errors.append(e)
        finally:
            _sys.settrace(None)

    os.kill(sc.pid, signal.SIGSTOP)
    t = threading.Thread(target=late)
    try:
        t.start()
        assert held.wait(10)
    finally:
        os.kill(sc.pid, signal.SIGCONT)
    (slot,) = c._conn.owned
    end = time.monotonic() + 10
    while slot.state[0] not in (SlotState.RESPONSE, SlotState.ERROR) and time.monotonic() < end:
        time.sleep(0.001)  # the late answer lands
    c.ping(timeout=5)  # takes the slot back (_recover_pending), and releases it
    go.set()
    t.join(10)
    assert len(errors) == 1  # (the held call did time out)
    free = c._conn.free
    assert len(free) == len({id(x) for x in free}) == 1, [x.index for x in free]
    got: list[bool] = []

    def recalls(off: int) -> None:
        for j in range(60):
            i = (off + 7 * j) % n
            got.append(c.recall(data[i], k=1, timeout=5).ids == [str(i)])

    ts = [threading.Thread(target=recalls, args=(o,)) for o in (0, 250)]
    [x.start() for x in ts]
    [x.join(60) for x in ts]
    assert got.count(True) == 120
    c.close()


def _time_out(c: KalosClient, n: int) -> None:
    """``n`` recalls that time out (the sidecar is stopped), each claiming a slot: 4 in all."""
    for _ in range(n):
        with pytest.raises(SidecarTimeout):
            c.recall(np.ones(8), k=1, timeout=0.05)
    assert len(c._conn.owned) == 4


def _until_answered(c: KalosClient) -> None:
    """Wait (10 s at most) for the sidecar to answer every request ``c`` left at a deadline."""
    end = time.monotonic() + 10
    while time.monotonic() < end and any(s.pending and s.state[0] not in (SlotState.RESPONSE, SlotState.ERROR)
                                         for s in c._conn.owned):  # fmt: skip
        time.sleep(0.001)


def test_slots_claimed_through_a_stall_go_back_to_the_sidecar(start_sidecar) -> None:
    """A sidecar paused while one client's calls time out: that client claims a slot for each
    (the earlier ones still hold requests), all of the sidecar's 4 here. Once the sidecar
    answers them, the client's next call keeps one and gives the others back, so another
    process's client finds a slot (it got SidecarBusy until the first client closed)."""
    sc = start_sidecar(dim=8, slots=4)
    a = KalosClient(sc.name, dim=8, spin_us=0)
    a.upsert(["x"], [np.ones(8)])
    os.kill(sc.pid, signal.SIGSTOP)
    try:
        _time_out(a, 4)
    finally:
        os.kill(sc.pid, signal.SIGCONT)
    _until_answered(a)
    assert a.recall(np.ones(8), k=1, timeout=5).ids == ["x"]
    assert len(a._conn.owned) == 1
    with KalosClient(sc.name, dim=8, spin_us=0) as b:  # (another process's, as the sidecar sees it)
        assert b.recall(np.ones(8), k=1, timeout=2).ids == ["x"]
    assert a.recall(np.ones(8), k=1, timeout=5).ids == ["x"]
    # again with a slot free after the stall (a call held one through it), and only recalls
    # after it: the recall path brings the others back too (it pops a free slot, and once
    # never looked at the pending ones)
    os.kill(sc.pid, signal.SIGSTOP)
    held: list[list[str]] = []
    t = threading.Thread(target=lambda: held.append(a.recall(np.ones(8), k=1, timeout=10).ids))
    try:
        t.start()
        time.sleep(0.2)
        _time_out(a, 3)
    finally:
        os.kill(sc.pid, signal.SIGCONT)
    t.join(10)
    assert held == [["x"]]
    _until_answered(a)
    for _ in range(5):
        assert a.recall(np.ones(8), k=1, timeout=5).ids == ["x"]
    assert len(a._conn.owned) == 1
    with KalosClient(sc.name, dim=8, spin_us=0) as b:
        assert b.recall(np.ones(8), k=1, timeout=2).ids == ["x"]
    a.close()


def test_timeouts_pauses_deaths_and_recovery(start_sidecar, make_name) -> None:
    name = make_name()
    sc = start_sidecar(name=name, dim=8)
    c = KalosClient(name, dim=8, timeout=0.25)
    c.upsert(["a"], [np.ones(8)])
    t0 = time.monotonic()
    assert c.recall(np.ones(8), k=1).ids == ["a"]  # control: answered at once when not paused
    assert time.monotonic() - t0 < 0.25
    os.kill(sc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(SidecarTimeout):
            c.recall(np.ones(8), k=1)
        took = time.monotonic() - t0
        assert 0.24 <= took < 0.25 + 0.15, took  # (the margin: a wake-up on a loaded 2-core machine)
    finally:
        os.kill(sc.pid, signal.SIGCONT)
    assert c.recall(np.ones(8), k=1, timeout=2).ids == ["a"]  # the abandoned slot is not in the way
    sc.kill(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(SidecarUnavailable):
        c.recall(np.ones(8), k=1, timeout=5)
    assert time.monotonic() - t0 < 0.5  # noticed by the lock, not at the deadline
    again = start_sidecar(name=name, dim=8)  # new boot epoch, empty (no data dir)
    deadline = time.monotonic() + 5
    while True:
        try:
            assert c.recall(np.ones(8), k=1, timeout=2).ids == []  # (the first call reconnects)
            break
        except SidecarUnavailable:  # reconnect backoff
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert c.reconnects == 1
    c.close()
    again.stop()


def test_bad_inputs_have_clear_errors_and_the_sidecar_keeps_serving(start_sidecar) -> None:
    sc = start_sidecar(dim=4, max_k=50)
    with sc.client() as c:
        c.upsert(["a"], [[1, 0, 0, 0]], texts=["x"])
        cases = [
            (lambda: c.recall([1, 2, 3], k=1), ValueError, r"query has shape \(3,\).*dim=4"),
            (lambda: c.recall([1, 2, np.inf, 0], k=1), ValueError, "NaN or infinity"),
            (lambda: c.recall(np.array([1, 2, 1e39, 0]), k=1), ValueError, r"query\[0\] has a value beyond float32's"),
            (lambda: c.recall([1, 0, 0, 0], k=0), ValueError, r"k=0 must be an int in \[1, 50\]"),
            (lambda: c.recall([1, 0, 0, 0], k=51), ValueError, "k=51"),
            (lambda: c.recall([1, 0, 0, 0], filter={"a": {"$bogus": 1}}), ValueError, "unknown filter operator"),
            (lambda: c.recall([1, 0, 0, 0], filter=lambda m: True), TypeError, "callable"),
            (lambda: c.upsert(["a", "b"], [[1, 0, 0, 0]]), ValueError, "ids has 2 entries but vectors has 1"),
            (lambda: c.upsert(["a"], [[1, 0, 0, 0]], texts=[""]), ValueError, r"texts\[0\] is empty"),
            (lambda: c.upsert(["a"], [[1, 0, 0, 0]], texts=["\ud800"]), ValueError, r"texts\[0\] is not valid UTF-8"),
            (lambda: c.upsert(["a"], [[1, 0, 0, 0]], metadatas=[{"t": "\udc80"}]), ValueError,
             r"metadatas\[0\] has text that is not valid UTF-8"),
            (lambda: c.upsert(["a"], [[1, 0, 0, 0]], metadatas=[{"t": object()}]), ValueError,
             r"metadatas\[0\] is not JSON"),
            (lambda: c.upsert(["a"], [[1, 0, 0, 0]], metadatas=[{"t": float("nan")}]), ValueError, r"metadatas\[0\]"),
            (lambda: c.upsert(["a"], [[1, 0, 0, 0]], metadatas=[{1: "x"}]), ValueError, "non-string key"),
            (lambda: c.upsert(["a"], [[1, 0, 0, 0]], metadatas=[{"n": 10**400}]), ValueError,
             r"metadatas\[0\]\['n'\] is an integer beyond float64's range"),
            (lambda: c.recall([1, 0, 0, 0], filter={"n": 10**400}), ValueError, "beyond float64's range"),
            (lambda: c.upsert(["a"], [[0, 0, 0, 0]]), ValueError, r"vectors\[0\] is all zeros"),
            (lambda: c.upsert([""], [[1, 0, 0, 0]]), ValueError, r"ids\[0\]"),
            (lambda: c.get("abc"), TypeError, "not one string"),
            (lambda: c.recall([1, 0, 0, 0], namespace=3), TypeError, "namespace"),
            (lambda: c.recall([1, 0, 0, 0], timeout=-1), ValueError, "timeout"),
        ]
        for fn, err, match in cases:
            with pytest.raises(err, match=match):
                fn()
        # the sidecar checks it too, before its store commits (a raw request, past the client)
        args = b'{"namespace":"","ids":["big"],"texts":[""],"metadatas":[{"n":' + str(10**400).encode() + b"}]}"
        with pytest.raises(RequestRejected, match="beyond float64's range"):
            c._call(Op.UPSERT, vectors=np.ones((1, 4), np.float32), args=args, n_items=1)
        assert c.recall([1, 0, 0, 0], k=1).ids == ["a"] and c.count() == 1
    with pytest.raises(IncompatibleVersion, match=r"dim=4.*dim=5"):
        KalosClient(sc.name, dim=5)


def test_sidecar_rejects_what_a_misbehaving_client_sends(start_sidecar) -> None:
    """A client that skips its own checks still gets a clear rejection, not a crash."""
    sc = start_sidecar(dim=4)
    with sc.client() as c:
        from kalos_retrievers.protocol import Op

        with pytest.raises(RequestRejected, match="args are not valid JSON"):
            c._call(Op.GET, args=b"\xff\xfe")
        with pytest.raises(RequestRejected, match="unknown op"):
            c._call(77)
        with pytest.raises(RequestRejected, match=r"k=0 must be in"):
            c._call(Op.RECALL, vectors=np.ones((1, 4), np.float32), top_k=0, n_items=1)
        assert c.stats()["rejected_requests"] == 3
        assert c.ping() < 1.0


def test_one_client_shared_by_many_threads(start_sidecar) -> None:
    from concurrent.futures import ThreadPoolExecutor

    dim = 17
    data = np.random.default_rng(3).standard_normal((997, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, slots=6)
    with sc.client(max_slots=4) as c:  # 12 threads on 4 slots: some queue for a slot
        c.upsert([str(i) for i in range(len(data))], data)

        def work(seed: int) -> int:
            rng = np.random.default_rng(seed)
            wrong = 0
            for _ in range(150):
                i = int(rng.integers(len(data)))
                wrong += c.recall(data[i], k=2).ids[0] != str(i)
            return wrong

        with ThreadPoolExecutor(12) as ex:
            assert sum(ex.map(work, range(12))) == 0
        assert c.ping() < 1.0


def test_misspelled_argument_is_refused_not_written_elsewhere(start_sidecar) -> None:
    sc = start_sidecar(dim=4)
    with sc.client() as c:
        from kalos_retrievers.protocol import Op

        args = b'{"namepsace":"private","ids":["x"],"texts":["t"],"metadatas":[{}]}'
        with pytest.raises(RequestRejected, match="namepsace"):
            c._call(Op.UPSERT, vectors=np.ones((1, 4), np.float32), args=args, n_items=1)
        assert c.count() == 0  # nothing landed in the default namespace either


def test_a_plain_recall_takes_the_short_path_and_answers_like_the_general_one(start_sidecar, monkeypatch) -> None:
    """``recall`` of one query with documents (in any namespace, with or without a filter)
    goes through ``_recall_one``; every other call, and any argument that path does not
    take, through ``_recall``, which raises the argument's error. Both give numpy's top-k."""
    rng = np.random.default_rng()
    dim, n, k = 13, 501, 7
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, max_k=50)
    with sc.client() as c:
        c.upsert([str(i) for i in range(n)], data, texts=[f"t{i}" for i in range(n)],
                 metadatas=[{"i": i} for i in range(n)])  # fmt: skip
        general: list[tuple] = []
        real = KalosClient._recall

        def counting(self, *a):  # type: ignore[no-untyped-def]
            general.append(a)
            return real(self, *a)

        monkeypatch.setattr(KalosClient, "_recall", counting)
        q = rng.standard_normal(dim).astype(np.float32)
        ref_i, ref_s = reference_topk(data, q[None, :], k, "cosine")
        for query in (q, q.tolist(), q.astype(np.float64), q[None, :], q[::-1].copy()[::-1]):
            r = c.recall(query, k, timeout=5.0)
            assert_topk_equal(ids_of(r), r.scores, [str(i) for i in ref_i[0]], ref_s[0])
            assert [h.text for h in r] == [f"t{i}" for i in r.ids]
            assert [h.metadata["i"] for h in r] == [int(i) for i in r.ids]
        assert general == []  # every one took the short path
        g = real(c, q[None, :], k, "", None, False, True, None)[0]
        assert g.ids == r.ids and np.array_equal(g.scores, r.scores) and [h.text for h in g] == [h.text for h in r]
        assert len(c.recall(q, k, namespace="elsewhere")) == 0  # (scoped: the short path too, session 46)
        assert c.recall(q, k, filter={"i": {"$gte": 0}}).ids == r.ids
        assert general == []
        c.recall(q, k, with_vectors=True)
        assert len(c.recall(q, k, docs=False)) == k
        assert len(general) == 2
        bad_query = q.copy()
        bad_query[5] = np.nan
        for args, err, match in [
            ((bad_query, k), ValueError, "NaN or infinity"),
            ((np.stack([q, q]), k), ValueError, "use recall_batch"),
            ((q[:-1], k), ValueError, r"query has shape \(12,\)"),
            ((q, 51), ValueError, r"k=51 must be an int in \[1, 50\]"),
            ((q, 2.0), ValueError, r"k=2.0 must be an int"),
            ((q, True), ValueError, r"k=True must be an int"),
        ]:
            with pytest.raises(err, match=match):
                c.recall(*args)
        assert len(general) == 2 + 3  # the bad k reached _recall (a bad query is refused before it)
        with pytest.raises(ValueError, match="timeout"):
            c.recall(q, k, timeout=0)
        assert c.recall(q, np.int64(k)).ids == r.ids  # a numpy int k: the general path


def test_the_short_paths_finiteness_check_is_exact_and_quiet(start_sidecar, monkeypatch) -> None:
    """``_recall_one`` checks a query's finiteness with one dot product (elements times
    2**-100): valid queries of any magnitude take the short path with no numpy warning, even
    with warnings as errors; every non-finite one is refused with the general path's error."""
    import warnings

    rng = np.random.default_rng()
    dim, n, k = 31, 203, 5
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim)
    with sc.client() as c:
        c.upsert([str(i) for i in range(n)], data)
        general: list[tuple] = []
        real = KalosClient._recall
        monkeypatch.setattr(KalosClient, "_recall", lambda self, *a: general.append(a) or real(self, *a))
        q = data[17].copy()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for scale in (1.0, 1e-30, 1e20, 1e36):  # squares under- and overflow float32 at the ends
                r = c.recall((q * np.float32(scale)).astype(np.float32), k)
                assert r.ids[0] == "17"
            assert general == []  # all of them took the short path
            with np.errstate(all="raise"):  # tiny products may underflow: answered all the same
                assert c.recall((q * np.float32(1e-30)).astype(np.float32), k).ids[0] == "17"
        for bad in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf]):
            x = q.copy()
            x[: len(bad)] = bad
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # +inf and -inf together: numpy's "invalid value"
                with pytest.raises(ValueError, match="NaN or infinity"):
                    c.recall(x, k)


def test_real_results_pickle_with_their_documents(start_sidecar) -> None:
    """A recall's documents are memoryviews into its response (or the sidecar's document
    arena), which do not pickle: results pickled as those views failed for every real recall
    (multiprocessing, caches). They pickle with their documents as bytes, each query's share
    of a batch, and read back the same."""
    import pickle

    rng = np.random.default_rng()
    dim, n = 13, 211
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim)
    with sc.client() as c:
        c.upsert([f"r{i}" for i in range(n)], data, texts=[f"text {i} é" for i in range(n)],
                 metadatas=[{"i": i, "tag": ["a", i % 3]} for i in range(n)])  # fmt: skip
        got = [c.recall(data[5], k=7), *c.recall_batch(data[:3], k=4), c.recall(data[9], k=3, with_vectors=True)]
        for r in got:
            back = pickle.loads(pickle.dumps(r))  # noqa: S301 - our own bytes
            assert len(back) == len(r) and back.ids == r.ids and [h.text for h in back] == [h.text for h in r]
            assert [h.metadata for h in back] == [h.metadata for h in r]
            np.testing.assert_array_equal(back.scores, r.scores)
            np.testing.assert_array_equal(back.rows, r.rows)
        np.testing.assert_array_equal(pickle.loads(pickle.dumps(got[-1])).vectors, got[-1].vectors)  # noqa: S301
        assert got[1].ids[0] == "r0" and got[0].ids[0] == "r5"
        bare = pickle.loads(pickle.dumps(c.recall(data[0], k=2, docs=False)))  # noqa: S301
        assert len(bare) == 2 and bare.rows[0] == got[1].rows[0]


def test_a_batch_of_no_queries_has_no_results(start_sidecar) -> None:
    """``recall_batch([])`` raised "queries has shape (0,) ... Use an embedding model with N
    dimensions" (an empty list has no second axis); it returns [] as an empty (0, dim) array
    did. Control: an empty array of the wrong dimension is still refused."""
    sc = start_sidecar(dim=5)
    with sc.client() as c:
        assert c.recall_batch([]) == [] and c.recall_batch(()) == []
        assert c.recall_batch(np.empty((0, 5), np.float32)) == []
        with pytest.raises(ValueError, match="dim=5"):
            c.recall_batch(np.empty((0, 4), np.float32))

"""The resident kernel (doorbell_topk; ``KALOS_DOORBELL=0`` turns it off): batch-1 recalls
answered on the GPU with no sidecar Python, documents read by the client from the arena.

Each test starts a real sidecar with ``--device cuda``. The sidecar's ``stats`` say how many
recalls the resident kernel answered (``doorbell_served``): every test checks that the path it
means to test is the one that answered, and a client with ``arena_docs=False`` (documents in
the response, so never a DOORBELL request) is the negative control. Response areas are
poisoned before calls (see test_gpu_sidecar.poison).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
from kalos_testing import assert_topk_equal, index_stats, poison, recall_at_k, recall_id_worker, reference_topk

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _doorbell_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On by default; set anyway, so that these tests test it whatever the default."""
    monkeypatch.setenv("KALOS_DOORBELL", "1")


def served(c) -> int:  # type: ignore[no-untyped-def]
    return int(c.stats()["index"]["doorbell_served"])


def running(c) -> bool:  # type: ignore[no-untyped-def]
    return bool(c.stats()["index"]["doorbell_running"])


def kernel_back(c, q) -> None:  # type: ignore[no-untyped-def]
    """Start the resident kernel the way clients do: a write stops it, and the sidecar starts
    it again after a few lone batch-1 recalls (``stats`` is answered beside the kernel and
    does not count)."""
    for _ in range(20):
        if running(c):
            assert c._conn.doorbell_k() == 1024  # the header says so: clients ring it
            return
        c.recall(q, 1)
    idx = c.stats()["index"]
    raise AssertionError(
        "the resident kernel was not started by lone recalls: "
        f"doorbell_k {idx['doorbell_k']}, launches {idx['doorbell_launches']}, served {idx['doorbell_served']}, "
        f"the client sees an arena: {c._conn.arena() is not None}"  # dropped: recalls no longer count as lone
    )


def test_doorbell_recalls_are_exact_with_their_documents(start_sidecar) -> None:
    rng = np.random.default_rng()
    n, dim = 20_011, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    assert c._conn.doorbell_cap() == 1024  # type: ignore[union-attr]  # the header: a resident kernel
    c.upsert([str(i) for i in range(n)], data, texts=[f"text {i}" for i in range(n)],
             metadatas=[{"i": i, "odd": i % 2 == 1} for i in range(n)])  # fmt: skip
    kernel_back(c, data[0])
    launches = index_stats(c)["doorbell_launches"]
    c.upsert(["0"], data[:1], texts=["text 0"], metadatas=[{"i": 0, "odd": False}])
    idx = index_stats(c)  # the write stopped it (and an idle millisecond may have restarted it)
    assert not idx["doorbell_running"] or idx["doorbell_launches"] > launches, idx
    kernel_back(c, data[0])
    before = served(c)
    for k in (1, 10, 100, 1024):
        for _ in range(3):
            q = rng.standard_normal(dim).astype(np.float32)
            poison(sc.name)
            r = c.recall(q, k)
            ref_i, ref_s = reference_topk(data, q[None], k)
            assert_topk_equal(r.ids, r.scores, [str(i) for i in ref_i[0]], ref_s[0], context=f"k={k}")
            for hit in r:
                assert hit.text == f"text {hit.id}" and hit.metadata == {"i": int(hit.id), "odd": int(hit.id) % 2 == 1}
    assert served(c) - before == 12  # every one of them answered by the resident kernel
    # negative control: documents inline means the sidecar's Python answers
    with sc.client(arena_docs=False) as inline:
        b2 = served(c)
        r2 = inline.recall(data[7], 5)
        assert r2.ids[0] == "7" and served(c) == b2
    c.close()


def test_the_clients_whole_c_call_answers_the_kernels_recalls(start_sidecar, monkeypatch) -> None:
    """Session 43: ``KalosClient.recall`` to a resident kernel is one C call (``_fastpath.bell1``,
    from the client's plan): after the first recall (which makes the plan on the Python path)
    neither ``_recall_one`` (bell1 declined) nor ``_bell_rest`` (bell1 left the answer to Python)
    runs, and every answer is exact with its documents. Negative control: with ``_BELL1`` off the
    same recalls all go the Python way (``_recall_one``), with the same answers."""
    import kalos_retrievers.client as client_module

    if not getattr(client_module, "_BELL1", False):
        pytest.fail("the client's C extension (with bell1) is not built here")
    rng = np.random.default_rng()
    n, dim = 30_007, 768
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data, texts=[f"text {i}" for i in range(n)])
    kernel_back(c, data[0])
    queries = [rng.standard_normal(dim).astype(np.float32) for _ in range(24)]
    ks = [(1, 10, 100, 1024)[j % 4] for j in range(len(queries))]
    paths = {"one": 0, "rest": 0}
    one, rest = c._recall_one, c._bell_rest

    def recall_one(*a):  # type: ignore[no-untyped-def]
        paths["one"] += 1
        return one(*a)

    def bell_rest(*a):  # type: ignore[no-untyped-def]
        paths["rest"] += 1
        return rest(*a)

    c._recall_one, c._bell_rest = recall_one, bell_rest
    for on in (True, False):
        monkeypatch.setattr(client_module, "_BELL1", on)
        c._bell = None
        c.recall(data[1], 1)  # (the plan, when on)
        paths.update(one=0, rest=0)
        before = served(c)
        for q, k in zip(queries, ks, strict=True):
            poison(sc.name)
            r = c.recall(q, k)
            ref_i, ref_s = reference_topk(data, q[None], k)
            assert_topk_equal(r.ids, r.scores, [str(i) for i in ref_i[0]], ref_s[0], context=f"bell1 {on}, k={k}")
            assert all(h.text == f"text {h.id}" for h in r)
        assert served(c) - before == len(queries), on  # the resident kernel answered them all
        assert paths == ({"one": 0, "rest": 0} if on else {"one": len(queries), "rest": 0}), (on, paths)
    c.close()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_doorbell_finds_every_hit_when_few_blocks_hold_them(start_sidecar, dtype) -> None:  # type: ignore[no-untyped-def]
    """The resident kernel's merge for k <= 32 (kernels/recall.cu, ll_merge): each block
    writes its best k as tagged records and block 0 reads whole lists only for the k best
    heads. A query's hits here are a run of 32 consecutive near-copies, which one or two blocks
    scan (block 0 too, for the runs at the ends), so their lists hold most hits and the merge
    must read past the heads; the queries go from run to run and back (a list left from the
    request before would show), and k = 33 and 100 take the appended lists instead. All of
    them answered by the resident kernel."""
    rng = np.random.default_rng()
    n, dim = 40_009, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    # one run at the first rows and one at the last, which block 0 usually scans (its own
    # best are taken from its candidates, not from a list)
    middle = rng.choice(np.arange(1, (n - 200) // 100), 3, replace=False)
    starts = sorted([7, n - 39] + [int(x) * 100 + 7 for x in middle])
    for s in starts:
        data[s : s + 32] = rng.standard_normal(dim) + 0.03 * rng.standard_normal((32, dim))
    sc = start_sidecar(dim=dim, device="cuda", dtype=dtype)
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data, texts=[f"text {i}" for i in range(n)])
    kernel_back(c, data[0])
    before = served(c)
    calls = 0
    for s in starts + starts[::-1]:
        q = data[s + 5] + 0.01 * rng.standard_normal(dim).astype(np.float32)
        ref_i, ref_s = reference_topk(data, q[None], 100)
        for k in (1, 10, 32, 33, 100):
            poison(sc.name)
            r = c.recall(q, k)
            calls += 1
            if dtype == "float32":
                want = [str(i) for i in ref_i[0][:k]]
                assert_topk_equal(r.ids, r.scores, want, ref_s[0][:k], context=f"run {s} k={k}")
            got = {int(i) for i in r.ids[:32]}
            assert got <= set(range(s, s + 32)) and len(got) == min(k, 32), (s, k, sorted(got))
            assert all(hit.text == f"text {hit.id}" for hit in r)
    assert served(c) - before == calls  # every one answered by the resident kernel
    c.close()


@pytest.mark.parametrize(("metric", "dim"), [("cosine", 768), ("l2", 97), ("ip", 33)])
def test_int8_the_kernel_rescores_its_candidates_as_the_sidecar_does(start_sidecar, metric, dim) -> None:  # type: ignore[no-untyped-def]
    """int8 storage: the resident kernel scans RESCORE_FACTOR x k candidates with the quantized
    rows and re-scores them on the GPU from the float16 copy of the rows in registered host
    memory. Its answers must be the sidecar's own (a client with documents inline, which the
    kernel never answers: the negative control), which re-scores on the host, and reach
    recall@k >= 0.99 against exact search. The rows grow between two rounds, so the copy is
    reallocated and registered again while the kernel is stopped. (The sidecar stops the kernel
    to answer a recall itself, so it is started again before each of the kernel's.)"""
    rng = np.random.default_rng()
    n, first = 12_007, 1_001
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="int8", metric=metric)
    c = sc.client()
    inline = sc.client(arena_docs=False)
    got: list[list[str]] = []
    ref: list[list[str]] = []
    for lo, hi in ((0, first), (first, n)):  # the second upsert grows the copy past 1,024 rows
        c.upsert([str(i) for i in range(lo, hi)], data[lo:hi], texts=[f"text {i}" for i in range(lo, hi)])
        for k in (1, 10, 100, 1024):
            for _ in range(2):
                q = rng.standard_normal(dim).astype(np.float32)
                kernel_back(c, data[0])
                before = served(c)
                poison(sc.name)
                r = c.recall(q, k)
                assert served(c) == before + 1, "not the kernel's answer"
                poison(sc.name)
                own = inline.recall(q, k)
                assert served(c) == before + 1  # the sidecar's
                assert_topk_equal(r.ids, r.scores, own.ids, own.scores, context=f"{metric} k={k} rows={hi}")
                assert all(hit.text == f"text {hit.id}" for hit in r)
                if k >= 10:
                    ref_i, _ = reference_topk(data[:hi], q[None], k, metric)
                    got.append(r.ids)
                    ref.append([str(i) for i in ref_i[0]])
    assert recall_at_k(got, ref) >= 0.99
    # A row rewritten in place (same row, same host address of its float16 copy) while the
    # kernel is stopped: the kernel's re-scoring must read the new vector. A copy of the old
    # one cached on the device would score the query (the new vector) against it: ~0 instead
    # of the self-similarity the sidecar computes.
    # (Inner product: a row is its own nearest only when no other row's product with it is
    # larger, which among 12k standard normal rows of 33-d fails ~0.5% of the time for a random
    # row: the rows taken are their own nearest by a margin, and the new vector is 4x longer.)
    for _ in range(3):
        i = int(rng.integers(n))
        while metric == "ip" and np.partition(data @ data[i], -2)[-2] > 0.8 * float(data[i] @ data[i]):
            i = int(rng.integers(n))
        kernel_back(c, data[0])
        assert c.recall(data[i], 1).ids == [str(i)]  # the old vector, through the kernel
        new = rng.standard_normal(dim).astype(np.float32) * (4 if metric == "ip" else 1)
        c.upsert([str(i)], new[None], texts=[f"new {i}"])
        data[i] = new  # (the next rows' margin counts it)
        kernel_back(c, data[0])
        before = served(c)
        r = c.recall(new, 1)
        assert served(c) == before + 1 and r.ids == [str(i)] and r[0].text == f"new {i}"
        own = inline.recall(new, 1)
        # (L2: a distance of ~0 from q.q - 2 q.x + x.x in float32: both sides are within
        # sqrt(dim * 1e-7) of 0, the stale row would be ~sqrt(2 dim) away)
        np.testing.assert_allclose(r.scores, own.scores, rtol=1e-4, atol=1e-2 if metric == "l2" else 1e-4)
    inline.close()
    c.close()


@pytest.mark.parametrize(("metric", "dim"), [("l2", 97), ("cosine", 64)])
def test_int8_many_requests_in_one_launch_with_k_rising_and_falling(start_sidecar, metric, dim) -> None:  # type: ignore[no-untyped-def]
    """int8: the re-scoring's hand-out and result records are tagged with the request's number
    in the launch, and the hand-out covers the request's own RESCORE_FACTOR x k candidates (row
    -1 past the ones found). 36 recalls in a row answered by one launch, k rising and falling
    (records a larger k left lie past a smaller k's; k = 1024 finds fewer rows than its 2,048
    candidates; up to 16 results one warp ranks them, above it a bitonic sort), must each equal
    the sidecar's own answer, asked afterwards (the rows do not change). A kernel that took an
    earlier request's record would re-score another query's candidates; one that handed out
    only the candidates found would leave blocks waiting (the test's timeout)."""
    rng = np.random.default_rng()
    n = 1_501
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="int8", metric=metric)
    c = sc.client()
    inline = sc.client(arena_docs=False)
    c.upsert([str(i) for i in range(n)], data, texts=[f"text {i}" for i in range(n)])
    ks = [1, 2, 7, 16, 3, 17, 100, 1024, 5, 1, 12, 700] * 3
    queries = rng.standard_normal((len(ks), dim)).astype(np.float32)
    kernel_back(c, data[0])
    launches = int(c.stats()["index"]["doorbell_launches"])
    before = served(c)
    got = []
    for q, k in zip(queries, ks, strict=True):
        poison(sc.name)
        got.append(c.recall(q, k))
    assert served(c) == before + len(ks), "not all answered by the kernel"
    assert int(c.stats()["index"]["doorbell_launches"]) == launches, "the kernel was started again in between"
    for j, (q, k, r) in enumerate(zip(queries, ks, got, strict=True)):
        own = inline.recall(q, k)  # the sidecar's (stops the kernel)
        assert len(r.ids) == min(k, n)
        assert_topk_equal(r.ids, r.scores, own.ids, own.scores, context=f"{metric} call {j} k={k}")
        assert all(hit.text == f"text {hit.id}" for hit in r)
    inline.close()
    c.close()


def test_doorbell_sees_every_write_and_never_returns_a_stale_document(start_sidecar) -> None:
    """Writes stop the resident kernel; each recall after a write reflects it, and a document
    read from the arena is the one the search scored (generations)."""
    rng = np.random.default_rng()
    n, dim = 5_003, 64
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data, texts=[f"v0 {i}" for i in range(n)])
    for round_ in range(1, 30):
        i = int(rng.integers(n))
        c.upsert([str(i)], data[i : i + 1], texts=[f"v{round_} {i}"])  # overwrite the text
        r = c.recall(data[i], 1)  # likely the sidecar's (awake after the write)
        assert r.ids == [str(i)] and r[0].text == f"v{round_} {i}"
        kernel_back(c, data[i])
        before = served(c)
        r = c.recall(data[i], 1)  # the resident kernel's, restarted after the write
        assert r.ids == [str(i)] and r[0].text == f"v{round_} {i}" and served(c) == before + 1
        gone = int(rng.integers(n))
        if gone != i:
            c.delete([str(gone)])
            kernel_back(c, data[gone])
            before = served(c)
            r = c.recall(data[gone], 3)
            assert str(gone) not in r.ids and served(c) == before + 1
    c.close()


def test_back_to_back_recalls_after_a_write_go_to_the_kernel(start_sidecar) -> None:
    """A write stops the kernel; the sidecar answers the next recalls itself and, after a few
    lone ones in a row, starts the kernel again, which answers the rest (S5-3: with the
    kernel started only before the sidecar slept, a benchmark's 6000 back-to-back recalls were
    all the sidecar's)."""
    rng = np.random.default_rng()
    n, dim = 3_001, 64
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data)
    for _ in range(3):
        c.upsert(["0"], data[:1])  # the kernel stops; the sidecar is awake
        before = served(c)
        for _ in range(300):
            i = int(rng.integers(n))
            assert c.recall(data[i], 1).ids == [str(i)]
        # the first LONE_RECALLS (4) are the sidecar's, and a few more at each start: a client
        # that read "stopped" just before sends a REQUEST, which stops the kernel again (S5-6:
        # 292-296 and 288 of 300; 0 before the prompt restart)
        assert served(c) - before >= 270, served(c) - before
    c.close()


def test_an_idle_kernel_is_stopped_and_recalls_go_on(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A resident kernel that answers nothing for KALOS_DOORBELL_IDLE_S is stopped (it keeps
    every SM polling); the header says so, clients send REQUEST again, and lone recalls start
    it again."""
    monkeypatch.setenv("KALOS_DOORBELL_IDLE_S", "0.3")
    rng = np.random.default_rng()
    n, dim = 2_003, 48
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data)
    kernel_back(c, data[1])
    deadline = time.monotonic() + 5
    while running(c):  # housekeeping every 250 ms
        assert time.monotonic() < deadline, "the idle resident kernel was not stopped"
        time.sleep(0.05)
    assert c._conn.doorbell_k() == 0  # type: ignore[union-attr]
    before = served(c)
    assert c.recall(data[5], 1).ids == ["5"] and served(c) == before  # the sidecar's
    kernel_back(c, data[6])
    before = served(c)  # (kernel_back's own recalls may be the kernel's: it may start on idle)
    assert c.recall(data[7], 1).ids == ["7"] and served(c) == before + 1  # the kernel's
    c.close()


@pytest.mark.parametrize("rearm", ["1", "0"])
def test_a_write_between_recalls_leaves_the_kernel_running_for_the_next(start_sidecar, monkeypatch, rearm) -> None:  # type: ignore[no-untyped-def]
    """An agent's turn: a recall, a memory written, a pause (the model's turn), a recall. The
    write stops the kernel; once the sidecar has been idle ``KALOS_BELL_REARM_MS`` (1 ms) it
    starts the kernel again, so the next recall is the kernel's, and exact with the new row.
    Then the same with three users' filters in turn, as the memory store recalls: after each
    new user's first filter, handed back (a restart since session 51; before, the start's
    back-off for a second), every recall is the kernel's. Control (``0``): only lone recalls
    in a row restart it, and with a write between every two recalls none does: every recall
    after a write is the sidecar's."""
    monkeypatch.setenv("KALOS_BELL_REARM_MS", rearm)
    rng = np.random.default_rng()
    n, dim = 3_001, 40
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data)
    kernel_back(c, data[0])
    before = served(c)
    assert c.recall(data[1], 1).ids == ["1"] and served(c) == before + 1  # the kernel answered
    for turn in range(4):
        new = rng.standard_normal(dim).astype(np.float32) * 3
        c.upsert([f"new{turn}"], new[None])  # stops the kernel
        time.sleep(0.02)
        before = served(c)
        poison(sc.name)
        assert c.recall(new, 1).ids == [f"new{turn}"]
        assert served(c) == before + (rearm == "1"), f"turn {turn}: {index_stats(c)}"
    users = 3
    c.upsert([f"mem{i}" for i in range(n)], data, metadatas=[{"user": f"u{i % users}"} for i in range(n)],
             namespace="mem")  # fmt: skip
    kernel = []
    deadline = time.monotonic() + 2.5
    turn = 0
    while time.monotonic() < deadline or turn % users:
        u = turn % users
        new = rng.standard_normal(dim).astype(np.float32) * 3
        c.upsert([f"mem-new{turn}"], new[None], metadatas=[{"user": f"u{u}"}], namespace="mem")
        time.sleep(0.005)
        before = served(c)
        r = c.recall(new, 2, namespace="mem", filter={"user": f"u{u}"})
        assert r.ids[0] == f"mem-new{turn}" and all(h.metadata["user"] == f"u{u}" for h in r)
        kernel.append(served(c) - before)
        turn += 1
    last = kernel[-12:]
    assert last == ([1] * 12 if rearm == "1" else [0] * 12), (kernel, index_stats(c))
    c.close()


def test_other_recalls_still_go_through_the_sidecar(start_sidecar) -> None:
    """Namespaces, filters, vectors and batches are the sidecar's, and stay exact."""
    rng = np.random.default_rng()
    n, dim = 4_001, 33
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data, metadatas=[{"g": i % 3} for i in range(n)])
    c.upsert([f"x{i}" for i in range(50)], data[:50], namespace="other")
    before = served(c)
    q = rng.standard_normal(dim).astype(np.float32)
    r = c.recall(q, 10, filter={"g": 1})
    ref_i, ref_s = reference_topk(data, q[None], 10, eligible=np.arange(n) % 3 == 1)
    assert_topk_equal(r.ids, r.scores, [str(i) for i in ref_i[0]], ref_s[0])
    assert c.recall(data[3], 1, namespace="other").ids == ["x3"]
    assert c.recall(data[3], 1, with_vectors=True).vectors is not None
    assert len(c.recall_batch(data[:5], 2)) == 5
    assert served(c) == before  # none of these was the kernel's
    kernel_back(c, data[3])
    before = served(c)
    assert c.recall(data[3], 1).ids == ["3"] and served(c) == before + 1  # this one was
    c.close()


def test_a_query_with_nan_rung_to_the_kernel_is_refused_and_the_kernel_serves_on(start_sidecar) -> None:
    """The client library never sends a NaN query (it validates), but a client writing its
    slot by hand can, and can ring the kernel with it. The kernel hands such a request back
    (its sum of squares is not finite) and the sidecar answers BAD_REQUEST, as for any
    request; the kernel answers the next good recall. (Before the kernel checked, the answer
    was OK with no results, and counted as served: the negative control.)"""
    from kalos_retrievers.errors import RequestRejected
    from kalos_retrievers.protocol import Flag, Op

    rng = np.random.default_rng()
    n, dim = 1_009, 64
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    c.upsert([str(i) for i in range(n)], data)
    for bad_value in (np.nan, np.inf):
        kernel_back(c, data[0])
        before = served(c)
        bad = data[5:6].copy()
        bad[0, 7] = bad_value
        assert c._conn.doorbell_k() >= 5  # type: ignore[union-attr]  # so _call rings the kernel
        with pytest.raises(RequestRejected, match="NaN or infinity"):
            c._call(Op.RECALL, vectors=bad, top_k=5, n_items=1, flags=Flag.ARENA_DOCS)  # no validation
        assert served(c) == before  # the kernel did not answer it
    kernel_back(c, data[0])
    before = served(c)
    assert c.recall(data[11], 1).ids == ["11"] and served(c) == before + 1
    c.close()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_kernel_names_documents_by_generation_or_by_entry_as_asked(start_sidecar, dtype) -> None:  # type: ignore[no-untyped-def]
    """A v1.2 client asks for the hits' generations (ARENA_DOCS), a v1.3 one for the arena's
    version and the hits' whole entries (and ARENA_ENTRIES): the resident kernel answers each
    in its format, for the rows it scored, and the client finds those rows' documents. Every
    slot's blob is poisoned before each call, so every byte of the answer was written by it.
    (int8: the kernel reads each candidate's entry with its row, and the answer maps its best k
    back to them; its scores are the float16 copy's, so the reference is the query's own row
    first and the sidecar's answer for the rest.)"""
    import mmap

    import posix_ipc

    from kalos_retrievers.protocol import HEADER_SIZE, Flag, Op, RespFlag, decode_header, segment_name

    def poison_blobs() -> None:
        shm = posix_ipc.SharedMemory(segment_name(sc.name))
        try:
            mm = mmap.mmap(shm.fd, shm.size)
            lay = decode_header(mm[:HEADER_SIZE], shm.size).layout
            for i in range(lay.n_slots):
                o = lay.slot_offset(i) + lay.blob_offset
                mm[o : o + 4096] = b"\xab" * 4096
            mm.close()
        finally:
            shm.close_fd()

    rng = np.random.default_rng()
    n, dim, k = 4_099, 33, 7
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype=dtype)
    c = sc.client()
    inline = sc.client(arena_docs=False)
    c.upsert([str(i) for i in range(n)], data, texts=[f"text {i}" for i in range(n)])
    kernel_back(c, data[0])
    arena = c._conn.arena()  # type: ignore[union-attr]
    assert arena is not None
    both = Flag.ARENA_DOCS | Flag.ARENA_ENTRIES
    for flags in (Flag.ARENA_DOCS, both, Flag.ARENA_DOCS, both):
        i = int(rng.integers(n))
        kernel_back(c, data[0])
        before = served(c)
        poison(sc.name)
        poison_blobs()
        rep = c._call(Op.RECALL, vectors=data[i : i + 1], top_k=k, n_items=1, flags=flags)
        assert served(c) == before + 1  # the kernel's answer
        assert rep.n_results == k and rep.rows is not None
        rows = rep.rows[:k]
        if dtype == "int8":
            assert rows[0] == i
            own = inline.recall(data[i], k)  # the sidecar's (stops the kernel)
            assert_topk_equal([str(r) for r in rows], rep.scores[:k], own.ids, own.scores)
        else:
            ref_i, ref_s = reference_topk(data, data[i : i + 1], k)
            assert_topk_equal([str(r) for r in rows], rep.scores[:k], [str(r) for r in ref_i[0]], ref_s[0])
        if flags & Flag.ARENA_ENTRIES:
            assert rep.resp_flags == RespFlag.ARENA_DOCS | RespFlag.ARENA_ENTRIES
            assert rep.blob == arena.version.to_bytes(8, "little") + arena._table[rows].tobytes()
            docs = arena.entry_docs(rep.blob, k)
        else:
            assert rep.resp_flags == RespFlag.ARENA_DOCS
            assert rep.blob == arena._table["gen"][rows].tobytes()
            docs = arena.docs(rows, np.frombuffer(rep.blob, "<u4"))
        assert docs is not None and len(docs) == k
        assert all(bytes(d).endswith(f"text {r}{{}}".encode()) for d, r in zip(docs, rows, strict=True))
    inline.close()
    c.close()


def test_a_crowd_is_handed_to_the_batched_path_and_everyone_gets_their_answer(start_sidecar) -> None:
    dim = 97
    data = np.random.default_rng(0).standard_normal((4001, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32", slots=24)
    with sc.client() as c:
        c.upsert([str(i) for i in range(len(data))], data)
        kernel_back(c, data[0])  # the crowd finds it running
        before = served(c)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=recall_id_worker, args=(sc.name, dim, s, 400, q)) for s in range(12)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sum(m for m, _ in results) == 0 and sum(e for _, e in results) == 0
    with sc.client() as c:
        st = c.stats()
        assert st["batches"] > 0  # some were answered together by the sidecar
        assert int(st["index"]["doorbell_served"]) > before  # and some by the kernel


def test_threads_of_one_client_and_a_stop_while_the_kernel_runs(start_sidecar) -> None:
    dim = 64
    data = np.random.default_rng(1).standard_normal((3001, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda")
    c = sc.client()
    c.upsert([str(i) for i in range(len(data))], data)
    kernel_back(c, data[0])
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                i = int(rng.integers(len(data)))
                assert c.recall(data[i], 1).ids == [str(i)]
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors[:3]
    assert served(c) > 0
    c.close()
    assert sc.stop() == 0  # the resident kernel is running: the sidecar stops it, exits cleanly

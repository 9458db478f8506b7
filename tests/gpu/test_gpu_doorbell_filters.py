"""The resident kernel serves filters (session 49; protocol v1.6).

A lone batch-1 recall with a filter is rung to the kernel where the header's ``doorbell_args``
says it compares args that long; the kernel answers it over the rows the filter keeps (a mask
the sidecar builds at each start) when it serves that exact filter, and hands it back to the
sidecar otherwise, which notes it so that the kernel serves it from its next start. Each test
starts a real GPU sidecar and reads how many recalls the kernel answered (``doorbell_served``)
and which filters it serves (``doorbell_filters``) from its stats: a result must be right *and*
come from the path the test means. The controls: a filter of the same length that differs in
one byte (handed back, and answered with its own rows), documents inline (never rung), and a
sidecar with ``KALOS_BELL_FILTERS=0``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kalos_testing import (
    assert_topk_equal,
    check_scoped,
    index_stats,
    load_interleaved,
    poison,
    recall_at_k,
    reference_topk,
    until_kernel_serves,
)
from kalos_testing import kernel_answers as served

from kalos_retrievers.filters import validate_filter

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

SPACES = {"": 2003, "mem": 6007}  # rows per namespace
USERS = 5  # metadata {"i": i, "user": f"u{i % USERS}"}


@pytest.fixture(autouse=True)
def _doorbell_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KALOS_DOORBELL", "1")


def serving(c, q, namespace: str, flt: dict) -> None:  # type: ignore[no-untyped-def]
    """Lone recalls with ``flt`` in ``namespace`` until the kernel runs and serves it."""
    want = {"namespace": namespace, "filter": validate_filter(flt)}  # (as the client sends it)
    until_kernel_serves(c, lambda: c.recall(q, 1, namespace=namespace, filter=flt),
                        lambda idx: want in idx["doorbell_filters"], str(want))  # fmt: skip


def load(c, rng, dim: int) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    """SPACES' rows, mixed in the index (:func:`load_interleaved`), metadata ``{"i": i,
    "user": f"u{i % USERS}"}``."""
    return load_interleaved(c, rng, dim, SPACES, 701, lambda i: {"i": i, "user": f"u{i % USERS}"})


def check(r, ns: str, data: np.ndarray, keep: np.ndarray, q: np.ndarray, k: int, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """``r`` is the exact top-k of namespace ``ns`` (``data``: its rows) among the rows
    ``keep`` (bool per row), with their texts."""
    check_scoped(r, ns, data, q, k, dtype, keep)


def user(n: int, u: int) -> np.ndarray:
    return np.arange(n) % USERS == u


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_filters_recalls_are_answered_by_the_kernel_exactly(start_sidecar, dtype) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng()
    dim = 97
    sc = start_sidecar(dim=dim, device="cuda", dtype=dtype)
    c, plain = sc.client(), sc.client(arena_docs=False)
    assert c._conn.doorbell_args() == 128  # type: ignore[union-attr]  # the header says it serves filters
    data = load(c, rng, dim)
    n = SPACES["mem"]
    u1 = {"user": "u1"}
    serving(c, data["mem"][0], "mem", u1)
    before = served(c)
    calls = 0
    for k in (1, 10, 33, 100):
        for _ in range(3):
            q = rng.standard_normal(dim).astype(np.float32)
            poison(sc.name)
            check(c.recall(q, k, namespace="mem", filter=u1), "mem", data["mem"], user(n, 1), q, k, dtype)
            calls += 1
    assert served(c) - before == calls  # every one answered by the kernel
    # a filter of the same length differing in one byte: not what it serves. Handed back and
    # answered by the sidecar over its own rows (a kernel that took u1's mask for it would
    # return u1's rows)
    q = rng.standard_normal(dim).astype(np.float32)
    before = served(c)
    poison(sc.name)
    check(c.recall(q, 10, namespace="mem", filter={"user": "u2"}), "mem", data["mem"], user(n, 2), q, 10, dtype)
    assert served(c) == before
    # a filter that keeps fewer rows than k, one that keeps none, and one in the default
    # namespace, served beside u1 once noted
    few = {"i": {"$lt": 3}}
    none = {"user": "nobody"}
    mine = {"user": "u3"}
    for ns, flt in (("mem", few), ("mem", none), ("", mine)):
        serving(c, q, ns, flt)
    assert {"namespace": "mem", "filter": validate_filter(u1)} in index_stats(c)["doorbell_filters"]
    before = served(c)
    for _ in range(2):
        q = rng.standard_normal(dim).astype(np.float32)
        poison(sc.name)
        r = c.recall(q, 10, namespace="mem", filter=few)
        assert sorted(r.ids) == ["mem#0", "mem#1", "mem#2"]
        check(r, "mem", data["mem"], np.arange(n) < 3, q, 10, dtype)
        assert len(c.recall(q, 10, namespace="mem", filter=none)) == 0
        check(c.recall(q, 10, filter=mine), "", data[""], user(SPACES[""], 3), q, 10, dtype)
        check(c.recall(q, 10, namespace="mem", filter=u1), "mem", data["mem"], user(n, 1), q, 10, dtype)
    assert served(c) - before == 8
    assert index_stats(c)["bell_list_uploads"] >= 1  # (few, none and mine keep under a 16th of the rows: lists)
    # the controls: documents inline are never rung; the sidecar's answer is the same
    before = served(c)
    check(plain.recall(q, 10, namespace="mem", filter=u1), "mem", data["mem"], user(n, 1), q, 10, dtype)
    assert served(c) == before
    c.close()
    plain.close()


def test_a_write_is_seen_by_the_filters_the_kernel_serves(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """The kernel is stopped for every write and each served filter's mask is made from the
    rows as they are at its next start: a row written into the filter is found at once, one
    whose metadata moves it out of the filter is gone at once, and a deleted one too."""
    rng = np.random.default_rng()
    dim = 33
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    data = load(c, rng, dim)
    u1 = {"user": "u1"}
    serving(c, data["mem"][0], "mem", u1)
    q = rng.standard_normal(dim).astype(np.float32)
    c.upsert(["mem#new"], (5 * q)[None], texts=["mem text new"], metadatas=[{"user": "u1"}], namespace="mem")
    serving(c, q, "mem", u1)
    before = served(c)
    assert c.recall(q, 3, namespace="mem", filter=u1).ids[0] == "mem#new" and served(c) == before + 1
    c.upsert(["mem#new"], (5 * q)[None], texts=["mem text new"], metadatas=[{"user": "u2"}], namespace="mem")
    serving(c, q, "mem", u1)
    before = served(c)
    r = c.recall(q, 10, namespace="mem", filter=u1)
    assert "mem#new" not in r.ids and served(c) == before + 1
    keep = user(SPACES["mem"], 1)
    ref_i, ref_s = reference_topk(data["mem"], q[None], 10, eligible=keep)
    assert_topk_equal(r.ids, r.scores, [f"mem#{i}" for i in ref_i[0]], ref_s[0])
    gone = [f"mem#{i}" for i in ref_i[0][:4]]
    c.delete(gone, namespace="mem")
    serving(c, q, "mem", u1)
    before = served(c)
    r = c.recall(q, 10, namespace="mem", filter=u1)
    assert served(c) == before + 1 and not set(gone) & set(r.ids)
    keep[ref_i[0][:4]] = False
    ref_i, ref_s = reference_topk(data["mem"], q[None], 10, eligible=keep)
    assert_topk_equal(r.ids, r.scores, [f"mem#{i}" for i in ref_i[0]], ref_s[0])
    c.close()


@pytest.mark.parametrize("lists", ["16", "0"])
def test_a_selective_filter_is_served_through_a_list_that_follows_writes(start_sidecar, monkeypatch, lists) -> None:  # type: ignore[no-untyped-def]
    """A filter that keeps at most a 16th of the rows is served through a list of its rows
    (session 52: the kernel walks those rows only; ``bell_list_uploads`` counts the lists
    made): its recalls are the kernel's and exact for k below and above the rows it keeps, a
    row written into it is found at once, and rows deleted from it are gone at once (each write
    stops the kernel, and its next start makes the list again). The control,
    ``KALOS_FILTER_LIST=0``: the same recalls through a mask, no list made."""
    monkeypatch.setenv("KALOS_FILTER_LIST", lists)
    rng = np.random.default_rng()
    dim = 33
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    data = load(c, rng, dim)
    n = SPACES["mem"]
    few = {"i": {"$lt": 301}}  # 301 of the 8,010 rows: 301 x 16 <= 8,010
    keep = np.arange(n) < 301
    serving(c, data["mem"][0], "mem", few)
    before = served(c)
    for k in (1, 10, 400):
        q = rng.standard_normal(dim).astype(np.float32)
        poison(sc.name)
        check(c.recall(q, k, namespace="mem", filter=few), "mem", data["mem"], keep, q, k, "float32")
    assert served(c) - before == 3
    q = rng.standard_normal(dim).astype(np.float32)
    c.upsert(["mem#new"], (5 * q)[None], texts=["mem text new"], metadatas=[{"i": 7}], namespace="mem")
    serving(c, q, "mem", few)
    before = served(c)
    assert c.recall(q, 3, namespace="mem", filter=few).ids[0] == "mem#new" and served(c) == before + 1
    c.delete(["mem#new"], namespace="mem")
    ref_i, _ = reference_topk(data["mem"], q[None], 10, eligible=keep)
    gone = [f"mem#{i}" for i in ref_i[0][:4]]
    c.delete(gone, namespace="mem")
    keep[ref_i[0][:4]] = False
    serving(c, q, "mem", few)
    before = served(c)
    poison(sc.name)
    r = c.recall(q, 10, namespace="mem", filter=few)
    assert served(c) == before + 1 and not {"mem#new", *gone} & set(r.ids)
    check(r, "mem", data["mem"], keep, q, 10, "float32")
    uploads = index_stats(c)["bell_list_uploads"]
    assert uploads >= 3 if lists != "0" else uploads == 0, uploads
    c.close()


@pytest.mark.parametrize("lists", ["16", "0"])
def test_a_small_namespace_is_served_through_a_list_of_its_rows(start_sidecar, monkeypatch, lists) -> None:  # type: ignore[no-untyped-def]
    """A namespace that holds at most a 16th of the rows, recalled without a filter, is scanned
    through a list of its rows (session 53), by the kernel and on the sidecar's path alike:
    its lone recalls are the kernel's and exact for k below and above its rows, a row written
    into it is found at once and rows deleted from it are gone at once; a batch of its recalls
    (the sidecar's path) is exact too. The control, ``KALOS_FILTER_LIST=0``: the same recalls
    over the namespace's ids, no list made."""
    monkeypatch.setenv("KALOS_FILTER_LIST", lists)
    rng = np.random.default_rng()
    dim = 33
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    spaces = {"": 4003, "few": 211}  # 211 x 16 <= 4,214
    data = load_interleaved(c, rng, dim, spaces, 501, lambda i: {"i": i})
    keep = np.ones(spaces["few"], bool)

    def kernel_serves(q: np.ndarray) -> None:
        until_kernel_serves(c, lambda: c.recall(q, 1, namespace="few"),
                            lambda idx: "few" in idx["doorbell_spaces"], "few")  # fmt: skip

    kernel_serves(data["few"][0])
    before = served(c)
    for k in (1, 10, 250):
        q = rng.standard_normal(dim).astype(np.float32)
        poison(sc.name)
        check(c.recall(q, k, namespace="few"), "few", data["few"], keep, q, k, "float32")
    assert served(c) - before == 3
    listed = index_stats(c)["filter_lists"]
    qs = rng.standard_normal((3, dim)).astype(np.float32)
    for q, r in zip(qs, c.recall_batch(qs, 10, namespace="few"), strict=True):  # (the sidecar's path)
        check(r, "few", data["few"], keep, q, 10, "float32")
    assert index_stats(c)["filter_lists"] - listed == (1 if lists != "0" else 0)
    q = rng.standard_normal(dim).astype(np.float32)
    c.upsert(["few#new"], (5 * q)[None], texts=["few text new"], metadatas=[{"i": 7}], namespace="few")
    kernel_serves(q)
    before = served(c)
    assert c.recall(q, 3, namespace="few").ids[0] == "few#new" and served(c) == before + 1
    c.delete(["few#new"], namespace="few")
    ref_i, _ = reference_topk(data["few"], q[None], 10)
    gone = [f"few#{i}" for i in ref_i[0][:4]]
    c.delete(gone, namespace="few")
    keep[ref_i[0][:4]] = False
    kernel_serves(q)
    before = served(c)
    poison(sc.name)
    r = c.recall(q, 10, namespace="few")
    assert served(c) == before + 1 and not {"few#new", *gone} & set(r.ids)
    check(r, "few", data["few"], keep, q, 10, "float32")
    uploads = index_stats(c)["bell_list_uploads"]
    assert uploads >= 3 if lists != "0" else uploads == 0, uploads
    c.close()


@pytest.mark.parametrize("selective", [False, True])
def test_int8_a_filters_recalls_are_rescored_by_the_kernel(start_sidecar, selective) -> None:  # type: ignore[no-untyped-def]
    """int8 storage: the kernel's scan with a filter's mask (or, for a selective filter, its
    list of rows) finds candidates among the rows it keeps only, and re-scores them: every
    hit passes the filter, its answers are the sidecar's own (documents inline, never rung),
    and recall@10 >= 0.99 against exact search."""
    rng = np.random.default_rng()
    dim = 96
    sc = start_sidecar(dim=dim, device="cuda", dtype="int8")
    c, inline = sc.client(), sc.client(arena_docs=False)
    data = load(c, rng, dim)
    keep = np.arange(SPACES["mem"]) < 301 if selective else user(SPACES["mem"], 4)
    u4 = {"i": {"$lt": 301}} if selective else {"user": "u4"}
    got, ref = [], []
    for _ in range(20):
        q = rng.standard_normal(dim).astype(np.float32)
        serving(c, data["mem"][0], "mem", u4)  # (the sidecar's answer below stops the kernel)
        before = served(c)
        poison(sc.name)
        r = c.recall(q, 10, namespace="mem", filter=u4)
        assert served(c) == before + 1, "not the kernel's answer"
        assert all(keep[int(i.split("#")[1])] for i in r.ids) and len(r) == 10
        own = inline.recall(q, 10, namespace="mem", filter=u4)
        assert_topk_equal(r.ids, r.scores, own.ids, own.scores)
        ref_i, _ = reference_topk(data["mem"], q[None], 10, eligible=keep)
        got.append(r.ids)
        ref.append([f"mem#{i}" for i in ref_i[0]])
    assert recall_at_k(got, ref) >= 0.99
    assert (index_stats(c)["bell_list_uploads"] > 0) == selective
    inline.close()
    c.close()


def test_without_filters_the_kernel_serves_namespaces_only(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The negative control: ``KALOS_BELL_FILTERS=0`` leaves ``doorbell_args`` 0, clients send
    a filter's recalls to the sidecar, and the kernel never answers one (it still serves a
    namespace without a filter)."""
    monkeypatch.setenv("KALOS_BELL_FILTERS", "0")
    rng = np.random.default_rng()
    dim = 33
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    assert c._conn.doorbell_args() == 0 and c._conn.doorbell_spaces() > 0  # type: ignore[union-attr]
    data = load(c, rng, dim)
    for _ in range(20):
        c.recall(data["mem"][0], 1, namespace="mem", filter={"user": "u1"})
    for _ in range(30):  # a namespace's lone recalls start the kernel, which serves it
        idx = index_stats(c)
        if idx["doorbell_running"] and "mem" in idx["doorbell_spaces"]:
            break
        c.recall(data["mem"][0], 1, namespace="mem")
    assert idx["doorbell_running"] and idx["doorbell_filters"] == [] and "mem" in idx["doorbell_spaces"]
    before = served(c)
    for _ in range(10):
        q = rng.standard_normal(dim).astype(np.float32)
        check(c.recall(q, 10, namespace="mem", filter={"user": "u1"}), "mem", data["mem"], user(SPACES["mem"], 1),
              q, 10, "float32")  # fmt: skip
    assert served(c) == before
    for _ in range(30):  # (the sidecar's answers stopped the kernel: started again by the namespace's)
        if index_stats(c)["doorbell_running"]:
            break
        c.recall(q, 1, namespace="mem")
    before = served(c)
    check(c.recall(q, 10, namespace="mem"), "mem", data["mem"], np.ones(SPACES["mem"], bool), q, 10, "float32")
    assert served(c) == before + 1
    c.close()


def test_more_filters_in_turn_than_the_kernel_serves_do_not_stop_and_start_it_again_and_again(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """12 users' filters recalled in random turn, for the kernel's 8 entries: each recall of a
    filter it does not serve stops it, and the start backs off (Dispatcher.lone_enough), so 360
    recalls start it a handful of times (without the back-off, every few recalls: ~20 starts
    per 300 in a review's model). Every answer stays exact. The control: 6 users, fewer than
    it serves, are almost all the kernel's, from a start or so per user."""
    rng = np.random.default_rng()
    dim = 33
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    n = 2411
    data = rng.standard_normal((n, dim)).astype(np.float32)
    users = 12
    c.upsert([f"mem#{i}" for i in range(n)], data, texts=[f"mem text {i}" for i in range(n)],
             metadatas=[{"i": i, "user": f"u{i % users}"} for i in range(n)], namespace="mem")  # fmt: skip

    def turns(active: int, calls: int) -> tuple[int, int]:
        """(kernel starts, kernel answers) over ``calls`` recalls of ``active`` users in random
        turn (in strict rotation, more users than 8 are never counted: each is out of the 8
        most recent by its next recall)."""
        idx = index_stats(c)
        launches, answers = idx["doorbell_launches"], idx["doorbell_served"]
        for _ in range(calls):
            u = int(rng.integers(active))
            q = rng.standard_normal(dim).astype(np.float32)
            r = c.recall(q, 5, namespace="mem", filter={"user": f"u{u}"})
            check(r, "mem", data, np.arange(n) % users == u, q, 5, "float32")
        idx = index_stats(c)
        return idx["doorbell_launches"] - launches, idx["doorbell_served"] - answers

    starts, answered = turns(users, 360)
    assert starts <= 10, (starts, answered)
    time.sleep(1.1)  # (a second without such a stop: the back-off is over)
    starts, answered = turns(6, 360)  # the control
    # (up to 7: since session 51 a scope the kernel declines while its table has room costs a
    # start, not the back-off's second (Dispatcher._learned; a model of these recalls gave 2-4),
    # and since session 50 a lone recall followed by an idle millisecond starts it too)
    assert starts <= 7 and answered >= 300, (starts, answered)
    c.close()

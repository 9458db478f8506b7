"""``KalosClient.recall`` of one query in a namespace or with a filter (the agent memory store's
every recall, the LangGraph store's, a namespaced retriever's), against a real CPU sidecar.

Such a recall takes the same short paths as one in the default namespace: the client writes
it with ``_fastpath.request1`` (its args after the query) and reads the answer with
``answer1``; the sidecar takes it with ``_hotpath.take`` (its args handed over) and answers it
with ``answer1``. Each answer here is checked against ``recall_batch`` of the same query (the
client's general path, the reference), against a numpy search of the scope's rows, and, with
the extension taken away, against the client's Python path."""

from __future__ import annotations

import numpy as np
import pytest
from kalos_testing import is_top_k

import kalos_retrievers.client as client_module

pytestmark = pytest.mark.timeout(120)
fastpath = pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")
if not client_module._X86:
    pytest.skip("the client's C path is x86-64 only", allow_module_level=True)

DIM, N = 13, 149
NAMESPACES = ("", "memory/agent-ü", "memory/other")
SCOPES = [
    ("memory/agent-ü", None),
    ("memory/agent-ü", {"odd": 1}),
    ("", {"i": {"$lt": 40}}),
    ("memory/other", {"$and": [{"odd": 0}, {"i": {"$gte": 30}}]}),
    ("nobody", None),  # a namespace without rows: an empty answer
]


class Counted:
    """``_fastpath`` with ``request1`` counted: ``scoped`` counts the calls given args."""

    def __init__(self) -> None:
        self.requests = self.scoped = 0

    def __getattr__(self, name: str) -> object:
        return getattr(fastpath, name)

    def request1(self, *a: object) -> object:
        self.requests += 1
        self.scoped += len(a) == 7 and bool(a[6])
        return fastpath.request1(*a)


def loaded(start_sidecar, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """A sidecar holding N rows in each of NAMESPACES; returns it and {namespace: vectors}."""
    sc = start_sidecar(dim=DIM)
    data = {}
    with sc.client() as c:
        for j, ns in enumerate(NAMESPACES):
            data[ns] = v = rng.standard_normal((N, DIM)).astype(np.float32)
            c.upsert([f"{j}-{i}" for i in range(N)], v, [f"text {j} {i}" for i in range(N)],
                     [{"i": i, "odd": i % 2} for i in range(N)], namespace=ns)  # fmt: skip
    return sc, data


def matches(flt: dict | None, i: int) -> bool:
    if flt is None:
        return True
    if "$and" in flt:
        return all(matches(f, i) for f in flt["$and"])
    if "odd" in flt:
        return i % 2 == flt["odd"]
    (op, v), = flt["i"].items()
    return i < v if op == "$lt" else i >= v


def is_top(data: dict, ns: str, flt: dict | None, q: np.ndarray, k: int, ids: list[str]) -> bool:
    """``ids`` is the scope's top k: the reference's order, or one that differs only among rows
    whose float64 scores agree within float32's precision (random data, unseeded: it happens;
    :func:`kalos_testing.is_top_k`). An id outside the scope fails."""
    if ns not in data:
        return ids == []
    v = data[ns].astype(np.float64)
    keep = np.array([i for i in range(N) if matches(flt, i)])
    place = {f"{NAMESPACES.index(ns)}-{i}": j for j, i in enumerate(keep)}
    if not all(i in place for i in ids):
        return False
    s = (v[keep] @ q) / np.linalg.norm(v[keep], axis=1)
    return is_top_k(s, [place[i] for i in ids], k, atol=1e-6 * float(np.linalg.norm(q)))


def test_scoped_recalls_take_the_short_paths_and_answer_as_the_general_path(
    start_sidecar, monkeypatch: pytest.MonkeyPatch, docs_from: str
) -> None:  # fmt: skip
    rng = np.random.default_rng()
    sc, data = loaded(start_sidecar, rng)
    wide = rng.standard_normal((23, 2 * DIM)).astype(np.float32)
    queries = [wide[j, ::2] if j % 5 == 0 else wide[j, :DIM].copy() for j in range(len(wide))]  # some strided
    ks = [1, 4, 10, N + 3]
    counted = Counted()
    monkeypatch.setattr(client_module, "_fastpath", counted)
    with sc.client() as c:
        c.ping()  # (a fresh client's first call claims its slots: the general path)
        before = c.stats()["phases"].get("pickup", {}).get("count", 0)
        got, want = [], []
        for j, q in enumerate(queries):
            ns, flt = SCOPES[j % len(SCOPES)]
            k = ks[j % len(ks)]
            got.append(c.recall(q, k, namespace=ns, filter=flt))
            want.append(c.recall_batch([q], k, namespace=ns, filter=flt)[0])
            assert is_top(data, ns, flt, q.astype(np.float64), k, got[-1].ids), (ns, flt, k, got[-1].ids)
        scoped = sum(1 for j in range(len(queries)) if SCOPES[j % len(SCOPES)] != ("", None))
        strided = sum(not q.flags.c_contiguous for q in queries)
        # each recall written in C with its args (a strided view: then its copy); recall_batch not
        assert counted.scoped == scoped + strided and counted.requests == counted.scoped
        # the sidecar's short path took them all, recall_batch's too (a lone batch-1 recall each)
        assert c.stats()["phases"]["pickup"]["count"] - before == 2 * len(queries)
        assert c.arena_retries == 0
    for r, w in zip(got, want, strict=True):
        assert r.ids == w.ids and np.allclose(r.scores, w.scores)
        assert [(h.text, h.metadata, h.namespace) for h in r] == [(h.text, h.metadata, h.namespace) for h in w]
    assert {h.namespace for r in got for h in r} == {"memory/agent-ü", "", "memory/other"}


def test_the_python_path_writes_the_same_scoped_recall(start_sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extension the short Python path writes the args itself: the same answers."""
    rng = np.random.default_rng()
    sc, data = loaded(start_sidecar, rng)
    with sc.client() as c:
        c.ping()
        monkeypatch.setattr(client_module, "_fastpath", None)
        for ns, flt in SCOPES:
            q = rng.standard_normal(DIM).astype(np.float32)
            r = c.recall(q, 7, namespace=ns, filter=flt)
            assert is_top(data, ns, flt, q.astype(np.float64), 7, r.ids)
            assert all(h.namespace == ns for h in r)


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"namespace": 7}, TypeError),
        ({"namespace": "x" * 256}, ValueError),
        ({"namespace": "bad \udcff"}, ValueError),
        ({"filter": {"i": {"$near": 1}}}, ValueError),
        ({"filter": "odd"}, TypeError),
        ({"namespace": "memory/agent-ü", "filter": {"odd": float("nan")}}, ValueError),
    ],
)
def test_a_bad_namespace_or_filter_gets_the_general_paths_error(start_sidecar, kw: dict, error: type) -> None:
    sc = start_sidecar(dim=DIM)
    q = np.ones(DIM, np.float32)
    with sc.client() as c:
        c.ping()
        with pytest.raises(error) as fast:
            c.recall(q, 3, **kw)
        with pytest.raises(error) as general:
            c.recall_batch([q], 3, **kw)
        assert str(fast.value) == str(general.value)
        assert c.recall(q, 3, namespace="memory/agent-ü", filter={"odd": 1}).ids == []  # still usable


def test_a_filter_too_long_for_the_slot_gets_the_general_paths_error(start_sidecar) -> None:
    sc = start_sidecar(dim=DIM, payload_kb=4)
    q = np.ones(DIM, np.float32)
    flt = {"i": {"$in": list(range(2000))}}
    with sc.client() as c:
        c.ping()
        with pytest.raises(ValueError, match="more than a slot's payload") as fast:
            c.recall(q, 3, filter=flt)
        with pytest.raises(ValueError) as general:
            c.recall_batch([q], 3, filter=flt)
        assert str(fast.value) == str(general.value)
        c.upsert(["a"], q, None, [{"i": 5}])
        assert c.recall(q, 3, filter={"i": {"$in": list(range(200))}}).ids == ["a"]  # (one that fits)


def test_an_extension_built_before_scoped_requests_sends_them_the_python_way(
    start_sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose ``_fastpath`` predates the args (no ``REQUEST1_ARGS``; its request1
    takes 6 arguments) writes a scoped recall through the short Python path, and a default
    recall still through C."""
    rng = np.random.default_rng()
    sc, data = loaded(start_sidecar, rng)

    class Old:
        calls = 0

        def __getattr__(self, name: str) -> object:
            if name == "REQUEST1_ARGS":
                raise AttributeError(name)
            return getattr(fastpath, name)

        def request1(self, *a: object) -> object:
            if len(a) != 6:
                raise TypeError("request1 takes 6 arguments")
            Old.calls += 1
            return fastpath.request1(*a)

    monkeypatch.setattr(client_module, "_fastpath", Old())
    monkeypatch.setattr(client_module, "_REQUEST1_ARGS", hasattr(client_module._fastpath, "REQUEST1_ARGS"))
    assert not client_module._REQUEST1_ARGS
    with sc.client() as c:
        c.ping()
        for ns, flt in SCOPES:
            q = rng.standard_normal(DIM).astype(np.float32)
            assert is_top(data, ns, flt, q.astype(np.float64), 5, c.recall(q, 5, namespace=ns, filter=flt).ids)
        assert Old.calls == 0
        q = rng.standard_normal(DIM).astype(np.float32)
        assert is_top(data, "", None, q.astype(np.float64), 5, c.recall(q, 5).ids) and Old.calls == 1

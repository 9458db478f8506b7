"""``KalosClient.recall`` through its C path (``_fastpath``) against a real CPU sidecar, with a
process standing in for the GPU's resident kernel: the client is told a kernel runs
(``doorbell_k``), and the stand-in takes each DOORBELL request, searches through a second,
ordinary client, and answers in the slot with arena entries as the kernel does, or hands the
request back to the sidecar as the kernel does in a crowd. The C path's results must equal the
Python path's and the sidecar's own, in every case it leaves to Python too."""

from __future__ import annotations

import kalos_testing
import numpy as np
import pytest

import kalos_retrievers.client as client_module

pytestmark = pytest.mark.timeout(120)
fastpath = pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")
if not client_module._X86:
    pytest.skip("the arena and the doorbell path are x86-64 only", allow_module_level=True)

DIM, K = 9, 7


def stand_in(name: str, hand_back: bool) -> kalos_testing.DoorbellStandIn:
    """``kalos_testing.doorbell_stand_in`` for this module's dimension, while in the ``with`` block."""
    return kalos_testing.DoorbellStandIn(name, DIM, hand_back)


class Counted:
    """``_fastpath`` with its calls counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.sent = 0  # calls that wrote the request (not None: answered, or left to Python's wait)

    def recall1(self, *a: object) -> object:
        self.calls += 1
        out = fastpath.recall1(*a)
        self.sent += out is not None
        return out


@pytest.mark.parametrize("hand_back", [False, True], ids=["answered", "handed-back"])
def test_the_c_path_gives_what_the_python_path_and_the_sidecar_give(start_sidecar, monkeypatch,
                                                                    hand_back: bool) -> None:  # fmt: skip
    monkeypatch.setenv("KALOS_ARENA", "1")
    sc = start_sidecar(dim=DIM)
    rng = np.random.default_rng()
    n = 203
    with sc.client(arena_docs=True) as c, sc.client(arena_docs=False) as plain:
        texts = [f"memory {i} " * (1 + i % 5) for i in range(n)]
        c.upsert([f"m{i}" for i in range(n)], rng.standard_normal((n, DIM)).astype(np.float32), texts=texts,
                 metadatas=[{"i": i} for i in range(n)])  # fmt: skip
        c.ping()
        monkeypatch.setattr(client_module._Conn, "doorbell_k", lambda self: 64)  # "a kernel runs"
        # every third query a strided view (the C path takes its copy, as the Python path does)
        wide = rng.standard_normal((23, 2 * DIM)).astype(np.float32)
        queries = [wide[j, ::2] if j % 3 == 0 else wide[j, :DIM].copy() for j in range(len(wide))]
        strided = sum(not q.flags.c_contiguous for q in queries)
        counted = Counted()
        got: dict[str, list] = {}
        with stand_in(sc.name, hand_back) as kernel:
            for path, mod in (("c", counted), ("python", None)):
                monkeypatch.setattr(client_module, "_fastpath", mod)
                got[path] = [c.recall(q, K) for q in queries]
        want = [plain.recall(q, K) for q in queries]
        assert strided == 8 and counted.calls == len(queries) + strided  # every C-path recall went through recall1 ...
        if hand_back:  # ... and each, handed back, was answered by the sidecar through Python
            assert kernel.handed_back.value == 2 * len(queries) and kernel.answered.value == 0
        else:
            assert kernel.answered.value == 2 * len(queries) and kernel.handed_back.value == 0
        for path in ("c", "python"):
            for r, w in zip(got[path], want, strict=True):
                assert r.ids == w.ids
                assert np.allclose(r.scores, w.scores)
                assert [h.text for h in r] == [h.text for h in w]
                assert [h.metadata for h in r] == [h.metadata for h in w]


@pytest.mark.parametrize("hand_back", [False, True], ids=["answered", "handed-back"])
def test_a_namespaces_recall_rings_the_kernel_where_the_header_says_it_serves_namespaces(
        start_sidecar, monkeypatch, hand_back: bool) -> None:  # fmt: skip
    """With ``doorbell_spaces`` set (v1.5), a recall in a namespace without a filter is sent
    as DOORBELL with its args after the query, by the C path, the Python path and a batch of
    one query alike: the stand-in answers it in that namespace, or hands it back and the
    sidecar answers it from the same slot; either way the results are the sidecar's own. A
    filter is rung too once ``doorbell_args`` is set (v1.6), within its 128 bytes. A filter
    without ``doorbell_args``, args past it, or a header without ``doorbell_spaces`` (the
    controls) send it to the sidecar as before."""
    monkeypatch.setenv("KALOS_ARENA", "1")
    sc = start_sidecar(dim=DIM)
    rng = np.random.default_rng()
    with sc.client(arena_docs=True) as c, sc.client(arena_docs=False) as plain:
        for ns, n in (("", 51), ("notes", 203), ("ünï-名前", 37)):
            c.upsert([f"{ns}{i}" for i in range(n)], rng.standard_normal((n, DIM)).astype(np.float32),
                     texts=[f"{ns} memory {i}" for i in range(n)], metadatas=[{"i": i} for i in range(n)],
                     namespace=ns)  # fmt: skip
        c.ping()
        monkeypatch.setattr(client_module._Conn, "doorbell_k", lambda self: 64)  # "a kernel runs"
        spaces = {"n": 8}
        monkeypatch.setattr(client_module._Conn, "doorbell_spaces", lambda self: spaces["n"])
        queries = rng.standard_normal((9, DIM)).astype(np.float32)

        def check(namespace: str, flt: dict | None = None) -> None:
            for q in queries:
                r = c.recall(q, K, namespace=namespace, filter=flt)
                w = plain.recall(q, K, namespace=namespace, filter=flt)
                assert r.ids == w.ids and np.allclose(r.scores, w.scores)
                assert [h.text for h in r] == [h.text for h in w] and r.namespace == namespace

        with stand_in(sc.name, hand_back) as kernel:
            check("notes")
            check("ünï-名前")
            rung = len(queries) * 2
            assert (kernel.handed_back.value, kernel.answered.value) == ((rung, 0) if hand_back else (0, rung))
            check("notes", {"i": {"$gte": 100}})  # a filter: the sidecar's, never rung (v1.5)
            assert kernel.handed_back.value + kernel.answered.value == rung
            monkeypatch.setattr(client_module._Conn, "doorbell_args", lambda self: 128)  # v1.6: rung
            check("notes", {"i": {"$gte": 100}})
            check("", {"i": {"$lt": 20}})
            rung += 2 * len(queries)
            assert kernel.handed_back.value + kernel.answered.value == rung
            check("notes", {"i": {"$in": list(range(40))}})  # args of 136 bytes: never rung
            assert kernel.handed_back.value + kernel.answered.value == rung
            monkeypatch.setattr(client_module, "_fastpath", None)  # the Python path rings it too
            check("notes")
            check("notes", {"i": {"$gte": 100}})
            for q in queries[:3]:  # and so does a batch of one query
                (r,) = c.recall_batch(q[None], K, namespace="notes")
                assert r.ids == plain.recall(q, K, namespace="notes").ids
                (r,) = c.recall_batch(q[None], K, namespace="notes", filter={"i": {"$lt": 9}})
                assert r.ids == plain.recall(q, K, namespace="notes", filter={"i": {"$lt": 9}}).ids
            rung += 2 * len(queries) + 6
            assert kernel.handed_back.value + kernel.answered.value == rung
            spaces["n"] = 0
            check("notes")  # the control: no doorbell_spaces, no namespace rung
            check("notes", {"i": {"$gte": 100}})  # nor a filter (doorbell_args alone says nothing)
            assert kernel.handed_back.value + kernel.answered.value == rung


def test_a_query_that_is_not_finite_is_refused_as_on_the_python_path(start_sidecar, monkeypatch) -> None:
    monkeypatch.setenv("KALOS_ARENA", "1")
    sc = start_sidecar(dim=DIM)
    with sc.client(arena_docs=True) as c:
        c.upsert(["a"], np.ones((1, DIM), np.float32), texts=["alpha"])
        c.ping()
        monkeypatch.setattr(client_module._Conn, "doorbell_k", lambda self: 64)
        q = np.ones(DIM, np.float32)
        q[3] = np.nan
        with pytest.raises(ValueError, match=r"NaN|finite"):
            c.recall(q, 1)
        monkeypatch.undo()
        assert c.recall(np.ones(DIM, np.float32), 1)[0].text == "alpha"  # the slot is fine


def test_queries_of_other_types_are_converted_and_take_the_c_path_with_the_same_answers(start_sidecar,
                                                                                     monkeypatch) -> None:  # fmt: skip
    """A 1-D float32 query goes to the C path as it is (recall1 checks its length); int32,
    big-endian, float64 and one-row 2-D queries are converted to float32 first and take the C
    path too, with the sidecar's answers; wrong sizes are refused with the Python path's
    messages, unsent. (Negative control: handing every 1-D array to recall1 unconverted, as
    441b547 did, sent the other dtypes the slow Python way: 2 requests written in C, not 5.)"""
    monkeypatch.setenv("KALOS_ARENA", "1")
    sc = start_sidecar(dim=DIM)
    rng = np.random.default_rng(20261203)
    n = 61
    with sc.client(arena_docs=True) as c, sc.client(arena_docs=False) as plain:
        c.upsert([f"m{i}" for i in range(n)], rng.standard_normal((n, DIM)).astype(np.float32),
                 texts=[f"memory {i}" for i in range(n)])  # fmt: skip
        c.ping()
        monkeypatch.setattr(client_module._Conn, "doorbell_k", lambda self: 64)  # "a kernel runs"
        base = rng.integers(-5, 6, DIM).astype(np.float32)
        base[0] = 7.0  # never all zero
        converted = {
            "int32": base.astype(np.int32),
            "big-endian": base.astype(">f4"),
            "float64": base.astype(np.float64),
            "one row, 2-D": base.reshape(1, DIM),
        }
        counted = Counted()
        monkeypatch.setattr(client_module, "_fastpath", counted)
        with stand_in(sc.name, hand_back=False) as kernel:
            want = plain.recall(base, K)
            for what, q in converted.items():
                got = c.recall(q, K)
                assert got.ids == want.ids, what
                assert np.allclose(got.scores, want.scores), what
            wrong = [(base[:-1], rf"shape \({DIM - 1},\).*dim={DIM}"), (np.append(base, 1.0), rf"shape \({DIM + 1},\)"),
                     (np.tile(base, (2, 1)), "query has 2 vectors; use recall_batch")]  # fmt: skip
            for q, message in wrong:
                with pytest.raises(ValueError, match=message):
                    c.recall(q, K)
            assert c.recall(base, K).ids == want.ids
        # recall1 sent the four converted queries and the last (the stand-in answered them); it
        # was offered the short float32 one too, and sent nothing; the other wrong ones never
        # reached it
        assert (counted.calls, counted.sent, kernel.answered.value) == (6, 5, 5)

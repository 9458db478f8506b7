"""The resident kernel serves namespaces besides the default one (session 48; protocol v1.5).

A lone batch-1 recall in a namespace without a filter is rung to the kernel like the default
namespace's (the header's ``doorbell_spaces``); the kernel answers it over that namespace's rows
when it serves the namespace, and hands it back to the sidecar otherwise, which notes the
namespace so that the kernel serves it from its next start. Each test starts a real GPU
sidecar and reads how many recalls the kernel answered (``doorbell_served``) and which
namespaces it serves (``doorbell_spaces``) from its stats: a result must be right *and* come
from the path the test means. The controls: a client with documents inline (never rung), a
filter not served yet (handed back; tests/gpu/test_gpu_doorbell_filters.py serves filters), a
sidecar with ``KALOS_BELL_SPACES=0``.
"""

from __future__ import annotations

import numpy as np
import pytest
from kalos_testing import (
    assert_topk_equal,
    check_scoped,
    index_stats,
    load_interleaved,
    poison,
    reference_topk,
    until_kernel_serves,
)
from kalos_testing import kernel_answers as served

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

SPACES = {"": 3001, "notes": 5003, "ünï-名前": 1009}  # rows per namespace


@pytest.fixture(autouse=True)
def _doorbell_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KALOS_DOORBELL", "1")


def serving(c, q, namespace: str) -> None:  # type: ignore[no-untyped-def]
    """Lone recalls in ``namespace`` until the kernel runs and serves it."""
    until_kernel_serves(c, lambda: c.recall(q, 1, namespace=namespace),
                        lambda idx: namespace in idx["doorbell_spaces"], repr(namespace))  # fmt: skip


def load(c, rng, dim: int) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    """SPACES' rows, mixed in the index (:func:`load_interleaved`), metadata ``{"i": i}``."""
    return load_interleaved(c, rng, dim, SPACES, 499, lambda i: {"i": i})


def check(r, ns: str, data: np.ndarray, q: np.ndarray, k: int, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """``r`` is the exact top-k of namespace ``ns`` (``data``: its rows), with its texts."""
    check_scoped(r, ns, data, q, k, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_namespaces_recalls_are_answered_by_the_kernel_exactly(start_sidecar, dtype) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng()
    dim = 97
    sc = start_sidecar(dim=dim, device="cuda", dtype=dtype)
    c, plain = sc.client(), sc.client(arena_docs=False)
    assert c._conn.doorbell_spaces() > 0  # type: ignore[union-attr]  # the header says it serves namespaces
    data = load(c, rng, dim)
    serving(c, data["notes"][0], "notes")
    before = served(c)
    calls = 0
    for k in (1, 10, 33, 100):
        for _ in range(3):
            q = rng.standard_normal(dim).astype(np.float32)
            poison(sc.name)
            r = c.recall(q, k, namespace="notes")
            calls += 1
            check(r, "notes", data["notes"], q, k, dtype)
    assert served(c) - before == calls  # every one answered by the kernel
    q = rng.standard_normal(dim).astype(np.float32)
    check(c.recall(q, 10), "", data[""], q, 10, dtype)  # the default namespace's too
    assert served(c) - before == calls + 1
    # a namespace it does not serve yet: handed back and answered by the sidecar, then noted,
    # and served (with "notes") once the kernel starts again
    check(c.recall(q, 10, namespace="ünï-名前"), "ünï-名前", data["ünï-名前"], q, 10, dtype)
    serving(c, q, "ünï-名前")
    assert set(index_stats(c)["doorbell_spaces"]) == {"notes", "ünï-名前"}
    before = served(c)
    for ns in ("ünï-名前", "notes", "", "ünï-名前"):
        q = rng.standard_normal(dim).astype(np.float32)
        poison(sc.name)
        check(c.recall(q, 10, namespace=ns), ns, data[ns], q, 10, dtype)
    assert served(c) - before == 4
    # a name of a served one's length that differs in its last byte: handed back, and empty
    # (it holds no rows); the kernel must not take it for "notes"
    before = served(c)
    assert len(c.recall(q, 10, namespace="notez")) == 0 and served(c) == before
    # the controls: a filter (one every row passes: rung, v1.6, but not served yet, so handed
    # back), and documents inline, are the sidecar's
    before = served(c)
    check(c.recall(q, 10, namespace="notes", filter={"i": {"$gte": 0}}), "notes", data["notes"], q, 10, dtype)
    check(plain.recall(q, 10, namespace="notes"), "notes", data["notes"], q, 10, dtype)
    assert served(c) == before
    c.close()
    plain.close()


def test_a_write_in_a_served_namespace_is_seen_and_a_recreated_one_is_not_stale(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """The kernel is stopped for every write and names its namespaces afresh at each start:
    a row written into a served namespace is found at once, and a namespace whose rows were
    all deleted and then written again (the same id: ids are never reused) returns only its
    new rows, none of the deleted ones."""
    rng = np.random.default_rng()
    dim = 33
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    data = load(c, rng, dim)
    serving(c, data["notes"][0], "notes")
    q = rng.standard_normal(dim).astype(np.float32)
    c.upsert(["notes#new"], (5 * q)[None], texts=["notes text new"], namespace="notes")
    serving(c, q, "notes")
    before = served(c)
    r = c.recall(q, 3, namespace="notes")
    assert r.ids[0] == "notes#new" and served(c) == before + 1
    c.delete([f"notes#{i}" for i in range(SPACES["notes"])] + ["notes#new"], namespace="notes")
    fresh = rng.standard_normal((7, dim)).astype(np.float32)
    c.upsert([f"again#{i}" for i in range(7)], fresh, texts=[f"again {i}" for i in range(7)], namespace="notes")
    serving(c, q, "notes")
    before = served(c)
    r = c.recall(q, 10, namespace="notes")
    assert served(c) == before + 1
    ref_i, ref_s = reference_topk(fresh, q[None], 10)
    assert_topk_equal(r.ids, r.scores, [f"again#{i}" for i in ref_i[0]], ref_s[0])  # 7: the new rows only
    c.close()


def test_without_namespaces_the_kernel_answers_the_default_namespace_only(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The negative control: ``KALOS_BELL_SPACES=0`` leaves ``doorbell_spaces`` 0, clients send
    a namespace's recalls to the sidecar, and the kernel never answers one (it still answers
    the default namespace's)."""
    monkeypatch.setenv("KALOS_BELL_SPACES", "0")
    rng = np.random.default_rng()
    dim = 33
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    assert c._conn.doorbell_spaces() == 0  # type: ignore[union-attr]
    data = load(c, rng, dim)
    for _ in range(20):  # the default namespace's lone recalls start the kernel
        c.recall(data[""][0], 1)
    assert index_stats(c)["doorbell_running"]
    before = served(c)
    for _ in range(10):
        q = rng.standard_normal(dim).astype(np.float32)
        check(c.recall(q, 10, namespace="notes"), "notes", data["notes"], q, 10, "float32")
    assert served(c) == before and index_stats(c)["doorbell_spaces"] == []
    c.close()

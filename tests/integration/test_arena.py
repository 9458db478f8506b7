"""The document arena with a real (CPU) sidecar, kept because ``KALOS_ARENA=1``: recalls whose
documents the client reads from ``/kalos-NAME-docs.V`` (``arena_docs=True``) give what
documents in the response give, follow the arena to new versions, fall back when a row
changed, and leave nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from kalos_retrievers.arena import ArenaView

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _arena_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A sidecar keeps an arena only when something will read it (the GPU's resident kernel)
    or when asked: these CPU sidecars are asked."""
    monkeypatch.setenv("KALOS_ARENA", "1")


def test_without_a_reader_there_is_no_arena(start_sidecar, monkeypatch) -> None:
    """Negative control: by default a CPU sidecar creates none, and ``arena_docs=True``
    clients get their documents inline."""
    monkeypatch.delenv("KALOS_ARENA")
    sc = start_sidecar(dim=4)
    assert arenas(sc.name) == []
    with sc.client(arena_docs=True) as c:
        c.upsert(["a"], np.ones((1, 4), np.float32), texts=["alpha"])
        assert c.recall(np.ones(4, np.float32), 1)[0].text == "alpha"
        assert c._conn.arena() is None  # type: ignore[union-attr]


def arenas(name: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"kalos-{name}-docs.*"))


# A batch-1 recall's answer is read in C (``_fastpath.answer1``, documents by entry) where the
# extension is built, and in Python (``ArenaView``) otherwise or when C leaves it: the tests of
# the arena's rules run both ways ("python": the extension taken away).
PATHS = ["c", "python"]


class CountingFastpath:
    """``_fastpath`` with ``answer1`` watched: ``on_docs(n)`` for each answer whose documents C
    read (``n`` of them); with ``drop_docs`` set, the first such answer's documents are dropped
    (as C does when an entry does not check), leaving them to Python."""

    def __init__(self, real: object, on_docs, drop_docs: bool = False) -> None:  # type: ignore[no-untyped-def]
        self._real, self._on_docs, self._drop = real, on_docs, drop_docs

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def answer1(self, *a):  # type: ignore[no-untyped-def]
        out = self._real.answer1(*a)  # type: ignore[attr-defined]
        if type(out) is tuple and out[-1] is not None:
            if self._drop:
                self._drop = False
                return (*out[:-1], None)
            self._on_docs(len(out[-1]))
        return out


def use_path(monkeypatch, path: str, on_docs=lambda n: None, drop_docs: bool = False) -> None:  # type: ignore[no-untyped-def]
    import kalos_retrievers.client as client_module

    if path == "python":
        monkeypatch.setattr(client_module, "_fastpath", None)
    elif client_module._fastpath is None:
        pytest.skip("the C extension is not built here")
    else:
        monkeypatch.setattr(client_module, "_fastpath", CountingFastpath(client_module._fastpath, on_docs, drop_docs))


@pytest.mark.parametrize("path", PATHS)
def test_arena_documents_equal_inline_documents_across_versions(start_sidecar, monkeypatch, path: str) -> None:
    """Batches too (their hits checked in vectorized passes); results read lazily keep
    reading the version they were answered from after the arena has moved on."""
    rng = np.random.default_rng()
    dim = 11
    sc = start_sidecar(dim=dim)
    inline = sc.client(arena_docs=False)
    arena = sc.client(arena_docs=True)
    first = arenas(sc.name)
    assert len(first) == 1
    ids: list[str] = []
    read: list[int] = []
    real_entry_docs = ArenaView.entry_docs

    def counted(self, blob, n):  # type: ignore[no-untyped-def]
        read.append(n)
        return real_entry_docs(self, blob, n)

    monkeypatch.setattr(ArenaView, "entry_docs", counted)  # (a v1.3 sidecar answers with entries)
    in_c: list[int] = []  # the batch-1 recalls whose documents C read
    use_path(monkeypatch, path, lambda n: (in_c.append(n), read.append(n)))
    early = None
    for batch in range(6):  # long texts: the arena's heap fills and moves to new versions
        n = 301
        vecs = rng.standard_normal((n, dim)).astype(np.float32)
        new = [f"b{batch}-{i}" for i in range(n)]
        arena.upsert(new, vecs, texts=[f"{j} " + "x" * int(rng.integers(1, 900)) for j in new],
                     metadatas=[{"batch": batch, "i": i} for i in range(n)])  # fmt: skip
        ids += new
        q = rng.standard_normal((7, dim)).astype(np.float32)
        got = arena.recall_batch(q, 13)
        assert read[-1] == 7 * 13  # the batch's documents came from the arena
        for a, b in zip(got, inline.recall_batch(q, 13), strict=True):
            assert a.ids == b.ids and np.array_equal(a.scores, b.scores)
            assert [(h.text, h.metadata, h.created_at) for h in a] == [(h.text, h.metadata, h.created_at) for h in b]
        r = arena.recall(q[0], 5)
        assert read[-1] == 5 and [h.text.split(" ")[0] for h in r] == r.ids
        if early is None:  # not read yet: read below, after the versions it came from are gone
            early = (arena.recall_batch(q, 13), inline.recall_batch(q, 13))
    now = arenas(sc.name)
    assert len(now) == 1 and now != first  # moved on, the old versions unlinked
    assert early is not None
    for a, b in zip(*early, strict=True):
        assert [(h.id, h.text, h.metadata) for h in a] == [(h.id, h.text, h.metadata) for h in b]
    assert arena.arena_retries == 0
    assert in_c == ([5] * 6 if path == "c" else [])  # on the C path, C read them
    inline.close()
    arena.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entries", [True, False], ids=["entries", "generations"])
def test_a_row_changed_after_the_answer_is_asked_for_again(start_sidecar, monkeypatch, entries: bool,
                                                           path: str) -> None:  # fmt: skip
    """The client takes a document from the arena only as the answer named it (by entry from
    a v1.3 sidecar; by generation from an older one, simulated by the flags the connection
    asks with); when it is not there (simulated: the view finds nothing, and on the C path C
    found nothing either) it repeats the recall with the documents inline, and the result is
    still right."""
    from kalos_retrievers.protocol import Flag

    dim = 6
    sc = start_sidecar(dim=dim)
    c = sc.client(arena_docs=True)
    data = np.eye(dim, dtype=np.float32)
    c.upsert([f"r{i}" for i in range(dim)], data, texts=[f"t{i}" for i in range(dim)])
    conn = c._conn
    assert conn is not None and conn.arena_flags == Flag.ARENA_DOCS | Flag.ARENA_ENTRIES
    if not entries:  # as to a v1.2 sidecar (the C path's flags are the layout's)
        conn.arena_flags = Flag.ARENA_DOCS
        conn.fast_layout = (*conn.fast_layout[:6], int(Flag.ARENA_DOCS), conn.fast_layout[7])
    assert c.recall(data[2], 1)[0].text == "t2" and c.arena_retries == 0
    use_path(monkeypatch, path, drop_docs=True)
    calls = []
    method = "entry_docs" if entries else "docs"
    real = getattr(ArenaView, method)

    def changed_once(self, *a):  # type: ignore[no-untyped-def]
        calls.append(a)
        return None if len(calls) == 1 else real(self, *a)

    monkeypatch.setattr(ArenaView, method, changed_once)
    r = c.recall(data[4], 2)
    assert r.ids[0] == "r4" and r[0].text == "t4"
    assert c.arena_retries == 1 and len(calls) == 1  # the retry carried its documents inline
    monkeypatch.undo()
    use_path(monkeypatch, path)
    # a real rewrite: the generation moves on, an old answer's generation no longer matches
    view = c._conn.arena()  # type: ignore[union-attr]
    r = c.recall(data[1], 1)
    row = int(r.rows[0])
    g_old = int(np.frombuffer(bytes(view._buf[64 + 16 * row + 12 : 64 + 16 * row + 16]), "<u4")[0])
    assert view.get(row, g_old) is not None  # readable at its generation
    c.upsert(["r1"], data[1:2], texts=["rewritten"])
    assert view.get(row, g_old) is None
    assert c.recall(data[1], 1)[0].text == "rewritten"
    c.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_v12_sidecar_is_asked_for_generations_not_entries(start_sidecar, monkeypatch, path: str) -> None:
    """ARENA_ENTRIES is protocol v1.3, and a v1.2 sidecar refuses flags it does not know: a
    client whose sidecar's header says minor 2 asks for generations (flag ARENA_DOCS alone),
    batch-1 and batches, and reads the documents by generation. Without the header's say
    (the negative control, the real v1.3 header), the same calls go by entry."""
    import dataclasses

    import kalos_retrievers._conn as conn_module
    from kalos_retrievers.protocol import Flag

    dim = 5
    sc = start_sidecar(dim=dim)
    data = np.eye(dim, dtype=np.float32)
    used: list[str] = []
    for method in ("docs", "entry_docs"):
        real = getattr(ArenaView, method)
        monkeypatch.setattr(ArenaView, method,
                            lambda self, *a, _m=method, _real=real: used.append(_m) or _real(self, *a))  # fmt: skip
    in_c: list[int] = []
    use_path(monkeypatch, path, lambda n: (in_c.append(n), used.append("entry_docs")))  # C reads by entry only
    real_decode = conn_module.decode_header
    for minor, want_flags, want_used in ((2, Flag.ARENA_DOCS, "docs"),
                                         (None, Flag.ARENA_DOCS | Flag.ARENA_ENTRIES, "entry_docs")):  # fmt: skip
        if minor is not None:
            def as_minor(*a, _minor=minor, **kw):  # type: ignore[no-untyped-def]
                return dataclasses.replace(real_decode(*a, **kw), version_minor=_minor)

            monkeypatch.setattr(conn_module, "decode_header", as_minor)
        else:
            monkeypatch.setattr(conn_module, "decode_header", real_decode)
        used.clear()
        with sc.client(arena_docs=True) as c:
            c.upsert([f"r{i}" for i in range(dim)], data, texts=[f"t{i}" for i in range(dim)])
            assert c._conn.arena_flags == want_flags  # type: ignore[union-attr]
            assert c.recall(data[3], 2)[0].text == "t3"
            assert [r[0].text for r in c.recall_batch(data[:3], 2)] == ["t0", "t1", "t2"]
            assert used == [want_used, want_used] and c.arena_retries == 0
    assert in_c == ([2] if path == "c" else [])  # by entry from the v1.3 sidecar only


def test_entries_are_not_asked_of_a_connection_that_does_not_speak_v13(start_sidecar) -> None:
    """A recall picks its flags from the connection it saw; if a restart replaced that
    connection by one to a v1.2 sidecar before the request goes out (simulated: the current
    connection says it speaks v1.2), the request asks for generations, which that sidecar
    knows, instead of failing on a flag it does not (negative control: a v1.3 connection is
    asked for entries)."""
    from kalos_retrievers.protocol import Flag, Op, RespFlag

    dim = 4
    sc = start_sidecar(dim=dim)
    c = sc.client(arena_docs=True)
    c.upsert(["a"], np.array([[1, 0, 0, 0]], np.float32), texts=["alpha"])
    q = np.array([[1, 0, 0, 0]], np.float32)
    both = Flag.ARENA_DOCS | Flag.ARENA_ENTRIES
    rep = c._call(Op.RECALL, vectors=q, top_k=1, n_items=1, flags=both)
    assert rep.resp_flags & RespFlag.ARENA_ENTRIES  # the control: v1.3 is asked for entries
    c._conn.arena_flags = Flag.ARENA_DOCS  # type: ignore[union-attr]  # as if it were v1.2
    rep = c._call(Op.RECALL, vectors=q, top_k=1, n_items=1, flags=both)
    assert rep.resp_flags & RespFlag.ARENA_DOCS and not rep.resp_flags & RespFlag.ARENA_ENTRIES
    assert len(rep.blob) == 4  # one generation
    c.close()


def test_an_answer_from_a_newer_arena_version_is_read_from_that_version(start_sidecar, monkeypatch) -> None:
    """The sidecar moved its arena to a new version after the client picked the one to read
    (simulated: the client is handed the version it mapped before the move): the answer's
    entries name the new version, so the client maps the version the header names now and
    reads them there, without asking again. (Without that step the version check fails and
    the recall is asked again inline: arena_retries would count it.)"""
    from kalos_retrievers import KalosClient

    dim = 4
    sc = start_sidecar(dim=dim)
    c = sc.client(arena_docs=True)
    c.upsert(["a"], np.array([[1, 0, 0, 0]], np.float32), texts=["alpha"])
    old = c._conn.arena()  # type: ignore[union-attr]
    assert old is not None
    rng = np.random.default_rng()
    vecs = rng.standard_normal((1200, dim)).astype(np.float32)
    vecs[:, 0] = 0  # none near "a"
    vecs[:, 1] += 0.1
    c.upsert([f"x{i}" for i in range(1200)], vecs, texts=["y" * 1000] * 1200)  # past the first heap and table
    new = c._conn.arena()  # type: ignore[union-attr]
    assert new is not None and new.version > old.version
    monkeypatch.setattr(KalosClient, "_arena", lambda self: old)
    r = c.recall(np.array([1, 0, 0, 0], np.float32), 1)
    assert r.ids == ["a"] and r[0].text == "alpha" and c.arena_retries == 0
    rs = c.recall_batch(np.array([[1, 0, 0, 0], [1, 0.01, 0, 0]], np.float32), 1)
    assert [x[0].text for x in rs] == ["alpha", "alpha"] and c.arena_retries == 0
    c.close()


def test_a_killed_sidecars_arena_is_removed_by_the_next_one(start_sidecar, make_name) -> None:
    name = make_name()
    sc = start_sidecar(name=name, dim=4)
    with sc.client() as c:
        c.upsert(["a"], np.ones((1, 4), np.float32), texts=["alpha"])
    assert len(arenas(name)) == 1
    os.kill(sc.pid, signal.SIGKILL)  # type: ignore[arg-type]
    sc.proc.wait(10)  # type: ignore[union-attr]
    assert len(arenas(name)) == 1  # left behind by the dead sidecar
    sc2 = start_sidecar(name=name, dim=4)
    with sc2.client(arena_docs=True) as c:
        c.upsert(["b"], np.ones((1, 4), np.float32), texts=["beta"])
        assert c.recall(np.ones(4, np.float32), 1)[0].text == "beta"
    left = arenas(name)
    assert len(left) == 1 and left[0].endswith(".1")  # the stale one is gone, ours is new
    assert sc2.stop() == 0
    assert arenas(name) == []  # a clean stop unlinks it


def _mapped(name: str) -> bool:
    """Whether this process maps /dev/shm/``name`` (unlinked or not)."""
    return f"/dev/shm/{name}" in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("let_go", [True, False], ids=["let-go", "control"])
def test_a_client_that_stops_recalling_lets_go_of_an_old_arena_version(
    start_sidecar, monkeypatch, let_go: bool
) -> None:
    """A client maps the arena's current version when it recalls. When the sidecar has moved
    on (the heap filled: a new version, the old one unlinked), the client's next call of any
    other kind unmaps the old version, so a client that now only writes, counts or pings
    holds no unlinked arena memory. Negative control: without that step it stays mapped."""
    import gc

    from kalos_retrievers.client import _Conn

    if not let_go:
        monkeypatch.setattr(_Conn, "drop_stale_arena", lambda self: None)
    rng = np.random.default_rng()
    dim = 5
    sc = start_sidecar(dim=dim)
    with sc.client(arena_docs=True) as reader, sc.client(arena_docs=False) as writer:
        writer.upsert(["a"], np.ones((1, dim), np.float32), texts=["alpha"])
        assert reader.recall(np.ones(dim, np.float32), 1)[0].text == "alpha"
        (old,) = arenas(sc.name)
        assert _mapped(old)
        for batch in range(6):  # long texts: the heap fills, the arena moves to new versions
            n = 301
            writer.upsert([f"b{batch}-{i}" for i in range(n)], rng.standard_normal((n, dim)).astype(np.float32),
                          texts=["x" * int(rng.integers(300, 900)) for _ in range(n)])  # fmt: skip
        assert old not in arenas(sc.name)  # moved on, the old version unlinked
        assert _mapped(old)  # the reader still maps it
        assert reader.count() == 1 + 6 * 301
        gc.collect()
        assert _mapped(old) is not let_go
        assert reader.recall(np.ones(dim, np.float32), 1)[0].text == "alpha"  # maps the new one

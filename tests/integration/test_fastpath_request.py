"""``KalosClient.recall`` of one query that the sidecar itself answers (no resident kernel takes
it), through the client's C path: ``_fastpath.request1`` writes the REQUEST, the client posts
and waits as on the Python path, ``_fastpath.answer1`` reads the answer. Against a real CPU
sidecar, with a document arena (``KALOS_ARENA=1``: C reads the documents too) and without
(the default on a CPU: the documents come inline, and Python decodes them from the blob C
copied). Each test runs on both paths ("python": the extension taken away), so that the
Python path is the reference and the negative control of what the C path must do the same."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

import kalos_retrievers.client as client_module
from kalos_retrievers.errors import RequestRejected, SidecarTimeout, SidecarUnavailable
from kalos_retrievers.protocol import RESPONSE_OFFSET, RESPONSE_STRUCT, Flag, SlotState, Status

pytestmark = pytest.mark.timeout(120)
fastpath = pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")
if not client_module._X86:
    pytest.skip("the arena is x86-64 only", allow_module_level=True)

DIM, N = 11, 157
PATHS = ["c", "python"]
FLAGS_ARENA = Flag.ARENA_DOCS | Flag.ARENA_ENTRIES  # a v1.3 sidecar's arena recall


class Counted:
    """``_fastpath`` with ``request1`` / ``answer1`` counted (``read``: answers C read whole;
    ``flags``: the request flags of each layout request1 was given)."""

    def __init__(self, leave: bool = False) -> None:
        self.requests = self.answers = self.read = 0
        self.flags: set[int] = set()
        self.leave = leave  # answer1 leaves every answer to Python (as for one it does not take)

    def recall1(self, *a: object) -> object:
        raise AssertionError("no resident kernel runs: recall1 must not be called")

    def request1(self, *a: object) -> object:
        self.requests += 1
        self.flags.add(a[2][6])  # type: ignore[index]
        return fastpath.request1(*a)

    def answer1(self, *a: object) -> object:
        self.answers += 1
        if self.leave:
            return None
        out = fastpath.answer1(*a)
        self.read += type(out) is tuple
        return out


def loaded(start_sidecar, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    sc = start_sidecar(dim=DIM)
    with sc.client() as c:
        c.upsert([f"m{i}" for i in range(N)], rng.standard_normal((N, DIM)).astype(np.float32),
                 texts=[f"memory {i} " * (1 + i % 4) for i in range(N)],
                 metadatas=[{"i": i, "odd": i % 2} for i in range(N)])  # fmt: skip
    return sc


def use(monkeypatch: pytest.MonkeyPatch, path: str, counted: Counted) -> None:
    monkeypatch.setattr(client_module, "_fastpath", counted if path == "c" else None)


@pytest.mark.parametrize("leave", [False, True], ids=["read-in-c", "left-to-python"])
def test_the_c_path_gives_what_the_python_path_and_inline_documents_give(start_sidecar, monkeypatch, docs_from: str,
                                                                         leave: bool) -> None:  # fmt: skip
    """Every recall's request written by request1 and its answer read by answer1 (or, when
    answer1 leaves it, read by Python from the wait on, not waited for again); results equal the
    Python path's and those of a client taking documents inline; the wait learnt once per
    recall."""
    rng = np.random.default_rng()
    sc = loaded(start_sidecar, rng)
    wide = rng.standard_normal((29, 2 * DIM)).astype(np.float32)
    queries = [wide[j, ::2] if j % 4 == 0 else wide[j, :DIM].copy() for j in range(len(wide))]  # some strided
    ks = [1, 3, 10, N, N + 5]
    with sc.client(arena_docs=True) as c, sc.client(arena_docs=False) as plain:
        assert (c._arena() is not None) == (docs_from == "arena")
        c.recall(queries[1], 1)  # (a fresh client's first call claims its slots: the general path)
        observed, waits = [], []
        real_observe, real_wait = c._observe_wait, c._wait
        monkeypatch.setattr(c, "_observe_wait", lambda ns: observed.append(ns) or real_observe(ns))
        monkeypatch.setattr(c, "_wait", lambda *a, **kw: waits.append(1) or real_wait(*a, **kw))
        got = {}
        counted = Counted(leave)
        for path in PATHS:
            use(monkeypatch, path, counted)
            observed.clear(), waits.clear()
            got[path] = [c.recall(q, ks[j % len(ks)]) for j, q in enumerate(queries)]
            assert len(observed) == len(queries) and len(waits) == len(queries), path
        strided = sum(not q.flags.c_contiguous for q in queries)
        assert strided == 8 and counted.requests == len(queries) + strided  # (a strided view: then its copy)
        assert counted.answers == len(queries) and counted.read == (0 if leave else len(queries))
        want = [plain.recall(q, ks[j % len(ks)]) for j, q in enumerate(queries)]
        for path in PATHS:
            for r, w in zip(got[path], want, strict=True):
                assert r.ids == w.ids and np.allclose(r.scores, w.scores)
                assert [(h.text, h.metadata) for h in r] == [(h.text, h.metadata) for h in w]
        assert c.arena_retries == 0


@pytest.mark.parametrize("path", PATHS)
def test_an_error_answer_is_raised_and_the_slot_reused(start_sidecar, monkeypatch, docs_from: str, path: str) -> None:
    """An answer with an error status (written by a stand-in wait, as a sidecar would) raises
    the Python path's error, and the slot goes back into circulation."""
    rng = np.random.default_rng()
    sc = loaded(start_sidecar, rng)
    counted = Counted()
    with sc.client(arena_docs=True) as c:
        c.ping()
        conn = c._conn
        assert conn is not None
        free = len(conn.free)
        msg = b"this recall is refused"

        def refuse(conn, s, seq, deadline, *, recall, doorbell=False, check=True):  # type: ignore[no-untyped-def]
            # the request is in the slot (REQUEST) when the wait begins; the sidecar may answer
            # it before this looks (waiting first to see REQUEST or BUSY hung then, 2-core VM)
            while s.state[0] not in (SlotState.RESPONSE, SlotState.ERROR):  # the real answer first
                time.sleep(0.0001)
            s.blob[: len(msg)] = msg
            RESPONSE_STRUCT.pack_into(s.ctl, RESPONSE_OFFSET, seq, Status.BAD_REQUEST, 0, len(msg), 0)
            s.state[0] = SlotState.ERROR
            return c._check_seq(s, seq) if check else None

        use(monkeypatch, path, counted)
        monkeypatch.setattr(c, "_wait", refuse)
        with pytest.raises(RequestRejected, match="this recall is refused"):
            c.recall(rng.standard_normal(DIM).astype(np.float32), 5)
        monkeypatch.setattr(c, "_wait", type(c)._wait.__get__(c))
        assert len(conn.free) == free
        assert len(c.recall(rng.standard_normal(DIM).astype(np.float32), 5)) == 5
        assert counted.requests == (2 if path == "c" else 0)


@pytest.mark.parametrize("path", PATHS)
def test_a_paused_sidecar_times_out_and_the_slot_stays_out_until_answered(start_sidecar, monkeypatch, docs_from: str,
                                                                          path: str) -> None:  # fmt: skip
    """The deadline holds on the C path as on the Python one: SidecarTimeout, the slot left out
    of circulation (a late answer must not be read as another call's), and back once the
    sidecar, resumed, has answered it."""
    rng = np.random.default_rng()
    sc = loaded(start_sidecar, rng)
    with sc.client(arena_docs=True, spin_us=0) as c:
        c.ping()
        conn = c._conn
        assert conn is not None
        free = len(conn.free)
        counted = Counted()
        use(monkeypatch, path, counted)
        q = rng.standard_normal(DIM).astype(np.float32)
        want = c.recall(q, 4).ids
        sc.kill(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(SidecarTimeout):
                c.recall(q, 4, timeout=0.3)
            assert 0.25 < time.monotonic() - t0 < 5
            assert len(conn.free) == free - 1  # abandoned
        finally:
            sc.kill(signal.SIGCONT)
        assert c.recall(q, 4).ids == want
        end = time.monotonic() + 10
        while len(conn.free) < free and time.monotonic() < end:
            c.recall(q, 4)
            time.sleep(0.01)
        assert len(conn.free) == free  # answered late, then recovered
    assert (counted.requests >= 2) == (path == "c")  # (the one before the pause, the one timed out)


@pytest.mark.parametrize("path", PATHS)
def test_a_sidecar_killed_during_the_wait_is_reported_at_once(start_sidecar, monkeypatch, docs_from: str,
                                                             path: str) -> None:  # fmt: skip
    rng = np.random.default_rng()
    sc = loaded(start_sidecar, rng)
    with sc.client(arena_docs=True, spin_us=0, timeout=30) as c:
        c.ping()
        counted = Counted()
        use(monkeypatch, path, counted)
        sc.kill(signal.SIGSTOP)
        sc.kill(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SidecarUnavailable):
            c.recall(rng.standard_normal(DIM).astype(np.float32), 3)
        assert time.monotonic() - t0 < 10  # not the 30 s deadline
    assert counted.requests == (1 if path == "c" else 0)
    assert sc.proc is not None
    sc.proc.wait(10)
    start_sidecar(dim=DIM, name=sc.name)  # removes what the killed sidecar left in /dev/shm


@pytest.mark.parametrize("path", PATHS)
def test_a_client_taking_documents_inline_from_a_sidecar_with_an_arena_asks_for_them_inline(
    start_sidecar, monkeypatch, path: str
) -> None:
    """The C path's request flags are the client's: with ``arena_docs=False`` none, even when
    the sidecar keeps an arena (asked for arena entries, the answers would name documents the
    client does not read, and every recall would be asked again inline: ``arena_retries``)."""
    monkeypatch.setenv("KALOS_ARENA", "1")
    rng = np.random.default_rng()
    sc = loaded(start_sidecar, rng)
    counted = Counted()
    with sc.client(arena_docs=False) as c, sc.client(arena_docs=True) as reference:
        c.ping(), reference.ping()  # (a fresh client's first call claims its slots: the general path)
        assert c._arena() is None and reference._arena() is not None
        use(monkeypatch, path, counted)
        qs = rng.standard_normal((13, DIM)).astype(np.float32)
        got = [c.recall(q, 7) for q in qs]
        assert c.arena_retries == 0
        for r, w in zip(got, [reference.recall(q, 7) for q in qs], strict=True):
            assert r.ids == w.ids and [h.text for h in r] == [h.text for h in w]
    assert counted.flags == ({0, int(FLAGS_ARENA)} if path == "c" else set())
    assert counted.requests == (2 * len(qs) if path == "c" else 0)


@pytest.mark.parametrize("path", PATHS)
def test_answers_that_continue_are_read_whole(start_sidecar, monkeypatch, path: str) -> None:
    """Inline documents that do not fit the slot's blob come in several answers (MORE): the C
    path leaves such an answer to Python, which reads it and asks for the rest; results equal
    the Python path's and a reference client's."""
    rng = np.random.default_rng()
    sc = start_sidecar(dim=DIM, blob_kb=8)
    n = 601
    with sc.client() as c:
        c.upsert([f"m{i}" for i in range(n)], rng.standard_normal((n, DIM)).astype(np.float32),
                 texts=[f"memory {i} " + "y" * int(rng.integers(1, 300)) for i in range(n)])  # fmt: skip
    counted = Counted()
    qs = rng.standard_normal((9, DIM)).astype(np.float32)
    ks = [1, 10, 200, 500, 1024]
    with sc.client(arena_docs=False) as c, sc.client(arena_docs=False) as reference:
        c.ping()
        want = [reference.recall(q, ks[j % len(ks)]) for j, q in enumerate(qs)]
        use(monkeypatch, path, counted)
        got = [c.recall(q, ks[j % len(ks)]) for j, q in enumerate(qs)]
    for r, w in zip(got, want, strict=True):
        assert r.ids == w.ids and [h.text for h in r] == [h.text for h in w]
    if path == "c":
        assert counted.answers == len(qs) and 0 < counted.read < counted.answers  # some continued

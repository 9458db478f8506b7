"""The dispatcher answering a batch's batch-1 members in C (``_hotpath.answer1`` from
``Dispatcher._answer_hot``), in process: an anonymous map stands in for the segment.

Each scenario runs the same batch twice over one service, through a dispatcher with the C path
and through one without it (``_hotpath`` None: KALOS_HOTPATH=0), and compares everything a
client or an operator could see: every slot's bytes (state word, response words, rows, scores,
blob), the posts of each slot's semaphore, what is kept for CONTINUE, and the stats recorded.
The batches are real ones: several slots waiting at once on a CPU index go through the batch
path (pick-up, one search over all members, ``_answer_batch``), as in test_dispatcher_batch.py."""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import numpy as np
import pytest
from kalos_retrievers.sidecar import dispatcher as dispatcher_module
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats

from kalos_retrievers.protocol import (
    CTL_SIZE,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    RESPONSE_OFFSET,
    Flag,
    Layout,
    RespFlag,
    Response,
    SlotState,
    Status,
)

# the C module (skips this file where it is not built) and the helpers of its own tests
from unit.test_hotpath import (  # isort: skip
    ARENA, DIM, ENTRIES, ROWS as ARENA_ROWS, Slot, _arena, _arena_arg, _Counting, _docs, _recall, _Sem, _service, hp,
)  # fmt: skip

N_SLOTS, ROWS = 6, 150
FLAGS = {"inline": 0, "no docs": Flag.NO_DOCS, "generations": ARENA, "entries": ENTRIES}


@pytest.mark.parametrize("flags", [0, Flag.NO_DOCS, ARENA], ids=["inline", "no docs", "generations"])
@pytest.mark.parametrize("kk", [1, 256, 257, 500])  # (above 256: answer1's copy of the rows is on the heap)
def test_answer1_over_the_slots_own_rows_and_scores(flags: int, kk: int) -> None:
    """answer1 given the slot's own rows and scores areas (a batch's member) answers from them
    as from the search's own arrays, and leaves them as they are."""
    rng = np.random.default_rng()
    rows, scores = rng.choice(ARENA_ROWS, kk).astype(np.int32), rng.standard_normal(kk).astype(np.float32)
    w = _arena(ARENA_ROWS)
    docs = [b"d%d" % r for r in range(ARENA_ROWS)] if kk > 1 else _docs(ARENA_ROWS)  # (inline: fits the blob)
    out = []
    for own in (True, False):
        s = Slot()
        at_rows = np.frombuffer(s.mm, np.int32, kk, s.off + s.lay.rows_offset)
        at_scores = np.frombuffer(s.mm, np.float32, kk, s.off + s.lay.scores_offset)
        at_rows[:], at_scores[:] = rows, scores
        s.request(_recall(flags=flags), SlotState.BUSY)
        args = (at_rows, at_scores) if own else (rows.copy(), scores.copy())
        assert hp.answer1(s.view, s.layout, 4, flags, *args, ARENA_ROWS, docs, _arena_arg(w)) is True
        assert at_rows.tolist() == rows.tolist() and at_scores.tobytes() == scores.tobytes()
        out.append(bytes(s.view))
    assert out[0] == out[1]
    resp = Response.unpack(out[0][:CTL_SIZE])
    assert (resp.seq, resp.status, resp.n_results) == (4, Status.OK, kk)
    if flags == ARENA:
        assert out[0][s.lay.blob_offset :][: resp.resp_len] == w.refs(rows.tolist(), False)


class _Hot(_Counting):
    """The C module, counting its calls (``_Counting``) and noting, for each answer1 call,
    whether the rows and scores it was given are the slot's own areas (a batch's, where the
    search wrote them)."""

    def __init__(self) -> None:
        super().__init__()
        self.own_areas: list[bool] = []

    def answer1(self, slot: memoryview, layout: tuple[int, ...], *rest: Any) -> bool:
        base = np.frombuffer(slot, np.uint8).ctypes.data
        rows, scores = rest[2], rest[3]
        self.own_areas.append((rows.ctypes.data - base, scores.ctypes.data - base) == (layout[2], layout[3]))
        return self.__getattr__("answer1")(slot, layout, *rest)  # type: ignore[no-any-return]


class _Rig(NamedTuple):
    d: Dispatcher
    mm: mmap.mmap
    lay: Layout


def _rigs(svc: Service, monkeypatch: pytest.MonkeyPatch, blob_size: int = 1 << 14) -> tuple[_Rig, _Rig]:
    """(the C path's dispatcher, the Python path's), each over its own map, one service."""
    out = []
    for hot in (hp, None):
        monkeypatch.setattr(dispatcher_module, "_hotpath", hot)
        lay = Layout(n_slots=N_SLOTS, dim=DIM, max_k=64, payload_size=1 << 14, blob_size=blob_size)
        mm = mmap.mmap(-1, lay.segment_size)
        d = Dispatcher(mm, lay, [_Sem() for _ in range(N_SLOTS)], svc, Stats(), max_batch=64, describe=lambda: {})
        if hot is not None:
            d.hot = _Hot()  # type: ignore[assignment]
        out.append(_Rig(d, mm, lay))
    return out[0], out[1]


def _run(rig: _Rig, qs: np.ndarray, flags: int, k: int, seq: int) -> dict[str, Any]:
    """Every slot's request (query ``qs[i]``, seq ``seq + i``) waiting at once, answered as one
    batch; then what a client or an operator sees of it."""
    d, mm, lay = rig
    posts = [s.posts for s in d.sems]
    for i in range(N_SLOTS):
        off = lay.slot_offset(i)
        mm[off : off + lay.slot_size] = bytes(lay.slot_size)  # every run starts from the same bytes
        np.frombuffer(mm, np.float32, DIM, off + lay.payload_offset)[:] = qs[i]
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, *_recall(flags=flags, top_k=k, seq=seq + i))
    d.states[:] = SlotState.REQUEST
    assert d.poll() == N_SLOTS
    d.settle()
    s = d.stats
    return {
        "slots": [bytes(mm[lay.slot_offset(i) : lay.slot_offset(i) + lay.slot_size]) for i in range(N_SLOTS)],
        "posts": [x.posts - p for x, p in zip(d.sems, posts, strict=True)],
        "pending": dict(d.pending),
        "requests": dict(s.requests),
        "latency": {op: h.count for op, h in s.latency.items()},
        "phases": {name: h.count for name, h in s.phases.items()},
        "batches": (s.batches, s.batched_queries),
    }


def _assert_same(c: dict[str, Any], p: dict[str, Any]) -> None:
    """The C path's outcome is the Python path's, byte for byte (the first difference named)."""
    for i, (a, b) in enumerate(zip(c["slots"], p["slots"], strict=True)):
        if a != b:
            at = next(j for j in range(len(a)) if a[j] != b[j])
            raise AssertionError(f"slot {i} differs first at byte {at}: {a[at]} (C) != {b[at]} (Python)")
    assert c == p


def _responses(out: dict[str, Any], lay: Layout) -> list[tuple[int, Response, bytes]]:
    """(state, response words, blob) of each slot."""
    got = []
    for raw in out["slots"]:
        resp = Response.unpack(raw[:CTL_SIZE])
        got.append((int(np.frombuffer(raw, np.uint32, 1)[0]), resp, raw[lay.blob_offset :][: resp.resp_len]))
    return got


def _queries(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((N_SLOTS, DIM)).astype(np.float32)


@pytest.mark.parametrize("flags", list(FLAGS.values()), ids=list(FLAGS))
@pytest.mark.parametrize("k", [1, 10, 33])
def test_a_batchs_answers_in_c_are_the_python_paths_byte_for_byte(
    flags: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = _service(ROWS)
    c, p = _rigs(svc, monkeypatch)
    rng = np.random.default_rng()
    for r in range(3):
        qs = _queries(rng)
        out = _run(c, qs, flags, k, 100 * r)
        _assert_same(out, _run(p, qs, flags, k, 100 * r))
        for i, (state, resp, _) in enumerate(_responses(out, c.lay)):
            assert (state, resp.seq, resp.status, resp.n_results) == (SlotState.RESPONSE, 100 * r + i, Status.OK, k)
            want = RespFlag.ARENA_DOCS | (RespFlag.ARENA_ENTRIES if flags & Flag.ARENA_ENTRIES else 0)
            assert resp.resp_flags == (want if flags & Flag.ARENA_DOCS else 0)
        assert out["batches"] == (r + 1, (r + 1) * N_SLOTS)  # one batch of them all, each round
    # every member answered in C, from the rows and scores the search left in its slot
    hot = c.d.hot
    assert hot.calls["take"] == hot.calls["answer1"] == hot.calls["answered"] == 3 * N_SLOTS  # type: ignore[union-attr]
    assert hot.own_areas == [True] * (3 * N_SLOTS)  # type: ignore[union-attr]


def test_answers_with_vectors_are_left_to_python_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """answer1 leaves vectors to Python: the batch path does not even ask it."""
    svc = _service(ROWS)
    c, p = _rigs(svc, monkeypatch)
    qs = _queries(np.random.default_rng())
    for flags in (Flag.WITH_VECTORS, Flag.WITH_VECTORS | ARENA):
        _assert_same(_run(c, qs, flags, 10, 5), _run(p, qs, flags, 10, 5))
    assert "answer1" not in c.d.hot.calls  # type: ignore[union-attr]


def test_an_empty_index_is_answered_as_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rows, kk 0: today's path (answer1 not asked), the same empty answers."""
    svc = _service(0)
    c, p = _rigs(svc, monkeypatch)
    qs = _queries(np.random.default_rng())
    for flags in FLAGS.values():
        out = _run(c, qs, flags, 10, 1)
        _assert_same(out, _run(p, qs, flags, 10, 1))
        assert all(r.status == Status.OK and r.n_results == 0 for _, r, _ in _responses(out, c.lay))
    assert "answer1" not in c.d.hot.calls  # type: ignore[union-attr]


BAD_ROW = 2  # the member (slot) the index gives a wrong row


@pytest.mark.parametrize("flags", list(FLAGS.values()), ids=list(FLAGS))
@pytest.mark.parametrize("fault", ["above high", "negative", "deleted", "arena entry cleared"])
@pytest.mark.parametrize("k", [1, 10])
def test_a_member_given_a_bad_row_gets_the_python_paths_error_and_its_neighbours_answers(
    flags: int, fault: str, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index returns one member a row it must never return (a bug): out of range, a
    deleted row (no document), or a row whose arena entry is empty while the row table still
    holds its document (the table and the arena part ways). answer1 declines that member; the
    Python path then answers it, here as alone (INTERNAL, its message), and every other member
    is answered in C. NO_DOCS names no document and checks nothing: both paths answer it."""
    svc = _service(ROWS)
    qs = _queries(np.random.default_rng())
    # a row in no member's true top-k, so that only the member given it is affected
    # (mid-table: deleting it leaves `high` as it is)
    hits = set(svc.index.search(qs, k, svc.rows.high, 0, None, True)[0].ravel().tolist())
    orphan = min(set(range(1, ROWS - 1)) - hits)
    if fault == "deleted":
        assert svc.delete({"namespace": "", "ids": [f"r{orphan}"]}) == 1
    elif fault == "arena entry cleared":
        svc.rows.arena.clear(orphan)  # type: ignore[union-attr]
    bad = {"above high": ROWS + 3, "negative": -2}.get(fault, orphan)
    search = svc.index.search

    def bad_search(*a: Any, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        rows, scores = search(*a, **kw)
        rows[BAD_ROW, -1] = bad  # (members are searched in slot order)
        return rows, scores

    monkeypatch.setattr(svc.index, "search", bad_search)
    c, p = _rigs(svc, monkeypatch)
    out = _run(c, qs, flags, k, 40)
    _assert_same(out, _run(p, qs, flags, k, 40))
    refused = not flags & Flag.NO_DOCS and not (fault == "arena entry cleared" and not flags & Flag.ARENA_DOCS)
    for i, (state, resp, blob) in enumerate(_responses(out, c.lay)):
        if i == BAD_ROW and refused:
            assert (state, resp.status) == (SlotState.ERROR, Status.INTERNAL)
            assert blob == (b"the index returned rows out of range" if bad != orphan
                            else b"the index returned rows that hold no memory")  # fmt: skip
        else:
            assert (state, resp.status, resp.n_results) == (SlotState.RESPONSE, Status.OK, k)
    assert out["posts"] == [1] * N_SLOTS
    assert c.d.hot.calls["answered"] == N_SLOTS - refused  # type: ignore[union-attr]
    assert out["requests"] == {("recall", "ok"): N_SLOTS - refused, **({("recall", "internal"): 1} if refused else {})}


def test_an_answer_too_large_for_the_blob_is_sent_in_parts_as_by_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents inline that do not fit the slot's blob: answer1 declines, and the Python path
    sends the first part (flag MORE) and keeps the rest for CONTINUE, as it would alone; the
    members whose answers fit are answered in C."""
    svc = _service(0)
    long_rows = {5, 6, 7, 8}  # 1000-byte texts: 33 hits with all four overflow the 4096-byte blob
    texts = [("x" * 1000 if r in long_rows else f"t{r}") for r in range(ROWS)]
    data = np.random.default_rng().standard_normal((ROWS, DIM)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(ROWS)], "texts": texts,
                "metadatas": [{} for _ in range(ROWS)]}, data)  # fmt: skip
    c, p = _rigs(svc, monkeypatch, blob_size=4096)
    qs = np.tile(-(data[5] + data[6] + data[7] + data[8]), (N_SLOTS, 1))  # the long documents last,
    qs[1] *= -1  # but first for slot 1
    qs += 0.1 * np.random.default_rng().standard_normal(qs.shape).astype(np.float32)
    out = _run(c, qs, 0, 33, 1)
    _assert_same(out, _run(p, qs, 0, 33, 1))
    assert set(out["pending"]) == {1}
    assert _responses(out, c.lay)[1][1].resp_flags & RespFlag.MORE
    assert c.d.hot.calls["answered"] == N_SLOTS - 1  # type: ignore[union-attr]


@pytest.mark.parametrize("flags", [ARENA, ENTRIES], ids=["generations", "entries"])
@pytest.mark.parametrize("k", [1, 10])
def test_rows_the_arena_does_not_cover_yet_are_answered_inline_as_by_python(
    flags: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members whose rows are all below the arena's rows_cap get arena references, the others
    their documents inline (rows the arena does not cover yet), each as the Python path decides."""
    svc = _service(ROWS)
    monkeypatch.setattr(svc.rows.arena, "rows_cap", 16)
    c, p = _rigs(svc, monkeypatch)
    qs = svc.vectors(np.array([3, 100, 7, 120, 0, 60], np.int64))  # cosine: each row its own top-1
    out = _run(c, qs, flags, k, 9)
    _assert_same(out, _run(p, qs, flags, k, 9))
    arena_answers = [bool(r.resp_flags & RespFlag.ARENA_DOCS) for _, r, _ in _responses(out, c.lay)]
    assert arena_answers == ([True, False, True, False, True, False] if k == 1 else [False] * N_SLOTS)


def test_the_comparison_catches_a_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: one byte changed anywhere in a slot, one post or one stat more, and
    an answer1 that writes a wrong answer (another seq) all fail the comparison above."""
    svc = _service(ROWS)
    c, p = _rigs(svc, monkeypatch)
    qs = _queries(np.random.default_rng())
    out, want = _run(c, qs, ENTRIES, 10, 3), _run(p, qs, ENTRIES, 10, 3)
    _assert_same(out, want)
    lay = c.lay
    for at in (0, 8, CTL_SIZE - 1, lay.rows_offset + 4, lay.scores_offset + 39, lay.blob_offset + 20):
        for slot in (0, N_SLOTS - 1):
            changed = bytearray(out["slots"][slot])
            changed[at] ^= 1
            with pytest.raises(AssertionError, match=f"slot {slot} differs first at byte {at}"):
                _assert_same({**out, "slots": [*out["slots"][:slot], bytes(changed), *out["slots"][slot + 1 :]]}, want)
    with pytest.raises(AssertionError):
        _assert_same({**out, "posts": [2, *out["posts"][1:]]}, want)
    with pytest.raises(AssertionError):
        _assert_same({**out, "phases": {**out["phases"], "answer": out["phases"]["answer"] + 1}}, want)

    class _WrongSeq(_Hot):
        def answer1(self, slot: memoryview, layout: tuple[int, ...], seq: int, *rest: Any) -> bool:
            return super().answer1(slot, layout, seq + (seq == 5), *rest)  # slot 2's answer only

    c.d.hot = _WrongSeq()  # type: ignore[assignment]
    out, want = _run(c, qs, ENTRIES, 10, 3), _run(p, qs, ENTRIES, 10, 3)
    with pytest.raises(AssertionError, match=f"slot 2 differs first at byte {RESPONSE_OFFSET}"):  # its seq
        _assert_same(out, want)


@pytest.mark.parametrize("flags", [ARENA, ENTRIES], ids=["generations", "entries"])
def test_what_answer1_leaves_gets_the_whole_batchs_python_answer_beside_rows_the_arena_does_not_cover(
    flags: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether _answer_gens applies is the whole batch's, members answered in C included: one
    member's row past the arena's rows_cap sends every member of the Python path to
    _write_hits, which checks the row table's documents, not the arena's entries. A member
    answer1 declines (its row's arena entry is empty while the row table holds its document:
    the two part ways) then gets that answer here too, not _answer_gens' refusal of the entry
    because the member past rows_cap was answered in C (before the fix: INTERNAL "rows that
    hold no memory" in C's batch, OK in Python's)."""
    svc = _service(ROWS)
    monkeypatch.setattr(svc.rows.arena, "rows_cap", 16)
    svc.rows.arena.clear(7)  # type: ignore[union-attr]
    c, p = _rigs(svc, monkeypatch)
    qs = svc.vectors(np.array([100, 3, 7, 5, 0, 9], np.int64))  # cosine: each row its own top-1
    out = _run(c, qs, flags, 1, 9)
    _assert_same(out, _run(p, qs, flags, 1, 9))
    assert [r.status for _, r, _ in _responses(out, c.lay)] == [Status.OK] * N_SLOTS
    assert c.d.hot.calls["answered"] == N_SLOTS - 1  # type: ignore[union-attr]

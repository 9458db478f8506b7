"""The sidecar's batch-1 recall in C (``kalos_retrievers.sidecar._hotpath``) and the dispatcher's
short path around it (``Dispatcher._lone``), in process: an anonymous map stands in for the
segment and a bytearray arena for the sidecar's.

What the C code takes (a valid batch-1 recall in the default namespace) and what it leaves,
untouched, to the Python path (everything else); what it answers (arena documents) and what it
only writes the results of; and, through the dispatcher, that the short path's answers are the
Python path's, byte for byte, and that its errors are the Python path's errors."""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest
from kalos_testing import PostCounter as _Sem

from kalos_retrievers.arena import ArenaWriter
from kalos_retrievers.protocol import (
    CTL_OFFSETS,
    CTL_SIZE,
    KNOWN_FLAGS,
    METRICS,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    RESPONSE_OFFSET,
    RESPONSE_STRUCT,
    Flag,
    Invalid,
    Layout,
    Op,
    Request,
    RespFlag,
    SlotState,
    Status,
    align8,
    decode_recall_args,
    encode_docs_blob,
    encode_recall_args,
    validate_request,
)

hp = pytest.importorskip("kalos_retrievers.sidecar._hotpath", reason="the C extension is not built here")

from kalos_retrievers.sidecar import dispatcher as dispatcher_module  # noqa: E402
from kalos_retrievers.sidecar.dispatcher import Dispatcher  # noqa: E402
from kalos_retrievers.sidecar.index import CpuIndex  # noqa: E402
from kalos_retrievers.sidecar.service import Service  # noqa: E402
from kalos_retrievers.sidecar.stats import Stats  # noqa: E402
from kalos_retrievers.sidecar.store import NullStore  # noqa: E402

DIM, ROWS = 97, 53
ARENA = Flag.ARENA_DOCS
ENTRIES = Flag.ARENA_DOCS | Flag.ARENA_ENTRIES


def test_the_c_constants_are_the_protocols() -> None:
    assert dict(hp.CTL_OFFSETS.items()) == {k: CTL_OFFSETS[k] for k in hp.CTL_OFFSETS}
    c = hp.CONSTANTS
    assert (c["BUSY"], c["RESPONSE"], c["RECALL"]) == (SlotState.BUSY, SlotState.RESPONSE, Op.RECALL)
    assert c["CTL_SIZE"] == CTL_SIZE
    assert (c["WITH_VECTORS"], c["NO_DOCS"], c["ARENA_DOCS"], c["ARENA_ENTRIES"]) == (
        Flag.WITH_VECTORS, Flag.NO_DOCS, Flag.ARENA_DOCS, Flag.ARENA_ENTRIES)  # fmt: skip
    assert c["KNOWN_FLAGS"] == KNOWN_FLAGS
    assert (c["RESP_ARENA_DOCS"], c["RESP_ARENA_ENTRIES"]) == (RespFlag.ARENA_DOCS, RespFlag.ARENA_ENTRIES)
    assert CTL_OFFSETS["seq"] == REQUEST_OFFSET and CTL_OFFSETS["resp_seq"] == RESPONSE_OFFSET


# ------------------------------------------------------------------ the C functions alone
class Slot:
    """One slot of an anonymous map, and the layout tuple the dispatcher gives the C code."""

    def __init__(self, dim: int = DIM) -> None:
        self.lay = Layout(n_slots=1, dim=dim, max_k=64, payload_size=1 << 12, blob_size=1 << 12)
        self.mm = mmap.mmap(-1, self.lay.segment_size)
        off = self.lay.slot_offset(0)
        self.off = off
        self.view = memoryview(self.mm)[off : off + self.lay.slot_size]
        lay = self.lay
        self.layout = (lay.dim, lay.payload_offset, lay.rows_offset, lay.scores_offset, lay.blob_offset,
                       lay.blob_size, lay.max_k, lay.max_results)  # fmt: skip
        self.q = np.frombuffer(self.mm, np.float32, dim, off + lay.payload_offset)

    def request(self, req: Request, state: int = SlotState.REQUEST) -> None:
        REQUEST_STRUCT.pack_into(self.mm, self.off + REQUEST_OFFSET, *req)
        self.view.cast("I")[0] = state

    @property
    def state(self) -> int:
        return self.view.cast("I")[0]

    def response(self) -> tuple[int, ...]:
        return RESPONSE_STRUCT.unpack_from(self.mm, self.off + RESPONSE_OFFSET)

    def blob(self, n: int) -> bytes:
        b = self.off + self.lay.blob_offset
        return bytes(self.mm[b : b + n])


def _recall(dim: int = DIM, **kw: int) -> Request:
    words = {"seq": 77, "op": Op.RECALL, "flags": ENTRIES, "top_k": 10, "n_items": 1, "vec_len": 4 * dim,
             "args_len": 0, "deadline_ns": 0}  # fmt: skip
    words.update(kw)
    return Request(**words)


@pytest.mark.parametrize("state", [SlotState.REQUEST, SlotState.DOORBELL])
@pytest.mark.parametrize("flags", [0, Flag.NO_DOCS, Flag.WITH_VECTORS, ARENA, ENTRIES])
def test_take_returns_a_valid_recalls_words_and_marks_it_busy(state: int, flags: int) -> None:
    s = Slot()
    s.q[:] = np.random.default_rng().standard_normal(DIM)
    req = _recall(flags=flags, seq=2**63 + 5, top_k=64, deadline_ns=time.monotonic_ns() + 10**9)
    s.request(req, state)
    words = hp.take(s.view, s.layout)
    assert words == tuple(req) and s.state == SlotState.BUSY
    validate_request(Request(*words), s.lay)  # what it took, Python takes too


_DECLINED = {
    "another op": {"op": Op.UPSERT},
    "an unknown op": {"op": 99},
    "two queries": {"n_items": 2, "vec_len": 8 * DIM},
    "no queries": {"n_items": 0, "vec_len": 0},
    "args (a namespace or a filter)": {"args_len": 8},
    "short query bytes": {"vec_len": 4 * DIM - 4},
    "odd query bytes": {"vec_len": 4 * DIM + 2},
    "k 0": {"top_k": 0},
    "k above max_k": {"top_k": 65},
    "unknown flags": {"flags": 16 | ARENA},
    "ARENA_ENTRIES without ARENA_DOCS": {"flags": Flag.ARENA_ENTRIES},
    "an expired deadline": {"deadline_ns": 1},
}


@pytest.mark.parametrize("why", list(_DECLINED))
def test_take_leaves_every_other_request_untouched(why: str) -> None:
    s = Slot()
    s.q[:] = 1.0
    s.request(_recall(**_DECLINED[why]))
    before = bytes(s.view)
    assert hp.take(s.view, s.layout) is None
    assert bytes(s.view) == before  # nothing written, the state word included
    s.request(_recall())  # the negative control: the same slot, a valid recall, is taken
    assert hp.take(s.view, s.layout) is not None


def test_take_with_args_returns_the_args_copied_once_and_still_checks_their_bound() -> None:
    """A namespace's or a filter's recall (the lone path asks for it) comes with its args'
    bytes, as decode_recall_args reads them; args that would run past the payload are left to
    Python (which refuses them TOO_LARGE), as is any args recall without ``with_args``."""
    s = Slot()
    s.q[:] = 0.25
    args = encode_recall_args("memory/agent-7", b'{"user":1}')
    at = s.off + s.lay.payload_offset + align8(4 * DIM)
    s.mm[at : at + len(args)] = args
    req = _recall(args_len=len(args))
    s.request(req)
    before = bytes(s.view)
    assert hp.take(s.view, s.layout) is None and bytes(s.view) == before  # (not asked for args)
    words = hp.take(s.view, s.layout, True)
    assert words is not None and words[:8] == tuple(req) and s.state == SlotState.BUSY
    assert words[8] == args and decode_recall_args(words[8]) == ("memory/agent-7", {"user": 1})
    s.mm[at : at + len(args)] = bytes(len(args))  # a copy: the slot rewritten does not change it
    assert words[8] == args
    s.request(_recall())  # no args: b""
    assert hp.take(s.view, s.layout, True)[8:] == (b"",)
    room = s.lay.payload_size - align8(4 * DIM)
    for too_long in (room + 1, 2**63):
        s.request(_recall(args_len=too_long))
        before = bytes(s.view)
        assert hp.take(s.view, s.layout, True) is None and bytes(s.view) == before
        with pytest.raises(Invalid):
            validate_request(_recall(args_len=too_long), s.lay)  # (Python says why)
    s.request(_recall(args_len=room))  # the negative control: args filling the payload exactly
    words = hp.take(s.view, s.layout, True)
    assert words is not None and len(words[8]) == room
    with pytest.raises(TypeError, match="2 or 3 arguments"):
        hp.take(s.view, s.layout, True, True)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [0, 50, DIM - 1])
def test_take_leaves_a_query_that_is_not_finite(bad: float, at: int) -> None:
    s = Slot()
    s.q[:] = 0.5
    s.q[at] = bad
    s.request(_recall())
    assert hp.take(s.view, s.layout) is None and s.state == SlotState.REQUEST
    s.q[at] = 3.0e38  # finite, however large
    assert hp.take(s.view, s.layout) is not None


def test_a_layout_that_does_not_fit_the_slot_is_an_error_not_a_read_outside_it() -> None:
    s = Slot()
    s.request(_recall())
    bad = list(s.layout)
    bad[1] = len(s.view) - 4 * DIM + 4  # the query would run past the slot
    with pytest.raises(ValueError, match="does not fit"):
        hp.take(s.view, tuple(bad))
    with pytest.raises(TypeError, match="8 ints"):
        hp.take(s.view, s.layout[:7])
    with pytest.raises(ValueError, match="does not fit"):
        hp.take(s.view[: CTL_SIZE + 8], s.layout)
    with pytest.raises(BufferError):
        hp.take(bytes(s.view), s.layout)  # read-only: nothing could be marked BUSY


def _arena(rows: int, cap: int = 64, empty: tuple[int, ...] = ()) -> ArenaWriter:
    segs: dict[int, bytearray] = {}

    def open_segment(version: int, size: int) -> bytearray:
        segs[version] = bytearray(size)
        return segs[version]

    w = ArenaWriter(open_segment, segs.pop, cap, 1 << 14)
    for r in range(rows):
        if r not in empty:
            w.put(r, _doc(r))
    return w


def _doc(r: int) -> bytes:
    return f"document {r}".encode() * (1 + r % 3)  # lengths vary


def _docs(rows: int, empty: tuple[int, ...] = ()) -> list[bytes | None]:
    """The sidecar's per-row documents (RowTable.docs): None where a row holds none."""
    return [None if r in empty else _doc(r) for r in range(rows)]


def _arena_arg(w: ArenaWriter | None) -> tuple[memoryview, int, int] | None:
    return None if w is None else (w.table_bytes, w.rows_cap, w.version)


def _results(rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([rows], np.int32), (np.arange(len(rows), dtype=np.float32)[None, :] - 0.5)


def _assert_results(s: Slot, rows: np.ndarray, scores: np.ndarray) -> None:
    kk = rows.shape[1]
    assert np.frombuffer(s.mm, np.int32, kk, s.off + s.lay.rows_offset).tolist() == rows[0].tolist()
    assert np.frombuffer(s.mm, np.float32, kk, s.off + s.lay.scores_offset).tolist() == scores[0].tolist()


@pytest.mark.parametrize("flags", [ARENA, ENTRIES])
@pytest.mark.parametrize("kk", [0, 1, 7, 64])
def test_answer1_writes_the_results_and_the_arena_answer_refs_would_give(flags: int, kk: int) -> None:
    s = Slot()
    w = _arena(ROWS + 11)
    rows, scores = _results(np.random.default_rng().choice(ROWS, kk, replace=kk > ROWS).tolist())
    s.request(_recall(flags=flags), SlotState.BUSY)
    assert hp.answer1(s.view, s.layout, 9, flags, rows, scores, ROWS, _docs(ROWS), _arena_arg(w))
    want = w.refs(rows[0].tolist(), bool(flags & Flag.ARENA_ENTRIES))
    rflags = RespFlag.ARENA_DOCS | (RespFlag.ARENA_ENTRIES if flags & Flag.ARENA_ENTRIES else 0)
    assert s.response() == (9, Status.OK, kk, len(want), rflags)
    assert s.blob(len(want)) == want and s.state == SlotState.RESPONSE
    _assert_results(s, rows, scores)


@pytest.mark.parametrize("flags", [0, ARENA, ENTRIES])  # ARENA*: no arena, or a row beyond it
@pytest.mark.parametrize("kk", [0, 1, 5, 64])
def test_answer1_writes_the_documents_inline_as_encode_docs_blob(flags: int, kk: int) -> None:
    rows_list = np.random.default_rng().choice(ROWS, kk, replace=kk > ROWS).tolist()
    if kk:
        rows_list[-1] = 40  # past the second arena's table (16 rows)
    for arena in (None, _arena(16, cap=16)):
        if arena is not None and (not flags or not kk):
            continue
        s = Slot()
        rows, scores = _results(rows_list)
        s.request(_recall(flags=flags), SlotState.BUSY)
        assert hp.answer1(s.view, s.layout, 3, flags, rows, scores, ROWS, _docs(ROWS), _arena_arg(arena))
        want = encode_docs_blob([_doc(r) for r in rows_list])
        assert s.response() == (3, Status.OK, kk, len(want), 0)
        assert s.blob(len(want)) == want and s.state == SlotState.RESPONSE
        _assert_results(s, rows, scores)


def test_answer1_writes_rows_and_scores_only_for_no_docs() -> None:
    s = Slot()
    rows, scores = _results([4, 0, 9])
    s.request(_recall(flags=Flag.NO_DOCS), SlotState.BUSY)
    assert hp.answer1(s.view, s.layout, 5, Flag.NO_DOCS, rows, scores, ROWS, [], None)
    assert s.response() == (5, Status.OK, 3, 0, 0) and s.state == SlotState.RESPONSE
    _assert_results(s, rows, scores)


def _answer1_declines(s: Slot, rows_list: list[int], *, flags: int = ENTRIES, high: int = ROWS,
                      arena: ArenaWriter | None = None, docs: list[bytes | None] | None = None) -> None:  # fmt: skip
    """answer1 writes the rows and scores, and nothing else: no response, the state unchanged.
    Then the negative control: the same call, all rows in range and holding documents, answers."""
    rows, scores = _results(rows_list)
    s.request(_recall(flags=flags), SlotState.BUSY)
    resp = s.response()
    d = _docs(ROWS) if docs is None else docs
    assert hp.answer1(s.view, s.layout, 9, flags, rows, scores, high, d, _arena_arg(arena)) is False
    assert s.state == SlotState.BUSY and s.response() == resp
    _assert_results(s, rows, scores)
    # the negative control: rows in range that hold documents, no vectors asked for, a blob
    # of the slot's usual size: the same call answers
    ok = Slot()
    r, sc = _results([1, 2])
    ok.request(_recall(flags=flags & ~Flag.WITH_VECTORS), SlotState.BUSY)
    assert hp.answer1(ok.view, ok.layout, 9, flags & ~Flag.WITH_VECTORS, r, sc, ROWS, _docs(ROWS),
                      _arena_arg(_arena(ROWS))) is True  # fmt: skip
    assert ok.state == SlotState.RESPONSE


@pytest.mark.parametrize("flags", [0, ARENA, ENTRIES])
@pytest.mark.parametrize(
    ("rows", "high"),
    [([3, -1], ROWS), ([3, ROWS], ROWS), ([3, 40], 40), ([2**31 - 1], ROWS)],
    ids=["negative", "at high", "above a lower high", "huge"],
)
def test_answer1_leaves_rows_out_of_range(flags: int, rows: list[int], high: int) -> None:
    _answer1_declines(Slot(), rows, flags=flags, high=high, arena=_arena(ROWS) if flags else None)
    s = Slot()  # the negative control: rows in range are answered
    r, sc = _results([3, 5])
    s.request(_recall(flags=flags), SlotState.BUSY)
    assert hp.answer1(s.view, s.layout, 9, flags, r, sc, ROWS, _docs(ROWS), _arena_arg(_arena(ROWS)))


def test_answer1_leaves_rows_that_hold_no_document() -> None:
    _answer1_declines(Slot(), [1, 5], arena=_arena(ROWS, empty=(5,)))  # the arena's entry is empty
    _answer1_declines(Slot(), [1, 5], flags=0, docs=_docs(ROWS, empty=(5,)))  # inline: docs[5] is None
    _answer1_declines(Slot(), [1, 50], flags=0, docs=_docs(ROWS)[:50])  # a docs list too short


@pytest.mark.parametrize("flags", [Flag.WITH_VECTORS, Flag.WITH_VECTORS | ARENA, Flag.WITH_VECTORS | Flag.NO_DOCS])
def test_answer1_leaves_answers_with_vectors(flags: int) -> None:
    _answer1_declines(Slot(), [1, 2, 3], flags=flags, arena=_arena(ROWS))


@pytest.mark.parametrize("flags", [0, ENTRIES])
def test_answer1_leaves_an_answer_that_would_not_fit_the_blob(flags: int) -> None:
    docs = [b"x" * 100] * ROWS
    w = _arena(ROWS)
    exact = 4 * (3 + 2) + 300 if not flags else 8 + 16 * 3
    for size, fits in ((exact - 1, False), (exact, True)):
        s = Slot()
        s.layout = (*s.layout[:5], size, *s.layout[6:])
        r, sc = _results([1, 2, 3])
        s.request(_recall(flags=flags), SlotState.BUSY)
        assert hp.answer1(s.view, s.layout, 9, flags, r, sc, ROWS, docs, _arena_arg(w)) is fits
        assert s.state == (SlotState.RESPONSE if fits else SlotState.BUSY)


def test_answer1_refuses_arguments_it_cannot_use() -> None:
    s = Slot()
    w = _arena_arg(_arena(ROWS))
    assert w is not None
    docs = _docs(ROWS)
    ok_rows, ok_scores = _results([1, 2])
    with pytest.raises(TypeError, match="int32"):
        hp.answer1(s.view, s.layout, 1, ENTRIES, ok_rows.astype(np.int64), ok_scores, ROWS, docs, w)
    with pytest.raises(TypeError, match="float32"):
        hp.answer1(s.view, s.layout, 1, ENTRIES, ok_rows, ok_scores.astype(np.float64), ROWS, docs, w)
    with pytest.raises(ValueError, match="differ"):
        hp.answer1(s.view, s.layout, 1, ENTRIES, ok_rows, np.zeros((1, 3), np.float32), ROWS, docs, w)
    with pytest.raises(ValueError, match="rows_cap"):
        hp.answer1(s.view, s.layout, 1, ENTRIES, ok_rows, ok_scores, ROWS, docs, (w[0], 10**6, 1))
    with pytest.raises(TypeError, match="arena"):
        hp.answer1(s.view, s.layout, 1, ENTRIES, ok_rows, ok_scores, ROWS, docs, w[:2])
    with pytest.raises(TypeError, match="list"):
        hp.answer1(s.view, s.layout, 1, 0, ok_rows, ok_scores, ROWS, tuple(docs), None)
    with pytest.raises(TypeError, match="9 arguments"):
        hp.answer1(s.view, s.layout, 1, 0, ok_rows, ok_scores, ROWS, docs)
    assert s.state == 0 and s.response() == (0, 0, 0, 0, 0)  # nothing answered


# ------------------------------------------------------------------ through the dispatcher
class _Counting:
    """The C module, counting the calls of each function (which path answered)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        f = getattr(hp, name)

        def counted(*args):  # type: ignore[no-untyped-def]
            out = f(*args)
            self.calls[name] = self.calls.get(name, 0) + 1
            if out is True:
                self.calls["answered"] = self.calls.get("answered", 0) + 1
            return out

        return counted


def _service(rows: int, *, dim: int = DIM, arena: bool = True, metric: str = "cosine") -> Service:
    svc = Service(CpuIndex(dim, METRICS[metric]), NullStore(), dim=dim, metric=METRICS[metric])
    if arena:
        bufs: dict[int, bytearray] = {}
        svc.rows.arena = ArenaWriter(lambda v, size: bufs.setdefault(v, bytearray(size)), bufs.pop)
    if rows:
        data = np.random.default_rng(7).standard_normal((rows, dim)).astype(np.float32)
        svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [f"text {i}" for i in range(rows)],
                    "metadatas": [{"i": i} for i in range(rows)]}, data)  # fmt: skip
    return svc


def _answer(d: Dispatcher, mm: mmap.mmap, lay: Layout, q: np.ndarray, req: Request) -> tuple[bytes, int]:
    """Slot 0's whole bytes after the dispatcher answered ``req`` with query ``q``, and its posts."""
    off = lay.slot_offset(0)
    mm[off : off + lay.slot_size] = bytes(lay.slot_size)  # every run starts from the same bytes
    np.frombuffer(mm, np.float32, lay.dim, off + lay.payload_offset)[:] = q
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, *req)
    np.ndarray((1,), np.uint32, mm, off)[0] = SlotState.REQUEST
    posts = d.sems[0].posts
    assert d.poll() == 1
    d.settle()
    return bytes(mm[off : off + lay.slot_size]), d.sems[0].posts - posts


def _two_dispatchers(svc: Service, monkeypatch: pytest.MonkeyPatch, dim: int = DIM):  # type: ignore[no-untyped-def]
    """(the C path's dispatcher, the Python path's), each over its own map, one service."""
    out = []
    for hot in (hp, None):
        monkeypatch.setattr(dispatcher_module, "_hotpath", hot)
        lay = Layout(n_slots=3, dim=dim, max_k=64, payload_size=1 << 14, blob_size=1 << 14)
        mm = mmap.mmap(-1, lay.segment_size)
        d = Dispatcher(mm, lay, [_Sem() for _ in range(3)], svc, Stats(), max_batch=64, describe=lambda: {})
        assert d._lone_path is (hot is not None)
        if hot is not None:
            d.hot = _Counting()  # type: ignore[assignment]
        out.append((d, mm, lay))
    return out


@pytest.mark.parametrize("metric", ["cosine", "l2", "ip"])
@pytest.mark.parametrize("flags", [0, Flag.NO_DOCS, Flag.WITH_VECTORS, ARENA, ENTRIES])
@pytest.mark.parametrize("k", [1, 10, 64])
def test_the_short_paths_answers_are_the_python_paths_byte_for_byte(
    metric: str, flags: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = _service(ROWS, metric=metric)  # k 64 > 53 rows: 53 results
    (dc, mc, lay), (dp, mp, _) = _two_dispatchers(svc, monkeypatch)
    rng = np.random.default_rng()
    for seq in range(5):
        q = rng.standard_normal(DIM).astype(np.float32)
        req = _recall(flags=flags, top_k=k, seq=1000 + seq)
        c, cposts = _answer(dc, mc, lay, q, req)
        p, pposts = _answer(dp, mp, lay, q, req)
        assert c == p and cposts == pposts == 1
        resp = RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)
        assert resp[:3] == (1000 + seq, Status.OK, min(k, ROWS))
    # the C side took the short path, and answered in C all but the answers with vectors
    calls = dc.hot.calls  # type: ignore[attr-defined]
    assert calls["take"] == calls["answer1"] == 5
    assert calls.get("answered", 0) == (0 if flags & Flag.WITH_VECTORS else 5)
    # the stats say the same of both paths: five recalls answered OK, each with its phases
    for d in (dc, dp):
        assert d.stats.requests[("recall", "ok")] == 5 and d.stats.latency["recall"].count == 5
        assert all(d.stats.phases[p].count == 5 for p in ("pickup", "search", "answer"))


def test_the_short_path_answers_an_empty_index_as_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(0)
    (dc, mc, lay), (dp, mp, _) = _two_dispatchers(svc, monkeypatch)
    q = np.ones(DIM, np.float32)
    for flags in (0, ENTRIES):
        c, _ = _answer(dc, mc, lay, q, _recall(flags=flags))
        p, _ = _answer(dp, mp, lay, q, _recall(flags=flags))
        assert c == p and RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)[1:3] == (Status.OK, 0)


@pytest.mark.parametrize(
    ("why", "req_kw", "q_bad", "status", "message"),
    [
        ("NaN", {}, np.nan, Status.BAD_REQUEST, b"NaN"),
        ("deadline", {"deadline_ns": 1}, None, Status.DEADLINE, b"deadline"),
        ("k", {"top_k": 65}, None, Status.BAD_REQUEST, b"k=65"),
        ("dim", {"vec_len": 4 * DIM - 4}, None, Status.DIMENSION, b"query bytes"),
    ],
)
def test_what_the_short_path_leaves_gets_the_python_paths_error(
    why: str, req_kw: dict[str, int], q_bad: float | None, status: int, message: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = _service(ROWS)
    (dc, mc, lay), (dp, mp, _) = _two_dispatchers(svc, monkeypatch)
    q = np.ones(DIM, np.float32)
    if q_bad is not None:
        q[DIM // 2] = q_bad
    req = _recall(**req_kw)
    c, cposts = _answer(dc, mc, lay, q, req)
    p, _ = _answer(dp, mp, lay, q, req)
    assert c == p and cposts == 1
    resp = RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)
    assert c[:4] == np.uint32(SlotState.ERROR).tobytes() and resp[1] == status
    assert message in c[lay.blob_offset : lay.blob_offset + resp[3]]


def test_rows_the_short_path_declines_are_refused_by_the_python_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """An index returning a row out of range (a bug): answer1 writes the results and declines,
    and the Python path refuses them with INTERNAL, as it would have alone."""
    svc = _service(ROWS)
    (dc, mc, lay), _ = _two_dispatchers(svc, monkeypatch)
    search = svc.index.search

    def bad_search(*a, **kw):  # type: ignore[no-untyped-def]
        rows, scores = search(*a, **kw)
        rows[0, -1] = ROWS + 3
        return rows, scores

    monkeypatch.setattr(svc.index, "search", bad_search)
    c, posts = _answer(dc, mc, lay, np.ones(DIM, np.float32), _recall())
    resp = RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)
    assert posts == 1 and resp[1] == Status.INTERNAL
    assert b"out of range" in c[lay.blob_offset : lay.blob_offset + resp[3]]
    monkeypatch.setattr(svc.index, "search", search)  # the negative control: answered
    c, _ = _answer(dc, mc, lay, np.ones(DIM, np.float32), _recall())
    assert RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)[1] == Status.OK


def _scoped_service() -> Service:
    """_service's rows, and as many in namespace "mem/ü" (ids n0.., metadata {"i": i})."""
    svc = _service(ROWS)
    vecs = np.random.default_rng(8).standard_normal((ROWS, DIM)).astype(np.float32)
    svc.upsert({"namespace": "mem/ü", "ids": [f"n{i}" for i in range(ROWS)],
                "texts": [f"scoped {i}" for i in range(ROWS)], "metadatas": [{"i": i} for i in range(ROWS)]},
               vecs)  # fmt: skip
    return svc


def _ask(d: Dispatcher, mm: mmap.mmap, lay: Layout, req: Request, args: bytes) -> tuple[bytes, int]:
    """Slot 0's bytes and posts after ``d`` answered ``req`` (query all ones) with ``args``
    written after the query (unlike _answer, the slot is not cleared first)."""
    off = lay.slot_offset(0)
    start = off + lay.payload_offset + align8(4 * lay.dim)
    mm[start : start + len(args)] = args
    np.frombuffer(mm, np.float32, lay.dim, off + lay.payload_offset)[:] = 1.0
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, *req)
    np.ndarray((1,), np.uint32, mm, off)[0] = SlotState.REQUEST
    assert d.poll() == 1
    d.settle()
    return bytes(mm[off : off + lay.slot_size]), d.sems[0].posts


_SCOPES = {
    "a namespace": ("mem/ü", None),
    "a filter": ("", b'{"i": {"$lt": 20}}'),
    "a namespace and a filter": ("mem/ü", b'{"i": {"$gte": 40}}'),
    "a namespace with no rows": ("nobody", None),
    "a filter no row matches": ("", b'{"i": -1}'),
    "a filter the sidecar refuses": ("", b'{"i": {"$near": 3}}'),
    "args that do not decode": None,
}


@pytest.mark.parametrize("why", list(_SCOPES))
@pytest.mark.parametrize("flags", [0, ENTRIES])
def test_a_lone_recall_in_a_namespace_or_with_a_filter_takes_the_short_path(
    why: str, flags: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """take hands the args over, the search keeps to their namespace and filter, and the
    answer (or the error: a filter the sidecar refuses, args that do not decode) is the Python
    path's, byte for byte."""
    svc = _scoped_service()
    (dc, mc, lay), (dp, mp, _) = _two_dispatchers(svc, monkeypatch)
    scope = _SCOPES[why]
    args = b"\x05\x00ab" if scope is None else encode_recall_args(*scope)
    req = _recall(args_len=len(args), flags=flags)
    out = [_ask(d, mm, lay, req, args) for d, mm in ((dc, mc), (dp, mp))]
    assert out[0] == out[1] and out[0][1] == 1
    c = out[0][0]
    resp = RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)
    calls = dc.hot.calls  # type: ignore[attr-defined]
    assert calls["take"] == 1  # taken with its args: the short path
    n = {"a namespace": 10, "a filter": 10, "a namespace and a filter": 10}.get(why, 0)
    if why in ("a filter the sidecar refuses", "args that do not decode"):
        assert c[:4] == np.uint32(SlotState.ERROR).tobytes() and resp[1] == Status.BAD_REQUEST
        assert "answer1" not in calls
        return
    assert resp[1:3] == (Status.OK, n), c[lay.blob_offset : lay.blob_offset + resp[3]]
    assert calls.get("answered", 0) == (1 if n else 0)
    ids = [svc.rows.ids[r] for r in np.frombuffer(c, np.int32, n, lay.rows_offset)]
    assert all(x[0] == ("n" if "namespace" in why else "r") for x in ids), ids  # in its namespace
    if "filter" in why:  # the filter held: not an unfiltered search
        assert all((int(x[1:]) < 20) if scope[0] == "" else (int(x[1:]) >= 40) for x in ids), ids


def test_a_filter_kept_by_the_service_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lone path asks the service for a filter's kept answer by the args' bytes first: the
    same filter again decodes nothing; a write to its namespace, and it is evaluated anew (the
    new row found)."""
    svc = _scoped_service()
    (dc, mc, lay), _ = _two_dispatchers(svc, monkeypatch)
    decoded: list[bytes] = []
    real = dispatcher_module.decode_recall_args
    monkeypatch.setattr(dispatcher_module, "decode_recall_args", lambda a: decoded.append(a) or real(a))
    args = encode_recall_args("mem/ü", b'{"i": {"$gte": 40}}')
    req = _recall(args_len=len(args), flags=0, top_k=20)
    first = _ask(dc, mc, lay, req, args)[0]
    again = _ask(dc, mc, lay, req, args)[0]
    assert len(decoded) == 1 and first == again
    assert RESPONSE_STRUCT.unpack_from(again, RESPONSE_OFFSET)[1:3] == (Status.OK, 13)
    svc.upsert({"namespace": "mem/ü", "ids": ["late"], "texts": ["late"], "metadatas": [{"i": 99}]},
               np.ones((1, DIM), np.float32))  # fmt: skip
    c = _ask(dc, mc, lay, req, args)[0]
    assert len(decoded) == 2 and RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)[1:3] == (Status.OK, 14)
    assert "late" in [svc.rows.ids[r] for r in np.frombuffer(c, np.int32, 14, lay.rows_offset)]


@pytest.mark.parametrize("why", [w for w in _SCOPES if _SCOPES[w] is not None])
@pytest.mark.parametrize("flags", [0, ENTRIES, Flag.NO_DOCS, Flag.WITH_VECTORS])
def test_a_scoped_recall_off_the_lone_path_is_answered_in_c_as_python_answers_it(
    why: str, flags: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off the lone path (a GPU index's, or a CPU sidecar's crowd) a scoped recall is taken
    and checked by take (its args handed over) and answered through Dispatcher._one: by
    answer1 where it can be (documents inline or from the arena); the slot's bytes, posts and
    stats are the Python path's."""
    svc = _scoped_service()
    (dc, mc, lay), (dp, mp, _) = _two_dispatchers(svc, monkeypatch)
    dc._lone_path = False  # (as for a GPU index)

    def checked_in_python(req: Request) -> None:
        raise AssertionError(f"_hotpath.take checks a scoped recall; Python checked {req}")

    monkeypatch.setattr(dc, "_check", checked_in_python)
    args = encode_recall_args(*_SCOPES[why])
    req = _recall(args_len=len(args), flags=flags)
    out = [_ask(d, mm, lay, req, args) for d, mm in ((dc, mc), (dp, mp))]
    assert out[0] == out[1] and out[0][1] == 1
    resp = RESPONSE_STRUCT.unpack_from(out[0][0], RESPONSE_OFFSET)
    n = resp[2] if resp[1] == Status.OK else 0
    calls = dc.hot.calls  # type: ignore[attr-defined]
    c_answers = n > 0 and not flags & Flag.WITH_VECTORS and resp[1] == Status.OK
    assert calls.get("answered", 0) == (1 if c_answers else 0), calls
    for d in (dc, dp):
        assert sum(v for (op, _), v in d.stats.requests.items() if op == "recall") == 1


def test_a_hotpath_built_before_take_had_args_leaves_scoped_recalls_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``_hotpath`` without ``TAKE_ARGS`` (its take has 2 arguments): the dispatcher asks it
    only the old way, so a scoped lone recall goes the usual way (Dispatcher._one, answered
    as that path answers it) and a default one still the short way."""

    class Old:
        def __init__(self) -> None:
            self.calls: dict[str, int] = {}

        def take(self, *a):  # type: ignore[no-untyped-def]
            if len(a) != 2:
                raise TypeError("take takes 2 arguments")
            self.calls["take"] = self.calls.get("take", 0) + 1
            return hp.take(*a)

        def answer1(self, *a):  # type: ignore[no-untyped-def]
            self.calls["answer1"] = self.calls.get("answer1", 0) + 1
            return hp.answer1(*a)

    svc = _service(ROWS)
    lay = Layout(n_slots=3, dim=DIM, max_k=64, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    d = Dispatcher(mm, lay, [_Sem() for _ in range(3)], svc, Stats(), max_batch=64, describe=lambda: {})
    d.hot = Old()  # (after the dispatcher was made: what it asks is decided by the module it has now)
    assert d._lone_path
    args = encode_recall_args("", b'{"i": {"$lt": 20}}')
    c, posts = _ask(d, mm, lay, _recall(args_len=len(args), flags=0), args)
    resp = RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)
    assert posts == 1 and resp[1:3] == (Status.OK, 10)
    assert (np.frombuffer(c, np.int32, 10, lay.rows_offset) < 20).all()  # the filter held
    assert d.hot.calls == {"take": 1, "answer1": 1}  # declined (args): taken by _one, answered in C
    c, posts = _answer(d, mm, lay, np.ones(DIM, np.float32), _recall(flags=0))
    assert posts == 1 and RESPONSE_STRUCT.unpack_from(c, RESPONSE_OFFSET)[1:3] == (Status.OK, 10)
    assert d.hot.calls == {"take": 2, "answer1": 2}  # the default recall: the short path


def test_an_answer_given_in_c_is_never_overwritten_by_a_later_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once answer1 has written RESPONSE the client may already have read it: a failure after
    that (here the semaphore's post) must not turn it into an INTERNAL error (and a second post)."""
    svc = _service(ROWS)
    (dc, mc, lay), _ = _two_dispatchers(svc, monkeypatch)

    class _Broken(_Sem):
        def release(self) -> None:
            super().release()
            raise RuntimeError("sem_post failed")

    dc.sems[0] = _Broken()
    with pytest.raises(RuntimeError, match="sem_post"):
        _answer(dc, mc, lay, np.ones(DIM, np.float32), _recall(flags=ENTRIES))
    off = lay.slot_offset(0)
    resp = RESPONSE_STRUCT.unpack_from(mc, off + RESPONSE_OFFSET)
    assert np.ndarray((1,), np.uint32, mc, off)[0] == SlotState.RESPONSE and resp[1] == Status.OK
    assert dc.sems[0].posts == 1


@pytest.mark.parametrize(
    ("why", "status"),
    [("NaN", Status.BAD_REQUEST), ("deadline", Status.DEADLINE), ("k", Status.BAD_REQUEST),
     ("dim", Status.DIMENSION), ("args past the payload", Status.TOO_LARGE), ("ping", Status.OK)],
)  # fmt: skip
def test_a_lone_request_take_declined_is_not_taken_again(
    why: str, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone request _hotpath.take declines (in _lone) goes the Python way at once: take is not
    asked of it again (a second read of the slot, ~1 µs, for the same None), and the answer is
    the Python path's, byte for byte."""

    svc = _service(ROWS)
    (dc, mc, lay), (dp, mp, _) = _two_dispatchers(svc, monkeypatch)
    q = np.ones(DIM, np.float32)
    kw: dict[str, int] = {}
    args = b""
    if why == "NaN":
        q[3] = np.nan
    elif why == "deadline":
        kw = {"deadline_ns": 1}
    elif why == "k":
        kw = {"top_k": 65}
    elif why == "dim":
        kw = {"vec_len": 4 * DIM - 4}
    elif why == "args past the payload":
        kw = {"args_len": lay.payload_size}
    else:  # another op
        kw = {"op": Op.PING, "vec_len": 0}
    off = lay.slot_offset(0)
    out = []
    for d, mm in ((dc, mc), (dp, mp)):
        mm[off : off + lay.slot_size] = bytes(lay.slot_size)
        start = off + lay.payload_offset + align8(4 * DIM)
        mm[start : start + len(args)] = args
        np.frombuffer(mm, np.float32, DIM, off + lay.payload_offset)[:] = q
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, *_recall(**{"args_len": len(args), **kw}))
        np.ndarray((1,), np.uint32, mm, off)[0] = SlotState.REQUEST
        assert d.poll() == 1
        d.settle()
        out.append((bytes(mm[off : off + lay.slot_size]), d.sems[0].posts))
    assert out[0] == out[1] and out[0][1] == 1
    calls = dc.hot.calls  # type: ignore[attr-defined]
    assert calls == {"take": 1}, calls  # declined once, and not asked again
    resp = RESPONSE_STRUCT.unpack_from(out[0][0], RESPONSE_OFFSET)
    assert resp[1] == status

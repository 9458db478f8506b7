"""Protocol v1: layout, header, request validation, args and document encodings. Pure: no shm."""

from __future__ import annotations

import itertools
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kalos_retrievers import protocol as P
from kalos_retrievers.protocol import (
    CTL_OFFSETS,
    HEADER_OFFSETS,
    Flag,
    HeaderError,
    Invalid,
    Layout,
    Op,
    Request,
    Status,
)

LAYOUTS = [
    Layout(n_slots=1, dim=3),
    Layout(n_slots=7, dim=97, max_k=100, max_results=333, payload_size=128 * 77, blob_size=4096),
    Layout(n_slots=33, dim=768, payload_size=1 << 20),
    Layout(n_slots=3, dim=1536, max_k=1024, max_results=8192, payload_size=128 * 3333, blob_size=128 * 41),
]


@pytest.mark.parametrize("lay", LAYOUTS)
def test_layout_areas_are_aligned_disjoint_and_inside_the_slot(lay: Layout) -> None:
    areas = [
        (0, P.CTL_SIZE),
        (lay.payload_offset, lay.rows_offset),
        (lay.rows_offset, lay.scores_offset),
        (lay.scores_offset, lay.blob_offset),
        (lay.blob_offset, lay.blob_offset + lay.blob_size),
    ]
    for (a0, a1), (b0, _) in itertools.pairwise(areas):
        assert a0 < a1 <= b0
    assert areas[-1][1] <= lay.slot_size
    assert lay.slot_size % 4096 == 0 and lay.payload_offset % 128 == 0
    assert lay.rows_offset - lay.payload_offset == lay.payload_size
    assert lay.scores_offset - lay.rows_offset >= 4 * lay.max_results
    assert lay.segment_size == P.HEADER_SIZE + lay.n_slots * lay.slot_size
    assert lay.max_queries >= 1 and lay.max_queries * 4 * lay.dim <= lay.payload_size


@pytest.mark.parametrize(
    "kw",
    [
        {"n_slots": 0, "dim": 8},
        {"n_slots": 5000, "dim": 8},
        {"n_slots": 2, "dim": 0},
        {"n_slots": 2, "dim": 8, "max_k": 0},
        {"n_slots": 2, "dim": 8, "max_k": 100, "max_results": 99},
        {"n_slots": 2, "dim": 8, "payload_size": 1000},
        {"n_slots": 2, "dim": 1024, "payload_size": 4096},
    ],
)
def test_layout_rejects_bad_geometry(kw: dict) -> None:
    with pytest.raises(ValueError, match="must"):
        Layout(**kw)


def _header(lay: Layout, **kw: object) -> bytes:
    args = {"metric": P.Metric.L2, "dtype": 1, "pid": 4242, "uid": 1000, "boot_epoch": 77, "name": "n",
                "backend": "cpu", "state": P.SidecarState.READY}  # fmt: skip
    args.update(kw)
    return P.encode_header(lay, **args).ljust(P.HEADER_SIZE, b"\x00")  # type: ignore[arg-type]


@pytest.mark.parametrize("lay", LAYOUTS)
def test_header_round_trip(lay: Layout) -> None:
    h = P.decode_header(_header(lay, name="mem-1", backend="cuda:0"), lay.segment_size)
    assert h.layout == lay
    assert (h.name, h.backend, h.sidecar_pid, h.boot_epoch) == ("mem-1", "cuda:0", 4242, 77)
    assert h.metric_name == "l2" and h.dtype_name == "float16"
    assert h.max_queries == lay.max_queries


def test_a_foreign_segment_is_told_from_a_kalos_one_and_a_dead_starters_zeros() -> None:
    good = _header(LAYOUTS[1])
    assert not P.foreign_segment(good)  # Kalos's (whatever its version or state)
    assert not P.foreign_segment(_header(LAYOUTS[1], version_major=2))
    assert not P.foreign_segment(bytes(4096)) and not P.foreign_segment(b"")  # zeros: a dead start
    assert P.foreign_segment(b"NOTKALOS" + good[8:]) and P.foreign_segment(b"\x00" * 7 + b"\x01")
    assert P.foreign_segment(b"KALOSHM")  # (shorter than the magic, not zeros)
    assert P.foreign_segment(memoryview(b"KALOSHM\x01" + bytes(100)))


def test_header_errors_each_have_their_kind() -> None:
    lay = LAYOUTS[1]
    good = _header(lay)
    cases = {
        HeaderError.SHORT: good[:40],
        HeaderError.MAGIC: b"NOTKALOS" + good[8:],
        HeaderError.INITIALIZING: b"\x00" * 8 + good[8:],  # created, header not written yet
        HeaderError.VERSION: _header(lay, version_major=2),
    }
    for kind, buf in cases.items():
        with pytest.raises(HeaderError) as e:
            P.decode_header(buf, lay.segment_size)
        assert e.value.kind == kind, (kind, str(e.value))
    with pytest.raises(HeaderError) as e:
        P.decode_header(_header(lay, version_major=0), lay.segment_size)
    assert e.value.kind == HeaderError.INITIALIZING
    with pytest.raises(HeaderError) as e:  # the segment is smaller than the header says
        P.decode_header(good, lay.segment_size - 1)
    assert e.value.kind == HeaderError.CORRUPT
    corrupt = bytearray(good)
    struct.pack_into("<Q", corrupt, HEADER_OFFSETS["slot_size"], 12345)
    with pytest.raises(HeaderError) as e:
        P.decode_header(bytes(corrupt), lay.segment_size)
    assert e.value.kind == HeaderError.CORRUPT


def _req(**kw: int) -> Request:
    base = {"seq": 1, "op": Op.RECALL, "flags": 0, "top_k": 10, "n_items": 1, "vec_len": 4 * 97, "args_len": 0,
                "deadline_ns": 0}  # fmt: skip
    base.update(kw)
    return Request(**base)


def test_valid_requests_pass() -> None:
    lay = LAYOUTS[1]
    for req in [
        _req(),
        _req(n_items=lay.max_queries, vec_len=4 * 97 * lay.max_queries, top_k=1),
        _req(op=Op.UPSERT, n_items=3, vec_len=3 * 4 * 97, args_len=100),
        _req(op=Op.GET, vec_len=0, args_len=10),
        _req(op=Op.PING, vec_len=0, top_k=0, n_items=0),
        _req(flags=Flag.WITH_VECTORS | Flag.NO_DOCS),
        _req(flags=Flag.ARENA_DOCS),
        _req(flags=Flag.ARENA_DOCS | Flag.ARENA_ENTRIES),  # v1.3
    ]:
        P.validate_request(req, lay)


@pytest.mark.parametrize(
    ("kw", "status"),
    [
        ({"op": 99}, Status.BAD_OP),
        ({"flags": 1 << 9}, Status.BAD_REQUEST),
        ({"flags": Flag.ARENA_ENTRIES}, Status.BAD_REQUEST),  # entries of what? only with ARENA_DOCS
        ({"top_k": 0}, Status.BAD_REQUEST),
        ({"top_k": 101}, Status.BAD_REQUEST),
        ({"n_items": 0, "vec_len": 0}, Status.BAD_REQUEST),
        ({"vec_len": 4 * 96}, Status.DIMENSION),
        ({"vec_len": 4 * 97 + 2}, Status.BAD_REQUEST),
        ({"args_len": 1 << 62}, Status.TOO_LARGE),
        ({"vec_len": (1 << 64) - 4}, Status.TOO_LARGE),
        ({"n_items": 4, "top_k": 100, "vec_len": 16 * 97}, Status.TOO_LARGE),  # 400 > 333 results
        ({"op": Op.UPSERT, "vec_len": 0, "args_len": 5}, Status.DIMENSION),
        ({"op": Op.UPSERT, "n_items": 2, "vec_len": 4 * 97, "args_len": 5}, Status.DIMENSION),
        ({"op": Op.DELETE, "vec_len": 0, "args_len": 0}, Status.BAD_REQUEST),
        ({"op": Op.GET, "vec_len": 4 * 97, "args_len": 5}, Status.BAD_REQUEST),
    ],
)
def test_invalid_requests_get_their_status(kw: dict, status: int) -> None:
    with pytest.raises(Invalid) as e:
        P.validate_request(_req(**kw), LAYOUTS[1])
    assert e.value.status == status and str(e.value)


U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


@settings(max_examples=3000, deadline=None)
@given(U64, st.sampled_from([*range(0, 12), 2**31, 2**32 - 1]), U32, U32, U32, U64, U64, U64)
def test_validate_request_is_total_and_passing_requests_stay_in_the_slot(
    seq: int, op: int, flags: int, k: int, n: int, vec_len: int, args_len: int, dl: int
) -> None:
    lay = LAYOUTS[1]
    req = Request(seq, op, flags, k, n, vec_len, args_len, dl)
    try:
        P.validate_request(req, lay)
    except Invalid as e:
        assert e.status in P.STATUS_NAMES
        return
    assert P.align8(req.vec_len) + req.args_len <= lay.payload_size
    if op == Op.RECALL:
        assert req.n_items * req.top_k <= lay.max_results and req.top_k <= lay.max_k


def test_recall_args_round_trip_and_fast_path() -> None:
    assert P.encode_recall_args("", None) == b""
    assert P.decode_recall_args(b"") == ("", None)
    for ns, flt in [("ns", None), ("", b'{"a":1}'), ("naïve ☃", b'{"$or":[{"x":{"$gt":1}}]}')]:
        ns2, flt2 = P.decode_recall_args(P.encode_recall_args(ns, flt))
        assert ns2 == ns and (flt2 is None if flt is None else flt2 == __import__("json").loads(flt))


@given(st.binary(max_size=64))
def test_recall_args_decoder_only_raises_invalid(buf: bytes) -> None:
    try:
        P.decode_recall_args(buf)
    except Invalid as e:
        assert e.status == Status.BAD_REQUEST


@pytest.mark.parametrize("buf", [b"\xff", b"[1,2]", b'{"a":NaN}', b'{"a": Infinity}', b"{", b"[" * 5000])
def test_json_args_refuse_garbage(buf: bytes) -> None:
    with pytest.raises(Invalid):
        P.decode_json_args(buf)


def test_docs_round_trip_with_and_without_vectors() -> None:
    docs = [P.encode_doc("id-ü", "text ☃", b'{"k":[1,2]}', 1.5, 2.5), P.encode_doc("e", "", b"", 0, 0)]
    views, vecs = P.decode_docs_blob(P.encode_docs_blob(docs), 3, False)
    assert vecs is None
    d0, d1 = (P.decode_doc(v) for v in views)
    assert (d0.id, d0.text, d0.metadata, d0.created_at, d0.updated_at) == ("id-ü", "text ☃", {"k": [1, 2]}, 1.5, 2.5)
    assert (d1.text, d1.metadata) == ("", {})
    assert P.doc_id(views[0]) == "id-ü"
    v = np.arange(6, dtype=np.float32).reshape(2, 3)
    views, vecs = P.decode_docs_blob(P.encode_docs_blob(docs, v), 3, True)
    assert vecs is not None and np.array_equal(vecs, v) and len(views) == 2
    views, vecs = P.decode_docs_blob(P.encode_docs_blob([]), 3, False)
    assert views == [] and vecs is None


def test_doc_views_cut_and_slice_like_a_list() -> None:
    docs = [P.encode_doc(f"id{i}", "t" * i, b"{}", 0, 0) for i in range(7)]
    views, _ = P.decode_docs_blob(P.encode_docs_blob(docs), 3, False)
    as_list = [bytes(v) for v in views]
    assert as_list == docs and len(views) == 7
    for sl in [slice(2, 5), slice(5, 2), slice(-3, None), slice(0, 7, 2), slice(None)]:
        assert [bytes(v) for v in views[sl]] == docs[sl]
    sub = views[1:6]
    assert [bytes(v) for v in sub[1:3]] == docs[2:4] and bytes(sub[-1]) == docs[5]
    with pytest.raises(IndexError):
        sub[5]
    with pytest.raises(IndexError):
        views[-8]


def test_doc_views_split_into_equal_parts_per_query() -> None:
    docs = [P.encode_doc(f"id{i}", "t" * i, b"{}", 0, 0) for i in range(12)]
    views, _ = P.decode_docs_blob(P.encode_docs_blob(docs), 3, False)
    parts = views.split(4)
    assert [[bytes(v) for v in p] for p in parts] == [docs[3 * i : 3 * i + 3] for i in range(4)]
    assert [bytes(v) for v in views[2:10].split(2)[1]] == docs[6:10]
    assert views[0:0].split(5) == [[]] * 5  # no hits: an empty part per query
    with pytest.raises(ValueError, match="equal parts"):
        views.split(5)
    with pytest.raises(ValueError, match="equal parts"):
        views.split(0)
    as_bytes = [bytes(v) for v in views]  # the arena's copies of a batch-1 recall's hits
    assert P.split_docs(as_bytes, 3) == [docs[0:4], docs[4:8], docs[8:12]]
    assert [[bytes(v) for v in p] for p in P.split_docs(views, 2)] == [docs[:6], docs[6:]]
    with pytest.raises(ValueError, match="equal parts"):
        P.split_docs(as_bytes, 5)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_docs_blob_decoder_only_raises_decode_error(blob: bytes, has_vectors: bool) -> None:
    try:
        views, _ = P.decode_docs_blob(blob, 3, has_vectors)
        for v in views:
            P.decode_doc(v)
    except P.ProtocolDecodeError:
        pass


@pytest.mark.parametrize(
    "meta",
    [b"{}", b'{"k":[1,2]}', b'{"t":"\xc3\xbc \\u2603","n":-1.5e300,"big":123456789012345678901234567890}',
     b'{"a":{"b":{"c":[null,true,false]}}}', b' { "spaced" : 1 } ', b'{"a":1}\n',
     b'\xef\xbb\xbf{"bom":1}', '{"utf16":1}'.encode("utf-16"), '{"le":1}'.encode("utf-16-le"),
     b'{"s":"\xed\xa0\x80"}'],
)  # fmt: skip
def test_doc_fields_decode_metadata_as_json_loads_does(meta: bytes) -> None:
    """The fast scanner path and its json.loads fallback give json.loads's result."""
    buf = P.encode_doc("i", "t", meta, 0, 0)
    assert P.decode_doc_fields(buf) == ("i", "t", json.loads(meta))
    assert P.decode_doc(memoryview(buf)).metadata == json.loads(meta)


@pytest.mark.parametrize("meta", [b"[1,2]", b'"s"', b"{", b'{"a":1}x', b'{"a":1}{}', b"\xff", b"{" * 5000, b" "])
def test_doc_fields_refuse_what_is_not_one_json_object(meta: bytes) -> None:
    with pytest.raises(P.ProtocolDecodeError):
        P.decode_doc_fields(P.encode_doc("i", "t", meta, 0, 0))


def test_check_vectors_names_the_argument() -> None:
    assert P.check_vectors([1, 2, 3], 3, "q").shape == (1, 3)
    with pytest.raises(ValueError, match=r"query has shape \(4,\).*dim=3"):
        P.check_vectors([1, 2, 3, 4], 3, "query")
    with pytest.raises(ValueError, match=r"vectors\[1\] contains NaN"):
        P.check_vectors([[1, 2, 3], [1, np.nan, 3]], 3, "vectors")
    with pytest.raises(ValueError, match="numeric"):
        P.check_vectors(["a", "b", "c"], 3, "q")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_check_vectors_list_fast_path_matches_numpy() -> None:
    """A list of dim numbers (an Embeddings' output) is packed by struct; the result must be
    what numpy's conversion gives, and whatever struct refuses must still convert or fail as
    numpy's path does."""
    rng = np.random.default_rng(7)
    for dim in (1, 3, 97, 768):
        vals = rng.standard_normal(dim).tolist()
        assert P._list_vector(vals, dim) is not None  # the fast path took it
        got = P.check_vectors(vals, dim, "q")
        assert got.shape == (1, dim) and got.dtype == np.float32 and got.flags.c_contiguous
        assert got.flags.writeable
        np.testing.assert_array_equal(got[0], np.asarray(vals, np.float32))
    # items with __float__ that numpy converts differently never reach struct
    with pytest.raises(ValueError, match="shape"):
        P.check_vectors([np.ones(1), np.ones(1), np.ones(1)], 3, "q")
    mixed = [1, True, np.float32(2.5), np.float64(-3.0), 4.25]
    np.testing.assert_array_equal(P.check_vectors(mixed, 5, "q")[0], [1, 1, 2.5, -3, 4.25])
    np.testing.assert_array_equal(P.check_vectors(["1.5", 2, 3], 3, "q")[0], [1.5, 2, 3])  # numpy's
    for bad in ([1.0, float("nan"), 2.0], [1.0, float("inf"), 2.0], [1.0, 1e39, 2.0], [1.0, 10**400, 2.0]):
        with pytest.raises(ValueError, match=r"q\[0\] (contains NaN or infinity|has a value beyond float32)|numeric"):
            P.check_vectors(bad, 3, "q")
    with pytest.raises(ValueError, match=r"q\[0\] has a value beyond float32's range"):  # (finite as given)
        P.check_vectors([1.0, 1e39, 2.0], 3, "q")


def test_check_vectors_huge_finite_values_pass_without_warnings() -> None:
    """Values whose squares overflow float32 are finite: they pass, and without a warning (a
    finite check by sum of squares once warned here, an error under -W error)."""
    import warnings

    v = np.full((2, 5), 3e20, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert P.check_vectors(v, 5, "q").shape == (2, 5)
        assert P.check_vectors([3e20] * 5, 5, "q").shape == (1, 5)
    v[1, 4] = np.inf
    with pytest.raises(ValueError, match=r"q\[1\] contains NaN"):
        P.check_vectors(v, 5, "q")


@pytest.mark.parametrize("name", ["", "-x", "a/b", "x" * 65, "sp ace", "é"])
def test_names_are_checked(name: str) -> None:
    with pytest.raises(ValueError, match="not a valid sidecar name"):
        P.segment_name(name)


def test_protocol_doc_lists_every_field_at_its_offset() -> None:
    """docs/protocol.md is the human copy of these tables; it must not drift."""
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    for table, offsets in (("header", HEADER_OFFSETS), ("slot", CTL_OFFSETS)):
        for field, off in offsets.items():
            assert re.search(rf"\|\s*{off}\s*\|[^|\n]*\|\s*`{field}`", doc), f"{table} field {field} @ {off}"


def test_json_args_take_only_the_ops_keys() -> None:
    assert P.decode_json_args(b'{"namespace":"n","ids":["a"]}', Op.GET) == {"namespace": "n", "ids": ["a"]}
    with pytest.raises(Invalid, match=r"upsert does not take argument\(s\) \['namepsace'\]") as e:
        P.decode_json_args(b'{"namepsace":"n","ids":[],"texts":[],"metadatas":[]}', Op.UPSERT)
    assert e.value.status == Status.BAD_REQUEST
    for op, keys in P.ARG_KEYS.items():  # every key the client sends is accepted
        P.decode_json_args(P.encode_json(dict.fromkeys(keys)), op)


def test_recall_result_hits_equal_dataclass_hits() -> None:
    """A hit read from a RecallResult is built without Hit's __init__ (one __dict__ instead of
    eight frozen setattrs); it must be the very Hit that Hit(...) builds, with and without
    vectors, at any index, and the shortcut must switch itself off for a Hit it cannot build."""
    import dataclasses

    from kalos_retrievers import results as R

    docs = [P.encode_doc(f"id-{i}", f"text {i}", b'{"i": %d}' % i, 10.0 + i, 20.0 + i) for i in range(3)]
    vecs = np.arange(9, dtype=np.float32).reshape(3, 3)
    for vectors in (None, vecs):
        res = R.RecallResult(np.arange(3, dtype=np.int32), np.array([0.9, 0.5, 0.1], np.float32),
                             [memoryview(d) for d in docs], vectors, "ns")  # fmt: skip
        for i in (2, 0, -2):
            j = i % 3
            want = R.Hit(f"id-{j}", float(res.scores[j]), f"text {j}", {"i": j}, "ns", 10.0 + j, 20.0 + j,
                         None if vectors is None else vectors[j])  # fmt: skip
            got = res[i]
            assert got == want and repr(got) == repr(want)
            assert list(got.__dict__) == [f.name for f in dataclasses.fields(R.Hit)]
            assert (got.vector is None) == (vectors is None) and got is res[i]  # built once
            with pytest.raises(dataclasses.FrozenInstanceError):
                got.text = "changed"  # type: ignore[misc]
    assert R._fast_hits_work() and R._make_hit is R._hit_unchecked
    try:  # negative control: a Hit with a post-init hook is not what the shortcut builds
        R.Hit.__post_init__ = lambda self: None  # type: ignore[attr-defined]
        assert not R._fast_hits_work()
    finally:
        del R.Hit.__post_init__  # type: ignore[attr-defined]


@pytest.mark.parametrize("as_views", [True, False])
def test_batch_results_cut_each_querys_share_when_read(as_views: bool) -> None:
    """``RecallResult.batch`` gives query ``i`` row ``i`` of the rows and scores and the
    ``i``-th share of the documents and vectors, cut on first access: every attribute and hit
    equals what a result built from that share up front gives, whichever is read first."""
    from kalos_retrievers import results as R

    nq, per, dim = 5, 3, 7  # odd sizes
    enc = [P.encode_doc(f"id-{i}", f"text {i}", b'{"i": %d}' % i, 1.0 + i, 2.0 + i) for i in range(nq * per)]
    docs = P.decode_docs_blob(P.encode_docs_blob(enc), dim, False)[0] if as_views else enc
    rows = np.arange(nq * per, dtype=np.int32).reshape(nq, per)[:, ::-1]
    scores = np.linspace(1, 0, nq * per, dtype=np.float32).reshape(nq, per)
    vectors = np.arange(nq * per * dim, dtype=np.float32).reshape(nq * per, dim)
    for vecs in (None, vectors):
        got = R.RecallResult.batch(rows, scores, docs, vecs, "ns")
        assert len(got) == nq
        for i, res in enumerate(got):
            want = R.RecallResult(rows[i], scores[i], [memoryview(d) for d in enc[i * per : (i + 1) * per]],
                                  None if vecs is None else vecs[i * per : (i + 1) * per], "ns")  # fmt: skip
            assert len(res) == per and res.namespace == "ns"
            first = i % 3  # a hit, the ids, or the arrays read first
            if first == 0:
                assert res[-1] == want[-1] and res[0] == want[0]
            if first == 1:
                assert res.ids == want.ids == [f"id-{j}" for j in range(i * per, (i + 1) * per)]
            assert np.array_equal(res.rows, rows[i]) and np.array_equal(res.scores, scores[i])
            assert (res.vectors is None) == (vecs is None)
            if vecs is not None:
                assert np.array_equal(res.vectors, want.vectors)
            assert [h.id for h in res] == want.ids and list(res) == list(want)
            assert res.id_text_metadata() == want.id_text_metadata()
            with pytest.raises(IndexError):
                res[per]
    # no documents (docs=False), and an answer with no hits
    bare = R.RecallResult.batch(rows, scores, None)
    assert np.array_equal(bare[4].scores, scores[4]) and bare[4].vectors is None
    with pytest.raises(ValueError, match="docs=False"):
        bare[1][0]
    with pytest.raises(ValueError, match="docs=False"):
        _ = bare[1].ids
    empty = R.RecallResult.batch(np.zeros((2, 0), np.int32), np.zeros((2, 0), np.float32), docs[:0])
    assert [len(r) for r in empty] == [0, 0] and empty[1].ids == [] and list(empty[0]) == []
    # shares that do not split evenly are refused
    with pytest.raises(ValueError, match="do not split"):
        R.RecallResult.batch(rows, scores, docs[:-1])
    with pytest.raises(ValueError, match="do not split"):
        R.RecallResult.batch(rows, scores, docs, vectors[:-1])


def test_batch_results_pickle_their_share_and_take_assignments() -> None:
    """A batch's result pickles (and copies) as its own share, not the whole batch; ``rows``,
    ``scores`` and ``vectors`` stay assignable, as plain attributes were; a result built with
    ``scores=None`` reads None back."""
    import copy
    import pickle

    from kalos_retrievers import results as R

    nq, per, dim = 6, 3, 5
    enc = [P.encode_doc(f"id-{i}", f"t{i}", b"{}", 1.0, 2.0) for i in range(nq * per)]
    rows = np.arange(nq * per, dtype=np.int32).reshape(nq, per)
    scores = np.linspace(1, 0, nq * per, dtype=np.float32).reshape(nq, per)
    vectors = np.random.default_rng(3).standard_normal((nq * per, dim)).astype(np.float32)
    batch = R.RecallResult.batch(rows, scores, enc, vectors, "ns")
    alone = pickle.dumps(R.RecallResult(rows[4], scores[4], enc[12:15], vectors[12:15], "ns"))
    for res in (pickle.loads(pickle.dumps(batch[4])), copy.deepcopy(batch[4]), copy.copy(batch[4])):  # noqa: S301
        assert res._batch is None and res.ids == ["id-12", "id-13", "id-14"] and res.namespace == "ns"
        assert np.array_equal(res.rows, rows[4]) and np.array_equal(res.vectors, vectors[12:15])
    assert len(pickle.dumps(batch[4])) <= len(alone) + 64  # its share, not the batch's 18 hits
    r = batch[2]
    r.scores = np.zeros(per, np.float32)
    r.rows = rows[0]
    r.vectors = None
    assert not r.scores.any() and np.array_equal(r.rows, rows[0]) and r.vectors is None and len(r) == per
    assert r[0].score == 0.0 and r[0].vector is None
    bare = R.RecallResult(np.arange(2, dtype=np.int32), None, None)  # type: ignore[arg-type]
    assert bare.scores is None and bare.vectors is None and len(bare) == 2
    with pytest.raises(IndexError):
        batch[1][-per - 1]
    assert batch[1][-1] == batch[1][per - 1]


def test_the_carousel_layout_is_the_sidecars_slots_and_the_headers_words_decode() -> None:
    """Protocol v1.4: a client computes the carousel's slot layout from dim alone, and it must be
    the one the sidecar's Slots use (tests/unit/test_carousel.py checks those against the
    kernel); the header's carousel words decode where the sidecar writes them."""
    from types import SimpleNamespace

    from kalos_retrievers.sidecar import carousel

    host = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(hostRegister=lambda *a: None,
                                                                        hostUnregister=lambda *a: None)))  # fmt: skip
    for dim in (1, 3, 97, 768, 1536):
        lay = P.CarouselLayout.of(dim)
        s = carousel.Slots(host, carousel.MAX_SLOTS, dim)
        assert (lay.rows_off, lay.scores_off, lay.slot_bytes) == (s.rows_off, s.scores_off, s.slot_bytes)
        assert lay.slot_bytes % 128 == 0 and lay.scores_off + 4 * P.CAR_KMAX <= lay.slot_bytes
        assert lay.segment_size() % 4096 == 0 and lay.segment_size() >= carousel.MAX_SLOTS * lay.slot_bytes
        s.close()
    assert P.CarouselLayout.of(768) == (768, 3104, 3232, 3456)
    with pytest.raises(ValueError, match="dim"):
        P.CarouselLayout.of(0)
    layout = Layout(n_slots=3, dim=8, max_k=10, max_results=10, payload_size=4096, blob_size=4096)
    raw = bytearray(P.encode_header(layout, metric=0, dtype=1, pid=1, uid=0, boot_epoch=3, name="n", backend="cuda:0"))
    raw += bytes(P.HEADER_SIZE - len(raw))
    assert P.decode_header(bytes(raw)).carousel_epoch == 0
    struct.pack_into("<QI", raw, HEADER_OFFSETS["carousel_epoch"], 2**40 + 7, 48)
    h = P.decode_header(bytes(raw))
    assert (h.carousel_epoch, h.carousel_slots) == (2**40 + 7, 48)


def test_car_takes_what_the_kernel_scores_as_the_sidecar_does() -> None:
    """Cosine: a query whose largest |x| is within [1e-15, 5e16] (outside, the kernel's float32
    sum of squares underflows or overflows); inner product and L2: one float16 holds (|x| <=
    65504). car_bounds gives the same ranges to the client's C check."""
    cos, ip, l2 = P.Metric.COSINE, P.Metric.IP, P.Metric.L2
    assert P.car_takes(cos, 1.0) and P.car_takes(cos, 1e-15) and P.car_takes(cos, 5e16)
    assert not P.car_takes(cos, 1e-16) and not P.car_takes(cos, 6e16) and not P.car_takes(cos, 0.0)
    for m in (ip, l2):
        assert P.car_takes(m, 0.0) and P.car_takes(m, 65504.0) and not P.car_takes(m, 65505.0)
    assert P.car_bounds(cos) == (1e-15, 5e16) and P.car_bounds(ip) == P.car_bounds(l2) == (0.0, 65504.0)


@pytest.mark.parametrize(
    "obj",
    ["", "id-7", 'q"uote\\ \n\t\x00 \u2028 é 漢', {}, {"a": 1, "b": [1, "é", None, True, 2.5, -0.0]},
     [1, 2], 3, 1e300, None, True, {"nested": {"k": ["v", {"w": 1}]}}, ("t", 1)],
)
def test_encode_json_is_json_dumps_compact_strict_utf8(obj) -> None:
    """The wire's JSON is pinned to json.dumps with these arguments, byte for byte."""
    want = json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()
    assert P.encode_json(obj) == want


@pytest.mark.parametrize(
    ("obj", "error"),
    [(float("nan"), ValueError), ({"a": float("inf")}, ValueError), ({"s": {1, 2}}, TypeError),
     ("\ud800", UnicodeEncodeError), ({1.5: "non-str key"}, None)],
)
def test_encode_json_refuses_what_json_dumps_refuses(obj, error) -> None:
    def dumps() -> bytes:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()

    if error is None:  # (json.dumps accepts it: so must encode_json, with the same bytes)
        assert P.encode_json(obj) == dumps()
        return
    with pytest.raises(error):
        dumps()
    with pytest.raises(error):
        P.encode_json(obj)


def test_ringable_args_are_a_namespace_alone_within_64_bytes() -> None:
    """What a DOORBELL recall may carry (v1.5): a namespace's args without a filter, at most
    DOORBELL_ARGS_MAX bytes (a name of up to 58 bytes of UTF-8); told apart from a filter's
    by the name's length alone, as the client and the dispatcher do."""

    def ringable(namespace: str, flt: bytes | None = None) -> bool:
        args = P.encode_recall_args(namespace, flt)
        return P.ringable_args(len(args), int.from_bytes(args[:2], "little"))

    assert ringable("notes") and ringable("é" * 29) and ringable("x" * 58)
    assert not ringable("x" * 59) and not ringable("é" * 30)  # 65 and 66 bytes
    assert not ringable("notes", b'{"u":1}') and not ringable("", b'{"u":1}')
    assert not ringable("")  # the default namespace's recall carries no args at all
    assert not P.ringable_args(6, 0) and not P.ringable_args(0, 0)


def test_ringable_args_with_doorbell_args_are_any_args_within_it() -> None:
    """Where the header's ``doorbell_args`` is nonzero (v1.6), any args up to that many bytes
    may be rung: a namespace, a filter, or both; longer ones, and none at all, may not. With
    ``doorbell_args`` 0 (the control) the v1.5 rule holds for the same args."""

    def ringable(namespace: str, flt: bytes | None, args_max: int) -> bool:
        args = P.encode_recall_args(namespace, flt)
        return P.ringable_args(len(args), int.from_bytes(args[:2], "little"), args_max)

    m = P.DOORBELL_SCOPE_ARGS_MAX
    assert m == 128
    flt = b'{"user_id":"u-1234"}'
    assert ringable("memories", flt, m) and ringable("", flt, m) and ringable("notes", None, m)
    assert not ringable("memories", flt, 0) and not ringable("", flt, 0) and ringable("notes", None, 0)
    assert ringable("x" * 122, None, m) and not ringable("x" * 123, None, m)  # 128 and 129 bytes
    assert ringable("", b'"' + b"x" * 120 + b'"', m) and not ringable("", b'"' + b"x" * 121 + b'"', m)
    assert ringable("x" * 58, None, 64) and not ringable("x" * 59, None, 64)
    assert not ringable("", None, m) and not P.ringable_args(6, 0, m)

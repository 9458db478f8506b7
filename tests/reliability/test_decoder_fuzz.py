"""Scenario 9 (fuzz target): the protocol decoders on arbitrary input.

Each decoder documents the exceptions it raises; on any input, structured or random, only those
may escape (a RecursionError, struct.error, IndexError... escaping would be an answer the
sidecar or the client did not plan for). Where a decoder accepts, what it returns is checked
too: a request that passes ``validate_request`` never reaches outside its slot; a decoded
document's metadata is a dict; a docs blob's views lie inside the blob.

Negative control: the same property run on a decoder with its error mapping removed finds the
escaping exception.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliability._harness import scale

import kalos_retrievers.protocol as proto
from kalos_retrievers.protocol import (
    DOC_HEADER,
    HEADER_SIZE,
    HeaderError,
    Invalid,
    Layout,
    Op,
    ProtocolDecodeError,
    Request,
    align8,
    decode_doc,
    decode_docs_blob,
    decode_recall_args,
    encode_doc,
    encode_docs_blob,
    encode_header,
)

pytestmark = pytest.mark.reliability

EXAMPLES = scale(400, 20000)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
EDGE64 = st.sampled_from([0, 1, 3, 4, 7, 8, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 4,
                          2**62, 2**63 - 1, 2**63, 2**64 - 8, 2**64 - 1])  # fmt: skip
LAYOUTS = st.builds(
    lambda n, dim, k, pay, blob: Layout(n_slots=n, dim=dim, max_k=k, max_results=8192,
                                        payload_size=max(pay, align8(4 * dim + 128) + 127) // 128 * 128,
                                        blob_size=blob * 128),  # fmt: skip
    st.integers(1, 64), st.integers(1, 4096), st.integers(1, 1024),
    st.integers(128, 1 << 22), st.integers(32, 1 << 14),
)  # fmt: skip


def deep(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


#: hostile byte strings a random generator rarely finds by itself
NASTY = st.sampled_from([
    deep(3000), deep(3000, b'{"a":', b"}"), b"[" * 3000, b"\xff\xfe", b"\xed\xa0\x80",
    b'{"a": NaN}', b'{"a": Infinity}', b"1" * 5000, b'{"a": 1' + b"0" * 5000 + b"}", b"{}",
    b'{"namespace": "\\ud800"}', b"null", b"[]", b'"x"', b"\x00" * 64,
])  # fmt: skip
BYTES = st.one_of(st.binary(max_size=512), NASTY)


@FUZZ
@given(layout=LAYOUTS, op=st.one_of(st.sampled_from(sorted(proto.OP_NAMES)), U32),
       flags=st.one_of(st.integers(0, 3), U32),
       top_k=st.one_of(EDGE64.filter(lambda x: x < 2**32), U32, st.integers(0, 2048)),
       n_items=st.one_of(EDGE64.filter(lambda x: x < 2**32), U32, st.integers(0, 64)),
       vec_len=st.one_of(EDGE64, U64, st.integers(0, 1 << 16)), args_len=st.one_of(EDGE64, U64, st.integers(0, 4096)),
       deadline=U64)  # fmt: skip
def test_validate_request_total_and_safe(layout: Layout, op: int, flags: int, top_k: int,
                                         n_items: int, vec_len: int, args_len: int, deadline: int) -> None:  # fmt: skip
    req = Request(1, op, flags, top_k, n_items, vec_len, args_len, deadline)
    try:
        proto.validate_request(req, layout)
    except Invalid as e:
        assert e.status in proto.STATUS_NAMES and str(e)
        return
    # accepted: everything the dispatcher will touch lies inside the slot
    assert align8(vec_len) + args_len <= layout.payload_size
    assert vec_len % 4 == 0
    if op == Op.RECALL:
        assert 1 <= top_k <= layout.max_k and 1 <= n_items <= layout.max_queries
        assert n_items * top_k <= layout.max_results
        assert vec_len == n_items * 4 * layout.dim
    if op == Op.UPSERT:
        assert vec_len == n_items * 4 * layout.dim and n_items >= 1


@FUZZ
@given(buf=st.one_of(BYTES, st.builds(
    lambda ns, n, flt, fl, exact: (struct.pack("<H", len(ns) if exact else n) + ns
                                   + struct.pack("<I", len(flt) if exact else fl) + flt),
    st.binary(max_size=40), st.integers(0, 2**16 - 1), BYTES, U32, st.booleans())))  # fmt: skip
@example(buf=struct.pack("<H", 0) + struct.pack("<I", 6000) + deep(3000))
def test_decode_recall_args_only_invalid(buf: bytes) -> None:
    try:
        ns, _flt = proto.decode_recall_args(buf)
    except Invalid:
        return
    assert isinstance(ns, str)


@FUZZ
@given(ns=st.text(max_size=20), flt=st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.integers())))
def test_decode_recall_args_round_trip(ns: str, flt: dict | None) -> None:
    try:
        raw = proto.encode_recall_args(ns, proto.encode_json(flt) if flt else None)
    except UnicodeEncodeError:
        return  # lone surrogates never reach the wire: the client refuses them
    got_ns, got_flt = decode_recall_args(raw)
    assert got_ns == ns and got_flt == (flt or None)


@FUZZ
@given(buf=BYTES)
def test_decode_json_args_only_invalid(buf: bytes) -> None:
    try:
        obj = proto.decode_json_args(buf)
    except Invalid:
        return
    assert isinstance(obj, dict)


@FUZZ
@given(buf=st.one_of(BYTES, st.builds(
    lambda c, u, il, tl, ml, rest: DOC_HEADER.pack(c, u, il, tl, ml) + rest,
    st.floats(), st.floats(), st.one_of(U32, st.integers(0, 40)), st.one_of(U32, st.integers(0, 40)),
    st.one_of(U32, st.integers(0, 40)), BYTES), st.builds(
    lambda i, t, m: DOC_HEADER.pack(0.0, 0.0, len(i), len(t), len(m)) + i + t + m,
    st.binary(max_size=10), st.binary(max_size=10), BYTES)))  # fmt: skip
@example(buf=DOC_HEADER.pack(0.0, 0.0, 0, 0, 6000) + deep(3000))
@example(buf=DOC_HEADER.pack(0.0, 0.0, 0, 0, 1) + b"5")
def test_decode_doc_only_protocol_decode_error(buf: bytes) -> None:
    try:
        doc = proto.decode_doc(buf)
    except ProtocolDecodeError:
        return
    assert isinstance(doc.id, str) and isinstance(doc.text, str) and isinstance(doc.metadata, dict)


@FUZZ
@given(id_=st.text(max_size=20), text=st.text(max_size=50), meta=st.dictionaries(st.text(max_size=5), st.integers()))
def test_decode_doc_round_trip(id_: str, text: str, meta: dict) -> None:
    try:
        raw = encode_doc(id_, text, proto.encode_json(meta), 1.5, 2.5)
    except UnicodeEncodeError:
        return
    d = decode_doc(raw)
    assert (d.id, d.text, d.metadata, d.created_at, d.updated_at) == (id_, text, meta, 1.5, 2.5)


@FUZZ
@given(blob=st.one_of(BYTES, st.builds(
    lambda n, offs, rest: struct.pack("<I", n) + struct.pack(f"<{len(offs)}I", *offs) + rest,
    st.one_of(U32, st.integers(0, 8)), st.lists(U32 | st.integers(0, 64), max_size=10), BYTES)),
    dim=st.integers(1, 64), has_vectors=st.booleans())  # fmt: skip
def test_decode_docs_blob_only_protocol_decode_error(blob: bytes, dim: int, has_vectors: bool) -> None:
    try:
        docs, vecs = proto.decode_docs_blob(blob, dim, has_vectors)
    except ProtocolDecodeError:
        return
    for d in docs:
        assert isinstance(d, memoryview) and len(d) <= len(blob)
    if has_vectors:
        assert vecs is not None and vecs.shape == (len(docs), dim)
    else:
        assert vecs is None


@FUZZ
@given(docs=st.lists(st.binary(max_size=30), max_size=8), dim=st.integers(1, 8), with_vecs=st.booleans())
def test_decode_docs_blob_round_trip(docs: list[bytes], dim: int, with_vecs: bool) -> None:
    vecs = np.arange(len(docs) * dim, dtype=np.float32).reshape(len(docs), dim) if with_vecs else None
    views, got = decode_docs_blob(encode_docs_blob(docs, vecs), dim, with_vecs)
    assert [bytes(v) for v in views] == docs
    if with_vecs:
        assert got is not None and np.array_equal(got, vecs)


_GOOD = encode_header(Layout(n_slots=2, dim=8, payload_size=8192, blob_size=4096), metric=0, dtype=0,
                      pid=1, uid=0, boot_epoch=1, name="x", backend="cpu", state=1)  # fmt: skip


@FUZZ
@given(data=st.data(), size=st.one_of(st.none(), st.integers(0, 1 << 30)))
def test_decode_header_only_header_error(data: st.DataObject, size: int | None) -> None:
    kind = data.draw(st.integers(0, 2))
    if kind == 0:  # random bytes
        buf = data.draw(st.binary(max_size=HEADER_SIZE))
    else:  # a good header with random fields overwritten
        buf = bytearray(_GOOD + b"\x00" * (HEADER_SIZE - len(_GOOD)))
        for _ in range(data.draw(st.integers(1, 6))):
            off = data.draw(st.integers(0 if kind == 2 else 8, len(_GOOD) - 1))
            val = data.draw(st.binary(min_size=1, max_size=8))
            buf[off : off + len(val)] = val
        buf = bytes(buf)
    try:
        h = proto.decode_header(buf, size)
    except HeaderError as e:
        assert e.kind in ("short", "magic", "initializing", "version", "corrupt")
        return
    lay = h.layout  # accepted: the geometry is self-consistent and fits the segment
    assert size is None or lay.segment_size <= size


def test_fuzz_negative_control_finds_an_escaping_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_json_args without its error mapping: the same property finds what escapes."""
    monkeypatch.setattr(proto, "decode_json_args", json.loads)
    with pytest.raises(Exception) as ei:
        test_decode_json_args_only_invalid()
    found = list(ei.value.exceptions) if isinstance(ei.value, BaseExceptionGroup) else [ei.value]
    assert any(isinstance(e, ValueError | RecursionError) for e in found), found

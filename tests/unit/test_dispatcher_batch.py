"""The dispatcher answering several waiting recalls with one search, in process (an anonymous
map stands in for the segment): each member gets its own answer, and a member whose query is
not finite gets an error without failing its neighbours."""

from __future__ import annotations

import mmap

import numpy as np
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import (
    CTL_SIZE,
    HEADER_SIZE,
    METRICS,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    Layout,
    Op,
    Response,
    SlotState,
    Status,
)


class _Sem:
    def __init__(self) -> None:
        self.posts = 0

    def release(self) -> None:
        self.posts += 1


def test_batched_members_get_their_own_answers_and_a_nan_member_only_an_error() -> None:
    n_slots, dim, k, rows = 7, 13, 3, 301
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    rng = np.random.default_rng()
    data = rng.standard_normal((rows, dim)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [""] * rows,
                "metadatas": [{} for _ in range(rows)]}, data)  # fmt: skip
    sems = [_Sem() for _ in range(n_slots)]
    stats = Stats()
    d = Dispatcher(mm, lay, sems, svc, stats, max_batch=64, describe=lambda: {})
    q = rng.standard_normal((n_slots, dim)).astype(np.float32)
    q[4, 5] = np.nan  # slot 4: a client that skipped validation
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    for i in range(n_slots):
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q[i]
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 100 + i, Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
    states[:] = SlotState.REQUEST
    assert d.poll() == n_slots
    assert stats.batches == 1 and stats.batched_queries == n_slots - 1  # one search for the rest
    for i in range(n_slots):
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert resp.seq == 100 + i and sems[i].posts == 1
        if i == 4:
            assert states[i] == SlotState.ERROR and resp.status == Status.BAD_REQUEST
            blob = bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])
            assert b"NaN" in blob
            continue
        assert states[i] == SlotState.RESPONSE and resp.status == Status.OK and resp.n_results == k
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset)
        want = np.argsort(-(data @ q[i]), kind="stable")[:k]
        assert sorted(got.tolist()) == sorted(want.tolist())


def test_a_failed_batch_search_answers_each_member_once() -> None:
    """When the batched search itself fails, the members still waiting get its error, and the
    one already refused for NaN is not answered a second time."""
    from kalos_retrievers.protocol import Invalid

    n_slots, dim = 4, 6
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    svc = Service(CpuIndex(dim, METRICS["ip"]), NullStore(), dim=dim, metric=METRICS["ip"])
    svc.upsert({"namespace": "", "ids": ["a"], "texts": [""], "metadatas": [{}]}, np.ones((1, dim), np.float32))

    def broken(*_a, **_k):  # type: ignore[no-untyped-def]
        raise Invalid(Status.BAD_REQUEST, "the search refused the batch")

    svc.recall_slots = broken  # type: ignore[method-assign]
    sems = [_Sem() for _ in range(n_slots)]
    d = Dispatcher(mm, lay, sems, svc, Stats(), max_batch=64, describe=lambda: {})
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    for i in range(n_slots):
        off = lay.slot_offset(i)
        q = np.full(dim, np.nan if i == 2 else 1.0, np.float32)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 50 + i, Op.RECALL, 0, 1, 1, 4 * dim, 0, 0)
    states[:] = SlotState.REQUEST
    assert d.poll() == n_slots
    assert [s.posts for s in sems] == [1] * n_slots
    for i in range(n_slots):
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        blob = bytes(mm[off + lay.blob_offset : off + lay.blob_offset + resp.resp_len])
        assert states[i] == SlotState.ERROR and resp.status == Status.BAD_REQUEST
        assert (b"NaN" if i == 2 else b"refused the batch") in blob

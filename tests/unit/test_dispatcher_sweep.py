"""The dispatcher driving a GPU index's sweep (sidecar/sweep.py), in process, over a fake index
that keeps the sweep's real bookkeeping (``Plan``, ``Positions``) and searches a batch on the
CPU only once the plan says it has scanned every range: each poll keeps the scan going, a
batch is answered only when the index says it is done, requests that come while the sweep
scans join it, and writes, other requests and slot reclaim wait for it."""

from __future__ import annotations

import mmap
import tempfile

import numpy as np
import pytest
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore
from kalos_retrievers.sidecar.sweep import Member, Plan, Positions
from kalos_testing import PostCounter as _Sem

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
    align8,
)


class _SweepingIndex(CpuIndex):
    """A CPU index with a sweep: ``sweep_join`` poisons the batch's answers and adds it to a
    real ``Plan``; each ``sweep_pump`` runs ``passes_per_pump`` passes; a batch is searched
    (its answers written) when its last pass is done, and its token returned by
    ``sweep_finished`` then. ``lanes`` batches at most. ``early``: the broken index of the
    negative control, which reports a batch finished as soon as it joined."""

    sweeps = True  # type: ignore[assignment]
    defers = True  # type: ignore[assignment]

    def __init__(self, dim: int, metric: int, chunks: int = 4) -> None:
        super().__init__(dim, metric)
        self.plan = Plan(chunks)
        self.positions = Positions(64)
        self.lanes = 8
        self.passes_per_pump = 1
        self.early = False
        self.log: list[str] = []
        self.high = -1
        self._work: dict[int, tuple] = {}  # id(member) -> (specs, k, high, ns, dense)
        self._done: list = []

    def sweep_fits(self, n: int, k: int, high: int) -> bool:
        return 1 <= n <= 32

    def sweep_can_join(self, n, k, high, ns, dense) -> bool:  # type: ignore[no-untyped-def]
        if len(self.plan.members) >= self.lanes:
            return False
        if self.plan.members and high != self.high:
            return False
        start = self.positions.take(n)
        if start is None:
            return False
        self.positions.give(start)
        return True

    def sweep_join(self, specs, k, high, ns, dense, token) -> None:  # type: ignore[no-untyped-def]
        n = sum(len(s.queries) for s in specs)
        assert self.sweep_can_join(n, k, high, ns, dense)
        if not self.plan.members:
            self.plan.restart()
            self.high = high
        start = self.positions.take(n)
        m = Member(token, start, n, k, 0)
        self.plan.add(m)
        for s in specs:
            s.rows[:, :k] = -7  # what an unfinished device search leaves: out of range
        self._work[id(m)] = (specs, k, high, ns, None, dense)
        self.log.append(f"join {len(specs)}")
        if self.early:
            self._done.append((token, None))

    def sweep_pump(self) -> int:
        for _ in range(self.passes_per_pump if self.plan.members else 0):
            self._pass()
        return 0

    def _pass(self) -> None:
        c, _, leaving = self.plan.next_pass()
        self.log.append(f"pass {c}")
        for m in leaving:
            self.search_slots(*self._work.pop(id(m)))
            self.positions.give(m.start)
            self.log.append(f"leave {m.n}")
            if not self.early:
                self._done.append((m.token, None))

    def sweep_finished(self) -> list:
        out, self._done = self._done, []
        return out

    def sweep_settle(self) -> None:
        self.log.append("settle")
        while self.plan.members:
            self._pass()

    @property
    def sweep_busy(self) -> bool:
        return bool(self.plan.members or self._done)


def _rig(n_slots: int, dim: int = 5, rows: int = 41, k: int = 3, max_batch: int = 64):  # type: ignore[no-untyped-def]
    lay = Layout(n_slots=n_slots, dim=dim, payload_size=1 << 14, blob_size=1 << 14)
    mm = mmap.mmap(-1, lay.segment_size)
    index = _SweepingIndex(dim, METRICS["ip"])
    svc = Service(index, NullStore(), dim=dim, metric=METRICS["ip"])
    rng = np.random.default_rng()
    data = rng.standard_normal((rows, dim)).astype(np.float32)
    svc.upsert({"namespace": "", "ids": [f"r{i}" for i in range(rows)], "texts": [""] * rows,
                "metadatas": [{} for _ in range(rows)]}, data)  # fmt: skip
    d = Dispatcher(mm, lay, [_Sem() for _ in range(n_slots)], svc, Stats(), max_batch=max_batch,
                   describe=lambda: {})  # fmt: skip
    states = np.ndarray((n_slots,), np.uint32, mm, HEADER_SIZE, (lay.slot_size,))
    q = rng.standard_normal((n_slots, dim)).astype(np.float32)
    seqs = [0] * n_slots

    def request(i: int) -> None:
        seqs[i] += 1
        off = lay.slot_offset(i)
        np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = q[i]
        REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, seqs[i], Op.RECALL, 0, k, 1, 4 * dim, 0, 0)
        states[i] = SlotState.REQUEST

    def answered(i: int) -> bool:
        """Slot ``i`` holds the answer to its last request: checked against the rows."""
        if states[i] in (SlotState.REQUEST, SlotState.BUSY):
            return False
        assert states[i] == SlotState.RESPONSE, (i, states[i], index.log)  # (not an error)
        off = lay.slot_offset(i)
        resp = Response.unpack(mm[off : off + CTL_SIZE])
        assert resp.seq == seqs[i], (i, resp)
        got = np.frombuffer(mm, np.int32, k, off + lay.rows_offset).tolist()
        assert sorted(got) == sorted(np.argsort(-(data @ q[i]))[:k].tolist()), (i, got, index.log)
        return True

    return d, index, svc, states, request, answered, lay, mm


@pytest.mark.parametrize("early", [False, True])
def test_a_batch_is_answered_once_the_sweep_has_scanned_every_range_for_it(early: bool) -> None:
    """Three requests join the sweep as one batch at the first poll; each later poll runs one
    pass; they are answered (exactly) at the fourth pass of four ranges, and not before: the
    slots stay BUSY, their answers poisoned, until then. Negative control (``early``): an
    index that reports the batch finished at once gets its poisoned answers sent, which the
    check catches."""
    d, index, _svc, states, request, answered, _lay, _mm = _rig(5)
    index.early = early
    for i in range(3):
        request(i)
    if early:
        d.poll()
        d.poll()  # answers the batch the index said was done
        with pytest.raises(AssertionError):
            answered(0)
        return
    assert d.poll() == 3
    assert index.log == ["join 3", "pass 0"], index.log
    for _ in range(3):
        assert not any(answered(i) for i in range(3))
        assert all(states[i] == SlotState.BUSY for i in range(3))
        d.poll()
    assert index.log[-2:] == ["pass 3", "leave 3"], index.log
    assert d.poll() == 3  # the next poll answers what the index finished
    assert all(answered(i) for i in range(3)), index.log
    assert [s.posts for s in d.sems[:3]] == [1, 1, 1]
    assert d.poll() == 0 and not index.sweep_busy


def test_requests_that_come_while_the_sweep_scans_join_it_at_the_next_pass() -> None:
    """A second cohort joins two passes after the first, at range 2; each is answered after
    its own four passes, in the order they leave, with its own rows."""
    d, index, _svc, _states, request, answered, _lay, _mm = _rig(6)
    for i in range(3):
        request(i)
    d.poll()
    d.poll()
    for i in range(3, 6):
        request(i)
    d.poll()  # joins at pass 2
    assert index.log == ["join 3", "pass 0", "pass 1", "join 3", "pass 2"], index.log
    d.poll()  # pass 3: the first cohort leaves
    d.poll()  # answered; pass 0
    assert all(answered(i) for i in range(3)) and not any(answered(i) for i in range(3, 6))
    d.poll()  # pass 1: the second cohort's fourth
    assert not any(answered(i) for i in range(3, 6))
    assert index.log[-2:] == ["pass 1", "leave 3"], index.log
    d.poll()
    assert all(answered(i) for i in range(3, 6)), index.log


def test_a_full_sweep_is_kept_going_until_a_batch_can_join() -> None:
    """With one lane, a batch that comes while another scans waits for it: the dispatcher
    pumps the sweep until the first leaves, then joins the second (nothing is lost)."""
    d, index, _svc, _states, request, answered, _lay, _mm = _rig(4)
    index.lanes = 1
    request(0)
    request(3)
    d.poll()
    request(1)
    request(2)
    d.poll()
    assert answered(0) and answered(3)
    assert index.log[:6] == ["join 2", "pass 0", "pass 1", "pass 2", "pass 3", "leave 2"], index.log
    assert index.log[6] == "join 2", index.log
    while index.sweep_busy:
        d.poll()
    assert answered(1) and answered(2)


def test_a_lone_query_takes_the_usual_path_unless_the_sweep_scans() -> None:
    """One query with the sweep empty is searched the usual way (sooner than a whole scan in
    ranges); one that comes while the sweep scans joins it."""
    d, index, _svc, _states, request, answered, _lay, _mm = _rig(4)
    request(0)
    d.poll()
    d.settle()
    assert answered(0) and index.log == [], index.log
    request(1)
    request(2)
    d.poll()
    request(0)
    d.poll()
    assert index.log == ["join 2", "pass 0", "join 1", "pass 1"], index.log
    while index.sweep_busy:
        d.poll()
    assert answered(0) and answered(1) and answered(2)


def test_a_write_settles_the_sweep_first() -> None:
    """An upsert that comes while batches scan settles the sweep first (the batches answered
    from the rows as they were), then is applied; the next recall joins a new sweep over the
    new rows."""
    d, index, svc, states, request, answered, lay, mm = _rig(4)
    request(0)
    request(1)
    d.poll()
    dim = svc.dim
    off = lay.slot_offset(3)
    np.frombuffer(mm, np.float32, dim, off + lay.payload_offset)[:] = 100.0  # would win every recall
    args = b'{"namespace":"","ids":["new"],"texts":["t"],"metadatas":[{}]}'
    at = off + lay.payload_offset + align8(4 * dim)
    mm[at : at + len(args)] = args
    REQUEST_STRUCT.pack_into(mm, off + REQUEST_OFFSET, 99, Op.UPSERT, 0, 0, 1, 4 * dim, len(args), 0)
    states[3] = SlotState.REQUEST
    rows_before = svc.rows.live
    d.poll()
    assert "settle" in index.log and index.log.index("settle") < index.log.index("leave 2")
    assert answered(0) and answered(1)  # from the rows before the write (the new row would have won)
    assert states[3] == SlotState.RESPONSE and svc.rows.live == rows_before + 1
    assert not index.sweep_busy


@pytest.mark.parametrize("sweeping", [True, False])
def test_reclaim_leaves_slots_in_the_sweep_alone(sweeping: bool) -> None:
    """A BUSY slot whose batch is in the sweep is not freed by reclaim, even if its owner is
    gone (the device will still write its answer there); negative control: with the sweep
    settled first, the same slot is reclaimed."""
    d, index, _svc, states, request, _answered, _lay, _mm = _rig(3)
    request(1)
    request(2)
    d.poll()
    assert states[1] == SlotState.BUSY and index.sweep_busy
    if not sweeping:
        d.settle()
        states[1] = SlotState.BUSY  # (as if the answer had not been posted: the control's point)
    with tempfile.TemporaryFile() as f:
        f.truncate(4096)
        n = d.reclaim(f.fileno())
    if sweeping:
        assert n == 0 and states[1] == SlotState.BUSY
    else:
        assert n == 2 and states[1] == SlotState.FREE  # (slot 2 too: answered, its owner gone)


def test_a_failed_answer_leaves_the_other_finished_batches_answered(caplog: pytest.LogCaptureFixture) -> None:
    """Two batches (one member each: ``max_batch`` 1) join at the same pass and leave at the
    same pass; posting the first one's answer fails: it is logged, and the second batch is
    still answered (the index hands each over once)."""
    d, index, _svc, _states, request, answered, _lay, _mm = _rig(4, max_batch=1)
    request(0)
    request(1)
    d.poll()
    assert index.log == ["join 1", "join 1", "pass 0"], index.log

    class _Broken(_Sem):
        def release(self) -> None:
            raise OSError("semaphore gone")

    d.sems[0] = _Broken()
    for _ in range(4):
        d.poll()
    assert index.log[-3:] == ["pass 3", "leave 1", "leave 1"], index.log
    assert "answering a batch of the sweep failed" in caplog.text
    assert answered(1), index.log

"""When the sidecar starts its resident GPU kernel, and what the header tells clients meanwhile.

In process, with stand-ins: a segment header in an anonymous map, a dispatcher that records
what it was asked, an index that records its starts (the kernel itself is tested on the GPU,
tests/gpu/test_gpu_doorbell.py).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar.index import NS_NONE, BellScope, CpuIndex
from kalos_retrievers.sidecar.server import Server
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import HEADER_OFFSETS, METRICS, decode_recall_args, encode_recall_args

K = HEADER_OFFSETS["doorbell_k"]  # nonzero only while the kernel runs (or is about to)


class _Index:
    doorbell_k = 1024
    doorbell_spaces = 0
    carousel_running = False

    def __init__(self, fail: bool = False) -> None:
        self.doorbell_running = False
        self.fail = fail

    def doorbell_served(self) -> int:
        return 0

    def pause_doorbell(self) -> None:
        self.doorbell_running = False


class _Service:
    def __init__(self, index: _Index, rows: bool = True) -> None:
        self.index, self.rows = index, rows

    def doorbell_useful(self) -> bool:
        return self.rows and not self.index.doorbell_running

    def resume_doorbell(self) -> None:
        if self.index.fail:
            raise RuntimeError("launch failed")
        self.index.doorbell_running = True


class _Dispatcher:
    def __init__(self, mm: mmap.mmap, waiting: int = 0, doorbells: int = 0) -> None:
        # waiting: REQUESTs; doorbells: DOORBELLs (rung after the header said the kernel runs)
        self.mm, self.n_waiting, self.n_doorbells, self.lone = mm, waiting, doorbells, 5
        self.header_at_settle: int | None = None

    def waiting(self) -> np.ndarray:
        return np.zeros(self.n_waiting + self.n_doorbells, np.intp)

    def requests_waiting(self) -> bool:
        return bool(self.n_waiting)

    def settle(self) -> int:
        self.header_at_settle = struct.unpack_from("<I", self.mm, K)[0]
        return 1

    def kernel_started(self) -> None:
        self.lone = 0


class _Seg:
    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm


def server(index: _Index, waiting: int = 0, rows: bool = True,
           doorbells: int = 0) -> tuple[Any, _Dispatcher, mmap.mmap]:  # fmt: skip
    mm = mmap.mmap(-1, 4096)
    srv: Any = Server.__new__(Server)  # only what _resume_doorbell_if_idle touches
    srv.seg, srv.service = _Seg(mm), _Service(index, rows)
    srv.dispatcher = d = _Dispatcher(mm, waiting, doorbells)
    srv._bell_idle = (0, 0)
    return srv, d, mm


def on(mm: mmap.mmap) -> int:
    """The header's doorbell_k (what clients read to ring the kernel), and doorbell_cap."""
    k, cap = struct.unpack_from("<II", mm, K)
    assert cap == _Index.doorbell_k  # the sidecar has a kernel, running or not
    return int(k)


def test_clients_are_told_it_runs_before_the_last_lone_recall_is_answered() -> None:
    """That client's next recall comes ~20 us after its answer: it must find the kernel
    announced, or it sends a REQUEST, whose service stops the kernel again."""
    index = _Index()
    srv, d, mm = server(index)
    srv._resume_doorbell_if_idle()
    assert d.header_at_settle == 1024  # announced before the answer went out
    assert index.doorbell_running and on(mm) == 1024 and d.lone == 0


def test_no_start_while_a_request_waits() -> None:
    """Negative control: a request waiting is served first (it may stop the kernel anyway),
    and a "runs" said before a lone scoped recall's answer (Dispatcher.on_start_due) is taken
    back: the header says the kernel is stopped."""
    index = _Index()
    srv, d, mm = server(index, waiting=1, doorbells=1)
    srv._publish_doorbell(True)  # (the dispatcher's on_start_due)
    assert on(mm) == 1024
    srv._resume_doorbell_if_idle()
    assert d.header_at_settle is None and not index.doorbell_running and on(mm) == 0


def test_a_doorbell_rung_after_the_header_said_it_runs_does_not_put_the_start_off() -> None:
    """The lone scoped recall that completes the lone count is answered after the header says
    the kernel runs (Dispatcher.on_start_due), so its client's next recall may already wait as
    a DOORBELL when the serve loop starts the kernel: the kernel takes it once it runs. Put
    off, the client's recall would be the sidecar's and the header would say "runs" with no
    kernel (S55-1). Control: test_no_start_while_a_request_waits."""
    index = _Index()
    srv, d, mm = server(index, doorbells=1)
    srv._publish_doorbell(True)
    srv._resume_doorbell_if_idle()
    assert d.header_at_settle == 1024 and index.doorbell_running and on(mm) == 1024 and d.lone == 0


def test_the_server_has_the_dispatcher_say_the_kernel_runs_before_a_start_due() -> None:
    """The wiring of Dispatcher.on_start_due (the test above and test_dispatcher_batch.py's
    give each side alone): a started Server's dispatcher, asked, sets the header's doorbell_k,
    and the server's next publication puts it back as the index is (stopped)."""
    from conftest import unique_name
    from kalos_retrievers.sidecar.server import ServeConfig

    srv = Server(ServeConfig(name=unique_name("due"), dim=3, metric="ip", device="cpu", slots=2))
    srv.start()
    try:
        srv.service.index.doorbell_k = 16  # a resident kernel's k, as a GpuIndex offers one (stopped)
        srv._publish_doorbell()
        assert struct.unpack_from("<II", srv.seg.mm, K) == (0, 16)
        srv.dispatcher.on_start_due()
        assert struct.unpack_from("<II", srv.seg.mm, K) == (16, 16)
        srv._publish_doorbell()
        assert struct.unpack_from("<II", srv.seg.mm, K) == (0, 16)
    finally:
        srv.close()


def test_no_start_over_an_empty_default_namespace() -> None:
    """The kernel would hand every recall back (a round trip each): not started."""
    index = _Index()
    srv, d, _ = server(index, rows=False)
    srv._resume_doorbell_if_idle()
    assert d.header_at_settle is None and not index.doorbell_running


def test_a_failed_start_is_announced_as_stopped() -> None:
    """Clients told it runs must be told it does not when the launch fails (a client waiting
    on a DOORBELL posts the sidecar's doorbell when it reads 0: test_waiting.py)."""
    index = _Index(fail=True)
    srv, d, mm = server(index)
    failed: list[bool] = []
    srv._doorbell_failed = lambda: failed.append(True)
    srv._resume_doorbell_if_idle()
    assert failed and d.header_at_settle == 1024 and not index.doorbell_running and on(mm) == 0


def test_the_header_says_whether_the_kernel_serves_namespaces() -> None:
    """``doorbell_spaces`` (v1.5): nonzero while the index has a resident kernel that serves
    namespaces, so that clients ring it with a namespace's recalls too; 0 for a kernel of the
    default namespace only, and once the kernel is given up (doorbell_k 0). ``doorbell_args``
    (v1.6): the longest args it compares where it serves filters too, 0 otherwise."""
    spaces = HEADER_OFFSETS["doorbell_spaces"]
    assert HEADER_OFFSETS["doorbell_args"] == spaces + 4
    index = _Index()
    srv, _, mm = server(index)
    srv._publish_doorbell()
    assert struct.unpack_from("<II", mm, spaces) == (0, 0)  # the control: a kernel of the default namespace
    index.doorbell_args = 128  # type: ignore[misc]  # (no namespaces served: no filters either)
    srv._publish_doorbell()
    assert struct.unpack_from("<II", mm, spaces) == (0, 0)
    index.doorbell_spaces = 8  # type: ignore[misc]
    index.doorbell_args = 0  # type: ignore[misc]  # namespaces alone (KALOS_BELL_FILTERS=0)
    srv._publish_doorbell()
    assert struct.unpack_from("<II", mm, spaces) == (8, 0)
    index.doorbell_args = 128  # type: ignore[misc]  # and filters (v1.6)
    srv._publish_doorbell()
    assert struct.unpack_from("<II", mm, spaces) == (8, 128)
    index.doorbell_k = 0  # type: ignore[misc]  # given up (_doorbell_failed)
    srv._publish_doorbell()
    assert struct.unpack_from("<II", mm, spaces) == (0, 0)


class _SpacesIndex(CpuIndex):
    """A CPU index that says it has a resident kernel serving namespaces, and records its starts.
    ``lists``: what it answers Index.wants_rows (the GPU index's answer for a selective one)."""

    doorbell_k = 16
    doorbell_spaces = 2

    def __init__(self, dim: int, lists: bool = False) -> None:
        super().__init__(dim, METRICS["ip"])
        self.starts: list[tuple[int, int, list[tuple[str, int]]]] = []
        self.scopes: list[BellScope] = []
        self.lists = lists

    def wants_rows(self, count: int, high: int) -> bool:
        return self.lists

    def resume_doorbell(self, high: int, ns: int, spaces: Sequence[BellScope] = (),
                        touched_since: Any = None) -> None:  # fmt: skip
        """(Recorded with each scope as (name, id), and as given in ``scopes``.)"""
        assert touched_since is None or touched_since(0) is not None  # (the row table's)
        self.starts.append((high, ns, [(decode_recall_args(sc.args)[0], sc.ns_id) for sc in spaces]))
        self.scopes = list(spaces)


def test_the_kernel_is_started_with_the_namespaces_recalled_alone_most_recently() -> None:
    """Service.note_bell_space keeps the index's ``doorbell_spaces`` most recent namespaces;
    each start names those that hold rows now, with their ids, the most recent first. With an
    empty default namespace, a noted namespace with rows is reason enough to start it."""
    dim = 3
    svc = Service(_SpacesIndex(dim), NullStore(), dim=dim, metric=METRICS["ip"])
    rng = np.random.default_rng()

    def add(ns: str, n: int) -> None:
        svc.upsert({"namespace": ns, "ids": [f"{ns}{i}" for i in range(n)], "texts": [""] * n,
                    "metadatas": [{} for _ in range(n)]}, rng.standard_normal((n, dim)).astype(np.float32))  # fmt: skip

    add("a", 5)
    add("b", 3)
    assert not svc.doorbell_useful()  # the default namespace is empty and nothing is noted
    svc.note_bell_space("a")
    assert svc.doorbell_useful()
    svc.note_bell_space("b")
    svc.note_bell_space("gone")  # holds no rows: noted, never named to the kernel
    svc.resume_doorbell()
    ids = {ns: svc.rows.ns_id(ns) for ns in ("a", "b")}
    assert svc.index.starts[-1] == (svc.rows.high, NS_NONE, [("b", ids["b"])])  # "a" fell out (2 kept)
    svc.note_bell_space("b")
    svc.note_bell_space("a")
    add("", 4)
    svc.resume_doorbell()
    assert svc.index.starts[-1][2] == [("a", ids["a"]), ("b", ids["b"])]
    assert svc.index.starts[-1][1] == svc.rows.ns_id("")  # the default namespace beside others: its id
    svc.delete({"namespace": "a", "ids": [f"a{i}" for i in range(5)]})
    svc.resume_doorbell()
    assert svc.index.starts[-1][2] == [("b", ids["b"])]  # emptied: not named


def test_a_filter_is_started_with_the_rows_it_keeps_as_they_are_then() -> None:
    """A noted filter (Service.note_bell_space with its args) is named to each start with the
    rows it keeps at that start, the service's kept answer: after a write into its namespace,
    the next start gets the rows as they are after it (the kernel is stopped before any
    write). A filter of no condition (``{}``) is its whole namespace; a namespace emptied is
    named no more, filter or not; and with the default namespace empty, a noted filter whose
    namespace has rows is reason enough to start the kernel."""
    dim = 3
    svc = Service(_SpacesIndex(dim), NullStore(), dim=dim, metric=METRICS["ip"])
    rng = np.random.default_rng()

    def add(ids: list[str], users: list[str]) -> None:
        vectors = rng.standard_normal((len(ids), dim)).astype(np.float32)
        svc.upsert({"namespace": "mem", "ids": ids, "texts": [""] * len(ids),
                    "metadatas": [{"user": u} for u in users]}, vectors)  # fmt: skip

    add([f"m{i}" for i in range(11)], [f"u{i % 3}" for i in range(11)])
    key = encode_recall_args("mem", b'{"user":"u1"}')
    assert not svc.doorbell_useful()
    assert not svc.note_bell_space("mem", {"user": "u1"}, key)
    assert svc.note_bell_space("mem", {"user": "u1"}, key)  # noted already
    assert svc.doorbell_useful()

    def served() -> list[str]:
        (sc,) = svc.index.scopes
        assert sc.args == key and sc.ns_id == svc.rows.ns_id("mem") and sc.rows is not None
        assert sc.seq == svc.rows.change_seq  # (the rows as of the table's last change)
        return sorted(svc.rows.ids[r] for r in sc.rows)

    svc.resume_doorbell()
    assert served() == ["m1", "m10", "m4", "m7"]
    add(["m4", "m20"], ["u2", "u1"])  # m4 leaves the filter, m20 joins it
    svc.resume_doorbell()
    assert served() == ["m1", "m10", "m20", "m7"]
    svc.delete({"namespace": "mem", "ids": ["m1"]})
    svc.resume_doorbell()
    assert served() == ["m10", "m20", "m7"]
    everything = encode_recall_args("mem", b"{}")
    svc.note_bell_space("mem", {}, everything)
    svc.resume_doorbell()
    assert svc.index.scopes[0] == BellScope(everything, svc.rows.ns_id("mem"))  # the most recent first
    svc.delete({"namespace": "mem", "all": True})
    assert not svc.doorbell_useful()
    svc.resume_doorbell()
    assert svc.index.scopes == []


def test_a_namespace_the_index_wants_as_rows_is_named_with_them() -> None:
    """Where the index wants a namespace's rows (Index.wants_rows: the GPU index where they
    would be scanned as a list), a noted namespace without a filter, or with one of no
    condition (``{}``), is named to each start with its rows as they are then, marked
    ``whole`` (the index serves it as the namespace alone where it makes no list); the
    namespace holding every row is named alone. Where the index does not want them (the
    control), the namespace is named alone."""
    dim = 3
    for lists in (True, False):
        svc = Service(_SpacesIndex(dim, lists=lists), NullStore(), dim=dim, metric=METRICS["ip"])
        vectors = np.random.default_rng().standard_normal((13, dim)).astype(np.float32)
        for ns, ids in (("docs", range(10)), ("mem", range(10, 13))):
            svc.upsert({"namespace": ns, "ids": [f"d{i}" for i in ids], "texts": [""] * len(ids),
                        "metadatas": [{}] * len(ids)}, vectors[list(ids)])  # fmt: skip
        keys = [encode_recall_args("mem", None), encode_recall_args("mem", b"{}")]
        for key, flt in zip(keys, (None, {}), strict=True):
            svc.note_bell_space("mem", flt, key)
            svc.note_bell_space("mem", flt, key)
        svc.resume_doorbell()
        mem = svc.rows.ns_id("mem")
        for sc, key in zip(svc.index.scopes, reversed(keys), strict=True):
            assert (sc.args, sc.ns_id) == (key, mem)
            if lists:
                assert sc.whole and sc.seq == svc.rows.change_seq and sc.rows.tolist() == [10, 11, 12]
            else:
                assert sc == BellScope(key, mem)
        svc.delete({"namespace": "docs", "all": True})
        svc.compact(max_moves=100)  # "mem" holds every row: no list
        svc.index.doorbell_running = False
        svc.resume_doorbell()
        assert svc.index.scopes == [BellScope(k, mem) for k in reversed(keys)]




class _Stopped(_Dispatcher):
    """A dispatcher whose kernel had answered ``answers`` recalls when it last stopped, with
    ``declines`` scoped recalls it did not take counted by then; ``lone`` lone recalls the
    kernel would take came last; ``backing`` says whether the start backs off."""

    def __init__(self, mm: mmap.mmap, answers: int, declines: int = 0, lone: int = 0) -> None:
        super().__init__(mm)
        self.answers, self.kernel_declines, self.lone = answers, declines, lone
        self.backing = self.busy = False

    def kernel_answers(self) -> int:
        return self.answers

    def backing_off(self) -> bool:
        return self.backing

    def device_busy(self) -> bool:
        return self.busy


def idle_server(answers: int = 0) -> tuple[Any, _Index, _Stopped]:
    """A server with a stopped kernel whose dispatcher says what :class:`_Stopped` says."""
    index = _Index()
    srv, _, mm = server(index)
    srv._bell_rearm, srv._bell_wanted, srv._bell_fruitless = False, False, 0
    srv.dispatcher = d = _Stopped(mm, answers, declines=3)
    return srv, index, d


def after_pass(srv: Any, *, stopped: bool = False, lone: int | None = None, declined: bool = False) -> None:
    """``_after_pass`` as the serve loop calls it after a pass that worked: ``stopped`` the
    kernel, left ``lone`` lone recalls counted (None: as before it), ``declined`` a scoped
    recall."""
    d = srv.dispatcher
    before, lone_before = d.kernel_declines, d.lone
    if lone is not None:
        d.lone = lone
    d.kernel_declines += declined
    srv._after_pass(d, stopped, before, lone_before)


def stopped(answers: int, declined: bool = False, fruitless: int = 0) -> tuple[Any, _Index]:
    """A server after a write's pass stopped the kernel, which had answered ``answers``;
    ``fruitless`` runs before it had answered nothing."""
    srv, index, _ = idle_server(answers)
    srv._bell_fruitless = fruitless
    after_pass(srv, stopped=True, declined=declined)
    return srv, index


MS = 1_000_000
FAR = 20_000 * MS  # a time long after the last work


@pytest.fixture(autouse=True)
def _rearm_1ms(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import kalos_retrievers.sidecar.server as server_module

    monkeypatch.setattr(server_module, "BELL_REARM_NS", 1 * MS)


def test_a_kernel_a_write_stopped_is_restarted_once_the_sidecar_is_idle() -> None:
    """An agent recalls, writes a memory, and recalls again a turn later: the write stops the
    kernel, and without the restart only 4 lone recalls in a row would start it again, so an
    agent writing between its recalls would never find it running. Restarted after
    ``BELL_REARM_NS`` idle, not before (back-to-back traffic must not wait for a start), once."""
    srv, index = stopped(answers=5)
    last = 10_000 * MS
    assert not srv._rearm_bell(last + MS - 1, last) and not index.doorbell_running  # not yet
    assert srv._rearm_bell(last + MS, last) and index.doorbell_running and on(srv.seg.mm) == 1024
    index.doorbell_running = False  # (stopped again by something that is not a pass)
    assert not srv._rearm_bell(last + 5 * MS, last) and not index.doorbell_running  # once


def test_a_lone_recall_then_a_write_then_an_idle_spell_starts_the_kernel() -> None:
    """The memory store's turn: a search (a lone recall the kernel would take, answered by the
    sidecar), an add right after it (lone back to 0, nothing to stop), then the model's turn:
    the kernel is started in that pause, so the next search is its. Not before
    ``BELL_REARM_NS`` idle; once."""
    srv, index, _ = idle_server()
    after_pass(srv, lone=1)  # the search
    after_pass(srv, lone=0)  # the add
    assert srv._rearm_pending() and not srv._rearm_bell(MS - 1, 0) and not index.doorbell_running
    assert srv._rearm_bell(MS, 0) and index.doorbell_running
    index.doorbell_running = False
    assert not srv._rearm_pending() and not srv._rearm_bell(5 * MS, 0)  # once, until the next recall
    after_pass(srv, lone=1)
    assert srv._rearm_bell(7 * MS, 6 * MS) and index.doorbell_running


def test_restarts_after_runs_that_answered_nothing_stop_after_two() -> None:
    """A kernel that answered nothing since its start is restarted after a write too (a start
    after a search, then the add: the next search would have been its first), but not after
    ``BELL_FRUITLESS_MAX`` such runs in a row (writes alone, a pause between each, would
    otherwise restart it after every one). A run that answered, or a lone recall the kernel
    would take, starts the count over."""
    for fruitless, restarts in ((0, True), (1, False)):
        srv, index = stopped(answers=0, fruitless=fruitless)
        assert srv._rearm_bell(FAR, 0) == restarts and index.doorbell_running == restarts
    srv, index = stopped(answers=1, fruitless=5)
    assert srv._bell_fruitless == 0 and srv._rearm_bell(FAR, 0) and index.doorbell_running
    srv, index, _ = idle_server(answers=0)
    srv._bell_fruitless = 5
    after_pass(srv, lone=1)  # a recall the kernel would take, answered by the sidecar
    assert srv._bell_fruitless == 0
    srv._bell_wanted = False
    after_pass(srv, stopped=True)  # then a write stopped a run that answered nothing: restarted
    assert srv._bell_rearm and srv._rearm_bell(FAR, 0) and index.doorbell_running


def test_a_scoped_recall_the_kernel_did_not_take_cancels_the_starts_on_idle(monkeypatch) -> None:
    """Negative controls: a stop for a scoped recall the kernel did not take is the start's
    back-off's (Dispatcher.lone_enough), which a start on idle would undo, and it is not
    counted as a fruitless run (a first, unserved filter's stop would use up the restarts an
    agent's writes need); ``KALOS_BELL_REARM_MS=0`` turns every start on idle off."""
    import kalos_retrievers.sidecar.server as server_module

    srv, index = stopped(answers=0, declined=True, fruitless=1)
    assert srv._bell_fruitless == 1 and not srv._bell_rearm and not srv._bell_wanted
    assert not srv._rearm_bell(FAR, 0) and not index.doorbell_running
    monkeypatch.setattr(server_module, "BELL_REARM_NS", 0)
    for srv, index in (stopped(answers=5), idle_server()[:2]):
        after_pass(srv, lone=1)
        assert not srv._rearm_pending() and not srv._rearm_bell(FAR, 0) and not index.doorbell_running


def test_requests_served_beside_the_kernel_do_not_ask_for_a_start_again() -> None:
    """Stats or a ping after a lone recall leave the dispatcher's lone count as it was: once
    the start that recall asked for was tried (here: skipped, backing off) or cancelled by a
    decline, they do not ask for it again (the kernel would hold every SM for 5 s for nothing)."""
    srv, index, d = idle_server()
    d.backing = True
    after_pass(srv, lone=1)  # the recall
    assert not srv._rearm_bell(FAR, 0)  # tried: backing off
    d.backing = False
    after_pass(srv)  # a stats request: lone still 1
    assert not srv._rearm_pending() and not srv._rearm_bell(2 * FAR, FAR) and not index.doorbell_running
    after_pass(srv, lone=2)  # another lone recall does ask
    assert srv._rearm_bell(3 * FAR, 2 * FAR) and index.doorbell_running


def test_no_start_on_idle_while_the_start_backs_off() -> None:
    """After a lone recall, while scoped recalls the kernel did not take keep the start
    backing off: no start, and none tried again in the same idle spell (no spin on the
    check). A restart a write's stop asked for is not the back-off's (the kernel was running)."""
    srv, index, d = idle_server()
    d.backing = True
    after_pass(srv, lone=1)
    assert not srv._rearm_bell(FAR, 0) and not index.doorbell_running and not srv._rearm_pending()
    srv, index = stopped(answers=5)
    srv.dispatcher.backing = True
    assert srv._rearm_bell(FAR, 0) and index.doorbell_running


def test_no_start_on_idle_while_the_device_is_busy_or_a_carousel_runs() -> None:
    """A crowd's carousel (starting the kernel stops it) or a batch in flight (the start would
    settle it early): nothing is started on idle while either is there, and a carousel running
    after a pass cancels the starts asked for before it."""
    srv, index = stopped(answers=5)
    srv.dispatcher.busy = True
    assert not srv._rearm_pending() and not srv._rearm_bell(FAR, 0) and not index.doorbell_running
    srv.dispatcher.busy = False
    assert srv._rearm_pending()  # (still asked for once the batch is answered)
    index.carousel_running = True
    assert not srv._rearm_pending()
    after_pass(srv, lone=1)  # a pass with the carousel running
    index.carousel_running = False
    assert not srv._bell_rearm and not srv._bell_wanted and not srv._rearm_bell(FAR, 0)


def test_a_restart_due_while_a_request_waits_is_left_to_the_lone_recalls() -> None:
    """A request waiting when the start falls due is served first (as for any start); the
    start is not tried again: the lone recalls start the kernel from there."""
    srv, index = stopped(answers=5)
    srv.dispatcher.n_waiting = 1
    assert srv._rearm_bell(2 * MS, 0) and not index.doorbell_running and not srv._bell_rearm
    srv.dispatcher.n_waiting = 0
    assert not srv._rearm_bell(4 * MS, 0) and not index.doorbell_running


def test_a_start_by_lone_recalls_clears_the_starts_asked_for() -> None:
    srv, index = stopped(answers=5)
    after_pass(srv, lone=4)
    srv._resume_doorbell_if_idle()  # (the serve loop's start after 4 lone recalls)
    assert index.doorbell_running and not srv._bell_rearm and not srv._bell_wanted


def test_an_index_without_a_resident_kernel_never_waits_for_a_start() -> None:
    """A CPU sidecar: no start pending, so its serve loop sleeps as long as it would."""
    srv, index, _ = idle_server()
    after_pass(srv, lone=1)
    index.doorbell_k = 0
    assert not srv._rearm_pending()


def test_answers_settled_on_the_way_to_sleep_move_the_idle_spells_start(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Answers ``_settle`` posts as the serve loop goes to sleep (a batch queued behind another)
    are work too: they stamp ``_bell_answered``, from which (with the loop's last work) the idle
    spell before a start is counted, so the start comes 1 ms after them, not 1 ms after the
    pass. The negative control: a settle that answered nothing leaves the stamp."""
    import kalos_retrievers.sidecar.server as server_module

    clock = {"ns": 50 * MS}
    monkeypatch.setattr(server_module.time, "monotonic_ns", lambda: clock["ns"])
    srv, index, d = idle_server(answers=5)
    srv._bell_answered = 0
    after_pass(srv, stopped=True)  # a write stopped the kernel at 49 ms (the pass's work)
    last_work = 49 * MS
    assert srv._settle(d) == 1 and srv._bell_answered == 50 * MS  # answers posted at 50 ms
    quiet_since = max(last_work, srv._bell_answered)  # (as serve_forever counts it)
    assert not srv._rearm_bell(50 * MS + MS - 1, quiet_since) and not index.doorbell_running
    assert srv._rearm_bell(51 * MS, quiet_since) and index.doorbell_running
    clock["ns"] = 60 * MS
    d.settle = lambda crowd=True: 0  # type: ignore[method-assign]
    assert srv._settle(d) == 0 and srv._bell_answered == 50 * MS

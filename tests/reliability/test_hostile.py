"""Scenario 9: a hostile client writes whatever it likes into its own slots.

The test process claims six of eight slots by taking their locks: two it attacks from (2 and
5), four it leaves idle as guards around them (1, 3, 4, 6); two honest clients (a recaller
checking every answer, a writer checking read-your-writes) get the remaining slots. The attack
loops for the configured time: random control words, adversarial values (huge k, counts,
offsets, lengths whose products overflow, unknown ops and flags, past and far deadlines),
garbage, deeply nested or non-UTF-8 args, NaN vectors, and valid requests whose fields and
payload are rewritten while the sidecar reads them.

Pass: the sidecar never crashes; the header and the guard slots are bit-for-bit unchanged (it
never writes outside the slot it answers); every answer's length fits the slot; the honest clients
see no error and no wrong answer, and keep being served throughout; the sidecar counts the
refused requests (``stats()["rejected_requests"]``); nothing NaN was stored.

Deterministic companions (an in-process dispatcher) pin down the two cross-client faults the
attack found: one member of a batched recall failing its neighbours, and a vector checked for
NaN in the slot but copied after the client rewrote it.

Negative controls: a sidecar that writes one byte past the slot it answers, and one that dies on
a bad request, both fail the harness; the in-process checks detect the pre-fix batch and an
injected NaN.
"""

from __future__ import annotations

import mmap
import struct
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import service as service_mod
from kalos_retrievers.sidecar.dispatcher import Dispatcher
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.stats import Stats
from kalos_retrievers.sidecar.store import NullStore
from reliability._harness import (
    Counters,
    SegmentView,
    figure,
    fork_worker,
    open_doorbell,
    scale,
)
from reliability._workers import (
    ERR,
    HONEST_STRIDE,
    OK,
    WRONG,
    dataset,
    honest_recaller,
    honest_writer,
    load_dataset,
)

from kalos_retrievers import KalosClient, Sidecar, _ipc
from kalos_retrievers.protocol import (
    CTL_SIZE,
    REQUEST_OFFSET,
    REQUEST_STRUCT,
    RESPONSE_OFFSET,
    STATUS_NAMES,
    Invalid,
    Layout,
    Metric,
    Op,
    Response,
    SlotState,
    Status,
    align8,
    decode_doc,
    decode_docs_blob,
    encode_json,
)

pytestmark = pytest.mark.reliability

DIM, N = 8, 200
DURATION = scale(8.0, 600.0)
HOSTILE, GUARDS = (2, 5), (1, 3, 4, 6)
STOP_AT = 60
U64 = 2**64 - 1
EDGES = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 1023, 1024, 1025, 8191, 8192, 8193, 2**16, 2**31 - 1,
         2**31, 2**32 - 1]  # fmt: skip
EDGES64 = [*EDGES, 2**32, 2**32 + 4, 2**62, 2**63 - 1, 2**63, U64 - 7, U64]


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def _args_pool() -> list[bytes]:
    """Args a fuzzer rarely finds: structured, wrong in one way each. Every structured one
    names the hostile's own namespace "evil" (the attack must not be a legitimate delete of the
    honest clients' data)."""
    ns = b'"namespace":"evil"'
    return [
        b"", b"{}", b"null", b"[]", b"\xff\xfe\xfd", b"\xed\xa0\x80", deep(3000),
        b'{' + ns + b',"a":' + deep(3000) + b"}",
        b'{' + ns + b',"ids":["a","b"],"texts":["t"],"metadatas":[{}]}',
        b'{' + ns + b',"ids":["a"],"texts":["t"],"metadatas":[{}]}',
        b'{' + ns + b',"ids":["' + b"x" * 600 + b'"],"texts":["t"],"metadatas":[{}]}',
        b'{' + ns + b',"ids":[1],"texts":[2],"metadatas":[3]}',
        b'{' + ns + b',"ids":"notalist"}', b'{' + ns + b',"all":true}',
        b'{"namespace":5}', b'{"namespace":"' + b"n" * 300 + b'"}',
        b'{' + ns + b',"limit":-1}', b'{' + ns + b',"limit":1000000000000000000,"offset":7}',
        b'{' + ns + b',"filter":{"a":{"$regex":"x"}}}', b'{' + ns + b',"filter":{"$or":5}}',
        b'{' + ns + b',"filter":' + b'{"$not":' * 50 + b'{"a":1}' + b"}" * 50 + b"}",
        b'{' + ns + b',"filter":{"a":{"$gt":1' + b"0" * 5000 + b'}}}',
        b'{' + ns + b',"filter":{"a":{"$gt":NaN}}}', b'{' + ns + b',"x":Infinity}',
        struct.pack("<H", 65535) + b"evil",
        struct.pack("<H", 4) + b"evil" + struct.pack("<I", 2**32 - 1) + b"{}",
        struct.pack("<H", 4) + b"evil" + struct.pack("<I", 2) + b"{}",
        struct.pack("<H", 4) + b"evil" + struct.pack("<I", 6000) + deep(3000),
        struct.pack("<H", 4) + b"\xff\xfe\xfd\xfc" + struct.pack("<I", 0),
    ]  # fmt: skip


ARGS = _args_pool()


class Attack:
    """One hostile client's view: builds requests in its slots and reads what comes back."""

    def __init__(self, view: SegmentView, seed: int) -> None:
        self.v = view
        self.lay = view.layout
        self.rng = np.random.default_rng(seed)
        self.bell = open_doorbell(view.name)
        self.sent = self.answered = self.errors = self.unanswered = 0
        self.statuses: dict[str, int] = {}
        self.modes: dict[str, int] = {}
        self.violations: list[str] = []

    def pick(self, values: list[Any]) -> Any:
        """A uniform choice that keeps Python ints exact (numpy would turn 2**64 - 1 into a
        float)."""
        return values[int(self.rng.integers(len(values)))]

    def _vectors(self, n: int) -> np.ndarray:
        r = self.rng
        kind = int(r.integers(6))
        v = r.standard_normal((n, DIM)).astype(np.float32)
        if kind == 1:
            v[int(r.integers(n)), int(r.integers(DIM))] = np.nan
        elif kind == 2:
            v[:] = np.inf
        elif kind == 3:
            v[:] = 0
        elif kind == 4:
            v[:] = np.float32(3e38) * np.sign(v)
        return v

    def _valid(self, seq: int, now: int) -> tuple[tuple[int, ...], bytes]:
        r = self.rng
        op = self.pick([Op.RECALL, Op.RECALL, Op.UPSERT, Op.GET, Op.SCAN, Op.COUNT, Op.DELETE,
                        Op.PING, Op.STATS, Op.NAMESPACES])  # fmt: skip
        n, k, vec_b, args = 0, 0, b"", b""
        if op == Op.RECALL:
            n, k = int(r.integers(1, 4)), int(r.integers(1, 20))
            vec_b = r.standard_normal((n, DIM)).astype(np.float32).tobytes()
            if r.random() < 0.5:
                flt = encode_json({"i": {"$gte": 0}})
                args = struct.pack("<H", 4) + b"evil" + struct.pack("<I", len(flt)) + flt
        elif op == Op.UPSERT:
            n = int(r.integers(1, 4))
            vec_b = r.standard_normal((n, DIM)).astype(np.float32).tobytes()
            args = encode_json({"namespace": "evil", "ids": [f"e{int(r.integers(50))}" for _ in range(n)],
                                "texts": ["t"] * n, "metadatas": [{"i": j} for j in range(n)]})  # fmt: skip
        elif op in (Op.GET, Op.DELETE):
            args = encode_json({"namespace": "evil", "ids": [f"e{int(r.integers(50))}"]})
        elif op in (Op.SCAN, Op.COUNT):
            args = encode_json({"namespace": "evil", "filter": {"i": {"$lt": 2}}})
        payload = vec_b + b"\x00" * (align8(len(vec_b)) - len(vec_b)) + args
        return (seq, op, 0, k, n, len(vec_b), len(args), now + 10**9), payload

    def _write(self, h: int, fields: tuple[int, ...], payload: bytes) -> None:
        off = self.lay.slot_offset(h)
        p0 = off + CTL_SIZE
        self.v.mm[p0 : p0 + len(payload)] = payload
        REQUEST_STRUCT.pack_into(self.v.mm, off + REQUEST_OFFSET, *fields)

    def one(self) -> None:
        r, lay = self.rng, self.lay
        h = self.pick(list(HOSTILE))
        off = lay.slot_offset(h)
        mode = self.pick(["random", "adversarial", "racy", "nan-batch", "state"])
        self.modes[mode] = self.modes.get(mode, 0) + 1
        seq = int(r.integers(1, 2**62))
        now = time.monotonic_ns()
        if mode == "state":  # a state word no protocol step writes, left there a moment
            struct.pack_into("<I", self.v.mm, off, self.pick([6, 7, 99, 2**32 - 1, SlotState.BUSY]))
            time.sleep(0.001)
            struct.pack_into("<I", self.v.mm, off, SlotState.FREE)
            return
        if mode == "random":
            raw = r.bytes(REQUEST_STRUCT.size)
            payload = r.bytes(int(r.integers(0, 4096)))
            fields = REQUEST_STRUCT.unpack(raw)
            fields = (seq, *fields[1:])
        elif mode == "nan-batch":  # a plain k=1 recall (batched with the honest recaller's) with NaN
            v = r.standard_normal((1, DIM)).astype(np.float32)
            v[0, int(r.integers(DIM))] = np.nan
            payload = v.tobytes()
            fields = (seq, Op.RECALL, 0, 1, 1, len(payload), 0, now + 10**9)
        elif mode == "racy":  # a valid request, rewritten below while the sidecar reads it
            fields, payload = self._valid(seq, now)
        else:
            op = self.pick([*range(1, 11), 0, 11, 255, 2**32 - 1])
            n = self.pick(EDGES) if mode == "adversarial" else int(r.integers(1, 4))
            k = self.pick(EDGES) if mode == "adversarial" else int(r.integers(1, 20))
            vecs = self._vectors(max(1, min(n, 64))) if op in (Op.RECALL, Op.UPSERT) else None
            args = ARGS[int(r.integers(len(ARGS)))]
            vec_b = b"" if vecs is None else vecs.tobytes()
            payload = vec_b + b"\x00" * (align8(len(vec_b)) - len(vec_b)) + args
            vec_len = len(vec_b) if mode == "racy" else self.pick([len(vec_b), *EDGES64])
            args_len = len(args) if mode == "racy" else self.pick([len(args), *EDGES64])
            flags = self.pick([0, 1, 2, 3, 4, 2**31, 2**32 - 1])
            deadline = self.pick([0, 1, now + 10**9, U64])
            fields = (seq, op, flags, k, n, vec_len, args_len, deadline)
        payload = payload[: lay.payload_size]
        self._write(h, fields, payload)
        struct.pack_into("<I", self.v.mm, off, SlotState.REQUEST)
        _ipc.post(self.bell)
        self.sent += 1
        if mode == "racy":  # rewrite the request while the sidecar may be reading it
            start = time.monotonic_ns() + int(r.integers(0, 300_000))
            while time.monotonic_ns() < start and self.v.states[h] == SlotState.REQUEST:
                pass
            end = time.monotonic_ns() + int(r.integers(0, 500_000))
            p0 = off + CTL_SIZE
            while time.monotonic_ns() < end:
                what = int(r.integers(3))
                if what == 0:
                    # Writes keep their args intact: a flipped byte could turn "namespace" into
                    # another key, and the write would legitimately land in the honest clients'
                    # default namespace. Their vectors are fair game.
                    span = fields[5] if fields[1] in (Op.UPSERT, Op.DELETE) else len(payload)
                    if span:
                        self.v.mm[p0 + int(r.integers(0, span))] = int(r.integers(256))
                elif what == 1:
                    struct.pack_into("<f", self.v.mm, p0 + 4 * int(r.integers(DIM)), np.nan)
                else:
                    word = REQUEST_OFFSET + 8 + 4 * int(r.integers(4))  # op, flags, top_k, n_items
                    struct.pack_into("<I", self.v.mm, off + word, self.pick(EDGES))
        self._collect(h, seq)

    def _collect(self, h: int, seq: int) -> None:
        off = self.lay.slot_offset(h)
        deadline = time.monotonic() + 1.0
        while self.v.states[h] not in (SlotState.RESPONSE, SlotState.ERROR):
            if time.monotonic() > deadline:
                self.unanswered += 1
                struct.pack_into("<I", self.v.mm, off, SlotState.FREE)
                return
            time.sleep(0.0001)
        resp = Response.unpack(self.v.mm, off + RESPONSE_OFFSET)
        self.answered += 1
        name = STATUS_NAMES.get(resp.status, f"?{resp.status}")
        self.statuses[name] = self.statuses.get(name, 0) + 1
        if resp.status not in STATUS_NAMES:
            self.violations.append(f"unknown status {resp.status}")
        if resp.resp_len > self.lay.blob_size:
            self.violations.append(f"response length {resp.resp_len} exceeds the slot's blob")
        if self.v.states[h] == SlotState.ERROR:
            self.errors += 1
        struct.pack_into("<I", self.v.mm, off, SlotState.FREE)


def run_hostile(sc: Sidecar, duration: float, seed: int) -> dict[str, Any]:
    name = sc.name
    with KalosClient(name, dim=DIM, spin_us=0) as c:
        load_dataset(c, N, DIM)
        rejected0 = c.stats()["rejected_requests"]
    batches = None
    view = SegmentView(name)
    for i in (*HOSTILE, *GUARDS):
        assert _ipc.try_lock(view.fd, _ipc.slot_lock_byte(i)), f"slot {i} is taken"
    counters = Counters()
    honest = [fork_worker(honest_recaller, name, DIM, N, counters, 0, seed, STOP_AT),
              fork_worker(honest_writer, name, DIM, counters, HONEST_STRIDE, STOP_AT, seed + 1)]  # fmt: skip
    bases = (0, HONEST_STRIDE)
    attack = Attack(view, seed)
    violations = attack.violations
    guard0 = view.digest(GUARDS)
    stalls = 0
    try:
        t_end = time.monotonic() + duration
        next_check = time.monotonic() + 0.5
        oks = [counters[b + OK] for b in bases]
        while time.monotonic() < t_end:
            attack.one()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                if sc.proc is not None and sc.proc.poll() is not None:
                    violations.append(f"the sidecar died (exit code {sc.proc.returncode})")
                    break
                if view.digest(GUARDS) != guard0:
                    violations.append("the header or a guard slot changed: the sidecar wrote "
                                      "outside the slot it answered")  # fmt: skip
                    break
                now_ok = [counters[b + OK] for b in bases]
                stalls += sum(a == b for a, b in zip(now_ok, oks, strict=True))
                oks = now_ok
    finally:
        counters[STOP_AT] = 1
        out = [w.result(30) for w in honest]
        for i in (*HOSTILE, *GUARDS):
            _ipc.unlock(view.fd, _ipc.slot_lock_byte(i))
    if view.digest(GUARDS) != guard0 and not any("guard" in v for v in violations):
        violations.append("the header or a guard slot changed")
    view.close()
    if stalls:
        violations.append(f"an honest client made no progress in {stalls} half-second windows")
    for b, o in zip(bases, out, strict=True):
        if counters[b + ERR] or counters[b + WRONG]:
            violations.append(f"honest client {b}: {counters[b + ERR]} errors {o['errors'][:2]}, "
                              f"{counters[b + WRONG]} wrong answers")  # fmt: skip
    rejected = None
    if sc.proc is None or sc.proc.poll() is None:
        with KalosClient(name, dim=DIM, spin_us=0) as c:
            c.ping()
            st = c.stats()
            rejected = st["rejected_requests"] - rejected0
            batches = st["batches"]
            if rejected < attack.errors or not rejected:
                violations.append(f"stats counted {rejected} rejected requests, the attacker saw "
                                  f"{attack.errors} refusals")  # fmt: skip
            evil = c.scan(namespace="evil", limit=10**6, with_vectors=True)
            bad = [r.id for r in evil if not np.all(np.isfinite(r.vector)) or not np.any(r.vector)]
            if bad:
                violations.append(f"stored non-finite or zero vectors: {bad[:5]}")
            if c.count(namespace="") != N:
                violations.append(f"the honest namespace holds {c.count(namespace='')} rows, not {N}")
    elif not any("died" in v for v in violations):
        violations.append(f"the sidecar died (exit code {sc.proc.returncode})")
    # what the INTERNAL answers were (each is logged with its traceback): for the report
    log = sc.log_path.read_text(errors="replace") if sc.log_path.exists() else ""
    internal = sorted({tb.strip().splitlines()[-1] for tb in log.split("Traceback")[1:] if tb.strip()})
    return {
        "duration_s": duration, "violations": violations, "hostile_sent": attack.sent,
        "internal_errors": internal[:10],
        "answered": attack.answered, "unanswered": attack.unanswered, "refused": attack.errors,
        "rejected_counted": rejected, "batches": batches, "statuses": attack.statuses, "modes": attack.modes,
        "honest_ok": [counters[b + OK] for b in bases],
    }  # fmt: skip


def test_hostile_client_cannot_hurt_sidecar_or_neighbours(launch: Callable[..., Sidecar]) -> None:
    sc = launch(slots=8)
    out = run_hostile(sc, DURATION, seed=31)
    figure("9 hostile client", **out)
    assert not out["violations"], out["violations"]
    assert out["unanswered"] <= out["hostile_sent"] // 100, out


@pytest.mark.parametrize(("patch", "word"), [("write_outside", "guard"), ("crash_on_bad_request", "died"),
                                           ("pre_fix_batch", "honest client")])  # fmt: skip
def test_hostile_negative_controls(launch: Callable[..., Sidecar], patch: str, word: str) -> None:
    sc = launch(slots=8, patch=patch)
    out = run_hostile(sc, 2.0, seed=32)
    assert any(word in v for v in out["violations"]), out


# ---------------------------------------------------------------------------------------------
# In-process dispatcher: deterministic versions of the races the attack exercises


class _Sem:
    def __init__(self) -> None:
        self.posts = 0

    def release(self) -> None:
        self.posts += 1


class Rig:
    """A Dispatcher over an anonymous mapping, with N rows, driven by hand."""

    def __init__(self, slots: int = 4) -> None:
        self.lay = Layout(n_slots=slots, dim=DIM, max_k=16, payload_size=8192, blob_size=8192)
        self.mm = mmap.mmap(-1, self.lay.segment_size)
        self.svc = Service(CpuIndex(DIM, Metric.COSINE), NullStore(), dim=DIM, metric=Metric.COSINE)
        self.data = dataset(N, DIM)
        self.svc.upsert({"namespace": "", "ids": [str(i) for i in range(N)], "texts": ["t"] * N,
                         "metadatas": [{}] * N}, self.data)  # fmt: skip
        self.sems = [_Sem() for _ in range(slots)]
        self.d = Dispatcher(self.mm, self.lay, self.sems, self.svc, Stats(), describe=dict)

    def request(self, i: int, op: int, vecs: np.ndarray | None = None, args: bytes = b"",
                k: int = 0, n: int = 0) -> None:  # fmt: skip
        off = self.lay.slot_offset(i)
        vb = b"" if vecs is None else np.ascontiguousarray(vecs, "<f4").tobytes()
        p0 = off + CTL_SIZE
        self.mm[p0 : p0 + len(vb)] = vb
        a0 = p0 + align8(len(vb))
        self.mm[a0 : a0 + len(args)] = args
        REQUEST_STRUCT.pack_into(self.mm, off + REQUEST_OFFSET, 7, op, 0, k, n, len(vb), len(args), 0)
        struct.pack_into("<I", self.mm, off, SlotState.REQUEST)

    def answer(self, i: int) -> tuple[int, int, bytes]:
        off = self.lay.slot_offset(i)
        state = struct.unpack_from("<I", self.mm, off)[0]
        resp = Response.unpack(self.mm, off + RESPONSE_OFFSET)
        b0 = off + self.lay.blob_offset
        return state, resp.status, bytes(self.mm[b0 : b0 + resp.resp_len])

    def honest_ok(self, i: int, want_id: str) -> bool:
        state, status, blob = self.answer(i)
        if state != SlotState.RESPONSE or status != Status.OK or self.sems[i].posts != 1:
            return False
        docs, _ = decode_docs_blob(blob, DIM, False)
        return [decode_doc(d).id for d in docs] == [want_id]


def _batch_with_nan_member(rig: Rig) -> bool:
    rig.request(0, Op.RECALL, rig.data[3:4], k=1, n=1)
    bad = rig.data[4:5].copy()
    bad[0, 2] = np.nan
    rig.request(1, Op.RECALL, bad, k=1, n=1)
    rig.d.poll()
    rig.d.settle()  # a batch may stay in flight after poll()
    return rig.honest_ok(0, "3") and rig.answer(1)[:2] == (SlotState.ERROR, Status.BAD_REQUEST)


def _batch_with_rows_rewritten(rig: Rig, monkeypatch: pytest.MonkeyPatch, value: int) -> bool:
    def search_then_hostile_write(real: Any) -> Any:
        def search(specs: Any, *a: Any, **kw: Any) -> int:
            kk = real(specs, *a, **kw)
            specs[1].rows[0, 0] = value  # the hostile rewrites its own result row mid-answer
            return kk

        return search

    # the pipelined dispatcher launches (the CPU index searches at once); the old one searched
    monkeypatch.setattr(rig.svc, "launch_recall", search_then_hostile_write(rig.svc.launch_recall))
    monkeypatch.setattr(rig.svc, "recall_slots", search_then_hostile_write(rig.svc.recall_slots))
    rig.request(0, Op.RECALL, rig.data[3:4], k=1, n=1)
    rig.request(1, Op.RECALL, rig.data[4:5], k=1, n=1)
    rig.d.poll()
    rig.d.settle()
    return rig.honest_ok(0, "3") and rig.answer(1)[0] == SlotState.ERROR


def _old_recall_batch(self: Dispatcher, part: Any, k: int, flags: int) -> None:
    """The dispatcher's batch as it was before the fix (the negative control), inside the
    error handling its caller had: one failure answered every member with the error."""
    try:
        specs = [self._spec(i, req) for i, req, _ in part]
        kk = self.service.recall_slots(specs, k, "", None)
        for (i, req, t0), spec in zip(part, specs, strict=True):
            self._write_hits(i, req, spec, kk, flags, t0)
    except Invalid as e:
        for i, req, t0 in part:
            self._error(i, req, e.status, str(e), t0)


def test_batched_recall_member_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _batch_with_nan_member(Rig())
    assert _batch_with_rows_rewritten(Rig(), monkeypatch, 10**6)  # out of range
    rig = Rig()
    rig.svc.delete({"namespace": "", "ids": ["150"]})
    assert _batch_with_rows_rewritten(rig, monkeypatch, 150)  # a row that holds nothing now


def test_batched_recall_negative_control_pre_fix_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Dispatcher, "_pipeline", _old_recall_batch)
    assert not _batch_with_nan_member(Rig())
    assert not _batch_with_rows_rewritten(Rig(), monkeypatch, 10**6)


def _upsert_with_late_nan(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """An upsert whose vector the client turns into NaN right after the sidecar's NaN check
    (the check is made to trigger the write: the worst possible timing)."""
    off = rig.lay.slot_offset(2) + CTL_SIZE

    def isfinite_then_hostile_write(x: Any, *a: Any, **kw: Any) -> Any:
        out = np.isfinite(x, *a, **kw)
        struct.pack_into("<f", rig.mm, off, np.nan)
        return out

    fake_np = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    fake_np.isfinite = isfinite_then_hostile_write
    monkeypatch.setattr(service_mod, "np", fake_np)
    args = encode_json({"namespace": "evil", "ids": ["e"], "texts": ["t"], "metadatas": [{}]})
    rig.request(2, Op.UPSERT, np.ones((1, DIM), np.float32), args=args, n=1)
    rig.d.poll()
    monkeypatch.undo()
    rows = rig.svc.get({"namespace": "evil", "ids": ["e"]})
    return rig.svc.vectors(rows)


def test_upsert_vector_rewritten_after_check_is_never_stored_as_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    vecs = _upsert_with_late_nan(Rig(), monkeypatch)
    assert len(vecs) == 0 or np.all(np.isfinite(vecs)), vecs


def test_upsert_nan_negative_control_injected_nan_is_detected() -> None:
    rig = Rig()
    rig.request(2, Op.UPSERT, np.ones((1, DIM), np.float32), n=1,
                args=encode_json({"namespace": "evil", "ids": ["e"], "texts": ["t"], "metadatas": [{}]}))  # fmt: skip
    rig.d.poll()
    rows = rig.svc.get({"namespace": "evil", "ids": ["e"]})
    rig.svc.index.data[rows[0], 1] = np.nan  # the fault the check above exists to catch
    vecs = rig.svc.vectors(rows)
    assert not np.all(np.isfinite(vecs))


def _stored_vector_of_huge_upsert(rig: Rig) -> np.ndarray:
    huge = np.full((1, DIM), 3e38, np.float32)
    huge[0, 1] = -3e38
    args = encode_json({"namespace": "evil", "ids": ["big"], "texts": ["t"], "metadatas": [{}]})
    rig.request(3, Op.UPSERT, huge, args=args, n=1)
    rig.d.poll()
    return rig.svc.vectors(rig.svc.get({"namespace": "evil", "ids": ["big"]}))


def test_huge_finite_vector_is_stored_normalized() -> None:
    """Components near float32's maximum are finite and valid; squaring them in float32
    overflowed, so the stored (cosine-normalized) vector came out all zeros."""
    vecs = _stored_vector_of_huge_upsert(Rig())
    assert len(vecs) == 1 and np.all(np.isfinite(vecs)) and abs(np.linalg.norm(vecs[0]) - 1) < 1e-5, vecs


def test_huge_vector_negative_control_float32_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    def float32_norm(x: np.ndarray) -> np.ndarray:  # normalize_rows as it was
        with np.errstate(over="ignore"):
            n = np.linalg.norm(x, axis=1, keepdims=True)
        return (x / np.where(n == 0, 1, n)).astype(np.float32, copy=False)

    monkeypatch.setattr(service_mod, "normalize_rows", float32_norm)
    vecs = _stored_vector_of_huge_upsert(Rig())
    assert not (np.all(np.isfinite(vecs)) and np.all(np.abs(np.linalg.norm(vecs, axis=1) - 1) < 1e-5))


def test_guard_slots_surround_the_hostile_ones() -> None:
    """Sanity of the harness: a write past either end of a hostile slot lands in a guard."""
    assert not set(HOSTILE) & set(GUARDS)
    assert all(h - 1 in GUARDS and h + 1 in GUARDS for h in HOSTILE)

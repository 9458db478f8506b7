"""``Service.eligible_for`` with a key: a filter's candidate rows kept, and brought up to date
from the rows each change touched once a row of its namespace changes (or made afresh after
too many changes). Every answer is checked against a fresh evaluation (no key) after random
upserts, deletes and compactions in the namespace and beside it; the negative controls show
that a kept answer that ignored the namespace's version, or the rows a change touched, would
be wrong."""

from __future__ import annotations

import random

import kalos_retrievers.sidecar.rows as rows_module
import kalos_retrievers.sidecar.service as service_module
import numpy as np
import pytest
from kalos_retrievers.sidecar.index import CpuIndex
from kalos_retrievers.sidecar.service import Service
from kalos_retrievers.sidecar.store import NullStore

from kalos_retrievers.protocol import METRICS, encode_json, encode_recall_args

DIM = 5
NS = "memory/agent"


class _Wants(CpuIndex):
    """A CPU index that wants a namespace's rows (Index.wants_rows) or not, as ``wanted`` says,
    whatever its size (the CPU index itself: where it would gather them)."""

    wanted = True

    def wants_rows(self, count: int, high: int) -> bool:
        return self.wanted


def _service(index: CpuIndex | None = None) -> Service:
    index = index or CpuIndex(DIM, METRICS["cosine"])
    return Service(index, NullStore(), dim=DIM, metric=index.metric)


def _upsert(svc: Service, ns: str, ids: list[str], users: list[str]) -> None:
    vecs = np.random.default_rng(len(ids)).standard_normal((len(ids), DIM)).astype(np.float32)
    svc.upsert({"namespace": ns, "ids": ids, "texts": ids, "metadatas": [{"user_id": u} for u in users]}, vecs)


def _scope(svc: Service, ns: str, flt: dict, *, keyed: bool = True) -> tuple[list[int], int, int, bool]:
    """(candidate rows, how many, the namespace id, dense) of eligible_for, with or without a key."""
    key = encode_recall_args(ns, encode_json(flt)) if keyed else None
    ns_id, cands, dense, n = svc.eligible_for(ns, flt, key)
    return ([] if cands is None else cands.tolist()), n, ns_id, dense


def test_a_kept_answer_is_the_fresh_one_through_random_changes() -> None:
    rnd = random.Random(7)
    svc = _service()
    filters = [{"user_id": "u1"}, {"user_id": {"$in": ["u2", "u3"]}}, {"user_id": {"$ne": "u1"}},
               {"$or": [{"user_id": "u0"}, {"user_id": {"$exists": False}}]}]  # fmt: skip
    live: dict[str, set[str]] = {NS: set(), "other": set()}
    for step in range(300):
        op = rnd.random()
        ns = NS if rnd.random() < 0.7 else "other"
        if op < 0.45:
            ids = [f"m{rnd.randrange(200)}" for _ in range(rnd.randrange(1, 6))]
            ids = list(dict.fromkeys(ids))
            _upsert(svc, ns, ids, [f"u{rnd.randrange(4)}" for _ in ids])
            live[ns] |= set(ids)
        elif op < 0.7 and live[ns]:
            gone = rnd.sample(sorted(live[ns]), min(len(live[ns]), rnd.randrange(1, 4)))
            svc.delete({"namespace": ns, "ids": gone})
            live[ns] -= set(gone)
        elif op < 0.75:
            svc.compact(max_moves=rnd.randrange(1, 50))
        for flt in filters:
            for scope_ns in (NS, "other"):
                assert _scope(svc, scope_ns, flt) == _scope(svc, scope_ns, flt, keyed=False), (step, flt)
    assert 0 < len(svc._scopes) <= service_module._SCOPES_KEPT
    assert svc._scope_rows == sum(len(v[2][1]) for v in svc._scopes.values())
    assert svc.scope_refreshes > 100  # brought up to date from the touched rows, not afresh


def test_a_kept_answer_is_brought_up_to_date_from_the_rows_the_changes_touched() -> None:
    """A write between two recalls costs the evaluation of the rows it touched: the kept
    answer is updated (rows added, rows whose metadata no longer match dropped, the tail row
    deleted, rows moved by compaction followed), and equals a fresh evaluation each time."""
    svc = _service()
    _upsert(svc, NS, [f"m{i}" for i in range(40)], [f"u{i % 4}" for i in range(40)])
    flt = {"user_id": "u1"}
    assert _scope(svc, NS, flt)[1] == 10
    refreshes = svc.scope_refreshes
    _upsert(svc, NS, ["new"], ["u1"])  # added
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and _scope(svc, NS, flt)[1] == 11
    _upsert(svc, NS, ["m1"], ["u2"])  # no longer matches
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and _scope(svc, NS, flt)[1] == 10
    svc.delete({"namespace": NS, "ids": ["new"]})  # the last row: the table's high falls below it
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and _scope(svc, NS, flt)[1] == 9
    svc.delete({"namespace": NS, "ids": [f"m{i}" for i in range(0, 20)]})
    svc.compact(max_moves=100)  # rows of u1 move into the holes
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and _scope(svc, NS, flt)[1] == 5
    assert svc.scope_refreshes == refreshes + 4


def test_the_negative_control_a_refresh_blind_to_the_touched_rows_would_answer_stale(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    svc = _service()
    _upsert(svc, NS, ["a", "b"], ["u1", "u2"])
    flt = {"user_id": "u1"}
    assert _scope(svc, NS, flt)[1] == 1
    monkeypatch.setattr(svc.rows, "touched_since", lambda seq: np.empty(0, np.int64))
    _upsert(svc, NS, ["c"], ["u1"])
    assert _scope(svc, NS, flt)[1] == 1  # stale: what the touched rows prevent
    assert _scope(svc, NS, flt, keyed=False)[1] == 2


def test_after_more_changes_than_the_table_remembers_the_answer_is_made_afresh(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(rows_module, "CHANGES_KEPT", 8)
    svc = _service()
    assert len(svc.rows.changes) == 8
    _upsert(svc, NS, ["a", "b"], ["u1", "u2"])
    flt = {"user_id": "u1"}
    assert _scope(svc, NS, flt)[1] == 1
    _upsert(svc, NS, [f"n{i}" for i in range(7)], ["u1"] * 7)  # 7 changes: still known
    assert _scope(svc, NS, flt)[1] == 8 and svc.scope_refreshes == 1
    _upsert(svc, NS, [f"p{i}" for i in range(8)], ["u1"] * 8)  # 8: exactly what the ring holds
    assert _scope(svc, NS, flt)[1] == 16 and svc.scope_refreshes == 2
    _upsert(svc, NS, [f"q{i}" for i in range(9)], ["u1"] * 9)  # 9: more than it holds
    assert svc.rows.touched_since(svc._scopes[encode_recall_args(NS, encode_json(flt))][3]) is None
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and _scope(svc, NS, flt)[1] == 25
    assert svc.scope_refreshes == 2  # made afresh


def test_many_changes_are_not_followed_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """More changes since than _REFRESH_MAX (or a 64th of the namespace's rows): made
    afresh, which is then cheaper; and a stale answer not kept again is dropped, so that later
    recalls do not follow the same changes from its old place again."""
    monkeypatch.setattr(service_module, "_REFRESH_MAX", 4)
    svc = _service()
    _upsert(svc, NS, ["a", "b"], ["u1", "u2"])
    flt = {"user_id": "u1"}
    assert _scope(svc, NS, flt)[1] == 1
    _upsert(svc, "other", [f"x{i}" for i in range(5)], ["u1"] * 5)  # beside it: 5 changes
    _upsert(svc, NS, ["c"], ["u1"])
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and svc.scope_refreshes == 0
    _upsert(svc, NS, ["d"], ["u1"])
    assert _scope(svc, NS, flt)[1] == 3 and svc.scope_refreshes == 1  # one change: followed
    key = encode_recall_args(NS, encode_json(flt))
    svc.delete({"namespace": NS, "ids": ["a", "b", "c", "d"]})  # emptied: nothing to keep
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) == ([], 0, -1, False)
    assert key not in svc._scopes and svc._scope_rows == 0
    _upsert(svc, NS, ["e", "f"], ["u1", "u1"])  # refilled
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and _scope(svc, NS, flt)[1] == 2


def test_a_kept_answer_follows_the_table_growing() -> None:
    """The row table grows (1024 rows, then more) between the kept answer and its refresh."""
    svc = _service()
    _upsert(svc, NS, [f"m{i}" for i in range(1020)], [f"u{i % 4}" for i in range(1020)])
    flt = {"user_id": "u1"}
    assert _scope(svc, NS, flt)[1] == 255 and svc.rows.capacity == 1024
    _upsert(svc, NS, [f"n{i}" for i in range(10)], ["u1"] * 10)
    assert svc.rows.capacity > 1024
    assert _scope(svc, NS, flt) == _scope(svc, NS, flt, keyed=False) and _scope(svc, NS, flt)[1] == 265
    assert svc.scope_refreshes == 1


def test_a_write_to_the_namespace_is_seen_and_a_write_beside_it_keeps_the_answer() -> None:
    svc = _service()
    _upsert(svc, NS, ["a", "b", "c"], ["u1", "u2", "u1"])
    _upsert(svc, "other", ["x"], ["u1"])
    flt = {"user_id": "u1"}
    first, n, _, _ = _scope(svc, NS, flt)
    assert n == 2
    key = encode_recall_args(NS, encode_json(flt))
    kept = svc._scopes[key][2][1]
    assert kept is not None and not kept.flags.writeable  # (the searches only read it)
    _upsert(svc, "other", ["y"], ["u1"])  # beside it: the same answer, the same array
    assert svc.eligible_for(NS, flt, key)[1] is kept
    _upsert(svc, NS, ["d"], ["u1"])  # in it: a new row matches
    now, n, _, _ = _scope(svc, NS, flt)
    assert n == 3 and len(now) == 3 and set(first) < set(now)
    _upsert(svc, NS, ["a"], ["u2"])  # its metadata changed: no longer matches
    assert _scope(svc, NS, flt)[1] == 2


def test_the_negative_control_a_cache_blind_to_the_version_would_answer_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sequence with the namespace's version frozen: the kept answer misses the new row."""
    svc = _service()
    _upsert(svc, NS, ["a", "b"], ["u1", "u2"])
    flt = {"user_id": "u1"}
    assert _scope(svc, NS, flt)[1] == 1
    frozen = list(svc.rows.ns_version)
    monkeypatch.setattr(svc.rows, "ns_version", frozen)
    _upsert(svc, NS, ["c"], ["u1"])
    frozen[svc.rows.ns_id(NS)] -= 1  # (the upsert bumped it: taken back)
    assert _scope(svc, NS, flt)[1] == 1  # stale: what eligible_for's version check prevents
    assert _scope(svc, NS, flt, keyed=False)[1] == 2


def test_the_kept_answers_are_bounded_in_number_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_module, "_SCOPE_ROWS_KEPT", 10)
    svc = _service()
    _upsert(svc, NS, [f"m{i}" for i in range(12)], [f"u{i % 3}" for i in range(12)])
    for u in range(3):  # 4 rows each: two fit in 10 rows
        assert _scope(svc, NS, {"user_id": f"u{u}"})[1] == 4
    assert len(svc._scopes) == 2 and svc._scope_rows == 8
    assert _scope(svc, NS, {"user_id": {"$ne": "nobody"}})[1] == 12  # more than the bound: not kept
    assert len(svc._scopes) == 2 and svc._scope_rows == 8
    monkeypatch.setattr(service_module, "_SCOPES_KEPT", 3)
    for u in range(6):
        _scope(svc, NS, {"user_id": f"v{u}"})  # (none match: nothing to keep)
    _scope(svc, NS, {"user_id": {"$in": ["u0"]}})
    _scope(svc, NS, {"user_id": {"$in": ["u1"]}})
    assert len(svc._scopes) <= 3 and svc._scope_rows == sum(len(v[2][1]) for v in svc._scopes.values())


# A namespace recalled without a filter (session 53): its rows are kept under its args where the
# index wants them (Index.wants_rows: the CPU index where it would gather them, the GPU index
# where they would be scanned as a list), brought up to date as a filter's are.


def _bare(svc: Service, ns: str, flt: dict | None = None) -> tuple[np.ndarray | None, int, bool]:
    """(candidate rows, how many, dense) of eligible_for of ``ns`` without a filter (or ``{}``),
    keyed as a client's args are."""
    key = encode_recall_args(ns, None if flt is None else encode_json(flt))
    _, cands, dense, n = svc.eligible_for(ns, flt, key)
    return cands, n, dense


def test_a_namespace_is_kept_as_its_rows_through_random_changes() -> None:
    rnd = random.Random(11)
    svc = _service(_Wants(DIM, METRICS["cosine"]))
    live: dict[str, set[str]] = {NS: set(), "other": set()}
    q = np.random.default_rng(3).standard_normal((2, DIM)).astype(np.float32)
    listed = 0
    for step in range(300):
        ns = NS if rnd.random() < 0.5 else "other"
        op = rnd.random()
        if op < 0.5:
            ids = list(dict.fromkeys(f"m{rnd.randrange(120)}" for _ in range(rnd.randrange(1, 6))))
            _upsert(svc, ns, ids, ["u"] * len(ids))
            live[ns] |= set(ids)
        elif op < 0.85 and live[ns]:
            gone = rnd.sample(sorted(live[ns]), min(len(live[ns]), rnd.randrange(1, 6)))
            svc.delete({"namespace": ns, "ids": gone})
            live[ns] -= set(gone)
        else:
            svc.compact(max_moves=rnd.randrange(1, 50))
        for scope_ns in (NS, "other"):
            for flt in (None, {}):
                cands, n, dense = _bare(svc, scope_ns, flt)
                ns_id = svc.rows.ns_id(scope_ns)
                assert n == len(live[scope_ns]), (step, scope_ns)
                if not n or dense:  # (empty, or every row below the high-water mark: no list)
                    assert cands is None, (step, scope_ns)
                    continue
                listed += 1
                assert not cands.flags.writeable  # (the kept answer: the searches only read it)
                assert cands.tolist() == svc.rows.rows_of(ns_id).tolist(), (step, scope_ns, flt)
                high = svc.rows.high
                got = svc.index.search(q, min(3, n), high, ns_id, cands, False)
                want = svc.index.search(q, min(3, n), high, ns_id, None, False)
                assert np.array_equal(got[0], want[0]) and np.allclose(got[1], want[1])
    assert listed > 300 and svc.scope_refreshes > 100  # (lists brought up to date, not made afresh)
    assert svc._scope_rows == sum(len(v[2][1]) for v in svc._scopes.values())


def test_the_negative_control_a_namespaces_list_blind_to_the_touched_rows_would_answer_stale(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    svc = _service(_Wants(DIM, METRICS["cosine"]))
    _upsert(svc, NS, ["a", "b"], ["u", "u"])
    _upsert(svc, "other", ["x"], ["u"])
    assert _bare(svc, NS)[0].tolist() == [0, 1]
    monkeypatch.setattr(svc.rows, "touched_since", lambda seq: np.empty(0, np.int64))
    _upsert(svc, NS, ["c"], ["u"])
    assert _bare(svc, NS)[0].tolist() == [0, 1]  # stale: row 3 missed, what the touched rows prevent
    assert svc.rows.rows_of(svc.rows.ns_id(NS)).tolist() == [0, 1, 3]


def test_a_namespace_is_given_as_its_rows_only_where_the_index_wants_them() -> None:
    """An index that wants no rows (the GPU index for a namespace above its list fraction) gets
    the namespace alone, and nothing is kept; a list kept while the namespace was wanted as rows
    is dropped once it is not, and once the namespace holds every row (dense)."""

    index = _Wants(DIM, METRICS["ip"])
    index.wanted = False
    svc = _service(index)
    _upsert(svc, NS, ["a", "b", "c"], ["u"] * 3)
    _upsert(svc, "other", ["x", "y"], ["u"] * 2)
    assert _bare(svc, NS) == (None, 3, False) and svc._scopes == {}
    svc.index.wanted = True
    assert _bare(svc, NS)[0].tolist() == [0, 1, 2] and len(svc._scopes) == 1 and svc._scope_rows == 3
    svc.index.wanted = False
    assert _bare(svc, NS) == (None, 3, False) and svc._scopes == {} and svc._scope_rows == 0
    svc.index.wanted = True
    assert _bare(svc, NS)[0] is not None
    svc.delete({"namespace": "other", "all": True})
    svc.compact(max_moves=100)
    assert svc.rows.dense(svc.rows.ns_id(NS))
    assert _bare(svc, NS) == (None, 3, True) and svc._scopes == {}  # dense: the namespace alone, no list


def test_the_cpu_index_wants_the_rows_it_would_gather() -> None:
    """CpuIndex.search gathers a namespace of fewer than an eighth of the rows (its rows found
    at each call without a list) and scores a larger one in place: only the first is kept."""
    svc = _service()
    _upsert(svc, NS, [f"m{i}" for i in range(5)], ["u"] * 5)
    _upsert(svc, "other", [f"o{i}" for i in range(36)], ["u"] * 36)  # 5 of 41 rows: 5 x 8 < 41
    cands, n, _ = _bare(svc, NS)
    assert n == 5 and cands.tolist() == svc.rows.rows_of(svc.rows.ns_id(NS)).tolist()
    assert _bare(svc, "other") == (None, 36, False)  # 36 of 41: scored in place, not kept
    _upsert(svc, NS, ["m5"], ["u"])  # 6 of 42: 6 x 8 > 42
    assert _bare(svc, NS) == (None, 6, False) and svc._scopes == {}

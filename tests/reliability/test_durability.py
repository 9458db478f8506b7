"""Scenario 4: ``kill -9`` of the sidecar at random points of a concurrent upsert/delete
workload with ``--data-dir``.

Writers (separate processes, each on its own ids) upsert and delete batches back to back; the
sidecar is killed at a random moment, restarted on the same store, and the state it serves is
checked against what was acknowledged. An op in flight at the kill is unacknowledged: its ids
may hold the old or the new state (and an upsert batch lands whole or not at all).

Pass, after every restart: 0 acknowledged ids missing (or holding an older version), 0 phantom
ids (deleted, or never written), 0 duplicates, 0 zero/NaN vectors, every vector and text exactly
the one written, the index returning exactly the stored rows, count == the store's count; and
read-your-writes right after every acknowledged upsert.

Negative controls: a sidecar that acknowledges every other write without committing it fails the
harness; the snapshot checker flags injected duplicates, NaN/zero vectors and count mismatches.
"""

from __future__ import annotations

import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability._harness import Counters, figure, fork_worker, scale, wait_until
from reliability._workers import durable_writer, version_vector

from kalos_retrievers import KalosClient, Sidecar

pytestmark = pytest.mark.reliability

DIM = 8
WRITERS, IDS_EACH = 3, 40
KILLS = scale(12, 200)
STOP_AT = 60

Accept = dict[str, set[str | None]]


def check_snapshot(rows: list[tuple[str, str, dict[str, Any], np.ndarray]], accept: Accept,
                   counts: dict[str, int]) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """Compare what a restarted sidecar serves with what may be there.

    ``rows``: (id, text, metadata, vector) of every served row; ``accept``: for each id the
    states it may be in (None: absent, else a version); ``counts``: named counts that must all
    equal the number of rows. Returns the violations and each id's actual state."""
    bad: list[str] = []
    ids = [r[0] for r in rows]
    for id_, n in Counter(ids).items():
        if n > 1:
            bad.append(f"duplicate id {id_!r} x{n}")
    actual: dict[str, str] = {}
    for id_, text, meta, vec in rows:
        if id_ not in accept:
            bad.append(f"phantom id {id_!r}: never written")
            continue
        version = text.split("|", 1)[1] if "|" in text else "?"
        actual[id_] = version
        if version not in accept[id_]:
            if accept[id_] == {None}:
                bad.append(f"phantom id {id_!r}: deleted (acknowledged) but served as {version}")
            else:
                bad.append(f"id {id_!r} serves version {version}, acknowledged {accept[id_]}")
        if text != f"{id_}|{version}" or meta != {"v": version}:
            bad.append(f"id {id_!r}: text/metadata {text!r} {meta!r} do not match")
        v = np.asarray(vec, np.float64)
        if not np.all(np.isfinite(v)):
            bad.append(f"id {id_!r}: NaN/inf vector")
            continue
        if not np.any(v):
            bad.append(f"id {id_!r}: zero vector")
            continue
        want = version_vector(id_, version, len(v)).astype(np.float64)
        want /= np.linalg.norm(want)
        if not np.allclose(v, want, atol=1e-5):
            bad.append(f"id {id_!r}: vector differs from the one written")
    for id_, states in accept.items():
        if id_ not in actual and None not in states:
            bad.append(f"acknowledged id {id_!r} (version {states}) is missing")
    for what, n in counts.items():
        if n != len(rows):
            bad.append(f"{what} = {n}, but {len(rows)} rows are served")
    return bad, actual


def store_count(data_dir: Path) -> int:
    db = sqlite3.connect(data_dir / "kalos.sqlite3", timeout=10)
    try:
        return int(db.execute("SELECT count(*) FROM memories").fetchone()[0])
    finally:
        db.close()


def served_state(name: str, data_dir: Path) -> tuple[list[tuple[str, str, dict[str, Any], np.ndarray]], dict[str, int]]:
    with KalosClient(name, dim=DIM, spin_us=0, timeout=10.0) as c:
        recs = c.scan(limit=10**6, with_vectors=True)
        rows = [(r.id, r.text, r.metadata, r.vector) for r in recs]
        counts = {"count()": c.count(), "count('')": c.count(namespace=""),
                  "store count": store_count(data_dir)}  # fmt: skip
        if rows:  # the index holds exactly the stored rows: a recall with k = all finds all
            hits = c.recall(np.ones(DIM, np.float32), k=min(len(rows) + 5, 1024))
            counts["index recall"] = len(set(hits.ids) & {r[0] for r in rows})
            counts["index hits"] = len(hits)
    return rows, counts


def run_durability(launch_same: Callable[[], Sidecar], data_dir: Path, kills: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    id_sets = [[f"w{w}-{i}" for i in range(IDS_EACH)] for w in range(WRITERS)]
    accept: Accept = {i: {None} for s in id_sets for i in s}
    violations: list[str] = []
    stats = Counter()
    sc = launch_same()
    for rnd in range(kills):
        counters = Counters()
        writers = [fork_worker(durable_writer, sc.name, DIM, w, id_sets[w], rnd,
                               seed * 100_000 + rnd * 10 + w, counters, STOP_AT)
                   for w in range(WRITERS)]  # fmt: skip
        wait_until(lambda c=counters: all(c[w] >= 1 for w in range(WRITERS)), 10.0)
        time.sleep(float(rng.uniform(0.0, 0.3)))  # the random kill point
        sc.kill(signal.SIGKILL)
        assert sc.proc is not None
        sc.proc.wait()
        counters[STOP_AT] = 1
        logs = [w.result(30) for w in writers]
        for out in logs:
            if out.get("connect_error"):
                violations.append(f"round {rnd}: writer could not connect: {out['connect_error']}")
            stats["ryw_checked"] += out["ryw_checked"]
            for b in out["ryw_bad"]:
                violations.append(f"round {rnd}: read-your-writes failed: {b}")
            for e in out["log"]:
                new = e["version"] if e["op"] == "upsert" else None
                for i in e["ids"]:
                    accept[i] = {new} if e["ack"] else accept[i] | {new}
                stats["acked" if e["ack"] else "in_flight_at_kill"] += 1
        sc = launch_same()
        rows, counts = served_state(sc.name, data_dir)
        bad, actual = check_snapshot(rows, accept, counts)
        violations += [f"round {rnd}: {b}" for b in bad]
        # an unacknowledged upsert batch lands whole or not at all
        for out in logs:
            for e in out["log"]:
                if not e["ack"] and e["op"] == "upsert":
                    landed = {actual.get(i) == e["version"] for i in e["ids"]}
                    stats["in_flight_landed" if landed == {True} else "in_flight_lost"] += 1
                    if len(landed) > 1:
                        violations.append(f"round {rnd}: upsert batch {e['ids']} landed in part")
        accept = {i: {actual.get(i)} for i in accept}
        stats["rows_last"] = len(rows)
        if len(violations) > 20:
            break
    sc.stop()
    return {"kills": kills, "violations": violations, **stats}


def test_kill9_during_writes_loses_nothing(launch: Callable[..., Sidecar], tmp_path: Path, make_name) -> None:
    name = make_name()
    out = run_durability(lambda: launch(name=name, data_dir=tmp_path), tmp_path, KILLS, seed=7)
    figure("4 sidecar kill -9 during writes", **out)
    assert not out["violations"], out["violations"][:20]
    assert out["acked"] > KILLS and out["ryw_checked"] > 0


def test_kill9_durability_negative_control_lost_writes(
    launch: Callable[..., Sidecar], tmp_path: Path, make_name: Callable[[], str]
) -> None:
    name = make_name()
    out = run_durability(lambda: launch(name=name, data_dir=tmp_path, patch="lose_writes"), tmp_path, 2, seed=8)
    assert any("missing" in v or "phantom" in v or "acknowledged" in v for v in out["violations"]), out


def test_snapshot_checker_negative_control() -> None:
    """The checker flags each anomaly it exists for (so a clean report means something)."""
    good = version_vector("a", "1", DIM).astype(np.float64)
    good /= np.linalg.norm(good)
    accept: Accept = {"a": {"1"}, "b": {None}, "c": {"2"}}
    clean, _ = check_snapshot([("a", "a|1", {"v": "1"}, good)], accept | {"c": {None, "2"}}, {"n": 1})
    assert clean == []
    cases = {
        "duplicate": ([("a", "a|1", {"v": "1"}, good)] * 2, {"n": 2}),
        "NaN": ([("a", "a|1", {"v": "1"}, good * np.nan)], {"n": 1}),
        "zero vector": ([("a", "a|1", {"v": "1"}, good * 0)], {"n": 1}),
        "phantom": ([("a", "a|1", {"v": "1"}, good), ("b", "b|0", {"v": "0"}, good)], {"n": 2}),
        "is missing": ([], {"n": 0}),
        "rows are served": ([("a", "a|1", {"v": "1"}, good)], {"n": 3}),
        "differs": ([("a", "a|1", {"v": "1"}, -good)], {"n": 1}),
    }
    for word, (rows, counts) in cases.items():
        bad, _ = check_snapshot(rows, accept, counts)
        assert any(word in b for b in bad), (word, bad)

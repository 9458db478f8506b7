"""Scenario 5: a torn or corrupt store of record on start.

The store is built by a real sidecar, then damaged on disk: the WAL truncated at random points or
with bytes flipped (as a crash mid-write leaves it), bytes flipped anywhere in the main file or
precisely inside a vector BLOB, a file written by a previous release (older schema, no CRC
column), a newer release, another dimension, garbage, a truncated main file.

Pass, for every case: the sidecar either recovers and serves only what was written (exactly:
ids, texts, metadata, timestamps and vectors; after a torn WAL a prefix of the committed
transactions, each whole) or refuses to start with a clear message and exit code 4 (never a
traceback, never another code). It never serves silently wrong data.

Negative controls: a flip inside a vector whose CRC is forged to match, and a sidecar whose CRC
check is switched off, are both reported as "served wrong data".
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar.store import row_crc
from reliability._harness import figure, scale
from reliability._workers import version_vector

from kalos_retrievers import KalosClient, Sidecar, SidecarStartError

pytestmark = pytest.mark.reliability

DIM = 8
TX, PER_TX = 12, 5
EXIT_STORE = 4
CLEAR = ("corrupt", "checksum", "schema version", "not a readable SQLite database",
         "integrity check", "previous release", "holds dim=")  # fmt: skip
WAL_CASES = scale(8, 80)
FLIP_CASES = scale(16, 300)

Rec = tuple[str, str, str, float, float, bytes]  # ns, id, text, created, updated, vector bytes


def build_store(launch: Callable[..., Sidecar], data_dir: Path, *, kill: bool) -> dict[str, Rec]:
    """TX transactions of PER_TX rows each ("t{t}-{i}"); returns what was acknowledged, as the
    sidecar served it back (timestamps included)."""
    sc = launch(data_dir=data_dir)
    with KalosClient(sc.name, dim=DIM, spin_us=0) as c:
        for t in range(TX):
            ids = [f"t{t}-{i}" for i in range(PER_TX)]
            c.upsert(ids, np.stack([version_vector(i, "1", DIM) for i in ids]),
                     texts=[f"text of {i}" for i in ids],
                     metadatas=[{"t": t, "i": i} for i in range(PER_TX)])  # fmt: skip
        recs = c.scan(limit=10**6, with_vectors=True)
    if kill:
        sc.kill(signal.SIGKILL)
        assert sc.proc is not None
        sc.proc.wait()
    else:
        sc.stop()
    return {r.id: _rec(r) for r in recs}


def _rec(r: Any) -> Rec:
    return (r.namespace, r.id, r.text, r.created_at, r.updated_at,
            np.asarray(r.vector, "<f4").tobytes())  # fmt: skip


def start_on(launch: Callable[..., Sidecar], data_dir: Path, patch: str | None = None) -> dict[str, Any]:
    sc = launch(data_dir=data_dir, start=False, patch=patch)
    try:
        sc.start()
    except SidecarStartError:
        assert sc.proc is not None
        return {"outcome": "refused", "code": sc.proc.returncode, "log": sc.log_tail(40)}
    with KalosClient(sc.name, dim=DIM, spin_us=0) as c:
        recs = c.scan(limit=10**6, with_vectors=True)
        count = c.count()
    sc.stop()
    return {"outcome": "served", "rows": {r.id: _rec(r) for r in recs}, "count": count}


def judge(res: dict[str, Any], written: dict[str, Rec], *, prefix: bool = False,
          must_refuse: bool = False) -> list[str]:  # fmt: skip
    """Violations of "recovers exactly or refuses clearly"."""
    if res["outcome"] == "refused":
        log = res["log"]
        bad = []
        if res["code"] != EXIT_STORE:
            bad.append(f"refused with exit code {res['code']}, not {EXIT_STORE}: {log[-600:]}")
        if "Traceback" in log or not any(w in log for w in CLEAR):
            bad.append(f"refusal without a clear message: {log[-600:]}")
        return bad
    rows = res["rows"]
    bad = [f"served wrong data for {i!r}" for i, r in rows.items() if written.get(i) != r]
    if must_refuse and not bad:
        bad.append("served a store it should have refused")
    if res["count"] != len(rows):
        bad.append(f"count {res['count']} != {len(rows)} rows served")
    if prefix:
        txs = {t: sum(f"t{t}-{i}" in rows for i in range(PER_TX)) for t in range(TX)}
        if any(n not in (0, PER_TX) for n in txs.values()):
            bad.append(f"a transaction was recovered in part: {txs}")
        have = [t for t in range(TX) if txs[t]]
        if have != list(range(len(have))):
            bad.append(f"recovered transactions {have} are not a prefix")
    elif not prefix and set(rows) != set(written):
        bad.append(f"served {len(rows)} of {len(written)} rows without refusing")
    return bad


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "kalos.lock").unlink(missing_ok=True)
    return dst


def test_torn_or_flipped_wal_recovers_a_prefix(launch: Callable[..., Sidecar], tmp_path: Path) -> None:
    base = tmp_path / "base"
    written = build_store(launch, base, kill=True)
    wal = base / "kalos.sqlite3-wal"
    assert wal.exists() and wal.stat().st_size > 0, "the kill left no WAL to tear"
    size = wal.stat().st_size
    rng = np.random.default_rng(11)
    outcomes: dict[str, int] = {}
    violations = []
    for k in range(WAL_CASES):
        d = _copy(base, tmp_path / f"wal{k}")
        data = bytearray((d / "kalos.sqlite3-wal").read_bytes())
        if k % 2 == 0:  # torn: truncated at a random point (mid-frame or mid-header)
            cut = int(rng.integers(0, size))
            data = data[:cut]
            what = f"truncated at {cut}/{size}"
        else:  # bytes flipped mid-file
            at = int(rng.integers(32, size))
            data[at] ^= 1 << int(rng.integers(8))
            what = f"bit flipped at {at}/{size}"
        (d / "kalos.sqlite3-wal").write_bytes(bytes(data))
        res = start_on(launch, d)
        key = res["outcome"] if res["outcome"] == "refused" else f"served {len(res['rows'])} rows"
        outcomes[key] = outcomes.get(key, 0) + 1
        violations += [f"WAL {what}: {b}" for b in judge(res, written, prefix=True)]
    figure("5 torn/flipped WAL", cases=WAL_CASES, outcomes=outcomes, violations=violations)
    assert not violations, violations


def test_flipped_main_file_recovers_or_refuses(launch: Callable[..., Sidecar], tmp_path: Path) -> None:
    base = tmp_path / "base"
    written = build_store(launch, base, kill=False)
    assert not (base / "kalos.sqlite3-wal").exists() or (base / "kalos.sqlite3-wal").stat().st_size == 0
    size = (base / "kalos.sqlite3").stat().st_size
    rng = np.random.default_rng(12)
    outcomes: dict[str, int] = {}
    violations = []
    for k in range(FLIP_CASES):
        d = _copy(base, tmp_path / f"flip{k}")
        data = bytearray((d / "kalos.sqlite3").read_bytes())
        spots = sorted(int(x) for x in rng.integers(0, size, size=int(rng.integers(1, 4))))
        for at in spots:
            data[at] ^= int(rng.integers(1, 256))
        (d / "kalos.sqlite3").write_bytes(bytes(data))
        res = start_on(launch, d)
        outcomes[res["outcome"]] = outcomes.get(res["outcome"], 0) + 1
        violations += [f"bytes flipped at {spots}: {b}" for b in judge(res, written)]
    figure("5 flipped main file", cases=FLIP_CASES, outcomes=outcomes, violations=violations)
    assert not violations, violations


def _flip_inside_vector(d: Path, written: dict[str, Rec], forge_crc: bool) -> str:
    """Flip one byte inside the vector BLOB of one row (found by its bytes in the file)."""
    target = "t3-2"
    vec = written[target][5]
    path = d / "kalos.sqlite3"
    data = bytearray(path.read_bytes())
    at = data.find(vec)
    assert at >= 0 and data.find(vec, at + 1) < 0, "vector bytes not found exactly once"
    data[at + 5] ^= 0x40
    path.write_bytes(bytes(data))
    if forge_crc:  # recompute the row's CRC over the damaged bytes: undetectable corruption
        db = sqlite3.connect(path)
        ns, id_, text, meta, v = db.execute("SELECT ns, id, text, metadata, vector FROM memories "
                                            "WHERE id=?", (target,)).fetchone()  # fmt: skip
        db.execute("UPDATE memories SET crc=? WHERE id=?",
                   (row_crc(ns, id_, text, bytes(meta), bytes(v)), target))  # fmt: skip
        db.commit()
        db.close()
    return target


def test_flip_inside_vector_blob_is_refused(launch: Callable[..., Sidecar], tmp_path: Path) -> None:
    base = tmp_path / "base"
    written = build_store(launch, base, kill=False)
    d = _copy(base, tmp_path / "vec")
    _flip_inside_vector(d, written, forge_crc=False)
    res = start_on(launch, d)
    assert res["outcome"] == "refused", "a flipped vector was served"
    assert not judge(res, written), judge(res, written)
    assert "checksum" in res["log"]


def test_flip_inside_vector_negative_controls(launch: Callable[..., Sidecar], tmp_path: Path) -> None:
    base = tmp_path / "base"
    written = build_store(launch, base, kill=False)
    forged = _copy(base, tmp_path / "forged")
    target = _flip_inside_vector(forged, written, forge_crc=True)
    assert f"served wrong data for {target!r}" in judge(start_on(launch, forged), written)
    plain = _copy(base, tmp_path / "plain")
    _flip_inside_vector(plain, written, forge_crc=False)
    assert f"served wrong data for {target!r}" in judge(start_on(launch, plain, patch="no_crc"), written)


def _previous_release(path: Path) -> None:
    """The layout of a release before the CRC column and the meta table."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE memories(ns TEXT NOT NULL, id TEXT NOT NULL, text TEXT NOT NULL, "
               "metadata BLOB NOT NULL, vector BLOB NOT NULL, created_at REAL NOT NULL, "
               "updated_at REAL NOT NULL, PRIMARY KEY (ns, id)) WITHOUT ROWID")  # fmt: skip
    db.execute("INSERT INTO memories VALUES ('', 'old', 'old text', '{}', ?, 1.0, 1.0)",
               (np.ones(DIM, "<f4").tobytes(),))  # fmt: skip
    db.commit()
    db.close()


def _with_meta(version: str, dim: str = str(DIM)) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.executemany("INSERT INTO meta VALUES (?, ?)",
                       [("schema_version", version), ("dim", dim), ("metric", "cosine")])  # fmt: skip
        db.execute("CREATE TABLE memories(ns TEXT, id TEXT, vector BLOB)")
        db.commit()
        db.close()

    return make


def _meta_without_dim(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.commit()
    db.close()


def _garbage(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).bytes(20000))


@pytest.mark.parametrize("make", [_previous_release, _with_meta("0"), _with_meta("2"),
                                  _with_meta("1", dim="16"), _meta_without_dim, _garbage],
                         ids=["previous-release-no-crc", "schema-0", "schema-2-newer",
                              "other-dim", "meta-without-dim", "garbage"])  # fmt: skip
def test_foreign_store_is_refused_with_exit_4(launch: Callable[..., Sidecar], tmp_path: Path,
                                              make: Callable[[Path], None]) -> None:  # fmt: skip
    tmp_path.chmod(0o700)
    make(tmp_path / "kalos.sqlite3")
    res = start_on(launch, tmp_path)
    assert res["outcome"] == "refused", f"served {res.get('rows')}"
    assert not judge(res, {}), judge(res, {})


def test_truncated_main_file_is_refused(launch: Callable[..., Sidecar], tmp_path: Path) -> None:
    base = tmp_path / "base"
    written = build_store(launch, base, kill=False)
    for frac in (0.3, 0.5, 0.9):
        d = _copy(base, tmp_path / f"trunc{frac}")
        data = (d / "kalos.sqlite3").read_bytes()
        (d / "kalos.sqlite3").write_bytes(data[: int(len(data) * frac)])
        res = start_on(launch, d)
        assert not judge(res, written), (frac, judge(res, written))

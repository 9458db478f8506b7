"""Session 57: the store's table (WITHOUT ROWID) in SQLite alone at three page sizes.

    python docs/bench-results/2026-12-06-devvm-s57/sqlite_pages.py 100000

N rows x 768 in commits of 7,700 rows (synchronous=FULL, WAL), then 200 one-row commits, then
one full read; two rounds. Prints µs a row, the one-row commit's p50 and the file's size after
a checkpoint."""

import os
import shutil
import sqlite3
import sys
import time

import numpy as np

N = int(sys.argv[1])
CHUNK = 7700
TABLE = ("CREATE TABLE memories(ns TEXT NOT NULL, id TEXT NOT NULL, text TEXT NOT NULL, metadata BLOB NOT NULL,"
         " vector BLOB NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL, crc INTEGER NOT NULL,"
         " PRIMARY KEY (ns, id)) WITHOUT ROWID")  # fmt: skip
INSERT = "INSERT OR REPLACE INTO memories VALUES (?,?,?,?,?,?,?,?)"
vecs = np.random.default_rng(0).standard_normal((N, 768)).astype("<f4")


def run(page: int) -> None:
    d = f"/tmp/sqlb/db_{page}"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    db = sqlite3.connect(d + "/x.db", isolation_level=None)
    db.execute(f"PRAGMA page_size={page}")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(TABLE)
    tw = 0.0
    for s in range(0, N, CHUNK):
        params = [("", f"doc-{i}", f"memory number {i} text", b"{}", vecs[i].tobytes(), 1.0, 1.0, 0)
                  for i in range(s, min(N, s + CHUNK))]  # fmt: skip
        a = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.executemany(INSERT, params)
        db.execute("COMMIT")
        tw += time.perf_counter() - a
    one = []
    for j in range(200):
        a = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.execute(INSERT, ("", f"new-{j}", "x", b"{}", vecs[j].tobytes(), 1.0, 1.0, 0))
        db.execute("COMMIT")
        one.append(time.perf_counter() - a)
    t1 = time.perf_counter()
    cur = db.execute("SELECT ns, id, text, metadata, vector, created_at, updated_at, crc FROM memories")
    while cur.fetchmany(10000):
        pass
    t2 = time.perf_counter()
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = os.path.getsize(d + "/x.db")
    print(f"page={page:6d} bulk {tw / N * 1e6:6.1f} us/row  one-row commit p50 {np.median(one) * 1e3:.2f} ms"
          f"  read {(t2 - t1) / N * 1e6:5.1f} us/row  db {size / 2**20:.0f} MiB", flush=True)  # fmt: skip
    db.close()
    shutil.rmtree(d)


for _ in range(2):
    for page in (4096, 16384, 65536):
        run(page)

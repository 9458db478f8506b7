"""Store of record: SQLite in WAL mode. The index is a cache of it, rebuilt at start.

A write is acknowledged to the client only after its transaction commits; with
``synchronous=FULL`` (the default) the commit is on disk when acknowledged, so it survives
``kill -9`` of the sidecar and a power cut. Each row carries a CRC-32 of its content, checked
when the index is rebuilt: a flipped byte inside a vector is refused with a clear message
instead of being served as a silently different memory.

Without a data directory the sidecar keeps no store at all (:class:`NullStore`): the index is
the only copy, and the sidecar says so when it starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

log = logging.getLogger("kalos.sidecar.store")

SCHEMA_VERSION: Final = 1
DB_FILE: Final = "kalos.sqlite3"
LOCK_FILE: Final = "kalos.lock"
# A new store's page size (SQLite's largest). The table is WITHOUT ROWID, i.e. an index b-tree,
# which keeps at most ((page - 12) * 64 / 255) - 23 bytes of a row in its leaf: 1,002 on SQLite's
# default 4 KiB pages, so every 768-d row (its vector alone 3,072 bytes) spilled ~2 KB onto an
# overflow page of its own; on 64 KiB pages a row of up to 16,422 bytes (a 1536-d vector and
# ~10 KB of text) stays in its leaf. Measured on the development VM (100k rows x 768, 7,700-row
# commits, synchronous=FULL): a bulk commit 47-50 -> 23-29 µs a row, the file 446 -> 332 MiB,
# a one-row commit 0.25 -> 0.40 ms (docs/benchmarks.md, session 57). A store made with another
# page size keeps its own: SQLite fixes it when the file is first written.
PAGE_SIZE: Final = 65536


class StoreOpenError(Exception):
    """The store cannot be used as it is; the message says what to do."""


class StoreInUse(StoreOpenError):
    """Another running sidecar holds the data dir's lock: the store is fine, and usable once
    that sidecar stops."""


class StoreUnavailable(StoreOpenError):
    """SQLite could not open the store for a reason outside it (a full disk, an I/O error, no
    memory): the store may well be fine, and a start once that is mended serves it. (Told
    apart from damage, which no restart mends: a full disk at a restart read as corrupt, exit
    4, and a supervisor that does not restart on 4 left the sidecar down.)"""


# SQLite's primary result codes that say nothing against the file itself; SQLITE_IOERR's
# extended SHORT_READ (522, the file is shorter than its pages say) is damage
_OUTSIDE: Final = {5: "busy", 6: "locked", 7: "out of memory", 10: "I/O error", 13: "disk full",
                   14: "cannot open a file"}  # fmt: skip
_SHORT_READ: Final = 522
_CANTOPEN: Final = 14  # (a permission, or a directory in the way, as well as the disk: _cannot_open)


@dataclass(frozen=True)
class StoredRow:
    namespace: str
    id: str
    text: str
    metadata_json: bytes
    vector: np.ndarray
    created_at: float
    updated_at: float


def row_crc(namespace: str, id_: str, text: str, metadata_json: bytes, vector: bytes,
            created_at: float | None = None, updated_at: float | None = None) -> int:
    """CRC-32 of a row's content. Rows are written with the timestamps included (they are
    served too: a flipped byte in one must not pass); rows written before the timestamps were
    covered carry the CRC without them, which :meth:`SqliteStore.load` still accepts."""
    # (CRC-32 runs on: crc32(b, crc32(a)) == crc32(a + b), so each field is added without
    # copying it behind its separator; the values are those of the concatenation)
    crc32, sep = zlib.crc32, b"\x00"
    c = crc32(namespace.encode())
    c = crc32(id_.encode(), crc32(sep, c))
    c = crc32(text.encode(), crc32(sep, c))
    c = crc32(metadata_json, crc32(sep, c))
    c = crc32(vector, crc32(sep, c))
    if created_at is None or updated_at is None:
        return c
    return crc32(_TIMES.pack(created_at, updated_at), crc32(sep, c))


_TIMES: Final = struct.Struct("<dd")


def _make_dir(path: Path) -> None:
    """Create ``path`` (and any missing parents) so that it survives a power cut.

    A directory's entry lives in its parent, and a new entry is on disk only once the parent
    is fsynced. SQLite syncs the data dir itself when it creates the write-ahead log (so the
    database and log files' entries are safe), but not the data dir's parent: a store made in
    a new directory could lose the whole directory, acknowledged writes and all, to a power
    cut soon after. So each directory made here has its parent fsynced, top down.
    """
    missing = []
    p = path.absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in reversed(missing):
        _fsync_dir(d.parent)


def _fsync_dir(path: Path) -> None:
    """fsync a directory; where that is refused (some FUSE and CIFS mounts, a parent that can
    be written but not read) the store still opens, as SQLite's own directory syncs do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("cannot fsync directory %s (%s): a power cut soon after this start may lose "
                    "the new data dir", path, e.strerror or e)


class NullStore:
    """No persistence: the sidecar runs in memory."""

    durable = False
    path: Path | None = None

    def upsert(self, rows: Sequence[StoredRow]) -> None:
        pass

    def delete(self, namespace: str, ids: Sequence[str]) -> None:
        pass

    def load(self, dim: int, batch: int = 10000) -> Iterator[list[StoredRow]]:
        return iter(())

    def count(self) -> int:
        return 0

    def close(self) -> None:
        pass


class SqliteStore:
    """SQLite store in ``data_dir``. One sidecar per directory (an exclusive lock file)."""

    durable = True

    def __init__(self, data_dir: str | os.PathLike[str], *, dim: int, metric: str,
                 synchronous: str = "FULL") -> None:  # fmt: skip
        self.dir = Path(data_dir)
        _make_dir(self.dir)
        self.path = self.dir / DB_FILE
        self._dir_fd = -1
        self._lock_fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        in_use = StoreInUse(f"data dir {self.dir} is in use by another running sidecar; give each "
                            "sidecar its own --data-dir")  # fmt: skip
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise in_use from None
        try:
            # the directory too: the lock file can be unlinked ("a stale lock") while its
            # holder runs, and the next sidecar would lock a new file beside it. (The file's
            # lock stays: a sidecar of an earlier release takes only that one.)
            try:
                self._dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
                fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise in_use from None
            except OSError:
                # (a directory this user may write but not read, a filesystem without flock on
                # directories: the file's lock holds alone, as before)
                if self._dir_fd >= 0:
                    os.close(self._dir_fd)
                self._dir_fd = -1
            self._open(dim, metric, synchronous)
        except BaseException:
            self.close()
            raise

    def _open(self, dim: int, metric: str, synchronous: str) -> None:
        self._refuse_a_lost_main_file()
        if not self.path.exists():  # (beside a log with frames: refused just above)
            self._make_new(dim, metric)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # (before WAL: a new file only)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(f"PRAGMA synchronous={synchronous}")
            self.db.execute("PRAGMA busy_timeout=5000")
            ok = self.db.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as e:
            if self._outside(e):
                raise self._unavailable(e) from None
            raise StoreOpenError(
                f"{self.path} is not a readable SQLite database ({e}). The store is corrupt: "
                "restore it from a backup, or move it away to start empty"
            ) from None
        except UnicodeDecodeError as e:  # (SQLite's own message quotes damaged, non-UTF-8 schema text)
            raise StoreOpenError(
                f"{self.path} is not a readable SQLite database ({e}). The store is corrupt: "
                "restore it from a backup, or move it away to start empty"
            ) from None
        if ok != "ok":
            raise StoreOpenError(
                f"{self.path} failed SQLite's integrity check ({ok}); the store is corrupt: "
                "restore it from a backup, or move it away to start empty"
            )
        for p in self.dir.glob(DB_FILE + "*"):
            os.chmod(p, 0o600)
        if not self._has_table("meta"):  # (a file an earlier release began and never finished)
            # No meta table: a new file, unless it already holds tables (a release before the
            # meta table, or another program's database): never build ours beside those.
            if self.db.execute("SELECT 1 FROM sqlite_master WHERE type='table'").fetchone():
                raise StoreOpenError(
                    f"{self.path} holds tables but no Kalos schema version: it was written by a "
                    "previous release or by another program. Open it with the release that "
                    "wrote it and export the data, or use another --data-dir"
                )
            try:
                self._create(dim, metric)
            except sqlite3.DatabaseError as e:
                if self._outside(e):
                    raise self._unavailable(e) from None
                raise
            return
        try:
            meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
            version = int(meta.get("schema_version", "0"))
            if version == SCHEMA_VERSION:
                stored = (int(meta["dim"]), meta["metric"])
        except (sqlite3.DatabaseError, KeyError, ValueError, TypeError) as e:
            # an incomplete or damaged meta table: refuse (exit code 4), don't crash
            raise StoreOpenError(
                f"{self.path} has an unreadable Kalos meta table ({type(e).__name__}: {e}); "
                "the store is corrupt or from another release: restore it from a backup"
            ) from None
        if version != SCHEMA_VERSION:
            raise StoreOpenError(
                f"{self.path} has schema version {version}; this release reads version "
                f"{SCHEMA_VERSION}. Open it with the release that wrote it and export the data"
            )
        if stored != (dim, metric):
            raise StoreOpenError(
                f"{self.path} holds dim={meta['dim']} metric={meta['metric']} vectors, but the "
                f"sidecar was started with --dim {dim} --metric {metric}; start it with the "
                "stored settings, or use another --data-dir"
            )
        if not self._has_table("memories"):  # (a Kalos meta table, its rows' table gone)
            raise StoreOpenError(
                f"{self.path} has a Kalos meta table but no memories table: the store is "
                "damaged. Restore it from a backup, or move it away to start empty"
            )

    def _make_new(self, dim: int, metric: str) -> None:
        """Make a new, empty store under a temporary name, on disk whole, and rename it into
        place: a main file is then never empty, even after a full disk or a kill at the first
        start (SQLite creates its file empty and writes the first page later), so an empty one
        is always a truncated store (:meth:`_refuse_a_lost_main_file`)."""
        tmp = self.dir / (DB_FILE + ".new")
        for p in (tmp, self.dir / (DB_FILE + ".new-journal")):  # (a killed first start's)
            p.unlink(missing_ok=True)
        db = None
        try:
            db = sqlite3.connect(tmp, isolation_level=None)
            db.execute(f"PRAGMA page_size={PAGE_SIZE}")
            db.execute("PRAGMA synchronous=FULL")
            self.db = db
            self._create(dim, metric)  # (a rollback journal here: WAL is set once it is in place)
            self.db = None
            db.close()
            db = None
            os.chmod(tmp, 0o600)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
        except sqlite3.DatabaseError as e:
            if self._outside(e):
                raise self._unavailable(e) from None
            raise
        except PermissionError:
            raise
        except OSError as e:  # (an fsync or a rename the disk refused: not a usage error)
            raise StoreUnavailable(f"{self.path} could not be made: {e.strerror or e}; mend the disk "
                                   "or free space, and start again") from None  # fmt: skip
        finally:
            self.db = None
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.dir)

    def _refuse_a_lost_main_file(self) -> None:
        """An empty main file, or one missing or empty beside a write-ahead log that holds
        frames: the file was lost or truncated (SQLite writes its first page before any log
        exists). SQLite would open it as a new, empty database (and delete the log, which
        after a ``kill -9`` holds every row not yet checkpointed): refuse instead (exit 4). A
        missing file without a log is a new store (or one moved away on purpose)."""
        wal = self.dir / (DB_FILE + "-wal")
        try:
            wal_size = wal.stat().st_size
        except FileNotFoundError:
            wal_size = 0
        try:
            size: int | None = self.path.stat().st_size
        except FileNotFoundError:
            size = None
        if size == 0 and not wal_size:  # (SQLite would make a new store in it)
            raise StoreOpenError(
                f"{self.path} is empty (0 bytes): a store's file never is (it is made whole, then put "
                "in place), so it was truncated, rows and all, or left by an earlier release's first "
                "start cut short. Restore it from a backup, or remove the kalos.sqlite3* files to "
                "start empty"
            )
        if wal_size and not size:
            raise StoreOpenError(
                f"{self.path} is {'missing' if size is None else 'empty'}, but its write-ahead log "
                f"{wal.name} holds {wal_size} bytes: the store's main file was lost or truncated, and "
                "SQLite would discard the log. Restore the store from a backup (a first start "
                "killed while it made the store: remove the kalos.sqlite3* files and start again)"
            )

    @staticmethod
    def _outside(e: sqlite3.DatabaseError) -> bool:
        code = getattr(e, "sqlite_errorcode", None)
        return code is not None and code != _SHORT_READ and code & 0xFF in _OUTSIDE

    def _unavailable(self, e: sqlite3.DatabaseError) -> Exception:
        why = _OUTSIDE[e.sqlite_errorcode & 0xFF]  # type: ignore[attr-defined]
        if e.sqlite_errorcode & 0xFF == _CANTOPEN:  # type: ignore[attr-defined]
            cause = self._cannot_open()
            if cause is not None:
                return cause
        return StoreUnavailable(
            f"{self.path} could not be opened or read: {why} ({e}; {getattr(e, 'sqlite_errorname', '?')}). "
            "Nothing says the store is damaged: free space on its disk (SQLite's temporary files "
            "need room too), or mend the disk, and start again"
        )

    def _cannot_open(self) -> Exception | None:
        """Why SQLite could not open one of the store's files (SQLITE_CANTOPEN says nothing
        more): a permission (PermissionError: exit 6, as for the data dir) or a directory where
        a file should be (exit 4); None where the files open (a full disk, say)."""
        for p in (self.path, *(self.dir / (DB_FILE + x) for x in ("-wal", "-shm"))):
            if not p.exists():
                continue
            try:
                os.close(os.open(p, os.O_RDWR))
            except IsADirectoryError:
                return StoreOpenError(f"{p} is a directory, where the store's file should be: move it away")
            except PermissionError as e:
                return PermissionError(e.errno, f"this user may not read and write the store's file ({e.strerror})",
                                       str(p))  # fmt: skip
            except OSError:
                continue
        if not os.access(self.dir, os.W_OK | os.X_OK):
            return PermissionError(13, "this user may not create files in the data dir (SQLite's log)", str(self.dir))
        return None

    def _has_table(self, name: str) -> bool:
        q = "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?"
        return self.db.execute(q, (name,)).fetchone() is not None

    def _create(self, dim: int, metric: str) -> None:
        with self._tx():
            self.db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self.db.execute(
                "CREATE TABLE memories("
                " ns TEXT NOT NULL, id TEXT NOT NULL, text TEXT NOT NULL,"
                " metadata BLOB NOT NULL, vector BLOB NOT NULL,"
                " created_at REAL NOT NULL, updated_at REAL NOT NULL, crc INTEGER NOT NULL,"
                " PRIMARY KEY (ns, id)) WITHOUT ROWID"
            )
            self.db.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [("schema_version", str(SCHEMA_VERSION)), ("dim", str(dim)), ("metric", metric)],
            )

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")  # (in the try: a COMMIT that fails may leave it open)
        except BaseException:
            # (SQLite may have rolled back already: a full disk part-way through a large write.
            # Its own error is the one to raise, not ROLLBACK's "no transaction is active".)
            if self.db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
            raise

    def upsert(self, rows: Sequence[StoredRow]) -> None:
        """Insert or replace rows in one transaction; returns after the commit."""
        params = []
        for r in rows:
            vec = np.ascontiguousarray(r.vector, dtype="<f4").tobytes()
            crc = row_crc(r.namespace, r.id, r.text, r.metadata_json, vec, r.created_at,
                          r.updated_at)  # fmt: skip
            params.append((r.namespace, r.id, r.text, r.metadata_json, vec, r.created_at,
                           r.updated_at, crc))  # fmt: skip
        with self._tx():
            self.db.executemany("INSERT OR REPLACE INTO memories VALUES (?,?,?,?,?,?,?,?)", params)

    def delete(self, namespace: str, ids: Sequence[str]) -> None:
        with self._tx():
            self.db.executemany("DELETE FROM memories WHERE ns=? AND id=?",
                                [(namespace, i) for i in ids])  # fmt: skip

    def count(self) -> int:
        """The stored rows.

        Raises:
            StoreOpenError: SQLite cannot read the table (damage the open's checks missed).
        """
        try:
            return int(self.db.execute("SELECT count(*) FROM memories").fetchone()[0])
        except sqlite3.DatabaseError as e:
            if self._outside(e):
                raise self._unavailable(e) from None
            raise StoreOpenError(f"{self.path} cannot be read ({e}): the store is corrupt. Restore "
                                 "it from a backup, or move it away to start empty") from None  # fmt: skip

    def load(self, dim: int, batch: int = 10000) -> Iterator[list[StoredRow]]:
        """Every stored row, in batches, each checked against its CRC.

        Raises:
            StoreOpenError: a row's checksum, types or vector size are wrong, or SQLite cannot
                read the file (a damaged page, text that is not UTF-8...).
        """
        try:
            cur = self.db.execute(
                "SELECT ns, id, text, metadata, vector, created_at, updated_at, crc FROM memories"
            )
            while True:
                chunk = cur.fetchmany(batch)
                if not chunk:
                    return
                yield [self._checked(row, dim) for row in chunk]
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            if isinstance(e, sqlite3.DatabaseError) and self._outside(e):
                raise self._unavailable(e) from None
            # Raised by damage that SQLite's quick_check does not look at (e.g. a flipped byte
            # that makes a TEXT value invalid UTF-8): refuse like any other corruption rather
            # than crash with a traceback and a generic exit code.
            raise StoreOpenError(
                f"{self.path} cannot be read ({e}): the store is corrupt. Restore it from a "
                "backup; Kalos will not serve data it cannot vouch for"
            ) from None

    def _checked(self, row: tuple[Any, ...], dim: int) -> StoredRow:
        ns, id_, text, meta, vec, created, updated, crc = row
        # A flipped byte can change a column's type (TEXT to BLOB, REAL to INTEGER...) as
        # well as its value: check the types before computing anything from them.
        ok = (
            all(isinstance(x, str) for x in (ns, id_, text))
            and isinstance(meta, bytes) and isinstance(vec, bytes) and len(vec) == 4 * dim
            and isinstance(created, float) and isinstance(updated, float) and isinstance(crc, int)
        )  # fmt: skip
        # the CRC as rows are written now first; the older form (no timestamps) only if that fails
        if not ok or (crc != row_crc(ns, id_, text, meta, vec, created, updated)
                      and crc != row_crc(ns, id_, text, meta, vec)):  # fmt: skip
            raise StoreOpenError(
                f"row (namespace={ns!r}, id={id_!r}) of {self.path} fails its checksum: "
                "the file is corrupt. Restore it from a backup; Kalos will not serve "
                "data it cannot vouch for"
            )
        return StoredRow(ns, id_, text, meta, np.frombuffer(vec, dtype="<f4"), created, updated)

    def close(self) -> None:
        db = getattr(self, "db", None)
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()
            self.db = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1
        if getattr(self, "_dir_fd", -1) >= 0:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = -1

"""Shared machinery of the reliability suite (importable as ``reliability._harness``).

* :func:`scale`: CI-length vs full-length counts (``KALOS_RELIABILITY_FULL=1`` selects the
  issue's full figures: 200 kills, 10-minute fuzz and soak, 10,000 connect cycles).
* :func:`fork_worker`: run a function in a forked child (cheap: no interpreter start-up, which
  matters for 200 kills on 2 cores); the child always leaves through ``os._exit``.
* :class:`Counters`: int64 counters in an anonymous shared mapping, written by forked workers
  and read by the test while they run.
* :class:`SegmentView`: a test's own read-write mapping of a sidecar's segment, to read slot
  states, count free slots, checksum guard areas, or write hostile requests.
* :data:`PATCHES`: fault injections for negative controls. A patched sidecar is the real
  ``kalos-sidecar serve`` started with ``python -P -c "<patch>; main()"``: the protection under
  test is switched off inside the sidecar process only, never in the code the suite ships.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc

from kalos_retrievers import _ipc
from kalos_retrievers.protocol import (
    CTL_OFFSETS,
    HEADER_OFFSETS,
    HEADER_SIZE,
    SlotState,
    decode_header,
    doorbell_name,
    segment_name,
)

FULL = os.environ.get("KALOS_RELIABILITY_FULL", "") not in ("", "0")


def scale(ci: Any, full: Any) -> Any:
    """``full`` when ``KALOS_RELIABILITY_FULL=1``, else the CI-length ``ci``."""
    return full if FULL else ci


def figure(name: str, **values: Any) -> None:
    """Print one line of figures for the report (visible with ``-s`` or in the -rA summary);
    also appended to ``$KALOS_RELIABILITY_FIGURES`` when that is set."""
    line = json.dumps({"scenario": name, "full": FULL, **values}, default=str)
    print("FIGURE", line)
    path = os.environ.get("KALOS_RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def wait_until(pred: Callable[[], Any], timeout: float, interval: float = 0.002) -> Any:
    """Poll ``pred`` until it returns a truthy value or ``timeout`` passes; return its last
    value (falsy on timeout). Timing is by the monotonic clock."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


# --------------------------------------------------------------------------------------------
# Forked workers


class Worker:
    def __init__(self, pid: int, result_path: Path) -> None:
        self.pid = pid
        self.result_path = result_path
        self.status: int | None = None

    def alive(self) -> bool:
        if self.status is not None:
            return False
        pid, st = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return True
        self.status = st
        return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for the exit (SIGKILL after ``timeout``); returns the wait status."""
        if self.status is not None:
            return self.status
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                self.kill()
                _, self.status = os.waitpid(self.pid, 0)
                self.result_path.unlink(missing_ok=True)
                raise AssertionError(f"worker {self.pid} did not finish within {timeout} s")
            time.sleep(0.005)
        assert self.status is not None
        if os.WIFSIGNALED(self.status):  # killed: it wrote no result, and none will be read
            self.result_path.unlink(missing_ok=True)
        return self.status

    def result(self, timeout: float = 30.0) -> Any:
        st = self.wait(timeout)
        try:
            data = json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            data = None
        finally:
            self.result_path.unlink(missing_ok=True)
        if data is None:
            raise AssertionError(f"worker {self.pid} left no result (wait status {st:#x})")
        if "exception" in data:
            raise AssertionError(f"worker {self.pid} raised:\n{data['exception']}")
        return data["result"]


def fork_worker(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Worker:
    """Run ``fn(*args, **kwargs)`` in a forked child; its JSON-able return value (or the
    traceback of what it raised) comes back through :meth:`Worker.result`."""
    fd, path = tempfile.mkstemp(prefix="kalos-rel-", suffix=".json")
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's alarm is the parent's
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                out: dict[str, Any] = {"result": fn(*args, **kwargs)}
            except BaseException:
                out = {"exception": traceback.format_exc()}
                code = 1
            with open(path, "w") as f:
                json.dump(out, f, default=_jsonable)
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    return Worker(pid, Path(path))


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, set | frozenset | tuple):
        return list(x)
    return str(x)


class Counters:
    """``n`` int64 counters shared with forked children (an anonymous MAP_SHARED mapping)."""

    def __init__(self, n: int = 64) -> None:
        self._mm = mmap.mmap(-1, 8 * n)
        self.a = np.frombuffer(self._mm, np.int64, n)

    def __getitem__(self, i: int) -> int:
        return int(self.a[i])

    def __setitem__(self, i: int, v: int) -> None:
        self.a[i] = v

    def add(self, i: int, v: int = 1) -> None:
        self.a[i] += v  # one writer per counter: no lost updates


# --------------------------------------------------------------------------------------------
# Shared-memory objects of a sidecar name


def ipc_objects(name: str) -> set[str]:
    """The /dev/shm entries that belong to sidecar ``name`` (segment and semaphores)."""
    pat = re.compile(rf"^(kalos-{re.escape(name)}|sem\.kalos-{re.escape(name)}-(bell|r\d+))$")
    return {p for p in os.listdir("/dev/shm") if pat.match(p)}


def expected_ipc_objects(name: str, slots: int) -> set[str]:
    return {f"kalos-{name}", f"sem.kalos-{name}-bell"} | {f"sem.kalos-{name}-r{i}" for i in range(slots)}


def cleanup_ipc(name: str) -> set[str]:
    """Unlink whatever a killed sidecar left under ``name`` (its document arenas too); returns
    what was removed."""
    arena = re.compile(rf"^kalos-{re.escape(name)}-docs\.\d+$")
    gone = ipc_objects(name) | {p for p in os.listdir("/dev/shm") if arena.match(p)}
    for p in gone:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{p}")
    return gone


def segment_inode(name: str) -> int | None:
    return _ipc.segment_inode(segment_name(name))


# --------------------------------------------------------------------------------------------
# A test's own view of a segment


class SegmentView:
    """Read-write mapping of ``/kalos-NAME`` through the test's own descriptor (its own open
    file description: its locks conflict with the sidecar's and the clients')."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.shm = posix_ipc.SharedMemory(segment_name(name), flags=0)
        self.fd = self.shm.fd
        self.size = os.fstat(self.fd).st_size
        self.mm = mmap.mmap(self.fd, self.size)
        self.inode = os.fstat(self.fd).st_ino
        self.header = decode_header(self.mm[:HEADER_SIZE], self.size)
        self.layout = self.header.layout
        lay = self.layout
        self.states = np.ndarray((lay.n_slots,), np.uint32, self.mm, HEADER_SIZE, (lay.slot_size,))
        self.owners = np.ndarray((lay.n_slots,), np.uint32, self.mm, HEADER_SIZE + 4, (lay.slot_size,))

    def close(self) -> None:
        self.states = self.owners = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self.mm.close()
        with contextlib.suppress(Exception):
            self.shm.close_fd()

    def __enter__(self) -> SegmentView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # slots -------------------------------------------------------------------------------
    def slot_locked(self, i: int) -> bool:
        return _ipc.is_locked(self.fd, _ipc.slot_lock_byte(i))

    def free_slots(self) -> int:
        """Slots a new client could claim now: state FREE and nobody holds the slot's lock."""
        return sum(1 for i in range(self.layout.n_slots)
                   if self.states[i] == SlotState.FREE and not self.slot_locked(i))  # fmt: skip

    def slots_of(self, pid: int) -> list[int]:
        return [i for i in range(self.layout.n_slots)
                if self.owners[i] == pid and self.states[i] != SlotState.FREE]  # fmt: skip

    def sidecar_alive(self) -> bool:
        return _ipc.is_locked(self.fd, _ipc.SIDECAR_LOCK_BYTE)

    def slot_bytes(self, i: int) -> memoryview:
        off = self.layout.slot_offset(i)
        return memoryview(self.mm)[off : off + self.layout.slot_size]

    def ctl_u32(self, i: int, field: str) -> int:
        return struct.unpack_from("<I", self.mm, self.layout.slot_offset(i) + CTL_OFFSETS[field])[0]

    # guards ------------------------------------------------------------------------------
    #: header fields the sidecar legitimately rewrites while serving
    MUTABLE_HEADER = ("heartbeat_ns", "row_count", "capacity", "state")

    def header_digest(self) -> str:
        b = bytearray(self.mm[:HEADER_SIZE])
        for f in self.MUTABLE_HEADER:
            o = HEADER_OFFSETS[f]
            n = 4 if f == "state" else 8
            b[o : o + n] = b"\x00" * n
        return hashlib.blake2b(bytes(b), digest_size=16).hexdigest()

    def digest(self, slots: Iterable[int]) -> dict[str, str]:
        out = {"header": self.header_digest()}
        for i in slots:
            out[f"slot{i}"] = hashlib.blake2b(self.slot_bytes(i), digest_size=16).hexdigest()
        return out


def open_doorbell(name: str) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore(doorbell_name(name), flags=0)


# --------------------------------------------------------------------------------------------
# Processes


def proc_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_sockets(pid: int) -> set[int]:
    """Socket inodes among ``pid``'s descriptors."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
            if t.startswith("socket:["):
                out.add(int(t[8:-1]))
    return out


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets of ``pid`` in LISTEN state (IPv4 and IPv6)."""
    inodes = proc_sockets(pid)
    out = []
    for table in ("tcp", "tcp6"):
        p = Path(f"/proc/{pid}/net/{table}")
        if not p.exists():
            continue
        for line in p.read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or int(f[9]) not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = f[1].split(":")
            out.append((_decode_addr(addr_hex), int(port_hex, 16)))
    return out


def _decode_addr(h: str) -> str:
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    b = b"".join(words)
    if b[:12] == b"\x00" * 10 + b"\xff\xff":
        return ".".join(str(x) for x in b[12:])
    return ":".join(b[i : i + 2].hex() for i in range(0, 16, 2))


# --------------------------------------------------------------------------------------------
# Fault injection for negative controls: patches applied inside a sidecar process

PATCHES: dict[str, str] = {
    # scenario 1: never reclaim the slots of dead clients
    "no_reclaim": (
        "from kalos_retrievers.sidecar.dispatcher import Dispatcher\n"
        "Dispatcher.reclaim = lambda self, fd: 0\n"
    ),
    # scenario 4: acknowledge every other write without committing it
    "lose_writes": (
        "from kalos_retrievers.sidecar import store as _s\n"
        "_up, _del, _n = _s.SqliteStore.upsert, _s.SqliteStore.delete, [0]\n"
        "def _upsert(self, rows):\n"
        "    _n[0] += 1\n"
        "    if _n[0] % 2: _up(self, rows)\n"
        "def _delete(self, ns, ids):\n"
        "    _n[0] += 1\n"
        "    if _n[0] % 2: _del(self, ns, ids)\n"
        "_s.SqliteStore.upsert, _s.SqliteStore.delete = _upsert, _delete\n"
    ),
    # scenario 5: load rows without checking their CRC
    "no_crc": (
        "from kalos_retrievers.sidecar import store as _s\n"
        "class _AnyCrc(int):\n"
        "    def __ne__(self, other): return False\n"
        "    def __eq__(self, other): return True\n"
        "    __hash__ = int.__hash__\n"
        "_s.row_crc = lambda *a: _AnyCrc(0)\n"
    ),
    # scenario 6: a sidecar that does not respect a live owner's lock, or never clears stale
    # state
    "ignore_live_owner": (
        "from kalos_retrievers import _ipc\n"
        "from kalos_retrievers.sidecar.server import Server\n"
        "Server._clear_stale = lambda self, name: _ipc.unlink_segment(name)\n"
        # nor check, after taking the lock, that the name is still ours
        "Server._holds_name = lambda self, seg, name: (_ipc.try_lock(seg.fd, 0), True)[1]\n"
    ),
    "keep_stale": (
        "from kalos_retrievers.sidecar.server import Server\n"
        "Server._clear_stale = lambda self, name: None\n"
    ),
    # scenario 7: never notice that the segment or semaphores were removed
    "no_republish": (
        "from kalos_retrievers.sidecar.server import Server\n"
        "Server._removed_from_outside = lambda self: False\n"
    ),
    # scenario 9: write one byte past the answered slot (into the next slot) on every error
    # response, or die on a bad request
    "write_outside": (
        "from kalos_retrievers.sidecar.dispatcher import Dispatcher\n"
        "_r = Dispatcher._respond\n"
        "def _respond(self, i, req, status, n, blob, flags, t0):\n"
        "    _r(self, i, req, status, n, blob, flags, t0)\n"
        "    if status and i + 1 < self.layout.n_slots:\n"
        "        o = self.slot_off[i + 1] + self.layout.blob_offset + 77\n"
        "        self.mm[o] = (self.mm[o] + 1) & 0xFF\n"
        "Dispatcher._respond = _respond\n"
    ),
    # the dispatcher's batched recall as it was before the per-member isolation fix
    "pre_fix_batch": (
        "from kalos_retrievers.sidecar.dispatcher import Dispatcher\n"
        "from kalos_retrievers.protocol import Invalid, Status\n"
        "def _old(self, part, k, flags):\n"
        "    try:\n"
        "        specs = [self._spec(i, req) for i, req, _ in part]\n"
        "        kk = self.service.recall_slots(specs, k, '', None)\n"
        "        for (i, req, t0), spec in zip(part, specs):\n"
        "            self._write_hits(i, req, spec, kk, flags, t0)\n"
        "    except Invalid as e:\n"
        "        for i, req, t0 in part:\n"
        "            self._error(i, req, e.status, str(e), t0)\n"
        "    except Exception as e:\n"
        "        for i, req, t0 in part:\n"
        "            self._error(i, req, Status.INTERNAL, str(e), t0)\n"
        "Dispatcher._pipeline = _old\n"
    ),
    "crash_on_bad_request": (
        "import os\n"
        "from kalos_retrievers.sidecar.dispatcher import Dispatcher\n"
        "_e = Dispatcher._error\n"
        "def _error(self, i, req, status, message, t0):\n"
        "    if status == 1: os._exit(70)\n"
        "    _e(self, i, req, status, message, t0)\n"
        "Dispatcher._error = _error\n"
    ),
    # scenario 13: keep every response blob forever (a sidecar-side leak)
    "leak_responses": (
        "from kalos_retrievers.sidecar.dispatcher import Dispatcher\n"
        "_r, _kept = Dispatcher._respond, []\n"
        "def _respond(self, i, req, status, n, blob, flags, t0):\n"
        "    _kept.append(bytes(16384))\n"
        "    _r(self, i, req, status, n, blob, flags, t0)\n"
        "Dispatcher._respond = _respond\n"
    ),
}

_MAIN = (
    "import sys\n"
    "from kalos_retrievers.sidecar.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def apply_patch(argv: list[str], patch: str | None) -> list[str]:
    """Turn a Sidecar's ``python -P -m kalos_retrievers.sidecar serve ...`` into the same
    command with ``patch`` applied first (None: unchanged)."""
    if patch is None:
        return argv
    assert argv[2:4] == ["-m", "kalos_retrievers.sidecar"], argv
    return [*argv[:2], "-c", PATCHES[patch] + _MAIN, *argv[4:]]

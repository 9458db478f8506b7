"""Scenario 8: the connect handshake (magic, protocol version, initialization, size).

Fake segments are published under a test name, with the sidecar's lock held by the test, so the
client meets exactly the header under test.

Pass: wrong magic, another protocol major version, version 0 (still initializing), an unwritten
(all-zero) header, a segment shorter than its header, an empty segment, a geometry that does not
fit the segment, a stale segment (nobody holds the lock) and another dimension each map to their
own error class and a message that says what is wrong; a well-formed fake header connects (so
the harness itself is sound).

Negative control: with the client's error mapping collapsed to one generic error, the harness
reports that the cases are no longer told apart.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import posix_ipc
import pytest
from reliability._harness import cleanup_ipc

import kalos_retrievers._conn as conn_mod
from kalos_retrievers import (
    DimensionMismatch,
    IncompatibleVersion,
    KalosClient,
    KalosError,
    ProtocolError,
    SidecarUnavailable,
    _ipc,
)
from kalos_retrievers.protocol import (
    HEADER_OFFSETS,
    VERSION_OFFSET,
    Layout,
    SidecarState,
    encode_header,
    segment_name,
)

pytestmark = pytest.mark.reliability

LAYOUT = Layout(n_slots=2, dim=8, max_k=16, max_results=8192, payload_size=8192, blob_size=4096)


def good_header(version: int = 1) -> bytearray:
    h = bytearray(encode_header(LAYOUT, metric=0, dtype=0, pid=os.getpid(), uid=os.getuid(),
                                boot_epoch=5, name="fake", backend="cpu",
                                state=SidecarState.READY))  # fmt: skip
    struct.pack_into("<H", h, VERSION_OFFSET, version)
    return h


@contextmanager
def fake_segment(name: str, size: int, header: bytes, *, hold_lock: bool = True) -> Iterator[None]:
    shm = posix_ipc.SharedMemory(segment_name(name), posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        if size:
            mm = mmap.mmap(shm.fd, size)
            n = min(len(header), size)
            mm[:n] = header[:n]
            mm.close()
        if hold_lock:
            assert _ipc.try_lock(shm.fd, _ipc.SIDECAR_LOCK_BYTE)
        # semaphores a well-formed segment needs, so the positive control really connects
        sems = [_ipc.create_semaphore(f"/kalos-{name}-bell")]
        yield
    finally:
        for s in sems:
            _ipc.close_semaphore(s)
        shm.close_fd()
        cleanup_ipc(name)


def _bad_magic() -> bytes:
    h = good_header()
    h[:8] = b"NOTKALOS"
    return bytes(h)


def _geometry() -> bytes:
    h = good_header()
    struct.pack_into("<I", h, HEADER_OFFSETS["n_slots"], 64)  # more slots than the segment holds
    return bytes(h)


SEG = LAYOUT.segment_size
#: case -> (segment size, header bytes, lock held, client dim, expected class, words in the message)
CASES: dict[str, tuple[int, bytes, bool, int | None, type[Exception], tuple[str, ...]]] = {
    "wrong magic": (SEG, _bad_magic(), True, None, ProtocolError, ("not a Kalos segment",)),
    "major version 2": (SEG, bytes(good_header(2)), True, None, IncompatibleVersion, ("v2.", "Upgrade")),
    "major version 65535": (SEG, bytes(good_header(0xFFFF)), True, None, IncompatibleVersion, ("v65535",)),
    "version 0": (SEG, bytes(good_header(0)), True, None, SidecarUnavailable, ("still starting up",)),
    "unwritten header": (SEG, b"", True, None, SidecarUnavailable, ("still starting up",)),
    "shorter than header": (100, bytes(good_header()), True, None, ProtocolError, ("shorter than a header",)),
    "empty segment": (0, b"", True, None, SidecarUnavailable, ("still creating its segment",)),
    "geometry": (SEG, _geometry(), True, None, ProtocolError, ("geometry",)),
    "stale": (SEG, bytes(good_header()), False, None, SidecarUnavailable, ("stale",)),
    "other dim": (SEG, bytes(good_header()), True, 16, DimensionMismatch, ("dim=8", "dim=16")),
}


def run_handshakes(make_name: Callable[[], str]) -> dict[str, Any]:
    """Connect to each fake segment; returns what each case raised, and the violations."""
    seen: dict[str, tuple[str, str]] = {}
    bad: list[str] = []
    for case, (size, header, lock, dim, cls, words) in CASES.items():
        name = make_name()
        with fake_segment(name, size, header, hold_lock=lock):
            try:
                KalosClient(name, dim=dim, spin_us=0, timeout=0.5).close()
            except KalosError as e:
                seen[case] = (type(e).__name__, str(e))
            except Exception as e:  # anything else is a crash of the handshake
                bad.append(f"{case}: raised {type(e).__name__}: {e}")
                continue
            else:
                bad.append(f"{case}: connected")
                continue
        got_cls, msg = seen[case]
        if got_cls != cls.__name__:
            bad.append(f"{case}: raised {got_cls}, expected {cls.__name__}: {msg}")
        if not all(w in msg for w in words) or name not in msg:
            bad.append(f"{case}: unclear message (wanted {words} and the name): {msg}")
    distinct = {(c, m.split(":")[0][:40]) for c, m in seen.values()}
    messages = {m for _, m in seen.values()}
    if len(messages) < len(seen):
        bad.append("two cases gave the same message")
    return {"seen": seen, "violations": bad, "distinct": len(distinct)}


def test_handshake_errors_are_distinct_and_clear(make_name: Callable[[], str]) -> None:
    out = run_handshakes(make_name)
    assert not out["violations"], out["violations"]


def test_handshake_positive_control_well_formed_fake_connects(make_name: Callable[[], str]) -> None:
    name = make_name()
    with fake_segment(name, SEG, bytes(good_header())), KalosClient(name, dim=8, spin_us=0, lazy=True) as c:
        assert c.header.dim == 8 and c.header.boot_epoch == 5


def test_handshake_negative_control_collapsed_errors(
    make_name: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conn_mod, "_header_error",
                        lambda name, e: ProtocolError(f"segment of {name!r} is unusable"))  # fmt: skip
    out = run_handshakes(make_name)
    assert any("expected" in v for v in out["violations"]), out
    assert any("unclear message" in v for v in out["violations"]), out

"""One connection of a :class:`~kalos_retrievers.client.KalosClient` to one boot epoch of a
sidecar: the mapped segment and its header, the slots this process has claimed, the document
arena and the carousel's slots (protocol v1.4) as the sidecar publishes them.

A connection only maps, claims and reads; the request/answer exchange, the waits and the
reconnects are the client's (:mod:`.client`). When the sidecar restarts (a new boot epoch), the
client drops its connection and opens a new one.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
import time
from typing import Any, Final

import numpy as np
import posix_ipc

from . import _ipc
from .arena import ArenaView, arena_name
from .errors import DimensionMismatch, IncompatibleVersion, KalosError, ProtocolError, SidecarUnavailable
from .protocol import (
    CAR_HEAD,
    CAR_KMAX,
    CTL_SIZE,
    HEADER_OFFSETS,
    REQUEST_OFFSET,
    CarouselLayout,
    Flag,
    Header,
    HeaderError,
    SidecarState,
    SlotState,
    car_bounds,
    carousel_segment_name,
    decode_header,
    doorbell_name,
    foreign_segment,
    response_sem_name,
    segment_name,
)

_ARENA_VERSION_WORD = 62  # header u32 index of arena_version (offset 248, two words)
_DOORBELL_K_WORD = 64  # header u32 index of doorbell_k (offset 256)
_DOORBELL_CAP_WORD = 65  # header u32 index of doorbell_cap (offset 260)
_CAROUSEL_EPOCH_WORD = 66  # header u32 index of carousel_epoch (offset 264, two words; v1.4)
_CAROUSEL_SLOTS_WORD = 68  # header u32 index of carousel_slots (offset 272)
_DOORBELL_SPACES_WORD = 69  # header u32 index of doorbell_spaces (offset 276; v1.5)
_DOORBELL_ARGS_WORD = 70  # header u32 index of doorbell_args (offset 280; v1.6)
_HEADER_WORDS = 71  # the header's u32 words the client reads (through doorbell_args)
_DOORBELL: Final = np.uint32(SlotState.DOORBELL)


class _Slot:
    """A claimed slot and typed views of its areas. Used by one thread at a time."""

    __slots__ = ("blob", "ctl", "index", "mem", "payload", "payload_f32", "pending", "rows", "scores",
                 "sem", "seq", "state")  # fmt: skip

    def __init__(self, conn: _Conn, index: int) -> None:
        lay = conn.layout
        off = lay.slot_offset(index)
        mv = memoryview(conn.seg.mm)
        self.index = index
        self.ctl = mv[off : off + CTL_SIZE]
        self.mem = mv[off : off + lay.slot_size]  # the whole slot (_fastpath writes and reads it)
        self.state = self.ctl.cast("I")
        self.payload = mv[off + lay.payload_offset : off + lay.rows_offset]
        self.payload_f32 = np.frombuffer(self.payload, dtype="<f4")
        self.rows = np.frombuffer(conn.seg.mm, "<i4", lay.max_results, off + lay.rows_offset)
        self.scores = np.frombuffer(conn.seg.mm, "<f4", lay.max_results, off + lay.scores_offset)
        self.blob = mv[off + lay.blob_offset : off + lay.blob_offset + lay.blob_size]
        self.sem = _ipc.open_semaphore(response_sem_name(conn.name, index))
        self.seq = random.getrandbits(48)
        self.pending = 0  # seq of an abandoned request still in the sidecar's hands


class _CarouselView:
    """A GPU sidecar's carousel slots, mapped (protocol v1.4, KALOS_CAROUSEL=direct): slot i
    is the one the holder of protocol slot i writes its batch-1 recalls into."""

    __slots__ = ("buf", "lay", "queries", "rows", "scores", "words")

    def __init__(self, mm: mmap.mmap, dim: int, n: int) -> None:
        lay = CarouselLayout.of(dim)
        if not n > 0 or len(mm) < n * lay.slot_bytes:
            raise ValueError(f"a carousel segment of {len(mm)} bytes does not hold {n} slots of {lay.slot_bytes}")
        self.buf, self.lay = mm, lay  # (for _fastpath.car_request1 / car_answer1: slot i at i * slot_bytes)
        stride = lay.slot_bytes // 4

        def view(dtype: Any, off: int, count: int) -> np.ndarray:  # [n, count] at byte off of each slot
            return np.frombuffer(mm, dtype, n * stride).reshape(n, stride)[:, off // 4 : off // 4 + count]

        self.words = view(np.uint32, 0, stride)  # (the map lives as long as these views do)
        self.queries = view(np.float32, CAR_HEAD, dim)
        self.rows = view(np.int32, lay.rows_off, CAR_KMAX)
        self.scores = view(np.float32, lay.scores_off, CAR_KMAX)

    @classmethod
    def open(cls, name: str, dim: int, n: int) -> _CarouselView:
        shm = posix_ipc.SharedMemory(carousel_segment_name(name), flags=0)
        try:
            mm = mmap.mmap(shm.fd, os.fstat(shm.fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            shm.close_fd()
        return cls(mm, dim, n)


class _Conn:
    def __init__(self, name: str, seg: _ipc.Segment, header: Header) -> None:
        self.name = name
        self.seg = seg
        self.header = header
        self.layout = header.layout
        self.epoch = header.boot_epoch
        self.dead = False
        self.bell = _ipc.open_semaphore(doorbell_name(name))
        self.owned: list[_Slot] = []
        self.free: list[_Slot] = []
        # True while a slot of ours may hold an abandoned request (a call left it at its
        # deadline): the client's next call runs _recover_pending (see KalosClient._release)
        self.recover = False
        # slots whose thread is blocked on its semaphore now (KalosClient._block): close()
        # leaves the semaphores open while any is, and the last one out closes them (a
        # semaphore closed under a thread's sem_timedwait crashes the process)
        self.sleepers: set[int] = set()
        self._closing = False
        self._sems_open = True
        self._state_off = 16  # HEADER_OFFSETS["state"]; fixed by the v1 layout
        self._hdr32 = memoryview(seg.mm)[: 4 * _HEADER_WORDS].cast("I")
        self._car_epoch = memoryview(seg.mm)[4 * _CAROUSEL_EPOCH_WORD : 4 * _CAROUSEL_EPOCH_WORD + 8].cast("Q")
        self._car: _CarouselView | None = None  # the carousel's slots, mapped (KALOS_CAROUSEL=direct)
        self._car_tried = 0  # the carousel epoch at which mapping its slots last failed
        self.car_bounds = car_bounds(header.metric)  # a direct query's largest |x| lies in these
        self._states: np.ndarray | None = None  # every slot's state word (waiting_requests)
        self._arena: ArenaView | None = None
        self._arena_mm: mmap.mmap | None = None
        # what a recall whose documents come from the arena asks for: the hits' whole entries
        # from a v1.3 sidecar (arena.ArenaView.entry_docs), their generations from older ones
        self.arena_flags = Flag.ARENA_DOCS | (Flag.ARENA_ENTRIES if header.version_minor >= 3 else 0)
        # q . tiny is finite exactly when every element of q is (see _recall_one)
        self.tiny = np.full(header.dim, 2.0**-100, np.float32)
        # what _fastpath needs of the layout (with the flags of a recall whose documents come
        # from the arena, and of one whose documents come inline), and the header it reads
        # doorbell_k from
        lay = self.layout
        self.fast_layout = (header.dim, lay.payload_offset, lay.rows_offset, lay.scores_offset, lay.blob_offset,
                            lay.blob_size, int(self.arena_flags), _DOORBELL_K_WORD)  # fmt: skip
        self.fast_layout_inline = (*self.fast_layout[:6], 0, _DOORBELL_K_WORD)
        self.hdr = memoryview(seg.mm)[: 4 * (_DOORBELL_CAP_WORD + 1)]
        self.hdr_all = memoryview(seg.mm)[: 4 * _HEADER_WORDS]  # (bytes: _fastpath.bell1 reads through the carousel's)

    def doorbell_k(self) -> int:
        """Largest k the GPU's resident kernel answers now (0: it is stopped, or there is none):
        DOORBELL requests only while nonzero."""
        return self._hdr32[_DOORBELL_K_WORD]

    def doorbell_cap(self) -> int:
        """Largest k of the sidecar's resident kernel, running or not (0: it has none)."""
        return self._hdr32[_DOORBELL_CAP_WORD]

    def doorbell_spaces(self) -> int:
        """Nonzero when the resident kernel serves namespaces besides the default one (v1.5):
        a namespace's recall without a filter may then be sent as DOORBELL too (the kernel
        hands back one it does not serve)."""
        return self._hdr32[_DOORBELL_SPACES_WORD]

    def doorbell_args(self) -> int:
        """The longest recall args the resident kernel compares with the scopes it serves
        (v1.6; 0 from an older sidecar, or one that serves namespaces without filters): a
        recall whose args are that long or shorter, a filter's too, may be sent as DOORBELL
        (:func:`~kalos_retrievers.protocol.ringable_args`)."""
        return self._hdr32[_DOORBELL_ARGS_WORD]

    def carousel_epoch(self) -> int:
        """The header's carousel epoch (v1.4): odd while the sidecar's carousel takes direct
        requests (one aligned 8-byte load)."""
        return self._car_epoch[0]

    def carousel(self, slot: int) -> _CarouselView | None:
        """The carousel's slots, mapped, when protocol slot ``slot`` may write into them now (the
        epoch odd, ``slot`` below the header's carousel_slots); else None."""
        epoch = self._car_epoch[0]
        if not epoch & 1 or slot >= self._hdr32[_CAROUSEL_SLOTS_WORD]:
            return None
        car = self._car
        if car is None:
            if self._car_tried == epoch:
                return None
            try:
                car = self._car = _CarouselView.open(self.name, self.header.dim, self._hdr32[_CAROUSEL_SLOTS_WORD])
            except (posix_ipc.Error, OSError, ValueError):
                self._car_tried = epoch  # (tried again at the next epoch)
                return None
        return car

    def waiting_requests(self) -> int:
        """How many slots hold a request not answered yet (REQUEST, BUSY or DOORBELL): every
        client's, ours included."""
        st = self._states
        if st is None:
            lay = self.layout
            st = self._states = np.ndarray((lay.n_slots,), "<u4", self.seg.mm, lay.slot_offset(0), (lay.slot_size,))
        # REQUEST and BUSY are 2 and 3: st - 2 <= 1 (FREE and CLAIMED wrap around)
        return int(np.count_nonzero(st - np.uint32(SlotState.REQUEST) <= 1)) + int(np.count_nonzero(st == _DOORBELL))

    def arena(self) -> ArenaView | None:
        """The sidecar's current document arena, mapped read-only (None: it has none, or the
        version just named is already gone: the call then asks for documents inline)."""
        h = self._hdr32
        version = h[_ARENA_VERSION_WORD] | h[_ARENA_VERSION_WORD + 1] << 32
        a = self._arena
        if a is not None and a.version == version:
            return a
        if not version:
            return None
        try:
            shm = posix_ipc.SharedMemory(arena_name(self.name, version), flags=0, read_only=True)
        except (posix_ipc.Error, OSError):
            return None
        try:
            mm = mmap.mmap(shm.fd, os.fstat(shm.fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
            view = ArenaView(mm, version)
        except (OSError, ValueError):
            return None
        finally:
            shm.close_fd()
        self._drop_arena()
        self._arena, self._arena_mm = view, mm
        return view

    def mapped_arena(self) -> ArenaView | None:
        """The arena version mapped now (None: none), without looking for a newer one."""
        return self._arena

    def drop_stale_arena(self) -> None:
        """Forget the mapped arena if the sidecar has moved on to a newer version: a client
        that stops recalling would otherwise keep that version's memory (unlinked, but still
        mapped) until its next recall."""
        a = self._arena
        if a is not None and not self.dead:
            h = self._hdr32
            if a.version != h[_ARENA_VERSION_WORD] | h[_ARENA_VERSION_WORD + 1] << 32:
                self._drop_arena()

    def _drop_arena(self) -> None:
        """Forget the mapped arena. Not released or closed here: another thread may be reading
        through it, and the results of batches keep views into it (their documents, decoded
        on access); the map goes when the last reference does."""
        self._arena = self._arena_mm = None

    @classmethod
    def connect(cls, name: str, dim: int | None) -> _Conn:
        seg = _ipc.Segment.open(segment_name(name), name)
        try:
            if not _ipc.is_locked(seg.fd, _ipc.SIDECAR_LOCK_BYTE):
                if foreign_segment(seg.mm[:8]):
                    raise ProtocolError(
                        f"/dev/shm segment of {name!r} is not a Kalos segment (its first bytes "
                        f"are {bytes(seg.mm[:8])!r}); another program uses this name: pick "
                        "another --name"
                    )
                raise SidecarUnavailable(
                    f"sidecar {name!r} is not running (its segment is stale: a sidecar died "
                    "without cleaning up; the next `kalos-sidecar serve` removes it)"
                )
            try:
                header = decode_header(seg.mm[:4096] if seg.size >= 4096 else seg.mm[:], seg.size)
            except HeaderError as e:
                raise _header_error(name, e) from None
            if header.state != SidecarState.READY:
                raise SidecarUnavailable(f"sidecar {name!r} is not ready (state {header.state})")
            if dim is not None and dim != header.dim:
                raise DimensionMismatch(
                    f"sidecar {name!r} stores dim={header.dim} vectors but this client was "
                    f"created with dim={dim}: use an embedding model with {header.dim} "
                    f"dimensions, or start a sidecar under another name with --dim {dim}"
                )
            return cls(name, seg, header)
        except BaseException:
            seg.close()
            raise

    def sidecar_alive(self) -> bool:
        """Cheap check: the sidecar's lock is held and it has not announced a stop."""
        if self.dead:
            return False
        if self._hdr32[4] != SidecarState.READY:  # byte 16: state
            return False
        # Another thread may close this connection between the check above and the lock's
        # query (a reconnect after the sidecar died, or close()): its descriptor is then
        # closed (EBADF: a raw OSError reached a caller, CI session 66) or already another
        # file's. close() marks the connection dead first, so it is looked at again after.
        # Only those errors: a signal handler's exception raised out of the fcntl (a timeout
        # decorator's TimeoutError is an OSError too) is the caller's, not a sign the sidecar
        # died (taken for one, the call was sent again on a new connection: a write done twice).
        try:
            alive = _ipc.is_locked(self.seg.fd, _ipc.SIDECAR_LOCK_BYTE)
        except OSError as e:
            if e.errno in (errno.EBADF, errno.EINVAL):  # (closed, or another kind of file's now)
                return False
            raise
        return alive and not self.dead

    def heartbeat_age(self) -> float:
        """Seconds since the sidecar's maintenance thread last stamped the header (it does
        every 0.1 s while serving; CLOCK_MONOTONIC is the host's, the same in every process)."""
        at = HEADER_OFFSETS["heartbeat_ns"]
        stamped = int.from_bytes(self.seg.mm[at : at + 8], "little")
        return (time.monotonic_ns() - stamped) / 1e9

    def untaken_requests(self) -> dict[int, int]:
        """``{slot: request seq}`` of the segment's slots whose requests (REQUEST) the sidecar
        has not taken yet, whoever owns them: read twice, a pair that stayed says it took none
        from that slot meanwhile."""
        out = {}
        mm, lay = self.seg.mm, self.layout
        for i in range(lay.n_slots):
            off = lay.slot_offset(i)
            if int.from_bytes(mm[off : off + 4], "little") == SlotState.REQUEST:
                out[i] = int.from_bytes(mm[off + REQUEST_OFFSET : off + REQUEST_OFFSET + 8], "little")
        return out

    def claim(self) -> _Slot | None:
        n = self.layout.n_slots
        start = (os.getpid() * 7 + len(self.owned) * 13 + random.randrange(n)) % n
        owned = {s.index for s in self.owned}
        for j in range(n):
            i = (start + j) % n
            if i in owned or not _ipc.try_lock(self.seg.fd, _ipc.slot_lock_byte(i)):
                continue
            # from here until it is owned, anything raised (a signal handler's KeyboardInterrupt
            # too) gives the slot back: locked and not owned, no one could use it until close()
            try:
                state = memoryview(self.seg.mm)[self.layout.slot_offset(i) :][:8].cast("I")
                if state[0] != SlotState.FREE:
                    # a dead owner's leftovers: the sidecar reclaims it shortly
                    del state
                    _ipc.unlock(self.seg.fd, _ipc.slot_lock_byte(i))
                    continue
                state[1] = os.getpid() & 0xFFFFFFFF
                state[0] = SlotState.CLAIMED
                del state
                slot = _Slot(self, i)
                self.owned.append(slot)
            except BaseException:
                if any(s.index == i for s in self.owned):
                    raise  # (owned already: it is ours; the client's _reclaim_lost brings it into use)
                self.release_slot_lock(i)  # (a CLAIMED word without its lock: the sidecar reclaims it)
                raise
            return slot
        return None

    @property
    def closing(self) -> bool:
        """close() has run (or runs): the connection's slots and semaphores are being given up."""
        return self._closing

    def wait_slot(self, slot: _Slot, timeout: float) -> bool | None:
        """Wait up to ``timeout`` s for a post on ``slot``'s semaphore (True: taken), or None
        when the connection is being closed. Safe against :meth:`close` from another thread:
        the waiter is registered before it looks at ``_closing``, and close() sets that before
        it looks at the registered waiters (under the GIL one sees the other), so a semaphore
        is never closed under a thread blocked on it (that crashed the process: sem_close
        unmaps what sem_timedwait reads, with the GIL released)."""
        i = slot.index
        try:
            self.sleepers.add(i)  # (in the try: a signal handler may raise at any step)
            if self._closing:
                return None
            return _ipc.wait(slot.sem, timeout)
        finally:
            self.sleepers.discard(i)
            if self._closing and not self.sleepers:
                self.close_semaphores()

    def drain_slot(self, slot: _Slot) -> None:
        """Take the posts left on ``slot``'s semaphore (answers seen by spinning), as safely
        against :meth:`close` as :meth:`wait_slot` (a non-blocking take releases the GIL too)."""
        i = slot.index
        try:
            self.sleepers.add(i)
            if not self._closing:
                _ipc.drain(slot.sem)
        finally:
            self.sleepers.discard(i)
            if self._closing and not self.sleepers:
                self.close_semaphores()

    def close_semaphores(self) -> None:
        """Close the doorbell's and the slots' semaphores, once (close(), or the last thread
        that was blocked on one when close() ran)."""
        if not self._sems_open:
            return
        self._sems_open = False
        for s in self.owned:
            _ipc.close_semaphore(s.sem)
        _ipc.close_semaphore(self.bell)

    def give_back(self, slot: _Slot) -> None:
        """Return an idle slot of ours (CLAIMED, on no free list, no request in it, no thread
        waiting on it) to the segment: FREE for any client to claim, its lock dropped. Not
        once the connection closes: close() gives every slot up."""
        if self._closing:
            return
        self.owned.remove(slot)
        slot.state[0] = SlotState.FREE  # (before the lock goes: a claimer checks FREE under it)
        _ipc.close_semaphore(slot.sem)
        self.release_slot_lock(slot.index)

    def release_slot_lock(self, i: int) -> None:
        with contextlib.suppress(OSError):
            _ipc.unlock(self.seg.fd, _ipc.slot_lock_byte(i))

    def close(self) -> None:
        """Give every slot back and unmap. Slots with an abandoned request stay non-FREE: the
        sidecar reclaims them once it has finished with them; so do slots another thread is
        in a call on (a close from another thread, or a reconnect after the sidecar died):
        that call ends with SidecarUnavailable, and its slot's semaphore stays open until it
        has stopped waiting on it."""
        if self._closing:  # (once: the descriptor's number may be another's by now)
            return
        self.dead = True
        self._closing = True  # (before the sleepers are looked at: see wait_slot)
        idle = []
        while True:  # taken one by one (list.pop is atomic): no thread can take them after this
            try:
                idle.append(self.free.pop())
            except IndexError:
                break
        for s in idle:
            if not s.pending:
                with contextlib.suppress(ValueError, TypeError):
                    s.state[0] = SlotState.FREE
        # Every slot's lock, now: closing the segment does not drop them (the map keeps a
        # duplicate of the descriptor until the slots' views into it are gone). Once only, so
        # the descriptor is still ours: its number is never another connection's here.
        for s in self.owned:
            self.release_slot_lock(s.index)
        if not self.sleepers:
            self.close_semaphores()
        self.free.clear()
        self._drop_arena()
        self._states = None
        self._car = None
        # (the header's views are not released: another thread still in a call may read them,
        # the doorbell's and the carousel's words; the map goes when the last view does)
        self.seg.close()


def _header_error(name: str, e: HeaderError) -> KalosError:
    if e.kind == HeaderError.INITIALIZING:
        return SidecarUnavailable(f"sidecar {name!r} is still starting up; retry shortly")
    if e.kind == HeaderError.VERSION:
        return IncompatibleVersion(
            f"sidecar {name!r}: {e}. Upgrade the older of the two (`pip install -U "
            "kalos-retrievers` in both environments) and restart the sidecar"
        )
    if e.kind == HeaderError.MAGIC:
        return ProtocolError(
            f"/dev/shm segment of {name!r} is not a Kalos segment ({e}); another program uses "
            "this name: pick another --name"
        )
    return ProtocolError(f"segment of sidecar {name!r} is unusable: {e}")

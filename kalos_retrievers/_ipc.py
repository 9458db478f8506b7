"""Transport: POSIX shared memory, semaphores and byte-range locks. No protocol logic here.

Ownership uses Linux open-file-description (OFD) byte-range locks on the segment's file
descriptor rather than semaphores or pid bookkeeping:

* byte 0 is held by the sidecar for as long as it runs; a client that finds it free knows
  the sidecar is gone (kill -9 included) without waiting for a heartbeat to age;
* byte ``1 + i`` is held by the client that owns slot ``i``.

The kernel drops a lock when the last descriptor of its open file description closes, so a
process that dies releases everything it held, whatever killed it, and whatever pid namespace
it lived in (a Kubernetes sidecar container does not see the app's pids, but it does share the
segment). Unlike classic POSIX locks, OFD locks conflict between two descriptors of the same
process (two clients, two threads) and survive the closing of an unrelated descriptor.

Semaphores are only doorbells: one the clients post for the sidecar, one per slot the sidecar
posts for the client. This module is the one place where posix_ipc's exceptions become Kalos's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
from typing import Final

import posix_ipc

from .errors import PermissionDenied, SidecarUnavailable

if not hasattr(fcntl, "F_OFD_SETLK") or not hasattr(os, "posix_fallocate"):  # (macOS, BSD)
    raise ImportError(
        "Kalos runs on Linux only: its shared-memory protocol needs open-file-description locks "
        "(fcntl.F_OFD_SETLK) and posix_fallocate, which this system does not have"
    )

SIDECAR_LOCK_BYTE: Final = 0
_FLOCK: Final = struct.Struct("hhqqi4x")  # struct flock on x86-64 and aarch64 Linux
assert _FLOCK.size == 32


def slot_lock_byte(slot: int) -> int:
    return 1 + slot


def try_lock(fd: int, byte: int) -> bool:
    """Take an exclusive OFD lock on one byte without waiting. True when taken."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))


def is_locked(fd: int, byte: int) -> bool:
    """Whether another open file description holds a lock on ``byte`` (one syscall)."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK


# --------------------------------------------------------------------------------------------
# Segments


class Segment:
    """An open, mapped shared-memory segment. Keeps its descriptor open: the locks live on it."""

    def __init__(self, shm: posix_ipc.SharedMemory, size: int) -> None:
        self.shm = shm
        self.fd = shm.fd
        self.size = size
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.inode = os.fstat(self.fd).st_ino

    @classmethod
    def open(cls, name: str, display: str) -> Segment:
        """Open an existing segment for reading and writing.

        Raises:
            SidecarUnavailable: no segment of that name.
            PermissionDenied: it exists but this user may not open it.
        """
        try:
            shm = posix_ipc.SharedMemory(name, flags=0)
        except posix_ipc.ExistentialError:
            raise SidecarUnavailable(
                f"no Kalos sidecar named {display!r} is running (no shared-memory segment "
                f"{name}); start one with `kalos-sidecar serve --name {display} --dim D`"
            ) from None
        except posix_ipc.PermissionsError:
            raise PermissionDenied(
                f"the segment {name} of sidecar {display!r} belongs to another user "
                f"(this process runs as uid {os.getuid()}); run the client as the sidecar's user"
            ) from None
        try:
            size = os.fstat(shm.fd).st_size
            if size == 0:
                raise SidecarUnavailable(f"sidecar {display!r} is still creating its segment")
            return cls(shm, size)
        except BaseException:
            shm.close_fd()
            raise

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create a new segment (fails if the name exists) with mode 0600 whatever the umask,
        its pages reserved: a /dev/shm without room for it is an error here, where a segment
        only sized would kill its process with SIGBUS at the first write past the room left
        (Docker's default /dev/shm is 64 MiB).

        Raises:
            FileExistsError: the name is taken.
            PermissionDenied: the system refused (e.g. /dev/shm not writable).
            OSError: no room for ``size`` bytes (ENOSPC); nothing is left behind.
        """
        try:
            shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError:
            raise FileExistsError(name) from None
        except posix_ipc.PermissionsError as e:
            raise PermissionDenied(f"cannot create shared memory {name}: {e}") from None
        try:
            os.fchmod(shm.fd, 0o600)
            os.posix_fallocate(shm.fd, 0, size)
        except BaseException as e:  # (an exception a signal handler raised in the reservation too)
            ino = os.fstat(shm.fd).st_ino
            shm.close_fd()
            if segment_inode(name) == ino:  # (not a rival's, made under the name meanwhile)
                unlink_segment(name)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise OSError(errno.ENOSPC, f"/dev/shm has no room for {name} ({size / 2**20:.1f} MiB)") from None
            raise
        return cls(shm, size)

    def close(self) -> None:
        # BufferError: numpy views into the map are still alive somewhere; the map goes with them
        with contextlib.suppress(BufferError):
            self.mm.close()
        with contextlib.suppress(posix_ipc.Error, OSError):
            self.shm.close_fd()
        self.fd = -1  # (the number may be reused by the next open: never lock or unlock through it)


def unlink_segment(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def segment_inode(name: str) -> int | None:
    """Inode of the segment currently published under ``name`` (None when absent)."""
    try:
        shm = posix_ipc.SharedMemory(name, flags=0)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return None
    try:
        return os.fstat(shm.fd).st_ino
    finally:
        shm.close_fd()


# --------------------------------------------------------------------------------------------
# Semaphores


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    """Open an existing semaphore.

    Raises:
        SidecarUnavailable: it does not exist (the sidecar is gone or restarting).
        PermissionDenied: another user's.
    """
    try:
        return posix_ipc.Semaphore(name, flags=0)
    except posix_ipc.ExistentialError:
        raise SidecarUnavailable(f"semaphore {name} is gone: the sidecar stopped") from None
    except posix_ipc.PermissionsError:
        raise PermissionDenied(f"semaphore {name} belongs to another user") from None


def create_semaphore(name: str) -> posix_ipc.Semaphore:
    """Create a semaphore with value 0 and mode 0600 (replacing a stale one of that name).

    Raises:
        PermissionDenied: a semaphore of that name belongs to another user (it is left alone,
            as a segment of another user's is), or the system refused to create it.
    """
    path = "/dev/shm/sem." + name.lstrip("/")
    try:
        owner: int | None = os.stat(path).st_uid
    except OSError:
        owner = None
    if owner is not None and owner != os.geteuid():
        raise PermissionDenied(
            f"semaphore {name} exists and belongs to another user (uid {owner}); refusing to "
            "touch it. Pick another --name, or have its owner remove it"
        )
    try:
        unlink_semaphore(name)
        sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=0o600, initial_value=0)
    except posix_ipc.PermissionsError as e:
        raise PermissionDenied(f"cannot create semaphore {name}: {e}") from None
    except posix_ipc.ExistentialError:
        raise PermissionDenied(f"semaphore {name} was created by another process meanwhile") from None
    if os.path.exists(path):
        os.chmod(path, 0o600)
    return sem


def unlink_semaphore(name: str) -> bool:
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        return False
    return True


_CLOSED: Final = "the connection to the sidecar was closed during the call (the client's close(), or a reconnect)"


def wait(sem: posix_ipc.Semaphore, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds (0: don't block). True when the semaphore was taken.

    Raises:
        SidecarUnavailable: ``sem`` was closed (by another thread's close of the connection).
    """
    try:
        sem.acquire(timeout if timeout > 0 else 0)
    except posix_ipc.BusyError:
        return False
    except posix_ipc.SignalError:
        return False
    except posix_ipc.ExistentialError:
        raise SidecarUnavailable(_CLOSED) from None
    return True


def drain(sem: posix_ipc.Semaphore) -> int:
    """Take every pending post without blocking; return how many there were."""
    n = 0
    while True:
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            return n
        except posix_ipc.ExistentialError:
            raise SidecarUnavailable(_CLOSED) from None
        n += 1


def posts(sem: posix_ipc.Semaphore) -> int:
    """The semaphore's value: posts not taken yet."""
    try:
        return int(sem.value)
    except posix_ipc.ExistentialError:
        raise SidecarUnavailable(_CLOSED) from None


def post(sem: posix_ipc.Semaphore) -> None:
    try:
        sem.release()
    except posix_ipc.ExistentialError:
        raise SidecarUnavailable(_CLOSED) from None


def close_semaphore(sem: posix_ipc.Semaphore | None) -> None:
    if sem is None:
        return
    with contextlib.suppress(posix_ipc.Error):
        sem.close()

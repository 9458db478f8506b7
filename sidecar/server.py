"""The sidecar's lifecycle: claim the name, publish the segment, serve, clean up.

Start-up order matters to clients and to a second sidecar started with the same name:

1. create ``/kalos-NAME`` exclusively (mode 0600) and at once take the sidecar lock (byte 0).
   If the name exists, its lock tells live from stale: a live owner means we refuse (exit code
   3); a stale segment (its sidecar was killed) is removed and the name taken over. Of two
   sidecars started at once, exactly one ends up holding the lock of the published segment.
2. create the doorbell and per-slot semaphores (replacing stale ones);
3. write the header with version 0 (clients read "still initializing"), load the store of
   record into the index, then mark the header READY and write the version last.

While serving, a maintenance thread refreshes the heartbeat and checks that the segment and
semaphores are still published (systemd's ``RemoveIPC`` deletes a user's IPC objects when
the user logs out): if they were removed, they are re-created under a new boot epoch and the
clients reconnect by themselves. SIGTERM and SIGINT stop the loop; pending requests are
refused with a STOPPING status, and the segment and semaphores are removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from kalos_retrievers import _ipc
from kalos_retrievers.arena import ArenaWriter, arena_name
from kalos_retrievers.errors import PermissionDenied
from kalos_retrievers.protocol import (
    CAR_MAX_SLOTS,
    DTYPES,
    HEADER_OFFSETS,
    METRICS,
    VERSION_MAJOR,
    VERSION_OFFSET,
    Layout,
    SidecarState,
    Status,
    carousel_segment_name,
    check_name,
    doorbell_name,
    encode_header,
    foreign_segment,
    response_sem_name,
    segment_name,
)

from . import blas, knobs
from .dispatcher import LONE_RECALLS, Dispatcher
from .index import CpuIndex, FatalDeviceError, Index, IndexCapacityError, IndexOutOfStep
from .knobs import knob, number
from .service import Service
from .stats import Stats, thread_sched, time_gc
from .store import NullStore, SqliteStore, StoreInUse, StoreOpenError, StoreUnavailable

log = logging.getLogger("kalos.sidecar")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NAME_IN_USE = 3
EXIT_STORE = 4
EXIT_DEVICE = 5
EXIT_PERMISSION = 6
EXIT_CUDA_FAULT = 7


class StartError(Exception):
    """The sidecar cannot start; ``exit_code`` says why (see the EXIT_* constants)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class ServeConfig:
    name: str
    dim: int
    metric: str = "cosine"
    device: str = "auto"
    dtype: str | None = None  # backend default: float32 on CPU, float16 on GPU
    data_dir: str | None = None
    slots: int = 16
    max_batch: int = 64
    max_k: int = 1024
    payload_kb: int = 1024
    blob_kb: int = 1024
    spin_us: float = 1000.0
    threads: int | None = None  # BLAS threads for host matrix products (None: the library's)
    sync: str = "full"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.metric not in METRICS:
            raise ValueError(f"--metric {self.metric!r}: choose one of {', '.join(METRICS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.sync not in ("full", "normal"):
            raise ValueError("--sync must be 'full' or 'normal'")
        if not 1 <= self.max_batch <= 4096:
            raise ValueError("--max-batch must be in [1, 4096]")
        if self.threads is not None and not 1 <= self.threads <= 1024:
            raise ValueError("--threads must be in [1, 1024]")
        if not 1 <= self.max_k <= 1 << 20:
            raise ValueError(f"--max-k {self.max_k} must be in [1, 1048576]")
        if self.data_dir is not None and not str(self.data_dir).strip():
            # (a unit's --data-dir "$DATA_DIR" with the variable unset: refused, not a sidecar
            # that acknowledges writes it will lose at the next restart)
            raise ValueError("--data-dir is empty; give a directory, or leave the flag out to run in memory only")
        if not (isinstance(self.spin_us, int | float) and 0 <= self.spin_us <= 1e9):
            raise ValueError(f"--spin-us {self.spin_us!r} must be a number of microseconds in [0, 1e9]")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} must be in [0, 65535]")
        dev = self.device
        if dev.startswith("cuda:") and not (dev[5:].isdigit() and dev[5:].isascii()):
            raise ValueError(f"--device {dev!r}: use auto, cpu, cuda or cuda:N (N a device number)")
        if self.blob_kb < 4:
            raise ValueError(f"--blob-kb {self.blob_kb} must be >= 4")
        if self.dim >= 1 and self.payload_kb * 1024 < 4 * self.dim + 128:
            least = -(-(4 * self.dim + 128) // 1024)
            raise ValueError(f"--payload-kb {self.payload_kb} cannot hold one query of --dim {self.dim}: "
                             f"give at least {least}")  # fmt: skip
        self.layout  # noqa: B018 - validates the geometry

    @property
    def layout(self) -> Layout:
        return Layout(
            n_slots=self.slots,
            dim=self.dim,
            max_k=self.max_k,
            max_results=max(8192, self.max_k),
            payload_size=self.payload_kb * 1024,
            blob_size=self.blob_kb * 1024,
        )


def make_index(cfg: ServeConfig) -> Index:
    """The index backend for ``--device`` (``auto`` takes the GPU when CuPy sees one)."""
    metric = METRICS[cfg.metric]
    dev = cfg.device
    if dev == "cpu":
        if cfg.dtype not in (None, "float32"):
            raise StartError("the CPU backend stores float32 only; drop --dtype", EXIT_USAGE)
        return CpuIndex(cfg.dim, metric)
    if dev != "auto" and not (dev == "cuda" or dev.startswith("cuda:")):
        raise StartError(f"--device {dev!r}: use auto, cpu, cuda or cuda:N", EXIT_USAGE)
    ordinal = int(dev.split(":", 1)[1]) if ":" in dev else 0
    from .index_gpu import CAND_MAX as INT8_MAX_K  # (no CuPy needed to import it)
    from .index_gpu import environment_errors

    # the switches it reads at import (KALOS_CAROUSEL=bogus: knobs.ERRORS) and those a GpuIndex
    # reads when made, checked before any GPU is looked for: on the laptop too
    errors = knobs.ERRORS + environment_errors(os.environ)
    if errors:
        raise StartError("; ".join(errors), EXIT_USAGE)

    if cfg.dtype == "int8" and cfg.max_k > INT8_MAX_K:
        # (its re-scoring buffer: a larger k would come back short)
        raise StartError(f"--max-k {cfg.max_k}: int8 storage answers k up to {INT8_MAX_K}; "
                         "lower --max-k, or store float16", EXIT_USAGE)  # fmt: skip
    try:
        from .gpu import GpuUnavailable, open_gpu_index
    except ImportError as e:  # pragma: no cover - the module ships with the package
        raise StartError(f"GPU backend missing from this install: {e}", EXIT_DEVICE) from None
    try:
        return open_gpu_index(cfg.dim, metric, ordinal, cfg.dtype or "float16")
    except ValueError as e:  # a setting in the environment (KALOS_RESCORE_FACTOR, ...)
        raise StartError(f"--device {dev}: {e}", EXIT_USAGE) from None
    except GpuUnavailable as e:
        if dev == "auto":
            log.info("no usable GPU (%s); using the CPU backend", e)
            return CpuIndex(cfg.dim, metric)
        raise StartError(f"--device {dev}: {e}", EXIT_DEVICE) from None


class Server:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.stats = Stats()
        self._stop = threading.Event()
        self._signalled = False  # (a stop signal arrived: later ones are ignored, see _on_signal)
        self.holding_signals = False  # (signals_held)
        self.held_signal: int | None = None
        self.seg: _ipc.Segment | None = None
        self.bell: Any = None
        self.resp_sems: list[Any] = []
        self.service: Service | None = None
        self.dispatcher: Dispatcher | None = None
        self.boot_epoch = 0
        self._maint: threading.Thread | None = None
        self._metrics: Any = None  # the metrics endpoint (--metrics-port), serving from the start
        self.ready = False  # (the metrics endpoint answers 503 until then)
        self._republish = threading.Event()
        # Held while re-publishing, and by the maintenance thread while it checks what is
        # published: without it the check could see the half-built state of a re-publication
        # (seg None: the assert killed the thread; or the new segment before its semaphores:
        # a second, spurious re-publication).
        self._publish_lock = threading.Lock()
        self._fatal = False
        self._untime_gc: Callable[[], None] | None = None  # stops timing collections (see time_gc)
        self._profile: Any = None  # the queued launches' cProfile.Profile (KALOS_PROFILE)
        self._serve_tid: int | None = None  # the serve loop's thread (native id), once it runs
        self.arena: ArenaWriter | None = None
        self._arena_segs: dict[int, _ipc.Segment] = {}
        self._arena_tried = False
        self._bell_idle = (0, 0)  # the resident kernel's served count, and since when unchanged
        # Starts of the resident kernel once the sidecar is idle (_rearm_bell, _after_pass): one a
        # pass's stop asked for; one a lone recall it would take asked for; the kernel's runs in
        # a row that ended without an answer
        self._bell_rearm = False
        self._bell_wanted = False
        self._bell_fruitless = 0
        self._bell_answered = 0  # when _settle last answered a search (ns, monotonic)
        self._car_seg: _ipc.Segment | None = None  # the carousel's slots (KALOS_CAROUSEL=direct)
        self._car_words = (0, 0)  # the header's carousel_epoch and carousel_slots, as last published
        self._car_closed = False  # True after a re-publication: no direct slot is offered (_offer_carousel)

    # ------------------------------------------------------------------ start
    def _serve_metrics(self) -> None:
        """Serve --metrics-port once the name is ours (a second sidecar of this name exits 3 on
        the name, not on the first one's port) and before the rows load (a port in use is a
        usage error, exit 2, found in seconds rather than after a long load; scrapes get 503
        until ready)."""
        cfg = self.cfg
        if cfg.metrics_port is None:
            return
        from .metrics import start_metrics_server

        try:
            self._metrics = start_metrics_server(self, cfg.metrics_host, cfg.metrics_port)
        except OSError as e:
            raise StartError(f"--metrics-port {cfg.metrics_port} on {cfg.metrics_host}: {e.strerror or e}",
                             EXIT_USAGE) from None  # fmt: skip

    def start(self) -> None:
        cfg = self.cfg
        if knobs.ERRORS:  # (tuning variables read at import, where they could not raise)
            raise StartError("; ".join(knobs.ERRORS), EXIT_USAGE)
        os.umask(0o077)  # everything we create (store files, IPC objects) is ours alone
        index = make_index(cfg)
        # the CPU backend's products run on BLAS: unless told, it leaves a quarter of a large
        # host's cores to the clients (blas.default_threads); a GPU backend's pool is left alone
        threads = cfg.threads
        if threads is None and isinstance(index, CpuIndex):
            threads = blas.default_threads()
        if threads is not None:
            lib = blas.set_threads(threads)
            if lib is None and cfg.threads is not None:
                log.warning("--threads %d: numpy's BLAS is not an OpenBLAS this sidecar can "
                            "configure; set OPENBLAS_NUM_THREADS, OMP_NUM_THREADS or "
                            "MKL_NUM_THREADS in its environment instead", cfg.threads)  # fmt: skip
            elif lib is not None:
                # OpenBLAS caps the count at what it was built for: log what it took
                why = "asked" if cfg.threads is not None else "default: a quarter of the cores left to clients,"
                log.info("BLAS threads: %s (%s %d; %s)", blas.get_threads(), why, threads,
                         os.path.basename(lib))  # fmt: skip
        log.info("backend: %s", index.describe())
        store: SqliteStore | NullStore
        if cfg.data_dir is not None:
            try:
                store = SqliteStore(cfg.data_dir, dim=cfg.dim, metric=cfg.metric,
                                    synchronous=cfg.sync.upper())  # fmt: skip
            except StoreOpenError as e:
                index.close()
                # (held by a live sidecar: as for a name in use, fine once that one stops)
                code = EXIT_NAME_IN_USE if isinstance(e, StoreInUse) else EXIT_STORE
                raise StartError(str(e), EXIT_ERROR if isinstance(e, StoreUnavailable) else code) from None
            except OSError as e:  # (not a directory, a read-only or missing parent, another user's)
                index.close()
                code = EXIT_PERMISSION if isinstance(e, PermissionError) else EXIT_USAGE
                raise StartError(f"--data-dir {cfg.data_dir} cannot be used: {e.strerror or e}"
                                 f"{f' ({e.filename})' if e.filename else ''}; give a directory "
                                 "this user can create and write", code) from None  # fmt: skip
            log.info("store of record: %s (SQLite WAL, synchronous=%s)", store.path, cfg.sync)
        else:
            store = NullStore()
            log.warning("no --data-dir: running in memory only; memories are lost when the "
                        "sidecar stops")  # fmt: skip
        self.service = Service(index, store, dim=cfg.dim, metric=METRICS[cfg.metric])
        try:  # (to the end: whatever stops the start, a signal included, undoes it all)
            self._publish()
            self._serve_metrics()
            self._load()
            self._maint = threading.Thread(target=self._maintain, name="kalos-maint", daemon=True)
            self._maint.start()
            self._set_ready()
        except BaseException:
            self.close()
            raise

    def _close_metrics(self) -> None:
        m, self._metrics = self._metrics, None
        if m is not None:
            with contextlib.suppress(Exception):
                m.shutdown()
                m.server_close()

    @contextlib.contextmanager
    def signals_held(self) -> Iterator[None]:
        """A block no stopping signal interrupts: a start-time handler (``cli._serve``'s)
        that finds :attr:`holding_signals` set records its signal in :attr:`held_signal`
        and returns, and the block's end raises it again. For the steps between creating an
        IPC object and recording it where :meth:`close` finds it. (Masking the signals would
        not do: Python runs its handlers in the main thread whichever thread the kernel
        delivers a signal to, BLAS's included.)"""
        self.holding_signals = True
        try:
            yield
        finally:
            self.holding_signals = False
            held, self.held_signal = self.held_signal, None
            if held is not None:
                signal.raise_signal(held)

    def _publish(self) -> None:
        """Create the segment and semaphores (header says INITIALIZING)."""
        cfg, lay = self.cfg, self.layout
        name = segment_name(cfg.name)
        # SIGTERM / SIGINT raise while the sidecar starts (cli._serve): held until the segment
        # is self.seg, which close() removes, or a signal between its creation and that
        # assignment would leave it in /dev/shm (see signals_held).
        with self.signals_held():
            for _ in range(5):
                try:
                    seg = _ipc.Segment.create(name, lay.segment_size)
                except FileExistsError:
                    self._clear_stale(name)
                    continue
                except PermissionDenied as e:
                    raise StartError(str(e), EXIT_PERMISSION) from None
                except OSError as e:  # (no room in /dev/shm: Docker's default is 64 MiB)
                    raise StartError(
                        f"{e.strerror or e}; give /dev/shm more room (docker run --shm-size, a Kubernetes "
                        "emptyDir with medium: Memory) or make the segment smaller (fewer --slots, a "
                        "smaller --payload-kb or --blob-kb)", EXIT_USAGE) from None  # fmt: skip
                if not self._holds_name(seg, name):
                    seg.close()
                    raise StartError(f"another sidecar named {cfg.name!r} is starting at the same "
                                     "time; this one gives way", EXIT_NAME_IN_USE)  # fmt: skip
                break
            else:
                raise StartError(f"could not claim the name {cfg.name!r}", EXIT_NAME_IN_USE)
            self.seg = seg
        # The name is ours now: response semaphores beyond our slot count were left by a dead
        # sidecar of this name that had more slots (create_semaphore below replaces the rest),
        # and document arenas by a dead sidecar of this name.
        _remove_extra_semaphores(cfg.name, lay.n_slots)
        first = not self._arena_tried  # a re-publication keeps the arena it has (or had)
        if not first:  # (before any header is written: see _offer_carousel)
            self._car_closed = True
        if first:
            _remove_stale_arenas(cfg.name)
        self.boot_epoch = random.getrandbits(63) | 1
        self._write_header(SidecarState.INITIALIZING, version=0)
        try:  # one by one, so that close() removes exactly those we created (signals held: as above)
            with self.signals_held():
                self.bell = _ipc.create_semaphore(doorbell_name(cfg.name))
                self.resp_sems = []
                for i in range(lay.n_slots):
                    self.resp_sems.append(_ipc.create_semaphore(response_sem_name(cfg.name, i)))
        except PermissionDenied as e:  # another user's semaphore under our name
            raise StartError(str(e), EXIT_PERMISSION) from None
        assert self.service is not None
        if first:
            self._arena_tried = True
            self._open_arena()
        try:
            self.service.index.attach_segment(seg.mm)
            k = self.service.index.enable_doorbell(lay, self.arena)
            self.service.index.on_doorbell = self._publish_doorbell
        except FatalDeviceError as e:
            raise StartError(str(e), EXIT_CUDA_FAULT) from None
        self._publish_doorbell()
        self._offer_carousel(lay.n_slots, first)
        if k:
            log.info("resident kernel (KALOS_DOORBELL=0 turns it off): once a client recalls alone, batch-1 "
                     "recalls of the default namespace with k <= %d are answered on the GPU without the "
                     "sidecar's Python", k)  # fmt: skip
        self.dispatcher = Dispatcher(seg.mm, lay, self.resp_sems, self.service, self.stats,
                                     max_batch=cfg.max_batch, describe=self.describe)  # fmt: skip
        self.dispatcher.on_start_due = lambda: self._publish_doorbell(True)  # (see _resume_doorbell_if_idle)
        if PROFILE:  # (diagnostics; one profile across re-publications)
            if self._profile is None:
                import cProfile

                self._profile = cProfile.Profile()
            self.dispatcher.profile = self._profile
        if self.dispatcher.timing and self._untime_gc is None:  # (diagnostics: KALOS_BATCH_TIMING=1 / host)
            self._untime_gc = time_gc(self.stats)
        log.info("segment %s: %d slots of %d KiB (%.1f MiB in all), dim=%d, metric=%s",
                 name, lay.n_slots, lay.slot_size // 1024, lay.segment_size / 2**20, cfg.dim,
                 cfg.metric)  # fmt: skip

    def _open_arena(self) -> None:
        """Create the document arena and keep the row table's documents in it, if anything
        will read it: the GPU's resident kernel (on unless ``KALOS_DOORBELL=0``) and its clients, or
        ``KALOS_ARENA=1``. Without room for it in /dev/shm the sidecar runs without one."""
        assert self.service is not None
        if not (self.service.index.wants_arena() or os.environ.get("KALOS_ARENA") == "1"):
            return
        name = self.cfg.name

        def open_segment(version: int, size: int) -> Any:
            with self.signals_held():  # (recorded where close() finds it: see _publish)
                try:  # (its pages reserved: a full /dev/shm is an error here, not a SIGBUS on a write)
                    seg = _ipc.Segment.create(arena_name(name, version), size)
                except (PermissionDenied, OSError) as e:  # (FileExistsError among the OSErrors)
                    raise OSError(f"cannot create the document arena {arena_name(name, version)}: {e}") from None
                self._arena_segs[version] = seg
            return seg.mm

        def unlink(version: int) -> None:
            _ipc.unlink_segment(arena_name(name, version))
            for v in arena_segments_to_close(self._arena_segs, version):
                self._arena_segs.pop(v).close()

        try:
            self.arena = ArenaWriter(open_segment, unlink)
        except OSError as e:
            log.warning("no document arena (%s): recalls carry their documents", e)
            return
        rows = self.service.rows
        rows.arena = self.arena
        rows.on_arena_moved = self._arena_moved
        self._arena_moved(self.arena.version)

    def _arena_moved(self, version: int) -> None:
        if version == 0:  # dropped (see RowTable._in_arena)
            self.arena = None
        if self.seg is not None:
            struct.pack_into("<Q", self.seg.mm, HEADER_OFFSETS["arena_version"], version)
        if self.service is not None:
            self.service.index.arena_moved(self.arena)
        self._publish_doorbell()

    def _publish_doorbell(self, running: bool | None = None) -> None:
        """Tell clients up to which k the index's resident kernel answers now (``doorbell_k``:
        0 while it is stopped: ``running``, or else as the index says) and whether it has one
        (``doorbell_cap``), and whether it serves namespaces besides the default one
        (``doorbell_spaces``, v1.5: clients then ring it with a namespace's recalls too) and
        filters (``doorbell_args``, v1.6: the longest args it compares, a filter's too). The
        index calls this (``on_doorbell``) after the kernel starts and before it stops. (A v1.1
        client reads only ``doorbell_k``: it rings the kernel only while it runs, too.)"""
        if self.seg is not None and self.service is not None:
            idx = self.service.index
            if running is None:
                running = idx.doorbell_running
            k = idx.doorbell_k if running else 0
            struct.pack_into("<II", self.seg.mm, HEADER_OFFSETS["doorbell_spaces"],
                             idx.doorbell_spaces if idx.doorbell_k else 0,
                             idx.doorbell_args if idx.doorbell_k and idx.doorbell_spaces else 0)  # fmt: skip
            struct.pack_into("<II", self.seg.mm, HEADER_OFFSETS["doorbell_k"], k, idx.doorbell_k)

    def _offer_carousel(self, n_slots: int, first: bool) -> None:
        """KALOS_CAROUSEL=direct on an index with a carousel: clients holding protocol slots
        below ``min(n_slots, 48)`` may write batch-1 recalls into the carousel's own slots
        while it runs (protocol v1.4; the other 16 of its 64 slots stay the dispatcher's, for
        the recalls that still come the usual way). The index maps the shared segment at its
        first start (:meth:`_carousel_map`) and publishes each epoch (:meth:`_publish_carousel`).

        A re-publication (not ``first``) offers no direct slot any more (``carousel_slots`` 0
        in the new header, for the sidecar's life): the clients of the old segment may still
        write into the carousel's slots by the numbers of their old protocol slots, which the
        new segment's clients now hold (the stop before the re-publication has already told
        them the carousel stopped; only a late writer is left)."""
        assert self.service is not None
        idx = self.service.index
        if not first:  # (_car_closed since _publish began)
            self._publish_carousel(*self._car_words)
            return
        if not idx.carousel_k:
            return
        _remove_stale_carousel(self.cfg.name)
        from .index_gpu import CAROUSEL_DIRECT

        if not CAROUSEL_DIRECT:
            return
        idx.carousel_direct = min(n_slots, CAR_MAX_SLOTS - 16)
        idx.carousel_map = self._carousel_map
        idx.on_carousel = self._publish_carousel
        self._publish_carousel(*self._car_words)

    def _carousel_map(self, size: int) -> Any:
        """Create the carousel's shared segment (``/kalos-NAME-car``; one a dead sidecar of this
        name left was removed at the first publication) and return its map."""
        name = carousel_segment_name(self.cfg.name)
        with self.signals_held():  # (recorded where close() finds it: see _publish)
            try:  # (its pages reserved: a full /dev/shm is an error here, not a SIGBUS later)
                seg = _ipc.Segment.create(name, size)
            except (PermissionDenied, OSError) as e:  # (FileExistsError among the OSErrors)
                raise OSError(f"cannot create the carousel's segment {name}: {e}") from None
            self._car_seg = seg
        return seg.mm

    def _publish_carousel(self, epoch: int, slots: int) -> None:
        """The header's carousel words: ``epoch`` (odd while the kernel takes direct requests)
        and how many protocol slots (from 0) may write to it."""
        self._car_words = (epoch, slots)
        if self.seg is not None:
            struct.pack_into("<I", self.seg.mm, HEADER_OFFSETS["carousel_slots"], 0 if self._car_closed else slots)
            off = HEADER_OFFSETS["carousel_epoch"]
            with memoryview(self.seg.mm)[off : off + 8].cast("Q") as word:
                word[0] = epoch  # (one aligned 8-byte store, after the slots: x86-64 keeps them in order)

    def _holds_name(self, seg: _ipc.Segment, name: str) -> bool:
        """Take the sidecar lock on a segment we just created, and check the name still points
        at it: between our create and our lock, a rival may have judged the segment stale and
        unlinked it, so holding the lock alone is not enough."""
        return _ipc.try_lock(seg.fd, _ipc.SIDECAR_LOCK_BYTE) and _ipc.segment_inode(name) == seg.inode

    def _clear_stale(self, name: str) -> None:
        try:
            old = _ipc.Segment.open(name, self.cfg.name)
        except PermissionDenied:
            raise StartError(
                f"shared memory {name} exists and belongs to another user; refusing to touch "
                "it. Pick another --name, or have its owner remove it", EXIT_PERMISSION,
            ) from None
        except Exception:  # vanished in between, or empty: try creating again
            return
        try:
            if os.fstat(old.fd).st_uid != os.getuid():
                raise StartError(f"shared memory {name} belongs to another user; pick another "
                                 "--name", EXIT_PERMISSION)  # fmt: skip
            if not _ipc.try_lock(old.fd, _ipc.SIDECAR_LOCK_BYTE):
                pid = _read_pid(old)
                raise StartError(
                    f"a sidecar named {self.cfg.name!r} is already running (pid {pid}); stop it "
                    f"with `kalos-sidecar stop {self.cfg.name}` or choose another --name",
                    EXIT_NAME_IN_USE,
                )
            if foreign_segment(old.mm[:8]):
                raise StartError(
                    f"shared memory {name} exists but is not a Kalos segment (its first bytes "
                    f"are {bytes(old.mm[:8])!r}): another program uses this name, and this "
                    "sidecar will not remove it. Pick another --name", EXIT_NAME_IN_USE,
                )
            log.warning("removing the stale segment %s left by a sidecar that died (pid %s)",
                        name, _read_pid(old))  # fmt: skip
            _ipc.unlink_segment(name)
        finally:
            old.close()

    def _write_header(self, state: int, version: int = VERSION_MAJOR) -> None:
        assert self.seg is not None and self.service is not None
        idx = self.service.index
        hdr = encode_header(
            self.layout, metric=METRICS[self.cfg.metric],
            dtype=DTYPES.get(idx.dtype, 0), pid=os.getpid(), uid=os.getuid(),
            boot_epoch=self.boot_epoch, name=self.cfg.name, backend=idx.name, state=state,
            version_major=0, capacity=idx.capacity, row_count=self.service.rows.live,
            heartbeat_ns=time.monotonic_ns(), arena_version=self.arena.version if self.arena else 0,
        )  # fmt: skip
        self.seg.mm[: len(hdr)] = hdr
        self._publish_doorbell()
        self._publish_carousel(*self._car_words)  # (the bytes above wrote zeros over them)
        if version:
            struct.pack_into("<H", self.seg.mm, VERSION_OFFSET, version)

    def _load(self) -> None:
        assert self.service is not None
        if not self.service.store.durable:
            return
        t0 = time.monotonic()
        last = [t0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 1.0 or done == total:
                last[0] = now
                log.info("loading the store: %d/%d rows (%.0f%%, %.1f s)", done, total,
                         100 * done / max(total, 1), now - t0)  # fmt: skip

        try:
            n = self.service.load(progress)
        except StoreOpenError as e:
            raise StartError(str(e), EXIT_ERROR if isinstance(e, StoreUnavailable) else EXIT_STORE) from None
        except IndexCapacityError as e:  # (the index is sized for the whole store first)
            raise StartError(
                f"the store of record holds {self.service.store.count()} rows and the index "
                f"cannot hold them: {e}. Give the sidecar more device memory (a larger "
                "KALOS_GPU_MEMORY_LIMIT, a GPU of its own) or a smaller --dtype (int8), or "
                "start it on the CPU", EXIT_DEVICE) from None  # fmt: skip
        log.info("loaded %d rows from the store in %.2f s", n, time.monotonic() - t0)

    def _set_ready(self) -> None:
        self.ready = True
        self._write_header(SidecarState.READY)
        assert self.service is not None
        log.info("ready: sidecar %r serving %d rows on %s (pid %d)", self.cfg.name,
                 self.service.rows.live, self.service.index.name, os.getpid())  # fmt: skip

    # ------------------------------------------------------------------ serve
    def serve_forever(self) -> None:
        """Run the dispatcher until :meth:`stop` (or SIGTERM/SIGINT in the main thread)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        self._serve_tid = threading.get_native_id()  # (describe()'s "serve_thread")
        pace = Pace(int(self.cfg.spin_us * 1000))
        next_housekeeping = 0
        while not self._stop.is_set():
            if self._republish.is_set():
                self._do_republish()
            d = self.dispatcher
            assert d is not None and self.seg is not None
            worked = 0
            idx = self.service.index  # type: ignore[union-attr]
            was_running, declines, lone = idx.doorbell_running, d.kernel_declines, d.lone
            try:
                t_poll = time.monotonic_ns()
                worked = d.poll()
                if worked:
                    pace.worked(t_poll, time.monotonic_ns())
            except FatalDeviceError as e:
                self._fatal_device(e)
            except Exception as failed:  # poll() answers the errors it expects itself
                log.exception("dispatcher pass failed")
                try:  # nothing may sleep, reclaim or compact under a batch still in flight
                    d.settle()
                except FatalDeviceError as e:
                    self._fatal_device(e)
                except Exception:
                    log.exception("answering the batch in flight failed")
                try:  # what the pass had picked up and not answered: answered INTERNAL now
                    n = d.answer_stranded(failed)
                    if n:
                        log.error("answered %d request(s) left unanswered by the failed pass", n)
                except FatalDeviceError as e:
                    self._fatal_device(e)
                except Exception:
                    log.exception("answering the requests the failed pass left failed")
                # the header as it is: the pass may have said the kernel runs before a start that
                # now does not come (Dispatcher.on_start_due)
                self._publish_doorbell()
            if worked:
                # (outside the try above: a fatal device error here must end the loop)
                self._after_pass(d, was_running and not idx.doorbell_running, declines, lone)
                if d.lone_enough(LONE_RECALLS):  # a client recalling alone: start the kernel
                    self._resume_doorbell_if_idle()
                continue
            now = time.monotonic_ns()
            quiet_since = max(pace.last_work, self._bell_answered)  # (the last work or answer)
            if self._rearm_bell(now, quiet_since):
                continue
            if now >= next_housekeeping:
                next_housekeeping = now + 250_000_000
                try:
                    self.service.index.check_doorbell()  # type: ignore[union-attr]
                    self._stop_idle_doorbell(now)
                except FatalDeviceError as e:
                    self._fatal_device(e)
                except Exception:
                    self._doorbell_failed()
                try:
                    d.stop_idle_carousel(now, int(DOORBELL_IDLE_S * 1e9))
                except FatalDeviceError as e:
                    self._fatal_device(e)
                except Exception:  # (a post of its answers that failed): it is stopped next time
                    log.exception("stopping the idle carousel failed")
                n = d.reclaim(self.seg.fd)
                if n:
                    self.stats.reclaimed_slots += n
                    log.info("reclaimed %d slot(s) of clients that went away", n)
                _ipc.drain(self.bell)  # bounded: posts never pile up under constant load
                if now - pace.last_work > 50_000_000:
                    # nothing compacts under a batch in flight (see Dispatcher._awaits_cohort); a
                    # carousel that has answered nothing for 50 ms is drained (a fault if it never does)
                    self._settle(d)
                    if not self.service.index.carousel_running:  # (direct clients' recalls are not "work" here)
                        self._compact_if_fragmented()
                elif self._badly_fragmented() and not self.service.index.carousel_running:
                    # steady requests leave no 50 ms gap, and every recall would keep reading the
                    # holes (90% of the rows deleted: 6.1 ms a recall where 0.7 would do): a step
                    # per housekeeping tick (4 a second) all the same
                    self._settle(d)
                    self._compact_if_fragmented()
                continue  # poll again before sleeping: the drain may have taken a new request's post
            sleep_ns = pace.sleep_ns(now)
            if sleep_ns and self._rearm_pending():  # (awake when the restart falls due)
                sleep_ns = max(min(sleep_ns, quiet_since + BELL_REARM_NS - now), 1)
            if not sleep_ns or d.crowd_in_flight():
                continue  # (the carousel's answers are posted by this loop: poll on until they are in)
            # (The resident kernel need not run while we sleep: while it is stopped the header
            # says so, and clients send REQUEST and post the doorbell.)
            if self._settle(d) or d.waiting().size:
                continue
            if _ipc.wait(self.bell, min(sleep_ns, _IDLE_WAIT_NS) / 1e9):
                _ipc.drain(self.bell)
        self._serve_tid = None  # (a later thread could take its id)
        self.close()

    def _settle(self, d: Dispatcher) -> int:
        """``d.settle()``, a device fault in it ending the sidecar as any other does."""
        try:
            n = d.settle()
        except FatalDeviceError as e:
            self._fatal_device(e)
        if n:  # (answers the loop's passes did not: the idle before a start counts from them too)
            self._bell_answered = time.monotonic_ns()
        return n

    def _resume_doorbell_if_idle(self) -> None:
        """(Re)start the index's resident kernel, unless a request waits (the next pass serves
        it, and may count it as lone, too).

        The header says it runs *before* the batch in flight (the last lone recall) is
        answered: that client's next recall, ~20 us later, must find it so and ring the
        kernel. Said after, that recall often came as a REQUEST, which stopped the kernel
        again, four lone recalls later the same (S5-9: 52 of 300 back-to-back recalls answered
        by the kernel in one run, 268-296 in others). A lone scoped recall is answered within
        the pass, so the dispatcher says it before that answer (``on_start_due``); that
        client's next recall may then be a DOORBELL waiting here, which the kernel takes once
        it starts: only a REQUEST waiting puts the start off (and the header back)."""
        d = self.dispatcher
        assert d is not None and self.service is not None
        if d.requests_waiting() or not self.service.doorbell_useful():
            self._publish_doorbell()  # (as it is: a "runs" said before a scoped answer taken back)
            return
        self._bell_rearm = self._bell_wanted = False
        try:
            self._publish_doorbell(True)  # a DOORBELL rung from now is taken once it starts
            d.settle()
            d.kernel_started()
            self.service.resume_doorbell()
            self._bell_idle = (self.service.index.doorbell_served(), time.monotonic_ns())
        except FatalDeviceError as e:
            self._fatal_device(e)
        except Exception:
            self._doorbell_failed()
        finally:
            self._publish_doorbell()  # as it is: not running if it could not start

    def _after_pass(self, d: Dispatcher, stopped: bool, declines: int, lone: int) -> None:
        """Book-keeping of the resident kernel's starts on idle (:meth:`_rearm_bell`) after a
        pass that worked; ``stopped``: it stopped the kernel; ``declines`` and ``lone``:
        ``d.kernel_declines`` and ``d.lone`` before it.

        * A lone recall the kernel would take (``d.lone`` grew) asks for a start once the
          sidecar is idle (``_bell_wanted``): a write right after it does not undo that (an
          agent's search, then its add, then the model's turn), where 4 lone recalls in a row
          never come. (Requests served beside the kernel, stats or a ping, leave ``d.lone`` as
          it was: they ask for nothing again.)
        * A stop asks for a restart (``_bell_rearm``; a write, most often), unless
          ``BELL_FRUITLESS_MAX`` runs in a row answered nothing with no such recall in between
          (writes alone, a pause between each, would restart it after every one).
        * A scoped recall the running kernel did not take (a decline, ``d.kernel_declines``)
          cancels both: that is the start's back-off's to handle
          (:meth:`Dispatcher.lone_enough`). Not one while the kernel's table fills up (a new
          user's first search, ``d.kernel_learns``, :meth:`Dispatcher._learned`):
          its stop is any pass's, and the kernel starts again with the scope in its table. A
          carousel running cancels both too (a crowd's: starting the kernel would stop it)."""
        if d.lone > lone:
            self._bell_fruitless = 0
            self._bell_wanted = True
        if d.kernel_declines != declines or self.service.index.carousel_running:  # type: ignore[union-attr]
            self._bell_rearm = self._bell_wanted = False
            return
        if stopped:
            self._bell_run_ended(d)
            self._bell_rearm = self._bell_fruitless < BELL_FRUITLESS_MAX

    def _bell_run_ended(self, d: Dispatcher) -> None:
        """A run of the resident kernel ended (a pass's stop, or idle): fruitless if it
        answered nothing (the count starts over at a run that answered, and at a lone recall
        the kernel would take, served by the sidecar)."""
        self._bell_fruitless = 0 if d.kernel_answers() > 0 else self._bell_fruitless + 1

    def _rearm_pending(self) -> bool:
        """Whether :meth:`_rearm_bell` has a start to try once the sidecar has been idle long
        enough: asked for (:meth:`_after_pass`), with a kernel to start (not on a CPU index),
        and the device free of a crowd's carousel and of a batch in flight."""
        if not (self._bell_rearm or self._bell_wanted) or not BELL_REARM_NS:
            return False
        idx, d = self.service.index, self.dispatcher  # type: ignore[union-attr]
        return bool(idx.doorbell_k) and not idx.carousel_running and d is not None and not d.device_busy()

    def _rearm_bell(self, now: int, last_work: int) -> bool:
        """Once the sidecar has been idle ``BELL_REARM_NS`` since ``last_work`` (ns, monotonic:
        its last pass's work or answer), start the resident kernel if :meth:`_after_pass` asked
        for it: the next recall, a moment later (an agent's next turn), finds it running. A
        start asked for by a lone recall waits while the start backs off
        (:meth:`Dispatcher.backing_off`); a restart after a pass's stop does not (the kernel was
        running: the back-off had let it start). Tried once (if a request waits then, it is
        served first, and lone recalls start the kernel as before). True if it was tried."""
        if now - last_work < BELL_REARM_NS or not self._rearm_pending():
            return False
        d = self.dispatcher
        assert d is not None
        start = self._bell_rearm or not d.backing_off()
        self._bell_rearm = self._bell_wanted = False
        if start:
            self._resume_doorbell_if_idle()
        return start

    def _stop_idle_doorbell(self, now: int) -> None:
        """Housekeeping: stop a resident kernel that has answered nothing for
        DOORBELL_IDLE_S (it keeps every SM busy polling; the next lone recalls start it again)."""
        idx = self.service.index  # type: ignore[union-attr]
        if not idx.doorbell_running:
            return
        served = idx.doorbell_served()
        if served != self._bell_idle[0]:
            self._bell_idle = (served, now)
        elif now - self._bell_idle[1] > DOORBELL_IDLE_S * 1e9:
            idx.pause_doorbell()
            if self.dispatcher is not None:
                self._bell_run_ended(self.dispatcher)

    def _doorbell_failed(self) -> None:
        """The resident kernel could not be started or checked (not a sticky fault): serve
        without it."""
        log.exception("the resident kernel failed; serving without it")
        assert self.service is not None
        with contextlib.suppress(Exception):
            self.service.index.pause_doorbell()
        self.service.index.doorbell_k = 0
        self._publish_doorbell()

    def _fatal_device(self, e: FatalDeviceError) -> NoReturn:
        log.critical("%s; exiting so that a supervisor restarts the sidecar (the index "
                     "reloads from the store)", e)  # fmt: skip
        self._fatal = True
        raise StartError(str(e), EXIT_ERROR if isinstance(e, IndexOutOfStep) else EXIT_CUDA_FAULT) from None

    def _badly_fragmented(self) -> bool:
        """Holes are at least half of the scanned rows (and 1,024 or more)."""
        svc = self.service
        assert svc is not None
        holes = svc.fragmentation()
        return holes >= 1024 and 2 * holes >= svc.rows.high

    def _compact_if_fragmented(self) -> None:
        """Background compaction, a bounded step at a time while idle: deletes leave holes
        that the scan would otherwise keep reading."""
        svc = self.service
        assert svc is not None
        holes = svc.fragmentation()
        if holes > max(1024, svc.rows.high // 10):
            try:
                svc.index.pause_doorbell()  # rows move: the resident kernel must not scan them
                moved = svc.compact(4096)
            except FatalDeviceError:
                raise
            except Exception:
                log.exception("compaction step failed")
                return
            log.debug("compaction moved %d rows (%d holes left)", moved, svc.fragmentation())

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # Once only: a signal that lands while the first one's handler is inside Event.set()
        # runs this handler again on the same thread, whose set() then waited forever for the
        # lock the first holds (a burst of SIGTERMs hung 17 sidecars of 20). The flag is set
        # before anything takes a lock.
        if self._signalled:
            return
        self._signalled = True
        log.info("received %s: shutting down", signal.Signals(signum).name)
        self.stop()

    def stop(self) -> None:
        """Ask the serving loop to finish (safe from signal handlers and other threads)."""
        self._stop.set()
        if self.bell is not None:
            with contextlib.suppress(Exception):
                _ipc.post(self.bell)

    def describe(self) -> dict[str, Any]:
        assert self.service is not None
        idx = self.service.index.describe()
        d = self.dispatcher
        if d is not None and self.service.index.doorbell_k:
            # scoped recalls the resident kernel handed back: those its start's back-off counted,
            # and those while its table filled up (Dispatcher._learned)
            idx.update(doorbell_declines=d.kernel_declines, doorbell_learns=d.kernel_learns)
        return {
            "name": self.cfg.name,
            "pid": os.getpid(),
            "boot_epoch": self.boot_epoch,
            "rows": self.service.rows.live,
            "namespaces": len(self.service.rows.namespaces()),
            "dim": self.cfg.dim,
            "metric": self.cfg.metric,
            "durable": self.service.store.durable,
            "data_dir": self.cfg.data_dir,
            "slots": self.layout.n_slots,
            "blas_threads": blas.pool_threads(),  # (the pool: small products take 1 thread)
            "index": idx,
            "device_bytes": idx.get("device_bytes", 0),
            **({"serve_thread": st} if (st := thread_sched(self._serve_tid)) is not None else {}),
        }

    # ------------------------------------------------------------------ maintenance
    def _maintain(self) -> None:
        hb = HEADER_OFFSETS["heartbeat_ns"]
        rc = HEADER_OFFSETS["row_count"]
        cap = HEADER_OFFSETS["capacity"]
        next_check = 0.0
        while not self._stop.wait(0.1):
            seg, svc = self.seg, self.service
            if seg is None or svc is None:
                continue
            with contextlib.suppress(ValueError, TypeError):
                struct.pack_into("<Q", seg.mm, hb, time.monotonic_ns())
                struct.pack_into("<Q", seg.mm, rc, svc.rows.live)
                struct.pack_into("<Q", seg.mm, cap, svc.index.capacity)
            now = time.monotonic()
            if now >= next_check and not self._republish.is_set():
                next_check = now + 0.25
                try:
                    with self._publish_lock:
                        removed = self.seg is not None and self._removed_from_outside()
                except Exception:  # never let the check kill the maintenance thread
                    log.exception("checking the published segment failed")
                    removed = False
                if removed:
                    log.warning("the segment or its semaphores were removed from outside "
                                "(systemd RemoveIPC?); re-publishing")  # fmt: skip
                    self._republish.set()
                    self.stop_wait_nudge()

    def stop_wait_nudge(self) -> None:
        with contextlib.suppress(Exception):
            _ipc.post(self.bell)

    def _removed_from_outside(self) -> bool:
        assert self.seg is not None
        if _ipc.segment_inode(segment_name(self.cfg.name)) != self.seg.inode:
            return True
        # Every semaphore, not only the doorbell: a client that claims a slot whose response
        # semaphore is gone cannot use it (it would fail on that slot forever).
        try:
            present = set(os.listdir("/dev/shm"))
        except OSError:
            return False
        names = [doorbell_name(self.cfg.name)]
        names += [response_sem_name(self.cfg.name, i) for i in range(self.layout.n_slots)]
        return any("sem." + n.lstrip("/") not in present for n in names)

    def _do_republish(self) -> None:
        with self._publish_lock:
            self._do_republish_locked()

    def _do_republish_locked(self) -> None:
        """Re-create segment and semaphores under a new epoch; the index is untouched."""
        self._republish.clear()
        old_seg, old_bell, old_sems = self.seg, self.bell, self.resp_sems
        if self.dispatcher is not None:
            with contextlib.suppress(Exception):
                self.dispatcher.refuse_all(Status.STOPPING, "the sidecar is re-publishing")
        self.dispatcher = None
        self._bell_rearm = self._bell_wanted = False  # (no client of the new segment recalled yet)
        self._bell_fruitless = self._bell_answered = 0
        if self.service is not None:
            with contextlib.suppress(Exception):
                self.service.index.detach_segment()
        with contextlib.suppress(Exception):
            if old_seg is not None and _ipc.segment_inode(segment_name(self.cfg.name)) == old_seg.inode:
                _ipc.unlink_segment(segment_name(self.cfg.name))
        self.seg = None
        try:
            self._publish()
        except StartError as e:
            log.error("could not re-publish: %s", e)
            self._stop.set()
            return
        finally:
            for s in old_sems:
                _ipc.close_semaphore(s)
            _ipc.close_semaphore(old_bell)
            if old_seg is not None:
                old_seg.close()
        self.stats.republished += 1
        self._set_ready()

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Refuse what is pending, remove the IPC objects, close the store. Idempotent."""
        self._stop.set()
        if self._untime_gc is not None:
            self._untime_gc()
            self._untime_gc = None
        if self._profile is not None:  # (KALOS_PROFILE: written however the sidecar stops)
            profile, self._profile = self._profile, None
            try:
                profile.dump_stats(PROFILE)
            except Exception:  # diagnostics must not keep the sidecar from closing
                log.exception("KALOS_PROFILE: could not write %s", PROFILE)
        self._close_metrics()
        seg = self.seg
        if seg is not None:
            if self.dispatcher is not None and not self._fatal:
                # what is in flight (a batch, the carousel's recalls, the direct clients'
                # among them) answered before clients are told the sidecar stops: a client
                # that sees STOPPING stops waiting
                with contextlib.suppress(Exception):
                    self.dispatcher.stop_carousel()
                with contextlib.suppress(Exception):
                    self.dispatcher.settle()
            with contextlib.suppress(Exception):
                struct.pack_into("<I", seg.mm, HEADER_OFFSETS["state"], SidecarState.STOPPING)
            if self.dispatcher is not None:
                with contextlib.suppress(Exception):
                    self.dispatcher.refuse_all(Status.STOPPING, "the sidecar is stopping")
            name = segment_name(self.cfg.name)
            if _ipc.segment_inode(name) == seg.inode:
                _ipc.unlink_segment(name)
            if self.bell is not None:
                _ipc.unlink_semaphore(doorbell_name(self.cfg.name))
            for i in range(len(self.resp_sems)):
                _ipc.unlink_semaphore(response_sem_name(self.cfg.name, i))
            for s in self.resp_sems:
                _ipc.close_semaphore(s)
            _ipc.close_semaphore(self.bell)
            self.dispatcher = None
            if self.service is not None and not self._fatal:
                with contextlib.suppress(Exception):
                    self.service.index.detach_segment()
            seg.close()
            self.seg = None
        if self.service is not None:
            self.service.store.close()
            if not self._fatal:  # a faulted context cannot be cleaned up; the exit frees it
                self.service.index.close()
            self.service = None
        if self._car_seg is not None:  # (the index has let go of its map: closed above)
            with contextlib.suppress(Exception):
                if _ipc.segment_inode(carousel_segment_name(self.cfg.name)) == self._car_seg.inode:
                    _ipc.unlink_segment(carousel_segment_name(self.cfg.name))
            self._car_seg.close()
            self._car_seg = None
        if self.arena is not None:
            self.arena.close()  # unlinks the current version
            self.arena = None
        for version, seg in self._arena_segs.items():  # (a version made by a move cut short too)
            with contextlib.suppress(Exception):
                if _ipc.segment_inode(arena_name(self.cfg.name, version)) == seg.inode:
                    _ipc.unlink_segment(arena_name(self.cfg.name, version))
            seg.close()
        self._arena_segs.clear()
        log.info("stopped")


def arena_segments_to_close(segs: Mapping[int, Any], version: int) -> list[int]:
    """The arena versions whose segments go when the writer unlinks ``version`` (its name goes
    at once). ``segs``: version -> an open ``_ipc.Segment``.

    * A move (``version``, the old one, is still mapped: the writer keeps it until the next
      move, because the GPU backend unregisters its row table after this call and a range must
      be unregistered while it is still mapped): the versions before it, whose maps the writer
      closed at this move and whose tables were unregistered at the last one.
    * Otherwise the writer closed ``version``'s map first: the arena was closed or dropped, or
      a new version failed half-written. Then ``version`` and every version whose map is
      closed go, and nothing else (a failed new version leaves the current one in use).
    """
    seg = segs.get(version)
    if seg is not None and not seg.mm.closed:
        return [v for v in segs if v < version]
    return [v for v, s in segs.items() if v == version or s.mm.closed]


_IDLE_WAIT_NS = 50_000_000  # longest doorbell wait: housekeeping and stop run between waits
# Diagnostics (KALOS_PROFILE=FILE): the dispatcher's launches of batches queued behind another
# run under cProfile (Dispatcher.profile), its statistics written to FILE (pstats' format) when
# the serve loop stops: where the host's time goes between a cohort's last request and its pass.
PROFILE = os.environ.get("KALOS_PROFILE", "")
DOORBELL_IDLE_S = knob("KALOS_DOORBELL_IDLE_S", number(0, 86_400), 5.0)  # stopped after this idle
# The resident kernel is started again after the sidecar has been idle this long, once a pass
# stopped it (a write, most often) or after a lone recall it would take (Server._rearm_bell;
# KALOS_BELL_REARM_MS, 0: only 4 lone recalls in a row start it). Idle, so that back-to-back
# traffic does not wait for a start (~0.2-0.4 ms of the host's time); not after a pass's stop
# of this many runs in a row that answered nothing, with no recall it would take in between.
BELL_REARM_NS = int(knob("KALOS_BELL_REARM_MS", number(0, 3_600_000), 1.0) * 1_000_000)
BELL_FRUITLESS_MAX = 2
_PACE_MIN_MARGIN_NS = 250_000  # a timed wait oversleeps by ~0.1 ms on a small VM
_PACE_MAX_GAP_NS = 100_000_000  # longer gaps are not predicted: the sidecar just sleeps


class Pace:
    """When the dispatcher spins and when it sleeps between requests.

    A sleeping sidecar pays a wake-up when a request comes (on a 2-vCPU VM ~0.1 ms p50 and
    over 1 ms p90; ~6 µs for the whole round trip when both sides spin); a spinning one costs
    a core. So the dispatcher learns ``gap_ns``, the typical time from the end of one piece of
    work to the arrival of the next, and waits accordingly:

    * short gaps (back-to-back calls, several busy clients): spin ``spin_ns`` after the last
      work, then sleep;
    * longer gaps (a client that computes for milliseconds between recalls): sleep on the
      doorbell through most of the expected gap (a request that comes early still rings it),
      spin across the expected arrival, ``margin_ns`` either side, then sleep;
    * gaps over ``_PACE_MAX_GAP_NS`` (or no traffic yet): as short gaps.

    ``gap_ns`` is a moving average that falls fast (half-way to a shorter gap) and rises slowly
    (1/8 of the way, a sample counted as at most twice the average): it errs towards waking
    early, a single pause of the client does not undo it, and when traffic turns back-to-back
    the dispatcher is spinning again within a few requests.

    Spinning stays bounded: at most ``2 * spin_ns`` per request, and an idle sidecar is asleep
    within ``gap_ns + spin_ns`` of its last request. ``spin_ns == 0`` never spins.
    """

    def __init__(self, spin_ns: int) -> None:
        self.spin_ns = spin_ns
        self.gap_ns = 0
        self.last_work = 0

    def worked(self, t_found: int, t_done: int) -> None:
        """Work found at ``t_found`` (ns, monotonic) was answered by ``t_done``."""
        if self.last_work:
            gap, avg = t_found - self.last_work, self.gap_ns
            if not avg:
                self.gap_ns = gap
            elif gap < avg:
                self.gap_ns = avg - ((avg - gap) >> 1)
            else:
                self.gap_ns = avg + ((min(gap, 2 * avg) - avg) >> 3)
        self.last_work = t_done

    def margin_ns(self) -> int:
        """How far either side of the expected arrival to spin: an eighth of the gap (its
        usual jitter), at least a timed wait's oversleep, at most ``spin_ns``."""
        return min(max(self.gap_ns >> 3, _PACE_MIN_MARGIN_NS), self.spin_ns)

    def sleep_ns(self, now: int) -> int:
        """0 to keep spinning now, else how long the dispatcher may sleep (ns)."""
        since = now - self.last_work
        if not self.spin_ns:
            return _IDLE_WAIT_NS
        if self.gap_ns <= self.spin_ns or self.gap_ns > _PACE_MAX_GAP_NS:
            return 0 if since < self.spin_ns else _IDLE_WAIT_NS
        margin = self.margin_ns()
        if since < self.gap_ns - margin:
            return self.gap_ns - margin - since  # sleep until shortly before the expected request
        if since < self.gap_ns + margin:
            return 0
        return _IDLE_WAIT_NS


def _ours_in_dev_shm(pattern: str) -> list[tuple[str, int]]:
    """(entry, N) for each /dev/shm entry of ours matching ``pattern`` (one group: N)."""
    pat = re.compile(pattern)
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return []
    return [(e, int(m.group(1))) for e in entries if (m := pat.match(e)) and _owned_by_us(f"/dev/shm/{e}")]


def _remove_extra_semaphores(name: str, n_slots: int) -> None:
    """Unlink ``/kalos-NAME-rN`` for every N >= ``n_slots`` (Linux lists them in /dev/shm)."""
    for entry, n in _ours_in_dev_shm(rf"^sem\.kalos-{re.escape(name)}-r(\d+)$"):
        if n >= n_slots:
            log.info("removing the stale semaphore %s", entry)
            with contextlib.suppress(Exception):  # e.g. another user's: leave it
                _ipc.unlink_semaphore(response_sem_name(name, n))


def _remove_stale_arenas(name: str) -> None:
    """Unlink ``/kalos-NAME-docs.V`` left by a dead sidecar of this name (ours only)."""
    for entry, version in _ours_in_dev_shm(rf"^kalos-{re.escape(name)}-docs\.(\d+)$"):
        log.info("removing the stale document arena %s", entry)
        with contextlib.suppress(Exception):
            _ipc.unlink_segment(arena_name(name, version))


def _remove_stale_carousel(name: str) -> None:
    """Unlink ``/kalos-NAME-car`` left by a dead sidecar of this name (ours only; called once the
    name is ours)."""
    seg = carousel_segment_name(name)
    if _owned_by_us(f"/dev/shm{seg}"):
        log.info("removing the stale carousel segment %s", seg)
        with contextlib.suppress(Exception):
            _ipc.unlink_segment(seg)


def _owned_by_us(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.geteuid()
    except OSError:
        return False


def _read_pid(seg: _ipc.Segment) -> int | str:
    try:
        return struct.unpack_from("<Q", seg.mm, HEADER_OFFSETS["sidecar_pid"])[0]
    except (struct.error, ValueError):
        return "?"

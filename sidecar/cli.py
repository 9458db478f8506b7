"""``kalos-sidecar``: serve, status, stats, stop, bench.

Exit codes (stable, for supervisors and readiness probes):

== ==========================================================================
0  success (``status``: up and answering; or up by its heartbeat, with clients holding every slot)
1  error (``status``: not running)
2  usage error (``status``: running but not answering in time)
3  ``serve``: a live sidecar already holds this name
4  ``serve``: the store of record is unusable (corrupt, other dim, other release)
5  ``serve``: the requested device is unavailable
6  ``serve``: permission problem (a name or file owned by another user)
7  ``serve``: the GPU reported a sticky fault; restart (the store reloads)
== ==========================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kalos_retrievers import _ipc
from kalos_retrievers.errors import KalosError, SidecarBusy, SidecarTimeout, SidecarUnavailable
from kalos_retrievers.protocol import DTYPES, METRICS, Header, check_name, segment_name, starting_pid

from .server import EXIT_ERROR, EXIT_OK, EXIT_USAGE, ServeConfig, Server, StartError

if TYPE_CHECKING:
    from kalos_retrievers.client import KalosClient


def _name(text: str) -> str:
    try:
        return check_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _timeout(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{text!r}: choose DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kalos-sidecar", description=(__doc__ or "The Kalos sidecar.").split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a sidecar in the foreground")
    s.add_argument("--name", required=True, help="segment name: /dev/shm/kalos-NAME")
    s.add_argument("--dim", required=True, type=int, help="vector dimension")
    s.add_argument("--metric", default="cosine", choices=sorted(METRICS))
    s.add_argument("--device", default="auto", help="auto (GPU if CuPy sees one), cpu, cuda, cuda:N")
    s.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="storage type on the GPU (default float16); the CPU stores float32")
    s.add_argument("--data-dir", default=None, help="SQLite store of record; omit for in-memory")
    s.add_argument("--slots", type=int, default=16, help="request slots (concurrent callers)")
    s.add_argument("--max-batch", type=int, default=64, help="most queries answered by one launch")
    s.add_argument("--max-k", type=int, default=1024, help="largest k a recall may ask for")
    s.add_argument("--payload-kb", type=int, default=1024, help="request area per slot (KiB)")
    s.add_argument("--blob-kb", type=int, default=1024, help="response area per slot (KiB)")
    s.add_argument("--spin-us", type=float, default=1000.0,
                   help="busy-poll this long after the last request before sleeping; when "
                        "requests come at a steady pace, sleep through the gap and spin across "
                        "the next expected request instead")
    s.add_argument("--threads", type=int, default=None,
                   help="threads for the CPU backend's matrix products (default: three "
                        "quarters of the cores on hosts of 8 or more, else numpy's BLAS default, "
                        "one per core; OPENBLAS_NUM_THREADS etc. in the environment are "
                        "respected); fewer leave cores to the application")
    s.add_argument("--sync", default="full", choices=["full", "normal"],
                   help="SQLite synchronous mode: full survives power loss, normal a crash")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus text here")
    s.add_argument("--metrics-host", default="127.0.0.1")
    s.add_argument("--log-level", type=_log_level, default="INFO")
    s.add_argument("--lifeline-fd", type=int, default=None,
                   help="an inherited pipe's read end: stop (as on SIGTERM) when its write end "
                        "is closed, i.e. when the process that started this sidecar has exited "
                        "(kalos_retrievers.spawn.Sidecar passes one)")

    st = sub.add_parser("status", help="exit 0 if the sidecar is up and answering")
    st.add_argument("name", type=_name)
    st.add_argument("--timeout", type=_timeout, default=1.0)
    st.add_argument("--quiet", "-q", action="store_true")

    sx = sub.add_parser("stats", help="print the sidecar's counters")
    sx.add_argument("name", type=_name)
    sx.add_argument("--prometheus", action="store_true", help="Prometheus text format")
    sx.add_argument("--timeout", type=_timeout, default=2.0)

    sp = sub.add_parser("stop", help="stop a running sidecar (SIGTERM) and wait for it")
    sp.add_argument("name", type=_name)
    sp.add_argument("--timeout", type=_timeout, default=15.0)

    b = sub.add_parser("bench", help="recall latency and throughput benchmark")
    from .bench import add_arguments

    add_arguments(b)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    if args.command == "stats":
        return _stats(args)
    if args.command == "stop":
        return _stop(args)
    from .bench import run as run_bench

    return run_bench(args)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s kalos-sidecar[{args.name}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # a fatal signal (SIGBUS: a foreign process shrank the segment; SIGSEGV) leaves Python's
    # traceback in the log, where the log's last line had been "ready"
    if sys.stderr is not None:  # (started with stderr closed: serve without it)
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            faulthandler.enable(file=sys.stderr)
    log = logging.getLogger("kalos.sidecar")
    if args.lifeline_fd is not None:
        try:
            _watch_lifeline(args.lifeline_fd, log)
        except OSError as e:
            log.error("--lifeline-fd %d: %s", args.lifeline_fd, e)
            return EXIT_USAGE
    try:
        cfg = ServeConfig(
            name=args.name, dim=args.dim, metric=args.metric, device=args.device, dtype=args.dtype,
            data_dir=args.data_dir, slots=args.slots, max_batch=args.max_batch, max_k=args.max_k,
            payload_kb=args.payload_kb, blob_kb=args.blob_kb, spin_us=args.spin_us, threads=args.threads,
            sync=args.sync, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        )  # fmt: skip
    except ValueError as e:
        log.error("%s", e)
        return EXIT_USAGE
    server = Server(cfg)
    # SIGTERM / SIGINT while starting (a long load, the lifeline's EOF) unwind start(), which
    # undoes what it made, instead of killing the process with its segment left in /dev/shm.
    # Only the first one raises (a second, while the start unwinds, must not cut that short);
    # once started, the serving handlers take over with no gap in between.
    armed = [True]

    def stop_starting(signum: int, frame: object) -> None:
        if server.holding_signals:  # (an IPC object made but not yet where close() finds it)
            server.held_signal = signum
            return
        if armed[0]:
            armed[0] = False
            raise _StoppedWhileStarting(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_starting)
    try:
        try:
            server.start()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, server._on_signal)
        except StartError as e:
            armed[0] = False
            log.error("%s", e)
            return e.exit_code
        except KalosError as e:
            armed[0] = False
            log.error("%s", e)
            return EXIT_ERROR
    except _StoppedWhileStarting:
        armed[0] = False
        server.close()  # (idempotent: start() has closed what it made)
        log.info("stopped while starting")
        return EXIT_OK
    try:
        server.serve_forever()
    except StartError as e:  # a sticky CUDA fault while serving
        log.error("%s", e)
        server.close()
        # Leave at once: interpreter shutdown would try to free device memory through a
        # context that is in a sticky error state.
        logging.shutdown()
        os._exit(e.exit_code)
    except BaseException:  # a bug outside every handler: the segment and semaphores go with it
        server.close()
        raise
    return EXIT_OK


def _loading_pid(name: str) -> int | None:
    """The pid of a live sidecar named ``name`` that is still starting (its segment's header
    written, its lock held), or None."""
    try:
        seg = _ipc.Segment.open(segment_name(name), name)
    except KalosError:
        return None
    try:
        pid = starting_pid(seg.mm)
        return pid if pid is not None and _ipc.is_locked(seg.fd, _ipc.SIDECAR_LOCK_BYTE) else None
    finally:
        seg.close()


def _maps_segment(pid: int, name: str) -> bool | None:
    """Whether process ``pid`` is sidecar ``name``: it maps the segment (``/proc/PID/maps``
    lists its inode), or, where its maps cannot be read (another user's process, without
    CAP_SYS_PTRACE), its command line is ``serve`` with this name. None without /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    ino = _ipc.segment_inode(segment_name(name))
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except FileNotFoundError:
        return False  # (no such process here)
    except OSError:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return False
        return b"serve" in argv and (f"--name={name}".encode() in argv or any(
            a == b"--name" and b == name.encode() for a, b in itertools.pairwise(argv)))  # fmt: skip
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and ino is not None and fields[4] == str(ino) and "kalos-" in fields[5]:
            return True
    return False


class _StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT before the sidecar was serving."""


def _watch_lifeline(fd: int, log: logging.Logger) -> None:
    """Send ourselves SIGTERM (the usual clean stop) once every holder of the pipe's write end
    has closed it: read returns EOF then, however the starting process ended (SIGKILL too).
    A parent-death signal would not do: it fires when the starting *thread* exits."""
    os.fstat(fd)  # (EBADF: not an inherited descriptor)
    os.set_inheritable(fd, False)

    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError as e:
            log.warning("lifeline fd %d unreadable (%s): this sidecar no longer stops with its starter", fd, e)
            return
        log.info("the process that started this sidecar has exited: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kalos-lifeline", daemon=True).start()


def _client(name: str, timeout: float):  # type: ignore[no-untyped-def]
    from kalos_retrievers.client import KalosClient

    return KalosClient(name, timeout=timeout, spin_us=0)


def _status(args: argparse.Namespace) -> int:
    try:
        with _client(args.name, args.timeout) as c:
            conn = c._conn
            untaken = conn.untaken_requests() if conn is not None else {}
            try:
                rtt = c.ping()
            except SidecarBusy as e:
                return _status_without_a_slot(args, c, e, untaken)
            h = c.header
    except SidecarTimeout as e:
        if not args.quiet:
            print(f"not answering: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KalosError as e:
        if not args.quiet:
            print(f"down: {e}", file=sys.stderr)
        return EXIT_ERROR
    if not args.quiet:
        _print_ready(h, round(rtt * 1e6, 1))
    return EXIT_OK


def _print_ready(h: Header, ping_us: float | None, **more: str) -> None:
    print(json.dumps({
        "name": h.name, "status": "ready", "pid": h.sidecar_pid, "backend": h.backend,
        "dim": h.dim, "metric": h.metric_name, "rows": h.row_count, "ping_us": ping_us, **more,
    }))  # fmt: skip


def _status_without_a_slot(args: argparse.Namespace, c: KalosClient, e: SidecarBusy,
                           untaken: dict[int, int]) -> int:  # fmt: skip
    """Every slot is held by a client (idle clients keep one each): the ping cannot be sent,
    and that says nothing of the sidecar. Up (0) when it is alive (its lock held), its
    maintenance thread stamped the header within the last second (every 0.1 s while serving),
    and no request untaken when the probe began (``untaken``: slot -> seq) is still untaken: a
    probe must not report a busy sidecar as wedged (a supervisor would restart it), nor a
    wedged one whose slots its callers' given-up requests hold as ready. Else not answering
    (2), or down (1) when it is gone. (Untaken requests only: one being worked on may take
    long; one the sidecar has not taken for the probe's whole wait is the serve loop not
    taking requests.)"""
    conn = c._conn
    if conn is None or conn.dead or not conn.sidecar_alive():
        if not args.quiet:
            print(f"down: {e}; it is gone", file=sys.stderr)
        return EXIT_ERROR
    age = conn.heartbeat_age()
    stuck = sorted(i for i, seq in conn.untaken_requests().items() if untaken.get(i) == seq)
    if age > 1.0 or stuck:
        why = (f"its heartbeat is {age:.1f} s old" if age > 1.0
               else f"slot {stuck[0]}'s request has waited the probe's {args.timeout} s untaken")  # fmt: skip
        if not args.quiet:
            print(f"not answering: {e}; {why}", file=sys.stderr)
        return EXIT_USAGE
    if not args.quiet:
        h = c.header
        _print_ready(h, None, note=f"not pinged: all {h.n_slots} slots are held by clients (heartbeat "
                                   f"{age * 1e3:.0f} ms old); start it with more --slots if clients wait for one")
    return EXIT_OK


def _stats(args: argparse.Namespace) -> int:
    try:
        with _client(args.name, args.timeout) as c:
            s = c.stats()
    except KalosError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if args.prometheus:
        from .stats import Histogram, Stats

        st = Stats()
        for key, n in s["requests"].items():
            op, status = key.split("/")
            st.requests[(op, status)] = n
        for op, summary in s.get("latency", {}).items():  # (the histograms, as /metrics has them)
            h = Histogram.of_summary(summary)
            if h is not None:
                st.latency[op] = h
        # the counters the text reports from Stats itself (a fresh Stats would say 0)
        st.rejected = s.get("rejected_requests", 0)
        st.reclaimed_slots = s.get("reclaimed_slots", 0)
        st.republished = s.get("republished", 0)
        st.started = time.time() - s.get("uptime_s", 0.0)
        print(st.prometheus(s), end="")
    else:
        print(json.dumps(s, indent=2))
    return EXIT_OK


def _stop(args: argparse.Namespace) -> int:
    try:
        with _client(args.name, 2.0) as c:
            pid = c.header.sidecar_pid
    except SidecarUnavailable as e:
        loading = _loading_pid(args.name)  # (clients cannot use it yet: still loading its rows)
        if loading is None:
            print(f"not running: {e}", file=sys.stderr)
            return EXIT_ERROR
        pid = loading
    if _maps_segment(pid, args.name) is False:  # (None: no /proc to ask; signalled as before)
        # the header's pid is the sidecar's in its own pid namespace: here it may be any
        # process (in a pod without a shared process namespace, the application's own pid 1)
        print(f"pid {pid} (the sidecar's, from its segment's header) is not the process holding "
              f"/dev/shm{segment_name(args.name)} here: the sidecar runs in another pid namespace "
              "(another container); stop it there, or through its supervisor", file=sys.stderr)  # fmt: skip
        return EXIT_ERROR
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print(f"sidecar pid {pid} is not visible from here (another pid namespace?)", file=sys.stderr)
        return EXIT_ERROR
    deadline = time.monotonic() + args.timeout
    name = segment_name(args.name)
    while time.monotonic() < deadline:
        if _ipc.segment_inode(name) is None:
            print(f"stopped sidecar {args.name!r} (pid {pid})")
            return EXIT_OK
        time.sleep(0.02)
    print(f"sidecar {args.name!r} (pid {pid}) did not stop within {args.timeout} s", file=sys.stderr)
    return EXIT_ERROR

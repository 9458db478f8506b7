"""Start and stop a sidecar process from Python (examples, tests, notebooks).

>>> with Sidecar(dim=384, device="cpu") as sc:          # doctest: +SKIP
...     client = sc.client()
...     client.upsert(...)

The process runs ``python -P -m kalos_retrievers.sidecar serve`` with the same interpreter
(``-P``: the current directory is not put on ``sys.path``, so a source checkout in the current
directory cannot shadow the installed package, whose sidecar lives elsewhere in the tree), logs
to a file (``Sidecar.log_path``, owner-only, made by the first ``start``; its tail is included
in any start-up error), and by default
stops (as on SIGTERM) once the process that started it has exited, however it ended, so an
interrupted script leaves no orphan sidecar behind.

That "lifeline" is a pipe, not ``PR_SET_PDEATHSIG``: the kernel sends a parent-death signal
when the *thread* that forked the child exits, so a sidecar started from a worker thread (an
executor running ``afrom_texts``, say) would be stopped as soon as that thread finished. The
sidecar holds the pipe's read end (``serve --lifeline-fd``) and stops when it reads EOF, which
comes when every process holding the write end has exited: this one, and any process forked
from it while the sidecar runs (the write end is close-on-exec, so programs it execs never
hold it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import KalosError
from .protocol import check_name

if TYPE_CHECKING:
    from .client import KalosClient

__all__ = ["Sidecar", "SidecarStartError"]


class SidecarStartError(KalosError):
    """The sidecar process exited or did not become ready; the message has its log's tail."""


class Sidecar:
    """A sidecar process owned by this Python process.

    Args:
        name: sidecar name; a unique one is made up when None.
        dim: vector dimension.
        metric, device, dtype, data_dir, slots, max_batch, max_k, payload_kb, blob_kb, spin_us,
        threads:
            as the ``kalos-sidecar serve`` flags of the same names.
        startup_timeout: seconds to wait for READY (loading a large store takes a while).
        die_with_parent: stop the sidecar once this process (and whatever it forks while
            the sidecar runs) has exited, by any means, SIGKILL included; see the module's
            docstring.
        extra_args: more command-line arguments for ``serve``.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        dim: int,
        metric: str = "cosine",
        device: str = "auto",
        dtype: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        slots: int | None = None,
        max_batch: int | None = None,
        max_k: int | None = None,
        payload_kb: int | None = None,
        blob_kb: int | None = None,
        spin_us: float | None = None,
        threads: int | None = None,
        startup_timeout: float = 120.0,
        die_with_parent: bool = True,
        log_level: str = "INFO",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.name = check_name(name or f"k{uuid.uuid4().hex[:12]}")
        self.dim = dim
        self.data_dir = None if data_dir is None else str(data_dir)
        self.startup_timeout = startup_timeout
        self.die_with_parent = die_with_parent
        self.argv = [sys.executable, "-P", "-m", "kalos_retrievers.sidecar", "serve",
                     "--name", self.name, "--dim", str(dim), "--metric", metric,
                     "--device", device, "--log-level", log_level]  # fmt: skip
        opts = {"--dtype": dtype, "--data-dir": self.data_dir, "--slots": slots,
                "--max-batch": max_batch, "--max-k": max_k, "--payload-kb": payload_kb,
                "--blob-kb": blob_kb, "--spin-us": spin_us, "--threads": threads}  # fmt: skip
        for flag, value in opts.items():
            if value is not None:
                self.argv += [flag, str(value)]
        self.argv += list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None  # the write end of the sidecar's lifeline pipe
        # (named now, made by the first start: a Sidecar that is never started leaves no file;
        # 64 random bits, so no other user can make the file first)
        self.log_path = Path(tempfile.gettempdir()) / f"kalos-{self.name}-{uuid.uuid4().hex[:16]}.log"

    def start(self) -> Sidecar:
        """Start the process and wait until it answers a ping.

        Raises:
            SidecarStartError: it exited (bad flags, name in use, corrupt store...) or did not
                become ready within ``startup_timeout``; the message includes its log's tail.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise SidecarStartError(
                f"sidecar {self.name!r} is already running (pid {self.proc.pid}); stop() it before "
                "starting it again"
            )
        self._close_lifeline()  # (a previous start's, if this object is started again)
        argv, keep = self.argv, ()
        if self.die_with_parent:
            r, w = os.pipe()  # (both close-on-exec; pass_fds hands the sidecar the read end)
            argv, keep = [*argv, "--lifeline-fd", str(r)], (r,)
        try:
            try:  # owner-only, appended to by later starts; O_NOFOLLOW: a link planted there fails
                log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                raise SidecarStartError(f"sidecar {self.name!r}: cannot open its log {self.log_path}: "
                                        f"{e.strerror or e}") from None  # fmt: skip
            with open(log_fd, "ab") as log:
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, pass_fds=keep)  # fmt: skip
        except BaseException:
            if keep:
                os.close(w)
            raise
        finally:
            for fd in keep:
                os.close(fd)
        if keep:
            self._lifeline = w
        self.wait_ready(self.startup_timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        from .client import KalosClient

        deadline = time.monotonic() + timeout
        last: KalosError | None = None
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                self._close_lifeline()
                raise SidecarStartError(
                    f"sidecar {self.name!r} exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with KalosClient(self.name, timeout=1.0, spin_us=0) as c:
                    c.ping()
                    # Another sidecar already serving this name answers the ping too: only our
                    # own process counts (it is about to exit with "name in use").
                    if self.proc is None or c.header.sidecar_pid == self.proc.pid:
                        return
            except KalosError as e:  # not ours yet, or another program's segment under the
                last = e  # name (which our process refuses: it exits, and says why, above)
            if time.monotonic() > deadline:
                self.stop()
                raise SidecarStartError(
                    f"sidecar {self.name!r} not ready after {timeout} s (last: {last}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.02)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def client(self, **kwargs: Any) -> KalosClient:
        """A :class:`KalosClient` connected to this sidecar."""
        from .client import KalosClient

        return KalosClient(self.name, dim=self.dim, **kwargs)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed. Returns the exit code (None if never started).

        The log file is removed after a clean exit (code 0) and kept otherwise, for the post
        mortem (``log_path``).
        """
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._close_lifeline()
        if p.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        return p.returncode

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send a signal (default SIGKILL) without waiting: for fault-injection tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def __enter__(self) -> Sidecar:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Degradation: when the sidecar is gone or slow, retrieval returns empty context.

Every adapter (LangChain, LlamaIndex, the memory store) routes its calls through one
:class:`Degrader`, so the behaviour is the same everywhere:

* a *transient* error (:class:`~kalos_retrievers.errors.SidecarUnavailable`,
  :class:`~kalos_retrievers.errors.SidecarTimeout`) becomes an empty result, unless the adapter
  was built with ``on_error="raise"``;
* the first failure of an *episode* (a run of consecutive failures) logs one WARNING; the rest
  log at DEBUG; the first success afterwards logs one INFO "recovered" line;
* ``degraded_calls`` and ``episodes`` count what happened, for dashboards and tests;
* everything else (bad arguments, a version mismatch, a rejected request) is raised: those
  are bugs or misconfiguration that empty context would hide.

The client reconnects by itself, so recovery needs nothing from the caller.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Literal

from .errors import KalosError, SidecarTimeout

__all__ = ["Degrader", "OnError", "degradation_totals", "prometheus_text", "time_left"]

OnError = Literal["empty", "raise"]
log = logging.getLogger("kalos_retrievers")

# Degradations happen in the application's process, where the sidecar cannot count them (it is
# the thing that is away): every Degrader of the process also adds to these totals, which the
# application exports with its own metrics (see docs/deployment.md).
_totals_lock = threading.Lock()
_totals = {"degraded_calls": 0, "episodes": 0}


def degradation_totals() -> dict[str, int]:
    """Calls answered with empty context, and episodes, summed over this process's Degraders."""
    with _totals_lock:
        return dict(_totals)


def prometheus_text() -> str:
    """This process's degradation counters in the Prometheus text format (version 0.0.4)."""
    t = degradation_totals()
    return (
        "# HELP kalos_client_degraded_calls_total Calls answered with empty context because the "
        "Kalos sidecar was unavailable or too slow.\n"
        "# TYPE kalos_client_degraded_calls_total counter\n"
        f"kalos_client_degraded_calls_total {t['degraded_calls']}\n"
        "# HELP kalos_client_degradation_episodes_total Runs of consecutive degraded calls.\n"
        "# TYPE kalos_client_degradation_episodes_total counter\n"
        f"kalos_client_degradation_episodes_total {t['episodes']}\n"
    )


class Degrader:
    """Decides, counts and logs degradation for one adapter instance.

    Args:
        what: how log lines name the adapter, e.g. ``"KalosRetriever(name='mem')"``.
        on_error: ``"empty"`` to degrade on transient errors, ``"raise"`` to raise them.
    """

    def __init__(self, what: str, on_error: OnError = "empty") -> None:
        if on_error not in ("empty", "raise"):
            raise ValueError(f"on_error={on_error!r} must be 'empty' or 'raise'")
        self.what = what
        self.on_error: OnError = on_error
        self.degraded_calls = 0
        self.episodes = 0
        self.in_episode = False
        self.last_error: BaseException | None = None
        self._episode_start = 0.0
        self._recovered_at = -math.inf  # when the last episode ended (time.monotonic())
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Its settings only: a copy, or one unpickled (perhaps in another process, whose
        monotonic clock its episodes' times would not be on), counts degradation anew, with a
        lock of its own. So a retriever or store holding one can be copied and pickled."""
        return {"what": self.what, "on_error": self.on_error}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["what"], state["on_error"])  # type: ignore[misc]

    def should_degrade(self, exc: BaseException, on_error: OnError | None = None,
                       started: float | None = None) -> bool:  # fmt: skip
        """Record a failure. True: return empty context. False: re-raise ``exc``.

        ``on_error`` overrides this Degrader's for the call (an adapter whose policy can
        change after its Degrader was made passes its own). ``started``: when the failed call
        began (``time.monotonic()``); one that began before the success that ended the last
        episode failed in that outage, and opens no new one. (A sidecar that resumes answers
        the requests whose deadlines passed while it was paused "too late", after calls made
        since have succeeded: one outage was logged as two or three.)"""
        if on_error is None:
            on_error = self.on_error
        if not isinstance(exc, KalosError) or not exc.transient or on_error == "raise":
            return False
        with self._lock:
            self.degraded_calls += 1
            # kept without its traceback: the frames it holds would keep the failed call's
            # connection alive (its map, and through the map's descriptor its slot locks, in
            # a forked child too) for as long as this adapter lives
            self.last_error = _without_tracebacks(exc)
            first = not self.in_episode and (started is None or started >= self._recovered_at)
            if first:
                self.in_episode = True
                self.episodes += 1
                self._episode_start = time.monotonic()
        with _totals_lock:
            _totals["degraded_calls"] += 1
            _totals["episodes"] += first
        if first:
            log.warning("%s: the Kalos sidecar is unavailable or too slow (%s); returning empty "
                        "context until it answers in time", self.what, exc)  # fmt: skip
        else:
            log.debug("%s: still degraded: %s", self.what, exc)
        return True

    def succeeded(self) -> None:
        """Record a success; ends the current episode if there is one."""
        if not self.in_episode:
            return
        with self._lock:
            if not self.in_episode:
                return
            self.in_episode = False
            self._recovered_at = time.monotonic()
            took = self._recovered_at - self._episode_start
        log.info("%s: the Kalos sidecar is back after %.1f s; recall works again", self.what, took)


def _without_tracebacks(exc: BaseException) -> BaseException:
    """``exc`` with its traceback dropped, and those of the exceptions chained to it (a retry's
    first attempt, say, as ``__context__``)."""
    e: BaseException | None = exc
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def time_left(deadline: float, name: str) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``) for the next call to sidecar ``name``.

    Async adapter calls take their deadline when they are made, before they wait for a worker
    thread, so that many concurrent calls on a slow sidecar all end near one deadline instead
    of queueing one after another.

    Raises:
        SidecarTimeout: the deadline has passed already (transient: adapters degrade).
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise SidecarTimeout(
            f"sidecar {name!r}: the deadline passed before the request was sent (every worker "
            "thread was busy); raise the timeout or lower the concurrency"
        )
    return left

"""The async adapters' calls into a :class:`~kalos_retrievers.client.KalosClient`.

A client call blocks its thread until the sidecar answers or the call's deadline passes. Run on
the event loop's default executor, calls blocked by a paused sidecar took the threads that
``aembed_query``'s default, LangChain's synchronous callback handlers and the application's own
``run_in_executor`` work need: with a sidecar paused, a retriever's ``ainvoke(timeout=0.3)``
returned ``[]`` after up to twice its timeout, its embedding having queued behind recalls
waiting out theirs. So they run on the client's own threads (:attr:`KalosClient.executor`, as
many as its slots: a call beyond those waits for a slot anyway), with the caller's context
variables (callbacks, tracing). Those threads are few: a call queued behind calls that each
wait out their deadline on a paused sidecar would wait for them too (a retriever with a 0.25 s
timeout behind eight 2 s writes returned ``[]`` after 2 s; LlamaIndex's writes, which took their
deadline when a thread took them, ended after N / 8 timeouts). So a call carries the deadline
taken when it was made, and one still queued when it passes is dropped, never sent: a read
degrades or raises as if it had timed out, a write raises ``SidecarTimeout``.

A write cannot be stopped once its thread runs it. :func:`write` lets a cancelled write settle
(it ends by its own deadline) before the cancellation goes on, so that what the caller does
next, a retry or a delete of the same ids, comes after it rather than being overtaken by it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import SidecarTimeout

if TYPE_CHECKING:
    from .client import KalosClient

T = TypeVar("T")

__all__ = ["call", "write"]


def _submit(
    client: KalosClient, fn: Callable[..., T], args: tuple[Any, ...]
) -> tuple[concurrent.futures.Future[T], asyncio.Future[T]]:
    ctx = contextvars.copy_context()
    job = client.executor.submit(ctx.run, fn, *args)
    return job, asyncio.wrap_future(job)


async def _unstarted_at(job: concurrent.futures.Future[Any], fut: asyncio.Future[Any],
                        deadline: float | None) -> bool:  # fmt: skip
    """Wait until ``fut`` is done or ``deadline`` passes; True when it passed with the job
    still queued, which is then dropped (never started: nothing was sent)."""
    if deadline is None:
        return False
    await asyncio.wait({fut}, timeout=max(0.0, deadline - time.monotonic()))
    return not fut.done() and job.cancel()


def _unsent(client: KalosClient) -> SidecarTimeout:
    return SidecarTimeout(
        f"sidecar {client.name!r}: the deadline passed while the call waited for one of the "
        f"client's {client.max_slots} worker threads, each held by a call of its "
        "own (as while the sidecar is paused); nothing was sent. Raise the timeout or lower "
        "the concurrency"
    )


def raising(exc: BaseException) -> Callable[[], Any]:
    """A function that raises ``exc`` (for a degrading wrapper's ``fn``)."""

    def fn() -> Any:
        raise exc

    return fn


async def call(
    client: KalosClient,
    fn: Callable[..., T],
    *args: Any,
    deadline: float | None = None,
    expired: Callable[[SidecarTimeout], T] | None = None,
) -> T:
    """``fn(*args)`` on ``client``'s threads (a read: a recall, a get, a check).

    ``deadline`` (``time.monotonic()``, the one ``fn`` itself keeps): where it passes before a
    thread takes the call (every thread held by a call of its own, each up to its deadline on
    a paused sidecar), the call is dropped from the queue and ``expired(e)`` returns the
    outcome (a degrading adapter's empty answer; without ``expired``, ``e``, a
    ``SidecarTimeout``, is raised), instead of its caller waiting for the threads ahead."""
    job, fut = _submit(client, fn, args)
    try:
        if await _unstarted_at(job, fut, deadline):
            e = _unsent(client)
            if expired is None:
                raise e
            return expired(e)
        return await fut
    except asyncio.CancelledError:
        fut.cancel()  # (a queued call is dropped; a running read ends by its own deadline)
        raise


async def write(client: KalosClient, fn: Callable[..., T], *args: Any, deadline: float | None = None) -> T:
    """``fn(*args)`` on ``client``'s threads, a write: cancelled, it waits for the write in
    flight to end (within its deadline; cancelled again meanwhile, as anyio's cancel scopes
    do, it still waits) and then raises ``CancelledError``; a write still queued is dropped
    at once. The write may have been stored, whole or in part: pass ids, so that a retry
    overwrites. ``deadline``: as for :func:`call`; a write still queued when it passes raises
    ``SidecarTimeout`` (nothing was sent)."""
    job, fut = _submit(client, fn, args)
    try:
        if await _unstarted_at(job, fut, deadline):
            raise _unsent(client)
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if job.cancel():  # never started: nothing to wait for
            raise
        while not fut.done():
            try:
                await asyncio.wait({fut})
            except asyncio.CancelledError:
                continue  # (the write settles first, however often the caller is cancelled)
        if not fut.cancelled():
            fut.exception()  # (its error, if any, is retrieved: the caller was cancelled)
        raise

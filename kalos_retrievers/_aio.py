"""The async adapters' calls into a :class:`~kalos_retrievers.client.KalosClient`.

A client call blocks its thread until the sidecar answers or the call's deadline passes. Run on
the event loop's default executor, calls blocked by a paused sidecar took the threads that
``aembed_query``'s default, LangChain's synchronous callback handlers and the application's own
``run_in_executor`` work need: with a sidecar paused, a retriever's ``ainvoke(timeout=0.3)``
returned ``[]`` after up to twice its timeout, its embedding having queued behind recalls
waiting out theirs. So they run on the client's own threads (:attr:`KalosClient.executor`, as
many as its slots: a call beyond those waits for a slot anyway), with the caller's context
variables (callbacks, tracing).

A write cannot be stopped once its thread runs it. :func:`write` lets a cancelled write settle
(it ends by its own deadline) before the cancellation goes on, so that what the caller does
next, a retry or a delete of the same ids, comes after it rather than being overtaken by it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .client import KalosClient

T = TypeVar("T")

__all__ = ["call", "write"]


def _submit(client: KalosClient, fn: Callable[..., T], args: tuple[Any, ...]) -> asyncio.Future[T]:
    ctx = contextvars.copy_context()
    return asyncio.get_running_loop().run_in_executor(client.executor, functools.partial(ctx.run, fn, *args))


async def call(client: KalosClient, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``client``'s threads (a read: a recall, a get, a check)."""
    return await _submit(client, fn, args)


async def write(client: KalosClient, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``client``'s threads, a write: cancelled, it waits for the write in
    flight to end (within its deadline) and then raises ``CancelledError``. The write may
    have been stored, whole or in part: pass ids, so that a retry overwrites."""
    fut = _submit(client, fn, args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        if not fut.cancelled():
            fut.exception()  # (its error, if any, is retrieved: the caller was cancelled)
        raise

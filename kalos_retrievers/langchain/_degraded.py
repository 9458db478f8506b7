"""Degradation for LangChain retrievers: the shared :class:`~kalos_retrievers.Degrader` decides
and counts; this module turns a degraded call into a LangChain custom event.

The event is dispatched through the retriever run's own callback manager, the way
``langchain_core.callbacks.dispatch_custom_event`` does from inside a run: every callback
handler of the chain receives ``on_custom_event("kalos_degraded", data, run_id=<the
retriever's run id>, ...)``, and ``astream_events`` yields it as an ``on_custom_event`` event.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)

from ..degrade import Degrader, OnError

__all__ = ["DEGRADED_EVENT", "adegrade", "degrade"]

#: Name of the custom callback event a retriever dispatches when it returns empty context.
DEGRADED_EVENT = "kalos_degraded"


def _event_data(degrader: Degrader, exc: BaseException, name: str, first: bool) -> dict[str, Any]:
    return {
        "retriever": degrader.what,
        "sidecar": name,
        "error": type(exc).__name__,
        "message": str(exc),
        "first_in_episode": first,
        "episodes": degrader.episodes,
        "degraded_calls": degrader.degraded_calls,
    }


def degrade(
    degrader: Degrader,
    exc: Exception,
    name: str,
    run_manager: CallbackManagerForRetrieverRun,
    on_error: OnError | None = None,
    started: float | None = None,
) -> bool:
    """Let ``degrader`` judge ``exc`` (with the retriever's ``on_error``); on True also
    dispatch :data:`DEGRADED_EVENT`.

    Returns:
        True when the caller should return empty context, False when it should re-raise.
    """
    before = degrader.episodes
    if not degrader.should_degrade(exc, on_error, started):
        return False
    data = _event_data(degrader, exc, name, degrader.episodes != before)
    run_manager.get_child().on_custom_event(DEGRADED_EVENT, data, run_id=run_manager.run_id)
    return True


async def adegrade(
    degrader: Degrader,
    exc: Exception,
    name: str,
    run_manager: AsyncCallbackManagerForRetrieverRun,
    on_error: OnError | None = None,
    started: float | None = None,
) -> bool:
    """Async :func:`degrade`."""
    before = degrader.episodes
    if not degrader.should_degrade(exc, on_error, started):
        return False
    data = _event_data(degrader, exc, name, degrader.episodes != before)
    await run_manager.get_child().on_custom_event(DEGRADED_EVENT, data, run_id=run_manager.run_id)
    return True

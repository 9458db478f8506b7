"""Degradation glue for the LlamaIndex adapters: one guarded call and one instrumentation event.

The policy itself (what degrades, one warning per episode, counters) is
:class:`kalos_retrievers.degrade.Degrader`, shared with the LangChain adapter; this module only
runs a call under it and tells LlamaIndex's instrumentation when a call degraded, so that
observability handlers (Arize, Langfuse, a custom ``BaseEventHandler``) see it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events import BaseEvent

from ..degrade import Degrader, OnError, time_left
from ..errors import KalosError

__all__ = ["KalosDegradedEvent", "call_degrading", "time_left"]

T = TypeVar("T")
_dispatcher = get_dispatcher(__name__)


class KalosDegradedEvent(BaseEvent):
    """A Kalos call returned empty context because the sidecar was unavailable or too slow.

    Attributes:
        adapter: which adapter degraded, e.g. ``"KalosRetriever(name='mem', namespace='')"``.
        error: the transient error, as text.
        episode: the adapter's episode number (1 for the first outage it saw, ...).
    """

    adapter: str
    error: str
    episode: int

    @classmethod
    def class_name(cls) -> str:
        return "KalosDegradedEvent"


def call_degrading(degrader: Degrader, fn: Callable[[], T], empty: Callable[[], T],
                   on_error: OnError | None = None) -> T:  # fmt: skip
    """``fn()``, or ``empty()`` when it raised a transient error and ``degrader`` says degrade
    (``on_error``: the caller's policy now, when it can change after ``degrader`` was made)."""
    started = time.monotonic()
    try:
        out = fn()
    except KalosError as e:
        if not degrader.should_degrade(e, on_error, started=started):
            raise
        _dispatcher.event(
            KalosDegradedEvent(adapter=degrader.what, error=str(e), episode=degrader.episodes)
        )
        return empty()
    degrader.succeeded()
    return out

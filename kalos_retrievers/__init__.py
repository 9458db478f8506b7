"""Kalos: memory recall for LLM applications at the speed of the hardware.

A sidecar process keeps an application's memories (vectors, text, metadata) resident in GPU
memory (or, without a GPU, in numpy) and answers recall requests that client processes write
into POSIX shared memory. This package is the client side:

* :class:`KalosClient`: upsert, recall, get, delete, count, stats;
* :class:`Sidecar`: start and stop a sidecar process from Python;
* ``kalos_retrievers.langchain``: ``KalosVectorStore`` and ``KalosRetriever`` for LangChain;
* ``kalos_retrievers.llama_index``: the same for LlamaIndex;
* ``kalos_retrievers.memory``: ``KalosMemory``, an agent memory store.

The sidecar itself is ``kalos_retrievers.sidecar`` (command ``kalos-sidecar``).
"""

from __future__ import annotations

from .client import KalosClient
from .degrade import Degrader
from .errors import (
    CapacityError,
    DimensionMismatch,
    IncompatibleVersion,
    KalosError,
    PermissionDenied,
    ProtocolError,
    RequestRejected,
    SidecarBusy,
    SidecarTimeout,
    SidecarUnavailable,
    StoreError,
)
from .results import Hit, RecallResult, Record
from .spawn import Sidecar, SidecarStartError

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "Degrader",
    "DimensionMismatch",
    "Hit",
    "IncompatibleVersion",
    "KalosClient",
    "KalosError",
    "PermissionDenied",
    "ProtocolError",
    "RecallResult",
    "Record",
    "RequestRejected",
    "Sidecar",
    "SidecarBusy",
    "SidecarStartError",
    "SidecarTimeout",
    "SidecarUnavailable",
    "StoreError",
    "__version__",
]

"""One error hierarchy for everything Kalos raises.

The categories drive what callers do next, the way redis-py's exception classes drive its
``Retry``: adapters degrade to empty context on :class:`SidecarUnavailable` and
:class:`SidecarTimeout` (the sidecar is gone, restarting, paused or slow), and re-raise the
rest, which mean the caller or the deployment must change something.

Bad arguments are not ``KalosError``: they raise the built-in ``ValueError``/``TypeError`` with
a message naming the argument, as Python code is expected to.
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "DimensionMismatch",
    "IncompatibleVersion",
    "KalosError",
    "PermissionDenied",
    "ProtocolError",
    "RequestRejected",
    "SidecarBusy",
    "SidecarTimeout",
    "SidecarUnavailable",
    "StoreError",
]


class KalosError(Exception):
    """Base class of every error Kalos raises on purpose."""

    #: True when retrying later (or degrading to empty context now) is the right response.
    transient: bool = False

    #: Set on an error raised by a write of rows (``KalosClient.upsert``, a LangChain store's
    #: ``add_texts``/``add_documents``, ``KalosMemory.add``): the ids of all its rows, made-up
    #: ones included, so that a retry can overwrite rather than store twice what was
    #: committed (None from writes whose rows are an adapter's own, a ``KalosStore`` put) ...
    ids: list[str] | None = None
    #: ... and how many of them, the first ones, were committed for sure (the rest may or may
    #: not have been).
    committed: int | None = None


class SidecarUnavailable(KalosError):
    """No sidecar is serving this name: never started, stopped, killed, or restarting.

    The client reconnects by itself (with exponential backoff) on a later call.
    """

    transient = True


class SidecarTimeout(KalosError):
    """The sidecar did not answer before the call's deadline (paused, overloaded, slow disk)."""

    transient = True


class SidecarBusy(SidecarTimeout):
    """Every request slot stayed taken until the deadline; start the sidecar with more ``--slots``."""


class ProtocolError(KalosError):
    """The shared-memory segment or a response broke the protocol (corruption or a bug)."""


class IncompatibleVersion(ProtocolError):
    """Client and sidecar speak different protocol versions, or disagree on the vector layout."""


class DimensionMismatch(IncompatibleVersion):
    """The client was created with a ``dim`` other than the sidecar's: the embedding model and the
    stored vectors disagree. Raised on connect, before any request is sent."""


class PermissionDenied(KalosError):
    """The segment belongs to another user, or its mode forbids this process."""


class RequestRejected(KalosError):
    """The sidecar validated the request and refused it; the message says why."""


class CapacityError(RequestRejected):
    """The index could not grow (out of host or device memory); the sidecar keeps serving."""


class StoreError(RequestRejected):
    """The store of record failed to commit; nothing of the write was acknowledged."""

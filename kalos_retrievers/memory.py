"""``KalosMemory``: long-term memory for agents, with an API that mem0 users will recognise.

Layout in the sidecar (one collection = two namespaces; document it to your operators):

* ``memory/<collection>``: one row per memory. id: a UUID; text: the memory; vector: its
  embedding; metadata: your metadata plus the scope keys ``user_id``/``agent_id``/``run_id``
  (and ``role``/``actor_id`` for memories that came from chat messages). Those five keys are
  reserved: metadata that uses them is refused, so nobody can file a memory under someone
  else's scope.
* ``memory-history/<collection>``: one row per ADD/UPDATE/DELETE event (vector-only, a fixed
  placeholder vector; never searched by similarity). With ``--data-dir`` the history is as
  durable as the memories.

Scoping: every call that reads or writes by scope needs at least one of ``user_id``,
``agent_id``, ``run_id``; the scope becomes equality conditions AND-ed with your ``filters`` and
evaluated in the sidecar, so no filter can widen it: ``search(user_id="bob", filters={"$or":
[{"user_id": "alice"}, ...]})`` still only sees bob's memories. As in mem0, a scope names only
what it names: ``search(agent_id="planner")`` sees that agent's memories of every user.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import secrets
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np

from . import _aio
from .client import KalosClient
from .degrade import Degrader, time_left
from .embeddings import Embedder
from .errors import KalosError
from .results import Hit, Record

__all__ = ["RESERVED_KEYS", "SCOPE_KEYS", "Embedder", "KalosMemory"]

SCOPE_KEYS: tuple[str, ...] = ("user_id", "agent_id", "run_id")
#: Metadata keys KalosMemory sets itself; user metadata may not use them.
RESERVED_KEYS = frozenset({*SCOPE_KEYS, "role", "actor_id"})
_PAGE = 1000
_MEM0_OPS = {
    "eq": "$eq", "ne": "$ne", "gt": "$gt", "gte": "$gte", "lt": "$lt", "lte": "$lte",
    "in": "$in", "nin": "$nin", "contains": "$like", "icontains": "$ilike",
}  # fmt: skip
_ROLES = {"human": "user", "ai": "assistant", "tool": "tool", "system": "system"}


class KalosMemory:
    """Agent memory on a Kalos sidecar: add, search, update, delete, with a history.

    Setup:
        A sidecar with ``--dim`` equal to your embedding model's, and ``--data-dir`` so that
        memories and their history survive restarts::

            kalos-sidecar serve --name agent-mem --dim 384 --data-dir ./kalos-data

    Instantiate:
        .. code-block:: python

            from kalos_retrievers.memory import KalosMemory

            memory = KalosMemory("agent-mem", embedding=embeddings)  # LangChain or LlamaIndex

    Add:
        .. code-block:: python

            memory.add("Prefers window seats", user_id="alice", metadata={"topic": "travel"})
            memory.add([{"role": "user", "content": "I'm vegetarian"},
                        {"role": "assistant", "content": "Noted!"}], user_id="alice")
            # -> [{"id": "...", "memory": "I'm vegetarian", "event": "ADD"}, ...]

        Each message (a string, a ``{"role", "content"}`` dict, or a LangChain/LlamaIndex chat
        message) becomes one memory; system messages and empty ones are skipped. Kalos stores
        what you give it: to distil facts first, run your LLM and add its output.

    Search:
        .. code-block:: python

            memory.search("what does alice eat?", user_id="alice", limit=3)
            # -> [{"id", "memory", "score", "metadata", "created_at", "updated_at",
            #      "user_id", ...}, ...]   best first; score: raw similarity
            memory.search("trips", user_id="alice", filters={"topic": "travel"})
            memory.search("trips", filters={"user_id": "alice", "year": {"gte": 2024}})

        ``filters`` takes the Kalos filter language (``{"year": {"$gte": 2024}}``, ``$or``, ...)
        and mem0's spelling (``{"year": {"gte": 2024}}``, ``AND``/``OR``/``NOT``,
        ``contains``/``icontains`` for substrings, ``"*"`` for "present").

    Manage:
        ``get(id)``, ``get_all(user_id=...)``, ``update(id, "new text")``, ``delete(id)``,
        ``delete_all(user_id=...)``, ``history(id)`` (ADD/UPDATE/DELETE events, oldest first),
        ``reset()`` (everything, history included). ``get``/``update``/``delete`` take an
        optional scope too: ``get(id, user_id="bob")`` is None for a memory of alice's.

    Async:
        ``aadd``, ``asearch`` and ``aupdate`` embed with the model's async API; they and
        ``aget``, ``aget_all``, ``adelete``, ``adelete_all``, ``ahistory``, ``areset`` run
        the shared-memory calls in a worker thread of the client's, off the event loop.

    Timeouts:
        ``search``/``asearch`` return ``[]`` within ``timeout`` seconds while the sidecar is
        absent, killed, paused or too slow: one warning per outage, counted in
        ``memory.degrader``; ``on_error="raise"`` raises instead. Writes and management calls
        always raise (a memory silently not written is worse than an error); an error from
        ``add`` says what it stored (``e.ids``, ``e.committed``, as ``KalosClient.upsert``).

    Args:
        name: the sidecar's ``--name``.
        embedding: LangChain ``Embeddings`` or LlamaIndex ``BaseEmbedding``.
        collection: which memory collection of that sidecar (several apps can share one).
        timeout: deadline of a search in seconds (all the sidecar calls it makes), also with
            ``client=``; every other call has the client's (without ``client=``: this one;
            default 2 s).
        on_error: ``"empty"`` (search degrades) or ``"raise"``.
        client: an existing :class:`~kalos_retrievers.KalosClient` to share.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        embedding: Any,
        collection: str = "memories",
        timeout: float | None = None,
        on_error: Literal["empty", "raise"] = "empty",
        client: KalosClient | None = None,
    ) -> None:
        if client is None:
            if name is None:
                raise ValueError("KalosMemory needs the sidecar's name (or a client=)")
            client = KalosClient(name, timeout=2.0 if timeout is None else timeout, lazy=True)
        if timeout is not None and not (isinstance(timeout, int | float) and 0 < timeout < 1e9):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or None")
        if not isinstance(collection, str) or not collection:
            raise ValueError("collection must be a non-empty string")
        self.client = client
        self.timeout: float = client.timeout if timeout is None else float(timeout)
        self.embedder = Embedder(embedding)
        self.collection = collection
        self.namespace = f"memory/{collection}"
        self.history_namespace = f"memory-history/{collection}"
        # update and delete read a memory, then write it and its history event: the threads of
        # one KalosMemory take turns per memory id (striped locks), so an update never brings
        # back a memory another thread deleted, and the history follows the stored order
        self._id_locks = [threading.Lock() for _ in range(64)]
        if len(self.history_namespace.encode("utf-8", "surrogatepass")) > 255:
            raise ValueError("collection is too long: namespaces are limited to 255 bytes")
        self.degrader = Degrader(f"KalosMemory(name={client.name!r}, collection={collection!r})",
                                 on_error)  # fmt: skip

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ add
    def add(
        self,
        messages: Any,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        infer: bool = False,
    ) -> list[dict[str, Any]]:
        """Store each message as a memory in the given scope.

        Args:
            messages: a string, a ``{"role", "content"[, "name"]}`` dict, a chat message
                object, or a list of those.
            user_id, agent_id, run_id: the scope (at least one).
            metadata: JSON-serializable dict stored with each memory (not the reserved keys).
            infer: accepted for mem0 compatibility; only ``False`` (Kalos runs no LLM).

        Returns:
            ``[{"id", "memory", "event": "ADD"}, ...]``, one per stored memory.
        """
        rows = self._prepare_add(messages, _scope(user_id, agent_id, run_id), metadata, infer)
        if not rows:
            return []
        vectors = self.embedder.documents([r[1] for r in rows])
        return self._write_added(rows, vectors)

    async def aadd(
        self,
        messages: Any,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        infer: bool = False,
    ) -> list[dict[str, Any]]:
        """:meth:`add`, embedding asynchronously and writing from a worker thread."""
        rows = self._prepare_add(messages, _scope(user_id, agent_id, run_id), metadata, infer)
        if not rows:
            return []
        vectors = await self.embedder.adocuments([r[1] for r in rows])
        return await _aio.write(self.client, self._write_added, rows, vectors, deadline=self._by())

    @staticmethod
    def _prepare_add(
        messages: Any, scope: dict[str, str], metadata: Mapping[str, Any] | None, infer: bool
    ) -> list[tuple[str, str, dict[str, Any]]]:
        if infer:
            raise ValueError(
                "infer=True needs an LLM to extract facts, and Kalos runs none: extract them "
                "with your LLM and add the results, or pass infer=False"
            )
        base = {**_user_metadata(metadata), **scope}
        rows = []
        items = _messages(messages)
        for mid, (role, actor, text) in zip(_sortable_ids(len(items)), items, strict=True):
            meta = dict(base)
            if role is not None:
                meta["role"] = role
            if actor is not None:
                meta["actor_id"] = actor
            rows.append((mid, text, meta))
        return rows

    def _write_added(
        self, rows: list[tuple[str, str, dict[str, Any]]], vectors: np.ndarray
    ) -> list[dict[str, Any]]:
        history = self._history([_event(r[0], "ADD", None, r[1], r[2]) for r in rows])
        ids = [r[0] for r in rows]
        self.client.upsert(ids, vectors, [r[1] for r in rows], [r[2] for r in rows],
                           namespace=self.namespace)  # fmt: skip
        try:
            self._record(history)
        except KalosError as e:  # the memories are stored (their history is not)
            e.ids, e.committed = ids, len(ids)
            raise
        except BaseException as e:  # (Ctrl-C, a timeout decorator's exception: said in the traceback)
            e.add_note(f"KalosMemory.add: the memories {ids} were stored; their ADD history was not")
            raise
        return [{"id": r[0], "memory": r[1], "event": "ADD"} for r in rows]

    # ------------------------------------------------------------------ search
    def search(
        self,
        query: str,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        limit: int = 100,
        threshold: float | None = None,
    ) -> list[dict[str, Any]]:
        """The memories of a scope most similar to ``query``, best first.

        Args:
            query: what to look for.
            user_id, agent_id, run_id: the scope (at least one, here or in ``filters``).
            filters: more conditions on metadata (Kalos or mem0 spelling), AND-ed with the scope.
            limit: most results (and at most the sidecar's ``--max-k``, 1,024 by default).
            threshold: drop results whose score is below it.

        Returns:
            ``[{"id", "memory", "score", "metadata", "created_at", "updated_at", <scope>}]``,
            or ``[]`` while the sidecar is unavailable (see *Timeouts*).
        """
        _check_search(query, limit, threshold)
        flt = self._scoped_filter(user_id, agent_id, run_id, filters)
        vec = self.embedder.query(query)
        return self._recall(vec, flt, limit, threshold, time.monotonic() + self.timeout)

    async def asearch(
        self,
        query: str,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        limit: int = 100,
        threshold: float | None = None,
    ) -> list[dict[str, Any]]:
        """:meth:`search`, embedding asynchronously; the sidecar call runs in a worker thread."""
        _check_search(query, limit, threshold)
        flt = self._scoped_filter(user_id, agent_id, run_id, filters)
        vec = await self.embedder.aquery(query)
        deadline = time.monotonic() + self.timeout  # counts the wait for a thread
        return await _aio.call(self.client, self._recall, vec, flt, limit, threshold, deadline, deadline=deadline,
                               expired=functools.partial(self._failed_search, deadline=deadline))  # fmt: skip

    def _recall(
        self,
        vec: np.ndarray,
        flt: dict[str, Any],
        limit: int,
        threshold: float | None,
        deadline: float,
    ) -> list[dict[str, Any]]:
        try:
            left = time_left(deadline, self.client.name)
            k = min(int(limit), self.client.header.max_k)
            hits = self.client.recall(vec, k, namespace=self.namespace, filter=flt, timeout=left)
        except KalosError as e:
            return self._failed_search(e, deadline)
        self.degrader.succeeded()
        return [_item(h, h.score) for h in hits if threshold is None or h.score >= threshold]

    def _failed_search(self, e: KalosError, deadline: float) -> list[dict[str, Any]]:
        """A search that failed with ``e`` (or whose deadline passed before a worker thread
        took it): no memories where the degrader degrades it, else ``e`` raised."""
        if self.degrader.should_degrade(e, started=deadline - self.timeout):
            return []
        raise e

    # ------------------------------------------------------------------ read and manage
    def get(self, memory_id: str, **scope: str | None) -> dict[str, Any] | None:
        """One memory by id, or None (also None when a given scope does not own it)."""
        rec = self._get(memory_id, scope)
        return None if rec is None else _item(rec)

    def get_all(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """The memories of a scope, oldest first (at most ``limit``)."""
        flt = self._scoped_filter(user_id, agent_id, run_id, filters)
        recs = self.client.scan(namespace=self.namespace, filter=flt, limit=limit)
        return [_item(r) for r in recs]

    def update(
        self,
        memory_id: str,
        data: str,
        *,
        metadata: Mapping[str, Any] | None = None,
        **scope: str | None,
    ) -> dict[str, Any]:
        """Replace a memory's text (re-embedded) and, if given, its metadata; record UPDATE.

        Its scope and ``created_at`` are kept. Returns the updated memory.

        Raises:
            KeyError: no such memory (in the given scope).
        """
        user = self._check_update(memory_id, data, metadata, scope)
        return self._write_update(memory_id, data, user, scope, self.embedder.documents([data]))

    def _check_update(
        self, memory_id: str, data: str, metadata: Mapping[str, Any] | None, scope: Mapping[str, str | None]
    ) -> dict[str, Any] | None:
        """:meth:`update`'s checks before the embedding; the user's metadata (None: keep)."""
        if not isinstance(data, str) or not data.strip():
            raise ValueError("data must be a non-empty string")
        if self._get(memory_id, scope) is None:  # (before paying for the embedding)
            raise KeyError(f"no memory with id {memory_id!r}{_in_scope(scope)}")
        return _user_metadata(metadata) if metadata is not None else None

    def _write_update(
        self, memory_id: str, data: str, user: dict[str, Any] | None, scope: Mapping[str, str | None], vec: Any
    ) -> dict[str, Any]:
        with self._id_lock(memory_id):
            old = self._get(memory_id, scope)  # again: it may have changed or gone meanwhile
            if old is None:
                raise KeyError(f"memory {memory_id!r} was deleted during the update")
            kept = {k: v for k, v in old.metadata.items() if k in RESERVED_KEYS}
            meta = {**(user if user is not None else _strip(old.metadata)), **kept}
            history = self._history([_event(memory_id, "UPDATE", old.text, data, meta)])
            self.client.upsert([memory_id], vec, [data], [meta], namespace=self.namespace)
            self._record(history)
        new = self._get(memory_id, {})
        if new is None:  # deleted by someone else in between
            raise KeyError(f"memory {memory_id!r} was deleted during the update")
        return _item(new)

    def delete(self, memory_id: str, **scope: str | None) -> None:
        """Delete one memory; record DELETE.

        Raises:
            KeyError: no such memory (in the given scope).
        """
        with self._id_lock(memory_id):
            old = self._get(memory_id, scope)
            if old is None:
                raise KeyError(f"no memory with id {memory_id!r}{_in_scope(scope)}")
            history = self._history([_event(memory_id, "DELETE", old.text, None, old.metadata)], fit=True)
            if not self.client.delete([memory_id], namespace=self.namespace):
                # (another process deleted it since the read: its DELETE is recorded there)
                raise KeyError(f"no memory with id {memory_id!r}{_in_scope(scope)}")
            self._record(history)

    def delete_all(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
    ) -> int:
        """Delete every memory of a scope (at least one id); record each; return how many.

        Works a page of memories at a time: where a page is refused (:meth:`delete`'s
        ``ValueError`` for a slot too small for a record), the pages before it stay deleted,
        each with its records. A page's memories are read again under their locks (those
        :meth:`update` and :meth:`delete` take), so within this process an update racing it
        raises ``KeyError`` rather than bringing a memory back, and a memory is recorded
        deleted once."""
        scope = _scope(user_id, agent_id, run_id)
        flt = self._scoped_filter(user_id, agent_id, run_id, None)
        deleted = 0
        while True:
            recs = self.client.scan(namespace=self.namespace, filter=flt, limit=_PAGE)
            if not recs:
                return deleted
            stripes = sorted({self._stripe(r.id) for r in recs})  # (in order: no deadlock)
            with contextlib.ExitStack() as held:
                for s in stripes:
                    held.enter_context(self._id_locks[s])
                # again, under the locks: a memory deleted or moved out of scope meanwhile is
                # not this call's to delete or record
                ids = [r.id for r in recs]
                recs = [r for r in self.client.get(ids, namespace=self.namespace)
                        if all(r.metadata.get(k) == v for k, v in scope.items())]
                if not recs:
                    continue
                history = self._history([_event(r.id, "DELETE", r.text, None, r.metadata) for r in recs], fit=True)
                deleted += self.client.delete([r.id for r in recs], namespace=self.namespace)
                self._record(history)

    def history(self, memory_id: str) -> list[dict[str, Any]]:
        """ADD/UPDATE/DELETE events of one memory, oldest first.

        Each: ``{"id", "memory_id", "event", "old_memory", "new_memory", "created_at",
        "is_deleted", "role", "actor_id"}`` (``created_at``: when the event was recorded).
        """
        if not isinstance(memory_id, str) or not memory_id:
            raise ValueError("memory_id must be a non-empty string")
        recs: list[Record] = []
        flt = {"memory_id": {"$eq": memory_id}}
        while True:
            page = self.client.scan(namespace=self.history_namespace, filter=flt, limit=_PAGE,
                                    offset=len(recs))  # fmt: skip
            recs.extend(page)
            if len(page) < _PAGE:
                break
        recs.sort(key=lambda r: r.id)  # ids sort in the order they were made
        return [{"id": r.id, **r.metadata, "created_at": _iso(r.created_at)} for r in recs]

    def reset(self) -> None:
        """Delete every memory of this collection, and its history."""
        self.client.delete_namespace(self.namespace)
        self.client.delete_namespace(self.history_namespace)

    # ------------------------------------------------------------------ async twins
    # Each runs its sidecar calls in one of the client's worker threads (kalos_retrievers._aio),
    # so a paused sidecar holds a thread of the client's, never the event loop; each takes its
    # deadline (the client's timeout) when it is made, and one still waiting for a thread then
    # raises SidecarTimeout unsent. aupdate embeds with the model's async API.
    async def aget(self, memory_id: str, **scope: str | None) -> dict[str, Any] | None:
        """Async :meth:`get`."""
        return await _aio.call(self.client, functools.partial(self.get, memory_id, **scope), deadline=self._by())

    async def aget_all(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        filters: Mapping[str, Any] | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Async :meth:`get_all`."""
        call = functools.partial(self.get_all, user_id=user_id, agent_id=agent_id, run_id=run_id,
                                 filters=filters, limit=limit)  # fmt: skip
        return await _aio.call(self.client, call, deadline=self._by())

    async def aupdate(
        self,
        memory_id: str,
        data: str,
        *,
        metadata: Mapping[str, Any] | None = None,
        **scope: str | None,
    ) -> dict[str, Any]:
        """Async :meth:`update` (the text embedded with the model's async API)."""
        user = await _aio.call(self.client, self._check_update, memory_id, data, metadata, scope, deadline=self._by())
        vec = await self.embedder.adocuments([data])
        return await _aio.write(self.client, self._write_update, memory_id, data, user, scope, vec,
                                deadline=self._by())  # fmt: skip

    async def adelete(self, memory_id: str, **scope: str | None) -> None:
        """Async :meth:`delete`."""
        await _aio.write(self.client, functools.partial(self.delete, memory_id, **scope), deadline=self._by())

    async def adelete_all(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
    ) -> int:
        """Async :meth:`delete_all`."""
        call = functools.partial(self.delete_all, user_id=user_id, agent_id=agent_id, run_id=run_id)
        return await _aio.write(self.client, call, deadline=self._by())

    async def ahistory(self, memory_id: str) -> list[dict[str, Any]]:
        """Async :meth:`history`."""
        return await _aio.call(self.client, self.history, memory_id, deadline=self._by())

    async def areset(self) -> None:
        """Async :meth:`reset`."""
        await _aio.write(self.client, self.reset, deadline=self._by())

    def _by(self) -> float:
        """The deadline of a management call made now (the client's timeout)."""
        return time.monotonic() + self.client.timeout

    # ------------------------------------------------------------------ helpers
    def _id_lock(self, memory_id: str) -> threading.Lock:
        if not isinstance(memory_id, str) or not memory_id:  # (checked before it is hashed)
            raise ValueError("memory_id must be a non-empty string")
        return self._id_locks[self._stripe(memory_id)]

    def _stripe(self, memory_id: str) -> int:
        return hash(memory_id) % len(self._id_locks)

    def _get(self, memory_id: str, scope: Mapping[str, str | None]) -> Record | None:
        if not isinstance(memory_id, str) or not memory_id:
            raise ValueError("memory_id must be a non-empty string")
        wanted = _scope(**_scope_kwargs(scope), required=False)
        recs = self.client.get([memory_id], namespace=self.namespace)
        if not recs:
            return None
        rec = recs[0]
        if any(rec.metadata.get(k) != v for k, v in wanted.items()):
            return None
        return rec

    def _history(
        self, events: list[dict[str, Any]], *, fit: bool = False
    ) -> tuple[list[str], list[dict[str, Any]]]:
        """History rows for ``events``, checked before the write they record is made: an event
        holds the memory's text (an update's, old and new), so it can outgrow a slot the
        memory fits, and a write then refused after the memory was written would leave it
        without its event. ``fit`` (deletes, not refused for their record's size):
        an event that does not fit keeps the start of its ``old_memory`` and is marked
        ``"old_memory_truncated": True``."""
        ids = _sortable_ids(len(events))
        try:
            self.client.check_upsert(len(events), ids, None, events, namespace=self.history_namespace)
        except ValueError as e:
            if not fit:
                raise ValueError(
                    f"{e} (here: a history event, which holds the memory's text, and for an "
                    "update the old text too; nothing was written)"
                ) from None
            events = [self._fitted(ev, id_) for ev, id_ in zip(events, ids, strict=True)]
        return ids, events

    def _fitted(self, event: dict[str, Any], event_id: str) -> dict[str, Any]:
        """``event`` (to be stored as ``event_id``: its size counts), or with its
        ``old_memory`` cut until it fits (to nothing, and then its other fields but the id and
        kind dropped). Raises ValueError, before the memory is deleted, where a slot cannot
        hold even that: no delete is made whose record cannot be."""
        keep = len(event["old_memory"] or "")
        while True:
            try:
                self.client.check_upsert(1, [event_id], None, [event], namespace=self.history_namespace)
                return event
            except ValueError as e:
                if "old_memory" not in event:  # (the least an event can be did not fit)
                    raise ValueError(
                        f"{e} (here: the DELETE event of memory {event['memory_id']!r}, cut to its "
                        f"id and kind: sidecar {self.client.name!r}'s request slot is too small; "
                        f"start it with a larger --payload-kb. {event['memory_id']!r} was not deleted)"
                    ) from None
                if keep == 0 and event.get("old_memory") == "":
                    event = {"memory_id": event["memory_id"], "event": event["event"],
                             "is_deleted": event["is_deleted"], "old_memory_truncated": True}  # fmt: skip
                    continue
                keep //= 2
                event = {**event, "old_memory": (event["old_memory"] or "")[:keep], "old_memory_truncated": True}

    def _record(self, history: tuple[list[str], list[dict[str, Any]]]) -> None:
        ids, events = history
        if not events:
            return
        placeholder = np.zeros((len(events), self.client.dim), np.float32)
        placeholder[:, 0] = 1.0  # history rows are never searched by similarity
        try:
            self.client.upsert(ids, placeholder, None, events, namespace=self.history_namespace)
        except KalosError as e:  # (the events' ids are this store's own, not the caller's)
            e.ids = e.committed = None
            raise

    def _scoped_filter(
        self,
        user_id: str | None,
        agent_id: str | None,
        run_id: str | None,
        filters: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        if filters is not None and not isinstance(filters, Mapping):
            raise TypeError(f"filters must be a dict, got {type(filters).__name__}")
        given = {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}
        origin = {k: f"{k}={v!r}" for k, v in given.items() if v is not None}

        def lift(key: str, value: Any, where: str) -> bool:
            """Take a scope id given in ``filters`` (a plain id, or ``{"eq": id}``)."""
            if key not in SCOPE_KEYS:
                return False
            if isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in ("eq", "$eq"):
                value = next(iter(value.values()))
            if not isinstance(value, str) or value == "*":  # ("*": present, not a scope)
                return False
            if given[key] is not None and given[key] != value:
                raise ValueError(f"{origin[key]} conflicts with {where}={value!r}: one scope per call")
            given[key], origin[key] = value, f"{where}={value!r}"
            return True

        rest: dict[str, Any] = {}
        for key, value in (filters or {}).items():
            if key in ("AND", "$and") and isinstance(value, list | tuple):
                # mem0's newer spelling: {"AND": [{"user_id": "alice"}, ...]}; each entry's
                # scope keys are taken from it, its other conditions kept
                kept = []
                for j, entry in enumerate(value):
                    if isinstance(entry, Mapping):
                        entry = {k: v for k, v in entry.items() if not lift(k, v, f"filters[{key!r}][{j}][{k!r}]")}  # noqa: PLW2901
                        if not entry:
                            continue
                    kept.append(entry)
                if kept or not value:
                    rest[key] = kept if kept else value
            elif not lift(key, value, f"filters[{key!r}]"):
                rest[key] = value
        if all(v is None for v in given.values()):
            raise ValueError(
                "at least one of user_id, agent_id or run_id is required: as an argument, or in "
                "filters as an id ({'user_id': 'alice'} or {'user_id': {'eq': 'alice'}}, at the top "
                "level or in a top-level AND)"
            )
        scope = _scope(**given)  # type: ignore[arg-type]
        parts: list[dict[str, Any]] = [{k: {"$eq": v}} for k, v in scope.items()]
        if rest:
            parts.append(_translate_filter(rest))
        return parts[0] if len(parts) == 1 else {"$and": parts}


# --------------------------------------------------------------------------------------------
# Pure helpers


_id_lock = threading.Lock()
_last_ns = 0


def _sortable_ids(n: int) -> list[str]:
    """``n`` UUID-shaped ids that sort in creation order: 64 bits of time in ns (strictly
    increasing in this process), then 64 random bits. Memories added together then list in the
    order given, and history events in the order they happened."""
    global _last_ns  # noqa: PLW0603 - one clock per process
    with _id_lock:
        start = max(time.time_ns(), _last_ns + 1)
        _last_ns = start + n - 1
    return [str(uuid.UUID(int=((start + i) << 64) | secrets.randbits(64))) for i in range(n)]


def _scope(
    user_id: str | None = None,
    agent_id: str | None = None,
    run_id: str | None = None,
    *,
    required: bool = True,
) -> dict[str, str]:
    scope = {}
    for key, value in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)):
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key} must be a non-empty string, got {value!r}")
        scope[key] = value
    if required and not scope:
        raise ValueError("at least one of user_id, agent_id or run_id is required")
    return scope


def _scope_kwargs(scope: Mapping[str, str | None]) -> dict[str, str | None]:
    unknown = set(scope) - set(SCOPE_KEYS)
    if unknown:
        raise TypeError(f"unexpected arguments {sorted(unknown)}; the scope is {SCOPE_KEYS}")
    return dict(scope)


def _in_scope(scope: Mapping[str, str | None]) -> str:
    given = {k: v for k, v in scope.items() if v is not None}
    return f" in scope {given}" if given else ""


def _user_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    clash = sorted(RESERVED_KEYS & set(metadata))
    if clash:
        raise ValueError(
            f"metadata uses the reserved keys {clash}; pass the scope as user_id=/agent_id=/"
            "run_id= arguments, and rename other keys"
        )
    return dict(metadata)


def _strip(metadata: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metadata.items() if k not in RESERVED_KEYS}


def _messages(messages: Any) -> list[tuple[str | None, str | None, str]]:
    """``(role, actor, text)`` per storable message."""
    if isinstance(messages, bytes | bytearray):
        raise TypeError("messages is bytes; decode it to a str first")
    if isinstance(messages, str | Mapping) or _is_message(messages) or not isinstance(messages, Iterable):
        messages = [messages]  # (a message object is iterable too: pydantic yields its fields)
    out = []
    role: Any
    actor: Any
    content: Any
    for i, m in enumerate(messages):
        if isinstance(m, str):
            role, actor, content = "user", None, m
        elif isinstance(m, Mapping):
            role, actor, content = m.get("role"), m.get("name"), m.get("content")
        elif _is_message(m):
            raw = getattr(m, "role", None) or getattr(m, "type", None)
            role = _ROLES.get(str(getattr(raw, "value", raw)), str(getattr(raw, "value", raw)))
            actor, content = getattr(m, "name", None), m.content
        else:
            raise TypeError(
                f"messages[{i}] is a {type(m).__name__}; pass strings or role/content dicts"
            )
        if content is None:
            continue
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}] content must be text, got {type(content).__name__}")
        if role == "system" or not content.strip():
            continue
        out.append((_opt_str(role), _opt_str(actor), content))
    return out


def _is_message(m: Any) -> bool:
    """A chat message object: LangChain's ``BaseMessage`` (``type``), LlamaIndex's
    ``ChatMessage`` (``role``), or anything else with ``content`` and one of those."""
    return not isinstance(m, str | Mapping) and hasattr(m, "content") and (hasattr(m, "role") or hasattr(m, "type"))


def _opt_str(x: Any) -> str | None:
    return None if x is None else str(x)


def _translate_filter(flt: Mapping[str, Any]) -> dict[str, Any]:
    """mem0's filter spelling -> Kalos's (Kalos's own spelling passes through)."""
    out: dict[str, Any] = {}
    for key, value in flt.items():
        if key in ("AND", "OR", "$and", "$or"):
            if not (isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value)):
                raise ValueError(f"filters[{key!r}] must be a non-empty list of filters, got {value!r}")
            # ("AND" and "$and" in one filter: both hold; "OR" and "$or": two $or that both
            # must hold, so the second goes into an $and)
            _merge(out, "$" + key.lower().lstrip("$"), [_translate_filter(v) for v in value])
        elif key in ("NOT", "$not"):
            subs = value if isinstance(value, list | tuple) else [value]
            if not (subs and all(isinstance(v, Mapping) for v in subs)):
                raise ValueError(f"filters[{key!r}] must be a filter or a non-empty list of filters, got {value!r}")
            any_of = [_translate_filter(v) for v in subs]
            _merge(out, "$not", any_of[0] if len(any_of) == 1 else {"$or": any_of})
        elif isinstance(value, Mapping):
            for op in value:
                if op not in _MEM0_OPS and not str(op).startswith("$"):
                    raise ValueError(
                        f"filters[{key!r}]: unknown operator {op!r}; mem0's are "
                        f"{', '.join(sorted(_MEM0_OPS))}, or Kalos's $-operators ($eq, $in, ...)"
                    )
            ops: dict[str, Any] = {}
            for op, arg in value.items():
                kalos_op = _MEM0_OPS.get(op, op)
                if kalos_op in ops:  # ("lt" beside "$lt": both hold)
                    _merge(out, "$and", [{key: {kalos_op: arg}}])
                else:
                    ops[kalos_op] = arg
            out[key] = ops
        elif value == "*":
            out[key] = {"$exists": True}
        else:
            out[key] = value
    return out


def _merge(out: dict[str, Any], op: str, value: Any) -> None:
    """Put ``{op: value}`` into ``out``; where ``op`` is there already (mem0's ``"AND"`` beside
    Kalos's ``"$and"``), both must hold: ``$and`` lists join, others go into an ``$and``."""
    if op not in out:
        out[op] = value
    elif op == "$and":
        out[op] = [*out[op], *value]
    else:
        out.setdefault("$and", []).append({op: value})


@functools.lru_cache(maxsize=4096)
def _iso(ts: float) -> str:
    """A stored time (POSIX seconds) as ISO 8601 in UTC, as mem0 gives it. Cached: two per
    result, and an agent recalls the same memories again and again; ``isoformat`` took ~2.8 µs
    a call on the development VM, most of a search's result building (session 51)."""
    return datetime.fromtimestamp(ts, UTC).isoformat()


def _check_search(query: Any, limit: Any, threshold: Any) -> None:
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    _check_limit(limit)
    if threshold is not None and (not isinstance(threshold, numbers.Real) or isinstance(threshold, bool)
                                  or math.isnan(threshold)):  # fmt: skip
        raise ValueError(f"threshold={threshold!r} must be a number (a score) or None")


def _check_limit(limit: Any) -> None:
    if not isinstance(limit, numbers.Integral) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"limit={limit!r} must be an int >= 1")


def _item(rec: Record | Hit, score: float | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {"id": rec.id, "memory": rec.text}
    if score is not None:
        item["score"] = score
    item["metadata"] = _strip(rec.metadata)
    item["created_at"] = _iso(rec.created_at)
    item["updated_at"] = _iso(rec.updated_at)
    for key in (*SCOPE_KEYS, "role", "actor_id"):
        if key in rec.metadata:
            item[key] = rec.metadata[key]
    return item


def _event(
    memory_id: str, event: str, old: str | None, new: str | None, meta: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "memory_id": memory_id,
        "event": event,
        "old_memory": old,
        "new_memory": new,
        "is_deleted": event == "DELETE",
        "role": meta.get("role"),
        "actor_id": meta.get("actor_id"),
        **{k: meta[k] for k in SCOPE_KEYS if k in meta},
    }

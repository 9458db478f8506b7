"""``KalosStore``: LangGraph's long-term memory store (``BaseStore``) on a Kalos sidecar.

Needs the ``langgraph`` extra: ``pip install "kalos-retrievers[langgraph]"``.

Layout in the sidecar. A LangGraph namespace ``("users", "alice", "prefs")`` is encoded as
``users.alice.prefs`` (labels joined by ``.``; a ``.`` or ``\\`` inside a label is escaped with
``\\``, although LangGraph itself already refuses labels containing ``.``), and its items live
in two sidecar namespaces:

* ``<prefix>/i/<encoded>``: one row per item. id: the key; metadata: the item's value (so that
  ``filter`` runs in the sidecar); text: bookkeeping (how many vectors the item has, and
  "high": the most its key may have, see ``KalosStore._write_puts``); vector: a fixed placeholder
  (never searched).
* ``<prefix>/v/<encoded>``: one row per embedded text of an item (``index`` fields; a
  ``[*]`` path gives one text per element). id: ``key + "\\x00" + n``; metadata: the value
  again (filters apply to the search itself: the true top-k among matching items).

A sidecar namespace name is limited to 255 bytes, so the encoded namespace is limited to about
245 bytes; keys to 500 bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import json
import operator
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple

import numpy as np
from langchain_core.embeddings import Embeddings

try:
    import langgraph.store.base  # noqa: F401
except ImportError as e:  # (the one optional dependency of this module)
    raise ImportError(
        f"kalos_retrievers.langgraph needs LangGraph ({e}): pip install "
        "'kalos-retrievers[langgraph]' (or '.[langgraph]' in a Kalos checkout)"
    ) from e
from langgraph.store.base import (
    BaseStore,
    GetOp,
    IndexConfig,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    ensure_embeddings,
    get_text_at_path,
    tokenize_path,
)

from . import _aio
from .client import KalosClient, as_stored
from .degrade import Degrader
from .embeddings import Embedder
from .errors import KalosError, RequestRejected, SidecarTimeout
from .filters import matches, validate_filter
from .protocol import JSON_CONVERTED, json_value
from .results import Record

__all__ = ["KalosStore", "decode_namespace", "encode_namespace"]

_PAGE = 500
_PAGE_MAX = 10_000  # items a search's scan asks for at once
_MAX_KEY_BYTES = 500
_SIDECAR_OPS = frozenset({"$eq", "$ne", "$gt", "$gte", "$lt", "$lte"})
_LIST_OPS = frozenset({"$in", "$nin"})  # an extension: InMemoryStore refuses them
_OPS = _SIDECAR_OPS | _LIST_OPS
_Key = tuple[tuple[str, ...], str]


def encode_namespace(namespace: Sequence[str]) -> str:
    """``("a", "b.c")`` -> ``a.b\\.c``: labels joined by ``.``, ``\\`` and ``.`` escaped."""
    return ".".join(label.replace("\\", "\\\\").replace(".", "\\.") for label in namespace)


def decode_namespace(encoded: str) -> tuple[str, ...]:
    """Inverse of :func:`encode_namespace`."""
    labels: list[str] = []
    cur: list[str] = []
    chars = iter(encoded)
    for ch in chars:
        if ch == "\\":
            cur.append(next(chars, "\\"))
        elif ch == ".":
            labels.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    labels.append("".join(cur))
    return tuple(labels)


class _LlamaIndexEmbeddings(Embeddings):
    """A LlamaIndex ``BaseEmbedding`` seen through LangChain's interface."""

    def __init__(self, model: Any) -> None:
        self._e = Embedder(model)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._e.documents(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self._e.query(text).tolist()

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return (await self._e.adocuments(texts)).tolist()

    async def aembed_query(self, text: str) -> list[float]:
        return (await self._e.aquery(text)).tolist()


class KalosStore(BaseStore):
    """LangGraph ``BaseStore`` backed by Kalos: long-term memory for LangGraph agents.

    Setup:
        ``pip install "kalos-retrievers[langgraph]"`` and a sidecar whose ``--dim`` is your
        embedding model's (``--data-dir`` to keep memories across restarts)::

            kalos-sidecar serve --name agent-store --dim 384 --data-dir ./kalos-data

    Instantiate:
        .. code-block:: python

            from kalos_retrievers.langgraph import KalosStore

            store = KalosStore("agent-store", index={"dims": 384, "embed": embeddings,
                                                     "fields": ["text"]})

        ``index`` is LangGraph's ``IndexConfig``: ``embed`` a LangChain ``Embeddings``, an
        embedding function (sync or async), a provider string, or a LlamaIndex
        ``BaseEmbedding``; ``fields`` the JSON paths to embed (default ``["$"]``: the whole
        value). Without ``index`` the store is a key-value store with filtered listing.

    Put and get:
        .. code-block:: python

            store.put(("users", "alice"), "prefs", {"text": "likes window seats", "n": 3})
            store.get(("users", "alice"), "prefs").value
            store.put(("users", "alice"), "tmp", {"text": "scratch"}, index=False)  # no vector
            store.delete(("users", "alice"), "tmp")

    Search:
        .. code-block:: python

            store.search(("users", "alice"), query="seating", filter={"n": {"$gte": 2}}, limit=5)
            store.search(("users",), filter={"n": 3})          # every user, no query: oldest first
            store.list_namespaces(prefix=("users",), max_depth=2)

        With a query, results are best first (``SearchItem.score``: raw similarity, the best
        of an item's vectors); items without vectors follow with ``score=None`` when fewer
        than ``limit`` indexed items match, as in LangGraph's ``InMemoryStore``. Filters with
        ``$eq $ne $gt $gte $lt $lte`` or plain values run in the sidecar; equality on nested
        objects or lists is checked in this process on the best candidates. When the
        sidecar's best ``--max-k`` vectors of a namespace hold too few items that pass (a
        selective nested filter, or ``offset + limit`` above ``--max-k``), that namespace's
        matching vectors are read and scored in this process: still exact, but a read of
        the namespace.

    Use in a graph:
        .. code-block:: python

            graph = builder.compile(store=store)   # nodes receive it as `store`

    Async:
        ``aput``/``aget``/``asearch``/... (``abatch``) embed with the embedding's async API and
        run the shared-memory calls in a worker thread.

    Timeouts:
        A search returns ``[]`` within ``timeout`` seconds while the sidecar is absent,
        killed, paused or too slow (one warning per outage, counted in ``store.degrader``;
        ``on_error="raise"`` raises instead), and when its calls outlast it: a search makes
        one or two per namespace under its prefix (0.2-0.4 ms a namespace on a CPU sidecar), so one
        over thousands of namespaces needs a longer ``timeout``. ``get``, ``put``, ``delete`` and
        ``list_namespaces`` raise :class:`~kalos_retrievers.SidecarUnavailable` /
        :class:`~kalos_retrievers.SidecarTimeout`: a missing item and an unreachable one are
        different things. Ops in one ``batch`` run in order; they are not one transaction.

    Args:
        name: the sidecar's ``--name``.
        index: LangGraph ``IndexConfig`` for semantic search (``dims``, ``embed``, ``fields``).
        prefix: prefix of this store's sidecar namespaces (several stores can share a sidecar).
        timeout: deadline of a search in seconds (all the sidecar calls it makes), also with
            ``client=``; every other call has the client's (without ``client=``: this one;
            default 2 s).
        on_error: ``"empty"`` (searches degrade) or ``"raise"``.
        client: an existing :class:`~kalos_retrievers.KalosClient` to share.
    """

    __slots__ = ("_fields", "_put_locks", "client", "degrader", "embeddings", "index_config", "prefix", "timeout")

    def __init__(
        self,
        name: str | None = None,
        *,
        index: IndexConfig | None = None,
        prefix: str = "langgraph",
        timeout: float | None = None,
        on_error: Literal["empty", "raise"] = "empty",
        client: KalosClient | None = None,
    ) -> None:
        if client is None:
            if name is None:
                raise ValueError("KalosStore needs the sidecar's name (or a client=)")
            client = KalosClient(name, timeout=2.0 if timeout is None else timeout, lazy=True)
        if timeout is not None and not (isinstance(timeout, int | float) and 0 < timeout < 1e9):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or None")
        if not prefix or "/" in prefix or len(prefix.encode()) > 32:
            raise ValueError(f"prefix={prefix!r} must be 1-32 bytes without '/'")
        self.client = client
        self.timeout: float = client.timeout if timeout is None else float(timeout)
        self.prefix = prefix
        self.degrader = Degrader(f"KalosStore(name={client.name!r}, prefix={prefix!r})", on_error)
        # A put reads an item's vector count, then writes: the threads of one store take turns
        # per key (two processes putting one key at once can still leave it extra vector rows,
        # which searches skip, see _scored, and which stay: docs/memory.md). Keys share 64 locks:
        # puts of other keys go on meanwhile (one lock for all made every put wait for the one
        # before: 24 puts on a paused sidecar ended 24 timeouts after they began).
        self._put_locks = tuple(threading.Lock() for _ in range(64))
        self.index_config: dict[str, Any] | None = None
        self.embeddings: Embeddings | None = None
        self._fields: list[tuple[str, Any]] = []
        if index:
            self.index_config = dict(index)
            embed = index.get("embed")
            if hasattr(embed, "get_text_embedding_batch"):
                self.embeddings = _LlamaIndexEmbeddings(embed)
            else:
                self.embeddings = ensure_embeddings(embed)
            self._fields = _tokenized(index.get("fields") or ["$"])

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ BaseStore
    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in order and return one result per op."""
        ops = list(ops)
        self._validate(ops)
        docs, queries = self._texts_to_embed(ops)
        doc_vecs, query_vecs = {}, {}
        if self.embeddings is not None:
            if docs:
                doc_vecs = dict(zip(docs, self.embeddings.embed_documents(docs), strict=True))
            query_vecs = {q: self.embeddings.embed_query(q) for q in queries}
        return self._execute(ops, doc_vecs, query_vecs, None)

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch` with async embeddings; the sidecar calls run in a worker thread."""
        ops = list(ops)
        self._validate(ops)
        docs, queries = self._texts_to_embed(ops)
        doc_vecs, query_vecs = {}, {}
        if self.embeddings is not None:
            if docs:
                vecs = await self.embeddings.aembed_documents(docs)
                doc_vecs = dict(zip(docs, vecs, strict=True))
            qv = await asyncio.gather(*(self.embeddings.aembed_query(q) for q in queries))
            query_vecs = dict(zip(queries, qv, strict=True))
        # Searches take their deadline now: it counts the wait for a worker thread.
        deadline = time.monotonic() + self.timeout
        if any(isinstance(op, PutOp) for op in ops):
            return await _aio.write(self.client, self._execute, ops, doc_vecs, query_vecs, deadline, deadline=deadline)
        return await _aio.call(self.client, self._execute, ops, doc_vecs, query_vecs, deadline, deadline=deadline,
                               expired=functools.partial(self._unsent, ops, deadline=deadline))  # fmt: skip

    def _unsent(self, ops: list[Op], e: SidecarTimeout, deadline: float) -> list[Result]:
        """A batch whose deadline passed before a worker thread took it (nothing was sent):
        where it is all searches, each degraded as a search that timed out; else ``e``."""
        if all(isinstance(op, SearchOp) for op in ops) and self.degrader.should_degrade(
            e, started=deadline - self.timeout
        ):
            return [[] for _ in ops]
        raise e

    # ------------------------------------------------------------------ planning
    def _validate(self, ops: list[Op]) -> None:
        # BaseStore's helpers check labels, but ops handed to batch() directly skip them.
        for op in ops:
            if isinstance(op, PutOp):
                _check_labels(op.namespace)
                if not isinstance(op.key, str):
                    raise ValueError(f"key={op.key!r}: KalosStore keys are non-empty strings (InMemoryStore allows '')")
                # a delete: labels only, as BaseStore.delete checks; a key no put could store
                # (an empty or "langgraph" namespace, say) has nothing to delete (_unstorable)
                refusal = self._unstorable(op) if op.value is not None else None
                if refusal is not None:
                    raise refusal
            elif isinstance(op, GetOp):
                _check_labels(op.namespace)
            elif isinstance(op, SearchOp):
                _check_labels(op.namespace_prefix)
            elif isinstance(op, ListNamespacesOp):
                for cond in op.match_conditions or ():
                    _check_labels(cond.path)
            else:
                raise ValueError(f"Unknown operation type: {type(op)}")

    def _paths(self, op: PutOp) -> list[tuple[str, Any]]:
        if self.embeddings is None or op.value is None or op.index is False:
            return []
        return self._fields if op.index is None else _tokenized(op.index)

    def _texts_of(self, op: PutOp) -> list[str]:
        texts: list[str] = []
        for _path, tokens in self._paths(op):
            texts.extend(get_text_at_path(op.value, tokens))
        return texts

    def _texts_to_embed(self, ops: list[Op]) -> tuple[list[str], list[str]]:
        docs: dict[str, None] = {}
        queries: dict[str, None] = {}
        for op in ops:
            if isinstance(op, PutOp):
                docs.update(dict.fromkeys(self._texts_of(op)))
            elif isinstance(op, SearchOp) and op.query and self.embeddings is not None:
                queries[op.query] = None
        return list(docs), list(queries)

    # ------------------------------------------------------------------ execution
    def _execute(
        self,
        ops: list[Op],
        doc_vecs: Mapping[str, Any],
        query_vecs: Mapping[str, Any],
        deadline: float | None,
    ) -> list[Result]:
        results: list[Result] = [None] * len(ops)
        pending: dict[_Key, PutOp] = {}
        for i, op in enumerate(ops):
            if isinstance(op, PutOp):
                if op.value is None and self._unstorable(op) is not None:
                    continue  # (InMemoryStore: a delete of what is not there does nothing)
                pending[(op.namespace, op.key)] = op  # the last put of a key wins
                continue
            if pending:
                self._apply_puts(pending, doc_vecs)
                pending = {}
            if isinstance(op, GetOp):
                results[i] = self._get(op)
            elif isinstance(op, SearchOp):
                qvec = query_vecs.get(op.query or "")
                results[i] = self._guarded_search(op, qvec, deadline)
            elif isinstance(op, ListNamespacesOp):
                results[i] = self._list_namespaces(op)
        if pending:
            self._apply_puts(pending, doc_vecs)
        return results

    def _unstorable(self, op: PutOp) -> Exception | None:
        """Why no put can store ``op``'s key (the error a put raises; a delete of it has
        nothing to do): an empty namespace, one under the reserved root "langgraph", an empty
        key, or a key or namespace too long for Kalos. None: it can."""
        if not op.namespace:
            return InvalidNamespaceError("Namespace cannot be empty.")
        if op.namespace[0] == "langgraph":
            return InvalidNamespaceError(f'Root label for namespace cannot be "langgraph". Got: {op.namespace}')
        try:
            self._names(op.namespace)  # (its length)
        except InvalidNamespaceError as e:
            return e
        if not op.key:
            return ValueError(f"key={op.key!r}: KalosStore keys are non-empty strings (InMemoryStore allows '')")
        if len(op.key.encode("utf-8", "surrogatepass")) > _MAX_KEY_BYTES:
            return ValueError(f"key is longer than {_MAX_KEY_BYTES} bytes: {op.key[:40]!r}...")
        return None

    def _names(self, namespace: tuple[str, ...]) -> tuple[str, str]:
        enc = encode_namespace(namespace)
        items, vecs = f"{self.prefix}/i/{enc}", f"{self.prefix}/v/{enc}"
        if len(items.encode("utf-8", "surrogatepass")) > 255:
            raise InvalidNamespaceError(
                f"namespace {namespace} is too long for Kalos: its encoded form must fit in "
                f"{255 - len(self.prefix) - 3} bytes"
            )
        return items, vecs

    def _placeholders(self, n: int) -> np.ndarray:
        v = np.zeros((n, self.client.dim), np.float32)
        v[:, 0] = 1.0
        return v

    def _apply_puts(self, puts: Mapping[_Key, PutOp], doc_vecs: Mapping[str, Any]) -> None:
        stripes = sorted({hash(key) % len(self._put_locks) for key in puts})  # (in order: no deadlock)
        with contextlib.ExitStack() as held:
            for s in stripes:
                held.enter_context(self._put_locks[s])
            try:
                self._apply_puts_locked(puts, doc_vecs)
            except KalosError as e:  # (the ids of the rows a put writes are this store's own)
                e.ids = e.committed = None
                raise

    def _apply_puts_locked(self, puts: Mapping[_Key, PutOp], doc_vecs: Mapping[str, Any]) -> None:
        by_ns: dict[tuple[str, ...], list[PutOp]] = {}
        for (ns, _key), op in puts.items():
            by_ns.setdefault(ns, []).append(op)
        plans = [self._plan_puts(ns, ops, doc_vecs) for ns, ops in by_ns.items()]  # (every check first)
        if len(plans) > 1:
            # what the client would refuse of the item rows (a value too large for a slot, or
            # not JSON), before any namespace is written (a vector row holds no more than its
            # item's; one namespace's item write checks its rows before sending any)
            for p in plans:
                self.client.check_upsert(len(p.live), [o.key for o in p.live], p.books,
                                         [o.value for o in p.live], namespace=p.items_ns)  # fmt: skip
        for plan in plans:
            self._write_puts(plan)

    def _plan_puts(self, ns: tuple[str, ...], ops: list[PutOp], doc_vecs: Mapping[str, Any]) -> _PutPlan:
        """What the puts (and deletes) of one namespace write: read the items' rows, embed
        nothing (``doc_vecs`` holds every text's vector), check every vector."""
        items_ns, vecs_ns = self._names(ns)
        old = {r.id: r for r in self.client.get([o.key for o in ops], namespace=items_ns)}
        highs = {key: _book_of(r)[1] for key, r in old.items()}
        vec_ids: list[str] = []
        vec_rows: list[Any] = []
        vec_meta: list[Mapping[str, Any]] = []
        live = [o for o in ops if o.value is not None]
        counts: list[int] = []
        for o in live:
            texts = self._texts_of(o)
            counts.append(len(texts))
            for j, t in enumerate(texts):
                vec_ids.append(f"{o.key}\x00{j}")
                vec_rows.append(doc_vecs[t])
                vec_meta.append(o.value)  # type: ignore[arg-type]
        new_counts = dict(zip([o.key for o in live], counts, strict=True))
        stale = [f"{key}\x00{j}" for key, high in highs.items() for j in range(new_counts.get(key, 0), high)]
        vecs = np.empty((0, self.client.dim), np.float32)
        if vec_rows:
            self._check_dims(len(vec_rows[0]))
            vecs = np.asarray(vec_rows, np.float32)
            bad = np.flatnonzero(~np.isfinite(vecs).all(axis=1))
            if len(bad):
                key, j = vec_ids[bad[0]].rsplit("\x00", 1)
                raise ValueError(f"the embedding of text {j} of key {key!r} contains NaN or infinity")
            if self.client.metric == "cosine":
                # a text whose embedding is all zeros (no direction: no cosine) gets no vector
                # row, and any it had is removed; its item is found unscored
                keep = vecs.any(axis=1)
                if not keep.all():
                    stale.extend(i for i, k in zip(vec_ids, keep.tolist(), strict=True) if not k)
                    vec_ids = [i for i, k in zip(vec_ids, keep.tolist(), strict=True) if k]
                    vec_meta = [m for m, k in zip(vec_meta, keep.tolist(), strict=True) if k]
                    vecs = vecs[keep]
        gone = [o.key for o in ops if o.value is None and o.key in old]
        books = [_book(c, max(c, highs.get(o.key, 0))) for o, c in zip(live, counts, strict=True)]
        return _PutPlan(items_ns, vecs_ns, old, highs, live, counts, books, vec_ids, vecs, vec_meta, stale, gone)

    def _write_puts(self, p: _PutPlan) -> None:
        """Write one namespace's puts. An item row records how many vector rows its key may
        have ("high": the most a put of it wrote or began to, until one that removed the
        surplus brings it down). Each write is a separate call, so a process killed between
        two leaves rows; each is below its item's high, and the key's next put or delete
        removes every row from its new count up to the high. Hence the order: the item rows
        (with their new highs) before the vector rows, the stale vector rows before a deleted
        item's row. A write of vector rows that the sidecar refuses before storing any puts
        the items back as they were (but for ``updated_at``); one that may have stored some
        (a timeout, a later chunk refused) leaves the new values, whose highs cover them."""
        keys = [o.key for o in p.live]
        if p.live:
            self.client.upsert(keys, self._placeholders(len(keys)), p.books, [o.value for o in p.live],
                               namespace=p.items_ns)  # fmt: skip
        if len(p.vecs):
            try:
                self.client.upsert(p.vec_ids, p.vecs, None, p.vec_meta, namespace=p.vecs_ns)
            except RequestRejected as e:
                if not e.committed:  # (refused before any chunk was stored)
                    self._put_back(p)
                raise
        if p.stale:
            self.client.delete(p.stale, namespace=p.vecs_ns)
        self._lower_highs(p)
        if p.gone:
            self.client.delete(p.gone, namespace=p.items_ns)

    def _lower_highs(self, p: _PutPlan) -> None:
        """Bring the highs of the items this put shrank down to their counts, the surplus rows
        being gone, so that their later puts delete nothing; only items whose rows are still
        what this put wrote (another process's put of one since then keeps its own high)."""
        down = {o.key: (o, c, book) for o, c, book in zip(p.live, p.counts, p.books, strict=True)
                if p.highs.get(o.key, 0) > c}  # fmt: skip
        if not down:
            return
        now = self.client.get(list(down), namespace=p.items_ns)
        mine = [down[r.id] for r in now if r.text == down[r.id][2] and r.metadata == as_stored(down[r.id][0].value)]
        if mine:
            self.client.upsert([o.key for o, _, _ in mine], self._placeholders(len(mine)),
                               [_book(c, c) for _, c, _ in mine], [o.value for o, _, _ in mine],
                               namespace=p.items_ns)  # fmt: skip

    def _put_back(self, p: _PutPlan) -> None:
        """After the sidecar refused this put's vector rows before storing any: the item rows
        as they were (their highs kept at least this put's), and the items this put made
        removed. Best effort, each part on its own: what it cannot undo, the highs cover."""
        back = [(o, c) for o, c in zip(p.live, p.counts, strict=True) if o.key in p.old]
        if back:
            recs = [p.old[o.key] for o, _ in back]
            books = [_book(_book_of(r)[0], max(c, p.highs[r.id])) for r, (_, c) in zip(recs, back, strict=True)]
            with contextlib.suppress(Exception):
                self.client.upsert([r.id for r in recs], self._placeholders(len(recs)), books,
                                   [r.metadata for r in recs], namespace=p.items_ns)  # fmt: skip
        made = [o.key for o in p.live if o.key not in p.old]
        if made:
            with contextlib.suppress(Exception):
                self.client.delete(made, namespace=p.items_ns)

    def _check_dims(self, n: int) -> None:
        dims = (self.index_config or {}).get("dims")
        if n != self.client.dim or (dims is not None and dims != n):
            raise ValueError(
                f"the embedding model returns {n}-dimensional vectors, index['dims'] is {dims} "
                f"and sidecar {self.client.name!r} stores {self.client.dim}: they must agree"
            )

    def _get(self, op: GetOp) -> Item | None:
        if not op.key:  # (no put can make it)
            return None
        items_ns, _ = self._names(op.namespace)
        recs = self.client.get([op.key], namespace=items_ns)
        return _item(recs[0], op.namespace) if recs else None

    # ------------------------------------------------------------------ search
    def _guarded_search(self, op: SearchOp, qvec: Any, deadline: float | None) -> list[SearchItem]:
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        try:
            out = self._search(op, qvec, deadline)
        except KalosError as e:
            if self.degrader.should_degrade(e, started=deadline - self.timeout):
                return []
            raise
        self.degrader.succeeded()
        return out

    def _left(self, deadline: float) -> float:
        """Seconds left for a search's next sidecar call; none left raises ``SidecarTimeout``
        (transient: the search degrades) saying what the deadline covers."""
        left = deadline - time.monotonic()
        if left > 0:
            return left
        raise SidecarTimeout(
            f"sidecar {self.client.name!r}: a search's deadline ({self.timeout:g} s) passed before "
            "its next sidecar call. A search makes a recall and a read for each namespace under "
            "its prefix, and reads the items of each when it has no query or too few indexed "
            "items match (in abatch its deadline also counts the wait for a worker thread): "
            "give the store a longer timeout=, or search a narrower prefix"
        )

    def _search(self, op: SearchOp, qvec: Any, deadline: float) -> list[SearchItem]:
        """One search; every sidecar call it makes shares ``deadline``."""
        if op.limit <= 0 or op.offset < 0:
            return []
        flt, residual = _split_filter(op.filter)
        spaces = self._matching_spaces(op.namespace_prefix, deadline)
        want = op.offset + op.limit
        found: list[tuple[float | None, tuple[str, ...], Record]] = []
        if qvec is not None:
            found = self._scored(spaces, np.asarray(qvec, np.float32), flt=flt, residual=residual,
                                 want=want, deadline=deadline)  # fmt: skip
        if qvec is None and len(spaces) == 1 and not residual:  # one scan, its offset in the sidecar
            ns, items_ns, _ = spaces[0]
            page = self.client.scan(namespace=items_ns, filter=flt, limit=op.limit, offset=op.offset,
                                    timeout=self._left(deadline))  # fmt: skip
            return [SearchItem(ns, r.id, r.metadata, _dt(r.created_at), _dt(r.updated_at), None) for r in page]
        if len(found) < want:
            # Every indexed match is already in `found`; the rest are items without vectors.
            seen = {(ns, r.id) for _, ns, r in found}
            for ns, rec in self._scan_items(spaces, flt, residual, deadline, page=min(max(want, 64), _PAGE_MAX)):
                if (ns, rec.id) not in seen:
                    found.append((None, ns, rec))
                    if len(found) >= want:
                        break
        return [
            SearchItem(ns, r.id, r.metadata, _dt(r.created_at), _dt(r.updated_at), score)
            for score, ns, r in found[op.offset : want]
        ]

    def _matching_spaces(
        self, prefix: tuple[str, ...], deadline: float
    ) -> list[tuple[tuple[str, ...], str, str]]:
        head = f"{self.prefix}/i/"
        out = []
        # (the encoded prefix selects in the sidecar: a superset, "a.b" also selects "a.bc")
        selector = head + encode_namespace(prefix) if prefix else head
        for name in self.client.namespaces(selector, timeout=self._left(deadline)):
            if name.startswith(head):
                ns = decode_namespace(name[len(head) :])
                if ns[: len(prefix)] == tuple(prefix):
                    out.append((ns, name, f"{self.prefix}/v/{name[len(head) :]}"))
        return sorted(out)

    def _scored(
        self,
        spaces: list[tuple[tuple[str, ...], str, str]],
        qvec: np.ndarray,
        *,
        flt: dict[str, Any] | None,
        residual: dict[str, Any],
        want: int,
        deadline: float,
    ) -> list[tuple[float | None, tuple[str, ...], Record]]:
        """The ``want`` best items of ``spaces`` by their best vector. An item counts only if
        its item row exists and its value (the row's, not the vector rows' copy) passes the
        whole filter: a vector row left by an interrupted write, or by two processes putting
        one key at once, never brings back a deleted item or one that no longer matches."""
        max_k = self.client.header.max_k
        norm = validate_filter(flt)
        best: list[tuple[float, tuple[str, ...], Record]] = []
        for ns, items_ns, vecs_ns in spaces:
            k = min(max_k, want + 1)  # (one vector past the cut: whether it ties with the cut)
            checked: dict[str, Record | None] = {}
            while True:
                res = self.client.recall(qvec, k, namespace=vecs_ns, filter=flt,
                                         timeout=self._left(deadline))  # fmt: skip
                keys: dict[str, float] = {}
                for hit in res:
                    key = hit.id.rsplit("\x00", 1)[0]
                    if key not in keys:
                        keys[key] = hit.score  # hits are best first: the first is the item's max
                new = [key for key in keys if key not in checked]
                if new:
                    got = {r.id: r for r in self.client.get(new, namespace=items_ns, timeout=self._left(deadline))}
                    for key in new:
                        r = got.get(key)
                        checked[key] = r if _passes(r, norm, residual) else None
                found = [(score, ns, checked[key]) for key, score in keys.items() if checked[key] is not None]
                full = len(res) >= k  # (vectors beyond these may match)
                tied = seen = False
                if len(found) >= want:
                    scores = sorted((f[0] for f in found), reverse=True)
                    # the last vector returned scores what the want-th item does: vectors not
                    # returned may too, and which of them a recall returns depends on its k, so
                    # pages cut from recalls of different k would repeat some and skip others
                    tied = full and res[-1].score >= scores[want - 1]
                    seen = len(scores) > want and scores[want] >= scores[want - 1]  # (one is here)
                if (len(found) >= want and not tied) or not full or k >= max_k:
                    break
                k = min(max_k, 4 * k)  # several vectors per item, residual filtering, stale rows, ties
            if full and (len(found) < want or (tied and seen)):
                # more vectors match than one recall may return (--max-k), and too few of their
                # items passed, or a tie at the cut runs past it: the items beyond were
                # neither scored nor known to be absent. (At --max-k, a last vector that
                # scores the cut with no tie among those returned is taken as no tie.)
                found = self._scored_by_scan(ns, items_ns, vecs_ns, qvec, flt, norm, residual, checked,
                                             keys, deadline)  # fmt: skip
            best.extend(found)  # type: ignore[arg-type]
        best.sort(key=lambda t: (-t[0], t[1], t[2].id))  # (ties by namespace and key: stable pages)
        return best[:want]  # type: ignore[return-value]

    def _scored_by_scan(
        self,
        ns: tuple[str, ...],
        items_ns: str,
        vecs_ns: str,
        qvec: np.ndarray,
        flt: dict[str, Any] | None,
        norm: dict[str, Any] | None,
        residual: dict[str, Any],
        checked: dict[str, Record | None],
        recalled: Mapping[str, float],
        deadline: float,
    ) -> list[tuple[float, tuple[str, ...], Record]]:
        """Every matching item of one space by its best vector, scored in this process from
        the space's matching vector rows (read with their vectors, a page at a time): what a
        search needs when the sidecar's top ``--max-k`` vectors hold too few passing items.
        An item the sidecar's recall returned (``recalled``: its best score there) keeps that
        score, so that its place among others is the same on a page that needed no scan (the
        sidecar scores in float32, here in float64)."""
        metric = self.client.metric
        best: dict[str, float] = {}
        offset = 0
        while True:
            rows = self.client.scan(namespace=vecs_ns, filter=flt, limit=_PAGE_MAX, offset=offset,
                                    with_vectors=True, timeout=self._left(deadline))  # fmt: skip
            if rows:
                scores = _similarities(metric, qvec, np.stack([r.vector for r in rows]))
                for r, score in zip(rows, scores.tolist(), strict=True):
                    key = r.id.rsplit("\x00", 1)[0]
                    if score > best.get(key, -np.inf):
                        best[key] = score
            if len(rows) < _PAGE_MAX:
                break
            offset += _PAGE_MAX
        new = [key for key in best if key not in checked]
        for at in range(0, len(new), _PAGE_MAX):
            part = new[at : at + _PAGE_MAX]
            got = {r.id: r for r in self.client.get(part, namespace=items_ns, timeout=self._left(deadline))}
            for key in part:
                r = got.get(key)
                checked[key] = r if _passes(r, norm, residual) else None
        best.update((key, score) for key, score in recalled.items() if key in best)
        return [(score, ns, checked[key]) for key, score in best.items() if checked[key] is not None]  # type: ignore[misc]

    def _scan_items(
        self,
        spaces: list[tuple[tuple[str, ...], str, str]],
        flt: dict[str, Any] | None,
        residual: dict[str, Any],
        deadline: float,
        page: int = _PAGE,
    ) -> Iterator[tuple[tuple[str, ...], Record]]:
        """Matching items of every space, oldest first across spaces (read ``page`` items a
        request: each request sorts its whole space in the sidecar, so a search asks for as
        many as it may show at once)."""

        def one(
            ns: tuple[str, ...], items_ns: str
        ) -> Iterator[tuple[float, tuple[str, ...], str, Record]]:
            offset = 0
            while True:
                rows = self.client.scan(namespace=items_ns, filter=flt, limit=page, offset=offset,
                                        timeout=self._left(deadline))  # fmt: skip
                for r in rows:
                    if _matches(residual, r.metadata):
                        yield (r.created_at, ns, r.id, r)
                if len(rows) < page:
                    return
                offset += page

        streams = [one(ns, items_ns) for ns, items_ns, _ in spaces]
        for _, ns, _, rec in heapq.merge(*streams, key=lambda t: t[:3]):
            yield ns, rec

    # ------------------------------------------------------------------ namespaces
    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        head = f"{self.prefix}/i/"
        spaces = [
            decode_namespace(n[len(head) :]) for n in self.client.namespaces(head) if n.startswith(head)
        ]
        for cond in op.match_conditions or ():
            spaces = [ns for ns in spaces if _does_match(cond, ns)]
        if op.max_depth is not None:
            spaces = sorted({ns[: op.max_depth] for ns in spaces})
        else:
            spaces = sorted(spaces)
        return spaces[op.offset : op.offset + op.limit]


# --------------------------------------------------------------------------------------------
# Pure helpers


def _check_labels(namespace: tuple[str, ...]) -> None:
    for label in namespace:
        if not isinstance(label, str) or not label:
            raise InvalidNamespaceError(f"namespace labels must be non-empty strings: {namespace}")
        if "." in label or "\x00" in label:
            raise InvalidNamespaceError(
                f"namespace label {label!r} contains '.' or NUL, which LangGraph forbids"
            )


def _tokenized(paths: Sequence[str]) -> list[tuple[str, Any]]:
    return [(p, p if p == "$" else tokenize_path(p)) for p in paths]


def _passes(rec: Record | None, norm: dict[str, Any] | None, residual: dict[str, Any]) -> bool:
    """Whether an item row exists and its value passes the whole filter (the sidecar's part,
    normalized, and the part checked here)."""
    return rec is not None and matches(norm, rec.metadata) and _matches(residual, rec.metadata)


def _similarities(metric: str, q: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Raw scores of stored ``vectors`` (rows) against ``q`` as the sidecar computes them
    (higher is better): cosine, inner product, or the negated Euclidean distance. In float64:
    equal to the sidecar's up to its rounding (and its float16 storage, on a GPU)."""
    q64, v64 = q.astype(np.float64).ravel(), vectors.astype(np.float64)
    if metric == "l2":
        return -np.sqrt(((v64 - q64) ** 2).sum(axis=1))
    if metric == "cosine":  # (the sidecar stores unit vectors; normalized again, at no risk)
        q64 = q64 / max(float(np.linalg.norm(q64)), 1e-300)
        v64 = v64 / np.maximum(np.linalg.norm(v64, axis=1, keepdims=True), 1e-300)
    return v64 @ q64


class _PutPlan(NamedTuple):
    """The writes of one namespace's puts and deletes (:meth:`KalosStore._plan_puts`)."""

    items_ns: str
    vecs_ns: str
    old: dict[str, Record]  # the items' rows before
    highs: dict[str, int]  # their highs
    live: list[PutOp]  # puts of a value
    counts: list[int]  # each one's texts
    books: list[str]  # each one's item row's bookkeeping
    vec_ids: list[str]
    vecs: np.ndarray
    vec_meta: list[Mapping[str, Any]]
    stale: list[str]  # vector rows to remove
    gone: list[str]  # items to remove


_MAX_VECTORS = 1 << 24  # (a count above it in an item row's bookkeeping is not one this store wrote)


def _book(vectors: int, high: int) -> str:
    """An item row's bookkeeping text: its key's vector rows, and the most it may have."""
    return json.dumps({"vectors": vectors, "high": high})


def _book_of(rec: Record) -> tuple[int, int]:
    """``(vectors, high)`` of an item row's bookkeeping (rows ``key\x00j``, j below the high).
    Rows an older version wrote have no high: their count is it. A field that is not a count
    reads as the other one, so that a damaged row over-counts rather than under-counts."""
    try:
        book = json.loads(rec.text)
    except (ValueError, TypeError):
        return 0, 0
    if not isinstance(book, dict):
        return 0, 0
    n, high = (v if type(v) is int and 0 <= v <= _MAX_VECTORS else None
               for v in (book.get("vectors"), book.get("high")))  # fmt: skip
    if n is None:
        n = high or 0
    return n, max(n, high or 0)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _item(rec: Record, namespace: tuple[str, ...]) -> Item:
    return Item(value=rec.metadata, key=rec.id, namespace=namespace,
                created_at=_dt(rec.created_at), updated_at=_dt(rec.updated_at))  # fmt: skip


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def _split_filter(flt: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(part the sidecar evaluates, part checked here). Both must hold.

    A missing field reads as ``None``, as in ``InMemoryStore`` (``value.get(key)``): ``{"f":
    None}`` matches items without ``f``, and ``{"f": {"$ne": None}}`` does not. An operator
    other than ``$eq $ne $gt $gte $lt $lte $in $nin`` is refused here, before any call
    (``InMemoryStore`` raises on the first item it compares).

    A date, time or numpy number in it is compared as stored (:func:`_as_filtered`).

    Raises:
        ValueError: an unsupported operator.
    """
    _check_operators(flt or {})
    flt = _as_filtered(flt) if flt else flt
    parts: list[dict[str, Any]] = []
    residual: dict[str, Any] = {}
    for key, cond in (flt or {}).items():
        if key.startswith("$"):
            parts.append({key: cond})  # Kalos's own logical operators, as an extension
        elif _is_scalar(cond):
            parts.append(_sidecar_field(key, {"$eq": cond}))
        elif (
            isinstance(cond, Mapping)
            and cond
            and all(
                (op in _SIDECAR_OPS and _is_scalar(v))
                or (op in _LIST_OPS and isinstance(v, list | tuple) and all(map(_is_scalar, v)))
                for op, v in cond.items()
            )
        ):
            parts.append(_sidecar_field(key, cond))
        else:
            residual[key] = cond
    if not parts:
        return None, residual
    sidecar: dict[str, Any] = {}
    for part in parts:
        if part.keys() & sidecar.keys():  # (two parts on one key: "$or" twice, say)
            return {"$and": parts}, residual
        sidecar.update(part)
    return sidecar, residual


def _as_filtered(v: Any) -> Any:
    """A filter with its dates, times and numpy numbers as values store them (ISO strings,
    Python numbers: :func:`~kalos_retrievers.protocol.json_value`), so that ``{"at": dt}``
    finds the item put with ``{"at": dt}`` (it matched nothing: the stored string against the
    datetime); anything else as it is."""
    if isinstance(v, Mapping):
        return {k: _as_filtered(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_as_filtered(x) for x in v]
    if isinstance(v, JSON_CONVERTED):
        return json_value(v)
    return v


def _sidecar_field(key: str, cond: Mapping[str, Any]) -> dict[str, Any]:
    """One field's conditions in the sidecar's language, a missing field read as ``None``
    (each operator on its own, the clauses AND-ed)."""
    clauses = [_sidecar_clause(key, op, v) for op, v in cond.items()]
    if len(clauses) == 1:
        return clauses[0]
    if all(list(c) == [key] for c in clauses):  # plain conditions of the field: one dict of them
        merged: dict[str, Any] = {}
        for c in clauses:
            if c[key].keys() & merged.keys():
                break
            merged.update(c[key])
        else:
            return {key: merged}
    return {"$and": clauses}


def _sidecar_clause(key: str, op: str, v: Any) -> dict[str, Any]:
    """One operator on one field in the sidecar's language, meaning what ``InMemoryStore``'s
    Python comparison means: a missing field reads as ``None``; ``True == 1`` and ``False ==
    0`` (the sidecar keeps booleans apart from numbers, so each is asked for with its twin);
    a range compares ``float(value)``, so stored booleans take part as 1 and 0."""
    missing = {key: {"$exists": False}}
    if op == "$eq" and v is None:  # null, or no such field
        return {"$or": [{key: None}, missing]}
    if op == "$ne" and v is None:
        return {key: {"$ne": None, "$exists": True}}
    if op in ("$eq", "$ne") and _twin(v) is not None:
        return {key: {"$in" if op == "$eq" else "$nin": [v, _twin(v)]}}
    if op in _LIST_OPS:
        v = [y for x in v for y in (x, _twin(x)) if y is not None or x is None]
    if op == "$in" and None in v:
        others = [x for x in v if x is not None]
        return {"$or": [{key: None}, missing, *([{key: {"$in": others}}] if others else [])]}
    if op == "$nin" and None in v:
        return {key: {"$nin": list(v), "$exists": True}}
    if op in _RANGES and isinstance(v, int | float):
        x = float(v) if isinstance(v, bool) else v
        bools = [b for b in (False, True) if _RANGES[op](float(b), x)]
        clause = {key: {op: x}}
        return {"$or": [clause, {key: {"$in": bools}}]} if bools else clause
    return {key: {op: v}}  # ($ne and $nin of values other than None match a missing field, as here)


_RANGES: dict[str, Any] = {"$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le}


def _twin(v: Any) -> bool | int | None:
    """What Python's ``==`` equates with ``v`` across bool and number (``True`` and ``1``,
    ``False`` and ``0``), or None."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    return None


def _check_operators(flt: Mapping[str, Any]) -> None:
    for key, cond in flt.items():
        if not key.startswith("$") and isinstance(cond, Mapping):
            for op in cond:
                if str(op).startswith("$") and op not in _OPS:
                    raise ValueError(
                        f"Unsupported operator: {op} (filter[{key!r}]); supported: {', '.join(sorted(_OPS))}"
                    )


def _matches(residual: Mapping[str, Any], value: Mapping[str, Any]) -> bool:
    return all(_compare(value.get(k), v) for k, v in residual.items())


def _compare(item_value: Any, filter_value: Any) -> bool:
    """LangGraph's JSONB-like comparison (as ``InMemoryStore``), for what the sidecar cannot do."""
    if isinstance(filter_value, Mapping):
        if any(str(k).startswith("$") for k in filter_value):
            return all(_apply_operator(item_value, op, v) for op, v in filter_value.items())
        if not isinstance(item_value, Mapping):
            return False
        return all(_compare(item_value.get(k), v) for k, v in filter_value.items())
    if isinstance(filter_value, list | tuple):
        return (
            isinstance(item_value, list | tuple)
            and len(item_value) == len(filter_value)
            and all(_compare(a, b) for a, b in zip(item_value, filter_value, strict=True))
        )
    return item_value == filter_value


def _apply_operator(value: Any, op: str, arg: Any) -> bool:
    if op == "$eq":
        return _compare(value, arg)
    if op == "$ne":
        return not _compare(value, arg)
    if op in _LIST_OPS:
        if not isinstance(arg, list | tuple):
            raise ValueError(f"{op} takes a list, got {type(arg).__name__}")
        found = any(_compare(value, a) for a in arg)
        return found if op == "$in" else not found
    if op not in _RANGES:
        raise ValueError(f"Unsupported operator: {op}")
    # the rule of a top-level field's range (_sidecar_clause): numbers with numbers, booleans
    # among them as 1 and 0, strings with strings; any other pair does not match
    if isinstance(arg, int | float) and isinstance(value, int | float):
        return bool(_RANGES[op](value, arg))  # (exact, ints beyond 2**53 too, as in the sidecar)
    if isinstance(arg, str) and isinstance(value, str):
        return bool(_RANGES[op](value, arg))
    return False


def _does_match(cond: MatchCondition, ns: tuple[str, ...]) -> bool:
    path = tuple(cond.path)
    if len(ns) < len(path):
        return False
    if cond.match_type == "prefix":
        pairs = zip(ns, path, strict=False)
    elif cond.match_type == "suffix":
        pairs = zip(reversed(ns), reversed(path), strict=False)
    else:
        raise ValueError(f"Unsupported match type: {cond.match_type}")
    return all(p in ("*", a) for a, p in pairs)

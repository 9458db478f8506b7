"""``KalosVectorStore``: a LlamaIndex vector store served by a Kalos sidecar."""

from __future__ import annotations

import copy
import json
import numbers
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self

import numpy as np
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)

from .. import _aio
from ..client import KalosClient
from ..degrade import Degrader
from ..errors import SidecarTimeout
from ..filters import matches, validate_filter
from ..results import Hit, Record
from .degradation import call_degrading, time_left
from .filters import to_kalos_filter
from .mmr import mmr_select, spread_scores
from .nodes import node_to_row, row_to_node

if TYPE_CHECKING:
    from llama_index.core.base.embeddings.base import BaseEmbedding

    from .retriever import KalosRetriever

__all__ = ["KalosVectorStore"]

_PAGE = 1000  # rows per scan request when listing nodes
_MODES = (VectorStoreQueryMode.DEFAULT, VectorStoreQueryMode.MMR)


def _empty_result() -> VectorStoreQueryResult:
    # nodes=[] rather than None: VectorIndexRetriever rejects a result with neither nodes nor ids.
    return VectorStoreQueryResult(nodes=[], similarities=[], ids=[])


class KalosVectorStore(BasePydanticVectorStore):
    """LlamaIndex vector store whose nodes live in a Kalos sidecar (GPU or CPU).

    Setup:
        Install the package and start a sidecar whose ``--dim`` is your embedding model's::

            pip install kalos-retrievers
            kalos-sidecar serve --name docs --dim 384 --data-dir ./kalos-data

        (or, from Python, ``kalos_retrievers.Sidecar("docs", dim=384).start()``).

    Instantiate:
        .. code-block:: python

            from kalos_retrievers.llama_index import KalosVectorStore

            store = KalosVectorStore("docs")                      # the sidecar's --name
            store = KalosVectorStore("docs", namespace="tenant-7")  # a partition of it

        Building the store never fails because the sidecar is not up yet: it connects on the
        first call, and reconnects by itself after a sidecar restart.

    Add:
        .. code-block:: python

            from llama_index.core import Document, StorageContext, VectorStoreIndex

            storage = StorageContext.from_defaults(vector_store=store)
            index = VectorStoreIndex.from_documents(
                [Document(text="Kalos serves recall from shared memory", doc_id="d1",
                          metadata={"topic": "infra", "year": 2025})],
                storage_context=storage, embed_model=embed_model,
            )
            index.delete_ref_doc("d1")     # -> store.delete("d1"): every node of that document

        ``store.add(nodes)`` takes nodes that already carry an embedding; re-adding a node id
        overwrites it. The node comes back exactly as it went in (metadata, relationships, id).

    Search:
        .. code-block:: python

            from llama_index.core.vector_stores import (
                FilterOperator, MetadataFilter, MetadataFilters, VectorStoreQuery)

            result = store.query(VectorStoreQuery(
                query_embedding=embed_model.get_query_embedding("shared memory"),
                similarity_top_k=3,
                filters=MetadataFilters(filters=[
                    MetadataFilter(key="year", value=2024, operator=FilterOperator.GTE)]),
            ))
            result.nodes, result.similarities, result.ids

        Every ``FilterOperator`` and ``AND``/``OR``/``NOT`` (nested too) runs in the sidecar, and
        the result is the true top-k among matching nodes (see
        :mod:`kalos_retrievers.llama_index.filters`). ``doc_ids``/``node_ids`` restrict the
        search (an empty list means no restriction; ``honor_node_ids=False`` ignores
        ``node_ids``, for an index holding ``IndexNode``s: see Args). ``mode=VectorStoreQueryMode.MMR`` re-ranks
        ``mmr_prefetch_factor * similarity_top_k`` candidates for diversity
        (``mmr_threshold`` in the query or as a keyword, 0.5 by default). Similarities are the
        raw scores: cosine similarity for a cosine sidecar (higher is more similar).

    Use as retriever:
        .. code-block:: python

            index = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
            index.as_retriever(similarity_top_k=5).retrieve("what serves recall?")
            index.as_query_engine(llm=llm).query("what serves recall?")

            # or Kalos's own retriever, with its own degradation counters:
            retriever = store.as_retriever(embed_model, similarity_top_k=5)

    Async:
        ``async_add``, ``adelete``, ``aquery``, ``aget_nodes``, ``adelete_nodes`` and ``aclear``
        run the shared-memory call in a worker thread, so a slow or paused sidecar never blocks
        the event loop.

    Timeouts:
        Each call has a deadline (``timeout`` seconds, 2 by default; an async call's deadline
        includes its wait for a worker thread). When the sidecar is
        absent, killed, paused or too slow, ``query``/``aquery`` return an empty result within
        the deadline, log one warning per outage, count it in ``store.degrader``
        (``degraded_calls``, ``episodes``) and emit a ``KalosDegradedEvent`` to LlamaIndex's
        instrumentation; the first success logs "recovered". ``on_error="raise"`` raises
        instead. Writes and deletes always raise: losing them quietly would be worse.

    Args:
        name: the sidecar's ``--name``.
        namespace: the partition of the sidecar this store uses ('' by default).
        timeout: deadline of each call in seconds, an async call's wait for a worker thread
            included (default: the client's, 2 s for the client the store makes; a write
            larger than one slot sends each of its requests with what was left as it began).
            ``get_nodes`` sends its requests (a page each) with the client's timeout each.
        on_error: ``"empty"`` (degrade queries) or ``"raise"``.
        mmr_prefetch_factor: MMR considers this many times ``similarity_top_k`` candidates.
        honor_node_ids: False: a query's ``node_ids`` are ignored (``doc_ids`` and filters
            still apply). For an index holding ``IndexNode``s or ``ImageNode``s: a store that
            keeps text, as this one does, has only those in the index's ``nodes_dict``, and
            ``VectorStoreIndex.as_retriever()`` passes their ids as ``node_ids``, which
            would restrict every search to them.
        client: an existing :class:`~kalos_retrievers.KalosClient` to share (``name`` is then
            taken from it).
    """

    stores_text: bool = True
    flat_metadata: bool = False
    name: str = Field(frozen=True)  # the client is made for it: a store by another name is a new store
    namespace: str = ""
    timeout: float | None = None
    on_error: Literal["empty", "raise"] = "empty"
    mmr_prefetch_factor: int = 4
    honor_node_ids: bool = True

    _client: KalosClient = PrivateAttr()
    _degrader: Degrader = PrivateAttr()

    def __init__(
        self,
        name: str | None = None,
        *,
        namespace: str = "",
        timeout: float | None = None,
        on_error: Literal["empty", "raise"] = "empty",
        mmr_prefetch_factor: int = 4,
        honor_node_ids: bool = True,
        client: KalosClient | None = None,
        **kwargs: Any,
    ) -> None:
        if client is None and name is None:
            raise ValueError("KalosVectorStore needs the sidecar's name (or a client=)")
        if client is not None:
            name = client.name
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a string ('' is the default one), not {type(namespace).__name__}")
        if len(namespace.encode("utf-8", "surrogatepass")) > 255:
            raise ValueError("namespace is longer than 255 bytes")
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
        if mmr_prefetch_factor < 1:
            raise ValueError(f"mmr_prefetch_factor={mmr_prefetch_factor} must be >= 1")
        if not isinstance(honor_node_ids, bool):
            raise TypeError(f"honor_node_ids must be a bool, not {type(honor_node_ids).__name__}")
        super().__init__(name=name, namespace=namespace, timeout=timeout, on_error=on_error,  # type: ignore[call-arg]
                         mmr_prefetch_factor=mmr_prefetch_factor, honor_node_ids=honor_node_ids,
                         **kwargs)  # fmt: skip
        self._degrader = Degrader(f"KalosVectorStore(name={name!r}, namespace={namespace!r})",
                                  on_error)  # fmt: skip
        if client is None:
            client = KalosClient(name, timeout=timeout or 2.0, lazy=True)  # type: ignore[arg-type]
        self._client = client

    @classmethod
    def class_name(cls) -> str:
        return "KalosVectorStore"

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Self:
        """A copy with the same settings on the same client (a connection, shared as a copied
        object shares a database engine), degradation counted anew. (Pickling, LlamaIndex's
        own way, makes a lazy client by name when loaded.)"""
        fields = {k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != "name"}
        return type(self)(client=self._client, **fields)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """Pydantic's copy; one whose ``update`` changes ``name`` is a new store with a client of its
        own for that sidecar (a plain copy would keep talking to the old one)."""
        if update and "name" in update and update["name"] != self.name:
            fields = {k: v for k, v in self.__dict__.items() if k != "name"}
            return type(self)(**(copy.deepcopy(fields) if deep else fields) | dict(update))
        return super().model_copy(update=update, deep=deep)

    @property
    def client(self) -> KalosClient:
        """The :class:`~kalos_retrievers.KalosClient` this store talks through."""
        return self._client

    @property
    def degrader(self) -> Degrader:
        """Counters of degraded :meth:`query` calls: ``degraded_calls``, ``episodes``..."""
        return self._degrader

    def as_retriever(
        self, embed_model: BaseEmbedding | None = None, **kwargs: Any
    ) -> KalosRetriever:
        """A :class:`~kalos_retrievers.llama_index.KalosRetriever` over this store."""
        from .retriever import KalosRetriever

        return KalosRetriever(self, embed_model, **kwargs)

    def close(self) -> None:
        """Release the client's shared-memory slots."""
        self._client.close()

    # ------------------------------------------------------------------ writes
    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        """Store nodes (with their embeddings); return their ids. An existing id is overwritten.

        Raises:
            ValueError: a node has no embedding, or one of another dimension than the
                sidecar's, with NaN or infinity, or all zeros (cosine), or metadata that is not
                JSON, or text and metadata too large for a slot: nothing is stored.
            SidecarUnavailable, SidecarTimeout: the write did not happen, or (a write larger
                than one slot) only its first chunks did; never degraded.
        """
        return self._add(nodes, self._deadline())

    def _add(self, nodes: Sequence[BaseNode], deadline: float) -> list[str]:
        rows = [node_to_row(node, f"nodes[{i}]") for i, node in enumerate(nodes)]
        if not rows:
            return []
        vectors = _embeddings(rows, self._client.dim, self._client.metric == "cosine")
        # One upsert: the client checks every row before it sends any (a refused node leaves
        # nothing stored), a node without text is a vector-only row (None), and of duplicate
        # ids the last is kept, as when they are added one at a time.
        try:
            self._client.upsert([r[0] for r in rows], vectors, [r[2] or None for r in rows],
                                [r[3] for r in rows], namespace=self.namespace,
                                timeout=time_left(deadline, self.name))  # fmt: skip
        except (ValueError, TypeError) as e:
            raise _naming_node(e, rows) from None
        return [r[0] for r in rows]

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete every node whose ``ref_doc_id`` is ``ref_doc_id``."""
        self._delete(ref_doc_id, self._deadline())

    def _delete(self, ref_doc_id: str, deadline: float) -> None:
        self._client.delete(namespace=self.namespace, filter={"ref_doc_id": {"$eq": ref_doc_id}},
                            timeout=time_left(deadline, self.name))  # fmt: skip

    def delete_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
        **delete_kwargs: Any,
    ) -> None:
        """Delete the nodes with these ids and/or matching these filters (both: the intersection).

        ``node_ids=[]`` deletes nothing. Raises ``ValueError`` when neither is given: use
        :meth:`clear` to empty the store.
        """
        self._delete_nodes(node_ids, filters, self._deadline())

    def _delete_nodes(self, node_ids: list[str] | None, filters: MetadataFilters | None, deadline: float) -> None:
        if node_ids is None and filters is None:
            raise ValueError("delete_nodes() needs node_ids or filters; use clear() to delete all")
        if node_ids is not None and len(node_ids) == 0:
            return
        flt = to_kalos_filter(filters)
        if node_ids is None and flt is None:
            raise ValueError("delete_nodes(filters=...) got no filter; use clear() to delete all")
        self._client.delete(node_ids, namespace=self.namespace, filter=flt, timeout=time_left(deadline, self.name))

    def clear(self) -> None:
        """Delete every node of this store's namespace."""
        self._clear(self._deadline())

    def _clear(self, deadline: float) -> None:
        self._client.delete_namespace(self.namespace, timeout=time_left(deadline, self.name))

    # ------------------------------------------------------------------ reads
    def get_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
    ) -> list[BaseNode]:
        """Nodes by id (in that order; missing ids skipped) and/or by filter (oldest first).

        With neither, every node of the namespace. ``node_ids=[]`` returns ``[]``.
        """
        if node_ids is not None and len(node_ids) == 0:
            return []
        records: list[Record]
        if node_ids is not None:
            # by row id (rows written other than by LlamaIndex have no _node_id to filter on),
            # then the filter, checked here with the sidecar's own semantics
            records = self._client.get(list(dict.fromkeys(node_ids)), namespace=self.namespace)
            flt = validate_filter(to_kalos_filter(filters))
            records = [r for r in records if matches(flt, r.metadata)]
        else:
            records = self._scan(to_kalos_filter(filters))
        return [row_to_node(r.text, r.metadata, r.id) for r in records]

    def _scan(self, flt: dict[str, Any] | None) -> list[Record]:
        out: list[Record] = []
        while True:
            page = self._client.scan(
                namespace=self.namespace, filter=flt, limit=_PAGE, offset=len(out)
            )
            out.extend(page)
            if len(page) < _PAGE:
                return out

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """The ``similarity_top_k`` nodes most similar to ``query.query_embedding``.

        Keyword ``mmr_threshold`` (as ``VectorIndexRetriever`` passes its
        ``vector_store_kwargs``) overrides ``query.mmr_threshold`` in MMR mode.

        Returns:
            nodes, similarities (raw scores, best first; MMR: in MMR order) and ids; an empty
            result when the sidecar is unavailable or too slow (see *Timeouts* above).

        Raises:
            ValueError: no query embedding, an unsupported mode or filter.
        """
        return self._guarded_query(query, self._deadline(), kwargs)

    def _guarded_query(
        self, query: VectorStoreQuery, deadline: float, kwargs: dict[str, Any]
    ) -> VectorStoreQueryResult:
        return call_degrading(
            self._degrader, lambda: self._query(query, deadline, **kwargs), _empty_result, self.on_error
        )

    def _deadline(self, timeout: float | None = None) -> float:
        """The ``time.monotonic()`` deadline of a call starting now."""
        if timeout is None:
            timeout = self.timeout if self.timeout is not None else self._client.timeout
        return time.monotonic() + timeout

    def _query(
        self, query: VectorStoreQuery, deadline: float, **kwargs: Any
    ) -> VectorStoreQueryResult:
        """:meth:`query` without degradation (raises what the client raises)."""
        if query.mode not in _MODES:  # (a plain string passes VectorStoreQuery unconverted)
            raise ValueError(
                f"KalosVectorStore supports the query modes 'default' and 'mmr', not "
                f"{getattr(query.mode, 'value', query.mode)!r}"
            )
        if query.query_embedding is None:
            raise ValueError("VectorStoreQuery.query_embedding is None; embed the query first")
        k = query.similarity_top_k
        if type(k) is not int and (not isinstance(k, numbers.Integral) or isinstance(k, bool)):  # (int: no ABC check)
            raise ValueError(f"similarity_top_k={k!r} must be an int (0 or less: no nodes)")
        if k <= 0:
            return _empty_result()
        max_k = self._client.header.max_k
        if k > max_k:
            raise ValueError(
                f"similarity_top_k={k} is above sidecar {self.name!r}'s --max-k {max_k}; ask for "
                "fewer, or start the sidecar with a larger --max-k"
            )
        q = np.asarray(query.query_embedding, dtype=np.float32)
        mmr = query.mode == VectorStoreQueryMode.MMR
        fetch = min(max_k, k * self.mmr_prefetch_factor) if mmr else k
        hits: list[Hit] = []
        node_ids = query.node_ids if self.honor_node_ids else None
        budget = self._id_bytes() // (2 if node_ids and query.doc_ids else 1)
        pieces = [(n, d) for n in _id_pieces(node_ids, budget, "node_ids")
                  for d in _id_pieces(query.doc_ids, budget, "doc_ids")]  # fmt: skip
        # node_ids and doc_ids restrict the search inside the sidecar as a filter; a list longer
        # than a request holds (VectorStoreIndex.as_retriever passes every node id of an index
        # that keeps its nodes) is searched in pieces (each piece of one with each of the
        # other: together they cover every node both allow) whose best rows are merged: still
        # exact, since the best rows of the whole are among the best of the pieces.
        for node_piece, doc_piece in pieces:
            flt = to_kalos_filter(query.filters, node_ids=node_piece, doc_ids=doc_piece)
            hits += self._client.recall(q, fetch, namespace=self.namespace, filter=flt,
                                        with_vectors=mmr, timeout=time_left(deadline, self.name))  # fmt: skip
        if len(pieces) > 1:  # best first, each id once (an id may be in two pieces)
            best: dict[str, Hit] = {}
            for h in sorted(hits, key=lambda h: -h.score):
                best.setdefault(h.id, h)
            hits = list(best.values())[:fetch]
        if mmr and hits:
            threshold = kwargs.get("mmr_threshold", query.mmr_threshold)
            vectors = np.asarray([h.vector for h in hits], dtype=np.float32).reshape(len(hits), -1)
            rel = None
            if self._client.metric != "cosine":  # (rank by the sidecar's own scores, on cosine's scale)
                rel = spread_scores(np.array([h.score for h in hits], dtype=np.float64))
            order = mmr_select(q, vectors, k, 0.5 if threshold is None else float(threshold), rel)
            hits = [hits[i] for i in order]
        return VectorStoreQueryResult(
            nodes=[row_to_node(h.text, h.metadata, h.id) for h in hits],
            similarities=[h.score for h in hits],
            ids=[h.id for h in hits],
        )

    def _id_bytes(self) -> int:
        """How many bytes of ids one recall request carries: half of what a slot's payload
        leaves beside the query (the rest for the other filters), shared by ``node_ids`` and
        ``doc_ids`` when a query has both."""
        return (self._client.header.layout.payload_size - 4 * self._client.dim) // 2

    # ------------------------------------------------------------------ async twins
    # The client waits on shared memory and semaphores; a thread of the client's keeps that wait
    # (up to the deadline, when the sidecar is paused) off the event loop (kalos_retrievers._aio).
    # Each takes a deadline when it is made: one that waits out the store's timeout for a
    # worker thread (all held by calls of their own) is not sent (queries degrade, the others
    # raise SidecarTimeout).
    async def async_add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        deadline = self._deadline()
        return await _aio.write(self._client, self._add, nodes, deadline, deadline=deadline)

    async def adelete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        deadline = self._deadline()
        await _aio.write(self._client, self._delete, ref_doc_id, deadline, deadline=deadline)

    async def adelete_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
        **delete_kwargs: Any,
    ) -> None:
        deadline = self._deadline()
        await _aio.write(self._client, self._delete_nodes, node_ids, filters, deadline, deadline=deadline)

    async def aclear(self) -> None:
        deadline = self._deadline()
        await _aio.write(self._client, self._clear, deadline, deadline=deadline)

    async def aget_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
    ) -> list[BaseNode]:
        return await _aio.call(self._client, self.get_nodes, node_ids, filters, deadline=self._deadline())

    async def aquery(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        deadline = self._deadline()  # counts the wait for a worker thread
        return await _aio.call(self._client, self._guarded_query, query, deadline, kwargs, deadline=deadline,
                               expired=self._unsent_query)  # fmt: skip

    def _unsent_query(self, e: SidecarTimeout) -> VectorStoreQueryResult:
        """A query whose deadline passed before a worker thread took it: degraded as one
        that timed out (or ``e`` raised, with ``on_error="raise"``)."""
        return call_degrading(self._degrader, _aio.raising(e), _empty_result, self.on_error)


def _id_pieces(ids: Sequence[str] | None, budget: int, what: str = "node_ids") -> list[Sequence[str] | None]:
    """``ids`` cut into pieces of at most ``budget`` bytes as JSON (``[None]``: no ids)."""
    if not ids:
        return [None]
    if isinstance(ids, str):
        raise TypeError(f"{what} must be a list of strings, not one string")
    ids = list(ids)
    if all(type(i) is str for i in ids) and len(json.dumps(ids, separators=(",", ":"))) + 1 <= budget:
        return [ids]  # (one C call for the common case: all of them fit; the loop counts the same)
    pieces: list[Sequence[str] | None] = []
    start, size = 0, 2
    for i, node_id in enumerate(ids):
        n = len(json.dumps(str(node_id))) + 1
        if size + n > budget and i > start:
            pieces.append(ids[start:i])
            start, size = i, 2
        size += n
    pieces.append(ids[start:])
    return pieces


# how the client's checks name a row of a write (before anything is sent)
_ENTRY = re.compile(r"^(?:ids|texts|metadatas|texts/metadatas)\[(\d+)\]")


def _naming_node(e: Exception, rows: list[tuple[str, list[float], str, dict[str, Any]]]) -> Exception:
    """The client's refusal of ``rows[i]`` (``metadatas[i] ...``) as one that names the node
    as the other checks of :meth:`KalosVectorStore.add` do: ``nodes[i] (id 'x'): ...``."""
    m = _ENTRY.match(str(e))
    if m is None or type(e) not in (ValueError, TypeError) or int(m.group(1)) >= len(rows):
        return e
    i = int(m.group(1))
    return type(e)(f"nodes[{i}] (id {rows[i][0]!r}): {e}")


def _embeddings(rows: list[tuple[str, list[float], str, dict[str, Any]]], dim: int,
                cosine: bool) -> np.ndarray:  # fmt: skip
    """The rows' embeddings as one float32 matrix, each checked, errors naming the node."""
    for i, (node_id, vector, _, _) in enumerate(rows):
        if len(vector) != dim:
            raise ValueError(
                f"nodes[{i}] (id {node_id!r}) has a {len(vector)}-dimensional embedding, but "
                f"the sidecar stores {dim}-dimensional ones: embed with a {dim}-dimensional model"
            )
    vectors = np.asarray([r[1] for r in rows], dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"nodes[{i}] (id {rows[i][0]!r}) has an embedding with NaN or infinity")
    if cosine:
        zero = np.flatnonzero(~vectors.any(axis=1))
        if len(zero):
            i = int(zero[0])
            raise ValueError(
                f"nodes[{i}] (id {rows[i][0]!r}) has an all-zero embedding: it has no direction, "
                "so its cosine similarity is undefined; leave it out or use the 'ip' or 'l2' metric"
            )
    return vectors

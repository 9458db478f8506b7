"""``KalosRetriever``: a LlamaIndex retriever over a :class:`KalosVectorStore`."""

from __future__ import annotations

import numbers
from typing import Any, Literal

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.settings import Settings
from llama_index.core.vector_stores.types import (
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)

from .. import _aio
from ..degrade import Degrader
from ..errors import SidecarTimeout
from .degradation import call_degrading
from .vector_store import KalosVectorStore

__all__ = ["KalosRetriever"]


class KalosRetriever(BaseRetriever):
    """Retrieve nodes from Kalos; returns nothing, quickly, when the sidecar is not there.

    Setup:
        A sidecar and a :class:`KalosVectorStore` holding your nodes (see its docstring).

    Instantiate:
        .. code-block:: python

            from kalos_retrievers.llama_index import KalosRetriever, KalosVectorStore

            store = KalosVectorStore("docs")
            retriever = KalosRetriever(store, embed_model, similarity_top_k=4)
            # or: retriever = store.as_retriever(embed_model, similarity_top_k=4)

    Search:
        .. code-block:: python

            for hit in retriever.retrieve("how is recall served?"):
                print(hit.score, hit.node.get_content())

        ``filters`` (LlamaIndex ``MetadataFilters``), ``doc_ids``/``node_ids`` and
        ``vector_store_query_mode="mmr"`` (with ``mmr_threshold``) work as in
        :meth:`KalosVectorStore.query`. Scores are the raw similarities.

    Use in a query engine:
        .. code-block:: python

            from llama_index.core.query_engine import RetrieverQueryEngine

            engine = RetrieverQueryEngine.from_args(retriever, llm=llm)
            engine.query("how is recall served?")

    Async:
        ``await retriever.aretrieve(...)`` embeds with the model's async API and runs the
        shared-memory call in a worker thread: the event loop is never blocked.

    Timeouts:
        When the sidecar is absent, killed, paused or slower than ``timeout`` (default: the
        store's), ``retrieve`` returns ``[]`` within that deadline instead of raising (for
        ``aretrieve``, the deadline includes the wait for a worker thread, so a hundred
        concurrent calls on a paused sidecar all end after about one timeout). The
        first failure of an outage logs one WARNING, later ones DEBUG; ``retriever.degrader``
        counts them (``degraded_calls``, ``episodes``); each emits a ``KalosDegradedEvent``. The
        client reconnects by itself, so retrieval recovers without any call from you.
        ``on_error="raise"`` raises :class:`~kalos_retrievers.SidecarUnavailable` /
        :class:`~kalos_retrievers.SidecarTimeout` instead. Errors that mean a bug or a
        misconfiguration (bad filter, wrong dimension) always raise.

    Args:
        vector_store: the store to search.
        embed_model: embeds queries; None: ``llama_index.core.Settings.embed_model``, resolved
            at the first query.
        similarity_top_k: how many nodes to return.
        filters, node_ids, doc_ids: restrict the search (see :meth:`KalosVectorStore.query`).
        vector_store_query_mode: ``"default"`` or ``"mmr"``.
        mmr_threshold: MMR's relevance/diversity balance in [0, 1] (0.5 by default).
        timeout: this retriever's deadline in seconds (default: the store's client's).
        on_error: ``"empty"`` or ``"raise"`` (default: the store's ``on_error``, so a store
            made to raise gives retrievers that raise).
        vector_store_kwargs: keywords for each :meth:`KalosVectorStore.query`, as
            ``VectorIndexRetriever`` passes them (``mmr_threshold``).
        **kwargs: ``BaseRetriever``'s (``object_map``, ``objects``, ``verbose``); any other,
            ``alpha`` or ``sparse_top_k`` say, raises ``TypeError``: Kalos searches dense
            vectors only.
    """

    def __init__(
        self,
        vector_store: KalosVectorStore,
        embed_model: BaseEmbedding | None = None,
        *,
        similarity_top_k: int = 4,
        filters: MetadataFilters | None = None,
        node_ids: list[str] | None = None,
        doc_ids: list[str] | None = None,
        vector_store_query_mode: str | VectorStoreQueryMode = VectorStoreQueryMode.DEFAULT,
        mmr_threshold: float | None = None,
        timeout: float | None = None,
        on_error: Literal["empty", "raise"] | None = None,
        callback_manager: CallbackManager | None = None,
        vector_store_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        extra = sorted(kwargs.keys() - _BASE_RETRIEVER_KWARGS)
        if extra:
            hybrid = " (Kalos searches dense vectors only: no sparse or hybrid search)" if set(extra) & _HYBRID else ""
            raise TypeError(f"KalosRetriever() got unexpected keyword arguments {extra}{hybrid}")
        _check_top_k(similarity_top_k)
        mode = VectorStoreQueryMode(vector_store_query_mode)
        if mode not in (VectorStoreQueryMode.DEFAULT, VectorStoreQueryMode.MMR):
            raise ValueError(
                f"vector_store_query_mode={mode.value!r}: Kalos supports 'default' and 'mmr'"
            )
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
        self._store = vector_store
        self._embed_model = embed_model
        self._similarity_top_k = similarity_top_k
        self._filters = filters
        self._node_ids = node_ids
        self._doc_ids = doc_ids
        self._mode = mode
        self._mmr_threshold = mmr_threshold
        self._timeout = timeout
        self._query_kwargs = dict(vector_store_kwargs or {})
        what = f"KalosRetriever(name={vector_store.name!r}, namespace={vector_store.namespace!r})"
        self.degrader = Degrader(what, vector_store.on_error if on_error is None else on_error)
        super().__init__(callback_manager=callback_manager, **kwargs)

    @property
    def vector_store(self) -> KalosVectorStore:
        return self._store

    @property
    def similarity_top_k(self) -> int:
        """How many nodes a retrieval returns; settable, as on ``VectorIndexRetriever``."""
        return self._similarity_top_k

    @similarity_top_k.setter
    def similarity_top_k(self, similarity_top_k: int) -> None:
        _check_top_k(similarity_top_k)
        self._similarity_top_k = similarity_top_k

    @property
    def embed_model(self) -> BaseEmbedding:
        if self._embed_model is None:
            self._embed_model = Settings.embed_model
        return self._embed_model

    def _query_for(self, embedding: list[float], query_str: str | None) -> VectorStoreQuery:
        return VectorStoreQuery(
            query_embedding=embedding,
            similarity_top_k=self._similarity_top_k,
            node_ids=self._node_ids,
            doc_ids=self._doc_ids,
            query_str=query_str,
            mode=self._mode,
            filters=self._filters,
            mmr_threshold=self._mmr_threshold,
        )

    def _search(self, query: VectorStoreQuery, deadline: float) -> list[NodeWithScore]:
        result = call_degrading(
            self.degrader,
            lambda: self._store._query(query, deadline, **self._query_kwargs),
            lambda: VectorStoreQueryResult(nodes=[], similarities=[], ids=[]),
        )
        sims = result.similarities or []
        nodes = result.nodes or []
        return [NodeWithScore(node=n, score=s) for n, s in zip(nodes, sims, strict=True)]

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        embedding = query_bundle.embedding
        if embedding is None:
            embedding = self.embed_model.get_agg_embedding_from_queries(query_bundle.embedding_strs)
        query = self._query_for(embedding, query_bundle.query_str)
        return self._search(query, self._store._deadline(self._timeout))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        embedding = query_bundle.embedding
        if embedding is None:
            embedding = await self.embed_model.aget_agg_embedding_from_queries(
                query_bundle.embedding_strs
            )
        query = self._query_for(embedding, query_bundle.query_str)
        deadline = self._store._deadline(self._timeout)  # counts the wait for a worker thread
        return await _aio.call(self._store.client, self._search, query, deadline, deadline=deadline,
                               expired=self._unsent)  # fmt: skip

    def _unsent(self, e: SidecarTimeout) -> list[NodeWithScore]:
        """A search whose deadline passed before a worker thread took it: degraded as one
        that timed out (or ``e`` raised, with ``on_error="raise"``)."""
        return call_degrading(self.degrader, _aio.raising(e), list)


_BASE_RETRIEVER_KWARGS = frozenset({"object_map", "objects", "verbose"})
_HYBRID = frozenset({"alpha", "sparse_top_k", "hybrid_top_k"})  # (VectorIndexRetriever's hybrid search)


def _check_top_k(similarity_top_k: Any) -> None:
    if not isinstance(similarity_top_k, numbers.Integral) or isinstance(similarity_top_k, bool) or similarity_top_k < 1:
        raise ValueError(f"similarity_top_k={similarity_top_k!r} must be an int >= 1")

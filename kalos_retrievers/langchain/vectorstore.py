"""KalosVectorStore: a LangChain ``VectorStore`` over a Kalos sidecar."""

from __future__ import annotations

import contextlib
import copy
import numbers
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from .. import _aio
from ..client import KalosClient, check_metadatas
from ..degrade import time_left
from ..errors import KalosError
from ..filters import validate_filter
from ..results import RecallResult
from ..scores import relevance_fn
from ._convert import Rows, as_matrix, docs_of, findable, mmr_of, scored_of, to_document, to_rows

if TYPE_CHECKING:
    from .retriever import KalosVectorStoreRetriever

__all__ = ["KalosVectorStore"]


class KalosVectorStore(VectorStore):
    """Kalos vector store: LangChain documents kept by a Kalos sidecar, recalled over shared memory.

    The sidecar process holds vectors, texts and metadata (in GPU memory, or in numpy without a
    GPU); this object embeds texts with your ``Embeddings`` and talks to the sidecar through
    a :class:`~kalos_retrievers.KalosClient`.

    Setup:
        Install the package and start a sidecar (or let :meth:`from_texts` start one).

        ```bash
        pip install kalos-retrievers
        kalos-sidecar serve --name mem --dim 97 --device cpu   # --device auto uses a GPU
        ```

    Key init args:
        embedding: the ``Embeddings`` model; its dimension must equal the sidecar's ``--dim``.
        name: the name of a running sidecar, or
        client: an existing :class:`~kalos_retrievers.KalosClient`.
        namespace: default namespace of every call (each call may pass ``namespace=``).
        timeout: default deadline of each call to the sidecar, in seconds.

    Instantiate:
        ```python
        from langchain_core.embeddings import DeterministicFakeEmbedding
        from kalos_retrievers.langchain import KalosVectorStore

        embeddings = DeterministicFakeEmbedding(size=97)  # use your model, e.g. OpenAIEmbeddings()

        # Start a private sidecar (stopped by store.close()) and add texts in one go:
        store = KalosVectorStore.from_texts(
            ["the cat sat on the mat", "kalos means beautiful"],
            embeddings,
            metadatas=[{"topic": "pets"}, {"topic": "greek"}],
            ids=["cat", "kalos"],
            device="cpu",
        )
        # Or connect to a sidecar that is already running; nothing is checked until the first
        # call, so a chain can be built before the sidecar is up:
        # store = KalosVectorStore(embeddings, name="mem")
        ```

    Add:
        ```python
        from langchain_core.documents import Document

        ids = store.add_documents([
            Document("an id from the document is kept", metadata={"topic": "ids"}, id="doc-1"),
            Document("no id: Kalos makes one up", metadata={"topic": "ids"}),
        ])
        print(ids[0], len(ids))
        store.delete(ids=[ids[1]])
        print([d.id for d in store.get_by_ids(["cat", "doc-1", "missing"])])
        ```

        ```text
        doc-1 2
        ['cat', 'doc-1']
        ```

    Search:
        ```python
        for doc in store.similarity_search("the cat sat on the mat", k=1):
            print(doc.page_content, doc.metadata, doc.id)
        # filters are MongoDB-style dicts, evaluated in the sidecar before the top-k:
        hits = store.similarity_search_with_score(
            "kalos means beautiful", k=2, filter={"topic": {"$in": ["greek", "ids"]}}
        )
        print([(d.id, round(s, 3)) for d, s in hits][:1])
        ```

        ```text
        the cat sat on the mat {'topic': 'pets'} cat
        [('kalos', 1.0)]
        ```

    Retriever:
        ```python
        retriever = store.as_retriever(search_type="mmr", search_kwargs={"k": 2, "fetch_k": 10})
        print(len(retriever.invoke("the cat sat on the mat")))
        # KalosRetriever returns empty context instead of raising when the sidecar is down:
        from kalos_retrievers.langchain import KalosRetriever

        retriever = KalosRetriever(vectorstore=store, k=1, timeout=0.25)
        print(retriever.invoke("kalos means beautiful")[0].id)
        ```

        ```text
        2
        kalos
        ```

    Async:
        ```python
        docs = await store.asimilarity_search("the cat sat on the mat", k=1)
        print(docs[0].id)
        ```

        ```text
        cat
        ```

    Timeouts:
        Every call has a deadline: ``timeout=`` per call, else the store's ``timeout``, else the
        client's (2 s). It starts after the embedding model returned, and, for the ``a*``
        methods, it includes the wait for a worker thread. A sidecar that is absent, killed or
        paused makes the store's methods raise
        :class:`~kalos_retrievers.SidecarUnavailable` /
        :class:`~kalos_retrievers.SidecarTimeout` at once or at the deadline; a
        :class:`~kalos_retrievers.langchain.KalosRetriever` (and ``as_retriever()``) turns
        those into empty context, a logged warning and a ``kalos_degraded`` callback event.

        ```python
        docs = store.similarity_search("kalos", k=1, timeout=0.05)
        print(docs[0].id in {"cat", "kalos", "doc-1"})
        store.close()  # this store started the sidecar, so this stops it
        ```

        ```text
        True
        ```
    """

    def __init__(
        self,
        embedding: Embeddings,
        *,
        name: str | None = None,
        client: KalosClient | None = None,
        namespace: str = "",
        timeout: float | None = None,
    ) -> None:
        """Connect a store to a sidecar by ``name``, or wrap an existing ``client``.

        Args:
            embedding: the model that turns texts into vectors.
            name: a sidecar's ``--name``; a lazy client is made, so a sidecar that is not
                up yet is only noticed by the first call.
            client: an existing client (not closed by :meth:`close`).
            namespace: namespace used when a call does not pass ``namespace=``.
            timeout: default deadline of each sidecar call in seconds (None: the client's).

        Raises:
            ValueError: neither or both of ``name`` and ``client``, or a bad ``timeout``.
            TypeError: ``embedding`` is not an ``Embeddings`` or ``namespace`` not a str.
        """
        if (name is None) == (client is None):
            raise ValueError(
                "KalosVectorStore needs exactly one of name= (a running sidecar's --name) and "
                "client= (a KalosClient); to start a sidecar use KalosVectorStore.from_texts()"
            )
        if not isinstance(embedding, Embeddings):
            raise TypeError(
                f"embedding must be a langchain Embeddings, got {type(embedding).__name__}"
            )
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or None")
        self.embedding = embedding
        self.namespace = namespace
        self.timeout = timeout
        self._owns_client = client is None
        if client is None:
            assert name is not None
            client = KalosClient(name, timeout=2.0 if timeout is None else timeout, lazy=True)
        self.client: KalosClient = client

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the client if this store made it (stopping a sidecar it spawned)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KalosVectorStore(name={self.client.name!r}, namespace={self.namespace!r})"

    def __copy__(self) -> Self:
        """A shallow copy on the same client, which it never stops (as :meth:`__deepcopy__`)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._owns_client = False
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """A copy (its embedding model deep-copied) on the same client: a client is a
        connection, shared as a copied object shares a database engine. The copy never stops
        a sidecar the original spawned."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)  # (not copy.copy: it would pickle, without the client)
        new.embedding = copy.deepcopy(self.embedding, memo)
        new._owns_client = False
        return new

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its client (shared memory and locks do not travel): unpickled, the
        store connects to the sidecar of the same name on its first call (a lazy client of
        its own, with the original client's timeout), in whatever process it is loaded."""
        state = self.__dict__.copy()
        client = state.pop("client")
        state["_client_of"] = (client.name, client.timeout)
        state["_owns_client"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        name, timeout = state.pop("_client_of")
        self.__dict__.update(state)
        self.client = KalosClient(name, timeout=timeout, lazy=True)

    @property
    def embeddings(self) -> Embeddings:
        return self.embedding

    # ------------------------------------------------------------------ add / delete / get
    def add_documents(
        self, documents: list[Document], ids: Sequence[str | None] | None = None, **kwargs: Any
    ) -> list[str]:
        """Store ``documents``: :meth:`add_texts` of their texts and metadata, under ``ids``
        if given (non-empty), else each ``Document.id`` (a fresh UUID where it is None), as
        ``InMemoryVectorStore`` does. Takes :meth:`add_texts`' keyword arguments."""
        texts, metas, doc_ids = _document_rows(documents, ids)
        return self.add_texts(texts, metas, ids=doc_ids, **kwargs)

    async def aadd_documents(
        self, documents: list[Document], ids: Sequence[str | None] | None = None, **kwargs: Any
    ) -> list[str]:
        """Async :meth:`add_documents`."""
        texts, metas, doc_ids = _document_rows(documents, ids)
        return await self.aadd_texts(texts, metas, ids=doc_ids, **kwargs)

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: Sequence[str | None] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """Embed ``texts`` and store them; an existing id is overwritten.

        Args:
            texts: the texts.
            metadatas: one JSON-serializable dict per text (stored and returned unchanged).
            ids: one id per text; None entries (or ``ids=None``) get a fresh UUID.
            namespace: where to store them (default: the store's namespace).
            timeout: deadline of each write request, in seconds, counted after embedding (a
                write larger than one slot is sent as several requests).
            batch_size: embed and write this many texts at a time (default: all at once).

        Returns:
            The ids, in the order of ``texts``.

        Raises:
            ValueError: mismatched lengths, metadata that is not JSON, a text and metadata
                too large for one slot, or embeddings whose dimension differs from the
                sidecar's, with NaN, or all zeros (cosine): nothing is stored, but for an
                embedding refused in a later batch of ``batch_size``, whose earlier batches
                are stored.
            SidecarUnavailable, SidecarTimeout: the sidecar is gone or too slow; rows of
                earlier batches (or slot-sized chunks) may be stored. The error's ``ids``
                are every text's id (fresh UUIDs included) and its ``committed`` how many
                texts, the first ones, were stored for sure: adding the texts again with
                ``ids=e.ids`` overwrites them, where ``ids=None`` would store those twice.
        """
        _no_extra(kwargs, "add_texts")
        rows = to_rows(texts, metadatas, ids)
        batches = _batches(len(rows.ids), batch_size)
        if len(batches) > 1:
            self._check_rows(rows, namespace)
        for lo, hi in batches:
            part = rows.texts[lo:hi]
            vectors = as_matrix(self.embedding.embed_documents(part), hi - lo, "embed_documents")
            with _write_of(rows, lo):
                self._upsert(rows, lo, vectors, namespace, self._deadline(timeout))
        return rows.ids

    async def aadd_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: Sequence[str | None] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """Async :meth:`add_texts` (``aembed_documents``, then the write in a worker thread)."""
        _no_extra(kwargs, "aadd_texts")
        rows = to_rows(texts, metadatas, ids)
        batches = _batches(len(rows.ids), batch_size)
        if len(batches) > 1:
            await _aio.call(self.client, self._check_rows, rows, namespace, deadline=self._deadline(timeout))
        for lo, hi in batches:
            part = rows.texts[lo:hi]
            embedded = await self.embedding.aembed_documents(part)
            vectors = as_matrix(embedded, hi - lo, "aembed_documents")
            deadline = self._deadline(timeout)
            with _write_of(rows, lo):
                await _aio.write(self.client, self._upsert, rows, lo, vectors, namespace, deadline, deadline=deadline)
        return rows.ids

    def delete(
        self,
        ids: list[str] | None = None,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> bool:
        """Delete by ids and/or by metadata filter; ids that are not stored are ignored.

        Args:
            ids: the ids to delete.
            filter: delete the rows matching this filter (with ``ids``: rows matching both).
            namespace: where (default: the store's namespace).
            timeout: deadline in seconds.

        Returns:
            True once the sidecar's store of record has committed the delete.

        Raises:
            ValueError: neither ``ids`` nor ``filter``; to empty a namespace call
                ``store.client.delete_namespace(namespace)``.
        """
        _no_extra(kwargs, "delete")
        if ids is None and not filter:
            raise ValueError(
                "delete() needs ids or filter=; to empty a namespace call "
                "store.client.delete_namespace(namespace)"
            )
        self._delete(ids, validate_filter(filter), namespace, self._deadline(timeout))
        return True

    async def adelete(
        self,
        ids: list[str] | None = None,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> bool:
        """Async :meth:`delete`."""
        _no_extra(kwargs, "adelete")
        if ids is None and not filter:
            raise ValueError("adelete() needs ids or filter=")
        flt = validate_filter(filter)
        deadline = self._deadline(timeout)
        await _aio.write(self.client, self._delete, ids, flt, namespace, deadline, deadline=deadline)
        return True

    def get_by_ids(
        self, ids: Sequence[str], /, *, namespace: str | None = None, timeout: float | None = None
    ) -> list[Document]:
        """The stored documents of ``ids``, in that order; ids not found are skipped (as are
        ids no row can have: empty, or over 512 bytes)."""
        return self._get(ids, namespace, self._deadline(timeout))

    async def aget_by_ids(
        self, ids: Sequence[str], /, *, namespace: str | None = None, timeout: float | None = None
    ) -> list[Document]:
        """Async :meth:`get_by_ids`."""
        deadline = self._deadline(timeout)
        return await _aio.call(self.client, self._get, ids, namespace, deadline, deadline=deadline)

    # ------------------------------------------------------------------ search
    def similarity_search(
        self,
        query: str,
        k: int = 4,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """The ``k`` documents most similar to ``query``, best first.

        Args:
            query: the text to embed and search for.
            k: how many (fewer when fewer rows match); 0 returns ``[]`` without embedding the
                query or asking the sidecar.
            filter: metadata filter, e.g. ``{"topic": {"$in": ["a", "b"]}}``; the result is
                the true top-k among matching rows. A callable is refused.
            namespace: search this namespace (default: the store's).
            timeout: deadline in seconds, counted after embedding.

        Raises:
            TypeError: ``filter`` is a callable (pass a dict of ``$`` operators).
            ValueError: bad ``k`` or filter, or an embedding of the wrong dimension.
            SidecarUnavailable, SidecarTimeout: the sidecar is gone or too slow.
        """
        _no_extra(kwargs, "similarity_search")
        flt = validate_filter(filter)
        if self._nothing(k, timeout):
            return []
        vector = self.embedding.embed_query(query)
        return docs_of(self._recall(vector, k, flt, namespace, self._seconds(timeout)))

    async def asimilarity_search(
        self,
        query: str,
        k: int = 4,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """Async :meth:`similarity_search`."""
        _no_extra(kwargs, "asimilarity_search")
        flt = validate_filter(filter)
        if self._nothing(k, timeout):
            return []
        vector = await self.embedding.aembed_query(query)
        return docs_of(await self._arecall(vector, k, flt, namespace, timeout))

    def similarity_search_with_score(
        self,
        query: str,
        k: int = 4,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        """:meth:`similarity_search` with each document's raw score.

        Returns:
            ``(document, score)`` pairs, best first. Scores are similarities, higher is more
            similar: cosine similarity in [-1, 1] (metric ``cosine``, the default), inner
            product (``ip``), or the negated Euclidean distance (``l2``).
        """
        _no_extra(kwargs, "similarity_search_with_score")
        flt = validate_filter(filter)
        if self._nothing(k, timeout):
            return []
        vector = self.embedding.embed_query(query)
        return scored_of(self._recall(vector, k, flt, namespace, self._seconds(timeout)))

    async def asimilarity_search_with_score(
        self,
        query: str,
        k: int = 4,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[tuple[Document, float]]:
        """Async :meth:`similarity_search_with_score`."""
        _no_extra(kwargs, "asimilarity_search_with_score")
        flt = validate_filter(filter)
        if self._nothing(k, timeout):
            return []
        vector = await self.embedding.aembed_query(query)
        return scored_of(await self._arecall(vector, k, flt, namespace, timeout))

    def similarity_search_by_vector(
        self,
        embedding: list[float],
        k: int = 4,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """:meth:`similarity_search` for an already embedded query."""
        _no_extra(kwargs, "similarity_search_by_vector")
        flt = validate_filter(filter)
        return docs_of(self._recall(embedding, k, flt, namespace, self._seconds(timeout)))

    async def asimilarity_search_by_vector(
        self,
        embedding: list[float],
        k: int = 4,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """Async :meth:`similarity_search_by_vector`."""
        _no_extra(kwargs, "asimilarity_search_by_vector")
        flt = validate_filter(filter)
        return docs_of(await self._arecall(embedding, k, flt, namespace, timeout))

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        """Relevance in [0, 1], higher is more similar, from the sidecar's metric.

        ========  ======================  ==========================================
        metric    raw score ``s``         relevance
        ========  ======================  ==========================================
        cosine    cosine similarity       ``(1 + s) / 2``
        ip        inner product           ``(1 + s) / 2`` (cosine's, for unit vectors)
        l2        ``-distance``           ``1 / (1 + distance)``
        ========  ======================  ==========================================

        All are monotone in ``s`` (a relevance threshold keeps the raw order) and clipped
        into [0, 1]; not LangChain's own functions (see :mod:`kalos_retrievers.scores` for
        what a threshold means in cosine and distance). This is
        :func:`kalos_retrievers.scores.relevance_fn`, shared with the LlamaIndex adapter.
        Asking for the metric connects to the sidecar.
        """
        return relevance_fn(self.client.metric)

    def _similarity_search_with_relevance_scores(
        self, query: str, k: int = 4, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        # One sidecar round trip; the metric is read after it, so an absent sidecar fails in
        # the search (with the search's error) rather than in the metric lookup.
        pairs = self.similarity_search_with_score(query, k, **kwargs)
        if not pairs:  # (k=0 asked nothing of the sidecar: nor does the metric's read)
            return []
        fn = self._select_relevance_score_fn()
        return [(doc, fn(score)) for doc, score in pairs]

    async def _asimilarity_search_with_relevance_scores(
        self, query: str, k: int = 4, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        pairs = await self.asimilarity_search_with_score(query, k, **kwargs)
        if not pairs:
            return []
        fn = self._select_relevance_score_fn()  # cached header: no I/O after a search
        return [(doc, fn(score)) for doc, score in pairs]

    # ------------------------------------------------------------------ MMR
    def max_marginal_relevance_search(
        self,
        query: str,
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """Documents chosen by maximal marginal relevance: similar to the query, diverse.

        Recalls the ``fetch_k`` best with their stored vectors (one round trip), then
        re-ranks them with LangChain's ``maximal_marginal_relevance``.

        Args:
            query: the text to search for.
            k: how many documents to return.
            fetch_k: how many candidates to re-rank (at least ``k``).
            lambda_mult: 1 for pure similarity, 0 for maximum diversity.
            filter, namespace, timeout: as in :meth:`similarity_search`.
        """
        _no_extra(kwargs, "max_marginal_relevance_search")
        vector = [] if _zero(k) else self.embedding.embed_query(query)  # (k=0: nothing to embed)
        return self.max_marginal_relevance_search_by_vector(
            vector, k, fetch_k, lambda_mult, filter=filter, namespace=namespace, timeout=timeout
        )

    async def amax_marginal_relevance_search(
        self,
        query: str,
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """Async :meth:`max_marginal_relevance_search`."""
        _no_extra(kwargs, "amax_marginal_relevance_search")
        vector = [] if _zero(k) else await self.embedding.aembed_query(query)
        return await self.amax_marginal_relevance_search_by_vector(
            vector, k, fetch_k, lambda_mult, filter=filter, namespace=namespace, timeout=timeout
        )

    def max_marginal_relevance_search_by_vector(
        self,
        embedding: list[float],
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """:meth:`max_marginal_relevance_search` for an already embedded query."""
        _no_extra(kwargs, "max_marginal_relevance_search_by_vector")
        flt = validate_filter(filter)
        if _zero(k):
            _check_fetch_k(fetch_k)
            self._seconds(timeout)  # (checks it)
            return []
        res = self._recall(embedding, self._pool(k, fetch_k), flt, namespace, self._seconds(timeout),
                           with_vectors=True)  # fmt: skip
        return mmr_of(embedding, res, k, lambda_mult)

    async def amax_marginal_relevance_search_by_vector(
        self,
        embedding: list[float],
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        *,
        filter: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """Async :meth:`max_marginal_relevance_search_by_vector`."""
        _no_extra(kwargs, "amax_marginal_relevance_search_by_vector")
        flt = validate_filter(filter)
        if _zero(k):
            _check_fetch_k(fetch_k)
            self._seconds(timeout)  # (checks it)
            return []
        res = await self._arecall(embedding, self._pool(k, fetch_k), flt, namespace, timeout,
                                  with_vectors=True)  # fmt: skip
        return mmr_of(embedding, res, k, lambda_mult)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: Sequence[str | None] | None = None,
        name: str | None = None,
        client: KalosClient | None = None,
        namespace: str = "",
        timeout: float | None = None,
        batch_size: int | None = None,
        **sidecar_options: Any,
    ) -> Self:
        """A store holding ``texts``: in a running sidecar, or in one started for it.

        Args:
            texts, metadatas, ids, batch_size: as in :meth:`add_texts`.
            embedding: the embedding model.
            name: a running sidecar to add to.
            client: an existing client to add through.
            namespace, timeout: as in the constructor.
            **sidecar_options: with neither ``name`` nor ``client``, a sidecar is started
                with these :class:`~kalos_retrievers.Sidecar` options (``metric``, ``device``,
                ``data_dir``, ...) and the dimension of ``embedding``; the store owns it and
                :meth:`close` stops it.

        Raises:
            TypeError: ``sidecar_options`` given together with ``name`` or ``client``.
            SidecarStartError: the sidecar could not start (its log's tail is in the message).
        """
        if name is not None or client is not None:
            if sidecar_options:
                raise TypeError(
                    f"{sorted(sidecar_options)} only apply when from_texts starts a sidecar "
                    "(name=None and client=None)"
                )
            store = cls(embedding, name=name, client=client, namespace=namespace, timeout=timeout)
            store.add_texts(texts, metadatas, ids=ids, batch_size=batch_size)
            return store
        rows = to_rows(texts, metadatas, ids)
        batches = _batches(len(rows.ids), batch_size)
        check_metadatas(rows.metadatas)  # before a sidecar is started for them
        if len(batches) > 1:  # the sidecar's dimension from one query; then add_texts' batches
            probe = as_matrix([embedding.embed_query("dimension probe")], 1, "embed_query")
            store = cls._spawned(embedding, int(probe.shape[1]), namespace, timeout, sidecar_options)
            try:
                store.add_texts(rows.texts, rows.metadatas, ids=rows.ids, batch_size=batch_size)
            except BaseException:
                store.close()
                raise
            return store
        if rows.texts:
            vectors = as_matrix(embedding.embed_documents(rows.texts), len(rows.texts),
                                "embed_documents")  # fmt: skip
        else:  # nothing to add, but the sidecar needs a dimension
            vectors = as_matrix([embedding.embed_query("dimension probe")], 1, "embed_query")[:0]
        store = cls._spawned(embedding, int(vectors.shape[1]), namespace, timeout, sidecar_options)
        try:
            if len(vectors):
                store._upsert(rows, 0, vectors, None, store._deadline(None))
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def _spawned(
        cls, embedding: Embeddings, dim: int, namespace: str, timeout: float | None,
        sidecar_options: dict[str, Any],
    ) -> Self:  # fmt: skip
        """A store owning a sidecar started for it with ``sidecar_options``."""
        spawned = KalosClient.spawn(dim=dim, **sidecar_options)
        try:
            store = cls(embedding, client=spawned, namespace=namespace, timeout=timeout)
        except BaseException:  # a bad namespace, timeout or embedding: the sidecar goes with it
            spawned.close()
            raise
        store._owns_client = True
        return store

    # afrom_texts / afrom_documents: VectorStore's versions run from_texts in a worker thread.

    # ------------------------------------------------------------------ retriever
    def as_retriever(self, **kwargs: Any) -> KalosVectorStoreRetriever:
        """A ``VectorStoreRetriever`` that returns empty context when the sidecar is down.

        Args:
            **kwargs: ``search_type`` (``"similarity"``, ``"similarity_score_threshold"`` or
                ``"mmr"``), ``search_kwargs`` (each type takes ``k``, ``filter``,
                ``namespace`` and ``timeout``; ``similarity_score_threshold`` also
                ``score_threshold``, ``mmr`` also ``fetch_k`` and ``lambda_mult``),
                ``on_error`` (``"empty"`` or ``"raise"``), ``tags``.

        Raises:
            ValueError: ``search_kwargs`` the ``search_type`` does not take (``fetch_k``
                left in after switching from ``"mmr"``, a misspelling): refused here rather
                than at every ``invoke``.

        Returns:
            A :class:`~kalos_retrievers.langchain.KalosVectorStoreRetriever`.
        """
        from .retriever import KalosVectorStoreRetriever

        tags = kwargs.pop("tags", None) or [*self._get_retriever_tags()]
        return KalosVectorStoreRetriever(vectorstore=self, tags=tags, **kwargs)

    # ------------------------------------------------------------------ internals
    def _seconds(self, timeout: float | None) -> float:
        """A call's timeout in seconds: ``timeout``, else the store's, else the client's."""
        if timeout is None:
            return self.timeout if self.timeout is not None else self.client.timeout
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
        return timeout

    def _nothing(self, k: Any, timeout: float | None) -> bool:
        """Whether a search asks for no hits (``k=0``), checking ``k`` and ``timeout`` as the
        search would: a text search then returns ``[]`` without embedding its query (a model
        call, often a paid one)."""
        if not _zero(k):
            return False
        self._seconds(timeout)
        return True

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + self._seconds(timeout)

    def _left(self, deadline: float) -> float:
        return time_left(deadline, self.client.name)

    def _check_dim(self, got: int) -> None:
        dim = self.client.dim
        if got != dim:  # (the vector came from the embedding model or from the caller: *_by_vector)
            raise ValueError(
                f"a {got}-dimensional vector, but sidecar {self.client.name!r} stores "
                f"{dim}-dimensional ones: use an embedding model with {dim} dimensions (this "
                f"store's is {type(self.embedding).__name__}), or start a sidecar with --dim {got} "
                "for this model (KalosVectorStore.from_texts(..., name=None) starts one)"
            )

    def _pool(self, k: int, fetch_k: Any) -> int:
        """MMR's candidates: ``fetch_k`` (at least ``k``), at most the sidecar's ``--max-k``."""
        _check_fetch_k(fetch_k)
        return max(k, min(int(fetch_k), self.client.header.max_k))

    def _ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else namespace

    def _recall(
        self,
        vector: Any,
        k: int,
        flt: dict[str, Any] | None,
        namespace: str | None,
        timeout: float,
        *,
        with_vectors: bool = False,
    ) -> RecallResult:
        """Recall with ``timeout`` seconds left (sync calls start their deadline here, after
        embedding; async ones in :meth:`_arecall`). ``k=0`` asks for nothing: no hits, and
        the sidecar is not asked (as LangChain's ``InMemoryVectorStore`` returns ``[]``)."""
        if _zero(k):
            return _NO_HITS
        if type(vector) is list and vector and type(vector[0]) is float:
            # what embed_query returns: check its length here and let the client convert it
            # (and check it) once, instead of converting it twice (about 0.5 us at 384 floats)
            q: Any = vector
            got = len(vector)
        else:
            q = np.asarray(vector, dtype=np.float32)
            got = q.shape[-1] if q.ndim else 0
        self._check_dim(got)
        return self.client.recall(
            q, k, namespace=self.namespace if namespace is None else namespace, filter=flt,
            with_vectors=with_vectors, timeout=timeout,
        )  # fmt: skip

    def _recall_by(
        self,
        vector: Any,
        k: int,
        flt: dict[str, Any] | None,
        namespace: str | None,
        deadline: float,
        with_vectors: bool,
    ) -> RecallResult:
        return self._recall(vector, k, flt, namespace, self._left(deadline),
                            with_vectors=with_vectors)  # fmt: skip

    async def _arecall(
        self,
        vector: Any,
        k: int,
        flt: dict[str, Any] | None,
        namespace: str | None,
        timeout: float | None,
        *,
        with_vectors: bool = False,
    ) -> RecallResult:
        deadline = self._deadline(timeout)  # counts the wait for a worker thread
        if _zero(k):
            return _NO_HITS
        return await _aio.call(self.client, self._recall_by, vector, k, flt, namespace, deadline, with_vectors,
                               deadline=deadline)  # fmt: skip

    def _check_rows(self, rows: Rows, namespace: str | None) -> None:
        """Refuse what the client would refuse of any row's id, text or metadata before the
        first of several batches is embedded and stored (connects, as the write would)."""
        self.client.check_upsert(len(rows.ids), rows.ids, [t or None for t in rows.texts],
                                 rows.metadatas, namespace=self._ns(namespace))  # fmt: skip

    def _upsert(
        self, rows: Rows, lo: int, vectors: np.ndarray, namespace: str | None, deadline: float
    ) -> None:
        """Write rows ``lo .. lo + len(vectors)`` in one client upsert, which checks them all
        before it sends any (with ``lo`` > 0 :meth:`_check_rows` has checked their texts and
        metadatas already, so the client's indexes, which count from ``lo``, are not seen)."""
        if not len(vectors):
            return
        self._check_dim(vectors.shape[1])
        bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
        if len(bad):
            raise ValueError(f"the embedding of texts[{lo + int(bad[0])}] contains NaN or infinity")
        if self.client.metric == "cosine":
            zero = np.flatnonzero(~vectors.any(axis=1))
            if len(zero):
                raise ValueError(
                    f"the embedding of texts[{lo + int(zero[0])}] is all zeros: it has no "
                    "direction, so its cosine similarity is undefined (an empty text, for some "
                    "models); leave it out, or use a sidecar with the 'ip' or 'l2' metric"
                )
        hi = lo + len(vectors)
        # LangChain allows Document(page_content=""); the client stores it as a vector-only
        # row (a None text), which reads back as "". Duplicate ids: the last is kept, as in
        # any one upsert.
        texts = [t or None for t in rows.texts[lo:hi]]
        self.client.upsert(rows.ids[lo:hi], vectors, texts, rows.metadatas[lo:hi],
                           namespace=self._ns(namespace), timeout=self._left(deadline))  # fmt: skip

    def _delete(
        self, ids: Sequence[str] | None, flt: dict[str, Any] | None, namespace: str | None,
        deadline: float,
    ) -> None:  # fmt: skip
        if ids is not None:
            ids = findable(ids)
            if not ids:
                return
        self.client.delete(ids, namespace=self._ns(namespace), filter=flt,
                           timeout=self._left(deadline))  # fmt: skip

    def _get(self, ids: Sequence[str], namespace: str | None, deadline: float) -> list[Document]:
        ids = findable(ids)
        if not ids:
            return []
        records = self.client.get(ids, namespace=self._ns(namespace), timeout=self._left(deadline))
        return [to_document(r) for r in records]


def _document_rows(
    documents: list[Document], ids: Sequence[str | None] | None
) -> tuple[list[str], list[dict[str, Any]], list[str | None]]:
    docs = list(documents)
    for i, d in enumerate(docs):
        if not isinstance(d, Document):
            raise TypeError(f"documents[{i}] must be a langchain Document, got {type(d).__name__}")
    chosen = list(ids) if ids else [d.id for d in docs]
    return [d.page_content for d in docs], [d.metadata for d in docs], chosen


@contextlib.contextmanager
def _write_of(rows: Rows, lo: int) -> Iterator[None]:
    """A :class:`KalosError` from writing ``rows`` from ``lo`` on says the write's ids and
    how many of its rows were committed (the client says it of the rows it was given)."""
    try:
        yield
    except KalosError as e:
        e.ids, e.committed = rows.ids, lo + (e.committed or 0)
        raise


def _batches(n: int, batch_size: int | None) -> list[tuple[int, int]]:
    if batch_size is None:
        return [(0, n)] if n else []
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    return [(lo, min(n, lo + batch_size)) for lo in range(0, n, batch_size)]


def _no_extra(kwargs: dict[str, Any], method: str) -> None:
    if kwargs:
        raise TypeError(
            f"KalosVectorStore.{method}() got unexpected keyword arguments {sorted(kwargs)}; "
            "see its docstring for the ones it takes"
        )


def _zero(k: Any) -> bool:
    """Whether ``k`` asks for no hits (is 0). A ``k`` no search takes (not an integer, a bool,
    below 0) raises ``ValueError`` here, before any connection; the sidecar's ``--max-k``
    is the client's to check."""
    if type(k) is int and k > 0:  # (the usual case, first)
        return False
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k={k!r} must be an int >= 0")
    return k == 0


_NO_HITS = RecallResult(np.empty(0, np.int32), np.empty(0, np.float32), ())  # what k=0 finds


def _check_fetch_k(fetch_k: Any) -> None:
    if not isinstance(fetch_k, numbers.Integral) or isinstance(fetch_k, bool) or fetch_k < 1:
        raise ValueError(f"fetch_k={fetch_k!r} must be an int >= 1")

"""KalosRetriever: recall for LangChain chains that degrades to empty context.

Two retrievers share one behaviour through :class:`~kalos_retrievers.Degrader`:

* :class:`KalosRetriever`, the one to drop into a chain (similarity search with optional
  relevance threshold, every option a field and an ``invoke`` keyword);
* :class:`KalosVectorStoreRetriever`, what ``KalosVectorStore.as_retriever()`` returns
  (LangChain's ``VectorStoreRetriever`` with ``similarity``, ``similarity_score_threshold``
  and ``mmr``).
"""

from __future__ import annotations

import inspect
import numbers
import time
from collections.abc import Mapping
from typing import Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStoreRetriever
from pydantic import ConfigDict, Field, field_validator, model_validator

from ..degrade import Degrader
from ..filters import validate_filter
from ..results import RecallResult
from ..scores import relevance_fn
from ._convert import docs_of, make_document
from ._degraded import adegrade, degrade
from .vectorstore import KalosVectorStore

__all__ = ["KalosRetriever", "KalosVectorStoreRetriever"]

_CALL_OPTIONS = frozenset({"k", "filter", "namespace", "score_threshold", "timeout"})


class KalosRetriever(BaseRetriever):
    """Retriever over a Kalos sidecar that never breaks the chain when the sidecar is down.

    Setup:
        ```bash
        pip install kalos-retrievers
        kalos-sidecar serve --name mem --dim 97 --device cpu   # --device auto uses a GPU
        ```

        or, from Python (tests, notebooks):

        ```python
        from kalos_retrievers import Sidecar

        sidecar = Sidecar(dim=97, device="cpu").start()  # a made-up unique name
        ```

    Instantiate:
        ```python
        from langchain_core.embeddings import DeterministicFakeEmbedding
        from kalos_retrievers.langchain import KalosRetriever

        embeddings = DeterministicFakeEmbedding(size=97)  # your model, e.g. OpenAIEmbeddings()
        # Nothing connects until the first call, so a chain can be built before the sidecar
        # is up. KalosRetriever(vectorstore=store) reuses an existing KalosVectorStore.
        retriever = KalosRetriever(embedding=embeddings, name=sidecar.name, k=2, timeout=0.25)
        ```

    Add:
        ```python
        retriever.vectorstore.add_texts(
            ["Ada's favourite colour is teal", "Bob takes his coffee black", "Ada lives in Lisbon"],
            metadatas=[{"user": "ada"}, {"user": "bob"}, {"user": "ada"}],
            ids=["ada-colour", "bob-coffee", "ada-city"],
        )
        ```

    Search:
        ```python
        docs = retriever.invoke("Ada lives in Lisbon", k=1)  # invoke-time options override fields
        print(docs[0].page_content, docs[0].id)
        docs = retriever.invoke("Bob takes his coffee black", filter={"user": {"$eq": "ada"}})
        print(sorted(d.id for d in docs))
        ```

        ```text
        Ada lives in Lisbon ada-city
        ['ada-city', 'ada-colour']
        ```

    Retriever:
        ```python
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_core.runnables import RunnablePassthrough

        def format_docs(docs):
            return "\\n".join(d.page_content for d in docs)

        prompt = ChatPromptTemplate.from_template("Context:\\n{context}\\n\\nQuestion: {question}")
        chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt
        print("Lisbon" in chain.invoke("Ada lives in Lisbon").to_string())
        ```

        ```text
        True
        ```

    Async:
        ```python
        docs = await retriever.ainvoke("Bob takes his coffee black", k=1)
        print(docs[0].metadata)
        ```

        ```text
        {'user': 'bob'}
        ```

    Timeouts:
        When the sidecar is absent, stopped, killed mid-call, or misses the deadline
        (``timeout``; None: the store's), ``invoke``/``ainvoke`` return ``[]`` within the
        deadline plus a few milliseconds, log one WARNING per episode (and one INFO line when
        recall works again), count it in ``retriever.degrader`` and dispatch the callback event
        ``kalos_degraded`` (``on_custom_event`` in a callback handler, or ``astream_events``).
        ``on_error="raise"`` raises :class:`~kalos_retrievers.SidecarUnavailable` /
        :class:`~kalos_retrievers.SidecarTimeout` instead. The retriever reconnects by itself
        when the sidecar is back. Bad arguments and misconfiguration always raise.

        ```python
        sidecar.stop()
        print(retriever.invoke("Ada lives in Lisbon"), retriever.degrader.episodes)
        print(chain.invoke("Ada lives in Lisbon").to_string())  # the chain still answers
        ```

        ```text
        [] 1
        Human: Context:


        Question: Ada lives in Lisbon
        ```

    Args:
        vectorstore: the :class:`KalosVectorStore` to search; or pass ``embedding`` with
            ``name`` (a sidecar's name) or ``client`` and one is made.
        k: how many documents.
        namespace: search this namespace (None: the store's).
        filter: metadata filter (``$`` operators, see :mod:`kalos_retrievers.filters`).
        score_threshold: keep documents whose relevance (in [0, 1], see
            ``KalosVectorStore._select_relevance_score_fn``) is at least this.
        timeout: deadline of each recall in seconds (None: the store's).
        on_error: ``"empty"`` to degrade to ``[]`` on an unavailable or slow sidecar,
            ``"raise"`` to raise.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    vectorstore: KalosVectorStore
    k: int = Field(default=4, ge=1)
    namespace: str | None = None
    filter: Mapping[str, Any] | None = None
    score_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    timeout: float | None = Field(default=None, gt=0.0, le=86_400.0)
    on_error: Literal["empty", "raise"] = "empty"
    degrader: Degrader | None = Field(default=None, exclude=True, repr=False)
    """Counts of degraded calls (``degraded_calls``) and outages (``episodes``); made at
    construction. A field, not private state, so that the copies LangChain makes of a
    retriever (``configurable_fields``, ``configurable_alternatives``) share it: one outage
    is one episode and one warning, however many copies see it."""

    @model_validator(mode="before")
    @classmethod
    def _make_store(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "vectorstore" in data:
            return data
        data = dict(data)
        embedding = data.pop("embedding", None)
        name, client = data.pop("name", None), data.pop("client", None)
        if embedding is None:
            raise ValueError(
                "KalosRetriever needs vectorstore=KalosVectorStore(...), or embedding= "
                "together with name= (a sidecar's --name) or client= (a KalosClient)"
            )
        # the store's namespace is the retriever's, so that retriever.vectorstore.add_texts()
        # writes where invoke() searches
        namespace = data.get("namespace")
        data["vectorstore"] = KalosVectorStore(embedding, name=name, client=client,
                                               namespace="" if namespace is None else namespace)  # fmt: skip
        return data

    @field_validator("filter", mode="before")
    @classmethod
    def _check_filter(cls, value: Any) -> Any:
        validate_filter(value)  # a callable raises TypeError with how to fix it
        return value

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        if self.degrader is None:
            self.degrader = Degrader(f"KalosRetriever(name={self.vectorstore.client.name!r})",
                                     self.on_error)  # fmt: skip

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        # Per call, on the path where nothing fails, this does only: the fields (validated at
        # construction), the embedding, the recall, one flag test and k Documents.
        store = self.vectorstore
        if kwargs:
            k, flt, namespace, threshold, timeout = self._options(kwargs)
            if store._nothing(k, timeout):  # invoke(k=0): nothing to find, nothing embedded
                return []
        else:
            k, flt, namespace = self.k, self.filter, self.namespace
            threshold, timeout = self.score_threshold, self.timeout
        vector = store.embedding.embed_query(query)
        degrader: Degrader = self.degrader  # type: ignore[assignment]
        started = time.monotonic()
        try:
            res = store._recall(vector, k, flt, namespace, store._seconds(timeout))
            # (with a threshold, the metric is read: from the header, which reconnects if
            # another thread found the sidecar gone meanwhile, and may fail as the recall may)
            docs = docs_of(res) if threshold is None else self._documents(res, threshold)
        except Exception as exc:
            if degrade(degrader, exc, store.client.name, run_manager, self.on_error, started):
                return []
            raise
        if degrader.in_episode:
            degrader.succeeded()
        return docs

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, flt, namespace, threshold, timeout = self._options(kwargs)
        store = self.vectorstore
        if store._nothing(k, timeout):  # (as in the sync path)
            return []
        vector = await store.embedding.aembed_query(query)
        degrader: Degrader = self.degrader  # type: ignore[assignment]
        started = time.monotonic()
        try:
            res = await store._arecall(vector, k, flt, namespace, timeout)
            docs = self._documents(res, threshold)  # (as in the sync path: the metric's read may fail too)
        except Exception as exc:
            if await adegrade(degrader, exc, store.client.name, run_manager, self.on_error, started):
                return []
            raise
        if degrader.in_episode:
            degrader.succeeded()
        return docs

    def _options(
        self, kwargs: dict[str, Any]
    ) -> tuple[int, Any, str | None, float | None, float | None]:
        if not kwargs:
            return self.k, self.filter, self.namespace, self.score_threshold, self.timeout
        extra = kwargs.keys() - _CALL_OPTIONS
        if extra:
            raise TypeError(
                f"KalosRetriever.invoke() got unexpected keyword arguments {sorted(extra)}; "
                f"it takes {sorted(_CALL_OPTIONS)}"
            )
        flt = kwargs.get("filter", self.filter)
        validate_filter(flt)
        threshold = kwargs.get("score_threshold", self.score_threshold)
        if threshold is not None and not (isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)
                                          and 0.0 <= threshold <= 1.0):  # fmt: skip
            raise ValueError(f"score_threshold={threshold!r} must be a relevance (a number) in [0, 1]")
        return (kwargs.get("k", self.k), flt, kwargs.get("namespace", self.namespace), threshold,
                kwargs.get("timeout", self.timeout))  # fmt: skip

    def _documents(self, res: RecallResult, threshold: float | None) -> list[Document]:
        if threshold is None or not len(res):  # (no hits: no metric to read)
            return docs_of(res)
        fn = relevance_fn(self.vectorstore.client.metric)
        keep = [i for i, score in enumerate(res.scores.tolist()) if fn(score) >= threshold]
        return [make_document(text, meta, id_) for id_, text, meta in res.id_text_metadata(keep)]


class KalosVectorStoreRetriever(VectorStoreRetriever):
    """What :meth:`KalosVectorStore.as_retriever` returns: LangChain's ``VectorStoreRetriever``
    (``search_type`` ``"similarity"``, ``"similarity_score_threshold"`` or ``"mmr"``,
    ``search_kwargs``) with :class:`KalosRetriever`'s degradation: an unavailable or slow
    sidecar gives ``[]``, one warning per episode, and a ``kalos_degraded`` event, unless
    ``on_error="raise"``.
    """

    vectorstore: KalosVectorStore
    on_error: Literal["empty", "raise"] = "empty"
    degrader: Degrader | None = Field(default=None, exclude=True, repr=False)
    """As :attr:`KalosRetriever.degrader` (shared by LangChain's copies of this retriever)."""

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        takes = _SEARCH_KWARGS.get(self.search_type)
        extra = sorted(set(self.search_kwargs) - takes) if takes is not None else []
        if extra:  # refused here, not at every invoke (an error not degraded: the chain broke)
            others = [t for t, keys in _SEARCH_KWARGS.items() if set(extra) <= keys]
            raise ValueError(
                f"search_kwargs {extra} do not apply to search_type={self.search_type!r}, which "
                f"takes {sorted(takes)}" + (f" ({' and '.join(map(repr, others))} takes them)" if others else "")
            )
        if self.degrader is None:
            self.degrader = Degrader(
                f"KalosVectorStoreRetriever(name={self.vectorstore.client.name!r}, "
                f"search_type={self.search_type!r})",
                self.on_error,
            )

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        degrader: Degrader = self.degrader  # type: ignore[assignment]
        started = time.monotonic()
        try:
            docs = super()._get_relevant_documents(query, run_manager=run_manager, **kwargs)
        except Exception as exc:
            if degrade(degrader, exc, self.vectorstore.client.name, run_manager, self.on_error, started):
                return []
            raise
        if degrader.in_episode:
            degrader.succeeded()
        return docs

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        degrader: Degrader = self.degrader  # type: ignore[assignment]
        started = time.monotonic()
        try:
            docs = await super()._aget_relevant_documents(query, run_manager=run_manager, **kwargs)
        except Exception as exc:
            if await adegrade(degrader, exc, self.vectorstore.client.name, run_manager,
                              self.on_error, started):  # fmt: skip
                return []
            raise
        if degrader.in_episode:
            degrader.succeeded()
        return docs


def _keywords(method: Any) -> frozenset[str]:
    """The named arguments a store method takes after the query."""
    return frozenset(
        p.name for p in list(inspect.signature(method).parameters.values())[2:] if p.kind is not p.VAR_KEYWORD
    )


# what each search type's VectorStoreRetriever call passes search_kwargs to
_SEARCH_KWARGS = {
    "similarity": _keywords(KalosVectorStore.similarity_search),
    "similarity_score_threshold": _keywords(KalosVectorStore.similarity_search_with_score) | {"score_threshold"},
    "mmr": _keywords(KalosVectorStore.max_marginal_relevance_search),
}

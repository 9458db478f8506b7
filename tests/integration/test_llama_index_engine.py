"""LlamaIndex end to end on a real sidecar (odd dim 13): VectorStoreIndex over KalosVectorStore,
its retriever and query engine (MockLLM), KalosRetriever in a RetrieverQueryEngine. Offline: a
keyword embedding of our own, no model download."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from llama_index.core import Document, StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters

from kalos_retrievers import Sidecar
from kalos_retrievers.llama_index import KalosRetriever, KalosVectorStore

VOCAB = ["kalos", "recall", "shared", "memory", "gpu", "cat", "dog", "pet", "cooking", "pasta",
         "tomato", "garden", "sidecar"]  # fmt: skip
DIM = len(VOCAB)  # 13
_INDEX = {w: i for i, w in enumerate(VOCAB)}


class KeywordEmbedding(BaseEmbedding):
    """Bag of words over a fixed vocabulary: texts sharing words are close. Deterministic."""

    def _vec(self, text: str) -> list[float]:
        v = np.full(DIM, 0.01)
        for w in re.findall(r"[a-z]+", text.lower()):
            if w in _INDEX:
                v[_INDEX[w]] += 1.0
        return v.tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vec(text)


DOCS = [
    Document(text="Kalos serves recall from shared memory on the GPU sidecar.", doc_id="kalos",
             metadata={"topic": "infra", "year": 2025}),
    Document(text="A cat and a dog: every pet needs a garden.", doc_id="pets",
             metadata={"topic": "pets", "year": 2021}),
    Document(text="Cooking pasta with tomato; cooking is memory of taste.", doc_id="food",
             metadata={"topic": "cooking", "year": 2023}),
]  # fmt: skip


@pytest.fixture
def store(start_sidecar: Callable[..., Sidecar]) -> Iterator[KalosVectorStore]:
    sc = start_sidecar(dim=DIM)
    s = KalosVectorStore(sc.name, namespace="engine")
    yield s
    s.close()


@pytest.fixture
def index(store: KalosVectorStore) -> VectorStoreIndex:
    storage = StorageContext.from_defaults(vector_store=store)
    return VectorStoreIndex.from_documents(
        [d.model_copy() for d in DOCS], storage_context=storage, embed_model=KeywordEmbedding()
    )


def _doc_ids(nodes: list) -> list[str]:
    return [n.node.ref_doc_id for n in nodes]


def test_index_retriever_and_query_engine(index: VectorStoreIndex, store: KalosVectorStore) -> None:
    assert store.client.count("engine") == 3
    hits = index.as_retriever(similarity_top_k=2).retrieve("my dog is a good pet")
    assert _doc_ids(hits)[0] == "pets"
    assert hits[0].score is not None
    assert hits[0].score > hits[1].score  # type: ignore[operator]
    assert hits[0].node.metadata == {"topic": "pets", "year": 2021}
    response = index.as_query_engine(llm=MockLLM(), similarity_top_k=1).query("pasta and tomato")
    assert [n.node.ref_doc_id for n in response.source_nodes] == ["food"]
    assert str(response)  # MockLLM answered something from the retrieved context


def test_from_vector_store_filters_mmr_delete_insert(index: VectorStoreIndex,
                                                      store: KalosVectorStore) -> None:  # fmt: skip
    embed = KeywordEmbedding()
    again = VectorStoreIndex.from_vector_store(store, embed_model=embed)
    only_cooking = MetadataFilters(filters=[MetadataFilter(key="topic", value="cooking")])
    hits = again.as_retriever(filters=only_cooking).retrieve("kalos gpu recall")
    assert _doc_ids(hits) == ["food"]
    mmr = again.as_retriever(similarity_top_k=3, vector_store_query_mode="mmr",
                             vector_store_kwargs={"mmr_threshold": 0.5})  # fmt: skip
    assert set(_doc_ids(mmr.retrieve("memory"))) == {"kalos", "pets", "food"}
    again.delete_ref_doc("pets")
    assert "pets" not in _doc_ids(again.as_retriever(similarity_top_k=3).retrieve("dog pet cat"))
    again.insert(Document(text="A dog in the garden", doc_id="dog2", metadata={"topic": "pets"}))
    assert _doc_ids(again.as_retriever(similarity_top_k=1).retrieve("dog garden")) == ["dog2"]


def test_reopened_with_its_persisted_docstore_refresh_adds_no_duplicates(
    index: VectorStoreIndex, store: KalosVectorStore, tmp_path: Path
) -> None:
    """docs/llama_index.md's reopening for refresh_ref_docs: the index persisted and loaded
    with the store refreshes the same documents to nothing and a changed one to its new
    text, one copy of each (the control: reopened by from_vector_store, whose docstore is
    empty, every document is inserted again beside its old nodes). After delete_ref_doc,
    the docstore's delete_document lets a refresh bring the document back (without it the
    store that keeps text leaves its hash, and the refresh skips it)."""
    embed = KeywordEmbedding()
    index.storage_context.persist(str(tmp_path))
    loaded = load_index_from_storage(StorageContext.from_defaults(persist_dir=str(tmp_path), vector_store=store),
                                     embed_model=embed)  # fmt: skip
    assert loaded.refresh_ref_docs([d.model_copy() for d in DOCS]) == [False, False, False]
    changed = [d.model_copy() for d in DOCS]
    changed[1] = Document(text="A dog in the garden, a pet.", doc_id="pets", metadata={"topic": "pets"})
    assert loaded.refresh_ref_docs(changed) == [False, True, False]
    assert store.client.count("engine") == 3
    hits = loaded.as_retriever(similarity_top_k=3).retrieve("dog garden pet")
    assert [n.node.get_content() for n in hits if n.node.ref_doc_id == "pets"] == ["A dog in the garden, a pet."]
    loaded.delete_ref_doc("pets", delete_from_docstore=True)
    assert loaded.refresh_ref_docs(changed) == [False, False, False]  # (LlamaIndex: the hash stays)
    loaded.docstore.delete_document("pets", raise_error=False)
    assert loaded.refresh_ref_docs(changed) == [False, True, False] and store.client.count("engine") == 3
    bare = VectorStoreIndex.from_vector_store(store, embed_model=embed)  # the control
    assert bare.refresh_ref_docs([d.model_copy() for d in DOCS]) == [True, True, True]
    assert store.client.count("engine") == 6


async def test_async_retrieve_and_query(index: VectorStoreIndex) -> None:
    hits = await index.as_retriever(similarity_top_k=1).aretrieve("shared memory sidecar")
    assert _doc_ids(hits) == ["kalos"]
    response = await index.as_query_engine(llm=MockLLM(), similarity_top_k=1).aquery("pet cat")
    assert [n.node.ref_doc_id for n in response.source_nodes] == ["pets"]


async def test_kalos_retriever_in_a_query_engine(index: VectorStoreIndex,
                                                  store: KalosVectorStore) -> None:  # fmt: skip
    retriever = store.as_retriever(KeywordEmbedding(), similarity_top_k=1)
    assert isinstance(retriever, KalosRetriever)
    assert _doc_ids(retriever.retrieve("tomato pasta")) == ["food"]
    assert _doc_ids(await retriever.aretrieve("gpu recall")) == ["kalos"]
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())
    response = engine.query("cat and dog")
    assert [n.node.ref_doc_id for n in response.source_nodes] == ["pets"]
    filtered = KalosRetriever(store, KeywordEmbedding(), similarity_top_k=3,
                              filters=MetadataFilters(filters=[MetadataFilter(
                                  key="year", value=2022, operator=">")]))  # fmt: skip
    assert sorted(_doc_ids(filtered.retrieve("anything"))) == ["food", "kalos"]
    retriever.similarity_top_k = 3  # (settable, as on VectorIndexRetriever)
    assert retriever.similarity_top_k == 3 and len(retriever.retrieve("tomato pasta")) == 3
    assert retriever.degrader.degraded_calls == 0

"""KalosVectorStore and KalosRetriever without a sidecar: construction and argument checks."""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.vector_stores.types import VectorStoreQuery, VectorStoreQueryMode

from kalos_retrievers.llama_index import KalosRetriever, KalosVectorStore

NO_SIDECAR = "kalos-unit-no-such-sidecar"


def test_construction_never_needs_the_sidecar() -> None:
    store = KalosVectorStore(NO_SIDECAR, namespace="tenant-7", timeout=0.5)
    assert store.stores_text is True
    assert store.client.name == NO_SIDECAR
    assert not store.client.connected
    retriever = store.as_retriever(MockEmbedding(embed_dim=3), similarity_top_k=2)
    assert isinstance(retriever, KalosRetriever)
    assert retriever.degrader.degraded_calls == 0


def test_serializes_its_settings_only() -> None:
    d = KalosVectorStore(NO_SIDECAR, namespace="n").to_dict()
    assert d["name"] == NO_SIDECAR
    assert d["namespace"] == "n"
    assert d["class_name"] == "KalosVectorStore"
    assert "_client" not in d


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"namespace": "n" * 256}, "255 bytes"),
        ({"mmr_prefetch_factor": 0}, "mmr_prefetch_factor"),
        ({"on_error": "ignore"}, "on_error"),
    ],
)
def test_store_arguments_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KalosVectorStore(NO_SIDECAR, **kwargs)


def test_store_needs_a_name() -> None:
    with pytest.raises(ValueError, match="name"):
        KalosVectorStore()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"similarity_top_k": 0}, "similarity_top_k"),
        ({"vector_store_query_mode": "hybrid"}, "'default' and 'mmr'"),
        ({"timeout": 0}, "timeout"),
        ({"on_error": "maybe"}, "on_error"),
    ],
)
def test_retriever_arguments_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KalosRetriever(KalosVectorStore(NO_SIDECAR), MockEmbedding(embed_dim=3), **kwargs)


@pytest.mark.parametrize("mode", ["hybrid", VectorStoreQueryMode.HYBRID, "sparse"])
def test_an_unsupported_query_mode_is_named_whether_enum_or_string(mode: Any) -> None:
    """VectorStoreQuery does not convert a plain string mode: "hybrid" raised AttributeError
    ('str' object has no attribute 'value') instead of the documented ValueError."""
    with pytest.raises(ValueError, match=r"'default' and 'mmr', not '(hybrid|sparse)'"):
        KalosVectorStore(NO_SIDECAR).query(VectorStoreQuery(query_embedding=[1.0, 0.0, 0.0], mode=mode))

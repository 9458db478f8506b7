"""The public API of kalos_retrievers.llama_index, pinned: changing it is a deliberate act."""

from __future__ import annotations

import kalos_retrievers.llama_index as kli

EXPECTED_ALL = ["KalosDegradedEvent", "KalosRetriever", "KalosVectorStore", "to_kalos_filter"]


def test_all_is_pinned() -> None:
    assert sorted(kli.__all__) == EXPECTED_ALL


def test_every_name_in_all_exists() -> None:
    for name in kli.__all__:
        assert getattr(kli, name) is not None, name


def test_types_are_the_frameworks() -> None:
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.vector_stores.types import BasePydanticVectorStore

    assert issubclass(kli.KalosVectorStore, BasePydanticVectorStore)
    assert issubclass(kli.KalosRetriever, BaseRetriever)
    assert kli.KalosVectorStore.class_name() == "KalosVectorStore"

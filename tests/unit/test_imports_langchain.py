"""Pin the public API of kalos_retrievers.langchain (as langchain-qdrant's test_imports does)."""

from __future__ import annotations

import kalos_retrievers.langchain as lc

EXPECTED_ALL = [
    "DEGRADED_EVENT",
    "KalosRetriever",
    "KalosVectorStore",
    "KalosVectorStoreRetriever",
]


def test_all_imports() -> None:
    assert sorted(lc.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(lc, name) is not None


def test_public_classes_are_langchain_types() -> None:
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.vectorstores import VectorStore, VectorStoreRetriever

    assert issubclass(lc.KalosVectorStore, VectorStore)
    assert issubclass(lc.KalosRetriever, BaseRetriever)
    assert issubclass(lc.KalosVectorStoreRetriever, VectorStoreRetriever)
    assert lc.DEGRADED_EVENT == "kalos_degraded"

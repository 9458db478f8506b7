"""LangChain's own contract tests, against real CPU sidecars, nothing overridden or skipped.

* ``VectorStoreIntegrationTests`` (sync and async), run twice:
  - cosine sidecar, default namespace, emptied after every test (``delete_namespace``), so each
    test's "the store starts empty" also checks that the previous one was cleaned up;
  - l2 sidecar, a fresh namespace per test, next to rows in another namespace that must stay
    invisible;
  both at dim 6, the size of the suite's ``DeterministicFakeEmbedding``.
* ``RetrieversIntegrationTests``: a sidecar with dim 97 holding 11 documents.

One sidecar per class rather than per test keeps the run short. Their names extend the
module's ``shared_sidecar`` name, which is unique to this test run, so conftest's check for
leftover shared memory covers them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_tests.integration_tests import (
    RetrieversIntegrationTests,
    VectorStoreIntegrationTests,
)
from langchain_tests.integration_tests.vectorstores import EMBEDDING_SIZE

from kalos_retrievers import KalosClient, Sidecar
from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore


def class_sidecar(shared: Sidecar, suffix: str, **kw: Any) -> Iterator[Sidecar]:
    sc = Sidecar(f"{shared.name}{suffix}", device="cpu", startup_timeout=60.0, **kw).start()
    try:
        yield sc
    finally:
        sc.stop()
        sc.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def cosine6(shared_sidecar: Sidecar) -> Iterator[Sidecar]:
    yield from class_sidecar(shared_sidecar, "c6", dim=EMBEDDING_SIZE)


@pytest.fixture(scope="module")
def l2_6(shared_sidecar: Sidecar) -> Iterator[Sidecar]:
    yield from class_sidecar(shared_sidecar, "l6", dim=EMBEDDING_SIZE, metric="l2")


@pytest.fixture(scope="module")
def cosine97(shared_sidecar: Sidecar) -> Iterator[Sidecar]:
    yield from class_sidecar(shared_sidecar, "c97", dim=97)


class TestKalosVectorStoreStandard(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, cosine6: Sidecar) -> Iterator[KalosVectorStore]:
        store = KalosVectorStore(self.get_embeddings(), name=cosine6.name)
        try:
            yield store
        finally:
            store.client.delete_namespace("")
            store.close()


class TestKalosVectorStoreStandardNamespaceL2(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(
        self, l2_6: Sidecar, make_name: Callable[[], str]
    ) -> Iterator[KalosVectorStore]:
        client = KalosClient(l2_6.name, timeout=5.0)
        # Rows in another namespace, with ids the suite uses, must stay invisible to it.
        client.upsert(["1", "2", "foo"], [[1.0] * EMBEDDING_SIZE] * 3, texts=["x", "y", "z"],
                      namespace="other")  # fmt: skip
        namespace = make_name()
        store = KalosVectorStore(self.get_embeddings(), client=client, namespace=namespace)
        try:
            yield store
            assert client.count("other") == 3
        finally:
            client.delete_namespace(namespace)
            client.close()


class TestKalosRetrieverStandard(RetrieversIntegrationTests):
    TEXTS: ClassVar[list[str]] = [f"memory number {i}: {w}" for i, w in enumerate("abcdefghijk")]

    @pytest.fixture(autouse=True)
    def _sidecar(self, cosine97: Sidecar) -> None:
        self.embeddings = DeterministicFakeEmbedding(size=97)
        with KalosVectorStore(self.embeddings, name=cosine97.name) as store:
            store.add_texts(self.TEXTS, [{"i": i} for i in range(len(self.TEXTS))],
                            ids=[f"m{i}" for i in range(len(self.TEXTS))])  # fmt: skip
        self.sidecar_name = cosine97.name

    @property
    def retriever_constructor(self) -> type[KalosRetriever]:
        return KalosRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"embedding": self.embeddings, "name": self.sidecar_name, "k": 5}

    @property
    def retriever_query_example(self) -> str:
        return "memory number 3: d"

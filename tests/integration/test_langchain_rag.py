"""A RAG chain with KalosRetriever and an offline chat model that echoes its prompt.

``ParrotFakeChatModel`` answers with the last message it was given, so the answer shows exactly
what reached the prompt: the remembered fact while the sidecar is up, and an empty context
(but still an answer) while it is down.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.language_models.fake_chat_models import ParrotFakeChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnablePassthrough

from kalos_retrievers import Sidecar, SidecarUnavailable
from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore

DIM = 97
FACTS = [
    "Ada's bike is teal",
    "Bob's car is a red hatchback",
    "the office wifi password is hunter2",
    "Carol is allergic to peanuts",
]
QUESTION = "What colour is Ada's bike?"


class WordHashEmbedding(Embeddings):
    """Bag of words hashed into ``dim`` buckets: a question shares words with its fact."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def _one(self, text: str) -> list[float]:
        v = np.zeros(self.dim)
        for w in text.lower().replace("?", " ").split():
            v[zlib.crc32(w.encode()) % self.dim] += 1.0
        v[0] += 1e-3
        return v.tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._one(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._one(text)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def rag_chain(retriever: Any) -> Runnable[str, str]:
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from the context only."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ])  # fmt: skip
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | ParrotFakeChatModel()
        | StrOutputParser()
    )


@pytest.fixture
def sidecar(start_sidecar: Callable[..., Sidecar]) -> Sidecar:
    sc = start_sidecar(dim=DIM)
    with KalosVectorStore(WordHashEmbedding(DIM), name=sc.name) as store:
        store.add_texts(FACTS, [{"n": i} for i in range(len(FACTS))])
    return sc


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_rag_chain_remembers_and_survives_outage(sidecar: Sidecar, mode: str) -> None:
    retriever = KalosRetriever(embedding=WordHashEmbedding(DIM), name=sidecar.name, k=1,
                               timeout=0.3)  # fmt: skip
    chain = rag_chain(retriever)

    async def ask() -> str:
        return chain.invoke(QUESTION) if mode == "invoke" else await chain.ainvoke(QUESTION)

    answer = await ask()
    assert answer == f"Context:\n{FACTS[0]}\n\nQuestion: {QUESTION}"

    sidecar.stop()
    answer = await ask()
    assert answer == f"Context:\n\n\nQuestion: {QUESTION}"  # empty context, still an answer
    assert "teal" not in answer
    assert retriever.degrader.episodes == 1


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_rag_chain_control_raises_when_asked_to(sidecar: Sidecar, mode: str) -> None:
    """Negative control: the outage above really breaks retrieval; with on_error="raise" the
    chain fails instead of answering."""
    retriever = KalosRetriever(embedding=WordHashEmbedding(DIM), name=sidecar.name, k=1,
                               timeout=0.3, on_error="raise")  # fmt: skip
    chain = rag_chain(retriever)
    assert "teal" in chain.invoke(QUESTION)
    sidecar.stop()
    if mode == "invoke":
        with pytest.raises(SidecarUnavailable):
            chain.invoke(QUESTION)
    else:
        with pytest.raises(SidecarUnavailable):
            await chain.ainvoke(QUESTION)


def test_chain_built_before_the_sidecar_starts(
    start_sidecar: Callable[..., Sidecar], make_name: Callable[[], str]
) -> None:
    name = make_name()
    chain = rag_chain(KalosRetriever(embedding=WordHashEmbedding(DIM), name=name, k=1))
    assert chain.invoke(QUESTION).startswith("Context:\n\n")  # no sidecar yet: empty context
    sc = start_sidecar(dim=DIM, name=name)
    with KalosVectorStore(WordHashEmbedding(DIM), name=sc.name) as store:
        store.add_texts(FACTS)
    for _ in range(100):  # the client retries with backoff (<= 2 s) after the failed attempt
        answer = chain.invoke(QUESTION)
        if "teal" in answer:
            break
        time.sleep(0.05)
    assert answer == f"Context:\n{FACTS[0]}\n\nQuestion: {QUESTION}"

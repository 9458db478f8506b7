"""LangChain adapter: ``KalosVectorStore`` and ``KalosRetriever``.

>>> from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore   # doctest: +SKIP

See ``docs/langchain.md`` and the class docstrings (runnable tutorials).
"""

from __future__ import annotations

from ._degraded import DEGRADED_EVENT
from .query_constructor import KalosTranslator
from .retriever import KalosRetriever, KalosVectorStoreRetriever
from .vectorstore import KalosVectorStore

__all__ = [
    "DEGRADED_EVENT",
    "KalosRetriever",
    "KalosTranslator",
    "KalosVectorStore",
    "KalosVectorStoreRetriever",
]

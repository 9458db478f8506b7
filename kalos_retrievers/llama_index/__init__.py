"""LlamaIndex adapters for Kalos.

* :class:`KalosVectorStore`: a ``BasePydanticVectorStore`` (``VectorStoreIndex.from_vector_store``
  works on it) with metadata filters, MMR, and async twins of every call;
* :class:`KalosRetriever`: a ``BaseRetriever`` that degrades to empty context when the sidecar
  is unavailable;
* :func:`to_kalos_filter`: ``MetadataFilters`` -> the Kalos filter language;
* :class:`KalosDegradedEvent`: the instrumentation event emitted on each degraded call.

See docs/llama_index.md.
"""

from __future__ import annotations

from .degradation import KalosDegradedEvent
from .filters import to_kalos_filter
from .retriever import KalosRetriever
from .vector_store import KalosVectorStore

__all__ = ["KalosDegradedEvent", "KalosRetriever", "KalosVectorStore", "to_kalos_filter"]

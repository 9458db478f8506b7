"""What the client returns: numpy scores plus documents decoded only when touched.

A recall's response is copied out of the slot in one piece (so the slot can serve the next
request at once) and kept as bytes; :class:`RecallResult` decodes a document's id, text and
metadata the first time someone reads it. A caller that only needs ids and scores never pays
for JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .protocol import Doc, decode_doc_fields, doc_id, doc_times

__all__ = ["Hit", "RecallResult", "Record"]


@dataclass(frozen=True)
class Record:
    """A stored memory: what ``get`` and ``scan`` return, and what a hit carries."""

    id: str
    text: str
    metadata: dict[str, Any]
    namespace: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    vector: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_doc(cls, doc: Doc, namespace: str, vector: np.ndarray | None = None) -> Record:
        return cls(doc.id, doc.text, doc.metadata, namespace, doc.created_at, doc.updated_at, vector)


@dataclass(frozen=True)
class Hit:
    """One result of a recall: the record and its score (higher is more similar)."""

    id: str
    score: float
    text: str
    metadata: dict[str, Any]
    namespace: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    vector: np.ndarray | None = field(default=None, repr=False, compare=False)


_new = object.__new__
_setattr = object.__setattr__


def _hit_unchecked(
    id_: str, score: float, text: str, metadata: dict[str, Any], namespace: str, created_at: float,
    updated_at: float, vector: np.ndarray | None,
) -> Hit:  # fmt: skip
    """``Hit(...)`` without the frozen dataclass's ``__init__``, which sets each of the eight
    fields through ``object.__setattr__`` (about a third of the ~3 us a hit's first read took
    on the development VM): the instance gets its ``__dict__`` in one step, as the dataclass
    would leave it. Guarded by :func:`_fast_hits_work`."""
    h = _new(Hit)
    _setattr(h, "__dict__", {"id": id_, "score": score, "text": text, "metadata": metadata,
                             "namespace": namespace, "created_at": created_at, "updated_at": updated_at,
                             "vector": vector})  # fmt: skip
    return h


def _fast_hits_work() -> bool:
    """Whether :func:`_hit_unchecked` builds exactly what ``Hit(...)`` builds (same fields in
    the same order, no ``__post_init__``, no slots)."""
    try:
        args = ("id-1", 0.5, "text", {"k": [1]}, "ns", 1.0, 2.0, None)
        want, got = Hit(*args), _hit_unchecked(*args)
        return (
            not hasattr(Hit, "__post_init__")
            and not hasattr(Hit, "__slots__")
            and [f.name for f in fields(Hit)] == list(got.__dict__)
            and got == want
            and got.__dict__ == want.__dict__
            and repr(got) == repr(want)
        )
    except Exception:
        return False


_make_hit = _hit_unchecked if _fast_hits_work() else Hit


class RecallResult(Sequence[Hit]):
    """Top-k of one query, best first.

    Attributes:
        scores: float32 array of the similarities (cosine, inner product, or negated L2
            distance), highest first.
        rows: int32 array of the sidecar's internal row numbers (diagnostics only: rows are
            reused after deletes).
        vectors: the stored vectors (float32, one row per hit) when asked with
            ``with_vectors=True``, else None.
        ids: the ids of the hits (decoded on first access).
    """

    __slots__ = ("_docs", "_ids", "_items", "namespace", "rows", "scores", "vectors")

    def __init__(
        self,
        rows: np.ndarray,
        scores: np.ndarray,
        docs: Sequence[memoryview] | None,
        vectors: np.ndarray | None = None,
        namespace: str = "",
    ) -> None:
        self.rows = rows
        self.scores = scores
        self.vectors = vectors
        self.namespace = namespace
        self._docs = docs
        self._ids: list[str] | None = None
        self._items: list[Hit | None] | None = None  # Hits built so far (made on first access)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> list[str]:
        if self._ids is None:
            if self._docs is None:
                raise ValueError("this recall was made with docs=False: only rows and scores")
            self._ids = [doc_id(d) for d in self._docs]
        return self._ids

    def __getitem__(self, i: int) -> Hit:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]  # type: ignore[return-value]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        items = self._items
        if items is None:
            items = self._items = [None] * len(self.rows)
        hit = items[i]
        if hit is None:
            if self._docs is None:
                raise ValueError("this recall was made with docs=False: only rows and scores")
            doc = self._docs[i]
            id_, text, metadata = decode_doc_fields(doc)  # (no Doc object on the way)
            created, updated = doc_times(doc)
            vec = None if self.vectors is None else self.vectors[i]
            hit = _make_hit(id_, float(self.scores[i]), text, metadata, self.namespace, created, updated, vec)
            items[i] = hit
        return hit

    def id_text_metadata(
        self, which: Iterable[int] | None = None
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """``(id, text, metadata)`` of every hit (or of the hits at indices ``which``), in order.

        For adapters that build their own objects (LangChain ``Document`` objects): hits not
        read yet are decoded without building :class:`Hit` objects (about 1 us less per hit)
        and are not cached, so each call returns freshly decoded metadata dicts; a hit
        already read as a ``Hit`` gives that ``Hit``'s values.
        """
        docs, items = self._docs, self._items
        if docs is None:
            raise ValueError("this recall was made with docs=False: only rows and scores")
        if items is None:  # the common case: none read yet
            picked = docs if which is None else [docs[i] for i in which]
            return [decode_doc_fields(d) for d in picked]
        out = []
        for i in range(len(items)) if which is None else which:
            hit = items[i]
            if hit is None:
                out.append(decode_doc_fields(docs[i]))
            else:
                out.append((hit.id, hit.text, hit.metadata))
        return out

    def __iter__(self) -> Iterator[Hit]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"RecallResult(n={len(self)}, scores={np.array2string(self.scores, precision=3)})"

"""What the client returns: numpy scores plus documents decoded only when touched.

A recall's response is copied out of the slot in one piece (so the slot can serve the next
request at once) and kept as bytes; :class:`RecallResult` decodes a document's id, text and
metadata the first time someone reads it. A caller that only needs ids and scores never pays
for JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, overload

import numpy as np

from .protocol import Doc, DocViews, decode_doc_fields, doc_id, doc_times

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


_LATER: Any = object()  # a batch result's share not cut from its batch yet


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

    __slots__ = ("_batch", "_docs", "_i", "_ids", "_items", "_rows", "_scores", "_vectors", "namespace")

    def __init__(
        self,
        rows: np.ndarray,
        scores: np.ndarray,
        docs: Sequence[memoryview] | None,
        vectors: np.ndarray | None = None,
        namespace: str = "",
    ) -> None:
        self._rows = rows
        self._scores = scores
        self._vectors = vectors
        self._docs = docs
        self._batch: _Batch | None = None
        self._i = 0
        self.namespace = namespace
        self._ids: list[str] | None = None
        self._items: list[Hit | None] | None = None  # Hits built so far (made on first access)

    @classmethod
    def batch(
        cls,
        rows: np.ndarray,
        scores: np.ndarray,
        docs: Sequence[memoryview] | None,
        vectors: np.ndarray | None = None,
        namespace: str = "",
    ) -> list[RecallResult]:
        """The results of a batch of queries answered together: row ``i`` of ``rows`` and
        ``scores`` (2-D, one row per query, equal counts), the ``i``-th equal share of
        ``docs`` and of ``vectors``, for each query ``i``.

        Each result cuts its share (array views, a :class:`DocViews` or a list slice) the
        first time it is read. A batch of 64 queries made 64 row views, 64 score views and 64
        document views up front, a third of the client's Python per batch on the development
        VM (``benchmarks/client_overhead.py --batch 64``), for callers that often read a few.

        Raises:
            ValueError: ``docs`` or ``vectors`` do not split into equal shares, one per row.
        """
        nq, per = rows.shape[0], rows.shape[1]
        if docs is not None and len(docs) != nq * per:
            raise ValueError(f"{len(docs)} documents do not split into {nq} equal parts")
        if vectors is not None and len(vectors) != nq * per:
            raise ValueError(f"{len(vectors)} vectors do not split into {nq} equal parts")
        b = _Batch(rows, scores, docs, vectors, per)
        new, out = cls.__new__, []
        for i in range(nq):
            r = new(cls)
            r._batch, r._i, r.namespace = b, i, namespace
            r._rows = r._scores = r._vectors = r._docs = _LATER
            r._ids = r._items = None
            out.append(r)
        return out

    # A batch's share is cut from the batch when first read (``_LATER`` until then); what is
    # assigned is kept as given, as when these were plain attributes.
    @property
    def rows(self) -> np.ndarray:
        r = self._rows
        if r is _LATER:
            r = self._rows = self._batch.rows[self._i]  # type: ignore[union-attr]
        return r  # type: ignore[return-value]

    @rows.setter
    def rows(self, value: np.ndarray) -> None:
        self._rows = value

    @property
    def scores(self) -> np.ndarray:
        s = self._scores
        if s is _LATER:
            s = self._scores = self._batch.scores[self._i]  # type: ignore[union-attr]
        return s  # type: ignore[return-value]

    @scores.setter
    def scores(self, value: np.ndarray) -> None:
        self._scores = value

    @property
    def vectors(self) -> np.ndarray | None:
        v = self._vectors
        if v is _LATER:
            b = self._batch
            assert b is not None
            v = self._vectors = None if b.vectors is None else b.vectors[self._i * b.per : (self._i + 1) * b.per]
        return v  # type: ignore[return-value]

    @vectors.setter
    def vectors(self, value: np.ndarray | None) -> None:
        self._vectors = value

    def _doc_seq(self) -> Sequence[memoryview] | None:
        d = self._docs
        if d is _LATER:
            b = self._batch
            assert b is not None
            a, bd = self._i * b.per, b.docs
            if bd is None:
                d = None
            else:
                d = bd.part(a, b.per) if isinstance(bd, DocViews) else bd[a : a + b.per]
            self._docs = d
        return d  # type: ignore[return-value]

    def __len__(self) -> int:
        r = self._rows
        return self._batch.per if r is _LATER else len(r)  # type: ignore[union-attr, arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        # this query's share only (a batch's share would otherwise carry the whole batch); the
        # documents as bytes (a response's are memoryviews, which do not pickle)
        docs = self._doc_seq()
        if docs is not None:
            docs = [bytes(d) for d in docs]
        return (RecallResult, (self.rows, self.scores, docs, self.vectors, self.namespace))

    @property
    def ids(self) -> list[str]:
        if self._ids is None:
            docs = self._doc_seq()
            if docs is None:
                raise ValueError("this recall was made with docs=False: only rows and scores")
            self._ids = [doc_id(d) for d in docs]
        return self._ids

    @overload  # type: ignore[override]
    def __getitem__(self, i: int) -> Hit: ...
    @overload
    def __getitem__(self, i: slice) -> list[Hit]: ...
    def __getitem__(self, i: int | slice) -> Hit | list[Hit]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        items = self._items
        if items is None:
            items = self._items = [None] * len(self)
        try:
            hit = items[i]
        except IndexError:
            raise IndexError(i) from None
        if hit is None:
            if i < 0:  # (from the end: the same document, score and vector as the hit's place)
                i += len(items)
            # (slots first, the properties only for a batch's share not cut yet: a batch's
            # first reads pay no more than results cut up front)
            docs = self._docs
            if docs is _LATER:
                docs = self._doc_seq()
            if docs is None:
                raise ValueError("this recall was made with docs=False: only rows and scores")
            doc = docs[i]
            id_, text, metadata = decode_doc_fields(doc)  # (no Doc object on the way)
            created, updated = doc_times(doc)
            vectors = self._vectors
            if vectors is _LATER:
                vectors = self.vectors if self._batch.vectors is not None else None  # type: ignore[union-attr]
            scores = self._scores
            if scores is _LATER:
                scores = self.scores
            vec = None if vectors is None else vectors[i]
            hit = _make_hit(id_, float(scores[i]), text, metadata, self.namespace, created, updated, vec)
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
        docs, items = self._doc_seq(), self._items
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


class _Batch:
    """One answer's arrays, shared by the :class:`RecallResult` of each of its queries."""

    __slots__ = ("docs", "per", "rows", "scores", "vectors")

    def __init__(
        self, rows: np.ndarray, scores: np.ndarray, docs: Sequence[memoryview] | None, vectors: np.ndarray | None,
        per: int,
    ) -> None:  # fmt: skip
        self.rows, self.scores, self.docs, self.vectors, self.per = rows, scores, docs, vectors, per

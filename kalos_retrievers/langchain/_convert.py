"""Document <-> row mapping, in one place.

A LangChain ``Document`` is stored as one Kalos row: ``Document.id`` is the row id,
``page_content`` the text, ``metadata`` the metadata, unchanged. Nothing is added to the
metadata on the way in or out (no score, no internal key): scores travel beside the document,
as LangChain's ``(Document, score)`` tuples.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from langchain_core.documents import Document
from langchain_core.vectorstores.utils import maximal_marginal_relevance

from ..client import MAX_ID_BYTES
from ..results import Hit, RecallResult, Record

__all__ = ["Rows", "as_matrix", "docs_of", "make_document", "mmr_of", "scored_of", "to_document",
           "to_rows"]  # fmt: skip


_new = object.__new__
_setattr = object.__setattr__


def _document_unchecked(text: str, metadata: dict[str, Any], id_: str) -> Document:
    """``Document(page_content=text, metadata=metadata, id=id_)`` for values whose types are
    known to be right (a str, a dict, a str, as Kalos decodes them), without pydantic's
    validation: what ``model_construct`` does, in about half the time of ``Document(...)``
    (1.5 us on the development VM, paid k times per call). The metadata dict is the decoded
    one, not a copy (``Document(...)`` copies it): it belongs to this Document alone.
    Guarded by :func:`_fast_documents_work`; any mismatch falls back to ``Document(...)``.
    """
    d = _new(Document)
    _setattr(d, "__dict__", {"id": id_, "metadata": metadata, "page_content": text,
                             "type": "Document"})  # fmt: skip
    _setattr(d, "__pydantic_fields_set__", {"id", "metadata", "page_content"})
    _setattr(d, "__pydantic_extra__", None)
    _setattr(d, "__pydantic_private__", None)
    return d


def _document_checked(text: Any, metadata: Any, id_: Any) -> Document:
    return Document(page_content=text, metadata=metadata, id=id_)


def _fast_documents_work() -> bool:
    """Whether :func:`_document_unchecked` builds exactly what ``Document(...)`` builds with
    this langchain-core and pydantic (same fields, same state, no post-init hook)."""
    try:
        if set(Document.model_fields) != {"id", "metadata", "page_content", "type"}:
            return False
        if getattr(Document, "__pydantic_post_init__", None) is not None:
            return False
        meta = {"k": [1, {"n": None}]}
        want = Document(page_content="text", metadata=dict(meta), id="id-1")
        got = _document_unchecked("text", dict(meta), "id-1")
        return (
            got == want
            and got.__dict__ == want.__dict__
            and list(got.__dict__) == list(want.__dict__)
            and got.model_fields_set == want.model_fields_set
            and got.__pydantic_extra__ == want.__pydantic_extra__
            and got.__pydantic_private__ == want.__pydantic_private__
            and got.model_dump() == want.model_dump()
            and repr(got) == repr(want)
        )
    except Exception:
        return False


_FAST = _fast_documents_work()


def make_document(text: str, metadata: dict[str, Any], id_: str) -> Document:
    """The Document for one stored row (``Document.id`` is the row id, ``metadata`` the
    stored metadata, unchanged)."""
    if _FAST and type(text) is str and type(metadata) is dict and type(id_) is str:
        return _document_unchecked(text, metadata, id_)
    return _document_checked(text, metadata, id_)


def to_document(row: Hit | Record) -> Document:
    """The Document a recall hit or a stored record stands for."""
    return make_document(row.text, row.metadata, row.id)


@dataclass(frozen=True)
class Rows:
    """What one ``add_texts`` call writes: parallel lists, one entry per text."""

    ids: list[str]
    texts: list[str]
    metadatas: list[Mapping[str, Any] | None]


def to_rows(
    texts: Iterable[str],
    metadatas: Sequence[Mapping[str, Any] | None] | None,
    ids: Sequence[str | None] | None,
) -> Rows:
    """Check ``add_texts`` arguments against each other and fill in missing ids.

    An id that is ``None`` or ``""`` (``add_documents`` with some ``Document.id`` unset: a
    ``Document``'s id may be either) gets a fresh UUID, as does every row when ``ids`` is None
    (LangChain's in-memory store does the same).

    Raises:
        TypeError: ``texts`` or ``ids`` is a single string, or a text is not a string.
        ValueError: ``metadatas`` or ``ids`` has a different length than ``texts``.
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string")
    text_list = list(texts)
    n = len(text_list)
    for i, t in enumerate(text_list):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
    if metadatas is None:
        metas: list[Mapping[str, Any] | None] = [None] * n
    else:
        metas = list(metadatas)
        if len(metas) != n:
            raise ValueError(f"metadatas has {len(metas)} entries but texts has {n}")
    if ids is None:
        id_list = [uuid.uuid4().hex for _ in range(n)]
    else:
        if isinstance(ids, str):
            raise TypeError("ids must be a list of strings, not one string")
        given = list(ids)
        if len(given) != n:
            raise ValueError(f"ids has {len(given)} entries but texts has {n}")
        id_list = [uuid.uuid4().hex if x is None or x == "" else x for x in given]
    return Rows(id_list, text_list, metas)


def findable(ids: Sequence[str]) -> list[str]:
    """``ids`` less those no row can have (empty, over ``MAX_ID_BYTES`` bytes of UTF-8, not
    UTF-8 at all): ``get_by_ids`` and ``delete`` treat them as not found, as LangChain's
    contract asks of ids that are not stored, where the client refuses them as arguments.
    Anything not a string is left in, for the client's error."""
    if isinstance(ids, str):
        raise TypeError("ids must be a list of strings, not one string")
    return [x for x in ids if not isinstance(x, str) or _storable(x)]


def _storable(x: str) -> bool:
    try:
        return 0 < len(x.encode()) <= MAX_ID_BYTES
    except UnicodeEncodeError:
        return False


def as_matrix(vectors: Any, n: int, what: str) -> np.ndarray:
    """Embedding output as an (n, d) float32 array.

    Raises:
        ValueError: the embedding model returned the wrong number of vectors or ragged ones.
    """
    try:
        arr = np.asarray(vectors, dtype=np.float32)
    except ValueError as e:
        raise ValueError(f"{what} returned vectors of different lengths: {e}") from None
    if n == 0:
        return arr.reshape(0, arr.shape[-1] if arr.ndim == 2 else 0)
    if arr.ndim != 2 or arr.shape[0] != n:
        raise ValueError(f"{what} returned {arr.shape} for {n} texts; expected ({n}, dim)")
    return arr


def docs_of(res: RecallResult) -> list[Document]:
    """The hits of a recall as Documents, best first (no ``Hit`` objects built on the way)."""
    return [make_document(text, meta, id_) for id_, text, meta in res.id_text_metadata()]


def scored_of(res: RecallResult) -> list[tuple[Document, float]]:
    """The hits as ``(Document, raw score)`` pairs, best first."""
    rows = res.id_text_metadata()
    scores = res.scores.tolist()  # Python floats, as float(res.scores[i])
    return [(make_document(text, meta, id_), score)
            for (id_, text, meta), score in zip(rows, scores, strict=True)]  # fmt: skip


def mmr_of(query: Any, res: RecallResult, k: int, lambda_mult: float) -> list[Document]:
    """``k`` of the hits (recalled with their vectors) chosen by maximal marginal relevance."""
    if not len(res):
        return []
    assert res.vectors is not None
    # typed as list[list[float]], but it only ever calls np.array on it: no copy to lists
    candidates = cast("list[list[float]]", res.vectors)
    chosen = maximal_marginal_relevance(
        np.asarray(query, dtype=np.float32), candidates, lambda_mult=lambda_mult, k=k
    )
    return [make_document(text, meta, id_) for id_, text, meta in res.id_text_metadata(chosen)]

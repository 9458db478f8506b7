"""KalosVectorStore and KalosRetriever without a sidecar: construction and argument checks."""

from __future__ import annotations

import json
import random
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
        ({"similarity_top_k": None}, r"^similarity_top_k=None must be an int >= 1"),
        ({"similarity_top_k": 2.0}, r"^similarity_top_k=2.0 must be an int >= 1"),
        ({"vector_store_query_mode": "hybrid"}, "'default' and 'mmr'"),
        ({"timeout": 0}, "timeout"),
        ({"on_error": "maybe"}, "on_error"),
    ],
)
def test_retriever_arguments_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KalosRetriever(KalosVectorStore(NO_SIDECAR), MockEmbedding(embed_dim=3), **kwargs)


def test_retriever_similarity_top_k_is_settable_and_checked() -> None:
    r = KalosRetriever(KalosVectorStore(NO_SIDECAR), MockEmbedding(embed_dim=3), similarity_top_k=2)
    r.similarity_top_k = 6
    assert r.similarity_top_k == 6
    with pytest.raises(ValueError, match=r"^similarity_top_k=0 must be an int >= 1"):
        r.similarity_top_k = 0
    assert r.similarity_top_k == 6


def test_a_query_without_an_int_similarity_top_k_is_refused_by_name() -> None:
    """(0 or less answers no nodes, without a sidecar; None raised a bare TypeError)"""
    store = KalosVectorStore(NO_SIDECAR)
    assert store.query(VectorStoreQuery(query_embedding=[1.0, 0.0, 0.0], similarity_top_k=0)).ids == []
    for bad in (None, 2.5, True):
        with pytest.raises(ValueError, match=r"^similarity_top_k=.* must be an int"):
            store.query(VectorStoreQuery(query_embedding=[1.0, 0.0, 0.0], similarity_top_k=bad))


@pytest.mark.parametrize("mode", ["hybrid", VectorStoreQueryMode.HYBRID, "sparse"])
def test_an_unsupported_query_mode_is_named_whether_enum_or_string(mode: Any) -> None:
    """VectorStoreQuery does not convert a plain string mode: "hybrid" raised AttributeError
    ('str' object has no attribute 'value') instead of the documented ValueError."""
    with pytest.raises(ValueError, match=r"'default' and 'mmr', not '(hybrid|sparse)'"):
        KalosVectorStore(NO_SIDECAR).query(VectorStoreQuery(query_embedding=[1.0, 0.0, 0.0], mode=mode))


def _pieces_one_by_one(ids: list[Any], budget: int) -> list[list[Any]]:
    """The reference: each id's JSON size counted alone (what ``_id_pieces`` did for every list)."""
    pieces, start, size = [], 0, 2
    for i, node_id in enumerate(ids):
        n = len(json.dumps(str(node_id))) + 1
        if size + n > budget and i > start:
            pieces.append(ids[start:i])
            start, size = i, 2
        size += n
    pieces.append(ids[start:])
    return pieces


def test_id_pieces_match_counting_each_id() -> None:
    """The one-call path (every id a str and all of them fitting) cuts exactly where counting each
    id does, at budgets just below, at and above the whole list's size."""
    from kalos_retrievers.llama_index.vector_store import _id_pieces

    rng = random.Random(7)
    alphabet = ['a', 'Z', '"', "\\", "\n", "é", "\u2028", "😀", "/", " "]
    one_piece = 0
    for _ in range(300):
        ids: list[Any] = ["".join(rng.choices(alphabet, k=rng.randint(0, 9))) for _ in range(rng.randint(1, 13))]
        if rng.random() < 0.2:
            ids[rng.randrange(len(ids))] = rng.randint(0, 999)  # (not a str: the loop's str() of it)
        whole = 2 + sum(len(json.dumps(str(i))) + 1 for i in ids)
        for budget in (whole - 1, whole, whole + 1, max(3, whole // 3)):
            got = _id_pieces(ids, budget)
            assert got == _pieces_one_by_one(ids, budget), (ids, budget)
            one_piece += len(got) == 1
    assert one_piece > 300  # (both paths were taken)


def test_id_pieces_that_fit_are_measured_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """All ids strings and fitting: one ``json.dumps`` of the list, not one per id."""
    from kalos_retrievers.llama_index import vector_store

    seen: list[type] = []
    dumps = json.dumps

    def spy(obj: Any, **kw: Any) -> str:
        seen.append(type(obj))
        return dumps(obj, **kw)

    monkeypatch.setattr(vector_store.json, "dumps", spy)
    assert vector_store._id_pieces(["a", "b", "c"], 100) == [["a", "b", "c"]]
    assert seen == [list]
    seen.clear()
    assert vector_store._id_pieces(["a", 7], 100) == [["a", 7]]  # (a non-str id: counted one by one)
    assert seen == [str, str]

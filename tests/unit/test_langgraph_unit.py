"""KalosStore helpers without a sidecar: namespace encoding, filter split, matching."""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langchain_core.embeddings import DeterministicFakeEmbedding
from langgraph.store.base import (
    GetOp,
    InvalidNamespaceError,
    ListNamespacesOp,
    MatchCondition,
    PutOp,
    SearchOp,
)

from kalos_retrievers.langgraph import (
    KalosStore,
    _book,
    _book_of,
    _compare,
    _does_match,
    _split_filter,
    decode_namespace,
    encode_namespace,
)

LABEL = st.text(alphabet=st.sampled_from("ab.\\/x:é"), min_size=1, max_size=6)


@given(st.lists(LABEL, min_size=1, max_size=5))
def test_namespace_encoding_roundtrips(ns: list[str]) -> None:
    assert decode_namespace(encode_namespace(ns)) == tuple(ns)


@given(st.lists(LABEL, min_size=1, max_size=4), st.lists(LABEL, min_size=1, max_size=4))
def test_namespace_encoding_is_injective(a: list[str], b: list[str]) -> None:
    if a != b:
        assert encode_namespace(a) != encode_namespace(b)


def test_encoding_escapes_the_separator() -> None:
    assert encode_namespace(("a.b", "c")) == "a\\.b.c"
    assert encode_namespace(("a", "b", "c")) == "a.b.c"
    assert encode_namespace(("a\\", "b")) == "a\\\\.b"


def test_filter_split() -> None:
    sidecar, residual = _split_filter(
        {"a": 1, "b": {"$gt": 2, "$lte": 5}, "c": {"x": 1}, "d": [1, 2], "e": {"$eq": [1]}}
    )
    # (1 is asked for with True, which Python's == equates with it; stored booleans take part
    # in ranges as 1 and 0, and both are <= 5)
    b_lte_5 = {"$or": [{"b": {"$lte": 5}}, {"b": {"$in": [False, True]}}]}
    assert sidecar == {"a": {"$in": [1, True]}, "$and": [{"b": {"$gt": 2}}, b_lte_5]}
    assert _split_filter({"a": 3, "b": {"$gt": 2}}) == ({"a": {"$eq": 3}, "b": {"$gt": 2}}, {})
    assert residual == {"c": {"x": 1}, "d": [1, 2], "e": {"$eq": [1]}}
    assert _split_filter(None) == (None, {})


def test_residual_comparison_is_langgraphs() -> None:
    assert _compare({"x": 1, "y": 2}, {"x": 1})
    assert not _compare({"x": 2}, {"x": 1})
    assert not _compare("str", {"x": 1})
    assert _compare([1, 2], [1, 2])
    assert not _compare([1, 2], [1, 2, 3])
    assert _compare([1], {"$eq": [1]})
    assert _compare({"n": 3}, {"n": {"$gt": 2}})
    assert not _compare({"n": "abc"}, {"n": {"$gt": 2}})


def test_namespace_matching_with_wildcards() -> None:
    ns = ("a", "b", "c")
    assert _does_match(MatchCondition("prefix", ("a", "*")), ns)
    assert not _does_match(MatchCondition("prefix", ("b",)), ns)
    assert _does_match(MatchCondition("suffix", ("*", "c")), ns)
    assert not _does_match(MatchCondition("suffix", ("a", "b", "c", "d")), ns)


def test_ops_are_validated_before_anything_is_sent() -> None:
    store = KalosStore("kalos-unit-no-such-sidecar")  # lazy: no sidecar needed to build it
    bad = [
        PutOp(("a.b",), "k", {"v": 1}),      # would alias ("a", "b") if not refused
        PutOp((), "k", {"v": 1}),
        PutOp(("langgraph",), "k", {"v": 1}),
        GetOp(("",), "k"),
        SearchOp(("x\x00",)),
        ListNamespacesOp(match_conditions=(MatchCondition("prefix", ("a.b",)),)),
    ]  # fmt: skip
    for op in bad:
        with pytest.raises(InvalidNamespaceError):
            store.batch([op])
    with pytest.raises(ValueError, match="key is longer"):
        store.batch([PutOp(("a",), "k" * 501, {"v": 1})])
    with pytest.raises(ValueError, match="Unknown operation"):
        store.batch(["not an op"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="prefix"):
        KalosStore("x", prefix="a/b")
    with pytest.raises(InvalidNamespaceError, match="too long"):
        store.batch([PutOp(("x" * 250,), "k", {"v": 1})])


def test_llama_index_embeddings_are_accepted() -> None:
    from llama_index.core.embeddings import MockEmbedding

    store = KalosStore("x", index={"dims": 3, "embed": MockEmbedding(embed_dim=3)})
    assert store.embeddings is not None
    assert store.embeddings.embed_query("q") == [0.5, 0.5, 0.5]
    store2 = KalosStore("x", index={"dims": 3, "embed": DeterministicFakeEmbedding(size=3)})
    assert len(store2.embeddings.embed_documents(["a"])[0]) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(("text", "want"), [
    (_book(2, 5), (2, 5)),
    ('{"vectors": 3}', (3, 3)),  # (an older version's row: its count is its high)
    ('{"vectors": 3, "high": 1}', (3, 3)),
    ('{"vectors": 3, "high": null}', (3, 3)),
    ('{"vectors": null, "high": 5}', (5, 5)),
    ('{"vectors": 3, "high": 1e400}', (3, 3)),
    ('{"vectors": Infinity}', (0, 0)),
    ('{"vectors": true, "high": 2}', (2, 2)),
    ('{"vectors": -2, "high": 2}', (2, 2)),
    ('{"vectors": 2.0}', (0, 0)),
    ("[3]", (0, 0)),
    ("not json", (0, 0)),
    ("", (0, 0)),
    (None, (0, 0)),
])  # fmt: skip
def test_an_item_rows_bookkeeping_is_read_field_by_field_and_never_fails(text: str | None, want: tuple) -> None:
    """``(vectors, high)`` from an item row's text: a field that is not a count reads as the
    other, so a damaged row over-counts its vector rows rather than missing some."""
    assert _book_of(types.SimpleNamespace(text=text)) == want  # type: ignore[arg-type]


def test_without_langgraph_the_import_names_the_extra() -> None:
    """Without LangGraph installed, importing the store says which extra to install (it was a
    bare ModuleNotFoundError); with it, the import works (the control)."""
    import subprocess
    import sys

    code = "import kalos_retrievers.langgraph; print('ok')"
    ok = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr
    gone = subprocess.run([sys.executable, "-P", "-c", "import sys; sys.modules['langgraph'] = None; " + code],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert gone.returncode != 0 and "pip install 'kalos-retrievers[langgraph]'" in gone.stderr, gone.stderr

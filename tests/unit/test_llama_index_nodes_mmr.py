"""Node <-> row mapping and MMR selection: pure functions, no sidecar."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llama_index.core.schema import (
    Document,
    IndexNode,
    NodeRelationship,
    RelatedNodeInfo,
    TextNode,
)

from kalos_retrievers.llama_index.filters import NODE_ID_KEY
from kalos_retrievers.llama_index.mmr import mmr_select, spread_scores
from kalos_retrievers.llama_index.nodes import node_to_row, row_to_node


def _through_json(meta: dict) -> dict:
    return json.loads(json.dumps(meta))  # what the sidecar does to metadata


def test_text_node_roundtrip_keeps_everything() -> None:
    node = TextNode(
        text="Kalos serves recall",
        id_="n-1",
        embedding=[0.1, 0.2, 0.3],
        metadata={"topic": "infra", "year": 2025, "tags": ["a", "b"], "nested": {"k": [1, 2]},
                  "doc_id": "user's own doc_id key"},
        excluded_llm_metadata_keys=["year"],
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id="doc-9"),
                       NodeRelationship.NEXT: RelatedNodeInfo(node_id="n-2")},
    )  # fmt: skip
    node_id, vec, text, meta = node_to_row(node)
    assert (node_id, vec, text) == ("n-1", [0.1, 0.2, 0.3], "Kalos serves recall")
    assert meta[NODE_ID_KEY] == "n-1"
    assert meta["ref_doc_id"] == "doc-9"
    assert meta["topic"] == "infra"  # top level, so filters see it
    back = row_to_node(text, _through_json(meta), node_id)
    assert isinstance(back, TextNode)
    assert back.node_id == "n-1"
    assert back.text == node.text
    assert back.metadata == node.metadata  # including the user's own 'doc_id' key
    assert back.ref_doc_id == "doc-9"
    assert back.relationships == node.relationships
    assert back.excluded_llm_metadata_keys == ["year"]
    assert back.embedding is None


def test_text_is_not_stored_twice_but_empty_text_survives() -> None:
    _, _, text, meta = node_to_row(TextNode(text="hello", id_="a", embedding=[1.0]))
    assert "hello" not in meta["_node_content"]
    _, _, text, meta = node_to_row(TextNode(text="", id_="b", embedding=[1.0]))
    assert text == ""
    assert row_to_node(text, _through_json(meta)).text == ""


def test_index_node_and_document_keep_their_type() -> None:
    idx = IndexNode(text="summary", index_id="sub-index", id_="i1", embedding=[1.0, 0.0])
    back = _back(idx)
    assert isinstance(back, IndexNode)
    assert back.index_id == "sub-index"
    doc = Document(text="doc text", doc_id="d1", embedding=[0.0, 1.0], metadata={"a": 1})
    back = _back(doc)
    assert back.node_id == "d1"
    assert back.metadata == {"a": 1}
    assert back.get_content() == "doc text"
    # a Document comes back a Document, equal to what went in (it came back a TextNode)
    assert type(back) is Document
    assert back.model_dump(exclude={"embedding"}) == doc.model_dump(exclude={"embedding"})


def test_text_resources_and_image_documents_come_back_whole() -> None:
    """A Node's or Document's text_resource keeps its path, url and mimetype (LlamaIndex's
    remove_text drops them with the text), and an ImageDocument comes back an ImageDocument
    with its image_resource (it came back a TextNode); each equals what went in."""
    from llama_index.core.schema import ImageDocument, MediaResource, Node

    made = [
        Document(text_resource=MediaResource(text="# T\nbody", path="/d/a.md", url="https://x/a.md",
                                             mimetype="text/markdown"), id_="d", embedding=[1.0, 0.0]),
        Node(text_resource=MediaResource(text="hello", path="/p.html", mimetype="text/html"), id_="n",
             embedding=[0.0, 1.0], metadata={"k": 2}),
        ImageDocument(text="a cat", image_resource=MediaResource(path="/photos/cat.png", url="https://x/cat.png",
                                                                 mimetype="image/png"), id_="i", embedding=[1.0, 1.0]),
        Document(text="plain", id_="p", embedding=[1.0, 0.0]),  # (nothing but text: as before)
        Node(text_resource=MediaResource(text=""), id_="e", embedding=[1.0, 0.0]),  # (no text)
    ]  # fmt: skip
    for node in made:
        back = _back(node)
        assert type(back) is type(node), node.node_id
        assert back.model_dump(exclude={"embedding"}) == node.model_dump(exclude={"embedding"}), node.node_id
    _, _, text, meta = node_to_row(made[0])
    assert text == "# T\nbody" and "body" not in meta["_node_content"]  # (the text is not stored twice)


def _back(node):  # type: ignore[no-untyped-def]
    node_id, _, text, meta = node_to_row(node)
    return row_to_node(text, _through_json(meta), node_id)


def test_a_row_llama_index_did_not_write_reads_as_a_text_node() -> None:
    """A row written by the LangChain store or KalosClient.upsert has no serialized node: it
    comes back as a TextNode with the row's id, text and metadata (not an error)."""
    back = row_to_node("written by LangChain", {"source": "web", "doc_id": "d", NODE_ID_KEY: "lc-1"}, "lc-1")
    assert isinstance(back, TextNode)
    assert (back.node_id, back.text) == ("lc-1", "written by LangChain")
    assert back.metadata == {"source": "web", "doc_id": "d"}
    assert row_to_node("", {}, "v").text == ""


def test_node_without_embedding_is_refused() -> None:
    with pytest.raises(ValueError, match="has no embedding"):
        node_to_row(TextNode(text="x", id_="x"))


def test_mmr_prefers_diversity_and_threshold_one_is_plain_ranking() -> None:
    q = np.array([1.0, 0.0, 0.0])
    cands = np.array([
        [1.0, 0.05, 0.0],   # best
        [1.0, 0.06, 0.0],   # near-duplicate of the best
        [0.7, 0.0, 0.7],    # less similar, but different
    ])  # fmt: skip
    assert mmr_select(q, cands, 2, threshold=1.0) == [0, 1]
    assert mmr_select(q, cands, 2, threshold=0.5) == [0, 2]
    assert mmr_select(q, cands, 10, threshold=0.5) == [0, 2, 1]  # k > n: all, no repeats
    assert mmr_select(q, cands[:0], 3) == []
    with pytest.raises(ValueError, match="mmr_threshold"):
        mmr_select(q, cands, 2, threshold=1.5)


def test_mmr_ranks_by_the_relevance_given() -> None:
    """With ``relevance`` (an ip or L2 sidecar's scores, on cosine's scale) threshold 1 ranks
    by it, not by the cosine to the query; the diversity term is still the cosine."""
    q = np.array([1.0, 0.0, 0.0])
    cands = np.array([[1.0, 0.0, 0.0], [10.0, 0.1, 0.0], [1.0, 0.5, 0.0]])
    rel = np.array([1.0, -0.8, 0.5])  # (L2: [0] at distance 0, [1] ~9 away, [2] 0.5 away)
    assert mmr_select(q, cands, 3, threshold=1.0) == [0, 1, 2]  # (by cosine: [1] points the query's way)
    assert mmr_select(q, cands, 3, threshold=1.0, relevance=rel) == [0, 2, 1]


def test_spread_scores_keep_the_order_of_unbounded_scores() -> None:
    """Inner products of 40, 35, 30, 1.2, 1.1 stay apart (clipped relevance made them all 1,
    and MMR at threshold 0.99 then ranked by diversity alone); negated distances too."""
    ip = spread_scores(np.array([40.0, 35.0, 30.0, 1.2, 1.1]))
    assert ip[0] == 1.0 and ip[-1] == -1.0 and list(ip) == sorted(ip, reverse=True) and len(set(ip)) == 5
    assert list(spread_scores(np.array([-10.0, -20.0, -30.0]))) == [1.0, 0.0, -1.0]
    assert list(spread_scores(np.array([3.0, 3.0]))) == [1.0, 1.0] and len(spread_scores(np.array([]))) == 0
    # one non-finite score does not flatten the rest (it had made every candidate 1)
    mixed = spread_scores(np.array([-1.0, -2.0, -3.0, -np.inf, np.nan, np.inf]))
    assert list(mixed) == [1.0, 0.0, -1.0, -1.0, -1.0, 1.0]
    assert list(spread_scores(np.array([-np.inf, np.nan]))) == [-1.0, -1.0]
    e = np.eye(5)
    cands = np.array([e[0], e[0] + 0.01 * e[1], e[0] + 0.02 * e[2], e[3], e[4]])  # 1-2 twins of 0; 3, 4 apart
    order = mmr_select(e[0], cands, 3, threshold=0.99, relevance=spread_scores(np.array([40.0, 35.0, 30.0, 1.2, 1.1])))
    assert order == [0, 1, 2]


def test_mmr_penalty_is_to_the_closest_chosen_not_the_last() -> None:
    # Picks 0, then 2; for the third pick, candidate 1 (a copy of 0) must still be penalized by
    # its similarity to 0. A penalty by the last pick only (2, nearly orthogonal to 1) would
    # rank 1 above 3: 0.3 - 0.7 * 0.2 = 0.16 > 0.6 * 0.16.
    q = np.array([1.0, 0.0, 0.0, 0.0])
    cands = np.array([
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [0.2, 0.979796, 0.0, 0.0],
        [0.6, 0.0, 0.8, 0.0],
    ])  # fmt: skip
    assert mmr_select(q, cands, 3, threshold=0.3) == [0, 2, 3]

"""KalosVectorStore against a real sidecar: a LlamaIndex counterpart of LangChain's standard
``VectorStoreIntegrationTests`` (empty store, add/query, overwrite, deletes, get_nodes, every
filter operator, nested filters, id restrictions, MMR). Every test runs twice: through the
sync API and through its async twin.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import numpy as np
import pytest
from kalos_testing import is_top_k
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)

from kalos_retrievers import KalosClient, Sidecar
from kalos_retrievers.llama_index import KalosVectorStore

F = FilterOperator
DIM = 8  # shared_sidecar's


def vec(text: str, dim: int = DIM) -> list[float]:
    """A deterministic unit vector per text: the same text always lands on the same point."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(dim)
    return (v / np.linalg.norm(v)).tolist()


def node(id_: str, text: str | None = None, *, doc: str | None = None, **metadata: Any) -> TextNode:
    n = TextNode(id_=id_, text=text if text is not None else f"text of {id_}",
                 embedding=vec(text if text is not None else id_), metadata=metadata)  # fmt: skip
    if doc is not None:
        n.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=doc)
    return n


def mf(*filters: Any, condition: str = "and") -> MetadataFilters:
    return MetadataFilters(filters=list(filters), condition=FilterCondition(condition))


class Api:
    """The store's sync API, or its async twins, behind one awaitable interface."""

    _ASYNC: ClassVar[dict[str, str]] = {
        "add": "async_add",
        "delete": "adelete",
        "query": "aquery",
        "get_nodes": "aget_nodes",
        "delete_nodes": "adelete_nodes",
        "clear": "aclear",
    }

    def __init__(self, store: KalosVectorStore, use_async: bool) -> None:
        self.store = store
        self.use_async = use_async

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.use_async:
                return await getattr(self.store, self._ASYNC[name])(*args, **kwargs)
            return getattr(self.store, name)(*args, **kwargs)

        return call

    async def search(self, text: str, k: int = 10, **kw: Any) -> VectorStoreQueryResult:
        q = VectorStoreQuery(query_embedding=vec(text), similarity_top_k=k, **kw)
        return await self.query(q)

    async def ids(self, filters: MetadataFilters | None = None, **kw: Any) -> set[str]:
        res = await self.search("anything", 50, filters=filters, **kw)
        assert res.ids is not None
        return set(res.ids)


@pytest.fixture(params=["sync", "async"])
async def api(request: pytest.FixtureRequest, shared_sidecar: Sidecar) -> AsyncIterator[Api]:
    store = KalosVectorStore(shared_sidecar.name, namespace=f"li-{uuid.uuid4().hex[:10]}")
    yield Api(store, request.param == "async")
    store.clear()
    store.close()


# ---------------------------------------------------------------------------------------------
# basics


async def test_empty_store(api: Api) -> None:
    res = await api.search("foo", 4)
    assert (res.nodes, res.similarities, res.ids) == ([], [], [])
    assert await api.get_nodes() == []
    await api.delete("no-such-doc")  # deleting from an empty store is fine
    await api.clear()


async def test_add_then_query_returns_nodes_similarities_ids(api: Api) -> None:
    ids = await api.add([node("a", "foo"), node("b", "bar"), node("c", "baz")])
    assert ids == ["a", "b", "c"]
    res = await api.search("foo", 2)
    assert res.ids is not None
    assert res.nodes is not None
    assert res.similarities is not None
    assert res.ids[0] == "a"
    assert len(res.ids) == len(res.nodes) == len(res.similarities) == 2
    assert res.nodes[0].get_content() == "foo"
    assert res.similarities[0] == pytest.approx(1.0, abs=1e-5)  # cosine of identical vectors
    assert res.similarities[0] >= res.similarities[1]
    assert [n.node_id for n in res.nodes] == res.ids


async def test_similarity_top_k_is_honoured(api: Api) -> None:
    await api.add([node(f"n{i}") for i in range(11)])
    for k in (1, 3, 11, 50):
        res = await api.search("n4", k)
        assert len(res.ids or []) == min(k, 11)
    assert (await api.search("n4", 1)).ids == ["n4"]


async def test_node_comes_back_unchanged(api: Api) -> None:
    original = node("a", "foo", doc="doc-1", topic="t", year=2024, tags=["x"], deep={"k": [1]})
    original.excluded_embed_metadata_keys = ["year"]
    await api.add([original])
    (got,) = await api.get_nodes(["a"])
    assert got.node_id == "a"
    assert got.get_content() == "foo"
    assert got.metadata == original.metadata
    assert got.ref_doc_id == "doc-1"
    assert got.relationships == original.relationships
    assert got.excluded_embed_metadata_keys == ["year"]
    (hit,) = (await api.search("foo", 1)).nodes or []
    assert hit.metadata == original.metadata


async def test_rows_written_outside_llama_index_read_as_text_nodes(api: Api) -> None:
    """Rows a KalosClient (or the LangChain store) wrote into the namespace have no serialized
    node: query, get_nodes and filters still work and give TextNodes with their id, text and
    metadata."""
    store = api.store
    with KalosClient(store.name) as c:
        c.upsert(["raw-1", "raw-2"], np.array([vec("plain text row"), vec("other row")], np.float32),
                 texts=["plain text row", "other row"], metadatas=[{"src": "raw"}, None],
                 namespace=store.namespace)  # fmt: skip
    await api.add([node("li-1", "plain text row from llama", src="li")])
    res = await api.search("plain text row", 3)
    assert res.ids is not None and res.nodes is not None and set(res.ids) == {"raw-1", "raw-2", "li-1"}
    raw = {n.node_id: n for n in res.nodes}
    assert isinstance(raw["raw-1"], TextNode) and raw["raw-1"].text == "plain text row"
    assert raw["raw-1"].metadata == {"src": "raw"} and raw["raw-2"].metadata == {}
    assert [n.node_id for n in await api.get_nodes(node_ids=["raw-2", "li-1"])] == ["raw-2", "li-1"]
    assert await api.ids(mf(MetadataFilter(key="src", value="raw"))) == {"raw-1"}
    # ids and a filter: found by row id (such rows have no _node_id to filter on; they were
    # missed), the filter checked on what was found
    raw_only = mf(MetadataFilter(key="src", value="raw"))
    assert [n.node_id for n in await api.get_nodes(["li-1", "raw-1", "raw-2"], filters=raw_only)] == ["raw-1"]
    assert [n.node_id for n in await api.get_nodes(["raw-2", "raw-2"], filters=mf())] == ["raw-2"]


async def test_nodes_without_text_are_stored(api: Api) -> None:
    with_text, without = node("t", "has text"), node("e", "")
    without.embedding = vec("empty")
    await api.add([with_text, without])
    got = {n.node_id: n.get_content() for n in await api.get_nodes()}
    assert got == {"t": "has text", "e": ""}


async def test_overwrite_by_id(api: Api) -> None:
    await api.add([node("x", "old text", v=1)])
    await api.add([node("x", "new text", v=2)])
    nodes = await api.get_nodes()
    assert [(n.node_id, n.get_content(), n.metadata["v"]) for n in nodes] == [("x", "new text", 2)]
    assert await api.ids(mf(MetadataFilter(key="v", value=1))) == set()
    # the last of duplicate ids in one call wins, as one at a time would
    await api.add([node("y", "first"), node("y", "second")])
    assert [n.get_content() for n in await api.get_nodes(["y"])] == ["second"]


async def test_wrong_dimension_is_refused(api: Api) -> None:
    bad = TextNode(id_="bad", text="x", embedding=[1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="dim"):
        await api.add([bad])


async def test_a_refused_add_stores_none_of_its_nodes(api: Api) -> None:
    """Nodes with and without text, checked all before any is sent; errors name the node."""
    good = node("good")
    empty = TextNode(id_="no-text", text="", embedding=vec("e"))
    for bad, match in [
        (TextNode(id_="zero", text="", embedding=[0.0] * DIM), r"nodes\[2\] \(id 'zero'\) has an all-zero"),
        (TextNode(id_="nan", text="x", embedding=[float("nan")] * DIM), r"nodes\[2\] \(id 'nan'\) .* NaN"),
        (TextNode(id_="short", text="x", embedding=[1.0]), r"nodes\[2\] \(id 'short'\) has a 1-dim"),
        (node("big", "y" * (2 << 20)), r"^nodes\[2\] \(id 'big'\): texts/metadatas\[2\] is too large"),
        (node("odd", "y", n=10**400), r"^nodes\[2\] \(id 'odd'\): metadatas\[2\]\['n'\] is an integer beyond"),
        (TextNode(id_="unembedded", text="x"), r"^nodes\[2\] \(id 'unembedded'\) has no embedding"),
    ]:
        with pytest.raises(ValueError, match=match):
            await api.add([good, empty, bad])
    assert await api.get_nodes(["good", "no-text"]) == []
    assert await api.add([good, empty]) == ["good", "no-text"]  # the control
    assert [n.node_id for n in await api.get_nodes(["good", "no-text"])] == ["good", "no-text"]


async def test_node_ids_longer_than_a_request_are_searched_in_pieces(
    start_sidecar: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``VectorStoreIndex.as_retriever`` passes every node id of an index that keeps its nodes:
    a list longer than a request holds is searched in pieces, and the answer is still the true
    top-k among those nodes (float64 reference)."""
    dim, n, k = 97, 1503, 10
    sc = start_sidecar(dim=dim, payload_kb=16)
    rng = np.random.default_rng()
    data = rng.standard_normal((n, dim))
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    ids = [f"node-{i:05d}-{'x' * (i % 23)}" for i in range(n)]
    store = KalosVectorStore(sc.name, timeout=10)
    store.add([TextNode(id_=ids[i], text=f"t{i}", embedding=data[i].tolist()) for i in range(n)])
    keep = sorted(rng.choice(n, size=1001, replace=False).tolist())
    q = rng.standard_normal(dim)
    q /= np.linalg.norm(q)
    want = [ids[keep[j]] for j in np.argsort(-(data[keep] @ q))[:k]]
    assert len(_id_pieces_of(store, [ids[i] for i in keep])) > 2
    query = VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=k, node_ids=[ids[i] for i in keep])
    place = {ids[i]: j for j, i in enumerate(keep)}
    for res in (store.query(query), await store.aquery(query)):  # (an order flip within float32's precision: fine)
        assert res.ids is not None and all(i in place for i in res.ids), res.ids
        assert is_top_k(data[keep] @ q, [place[i] for i in res.ids], k, atol=1e-6), (res.ids, want)
        assert res.similarities == pytest.approx(sorted(data[keep] @ q, reverse=True)[:k], abs=1e-5)
    query.mode = VectorStoreQueryMode.MMR
    mmr = store.query(query)
    assert len(mmr.ids or []) == k and set(mmr.ids or []) <= {ids[i] for i in keep}
    monkeypatch.setattr(store, "_id_bytes", lambda: 1 << 30)  # the control: in one request
    query.mode = VectorStoreQueryMode.DEFAULT
    with pytest.raises(ValueError, match="payload"):
        store.query(query)
    store.close()


def test_pieces_of_node_ids_merge_best_first_and_each_id_once(start_sidecar: Any) -> None:
    """However few rows the pieces find, the answer is best first, and an id given twice (in
    two pieces) comes back once."""
    sc = start_sidecar(dim=DIM, payload_kb=1)
    store = KalosVectorStore(sc.name, timeout=10)
    e = np.eye(DIM)
    store.add([TextNode(id_="near", text="near", embedding=e[0].tolist()),
               TextNode(id_="far", text="far", embedding=e[1].tolist())])  # fmt: skip
    fillers = [f"unknown-{i:04d}" for i in range(100)]
    assert len(_id_pieces_of(store, ["far", *fillers, "near"])) > 1
    for mode in (VectorStoreQueryMode.DEFAULT, VectorStoreQueryMode.MMR):
        q = VectorStoreQuery(query_embedding=e[0].tolist(), similarity_top_k=5, mode=mode,
                             node_ids=["far", *fillers, "near", "far"])  # fmt: skip
        res = store.query(q)
        assert res.ids == ["near", "far"], mode
        assert res.similarities == pytest.approx([1.0, 0.0], abs=1e-5)
    store.close()


async def test_doc_ids_longer_than_a_request_are_searched_in_pieces_with_node_ids_too(
    start_sidecar: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long ``doc_ids`` list is cut into pieces as ``node_ids`` is (it was sent whole and
    refused as too large for the payload), and a query with both long lists searches each
    piece of one with each of the other: the answer is the true top-k of the nodes both
    allow (float64 reference), best first, each id once."""
    dim, n, k = 13, 301, 7
    sc = start_sidecar(dim=dim, payload_kb=1)
    rng = np.random.default_rng()
    data = rng.standard_normal((n, dim))
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    docs = [f"document-{i:04d}-{'y' * (i % 7)}" for i in range(n)]  # (one node per document)
    nodes = []
    for i in range(n):
        nodes.append(TextNode(id_=f"node-{i:04d}", text=f"t{i}", embedding=data[i].tolist()))
        nodes[-1].relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=docs[i])
    store = KalosVectorStore(sc.name, timeout=10)
    store.add(nodes)
    by_doc = sorted(rng.choice(n, size=211, replace=False).tolist())
    by_node = sorted(rng.choice(n, size=173, replace=False).tolist())
    q = rng.standard_normal(dim)
    q /= np.linalg.norm(q)
    for node_rows in (None, by_node):
        allowed = sorted(set(by_doc) & set(node_rows if node_rows is not None else range(n)))
        node_ids = None if node_rows is None else [f"node-{i:04d}" for i in node_rows]
        query = VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=k, doc_ids=[docs[i] for i in by_doc],
                                 node_ids=node_ids)  # fmt: skip
        for res in (store.query(query), await store.aquery(query)):
            got = [int(i.split("-")[1]) for i in res.ids or []]
            assert len(got) == k == len(set(got)) and set(got) <= set(allowed), (node_rows is None, got)
            assert is_top_k(data[allowed] @ q, [allowed.index(i) for i in got], k, atol=1e-6), got
            assert res.similarities == pytest.approx(sorted(data[allowed] @ q, reverse=True)[:k], abs=1e-5)
    assert len(_id_pieces_of(store, [docs[i] for i in by_doc])) > 2
    monkeypatch.setattr(store, "_id_bytes", lambda: 1 << 30)  # the control: in one request
    with pytest.raises(ValueError, match="payload"):
        store.query(query)
    store.close()


def test_an_index_holding_an_image_node_searches_every_node_with_honor_node_ids_off(
    start_sidecar: Any,
) -> None:
    """A store that keeps text has only its IndexNodes/ImageNodes in the index's nodes_dict,
    and ``VectorStoreIndex.as_retriever()`` passes their ids as ``node_ids``: by default the
    search is restricted to them (the control); ``honor_node_ids=False`` searches every node
    (still under ``doc_ids``), as ``VectorIndexRetriever(index)`` without ``node_ids`` does."""
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import ImageNode, QueryBundle

    sc = start_sidecar(dim=DIM)
    texts = [node(f"n{i}", doc="d1" if i < 2 else "d2") for i in range(3)]
    image = ImageNode(id_="img", text="a caption", embedding=vec("img"))
    query = QueryBundle(query_str="q", embedding=vec("n0"))
    got = {}
    for honor in (True, False):
        store = KalosVectorStore(sc.name, namespace=f"honor-{honor}", honor_node_ids=honor)
        index = VectorStoreIndex(nodes=[*texts, image], embed_model=MockEmbedding(embed_dim=DIM),
                                 storage_context=StorageContext.from_defaults(vector_store=store))  # fmt: skip
        assert list(index.index_struct.nodes_dict.values()) == ["img"]
        got[honor] = {n.node.node_id for n in index.as_retriever(similarity_top_k=9).retrieve(query)}
        restricted = store.query(VectorStoreQuery(query_embedding=vec("n0"), similarity_top_k=9,
                                                  node_ids=["img"], doc_ids=["d1"]))  # fmt: skip
        assert set(restricted.ids) == ({"img"} & {"n0", "n1"} if honor else {"n0", "n1"}), honor
        store.close()
    assert got == {True: {"img"}, False: {"n0", "n1", "n2", "img"}}
    with pytest.raises(TypeError, match="honor_node_ids must be a bool"):
        KalosVectorStore(sc.name, honor_node_ids="no")  # type: ignore[arg-type]
    restored = KalosVectorStore.from_dict(KalosVectorStore(sc.name, honor_node_ids=False).to_dict())
    assert restored.honor_node_ids is False


def _id_pieces_of(store: KalosVectorStore, ids: list[str]) -> list[Any]:
    from kalos_retrievers.llama_index.vector_store import _id_pieces

    return _id_pieces(ids, store._id_bytes())


# ---------------------------------------------------------------------------------------------
# deletes and get_nodes


async def test_delete_by_ref_doc_id(api: Api) -> None:
    await api.add([node("a1", doc="A"), node("a2", doc="A"), node("b1", doc="B"), node("free")])
    await api.delete("A")
    assert await api.ids() == {"b1", "free"}
    (b1,) = await api.get_nodes(["b1"])
    assert b1.ref_doc_id == "B"
    assert await api.ids(doc_ids=["B"]) == {"b1"}  # ref_doc_id is queryable


async def test_delete_nodes(api: Api) -> None:
    await api.add([node("a", k=1), node("b", k=2), node("c", k=2), node("d", k=3)])
    await api.delete_nodes(["a"])
    assert await api.ids() == {"b", "c", "d"}
    await api.delete_nodes(filters=mf(MetadataFilter(key="k", value=3)))
    assert await api.ids() == {"b", "c"}
    await api.delete_nodes(["b", "c"], filters=mf(MetadataFilter(key="k", value=99)))
    assert await api.ids() == {"b", "c"}  # ids AND filters: nothing matched both
    await api.delete_nodes([])  # an empty list deletes nothing
    assert await api.ids() == {"b", "c"}
    with pytest.raises(ValueError, match="clear"):
        await api.delete_nodes()
    await api.delete_nodes(["c", "no-such-node"])
    assert await api.ids() == {"b"}


async def test_get_nodes(api: Api) -> None:
    await api.add([node("a", k=1), node("b", k=2), node("c", k=2)])
    assert [n.node_id for n in await api.get_nodes(["c", "missing", "a"])] == ["c", "a"]
    assert await api.get_nodes([]) == []
    two = mf(MetadataFilter(key="k", value=2))
    assert {n.node_id for n in await api.get_nodes(filters=two)} == {"b", "c"}
    assert [n.node_id for n in await api.get_nodes(["c", "a", "b"], filters=two)] == ["c", "b"]
    assert {n.node_id for n in await api.get_nodes()} == {"a", "b", "c"}


async def test_clear(api: Api) -> None:
    await api.add([node(f"n{i}") for i in range(7)])
    await api.clear()
    assert await api.get_nodes() == []
    assert await api.ids() == set()


# ---------------------------------------------------------------------------------------------
# filters: every operator, conditions, nesting, id restrictions

CORPUS = [
    node("n1", n=1, s="Alpha", tags=["x", "y"], e=""),
    node("n2", n=2, s="beta", tags=["y"], e=None),
    node("n3", n=3.5, s="alphabet", tags=[], e="z"),
    node("n4", n=-1, s="gamma"),
    node("n5", s="ALPHA", tags=["z"], e=[]),
]


@pytest.mark.parametrize(
    ("flt", "expected"),
    [
        (MetadataFilter(key="n", value=2), {"n2"}),
        (MetadataFilter(key="s", value="Alpha", operator=F.EQ), {"n1"}),
        (MetadataFilter(key="n", value=2, operator=F.NE), {"n1", "n3", "n4", "n5"}),
        (MetadataFilter(key="n", value=1, operator=F.GT), {"n2", "n3"}),
        (MetadataFilter(key="n", value=2, operator=F.GTE), {"n2", "n3"}),
        (MetadataFilter(key="n", value=1, operator=F.LT), {"n4"}),
        (MetadataFilter(key="n", value=1, operator=F.LTE), {"n1", "n4"}),
        (MetadataFilter(key="s", value="beta", operator=F.GT), {"n4"}),
        (MetadataFilter(key="n", value=[1, 3.5], operator=F.IN), {"n1", "n3"}),
        (MetadataFilter(key="s", value=["beta", "gamma"], operator=F.IN), {"n2", "n4"}),
        (MetadataFilter(key="n", value=[1, 2], operator=F.NIN), {"n3", "n4", "n5"}),
        (MetadataFilter(key="tags", value=["x", "z"], operator=F.ANY), {"n1", "n5"}),
        (MetadataFilter(key="tags", value=["x", "y"], operator=F.ALL), {"n1"}),
        (MetadataFilter(key="tags", value="y", operator=F.CONTAINS), {"n1", "n2"}),
        (MetadataFilter(key="s", value="lpha", operator=F.TEXT_MATCH), {"n1", "n3"}),
        (MetadataFilter(key="s", value="alpha", operator=F.TEXT_MATCH_INSENSITIVE),
         {"n1", "n3", "n5"}),
        (MetadataFilter(key="e", value=None, operator=F.IS_EMPTY), {"n1", "n2", "n4", "n5"}),
        (MetadataFilter(key="tags", value=None, operator=F.IS_EMPTY), {"n3", "n4"}),
        (MetadataFilter(key="ref_doc_id", value="None"), {"n1", "n2", "n3", "n4", "n5"}),
    ],
    ids=lambda p: f"{p.key}-{p.operator.name}" if isinstance(p, MetadataFilter) else "",
)  # fmt: skip
async def test_each_filter_operator(api: Api, flt: MetadataFilter, expected: set[str]) -> None:
    await api.add(CORPUS)
    assert await api.ids(mf(flt)) == expected


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (mf(MetadataFilter(key="n", value=0, operator=F.GT),
            MetadataFilter(key="tags", value="y", operator=F.CONTAINS)), {"n1", "n2"}),
        (mf(MetadataFilter(key="n", value=3, operator=F.GT),
            MetadataFilter(key="s", value="gamma"), condition="or"), {"n3", "n4"}),
        (mf(MetadataFilter(key="n", value=2, operator=F.LT),
            MetadataFilter(key="s", value="beta"), condition="not"), {"n3", "n5"}),
        (mf(mf(MetadataFilter(key="n", value=2, operator=F.GTE),
               MetadataFilter(key="s", value="gamma", operator=F.TEXT_MATCH_INSENSITIVE),
               condition="or"),
            mf(MetadataFilter(key="tags", value="y", operator=F.CONTAINS), condition="not")),
         {"n3", "n4"}),
        (mf(mf(MetadataFilter(key="n", value=0, operator=F.GT),
               MetadataFilter(key="tags", value=["x"], operator=F.ANY)),
            MetadataFilter(key="s", value="ALPHA"), condition="or"), {"n1", "n5"}),
        (mf(), {"n1", "n2", "n3", "n4", "n5"}),
    ],
    ids=["and", "or", "not", "nested-and-or-not", "nested-or-and", "empty"],
)  # fmt: skip
async def test_conditions_and_nested_filters(
    api: Api, filters: MetadataFilters, expected: set[str]
) -> None:
    await api.add(CORPUS)
    assert await api.ids(filters) == expected


async def test_filter_is_true_top_k_among_matching(api: Api) -> None:
    # The 3 'rare' nodes are the least similar to the query; post-filtering a top-k would
    # return fewer than 3 of them.
    nodes = [node(f"common{i}", "q", grp="common") for i in range(20)]
    nodes += [node(f"rare{i}", f"unrelated {i}", grp="rare") for i in range(3)]
    await api.add(nodes)
    res = await api.search("q", 3, filters=mf(MetadataFilter(key="grp", value="rare")))
    assert set(res.ids or []) == {"rare0", "rare1", "rare2"}


async def test_node_ids_and_doc_ids_restrict_the_search(api: Api) -> None:
    await api.add([node("a", doc="D1"), node("b", doc="D1"), node("c", doc="D2")])
    assert await api.ids(node_ids=["a", "c"]) == {"a", "c"}
    assert await api.ids(node_ids=[]) == {"a", "b", "c"}  # empty list: no restriction
    assert await api.ids(doc_ids=["D1"]) == {"a", "b"}
    assert await api.ids(doc_ids=["D1"], node_ids=["b", "c"]) == {"b"}
    assert await api.ids(mf(MetadataFilter(key="doc_id", value="D2"))) == {"c"}


# ---------------------------------------------------------------------------------------------
# MMR and errors


def _mmr_nodes() -> list[TextNode]:
    e = np.eye(DIM)
    nodes = [
        TextNode(id_="best", text="best", embedding=e[0].tolist()),
        TextNode(id_="twin", text="twin", embedding=(e[0] + 0.02 * e[1]).tolist()),
        TextNode(id_="other", text="other", embedding=(0.6 * e[0] + 0.8 * e[2]).tolist()),
    ]
    nodes += [TextNode(id_=f"far{i}", text="far", embedding=e[3 + i].tolist()) for i in range(4)]
    return nodes


async def test_mmr_mode_diversifies(api: Api) -> None:
    await api.add(_mmr_nodes())
    e = np.eye(DIM)
    q = ((e[0] + 0.3 * e[2]) / np.linalg.norm(e[0] + 0.3 * e[2])).tolist()
    plain = await api.query(VectorStoreQuery(query_embedding=q, similarity_top_k=2))
    assert plain.ids == ["best", "twin"]
    mmr = VectorStoreQuery(query_embedding=q, similarity_top_k=2, mode=VectorStoreQueryMode.MMR)
    res = await api.query(mmr)
    assert res.ids == ["best", "other"]
    assert res.similarities is not None
    assert res.similarities[1] == pytest.approx(np.dot(q, 0.6 * e[0] + 0.8 * e[2]), abs=1e-4)
    assert (await api.query(mmr, mmr_threshold=1.0)).ids == ["best", "twin"]
    mmr.mmr_threshold = 1.0
    assert (await api.query(mmr)).ids == ["best", "twin"]


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_mmr_ranks_by_the_sidecars_own_scores(start_sidecar: Any, metric: str) -> None:
    """On an L2 or ip sidecar MMR's relevance term is the sidecar's score (its relevance, on
    cosine's scale), not the cosine to the query: ``mmr_threshold=1`` is the plain ranking.
    (With the cosine, an L2 store's MMR put ``far``, the farthest row, second: it points the
    query's way.) The diversity term stays the cosine between candidates: at 0.5 the
    near-duplicate ``twin`` waits behind the different ``other``."""
    sc = start_sidecar(dim=4, metric=metric)
    store = KalosVectorStore(sc.name, timeout=10)
    vecs = {"best": [1, 0, 0, 0], "twin": [1, 0.01, 0, 0], "other": [0.8, 0, 0.6, 0], "far": [10, 0.1, 0, 0],
            "off": [0, 1, 0, 0]}  # fmt: skip
    store.add([TextNode(id_=i, text=i, embedding=[float(x) for x in v]) for i, v in vecs.items()])
    q = [1.0, 0.0, 0.0, 0.0]
    plain = store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=5))
    mmr = store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=5, mode=VectorStoreQueryMode.MMR,
                                       mmr_threshold=1.0))  # fmt: skip
    assert mmr.ids == plain.ids, (mmr.ids, plain.ids)
    if metric == "l2":
        assert plain.ids is not None and plain.ids[:2] == ["best", "twin"] and plain.ids[-1] == "far"
    store.close()


async def test_a_retrievers_vector_store_kwargs_reach_the_query_and_hybrid_options_are_refused(api: Api) -> None:
    """``KalosRetriever(vector_store_kwargs=...)`` passes them to each query, as
    ``VectorIndexRetriever`` does (control: without them, MMR's default balance); an option of
    hybrid search (``alpha``) or any other unknown keyword raises ``TypeError`` naming it."""
    from llama_index.core.schema import QueryBundle

    from kalos_retrievers.llama_index import KalosRetriever

    await api.add(_mmr_nodes())
    e = np.eye(DIM)
    q = ((e[0] + 0.3 * e[2]) / np.linalg.norm(e[0] + 0.3 * e[2])).tolist()
    bundle = QueryBundle(query_str="q", embedding=q)

    def retriever(**kw: Any) -> KalosRetriever:
        return KalosRetriever(api.store, similarity_top_k=2, vector_store_query_mode="mmr", on_error="raise", **kw)

    async def ids(r: KalosRetriever) -> list[str]:
        got = await r.aretrieve(bundle) if api.use_async else r.retrieve(bundle)
        return [n.node.node_id for n in got]

    assert await ids(retriever()) == ["best", "other"]  # (control)
    assert await ids(retriever(vector_store_kwargs={"mmr_threshold": 1.0})) == ["best", "twin"]
    with pytest.raises(TypeError, match=r"\['alpha'\] \(Kalos searches dense vectors only"):
        retriever(alpha=0.5)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['similarity_topk'\]$"):
        retriever(similarity_topk=3)
    assert retriever(verbose=True) is not None  # (BaseRetriever's own)


async def test_query_errors_are_raised_not_degraded(api: Api) -> None:
    with pytest.raises(ValueError, match="query_embedding"):
        await api.query(VectorStoreQuery(query_embedding=None, similarity_top_k=1))
    with pytest.raises(ValueError, match="query modes"):
        await api.query(VectorStoreQuery(query_embedding=vec("q"), mode=VectorStoreQueryMode.SVM))
    with pytest.raises(ValueError, match="list"):
        await api.ids(mf(MetadataFilter(key="a", value=["x"], operator=F.EQ)))
    with pytest.raises(ValueError, match=r"^similarity_top_k=1025 is above .*--max-k 1024"):
        await api.search("q", 1025)
    with pytest.raises(TypeError, match="namespace must be a string"):
        KalosVectorStore(api.store.name, namespace=None)  # type: ignore[arg-type]
    assert api.store.degrader.degraded_calls == 0


def test_a_store_deep_copies_onto_its_client_and_pickles_by_name(start_sidecar: Any) -> None:
    """``copy.deepcopy`` (pydantic's, of the client's lock, raised TypeError) gives a store
    with the same settings on the same client; a pickled one connects by name when loaded."""
    import copy
    import pickle

    sc = start_sidecar(dim=DIM)
    store = KalosVectorStore(sc.name, namespace="copied", timeout=3, honor_node_ids=False)
    store.add([node("a")])
    for dup in (copy.deepcopy(store), pickle.loads(pickle.dumps(store))):  # noqa: S301 - our own bytes
        assert (dup.namespace, dup.timeout, dup.honor_node_ids) == ("copied", 3, False)
        assert dup.query(VectorStoreQuery(query_embedding=vec("a"), similarity_top_k=1)).ids == ["a"]
    assert copy.deepcopy(store).client is store.client
    store.close()


async def test_writes_end_at_the_stores_timeout_queued_or_not(start_sidecar: Any) -> None:
    """A store's ``timeout`` is each call's deadline, writes' too (they took the client's once
    sent: 2 s here), and an async write queued behind another keeps the deadline it was made
    with (it ran its own whole timeout once a thread took it: 0.55 s for 0.3)."""
    import asyncio
    import signal
    import time

    from kalos_retrievers import SidecarTimeout

    sc = start_sidecar(dim=DIM)
    client = KalosClient(sc.name, timeout=2.0, max_slots=1)
    store = KalosVectorStore(client=client, timeout=0.3)
    store.add([node("warm")])
    sc.kill(signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        with pytest.raises(SidecarTimeout):
            store.add([node("sync")])
        took_sync = time.perf_counter() - t0
        t0 = time.perf_counter()
        first = asyncio.create_task(store.async_add([node("a1")]))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(store.adelete_nodes(["warm"]))
        done = await asyncio.gather(first, second, return_exceptions=True)
        took_async = time.perf_counter() - t0
    finally:
        sc.kill(signal.SIGCONT)
    assert all(isinstance(d, SidecarTimeout) for d in done), done
    assert took_sync < 1.0 and took_async < 0.5, (took_sync, took_async)
    client.close()

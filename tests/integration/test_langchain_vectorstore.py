"""KalosVectorStore against real CPU sidecars: ids, metadata, filters, namespaces, scores, MMR,
retrievers from ``as_retriever()``, constructors, and every ``a*`` method."""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings

from kalos_retrievers import KalosClient, Sidecar, SidecarUnavailable
from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore, KalosVectorStoreRetriever


class WordHashEmbedding(Embeddings):
    """Bag of words hashed into ``dim`` buckets: texts sharing words are close. Offline."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def _one(self, text: str) -> list[float]:
        v = np.zeros(self.dim)
        for w in text.lower().replace("?", " ").replace(".", " ").split():
            v[zlib.crc32(w.encode()) % self.dim] += 1.0
        v[0] += 1e-3  # never all zeros
        return v.tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._one(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._one(text)


TEXTS = ["apples are red", "bananas are yellow", "cherries are red", "the sky is blue",
         "grass is green", "snow is white", "coal is black"]  # fmt: skip
METAS: list[dict[str, Any]] = [
    {"kind": "fruit", "colour": "red", "n": 1, "tags": ["sweet", "crisp"]},
    {"kind": "fruit", "colour": "yellow", "n": 2, "tags": ["sweet"]},
    {"kind": "fruit", "colour": "red", "n": 3, "tags": ["sour"]},
    {"kind": "nature", "colour": "blue", "n": 4, "nested": {"a": [1, 2, {"b": None}]}},
    {"kind": "nature", "colour": "green", "n": 5},
    {"kind": "nature", "colour": "white", "n": 6},
    {"kind": "mineral", "colour": "black", "n": 7, "unicode": "schwarz \u00e4 \u2603"},
]


@pytest.fixture(scope="module")
def sidecar97(shared_sidecar: Sidecar) -> Iterator[Sidecar]:
    """One dim-97 sidecar for the module (its name extends the run-unique shared one)."""
    sc = Sidecar(f"{shared_sidecar.name}v97", dim=97, device="cpu", startup_timeout=60.0)
    sc.start()
    yield sc
    sc.stop()
    sc.log_path.unlink(missing_ok=True)


@pytest.fixture
def store(sidecar97: Sidecar, make_name: Callable[[], str]) -> Iterator[KalosVectorStore]:
    """The seven TEXTS in a namespace of the test's own."""
    s = KalosVectorStore(WordHashEmbedding(97), name=sidecar97.name, namespace=make_name())
    s.add_texts(TEXTS, METAS, ids=[f"t{i}" for i in range(len(TEXTS))])
    yield s
    for ns in s.client.namespaces():
        if ns.startswith(s.namespace):
            s.client.delete_namespace(ns)
    s.close()


def test_ids_given_generated_and_from_documents(store: KalosVectorStore) -> None:
    docs = [Document("with id", metadata={"x": 1}, id="doc-a"), Document("without id")]
    ids = store.add_documents(docs)
    assert ids[0] == "doc-a"
    assert isinstance(ids[1], str)
    assert len(ids[1]) >= 16
    assert ids[1] != "doc-a"
    assert docs == [Document("with id", metadata={"x": 1}, id="doc-a"), Document("without id")]
    got = store.get_by_ids(["doc-a", ids[1], "nope"])
    assert got == [Document("with id", metadata={"x": 1}, id="doc-a"),
                   Document("without id", metadata={}, id=ids[1])]  # fmt: skip
    # explicit ids win over Document.id, as VectorStore.add_documents documents
    assert store.add_documents([Document("z", id="ignored")], ids=["explicit"]) == ["explicit"]
    assert store.get_by_ids(["ignored"]) == []



def test_ids_no_row_can_have_are_not_found_and_empty_ids_are_generated(store: KalosVectorStore) -> None:
    """LangChain's contract: get_by_ids does not raise for ids that are not found, and delete
    ignores them; an id no row can have (empty, over 512 bytes, a lone surrogate) is one, not
    an argument error. A Document's id may be "" as well as None: add_documents gives it a
    fresh id, as the in-memory store does (it failed: "ids[1]='' must be a non-empty string").
    Control: the client itself still refuses such ids."""
    ids = store.add_documents([Document("p", id="x1"), Document("q", id="")])
    assert ids[0] == "x1" and len(ids[1]) >= 16
    impossible = ["", "x" * 513, "\ud800"]
    assert [d.id for d in store.get_by_ids([*impossible, "x1", ids[1]])] == ["x1", ids[1]]
    assert store.get_by_ids(impossible) == []
    assert store.delete(impossible) is True and store.delete([*impossible, "x1"]) is True
    assert [d.id for d in store.get_by_ids(["x1", ids[1]])] == [ids[1]]
    with pytest.raises(ValueError, match="non-empty string"):
        store.client.get([""], namespace=store.namespace)
    with pytest.raises(TypeError, match="not one string"):
        store.get_by_ids("x1")

def test_same_id_overwrites(store: KalosVectorStore) -> None:
    store.add_texts(["apples are green now"], [{"kind": "changed"}], ids=["t0"])
    assert store.client.count(store.namespace) == len(TEXTS)
    (doc,) = store.get_by_ids(["t0"])
    assert doc == Document("apples are green now", metadata={"kind": "changed"}, id="t0")
    top = store.similarity_search("apples green now", k=1)[0]
    assert top.id == "t0"


def test_metadata_returned_unchanged(store: KalosVectorStore) -> None:
    for i, text in enumerate(TEXTS):
        for doc, _score in store.similarity_search_with_score(text, k=len(TEXTS)):
            assert doc.metadata == METAS[int(doc.id[1:])]  # no score, no internal key
        assert store.similarity_search(text, k=1)[0].id == f"t{i}"
    assert store.get_by_ids(["t3"])[0].metadata == METAS[3]


def test_empty_page_content_round_trips(store: KalosVectorStore) -> None:
    ids = store.add_documents([Document("", metadata={"e": True}, id="empty"),
                               Document("not empty", id="full")])  # fmt: skip
    assert ids == ["empty", "full"]
    assert sorted(store.get_by_ids(ids), key=lambda d: d.id or "") == [
        Document("", metadata={"e": True}, id="empty"),
        Document("not empty", metadata={}, id="full"),
    ]


def test_delete(store: KalosVectorStore) -> None:
    assert store.delete(["t0", "t1", "missing"]) is True
    assert store.get_by_ids(["t0", "t1", "t2"]) == [store.get_by_ids(["t2"])[0]]
    assert store.delete(filter={"kind": "nature"}) is True
    assert {d.id for d in store.similarity_search("is", k=10)} == {"t2", "t6"}
    with pytest.raises(ValueError, match="delete_namespace"):
        store.delete()


@pytest.mark.parametrize(
    ("flt", "expected"),
    [
        ({"colour": "red"}, {"t0", "t2"}),
        ({"colour": {"$in": ["red", "blue"]}}, {"t0", "t2", "t3"}),
        ({"n": {"$gte": 3, "$lt": 6}}, {"t2", "t3", "t4"}),
        ({"tags": {"$contains": "sweet"}}, {"t0", "t1"}),
        ({"$or": [{"kind": "mineral"}, {"n": {"$lte": 1}}]}, {"t0", "t6"}),
        ({"kind": {"$ne": "fruit"}, "colour": {"$nin": ["blue"]}}, {"t4", "t5", "t6"}),
        ({"$not": {"kind": {"$in": ["fruit", "nature"]}}}, {"t6"}),
        ({"nested": {"$exists": True}}, {"t3"}),
    ],
)
def test_filters(store: KalosVectorStore, flt: dict[str, Any], expected: set[str]) -> None:
    # the true top-k among matching rows: k larger than the matches returns exactly them
    docs = store.similarity_search("coal is black", k=len(TEXTS), filter=flt)
    assert {d.id for d in docs} == expected
    # and k=1 still finds a match even when the nearest row overall does not match
    assert store.similarity_search("coal is black", k=1, filter=flt)[0].id in expected


def test_callable_filter_refused(store: KalosVectorStore) -> None:
    with pytest.raises(TypeError, match=r"callable.*pass a dict"):
        store.similarity_search("x", filter=lambda doc: True)
    with pytest.raises(TypeError, match="callable"):
        store.as_retriever(search_kwargs={"filter": lambda doc: True}).invoke("x")
    with pytest.raises(TypeError, match="unexpected keyword"):
        store.similarity_search("x", filters={"a": 1})


def test_namespaces(store: KalosVectorStore) -> None:
    ns_b = f"{store.namespace}-b"
    store.add_texts(["apples are red"], [{"tenant": "b"}], ids=["t0"], namespace=ns_b)
    assert store.similarity_search("apples are red", k=10, namespace=ns_b) == [
        Document("apples are red", metadata={"tenant": "b"}, id="t0")
    ]
    assert store.get_by_ids(["t0"])[0].metadata == METAS[0]
    assert store.client.count(ns_b) == 1
    b = KalosVectorStore(store.embedding, client=store.client, namespace=ns_b)
    assert [d.id for d in b.similarity_search("anything", k=10)] == ["t0"]
    b.delete(["t0"])
    assert b.similarity_search("anything", k=10) == []
    assert store.get_by_ids(["t0"])[0].metadata == METAS[0]
    b.close()  # a store given a client= does not close it
    assert store.similarity_search("apples", k=1)[0].id == "t0"


def test_similarity_search_by_vector_and_scores(store: KalosVectorStore) -> None:
    vec = store.embedding.embed_query("snow is white")
    assert store.similarity_search_by_vector(vec, k=1)[0].id == "t5"
    pairs = store.similarity_search_with_score("snow is white", k=3)
    scores = [s for _, s in pairs]
    assert scores == sorted(scores, reverse=True)
    assert math.isclose(scores[0], 1.0, abs_tol=1e-5)  # cosine of a vector with itself


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_relevance_scores_in_unit_interval(
    start_sidecar: Callable[..., Sidecar], metric: str
) -> None:
    sc = start_sidecar(dim=3, metric=metric)
    with KalosVectorStore(WordHashEmbedding(3), name=sc.name) as store:
        store.add_texts(TEXTS, METAS)
        raw = store.similarity_search_with_score("apples are red", k=7)
        rel = store.similarity_search_with_relevance_scores("apples are red", k=7)
        assert [d for d, _ in raw] == [d for d, _ in rel]
        values = [r for _, r in rel]
        assert all(0.0 <= r <= 1.0 for r in values)
        assert values == sorted(values, reverse=True)  # monotone in the raw score
        fn = store._select_relevance_score_fn()
        assert fn(raw[0][1]) == values[0]
        thr = store.similarity_search_with_relevance_scores(
            "apples are red", k=7, score_threshold=values[2]
        )
        assert len(thr) >= 3
        assert all(r >= values[2] for _, r in thr)


def test_max_marginal_relevance(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(dim=3)
    with KalosVectorStore(DeterministicFakeEmbedding(size=3), name=sc.name) as store:
        # three near-duplicates of the query direction and one different row
        store.client.upsert(["d1", "d2", "d3", "x"],
                            [[1, 0, 0], [0.99, 0.01, 0], [0.98, 0.02, 0], [0.5, 0.5, 0.7]],
                            texts=["d1", "d2", "d3", "x"])  # fmt: skip
        q = [1.0, 0.0, 0.0]
        assert [d.id for d in store.similarity_search_by_vector(q, k=2)] == ["d1", "d2"]
        mmr = store.max_marginal_relevance_search_by_vector(q, k=2, fetch_k=4, lambda_mult=0.1)
        assert [d.id for d in mmr] == ["d1", "x"]
        same = store.max_marginal_relevance_search_by_vector(q, k=2, fetch_k=4, lambda_mult=1.0)
        assert [d.id for d in same] == ["d1", "d2"]
        assert store.max_marginal_relevance_search("anything", k=3, fetch_k=1)  # fetch_k < k
        assert store.max_marginal_relevance_search_by_vector(q, k=2, filter={"no": 1}) == []


def test_as_retriever_search_types(store: KalosVectorStore) -> None:
    sim = store.as_retriever(search_kwargs={"k": 2, "filter": {"kind": "fruit"}})
    assert isinstance(sim, KalosVectorStoreRetriever)
    assert [d.id for d in sim.invoke("cherries are red")] == ["t2", "t0"]
    thr = store.as_retriever(search_type="similarity_score_threshold",
                             search_kwargs={"score_threshold": 0.99, "k": 5})  # fmt: skip
    assert [d.id for d in thr.invoke("grass is green")] == ["t4"]
    mmr = store.as_retriever(search_type="mmr", search_kwargs={"k": 3, "fetch_k": 7})
    docs = mmr.invoke("apples are red")
    assert len(docs) == 3
    assert docs[0].id == "t0"
    assert [d.id for d in sim.invoke("x", k=1, namespace="nothing-here")] == []


def test_kalos_retriever_documents_and_threshold(store: KalosVectorStore) -> None:
    # KalosRetriever builds its Documents without the Hit objects and without pydantic's
    # validation: they must be the same Documents the store's own searches return.
    from kalos_retrievers.langchain import KalosRetriever

    r = KalosRetriever(vectorstore=store, k=7)
    docs = r.invoke("apples are red")
    assert docs == store.similarity_search("apples are red", k=7)
    assert all(type(d) is Document for d in docs)
    assert all(d.metadata == METAS[int(d.id[1:])] for d in docs)  # unchanged, no extra keys
    assert [d.page_content for d in docs] == [TEXTS[int(d.id[1:])] for d in docs]
    rel = store.similarity_search_with_relevance_scores("apples are red", k=7)
    cut = rel[2][1]
    want = [d for d, score in rel if score >= cut]
    assert r.invoke("apples are red", score_threshold=cut) == want
    assert KalosRetriever(vectorstore=store, k=7, score_threshold=cut).invoke(
        "apples are red") == want  # fmt: skip
    assert r.invoke("apples are red", score_threshold=1.0) in ([], want[:1])
    assert r.invoke("apples are red", k=2, filter={"kind": "fruit"}) == [
        d for d in docs if d.metadata["kind"] == "fruit"][:2]  # fmt: skip
    assert r.invoke("apples are red", namespace="nothing-here") == []
    for bad in ("0.5", True, 1.5):
        with pytest.raises(ValueError, match=r"^score_threshold="):
            r.invoke("apples are red", score_threshold=bad)
    assert r.invoke("apples are red", score_threshold=np.float32(cut)) == want  # numpy scalars are numbers


def test_from_texts_spawns_and_owns_the_sidecar() -> None:
    store = KalosVectorStore.from_texts(
        TEXTS, WordHashEmbedding(97), METAS, ids=[f"t{i}" for i in range(7)], device="cpu"
    )
    try:
        assert store.client.dim == 97
        assert store.similarity_search("snow is white", k=1)[0].id == "t5"
        name = store.client.name
    finally:
        store.close()
    with pytest.raises(SidecarUnavailable):
        KalosClient(name)


@pytest.mark.parametrize("bad", [{"namespace": 7}, {"timeout": -1}])
def test_from_texts_stops_its_sidecar_when_the_store_cannot_be_made(
    bad: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar is started before the store checks its arguments: a bad one raises, and
    the sidecar started for the store goes with it (it stayed, with its shared memory, until
    the Python process exited). Control: the same sidecar is reachable until then."""
    spawned: list[KalosClient] = []
    real = KalosClient.spawn

    def spawn(**kw: Any) -> KalosClient:
        c = real(**kw)
        spawned.append(c)
        assert KalosClient(c.name).dim == 97  # control: it serves, so a leak would be seen
        return c

    monkeypatch.setattr(KalosClient, "spawn", staticmethod(spawn))
    with pytest.raises((TypeError, ValueError)):
        KalosVectorStore.from_texts(TEXTS, WordHashEmbedding(97), device="cpu", **bad)
    (c,) = spawned
    with pytest.raises(SidecarUnavailable):
        KalosClient(c.name)


def test_from_texts_takes_batch_size_and_refuses_bad_metadata_before_starting_a_sidecar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datetime

    spawned: list[KalosClient] = []
    real = KalosClient.spawn

    def spawn(**kw: Any) -> KalosClient:
        spawned.append(c := real(**kw))
        return c

    monkeypatch.setattr(KalosClient, "spawn", staticmethod(spawn))
    with pytest.raises(ValueError, match=r"^metadatas\[1\] is not JSON"):
        KalosVectorStore.from_texts(TEXTS[:2], WordHashEmbedding(97), [{}, {"d": {datetime.date(2026, 1, 1)}}],
                                    device="cpu")  # fmt: skip
    assert spawned == []
    store = KalosVectorStore.from_texts(TEXTS, WordHashEmbedding(97), METAS, ids=[f"t{i}" for i in range(7)],
                                        batch_size=3, device="cpu")  # fmt: skip
    try:
        assert len(spawned) == 1 and store.client.count() == 7  # (batch_size is not a sidecar option)
        assert store.similarity_search("snow is white", k=1)[0].id == "t5"
    finally:
        store.close()


def test_afrom_texts_sidecar_outlives_the_event_loop_that_made_it() -> None:
    """VectorStore.afrom_texts runs from_texts in the loop's executor thread, which exits when
    asyncio.run shuts the executor down: the store's own sidecar must keep serving after that
    (a parent-death signal tied to that thread stopped it; kalos_retrievers/spawn.py)."""
    import asyncio
    import time

    store = asyncio.run(KalosVectorStore.afrom_texts(TEXTS, WordHashEmbedding(97), METAS,
                                                     ids=[f"t{i}" for i in range(7)], device="cpu"))  # fmt: skip
    try:
        time.sleep(0.3)  # (past the executor thread's exit)
        assert store.similarity_search("snow is white", k=1)[0].id == "t5"
        assert [d.id for d in store.as_retriever(search_kwargs={"k": 1}).invoke("snow is white")] == ["t5"]
    finally:
        store.close()


def test_from_documents_into_running_sidecar(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(dim=97)
    docs = [
        Document(t, metadata=m, id=f"d{i}")
        for i, (t, m) in enumerate(zip(TEXTS, METAS, strict=True))
    ]
    store = KalosVectorStore.from_documents(docs, WordHashEmbedding(97), name=sc.name,
                                            namespace="ns")  # fmt: skip
    assert store.get_by_ids(["d6"], namespace="ns") == [docs[6]]
    assert store.client.namespaces() == {"ns": 7}
    store.close()
    assert sc.proc is not None
    assert sc.proc.poll() is None
    with pytest.raises(TypeError, match="only apply when from_texts starts a sidecar"):
        KalosVectorStore.from_texts(["a"], WordHashEmbedding(97), name=sc.name, device="cpu")


def test_mmr_fetch_k_above_max_k_is_capped(start_sidecar: Callable[..., Sidecar]) -> None:
    """MMR's candidate pool stops at the sidecar's --max-k (as LlamaIndex's prefetch does)
    instead of failing with an error about a k the caller never passed."""
    sc = start_sidecar(dim=97, max_k=5)
    store = KalosVectorStore(WordHashEmbedding(97), name=sc.name)
    store.add_texts([f"doc {i} apple" for i in range(9)])
    assert len(store.max_marginal_relevance_search("apple", k=3, fetch_k=2000)) == 3
    assert len(store.max_marginal_relevance_search("apple", k=3, fetch_k=np.int64(4))) == 3
    assert len(store.as_retriever(search_type="mmr", search_kwargs={"k": 2, "fetch_k": 50}).invoke("apple")) == 2
    with pytest.raises(ValueError, match=r"^fetch_k="):
        store.max_marginal_relevance_search("apple", k=3, fetch_k=0)


def test_duplicate_ids_in_one_add_keep_the_last_even_across_empty_texts(store: KalosVectorStore) -> None:
    store.add_texts(["", "a real text"], ids=["x", "x"])
    assert [d.page_content for d in store.get_by_ids(["x"])] == ["a real text"]
    store.add_texts(["first", ""], ids=["y", "y"])
    assert [d.page_content for d in store.get_by_ids(["y"])] == [""]


def test_a_non_finite_embedding_is_named_by_its_text(store: KalosVectorStore) -> None:
    class Poisoned(WordHashEmbedding):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return [[math.nan] * 97 if t == "bad" else v for t, v in zip(texts, super().embed_documents(texts),
                                                                          strict=True)]  # fmt: skip

    bad = KalosVectorStore(Poisoned(97), client=store.client, namespace=store.namespace)
    with pytest.raises(ValueError, match=r"texts\[2\] contains NaN"):
        bad.add_texts(["a", "", "bad"])
    with pytest.raises(ValueError, match=r"texts\[2\] contains NaN"):
        bad.add_texts(["a", "", "bad"], batch_size=2)


def test_a_refused_add_stores_nothing_and_names_the_callers_entry(store: KalosVectorStore) -> None:
    """Every row is checked before any is sent, across texted and empty texts, the client's
    slot-sized chunks and add_texts' batches; the index is the caller's."""
    import datetime

    before = store.client.count(store.namespace)
    bad_meta = [{}, {}, {"when": {datetime.date(2026, 1, 1)}}]  # (a set: no JSON form)
    with pytest.raises(ValueError, match=r"^metadatas\[2\] is not JSON"):
        store.add_texts(["a", "", "c"], bad_meta, ids=["r0", "r1", "r2"])
    with pytest.raises(ValueError, match=r"^metadatas\[2\] is not JSON"):
        store.add_texts(["a", "", "c"], bad_meta, ids=["r0", "r1", "r2"], batch_size=1)
    payload = store.client.header.layout.payload_size
    with pytest.raises(ValueError, match=r"^texts/metadatas\[3\] is too large"):  # after a chunk's worth
        store.add_texts(["a", "", "b" * (payload // 2), "c" * payload], ids=["r0", "r1", "r2", "r3"])

    class ZeroForEmpty(WordHashEmbedding):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return [[0.0] * 97 if not t else v for t, v in zip(texts, super().embed_documents(texts), strict=True)]

    zero = KalosVectorStore(ZeroForEmpty(97), client=store.client, namespace=store.namespace)
    with pytest.raises(ValueError, match=r"texts\[1\] is all zeros"):
        zero.add_texts(["a", "", "c"], ids=["r0", "r1", "r2"])
    assert store.get_by_ids(["r0", "r1", "r2", "r3"]) == []
    assert store.client.count(store.namespace) == before
    # an embedding is known only when its batch is embedded: the batches before it are stored
    with pytest.raises(ValueError, match=r"texts\[3\] is all zeros"):
        zero.add_texts(["a", "b", "c", ""], ids=["r0", "r1", "r2", "r3"], batch_size=2)
    assert [d.id for d in store.get_by_ids(["r0", "r1", "r2", "r3"])] == ["r0", "r1"]
    # control: the same rows, made valid, are stored (texted and empty alike)
    assert store.add_texts(["a", "", "c"], [{}, {}, {"when": "2026-01-01"}], ids=["r0", "r1", "r2"],
                           batch_size=1) == ["r0", "r1", "r2"]  # fmt: skip
    assert [d.page_content for d in store.get_by_ids(["r0", "r1", "r2"])] == ["a", "", "c"]


def test_add_documents_takes_document_ids_unless_ids_are_given(store: KalosVectorStore) -> None:
    docs = [Document("one", id="doc-1"), Document("two", id="doc-2"), Document("three")]
    for ids in (None, []):  # as InMemoryVectorStore: an empty ids list is no ids
        got = store.add_documents(docs, ids=ids)
        assert got[:2] == ["doc-1", "doc-2"] and got[2] not in ("doc-1", "doc-2")
    assert store.add_documents(docs, ids=["x1", "x2", "x3"]) == ["x1", "x2", "x3"]
    assert [d.id for d in store.get_by_ids(["doc-1", "doc-2", "x3"])] == ["doc-1", "doc-2", "x3"]


async def test_aadd_documents_takes_document_ids(store: KalosVectorStore) -> None:
    got = await store.aadd_documents([Document("one", id="adoc-1")], ids=None)
    assert got == ["adoc-1"]
    assert [d.page_content for d in await store.aget_by_ids(["adoc-1"])] == ["one"]


def test_a_write_of_many_chunks_gives_each_chunk_the_timeout(store: KalosVectorStore,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A 2 s deadline fits one slot's write, not a large ingest: each request gets it."""
    client = store.client
    seen: list[float] = []
    real = client._call

    def spy(op: int, **kw: Any) -> Any:
        seen.append(kw["timeout"] if kw.get("deadline") is None else -1.0)
        return real(op, **kw)

    monkeypatch.setattr(client, "_call", spy)
    payload = client.header.layout.payload_size
    store.add_texts(["w" * (payload // 3)] * 7, ids=[f"w{i}" for i in range(7)], timeout=1.5)
    assert len(seen) >= 3 and all(t == pytest.approx(1.5, abs=0.05) for t in seen), seen


def test_dimension_mismatch_says_how_to_fix(shared_sidecar: Sidecar) -> None:
    assert shared_sidecar.dim == 8
    store = KalosVectorStore(DeterministicFakeEmbedding(size=6), name=shared_sidecar.name)
    with pytest.raises(ValueError, match=r"6-dimensional .* 8-dimensional .* --dim 6"):
        store.add_texts(["a"])
    with pytest.raises(ValueError, match="--dim 6"):
        store.similarity_search("a")


def test_construction_never_needs_the_sidecar(make_name: Callable[[], str]) -> None:
    store = KalosVectorStore(DeterministicFakeEmbedding(size=3), name=make_name())
    retriever = store.as_retriever()
    with pytest.raises(SidecarUnavailable, match="start one with"):
        store.similarity_search("x")  # the store raises; its retrievers degrade
    assert retriever.invoke("x") == []


async def test_async_methods(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(dim=97)
    emb = WordHashEmbedding(97)
    store = KalosVectorStore(emb, name=sc.name)
    ids = await store.aadd_texts(TEXTS, METAS, ids=[f"t{i}" for i in range(7)], batch_size=3)
    assert ids == [f"t{i}" for i in range(7)]
    assert await store.aadd_documents([Document("", id="e"), Document("x y", id="f")]) == ["e", "f"]
    assert [d.id for d in await store.aget_by_ids(["t1", "nope", "e"])] == ["t1", "e"]
    assert (await store.asimilarity_search("snow is white", k=1))[0].id == "t5"
    pairs = await store.asimilarity_search_with_score("snow is white", k=2)
    assert pairs[0][0].id == "t5"
    assert pairs[0][1] > pairs[1][1]
    rel = await store.asimilarity_search_with_relevance_scores("snow is white", k=2)
    assert [d for d, _ in rel] == [d for d, _ in pairs]
    assert all(0 <= r <= 1 for _, r in rel)
    vec = emb.embed_query("coal is black")
    assert (await store.asimilarity_search_by_vector(vec, k=1))[0].id == "t6"
    mmr = await store.amax_marginal_relevance_search("fruit red", k=2, filter={"kind": "fruit"})
    assert len(mmr) == 2
    assert all(d.metadata["kind"] == "fruit" for d in mmr)
    mmr_v = await store.amax_marginal_relevance_search_by_vector(vec, k=1)
    assert mmr_v[0].id == "t6"
    assert [d.id for d in await store.asearch("grass is green", "similarity", k=1)] == ["t4"]
    assert await store.adelete(["t4", "nope"]) is True
    assert await store.aget_by_ids(["t4"]) == []
    with pytest.raises(TypeError, match="callable"):
        await store.asimilarity_search("x", filter=lambda d: True)
    spawned = await KalosVectorStore.afrom_texts(["solo"], emb, ids=["s"], device="cpu")
    try:
        assert (await spawned.aget_by_ids(["s"]))[0].page_content == "solo"
    finally:
        spawned.close()
    other = await KalosVectorStore.afrom_documents([Document("q", id="q")], emb, name=sc.name,
                                                   namespace="af")  # fmt: skip
    assert [d.id for d in await other.asimilarity_search("q", k=5)] == ["q"]


def test_k_zero_finds_nothing_without_asking_the_sidecar(store: KalosVectorStore,
                                                         make_name: Callable[[], str]) -> None:  # fmt: skip
    """``k=0`` returns ``[]`` from every search, as LangChain's ``InMemoryVectorStore`` does,
    without a sidecar; a negative, bool or float ``k`` is refused, with or without one."""
    store.add_texts(["apple pie", "apple tart"], ids=["p", "t"])
    vec = store.embedding.embed_query("apple")
    assert len(store.similarity_search("apple", k=1)) == 1  # (control: there are rows to find)
    for s in (store, KalosVectorStore(WordHashEmbedding(97), name=make_name())):  # (the 2nd: no sidecar)
        assert s.similarity_search("apple", k=0) == []
        assert s.similarity_search("apple", k=np.int64(0)) == []
        assert s.similarity_search_with_score("apple", k=0) == []
        assert s.similarity_search_with_relevance_scores("apple", k=0) == []
        assert s.similarity_search_by_vector(vec, k=0) == []
        assert s.max_marginal_relevance_search("apple", k=0) == []
        assert s.max_marginal_relevance_search_by_vector(vec, k=0) == []
        assert s.as_retriever(search_kwargs={"k": 0}).invoke("apple") == []
        retriever = KalosRetriever(vectorstore=s, on_error="raise")
        assert retriever.invoke("apple", k=0) == []
        assert retriever.invoke("apple", k=0, score_threshold=0.5) == []
        assert asyncio.run(retriever.ainvoke("apple", k=0, score_threshold=0.5)) == []

        async def searches(s: KalosVectorStore = s) -> list[list[Any]]:
            return [await s.asimilarity_search("apple", k=0),
                    await s.asimilarity_search_with_score("apple", k=0),
                    await s.asimilarity_search_with_relevance_scores("apple", k=0),
                    await s.amax_marginal_relevance_search("apple", k=0)]  # fmt: skip

        assert asyncio.run(searches()) == [[], [], [], []]
        # what k=0 does not excuse: a bad k, fetch_k or timeout, refused before any connection
        for bad in (-1, True, 0.0, 1.5):
            with pytest.raises(ValueError, match=r"^k="):
                s.similarity_search("apple", k=bad)
        with pytest.raises(ValueError, match=r"^fetch_k="):
            s.max_marginal_relevance_search("apple", k=0, fetch_k=-1)
        with pytest.raises(ValueError, match=r"^timeout="):
            s.max_marginal_relevance_search("apple", k=0, timeout=-1)
        with pytest.raises(ValueError, match=r"^timeout="):
            asyncio.run(s.asimilarity_search("apple", k=0, timeout=-1))
        with pytest.raises(ValueError, match=r"^timeout="):
            asyncio.run(s.amax_marginal_relevance_search("apple", k=0, timeout=-1))


def test_add_texts_cut_by_a_kill_says_every_id_and_what_was_stored(start_sidecar, make_name, tmp_path) -> None:
    """``add_texts`` in batches that each take several slot-sized requests, its sidecar
    SIGKILLed before the second batch's second request: the error's ``ids`` are every text's
    (fresh UUIDs) and ``committed`` the rows of the requests answered (the first batch and
    the second's first request), which a restart finds; adding the texts again with those ids
    stores each once."""
    name, n = make_name(), 23
    texts = [f"text number {i} " + "x" * 300 for i in range(n)]
    sc = start_sidecar(name=name, dim=97, data_dir=tmp_path, payload_kb=2)  # 2 rows a request
    store = KalosVectorStore(WordHashEmbedding(97), name=name)
    call, sent = store.client._call, []

    def killed_before_the_second_batchs_second_request(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs["n_items"])
        if sum(sent[:-1]) > 10:  # (rows answered: the first batch and some of the second)
            sc.kill()
            sc.proc.wait(10)  # type: ignore[union-attr]
        return call(*args, **kwargs)

    store.client._call = killed_before_the_second_batchs_second_request  # type: ignore[method-assign]
    with pytest.raises(SidecarUnavailable) as info:
        store.add_texts(texts, batch_size=10)
    start_sidecar(name=name, dim=97, data_dir=tmp_path)
    e = info.value
    answered = sum(sent[:-1])
    assert 10 < answered < 20 and max(sent) < 10  # (the second batch, cut after its first request)
    assert e.ids is not None and len(set(e.ids)) == n and e.committed == answered
    again = KalosVectorStore(WordHashEmbedding(97), name=name)
    assert [d.page_content for d in again.get_by_ids(e.ids)] == texts[:answered]
    assert again.add_texts(texts, ids=e.ids) == e.ids and again.client.count() == n

class CountingEmbedding(WordHashEmbedding):
    """:class:`WordHashEmbedding` that counts the queries it embeds."""

    queries = 0

    def embed_query(self, text: str) -> list[float]:
        self.queries += 1
        return super().embed_query(text)


def test_retriever_k_zero_embeds_nothing(store: KalosVectorStore) -> None:
    """``KalosRetriever.invoke(q, k=0)`` and the store's text searches with ``k=0`` return
    ``[]`` before the query is embedded (an embedding is a model call, often a paid one); a
    bad ``k`` or ``timeout`` still raises."""
    store.add_texts(["apple pie"], ids=["p"])
    emb = CountingEmbedding(97)
    retriever = KalosRetriever(vectorstore=KalosVectorStore(emb, client=store.client,
                                                            namespace=store.namespace))  # fmt: skip
    assert [d.id for d in retriever.invoke("apple", k=1)] == ["p"] and emb.queries == 1  # (control)
    assert retriever.invoke("apple", k=0) == []
    assert asyncio.run(retriever.ainvoke("apple", k=0, score_threshold=0.5)) == []
    assert emb.queries == 1
    for bad in ({"k": -1}, {"k": 1.0}, {"k": 0, "timeout": -1}):
        with pytest.raises(ValueError, match=r"^(k|timeout)="):
            retriever.invoke("apple", **bad)
        with pytest.raises(ValueError, match=r"^(k|timeout)="):
            asyncio.run(retriever.ainvoke("apple", **bad))
    assert emb.queries == 1
    # the store's own text searches: k=0 embeds nothing either
    s = retriever.vectorstore
    assert s.similarity_search("apple", k=0) == s.similarity_search_with_score("apple", k=0) == []
    assert s.similarity_search_with_relevance_scores("apple", k=0) == []
    assert s.max_marginal_relevance_search("apple", k=0) == []

    async def searches() -> list[list[Any]]:
        return [await s.asimilarity_search("apple", k=0),
                await s.asimilarity_search_with_score("apple", k=0),
                await s.amax_marginal_relevance_search("apple", k=0)]  # fmt: skip

    assert asyncio.run(searches()) == [[], [], []]
    for bad in ({"k": -1}, {"k": 0, "timeout": -1}):
        with pytest.raises(ValueError, match=r"^(k|timeout)="):
            s.similarity_search("apple", **bad)
        with pytest.raises(ValueError, match=r"^(k|timeout)="):
            asyncio.run(s.asimilarity_search_with_score("apple", **bad))
    assert emb.queries == 1
    assert len(s.similarity_search("apple", k=1)) == 1 and emb.queries == 2  # (control)


def test_a_store_and_its_retrievers_deep_copy_and_pickle(store: KalosVectorStore) -> None:
    """``copy.deepcopy`` (the copy shares the client and never stops its sidecar) and pickling
    (unpickled, a lazy client of the same name and timeout) of the store, a KalosRetriever and
    ``as_retriever()``: each still recalls (both raised TypeError on the client's lock)."""
    import copy
    import pickle

    want = store.similarity_search(TEXTS[2], k=1)[0].id
    retriever = KalosRetriever(vectorstore=store, k=1)
    for obj in (store, retriever, store.as_retriever(search_kwargs={"k": 1})):
        dup, loaded = copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))  # noqa: S301 - our own bytes
        for o in (dup, loaded):
            found = o.similarity_search(TEXTS[2], k=1) if isinstance(o, KalosVectorStore) else o.invoke(TEXTS[2])
            assert [d.id for d in found] == [want], type(o)
        st = dup if isinstance(dup, KalosVectorStore) else dup.vectorstore
        assert st.client is store.client and not st._owns_client
        st = loaded if isinstance(loaded, KalosVectorStore) else loaded.vectorstore
        assert st.client is not store.client and st.client.timeout == store.client.timeout
        assert st.namespace == store.namespace
        st.close()
    copy.deepcopy(retriever).degrader.should_degrade(SidecarUnavailable("x"))  # (its own lock and counters)
    assert retriever.degrader.degraded_calls == 0

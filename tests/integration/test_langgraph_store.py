"""KalosStore (LangGraph BaseStore) on a real sidecar (odd dim 7): put/get/delete, search with
filter and query, list_namespaces, batch/abatch, a differential check against LangGraph's own
InMemoryStore, use inside a compiled graph, and degradation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import signal
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, TypedDict

import numpy as np
import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings
from langgraph.graph import END, START, StateGraph
from langgraph.store.base import BaseStore, GetOp, InvalidNamespaceError, ListNamespacesOp, PutOp, SearchOp
from langgraph.store.memory import InMemoryStore

from kalos_retrievers import CapacityError, KalosClient, KalosError, Sidecar, SidecarTimeout, SidecarUnavailable
from kalos_retrievers.langgraph import KalosStore

VOCAB = ["python", "rust", "tea", "coffee", "paris", "rome", "dog"]
DIM = len(VOCAB)  # 7


class KeywordEmbeddings(Embeddings):
    def _vec(self, text: str) -> list[float]:
        v = np.full(DIM, 0.01)
        for i, w in enumerate(re.findall(r"[a-z]+", text.lower())):
            if w in VOCAB:
                v[VOCAB.index(w)] += 1.0 + 0.01 * i  # position breaks ties between texts
        return v.tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._vec(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._vec(text)


INDEX: Any = {"dims": DIM, "embed": KeywordEmbeddings(), "fields": ["text", "tags[*]"]}


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    sc = Sidecar(dim=DIM, device="cpu", startup_timeout=60.0).start()
    yield sc
    sc.stop()
    sc.log_path.unlink(missing_ok=True)


@pytest.fixture
def store(sidecar: Sidecar) -> Iterator[KalosStore]:
    s = KalosStore(sidecar.name, index=INDEX, prefix=f"t{uuid.uuid4().hex[:8]}")
    yield s
    for ns in s.client.namespaces():
        if ns.startswith(s.prefix + "/"):
            s.client.delete_namespace(ns)
    s.close()


def keys(items: list) -> list[str]:
    return [i.key for i in items]


# ---------------------------------------------------------------------------------------------
# put / get / delete


def test_put_get_overwrite_delete(store: KalosStore) -> None:
    ns = ("users", "alice")
    assert store.get(ns, "prefs") is None
    store.put(ns, "prefs", {"text": "likes tea", "n": 1, "deep": {"a": [1, {"b": None}]}})
    item = store.get(ns, "prefs")
    assert item is not None
    assert (item.namespace, item.key) == (ns, "prefs")
    assert item.value == {"text": "likes tea", "n": 1, "deep": {"a": [1, {"b": None}]}}
    assert isinstance(item.created_at, datetime)
    assert item.created_at.tzinfo is not None
    time.sleep(0.01)
    store.put(ns, "prefs", {"text": "likes coffee", "n": 2})
    again = store.get(ns, "prefs")
    assert again is not None
    assert again.value == {"text": "likes coffee", "n": 2}
    assert again.created_at == item.created_at
    assert again.updated_at > item.updated_at
    assert store.get(("users", "bob"), "prefs") is None
    store.delete(ns, "prefs")
    assert store.get(ns, "prefs") is None
    assert store.list_namespaces() == []  # nothing left behind, vectors included
    store.delete(ns, "never-existed")


def test_search_with_filters_prefix_and_pages(store: KalosStore) -> None:
    for i in range(11):
        ns = ("docs", "team-a" if i % 2 else "team-b")
        store.put(ns, f"d{i:02d}", {"text": f"doc {i}", "n": i, "meta": {"kind": i % 3},
                                    "tags": ["x"] if i < 5 else ["x", "y"]})  # fmt: skip
    store.put(("other",), "o", {"text": "elsewhere", "n": 3})
    everything = store.search(("docs",), limit=100)
    assert keys(everything) == [f"d{i:02d}" for i in range(11)]  # oldest first, across spaces
    assert all(i.score is None for i in everything)
    assert keys(store.search(("docs", "team-a"), limit=100)) == [
        f"d{i:02d}" for i in range(1, 11, 2)
    ]
    assert len(store.search((), limit=100)) == 12
    pages = [keys(store.search(("docs",), limit=3, offset=o)) for o in range(0, 12, 3)]
    assert [k for p in pages for k in p] == [f"d{i:02d}" for i in range(11)]
    assert keys(store.search(("docs",), filter={"n": 3})) == ["d03"]
    assert keys(store.search(("docs",), filter={"n": {"$gte": 8}})) == ["d08", "d09", "d10"]
    assert keys(store.search(("docs",), filter={"n": {"$gt": 2, "$lt": 5}})) == ["d03", "d04"]
    assert len(store.search(("docs",), filter={"n": {"$ne": 3}}, limit=100)) == 10
    # nested-object and list equality, checked in this process (the sidecar cannot)
    assert keys(store.search(("docs",), filter={"meta": {"kind": 2}, "n": {"$lt": 6}})) == [
        "d02", "d05"]  # fmt: skip
    assert keys(store.search(("docs",), filter={"tags": ["x"], "n": {"$gte": 3}})) == ["d03", "d04"]
    assert store.search(("docs",), filter={"n": 99}) == []
    assert store.search(("nope",)) == []


def test_search_with_query(store: KalosStore) -> None:
    store.put(("kb",), "py", {"text": "python python", "tags": ["rust"]})
    store.put(("kb",), "rs", {"text": "rust"})
    store.put(("kb",), "tea", {"text": "tea and coffee"})
    store.put(("kb",), "raw", {"text": "python"}, index=False)  # no vector: listed, not scored
    store.put(("kb", "deep"), "cof", {"text": "coffee", "lang": "en"})
    hits = store.search(("kb",), query="python")
    assert keys(hits)[0] == "py"
    scored = [h for h in hits if h.score is not None]
    assert [h.score for h in scored] == sorted((h.score for h in scored), reverse=True)
    assert hits[-1].key == "raw"
    assert hits[-1].score is None
    # an item's score is its best vector's: "py" matches "rust" through its tags[*] field
    rust = store.search(("kb",), query="rust", limit=2)
    assert set(keys(rust)) == {"py", "rs"}
    assert rust[0].score == pytest.approx(rust[1].score, abs=1e-3)
    assert keys(store.search(("kb",), query="coffee", limit=2)) == ["cof", "tea"]
    assert keys(store.search(("kb",), query="coffee", filter={"lang": "en"})) == ["cof"]
    assert keys(store.search(("kb", "deep"), query="python")) == ["cof"]
    page = store.search(("kb",), query="python", limit=2, offset=1)
    assert keys(page) == keys(hits)[1:3]


def test_index_override_and_reindex_drops_stale_vectors(store: KalosStore) -> None:
    store.put(("kb",), "a", {"text": "dog", "tags": ["python", "rust", "tea"]})
    vec_ns = f"{store.prefix}/v/kb"
    assert store.client.count(vec_ns) == 4
    store.put(("kb",), "a", {"text": "dog", "tags": []})
    assert store.client.count(vec_ns) == 1
    assert store.search(("kb",), query="tea")[0].score < 0.5  # only "dog" is left to match
    store.put(("kb",), "b", {"text": "dog", "title": "tea"}, index=["title"])
    assert keys(store.search(("kb",), query="tea", limit=1)) == ["b"]
    store.put(("kb",), "b", {"text": "tea"}, index=False)
    assert store.client.count(vec_ns) == 1  # b's vector is gone with its index
    store.delete(("kb",), "a")
    assert store.client.count(vec_ns) == 0


def test_repeated_texts_in_one_batch(store: KalosStore) -> None:
    # LangGraph's InMemoryStore raises on this (see docs/memory.md); Kalos embeds each distinct
    # text once and gives every path its vector.
    store.batch([PutOp(("kb",), "a", {"text": "tea", "tags": ["tea", "dog"]}),
                 PutOp(("kb",), "b", {"text": "tea"})])  # fmt: skip
    assert store.client.count(f"{store.prefix}/v/kb") == 4
    assert set(keys(store.search(("kb",), query="tea", limit=2))) == {"a", "b"}


def test_list_namespaces(store: KalosStore) -> None:
    for ns in [("a", "b", "c"), ("a", "b", "d", "e"), ("a", "b", "d", "i"), ("a", "b", "f"),
               ("a", "c", "f"), ("x",)]:  # fmt: skip
        store.put(ns, "k", {"text": "v"})
    assert store.list_namespaces(prefix=("a", "b"), max_depth=3) == [
        ("a", "b", "c"), ("a", "b", "d"), ("a", "b", "f")]  # fmt: skip
    assert store.list_namespaces(suffix=("f",)) == [("a", "b", "f"), ("a", "c", "f")]
    assert store.list_namespaces(prefix=("a", "*", "f")) == [("a", "b", "f"), ("a", "c", "f")]
    assert store.list_namespaces(prefix=("a",), suffix=("*", "e")) == [("a", "b", "d", "e")]
    assert store.list_namespaces(max_depth=1) == [("a",), ("x",)]
    assert len(store.list_namespaces()) == 6
    assert store.list_namespaces(limit=2, offset=1) == [("a", "b", "d", "e"), ("a", "b", "d", "i")]


# ---------------------------------------------------------------------------------------------
# batch / abatch, differential against InMemoryStore


def _ops() -> list[Any]:
    return [
        PutOp(("u", "1"), "a", {"text": "python rust", "n": 1}),
        PutOp(("u", "1"), "b", {"text": "tea", "n": 2}),
        PutOp(("u", "2"), "c", {"text": "coffee paris", "n": 3, "tags": ["rome"]}),
        GetOp(("u", "1"), "a"),
        SearchOp(("u",), query="rome coffee", limit=5),
        SearchOp(("u",), filter={"n": {"$gte": 2}}),
        ListNamespacesOp(),
        PutOp(("u", "1"), "a", None),
        GetOp(("u", "1"), "a"),
    ]


def _normalize(result: Any) -> Any:
    if isinstance(result, list) and result and hasattr(result[0], "key"):
        return sorted((i.namespace, i.key, repr(i.value),
                       None if getattr(i, "score", None) is None else round(i.score, 4))
                      for i in result)  # fmt: skip
    if hasattr(result, "key"):
        return (result.namespace, result.key, result.value)
    return result


def test_batch_runs_ops_in_order(store: KalosStore) -> None:
    results = store.batch(_ops())
    assert results[0] is None
    assert results[3] is not None
    assert results[3].value == {"text": "python rust", "n": 1}  # the put before it is applied
    assert keys(results[4])[0] == "c"
    assert sorted(keys(results[5])) == ["b", "c"]
    assert results[6] == [("u", "1"), ("u", "2")]
    assert results[8] is None  # deleted by the put before it


async def test_abatch_matches_batch(sidecar: Sidecar) -> None:
    sync = KalosStore(sidecar.name, index=INDEX, prefix=f"s{uuid.uuid4().hex[:8]}")
    asyn = KalosStore(sidecar.name, index=INDEX, prefix=f"a{uuid.uuid4().hex[:8]}")
    expected = [_normalize(r) for r in sync.batch(_ops())]
    got = [_normalize(r) for r in await asyn.abatch(_ops())]
    assert got == expected
    await asyn.aput(("z",), "k", {"text": "dog"})
    assert (await asyn.aget(("z",), "k")).value == {"text": "dog"}  # type: ignore[union-attr]
    assert keys(await asyn.asearch(("z",), query="dog")) == ["k"]
    await asyn.adelete(("z",), "k")
    assert await asyn.alist_namespaces(prefix=("z",)) == []


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_searches_past_one_recall_rank_every_matching_item(
    metric: str, make_name: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the sidecar's best --max-k vectors of a namespace hold too few passing items (a
    selective nested filter, or offset + limit above --max-k), the items beyond came back
    unscored, oldest first, and better matches were dropped; they are scored in this process:
    the same ranking and scores as a float64 reference (and, under cosine, as InMemoryStore).
    Control: a search one recall answers reads no vectors."""
    emb = DeterministicFakeEmbedding(size=DIM)
    index: Any = {"dims": DIM, "embed": emb, "fields": ["text"]}
    ref = InMemoryStore(index=index)
    values = {f"k{i:03}": {"text": f"item {i}", "meta": {"lang": "en" if i % 20 == 3 else "de"}, "n": i % 7}
              for i in range(203)}  # fmt: skip
    indexed = {key for i, key in enumerate(values) if i % 50 != 7}
    with Sidecar(make_name(), dim=DIM, device="cpu", metric=metric, max_k=16, startup_timeout=60.0) as sc:
        store = KalosStore(sc.name, index=index)
        for key, value in values.items():
            for st in (ref, store):
                st.put(("kb",), key, value, index=None if key in indexed else False)
        scans: list[int] = []
        real = KalosStore._scored_by_scan

        def spy(self: KalosStore, *a: Any) -> Any:
            scans.append(1)
            return real(self, *a)

        monkeypatch.setattr(KalosStore, "_scored_by_scan", spy)
        cases: list[tuple[dict[str, Any], Callable[[dict[str, Any]], bool], bool]] = [
            ({"query": "item 7", "limit": 5, "filter": {"meta": {"lang": "en"}}},
             lambda v: v["meta"]["lang"] == "en", True),
            ({"query": "item 150", "limit": 20, "offset": 10}, lambda v: True, True),
            ({"query": "item 150", "limit": 12, "offset": 6, "filter": {"n": {"$lte": 3}, "meta": {"lang": "de"}}},
             lambda v: v["n"] <= 3 and v["meta"]["lang"] == "de", True),
            ({"query": "item 42", "limit": 9}, lambda v: True, False),  # control: one recall
            ({"query": "item 42", "limit": 16}, lambda v: True, False),  # (== --max-k: no tie, no read)
        ]  # fmt: skip
        for q, passes, reads in cases:
            qv = np.array(emb.embed_query(q["query"]), np.float64)
            scored = []
            for key in sorted(indexed):
                if passes(values[key]):
                    v = np.array(emb.embed_query(values[key]["text"]), np.float64)
                    if metric == "cosine":
                        score = float(v @ qv / np.linalg.norm(v) / np.linalg.norm(qv))
                    else:
                        score = -float(np.linalg.norm(v - qv))
                    scored.append((score, key))
            scored.sort(reverse=True)
            want = scored[q.get("offset", 0) : q.get("offset", 0) + q["limit"]]
            scans.clear()
            got = store.search(("kb",), **q)
            assert [i.key for i in got] == [key for _, key in want], q
            for g, (score, _) in zip(got, want, strict=True):
                assert g.score == pytest.approx(score, abs=1e-4), q
            assert bool(scans) == reads, q
            if metric == "cosine":  # (InMemoryStore ranks by cosine whatever the sidecar's metric)
                assert [i.key for i in ref.search(("kb",), **q)] == [i.key for i in got], q
        store.close()


class _SeededEmbeddings(Embeddings):
    """A random vector per text (seeded by it): scores of many digits, unlike KeywordEmbeddings'."""

    def _vec(self, text: str) -> list[float]:
        return np.random.default_rng(zlib.crc32(text.encode())).standard_normal(DIM).tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._vec(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._vec(text)


@pytest.mark.parametrize("max_k", [16, 1024])
def test_pages_of_tied_scores_neither_repeat_nor_skip(max_k: int, make_name: Callable[[], str]) -> None:
    """Items whose texts are the same score the same: pages through them are cut from one
    order, best first and then by namespace and key, whatever each page's offset + limit.
    (Before: which of the tied vectors a recall returned depended on its k, so pages of 7
    repeated some items and skipped others.) At --max-k 16 the ties run past one recall and
    are scored in this process; at 1024 a recall of more vectors settles them."""
    with Sidecar(make_name(), dim=DIM, device="cpu", max_k=max_k, startup_timeout=60.0) as sc:
        store = KalosStore(sc.name, index=INDEX)
        order = [f"k{i:03d}" for i in range(61)]
        rng = np.random.default_rng(5)
        for i in rng.permutation(len(order)).tolist():  # (put in an order unlike the keys')
            store.put(("tie", "b" if i % 3 else "a"), order[i], {"text": "rome"})
        for i in range(5):
            store.put(("tie", "a"), f"worse{i}", {"text": f"rome {'tea ' * (i + 1)}"})
        want = [k for ns in ("a", "b") for k in order if ("b" if int(k[1:]) % 3 else "a") == ns]
        want += [f"worse{i}" for i in range(5)]
        whole = store.search(("tie",), query="rome", limit=100)
        assert [i.key for i in whole] == want
        assert len({i.score for i in whole[:61]}) == 1  # (the ties are real)
        pages = [i.key for o in range(0, 70, 7) for i in store.search(("tie",), query="rome", limit=7, offset=o)]
        assert pages == [i.key for i in whole]
        # one namespace scored in this process for the later pages only (at --max-k 16): an
        # item the sidecar returned keeps the sidecar's score there (float32, where this
        # process scores in float64), so its place does not move between pages
        noisy = KalosStore(sc.name, index={"dims": DIM, "embed": _SeededEmbeddings(), "fields": ["text"]},
                           prefix="noisy")  # fmt: skip
        for i in range(10):
            noisy.put(("mix", "a"), f"a{i}", {"text": "T"})
            noisy.put(("mix", "a"), f"u{i}", {"text": "U"})
        for i in range(3):
            noisy.put(("mix", "b"), f"b{i}", {"text": "T"})
        for q in [f"query {j}" for j in range(8)]:
            whole = [i.key for i in noisy.search(("mix",), query=q, limit=100)]
            pages = [i.key for o in range(0, 25, 5) for i in noisy.search(("mix",), query=q, limit=5, offset=o)]
            assert pages == whole, q
        noisy.close()
        store.close()


def test_agrees_with_langgraph_in_memory_store(sidecar: Sidecar) -> None:
    """The same operations on LangGraph's reference store and on Kalos give the same answers:
    ranked results in the same order with the same scores, filtered listings with the same
    items, the same namespaces and values. Every text embeds to its own random vector, so
    there are no ties to break differently."""
    index: Any = {"dims": DIM, "embed": DeterministicFakeEmbedding(size=DIM),
                  "fields": ["text", "tags[*]"]}  # fmt: skip
    ref = InMemoryStore(index=index)
    store = KalosStore(sidecar.name, index=index, prefix=f"d{uuid.uuid4().hex[:8]}")
    rng = np.random.default_rng(3)
    for i in range(40):
        ns = ("org", f"team{i % 3}", f"user{i % 5}")
        words = " ".join(rng.choice(VOCAB, size=int(rng.integers(1, 4)), replace=False))
        # unique texts: InMemoryStore also raises when one put has the same text twice
        tags = [f"{w} tag{i}" for w in rng.choice(VOCAB, 2, replace=False)]
        value = {"text": f"{words} #{i}", "n": i % 7, "tags": tags, "kind": {"k": i % 2},
                 "flag": (True, 1, False, 0, 1.0)[i % 5]}  # (Python's ==: True == 1 == 1.0)
        if i % 3 < 2:  # "opt": null, "x" or absent (a missing field reads as None in both)
            value["opt"] = (None, "x")[i % 3]
        for s in (ref, store):
            s.put(ns, f"item{i}", value, index=None if i % 9 else False)
    for s in (ref, store):
        s.delete(("org", "team1", "user1"), "item1")
        s.put(("org", "team1", "user2"), "item2", {"text": "rewritten", "n": 2, "kind": {"k": 0}, "flag": 0})
    queries: list[dict[str, Any]] = [
        {"query": "python tea", "limit": 7},
        {"query": "rome", "limit": 5, "filter": {"n": {"$lte": 3}}},
        {"query": "dog coffee", "limit": 4, "offset": 2},
        {"query": "paris", "limit": 50, "filter": {"kind": {"k": 1}}},
        {"query": "rewritten", "limit": 3},
        {"filter": {"n": 4}, "limit": 50},
        {"filter": {"n": {"$ne": 2}, "kind": {"k": 0}}, "limit": 50},
        {"filter": {"opt": None}, "limit": 50},
        {"filter": {"opt": {"$ne": None}}, "limit": 50},
        {"filter": {"opt": {"$eq": None}, "n": {"$gte": 2}}, "limit": 50},
        {"query": "tea", "limit": 6, "filter": {"opt": None}},
        {"query": "tea", "limit": 6, "filter": {"opt": {"$ne": None}}},
        {"filter": {"flag": True}, "limit": 50},
        {"filter": {"flag": 1}, "limit": 50},
        {"filter": {"flag": {"$ne": 0}}, "limit": 50},
        {"filter": {"n": {"$lte": True}}, "limit": 50},
        {"filter": {"flag": {"$gt": 0.5}}, "limit": 50},
        {"query": "tea", "limit": 6, "filter": {"flag": False}},
    ]
    for q in queries:
        for prefix in [("org",), ("org", "team2"), ("org", "team0", "user0")]:
            want, got = ref.search(prefix, **q), store.search(prefix, **q)
            assert _normalize(got) == _normalize(want), (prefix, q)
            if "query" in q:  # ranked part: same order, same scores
                ranked = [(i.namespace, i.key) for i in want if i.score is not None]
                assert [(i.namespace, i.key) for i in got if i.score is not None] == ranked
                for g, w in zip(got, want, strict=True):
                    assert (g.score is None) == (w.score is None)
                    assert g.score is None or g.score == pytest.approx(w.score, abs=1e-4)
    # pages without a query: in one namespace both list oldest first (across namespaces
    # InMemoryStore lists namespace by namespace, Kalos by creation time: docs/memory.md)
    for q in ({"filter": {"n": {"$gte": 1}}, "limit": 3, "offset": 1}, {"limit": 2, "offset": 1}):
        want, got = ref.search(("org", "team0", "user0"), **q), store.search(("org", "team0", "user0"), **q)
        assert [(i.key, i.value) for i in got] == [(i.key, i.value) for i in want], q
    for kw in [{}, {"prefix": ("org", "team1")}, {"suffix": ("user3",)}, {"max_depth": 2}]:
        assert store.list_namespaces(**kw) == ref.list_namespaces(**kw), kw
    for i in range(40):
        ns = ("org", f"team{i % 3}", f"user{i % 5}")
        want_item, got_item = ref.get(ns, f"item{i}"), store.get(ns, f"item{i}")
        assert (got_item is None) == (want_item is None)
        assert got_item is None or got_item.value == want_item.value  # type: ignore[union-attr]


def test_filter_operators_beyond_in_memory_stores(store: KalosStore) -> None:
    """$in / $nin run in the sidecar (InMemoryStore refuses them); an unknown or misspelled
    operator is refused at once, even where nothing would be compared (it used to give [])."""
    for i, lang in enumerate(["en", "fr", "de"]):
        store.put(("ops",), f"k{i}", {"lang": lang, "n": i})
    assert sorted(keys(store.search(("ops",), filter={"lang": {"$in": ["en", "de"]}}))) == ["k0", "k2"]
    assert keys(store.search(("ops",), filter={"n": {"$nin": [0, 2]}})) == ["k1"]
    assert sorted(keys(store.search(("ops",), query="tea", filter={"lang": {"$in": ["fr", "de"]}}))) == ["k1", "k2"]
    for bad in ({"lang": {"$eqq": "en"}}, {"lang": {"$contains": "e"}}):
        with pytest.raises(ValueError, match="Unsupported operator"):
            store.search(("ops",), filter=bad)
        with pytest.raises(ValueError, match="Unsupported operator"):
            store.search(("nothing", "here"), filter=bad)


def test_a_range_on_a_nested_field_follows_a_top_level_ones_rule(store: KalosStore) -> None:
    """Ordered comparisons on a nested field (checked in this process) answer as on a
    top-level one (in the sidecar): numbers with numbers, booleans as 1 and 0, strings with
    strings, nothing else. (Before: both sides went through float(), so "5" > 3 held nested
    and not at the top, and "b" > "a" the other way round.)"""
    stored = {"int": 5, "float": 2.5, "numstr": "5", "str": "b", "true": True, "false": False, "none": None}
    for key, v in stored.items():
        store.put(("rng",), key, {"n": v, "m": {"n": v}})
    store.put(("rng",), "missing", {"m": {}})
    for op in ("$gt", "$gte", "$lt", "$lte"):
        for arg in (3, 1, 0.5, "a", "c", True):
            top = sorted(keys(store.search(("rng",), filter={"n": {op: arg}}, limit=20)))
            nested = sorted(keys(store.search(("rng",), filter={"m": {"n": {op: arg}}}, limit=20)))
            assert nested == top, (op, arg)
    assert sorted(keys(store.search(("rng",), filter={"m": {"n": {"$gt": "a"}}}))) == ["str"]
    assert sorted(keys(store.search(("rng",), filter={"m": {"n": {"$gt": 0.5}}}))) == ["float", "int", "true"]


def test_an_empty_key_is_refused_on_put_and_absent_on_get(store: KalosStore) -> None:
    with pytest.raises(ValueError, match="non-empty strings"):
        store.put(("x",), "", {"text": "tea"})
    assert store.get(("x",), "") is None
    store.delete(("x",), "")  # (nothing there: nothing to do, as in InMemoryStore)


def test_a_delete_of_what_no_put_could_store_does_nothing(store: KalosStore) -> None:
    """BaseStore.delete checks labels only: a delete in an empty namespace, under the root
    "langgraph", or of a key or namespace too long for Kalos does nothing, as in
    InMemoryStore (before: the put's rules raised). Labels are still checked."""
    store.put(("x",), "k", {"text": "tea"})
    for ns, key in [((), "k"), (("langgraph", "x"), "k"), (("x",), "k" * 501), (("y" * 300,), "k")]:
        assert InMemoryStore().delete(ns, key) is None  # (what LangGraph's own store does)
        store.delete(ns, key)
        store.batch([PutOp(ns, key, None)])
    with pytest.raises(InvalidNamespaceError):
        store.delete(("a.b",), "k")
    assert store.get(("x",), "k") is not None


class _Cut(BaseException):
    """Where a test's put stops, as if its process had died there (a BaseException: nothing
    of the put runs after it, as after a kill)."""


@pytest.mark.parametrize("cut", ["upsert", "delete"])
def test_a_put_cut_between_its_writes_leaves_no_row_its_next_put_or_delete_misses(
    store: KalosStore, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """A put makes several sidecar calls; a process that dies between them leaves vector rows
    of the value it was writing ("upsert": it dies as its vector rows are written, over a key
    that had none, and they are, as the test then does; "delete": the stale rows of the old
    value are not yet removed). The key's next put and
    its delete still remove every such row, so no copy of a deleted value stays behind and no
    old text ranks the new value (before: the rows past the new count were never removed)."""
    ns = ("cut", cut)
    _, vecs_ns = store._names(ns)
    many = {"text": "tea", "tags": ["paris secret", "rome secret", "dog secret"]}  # 4 vector rows
    if cut == "delete":
        store.put(ns, "k", many)
    real = getattr(store.client, cut)
    writes: list[str] = []

    def dies_at_the_vector_rows(*args: Any, **kwargs: Any) -> Any:
        namespace = kwargs.get("namespace")
        writes.append(namespace)
        if namespace == vecs_ns:
            raise _Cut
        return real(*args, **kwargs)

    monkeypatch.setattr(store.client, cut, dies_at_the_vector_rows)
    with pytest.raises(_Cut):
        store.put(ns, "k", {"text": "coffee"} if cut == "delete" else many)
    assert vecs_ns in writes
    monkeypatch.undo()
    if cut == "upsert":  # the item row came first, so the rows now written are below its high
        vecs = np.asarray(KeywordEmbeddings().embed_documents(["tea", "paris", "rome", "dog"]), np.float32)
        store.client.upsert([f"k\x00{j}" for j in range(4)], vecs, None, [many] * 4, namespace=vecs_ns)
    assert store.client.count(vecs_ns) == 4  # rows the next put must clear
    store.put(ns, "k", {"text": "python"})
    assert [r.id for r in store.client.scan(namespace=vecs_ns)] == ["k\x000"]
    assert [(i.key, i.value) for i in store.search(ns, query="paris secret")] == [("k", {"text": "python"})]
    assert store.search(ns, query="paris secret")[0].score < 0.5  # (scored by "python" alone)
    store.delete(ns, "k")
    assert store.client.count(vecs_ns) == 0


def test_a_refused_write_of_vector_rows_puts_the_items_back(store: KalosStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar refusing a put's vector rows (out of device memory, say) leaves the items as
    they were: an existing one with its old value and ranking, a new one absent; the error
    carries no ids (they are the store's rows', not the caller's). Control: the same batch
    unrefused stores both."""
    ns = ("refused",)
    _, vecs_ns = store._names(ns)
    store.put(ns, "old", {"text": "tea"})
    upsert = store.client.upsert

    def refuse_vector_rows(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("namespace") == vecs_ns:
            raise CapacityError("could not grow the index (injected)")
        return upsert(*args, **kwargs)

    monkeypatch.setattr(store.client, "upsert", refuse_vector_rows)
    batch = [PutOp(ns, "old", {"text": "python"}), PutOp(ns, "new", {"text": "rust"})]
    with pytest.raises(CapacityError) as info:
        store.batch(batch)
    assert (info.value.ids, info.value.committed) == (None, None)
    monkeypatch.undo()
    assert store.get(ns, "old").value == {"text": "tea"} and store.get(ns, "new") is None  # type: ignore[union-attr]
    assert [(i.key, i.value) for i in store.search(ns, query="tea")] == [("old", {"text": "tea"})]
    assert [r.id for r in store.client.scan(namespace=vecs_ns)] == ["old\x000"]
    store.batch(batch)  # (control)
    assert {i.key: i.value["text"] for i in store.search(ns, query="python rust")} == {"old": "python", "new": "rust"}


def test_a_vector_write_that_may_have_stored_rows_leaves_the_new_values(
    store: KalosStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later chunk of the vector rows refused (``committed`` > 0), or no answer in time: some
    rows may be stored, so the new values stand (put back, the old value would be ranked by
    the new texts), their highs covering the rows; the key's next put leaves exactly its own."""
    ns = ("partly",)
    _, vecs_ns = store._names(ns)
    upsert = store.client.upsert
    for error in (CapacityError("a later chunk refused (injected)"), SidecarTimeout("no answer (injected)")):
        store.put(ns, "k", {"text": "tea"})

        def stores_then_fails(*args: Any, error: KalosError = error, **kwargs: Any) -> Any:
            out = upsert(*args, **kwargs)
            if kwargs.get("namespace") == vecs_ns:
                error.committed = 1
                raise error
            return out

        monkeypatch.setattr(store.client, "upsert", stores_then_fails)
        with pytest.raises(type(error)):
            store.put(ns, "k", {"text": "python", "tags": ["rust"]})
        monkeypatch.undo()
        assert store.get(ns, "k").value == {"text": "python", "tags": ["rust"]}  # type: ignore[union-attr]
        assert [(i.key, i.value["text"]) for i in store.search(ns, query="python")] == [("k", "python")]
        store.put(ns, "k", {"text": "dog"})
        assert [r.id for r in store.client.scan(namespace=vecs_ns)] == ["k\x000"]


def test_dates_and_numpy_numbers_in_a_value_read_back_as_iso_strings_and_numbers(store: KalosStore) -> None:
    """A value holding a datetime (or a numpy number) is stored as the client stores metadata:
    the ISO string (the number), in the item and in each vector row; a put that shrinks such
    an item's vectors lowers its high (a comparison of the stored value with the put's, which
    raised TypeError on the datetime) and leaves one vector row."""
    import numpy as np

    when = datetime(2026, 12, 7, 8, 30)
    store.put(("dated",), "k", {"text": "tea", "tags": ["rust", "rome"], "when": when, "n": np.int64(4)})
    assert store.get(("dated",), "k").value == {  # type: ignore[union-attr]
        "text": "tea", "tags": ["rust", "rome"], "when": "2026-12-07T08:30:00", "n": 4}  # fmt: skip
    store.put(("dated",), "k", {"text": "tea", "when": when})
    items_ns, vecs_ns = store._names(("dated",))
    assert store.client.count(vecs_ns) == 1
    assert json.loads(store.client.get(["k"], namespace=items_ns)[0].text or "") == {"vectors": 1, "high": 1}
    assert [i.value["when"] for i in store.search(("dated",), query="tea")] == ["2026-12-07T08:30:00"]
    # a filter's datetime is compared as stored (it matched nothing: the string against the datetime)
    for flt in ({"when": when}, {"when": {"$eq": when}}, {"when": {"$gte": when}}, {"when": {"$in": [when]}}):
        assert [i.key for i in store.search(("dated",), filter=flt)] == ["k"], flt
    assert store.search(("dated",), filter={"when": {"$gt": when}}) == []


def test_a_batch_refused_in_a_later_namespace_writes_no_earlier_one(store: KalosStore) -> None:
    """A value too large for a slot, or not JSON, in the batch's second namespace refuses the
    batch before the first namespace is written (the client's rule: a ValueError, nothing
    written)."""
    for bad in ({"text": "tea", "blob": "x" * (1 << 21)}, {"text": "tea", "when": {datetime(2026, 12, 7)}}):
        store.put(("first",), "k", {"text": "tea"})
        with pytest.raises(ValueError, match=r"too large|JSON"):
            store.batch([PutOp(("first",), "k", {"text": "python"}), PutOp(("second",), "k", bad)])
        assert store.get(("first",), "k").value == {"text": "tea"}  # type: ignore[union-attr]
        assert store.get(("second",), "k") is None


def test_a_put_made_while_another_shrinks_its_key_keeps_its_value_and_high(
    sidecar: Sidecar, store: KalosStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's put of the key between this put's stale delete and its lowering of
    the high: the lowering skips that item (its rows are no longer this put's), so the other
    value and its high stand, and the key's next put removes every row beyond its count."""
    ns = ("race2",)
    items_ns, vecs_ns = store._names(ns)
    other = KalosStore(sidecar.name, index=INDEX, prefix=store.prefix)  # (its own client: another process's)
    store.put(ns, "k", {"text": "tea", "tags": ["rust", "rome", "dog", "paris"]})
    delete = store.client.delete

    def then_another_put(*args: Any, **kwargs: Any) -> Any:
        out = delete(*args, **kwargs)
        other.put(ns, "k", {"text": "coffee", "tags": ["python", "rust"]})
        return out

    monkeypatch.setattr(store.client, "delete", then_another_put)
    store.put(ns, "k", {"text": "tea"})
    monkeypatch.undo()
    assert store.get(ns, "k").value == {"text": "coffee", "tags": ["python", "rust"]}  # type: ignore[union-attr]
    assert json.loads(store.client.get(["k"], namespace=items_ns)[0].text) == {"vectors": 3, "high": 3}  # (its own)
    store.put(ns, "k", {"text": "dog"})
    assert [r.id for r in store.client.scan(namespace=vecs_ns)] == ["k\x000"]
    other.close()


def test_the_high_comes_down_once_the_surplus_rows_are_removed(
    store: KalosStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key whose texts went from five to one records one vector row once the other four are
    removed, so its later puts delete nothing (with the high kept at five, each would ask to
    delete four absent rows)."""
    ns = ("high",)
    items_ns, vecs_ns = store._names(ns)
    store.put(ns, "k", {"text": "tea", "tags": ["rust", "rome", "dog", "paris"]})
    assert json.loads(store.client.get(["k"], namespace=items_ns)[0].text) == {"vectors": 5, "high": 5}
    store.put(ns, "k", {"text": "tea"})
    assert json.loads(store.client.get(["k"], namespace=items_ns)[0].text) == {"vectors": 1, "high": 1}
    assert [r.id for r in store.client.scan(namespace=vecs_ns)] == ["k\x000"]
    deletes: list[Any] = []
    delete = store.client.delete
    monkeypatch.setattr(store.client, "delete", lambda *a, **kw: deletes.append(a) or delete(*a, **kw))
    store.put(ns, "k", {"text": "coffee"})
    assert deletes == []


@contextlib.contextmanager
def _own_store(sidecar: Sidecar, embed: Embeddings) -> Iterator[KalosStore]:
    store = KalosStore(sidecar.name, index={**INDEX, "embed": embed}, prefix=f"o{uuid.uuid4().hex[:8]}")
    try:
        yield store
    finally:
        for name in store.client.namespaces():
            if name.startswith(store.prefix + "/"):
                store.client.delete_namespace(name)
        store.close()


def test_a_nan_embedding_refuses_the_whole_batch_before_any_write(sidecar: Sidecar) -> None:
    """A text embedded to NaN refuses its batch, naming it, before any namespace's write: the
    values put before stay (the item rows are written first, so a late check would have
    stored the new values)."""
    class NanFor(KeywordEmbeddings):
        def _vec(self, text: str) -> list[float]:
            return [math.nan] * DIM if "nan" in text else super()._vec(text)

    with _own_store(sidecar, NanFor()) as store:
        store.put(("a",), "k", {"text": "tea"})
        store.put(("b",), "k", {"text": "tea"})
        with pytest.raises(ValueError, match=r"text 0 of key 'k' contains NaN"):
            store.batch([PutOp(("a",), "k", {"text": "python"}), PutOp(("b",), "k", {"text": "nan here"})])
        assert [store.get((n,), "k").value for n in "ab"] == [{"text": "tea"}] * 2  # type: ignore[union-attr]
        assert [i.key for i in store.search(("a",), query="tea")] == ["k"]


def test_a_text_that_embeds_to_zeros_is_stored_unscored(sidecar: Sidecar) -> None:
    """Under cosine a text whose embedding is all zeros (no direction) gets no vector row: its
    item is stored and found after the scored ones (``InMemoryStore`` stores it with score 0);
    a vector row it had before is removed. (Before, the whole put raised, storing nothing.)"""
    class ZeroForUnknown(KeywordEmbeddings):
        def _vec(self, text: str) -> list[float]:
            return [0.0] * DIM if "unknown" in text else super()._vec(text)

    with _own_store(sidecar, ZeroForUnknown()) as store:
        ns = ("zero",)
        _, vecs_ns = store._names(ns)
        store.put(ns, "ok", {"text": "tea"})
        store.put(ns, "unk", {"text": "tea", "tags": ["coffee"]})
        store.put(ns, "unk", {"text": "unknown words", "tags": ["coffee"]})
        assert sorted(r.id for r in store.client.scan(namespace=vecs_ns)) == ["ok\x000", "unk\x001"]
        got = store.search(ns, query="tea", limit=5)
        assert [(i.key, i.score is None) for i in got] == [("ok", False), ("unk", False)]  # (its tag's vector)
        store.put(ns, "unk", {"text": "unknown"})
        got = store.search(ns, query="tea", limit=5)
        assert [(i.key, i.score is None) for i in got] == [("ok", False), ("unk", True)]
        assert store.get(ns, "unk").value == {"text": "unknown"}  # type: ignore[union-attr]


def test_a_stale_vector_row_never_answers_for_its_item(store: KalosStore) -> None:
    """A vector row whose value is not the item's (left by two processes putting one key at
    once, or by an interrupted write) is checked against the item row: a filter on the stale
    value finds nothing (the old code returned the item), and a deleted item's stale row brings
    nothing back while its namespace has other items."""
    ns = ("race",)
    store.put(ns, "k", {"text": "tea", "writer": 0})
    _, vecs_ns = store._names(ns)
    vec = np.asarray(KeywordEmbeddings().embed_query("tea"), np.float32)[None]
    store.client.upsert(["k\x005"], vec, None, [{"text": "tea", "writer": 1}], namespace=vecs_ns)
    assert store.client.count(vecs_ns) == 2
    assert keys(store.search(ns, query="tea", filter={"writer": 0})) == ["k"]
    assert store.search(ns, query="tea", filter={"writer": 1}) == []
    assert [i.value["writer"] for i in store.search(ns, query="tea")] == [0]
    store.put(ns, "other", {"text": "coffee", "writer": 2})  # (the namespace stays after the delete)
    store.delete(ns, "k")
    assert store.client.count(vecs_ns) == 2  # k's stale row, other's
    assert keys(store.search(ns, query="tea")) == ["other"]


@pytest.mark.parametrize("turns", [True, False], ids=["turns", "control"])
def test_threads_putting_one_key_leave_exactly_its_vectors(store: KalosStore, monkeypatch, turns: bool) -> None:
    """Two threads put one key at once, with 6 and 1 tags (7 and 2 vector rows): afterwards
    the key has as many vector rows as its stored value has texts, because the store's puts
    take turns. Each put's read of the old count is slowed (the 1-tag put's more, so that it
    writes last); the negative control, without the turns, leaves the 6-tag put's extra rows
    under the 1-tag value."""
    ns = ("race",)
    _, vecs_ns = store._names(ns)
    store.put(ns, "k", {"text": "tea", "tags": ["tea 0"]})
    real_get = store.client.get

    def slow_get(*a, **kw):  # type: ignore[no-untyped-def]
        out = real_get(*a, **kw)
        time.sleep(0.05 if threading.current_thread().name == "six" else 0.3)
        return out

    monkeypatch.setattr(store.client, "get", slow_get)
    if not turns:
        store._put_locks = tuple(contextlib.nullcontext() for _ in store._put_locks)  # type: ignore[assignment]
    go = threading.Barrier(2)

    def writer(n_tags: int) -> None:
        go.wait()
        store.put(ns, "k", {"text": f"tea {n_tags}", "tags": [f"tea {j}" for j in range(n_tags)]})

    threads = [threading.Thread(target=writer, args=(n,), name=name) for n, name in ((6, "six"), (1, "one"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    item = store.get(ns, "k")
    assert item is not None
    rows = store.client.count(vecs_ns)
    assert (rows == 1 + len(item.value["tags"])) is turns, (item.value, rows)


@pytest.mark.parametrize("locks", ["per key", "one for all (control)"])
def test_puts_of_other_keys_do_not_wait_for_each_other(sidecar: Sidecar, locks: str) -> None:
    """Four threads put four keys at once on a paused sidecar (timeout 0.3 s): each ends at
    its own deadline, together, not one after the other (the control, one lock for every key
    as before, ends ~4 timeouts after the start)."""
    store = KalosStore(client=KalosClient(sidecar.name, timeout=0.3), prefix=f"p{uuid.uuid4().hex[:8]}")
    keys: list[str] = []
    stripes: set[int] = set()
    for i in range(1000):  # (keys of four different locks: string hashes differ from run to run)
        s = hash((("locks",), f"k{i}")) % len(store._put_locks)
        if s not in stripes and len(keys) < 4:
            stripes.add(s)
            keys.append(f"k{i}")
    if locks != "per key":
        one = threading.Lock()
        store._put_locks = (one,) * len(store._put_locks)
    store.put(("locks",), "warm", {"text": "tea"})
    errors: list[BaseException] = []
    go = threading.Barrier(4)

    def writer(key: str) -> None:
        go.wait()
        try:
            store.put(("locks",), key, {"text": "tea"})
        except SidecarTimeout as e:
            errors.append(e)

    sidecar.kill(signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=writer, args=(k,)) for k in keys]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
    finally:
        sidecar.kill(signal.SIGCONT)
    assert len(errors) == 4
    if locks == "per key":
        assert took < 0.8, took
    else:
        assert took > 1.0, took
    store.client.close()


# ---------------------------------------------------------------------------------------------
# in a graph, errors, degradation


class State(TypedDict):
    user: str
    fact: str
    recalled: list[str]


def test_a_compiled_graph_uses_the_store(store: KalosStore) -> None:
    def remember(state: State, *, store: BaseStore) -> dict:
        store.put(("memories", state["user"]), uuid.uuid4().hex, {"text": state["fact"]})
        return {}

    def recall(state: State, *, store: BaseStore) -> dict:
        items = store.search(("memories", state["user"]), query=state["fact"], limit=3)
        return {"recalled": [i.value["text"] for i in items]}

    builder = StateGraph(State)
    builder.add_node("remember", remember)
    builder.add_node("recall", recall)
    builder.add_edge(START, "remember")
    builder.add_edge("remember", "recall")
    builder.add_edge("recall", END)
    graph = builder.compile(store=store)
    graph.invoke({"user": "alice", "fact": "likes tea", "recalled": []})
    out = graph.invoke({"user": "alice", "fact": "likes coffee", "recalled": []})
    assert out["recalled"][0] == "likes coffee"
    assert set(out["recalled"]) == {"likes tea", "likes coffee"}
    bob = graph.invoke({"user": "bob", "fact": "tea", "recalled": []})
    assert bob["recalled"] == ["tea"]  # alice's memories live in alice's namespace


def test_dimension_mismatch_is_explained(sidecar: Sidecar) -> None:
    bad = KalosStore(sidecar.name, index={"dims": 5, "embed": DeterministicFakeEmbedding(size=5)},
                     prefix=f"m{uuid.uuid4().hex[:8]}")  # fmt: skip
    with pytest.raises(ValueError, match="must agree"):
        bad.put(("a",), "k", {"text": "x"})


def test_search_degrades_other_ops_raise(
    make_name: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kalos_retrievers")
    store = KalosStore(make_name(), index=INDEX, timeout=0.3)
    t0 = time.monotonic()
    assert store.search(("a",), query="tea") == []
    assert store.search(("a",), filter={"n": 1}) == []
    assert time.monotonic() - t0 < 1.5
    assert (store.degrader.degraded_calls, store.degrader.episodes) == (2, 1)
    assert sum("KalosStore" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(SidecarUnavailable):
        store.get(("a",), "k")
    with pytest.raises(SidecarUnavailable):
        store.put(("a",), "k", {"text": "tea"})
    strict = KalosStore(make_name(), index=INDEX, on_error="raise")
    with pytest.raises(SidecarUnavailable):  # negative control
        strict.search(("a",), query="tea")


def test_a_search_longer_than_its_deadline_says_what_the_deadline_covers(
    store: KalosStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A search under a prefix makes calls for each namespace; when they outlast its deadline
    on a sidecar that answers every one (here the first recall's caller is made to take
    longer than the whole deadline), it degrades saying so (before: "every worker thread was
    busy"), and names the remedies. Control: the same search in time finds every item."""
    caplog.set_level(logging.WARNING, logger="kalos_retrievers")
    for i in range(30):
        store.put(("many", f"u{i:02}"), "k", {"text": "tea"})
    ample = KalosStore(client=store.client, index=INDEX, prefix=store.prefix, timeout=30)
    assert len(ample.search(("many",), query="tea", limit=30)) == 30  # (control)
    recall = store.client.recall

    def answered_then_slow(*args: Any, **kwargs: Any) -> Any:
        res = recall(*args, **kwargs)
        time.sleep(0.15)
        return res

    monkeypatch.setattr(store.client, "recall", answered_then_slow)
    short = KalosStore(client=store.client, index=INDEX, prefix=store.prefix, timeout=0.1)
    assert short.search(("many",), query="tea", limit=30) == []
    assert isinstance(short.degrader.last_error, SidecarTimeout)
    said = str(short.degrader.last_error)
    assert "a search's deadline (0.1 s) passed before its next sidecar call" in said
    assert "longer timeout=" in said and "narrower prefix" in said
    assert any("unavailable or too slow" in r.getMessage() for r in caplog.records)


async def test_paused_sidecar_searches_degrade_together_and_recover(
    start_sidecar: Callable[..., Sidecar],
) -> None:
    sc = start_sidecar(dim=DIM)
    store = KalosStore(sc.name, index=INDEX, timeout=0.3)
    store.put(("a",), "k", {"text": "tea"})
    # on a shared client (timeout 2 s) the store's own timeout bounds a search (it was ignored)
    shared = KalosClient(sc.name, timeout=2.0)
    on_shared = KalosStore(index=INDEX, timeout=0.3, client=shared)
    assert KalosStore(index=INDEX, client=shared).timeout == 2.0  # (control: none given, the client's)
    sc.kill(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        many = await asyncio.gather(*(store.asearch(("a",), query="tea") for _ in range(30)))
        assert many == [[]] * 30
        assert time.monotonic() - t0 < 1.5  # one deadline, waiting for threads included (not 30 x 0.3 s)
        t0 = time.monotonic()
        assert on_shared.search(("a",), query="tea") == []
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(SidecarTimeout):  # a get is not degraded: not found != unreachable
            store.get(("a",), "k")
    finally:
        sc.kill(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not store.search(("a",), query="tea"):
        assert time.monotonic() < deadline, "search did not recover"
        time.sleep(0.05)
    assert not store.degrader.in_episode

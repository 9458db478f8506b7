"""KalosMemory on a real sidecar (odd dim 11): scoping and isolation between users (with
adversarial ids and filters), update/delete/history, persistence across a sidecar restart,
degradation, and both embedding families."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.embeddings import Embeddings
from llama_index.core.base.embeddings.base import BaseEmbedding

from kalos_retrievers import KalosClient, Sidecar, SidecarTimeout, SidecarUnavailable
from kalos_retrievers.memory import KalosMemory

VOCAB = ["tea", "coffee", "vegetarian", "window", "seat", "flight", "paris", "rome", "dog",
         "budget", "secret"]  # fmt: skip
DIM = len(VOCAB)  # 11


def _vec(text: str) -> list[float]:
    v = np.full(DIM, 0.01)
    for w in re.findall(r"[a-z]+", text.lower()):
        if w in VOCAB:
            v[VOCAB.index(w)] += 1.0
    return v.tolist()


class KeywordEmbeddings(Embeddings):
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [_vec(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return _vec(text)


class KeywordLlamaEmbedding(BaseEmbedding):
    def _get_query_embedding(self, query: str) -> list[float]:
        return _vec(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return _vec(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return _vec(text)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    sc = Sidecar(dim=DIM, device="cpu", startup_timeout=60.0).start()
    yield sc
    sc.stop()
    sc.log_path.unlink(missing_ok=True)


@pytest.fixture
def memory(sidecar: Sidecar, request: pytest.FixtureRequest) -> Iterator[KalosMemory]:
    m = KalosMemory(sidecar.name, embedding=KeywordEmbeddings(), collection=request.node.name[:80])
    yield m
    m.reset()
    m.close()


def texts(items: list[dict]) -> set[str]:
    return {i["memory"] for i in items}


# ---------------------------------------------------------------------------------------------
# add, search, scoping


def test_add_and_search_in_scope(memory: KalosMemory) -> None:
    added = memory.add("I drink tea every morning", user_id="alice", metadata={"topic": "food"})
    assert [(a["memory"], a["event"]) for a in added] == [("I drink tea every morning", "ADD")]
    memory.add("I drink coffee", user_id="bob", metadata={"topic": "food"})
    memory.add([{"role": "user", "content": "book a window seat on my flight"},
                {"role": "assistant", "content": "Window seat booked", "name": "travel-bot"},
                {"role": "system", "content": "you are a travel agent"}],
               user_id="alice", run_id="trip-1")  # fmt: skip
    hits = memory.search("tea", user_id="alice", limit=5)
    assert hits[0]["memory"] == "I drink tea every morning"
    assert texts(hits) == {"I drink tea every morning", "book a window seat on my flight",
                           "Window seat booked"}  # fmt: skip
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    top = hits[0]
    assert top["metadata"] == {"topic": "food"}
    assert top["user_id"] == "alice"
    assert top["created_at"] == top["updated_at"]
    assert set(top) >= {"id", "memory", "score", "metadata", "created_at", "updated_at"}
    by_run = memory.get_all(run_id="trip-1")
    assert [(m["memory"], m["role"]) for m in by_run] == [
        ("book a window seat on my flight", "user"),
        ("Window seat booked", "assistant"),
    ]
    assert by_run[1]["actor_id"] == "travel-bot"
    assert texts(memory.search("seat", user_id="alice", filters={"topic": "food"})) == {
        "I drink tea every morning"}  # fmt: skip
    assert texts(memory.search("tea", user_id="alice", threshold=0.9, limit=5)) == {
        "I drink tea every morning"}  # fmt: skip


def test_mem0_style_filters_and_scope_in_filters(memory: KalosMemory) -> None:
    memory.add("flight to paris", user_id="alice", metadata={"year": 2023, "city": "Paris"})
    memory.add("flight to rome", user_id="alice", metadata={"year": 2025, "city": "Rome"})
    got = memory.search("flight", filters={"user_id": "alice", "year": {"gte": 2024}})
    assert texts(got) == {"flight to rome"}
    got = memory.search("flight", filters={"user_id": "alice", "city": {"icontains": "par"}})
    assert texts(got) == {"flight to paris"}
    got = memory.get_all(user_id="alice", filters={"OR": [{"year": 2023}, {"city": "Rome"}]})
    assert texts(got) == {"flight to paris", "flight to rome"}
    # "*" on a scope key: present (alice's memories made by some agent), within the scope
    memory.add("flight booked by the planner", user_id="alice", agent_id="planner")
    memory.add("flight booked for bob", user_id="bob", agent_id="planner")
    assert texts(memory.get_all(user_id="alice", filters={"agent_id": "*"})) == {"flight booked by the planner"}
    assert texts(memory.search("flight", user_id="alice", filters={"agent_id": "*"})) == {
        "flight booked by the planner"}  # fmt: skip
    # mem0's newer spellings of a scope: {"eq": id}, and inside a top-level AND
    both = {"flight to paris", "flight to rome", "flight booked by the planner"}
    assert texts(memory.search("flight", filters={"user_id": {"eq": "alice"}})) == both
    assert texts(memory.search("flight", filters={"AND": [{"user_id": "alice"}, {"year": {"gte": 2024}}]})) == {
        "flight to rome"}  # fmt: skip
    assert texts(memory.get_all(filters={"$and": [{"agent_id": "planner"}, {"user_id": {"eq": "bob"}}]})) == {
        "flight booked for bob"}  # fmt: skip
    assert texts(memory.search("flight", filters={"AND": [{"user_id": "alice", "year": {"gte": 2024}}]})) == {
        "flight to rome"}  # fmt: skip  (a scope beside another condition in one entry)
    with pytest.raises(ValueError, match="conflicts"):
        memory.search("flight", user_id="bob", filters={"AND": [{"user_id": "alice"}]})
    with pytest.raises(ValueError, match=r"filters\['AND'\]\[0\]\['user_id'\]='alice' conflicts with "
                                         r"filters\['AND'\]\[1\]\['user_id'\]='bob'"):
        memory.search("flight", filters={"AND": [{"user_id": "alice"}, {"user_id": "bob"}]})
    with pytest.raises(ValueError, match=r"at least one of .* in a top-level AND"):
        memory.search("flight", filters={"user_id": {"in": ["alice"]}})  # (not a scope: which one?)


def test_both_spellings_of_a_condition_in_one_filter_both_hold(memory: KalosMemory) -> None:
    memory.add("flight to paris", user_id="alice", metadata={"year": 2023, "city": "Paris"})
    memory.add("flight to rome", user_id="alice", metadata={"year": 2025, "city": "Rome"})
    memory.add("flight to oslo", user_id="alice", metadata={"year": 2025, "city": "Oslo"})
    for flt, want in [
        ({"AND": [{"city": "Oslo"}], "$and": [{"year": 2025}]}, {"flight to oslo"}),
        ({"NOT": [{"city": "Rome"}], "$not": {"city": "Oslo"}}, {"flight to paris"}),
        ({"OR": [{"city": "Rome"}, {"city": "Paris"}], "$or": [{"year": 2025}]}, {"flight to rome"}),
        ({"year": {"lt": 2024, "$lt": 2030}}, {"flight to paris"}),
        ({"AND": [{"year": 2025}]}, {"flight to rome", "flight to oslo"}),  # the controls: one spelling
        ({"$not": {"city": "Oslo"}}, {"flight to paris", "flight to rome"}),
    ]:
        assert texts(memory.get_all(user_id="alice", filters=flt)) == want, flt
        assert texts(memory.search("flight", user_id="alice", filters=flt)) == want, flt


async def test_odd_search_and_add_arguments_are_refused_by_name(memory: KalosMemory) -> None:
    memory.add("I drink tea", user_id="alice")

    async def search(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        got = fn(*args, **kw)
        return await got if asyncio.iscoroutine(got) else got

    for fn in (memory.search, memory.asearch):
        for kw, err, match in [
            ({"query": None}, TypeError, "query must be a str"),
            ({"query": 5}, TypeError, "query must be a str"),
            ({"query": "tea", "filters": "topic"}, TypeError, "filters must be a dict"),
            ({"query": "tea", "threshold": "0.5"}, ValueError, "threshold="),
            ({"query": "tea", "threshold": float("nan")}, ValueError, "threshold="),
        ]:
            with pytest.raises(err, match=match):
                await search(fn, user_id="alice", **kw)
        assert texts(await search(fn, "tea", user_id="alice", threshold=0)) == {"I drink tea"}  # the control
    with pytest.raises(TypeError, match="bytes"):
        memory.add(b"I drink coffee", user_id="alice")


def test_an_adds_error_says_which_memories_were_stored(memory: KalosMemory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its history record failing after the memories were written, ``add`` raises with
    ``e.ids`` the memories' ids (not the history events') and ``e.committed`` all of them: a
    caller can tell they are stored and need not add them twice; the memory write failing, no
    memory is said stored. Controls: the ids are found by ``get_all``; the history is empty."""
    upsert = memory.client.upsert
    fail: list[str] = []

    def failing_in(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("namespace") in fail:
            raise SidecarTimeout("no answer (injected)")
        return upsert(*args, **kwargs)

    monkeypatch.setattr(memory.client, "upsert", failing_in)
    fail[:] = [memory.history_namespace]
    with pytest.raises(SidecarTimeout) as info:
        memory.add(["I like tea", "I live in Rome"], user_id="alice")
    stored = {i["id"]: i["memory"] for i in memory.get_all(user_id="alice")}
    assert info.value.ids is not None and set(info.value.ids) == set(stored)
    assert info.value.committed == 2 and sorted(stored.values()) == ["I like tea", "I live in Rome"]
    assert all(memory.history(i) == [] for i in stored)
    monkeypatch.undo()

    def no_answer(*args: Any, **kwargs: Any) -> Any:
        raise SidecarTimeout("no answer (injected)")

    monkeypatch.setattr(memory.client, "_call", no_answer)  # (the memories' own write, in the client)
    with pytest.raises(SidecarTimeout) as info:
        memory.add("I have a dog", user_id="bob")
    monkeypatch.undo()
    assert info.value.committed == 0 and len(info.value.ids or []) == 1 and memory.get_all(user_id="bob") == []

    def interrupted_in(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("namespace") == memory.history_namespace:
            raise KeyboardInterrupt  # (Ctrl-C between the two writes)
        return upsert(*args, **kwargs)

    monkeypatch.setattr(memory.client, "upsert", interrupted_in)
    with pytest.raises(KeyboardInterrupt) as stop:
        memory.add("I have a cat", user_id="carol")
    monkeypatch.undo()
    (cat,) = memory.get_all(user_id="carol")
    note = f"KalosMemory.add: the memories {[cat['id']]} were stored; their ADD history was not"
    assert stop.value.__notes__ == [note]


def test_a_memory_whose_history_event_outgrows_a_slot_is_not_written(
    start_sidecar: Callable[..., Sidecar],
) -> None:
    """The history event holds the text (an update's: old and new), so it can outgrow a slot
    the memory fits: it is checked before the memory is written, which then is not."""
    sc = start_sidecar(dim=DIM, payload_kb=64)
    m = KalosMemory(sc.name, embedding=KeywordEmbeddings())
    big = "tea " * 10_000  # 40 KB: fits a 64 KiB slot, as does its ADD event
    mem_id = m.add(big, user_id="alice")[0]["id"]
    with pytest.raises(ValueError, match="history event"):
        m.update(mem_id, big + "coffee " * 1000)  # old + new text: ~87 KB
    assert m.get(mem_id)["memory"] == big
    assert [e["event"] for e in m.history(mem_id)] == ["ADD"]
    with pytest.raises(ValueError, match="too large"):
        m.add("x" * 70_000, user_id="alice")
    assert [i["memory"] for i in m.get_all(user_id="alice")] == [big]
    m.update(mem_id, "coffee")  # the control: an event that fits is written with its update
    assert [e["event"] for e in m.history(mem_id)] == ["ADD", "UPDATE"]
    m.close()


def test_a_delete_whose_history_event_outgrows_a_slot_is_recorded_with_its_text_cut(
    start_sidecar: Callable[..., Sidecar],
) -> None:
    """A delete is not refused for its record's size: a memory that fits a slot with almost no room
    to spare (written by an older version, or by KalosClient) is deleted, and its DELETE event
    keeps the start of the text."""
    from kalos_retrievers.memory import _event

    sc = start_sidecar(dim=DIM, payload_kb=8)
    m = KalosMemory(sc.name, embedding=KeywordEmbeddings())
    meta = {"user_id": "alice"}
    lo, hi = 1, 8192  # the longest text whose row fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            m.client.check_upsert(1, ["legacy"], ["t" * mid], [meta], namespace=m.namespace)
            lo = mid
        except ValueError:
            hi = mid - 1
    text = "t" * lo
    m.client.upsert(["legacy"], [_vec("tea")], [text], [meta], namespace=m.namespace)
    with pytest.raises(ValueError, match="history event"):  # the control: its event does not fit
        m._history([_event("legacy", "DELETE", text, None, meta)])
    m.delete("legacy", user_id="alice")
    assert m.get("legacy") is None
    last = m.history("legacy")[-1]
    assert last["event"] == "DELETE" and last["old_memory_truncated"] is True
    assert 0 < len(last["old_memory"]) < len(text) and text.startswith(last["old_memory"])
    m.close()



def test_a_delete_whose_least_event_cannot_fit_is_refused_before_deleting(
    start_sidecar: Callable[..., Sidecar],
) -> None:
    """Where a slot holds a memory but not even its DELETE event cut to its id and kind (a
    --payload-kb barely above the vector), the delete is refused, naming the fix, and the
    memory stays: a delete is never made without its record."""
    sc = start_sidecar(dim=224, payload_kb=1)  # 896 bytes of vector: room for 128 more
    m = KalosMemory(sc.name, embedding=KeywordEmbeddings())
    v = np.zeros(224, np.float32)
    v[0] = 1.0
    m.client.upsert(["x"], v[None], ["t"], [{"user_id": "a"}], namespace=m.namespace)
    with pytest.raises(ValueError, match=r"DELETE event of memory 'x'.*--payload-kb\. 'x' was not deleted"):
        m.delete("x", user_id="a")
    rec = m.get("x")
    assert rec is not None and rec["memory"] == "t"
    m.close()


def test_a_delete_is_recorded_or_refused_whatever_the_ids_length(start_sidecar: Callable[..., Sidecar]) -> None:
    """At --dim 200 --payload-kb 1 (224 bytes beside the vector), memories with ids of 1 to 90
    characters: each delete either removes the memory and records its DELETE, or is refused
    with the memory kept; never a memory gone without its event (the fit is checked with the
    event's own 36-character id, not a shorter stand-in)."""
    sc = start_sidecar(dim=200, payload_kb=1)
    m = KalosMemory(sc.name, embedding=KeywordEmbeddings())
    v = np.zeros((1, 200), np.float32)
    v[0, 0] = 1.0
    outcomes = set()
    for n in range(1, 91):
        mid = f"{n:03d}" + "m" * (n - 3) if n >= 3 else "m" * n
        try:
            m.client.upsert([mid], v, ["t"], [{"user_id": "a"}], namespace=m.namespace)
        except ValueError:
            continue  # (the memory itself does not fit)
        try:
            m.delete(mid, user_id="a")
        except ValueError as e:
            assert "was not deleted" in str(e) and m.get(mid) is not None, (n, e)
            outcomes.add("refused")
        else:
            assert m.get(mid) is None and m.history(mid)[-1]["event"] == "DELETE", n
            outcomes.add("recorded")
    assert outcomes == {"refused", "recorded"}  # (both sides of the bound were reached)
    m.close()

ADVERSARIAL_USERS = ["alice", "alice2", "Alice", "alice ", "ali", "alïce", "*", "1", "a.b/c"]


def test_search_limit_is_checked_by_name_and_capped_at_max_k(make_name: Callable[[], str]) -> None:
    """search's default limit (100) on a sidecar started with --max-k 7 gives at most 7
    results, not a "k=100" error; a bad limit is refused as ``limit``."""
    with Sidecar(make_name(), dim=DIM, device="cpu", max_k=7, startup_timeout=60.0) as sc:
        m = KalosMemory(sc.name, embedding=KeywordEmbeddings())
        try:
            for i in range(9):
                m.add(f"tea number {i}", user_id="u")
            assert len(m.search("tea", user_id="u")) == 7
            assert len(asyncio.run(m.asearch("tea", user_id="u", limit=500))) == 7
            assert len(m.search("tea", user_id="u", limit=3)) == 3
            assert len(m.search("tea", user_id="u", limit=np.int64(2))) == 2
            with pytest.raises(ValueError, match="memory_id"):
                m.delete(["not", "an", "id"])  # type: ignore[arg-type]
            for bad in (0, -1, 2.5, True, "3"):
                with pytest.raises(ValueError, match=r"^limit="):
                    m.search("tea", user_id="u", limit=bad)  # type: ignore[arg-type]
        finally:
            m.close()


class SlowEmbeddings(KeywordEmbeddings):
    """An embedding model that takes 0.2 s per call (a network round trip, say)."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        time.sleep(0.2)
        return super().embed_documents(texts)


def _recording(errors: list[BaseException]) -> Callable[..., None]:
    """A thread target that runs ``fn(*a)`` and records what it raised in ``errors``."""

    def call(fn: Callable[..., Any], *a: Any) -> None:
        try:
            fn(*a)
        except BaseException as e:
            errors.append(e)

    return call


def test_updates_and_deletes_racing_in_threads_stay_consistent(sidecar: Sidecar, request) -> None:
    """An update whose embedding is still running when another thread deletes the memory
    raises KeyError instead of bringing it back; of several threads deleting one memory, one
    succeeds and one DELETE is recorded; of concurrent updates, the last recorded event is
    the stored text. (Before: the deleted memory came back as the update's text, and each
    racing delete recorded its own DELETE.)"""
    m = KalosMemory(sidecar.name, embedding=SlowEmbeddings(), collection=request.node.name[:80])
    try:
        (mid,) = [a["id"] for a in m.add("tea original", user_id="u")]
        errors: list[BaseException] = []

        call = _recording(errors)
        up = threading.Thread(target=call, args=(m.update, mid, "tea edited"))
        up.start()
        time.sleep(0.05)  # (the update is embedding)
        m.delete(mid)
        up.join()
        assert m.get(mid) is None
        assert [type(e) for e in errors] == [KeyError]
        assert [e["event"] for e in m.history(mid)] == ["ADD", "DELETE"]

        (mid,) = [a["id"] for a in m.add("tea again", user_id="u")]
        errors.clear()
        ts = [threading.Thread(target=call, args=(m.delete, mid)) for _ in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(errors) == 5 and all(isinstance(e, KeyError) for e in errors)
        assert [e["event"] for e in m.history(mid)] == ["ADD", "DELETE"]

        (mid,) = [a["id"] for a in m.add("tea v0", user_id="u")]
        ts = [threading.Thread(target=m.update, args=(mid, f"tea v{i}")) for i in (1, 2, 3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        stored, events = m.get(mid), m.history(mid)
        assert stored is not None and events[-1]["new_memory"] == stored["memory"]
        assert [e["event"] for e in events] == ["ADD", "UPDATE", "UPDATE", "UPDATE"]
        assert [e["old_memory"] for e in events[1:]] == [e["new_memory"] for e in events[:-1]]
    finally:
        m.reset()
        m.close()


def test_delete_all_takes_turns_with_updates_and_deletes_in_threads(
    memory: KalosMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delete_all reads each page again under the memories' locks: an update that read a
    memory before delete_all and writes it after raises nothing and the memory is still
    deleted (ADD, UPDATE, DELETE); a delete that completes between delete_all's scan and its
    delete leaves one DELETE, not two. (Before: the update brought the memory back after
    delete_all had counted it, and delete_all recorded a second DELETE.)"""
    history = memory._history
    main = threading.get_ident()
    hooks: list[Callable[[], None]] = []

    def slow_history(events: list[dict[str, Any]], **kw: Any) -> Any:
        if events and events[0]["event"] == "UPDATE":
            time.sleep(0.3)  # (the update holds its memory's lock: read, not yet written)
        if threading.get_ident() == main and hooks:
            hooks.pop()()  # (delete_all has scanned; hand the turn to another thread)
        return history(events, **kw)

    monkeypatch.setattr(memory, "_history", slow_history)
    (mid,) = [a["id"] for a in memory.add("tea original", user_id="u")]
    errors: list[BaseException] = []

    call = _recording(errors)
    up = threading.Thread(target=call, args=(memory.update, mid, "tea edited"))
    up.start()
    time.sleep(0.1)  # (the update is in its 0.3 s under the lock)
    assert memory.delete_all(user_id="u") == 1
    up.join()
    # (the update wrote under its lock; its read of the result after it may find the memory
    # deleted already: "deleted during the update", a KeyError, or not)
    assert all(isinstance(e, KeyError) and "during the update" in str(e) for e in errors), errors
    assert memory.get(mid) is None, "the update brought back a memory delete_all counted deleted"
    assert [e["event"] for e in memory.history(mid)] == ["ADD", "UPDATE", "DELETE"]

    errors.clear()
    (mid,) = [a["id"] for a in memory.add("tea again", user_id="u")]
    other = threading.Thread(target=call, args=(memory.delete, mid))
    hooks.append(lambda: (other.start(), other.join(timeout=1.0)))  # (it waits for the lock)
    n = memory.delete_all(user_id="u")
    other.join()
    assert memory.get(mid) is None
    assert [e["event"] for e in memory.history(mid)] == ["ADD", "DELETE"]
    assert n == 1 and [type(e) for e in errors] == [KeyError]


def test_users_are_isolated_adversarially(memory: KalosMemory) -> None:
    ids = {}
    for u in ADVERSARIAL_USERS:
        (added,) = memory.add(f"secret budget of {u!r}", user_id=u)
        ids[u] = added["id"]
    for u in ADVERSARIAL_USERS:
        mine = {f"secret budget of {u!r}"}
        assert texts(memory.search("secret budget", user_id=u, limit=100)) == mine, u
        assert texts(memory.get_all(user_id=u, limit=100)) == mine, u
        # filters AND with the scope: they narrow it, never widen it
        for extra in ({"$or": [{"user_id": "alice"}, {"user_id": {"$ne": u}}]},
                      {"$not": {"user_id": u}},
                      {"OR": [{"user_id": {"in": ADVERSARIAL_USERS}}]}):  # fmt: skip
            assert texts(memory.search("secret", user_id=u, filters=extra)) <= mine, (u, extra)
    # by id, a scope that does not own the memory sees nothing and changes nothing
    assert memory.get(ids["alice"], user_id="alice2") is None
    assert memory.get(ids["alice"], user_id="alice")["memory"] == "secret budget of 'alice'"
    with pytest.raises(KeyError):
        memory.update(ids["alice"], "hijacked", user_id="Alice")
    with pytest.raises(KeyError):
        memory.delete(ids["alice"], user_id="alice ")
    assert memory.get(ids["alice"])["memory"] == "secret budget of 'alice'"
    # metadata cannot smuggle a memory into another scope
    with pytest.raises(ValueError, match="reserved"):
        memory.add("plant", user_id="mallory", metadata={"user_id": "alice"})
    assert memory.delete_all(user_id="alice") == 1
    for u in ADVERSARIAL_USERS[1:]:
        assert len(memory.get_all(user_id=u)) == 1, u


def test_scope_is_true_top_k_among_the_users_memories(memory: KalosMemory) -> None:
    # 30 of alice's memories match the query better than bob's only one: bob must still get his.
    memory.add([f"tea tea tea {i}" for i in range(30)], user_id="alice")
    memory.add("a dog", user_id="bob")
    assert texts(memory.search("tea", user_id="bob", limit=1)) == {"a dog"}


def test_agent_and_run_scopes(memory: KalosMemory) -> None:
    memory.add("alice likes rome", user_id="alice", agent_id="planner")
    memory.add("bob likes paris", user_id="bob", agent_id="planner")
    memory.add("alice drinks tea", user_id="alice", agent_id="barista")
    # As in mem0, a scope names only what it names: the planner sees its memories of everyone.
    assert texts(memory.search("likes", agent_id="planner")) == {"alice likes rome",
                                                                  "bob likes paris"}  # fmt: skip
    assert texts(memory.search("likes", user_id="alice", agent_id="planner")) == {
        "alice likes rome"}  # fmt: skip
    assert texts(memory.get_all(user_id="alice")) == {"alice likes rome", "alice drinks tea"}
    assert memory.search("likes", user_id="carol") == []


# ---------------------------------------------------------------------------------------------
# update, delete, history


def test_update_delete_and_history(memory: KalosMemory) -> None:
    (added,) = memory.add("likes tea", user_id="alice", metadata={"src": "chat"})
    mid = added["id"]
    first = memory.get(mid)
    time.sleep(0.01)
    updated = memory.update(mid, "likes coffee")
    assert updated["memory"] == "likes coffee"
    assert updated["metadata"] == {"src": "chat"}  # kept
    assert updated["user_id"] == "alice"  # the scope is kept
    assert updated["created_at"] == first["created_at"]
    assert updated["updated_at"] > first["updated_at"]
    assert texts(memory.search("coffee", user_id="alice", limit=1)) == {
        "likes coffee"
    }  # re-embedded
    memory.update(mid, "likes coffee a lot", metadata={"src": "edit"})
    assert memory.get(mid)["metadata"] == {"src": "edit"}
    with pytest.raises(ValueError, match="reserved"):
        memory.update(mid, "x", metadata={"user_id": "bob"})
    memory.delete(mid)
    assert memory.get(mid) is None
    assert memory.search("coffee", user_id="alice") == []
    with pytest.raises(KeyError):
        memory.delete(mid)
    with pytest.raises(KeyError):
        memory.update(mid, "again")
    events = memory.history(mid)
    assert [(e["event"], e["old_memory"], e["new_memory"], e["is_deleted"]) for e in events] == [
        ("ADD", None, "likes tea", False),
        ("UPDATE", "likes tea", "likes coffee", False),
        ("UPDATE", "likes coffee", "likes coffee a lot", False),
        ("DELETE", "likes coffee a lot", None, True),
    ]
    assert all(e["memory_id"] == mid and e["user_id"] == "alice" for e in events)
    assert [e["created_at"] for e in events] == sorted(e["created_at"] for e in events)
    assert memory.history("no-such-id") == []


def test_delete_all_records_history_and_reset_clears_only_this_collection(
    memory: KalosMemory, sidecar: Sidecar
) -> None:
    ids = [a["id"] for a in memory.add(["tea", "coffee", "dog"], user_id="alice")]
    memory.add("rome", user_id="bob")
    assert memory.delete_all(user_id="alice") == 3
    assert memory.get_all(user_id="alice") == []
    assert [e["event"] for e in memory.history(ids[0])] == ["ADD", "DELETE"]
    other = KalosMemory(sidecar.name, embedding=KeywordEmbeddings(), collection="other-app")
    other.add("paris", user_id="bob")
    memory.reset()
    assert memory.get_all(user_id="bob") == []
    assert memory.history(ids[0]) == []
    assert texts(other.get_all(user_id="bob")) == {"paris"}
    other.reset()


# ---------------------------------------------------------------------------------------------
# persistence


@pytest.mark.parametrize("durable", [True, False])
def test_memories_and_history_survive_a_sidecar_restart(
    start_sidecar: Callable[..., Sidecar], tmp_path: Path, durable: bool
) -> None:
    data = tmp_path / "kalos" if durable else None
    sc = start_sidecar(dim=DIM, data_dir=data)
    memory = KalosMemory(sc.name, embedding=KeywordEmbeddings(), timeout=1.0)
    keep = memory.add("likes tea", user_id="alice")[0]["id"]
    memory.update(keep, "likes coffee")
    gone = memory.add("has a dog", user_id="alice")[0]["id"]
    memory.delete(gone)
    sc.kill(signal.SIGKILL)  # acknowledged writes are committed: no clean shutdown needed
    assert sc.proc is not None
    sc.proc.wait(10)
    start_sidecar(dim=DIM, data_dir=data, name=sc.name)
    deadline = time.monotonic() + 10
    while True:  # the same KalosMemory reconnects by itself
        try:
            found = memory.get_all(user_id="alice")
            break
        except SidecarUnavailable:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    if not durable:  # negative control: without --data-dir the same checks fail
        assert found == []
        assert memory.history(keep) == []
        return
    assert texts(found) == {"likes coffee"}
    assert texts(memory.search("coffee", user_id="alice")) == {"likes coffee"}
    assert [e["event"] for e in memory.history(keep)] == ["ADD", "UPDATE"]
    assert [e["event"] for e in memory.history(gone)] == ["ADD", "DELETE"]


# ---------------------------------------------------------------------------------------------
# degradation, embeddings, async


async def test_search_degrades_while_the_sidecar_is_down(
    start_sidecar: Callable[..., Sidecar], make_name: Callable[[], str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING, logger="kalos_retrievers")
    absent = KalosMemory(make_name(), embedding=KeywordEmbeddings(), timeout=0.3)
    assert absent.search("tea", user_id="alice") == []
    assert absent.search("tea", user_id="alice") == []
    assert (absent.degrader.degraded_calls, absent.degrader.episodes) == (2, 1)
    assert sum("KalosMemory" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(SidecarUnavailable):  # writes are never degraded
        absent.add("tea", user_id="alice")
    strict = KalosMemory(make_name(), embedding=KeywordEmbeddings(), on_error="raise")
    with pytest.raises(SidecarUnavailable):  # negative control
        strict.search("tea", user_id="alice")

    sc = start_sidecar(dim=DIM)
    memory = KalosMemory(sc.name, embedding=KeywordEmbeddings(), timeout=0.3)
    strict = KalosMemory(sc.name, embedding=KeywordEmbeddings(), timeout=0.3, on_error="raise")
    # with a shared client (its timeout 2 s), the memory's own timeout still bounds a search
    # (it was ignored: the search took the client's 2 s); control: without one, the client's
    shared = KalosClient(sc.name, timeout=2.0)
    on_shared = KalosMemory(embedding=KeywordEmbeddings(), timeout=0.3, client=shared)
    assert on_shared.timeout == 0.3 and KalosMemory(embedding=KeywordEmbeddings(), client=shared).timeout == 2.0
    memory.add("likes tea", user_id="alice")
    sc.kill(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert memory.search("tea", user_id="alice") == []
        assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        assert on_shared.search("tea", user_id="alice") == []
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(SidecarTimeout):  # negative control
            strict.search("tea", user_id="alice")
        # concurrent async searches share one deadline, waiting for threads included
        t0 = time.monotonic()
        many = await asyncio.gather(*(memory.asearch("tea", user_id="alice") for _ in range(30)))
        assert many == [[]] * 30
        assert time.monotonic() - t0 < 1.5  # (one deadline; one after another would take 9 s)
    finally:
        sc.kill(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not memory.search("tea", user_id="alice"):
        assert time.monotonic() < deadline, "search did not recover"
        time.sleep(0.05)
    assert not memory.degrader.in_episode


def test_llama_index_embedding_model(sidecar: Sidecar) -> None:
    memory = KalosMemory(sidecar.name, embedding=KeywordLlamaEmbedding(), collection="li-embed")
    memory.add(["tea time", "dog walk"], user_id="u")
    assert memory.search("tea", user_id="u", limit=1)[0]["memory"] == "tea time"
    memory.reset()


async def test_async_add_and_search(memory: KalosMemory) -> None:
    added = await memory.aadd("flight to rome", user_id="alice")
    assert added[0]["event"] == "ADD"
    hits = await memory.asearch("rome", user_id="alice", limit=1)
    assert texts(hits) == {"flight to rome"}
    assert await memory.asearch("rome", user_id="bob") == []


async def _longest_loop_gap(call: Callable[[], Any]) -> float:
    """The longest gap between a 1 ms ticker's wake-ups while ``call()`` (awaited when it
    returns an awaitable) raises SidecarTimeout."""
    ticks = [time.perf_counter()]
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.001)
            ticks.append(time.perf_counter())

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    try:
        out = call()
        if asyncio.iscoroutine(out):
            await out
    except SidecarTimeout:
        pass
    else:
        raise AssertionError("no SidecarTimeout")
    stop.set()
    await tick
    return max(b - a for a, b in itertools.pairwise(ticks))


async def test_async_management_twins_agree_with_the_sync_calls_and_keep_the_loop_free(
    sidecar: Sidecar, memory: KalosMemory
) -> None:
    """aget / aget_all / aupdate / ahistory / adelete / adelete_all / areset do what their
    sync twins do; on a paused sidecar a call keeps the event loop running (a 1 ms ticker
    sees no gap near the call's 0.4 s wait: the sync call inside a coroutine is the control,
    a gap of the whole wait) and raises SidecarTimeout at the client's deadline."""
    a = memory.add("I drink tea", user_id="alice")[0]["id"]
    memory.add("paris flight", user_id="alice", run_id="r1")
    memory.add("bob likes coffee", user_id="bob")
    assert await memory.aget(a) == memory.get(a) and await memory.aget(a, user_id="bob") is None
    assert await memory.aget_all(user_id="alice") == memory.get_all(user_id="alice")
    updated = await memory.aupdate(a, "I drink coffee now", metadata={"topic": "food"}, user_id="alice")
    assert updated["memory"] == "I drink coffee now" and updated["metadata"] == {"topic": "food"}
    with pytest.raises(KeyError):
        await memory.aupdate(a, "x", user_id="bob")
    events = [e["event"] for e in await memory.ahistory(a)]
    assert events == ["ADD", "UPDATE"] == [e["event"] for e in memory.history(a)]
    await memory.adelete(a)
    assert memory.get(a) is None and await memory.adelete_all(user_id="alice") == 1
    assert [m["memory"] for m in memory.get_all(user_id="bob")] == ["bob likes coffee"]
    slow = KalosMemory(client=KalosClient(sidecar.name, timeout=0.4), embedding=KeywordEmbeddings(),
                       collection=memory.collection)  # fmt: skip
    bob = memory.get_all(user_id="bob")[0]["id"]
    slow.get(bob)  # (connected)
    sidecar.kill(signal.SIGSTOP)
    try:
        gaps = {"async": await _longest_loop_gap(lambda: slow.aget(bob)),
                "sync (control)": await _longest_loop_gap(lambda: slow.get(bob))}  # fmt: skip
    finally:
        sidecar.kill(signal.SIGCONT)
    assert gaps["async"] < 0.2 < gaps["sync (control)"], gaps
    await memory.areset()
    assert memory.get_all(user_id="bob") == []
    slow.client.close()


async def test_an_async_add_waits_for_a_thread_as_long_as_the_clients_timeout(sidecar: Sidecar) -> None:
    """A write's deadline is the client's timeout (the sync ``add``'s), not the memory's
    search timeout: ``aadd`` queued 0.5 s behind another call on a one-thread client stores
    its memory although searches give up after 0.25 s (it raised SidecarTimeout unsent)."""
    from kalos_retrievers import _aio

    client = KalosClient(sidecar.name, timeout=2, max_slots=1)
    memory = KalosMemory(client=client, embedding=KeywordEmbeddings(), collection="aadd-deadline", timeout=0.25)
    try:
        busy = asyncio.create_task(_aio.call(client, time.sleep, 0.5))
        await asyncio.sleep(0.02)
        added = await memory.aadd("tea at noon", user_id="u")
        await busy
        assert [m["memory"] for m in memory.get_all(user_id="u")] == ["tea at noon"] == [a["memory"] for a in added]
    finally:
        memory.reset()
        client.close()

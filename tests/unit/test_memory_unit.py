"""KalosMemory without a sidecar: argument checks, scoping filters, message parsing."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from typing import Any

import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.embeddings import MockEmbedding

from kalos_retrievers.filters import matches, validate_filter
from kalos_retrievers.memory import Embedder, KalosMemory, _iso, _messages, _translate_filter


@pytest.fixture
def memory() -> KalosMemory:
    # Building it never touches the sidecar (there is none under this name).
    return KalosMemory("kalos-unit-no-such-sidecar", embedding=DeterministicFakeEmbedding(size=5))


def test_construction_needs_no_sidecar_and_a_name(memory: KalosMemory) -> None:
    assert memory.namespace == "memory/memories"
    assert memory.history_namespace == "memory-history/memories"
    with pytest.raises(ValueError, match="name"):
        KalosMemory(embedding=DeterministicFakeEmbedding(size=5))
    with pytest.raises(TypeError, match="LangChain Embeddings or a LlamaIndex"):
        KalosMemory("x", embedding=object())
    with pytest.raises(ValueError, match="255 bytes"):
        KalosMemory("x", embedding=DeterministicFakeEmbedding(size=5), collection="c" * 250)


def test_scope_is_required_and_checked(memory: KalosMemory) -> None:
    with pytest.raises(ValueError, match="at least one of user_id"):
        memory.add("hello")
    with pytest.raises(ValueError, match="at least one of user_id"):
        memory.search("hello")
    with pytest.raises(ValueError, match="at least one of user_id"):
        memory.delete_all()
    with pytest.raises(ValueError, match="user_id must be a non-empty string"):
        memory.search("hello", user_id="")
    with pytest.raises(ValueError, match="user_id must be a non-empty string"):
        memory.search("hello", user_id=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conflicts"):
        memory.search("hello", user_id="alice", filters={"user_id": "bob"})
    with pytest.raises(ValueError, match="infer=True"):
        memory.add("hello", user_id="u", infer=True)


@pytest.mark.parametrize("key", ["user_id", "agent_id", "run_id", "role", "actor_id"])
def test_reserved_metadata_keys_are_refused(memory: KalosMemory, key: str) -> None:
    # Otherwise bob could file a memory under alice's scope through metadata.
    with pytest.raises(ValueError, match="reserved keys"):
        memory.add("hello", user_id="bob", metadata={key: "alice"})


def test_scope_filter_cannot_be_widened(memory: KalosMemory) -> None:
    alice = {"user_id": "alice", "topic": "x"}
    bob = {"user_id": "bob", "topic": "y"}
    attempts: list[dict[str, Any]] = [
        {"$or": [{"user_id": "alice"}, {"topic": "y"}]},
        {"$not": {"user_id": "bob"}},
        {"user_id": {"$ne": "bob"}},
        {"OR": [{"user_id": "alice"}, {"topic": "x"}]},
        {"user_id": {"in": ["alice", "bob"]}},
    ]
    for extra in attempts:
        flt = validate_filter(memory._scoped_filter("bob", None, None, extra))
        assert not matches(flt, alice), extra
    # control: the same filters do let bob's own memory through where they should
    flt = validate_filter(memory._scoped_filter("bob", None, None, attempts[0]))
    assert matches(flt, bob)
    with pytest.raises(ValueError, match="conflicts"):
        memory._scoped_filter("bob", None, None, {"user_id": "alice"})
    # mem0's "*" ("present") on a scope key is a condition within the scope, not a scope
    flt = validate_filter(memory._scoped_filter("bob", None, None, {"user_id": "*"}))
    assert matches(flt, bob) and not matches(flt, alice)
    with pytest.raises(ValueError, match="at least one of user_id"):
        memory._scoped_filter(None, None, None, {"user_id": "*"})
    # the literal user "*" is still a scope, given as the argument
    flt = validate_filter(memory._scoped_filter("*", None, None, None))
    assert matches(flt, {"user_id": "*"}) and not matches(flt, alice)


def test_a_star_on_a_scope_key_means_present(memory: KalosMemory) -> None:
    """``filters={"agent_id": "*"}`` with ``user_id="alice"``: alice's memories that have an
    agent (mem0's wildcard, and what KalosMemory's docstring promises); it was read as the
    literal agent "*" and matched nothing."""
    flt = validate_filter(memory._scoped_filter("alice", None, None, {"agent_id": "*"}))
    assert matches(flt, {"user_id": "alice", "agent_id": "planner"})
    assert not matches(flt, {"user_id": "alice"})
    assert not matches(flt, {"user_id": "bob", "agent_id": "planner"})


@pytest.mark.parametrize("bad", [{"AND": {"a": 1}}, {"OR": []}, {"$or": ["a"]}, {"NOT": "a"}, {"NOT": []}])
def test_malformed_boolean_filters_are_refused_by_name(bad: dict[str, Any]) -> None:
    """AND/OR need a list of filters and NOT a filter or a list of them: given a dict or a
    string they raised a bare AttributeError from inside the translation."""
    key = next(iter(bad))
    with pytest.raises(ValueError, match=re.escape(f"filters[{key!r}] must be")):
        _translate_filter(bad)


def test_scope_from_filters_only() -> None:
    m = KalosMemory("x", embedding=DeterministicFakeEmbedding(size=5))
    flt = validate_filter(m._scoped_filter(None, None, None, {"user_id": "alice", "n": {"gte": 2}}))
    assert matches(flt, {"user_id": "alice", "n": 3})
    assert not matches(flt, {"user_id": "alice", "n": 1})
    assert not matches(flt, {"user_id": "alicex", "n": 3})
    assert not matches(flt, {"n": 3})


def test_mem0_filter_spelling() -> None:
    flt = validate_filter(_translate_filter({
        "AND": [{"city": {"icontains": "par"}}, {"NOT": [{"year": {"lt": 2020}}]}],
        "tag": "*",
    }))  # fmt: skip
    assert matches(flt, {"city": "Paris", "year": 2021, "tag": "t"})
    assert not matches(flt, {"city": "Paris", "year": 2019, "tag": "t"})
    assert not matches(flt, {"city": "Paris", "year": 2021})
    assert not matches(flt, {"city": "Rome", "year": 2021, "tag": "t"})
    # Kalos's own spelling passes through
    assert _translate_filter({"$or": [{"a": {"$gt": 1}}]}) == {"$or": [{"a": {"$gt": 1}}]}


def test_messages_in_every_shape() -> None:
    assert _messages("hi") == [("user", None, "hi")]
    assert _messages({"role": "assistant", "content": "yo", "name": "bot"}) == [
        ("assistant", "bot", "yo")
    ]
    got = _messages([
        {"role": "system", "content": "you are a bot"},   # skipped
        {"role": "user", "content": "   "},                # skipped: empty
        {"role": "user", "content": None},                 # skipped
        HumanMessage("I like tea"),
        AIMessage("noted"),
        SystemMessage("ignored"),
        ChatMessage(role=MessageRole.USER, content="from llama"),
        "plain",
    ])  # fmt: skip
    assert got == [
        ("user", None, "I like tea"),
        ("assistant", None, "noted"),
        ("user", None, "from llama"),
        ("user", None, "plain"),
    ]
    # one message object, not in a list (pydantic models are iterable: their fields came out)
    assert _messages(HumanMessage("alone")) == [("user", None, "alone")]
    assert _messages(AIMessage("reply", name="bot")) == [("assistant", "bot", "reply")]
    assert _messages(ChatMessage(role=MessageRole.USER, content="llama alone")) == [("user", None, "llama alone")]
    with pytest.raises(TypeError, match="messages"):
        _messages([42])
    with pytest.raises(TypeError, match="content must be text"):
        _messages([{"role": "user", "content": [{"type": "image"}]}])


def test_embedder_takes_langchain_and_llama_index() -> None:
    lc = Embedder(DeterministicFakeEmbedding(size=7))
    li = Embedder(MockEmbedding(embed_dim=7))
    assert (lc.kind, li.kind) == ("langchain", "llama_index")
    for e in (lc, li):
        assert e.documents(["a", "b"]).shape == (2, 7)
        assert e.query("a").shape == (7,)
        assert asyncio.run(e.adocuments(["a"])).shape == (1, 7)
        assert asyncio.run(e.aquery("a")).shape == (7,)
    assert Embedder(lc).kind == "langchain"


def test_ids_sort_in_creation_order() -> None:
    from kalos_retrievers.memory import _sortable_ids

    ids = _sortable_ids(5) + _sortable_ids(1) + _sortable_ids(3)
    assert ids == sorted(ids)
    assert len(set(ids)) == 9
    assert all(len(i) == 36 and i.count("-") == 4 for i in ids)  # UUID-shaped


def test_times_read_as_iso_utc_each_its_own_though_cached() -> None:
    # _iso keeps its answers (an agent recalls the same memories again and again): each time
    # still gets its own string, the one datetime gives, a second call the same one
    times = [1_764_633_600.0, 1_764_633_600.000001, 1_764_633_601.5, 1_764_633_600.25, 0.0, 1_764_633_600.0]
    want = [datetime.fromtimestamp(t, UTC).isoformat() for t in times]
    assert [_iso(t) for t in times] == want
    assert [_iso(t) for t in reversed(times)] == want[::-1]
    assert want[0] == "2025-12-02T00:00:00+00:00" and want[1] == "2025-12-02T00:00:00.000001+00:00"
    assert len(set(want)) == 5
    assert datetime.fromisoformat(_iso(1_764_633_601.5)).timestamp() == 1_764_633_601.5

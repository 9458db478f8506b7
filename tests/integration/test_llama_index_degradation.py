"""Degradation of the LlamaIndex adapters with a real sidecar: absent, killed (SIGKILL), paused
(SIGSTOP), restarted. Each scenario has a negative control showing the same test can fail:
``on_error="raise"`` raises where the default returns empty context, and a blocking call is
caught by the event-loop check that the async path passes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import VectorStoreQuery

from kalos_retrievers import Sidecar, SidecarTimeout, SidecarUnavailable
from kalos_retrievers.llama_index import KalosDegradedEvent, KalosRetriever, KalosVectorStore

pytestmark = pytest.mark.reliability

DIM = 8
TIMEOUT = 0.3
SLACK = 0.7  # scheduling slack on a loaded 2-core CI machine


class Collect(BaseEventHandler):
    seen: list[KalosDegradedEvent] = []  # noqa: RUF012 - a pydantic field, copied per instance

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, KalosDegradedEvent):
            self.seen.append(event)


@pytest.fixture
def events() -> Iterator[list[KalosDegradedEvent]]:
    handler = Collect()
    root = get_dispatcher()
    root.add_event_handler(handler)
    yield handler.seen
    root.event_handlers.remove(handler)


def warnings_of(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and what in r.getMessage()]  # fmt: skip


def populate(store: KalosVectorStore, n: int = 11) -> None:
    rng = np.random.default_rng(7)
    vecs = rng.standard_normal((n, DIM))
    store.add([TextNode(id_=f"n{i}", text=f"memory {i}", embedding=v.tolist())
               for i, v in enumerate(vecs)])  # fmt: skip


def make(name: str, on_error: str = "empty") -> tuple[KalosVectorStore, KalosRetriever]:
    store = KalosVectorStore(name, timeout=TIMEOUT, on_error=on_error)  # type: ignore[arg-type]
    return store, store.as_retriever(MockEmbedding(embed_dim=DIM), similarity_top_k=3,
                                     on_error=on_error)  # fmt: skip


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def query() -> VectorStoreQuery:
    return VectorStoreQuery(query_embedding=[0.5] * DIM, similarity_top_k=3)


# ---------------------------------------------------------------------------------------------
# absent


def test_absent_sidecar_gives_empty_context_one_warning_and_counts(
    make_name: Callable[[], str], caplog: pytest.LogCaptureFixture,
    events: list[KalosDegradedEvent],
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="kalos_retrievers")
    store, retriever = make(make_name())  # building it does not need the sidecar
    for _ in range(3):
        nodes, took = timed(lambda: retriever.retrieve("where is it?"))
        assert nodes == []
        assert took < TIMEOUT + SLACK
    assert (retriever.degrader.degraded_calls, retriever.degrader.episodes) == (3, 1)
    assert len(warnings_of(caplog, "KalosRetriever")) == 1
    assert [e.episode for e in events] == [1, 1, 1]
    assert events[0].adapter.startswith("KalosRetriever(")
    res = store.query(query())  # the store degrades too, with its own counters
    assert (res.nodes, res.similarities, res.ids) == ([], [], [])
    assert store.degrader.degraded_calls == 1
    assert len(warnings_of(caplog, "KalosVectorStore")) == 1


def test_absent_sidecar_negative_control_raises(make_name: Callable[[], str]) -> None:
    store, retriever = make(make_name(), on_error="raise")
    with pytest.raises(SidecarUnavailable):
        retriever.retrieve("where is it?")
    with pytest.raises(SidecarUnavailable):
        store.query(query())
    assert retriever.degrader.degraded_calls == 0


def test_a_stores_retrievers_take_its_on_error(make_name: Callable[[], str]) -> None:
    emb = MockEmbedding(embed_dim=DIM)
    strict = KalosVectorStore(make_name(), on_error="raise", timeout=TIMEOUT)
    with pytest.raises(SidecarUnavailable):
        strict.as_retriever(emb).retrieve("where is it?")
    assert strict.as_retriever(emb, on_error="empty").retrieve("where is it?") == []  # the caller's wins
    soft = KalosVectorStore(make_name(), timeout=TIMEOUT)  # the control: the default degrades
    assert soft.as_retriever(emb).retrieve("where is it?") == []


def test_on_error_changed_after_construction_is_the_one_used(make_name: Callable[[], str]) -> None:
    """``on_error`` is a field: a store assigned, or copied with, ``"raise"`` raises; its
    control, the same store set back to ``"empty"``, degrades."""
    store = KalosVectorStore(make_name(), timeout=TIMEOUT)
    assert store.query(query()).ids == []
    strict = store.model_copy(update={"on_error": "raise"})
    with pytest.raises(SidecarUnavailable):
        strict.query(query())
    with pytest.raises(SidecarUnavailable):
        asyncio.run(strict.aquery(query()))
    store.on_error = "raise"
    with pytest.raises(SidecarUnavailable):
        store.query(query())
    store.on_error = "empty"
    assert store.query(query()).ids == []


def test_a_store_by_another_name_talks_to_that_sidecar(
    start_sidecar: Callable[..., Sidecar], make_name: Callable[[], str]
) -> None:
    """``name`` cannot be assigned (the client was made for it); a ``model_copy`` that updates
    it is a store on its own client for the other sidecar."""
    sidecar = start_sidecar(dim=DIM)
    store = KalosVectorStore(make_name(), timeout=TIMEOUT)
    with pytest.raises(ValueError, match="frozen"):
        store.name = sidecar.name
    other = store.model_copy(update={"name": sidecar.name})
    assert other.client is not store.client and other.client.name == sidecar.name
    populate(other)
    assert other.query(query()).ids  # answered by the running sidecar
    assert store.query(query()).ids == []  # the original still points at the absent one


def test_writes_are_never_degraded(make_name: Callable[[], str]) -> None:
    store, _ = make(make_name())
    with pytest.raises(SidecarUnavailable):
        populate(store)


# ---------------------------------------------------------------------------------------------
# killed


@pytest.mark.parametrize("on_error", ["empty", "raise"])
def test_killed_sidecar(start_sidecar: Callable[..., Sidecar], on_error: str) -> None:
    sc = start_sidecar(dim=DIM)
    store, retriever = make(sc.name, on_error)
    populate(store)
    assert len(retriever.retrieve("q")) == 3  # control: it returns something while alive
    sc.kill(signal.SIGKILL)
    assert sc.proc is not None
    sc.proc.wait(10)
    try:
        if on_error == "raise":  # negative control
            with pytest.raises(SidecarUnavailable):
                retriever.retrieve("q")
            return
        nodes, took = timed(lambda: retriever.retrieve("q"))
        assert nodes == []
        assert took < TIMEOUT + SLACK
        assert retriever.degrader.episodes == 1
    finally:
        reap(start_sidecar, sc)


def reap(start_sidecar: Callable[..., Sidecar], killed: Sidecar) -> None:
    """A SIGKILLed sidecar leaves its segment behind; the next start under its name removes
    it, and the fixture then stops that one cleanly."""
    start_sidecar(dim=DIM, name=killed.name)


# ---------------------------------------------------------------------------------------------
# paused


@pytest.fixture
def paused(start_sidecar: Callable[..., Sidecar]) -> Iterator[tuple[Sidecar, KalosVectorStore]]:
    sc = start_sidecar(dim=DIM)
    store = KalosVectorStore(sc.name, timeout=TIMEOUT)
    populate(store)
    sc.kill(signal.SIGSTOP)
    try:
        yield sc, store
    finally:
        sc.kill(signal.SIGCONT)


def test_paused_sidecar_deadline_is_honoured_and_recovery_is_automatic(
    paused: tuple[Sidecar, KalosVectorStore], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kalos_retrievers")
    sc, store = paused
    retriever = store.as_retriever(MockEmbedding(embed_dim=DIM), similarity_top_k=3)
    for _ in range(2):
        nodes, took = timed(lambda: retriever.retrieve("q"))
        assert nodes == []
        assert TIMEOUT * 0.9 <= took < TIMEOUT + SLACK  # it waited for the deadline, no longer
    assert isinstance(retriever.degrader.last_error, SidecarTimeout)
    assert len(warnings_of(caplog, "KalosRetriever")) == 1
    sc.kill(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not (nodes := retriever.retrieve("q")):
        assert time.monotonic() < deadline, "retrieval did not recover after SIGCONT"
        time.sleep(0.05)
    assert len(nodes) == 3
    assert not retriever.degrader.in_episode
    assert retriever.degrader.episodes == 1
    assert any("recall works again" in r.getMessage() for r in caplog.records)


def test_paused_sidecar_negative_control_raises(paused: tuple[Sidecar, KalosVectorStore]) -> None:
    sc, _ = paused
    store, retriever = make(sc.name, on_error="raise")
    with pytest.raises(SidecarTimeout):
        retriever.retrieve("q")
    with pytest.raises(SidecarTimeout):
        store.query(query())


async def _ticks_during(coro: Any) -> tuple[Any, int]:
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        out = await coro
    finally:
        stop = True
        await task
    return out, ticks


async def test_async_calls_do_not_block_the_event_loop(
    paused: tuple[Sidecar, KalosVectorStore],
) -> None:
    _, store = paused
    retriever = store.as_retriever(MockEmbedding(embed_dim=DIM))
    nodes, ticks = await _ticks_during(retriever.aretrieve("q"))
    assert nodes == []
    assert ticks >= 10  # ~TIMEOUT / 10 ms while the call waited for its deadline
    res, ticks = await _ticks_during(store.aquery(query()))
    assert res.nodes == []
    assert ticks >= 10

    # Negative control: the same measurement catches a call that blocks the loop.
    async def blocking() -> list:
        return retriever.retrieve("q")

    nodes, ticks = await _ticks_during(blocking())
    assert nodes == []
    assert ticks <= 2


async def test_concurrent_async_calls_share_one_deadline(
    paused: tuple[Sidecar, KalosVectorStore],
) -> None:
    """Many concurrent aretrieve on a paused sidecar end after about one timeout, although the
    default thread pool runs only a few of them at once: each call's deadline starts when it
    is made and counts its wait for a thread."""
    _, store = paused
    retriever = store.as_retriever(MockEmbedding(embed_dim=DIM))
    workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor size
    n = 4 * workers + 4  # at least 5 rounds of the pool if the calls queued
    t0 = time.monotonic()
    results = await asyncio.gather(*(retriever.aretrieve(f"q{i}") for i in range(n)))
    took = time.monotonic() - t0
    assert results == [[]] * n
    assert took < TIMEOUT + SLACK
    assert retriever.degrader.degraded_calls == n
    t0 = time.monotonic()
    res = await asyncio.gather(*(store.aquery(query()) for _ in range(n)))
    assert all(r.nodes == [] for r in res)
    assert time.monotonic() - t0 < TIMEOUT + SLACK

    # Negative control: calls whose deadline starts only once they have a thread do queue up,
    # and the bound above catches it.
    t0 = time.monotonic()
    await asyncio.gather(*(asyncio.to_thread(retriever.retrieve, f"q{i}") for i in range(n)))
    assert time.monotonic() - t0 > TIMEOUT + SLACK


# ---------------------------------------------------------------------------------------------
# restarted


def test_restarted_sidecar_recovers_without_a_new_client(
    start_sidecar: Callable[..., Sidecar], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kalos_retrievers")
    data = tmp_path / "kalos"
    sc = start_sidecar(dim=DIM, data_dir=data)
    store, retriever = make(sc.name)
    populate(store)
    before = [n.node.node_id for n in retriever.retrieve("q")]
    assert len(before) == 3
    sc.kill(signal.SIGKILL)
    assert sc.proc is not None
    sc.proc.wait(10)
    assert retriever.retrieve("q") == []  # control: down means empty, so recovery is real
    assert retriever.retrieve("q") == []
    start_sidecar(dim=DIM, data_dir=data, name=sc.name)
    deadline = time.monotonic() + 10
    while not (after := retriever.retrieve("q")):
        assert time.monotonic() < deadline, "retrieval did not recover after the restart"
        time.sleep(0.05)
    assert [n.node.node_id for n in after] == before  # same data, from the store of record
    assert (retriever.degrader.episodes, retriever.degrader.in_episode) == (1, False)
    assert len(warnings_of(caplog, "KalosRetriever")) == 1
    assert sum("recall works again" in r.getMessage() for r in caplog.records) == 1
    assert store.client.reconnects >= 1

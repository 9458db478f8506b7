"""KalosRetriever degradation with real sidecar processes: never started, SIGKILL mid-call,
SIGSTOP past the deadline, restarted under the same name; for invoke and ainvoke.

Each scenario has its negative control: with ``on_error="raise"`` the same scenario raises,
which proves the scenario really fails the call and the ``[]`` is the degradation at work.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.runnables import RunnableLambda

from kalos_retrievers import KalosClient, Sidecar, SidecarTimeout, SidecarUnavailable
from kalos_retrievers.langchain import DEGRADED_EVENT, KalosRetriever, KalosVectorStore

pytestmark = pytest.mark.reliability

DIM = 97
MARGIN = 0.15  # "timeout + a few ms", with room for a loaded 2-core CI machine
FACT = "the launch code is tangerine"
EMB = DeterministicFakeEmbedding(size=DIM)
MODES = ["invoke", "ainvoke"]


async def call(retriever: Any, mode: str, query: str = FACT, **kw: Any) -> list[Document]:
    if mode == "invoke":
        return retriever.invoke(query, **kw)
    return await retriever.ainvoke(query, **kw)


async def timed(retriever: Any, mode: str, **kw: Any) -> tuple[list[Document], float]:
    t0 = time.perf_counter()
    docs = await call(retriever, mode, **kw)
    return docs, time.perf_counter() - t0


def remember(sc: Sidecar) -> None:
    with KalosVectorStore(EMB, name=sc.name) as store:
        store.add_texts([FACT, "an unrelated memory"], ids=["fact", "other"])


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kalos_retrievers" and r.levelno == logging.WARNING]  # fmt: skip


def later(delay: float, fn: Callable[[], object]) -> threading.Timer:
    t = threading.Timer(delay, fn)
    t.start()
    return t


# ------------------------------------------------------------------ never started


@pytest.mark.parametrize("mode", MODES)
async def test_never_started(
    mode: str, make_name: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "kalos_retrievers")
    r = KalosRetriever(embedding=EMB, name=make_name(), timeout=0.3)
    for _ in range(3):
        docs, took = await timed(r, mode)
        assert docs == []
        assert took < 0.3 + MARGIN
    assert (r.degrader.episodes, r.degrader.degraded_calls) == (1, 3)
    assert len(warnings_of(caplog)) == 1
    assert isinstance(r.degrader.last_error, SidecarUnavailable)


@pytest.mark.parametrize("mode", MODES)
async def test_never_started_control_raises(mode: str, make_name: Callable[[], str]) -> None:
    r = KalosRetriever(embedding=EMB, name=make_name(), timeout=0.3, on_error="raise")
    with pytest.raises(SidecarUnavailable, match="start one with"):
        await call(r, mode)
    assert r.degrader.degraded_calls == 0


# ------------------------------------------------------------------ SIGKILL mid-call


@pytest.mark.parametrize("on_error", ["empty", "raise"])
@pytest.mark.parametrize("mode", MODES)
async def test_sigkill_mid_call(
    mode: str, on_error: str, start_sidecar: Callable[..., Sidecar],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    sc = start_sidecar(dim=DIM)
    remember(sc)
    r = KalosRetriever(embedding=EMB, name=sc.name, k=1, timeout=5.0, on_error=on_error)
    assert [d.id for d in await call(r, mode)] == ["fact"]
    # Pause it so that the next call is certainly in flight, then kill it under the call.
    sc.kill(signal.SIGSTOP)
    killer = later(0.15, lambda: sc.kill(signal.SIGKILL))
    t0 = time.perf_counter()
    try:
        if on_error == "raise":  # negative control: the kill does fail the call
            # (the request was never taken, so it is sent again, to nobody: the name's segment is stale)
            with pytest.raises(SidecarUnavailable, match=r"stopped during the call|is not running"):
                await call(r, mode)
        else:
            assert await call(r, mode) == []
            assert r.degrader.episodes == 1
            assert len(warnings_of(caplog)) == 1
    finally:
        killer.join()
    took = time.perf_counter() - t0
    assert 0.15 <= took < 1.0  # noticed by the liveness check, long before the 5 s deadline
    assert sc.proc is not None
    assert sc.proc.wait(5) == -signal.SIGKILL
    # the killed sidecar's segment is stale; a new one under the name removes it
    start_sidecar(dim=DIM, name=sc.name)


# ------------------------------------------------------------------ SIGSTOP past the deadline


@pytest.mark.parametrize("mode", MODES)
async def test_sigstop_deadline_honoured(
    mode: str, start_sidecar: Callable[..., Sidecar], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kalos_retrievers")
    sc = start_sidecar(dim=DIM)
    remember(sc)
    r = KalosRetriever(embedding=EMB, name=sc.name, k=1, timeout=0.25)
    assert [d.id for d in await call(r, mode)] == ["fact"]
    sc.kill(signal.SIGSTOP)
    try:
        for timeout in (0.25, 0.1):  # the field, then an invoke-time override
            docs, took = await timed(r, mode, timeout=timeout)
            assert docs == []
            assert timeout - 0.01 <= took < timeout + MARGIN, took
    finally:
        sc.kill(signal.SIGCONT)
    assert [d.id for d in await call(r, mode, timeout=2)] == ["fact"]  # (2 s: just woken, on a loaded CI)
    assert (r.degrader.episodes, r.degrader.degraded_calls) == (1, 2)
    assert isinstance(r.degrader.last_error, SidecarTimeout)
    # kept without the frames of the failed call (they would keep its connection alive)
    assert r.degrader.last_error.__traceback__ is None
    assert len(warnings_of(caplog)) == 1
    assert any("recall works again" in m for m in caplog.messages)


async def test_a_crowd_of_coroutines_degrades_within_one_timeout_and_spares_the_loops_threads(
    start_sidecar: Callable[..., Sidecar],
) -> None:
    """Recalls blocked by a paused sidecar run on the client's own threads: calls arriving
    every 5 ms each return [] after one timeout, and the event loop's default executor, where
    DeterministicFakeEmbedding's aembed_query and the application's own work run, stays free.
    (Before: the recalls took its threads, the embeddings queued behind recalls waiting out
    their deadlines, and calls took up to twice their timeout: p50 0.47 s of 0.3.)"""
    sc = start_sidecar(dim=DIM)
    remember(sc)
    client = KalosClient(sc.name, max_slots=2)
    store = KalosVectorStore(EMB, client=client)
    r = store.as_retriever(search_kwargs={"k": 1})
    assert [d.id for d in await r.ainvoke(FACT)] == ["fact"]
    loop = asyncio.get_running_loop()
    took: list[float] = []
    waited: list[float] = []

    async def one() -> None:
        t0 = time.perf_counter()
        assert await r.ainvoke(FACT, timeout=0.3) == []
        took.append(time.perf_counter() - t0)

    async def noop() -> None:  # (the application's own work on the default executor)
        t0 = time.perf_counter()
        await loop.run_in_executor(None, lambda: None)
        waited.append(time.perf_counter() - t0)

    sc.kill(signal.SIGSTOP)
    try:
        tasks = []
        for _ in range(60):
            tasks += [asyncio.create_task(one()), asyncio.create_task(noop())]
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
    finally:
        sc.kill(signal.SIGCONT)
    late = [t for t in took if t > 0.3 + MARGIN]
    assert len(took) == 60 and len(late) <= 2, sorted(took)[-5:]
    assert sorted(waited)[-3] < 0.1, sorted(waited)[-5:]
    assert [d.id for d in await r.ainvoke(FACT, timeout=2)] == ["fact"]
    client.close()


@pytest.mark.parametrize("mode", MODES)
async def test_sigstop_control_raises(mode: str, start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(dim=DIM)
    remember(sc)
    r = KalosRetriever(embedding=EMB, name=sc.name, timeout=0.2, on_error="raise")
    sc.kill(signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        with pytest.raises(SidecarTimeout, match="deadline"):
            await call(r, mode)
        assert time.perf_counter() - t0 >= 0.19
    finally:
        sc.kill(signal.SIGCONT)
    assert len(await call(r, mode)) == 2


# ------------------------------------------------------------------ restart under the same name


async def recovered(r: KalosRetriever, mode: str, within: float) -> tuple[list[Document], int]:
    """Call until documents come back; the client reconnects with backoff (<= ~2.4 s)."""
    end = time.monotonic() + within
    tries = 0
    while True:
        tries += 1
        docs = await call(r, mode)
        if docs or time.monotonic() > end:
            return docs, tries
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", MODES)
async def test_restart_recovers_without_new_retriever(
    mode: str, start_sidecar: Callable[..., Sidecar], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, "kalos_retrievers")
    sc = start_sidecar(dim=DIM, data_dir=tmp_path)
    remember(sc)
    r = KalosRetriever(embedding=EMB, name=sc.name, k=1, timeout=0.5)
    strict = KalosRetriever(embedding=EMB, name=sc.name, k=1, timeout=0.5, on_error="raise")
    assert [d.id for d in await call(r, mode)] == ["fact"]
    assert [d.id for d in await call(strict, mode)] == ["fact"]

    sc.kill(signal.SIGKILL)
    assert sc.proc is not None
    sc.proc.wait(5)
    for _ in range(3):
        assert await call(r, mode) == []
    with pytest.raises(SidecarUnavailable):  # negative control: the outage is real
        await call(strict, mode)

    start_sidecar(dim=DIM, name=sc.name, data_dir=tmp_path)  # same name, same store of record
    docs, _tries = await recovered(r, mode, within=5.0)
    assert [d.id for d in docs] == ["fact"]
    assert [d.id for d in await call(strict, mode)] == ["fact"]
    assert r.degrader.episodes == 1
    assert not r.degrader.in_episode
    assert len(warnings_of(caplog)) == 1  # r's one episode; on_error="raise" logs nothing
    assert sum("recall works again" in m for m in caplog.messages) == 1


# ------------------------------------------------------------------ the callback event


class Events(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any, UUID]] = []

    def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kw: Any) -> None:
        self.events.append((name, data, run_id))


class AsyncEvents(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any, UUID]] = []

    async def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kw: Any) -> None:
        self.events.append((name, data, run_id))


@pytest.mark.parametrize("mode", MODES)
async def test_degraded_event_reaches_chain_callbacks(
    mode: str, start_sidecar: Callable[..., Sidecar]
) -> None:
    sc = start_sidecar(dim=DIM)
    remember(sc)
    r = KalosRetriever(embedding=EMB, name=sc.name, k=1, timeout=0.2)
    chain = r | RunnableLambda(len)
    handler = Events() if mode == "invoke" else AsyncEvents()
    config: Any = {"callbacks": [handler]}

    # control: a healthy sidecar dispatches nothing
    assert await call(chain, mode, config=config) == 1
    assert handler.events == []

    sc.stop()
    assert await call(chain, mode, config=config) == 0
    assert await call(chain, mode, config=config) == 0
    assert [e[0] for e in handler.events] == [DEGRADED_EVENT, DEGRADED_EVENT]
    first, second = handler.events[0][1], handler.events[1][1]
    assert first["first_in_episode"] is True
    assert second["first_in_episode"] is False
    assert first["sidecar"] == sc.name
    assert first["error"] == "SidecarUnavailable"
    assert (second["episodes"], second["degraded_calls"]) == (1, 2)


async def test_degraded_event_in_astream_events(make_name: Callable[[], str]) -> None:
    r = KalosRetriever(embedding=EMB, name=make_name(), timeout=0.2)
    chain = r | RunnableLambda(lambda docs: "\n".join(d.page_content for d in docs))
    seen = [ev async for ev in chain.astream_events("q", version="v2")]
    custom = [ev for ev in seen if ev["event"] == "on_custom_event"]
    assert [ev["name"] for ev in custom] == [DEGRADED_EVENT]
    assert custom[0]["data"]["error"] == "SidecarUnavailable"
    assert seen[-1]["event"] == "on_chain_end"
    assert seen[-1]["data"]["output"] == ""


@pytest.mark.parametrize("mode", MODES)
async def test_as_retriever_degrades_too(mode: str, start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(dim=DIM)
    remember(sc)
    store = KalosVectorStore(EMB, name=sc.name, timeout=0.2)
    for search_type, kw in [("similarity", {}), ("mmr", {}),
                            ("similarity_score_threshold", {"score_threshold": 0.5})]:  # fmt: skip
        soft = store.as_retriever(search_type=search_type, search_kwargs={"k": 1, **kw})
        hard = store.as_retriever(search_type=search_type, search_kwargs={"k": 1, **kw},
                                  on_error="raise")  # fmt: skip
        assert [d.id for d in await call(soft, mode)] == ["fact"]
        sc.kill(signal.SIGSTOP)
        try:
            docs, took = await timed(soft, mode)
            assert docs == []
            assert took < 0.2 + MARGIN
            assert soft.degrader.episodes == 1
            with pytest.raises(SidecarTimeout):
                await call(hard, mode)
        finally:
            sc.kill(signal.SIGCONT)
        assert [d.id for d in await call(soft, mode, timeout=2)] == ["fact"]


# ------------------------------------------------------------------ LangChain's copies of a retriever


@pytest.mark.parametrize("mode", MODES)
async def test_configured_copies_share_one_episode(
    mode: str, make_name: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    """``configurable_fields`` rebuilds the retriever at every configured call: one outage is
    still one episode and one warning, counted on the original's degrader."""
    from langchain_core.runnables import ConfigurableField

    caplog.set_level(logging.DEBUG, "kalos_retrievers")
    r = KalosRetriever(embedding=EMB, name=make_name(), timeout=0.2)
    per_user = r.configurable_fields(k=ConfigurableField(id="k"))
    store = r.vectorstore
    mmr = store.as_retriever(search_type="mmr").configurable_fields(
        search_kwargs=ConfigurableField(id="search_kwargs"))  # fmt: skip
    for k in (1, 2, 3):
        config: Any = {"configurable": {"k": k, "search_kwargs": {"k": k}}}
        assert await call(per_user, mode, config=config) == []
        assert await call(mmr, mode, config=config) == []
    assert (r.degrader.episodes, r.degrader.degraded_calls) == (1, 3)
    assert mmr.default.degrader.episodes == 1  # type: ignore[attr-defined]
    assert len(warnings_of(caplog)) == 2  # one per retriever, not one per call
    assert "degrader" not in r.model_dump()


@pytest.mark.parametrize("mode", MODES)
async def test_on_error_set_after_construction_is_obeyed(mode: str, make_name: Callable[[], str]) -> None:
    r = KalosRetriever(embedding=EMB, name=make_name(), timeout=0.2)
    assert await call(r, mode) == []
    r.on_error = "raise"  # (the control: the same retriever degraded above)
    with pytest.raises(SidecarUnavailable):
        await call(r, mode)


def test_a_retrievers_own_store_writes_into_its_namespace(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(dim=DIM)
    r = KalosRetriever(embedding=EMB, name=sc.name, namespace="tenant-7", timeout=2)
    assert r.vectorstore.namespace == "tenant-7"
    r.vectorstore.add_texts([FACT], ids=["fact"])
    assert [d.id for d in r.invoke(FACT)] == ["fact"]
    assert KalosRetriever(embedding=EMB, name=sc.name, timeout=2).invoke(FACT) == []  # control: "" is empty
    with pytest.raises(ValueError, match="timeout"):
        KalosRetriever(embedding=EMB, name=sc.name, timeout=1e6)  # refused here, not at every call

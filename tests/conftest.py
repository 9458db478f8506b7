"""Fixtures shared by every tier.

* Sidecar names are unique per test run (``kt<pid>x<n>``), so parallel runs never collide.
* ``start_sidecar(**kw)`` starts a real sidecar process (CPU backend unless told otherwise)
  and stops it after the test; ``shared_sidecar`` is one per module for read-mostly tests.
* Tests marked ``gpu`` are skipped, with the reason, unless CuPy sees a CUDA device.
* At the end of the session no ``/dev/shm`` object of ours may be left behind.
* ``KALOS_LIST_MIN_ROWS`` is 0 unless the environment sets it: the tests' indexes are small,
  and the list paths they check would otherwise start only at 262,144 rows (the floor itself:
  ``tests/unit/test_index_gpu_lists.py``). Sidecar processes inherit it.
* ``KALOS_LIST_LAUNCH_ROWS`` is 0 unless the environment sets it, for the same reason: in
  the tests' small indexes the rule would send every listed batch to the mask instead
  (``list_pays``; its own tests set it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("KALOS_LIST_MIN_ROWS", "0")  # before the sidecar's modules read it
os.environ.setdefault("KALOS_LIST_LAUNCH_ROWS", "0")

from kalos_retrievers import Sidecar

_counter = itertools.count()
RUN_TAG = f"kt{os.getpid()}{uuid.uuid4().hex[:4]}"


def unique_name(prefix: str = "") -> str:
    return f"{RUN_TAG}{prefix}x{next(_counter)}"


def _gpu_available() -> str | None:
    """None when a GPU is usable, else why not."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as e:
        return f"CUDA unavailable: {e}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return
    why = _gpu_available()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Keep each phase's report on the test item (``start_sidecar`` reads whether the test
    failed). (An old-style wrapper: the GPU machine's pytest may predate ``wrapper=True``.)"""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def start_sidecar(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sidecar]]:
    """Factory: ``start_sidecar(dim=..., device="cpu", ...)`` -> a started :class:`Sidecar`.

    When the test failed, the end of each of its sidecars' logs is printed at teardown (pytest
    shows it with the failure): a sidecar that exits cleanly removes its log, and on the GPU
    machine that log is often the only account of what the sidecar did."""
    started: list[Sidecar] = []

    def start(**kw: Any) -> Sidecar:
        kw.setdefault("device", "cpu")
        kw.setdefault("dim", 8)
        kw.setdefault("name", unique_name())
        kw.setdefault("startup_timeout", 60.0)
        sc = Sidecar(**kw)
        started.append(sc)
        return sc.start()

    yield start
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for sc in started:
            print(f"--- the last lines of sidecar {sc.name}'s log ---\n{sc.log_tail(80)}", file=sys.stderr)
    for sc in started:
        sc.stop()
        sc.log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def serving(cfg: Any) -> Iterator[Any]:
    """A sidecar ``Server`` for ``cfg`` (a ``ServeConfig``) started in this process, its serve
    loop in a thread: for tests that patch the sidecar's own code. Stopped and joined on exit."""
    from kalos_retrievers.sidecar.server import Server

    srv = Server(cfg)
    srv.start()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.stop()
        t.join(30)


@pytest.fixture(scope="module")
def shared_sidecar() -> Iterator[Sidecar]:
    """One CPU sidecar (dim 8, in memory) per test module."""
    sc = Sidecar(unique_name("m"), dim=8, device="cpu", startup_timeout=60.0)
    sc.start()
    yield sc
    sc.stop()
    sc.log_path.unlink(missing_ok=True)


def leftover_shm() -> list[str]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    return sorted(p.name for p in shm.iterdir() if RUN_TAG in p.name)


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_shm() -> Iterator[None]:
    yield
    left = leftover_shm()
    assert not left, f"tests left shared-memory objects behind: {left}"


@pytest.fixture
def make_name() -> Callable[[str], str]:
    """``make_name()`` -> a sidecar name unique to this test run."""
    return unique_name


@pytest.fixture(params=["arena", "inline"])
def docs_from(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where a CPU sidecar's recalls' documents come from: its arena (``KALOS_ARENA=1``), or
    inline in the answer (a CPU sidecar's default). Set before the sidecar starts."""
    if request.param == "arena":
        monkeypatch.setenv("KALOS_ARENA", "1")
    else:
        monkeypatch.delenv("KALOS_ARENA", raising=False)
    return str(request.param)

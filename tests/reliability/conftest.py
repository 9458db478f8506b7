"""Fixtures of the reliability suite.

``launch(patch=None, start=True, **kw)`` builds (and by default starts) a real sidecar process
with small slots (CPU, dim 8) and, with ``patch``, one of the fault injections of
:data:`reliability._harness.PATCHES`. At teardown every sidecar it built is stopped and whatever a
``kill -9`` left in /dev/shm under their names is removed, so the session's leak check stays
meaningful for everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from reliability._harness import FULL, apply_patch, cleanup_ipc

from kalos_retrievers import Sidecar


@pytest.fixture
def launch(make_name: Callable[..., str]) -> Iterator[Callable[..., Sidecar]]:
    built: list[Sidecar] = []

    def make(*, patch: str | None = None, start: bool = True, **kw: Any) -> Sidecar:
        kw.setdefault("device", "cpu")
        kw.setdefault("dim", 8)
        kw.setdefault("name", make_name())
        kw.setdefault("slots", 8)
        kw.setdefault("payload_kb", 64)
        kw.setdefault("blob_kb", 64)
        kw.setdefault("startup_timeout", 60.0)
        kw.setdefault("spin_us", 50)  # leave the 2 CI cores to the clients
        sc = Sidecar(**kw)
        sc.argv = apply_patch(sc.argv, patch)
        built.append(sc)
        if start:
            sc.start()
        return sc

    yield make
    for sc in built:
        sc.stop()
        sc.log_path.unlink(missing_ok=True)
    for name in {sc.name for sc in built}:
        cleanup_ipc(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Full-length runs (KALOS_RELIABILITY_FULL=1) take up to ten minutes a test: lift the
    suite's 120 s per-test timeout for this directory's tests only."""
    if not FULL:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(1800))

"""The client's argument checks that need no sidecar."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from kalos_retrievers.client import KalosClient

pytestmark = pytest.mark.timeout(30)


def test_an_upsert_of_no_rows_checks_its_arguments_without_a_sidecar() -> None:
    """Zero vectors send nothing (no sidecar needed: a lazy client stays unconnected), but the
    arguments are refused as for rows, as ``check_upsert`` says ``upsert`` would."""
    c = KalosClient(f"kalos-unit-zero-{uuid.uuid4().hex[:8]}", dim=3, lazy=True)
    none = np.empty((0, 3), np.float32)
    assert c.upsert([], none) == [] and c.upsert(None, none) == []
    for kwargs, err, match in [
        ({"ids": ["a"]}, ValueError, "ids has 1 entries but vectors has 0"),
        ({"ids": [], "texts": ["x"]}, ValueError, "texts has 1 entries but vectors has 0"),
        ({"ids": [], "metadatas": [{}]}, ValueError, "metadatas has 1 entries but vectors has 0"),
        ({"ids": [], "namespace": 5}, TypeError, "namespace must be a str"),
        ({"ids": [], "timeout": -1}, ValueError, "timeout=-1"),
    ]:
        with pytest.raises(err, match=match):
            c.upsert(vectors=none, **kwargs)
    assert not c.connected


def test_metadata_nested_too_deep_is_refused_by_the_client_and_the_sidecar() -> None:
    """64 levels of dicts and lists are stored; 65 are refused, by the client (ValueError
    naming the entry, nothing sent) and by the sidecar for a raw request (BAD_REQUEST): 980
    levels were stored, then broke every recall returning the row in a deeper stack."""
    from kalos_retrievers.sidecar.index import CpuIndex
    from kalos_retrievers.sidecar.service import Service
    from kalos_retrievers.sidecar.store import NullStore

    from kalos_retrievers.protocol import MAX_METADATA_DEPTH, Invalid, nests_deeper

    def nested(levels: int) -> dict:
        m: object = 1
        for j in range(levels - 1):
            m = [m] if j % 2 else {"k": m}
        return {"m": m}

    assert MAX_METADATA_DEPTH == 64
    assert not nests_deeper(nested(64)) and nests_deeper(nested(65)) and not nests_deeper({})
    assert nests_deeper(nested(5000))  # (no recursion limit on the way)
    c = KalosClient(f"kalos-unit-deep-{uuid.uuid4().hex[:8]}", dim=3, lazy=True)
    with pytest.raises(ValueError, match=r"metadatas\[1\] nests deeper than 64 levels"):
        c.check_upsert(2, ids=["a", "b"], metadatas=[nested(64), nested(65)])
    svc = Service(CpuIndex(3, 0), NullStore(), dim=3, metric=0)
    one = np.ones((1, 3), np.float32)
    assert svc.upsert({"namespace": "", "ids": ["a"], "texts": [""], "metadatas": [nested(64)]}, one) == 1
    with pytest.raises(Invalid, match=r"metadatas\[0\] nests deeper than 64 levels"):
        svc.upsert({"namespace": "", "ids": ["b"], "texts": [""], "metadatas": [nested(65)]}, one)


def test_a_mapping_that_is_not_a_dict_is_measured_too() -> None:
    """The client measures any Mapping's nesting (a MappingProxyType of 65 levels passed it,
    and the sidecar refused that chunk after earlier chunks were committed)."""
    import types

    m: object = 1
    for _ in range(64):
        m = {"k": m}
    c = KalosClient(f"kalos-unit-proxy-{uuid.uuid4().hex[:8]}", dim=3, lazy=True)
    with pytest.raises(ValueError, match=r"metadatas\[0\] nests deeper than 64 levels"):
        c.check_upsert(1, ids=["a"], metadatas=[types.MappingProxyType({"m": m})])


def test_a_connection_closed_under_the_liveness_check_reads_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_Conn.sidecar_alive`` from one thread while another closes the connection (a
    reconnect after the sidecar died): its descriptor is closed by the time the lock is
    queried. That raised a raw ``OSError: [Errno 9] Bad file descriptor`` out of a recall
    (CI, session 66); it reads "not alive" now (the call then ends SidecarUnavailable). And a
    lock seen on a descriptor that close() has meanwhile given up (its number possibly
    another file's) does not count: close() marks the connection dead first."""
    import os
    from types import SimpleNamespace

    from kalos_retrievers import _conn as conn_module
    from kalos_retrievers.protocol import SidecarState

    r, w = os.pipe()
    os.close(r)
    os.close(w)  # (a number no longer open: fcntl on it is EBADF)
    hdr = [0, 0, 0, 0, SidecarState.READY]
    closed = SimpleNamespace(dead=False, _hdr32=hdr, seg=SimpleNamespace(fd=r))
    assert conn_module._Conn.sidecar_alive(closed) is False  # type: ignore[arg-type]

    racing = SimpleNamespace(dead=False, _hdr32=hdr, seg=SimpleNamespace(fd=0))

    def held_then_closed(fd: int, byte: int) -> bool:
        racing.dead = True  # (close() ran on another thread meanwhile)
        return True

    monkeypatch.setattr(conn_module._ipc, "is_locked", held_then_closed)
    assert conn_module._Conn.sidecar_alive(racing) is False  # type: ignore[arg-type]


def test_a_signal_handlers_oserror_in_the_liveness_check_is_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout decorator's ``TimeoutError`` (an ``OSError``) raised out of the lock query by
    its SIGALRM handler was read as "the sidecar died": the call was sent again on a new
    connection (a write done twice) and the caller never saw its timeout. It propagates now;
    EBADF still reads dead (the test above)."""
    from types import SimpleNamespace

    from kalos_retrievers import _conn as conn_module
    from kalos_retrievers.protocol import SidecarState

    conn = SimpleNamespace(dead=False, _hdr32=[0, 0, 0, 0, SidecarState.READY], seg=SimpleNamespace(fd=0))

    def interrupted(fd: int, byte: int) -> bool:
        raise TimeoutError("the caller's timeout")

    monkeypatch.setattr(conn_module._ipc, "is_locked", interrupted)
    with pytest.raises(TimeoutError, match="the caller's timeout"):
        conn_module._Conn.sidecar_alive(conn)  # type: ignore[arg-type]


def test_a_degrader_whose_last_error_is_a_retryable_loss_copies_and_pickles() -> None:
    """A degrader's last error may be the client's private ``_NotTaken`` (a call whose sidecar
    died before it took the request), whose ``__init__`` takes a deadline: rebuilt from its
    args alone it raised TypeError, so ``copy.deepcopy`` of a retriever, and ``pickle.loads``
    of one, failed after such an outage. Copies count degradation anew."""
    import copy
    import pickle

    from kalos_retrievers.client import _NotTaken
    from kalos_retrievers.degrade import Degrader

    e = _NotTaken("sidecar 'x' went away before it took the request", 12.5)
    back = pickle.loads(pickle.dumps(e))  # noqa: S301 - our own bytes
    assert type(back) is _NotTaken and str(back) == str(e) and back.deadline == 12.5
    d = Degrader("KalosRetriever(name='x')", "empty")
    assert d.should_degrade(e) and d.last_error is e and d.episodes == 1
    for dup in (copy.deepcopy(d), pickle.loads(pickle.dumps(d))):  # noqa: S301 - our own bytes
        fresh = (dup.what, dup.on_error, dup.degraded_calls, dup.episodes, dup.last_error)
        assert fresh == (d.what, "empty", 0, 0, None)
        assert dup.should_degrade(e) and dup.episodes == 1 and d.episodes == 1

"""Scenario 11: bad input at every public KalosClient method.

Pass: each bad argument (wrong dimension, NaN/inf, empty text, k <= 0 or huge, oversized text or
metadata, non-JSON metadata, invalid UTF-8 as lone surrogates, unknown filter operators, wrong
types) raises ``ValueError`` or ``TypeError`` whose message names the argument, before anything
is sent (the sidecar counts no rejected request), and the sidecar keeps serving correct answers.

Negative control: with the client's vector checks switched off the harness reports the NaN and
wrong-dimension cases (they reach the sidecar and come back as ``RequestRejected``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reliability._harness import figure
from reliability._workers import dataset, load_dataset

import kalos_retrievers.client as client_mod
from kalos_retrievers import KalosClient, Sidecar

pytestmark = pytest.mark.reliability

DIM, N = 8, 50
V = np.ones(DIM, np.float32)
NAN = np.full(DIM, np.nan, np.float32)
INF = np.full(DIM, np.inf, np.float32)
S = "\ud800"  # a lone surrogate: not encodable as UTF-8
BIG_TEXT = "x" * (80 * 1024)  # the test sidecar's payload is 64 KiB


def cases(c: KalosClient) -> list[tuple[str, Callable[[], Any], str]]:
    """(case, call, the argument the message must name)."""
    up = c.upsert
    return [
        # recall / recall_batch
        ("recall wrong dim", lambda: c.recall(np.ones(DIM - 1)), "query"),
        ("recall NaN", lambda: c.recall(NAN), "query"),
        ("recall inf", lambda: c.recall(INF), "query"),
        ("recall 2 vectors", lambda: c.recall(np.ones((2, DIM))), "query"),
        ("recall text", lambda: c.recall("hello"), "query"),
        ("recall None", lambda: c.recall(None), "query"),
        ("recall k=0", lambda: c.recall(V, k=0), "k"),
        ("recall k=-1", lambda: c.recall(V, k=-1), "k"),
        ("recall k huge", lambda: c.recall(V, k=10**9), "k"),
        ("recall k float", lambda: c.recall(V, k=1.5), "k"),
        ("recall k bool", lambda: c.recall(V, k=True), "k"),
        ("recall k str", lambda: c.recall(V, k="3"), "k"),
        ("recall namespace int", lambda: c.recall(V, namespace=5), "namespace"),
        ("recall namespace surrogate", lambda: c.recall(V, namespace=S), "namespace"),
        ("recall namespace long", lambda: c.recall(V, namespace="n" * 300), "namespace"),
        ("recall unknown operator", lambda: c.recall(V, filter={"a": {"$regex": "x"}}), "filter"),
        ("recall unknown logical", lambda: c.recall(V, filter={"$xor": [{"a": 1}]}), "filter"),
        ("recall filter not dict", lambda: c.recall(V, filter=5), "filter"),
        ("recall filter callable", lambda: c.recall(V, filter=lambda d: True), "filter"),
        ("recall filter surrogate", lambda: c.recall(V, filter={"a": S}), "filter"),
        ("recall filter surrogate key", lambda: c.recall(V, filter={S: 1}), "filter"),
        ("recall filter NaN", lambda: c.recall(V, filter={"a": {"$gt": math.nan}}), "filter"),
        ("recall timeout 0", lambda: c.recall(V, timeout=0), "timeout"),
        ("recall timeout str", lambda: c.recall(V, timeout="1"), "timeout"),
        ("recall timeout inf", lambda: c.recall(V, timeout=math.inf), "timeout"),
        ("recall_batch timeout inf", lambda: c.recall_batch(np.stack([V, V]), timeout=math.inf), "timeout"),
        ("recall_batch wrong dim", lambda: c.recall_batch(np.ones((3, DIM + 1))), "queries"),
        ("recall_batch NaN", lambda: c.recall_batch(np.stack([V, NAN])), "queries"),
        ("recall_batch k=0", lambda: c.recall_batch(np.stack([V, V]), k=0), "k"),
        # upsert
        ("upsert wrong dim", lambda: up(["a"], np.ones((1, DIM + 1))), "vectors"),
        ("upsert NaN", lambda: up(["a"], NAN[None]), "vectors"),
        ("upsert inf", lambda: up(["a"], INF[None]), "vectors"),
        ("upsert zero (cosine)", lambda: up(["a"], np.zeros((1, DIM))), "vectors"),
        ("upsert ids str", lambda: up("ab", np.ones((2, DIM))), "ids"),
        ("upsert ids count", lambda: up(["a", "b"], V[None]), "ids"),
        ("upsert empty id", lambda: up([""], V[None]), "ids[0]"),
        ("upsert int id", lambda: up([5], V[None]), "ids[0]"),
        ("upsert surrogate id", lambda: up([S], V[None]), "ids[0]"),
        ("upsert long id", lambda: up(["i" * 600], V[None]), "ids[0]"),
        ("upsert empty text", lambda: up(["a"], V[None], texts=[""]), "texts[0]"),
        ("upsert int text", lambda: up(["a"], V[None], texts=[5]), "texts[0]"),
        ("upsert surrogate text", lambda: up(["a"], V[None], texts=["ok" + S]), "texts[0]"),
        ("upsert texts str", lambda: up(["a"], V[None], texts="abc"), "texts"),
        ("upsert texts count", lambda: up(["a"], V[None], texts=["a", "b"]), "texts"),
        ("upsert oversized text", lambda: up(["a"], V[None], texts=[BIG_TEXT]), "texts"),
        ("upsert metadata not dict", lambda: up(["a"], V[None], metadatas=[5]), "metadatas[0]"),
        ("upsert metadata object", lambda: up(["a"], V[None], metadatas=[{"o": object()}]), "metadatas[0]"),
        ("upsert metadata set", lambda: up(["a"], V[None], metadatas=[{"s": {1, 2}}]), "metadatas[0]"),
        ("upsert metadata NaN", lambda: up(["a"], V[None], metadatas=[{"x": math.nan}]), "metadatas[0]"),
        ("upsert metadata int key", lambda: up(["a"], V[None], metadatas=[{1: "x"}]), "metadatas[0]"),
        ("upsert metadata surrogate", lambda: up(["a"], V[None], metadatas=[{"x": S}]), "metadatas[0]"),
        ("upsert oversized metadata", lambda: up(["a"], V[None], metadatas=[{"x": BIG_TEXT}]), "metadatas"),
        ("upsert metadatas count", lambda: up(["a"], V[None], metadatas=[{}, {}]), "metadatas"),
        ("upsert namespace surrogate", lambda: up(["a"], V[None], namespace=S), "namespace"),
        # get / scan / delete / delete_namespace / count
        ("get ids str", lambda: c.get("abc"), "ids"),
        ("get int id", lambda: c.get([1]), "ids[0]"),
        ("get surrogate id", lambda: c.get([S]), "ids[0]"),
        ("get namespace int", lambda: c.get(["a"], namespace=1), "namespace"),
        ("scan limit -1", lambda: c.scan(limit=-1), "limit"),
        ("scan limit str", lambda: c.scan(limit="5"), "limit"),
        ("scan offset -1", lambda: c.scan(offset=-1), "offset"),
        ("scan unknown operator", lambda: c.scan(filter={"a": {"$near": 1}}), "filter"),
        ("delete nothing", c.delete, "ids"),
        ("delete ids str", lambda: c.delete("abc"), "ids"),
        ("delete surrogate id", lambda: c.delete([S]), "ids[0]"),
        ("delete unknown operator", lambda: c.delete(filter={"a": {"$regex": 1}}), "filter"),
        ("delete_namespace int", lambda: c.delete_namespace(5), "namespace"),
        ("delete_namespace surrogate", lambda: c.delete_namespace(S), "namespace"),
        ("count filter without namespace", lambda: c.count(filter={"a": 1}), "filter"),
        ("count unknown operator", lambda: c.count("", filter={"a": {"$foo": 1}}), "filter"),
        ("count namespace int", lambda: c.count(5), "namespace"),
        ("namespaces timeout", lambda: c.namespaces(timeout=-1), "timeout"),
        ("stats timeout", lambda: c.stats(timeout=0), "timeout"),
        ("ping timeout", lambda: c.ping(timeout=float("nan")), "timeout"),
        # constructor
        ("client bad name", lambda: KalosClient("bad name!"), "name"),
        ("client dim 0", lambda: KalosClient(c.name, dim=0), "dim"),
        ("client dim str", lambda: KalosClient(c.name, dim="8"), "dim"),
        ("client timeout 0", lambda: KalosClient(c.name, timeout=0), "timeout"),
        ("client timeout inf", lambda: KalosClient(c.name, timeout=math.inf), "timeout"),
        ("client max_slots 0", lambda: KalosClient(c.name, max_slots=0), "max_slots"),
    ]


def run_bad_inputs(sc: Sidecar) -> dict[str, Any]:
    bad: list[str] = []
    data = dataset(N, DIM)
    with KalosClient(sc.name, dim=DIM, spin_us=0) as c:
        if c.count() == 0:
            load_dataset(c, N, DIM)
        before = c.stats()
        table = cases(c)
        for case, call, arg in table:
            try:
                call()
            except (ValueError, TypeError) as e:
                if arg not in str(e):
                    bad.append(f"{case}: {type(e).__name__} does not name {arg!r}: {e}")
            except Exception as e:
                bad.append(f"{case}: raised {type(e).__name__} instead of ValueError/TypeError: {e}")
            else:
                bad.append(f"{case}: accepted")
        after = c.stats()
        sent = after["rejected_requests"] - before["rejected_requests"]
        if sent:
            bad.append(f"{sent} bad requests reached the sidecar (refused there, not by the client)")
        # still serving, still right
        if c.count() != N or [c.recall(data[i], k=1).ids[0] for i in range(5)] != [str(i) for i in range(5)]:
            bad.append("the sidecar stopped serving correct answers")
    return {"cases": len(table), "violations": bad}


def test_bad_input_is_refused_clearly_by_the_client(launch: Callable[..., Sidecar]) -> None:
    sc = launch()
    out = run_bad_inputs(sc)
    figure("11 bad input", **out)
    assert not out["violations"], out["violations"]


def test_bad_input_negative_control_without_vector_checks(
    launch: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_checks(vectors: Any, dim: int, argument: str) -> np.ndarray:
        a = np.asarray(vectors, np.float32)
        return np.ascontiguousarray(a[None] if a.ndim == 1 else a)

    monkeypatch.setattr(client_mod, "check_vectors", no_checks)
    sc = launch()
    out = run_bad_inputs(sc)
    assert any(v.startswith("recall NaN: raised RequestRejected") for v in out["violations"]), out
    assert any("reached the sidecar" in v for v in out["violations"]), out

"""A GPU sidecar's crowd on the carousel (KALOS_CAROUSEL=1: sidecar/crowd.py hands batch-1 recalls
to ``carousel_topk``): client processes recalling at once get exact answers from it, writes in
the middle of the crowd drain and stop it and are found at once, and the index's counters say
the carousel answered (the negative control: without the switch it never starts).

Each worker computes its float64 references before its first call (tests/kalos_testing.py,
``exact_crowd_worker``), so the clients recall back to back and stay a crowd.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from kalos_testing import exact_crowd_worker, recall_row_worker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _rows(start_sidecar, dim: int, rows: int, metric: str, other_every: int = 0):  # type: ignore[no-untyped-def]
    """A GPU sidecar (float16) holding ``rows`` rows of ``dim`` (ids "0".., data seed 0), every
    ``other_every``-th in namespace "other" when nonzero (the default namespace then is not
    every row: the carousel is asked for its namespace id), with slots for 16 clients and this
    process."""
    data = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float16", metric=metric, slots=24)
    ns = np.arange(rows) % other_every == 0 if other_every else np.zeros(rows, bool)
    with sc.client() as c:
        for s in range(0, rows, 8192):
            part = np.arange(s, min(rows, s + 8192))
            for name, sel in (("", part[~ns[part]]), ("other", part[ns[part]])):
                if len(sel):
                    c.upsert([str(i) for i in sel], data[sel], namespace=name)
    return sc, data


def _start(target, args_of, procs: int):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    ps = [ctx.Process(target=target, args=(*args_of(s), q)) for s in range(procs)]
    for p in ps:
        p.start()

    def wait(timeout: float) -> list:
        got = [q.get(timeout=timeout) for _ in ps]
        for p in ps:
            p.join(60)
            assert p.exitcode == 0
        return got

    return wait


@pytest.mark.parametrize(("metric", "dim", "other_every"), [("cosine", 768, 7), ("l2", 97, 0), ("ip", 768, 0)])
def test_a_crowd_on_the_carousel_gets_exact_answers(start_sidecar, monkeypatch, metric: str, dim: int,
                                                    other_every: int) -> None:  # fmt: skip
    """16 processes x 120 recalls (k 1, 10, 32) over 50,021 float16 rows: every answer matches
    float64 within float16's tolerance (rows of another namespace never returned), and the
    carousel answered them (the index's counters)."""
    monkeypatch.setenv("KALOS_CAROUSEL", "1")
    monkeypatch.setenv("KALOS_CAROUSEL_MIN", "4")
    rows, calls = 50_021, 120
    sc, _ = _rows(start_sidecar, dim, rows, metric, other_every)
    wait = _start(exact_crowd_worker, lambda s: (sc.name, dim, metric, 100 + s, calls, rows, other_every), 16)
    assert wait(400) == [""] * 16
    with sc.client() as c:
        index = c.stats()["index"]
    assert index["carousel_k"] == 32 and index["carousel_launches"] >= 1, index
    assert index["carousel_boarded"] >= 16 * calls // 2, index  # most of the crowd rode it


def test_writes_in_a_crowd_on_the_carousel_are_found_at_once(start_sidecar, monkeypatch) -> None:
    """16 processes recall their own rows while this one upserts a row at a time and recalls it:
    each write drains and stops the carousel (the answers aboard come from the rows as they
    were), is found by the next recall, and the crowd starts the carousel again."""
    monkeypatch.setenv("KALOS_CAROUSEL", "1")
    monkeypatch.setenv("KALOS_CAROUSEL_MIN", "4")
    dim, rows = 768, 60_001
    sc, _ = _rows(start_sidecar, dim, rows, "cosine")
    wait = _start(recall_row_worker, lambda s: (sc.name, dim, s, 400), 16)
    rng = np.random.default_rng()
    with sc.client() as c:
        for j in range(20):
            v = rng.standard_normal(dim).astype(np.float32)
            c.upsert([f"w{j}"], v[None])
            assert c.recall(v, k=1).ids == [f"w{j}"]
    assert wait(300) == [0] * 16
    with sc.client() as c:
        index = c.stats()["index"]
    assert index["carousel_launches"] >= 2 and index["carousel_boarded"] > 0, index


def test_without_the_switch_the_carousel_never_starts(start_sidecar, monkeypatch) -> None:
    """The negative control: the same crowd without KALOS_CAROUSEL is served by batches."""
    monkeypatch.delenv("KALOS_CAROUSEL", raising=False)
    dim, rows = 97, 20_011
    sc, _ = _rows(start_sidecar, dim, rows, "cosine")
    wait = _start(exact_crowd_worker, lambda s: (sc.name, dim, "cosine", 200 + s, 60, rows, 0), 16)
    assert wait(400) == [""] * 16
    with sc.client() as c:
        index = c.stats()["index"]
    assert index["carousel_k"] == 0 and index["carousel_launches"] == 0 and index["mma_batches"] > 0, index

"""The whole zero-copy path on the GPU: client -> slot -> registered segment -> kernels -> slot.

Each test starts a real sidecar with ``--device cuda``. Before each call the test poisons the
response areas of every slot directly in the shared segment (rows 0x7f7f7f7f, scores NaN), and
asks for rows and scores only (``docs=False``, so the sidecar does not look at the rows): an
element the kernels fail to write reaches the test as poison.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from kalos_testing import (
    as_float16_stored,
    assert_topk_equal,
    poison,
    recall_row_worker,
    reference_topk,
)

from kalos_retrievers import CapacityError, SidecarUnavailable

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def test_zero_copy_recall_matches_reference(start_sidecar) -> None:
    rng = np.random.default_rng()
    n, dim = 20_011, 97
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32")
    c = sc.client()
    assert c.header.backend.startswith("cuda")
    c.upsert([str(i) for i in range(n)], data)
    for b in (1, 11, 77):
        q = rng.standard_normal((b, dim)).astype(np.float32)
        for k in (1, 10, 100):
            poison(sc.name)
            res = c.recall_batch(q, k, docs=False)
            ref_i, ref_s = reference_topk(data, q, k)
            for j, r in enumerate(res):
                assert np.all((r.rows >= 0) & (r.rows < n)), r.rows
                ids = [str(x) for x in r.rows]  # fresh index, in-order upsert: row == id here
                assert_topk_equal(ids, r.scores, [str(i) for i in ref_i[j]], ref_s[j],
                                  context=f"b={b} k={k} q{j}")  # fmt: skip
    # documents travel with the rows
    hit = c.recall(data[123], k=1)
    assert hit.ids == ["123"] and hit.scores[0] == pytest.approx(1.0, abs=1e-5)
    c.close()


def _crowd(name: str, dim: int, calls: int, rows: int = 4001, procs: int = 16):  # type: ignore[no-untyped-def]
    """Start ``procs`` client processes that each recall stored rows by themselves ``calls``
    times (``recall_row_worker``); returns the wait for them, which asserts they exited
    cleanly and returns how many answers were not the query's own row (misrouted)."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    ps = [ctx.Process(target=recall_row_worker, args=(name, dim, s, calls, q, rows)) for s in range(procs)]
    for p in ps:
        p.start()

    def wait(timeout: float) -> int:
        misrouted = sum(q.get(timeout=timeout) for _ in ps)
        for p in ps:
            p.join(60)
            assert p.exitcode == 0
        return misrouted

    return wait


def test_float16_default_recall_and_filters(start_sidecar) -> None:
    rng = np.random.default_rng()
    n, dim = 30_007, 768
    data = rng.standard_normal((n, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda")
    c = sc.client()
    assert c.header.dtype_name == "float16"
    c.upsert([str(i) for i in range(n)], data, metadatas=[{"m": i % 5} for i in range(n)])
    q = rng.standard_normal((11, dim)).astype(np.float32)
    # exact at float16 precision: against the float16-rounded rows and queries (recall@10 over
    # the float32 data swapped a 10th and 11th neighbour in ~0.5% of runs)
    stored, sq = as_float16_stored(data, "cosine"), as_float16_stored(q, "cosine")
    eligible = np.arange(n) % 5 == 2
    for flt, elig in ((None, None), ({"m": 2}, eligible)):
        poison(sc.name)
        res = c.recall_batch(q, 10, filter=flt)
        ref_i, ref_s = reference_topk(stored, sq, 10, "ip", eligible=elig)
        for j, r in enumerate(res):
            assert_topk_equal(r.ids, r.scores, [str(i) for i in ref_i[j]], ref_s[j], atol=1e-3,
                              context=f"filter {flt} q{j}")  # fmt: skip
    c.close()


def test_batch_timing_keeps_batches_exact(start_sidecar, monkeypatch) -> None:
    """The batch diagnostics (KALOS_BATCH_TIMING: CUDA events around mma_filter's graph)
    answer as the default path does, and report the batches they timed; without them, no
    timing is reported (the negative control)."""
    rng = np.random.default_rng()
    n, dim = 30_011, 768
    data = rng.standard_normal((n, dim)).astype(np.float32)
    q = rng.standard_normal((13, dim)).astype(np.float32)
    ref_i, ref_s = reference_topk(as_float16_stored(data, "cosine"), as_float16_stored(q, "cosine"), 10, "ip")
    for timing in (False, True):
        if timing:
            monkeypatch.setenv("KALOS_BATCH_TIMING", "1")
        else:
            monkeypatch.delenv("KALOS_BATCH_TIMING", raising=False)
        sc = start_sidecar(dim=dim, device="cuda")
        with sc.client() as c:
            c.upsert([str(i) for i in range(n)], data)
            for _ in range(3):
                poison(sc.name)
                for j, r in enumerate(c.recall_batch(q, 10)):
                    assert_topk_equal(r.ids, r.scores, [str(i) for i in ref_i[j]], ref_s[j], atol=1e-3,
                                      context=f"timing {timing} q{j}")  # fmt: skip
            index = c.stats()["index"]
        assert index["mma_path"]
        if timing:
            t = index["batch_timing"]
            assert t["batches"] >= 3 and t["queries_mean"] == 13, t
            # (the device's time starts before the launch call returns: it can exceed the host's)
            assert t["device_p50_us"] > 0 and t["launch_to_ready_p50_us"] > 0 and t["wait_p50_us"] >= 0, t
        else:
            assert "batch_timing" not in index
        sc.stop()


def test_concurrent_clients_get_their_own_answers(start_sidecar) -> None:
    dim = 97
    data = np.random.default_rng(0).standard_normal((4001, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float32", slots=24)
    with sc.client() as c:
        c.upsert([str(i) for i in range(len(data))], data)
    assert _crowd(sc.name, dim, 500)(120) == 0
    with sc.client() as c:
        assert c.stats()["batches"] > 0  # requests found together were answered together


def _float16_rows(start_sidecar, dim: int = 768, rows: int = 60_001):  # type: ignore[no-untyped-def]
    """A GPU sidecar holding ``rows`` float16 rows of ``dim`` (the crowd's: ids "0".., data
    seed 0) and slots for 16 clients and this process; returns (sidecar, dim, rows)."""
    data = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    sc = start_sidecar(dim=dim, device="cuda", dtype="float16", slots=24)
    with sc.client() as c:
        for s in range(0, rows, 8192):
            c.upsert([str(i) for i in range(s, min(rows, s + 8192))], data[s : s + 8192])
    return sc, dim, rows


def test_float16_cohorts_queued_behind_each_other_get_their_own_answers(start_sidecar, monkeypatch) -> None:
    """16 client processes recalling float16 rows (the mma path): a batch that gathers while
    another is on the device is queued behind it (the index's ``queued_batches``), and every
    client still gets its own row back. Those queued launches are made from the members' slot
    numbers in C (sidecar/_launch.c: ``queued_c``), which the GPU machine builds. (The carousel
    off: by default such a crowd rides it, tests/gpu/test_gpu_crowd.py.)"""
    monkeypatch.setenv("KALOS_CAROUSEL", "0")
    sc, dim, rows = _float16_rows(start_sidecar)
    assert _crowd(sc.name, dim, 400, rows)(300) == 0
    with sc.client() as c:
        index = c.stats()["index"]
    assert index["mma_path"] and index["queued_batches"] > 0 and index["queued_c"] > 0, index


def test_writes_while_a_float16_crowd_recalls_are_found_at_once(start_sidecar, monkeypatch) -> None:
    """16 client processes recall float16 rows (batched, queued behind each other) while this
    process upserts a row at a time and recalls it: each write waits for the batches in
    flight (they answer from the rows as they were), is found by the next recall, and every
    client still gets its own row back. (The carousel off, as above; with it, the same case is
    test_gpu_crowd.py's writes amid a crowd.)"""
    monkeypatch.setenv("KALOS_CAROUSEL", "0")
    sc, dim, rows = _float16_rows(start_sidecar)
    wait = _crowd(sc.name, dim, 400, rows)
    rng = np.random.default_rng()
    with sc.client() as c:
        for j in range(20):
            v = rng.standard_normal(dim).astype(np.float32)
            c.upsert([f"w{j}"], v[None])
            assert c.recall(v, k=1).ids == [f"w{j}"]
    assert wait(300) == 0
    with sc.client() as c:
        assert c.stats()["index"]["mma_batches"] > 0


def test_auto_picks_the_gpu_and_says_so(start_sidecar) -> None:
    sc = start_sidecar(dim=16, device="auto")
    with sc.client() as c:
        assert c.header.backend.startswith("cuda")
    assert "GPU backend: cuda:0" in sc.log_path.read_text()


def test_device_memory_limit_gives_capacity_error_and_keeps_serving(start_sidecar, monkeypatch) -> None:
    monkeypatch.setenv("KALOS_GPU_MEMORY_LIMIT", str(8 << 20))
    sc = start_sidecar(dim=768, device="cuda")
    rng = np.random.default_rng()
    with sc.client() as c:
        data = rng.standard_normal((2000, 768)).astype(np.float32)
        c.upsert([str(i) for i in range(2000)], data)
        with pytest.raises(CapacityError, match="device memory"):
            c.upsert([f"x{i}" for i in range(9000)], rng.standard_normal((9000, 768)))
        # a write larger than one slot is chunked; chunks committed before the refusal stay
        # (each chunk is atomic, the whole call is not: documented)
        n = c.count()
        assert 2000 <= n < 11000
        assert len(c.scan(limit=20000)) == n  # store, rows and index agree
        assert c.recall(data[7], k=1).ids == ["7"]


def test_sticky_cuda_error_exits_nonzero_and_restart_reloads(start_sidecar, make_name, tmp_path, monkeypatch) -> None:
    name = make_name()
    data = np.random.default_rng(1).standard_normal((501, 64)).astype(np.float32)
    sc = start_sidecar(name=name, dim=64, device="cuda", data_dir=tmp_path)
    with sc.client() as c:
        c.upsert([str(i) for i in range(501)], data)
    sc.stop()
    monkeypatch.setenv("KALOS_FAULT_INJECT", "illegal_address")
    faulty = start_sidecar(name=name, dim=64, device="cuda", data_dir=tmp_path)
    # documents inline: the sidecar launches this search (where the fault is injected), not
    # the resident kernel
    with faulty.client(timeout=5.0, arena_docs=False) as c, pytest.raises(SidecarUnavailable):
        c.recall(data[0], k=1)
    t0 = time.monotonic()
    assert faulty.proc is not None
    code = faulty.proc.wait(timeout=30)
    assert code == 7, faulty.log_tail()
    assert time.monotonic() - t0 < 30
    assert "exiting so that a supervisor restarts" in faulty.log_path.read_text()
    monkeypatch.delenv("KALOS_FAULT_INJECT")
    again = start_sidecar(name=name, dim=64, device="cuda", data_dir=tmp_path)
    with again.client() as c:
        assert c.count() == 501
        assert c.recall(data[42], k=1).ids == ["42"]


def test_cuda_device_that_does_not_exist_fails_start_with_code_5() -> None:
    r = subprocess.run([sys.executable, "-P", "-m", "kalos_retrievers.sidecar", "serve", "--name",
                        f"nodev{os.getpid()}", "--dim", "8", "--device", "cuda:99"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 5, r.stderr
    assert "cuda:99" in r.stderr

"""The sweep's bookkeeping (sidecar/sweep.py), on the CPU: pool positions, the ranges of one
scan, and which batches each pass serves. The last test runs the whole algorithm in numpy
(thresholds from a sample, candidates appended range by range, the top-k selected when a batch
leaves) with batches joining at random passes, against an exact top-k: what the GPU's launches
implement (tests/gpu/test_gpu_index.py runs them)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kalos_retrievers.sidecar.sweep import (
    ROW_ALIGN,
    Member,
    Plan,
    Positions,
    chunk_bounds,
    sweep_chunks,
    sweep_lead_us,
)


def test_positions_are_taken_lowest_first_and_reused() -> None:
    p = Positions(64)
    assert p.high == 0 and p.free == 64
    a, b, c = p.take(5), p.take(16), p.take(3)
    assert (a, b, c) == (0, 5, 21) and p.high == 24
    p.give(b)
    assert p.high == 24 and p.free == 56
    assert p.take(17) == 24  # does not fit the hole of 16
    assert p.take(16) == 5  # fits it exactly
    assert p.take(7) == 41
    p.give(41)
    p.give(24)
    assert p.high == 24
    assert p.take(64 - 24) == 24 and p.take(1) is None
    with pytest.raises(ValueError, match="no range taken at 2"):
        p.give(2)
    with pytest.raises(ValueError, match="n=0"):
        p.take(0)
    with pytest.raises(ValueError, match="n=65"):
        p.take(65)


def test_positions_against_a_model_over_random_takes_and_gives() -> None:
    rng = np.random.default_rng(11)
    p, used = Positions(64), np.zeros(64, bool)
    held: list[tuple[int, int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.45:
            start, n = held.pop(int(rng.integers(len(held))))
            p.give(start)
            used[start : start + n] = False
        else:
            n = int(rng.integers(1, 20))
            start = p.take(n)
            # the model: the lowest run of n free positions, or none
            runs = [s for s in range(64 - n + 1) if not used[s : s + n].any()]
            assert start == (runs[0] if runs else None), (n, used.nonzero())
            if start is not None:
                used[start : start + n] = True
                held.append((start, n))
        assert p.high == (int(used.nonzero()[0].max()) + 1 if used.any() else 0)
        assert p.free == int((~used).sum())


@pytest.mark.parametrize(("high", "chunks"), [(1, 4), (31, 4), (97, 3), (1_000_000, 4), (1_000_003, 7), (64, 64)])
def test_chunk_bounds_cover_the_rows_once_in_aligned_ranges(high: int, chunks: int) -> None:
    b = chunk_bounds(high, chunks)
    assert 1 <= len(b) <= chunks
    assert b[0][0] == 0 and b[-1][1] == high
    for (_, r1), (n0, _) in itertools.pairwise(b):
        assert r1 == n0
    assert all(r0 < r1 and r0 % ROW_ALIGN == 0 for r0, r1 in b)
    assert chunk_bounds(0, chunks) == []


def test_sweep_settings_from_the_environment() -> None:
    assert sweep_chunks({}) == 4 and sweep_chunks({"KALOS_SWEEP_CHUNKS": " "}) == 4
    assert sweep_chunks({"KALOS_SWEEP_CHUNKS": "8"}) == 8
    for bad in ("0", "65", "four", "4.5"):
        with pytest.raises(ValueError, match=r"KALOS_SWEEP_CHUNKS='.*': expected an integer from 1 to 64"):
            sweep_chunks({"KALOS_SWEEP_CHUNKS": bad})
    assert sweep_lead_us({}) == 0 and sweep_lead_us({"KALOS_SWEEP_LEAD_US": "25"}) == 25
    for bad in ("-1", "10001", "soon"):
        with pytest.raises(ValueError, match="KALOS_SWEEP_LEAD_US"):
            sweep_lead_us({"KALOS_SWEEP_LEAD_US": bad})


def test_each_member_scans_every_range_once_from_where_it_joined() -> None:
    plan = Plan(4)
    a = Member("a", 0, 1, 10, 0)
    plan.add(a)
    seen: dict[str, list[int]] = {"a": []}
    b = None
    for step in range(9):
        if step == 2:
            b = Member("b", 1, 2, 10, 1)
            plan.add(b)
            seen["b"] = []
        c, joining, leaving = plan.next_pass()
        for m in plan.members + leaving:
            seen[m.token].append(c)
        if step == 0:
            assert joining == [a]
        if step == 2:
            assert joining == [b]
        if step == 3:
            assert leaving == [a]
        if step == 5:
            assert leaving == [b]
    assert seen == {"a": [0, 1, 2, 3], "b": [2, 3, 0, 1]}
    assert b is not None and b.first == 2 and a.first == 0
    assert plan.members == []
    plan.restart()
    assert plan.cursor == 0
    plan.add(Member("c", 0, 1, 1, 0))
    with pytest.raises(RuntimeError, match="restart with members"):
        plan.restart()
    with pytest.raises(ValueError, match="chunks=0"):
        Plan(0)


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_the_sweep_in_numpy_answers_every_batch_exactly(chunks: int) -> None:
    """Batches of 1-5 queries join at random passes; each query's candidates are the rows of
    each range at or above its threshold (the k-th best of a sample of rows), appended as its
    passes scan the ranges; when it leaves, the best k of its list must be the exact top-k.
    Negative control inside: a query that scanned one range less misses rows of the answer in
    some of these draws (counted, must happen)."""
    rng = np.random.default_rng()
    rows, dim = 1009, 13
    data = rng.standard_normal((rows, dim)).astype(np.float32)
    bounds = chunk_bounds(rows, chunks)
    plan = Plan(len(bounds))
    pos = Positions(64)
    cand: dict[int, list[tuple[float, int]]] = {}
    tau: dict[int, float] = {}
    queries: dict[int, np.ndarray] = {}
    scores: dict[int, np.ndarray] = {}
    ks: dict[int, int] = {}
    short_missed = answered = 0
    token = 0
    for step in range(400):
        for _ in range(int(rng.integers(0, 3))):
            n = int(rng.integers(1, 6))
            start = pos.take(n)
            if start is None:
                break
            k = int(rng.choice([1, 7, 40]))
            m = Member(token, start, n, k, 0)
            token += 1
            plan.add(m)
            for j in range(start, start + n):
                queries[j] = rng.standard_normal(dim).astype(np.float32)
                scores[j] = data @ queries[j]  # (every range reads these: no BLAS rounding between shapes)
                ks[j] = k
                sample = scores[j][:64]
                tau[j] = float(np.sort(sample)[::-1][k - 1]) if k <= len(sample) else -np.inf
                cand[j] = []
        if not plan.scanning():
            continue
        # a batch whose front work is not done waits for a later pass (KALOS_SWEEP_LEAD_US)
        c, _, leaving = plan.next_pass(lambda m: rng.random() < 0.7)
        r0, r1 = bounds[c]
        for m in [m for m in plan.members if m.joined] + leaving:
            for j in range(m.start, m.start + m.n):
                s = scores[j][r0:r1]
                cand[j] += [(float(v), r0 + int(i)) for i, v in enumerate(s) if v >= tau[j]]
        for m in leaving:
            for j in range(m.start, m.start + m.n):
                got = sorted((v for v, _ in cand[j]), reverse=True)[: ks[j]]
                want = np.sort(scores[j])[::-1][: ks[j]]
                assert np.array_equal(np.float32(got), want), (step, j)
                assert len({r for _, r in cand[j]}) == len(cand[j])  # no row scanned twice
                # the control: without the range it joined at
                first = bounds[m.first]
                short = sorted((v for v, r in cand[j] if not first[0] <= r < first[1]), reverse=True)[: ks[j]]
                short_missed += not np.array_equal(np.float32(short), want)
                answered += 1
            pos.give(m.start)
    assert answered > 100
    if chunks > 1:
        assert short_missed > 0


def test_a_member_not_ready_waits_without_counting_passes() -> None:
    plan = Plan(3)
    a, b = Member("a", 0, 1, 1, 0), Member("b", 1, 1, 1, 1)
    plan.add(a)
    plan.next_pass()
    plan.add(b)
    assert plan.next_pass(lambda m: False) == (1, [], [])
    assert not b.joined and b.left == 3 and a.left == 1
    assert plan.next_pass() == (2, [b], [a]) and b.first == 2
    assert [plan.next_pass()[2] for _ in range(2)] == [[], [b]]
    # one range: a member joins and leaves in one pass, once it is ready
    one = Plan(1)
    m = Member("m", 0, 1, 1, 0)
    one.add(m)
    assert one.peek(lambda m: False) == (0, [], []) and not one.scanning(lambda m: False)
    assert one.scanning() and one.next_pass() == (0, [m], [m]) and one.members == []

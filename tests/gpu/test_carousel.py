"""The carousel (``carousel_topk``, sidecar/carousel.py) on the GPU, in process, against a float64
reference over the same float16 rows: a crowd of clients boarding and leaving a scan that
never stops, odd sizes, every k up to KMAX, more clients than positions, namespaces,
refusals, and a stop and a second launch.

Fresh random data every run. The rows are float16 (the kernel's only type); the reference
multiplies them, and the query as the kernel rounds it, in float64, so scores agree within
1e-3 and rows up to ties at the k-th (``assert_topk_equal``). Every request's results area is
poisoned before it is sent (``Slots.send``): an element the kernel did not write fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from kalos_testing import as_float16_stored, assert_topk_equal

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]

METRICS = {"cosine": 0, "ip": 1, "l2": 2}
NS_ANY = -2


class Rig:
    """Random rows on the device (float16, as a GPU index stores them: normalized first for
    cosine), slots, and the kernel running over them."""

    def __init__(self, metric: str, dim: int, rows: int, n_slots: int = 40, ns: np.ndarray | None = None,
                 raw: np.ndarray | None = None, max_blocks: int | None = None) -> None:  # fmt: skip
        import cupy as cp
        from kalos_retrievers.sidecar.carousel import Carousel, Slots

        self.cp, self.metric, self.dim = cp, metric, dim
        rng = np.random.default_rng()
        self.rng = rng
        if raw is None:
            raw = rng.standard_normal((rows, dim)).astype(np.float32)
        self.stored = as_float16_stored(raw, metric)  # float64 of what the device holds
        ld = -(-dim // 8) * 8
        host = np.zeros((rows, ld), np.float16)
        host[:, :dim] = self.stored
        self.data = cp.asarray(host)
        self.sqnorm = cp.asarray((raw.astype(np.float64) ** 2).sum(1).astype(np.float32))  # as GpuIndex: from float32
        self.sqn = cp.asnumpy(self.sqnorm).astype(np.float64)
        self.ns = ns
        self.slots = Slots(cp, n_slots, dim)
        self.car = None
        try:  # (what was made is released if the rest fails: registered host memory above all)
            dev_ns = cp.asarray(ns, cp.int32) if ns is not None else None
            self.car = Carousel(cp, self.data, dim, METRICS[metric], self.slots, sqnorm=self.sqnorm, ns=dev_ns,
                                max_blocks=max_blocks)  # fmt: skip
            self.car.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            if self.car is not None:
                self.car.close()
        finally:
            self.slots.close()

    def boundary_rows(self) -> list[int]:
        """The first and last row of every scanning block's range (as carousel_topk splits the
        rows: tiles of 32, block b from tiles * b // G), and the last row of all."""
        n, g = len(self.stored), self.car.scanners
        tiles = -(-n // 32)
        out = {n - 1}
        for b in range(g):
            lo, hi = tiles * b // g * 32, min(tiles * (b + 1) // g * 32, n)
            if lo < hi:
                out |= {lo, hi - 1}
        return sorted(out)

    def reference(self, q: np.ndarray, k: int, ns: int = NS_ANY) -> tuple[list[int], np.ndarray]:
        qq = as_float16_stored(q[None, :], self.metric)[0]
        dot = self.stored @ qq
        if self.metric == "l2":
            qn2 = float((q.astype(np.float32).astype(np.float64) ** 2).sum())
            s = -np.sqrt(np.maximum(qn2 + self.sqn - 2 * dot, 0))
        else:
            s = dot
        if ns != NS_ANY:
            s = np.where(self.ns == ns, s, -np.inf)
        order = np.argsort(-s, kind="stable")[: min(k, int(np.isfinite(s).sum()))]
        return order.tolist(), s[order]

    def check(self, answers: list, requests: list, atol: float = 1e-3) -> None:
        from kalos_retrievers.sidecar.carousel import DONE

        assert sorted(a.j for a in answers) == list(range(len(requests)))
        for a in answers:
            q, k, ns = requests[a.j]
            want, want_s = self.reference(q, k, ns)
            ctx = f"request {a.j} k={k} ns={ns}"
            assert a.state == DONE and a.n == len(want), (ctx, a.state, a.n, len(want))
            assert_topk_equal(a.rows[: a.n].tolist(), a.scores[: a.n], want, want_s, atol=atol, context=ctx)
            # the rest of the k written too: no result there
            assert (a.rows[a.n :] == -1).all() and np.isneginf(a.scores[a.n :]).all(), ctx


def _queries(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    return rng.standard_normal((n, dim)).astype(np.float32)


CROWDS = [("cosine", 768, 20011), ("ip", 97, 5003), ("l2", 768, 100003), ("cosine", 3, 37)]


@pytest.mark.parametrize(("metric", "dim", "rows"), CROWDS)
def test_a_crowd_boarding_the_carousel_gets_exact_answers(metric: str, dim: int, rows: int) -> None:
    from kalos_retrievers.sidecar.carousel import drive

    rig = Rig(metric, dim, rows)
    try:
        n = base = 150 if rows > 50000 else 400
        qs = _queries(rig.rng, n, dim)
        ks = [(1, 10, 32, 7, 3)[j % 5] for j in range(n)]
        requests = [(qs[j], min(ks[j], rows), NS_ANY) for j in range(n)]
        if metric == "cosine" and dim > 3:  # each block's first and last row, asked for by itself
            requests += [(rig.stored[r].astype(np.float32), 3, NS_ANY) for r in rig.boundary_rows()]
            n = len(requests)
        # 40 clients for 32 positions (some wait in their slots), half of them coming back at once
        answers = drive(rig.slots, lambda j: requests[j] if j < n else None, return_ns=30_000)
        rig.check(answers, requests)
        _answered(rig, n)
        if metric == "cosine" and dim > 3:
            own = {a.j: int(a.rows[0]) for a in answers if a.j >= base}
            assert own == {base + i: r for i, r in enumerate(rig.boundary_rows())}
        # a turn is at least one step of each block; at most a few ms on an H200 at these sizes
        assert all(0 < a.aboard_ns < 50_000_000 for a in answers)
    finally:
        rig.close()


def _answered(rig: Rig, n: int) -> None:
    """The conductor's count of answers reaches n (it is written just after each answer's state)."""
    import time

    end = time.monotonic() + 1
    while rig.car.answered < n and time.monotonic() < end:
        pass
    assert rig.car.answered == n


@pytest.mark.parametrize(("metric", "max_blocks"), [("cosine", 9), ("l2", 3)])
def test_long_turns_cut_their_lists_and_stay_exact(metric: str, max_blocks: int) -> None:
    """Few blocks over 100k rows: turns of ~50-400 steps, so every position's list is cut to
    its best k many times (its threshold raised each time), and queries board at every step
    of a turn. (With the whole grid, a block's turn at these sizes is 1-2 steps: no cut.)"""
    from kalos_retrievers.sidecar.carousel import drive

    rig = Rig(metric, 96, 100_003, max_blocks=max_blocks)
    try:
        n = 120
        qs = _queries(rig.rng, n, 96)
        requests = [(qs[j], (32, 1, 10, 17)[j % 4], NS_ANY) for j in range(n)]
        if metric == "cosine":  # each block's first and last row, asked for by itself
            requests += [(rig.stored[r].astype(np.float32), 1, NS_ANY) for r in rig.boundary_rows()]
            n = len(requests)
        answers = drive(rig.slots, lambda j: requests[j] if j < n else None, return_ns=100_000, timeout=60)
        rig.check(answers, requests)
        if metric == "cosine":
            assert sorted(int(a.rows[0]) for a in answers if a.j >= 120) == rig.boundary_rows()
    finally:
        rig.close()


def test_tied_rows_across_blocks_come_back_smallest_row_first() -> None:
    """Copies of one row spread over the blocks' ranges score exactly alike; the answer takes
    the k with the smallest row numbers, in that order (score descending, then row: the other
    paths' order), including when k cuts the copies."""
    from kalos_retrievers.sidecar.carousel import drive

    rows, dim = 50_021, 64
    raw = np.random.default_rng().standard_normal((rows, dim)).astype(np.float32)
    copies = [7, 4096, 12_345, 20_000, 33_333, 49_999]
    raw[copies] = raw[7]
    rig = Rig("cosine", dim, rows, raw=raw, max_blocks=7)
    try:
        requests = [(raw[7], k, NS_ANY) for k in (1, 3, 6, 8)]
        answers = drive(rig.slots, lambda j: requests[j] if j < len(requests) else None)
        for a in sorted(answers, key=lambda a: a.j):
            k = requests[a.j][1]
            assert a.rows[: min(k, 6)].tolist() == copies[: min(k, 6)], (k, a.rows)
            assert len(set(a.scores[: min(k, 6)].tolist())) == 1
        rig.check(answers, requests)
    finally:
        rig.close()


def test_k_beyond_the_rows_and_one_client_alone() -> None:
    from kalos_retrievers.sidecar.carousel import drive

    rig = Rig("cosine", 96, 11, n_slots=1)
    try:
        qs = _queries(rig.rng, 20, 96)
        requests = [(qs[j], 32 if j % 2 else 11, NS_ANY) for j in range(20)]
        answers = drive(rig.slots, lambda j: requests[j] if j < 20 else None)
        rig.check(answers, requests)
    finally:
        rig.close()


def test_namespaces_give_the_true_top_k_among_their_rows() -> None:
    from kalos_retrievers.sidecar.carousel import drive

    rng = np.random.default_rng()
    rows = 30011
    ns = rng.integers(0, 3, rows).astype(np.int32)
    perm = rng.permutation(rows)
    ns[perm[:25]] = 7  # a namespace with fewer rows than k
    ns[perm[25:525]] = -1  # deleted rows: in no namespace
    rig = Rig("ip", 129, rows, ns=ns)
    try:
        qs = _queries(rig.rng, 160, 129)
        names = (1, NS_ANY, 7, 5, 0)  # 5: no row at all
        requests = [(qs[j], (10, 32, 32, 4, 1)[j % 5], names[j % 5]) for j in range(160)]
        answers = drive(rig.slots, lambda j: requests[j] if j < 160 else None)
        rig.check(answers, requests)
        # (NS_ANY takes deleted rows too: the sidecar passes NS_ANY only when its namespace
        # covers every row without holes, as for the other kernels)
        assert {a.n for a in answers if requests[a.j][2] == 5} == {0}
        assert {a.n for a in answers if requests[a.j][2] == 7} == {25}
    finally:
        rig.close()


def test_refused_requests_and_the_carousel_serves_on() -> None:
    from kalos_retrievers.sidecar.carousel import DONE, ERROR, drive

    rig = Rig("cosine", 64, 4099)
    try:
        qs = _queries(rig.rng, 30, 64)
        bad = qs[3].copy()
        bad[5] = np.nan
        inf = qs[4].copy()
        inf[0] = np.inf
        requests = [(qs[j], 10, NS_ANY) for j in range(30)]
        requests[1] = (qs[1], 0, NS_ANY)
        requests[2] = (qs[2], 33, NS_ANY)
        requests[3] = (bad, 10, NS_ANY)
        requests[4] = (inf, 10, NS_ANY)
        requests[5] = (qs[5], 10, 3)  # a namespace, and the launch has no namespace array
        big = qs[6] * 1e6  # cosine: normalized before it is rounded to float16, so it is served
        requests[6] = (big, 10, NS_ANY)
        answers = drive(rig.slots, lambda j: requests[j] if j < 30 else None)
        refused = sorted(a.j for a in answers if a.state == ERROR)
        assert refused == [1, 2, 3, 4, 5]
        assert all(a.n == 0 for a in answers if a.state == ERROR)
        good = [a for a in answers if a.state == DONE]
        assert len(good) == 25
        _answered(rig, 25)  # the refused never took a position
        for a in good:
            want, want_s = rig.reference(*requests[a.j])
            assert_topk_equal(a.rows[: a.n].tolist(), a.scores[: a.n], want, want_s, atol=1e-3, context=str(a.j))
    finally:
        rig.close()


def test_a_stop_returns_and_a_second_launch_serves_exactly() -> None:
    import time

    from kalos_retrievers.sidecar.carousel import DONE, REQUEST, TAKEN, drive

    rig = Rig("l2", 200, 65537, max_blocks=3)  # turns of ~1,000 steps: a stop finds requests aboard
    try:
        qs = _queries(rig.rng, 64, 200)
        first = [(qs[j], 10, NS_ANY) for j in range(32)]
        rig.check(drive(rig.slots, lambda j: first[j] if j < 32 else None), first)
        # a stop with requests aboard: the kernel returns; their slots stay TAKEN (abandoned)
        for i in range(8):
            rig.slots.send(i, qs[i], 10)
        t0 = time.monotonic()
        while (rig.slots.words[:8, 0] == REQUEST).any() and time.monotonic() - t0 < 5:
            pass
        rig.car.stop(timeout=10)
        assert not rig.car.running
        states = rig.slots.words[:8, 0].tolist()
        assert set(states) <= {TAKEN, DONE} and TAKEN in states, states
        rig.slots.words[:8, 0] = 0
        rig.car.start()
        second = [(qs[32 + j], 32, NS_ANY) for j in range(32)]
        rig.check(drive(rig.slots, lambda j: second[j] if j < 32 else None), second)
    finally:
        rig.close()


def test_inner_product_refuses_a_query_float16_cannot_hold() -> None:
    from kalos_retrievers.sidecar.carousel import DONE, ERROR, drive

    rig = Rig("ip", 40, 3001)
    try:
        q = _queries(rig.rng, 2, 40)
        big = q[0].copy()
        big[3] = 70_000.0  # above float16's largest, 65504
        requests = [(big, 5, NS_ANY), (q[1] * 1000, 5, NS_ANY)]
        answers = sorted(drive(rig.slots, lambda j: requests[j] if j < 2 else None), key=lambda a: a.j)
        assert [a.state for a in answers] == [ERROR, DONE]
        want, want_s = rig.reference(*requests[1])
        assert_topk_equal(answers[1].rows[:5].tolist(), answers[1].scores[:5], want, want_s, atol=0.5, context="x1000")
    finally:
        rig.close()

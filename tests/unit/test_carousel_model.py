"""The carousel's algorithm (``carousel_topk`` in kernels/recall.cu), step for step in numpy, with
the blocks advancing in random order: every block boards a query at its own next step, keeps
it one turn over its range, filters by the k-th best its list has held, cuts its list to the
best k when another step might not fit, and hands its best k to the conductor, whose merge is
the answer. Checked against an exact top-k for queries that board at every phase of the
blocks' turns, with k from 1 to KMAX, ties and fewer rows than k.

This checks the design (that a turn begun anywhere covers every row once, that the threshold
never drops a member of the top-k, that a list never overflows its room); what the CUDA code
does is for tests/gpu/test_carousel.py, on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from kalos_retrievers.sidecar import carousel

WARPS = 8  # KALOS_BLOCK / 32
TILE = 32  # rows per warp tile (MT = 2)
STEP_ROWS = WARPS * TILE
CAP = carousel._CAP


def pack(score: float, row: int) -> tuple[float, int]:
    """sel_pack's order as a sort key: larger is better, ties by the smaller row."""
    return (score, -row)


def car_best(src: list[tuple[float, int]], k: int, r: int) -> list[tuple[float, int]]:
    """The kernel's car_best<R>, lane by lane: chunks of 32 x R words, each lane's share held
    with one of the best k so far, then k rounds of "the warp's largest below the last taken".
    Returns the best min(k, len(src)), best first."""
    mine: list = [None] * 32
    for c0 in range(0, len(src), 32 * r):
        lanes = [
            [src[i] for j in range(r) if (i := c0 + lane + 32 * j) < len(src)] + [mine[lane]] for lane in range(32)
        ]
        prev = None
        mine = [None] * 32
        for rnd in range(k):
            cands = [x for lane in lanes for x in lane if x is not None and (prev is None or pack(*x) < pack(*prev))]
            if not cands:
                break
            best = max(cands, key=lambda e: pack(*e))
            mine[rnd] = best
            prev = best
    return [m for m in mine[:k] if m is not None]


class Block:
    def __init__(self, b: int, g: int, nrows: int) -> None:
        tiles = -(-nrows // TILE)
        self.t_lo, self.t_hi = tiles * b // g, tiles * (b + 1) // g
        self.steps = max(1, -(-(self.t_hi - self.t_lo) // WARPS))
        self.step = 0
        self.lists: dict[int, list[tuple[float, int]]] = {}
        self.thr: dict[int, float] = {}
        self.rem: dict[int, int] = {}
        self.gen: dict[int, int] = {}
        self.max_fill = 0

    def rows_of_step(self) -> range:
        lo = (self.t_lo + self.step * WARPS) * TILE
        hi = min(self.t_hi, self.t_lo + (self.step + 1) * WARPS) * TILE
        return range(lo, max(lo, hi))

    def advance(self, conductor: Conductor, scores: np.ndarray, nrows: int) -> None:
        for p, g in conductor.gen.items():  # boarding
            if self.rem.get(p, 0) == 0 and self.gen.get(p, 0) != g:
                self.gen[p], self.rem[p], self.lists[p], self.thr[p] = g, self.steps, [], -np.inf
        act = [p for p, r in self.rem.items() if r > 0]
        if not act:
            return  # idle: the turn starts wherever the next boarding finds it
        for row in self.rows_of_step():
            if row >= nrows:
                continue
            for p in act:
                s = scores[conductor.query[p], row]
                if s >= self.thr[p]:
                    self.lists[p].append((s, row))
        for p in act:
            self.max_fill = max(self.max_fill, len(self.lists[p]))
            assert len(self.lists[p]) <= CAP, "a list overflowed its room"
            self.rem[p] -= 1
            k = conductor.k[p]
            if self.rem[p] == 0 or len(self.lists[p]) > CAP - STEP_ROWS:
                best = car_best(self.lists[p], k, CAP // 32)
                if self.rem[p] == 0:
                    conductor.res[p].append(best)
                else:
                    self.lists[p] = best
                    if len(best) == k:
                        self.thr[p] = best[-1][0]
        self.step = 0 if self.step + 1 == self.steps else self.step + 1


class Conductor:
    def __init__(self) -> None:
        self.gen: dict[int, int] = {}
        self.query: dict[int, int] = {}
        self.k: dict[int, int] = {}
        self.res: dict[int, list] = {}
        self.answers: dict[int, list[tuple[float, int]]] = {}

    def board(self, p: int, j: int, k: int) -> None:
        self.gen[p] = self.gen.get(p, 0) + 1
        self.query[p], self.k[p], self.res[p] = j, k, []

    def collect(self, g: int) -> list[int]:
        freed = []
        for p, lists in self.res.items():
            if len(lists) == g and p in self.query:
                # car_answer: each of 8 warps its share, chunks of 32 x 16, then one warp the 8 x 32
                words = [e for lst in lists for e in lst]
                per = -(-len(words) // 8)
                shares = [car_best(words[w * per : (w + 1) * per], self.k[p], 16) for w in range(8)]
                self.answers[self.query.pop(p)] = car_best([e for sh in shares for e in sh], self.k[p], 8)
                freed.append(p)
        return freed


@pytest.mark.parametrize(("nrows", "g", "ties"), [(5003, 7, False), (37, 5, False), (2048, 3, True), (9, 4, False)])
def test_queries_boarding_at_any_phase_get_the_exact_top_k(nrows: int, g: int, ties: bool) -> None:
    rng = np.random.default_rng()
    nq = 60
    scores = rng.standard_normal((nq, nrows))
    if ties:
        scores = np.round(scores, 1)  # many rows share each score
    ks = [int(x) for x in rng.integers(1, carousel.KMAX + 1, nq)]
    blocks = [Block(b, g, nrows) for b in range(g)]
    cond = Conductor()
    free = list(range(carousel.POSITIONS))
    pending = list(range(nq))
    for _ in range(100_000):
        if not pending and not cond.query:
            break
        if pending and free and rng.random() < 0.3:  # a request arrives between the blocks' steps
            cond.board(free.pop(0), (j := pending.pop(0)), ks[j])
        blocks[int(rng.integers(g))].advance(cond, scores, nrows)  # one block moves on a step
        free += cond.collect(g)
    assert len(cond.answers) == nq
    for j, got in cond.answers.items():
        k = min(ks[j], nrows)
        want = np.sort(scores[j])[::-1][:k]
        assert [s for s, _ in got] == list(want), j  # the k best scores, in order
        assert len({r for _, r in got}) == k
        assert all(scores[j, r] == s for s, r in got)
    assert max(b.max_fill for b in blocks) <= CAP


def test_the_model_fails_a_turn_one_step_short() -> None:
    """The negative control: a turn of one step fewer misses rows, and the check above sees it."""
    rng = np.random.default_rng(3)
    nrows, g = 4001, 3
    scores = rng.standard_normal((5, nrows))
    blocks = [Block(b, g, nrows) for b in range(g)]
    for b in blocks:
        b.steps -= 1
    cond = Conductor()
    for j in range(5):
        cond.board(j, j, 10)
    for _ in range(1000):
        blocks[int(rng.integers(g))].advance(cond, scores, nrows)
        cond.collect(g)
    wrong = [j for j, got in cond.answers.items() if [s for s, _ in got] != list(np.sort(scores[j])[::-1][:10])]
    assert len(cond.answers) == 5 and wrong


@pytest.mark.parametrize("r", [1, 8, 16, 17])
def test_car_best_takes_the_best_k_across_chunks(r: int) -> None:
    rng = np.random.default_rng()
    for n in (0, 1, 31, 32 * r, 32 * r + 1, 3 * 32 * r + 7):
        words = [(float(s), i) for i, s in enumerate(np.round(rng.standard_normal(n), 1))]  # ties
        for k in (1, 10, 32):
            want = sorted(words, key=lambda e: pack(*e), reverse=True)[:k]
            assert car_best(words, k, r) == want, (n, k)

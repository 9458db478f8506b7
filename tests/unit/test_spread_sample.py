"""The threshold top-k's sample of rows (kernels/recall.cu, ``spread_start``): where its runs
of 32 rows lie. The lines between ``// spread: begin`` and ``// spread: end`` are compiled by
nvcc as host code (they are ``__host__ __device__``: the kernels run the same text) into a
program that prints the row of every sample index; the checks are on those rows. Skipped
where nvcc is not installed (`.ci/run` compiles the kernels with it where it is). What the GPU
does with the rows (the sample's dump by ``mma_filter<NT, M, true>``, ``tau_scores``' table of
them) the GPU tests check."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from kalos_retrievers.sidecar import cuda_kernels

pytestmark = pytest.mark.timeout(120)

RUN = 32
# (S, n): S a power of two from 32 up (the host's samples are at least 1,024 rows or every row)
CASES = [(32, 33), (64, 127), (1024, 1025), (1024, 2047), (1024, 2048), (1024, 60_014), (4096, 1_005_000),
         (2048, 1_000_000), (16384, 16385), (16384, 1_000_003), (16384, 2**31 - 1), (1024, 2**31 - 1),
         (1024, 1000), (4096, 4096),
         (8192, 3_121_481), (16384, 2_473_397)]  # fmt: skip  (the last two: where a multiplicative hash skewed)

PROGRAM = r"""
#include <cstdio>
%s
int main() {
    int S, n;
    while (std::scanf("%%d %%d", &S, &n) == 2) {
        std::printf("%%d %%d %%d", S, n, (int)spread(S, n));
        for (int i = 0; i < S; i++) std::printf(" %%d", spread_row(i, S, n));
        std::printf("\n");
    }
}
"""


def spread_source() -> str:
    src = cuda_kernels.packaged_source()
    start, end = src.index("// spread: begin"), src.index("// spread: end")
    return src[start:end]


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], tuple[bool, list[int]]]:
    """Each case's (spread, the rows the sample indices 0, 32, 64, ... map to: its runs'
    first rows), having checked that every index maps to its run's first row plus its place
    in the run."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    d = tmp_path_factory.mktemp("spread")
    (d / "spread.cu").write_text(PROGRAM % spread_source())
    subprocess.run([nvcc, "-x", "cu", "-O1", "-o", str(d / "spread"), str(d / "spread.cu")], check=True,
                   capture_output=True, timeout=100)  # fmt: skip
    out = subprocess.run([str(d / "spread")], input="\n".join(f"{s} {n}" for s, n in CASES), check=True,
                         capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    got = {}
    for line in out.splitlines():
        s, n, on, *rows = map(int, line.split())
        assert len(rows) == s and all(rows[i] == rows[i - i % RUN] + i % RUN for i in range(s)), (s, n)
        got[s, n] = (bool(on), rows[::RUN])
    assert sorted(got) == sorted(CASES)
    return got


def strata(s: int, n: int) -> list[tuple[int, int]]:
    runs, chunks = s // RUN, n // RUN
    return [(RUN * (j * chunks // runs), RUN * ((j + 1) * chunks // runs)) for j in range(runs)]


def test_the_source_between_the_markers_is_what_the_kernels_call() -> None:
    src = cuda_kernels.packaged_source()
    body = spread_source()
    assert "spread_start(int j, int S, int n)" in body and "#define SPREAD_RUN" in body
    # (host code too: nothing of a kernel's between the markers)
    assert "__host__ __device__" in body and "threadIdx" not in body and "__shared__" not in body
    assert "spread_row(r0, nrows, n_all)" in src and "s_start[j] = spread_start(j, S, n)" in src


def test_each_run_is_whole_below_n_in_its_own_stratum(starts: dict) -> None:
    for (s, n), (on, rows) in starts.items():
        if s >= n:
            assert not on and rows == list(range(0, s, RUN)), (s, n)  # every row: the sample is rows 0..S-1
            continue
        assert on, (s, n)
        assert len(rows) == s // RUN
        for j, (row, (lo, hi)) in enumerate(zip(rows, strata(s, n), strict=True)):
            assert row % RUN == 0 and lo <= row < hi and row + RUN <= n, (s, n, j, row, lo, hi)
        # the strata tile the whole chunks: the last run's stratum ends at the last whole one
        assert strata(s, n)[0][0] == 0 and strata(s, n)[-1][1] == RUN * (n // RUN)


def test_a_namespace_written_after_another_meets_the_sample_in_its_share(starts: dict) -> None:
    """The case that sent batches to the exact path with the first S rows as the sample: the
    second half of the rows (and the last 8th) gets about its share of the runs."""
    for (s, n), (on, rows) in starts.items():
        if not on or s < 1024:
            continue
        runs = len(rows)
        for first in (n // 2, n - n // 8):
            share = sum(r >= first for r in rows) / runs
            assert abs(share - (n - first) / n) <= 2 / runs + 1e-9, (s, n, first, share)


def test_two_namespaces_written_in_turn_both_meet_the_sample(starts: dict) -> None:
    """Rows written in turn by two namespaces in blocks of 32 to 256 rows: evenly spaced runs
    (0c29a1d, the first spread) all fell in one of them where the spacing was a multiple of
    twice the block (every batch of the other then overflowed; the negative control below);
    the hashed places give each about half, as fair coins would (within 4 sd)."""
    for (s, n), (on, rows) in starts.items():
        if not on or s < 1024:
            continue
        for block in (32, 64, 128, 256, 1024):
            if n // len(rows) < 2 * block:  # (a stratum must hold both namespaces' rows)
                continue
            share = sum((r // block) % 2 for r in rows) / len(rows)
            assert abs(share - 0.5) <= 4 * (0.25 / len(rows)) ** 0.5, (s, n, block, share)  # 4 sd of a fair coin


def test_evenly_spaced_runs_or_a_multiplicative_hash_would_fail_the_turns_check() -> None:
    """The negative controls: 0c29a1d's runs (run j at 32 * (n // S) * j) give one namespace
    none of them at 1M rows in blocks of 64; d3160aa's offsets, Knuth's multiplicative hash of
    j in the strata, gave one 7 of 256 runs at 3,121,481 rows in blocks of 1,024 (reviews)."""
    s, n = 4096, 1_000_000
    rows = [RUN * (n // s) * j for j in range(s // RUN)]
    assert sum((r // 64) % 2 for r in rows) == 0
    s, n = 8192, 3_121_481
    knuth = lambda j: (j * 2654435761) % 2**32 >> 7  # noqa: E731
    rows = [RUN * (lo // RUN + knuth(j) % ((hi - lo) // RUN)) for j, (lo, hi) in enumerate(strata(s, n))]
    share = sum((r // 1024) % 2 for r in rows) / len(rows)
    assert abs(share - 0.5) > 4 * (0.25 / len(rows)) ** 0.5, share

"""benchmarks/carousel_probe.py's ``--profile`` summary (``_profile``): from car_prof's rows (the
kernel's CP_* columns for the scanning blocks, CC_* for the conductor, block 0) it finds a
convoy of merges, the slowest block and its SM, and the conductor's costs (docs/gpu-notes.md,
session 36: the convoy it found). The column order is the kernel's enums'."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def _probe():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("carousel_probe", ROOT / "benchmarks" / "carousel_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _enum(source: str, first: str) -> list[str]:
    body = re.search(r"enum \{ (" + first + r"[^}]*)\}", source).group(1)
    return [name.strip() for name in body.split(",") if name.strip()]


def test_the_columns_are_the_kernels() -> None:
    src = (ROOT / "kernels" / "recall.cu").read_text()
    probe = _probe()
    assert [n.lower() for n in _enum(src, "CP_STEPS")] == ["cp_" + c.replace("_", "") for c in probe._CP]
    assert [n.lower() for n in _enum(src, "CC_ROUNDS")] == ["cc_" + c.replace("_", "") for c in probe._CC]
    assert int(re.search(r"#define CAR_PROF_W (\d+)", src).group(1)) >= max(len(probe._CP), len(probe._CC))


def test_a_convoy_the_slowest_block_and_the_conductor() -> None:
    probe = _probe()
    cp, cc = {c: i for i, c in enumerate(probe._CP)}, {c: i for i, c in enumerate(probe._CC)}
    khz = 2_000_000  # 2 GHz: 2,000 cycles a µs
    p = np.zeros((7, 16), np.uint64)  # the conductor and 6 scanning blocks
    for b in range(1, 7):
        p[b, cp["steps"]] = 100
        p[b, cp["scan"]] = 100 * 40_000  # 20 µs a step
        p[b, cp["smid"]] = b % 3
        p[b, cp["tiles"]] = 119
    p[4, cp["merge"]], p[2, cp["merge"]] = 97 * 16_000, 2 * 16_000  # block 4 merges 97 of 99 answers, 8 µs each
    p[4, cp["n_merge"]], p[2, cp["n_merge"]] = 97, 2
    p[0, cc["rounds"]], p[0, cc["poll"]] = 10, 10 * 6_000  # 3 µs a round
    p[0, cc["n_merge"]], p[0, cc["merge"]], p[0, cc["select"]] = 5, 5 * 14_000, 5 * 10_000
    p[0, cp["smid"]] = 1  # the conductor's SM (its row's CP_SMID column)
    got = probe._profile(p, khz)
    assert got["merges"] == 99 and got["blocks_merging"] == 2
    assert got["top_mergers"][0] == [4, 97]
    assert got["slowest"][0][:3] == [4, 1, pytest.approx(20 + 97 * 8 / 100, abs=0.01)]
    assert got["us_per_step"]["scan"] == pytest.approx(20.0) and got["us_per_merge"] == pytest.approx(8.0)
    assert sum(got["share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert [b[0] for b in got["conductor_neighbours"]] == [1, 4]  # blocks 1 and 4 share SM 1
    c = got["conductor"]
    assert c["poll_us"] == pytest.approx(3.0) and c["us_per_merge"] == pytest.approx(7.0)
    assert c["us_per_select"] == pytest.approx(5.0) and c["merges"] == 5

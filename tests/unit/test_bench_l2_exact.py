"""benchmarks/l2_exact.py runs and prints one row per case, each with both timings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "l2_exact.py"


def test_each_case_is_timed_both_ways() -> None:
    out = subprocess.run([sys.executable, "-P", str(SCRIPT), "--rows", "3001", "--dim", "17", "--calls", "1"],
                         capture_output=True, text=True, timeout=100)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^\| ([^|]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)
    assert [r[0] for r in rows] == ["unit rows", "one row of norm 1,000", "the same, a batch of 16",
                                    "every row offset by 30"], out.stdout  # fmt: skip
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)

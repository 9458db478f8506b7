"""benchmarks/metadata_keys.py runs and reports the columns a deleted key left (none) and
set()'s two timings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "metadata_keys.py"


def test_no_column_is_left_and_set_is_timed() -> None:
    out = subprocess.run([sys.executable, "-P", str(SCRIPT), "--rows", "3001", "--keys", "17", "--set-rows", "2001"],
                         capture_output=True, text=True, timeout=100)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "17 keys written once and deleted at 3,001 rows' capacity: 0 columns left, 0.0 MB" in out.stdout
    m = re.search(r"set\(\) of 2,001 rows x 3 keys: new ([\d.]+) s, overwritten ([\d.]+) s", out.stdout)
    assert m is not None and float(m[1]) > 0 and float(m[2]) > 0, out.stdout

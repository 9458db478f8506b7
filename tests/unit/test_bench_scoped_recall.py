"""benchmarks/scoped_recall.py times every scoped case through a real (CPU) sidecar, one query a
call or ``--batch`` queries through ``recall_batch``; before timing, the script asserts each
case's answers are in scope (k hits, the namespace's rows, the filter's values), so a run that
printed its table answered them. Negative control: a ``--batch`` out of range is refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scoped_recall.py"
CASES = {"default", "namespace", "namespace+filter", "filter", "namespace+1% filter", "small namespace"}


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", str(SCRIPT), "--rows", "2003", "--dim", "19", "--calls", "7",
                           "--rounds", "1", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=100)  # fmt: skip


@pytest.mark.parametrize("batch", [1, 11])
def test_every_case_is_timed_one_query_or_a_batch_a_call(tmp_path: Path, batch: int) -> None:
    out = _run(tmp_path, "--batch", str(batch))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {name: (float(p50), float(p99)) for name, p50, p99 in
                re.findall(r"^\| ([^|]+?) \| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)}  # fmt: skip
    assert set(rows) == CASES and all(0 < p50 <= p99 for p50, p99 in rows.values()), out.stdout
    assert ("recall_batch of 11" in out.stdout) == (batch == 11), out.stdout
    saved = json.loads((tmp_path / "scoped_recall.json").read_text())
    assert saved["batch"] == batch and set(saved["rounds"]) == CASES


@pytest.mark.parametrize("batch", ["0", "1025"])
def test_a_batch_out_of_range_is_refused(tmp_path: Path, batch: str) -> None:
    out = _run(tmp_path, "--batch", batch)
    assert out.returncode == 2 and "--batch 1 to 1024" in out.stderr and "| " not in out.stdout

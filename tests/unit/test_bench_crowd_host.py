"""benchmarks/crowd_host.py runs (a few rounds) and prints both passes' figures: the host's time
per recall on the carousel's lane, the one part of the crowd's path a machine without a GPU can
time (docs/benchmarks.md, session 35)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from kalos_retrievers.sidecar import dispatcher

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(dispatcher._hotpath is None, reason="sidecar/_hotpath.c is not built"),
]
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "crowd_host.py"


@pytest.mark.parametrize("inline", [False, True])
def test_crowd_host_times_both_passes(inline: bool) -> None:
    cmd = [sys.executable, "-P", str(SCRIPT), "--slots", "7", "--rounds", "20", "--k", "13"]
    out = subprocess.run(cmd + (["--inline"] if inline else []), capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"7 recalls a pass, k 13, .* pickup \+ board p50 ([\d.]+) µs, "
                  r"harvest \+ answer \+ post p50 ([\d.]+) µs", out.stdout)  # fmt: skip
    assert m is not None, out.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0

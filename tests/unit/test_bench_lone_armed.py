"""benchmarks/lone_armed.py runs (a few blocks) and prints both sides' figures: what an armed,
stopped carousel costs a lone recall on the batched path (docs/benchmarks.md, session 41). Its
index refuses to start the carousel and the run then fails, so a run that printed is one where a
lone client never did; the negative control makes the lone client a crowd (``--crowd-min 1``)."""

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
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lone_armed.py"


@pytest.mark.parametrize("gone", [0, 9])
def test_lone_armed_times_both_sides(gone: int) -> None:
    cmd = [sys.executable, "-P", str(SCRIPT), "--calls", "1200", "--rows", "23", "--k", "7", "--gone", str(gone)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(rf"one client \({gone} gone\), 23 rows x 768, k 7, .* 800 calls: per recall p50 off ([\d.]+) µs, "
                  r"armed ([\d.]+) µs; armed - off [-+][\d.]+ ± [\d.]+ µs \(2 block pairs\)", out.stdout)  # fmt: skip
    assert m is not None, out.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0


def test_a_run_where_the_lone_client_started_the_carousel_prints_no_figures() -> None:
    cmd = [sys.executable, "-P", str(SCRIPT), "--calls", "1200", "--rows", "23", "--crowd-min", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert out.returncode != 0 and "armed - off" not in out.stdout
    assert "a lone client started the carousel" in out.stderr

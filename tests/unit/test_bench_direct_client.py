"""benchmarks/direct_client.py runs (a few calls, odd sizes) and prints the client's own time per
direct recall (docs/benchmarks.md, session 37); its assertion that every call came back with the
kernel's rows checks the direct path end to end on the way."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "direct_client.py"


def test_direct_client_times_the_clients_part() -> None:
    cmd = [sys.executable, "-P", str(SCRIPT), "--dim", "97", "--k", "13", "--calls", "60"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"direct recall, 97-d, k 13: the client's own time per call p50 ([\d.]+) µs", out.stdout)
    assert m is not None, out.stdout
    assert float(m.group(1)) > 0

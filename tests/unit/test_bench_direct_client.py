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


@pytest.mark.parametrize("path", ["C", "Python"])
def test_direct_client_times_the_clients_part(path: str) -> None:
    if path == "C":
        pytest.importorskip("kalos_retrievers._fastpath", reason="the C extension is not built here")
    cmd = [sys.executable, "-P", str(SCRIPT), "--dim", "97", "--k", "13", "--calls", "60"]
    out = subprocess.run(cmd + (["--no-c"] if path == "Python" else []), capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(rf"direct recall \({path} path\), 97-d, k 13: the client's own time per call p50 ([\d.]+) µs",
                  out.stdout)  # fmt: skip
    assert m is not None, out.stdout
    assert float(m.group(1)) > 0

"""benchmarks/client_overhead.py --bell runs and prints its figures: the client's Python around
the one C call of the resident kernel's path (docs/gpu-notes.md, session 42). The run checks
that the timed recalls took that path (``recall1`` called), so a run that printed is one that
did; the negative control asks for k 33, which no resident kernel takes (it answers k <= 32):
the recall goes the usual way and the run fails instead of timing the wrong path."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kalos_retrievers import client

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(client._fastpath is None or not client._X86, reason="the client's C extension is not built"),
]
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "client_overhead.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", str(SCRIPT), "--bell", "--calls", "300", *args],
                          capture_output=True, text=True, timeout=100)  # fmt: skip


def test_the_resident_kernels_path_is_timed() -> None:
    out = _run("--k", "7")
    assert out.returncode == 0, out.stderr[-2000:]
    figures = re.findall(r"^(recall \(numpy query\)|recall \(list query\)|recall \+ read every hit's text): "
                         r"p50 ([\d.]+) us$", out.stdout, re.M)  # fmt: skip
    assert len(figures) == 3 and all(float(v) > 0 for _, v in figures), out.stdout


def test_a_k_the_resident_kernel_does_not_take_fails_the_run() -> None:
    out = _run("--k", "33")
    assert out.returncode != 0 and "p50" not in out.stdout
    assert "not on the resident kernel's path" in out.stderr, out.stderr[-2000:]


def test_bell_is_batch_1_only() -> None:
    out = _run("--batch", "3")
    assert out.returncode == 2 and "--bell times batch 1" in out.stderr

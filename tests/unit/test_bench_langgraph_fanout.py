"""benchmarks/langgraph_fanout.py runs and prints its figures (docs/benchmarks.md, session 63);
a run whose query search comes back unscored fails instead of timing the fallback (control: an
embedding of zeros, whose texts get no vector rows)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langgraph")
pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "langgraph_fanout.py"


def test_langgraph_fanout_times_both_searches() -> None:
    cmd = [sys.executable, "-P", str(SCRIPT), "--namespaces", "13,3", "--dim", "17", "--repeat", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^\s+(\d+)\s+(query|no query)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M)
    assert [(n, label) for n, label, *_ in rows] == [(n, label) for n in ("13", "3") for label in ("query", "no query")]
    assert all(float(best) > 0 and float(med) >= float(best) for _, _, best, med, _ in rows)


def test_a_query_search_that_finds_no_vectors_fails_the_run(tmp_path: Path) -> None:
    shim = tmp_path / "sitecustomize.py"  # (every text embeds to zeros: no vector rows, items unscored)
    shim.write_text("from kalos_retrievers.embeddings import HashingEmbeddings as H\n"
                    "H.embed_documents = lambda self, texts: [[0.0] * self.dim for _ in texts]\n")  # fmt: skip
    cmd = [sys.executable, "-P", str(SCRIPT), "--namespaces", "11", "--dim", "17", "--repeat", "1"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode == 1 and "some unscored" in out.stderr, (out.stdout, out.stderr[-2000:])

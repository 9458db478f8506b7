"""benchmarks/load_path.py runs and prints µs per row for the write path and the start-up
reload (docs/benchmarks.md, session 44); its child asserts the reload found every row, so a run
that printed reloaded them all. Negative control: a --root that is not a source tree fails the
run instead of timing this checkout twice."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "load_path.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", str(SCRIPT), "--rows", "2049", "--dim", "17", "--rounds", "1", *args],
                          capture_output=True, text=True, timeout=100, env={"KALOS_BENCH_DIR": str(tmp_path),
                          "PATH": "/usr/bin:/bin"})  # fmt: skip


def test_each_part_is_timed(tmp_path: Path) -> None:
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = re.findall(r"^\| (\S+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)
    assert Path(row[0]) == SCRIPT.parents[1] and all(float(v) > 0 for v in row[1:]), out.stdout
    assert not list(tmp_path.iterdir())  # the stores went with their runs


def test_a_root_that_is_not_a_source_tree_fails_the_run(tmp_path: Path) -> None:
    out = _run(tmp_path, "--root", str(tmp_path))
    assert out.returncode != 0 and "| " not in out.stdout


def test_profile_names_the_costliest_functions_of_each_part(tmp_path: Path) -> None:
    out = _run(tmp_path, "--profile", "5")
    assert out.returncode == 0, out.stderr[-2000:]
    for part in ("memory", "durable", "reload"):
        block = out.stdout.split(f"== {part}: ", 1)[1]
        assert re.match(r"[\d.]+ us per row under cProfile", block), block[:200]
        assert "tottime" in block.split("== ", 1)[0]
    assert "service.py" in out.stdout  # the service's own functions are in the profile


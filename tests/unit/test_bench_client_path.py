"""``bench.throughput(client_path=...)``: the client processes import the client library found
in that directory, not this process's (so ``ab_sidecars.py --client-a/--client-b`` compares two
client libraries against one sidecar); and a client process that dies fails the run at once.

A stand-in package in a temporary directory has a ``_throughput_worker`` that reports a
recognisable number of "recalls" without any sidecar: the real worker would fail to connect to
the made-up sidecar name instead."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest
from kalos_retrievers.sidecar.bench import throughput

pytestmark = pytest.mark.timeout(120)


def stand_in(root: Path, body: str) -> Path:
    pkg = root / "kalos_retrievers"
    (pkg / "sidecar").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client.py").write_text("")
    (pkg / "sidecar" / "__init__.py").write_text("")
    worker = "def _throughput_worker(name, dim, k, seed, duration, start_at, out, arena_docs=None):\n"
    head = "import os\nimport numpy as np\n\n"
    (pkg / "sidecar" / "bench.py").write_text(head + worker + textwrap.indent(body, "    "))
    return root


def test_the_workers_import_the_client_library_of_client_path(tmp_path: Path) -> None:
    # 11 "recalls" of 5 µs each, and where the library came from, as the real worker reports
    root = stand_in(tmp_path, "out.put((np.full(11, 5.0), None, os.path.dirname(os.path.dirname(__file__))))\n")
    path_before = list(sys.path)
    res = throughput("kalos-no-such-sidecar-7f3", 3, 1, 3, 0.5, client_path=str(root))
    assert res["recalls_per_s"] == 3 * 11 / 0.5 and res["p50_us"] == 5.0
    assert res["client_package"] == str((tmp_path / "kalos_retrievers").resolve())
    assert "client_cpu_us_per_recall" not in res  # the stand-in reports no schedstat
    assert sys.path == path_before  # the directory was only on the path while they started


def test_an_older_worker_that_reports_no_package_is_still_counted(tmp_path: Path) -> None:
    res = throughput("kalos-no-such-sidecar-7f3", 3, 1, 2, 0.5,
                     client_path=str(stand_in(tmp_path, "out.put((np.full(4, 2.0), None))\n")))  # fmt: skip
    assert res["recalls_per_s"] == 2 * 4 / 0.5 and "client_package" not in res


def test_a_client_process_that_dies_fails_the_run_at_once(tmp_path: Path) -> None:
    """(Without the check, the run waited for the queue until its timeout: two minutes here.)"""
    root = stand_in(tmp_path, "raise SystemExit(3)\n")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited with \[3\] before reporting"):
        throughput("kalos-no-such-sidecar-7f3", 3, 1, 2, 0.5, client_path=str(root))
    assert time.monotonic() - t0 < 30


def test_a_client_path_without_the_library_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no installed kalos_retrievers"):
        throughput("kalos-no-such-sidecar-7f3", 3, 1, 2, 0.5, client_path=str(tmp_path))

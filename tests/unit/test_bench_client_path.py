"""``bench.throughput(client_path=...)``: the client processes import the client library found
in that directory, not this process's (so ``ab_sidecars.py --client-a/--client-b`` compares two
client libraries against one sidecar).

A stand-in package in a temporary directory has a ``_throughput_worker`` that reports a
recognisable number of "recalls" without any sidecar: the real worker would fail to connect to
the made-up sidecar name instead."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from kalos_retrievers.sidecar.bench import throughput

pytestmark = pytest.mark.timeout(120)


def stand_in(root: Path, n: int) -> Path:
    pkg = root / "kalos_retrievers"
    (pkg / "sidecar").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client.py").write_text("")
    (pkg / "sidecar" / "__init__.py").write_text("")
    (pkg / "sidecar" / "bench.py").write_text(
        textwrap.dedent(f"""
        import numpy as np

        def _throughput_worker(name, dim, k, seed, duration, start_at, out, arena_docs=None):
            out.put((np.full({n}, 5.0), None))  # {n} "recalls" of 5 µs
    """)
    )
    return root


def test_the_workers_import_the_client_library_of_client_path(tmp_path: Path) -> None:
    path_before = list(sys.path)
    res = throughput("kalos-no-such-sidecar-7f3", 3, 1, 3, 0.5, client_path=str(stand_in(tmp_path, 11)))
    assert res["recalls_per_s"] == 3 * 11 / 0.5 and res["p50_us"] == 5.0
    assert "client_cpu_us_per_recall" not in res  # the stand-in reports no schedstat
    assert sys.path == path_before  # the directory was only on the path while they started


def test_a_client_path_without_the_library_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no installed kalos_retrievers"):
        throughput("kalos-no-such-sidecar-7f3", 3, 1, 2, 0.5, client_path=str(tmp_path))

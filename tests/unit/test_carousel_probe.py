"""``benchmarks/carousel_probe.py`` on the CPU, before it costs device time: NumPy stands in for
CuPy and a thread that answers exactly stands in for the kernel. The probe must run its plan
(each return time, then one client alone), report every run, and count as mismatches the
answers that are wrong (the control: a kernel that returns a wrong row now and then fails the
probe). What the kernel itself computes and how fast is for the GPU."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import carousel
from kalos_retrievers.sidecar.carousel import DONE, REQUEST, TAKEN

pytestmark = pytest.mark.timeout(120)

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "carousel_probe.py"


class _Event:
    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _device_work(fn: Any) -> Any:
    """NumPy's ``fn`` as a CuPy call that launches kernels: refused while a carousel runs, as
    on the GPU, where it would never start (the carousel's blocks hold every SM)."""

    def call(*args: Any, **kw: Any) -> Any:
        if ThreadCarousel.running:
            raise RuntimeError("device work launched while the carousel holds every SM: it would hang on a GPU")
        return fn(*args, **kw)

    return call


def _numpy_cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    for name in ("float16", "float32", "empty_like", "linalg", "random"):
        setattr(cp, name, getattr(np, name))
    for name in ("zeros", "asarray", "argsort"):
        setattr(cp, name, _device_work(getattr(np, name)))
    cp.asnumpy = _device_work(np.asarray)  # type: ignore[attr-defined]
    cp.cuda = SimpleNamespace(  # type: ignore[attr-defined]
        Device=lambda: SimpleNamespace(synchronize=lambda: None),
        Event=_Event,
        get_elapsed_time=lambda a, b: 0.5,
        runtime=SimpleNamespace(hostRegister=lambda *a: None, hostUnregister=lambda *a: None),
    )
    return cp


class ThreadCarousel:
    """Answers the slots as the kernel would (cosine over the float16 rows, the query normalized
    and rounded to float16), from a thread; ``wrong`` answers every that-many-th request with
    its best row replaced."""

    wrong = 0
    running = False  # (class-wide: what _device_work checks)

    def __init__(self, cp: Any, data: np.ndarray, dim: int, metric: int, slots: Any, **kw: Any) -> None:
        self.rows32 = data[:, :dim].astype(np.float32)
        self.slots, self.grid = slots, 5
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.count = 0

    def start(self) -> None:
        ThreadCarousel.running = True
        self._t.start()

    def _run(self) -> None:
        s = self.slots
        while not self._stop.is_set():
            for i in np.flatnonzero(s.words[:, 0] == REQUEST):
                w = s.words[i]
                w[0] = TAKEN
                k = int(w[1])
                q = s.queries[i].astype(np.float64)
                q16 = (q / np.linalg.norm(q)).astype(np.float16).astype(np.float32)
                sc = self.rows32 @ q16
                top = np.argsort(-sc, kind="stable")[:k]
                self.count += 1
                if self.wrong and self.count % self.wrong == 0:
                    top = top.copy()
                    top[0] = top[-1] + 1 if top[-1] + 1 < len(sc) else 0
                s.rows[i, :k] = top
                s.scores[i, :k] = sc[top]
                w[4], w[5], w[6] = k, w[3], 400_000
                w[0] = DONE
            time.sleep(0.00005)

    def close(self) -> None:
        ThreadCarousel.running = False
        self._stop.set()
        self._t.join()


def _run_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, wrong: int) -> tuple[int, dict]:
    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    monkeypatch.setattr(carousel, "Carousel", ThreadCarousel)
    monkeypatch.setattr(ThreadCarousel, "wrong", wrong)
    spec = importlib.util.spec_from_file_location("carousel_probe", PROBE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["carousel_probe.py", "--rows", "3001", "--dim", "40", "--clients", "5",
                                      "--return-us", "0,150", "--duration", "0.3", "--check", "25",
                                      "--out", str(tmp_path)])  # fmt: skip
    rc = mod.main()
    return rc, json.loads((tmp_path / "carousel_probe.json").read_text())


def test_the_probe_runs_its_plan_and_finds_no_mismatch_in_exact_answers(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:  # fmt: skip
    rc, out = _run_probe(monkeypatch, tmp_path, wrong=0)
    assert rc == 0
    assert [(r["clients"], r["return_us"]) for r in out["runs"]] == [(5, 0.0), (5, 150.0), (1, 0.0)]
    for r in out["runs"]:
        assert r["answers"] > 0 and r["recalls_per_s"] > 0 and r["mismatches"] == 0
        assert r["checked"] == min(25, r["answers"]) and r["aboard_p50_us"] == 400.0
    assert out["rows"] == 3001 and out["grid"] == 5 and out["copy_us"] == 500.0


def test_the_probe_counts_wrong_answers_and_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rc, out = _run_probe(monkeypatch, tmp_path, wrong=7)
    assert rc == 1
    assert sum(r["mismatches"] for r in out["runs"]) >= 3


def test_device_work_during_the_run_is_refused_by_the_stand_in() -> None:
    """The control of the guard above: CuPy work while the stand-in runs raises (the probe's
    references are computed before the launch, which is why the runs above pass)."""
    cp = _numpy_cupy()
    car = ThreadCarousel(cp, np.zeros((4, 8), np.float16), 8, 0, SimpleNamespace(words=np.zeros((1, 8), np.uint32)))
    car.start()
    try:
        with pytest.raises(RuntimeError, match="would hang on a GPU"):
            cp.argsort(np.arange(3))
    finally:
        car.close()
    assert list(cp.argsort(np.arange(3))) == [0, 1, 2]

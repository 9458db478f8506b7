"""``kalos-sidecar`` as an operator uses it: serve, status (readiness probe), stats, stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kalos_retrievers import KalosClient, Sidecar, SidecarUnavailable
from kalos_retrievers.protocol import doorbell_name, segment_name

CLI = [sys.executable, "-P", "-m", "kalos_retrievers.sidecar"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def serve(name: str, *args: str, device: str = "cpu") -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "serve", "--name", name, "--device", device, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def wait_ready(name: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while cli("status", name, "-q").returncode != 0:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)


def shm_objects(name: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if f"kalos-{name}" in p.name]


def test_serve_status_stats_stop(make_name, tmp_path) -> None:
    name = make_name()
    assert cli("status", name).returncode == 1  # not running: non-zero, as a probe needs
    proc = serve(name, "--dim", "5", "--data-dir", str(tmp_path), "--slots", "3")
    try:
        wait_ready(name, proc)
        st = cli("status", name)
        info = json.loads(st.stdout)
        assert st.returncode == 0 and info["status"] == "ready" and info["dim"] == 5 and info["backend"] == "cpu"
        with KalosClient(name) as c:
            c.upsert(["a"], [np.ones(5)], texts=["x"])
        stats = json.loads(cli("stats", name).stdout)
        assert stats["rows"] == 1 and stats["requests"]["upsert/ok"] == 1 and stats["durable"] is True
        prom = cli("stats", name, "--prometheus").stdout
        assert 'kalos_requests_total{op="upsert",status="ok"} 1' in prom and "kalos_rows 1" in prom
        second = cli("serve", "--name", name, "--dim", "5", "--device", "cpu")
        assert second.returncode == 3 and "already running" in second.stderr
        stop = cli("stop", name)
        assert stop.returncode == 0, stop.stderr
        assert proc.wait(15) == 0
        log = proc.stdout.read() if proc.stdout else ""
        for line in ("segment /kalos-" + name, "backend:", "dim=5", "store of record", "ready: sidecar", "stopped"):
            assert line in log, (line, log)
        assert shm_objects(name) == []
        assert cli("status", name).returncode == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_restart_loads_the_store_with_progress_and_sigterm_cleans_up(make_name, tmp_path) -> None:
    name = make_name()
    proc = serve(name, "--dim", "3", "--data-dir", str(tmp_path))
    wait_ready(name, proc)
    with KalosClient(name) as c:
        c.upsert([str(i) for i in range(2500)], np.random.default_rng().standard_normal((2500, 3)))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0 and shm_objects(name) == []
    proc = serve(name, "--dim", "3", "--data-dir", str(tmp_path))
    wait_ready(name, proc)
    with KalosClient(name) as c:
        assert c.count() == 2500
    proc.send_signal(signal.SIGINT)
    assert proc.wait(15) == 0
    log = proc.stdout.read() if proc.stdout else ""
    assert "loading the store: 2500/2500 rows" in log and "loaded 2500 rows" in log
    assert shm_objects(name) == []


def _serve_with_index_limit(name: str, data_dir: Path, rows: int) -> subprocess.Popen[str]:
    """A CPU sidecar whose index refuses to grow past ``rows`` (as a GPU's memory limit does)."""
    patch = (
        "import sys\n"
        "from kalos_retrievers.sidecar import index as _ix\n"
        "_r = _ix.CpuIndex.reserve\n"
        "def _reserve(self, capacity):\n"
        f"    if capacity > {rows}:\n"
        "        raise _ix.IndexCapacityError(f'growing to {capacity} rows is over the test limit')\n"
        "    _r(self, capacity)\n"
        "_ix.CpuIndex.reserve = _reserve\n"
        "from kalos_retrievers.sidecar.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.Popen([sys.executable, "-P", "-c", patch, "serve", "--name", name, "--device", "cpu",
                             "--dim", "3", "--data-dir", str(data_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_a_store_larger_than_the_index_can_hold_fails_the_start_with_code_5(make_name, tmp_path) -> None:
    """The index is sized for the whole store before any row is loaded: a store it cannot hold
    fails the start at once, with exit code 5 and a message that says what to change (not a
    traceback half-way through the load). Control: the same limited index with room starts."""
    name = make_name()
    proc = serve(name, "--dim", "3", "--data-dir", str(tmp_path))
    wait_ready(name, proc)
    with KalosClient(name) as c:
        c.upsert([str(i) for i in range(1500)], np.random.default_rng(3).standard_normal((1500, 3)))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    small = _serve_with_index_limit(name, tmp_path, 1400)
    out = small.communicate(timeout=60)[0]
    assert small.returncode == 5, out
    assert "holds 1500 rows" in out and "over the test limit" in out and "Traceback" not in out, out
    assert shm_objects(name) == []
    roomy = _serve_with_index_limit(name, tmp_path, 1600)
    try:
        wait_ready(name, roomy)
        with KalosClient(name) as c:
            assert c.count() == 1500
    finally:
        roomy.send_signal(signal.SIGTERM)
        roomy.communicate(timeout=30)
    assert roomy.returncode == 0


def test_in_memory_mode_says_so_and_kill_9_leaves_state_the_next_start_clears(make_name) -> None:
    name = make_name()
    proc = serve(name, "--dim", "3")
    wait_ready(name, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    log = proc.stdout.read() if proc.stdout else ""
    assert "running in memory only" in log
    assert f"kalos-{name}" in shm_objects(name) and f"sem.kalos-{name}-bell" in shm_objects(name)
    with pytest.raises(SidecarUnavailable, match="stale"):
        KalosClient(name)
    proc = serve(name, "--dim", "3")
    wait_ready(name, proc)
    proc.terminate()
    assert proc.wait(15) == 0
    assert "removing the stale segment" in (proc.stdout.read() if proc.stdout else "")
    assert shm_objects(name) == []
    assert segment_name(name) and doorbell_name(name)  # names documented in docs/protocol.md


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (["--dim", "0"], 2, "dim=0"),
        (["--dim", "4", "--metric", "euclid"], 2, "invalid choice"),
        (["--dim", "4", "--slots", "0"], 2, "slots=0"),
        (["--dim", "4", "--threads", "0"], 2, "--threads must be in [1, 1024]"),
        (["--dim", "4", "--max-k", "0"], 2, "--max-k 0 must be in [1, 1048576]"),
        (["--dim", "4", "--data-dir", __file__], 2, f"--data-dir {__file__} cannot be used: File exists"),
        (["--dim", "4", "--data-dir", "/proc/kalos-no/such"], 2, "--data-dir /proc/kalos-no/such cannot be used"),
        (["--dim", "4", "--lifeline-fd", "987"], 2, "--lifeline-fd 987: [Errno 9] Bad file descriptor"),
        # an unset variable in a unit's --data-dir "$DATA_DIR": it ran in memory and lost writes
        (["--dim", "4", "--data-dir", ""], 2, "--data-dir is empty"),
        # these crashed after "ready" (nan, inf: leaving the segment) or at the bind (a port)
        (["--dim", "4", "--spin-us", "nan"], 2, "--spin-us nan must be a number of microseconds"),
        (["--dim", "4", "--spin-us", "inf"], 2, "--spin-us inf must be"),
        (["--dim", "4", "--spin-us", "-1"], 2, "--spin-us -1.0 must be"),
        (["--dim", "4", "--metrics-port", "70000"], 2, "--metrics-port 70000 must be in [0, 65535]"),
        (["--dim", "4", "--metrics-port", "-1"], 2, "--metrics-port -1 must be in [0, 65535]"),
        (["--dim", "4", "--device", "cuda:abc"], 2, "--device 'cuda:abc': use auto, cpu, cuda or cuda:N"),
        (["--dim", "4", "--device", "cuda:"], 2, "--device 'cuda:': use"),
        (["--dim", "4", "--device", "cuda:-1"], 2, "--device 'cuda:-1': use"),
        # the geometry's errors name the flags, not the layout's fields ("blob_size must be >= 4096")
        (["--dim", "4", "--blob-kb", "3"], 2, "--blob-kb 3 must be >= 4"),
        (["--dim", "768", "--payload-kb", "2"], 2, "--payload-kb 2 cannot hold one query of --dim 768: give at least"),
    ],
)
def test_bad_flags_exit_2(make_name, args: list[str], code: int, match: str) -> None:
    name = make_name()
    if "--device" not in args:
        args = ["--device", "cpu", *args]
    r = cli("serve", "--name", name, *args)
    assert r.returncode == code and match in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and shm_objects(name) == [], r.stderr


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["status", "bad/name"], "argument name: name='bad/name' is not a valid sidecar name"),
        (["stop", "bad/name"], "is not a valid sidecar name"),
        (["stats", "bad/name"], "is not a valid sidecar name"),
        (["status", "x", "--timeout", "-1"], "argument --timeout: must be a positive number of seconds"),
        (["serve", "--name", "x", "--dim", "4", "--log-level", "BOGUS"], "argument --log-level: 'BOGUS'"),
        (["bench", "--rows", "-5"], "argument --rows: must be >= 1, got -5"),
        (["bench", "--calls", "0"], "argument --calls: must be >= 1"),
        (["bench", "--rows", "100", "--k", "200"], "--k 200 must be at most --rows (100) and 1024"),
        (["bench", "--duration", "0"], "argument --duration: must be a positive number of seconds"),
    ],
)
def test_bad_arguments_of_every_command_exit_2_with_one_line(args: list[str], match: str) -> None:
    r = cli(*args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def serves_then_stops(name: str, env: dict[str, str], device: str) -> None:
    """``serve`` with ``env`` comes up, then exits 0 on SIGTERM."""
    proc = subprocess.Popen([*CLI, "serve", "--name", name, "--dim", "4", "--device", device], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_ready(name, proc)
    finally:
        proc.terminate()
    assert proc.wait(15) == 0


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_an_unknown_carousel_switch_exits_2_naming_it(make_name, device: str) -> None:
    """KALOS_CAROUSEL is read where a GPU backend could be picked (``auto`` too, so a typo is
    caught on the laptop before the GPU host): one line, exit 2, nothing left behind; the
    negative control, the default's value spelled out, starts."""
    name = make_name()
    env = {**os.environ, "KALOS_CAROUSEL": "Direct"}
    r = subprocess.run([*CLI, "serve", "--name", name, "--dim", "4", "--device", device], env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "KALOS_CAROUSEL='Direct': expected 0 (off)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and shm_objects(name) == []
    env["KALOS_CAROUSEL"] = "direct"
    serves_then_stops(name, env, "auto")


def test_bad_gpu_switches_exit_2_naming_each_with_auto_and_are_not_read_on_cpu(make_name) -> None:
    """The GPU index's switches, those read at its import and those a GpuIndex reads when
    made, are checked wherever ``auto`` could pick a GPU, a machine without one included: one
    line naming each, exit 2. (Before: KALOS_GEMM_MIN_Q=x failed with int()'s message naming
    nothing, only the first was said, and KALOS_RESCORE_FACTOR was first read on a GPU.) The
    control: ``--device cpu`` reads none of them and starts."""
    bad = {"KALOS_GEMM_MIN_Q": "x", "KALOS_SIDE_RESERVE": "-1", "KALOS_DOORBELL_MODE": "seven",
           "KALOS_RESCORE_FACTOR": "99", "KALOS_TPR": "3", "KALOS_GPU_MEMORY_LIMIT": "1e9"}  # fmt: skip
    env = {**os.environ, **bad}
    name = make_name()
    r = subprocess.run([*CLI, "serve", "--name", name, "--dim", "4", "--device", "auto"], env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    for key, value in bad.items():
        assert f"{key}={value!r}: expected" in errors[0], (key, r.stderr)
    assert "Traceback" not in r.stderr and shm_objects(name) == []
    serves_then_stops(name, env, "cpu")


def test_a_metrics_port_in_use_exits_2_and_leaves_nothing(make_name) -> None:
    """The port is bound once the name is taken, before the rows load: a port in use is a
    usage error (exit 2, one line), and nothing is left in /dev/shm (it used to fail after
    announcing "ready", with a traceback and exit 1, leaving its segment behind)."""
    import socket

    name = make_name()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = cli("serve", "--name", name, "--device", "cpu", "--dim", "4", "--metrics-port", str(port))
    assert r.returncode == 2, r.stderr
    assert f"--metrics-port {port} on 127.0.0.1: Address already in use" in r.stderr and "Traceback" not in r.stderr
    assert "ready: sidecar" not in r.stderr
    assert not [p for p in os.listdir("/dev/shm") if name in p]


def test_a_second_sidecar_of_a_name_exits_3_on_the_name_not_2_on_its_port(make_name) -> None:
    """Started again with the same unit (same name, same --metrics-port) while the first runs:
    the name is what is refused (exit 3, which a supervisor may retry), not the port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    name = make_name()
    first = serve(name, "--dim", "4", "--metrics-port", port)
    try:
        wait_ready(name, first)
        r = cli("serve", "--name", name, "--device", "cpu", "--dim", "4", "--metrics-port", port)
        assert r.returncode == 3 and "already" in r.stderr, r.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)


@pytest.mark.parametrize(("when", "signals"), [("segment /kalos-", 1), ("segment /kalos-", 2), ("ready: sidecar", 1)],
                         ids=["loading", "loading-twice", "just-ready"])  # fmt: skip
def test_sigterm_while_starting_exits_0_and_leaves_nothing(make_name, tmp_path, when: str, signals: int) -> None:
    """SIGTERM during the store's load (a supervisor's stop, the lifeline's EOF), twice in a
    row, or the moment "ready" is logged: exit 0 and nothing left in /dev/shm (a signal during
    the load used to kill the process, exit -15, with its segment and semaphores left; one
    just after "ready" returned 0 without closing; a second one cut the unwinding short)."""
    name = make_name()
    with KalosClient.spawn(name, dim=64, device="cpu", data_dir=tmp_path) as c:
        data = np.random.default_rng().random((5000, 64), np.float32)
        for i in range(12):
            c.upsert([f"{i}-{j}" for j in range(5000)], data)
    proc = serve(name, "--dim", "64", "--data-dir", str(tmp_path))
    assert proc.stdout is not None
    for line in proc.stdout:
        if when in line:
            break
    for _ in range(signals):
        proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, rest
    assert "stopped while starting" in rest or "received SIGTERM" in rest, rest
    assert not [p for p in os.listdir("/dev/shm") if name in p], rest


def test_stop_reaches_a_sidecar_still_loading(make_name, tmp_path) -> None:
    """``stop`` found the pid through a client, which a sidecar still loading its rows
    refuses: it said "not running", exit 1, and the sidecar went on to serve. It reads the pid
    from the header the sidecar wrote before the load (its lock held). The sidecar is frozen
    (SIGSTOP) between publishing its segment and loading, so the stop finds it mid-start every
    time; SIGCONT lets the pending SIGTERM land. Control: a name nobody holds is "not running".
    The store holds 40,000 rows so that its load lasts ~0.3 s: the SIGSTOP is sent after the
    test reads the log line, and with 50 rows the whole load took ~1.5 ms, a race a busy CI
    machine lost (session 52: the client connected to a sidecar already ready)."""
    name = make_name()
    with KalosClient.spawn(name, dim=8, device="cpu", data_dir=tmp_path) as c:
        rng = np.random.default_rng()
        for at in range(0, 40_000, 8_000):
            c.upsert([str(i) for i in range(at, at + 8_000)], rng.random((8_000, 8), np.float32))
    proc = serve(name, "--dim", "8", "--data-dir", str(tmp_path))
    assert proc.stdout is not None
    for line in proc.stdout:
        if "segment /kalos-" in line:  # (logged after the header is written, before the load)
            break
    proc.send_signal(signal.SIGSTOP)
    try:
        try:
            with pytest.raises(SidecarUnavailable, match="still starting up"):
                KalosClient(name)
            stopper = subprocess.Popen([*CLI, "stop", name, "--timeout", "30"], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)  # fmt: skip
            time.sleep(0.5)
            assert stopper.poll() is None, stopper.communicate()  # (waiting for the frozen sidecar)
        finally:
            proc.send_signal(signal.SIGCONT)
        out, err = stopper.communicate(timeout=60)
        assert stopper.returncode == 0 and f"stopped sidecar {name!r} (pid {proc.pid})" in out, err
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "ready: sidecar" not in rest, rest
        assert shm_objects(name) == []
    finally:
        if proc.poll() is None:  # (a failed run: the sidecar must not outlive the test)
            proc.terminate()
            proc.wait(30)
    r = cli("stop", make_name())
    assert r.returncode == 1 and "not running" in r.stderr, r.stderr


def test_a_data_dir_held_by_another_sidecar_exits_3(make_name, tmp_path) -> None:
    """A second sidecar on a running one's --data-dir, under its name or another: exit 3 (held
    by a live sidecar: fine once that one stops, as for a name in use), not 4, which says the
    store is unusable and which the unit template does not restart. Control: once the first
    stops, the same command starts."""
    first_name = make_name()
    first = serve(first_name, "--dim", "4", "--data-dir", str(tmp_path))
    try:
        wait_ready(first_name, first)
        for name in (first_name, make_name()):
            r = cli("serve", "--name", name, "--device", "cpu", "--dim", "4", "--data-dir", str(tmp_path))
            assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
            assert "in use by another running sidecar" in r.stderr or "already running" in r.stderr, r.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    again = serve(name, "--dim", "4", "--data-dir", str(tmp_path))
    try:
        wait_ready(name, again)
    finally:
        again.send_signal(signal.SIGTERM)
    assert again.wait(30) == 0


def test_the_metrics_port_is_held_from_before_the_load(make_name, tmp_path) -> None:
    """A sidecar still loading its rows already holds its --metrics-port (answering 503 until
    ready), so another sidecar given the same port exits 2 at once instead of both binding it
    and the later one crashing after its load."""
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    name = make_name()
    with KalosClient.spawn(name, dim=64, device="cpu", data_dir=tmp_path) as c:
        data = np.random.default_rng().random((5000, 64), np.float32)
        for i in range(12):
            c.upsert([f"{i}-{j}" for j in range(5000)], data)
    first = serve(name, "--dim", "64", "--data-dir", str(tmp_path), "--metrics-port", port)
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if "metrics: http://" in line:
                break
        try:  # (503 while it loads; 200 if the load was quicker than this request)
            status = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).status
        except urllib.error.HTTPError as e:
            status = e.code
        assert status in (200, 503)
        r = cli("serve", "--name", make_name(), "--device", "cpu", "--dim", "4", "--metrics-port", port)
        assert r.returncode == 2 and "Address already in use" in r.stderr, r.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 0


def test_cuda_without_a_gpu_exits_5(make_name) -> None:
    gpu = False
    with contextlib.suppress(Exception):  # no CuPy, or no CUDA driver: no GPU
        import cupy

        gpu = cupy.cuda.runtime.getDeviceCount() > 0
    if gpu:
        pytest.skip("a GPU is present: covered by tests/gpu")
    r = cli("serve", "--name", make_name(), "--dim", "4", "--device", "cuda")
    assert r.returncode == 5 and "--device cuda" in r.stderr, r.stderr
    auto = serve(make_name(), "--dim", "4", device="auto")  # falls back to the CPU, and says so
    try:
        auto_name = auto.args[auto.args.index("--name") + 1]  # type: ignore[union-attr]
        wait_ready(auto_name, auto)
    finally:
        auto.terminate()
        auto.wait(15)
    assert "using the CPU backend" in (auto.stdout.read() if auto.stdout else "")


@pytest.mark.parametrize("threads", [1, 2, 1024])
def test_threads_flag_sets_the_sidecars_blas_threads(make_name, threads: int) -> None:
    """``stats`` shows the pool ``--threads`` set, also after a small product ran on one
    thread (it showed OpenBLAS's setting of the moment: 1 after any small recall); a count
    past what OpenBLAS was built for (1024: 64 here) shows what it took, as the log does."""
    name = make_name()
    proc = serve(name, "--dim", "7", "--threads", str(threads))
    if threads > 2:  # (what this OpenBLAS takes of it)
        script = f"from kalos_retrievers.sidecar import blas; blas.set_threads({threads}); print(blas.get_threads())"
        threads = int(subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                                     check=True).stdout)  # fmt: skip
    try:
        wait_ready(name, proc)
        stats = json.loads(cli("stats", name).stdout)
        assert stats["blas_threads"] == threads
        with KalosClient(name) as c:  # and it still answers
            c.upsert(["a", "b"], [np.eye(7)[0], np.eye(7)[1]], texts=["x", "y"])
            assert c.recall(np.eye(7)[1], 1).ids == ["b"]
        assert json.loads(cli("stats", name).stdout)["blas_threads"] == threads
        assert cli("stop", name).returncode == 0
        assert f"BLAS threads: {threads}" in (proc.stdout.read() if proc.stdout else "")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_prints_its_table_and_writes_json(tmp_path) -> None:
    out = tmp_path / "bench.json"
    r = cli("bench", "--rows", "3001", "--dim", "13", "--calls", "60", "--warmup", "5", "--procs", "2",
            "--duration", "0.5", "--rounds", "3", "--block", "10", "--json", str(out), timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "sidecar added over numpy" in r.stdout and "recalls/s" in r.stdout
    res = json.loads(out.read_text())
    assert res["kalos"]["calls"] == 60 and res["kalos"]["p50_us"] > 0
    add = res["added_over_numpy"]
    assert add["rounds"] == 3 and add["block"] == 10 and add["a_p50_us"] > 0 and add["b_p50_us"] > 0
    assert res["added_over_numpy_paired"]["calls"] == 60
    thr = res["throughput"]
    assert thr["procs"] == 2 and thr["recalls_per_s"] > 0
    assert Path(thr["client_package"]).name == "kalos_retrievers"  # where the clients' library came from
    # the clients' CPU per recall (Linux with per-thread schedstat): each recall costs its
    # client some CPU (a round trip, at least its Python), and two clients keep at most two cores
    # plus rounding busy
    if os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        assert 1.0 < thr["client_cpu_us_per_recall"] < 1e5 and thr["client_runqueue_us_per_recall"] >= 0, thr
        assert 0.0 < thr["client_cores"] <= 2.1, thr
    assert set(res["sidecar"]["phases"]) == {"pickup", "search", "answer"}


def test_no_room_in_dev_shm_fails_the_start_with_code_2_and_leaves_nothing(make_name, monkeypatch) -> None:
    """The segment was only sized, never given its pages: in a /dev/shm with less room than
    the segment (Docker's default is 64 MiB; 16 slots take ~33), the start succeeded and the
    first write past the room killed the sidecar with SIGBUS (exit -7, no message). The pages
    are reserved at creation: no room is a usage error naming what to change, and nothing is
    left. (A full /dev/shm stood in for by posix_fallocate's ENOSPC; the real thing, in a
    2 MiB tmpfs, is in docs/deployment.md.) Control: with room, the same start serves."""
    import errno

    from kalos_retrievers.sidecar.server import EXIT_USAGE, ServeConfig, Server, StartError

    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    name = make_name()
    monkeypatch.setattr(os, "posix_fallocate", full)
    srv = Server(ServeConfig(name=name, dim=4, device="cpu"))
    with pytest.raises(StartError, match=r"/dev/shm has no room for /kalos-.* MiB\); give /dev/shm more room") as e:
        srv.start()
    assert e.value.exit_code == EXIT_USAGE and shm_objects(name) == []
    monkeypatch.setattr(os, "posix_fallocate", real)
    srv = Server(ServeConfig(name=name, dim=4, device="cpu"))
    srv.start()
    try:
        with KalosClient(name, timeout=5) as c:
            assert c.dim == 4
    finally:
        srv.close()
    assert shm_objects(name) == []


@pytest.mark.parametrize(
    "env", ["KALOS_GATHER_US=1.5", "KALOS_CAROUSEL_MIN=1", "KALOS_COMPILE_THREADS=64", "KALOS_BELL_REARM_MS=soon",
            "KALOS_DOORBELL_IDLE_S=-1"],
)  # fmt: skip
def test_a_bad_tuning_variable_refuses_serve_by_name_and_spares_the_other_commands(
    env: str, start_sidecar: Callable[..., Sidecar], make_name: Callable[[], str]
) -> None:
    """Read at import, where they cannot raise: serve exits 2 naming the variable, while
    status, stats and stop of a running sidecar work (they failed with a traceback)."""
    key, value = env.split("=")
    bad = {**os.environ, key: value}
    name = make_name()
    p = subprocess.run([sys.executable, "-P", "-m", "kalos_retrievers.sidecar", "serve", "--name", name, "--dim", "8",
                        "--device", "cpu"], env=bad, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and f"ERROR {key}='{value}': expected" in p.stderr, p.stderr[-1500:]
    assert "Traceback" not in p.stderr
    sc = start_sidecar(dim=8)  # (the control: a good environment serves)
    for cmd in (["status", sc.name], ["stats", sc.name]):
        q = subprocess.run([sys.executable, "-P", "-m", "kalos_retrievers.sidecar", *cmd], env=bad,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert q.returncode == 0, (cmd, q.stderr[-1500:])


def test_stop_refuses_a_pid_that_does_not_hold_the_segment(
    start_sidecar: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The header's pid is the sidecar's in its own pid namespace: from another (a pod's other
    container) it may name any process here. ``stop`` signals it only if it maps the segment."""
    import types

    from kalos_retrievers.sidecar import cli

    sc = start_sidecar(dim=8)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real = cli._client

        @contextlib.contextmanager
        def seen_from_another_namespace(name: str, timeout: float):  # type: ignore[no-untyped-def]
            with real(name, timeout):
                yield types.SimpleNamespace(header=types.SimpleNamespace(sidecar_pid=victim.pid))

        monkeypatch.setattr(cli, "_client", seen_from_another_namespace)
        assert cli.main(["stop", sc.name]) == 1
        assert "another pid namespace" in capsys.readouterr().err
        time.sleep(0.1)
        assert victim.poll() is None  # not signalled
        assert KalosClient(sc.name).ping() >= 0  # the sidecar serves on
        monkeypatch.undo()
        real_open = open

        def no_maps(path: Any, *a: Any, **kw: Any) -> Any:  # (another user's process, no CAP_SYS_PTRACE)
            if str(path).endswith("/maps"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *a, **kw)

        monkeypatch.setattr(cli, "open", no_maps, raising=False)
        assert sc.proc is not None
        assert cli._maps_segment(victim.pid, sc.name) is False  # its command line is not serve --name
        assert cli._maps_segment(sc.proc.pid, sc.name) is True
        monkeypatch.undo()
        assert cli._maps_segment(sc.proc.pid, sc.name) is True  # the control: its own pid is stopped
        assert cli.main(["stop", sc.name]) == 0
        assert sc.proc is not None and sc.proc.wait(10) == 0
    finally:
        victim.kill()
        victim.wait()


def test_a_sidecar_started_with_stderr_closed_serves(make_name) -> None:
    """``kalos-sidecar serve ... 2>&-``: no stderr to log to or to enable Python's fault
    handler on (it raised "sys.stderr is None" at start, exit 1); it serves without one."""
    name = make_name()
    p = subprocess.Popen(["/bin/sh", "-c", 'exec "$@" 2>&-', "sh", *CLI, "serve", "--name", name,
                          "--dim", "3", "--device", "cpu"], stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        end = time.monotonic() + 30
        while True:
            assert p.poll() is None, f"exited with {p.returncode}"
            try:
                with KalosClient(name, dim=3, timeout=2) as c:
                    assert c.ping() > 0
                break
            except SidecarUnavailable:
                assert time.monotonic() < end
                time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0


def test_the_cli_runs_under_python_OO() -> None:
    """``-OO`` strips docstrings, from which the parser takes its description: ``--help`` must
    still work (its control: ``__doc__`` is None there, as the printed check shows)."""
    r = subprocess.run([sys.executable, "-OO", *CLI[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout and "Traceback" not in r.stderr, r.stderr
    probe = "import kalos_retrievers.sidecar.cli as m; print(m.__doc__)"
    doc = subprocess.run([sys.executable, "-OO", "-P", "-c", probe], capture_output=True, text=True, timeout=60)
    assert doc.stdout.strip() == "None", doc.stderr


def test_status_of_a_sidecar_whose_slots_clients_all_hold(start_sidecar) -> None:
    """Two idle clients keep one slot each of a two-slot sidecar: ``status`` cannot send its
    ping. It exited 2 ("not answering": paused or wedged, for which a supervisor restarts);
    it exits 0 now, from the heartbeat the sidecar stamps every 0.1 s, and says why it did not
    ping. Control: the same sidecar paused (its heartbeat stops) exits 2."""
    sc = start_sidecar(dim=3, slots=2)
    a, b = sc.client(), sc.client()
    try:
        a.upsert(["x"], np.ones((1, 3), np.float32))
        b.count()
        r = cli("status", sc.name, "--timeout", "0.5")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["status"] == "ready" and out["ping_us"] is None and "all 2 slots are held" in out["note"]
        os.kill(sc.pid, signal.SIGSTOP)
        try:
            time.sleep(1.2)
            r = cli("status", sc.name, "--timeout", "0.5")
            assert r.returncode == 2 and "heartbeat is" in r.stderr, (r.returncode, r.stderr)
        finally:
            os.kill(sc.pid, signal.SIGCONT)
        a.close()
        assert cli("status", sc.name, "-q").returncode == 0  # (a slot free: pinged)
    finally:
        a.close()
        b.close()


def test_status_without_a_slot_reads_a_request_left_untaken_or_a_dead_sidecar_as_not_up(capsys) -> None:
    """With every slot held, ``status`` goes by the sidecar's lock, its heartbeat, and the
    requests that waited when the probe began: a REQUEST whose seq is the same after the
    probe's wait was never taken (a serve loop wedged while the maintenance thread stamps on:
    a review's PTRACE'd serve thread read "ready"), 2; a gone sidecar, 1; a taken one, 0."""
    import argparse
    from types import SimpleNamespace

    from kalos_retrievers.sidecar import cli as cli_module

    from kalos_retrievers import SidecarBusy

    def probe(alive: bool, before: dict, after: dict, age: float = 0.05) -> int:
        conn = SimpleNamespace(dead=False, sidecar_alive=lambda: alive, heartbeat_age=lambda: age,
                               untaken_requests=lambda: after)  # fmt: skip
        header = SimpleNamespace(name="x", sidecar_pid=1, backend="cpu", dim=3, metric_name="cosine",
                                 row_count=0, n_slots=2)  # fmt: skip
        c = SimpleNamespace(_conn=conn, header=header)
        args = argparse.Namespace(quiet=False, timeout=1.0)
        return cli_module._status_without_a_slot(args, c, SidecarBusy("no free slot"), before)  # type: ignore[arg-type]

    assert probe(True, {0: 7}, {0: 7}) == 2 and "slot 0's request has waited" in capsys.readouterr().err
    assert probe(True, {0: 7}, {}) == 0  # taken meanwhile
    assert probe(True, {0: 7}, {0: 8}) == 0  # (taken, and another written since)
    assert probe(True, {}, {}, age=3.0) == 2 and "heartbeat is 3.0 s old" in capsys.readouterr().err
    assert probe(False, {}, {}) == 1 and "it is gone" in capsys.readouterr().err

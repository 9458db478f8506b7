"""Observability: the Prometheus endpoint, ``kalos-sidecar stats --prometheus``, the client-side
degradation counters, and ``kalos-sidecar status`` as a readiness probe.

Pass: the endpoint is off unless asked; asked, it listens on 127.0.0.1 only and serves valid
Prometheus text with the kalos_* families the issue lists (requests by op and status, recall and
upsert latency histograms, rejected requests, reclaimed slots, re-publications, rows, device
memory), whose values agree with ``stats()``; the CLI's Prometheus text reports the same
counters; degradations are counted in the client process and exported in the same format;
``status -q`` exits 0 when ready, 2 when paused, 1 when gone, and prints nothing.

Negative controls: an endpoint bound to 0.0.0.0, and damaged exposition text, are reported.
"""

from __future__ import annotations

import io
import os
import re
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from contextlib import redirect_stdout
from typing import Any

import numpy as np
import pytest
from kalos_retrievers.sidecar import cli
from reliability._harness import SegmentView, fork_worker, open_doorbell, tcp_listeners, wait_until
from reliability._workers import load_dataset

from kalos_retrievers import Degrader, KalosClient, Sidecar, SidecarUnavailable, _ipc, degrade
from kalos_retrievers.protocol import REQUEST_OFFSET, REQUEST_STRUCT, SlotState

pytestmark = pytest.mark.reliability

DIM, N = 8, 50
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
REQUIRED = ["kalos_requests_total", "kalos_request_latency_seconds", "kalos_rejected_requests_total",
            "kalos_reclaimed_slots_total", "kalos_republished_total", "kalos_rows",
            "kalos_device_memory_bytes"]  # fmt: skip


def parse_prometheus(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]], list[str]]:
    """(family -> type, samples, violations of the text format 0.0.4)."""
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    bad: list[str] = []
    for line in text.splitlines():
        if not line or line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            parts = line.split(" ")
            if len(parts) != 4 or parts[3] not in ("counter", "gauge", "histogram", "summary", "untyped"):
                bad.append(f"bad TYPE line {line!r}")
            else:
                types[parts[2]] = parts[3]
            continue
        m = _SAMPLE.match(line)
        if not m:
            bad.append(f"not a sample line: {line!r}")
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            bad.append(f"bad value in {line!r}")
            continue
        name, labels = m.group(1), dict(_LABEL.findall(m.group(3) or ""))
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        family = base if base in types else name
        if family not in types:
            bad.append(f"sample {name} has no TYPE")
        if types.get(family) == "counter" and value < 0:
            bad.append(f"negative counter {line!r}")
        samples.append((name, labels, value))
    buckets: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]] = defaultdict(list)
    counts = {}
    for name, labels, value in samples:
        key_labels = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        if name.endswith("_bucket"):
            buckets[(name[:-7], key_labels)].append((float(labels["le"]), value))
        elif name.endswith("_count"):
            counts[(name[:-6], key_labels)] = value
    for key, bs in buckets.items():
        values = [v for _, v in sorted(bs)]
        if values != sorted(values):
            bad.append(f"histogram {key} buckets are not cumulative")
        if sorted(bs)[-1][0] != float("inf") or sorted(bs)[-1][1] != counts.get(key):
            bad.append(f"histogram {key}: +Inf bucket != _count")
    return types, samples, bad


def value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float | None:
    for n, ls, v in samples:
        if n == name and all(ls.get(k) == w for k, w in labels.items()):
            return v
    return None


def metrics_port(sc: Sidecar) -> int:
    m = wait_until(lambda: re.search(r"metrics: http://([\d.]+):(\d+)/metrics", sc.log_path.read_text()), 10)
    assert m, sc.log_tail()
    return int(m.group(2))


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, "", ""


def _reject_one(name: str) -> None:
    """Write one invalid request into a free slot (unknown op) and wait for the refusal."""
    with SegmentView(name) as v:
        i = next(i for i in range(v.layout.n_slots) if _ipc.try_lock(v.fd, _ipc.slot_lock_byte(i)))
        off = v.layout.slot_offset(i)
        REQUEST_STRUCT.pack_into(v.mm, off + REQUEST_OFFSET, 1, 999, 0, 0, 0, 0, 0, 0)
        struct.pack_into("<I", v.mm, off, SlotState.REQUEST)
        bell = open_doorbell(name)
        _ipc.post(bell)
        bell.close()
        assert wait_until(lambda: v.states[i] == SlotState.ERROR, 5)
        struct.pack_into("<I", v.mm, off, SlotState.FREE)
        _ipc.unlock(v.fd, _ipc.slot_lock_byte(i))


def _client_that_dies(name: str) -> None:
    c = KalosClient(name, spin_us=0)  # holds its slot until it dies
    c.ping()
    os.kill(os.getpid(), signal.SIGKILL)


def endpoint_violations(sc: Sidecar) -> tuple[list[str], dict[str, Any]]:
    assert sc.pid is not None
    bad = []
    port = metrics_port(sc)
    listeners = tcp_listeners(sc.pid)
    if listeners != [("127.0.0.1", port)]:
        bad.append(f"the sidecar listens on {listeners}, not only 127.0.0.1:{port}")
    status, ctype, text = scrape(port)
    if status != 200 or not ctype.startswith("text/plain"):
        bad.append(f"GET /metrics: {status} {ctype}")
    types, samples, fmt = parse_prometheus(text)
    bad += fmt
    bad += [f"missing family {f}" for f in REQUIRED if f not in types]
    return bad, {"port": port, "types": types, "samples": samples, "text": text}


def test_metrics_endpoint(launch: Callable[..., Sidecar]) -> None:
    sc = launch(extra_args=("--metrics-port", "0"))
    with sc.client(spin_us=0) as c:
        load_dataset(c, N, DIM)
        for _ in range(5):
            c.recall(np.ones(DIM), k=3)
    _reject_one(sc.name)
    fork_worker(_client_that_dies, sc.name).wait()
    with sc.client(spin_us=0) as c:
        assert wait_until(lambda: c.stats()["reclaimed_slots"] >= 1, 3)
        st = c.stats()
        count = c.count()
    bad, got = endpoint_violations(sc)
    assert not bad, bad
    s = got["samples"]
    assert value(s, "kalos_requests_total", op="recall", status="ok") == st["requests"]["recall/ok"]
    assert value(s, "kalos_requests_total", op="invalid", status="bad_op") == 1
    assert value(s, "kalos_request_latency_seconds_count", op="upsert") == st["latency"]["upsert"]["count"]
    assert value(s, "kalos_request_latency_seconds_count", op="recall") == st["latency"]["recall"]["count"]
    assert value(s, "kalos_rejected_requests_total") == st["rejected_requests"] == 1
    assert value(s, "kalos_reclaimed_slots_total") == st["reclaimed_slots"] >= 1
    assert value(s, "kalos_rows") == count == N
    assert value(s, "kalos_device_memory_bytes") == 0  # CPU backend
    assert scrape(got["port"], "/secret")[0] == 404


def test_the_clis_prometheus_text_has_the_endpoints_histograms(launch: Callable[..., Sidecar]) -> None:
    """``kalos-sidecar stats NAME --prometheus`` (for scrapers without the HTTP endpoint)
    passes the same format checks as /metrics and carries the same recall latency buckets
    (it used to print the histogram's HELP/TYPE with no samples)."""
    import subprocess
    import sys

    sc = launch(extra_args=("--metrics-port", "0"))
    with sc.client(spin_us=0) as c:
        load_dataset(c, N, DIM)
        for _ in range(7):
            c.recall(np.ones(DIM), k=3)
    _, got = endpoint_violations(sc)
    cli = subprocess.run([sys.executable, "-P", "-m", "kalos_retrievers.sidecar", "stats", sc.name, "--prometheus"],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    types, samples, fmt = parse_prometheus(cli.stdout)
    assert not fmt, fmt
    assert types.get("kalos_request_latency_seconds") == "histogram"

    def recall_lines(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith("kalos_request_latency") and 'op="recall"' in ln]

    assert recall_lines(cli.stdout) == recall_lines(got["text"]) != []
    assert value(samples, "kalos_request_latency_seconds_count", op="recall") == 7


def test_metrics_endpoint_is_off_by_default(launch: Callable[..., Sidecar]) -> None:
    sc = launch()
    assert sc.pid is not None
    assert tcp_listeners(sc.pid) == []


def test_metrics_negative_control_wildcard_bind(launch: Callable[..., Sidecar]) -> None:
    sc = launch(extra_args=("--metrics-port", "0", "--metrics-host", "0.0.0.0"))  # noqa: S104 - the fault
    bad, _ = endpoint_violations(sc)
    assert any("not only 127.0.0.1" in b for b in bad), bad


def test_prometheus_parser_negative_control() -> None:
    good = ("# TYPE a_total counter\na_total 3\n# TYPE h histogram\n"
            'h_bucket{le="1"} 2\nh_bucket{le="+Inf"} 3\nh_count 3\nh_sum 1\n')
    assert parse_prometheus(good)[2] == []
    for broken in (good.replace("h_bucket{le=\"1\"} 2", "h_bucket{le=\"1\"} 5"),
                   good.replace("# TYPE a_total counter\n", ""), good.replace("a_total 3", "a_total three"),
                   good.replace("h_count 3", "h_count 4")):  # fmt: skip
        assert parse_prometheus(broken)[2], broken


def test_cli_prometheus_reports_the_sidecars_counters(launch: Callable[..., Sidecar]) -> None:
    sc = launch()
    _reject_one(sc.name)
    _reject_one(sc.name)
    with sc.client(spin_us=0) as c:
        assert wait_until(lambda: c.stats()["uptime_s"] >= 0.3, 5, 0.05)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["stats", sc.name, "--prometheus"]) == 0
    _, samples, bad = parse_prometheus(out.getvalue())
    assert not bad, bad
    assert value(samples, "kalos_rejected_requests_total") == 2
    assert value(samples, "kalos_uptime_seconds") >= 0.3  # the sidecar's uptime, not a fresh one
    assert value(samples, "kalos_requests_total", op="invalid", status="bad_op") == 2


def test_degradations_are_counted_and_exported(make_name: Callable[[], str]) -> None:
    before = degrade.degradation_totals()
    c = KalosClient(make_name(), dim=DIM, spin_us=0, lazy=True)
    d, strict = Degrader("test"), Degrader("strict", on_error="raise")
    for _ in range(3):
        try:
            c.recall(np.ones(DIM))
        except SidecarUnavailable as e:
            assert d.should_degrade(e)
            assert not strict.should_degrade(e)  # raised, not degraded: not counted
    after = degrade.degradation_totals()
    assert after["degraded_calls"] - before["degraded_calls"] == 3
    assert after["episodes"] - before["episodes"] == 1
    types, samples, bad = parse_prometheus(degrade.prometheus_text())
    assert not bad and types == {"kalos_client_degraded_calls_total": "counter",
                                 "kalos_client_degradation_episodes_total": "counter"}  # fmt: skip
    assert value(samples, "kalos_client_degraded_calls_total") == after["degraded_calls"]


def _status(name: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-P", "-m", "kalos_retrievers.sidecar", "status", name, "-q",
                        "--timeout", "0.5"], capture_output=True, text=True, timeout=60)  # fmt: skip
    return r.returncode, r.stdout + r.stderr


def test_status_is_a_readiness_probe(launch: Callable[..., Sidecar]) -> None:
    sc = launch()
    assert _status(sc.name) == (0, "")
    sc.kill(signal.SIGSTOP)
    try:
        assert _status(sc.name) == (2, "")  # paused: not answering in time
    finally:
        sc.kill(signal.SIGCONT)
    assert _status(sc.name) == (0, "")
    sc.kill(signal.SIGKILL)
    assert sc.proc is not None
    sc.proc.wait()
    assert _status(sc.name) == (1, "")  # gone (a stale segment is "down", not "ready")
    assert _status("never-started-" + sc.name)[0] == 1

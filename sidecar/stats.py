"""Counters and latency histograms the sidecar keeps about itself.

Latencies go into fixed log-spaced buckets (about 9% wide, from 1 µs to 100 s), so recording
one costs an index computation and an increment, and percentiles are read off the buckets.
The same numbers feed ``kalos-sidecar stats`` and the Prometheus text endpoint.
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from kalos_retrievers.protocol import OP_NAMES, STATUS_NAMES

# KALOS_BATCH_TIMING=1 or "host": the sidecar's timing diagnostics on the host's clock (the
# dispatcher's waits, launches and clients' returns, the collector's pauses, the GPU index's
# stamps of its queued launches); "1" adds the GPU index's CUDA events (docs/deployment.md).
HOST_TIMING: Final = os.environ.get("KALOS_BATCH_TIMING", "0") in ("1", "host")

_BUCKETS_PER_DECADE: Final = 27
_DECADES: Final = 8  # 1 µs .. 100 s
_N: Final = _BUCKETS_PER_DECADE * _DECADES + 1


class Histogram:
    __slots__ = ("count", "counts", "sum_us")

    def __init__(self) -> None:
        self.counts = [0] * _N  # a list: += 1 on a numpy array costs more, on every request
        self.count = 0
        self.sum_us = 0.0

    def record(self, us: float) -> None:
        i = 0 if us <= 1 else min(_N - 1, int(math.log10(us) * _BUCKETS_PER_DECADE) + 1)
        self.counts[i] += 1
        self.count += 1
        self.sum_us += us

    @staticmethod
    def bucket_upper_us(i: int) -> float:
        return 10 ** (i / _BUCKETS_PER_DECADE)

    def percentile(self, p: float) -> float:
        if not self.count:
            return 0.0
        target = p / 100 * self.count
        i = int(np.searchsorted(np.cumsum(self.counts), target))
        return self.bucket_upper_us(min(i, _N - 1))

    def summary(self, buckets: bool = False) -> dict[str, Any]:
        """Count, mean and percentiles; with ``buckets``, also what rebuilds the histogram
        (:meth:`of_summary`): the sum and the nonzero buckets (``{index: count}``)."""
        out: dict[str, Any] = {
            "count": self.count,
            "mean_us": round(self.sum_us / self.count, 2) if self.count else 0.0,
            "p50_us": round(self.percentile(50), 1),
            "p99_us": round(self.percentile(99), 1),
            "p999_us": round(self.percentile(99.9), 1),
        }
        if buckets:
            out["sum_us"] = round(self.sum_us, 1)
            out["buckets"] = {str(i): c for i, c in enumerate(self.counts) if c}
        return out

    @classmethod
    def of_summary(cls, d: dict[str, Any]) -> Histogram | None:
        """The histogram a :meth:`summary` describes (None: one without its buckets, from an
        older sidecar)."""
        if "buckets" not in d:
            return None
        h = cls()
        for i, c in d["buckets"].items():
            h.counts[int(i)] = int(c)
        h.count, h.sum_us = int(d["count"]), float(d["sum_us"])
        return h


class Stats:
    def __init__(self) -> None:
        self.started = time.time()
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.latency: dict[str, Histogram] = {}
        self.phases: dict[str, Histogram] = {}
        self.reclaimed_slots = 0
        self.rejected = 0
        self.batches = 0
        self.batched_queries = 0
        self.republished = 0

    def record(self, op: int, status: int, us: float) -> None:
        name = OP_NAMES.get(op, "invalid")
        self.requests[(name, STATUS_NAMES.get(status, str(status)))] += 1
        if status == 0:
            h = self.latency.get(name)
            if h is None:
                h = self.latency[name] = Histogram()
            h.record(us)
        else:
            self.rejected += 1

    def phase(self, name: str, us: float) -> None:
        """Time spent in one phase of a request. Recalls without a filter record three (per
        search, which may answer several slots at once): "pickup", from finding the first
        request to starting the search (decoding, checks); "search", the index's work (on a
        GPU: launch and synchronize); "answer", from the search's end to the last response
        posted (documents encoded and written). Recalls the carousel answers record
        "crowd_lane" (send to harvest, host) and "crowd_aboard" (boarding to answer, GPU)."""
        h = self.phases.get(name)
        if h is None:
            h = self.phases[name] = Histogram()
        h.record(us)

    def snapshot(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "requests": {f"{op}/{st}": n for (op, st), n in sorted(self.requests.items())},
            "latency": {op: h.summary(buckets=True) for op, h in sorted(self.latency.items())},
            "phases": {p: h.summary() for p, h in sorted(self.phases.items())},
            "rejected_requests": self.rejected,
            "reclaimed_slots": self.reclaimed_slots,
            "batches": self.batches,
            "batched_queries": self.batched_queries,
            "republished": self.republished,
            **extra,
        }

    def prometheus(self, extra: dict[str, Any]) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out = [
            "# HELP kalos_requests_total Requests answered, by op and status.",
            "# TYPE kalos_requests_total counter",
        ]
        for (op, st), n in sorted(self.requests.items()):
            out.append(f'kalos_requests_total{{op="{op}",status="{st}"}} {n}')
        if self.latency:  # (a family without samples is not valid exposition)
            out += [
                "# HELP kalos_request_latency_seconds Time from pickup to response, by op.",
                "# TYPE kalos_request_latency_seconds histogram",
            ]
        for op, h in sorted(self.latency.items()):
            cum = np.cumsum(h.counts)
            for i in range(0, _N, 9):  # every 9th bucket: ~1/3 decade resolution is plenty
                le = h.bucket_upper_us(i) / 1e6
                out.append(f'kalos_request_latency_seconds_bucket{{op="{op}",le="{le:.6g}"}} {cum[i]}')
            out.append(f'kalos_request_latency_seconds_bucket{{op="{op}",le="+Inf"}} {h.count}')
            # the sum as summary() gives it (0.1 µs): `kalos-sidecar stats --prometheus`
            # rebuilds it from there, and printed the last digit differently 1 time in ~4
            out.append(f'kalos_request_latency_seconds_sum{{op="{op}"}} {round(h.sum_us, 1) / 1e6:.7f}')
            out.append(f'kalos_request_latency_seconds_count{{op="{op}"}} {h.count}')
        gauges = {
            "kalos_rows": ("Live rows in the index.", extra.get("rows", 0)),
            "kalos_rejected_requests_total": ("Requests refused by validation.", self.rejected),
            "kalos_reclaimed_slots_total": ("Slots taken back from dead clients.", self.reclaimed_slots),
            "kalos_republished_total": ("Times the segment was re-created after removal.", self.republished),
            "kalos_device_memory_bytes": ("Index memory on the device (0 on CPU).", extra.get("device_bytes", 0)),
            "kalos_uptime_seconds": ("Seconds since start.", round(time.time() - self.started, 1)),
        }
        for name, (help_, v) in gauges.items():
            kind = "counter" if name.endswith("_total") else "gauge"
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {v}"]
        return "\n".join(out) + "\n"


def time_gc(stats: Stats) -> Callable[[], None]:
    """Record each of this process's garbage collections in ``stats`` as the phase "gc0",
    "gc1" or "gc2" (its generation; all three are there from the start, at count 0), from its
    start to its end; return the function that stops recording.

    Diagnostics (the sidecar does it with ``KALOS_BATCH_TIMING=1`` or ``host``): the serve loop is one
    Python thread, so a collection that runs while a batch waits to be launched or answered
    delays that batch by its whole pause."""
    started = [0]
    # The histograms exist before the first collection: a collection can run anywhere, in the
    # middle of the stats' own snapshot too, and must never add a key to the dict it iterates.
    hists = [stats.phases.setdefault(f"gc{g}", Histogram()) for g in range(3)]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
        else:
            hists[min(info["generation"], 2)].record((time.perf_counter_ns() - started[0]) / 1000)

    gc.callbacks.append(timed)
    return lambda: gc.callbacks.remove(timed)


def thread_sched(tid: int | None) -> dict[str, int] | None:
    """What the kernel's scheduler says of thread ``tid`` of this process (Linux; None
    elsewhere, for no thread, or where the kernel keeps no schedstat): ``cpu_ns`` it ran,
    ``runqueue_ns`` it waited runnable for a CPU (time other threads took from it, the
    sidecar's own among them: on a host whose cores the clients fill, every such wait delays
    the batch the sidecar was about to launch or answer), ``timeslices``, and
    its ``voluntary_switches`` (it slept) and ``involuntary_switches`` (it was preempted).
    Cumulative since the thread started; the sidecar reports its serve loop's."""
    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            cpu, wait, slices = (int(x) for x in f.read().split()[:3])
        with open(f"/proc/self/task/{tid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return {"cpu_ns": cpu, "runqueue_ns": wait, "timeslices": slices,
                "voluntary_switches": int(status["voluntary_ctxt_switches"]),
                "involuntary_switches": int(status["nonvoluntary_ctxt_switches"])}  # fmt: skip
    except (OSError, ValueError, KeyError):  # not Linux, no schedstat, or the thread is gone
        return None

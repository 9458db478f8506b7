"""The sidecar's own diagnostics in its stats."""

from __future__ import annotations

import gc

from kalos_retrievers.sidecar.stats import Stats, time_gc


def test_garbage_collections_are_timed_until_stopped() -> None:
    """Each collection becomes a "gc<generation>" phase while timed; once stopped (the negative
    control), collections record nothing and the callback is gone."""
    stats = Stats()
    stop = time_gc(stats)
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        stop()
    phases = stats.phases
    assert phases["gc0"].count >= 1 and phases["gc2"].count >= 2, phases.keys()
    assert phases["gc2"].sum_us > 0
    counts = {name: h.count for name, h in phases.items()}
    gc.collect(2)
    assert {name: h.count for name, h in stats.phases.items()} == counts
    assert not any(getattr(c, "__qualname__", "").startswith("time_gc") for c in gc.callbacks)

"""Turning raw scores into relevance in [0, 1], the same way in every adapter.

Raw scores are similarities, higher is better:

========  ======================  =============================================
metric    raw score ``s``         relevance
========  ======================  =============================================
cosine    cosine similarity       ``(1 + s) / 2``: 1 identical, 0.5 orthogonal,
                                  0 opposite
ip        inner product           ``1 / (1 + exp(-s))`` (logistic): monotone,
                                  0.5 at ``s = 0``
l2        ``-distance``           ``1 / (1 + distance)``: 1 identical, toward 0
                                  as the distance grows
========  ======================  =============================================

All three are monotone in ``s``, so thresholds on relevance keep the order of the raw
scores, and all are clipped into [0, 1] against rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["relevance", "relevance_fn"]


def _cosine(s: float) -> float:
    return min(1.0, max(0.0, (1.0 + s) / 2.0))


def _ip(s: float) -> float:
    if s >= 0:
        return 1.0 / (1.0 + math.exp(-s))
    e = math.exp(s)
    return e / (1.0 + e)


def _l2(s: float) -> float:
    return 1.0 / (1.0 + max(0.0, -s))


_FNS: dict[str, Callable[[float], float]] = {"cosine": _cosine, "ip": _ip, "l2": _l2}


def relevance_fn(metric: str) -> Callable[[float], float]:
    """The relevance function for a sidecar's metric (``client.metric``)."""
    try:
        return _FNS[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}") from None


def relevance(metric: str, score: float) -> float:
    return relevance_fn(metric)(score)

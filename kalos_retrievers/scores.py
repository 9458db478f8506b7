"""Turning raw scores into relevance in [0, 1], the same way in every adapter.

Raw scores are similarities, higher is better:

========  ======================  =============================================
metric    raw score ``s``         relevance
========  ======================  =============================================
cosine    cosine similarity       ``(1 + s) / 2``: 1 identical, 0.5 orthogonal,
                                  0 opposite
ip        inner product           ``(1 + s) / 2``, clipped into [0, 1]: the same
                                  as cosine's for unit vectors (the usual reason
                                  to pick ip); rows with ``s >= 1`` all read 1
l2        ``-distance``           ``1 / (1 + distance)``: 1 identical, toward 0
                                  as the distance grows
========  ======================  =============================================

All three are monotone in ``s``, so thresholds on relevance keep the order of the raw
scores, and all are clipped into [0, 1] against rounding; a score that is not a number
(float32 overflow at norms past ~1e19) reads 0. These are not LangChain's own
``_cosine_relevance_score_fn`` (``s`` itself, negative for opposite vectors) or
``_euclidean_relevance_score_fn`` (``1 - d / sqrt(2)``): a threshold ``t`` here means
cosine ``s >= 2t - 1`` and an L2 distance ``d <= 1/t - 1``. (Until session 66, ip used the
logistic ``1 / (1 + exp(-s))``, whose best for unit vectors was 0.731: a threshold of 0.8
found nothing, not even the query's own row.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["relevance", "relevance_fn"]


def _half(s: float) -> float:
    if math.isnan(s):
        return 0.0
    return min(1.0, max(0.0, (1.0 + s) / 2.0))


def _l2(s: float) -> float:
    if math.isnan(s):  # (max(0.0, nan) is 0.0: a NaN distance would read "identical")
        return 0.0
    return 1.0 / (1.0 + max(0.0, -s))


_FNS: dict[str, Callable[[float], float]] = {"cosine": _half, "ip": _half, "l2": _l2}


def relevance_fn(metric: str) -> Callable[[float], float]:
    """The relevance function for a sidecar's metric (``client.metric``)."""
    try:
        return _FNS[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}") from None


def relevance(metric: str, score: float) -> float:
    return relevance_fn(metric)(score)

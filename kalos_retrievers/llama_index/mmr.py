"""Maximal marginal relevance over candidates the sidecar returned with their vectors. Pure."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["mmr_select", "spread_scores"]


def mmr_select(
    query: np.ndarray,
    candidates: np.ndarray,
    k: int,
    threshold: float = 0.5,
    relevance: np.ndarray | None = None,
) -> list[int]:
    """Indices of ``k`` candidates chosen by MMR, in the order chosen.

    Each step picks the candidate maximizing
    ``threshold * rel(c) - (1 - threshold) * max(sim(c, s) for s already chosen)``, ``sim``
    the cosine similarity between candidates: ``threshold=1`` is plain ranking by ``rel``,
    ``0`` pure diversity (LlamaIndex's ``mmr_threshold``; 0.5 by default, as in LlamaIndex).
    ``rel`` is ``relevance`` (one per candidate, on cosine's scale [-1, 1]: the adapter
    passes an ip or L2 sidecar's own scores through :func:`spread_scores`), or the cosine
    similarity to ``query`` when None. (Until session 66 it was always the cosine: an L2
    store's MMR at threshold 1 put its farthest row second.)

    Unlike ``llama_index.core``'s helper, the penalty is the similarity to the *closest* chosen
    candidate, not to the last one chosen, which is what MMR (Carbonell & Goldstein, 1998)
    specifies.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"mmr_threshold={threshold!r} must be in [0, 1]")
    n = len(candidates)
    if n == 0 or k <= 0:
        return []
    c = _unit(np.asarray(candidates, dtype=np.float64))
    q = _unit(np.asarray(query, dtype=np.float64).reshape(1, -1))[0]
    rel = c @ q if relevance is None else np.asarray(relevance, dtype=np.float64).reshape(n)
    closest = np.full(n, -np.inf)
    chosen: list[int] = []
    available = np.ones(n, dtype=bool)
    for _ in range(min(k, n)):
        penalty = np.where(np.isfinite(closest), closest, 0.0)
        score = threshold * rel - (1.0 - threshold) * penalty
        score[~available] = -np.inf
        best = int(np.argmax(score))
        chosen.append(best)
        available[best] = False
        closest = np.maximum(closest, c @ c[best])
    return chosen


def _unit(m: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.where(norms == 0, 1.0, norms)


def spread_scores(scores: np.ndarray) -> np.ndarray:
    """Raw scores (an inner product, a negated distance: unbounded) onto [-1, 1], the best
    candidate 1 and the worst -1, in order: MMR's relevance on the scale of its cosine
    penalty. Not a fixed map: ``(1 + s) / 2`` clipped made every inner product of 1 or more
    equal, and MMR then ranked by diversity alone; distances of 10-30 crowded into a sliver.
    All equal (or one candidate): all 1. The range is the finite scores'; ``+inf`` reads 1,
    ``-inf`` and NaN -1 (one ``-inf`` had made every candidate 1)."""
    s = np.asarray(scores, dtype=np.float64)
    if not len(s):
        return s
    fin = np.isfinite(s)
    out = np.where(s == np.inf, 1.0, -1.0)
    if not fin.any():
        return out
    lo, hi = float(s[fin].min()), float(s[fin].max())
    if not hi > lo or not math.isfinite(hi - lo):
        out[fin] = 1.0
    else:
        out[fin] = 2.0 * (s[fin] - lo) / (hi - lo) - 1.0
    return out

"""Environment knobs read when a sidecar module is imported, their bad values kept for ``serve``.

A module-level ``int(os.environ[...])`` raises at import, and the CLI imports the serving
modules for every subcommand: one mistyped tuning variable made ``status``, ``stats`` and
``stop`` fail too (and ``status`` report a healthy sidecar as not running). :func:`knob` reads
a variable at import without raising: a bad value is recorded in :data:`ERRORS` and the default
used, and ``kalos-sidecar serve`` refuses to start while :data:`ERRORS` holds any (exit 2, one
line each), so a misconfigured sidecar never serves with a value it was not given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ERRORS", "knob", "number", "whole"]

T = TypeVar("T")

#: ``"NAME='value': what it must be"`` for each knob whose value could not be used.
ERRORS: list[str] = []


def knob(name: str, parse: Callable[[str], T], default: T) -> T:
    """``parse(os.environ[name])``, or ``default`` where it is unset or blank, or where
    ``parse`` raised ``ValueError`` (recorded in :data:`ERRORS` with its message)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return parse(raw.strip())
    except ValueError as e:
        msg = str(e)
        ERRORS.append(msg if msg.startswith(name) else f"{name}={raw!r}: {msg}")
        return default


def whole(low: int) -> Callable[[str], int]:
    """A parser of whole numbers >= ``low``."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"expected a whole number >= {low}") from None
        if n < low:
            raise ValueError(f"expected a whole number >= {low}")
        return n

    return parse


def number(low: float) -> Callable[[str], float]:
    """A parser of finite numbers >= ``low``."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise ValueError(f"expected a number >= {low:g}") from None
        if not math.isfinite(x) or x < low:
            raise ValueError(f"expected a finite number >= {low:g}")
        return x

    return parse

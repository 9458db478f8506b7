"""Environment knobs read when a sidecar module is imported, their bad values kept for ``serve``.

A module-level ``int(os.environ[...])`` raises at import, and the CLI imports the serving
modules for every subcommand: one mistyped tuning variable made ``status``, ``stats`` and
``stop`` fail too (and ``status`` report a healthy sidecar as not running). :func:`knob` reads
a variable at import without raising: a bad value is recorded in :data:`ERRORS` and the default
used, and :meth:`Server.start <sidecar.server.Server.start>` refuses to start while
:data:`ERRORS` holds any (``kalos-sidecar serve``: exit 2, naming each), so a misconfigured
sidecar never serves with a value it was not given.
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


def number(low: float, high: float) -> Callable[[str], float]:
    """A parser of numbers from ``low`` to ``high``."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            x = math.nan
        if not low <= x <= high:
            raise ValueError(f"expected a number from {low:g} to {high:g}")
        return x

    return parse

"""Argument checks shared by every layer (each raises naming the argument and its owner)."""

from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Optional

__all__ = ["check_callable", "check_positive_number"]


def check_positive_number(owner: str, name: str, value) -> float:
    """``value`` as a float when it is a finite number > 0, else a ValueError naming
    ``owner``'s argument ``name`` (``True`` is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}({name}={value!r}): must be a finite number of seconds > 0"
                         if name.endswith(("timeout", "poll")) else
                         f"{owner}({name}={value!r}): must be a finite number > 0")
    return float(value)


def check_callable(owner: str, name: str, value: Optional[Callable]) -> Optional[Callable]:
    """``value`` when it is ``None`` or callable, else a TypeError naming the argument."""
    if value is not None and not callable(value):
        raise TypeError(f"{owner}({name}=...): expected a callable or None, got a {type(value).__name__}")
    return value

"""A client's DP-SGD batch: ``b = round(q n)`` rows, defined once, in integer arithmetic.

The privacy plan charges a client for ``b / n`` of its rows per step, and the client draws
``b`` rows; both must be the same integer. Computing ``q n`` in floating point gives
different answers in float64 (the plan, on the host) and float32 (the client, under ``jit``):
at ``q = 0.15``, ``n = 190`` the first is 28.4999... and the second 28.5000...; so ``q`` is
read once as a fraction ``P / D`` (``D <= MAX_DENOMINATOR``: 0.15 is 3/20), and
``b = round(P n / D)`` (halves to even, as Python's ``round`` and ``jnp.round``), at least 1
and at most ``n``, is computed with integers on both sides: :func:`batch_size` on the host, :func:`traced_batch_size`
under ``jit`` (int32 without overflow for any ``n < 2**31``).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Tuple

import jax.numpy as jnp

__all__ = ["MAX_DENOMINATOR", "batch_size", "rate_fraction", "traced_batch_size"]

MAX_DENOMINATOR = 10_000  # q is read to 1e-8 or better (the plan charges b / n, whatever q was)


def rate_fraction(sampling_rate: float) -> Tuple[int, int]:
    """``(P, D)``: ``sampling_rate`` as the nearest fraction with ``D <= MAX_DENOMINATOR``."""
    f = Fraction(float(sampling_rate)).limit_denominator(MAX_DENOMINATOR)
    return f.numerator, f.denominator


def batch_size(sampling_rate: float, num_rows: int) -> int:
    """The rows a client with ``num_rows`` rows uses per DP-SGD step (host integers)."""
    p, d = rate_fraction(sampling_rate)
    a, r = divmod(int(num_rows), d)
    up, rest = divmod(2 * p * r + d, 2 * d)  # round(p r / d) half up; rest == 0: exactly a half
    b = p * a + up - ((rest == 0) and (p * a + up) % 2 == 1)  # a half goes to the even neighbour
    return min(max(b, 1), int(num_rows))


def traced_batch_size(sampling_rate: float, num_rows) -> jnp.ndarray:
    """:func:`batch_size` under ``jit`` (``num_rows`` traced), in int32: the same integer."""
    p, d = rate_fraction(sampling_rate)
    n = jnp.asarray(num_rows).astype(jnp.int32)
    a, r = n // d, n % d
    up, rest = (2 * p * r + d) // (2 * d), (2 * p * r + d) % (2 * d)
    b = p * a + up
    b = b - ((rest == 0) & (b % 2 == 1)).astype(jnp.int32)
    return jnp.clip(b, 1, n)

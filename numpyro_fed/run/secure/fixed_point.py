"""Fixed-point encoding of messages in the ring of integers modulo ``2**64``.

Pairwise masks cancel exactly only in a finite ring, so every client's term is rounded to a
multiple of ``2**-FRACTION_BITS`` and written as a 64-bit integer modulo ``2**64``; sums
wrap, and a sum of ``J`` terms each within ``LIMIT / J`` decodes exactly. The rounding error of
a sum of ``J`` terms is at most ``J * 2**-(FRACTION_BITS + 1)`` (about ``3e-8`` per client),
below float32's resolution of any value larger than about ``0.25``. Integer and boolean
fields are summed exactly (as counts).

A real term that is not finite (a divergent trajectory's energy, a point where a likelihood
vanishes) cannot be written in the ring; it travels as a count in a second word per entry,
``+inf`` as ``1``, ``-inf`` as ``J + 1``, NaN as ``(J + 1)**2``, so that the sum of the words
counts each kind. The decoded sum of an entry is ``+inf`` / ``-inf`` when some clients' terms
were (and none of the other sign), NaN when signs disagree or some term was NaN, and the exact
fixed-point sum otherwise, as a floating-point sum would be. A *finite* term beyond ``LIMIT / J``
is refused on the client (:class:`OutOfRangeError`, naming the field), never sent as infinite,
unless the algorithm that sends it says that its huge values mean infinite (:func:`saturate`:
federated NUTS's energies on a divergent leaf).
"""

from __future__ import annotations

from typing import Any, List, Tuple

import jax
import numpy as np

__all__ = ["FRACTION_BITS", "LIMIT", "OutOfRangeError", "decode_message", "encode_message", "fixed_point_sum",
           "saturate", "sums_like", "word_count"]

FRACTION_BITS = 24
"""Bits after the binary point: terms are rounded to multiples of ``2**-24`` (about ``6e-8``)."""
LIMIT = float(2 ** (63 - FRACTION_BITS))
"""The largest absolute value a sum may reach (``2**39``, about ``5.5e11``); each of ``J``
clients' terms is held within ``LIMIT / J``."""
_SCALE = float(2 ** FRACTION_BITS)


class OutOfRangeError(ValueError):
    """A finite term a client would sum by masking lies beyond the ring's range (``LIMIT / J``)."""


def saturate(x, num_clients: int):
    """``x`` with its finite entries beyond the ring's range (``LIMIT / J``) as the infinities of
    their sign: for a term whose huge values mean infinite (a divergent trajectory's energies),
    chosen by the algorithm that sends it, so that :func:`encode_message` need not refuse them."""
    import jax.numpy as jnp

    bound = LIMIT / max(int(num_clients), 1)
    return jnp.where(jnp.isfinite(x) & (jnp.abs(x) >= bound), jnp.sign(x) * jnp.inf, x)


def _dtype(leaf) -> np.dtype:
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _real(leaf) -> bool:
    return _dtype(leaf).kind not in "biu"


def _leaves(message) -> List[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(message)]


def word_count(message) -> int:
    """The ``uint64`` words of one client's encoded ``message``: two per real entry (value and
    special-value count), one per integer entry."""
    return sum(int(np.size(x)) * (2 if _real(x) else 1) for x in jax.tree_util.tree_leaves(message))


def encode_message(message: Any, num_clients: int) -> np.ndarray:
    """One client's message pytree as ``uint64`` words (see the module docstring): the leaves in
    flattening order, each real leaf as its fixed-point values then its special-value counts."""
    base = np.uint64(int(num_clients) + 1)
    bound = LIMIT / max(int(num_clients), 1)
    parts = []
    for path, x in jax.tree_util.tree_flatten_with_path(message)[0]:
        x = np.asarray(x)
        if not _real(x):
            parts.append(np.ravel(x).astype(np.int64).view(np.uint64))
            continue
        x = np.ravel(x).astype(np.float64)
        big = np.isfinite(x) & (np.abs(x) >= bound)
        if np.any(big):
            raise OutOfRangeError(
                f"secure aggregation: field {jax.tree_util.keystr(path)} holds {np.max(np.abs(x[big])):.3g}, beyond "
                f"the {bound:.3g} a term of {num_clients} clients' fixed-point sum may reach (2**39 / J): it cannot be "
                f"summed by masking. Rescale the model (its parameters or data), or sum without masking")
        nan, high, low = np.isnan(x), x == np.inf, x == -np.inf
        plain = np.where(nan | high | low, 0.0, x)
        parts.append(np.round(plain * _SCALE).astype(np.int64).view(np.uint64))
        parts.append(high.astype(np.uint64) + low.astype(np.uint64) * base + nan.astype(np.uint64) * base * base)
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def decode_message(total: np.ndarray, like: Any, num_clients: int) -> Any:
    """The sum (modulo ``2**64``) of :func:`encode_message` words back in the structure of
    ``like``: integer and boolean leaves as counts (``int32``), real leaves in ``like``'s dtype."""
    base = int(num_clients) + 1
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out, at = [], 0
    for leaf in leaves:
        shape = tuple(np.shape(leaf))
        size = int(np.prod(shape, dtype=np.int64))
        words = np.asarray(total[at:at + size], np.uint64)
        at += size
        if not _real(leaf):
            out.append(words.view(np.int64).astype(np.int32).reshape(shape))
            continue
        value = words.view(np.int64).astype(np.float64) / _SCALE
        counts = np.asarray(total[at:at + size], np.uint64).astype(np.int64)
        at += size
        high, low, nan = counts % base, (counts // base) % base, counts // (base * base)
        value = np.where(high > 0, np.inf, value)
        value = np.where(low > 0, -np.inf, value)
        value = np.where((nan > 0) | ((high > 0) & (low > 0)), np.nan, value)
        out.append(value.astype(_dtype(leaf)).reshape(shape))
    return jax.tree_util.tree_unflatten(treedef, out)


def fixed_point_sum(stacked: Any) -> Any:
    """The sum over the leading (client) axis of every leaf of ``stacked``, as the masked
    protocol decodes it: each client's message encoded, the words added modulo ``2**64``, the
    total decoded (in the dtypes ``jnp.sum`` gives: counts for integer and boolean leaves)."""
    leaves = _leaves(stacked)
    num = leaves[0].shape[0]
    rows = [encode_message(jax.tree_util.tree_map(lambda x: np.asarray(x)[j], stacked), num) for j in range(num)]
    like = jax.tree_util.tree_map(lambda x: np.zeros(np.shape(x)[1:], _sum_dtype(x)), stacked)
    return decode_message(np.sum(rows, axis=0, dtype=np.uint64), like, num)


def _sum_dtype(x) -> np.dtype:
    return np.dtype(np.int32) if not _real(x) else _dtype(x)


def sums_like(stacked: Any) -> Tuple:
    """Shape structs of :func:`fixed_point_sum`'s result."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], _sum_dtype(x)), stacked)

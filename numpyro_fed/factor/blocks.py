"""Block-diagonal local latents: the structure integrated Laplace exploits (issue 27 item 1).

Given the global sites, a client's local latents in a plate are usually conditionally
independent across the plate's entries (a random intercept per child, a group effect per
ward), so the Hessian of ``v -> log p(y_j, v | u)`` is block diagonal: block ``k`` holds the
entries of every local site at plate index ``k``. :func:`local_blocks` proposes the blocks
from the client's layout (every local site must lie in the same plate, the row plate or one
group plate); :func:`blocks_hold` verifies the proposal on a client's own rows at a random
point (one exact Hessian-vector product against the block product), because a model may
couple the entries (a random walk over the plate) and the layout cannot see that.

With blocks of size ``b``, the Hessian costs ``b`` Hessian-vector products (one probe sums
the ``j``-th entry of every block, Curtis-Powell-Reid colouring) instead of ``n``, and a
Newton step, a solve and a log-determinant cost ``K`` small ``b x b`` factorisations, so
integrated Laplace is linear in the number of local latents.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._structure import SiteLayout
from .._typing import Array

__all__ = ["BLOCK_TOL", "block_hessian", "block_logdet", "block_solve", "blocks_hold", "local_blocks",
           "scatter_blocks"]

BLOCK_TOL = 1e-4  # relative disagreement of an exact Hessian-vector product with the block product


def local_blocks(layout: SiteLayout) -> Optional[np.ndarray]:
    """``(K, b)`` integer array: the flat coordinates of block ``k`` (index ``k`` along a
    plate every local site is in; the plate with the most entries if several), or ``None``
    when the layout proposes no blocks (a local site outside every shared plate, or a plate
    of one entry)."""
    if not layout.names or not layout.plate_axes:
        return None
    shared = set.intersection(*({p for p, _ in axes} for axes in layout.plate_axes))
    best = None
    for plate in shared:
        axes = [dict(site)[plate] for site in layout.plate_axes]
        sizes = {shape[axis] for shape, axis in zip(layout.shapes, axes)}
        if len(sizes) == 1 and (best is None or sizes.copy().pop() > best[0]):
            best = (sizes.pop(), axes)
    if best is None or best[0] < 2:
        return None
    K, axes = best
    parts, offset = [], 0
    for shape, axis in zip(layout.shapes, axes):
        idx = np.arange(int(np.prod(shape))).reshape(shape) + offset
        parts.append(np.moveaxis(idx, axis, 0).reshape(K, -1))
        offset += idx.size
    return np.concatenate(parts, axis=1)


def block_hessian(f: Callable, v: Array, index: Array) -> Array:
    """``(K, b, b)`` diagonal blocks of ``f``'s Hessian at ``v``, from ``b`` Hessian-vector
    products (exact when the Hessian is block diagonal in ``index``'s blocks)."""
    grad = jax.grad(f)

    def column(j):
        probe = jnp.zeros_like(v).at[index[:, j]].set(1.0)
        return jax.jvp(grad, (v,), (probe,))[1][index]  # (K, b): row i of block k, column j

    cols = jax.vmap(column)(jnp.arange(index.shape[1]))  # (b, K, b)
    h = jnp.transpose(cols, (1, 2, 0))
    return (h + jnp.swapaxes(h, 1, 2)) / 2


def scatter_blocks(values: Array, index: Array, n: int) -> Array:
    """The flat vector (or ``(n, m)`` matrix) whose rows ``index[k, i]`` are ``values[k, i]``."""
    return jnp.zeros((n,) + values.shape[2:], values.dtype).at[index].set(values)


def block_solve(h: Array, rhs: Array, index: Array) -> Array:
    """``H^-1 rhs`` for block-diagonal ``H`` (blocks ``h``); ``rhs`` is ``(n,)`` or ``(n, m)``."""
    sol = jax.vmap(jnp.linalg.solve)(h, rhs[index] if rhs.ndim == 2 else rhs[index][..., None])
    return scatter_blocks(sol if rhs.ndim == 2 else sol[..., 0], index, rhs.shape[0])


def block_logdet(h: Array):
    """``(sign, log|det H|)`` of a block-diagonal matrix: sign +1 only if every block's is."""
    sign, logdet = jax.vmap(jnp.linalg.slogdet)(h)
    return jnp.where(jnp.all(sign > 0), 1.0, -1.0), jnp.sum(logdet)


def blocks_hold(f: Callable, v: Array, index: Array, probe: Array) -> Array:
    """Whether ``f``'s Hessian at ``v`` is block diagonal in ``index``'s blocks, as far as
    one exact Hessian-vector product along the random ``probe`` can tell."""
    exact = jax.jvp(jax.grad(f), (v,), (probe,))[1]
    h = block_hessian(f, v, index)
    product = scatter_blocks(jnp.einsum("kij,kj->ki", h, probe[index]), index, v.shape[0])
    scale = 1.0 + jnp.max(jnp.abs(exact))
    return jnp.all(jnp.isfinite(exact)) & (jnp.max(jnp.abs(exact - product)) <= BLOCK_TOL * scale)

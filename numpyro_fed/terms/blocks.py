"""Block-diagonal local latents: the structure integrated Laplace exploits.

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

from .._typing import Array
from ..model.structure import SiteLayout

__all__ = ["BLOCK_TOL", "QUADRATURE_NODES", "block_hessian", "block_logdet", "block_solve", "blocks_hold",
           "local_blocks", "quadrature_correction", "scatter_blocks"]

BLOCK_TOL = 1e-4  # relative disagreement of an exact Hessian-vector product with the block product
# Gauss-Hermite nodes per dimension of a block (a product grid; blocks of more than three
# coordinates keep the Laplace term alone). 15 for one dimension: on the six-cities GLMM
# (random intercepts of four binary rows) 9 nodes leave beta0 0.2 NUTS sds off, 15 and 25
# agree to 0.01 sd.
QUADRATURE_NODES = {1: 15, 2: 7, 3: 4}
PATH_NODES = 4  # Gauss-Legendre nodes of the path integral that gives each block's value


def local_blocks(layout: SiteLayout) -> Optional[np.ndarray]:
    """``(K, b)`` integer array: the flat coordinates of block ``k`` (index ``k`` along a
    plate every local site is in; the plate with the most entries if several), or ``None``
    when the layout proposes no blocks (a local site outside every shared plate, or a plate
    of one entry). A client with at most three local coordinates and no such plate (a
    group's own effect) is one block of all of them: trivially block diagonal, and its
    integral gets the quadrature correction."""
    if not layout.names:
        return None
    total = int(sum(int(np.prod(shape)) for shape in layout.shapes))
    single = np.arange(total)[None, :] if 0 < total <= max(QUADRATURE_NODES) else None
    if not layout.plate_axes:
        return single
    shared = set.intersection(*({p for p, _ in axes} for axes in layout.plate_axes))
    best = None
    for plate in shared:
        axes = [dict(site)[plate] for site in layout.plate_axes]
        sizes = {shape[axis] for shape, axis in zip(layout.shapes, axes)}
        if len(sizes) == 1 and (best is None or sizes.copy().pop() > best[0]):
            best = (sizes.pop(), axes)
    if best is None or best[0] < 2:
        return single
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


def _quadrature_rule(b: int):
    """Product Gauss-Hermite rule for ``N(0, I_b)``: nodes ``(Q^b, b)`` and log weights summing to 1."""
    z, w = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES[b])
    w = w / w.sum()
    grid = np.stack(np.meshgrid(*[z] * b, indexing="ij"), -1).reshape(-1, b)
    log_w = np.sum(np.log(np.stack(np.meshgrid(*[w] * b, indexing="ij"), -1).reshape(-1, b)), 1)
    return grid, log_w


def quadrature_correction(f: Callable, v: Array, index: Array) -> Array:
    """``sum_k log(∫ exp f_k / Laplace_k)``: what adaptive Gauss-Hermite quadrature adds to the
    Laplace approximation of ``log ∫ exp f(v) dv`` for a block-separable ``f = sum_k f_k(v_k)``
    (Liu & Pierce, 1994; lme4's ``nAGQ``), 0 where every ``f_k`` is quadratic.

    ``v``: the mode of ``f``; ``-f``'s Hessian blocks there (:func:`block_hessian`) place the
    nodes. Node ``z_q`` of block ``k`` sits at ``v_k + L_k^-T z_q`` (``h_k = L_k L_k^T``).
    The model is one scalar function, so block ``k``'s own value ``f_k(v_k + δ_k) - f_k(v_k)``
    is the path integral ``∫_0^1 ∇_k f(v + t δ) · δ_k dt`` (Gauss-Legendre, :data:`PATH_NODES`
    nodes): every block moves at once and, the gradient of block ``k`` depending on ``v_k``
    only, one gradient gives all ``K`` values. Cost: ``Q^b x PATH_NODES`` gradients, whatever
    ``K``; with at most :data:`PATH_NODES` blocks (a client's own few local latents), each
    block's value is ``f`` with that block alone moved, ``Q^b x K`` evaluations instead. Blocks
    of more than three coordinates: 0 (the Laplace term alone)."""
    b = index.shape[1]
    if b not in QUADRATURE_NODES:
        return jnp.zeros((), v.dtype)
    nodes, log_p = _quadrature_rule(b)
    t, w = np.polynomial.legendre.leggauss(PATH_NODES)
    t, w = jnp.asarray((t + 1) / 2, v.dtype), jnp.asarray(w / 2, v.dtype)
    grad = jax.grad(f)
    chol = jnp.linalg.cholesky(-block_hessian(f, v, index))  # (K, b, b)
    # L_k^-1 once (K small triangular solves), not one batch of solves per node
    eye = jnp.eye(b, dtype=v.dtype)
    inv = jax.vmap(lambda c: jax.scipy.linalg.solve_triangular(c, eye, lower=True))(chol)

    def block_values(z):  # f_k(v_k + δ_k) - f_k(v_k) for every k, δ_k = L_k^-T z
        step = jnp.einsum("kji,j->ki", inv, z)  # (K, b)
        delta = scatter_blocks(step, index, v.shape[0])
        slopes = jax.vmap(lambda s: grad(v + s * delta))(t)  # (PATH_NODES, n)
        return jnp.sum((w @ slopes)[index] * step, axis=1)

    base = f(v)

    def moved_values(z):  # few blocks: f(v + δ_k) - f(v), block k alone moved, one value per block
        step = jnp.einsum("kji,j->ki", inv, z)  # (K, b)
        one = jnp.eye(index.shape[0], dtype=v.dtype)
        return jax.vmap(lambda e: f(v + scatter_blocks(step * e[:, None], index, v.shape[0])) - base)(one)

    nodes = jnp.asarray(nodes, v.dtype)
    # K values cost K evaluations, the path integral PATH_NODES gradients: direct where K is small
    values = jax.lax.map(moved_values if index.shape[0] <= PATH_NODES else block_values, nodes)  # (Q^b, K)
    terms = values + 0.5 * jnp.sum(nodes**2, 1)[:, None] + jnp.asarray(log_p, v.dtype)[:, None]
    return jnp.sum(jax.scipy.special.logsumexp(terms, axis=0))

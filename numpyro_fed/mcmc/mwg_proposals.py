"""The proposals of federated Metropolis-within-Gibbs's global moves (see
:mod:`~numpyro_fed.mcmc.mwg_algorithm`): the independence move's Student-t (of every global, or
of the scalar sites' block given the others) and its density, the random walk, the surrogate
transition's end point (:mod:`~numpyro_fed.mcmc.surrogate`) and the ridge move (a scale and the
effects it multiplies moved together, their product held). Pure functions of the server's
state; no randomness but the key they are given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax import random
from jax.scipy.special import gammaln

__all__ = ["RIDGE_SCALE", "T_DF", "T_SCALE", "block_chol", "block_conditional", "propose", "ridge_log_jacobian",
           "ridge_point", "t_log_prob"]

T_DF = 5.0  # the independence proposal's Student-t degrees of freedom (heavier tails than the posterior's)
T_SCALE = 1.1 * ((T_DF - 2.0) / T_DF) ** 0.5  # its scale: a covariance 1.1^2 times the posterior's
RIDGE_SCALE = 2.38  # the ridge move's step: this times the scale's posterior sd, over the root of the ridges' number


def _ridge_arrays(ridges, d, dtype):
    """``ridges`` (``((scale entry, (effect entries)), ...)``, static) as the scale entries and an
    ``(r, d)`` 0/1 matrix of each ridge's effects."""
    scalars = jnp.asarray([i for i, _ in ridges], jnp.int32)
    members = jnp.zeros((len(ridges), d), dtype)
    for r, (_, effects) in enumerate(ridges):
        members = members.at[r, jnp.asarray(effects)].set(1.0)
    return scalars, members


def ridge_point(key, s, ridges):
    """The ridge move's point from ``s.u``: each ridge's scale entry (a log scale) moves by ``delta_r``
    (normal, :data:`RIDGE_SCALE` times its posterior sd over ``sqrt(r)``) and the effects it multiplies
    by ``exp(-delta_r)``, so that their product, what the likelihood reads in a non-centred
    hierarchy, is held. The maps form a group (``delta`` and ``-delta`` are inverse and equally
    likely), so the move is exact by Metropolis-Hastings with their Jacobian
    (:func:`ridge_log_jacobian`) whatever the model."""
    d = s.u.shape[0]
    scalars, members = _ridge_arrays(ridges, d, s.u.dtype)
    sd = jnp.sqrt(jnp.sum(s.chol[scalars] ** 2, axis=1))
    delta = RIDGE_SCALE / len(ridges) ** 0.5 * sd * random.normal(key, (len(ridges),), s.u.dtype)
    return (s.u * jnp.exp(-(members.T @ delta))).at[scalars].add(delta)


def ridge_log_jacobian(u, point, ridges):
    """The log Jacobian of the ridge map from ``u`` to ``point``: ``-sum_r |effects_r| delta_r``."""
    scalars, members = _ridge_arrays(ridges, u.shape[0], u.dtype)
    return -jnp.sum(members.sum(1) * (point[scalars] - u[scalars]))


def t_log_prob(x, loc, chol, prec):
    """The proposal's Student-t log density (``T_DF`` degrees of freedom, scale ``T_SCALE chol``) at
    ``x`` (``(..., d)``), from the covariance's Cholesky factor ``chol`` and its inverse ``prec``:
    matrix products only (a batched triangular solve on XLA's CPU thread pool can deadlock)."""
    d = loc.shape[-1]
    diff = x - loc
    maha = jnp.einsum("...i,ij,...j->...", diff, prec, diff) / T_SCALE**2
    half_log_det = jnp.sum(jnp.log(jnp.abs(jnp.diag(chol)))) + d * jnp.log(T_SCALE)
    return (gammaln((T_DF + d) / 2) - gammaln(T_DF / 2) - d / 2 * jnp.log(T_DF * jnp.pi) - half_log_det
            - (T_DF + d) / 2 * jnp.log1p(maha / T_DF))


def block_conditional(s, small):
    """``(location, chol, prec)`` of the small sites' block given the others at ``s.u``: the
    proposal's Gaussian conditional (its precision is ``s.prec``'s block, the covariance's factor
    ``s.block_chol``, computed where the proposal is refreshed)."""
    lam_bb = s.prec[jnp.ix_(small, small)]
    shift = s.prec[small] @ (s.u - s.mean) - lam_bb @ (s.u[small] - s.mean[small])  # Lambda_BA (u_A - mu_A)
    loc = s.mean[small] - s.block_chol @ (s.block_chol.T @ shift)
    return loc, s.block_chol, lam_bb


def block_chol(prec, small):
    """The Cholesky factor of the small sites' conditional covariance (``prec``'s block inverted)."""
    if not small:
        return jnp.zeros((0, 0), prec.dtype)
    idx = jnp.asarray(small)
    lam_bb = prec[jnp.ix_(idx, idx)]
    return jnp.linalg.cholesky(jnp.linalg.inv((lam_bb + lam_bb.T) / 2))


def propose(key, s, kind, surrogate, small=(), ridges=()):
    """``((candidates, d), diverged)``: independent draws of the Student-t (``kind`` 0), or one
    point in every row (only the first is decided on): the random walk's proposal (1), the end of
    the surrogate transition from ``s.u`` (2; ``surrogate``: ``(key, s) -> (point, diverged)``) or the
    ridge move's point (4, :func:`ridge_point`); or (3) independent draws of the small sites' block
    given the others (:func:`block_conditional`), the others as they are."""
    n, d = s.proposal.shape
    k_t, k_w, k_s = random.split(key, 3)
    t = dist.MultivariateStudentT(T_DF, s.mean, T_SCALE * s.chol).sample(k_t, (n,))
    if small:
        loc, b_chol, _ = block_conditional(s, jnp.asarray(small))
        block = dist.MultivariateStudentT(T_DF, loc, T_SCALE * b_chol).sample(k_t, (n,))
        t = jnp.where(kind == 3, jnp.broadcast_to(s.u, (n, d)).at[:, jnp.asarray(small)].set(block), t)
    walk = s.u + jnp.exp(s.log_step) * (s.chol @ random.normal(k_w, (d,), s.u.dtype))
    if surrogate is None:
        point, diverged = walk, jnp.zeros((), bool)
    else:
        point, diverged = jax.lax.cond(kind == 2, surrogate, lambda k, st: (walk, jnp.zeros((), bool)), k_s, s)
    point = jnp.where(kind == 1, walk, point)
    if ridges:
        point = jnp.where(kind == 4, ridge_point(random.fold_in(k_w, 4), s, ridges), point)
    many = (kind == 0) | (kind == 3)
    return jnp.where(many, t, jnp.broadcast_to(point, (n, d))), diverged & (kind == 2)

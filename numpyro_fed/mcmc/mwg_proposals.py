"""The proposals of federated Metropolis-within-Gibbs's global moves (see
:mod:`~numpyro_fed.mcmc.mwg_algorithm`): the independence move's Student-t (of every global, or
of the scalar sites' block given the others) and its density, the random walk, and the surrogate
transition's end point (:mod:`~numpyro_fed.mcmc.surrogate`). Pure functions of the server's
state; no randomness but the key they are given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax import random
from jax.scipy.special import gammaln

__all__ = ["T_DF", "T_SCALE", "block_chol", "block_conditional", "propose", "t_log_prob"]

T_DF = 5.0  # the independence proposal's Student-t degrees of freedom (heavier tails than the posterior's)
T_SCALE = 1.1 * ((T_DF - 2.0) / T_DF) ** 0.5  # its scale: a covariance 1.1^2 times the posterior's


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


def propose(key, s, kind, surrogate, small=()):
    """``((candidates, d), diverged)``: independent draws of the Student-t (``kind`` 0), or one
    point in every row (only the first is decided on): the random walk's proposal (1) or the end of
    the surrogate transition from ``s.u`` (2; ``surrogate``: ``(key, s) -> (point, diverged)``); or
    (3) independent draws of the small sites' block given the others (:func:`block_conditional`), the others
    as they are."""
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
    many = (kind == 0) | (kind == 3)
    return jnp.where(many, t, jnp.broadcast_to(point, (n, d))), diverged & (kind == 2)

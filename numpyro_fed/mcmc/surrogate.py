"""The global move that spends rounds only on the likelihood: a surrogate transition corrected by
delayed acceptance.

The server holds the exact prior ``p(u)`` and a quadratic surrogate ``S(u)`` of the clients'
summed log-likelihood (its value, gradient and curvature at an anchor). It moves ``u`` by
Hamiltonian Monte Carlo on ``p(u) exp(S(u))`` alone, with no communication: a trajectory of
leapfrog steps in the coordinates the proposal's scale whitens, accepted or not by its own
Metropolis-Hastings test on that surrogate target (stage one). The end point is then sent to the
clients once, and accepted with probability

.. math:: \\min\\{1, \\exp([\\ell(u') - \\ell(u)] - [S(u') - S(u)])\\}

where ``ell`` is the clients' summed exact term (stage two). Because the stage-one kernel is
reversible with respect to ``p exp(S)``, the two stages together are reversible with respect to
``p exp(ell)``, the pooled posterior, whatever the surrogate (Liu, 2001, *Monte Carlo Strategies in
Scientific Computing*, the surrogate transition method; Christen and Fox, 2005, "Markov chain Monte
Carlo using an approximation", JCGS 14(4); Sherlock, Golightly and Henderson, 2017, "Adaptive,
delayed-acceptance MCMC for targets with expensive likelihoods", JCGS 26(2), arXiv:1509.00172). The
surrogate only decides how often stage two accepts. The hard geometry of a model (a shrinkage prior,
a hierarchy's scale against its effects, many dimensions) lives in the prior, which the trajectory
follows exactly, at no cost in rounds; the stage-two ratio only sees the surrogate's error between
two nearby points, so its acceptance falls polynomially with the dimension, not exponentially as an
importance-sampling or independence proposal's does.

The surrogate starts as the one a Laplace fit implies (its mode and covariance with the prior's own
curvature there) and is refitted during warmup to where the chains are: in warmup each client also
returns the gradient of its term at the point it evaluated, and at the ends of warmup's windows the
server fits the quadratic whose gradient best matches the summed gradients at every point so far
(least squares, shrunk toward the last surrogate: :func:`refit`). A Laplace fit's quadratic is
exact at the mode only; in a few hundred dimensions its error between two points of the posterior's
bulk (the posterior's skew) makes stage two reject most moves, while the fitted quadratic is right
on average where the chain moves. The surrogate, the trajectory's metric and its step are fixed
when warmup ends, so the kept draws come from a fixed, exact kernel.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from ..run.steps import leapfrog

__all__ = ["MAX_DELTA_ENERGY", "SHRINK_POINTS", "Surrogate", "accumulate", "laplace_surrogate", "metric", "refit",
           "surrogate_move", "surrogate_value"]

MAX_DELTA_ENERGY = 1000.0
"""A trajectory whose energy error exceeds this diverged (NumPyro's threshold): its end point is
rejected at stage one and the iteration is counted as divergent."""
SHRINK_POINTS = 10.0
"""The refitted surrogate's curvature is shrunk toward the last one as if by this many points."""
STEP_JITTER = 0.2  # the step is the set step times a uniform draw in [0.8, 1.2] (drawn apart from the state)


class Surrogate(NamedTuple):
    """``S(u) = g . (u - a) - (u - a)^T P (u - a) / 2``: the summed log-likelihood's quadratic
    surrogate (up to a constant) about the anchor ``a``."""

    anchor: jax.Array  # (d,)
    grad: jax.Array  # (d,)
    prec: jax.Array  # (d, d), positive semi-definite


def laplace_surrogate(log_prior: Callable, mode, cov) -> Surrogate:
    """The likelihood's surrogate that a Laplace fit ``N(mode, cov)`` of the posterior implies with
    the exact prior: at the mode the likelihood's gradient cancels the prior's, and its curvature is
    the posterior's precision less the prior's (its negative eigenvalues, where the prior is more
    curved there than the fit, set to zero)."""
    mode = jnp.asarray(mode)
    g_prior = jax.grad(log_prior)(mode)
    h_prior = jax.hessian(log_prior)(mode)
    cov = (cov + cov.T) / 2
    prec = jnp.linalg.inv(cov) + (h_prior + h_prior.T) / 2
    lam, vec = jnp.linalg.eigh((prec + prec.T) / 2)
    prec = (vec * jnp.maximum(lam, 0.0)) @ vec.T
    ok = jnp.all(jnp.isfinite(prec)) & jnp.all(jnp.isfinite(g_prior))
    return Surrogate(mode, jnp.where(ok, -g_prior, 0.0), jnp.where(ok, prec, 0.0))


def surrogate_value(sur: Surrogate, u):
    """``S(u)``."""
    x = u - sur.anchor
    return sur.grad @ x - 0.5 * x @ (sur.prec @ x)


def surrogate_move(key, log_prior: Callable, sur: Surrogate, u, chol, log_eps, steps: int, free=None):
    """One stage-one transition from ``u``: Hamiltonian Monte Carlo on ``p(u) exp(S(u))`` in the
    coordinates ``chol`` whitens (``steps`` leapfrog steps of ``exp(log_eps)`` times a jitter),
    with its Metropolis-Hastings test; ``free``: ``(d,)`` the entries it moves (the others held:
    ``chol`` must not mix them, :func:`metric`). Returns ``(u', moved, divergent)``."""
    k_p, k_a, k_e = random.split(key, 3)

    def potential(z):
        x = u + chol @ z
        return -(log_prior(x) + surrogate_value(sur, x))

    free = jnp.ones(u.shape, bool) if free is None else free
    grad = lambda z: jnp.where(free, jax.grad(potential)(z), 0.0)  # noqa: E731
    z0 = jnp.zeros_like(u)
    p0 = jnp.where(free, random.normal(k_p, u.shape, u.dtype), 0.0)
    eps = jnp.exp(log_eps) * random.uniform(k_e, (), u.dtype, 1.0 - STEP_JITTER, 1.0 + STEP_JITTER)

    z1, p1 = leapfrog(grad, z0, p0, eps, steps)
    delta = potential(z1) - potential(z0) + 0.5 * (p1 @ p1 - p0 @ p0)  # the energy error
    delta = jnp.where(jnp.isfinite(delta), delta, jnp.inf)
    divergent = delta > MAX_DELTA_ENERGY
    take = (jnp.log(random.uniform(k_a, (), u.dtype)) < -delta) & ~divergent
    return jnp.where(take, u + chol @ z1, u), take, divergent


# ---------------------------------------------------------------------- refitting in warmup
def _psd(m):
    m = (m + m.T) / 2
    lam, vec = jnp.linalg.eigh(m)
    return (vec * jnp.maximum(lam, 0.0)) @ vec.T


def accumulate(stats, x, g, origin, take):
    """The regression's sums with one more point ``x`` and its summed gradient ``g`` (where
    ``take``): ``(count, sum x, sum g, sum x x^T, sum g x^T)`` about ``origin``, flattened."""
    d = x.shape[0]
    x = x - origin
    add = jnp.concatenate([jnp.ones(1, x.dtype), x, g, jnp.outer(x, x).ravel(), jnp.outer(g, x).ravel()])
    return jnp.where(take & jnp.all(jnp.isfinite(add)), stats + add, stats) if d else stats


def refit(stats, sur: Surrogate, origin) -> Surrogate:
    """The quadratic whose gradient ``b - P (x - a)`` best fits the gradients summed in ``stats``
    (least squares over the points, ``a`` their mean and ``b`` their gradients' mean), ``P`` shrunk
    toward ``sur.prec`` as by :data:`SHRINK_POINTS` points and its negative eigenvalues set to zero.
    Where no point was taken, ``sur`` as it is."""
    d = sur.anchor.shape[0]
    n = stats[0]
    sx, sg = stats[1:1 + d], stats[1 + d:1 + 2 * d]
    sxx = stats[1 + 2 * d:1 + 2 * d + d * d].reshape(d, d)
    sgx = stats[1 + 2 * d + d * d:].reshape(d, d)
    m = jnp.maximum(n, 1.0)
    mx, mg = sx / m, sg / m
    cxx = sxx - m * jnp.outer(mx, mx)  # the centred sums
    cgx = sgx - m * jnp.outer(mg, mx)
    lam = SHRINK_POINTS * jnp.trace(cxx) / (m * d)
    prec = _psd(jnp.linalg.solve((cxx + lam * jnp.eye(d, dtype=cxx.dtype)).T, (lam * sur.prec - cgx).T).T)
    new = Surrogate(origin + mx, mg, prec)
    ok = (n > 1) & (lam > 0) & jnp.all(jnp.isfinite(prec)) & jnp.all(jnp.isfinite(mg))
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, sur)


def metric(log_prior: Callable, sur: Surrogate, chol, free=None):
    """The trajectory's metric: the lower Cholesky factor of the inverse of the surrogate target's
    curvature at the surrogate's anchor (the prior's and the surrogate's), over the ``free``
    entries given the others (those held: the identity, unmixed); ``chol`` where that is not
    positive definite."""
    h = _psd(-jax.hessian(log_prior)(sur.anchor)) + sur.prec
    if free is not None:
        both = free[:, None] & free[None, :]
        h = jnp.where(both, h, jnp.eye(h.shape[0], dtype=h.dtype))
    new = jnp.linalg.cholesky(jnp.linalg.inv(h))
    return jnp.where(jnp.all(jnp.isfinite(new)), new, chol)

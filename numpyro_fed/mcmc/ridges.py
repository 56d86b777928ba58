"""Which scales and effects federated Metropolis-within-Gibbs moves together (its ridge move).

In a non-centred hierarchy, ``effect = scale * z`` with ``z ~ Normal(0, 1)``, the likelihood reads
only the product: where the data pin the effects, the posterior of ``(log scale, z)`` is a curved
ridge, ``z`` proportional to ``1 / scale``, which moves of ``z`` and of the scale one at a time (or
a Gaussian proposal) cross slowly. The ridge move (:func:`~numpyro_fed.mcmc.mwg_proposals.ridge_point`)
follows it: the scale by ``delta``, ``z`` by ``exp(-delta)``, the product held. It is exact for
any pairing (a Metropolis-Hastings move with its Jacobian), so the pairing only decides where
rounds are spent: :func:`ridge_pairs` pairs a scalar global site with a vector global site where
the likelihood is flat along that orbit at the start, i.e. where the clients' terms' curvature
along it there (from the posterior's curvature, the Laplace fit's, less the prior's, which the
server computes itself, with the terms' gradient, minus the prior's at a mode, for the orbit's bend)
is under :data:`RIDGE_FLAT` of the posterior's. The model is not read: a scale that
multiplies the effects passes, a noise scale or an intercept does not. The move is the
transformation group move of Liu and Sabatti (2000), "Generalised Gibbs sampler and multigrid
Monte Carlo for Bayesian computation", Biometrika 87(2), and the interweaving of centred and
non-centred forms of Yu and Meng (2011), "To center or not to center: that is not the question",
Journal of Computational and Graphical Statistics 20(3), as one move.
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RIDGE_FLAT", "ridge_pairs"]

RIDGE_FLAT = 0.1
"""A scalar and a vector site are paired where the likelihood's curvature along their orbit at the
start is under this fraction of the posterior's there."""


def ridge_pairs(shapes: Sequence[Tuple[int, ...]], log_prior: Callable, mean, cov) -> tuple:
    """``((scale entry, (effect entries)), ...)``: for each scalar site (one unconstrained entry), the
    vector sites (two or more entries) whose orbit ``(u_i + delta, u_J exp(-delta))`` the likelihood is
    flat along at ``mean`` (see the module docstring); ``()`` where none. ``cov``: the posterior's
    covariance there (a Laplace fit's); ``log_prior``: the server's exact prior of the flat globals."""
    mean = np.asarray(mean, np.float64)
    sizes = [int(np.prod(s, dtype=int)) for s in shapes]
    starts = np.cumsum([0] + sizes)
    scalars = [int(starts[k]) for k, n in enumerate(sizes) if n == 1]
    vectors = [np.arange(starts[k], starts[k] + n) for k, n in enumerate(sizes) if n >= 2]
    if not scalars or not vectors:
        return ()
    post = np.linalg.inv(np.asarray(cov, np.float64))
    post = (post + post.T) / 2
    at = jnp.asarray(mean, jnp.result_type(float))
    prior = -np.asarray(jax.hessian(log_prior)(at), np.float64)
    slope = np.asarray(jax.grad(log_prior)(at), np.float64)
    lik = post - (prior + prior.T) / 2  # minus the clients' terms' Hessian
    pairs = []
    for i in scalars:
        effects = []
        for J in vectors:
            v = np.zeros_like(mean)
            v[i], v[J] = 1.0, -mean[J]  # the orbit's tangent; its second derivative is u_J on J
            along = float(v @ post @ v)  # the posterior's curvature along the orbit (at a mode)
            # the terms' curvature along the (curved) orbit: v' H v + grad . u_J, their gradient at a mode
            # minus the prior's
            flat = float(v @ lik @ v) + float(slope[J] @ mean[J])
            if np.isfinite(along) and along > 0 and flat <= RIDGE_FLAT * along:
                effects.extend(int(j) for j in J)
        if effects:
            pairs.append((i, tuple(effects)))
    return tuple(pairs)

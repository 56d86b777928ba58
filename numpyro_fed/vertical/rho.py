"""How far the augmented-variable posterior is from the true model's, and the rho that would do.

In the augmented form (Hassan et al. (2024) §3.2) each contribution ``g_j`` is replaced by
``z_j ~ N(g_j, rho^2)``, so the likelihood sees the true linear predictor plus noise of
variance ``J rho^2``. For a Gaussian likelihood with noise sd ``sigma`` this is exact
algebra: ``y ~ N(sum_j g_j, sigma^2 + J rho^2)``, so the noise variance the model learns is
off by ``J rho^2`` and every coefficient's posterior sd is inflated by
``sqrt(1 + J rho^2 / sigma^2)``. In general the extra predictor noise, relative to the
likelihood's own, is

.. math::

    e = J \\rho^2 \\, \\bar c, \\qquad
    \\bar c = \\frac{1}{n} \\sum_i -\\frac{\\partial^2 \\log p(y_i \\mid \\eta_i)}{\\partial \\eta_i^2}

(the mean curvature of the log-likelihood in the predictor ``eta = sum_j z_j``, ``1 /
sigma^2`` for a Gaussian, ``p (1 - p)`` for a Bernoulli). The likelihood's own scale then
moves by about ``e sqrt(n / 2)`` of its posterior sds (a variance estimated from n rows has
relative sd ``sqrt(2 / n)``), and slopes shrink or widen by a relative ``O(e)``, which is
``O(e sqrt(n))`` of their sds. The rule: keep ``e sqrt(n / 2) <= 0.3``, i.e.

.. math::

    \\rho \\le \\rho_{\\max} = \\sqrt{\\frac{0.3 \\sqrt{2 / n}}{J \\bar c}}.

It shrinks with ``n``: the augmented model is asymptotically exact only as ``rho -> 0``.
The server computes ``c̄`` from the likelihood it holds, at the fitted ``z`` (which crosses
in every iteration anyway).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RHO_SHIFT_LIMIT", "AugmentationCheck", "augmentation_check"]

RHO_SHIFT_LIMIT = 0.3
"""Largest shift, in posterior sds, that the augmentation may cause in the likelihood's scale."""


class AugmentationCheck(NamedTuple):
    """``excess``: ``J rho^2 c̄``; ``shift``: ``excess sqrt(n / 2)`` (sds); ``rho_max``: the
    largest rho within :data:`RHO_SHIFT_LIMIT`; ``curvature``: ``c̄``."""

    rho: float
    excess: float
    shift: float
    rho_max: float
    curvature: float

    @property
    def ok(self) -> bool:
        return self.shift <= RHO_SHIFT_LIMIT


def augmentation_check(log_lik, z, rho: float, num_rows: int) -> AugmentationCheck:
    """The check from the server's ``log_lik(z) -> log p(y | sum_j z_j, ...)`` (a function of
    the per-client ``z`` dict, separable over rows) at the fitted ``z``."""
    first = next(iter(z))

    def along_first(v):
        return log_lik({**z, first: v})

    # the Hessian in one client's z is diagonal (rows are independent): H 1 is its diagonal
    _, hvp = jax.jvp(jax.grad(along_first), (z[first],), (jnp.ones_like(z[first]),))
    curvature = float(jnp.mean(-hvp))
    J = len(z)
    excess = J * rho**2 * curvature
    shift = excess * np.sqrt(num_rows / 2.0)
    rho_max = float(np.sqrt(RHO_SHIFT_LIMIT * np.sqrt(2.0 / num_rows) / (J * curvature))) if curvature > 0 else np.inf
    return AugmentationCheck(float(rho), float(excess), float(shift), rho_max, curvature)

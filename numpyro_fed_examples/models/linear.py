"""Federated linear models of Yue et al. (2022): HM2 (§4, Example 4.1) and its variable-selection
form (§4.3). HM1 (§3) is an algorithm on a point estimate: :mod:`numpyro_fed.linear`."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_fed import local_site

__all__ = ["hm2_regression", "inclusion", "variable_selection"]

PRIORS = ("lasso", "ridge")


def hm2_regression(x, y, noise: Optional[float] = None):
    """HM2 of Yue et al. (2022) Example 4.1: one linear regression per device, tied by ``phi``.

    .. math::

        Y_k \\mid \\theta_k \\sim N(X_k \\theta_k, \\sigma_k^2 I),\\quad
        \\theta_k \\mid \\phi \\sim N(\\mu, \\mathrm{diag}(\\tau_1, \\ldots, \\tau_d)),\\quad
        \\mu \\sim N(0, I),\\quad \\tau_i \\sim \\log N(0, 1),

    ``phi = (mu, log tau)`` global (Gaussian prior in unconstrained space, as EP needs);
    ``theta_k`` (site ``theta``) and the noise scale ``sigma`` (``HalfNormal(1)``; or fixed
    ``noise``) are local to device k. ``x`` is (rows, d).
    """
    d = x.shape[-1]
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
    tau = numpyro.sample("tau", dist.LogNormal(0.0, 1.0).expand([d]).to_event(1))
    with local_site():
        theta = numpyro.sample("theta", dist.Normal(mu, jnp.sqrt(tau)).to_event(1))
        sigma = noise if noise is not None else numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ theta, sigma), obs=y)


def variable_selection(x, y, prior: str = "lasso"):
    """Federated penalised regression of Yue et al. (2022) §4.3 (Bayesian lasso / ridge on HM2).

    .. math::

        Y_k \\mid \\theta_k \\sim N(X_k \\theta_k, \\sigma^2 I),\\quad
        \\theta_{ki} \\mid \\phi \\sim \\pi(\\lambda, \\sigma^2),\\quad
        \\lambda \\sim \\log N(0, 1),\\quad \\sigma \\sim \\log N(0, 1),

    with ``pi`` a Laplace with zero mean and diversity ``sigma / lambda`` (``"lasso"``) or
    ``N(0, (sigma / lambda)^2)`` (``"ridge"``). ``phi = (log lambda, log sigma)`` is global
    and ``theta_k`` (site ``theta``) is local. Decide inclusion with :func:`inclusion`.
    """
    if prior not in PRIORS:
        raise ValueError(f"prior={prior!r}: choose one of {PRIORS}")
    d = x.shape[-1]
    lam = numpyro.sample("lam", dist.LogNormal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    base = dist.Laplace if prior == "lasso" else dist.Normal
    with local_site():
        theta = numpyro.sample("theta", base(0.0, sigma / lam).expand([d]).to_event(1))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ theta, sigma), obs=y)


def inclusion(draws, level: float = 0.9) -> np.ndarray:
    """Yue et al. (2022) §4.3's rule: include a coefficient unless its central ``level`` credible
    interval covers 0. ``draws`` has the draws on axis -2 (``(..., draws, d)``)."""
    lo, hi = np.quantile(np.asarray(draws), [(1 - level) / 2, (1 + level) / 2], axis=-2)
    return (lo > 0) | (hi < 0)

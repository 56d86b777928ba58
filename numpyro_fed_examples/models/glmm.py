"""Hierarchical models used in the Hassan et al. (2023) examples and the tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from numpyro_fed import local_site

__all__ = ["logistic_glmm", "normal_hierarchical"]


def logistic_glmm(wheeze, age, smoke, centered: bool = True):
    """Logistic mixed model of Hassan et al. (2023) S3.1 (six-cities wheeze data).

    .. math::

        y_{ij} \\sim \\mathrm{Bern}(\\mathrm{logit}^{-1}(\\beta_0 + \\beta_1 s_i + \\beta_2 a_{ij}
            + \\beta_3 s_i a_{ij} + b_i)),\\quad b_i \\mid \\omega \\sim N(0, e^{-2\\omega}),

    with ``beta_k ~ N(0, 10^2)`` and ``omega ~ N(0, 10^2)``. Rows are children: ``wheeze``
    and ``age`` are (children, 4), ``smoke`` is (children,). The random intercepts ``b``
    are local to the silo holding the child.

    With ``centered=False`` the same model is written with ``b_i = e^{-omega} eta_i``,
    ``eta_i ~ N(0, 1)`` (local site ``eta``; ``b`` is a deterministic site): the posterior
    of ``beta, omega`` is unchanged but a Gaussian variational family fits it far better.
    """
    beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([4]).to_event(1))
    omega = numpyro.sample("omega", dist.Normal(0.0, 10.0))
    with numpyro.plate("children", wheeze.shape[0]):
        with local_site():
            if centered:
                b = numpyro.sample("b", dist.Normal(0.0, jnp.exp(-omega)))
            else:
                eta = numpyro.sample("eta", dist.Normal(0.0, 1.0))
                b = numpyro.deterministic("b", jnp.exp(-omega) * eta)
        s = smoke[:, None]
        logits = beta[0] + beta[1] * s + beta[2] * age + beta[3] * s * age + b[:, None]
        numpyro.sample("wheeze", dist.Bernoulli(logits=logits).to_event(1), obs=wheeze)


def normal_hierarchical(y, tau0: float = 2.0, tau: float = 1.0, sigma: float = 1.0):
    """Normal-Normal hierarchy with known variances (exact Gaussian posterior).

    ``mu ~ N(0, tau0^2)``, group means ``b_i | mu ~ N(mu, tau^2)`` (local), and
    ``y_ik | b_i ~ N(b_i, sigma^2)``; ``y`` is (groups, observations per group).
    """
    mu = numpyro.sample("mu", dist.Normal(0.0, tau0))
    with numpyro.plate("groups", y.shape[0]):
        with local_site():
            b = numpyro.sample("b", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(b[:, None], sigma).to_event(1), obs=y)

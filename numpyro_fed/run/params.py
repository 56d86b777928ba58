"""Each family's fitted parameters, typed: what ``RunResult.params`` holds.

Every family's ``run`` returns one of these named tuples (a JAX pytree, so ``jax.tree_util``
and ``jax.device_get`` take it). The family's class names its type in ``params_type``.

| family | ``result.params`` |
| --- | --- |
| ``FederatedSVI`` (SFVI, SFVI-Avg, DP) | :class:`GuideParams` ``(guide, theta)`` |
| ``PVI``, ``BCM``, ``EP``, ``Laplace`` | :class:`GaussianParams` ``(mean, cov)`` |
| ``HM1`` | :class:`HM1Params` ``(theta, omega)`` |
| ``VerticalSVI``, ``VerticalSOUL`` | :class:`VerticalParams` ``(parties, server)`` |
| ``FederatedNUTS``, ``FederatedHMC``, MwG | :class:`DrawParams` ``(samples,)`` |

Example:
    >>> import jax.numpy as jnp
    >>> p = GaussianParams(mean=jnp.zeros(2), cov=jnp.eye(2))
    >>> p.mean.shape, p.cov.shape
    ((2,), (2, 2))
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import jax

__all__ = ["DrawParams", "GaussianParams", "GuideParams", "HM1Params", "VerticalParams"]



class GuideParams(NamedTuple):
    """SFVI and SFVI-Avg (with or without DP): ``guide`` is the global guide's parameters in
    its own unconstrained parametrisation; ``theta`` the global ``numpyro.param`` sites,
    constrained, as the model sees them."""

    guide: Dict[str, jax.Array]
    theta: Dict[str, jax.Array]


class GaussianParams(NamedTuple):
    """PVI, BCM, EP and the federated Laplace fit: the Gaussian approximation's moments over
    the flat unconstrained globals (``mean`` ``(d,)``, ``cov`` ``(d, d)``)."""

    mean: jax.Array
    cov: jax.Array


class HM1Params(NamedTuple):
    """HM1: ``theta`` ``(clients, p)`` (row k is client k's coefficients) and the
    between-client covariance ``omega`` ``(p, p)``, a point estimate."""

    theta: jax.Array
    omega: jax.Array


class VerticalParams(NamedTuple):
    """Vertical SFVI and SOUL: ``parties`` is ``{party: its parameters}`` (gathered by the
    simulation; over a network each party keeps its own and this is empty); ``server`` the
    server's (the response holder's). A party's ``numpyro.param`` sites (``"point"``) are
    constrained, as the model sees them."""

    parties: Dict[str, Any]
    server: Any
    _entries = "parties"


class DrawParams(NamedTuple):
    """Exact federated MCMC (NUTS, HMC, Metropolis-within-Gibbs): ``samples`` is ``{global
    site: draws}``, each ``(chains, samples, *site shape)``, constrained."""

    samples: Dict[str, jax.Array]
    _entries = "samples"

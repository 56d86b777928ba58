"""Federated expectation propagation (Yue et al. (2022) §4.2, Algorithms 2-3).

The global approximation ``q(phi) = p(phi) prod_k q_k(phi)`` over the model's global
latent sites (flat, unconstrained) has Gaussian factors in natural parameters
(``r_k = Sigma_k^-1 mu_k``, ``Q_k = Sigma_k^-1``: Lemma 1 makes products sums). In a round
every chosen device k

1. forms the cavity ``q_-k = q / q_k`` (eq. 3; ``r - r_k``, ``Q - Q_k``),
2. computes the mean and covariance of the tilted distribution
   ``q_\\k(phi) ∝ f_k(phi) q_-k(phi)`` (eq. 4) with its local latents integrated out,
   by Laplace, NUTS or Gaussian VI (:mod:`~numpyro_fed.terms.tilted`),
3. moment-matches ``q_new`` to it (eq. 5) and sends the single message
   ``Delta q_k = q_new / q`` (eq. 6; ``Delta r_k``, ``Delta Q_k``).

The server multiplies the changes in (eq. 7). Damping, the PD safeguard, acknowledgement,
dropout and the schedules are shared with PVI (:func:`~numpyro_fed.factor.updates.factor_protocol`):
with damping ``delta`` a device's factor moves by ``Delta q_k^delta`` (damped EP), and an
update that would leave ``Q`` not positive definite is halved and, failing that, rejected.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import random

from ..run.protocol import FederatedAlgorithm
from ..terms import gaussian as G
from ..terms.blocks import blocks_hold
from ..terms.gaussian import NaturalGaussian
from ..terms.tilted import TILTED_METHODS, gaussian_vi_moments, laplace_moments, moments_to_factor, nuts_moments
from .updates import factor_protocol

__all__ = ["ep", "local_update", "split_first_round", "tilted_moments"]


def tilted_moments(
    method: str, *, laplace_steps: int = 50, num_warmup: int = 500, num_samples: int = 500,
    optim: Any = None, vi_steps: int = 2000, num_particles: int = 8, diagonal: bool = False,
) -> Callable:
    """``(rng_key, log_lik, cavity, w0, d, index=None) -> (mean, cov, FitCheck)`` for
    ``method`` in ``"laplace"``, ``"nuts"``, ``"vi"`` (``index``: the local latents' blocks,
    used by ``"laplace"``)."""
    if method == "laplace":
        return lambda key, f, cav, w0, d, index=None: laplace_moments(f, cav, w0, d, key, steps=laplace_steps,
                                                                      index=index)
    if method == "nuts":
        return lambda key, f, cav, w0, d, index=None: nuts_moments(f, cav, w0, d, key, num_warmup=num_warmup,
                                                                   num_samples=num_samples)
    if method == "vi":
        return lambda key, f, cav, w0, d, index=None: gaussian_vi_moments(
            f, cav, w0, d, key, optim=optim, steps=vi_steps, num_particles=num_particles, diagonal=diagonal)
    raise ValueError(f"tilted={method!r}: choose one of {TILTED_METHODS}")


def local_update(client_log_lik: Callable, moments: Callable, num_local: int, d: int, diagonal: bool, index,
                 rng_key, cavity, q, data, kl_weight=1.0):
    """The client's EP update: the tilted distribution's moments (``moments``) from ``q``'s mean,
    as a Gaussian factor; with ``index`` (its local latents' Hessian blocks), verified on its own
    rows first (an invalid update, never a wrong one, where the blocks do not hold)."""
    del kl_weight
    start, _ = G.to_moments(q)  # q is always proper; the cavity need not be
    w0 = jnp.concatenate([start, jnp.zeros(num_local, start.dtype)])
    f = partial(client_log_lik, data=data)
    if index is None:
        mean, cov, check = moments(rng_key, f, cavity, w0, d)
        return moments_to_factor(mean, cov, diagonal), check
    k_point, k_probe, rng_key = random.split(rng_key, 3)
    v = random.normal(k_point, (num_local,), start.dtype)
    hold = blocks_hold(lambda x: f(jnp.concatenate([start, x])), v, index,
                       random.normal(k_probe, (num_local,), start.dtype))
    mean, cov, check = moments(rng_key, f, cavity, w0, d, index)
    mean = jnp.where(hold, mean, jnp.nan)  # coupled locals: an invalid update, never a wrong one
    return moments_to_factor(mean, cov, diagonal), check


def split_first_round(local: Callable, log_prior_factor: NaturalGaussian, num_clients: int) -> Callable:
    """A local update made under the split prior ``p^(1/J)`` (Tresp, 2000; Heikkilä et al.'s (2023)
    "BCM split"): in the first round the cavity is ``p``; the client fits under ``p^(1/J)``, i.e.
    against ``cavity - p^(1 - 1/J)``, and reports ``q_j + p^(1 - 1/J)``, so that its factor is
    ``q_j / p^(1/J)`` and the server's product is ``prod_j q_j``. PVI's and EP's local fits
    (with or without local latents) are wrapped by this one function."""
    rest = log_prior_factor.scale(1.0 - 1.0 / num_clients)

    def update(rng_key, cavity, q, data, kl_weight=1.0):
        new, check = local(rng_key, cavity - rest, q, data, kl_weight)
        return new + rest, check

    return update


def ep(
    log_prior_factor: NaturalGaussian,
    client_log_lik: Callable,
    num_clients: int,
    *,
    num_local: int = 0,
    moments: Callable = None,
    schedule: str = "sequential",
    damping: float = 1.0,
    max_halvings: int = 10,
    subset_size: int = 1,
    max_kl: Optional[float] = None,
    prior_site: Optional[Callable] = None,
    blocks: Optional[Any] = None,
    perturb: Optional[Callable] = None,
    trusted_aggregator: bool = False,
    split_prior: bool = False,
    aggregation: str = "trusted",
    variant: str = "plain",
    num_shards: int = 1,
) -> FederatedAlgorithm:
    """Build federated EP's pure functions.

    Args:
        log_prior_factor: ``p(phi)`` as a Gaussian factor (full or diagonal: the family).
        client_log_lik: ``(w, data) -> log p(y_j, v | u)`` for ``w = [u, v]`` (``u`` the
            global sites, ``v`` the client's ``num_local`` unconstrained local latents,
            Jacobians included); evaluated only by the client on its own data.
        num_local: size of ``v`` (0 without local latents).
        moments: a :func:`tilted_moments` estimator (default: Laplace).
        schedule: as in :func:`~numpyro_fed.factor.pvi_algorithm.pvi`.
        damping: as in :func:`~numpyro_fed.factor.pvi_algorithm.pvi`.
        max_halvings: as in :func:`~numpyro_fed.factor.pvi_algorithm.pvi`.
        subset_size: as in :func:`~numpyro_fed.factor.pvi_algorithm.pvi`.
        max_kl: optional trust region (see
            :func:`~numpyro_fed.factor.updates.factor_protocol`).
        prior_site: the server's step for a non-Gaussian prior's residual (see
            :mod:`~numpyro_fed.terms.prior_site`); ``log_prior_factor`` is then the prior's
            Gaussian part.
        blocks: ``(K, b)`` coordinates of ``v`` whose Hessian blocks are independent
            (:func:`~numpyro_fed.terms.blocks.local_blocks`). Each client verifies the
            structure on its own rows before each update (one exact Hessian-vector product at
            a random point, from its own key); where it fails the update is invalid (NaN),
            never computed on a wrong structure.
        perturb: update perturbation (Heikkilä et al. (2023) §4.2): the client's change in
            ``q(phi)``'s natural parameters is clipped and noised from its own key before it
            leaves (see :func:`~numpyro_fed.factor.updates.factor_protocol`). Only the global
            factor is released, so local latents, whose fit stays on the client, need no noise
            of their own: one row changes the clipped release by at most ``2C`` whatever the
            local fit did with it.
        trusted_aggregator: with ``perturb``: the noised changes are summed before the server
            (see :func:`~numpyro_fed.factor.updates.factor_protocol`).
        split_prior: the first round is a Bayesian committee machine with split prior
            (:func:`split_first_round`).
        aggregation: with ``trusted_aggregator``: ``"trusted"`` or ``"masking"`` (see
            :func:`~numpyro_fed.factor.updates.factor_protocol`).
        variant: ``"plain"``, or ``"virtual"``: ``num_shards`` shards per client, each fitted on
            its own rows against its own cavity (Heikkilä et al. (2023) Alg. 3; the local latents
            must each belong to one row). Not ``"local_averaging"``: its ``1/N`` weight on the KL
            does not split from the local sites of a joint fit.
        num_shards: shards per client for ``"virtual"``.

    References:
        Yue et al. (2022) (Algorithms 2 and 3); Vehtari et al. (2020), "Expectation propagation as
        a way of life".
    """
    moments = tilted_moments("laplace") if moments is None else moments
    # one trace of the model per shape: the estimators differentiate it to third order, and
    # jit lets JAX transform the traced program instead of re-running the model's Python
    client_log_lik = jax.jit(client_log_lik)
    local = partial(local_update, client_log_lik, moments, num_local, log_prior_factor.shift.shape[0],
                    log_prior_factor.diagonal, None if blocks is None else jnp.asarray(blocks))
    if split_prior:
        local = split_first_round(local, log_prior_factor, num_clients)
    return factor_protocol(
        log_prior_factor, local, num_clients, schedule=schedule, damping=damping,
        max_halvings=max_halvings, subset_size=subset_size, max_kl=max_kl, prior_site=prior_site,
        perturb=perturb, trusted_aggregator=trusted_aggregator, aggregation=aggregation, variant=variant,
        num_shards=num_shards,
    )

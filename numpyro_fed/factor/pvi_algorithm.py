"""Partitioned variational inference (PVI; Ashman et al., 2022; Heikkilä et al. (2023) §3.1, Algorithm 1).

The global approximation over the model's global latent sites (flat, unconstrained) is

.. math::

    q(\\theta) \\propto p(\\theta) \\prod_j t_j(\\theta),

with Gaussian factors stored in natural parameters, so ``q``'s natural parameters are the
prior's plus the sum of the clients' ``t_j``. In a round the server sends ``q``; every
asked client m forms the cavity ``q / t_m``, maximises its local ELBO

.. math::

    \\lambda^* = \\arg\\max_q \\; \\mathbb E_q[\\log p(x_m \\mid \\theta)]
        - \\mathrm{KL}(q \\,\\|\\, q / t_m)                     \\qquad (3.5)

and sends the single message ``Delta t_m = q^* / q`` (natural parameters; eq. 3.7). The
protocol around the local fit (schedules, damping, the PD safeguard, acknowledgement,
dropout) is :func:`~numpyro_fed.factor.updates.factor_protocol`, shared with EP.

Local updates:

- ``"conjugate"``: when ``log p(x_m | theta)`` is quadratic in ``theta`` (Gaussian
  likelihood, linear predictor) the optimum is closed-form: ``t_m`` is the likelihood
  itself (full covariance), or the mean-field projection of ``cavity * likelihood``;
- ``"optax"``: ``local_steps`` steps of an optax optimiser on a reparameterised Monte Carlo
  estimate of (3.5), starting from the current ``q``.

All functions are pure and jit-compatible.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import random

from ..dp.mechanisms import add_gradient, dp_sgd_transform, fixed_size_subset
from ..run.protocol import FederatedAlgorithm
from ..run.steps import carried_while
from ..terms import gaussian as G
from ..terms.gaussian import NaturalGaussian
from ..terms.tilted import FitCheck, convergence_stat
from .ep_algorithm import split_first_round
from .updates import factor_protocol

__all__ = ["LocalFit", "fit_local", "pvi"]


def _gaussian_params(q: NaturalGaussian):
    """``q`` as unconstrained optimiser parameters, and the map back to ``(loc, cov, root)``."""
    diagonal = q.diagonal
    mean, cov = G.to_moments(q)
    d = mean.shape[0]
    if diagonal:
        init = {"loc": mean, "scale": jnp.log(jnp.expm1(jnp.sqrt(cov)))}
    else:
        chol = jnp.linalg.cholesky(cov)
        diag = jnp.diag(chol)
        init = {"loc": mean, "scale": jnp.log(jnp.expm1(diag)), "lower": chol[jnp.tril_indices(d, -1)]}

    def moments(params):
        s = jax.nn.softplus(params["scale"])
        if diagonal:
            return params["loc"], s**2, s
        rows, cols = jnp.tril_indices(d, -1)
        tril = jnp.diag(s).at[rows, cols].set(params["lower"])
        return params["loc"], tril @ tril.T, tril

    return init, moments


def _draws(moments, params, eps):
    loc, _, root = moments(params)
    return loc + (eps * root if root.ndim == 1 else eps @ root.T)


def _optimise(init, moments, optim, steps, rng_key, gradient, max_chunks=1):
    """Optax steps from ``init`` in chunks of ``steps``; ``gradient(params, key) ->
    (objective, grads)``. After each chunk the fit is judged on that chunk
    (:func:`~numpyro_fed.terms.tilted.convergence_stat`: the objective's drift and the
    parameters' movement over its last two quarters); an unconverged fit runs another
    chunk, up to ``max_chunks`` (1 under DP-SGD, whose steps are accounted). Returns the
    Polyak average of the last chunk's final quarter as a Gaussian and its
    :class:`~numpyro_fed.terms.tilted.FitCheck` (``stat`` above 1: not converged)."""
    tail = max(steps // 4, 1)

    def step(carry, key):
        params, opt_state = carry
        value, grads = gradient(params, key)
        updates, opt_state = optim.update(grads, opt_state, params)
        params = jax.tree_util.tree_map(jnp.add, params, updates)
        loc, cov_, _ = moments(params)
        sd = jnp.sqrt(cov_ if cov_.ndim == 1 else jnp.diag(cov_))
        return (params, opt_state), (value, loc, sd, cov_)

    def chunk(carry):
        i, params, opt_state, key, _, _ = carry
        sub = jax.lax.cond(i == 0, lambda: key, lambda: random.fold_in(key, i))  # chunk 0: the key's own draws
        (params, opt_state), (values, locs, sds, covs) = jax.lax.scan(step, (params, opt_state),
                                                                        random.split(sub, steps))
        average = (jnp.mean(locs[-tail:], 0), jnp.mean(covs[-tail:], 0))
        return i + 1, params, opt_state, key, convergence_stat(values, locs, sds), average

    def more(carry):
        i, stat = carry[0], carry[4]
        return (i < max_chunks) & ~(stat <= 1.0)

    loc0, cov0, _ = moments(init)
    start = (0, init, optim.init(init), rng_key, jnp.full((), jnp.inf, loc0.dtype), (loc0, cov0))
    _, _, _, _, stat, (loc, cov_) = carried_while(more, chunk, start)
    return G.from_moments(loc, cov_), FitCheck(stat <= 1.0, stat, jnp.full((), jnp.nan, stat.dtype))


def _local_optax(log_lik, cavity: NaturalGaussian, q: NaturalGaussian, optim, steps, particles, rng_key,
                 kl_weight=1.0, max_chunks=1):
    """Maximise ``E_q[log_lik] - kl_weight KL(q || cavity)`` over ``q = N(loc, L L^T)`` from ``q``."""
    init, moments = _gaussian_params(q)
    d = q.shift.shape[0]

    def neg_elbo(params, key):
        loc, cov_, _ = moments(params)
        draws = _draws(moments, params, random.normal(key, (particles, d)))
        expected = jnp.mean(jax.vmap(log_lik)(draws))
        return -(expected - kl_weight * G.kl_divergence(G.from_moments(loc, cov_), cavity))

    return _optimise(init, moments, optim, steps, rng_key, jax.value_and_grad(neg_elbo), max_chunks)


def _local_dp_sgd(row_log_lik, data, cavity: NaturalGaussian, q: NaturalGaussian, optim, steps, particles, rng_key,
                  dp, kl_weight=1.0):
    """The local ELBO of :func:`_local_optax` maximised by DP-SGD (Heikkilä et al. (2023) §4.1, Theorem 6).

    Every step draws a fixed-size subset of ``dp.batch_size`` of the client's real rows
    without replacement (:func:`~numpyro_fed.dp.mechanisms.fixed_size_subset`), takes each
    row's gradient of ``-E_q[log p(y_i | theta)]`` by ``vmap`` over the rows, and hands the
    per-example gradients to optax's DP-SGD aggregation
    (:func:`~numpyro_fed.dp.mechanisms.dp_sgd_transform`: clipped over the whole pytree to
    ``dp.clip``, noise ``dp.noise_multiplier * clip`` on the sum, divided by the batch)
    seeded with the client's key; the mean is scaled to the client's ``n`` rows and the
    KL term's gradient, which does not touch the data, is added exactly after it. Then the
    caller's optimiser. The same draws ``eps`` as :func:`_local_optax` for the same key,
    so with the whole data in every batch, no noise and a large clip both are equal."""
    init, moments = _gaussian_params(q)
    d = q.shift.shape[0]
    size = dp.batch_size
    n = data.num_rows

    def kl(params):
        loc, cov_, _ = moments(params)
        return kl_weight * G.kl_divergence(G.from_moments(loc, cov_), cavity)

    def row_loss(params, row, eps):
        one = data._replace(args=jax.tree_util.tree_map(lambda x: x[None], row),
                            row_mask=jnp.ones(1, data.row_mask.dtype), num_rows=jnp.ones((), data.num_rows.dtype))
        return -jnp.mean(jax.vmap(lambda u: row_log_lik(u, one))(_draws(moments, params, eps)))

    chain = optax.chain(dp_sgd_transform(dp.clip, dp.noise_multiplier, random.fold_in(rng_key, 2)),
                        optax.scale(n), add_gradient(kl), optim)

    def gradient(params, key):
        eps = random.normal(key, (particles, d))
        rows = jax.tree_util.tree_map(lambda x: x[fixed_size_subset(random.fold_in(key, 1), data.row_mask, size)],
                                      data.args)
        values, per_example = jax.vmap(jax.value_and_grad(row_loss), in_axes=(None, 0, None))(params, rows, eps)
        return n * jnp.mean(values) + kl(params), per_example

    return _optimise(init, moments, chain, steps, rng_key, gradient)


class LocalFit(NamedTuple):
    """:func:`pvi`'s local fit settings, bound to :func:`fit_local`."""

    log_prior_factor: NaturalGaussian
    client_log_lik: Callable
    num_clients: int
    update: str
    optim: Any
    local_steps: int
    num_particles: int
    dp_sgd: Any
    split_prior: bool
    max_chunks: int


def fit_local(fit: LocalFit, rng_key, cavity: NaturalGaussian, q: NaturalGaussian, data, kl_weight=1.0):
    """``(q_j, check)``: the closed form for a conjugate model, else an optax (or DP-SGD) fit of
    the local ELBO, with the fit's own :class:`~numpyro_fed.terms.tilted.FitCheck`."""
    d = fit.log_prior_factor.shift.shape[0]

    def log_lik(u):
        return fit.client_log_lik(u, data)

    if fit.update == "conjugate":  # optimum: cavity * likelihood^(1 / kl_weight)
        hess = jax.hessian(log_lik)(jnp.zeros(d))
        exact = NaturalGaussian(jax.grad(log_lik)(jnp.zeros(d)), -(hess + hess.T) / 2).scale(1.0 / kl_weight)
        exact_fit = FitCheck(jnp.asarray(True), jnp.zeros(()), jnp.full((), jnp.nan))
        if fit.log_prior_factor.diagonal:  # mean-field optimum of KL(q || cavity * likelihood)
            full = NaturalGaussian(cavity.shift, jnp.diag(cavity.precision)) + exact
            return G.project_diagonal(full), exact_fit
        return cavity + exact, exact_fit
    if fit.dp_sgd is not None:
        return _local_dp_sgd(fit.client_log_lik, data, cavity, q, fit.optim, fit.local_steps, fit.num_particles,
                             rng_key, fit.dp_sgd, kl_weight)
    return _local_optax(log_lik, cavity, q, fit.optim, fit.local_steps, fit.num_particles, rng_key, kl_weight,
                        fit.max_chunks)


def pvi(
    log_prior_factor: NaturalGaussian,
    client_log_lik: Callable,
    num_clients: int,
    *,
    update: str = "conjugate",
    schedule: str = "synchronous",
    damping: float = 1.0,
    max_halvings: int = 10,
    max_kl: Optional[float] = None,
    subset_size: int = 1,
    optim: Any = None,
    local_steps: int = 100,
    max_local_steps: Optional[int] = None,
    num_particles: int = 8,
    variant: str = "plain",
    num_shards: int = 1,
    perturb: Any = None,
    dp_sgd: Any = None,
    trusted_aggregator: bool = False,
    split_prior: bool = False,
    prior_site: Optional[Callable] = None,
    aggregation: str = "trusted",
) -> FederatedAlgorithm:
    """Build PVI's pure functions.

    Args:
        log_prior_factor: the prior ``p(theta)`` as a Gaussian factor (its structure,
            full or diagonal, fixes the family).
        client_log_lik: ``(u, data) -> log p(x_j | theta(u))`` (with the Jacobian-free
            unconstrained ``u``); evaluated only by the client on its own data.
        num_clients: J.
        update: ``"conjugate"`` or ``"optax"`` (see the module docstring).
        schedule: ``"sequential"`` (one client per round, in turn), ``"synchronous"``
            (all), ``"subset"`` (``subset_size`` chosen uniformly per round).
        damping: ``delta`` in ``(0, 1]``.
        max_halvings: PD safeguard: halve ``delta`` at most this often, then reject.
        max_kl: optional trust region: also halve ``delta`` while the round would move ``q``
            by more than ``max_kl`` nats (see
            :func:`~numpyro_fed.factor.updates.factor_protocol`).
        variant: ``"plain"`` (Alg. 1); ``"local_averaging"`` (Heikkilä et al. (2023) Alg. 2: each client
            splits its rows into ``num_shards`` shards, fits each against the cavity with
            the KL weighted by ``1/N``, eq. 4.1, and averages the natural parameters,
            eq. 4.2); ``"virtual"`` (Alg. 3: one factor per shard, updated synchronously
            against its own cavity, eq. 4.9; the client sends the sum of the changes).
        num_shards: ``N`` shards per client (contiguous blocks of its real rows).
        perturb: update perturbation (Heikkilä et al. (2023) §4.2), see
            :func:`~numpyro_fed.factor.updates.factor_protocol`.
        max_local_steps: ``update="optax"``: an unconverged local fit (its objective or
            parameters still moving over the last quarter of ``local_steps``) runs another
            ``local_steps``, up to this many steps in all (default: ``local_steps``, no
            extension). Not under DP-SGD.
        dp_sgd: a :class:`~numpyro_fed.dp.mechanisms.DPSGD`: the local optimisation
            (``update="optax"``, ``variant="plain"``) runs DP-SGD (Heikkilä et al. (2023) §4.1) on the
            per-row log-likelihood ``client_log_lik(u, one_row_data)``.
        trusted_aggregator: see :func:`~numpyro_fed.factor.updates.factor_protocol`.
        aggregation: with ``trusted_aggregator``: ``"trusted"`` or ``"masking"`` (see
            :func:`~numpyro_fed.factor.updates.factor_protocol`).
        split_prior: the first round is a Bayesian committee machine with split prior
            (Tresp, 2000; Heikkilä et al.'s (2023) "BCM split" baseline): each client fits its posterior
            under the prior ``p^(1/J)`` and the server multiplies the fits, ``q = prod_j
            q_j``. (Without it, one synchronous round with damping 1 is "BCM same":
            ``q = prod_j q_j / p^(J-1)``, each ``q_j`` fitted under the full prior.) Only
            the first round is a BCM; :class:`~numpyro_fed.BCM` runs exactly one.

    References:
        Ashman et al. (2022), "Partitioned variational inference"; Heikkilä et al. (2023) §3.1, Alg. 1.
        prior_site: the server's step for a non-Gaussian prior's residual (see
            :mod:`~numpyro_fed.terms.prior_site`); ``log_prior_factor`` is then the prior's
            Gaussian part.
    """
    fit = LocalFit(log_prior_factor, client_log_lik, num_clients, update, optim, local_steps, num_particles, dp_sgd,
                   split_prior, max(1, (max_local_steps or local_steps) // local_steps))
    if dp_sgd is not None and (update != "optax" or variant != "plain" or perturb is not None):
        raise ValueError("dp_sgd= is the local optimisation of update='optax', variant='plain', without perturb=")
    local = partial(fit_local, fit)
    if split_prior:
        local = split_first_round(local, log_prior_factor, num_clients)
    return factor_protocol(
        log_prior_factor, local, num_clients, schedule=schedule, damping=damping,
        max_halvings=max_halvings, max_kl=max_kl, subset_size=subset_size, variant=variant, num_shards=num_shards,
        perturb=perturb, private_fit=dp_sgd is not None, trusted_aggregator=trusted_aggregator,
        prior_site=prior_site, aggregation=aggregation,
    )

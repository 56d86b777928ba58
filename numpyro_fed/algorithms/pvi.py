"""Partitioned variational inference (PVI; Ashman et al., 2022; paper 002 §3.1, Algorithm 1).

The global approximation over the model's global latent sites (flat, unconstrained) is

.. math::

    q(\\theta) \\propto p(\\theta) \\prod_j t_j(\\theta),

with Gaussian factors stored in natural parameters, so ``q``'s natural parameters are the
prior's plus the sum of the clients' ``t_j``. In a round the server sends ``q``; every
chosen client m forms the cavity ``q / t_m``, maximises its local ELBO

.. math::

    \\lambda^* = \\arg\\max_q \\; \\mathbb E_q[\\log p(x_m \\mid \\theta)]
        - \\mathrm{KL}(q \\,\\|\\, q / t_m)                     \\qquad (3.5)

and sends the single message ``Delta t_m = q^* / q`` (natural parameters; eq. 3.7), which
a DP mechanism can later clip and noise, with a flag saying whether its cavity was proper
(an improper cavity has no local ELBO; such a client sends a zero update and the server
counts it in ``PVIInfo.invalid``). The server applies ``q <- q * prod Delta t_m^delta``
with damping ``delta``; if the new precision is not positive definite it halves ``delta``
(up to ``max_halvings`` times) and otherwise rejects the round. It acknowledges the
damping it applied, and each client moves its own factor by the same fraction
(``t_m <- t_m * Delta t_m^delta``), so ``q = p prod_j t_j`` holds throughout.

Local updates:

- ``"conjugate"``: when ``log p(x_m | theta)`` is quadratic in ``theta`` (Gaussian
  likelihood, linear predictor) the optimum is closed-form: ``t_m`` is the likelihood
  itself (full covariance), or the mean-field projection of ``cavity * likelihood``;
- ``"optax"``: ``local_steps`` steps of an optax optimiser on a reparameterised Monte Carlo
  estimate of (3.5), starting from the current ``q``.

All functions are pure and jit-compatible.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

from .. import gaussian as G
from ..gaussian import NaturalGaussian

__all__ = ["PVIAlgorithm", "PVIClientState", "PVIInfo", "PVIServerState", "pvi"]

SCHEDULES = ("sequential", "synchronous", "subset")
VARIANTS = ("plain", "local_averaging", "virtual")


class PVIServerState(NamedTuple):
    q: NaturalGaussian
    active: jax.Array  # the clients chosen for the coming round
    round: jax.Array


class PVIClientState(NamedTuple):
    factor: NaturalGaussian  # t_j: the client's own factor
    pending: NaturalGaussian  # Delta t_j sent this round, applied once acknowledged


class PVIAlgorithm(NamedTuple):
    """:class:`~numpyro_fed.algorithms.FederatedAlgorithm`'s four functions plus the
    acknowledgement step ``client_accept(state, applied_damping) -> state``."""

    init_server: Callable
    init_client: Callable
    client_step: Callable
    server_step: Callable
    client_accept: Callable


class PVIInfo(NamedTuple):
    damping: jax.Array  # the damping applied (0: round rejected)
    halvings: jax.Array
    invalid: jax.Array  # active clients whose cavity was improper (they sent no update)


def _local_optax(log_lik, cavity: NaturalGaussian, q: NaturalGaussian, optim, steps, particles, rng_key,
                 kl_weight=1.0):
    """Maximise ``E_q[log_lik] - kl_weight KL(q || cavity)`` over ``q = N(loc, L L^T)`` from ``q``."""
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

    def neg_elbo(params, key):
        loc, cov_, root = moments(params)
        eps = random.normal(key, (particles, d))
        draws = loc + (eps * root if diagonal else eps @ root.T)
        expected = jnp.mean(jax.vmap(log_lik)(draws))
        return -(expected - kl_weight * G.kl_divergence(G.from_moments(loc, cov_), cavity))

    def step(carry, key):
        params, opt_state = carry
        grads = jax.grad(neg_elbo)(params, key)
        updates, opt_state = optim.update(grads, opt_state, params)
        params = jax.tree_util.tree_map(jnp.add, params, updates)
        return (params, opt_state), None

    keys = random.split(rng_key, steps)
    (params, _), _ = jax.lax.scan(step, (init, optim.init(init)), keys)
    loc, cov_, _ = moments(params)
    return G.from_moments(loc, cov_)


def pvi(
    log_prior_factor: NaturalGaussian,
    client_log_lik: Callable,
    num_clients: int,
    *,
    update: str = "conjugate",
    schedule: str = "synchronous",
    damping: float = 1.0,
    max_halvings: int = 10,
    subset_size: int = 1,
    optim: Any = None,
    local_steps: int = 100,
    num_particles: int = 8,
    variant: str = "plain",
    num_shards: int = 1,
) -> "PVIAlgorithm":
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
        variant: ``"plain"`` (Alg. 1); ``"local_averaging"`` (paper 002 Alg. 2: each client
            splits its rows into ``num_shards`` shards, fits each against the cavity with
            the KL weighted by ``1/N``, eq. 4.1, and averages the natural parameters,
            eq. 4.2); ``"virtual"`` (Alg. 3: one factor per shard, updated synchronously
            against its own cavity, eq. 4.9; the client sends the sum of the changes).
        num_shards: ``N`` shards per client (contiguous blocks of its real rows).

    References:
        Ashman et al. (2022), "Partitioned variational inference"; paper 002 §3.1, Alg. 1.
    """
    d = log_prior_factor.shift.shape[0]
    diagonal = log_prior_factor.diagonal

    def local_posterior(rng_key, cavity: NaturalGaussian, q: NaturalGaussian, data, kl_weight=1.0) -> NaturalGaussian:
        def log_lik(u):
            return client_log_lik(u, data)

        if update == "conjugate":  # optimum: cavity * likelihood^(1 / kl_weight)
            hess = jax.hessian(log_lik)(jnp.zeros(d))
            exact = NaturalGaussian(jax.grad(log_lik)(jnp.zeros(d)), -(hess + hess.T) / 2).scale(1.0 / kl_weight)
            if diagonal:  # mean-field optimum of KL(q || cavity * likelihood)
                full = NaturalGaussian(cavity.shift, jnp.diag(cavity.precision)) + exact
                return G.project_diagonal(full)
            return cavity + exact
        return _local_optax(log_lik, cavity, q, optim, local_steps, num_particles, rng_key, kl_weight)

    return factor_protocol(
        log_prior_factor, local_posterior, num_clients, schedule=schedule, damping=damping,
        max_halvings=max_halvings, subset_size=subset_size, variant=variant, num_shards=num_shards,
    )


def factor_protocol(
    log_prior_factor: NaturalGaussian,
    local_update: Callable,
    num_clients: int,
    *,
    schedule: str = "synchronous",
    damping: float = 1.0,
    max_halvings: int = 10,
    subset_size: int = 1,
    variant: str = "plain",
    num_shards: int = 1,
    max_kl: Optional[float] = None,
) -> "PVIAlgorithm":
    """The protocol PVI and EP share: factors ``t_j``, cavities, one ``Delta t_j`` per client.

    ``local_update(rng_key, cavity, q, data, kl_weight) -> q_new`` is the client's local
    fit (PVI: the local-ELBO optimum; EP: the moment-matched tilted distribution); the
    client sends ``Delta t_j = q_new / q``. Schedules, variants, damping and the PD
    safeguard are as documented in :func:`pvi`. ``max_kl`` (optional) adds a trust region
    to the safeguard: the damping is also halved while ``KL(q_new || q) > max_kl`` nats,
    which tames parallel (synchronous) EP when many clients' updates add up.
    """
    local_posterior = local_update
    prior = log_prior_factor
    diagonal = prior.diagonal
    d = prior.shift.shape[0]

    def choose(rng_key, rnd):
        if schedule == "synchronous":
            return jnp.ones(num_clients, bool)
        if schedule == "sequential":
            return jnp.arange(num_clients) == (rnd % num_clients)
        order = random.permutation(rng_key, num_clients)
        return jnp.zeros(num_clients, bool).at[order[:subset_size]].set(True)

    def init_server(rng_key):
        state = PVIServerState(prior, choose(rng_key, 0), jnp.zeros((), jnp.int32))
        return state, {"q": prior}

    virtual = variant == "virtual"
    shards = int(num_shards) if variant != "plain" else 1

    def _zero_factor():
        z = G.zeros(d, diagonal)
        return jax.tree_util.tree_map(lambda x: jnp.zeros((shards,) + x.shape), z) if virtual else z

    def init_client(rng_key, data) -> PVIClientState:
        del rng_key, data
        return PVIClientState(_zero_factor(), _zero_factor())

    def shard(data, k):
        """Client data restricted to its k-th shard: a contiguous block of its real rows."""
        index = jnp.arange(data.row_mask.shape[0])
        block = jnp.floor(index * shards / data.num_rows)
        return data._replace(row_mask=data.row_mask * (block == k).astype(data.row_mask.dtype))

    def _finite(nat):
        return jnp.all(jnp.isfinite(nat.shift)) & jnp.all(jnp.isfinite(nat.precision))

    def client_step(rng_key, state: PVIClientState, message, data):
        q = message["q"]
        keys = random.split(rng_key, shards)
        ks = jnp.arange(shards)
        if variant == "plain":
            cavity = q - state.factor
            pending = local_posterior(rng_key, cavity, q, data) - q
            delta, proper = pending, G.is_positive_definite(cavity)
        elif variant == "local_averaging":
            cavity = q - state.factor
            fits = jax.vmap(lambda k, key: local_posterior(key, cavity, q, shard(data, k), 1.0 / shards))(ks, keys)
            pending = jax.tree_util.tree_map(lambda x: jnp.mean(x, 0), fits) - q
            delta, proper = pending, G.is_positive_definite(cavity)
        else:  # virtual clients: one factor and one cavity per shard

            def one(k, key, t_k):
                cavity = q - t_k
                return local_posterior(key, cavity, q, shard(data, k)) - q, G.is_positive_definite(cavity)

            pending, proper = jax.vmap(one)(ks, keys, state.factor)
            delta, proper = jax.tree_util.tree_map(lambda x: jnp.sum(x, 0), pending), jnp.all(proper)
        # an improper cavity has no local ELBO, and a failed local fit (not finite, or not
        # a proper Gaussian) is no update: the client sends zero and says so
        valid = proper & _finite(delta) & G.is_positive_definite(q + delta)
        delta = jax.tree_util.tree_map(lambda x: jnp.where(valid, x, 0.0), delta)
        pending = jax.tree_util.tree_map(lambda x: jnp.where(valid, x, 0.0), pending)
        return state._replace(pending=pending), {"delta": delta, "valid": valid}

    def server_step(rng_key, state: PVIServerState, messages, active):
        w = active.astype(prior.shift.dtype)
        total = jax.tree_util.tree_map(lambda x: jnp.tensordot(w, x, axes=1), messages["delta"])

        def try_damping(carry):
            delta, halvings = carry
            return delta / 2, halvings + 1

        def acceptable(delta):
            new = state.q + total.scale(delta)
            pd = G.is_positive_definite(new)
            if max_kl is None:
                return pd
            safe = jax.tree_util.tree_map(lambda a, b: jnp.where(pd, a, b), new, state.q)
            return pd & (G.kl_divergence(safe, state.q) <= max_kl)

        def not_pd(carry):
            delta, halvings = carry
            return (~acceptable(delta)) & (halvings < max_halvings)

        applied, halvings = jax.lax.while_loop(not_pd, try_damping, (jnp.asarray(damping, prior.shift.dtype), 0))
        ok = acceptable(applied)
        applied = jnp.where(ok, applied, 0.0)
        q = state.q + total.scale(applied)
        rnd = state.round + 1
        new = PVIServerState(q, choose(rng_key, rnd), rnd)
        invalid = jnp.sum(active & ~messages["valid"])
        return new, {"q": q}, PVIInfo(applied, jnp.asarray(halvings), invalid)

    def client_accept(state: PVIClientState, applied) -> PVIClientState:
        """Move the client's factor by the fraction of its update the server applied."""
        return PVIClientState(state.factor + state.pending.scale(applied), _zero_factor())

    return PVIAlgorithm(init_server, init_client, client_step, server_step, client_accept)

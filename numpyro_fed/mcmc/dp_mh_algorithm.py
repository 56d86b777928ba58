"""Differentially private federated random-walk Metropolis, corrected for its noise.

Each round is one Metropolis-Hastings iteration of every chain over the flat unconstrained
global sites ``u``. The server proposes ``u' = u + s L z`` (``L L^T`` the proposal's covariance,
``s`` its step, adapted in warmup to :data:`TARGET_ACCEPT`); every client ``j`` computes, on each
of its rows ``i``, the log-likelihood ratio ``lambda_i = log p(y_i | u') - log p(y_i | u)``,
clips it to ``[-C, C]`` and releases

.. math::

    \\hat\\Lambda_j = \\sum_i \\mathrm{clip}_C(\\lambda_i) + \\sigma \\xi_j, \\qquad \\xi_j \\sim N(0, 1),

``xi_j`` from its own key: a Gaussian mechanism of sensitivity ``2C`` under the substitution of
one row. The server sums them, ``hat Lambda ~ N(Lambda, V)`` with ``V = J sigma^2`` known, and
accepts with the **penalty method** (Ceperley & Dewing 1999; Yildirim & Ermis 2019, "Exact MCMC
with differentially private moves", Statistics and Computing 29, §3, its distributed case):

.. math::

    \\log U < \\hat\\Lambda + \\log p(u') - \\log p(u) - V / 2 .

For Gaussian noise of known variance this acceptance satisfies detailed balance for the
posterior whose log-likelihood ratios are the clipped ones: where no row's ratio reaches ``C``
the chain targets the exact posterior. Each client counts, in its own state, the rows whose
ratio was clipped (never sent); the family warns with the counts. A round some client missed
decides nothing (the same proposal is evaluated again).

The noise costs acceptance: about ``exp(-V / 8)`` of it at ``V`` near 1 (so ``V`` of a few
units at most is practical: small ``C`` with small steps, many rows per client).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from ..protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients

__all__ = ["DPMHClientState", "DPMHConfig", "DPMHInfo", "DPMHServerState", "TARGET_ACCEPT", "dp_metropolis"]

TARGET_ACCEPT = 0.234
"""The random walk's target acceptance in warmup (Roberts, Gelman & Gilks 1997)."""


class DPMHConfig(NamedTuple):
    num_warmup: int
    num_samples: int
    num_chains: int
    clip: float  # C: each row's log-likelihood ratio is clipped to [-C, C]
    sigma: float  # each client's noise sd (sigma = noise multiplier * C)
    correct: bool = True  # the penalty -V/2 (False only to show what it corrects)


class DPMHServerState(NamedTuple):
    u: jax.Array  # (d,) the chain's point
    log_prior: jax.Array
    proposal: jax.Array  # (d,) the point the clients evaluate this round
    log_step: jax.Array
    iteration: jax.Array
    draws: jax.Array  # (num_samples, d)
    accepted: jax.Array  # (num_warmup + num_samples,) bool


class DPMHClientState(NamedTuple):
    releases: jax.Array  # noised sums this client has released (its privacy ledger)
    clipped: jax.Array  # rows whose ratio was clipped, summed over releases (never sent)


class DPMHInfo(NamedTuple):
    accepted: jax.Array  # (chains,)
    complete: jax.Array


def _client_step(rng_key, state: DPMHClientState, broadcast: Broadcast, data, *, row_log_lik: Callable,
                 config: DPMHConfig):
    b = broadcast.shared

    def chain(key, u, proposal):
        ratio = row_log_lik(proposal, data) - row_log_lik(u, data)  # (rows,), padded rows 0
        clipped = jnp.sum(jnp.abs(ratio) > config.clip)
        ratio = jnp.where(jnp.isfinite(ratio), ratio, jnp.sign(jnp.nan_to_num(ratio)) * config.clip)
        total = jnp.sum(jnp.clip(ratio, -config.clip, config.clip))
        return total + config.sigma * random.normal(key, (), total.dtype), clipped

    released, clipped = jax.vmap(chain)(random.split(rng_key, config.num_chains), b["current"], b["proposal"])
    new = DPMHClientState(state.releases + config.num_chains, state.clipped + jnp.sum(clipped))
    return new, {"llr": released}


def _decide(key, s: DPMHServerState, llr, complete, *, log_prior: Callable, chol, config: DPMHConfig,
            num_clients: int):
    k_accept, k_next = random.split(key)
    lp_new = log_prior(s.proposal)
    variance = num_clients * config.sigma ** 2
    log_ratio = llr + lp_new - s.log_prior - (variance / 2 if config.correct else 0.0)
    total = config.num_warmup + config.num_samples
    decide = complete & (s.iteration < total)
    accept = decide & (jnp.log(random.uniform(k_accept, (), llr.dtype)) < jnp.where(jnp.isfinite(log_ratio),
                                                                                    log_ratio, -jnp.inf))
    u = jnp.where(accept, s.proposal, s.u)
    lp = jnp.where(accept, lp_new, s.log_prior)
    it = s.iteration
    warm = it < config.num_warmup
    # warmup: Robbins-Monro on the log step towards the target acceptance (the decisions are public)
    rate = jnp.minimum(jnp.exp(log_ratio), 1.0)
    log_step = jnp.where(decide & warm, s.log_step + (rate - TARGET_ACCEPT) / jnp.sqrt(it + 1.0), s.log_step)
    slot = it - config.num_warmup
    draws = jnp.where(decide & ~warm, s.draws.at[jnp.clip(slot, 0, config.num_samples - 1)].set(u), s.draws)
    accepted = jnp.where(decide, s.accepted.at[jnp.clip(it, 0, total - 1)].set(accept), s.accepted)
    proposal = u + jnp.exp(log_step) * (chol @ random.normal(k_next, u.shape, u.dtype))
    proposal = jnp.where(decide, proposal, s.proposal)  # a round some client missed: the same proposal again
    return DPMHServerState(u, lp, proposal, log_step, it + decide.astype(it.dtype), draws, accepted), accept


def dp_metropolis(log_prior: Callable, row_log_lik: Callable, num_clients: int, start, scale, *,
                  config: DPMHConfig) -> FederatedAlgorithm:
    """Build the sampler's pure functions (see the module docstring).

    Args:
        log_prior: ``u -> log p(u)`` (Jacobians included), evaluated by the server.
        row_log_lik: ``(u, data) -> (rows,)`` each row's log-likelihood (padded rows 0),
            evaluated by the client on its own rows.
        num_clients: J.
        start: ``(chains, d)`` the chains' first points (public).
        scale: ``(d, d)`` the proposal's covariance before its step.
        config: :class:`DPMHConfig`.
    """
    start = jnp.asarray(start)
    C, d = start.shape
    dtype = start.dtype
    chol = jnp.linalg.cholesky(jnp.asarray(scale, dtype))
    total = config.num_warmup + config.num_samples
    decide = partial(_decide, log_prior=log_prior, chol=chol, config=config, num_clients=num_clients)

    def init_server(rng_key):
        def one(key, u0):
            proposal = u0 + jnp.exp(jnp.log(2.38 / jnp.sqrt(d))) * (chol @ random.normal(key, (d,), dtype))
            return DPMHServerState(u0, log_prior(u0), proposal, jnp.log(jnp.asarray(2.38 / jnp.sqrt(d), dtype)),
                                   jnp.zeros((), jnp.int32), jnp.zeros((config.num_samples, d), dtype),
                                   jnp.zeros(total, bool))

        s = jax.vmap(one)(random.split(rng_key, C), start)
        return s, Broadcast({"current": s.u, "proposal": s.proposal})

    def init_client(rng_key, data):
        del rng_key, data
        return DPMHClientState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def server_step(rng_key, state, messages, view):
        complete = jnp.all(view.answered)
        llr = jnp.sum(messages["llr"], axis=0)  # (chains,)
        new, accepted = jax.vmap(decide, in_axes=(0, 0, 0, None))(random.split(rng_key, C), state, llr, complete)
        return new, Broadcast({"current": new.u, "proposal": new.proposal}), DPMHInfo(accepted, complete)

    return FederatedAlgorithm(
        init_server, init_client, all_clients(num_clients),
        (Exchange(partial(_client_step, row_log_lik=row_log_lik, config=config), server_step, "dp_metropolis"),),
        monitor=lambda info: jnp.mean(info.accepted.astype(dtype)), monitor_name="accepted", name="dp_metropolis",
        done=lambda s: jnp.all(s.iteration >= total),
        describe=lambda s: f"iteration {min(int(jnp.min(s.iteration)), total)} of {total}",
        progress=lambda s: (min(int(jnp.min(s.iteration)), total), config.num_warmup, total),
    )

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
ratio was clipped in the kept iterations (never sent); the family warns with the counts. A round some client missed
decides nothing: the family gathers each iteration's releases over the rounds the clients take to answer, each
client releasing once (:func:`~numpyro_fed.dp.releases.capped_releases`).

**Under secure aggregation** (pairwise masking or a trusted aggregator; :mod:`numpyro_fed.run.secure`)
the server sees only ``hat Lambda``, never a client's own release. Each client still adds the whole
``sigma``: sharing the noise among the clients (each ``sigma / sqrt(J)``) would rest the guarantee on
the server following the protocol and reporting truthfully who answered, which a client cannot
check; ``V`` is ``J sigma^2`` either way.

The noise costs acceptance: about ``exp(-V / 8)`` of it at ``V`` near 1 (so ``V`` of a few
units at most is practical: small ``C`` with small steps, many rows per client).

**With a control variate** (:mod:`numpyro_fed.dp.control`: a private start's released sums of its
rows' clipped gradients and Hessians at a point ``a``) each client releases the clipped sum of its
ratios' residuals about their second-order expansion at ``a`` and the server adds the released
expansion back: a residual is third order near the mode, so a clip that keeps ``V`` near 2 binds
on none where the full ratios would all be clipped.

**Local latents that belong to rows** (a patient's random effect, inside the row plate): each
client keeps its rows' latents ``v_i`` and moves them first, every round, given the chain's
point ``u``, by ``local_steps`` random-walk Metropolis steps **row by row** (each row accepted
on its own joint term ``log p(y_i, v_i | u)``, its step adapted in warmup on its own
acceptance); the release is then the clipped sum of ``log p(y_i, v_i | u') - log p(y_i, v_i |
u)``. The chain is Metropolis-within-Gibbs on ``(u, v)``. A row's latents never leave its client
and depend only on that row's data and the public chain of ``u``, so under the substitution
of one row every other row's contribution has the same distribution given what was released,
and each release is a mixture of Gaussian mechanisms whose means differ by at most ``2C``:
by the joint convexity of the hockey-stick divergence it is dominated by the Gaussian
mechanism, and the releases compose adaptively as it does.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from ..dp.control import ControlVariate, row_taylor, taylor
from ..dp.rows import RowLocals
from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients

__all__ = ["LOCAL_TARGET_ACCEPT", "DPMHClientState", "DPMHConfig", "DPMHInfo", "DPMHServerState",
           "TARGET_ACCEPT", "dp_metropolis"]

TARGET_ACCEPT = 0.234
"""The random walk's target acceptance in warmup (Roberts, Gelman & Gilks 1997)."""


LOCAL_TARGET_ACCEPT = 0.44
"""Each row's local random walk's target acceptance in warmup (one-dimensional optimum)."""


class DPMHConfig(NamedTuple):
    num_warmup: int
    num_samples: int
    num_chains: int
    clip: float  # C: each row's log-likelihood ratio is clipped to [-C, C]
    sigma: float  # each client's noise sd (noise multiplier * C, summed securely or not)
    correct: bool = True  # the penalty -V/2 (False only to show what it corrects)
    local_steps: int = 5  # row-wise random-walk steps of the local latents per round
    secure: str = None  # None, or how the releases are summed before the server ("trusted", "masking")


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
    clipped: jax.Array  # rows whose ratio was clipped in kept iterations, summed (never sent)
    v: jax.Array = None  # (chains, locals) its rows' local latents (never sent)
    log_step: jax.Array = None  # (chains, rows) each row's local step
    draws: jax.Array = None  # (chains, num_samples, locals) the kept local draws
    taylor_g: jax.Array = None  # (rows, d) with a control variate: its rows' clipped gradients at the anchor
    taylor_factor: jax.Array = None  # (rows,) and their clip's factors (never sent)


class DPMHInfo(NamedTuple):
    accepted: jax.Array  # (chains,)
    complete: jax.Array


def _clipped(ratio, iteration, config: DPMHConfig):
    """Rows whose ratio the clip changes, counted in the kept iterations (the warmup's moves,
    which adapt the step, change no kept draw)."""
    return jnp.where(iteration >= config.num_warmup, jnp.sum(jnp.abs(ratio) > config.clip), 0)


def _client_step(rng_key, state: DPMHClientState, broadcast: Broadcast, data, *, row_log_lik: Callable,
                 config: DPMHConfig, control: ControlVariate = None):
    b = broadcast.shared

    def chain(key, u, proposal, iteration):
        ratio = row_log_lik(proposal, data) - row_log_lik(u, data)  # (rows,), padded rows 0
        if control is not None:  # the residual about the released expansion (dp/control.py)
            ratio = ratio - row_taylor(lambda x: row_log_lik(x, data), state.taylor_g, state.taylor_factor,
                                       control.anchor, u, proposal)
        clipped = _clipped(ratio, iteration, config)
        ratio = jnp.where(jnp.isfinite(ratio), ratio, jnp.sign(jnp.nan_to_num(ratio)) * config.clip)
        total = jnp.sum(jnp.clip(ratio, -config.clip, config.clip))
        return total + config.sigma * random.normal(key, (), total.dtype), clipped

    released, clipped = jax.vmap(chain)(random.split(rng_key, config.num_chains), b["current"], b["proposal"],
                                        b["iteration"])
    new = state._replace(releases=state.releases + config.num_chains, clipped=state.clipped + jnp.sum(clipped))
    return new, {"llr": released}


def _local_moves(key, v, log_step, u, data, iteration, *, row_joint: Callable, rows: RowLocals,
                 config: DPMHConfig):
    """``local_steps`` random-walk Metropolis steps of every row's locals given ``u``, each row
    accepted on its own term; in warmup each row's step adapts to its own acceptance."""
    real = data.row_mask > 0  # padded rows never move

    def step(carry, k):
        v, f, log_step, rate = carry
        z = random.normal(k, v.shape, v.dtype)
        proposal = v + jnp.exp(log_step)[rows.row_of] * z
        f_new = row_joint(u, proposal, data)
        ratio = jnp.where(jnp.isfinite(f_new), f_new - f, -jnp.inf)
        accept = real & (jnp.log(random.uniform(jax.random.fold_in(k, 1), f.shape, f.dtype)) < ratio)
        v = jnp.where(accept[rows.row_of], proposal, v)
        return (v, jnp.where(accept, f_new, f), log_step, rate + jnp.minimum(jnp.exp(ratio), 1.0)), None

    f0 = row_joint(u, v, data)
    (v, _, _, rate), _ = jax.lax.scan(step, (v, f0, log_step, jnp.zeros_like(f0)),
                                      random.split(key, config.local_steps))
    warm = iteration < config.num_warmup
    rate = rate / config.local_steps
    log_step = jnp.where(warm & real, log_step + (rate - LOCAL_TARGET_ACCEPT) / jnp.sqrt(iteration + 1.0), log_step)
    return v, log_step


def _client_step_locals(rng_key, state: DPMHClientState, broadcast: Broadcast, data, *, row_joint: Callable,
                        rows: RowLocals, config: DPMHConfig):
    b = broadcast.shared
    moves = partial(_local_moves, row_joint=row_joint, rows=rows, config=config)

    def chain(key, v, log_step, draws, u, proposal, iteration):
        k_local, k_noise = random.split(key)
        v, log_step = moves(k_local, v, log_step, u, data, iteration)
        ratio = row_joint(proposal, v, data) - row_joint(u, v, data)  # (rows,), padded rows 0
        clipped = _clipped(ratio, iteration, config)
        ratio = jnp.where(jnp.isfinite(ratio), ratio, jnp.sign(jnp.nan_to_num(ratio)) * config.clip)
        total = jnp.sum(jnp.clip(ratio, -config.clip, config.clip))
        slot = iteration - config.num_warmup  # the locals at the point u of this iteration
        keep = (slot >= 0) & (slot < config.num_samples)
        draws = jnp.where(keep, draws.at[jnp.clip(slot, 0, config.num_samples - 1)].set(v), draws)
        return total + config.sigma * random.normal(k_noise, (), total.dtype), clipped, v, log_step, draws

    released, clipped, v, log_step, draws = jax.vmap(chain)(
        random.split(rng_key, config.num_chains), state.v, state.log_step, state.draws, b["current"], b["proposal"],
        b["iteration"])
    new = DPMHClientState(state.releases + config.num_chains, state.clipped + jnp.sum(clipped), v, log_step, draws)
    return new, {"llr": released}


def _decide(key, s: DPMHServerState, llr, complete, *, log_prior: Callable, chol, config: DPMHConfig,
            num_clients: int, control: ControlVariate = None):
    k_accept, k_next = random.split(key)
    lp_new = log_prior(s.proposal)
    if control is not None:  # the clients released residuals: add back the released expansion
        llr = llr + taylor(control, s.u, s.proposal)
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


def dp_metropolis(log_prior: Callable, row_log_lik: Callable, num_clients: int, start: jax.Array, scale: jax.Array,
                  *, config: DPMHConfig, rows: RowLocals = None, control: ControlVariate = None,
                  derivatives: Callable = None) -> FederatedAlgorithm:
    """Build the sampler's pure functions (see the module docstring).

    Args:
        log_prior: ``u -> log p(u)`` (Jacobians included), evaluated by the server.
        row_log_lik: ``(u, data) -> (rows,)`` each row's log-likelihood (padded rows 0),
            evaluated by the client on its own rows; with ``rows``, ``(u, v, data) -> (rows,)``
            each row's joint term ``log p(y_i, v_i | u)`` (local Jacobians included).
        num_clients: J.
        start: ``(chains, d)`` the chains' first points (public).
        scale: ``(d, d)`` the proposal's covariance before its step.
        config: :class:`DPMHConfig`.
        rows: the local latents' :class:`RowLocals` (``None``: no local latents).
        control: a :class:`~numpyro_fed.dp.control.ControlVariate` (public; no local latents):
            the clients release their ratios' residuals about it.
        derivatives: with ``control``, ``(u, data) -> ((rows, d), (rows,))`` each row's clipped
            gradient and its clip's factor, as the release that ``control`` sums clipped them.
    """
    start = jnp.asarray(start)
    C, d = start.shape
    dtype = start.dtype
    chol = jnp.linalg.cholesky(jnp.asarray(scale, dtype))
    total = config.num_warmup + config.num_samples
    decide = partial(_decide, log_prior=log_prior, chol=chol, config=config, num_clients=num_clients,
                     control=control)
    if control is not None and (rows is not None or derivatives is None):
        raise ValueError("dp_metropolis: a control variate needs each row's derivatives and no local latents")

    def init_server(rng_key):
        def one(key, u0):
            proposal = u0 + jnp.exp(jnp.log(2.38 / jnp.sqrt(d))) * (chol @ random.normal(key, (d,), dtype))
            return DPMHServerState(u0, log_prior(u0), proposal, jnp.log(jnp.asarray(2.38 / jnp.sqrt(d), dtype)),
                                   jnp.zeros((), jnp.int32), jnp.zeros((config.num_samples, d), dtype),
                                   jnp.zeros(total, bool))

        s = jax.vmap(one)(random.split(rng_key, C), start)
        return s, Broadcast(shared(s))

    def init_client(rng_key, data):
        del rng_key
        zero = jnp.zeros((), jnp.int32)
        if control is not None:
            g, factor = derivatives(jnp.asarray(control.anchor, dtype), data)
            return DPMHClientState(zero, zero, taylor_g=g, taylor_factor=factor)
        if rows is None:
            return DPMHClientState(zero, zero)
        n = rows.row_of.shape[0]
        return DPMHClientState(zero, zero, jnp.zeros((C, n), dtype), jnp.zeros((C, rows.num_rows), dtype),
                               jnp.zeros((C, config.num_samples, n), dtype))

    if rows is None:
        client_step = partial(_client_step, row_log_lik=row_log_lik, config=config, control=control)
    else:
        client_step = partial(_client_step_locals, row_joint=row_log_lik, rows=rows, config=config)

    def shared(s):
        return {"current": s.u, "proposal": s.proposal, "iteration": s.iteration}

    def server_step(rng_key, state, messages, view):
        complete = jnp.all(view.answered)
        llr = messages["llr"] if config.secure else jnp.sum(messages["llr"], axis=0)  # (chains,)
        new, accepted = jax.vmap(decide, in_axes=(0, 0, 0, None))(random.split(rng_key, C), state, llr, complete)
        return new, Broadcast(shared(new)), DPMHInfo(accepted, complete)

    return FederatedAlgorithm(
        init_server, init_client, all_clients(num_clients),
        (Exchange(client_step, server_step, "dp_metropolis", ("llr",) if config.secure else (),
                  config.secure or "trusted"),),
        monitor=lambda info: jnp.mean(info.accepted.astype(dtype)), monitor_name="accepted", name="dp_metropolis",
        done=lambda s: jnp.all(s.iteration >= total),
        describe=lambda s: f"iteration {min(int(jnp.min(s.iteration)), total)} of {total}",
        progress=lambda s: (min(int(jnp.min(s.iteration)), total), config.num_warmup, total),
    )

"""Exact federated Metropolis-within-Gibbs: one communication round per iteration.

The target is the pooled posterior of the flat unconstrained global sites ``u`` and every
client's local latents ``v_j``, ``p(u) prod_j p(y_j, v_j | u)``. One iteration is two moves,
each leaving that posterior invariant:

1. **A joint move of the globals, the locals carried along.** Each client carries its locals with
   ``u``: with ``m_j(u)`` the mode of ``v_j | u`` (a fixed number of Newton steps from the
   first-order prediction ``m_j(u_0) + S_j (u - u_0)``, ``u_0`` the Laplace start and ``S_j`` the
   slope of the conditional mode there, both fixed for the run: a deterministic function of
   ``u``) and ``L_j(u)`` a square root of the inverse of the
   absolute curvature there (block by block where the locals lie in a plate), it maps

   .. math:: v_j' = m_j(u') + L_j(u') L_j(u)^{-1} (v_j - m_j(u)),

   a bijection for each pair ``(u, u')`` and its own inverse with the pair swapped: the move keeps
   the standardised locals ``e_j = L_j(u)^{-1} (v_j - m_j(u))`` and targets ``u``'s conditional
   given them, whose density is ``p(u) prod_j p(y_j, m_j(u) + L_j(u) e_j | u) |L_j(u)|``. For
   each point ``u'`` the server sends, each client returns one scalar, ``log p(y_j, v_j' | u') -
   log p(y_j, v_j | u) + log|L_j(u')| - log|L_j(u)|``; with the prior, the server has that
   conditional's ratio at every point. Three times in four the move is **iterated sampling
   importance resampling** (i-SIR; Andrieu, Lee & Vihola, 2018, "Uniform ergodicity of the
   iterated conditional SMC and geometric ergodicity of particle Gibbs samplers", Bernoulli 24(2),
   arXiv:1312.6432; Tjelmeland, 2004, "Using all Metropolis-Hastings proposals"): ``candidates``
   independent draws of a Student-t whose location and covariance (times 1.1^2) are the
   posterior's, from a Laplace fit and then from every chain's warmup draws, and the next state
   picked among them and the current point with probabilities proportional to ``pi / q`` (the
   conditional density over the Student-t's): a Gibbs step on an extended space, exact for any
   number of candidates, which moves far whenever one of them lands where the posterior is. Every
   fourth move is a random walk scaled by the same covariance, by Metropolis-Hastings (its one
   point is sent in every row). Where ``v_j | u`` is Gaussian the map is exact (the standardised
   locals are unchanged) and the move is of the marginal chain of ``u`` (no funnel between a
   scale and its effects); elsewhere it is exact all the same, only it moves less often.
2. **The locals given the globals** (Gibbs): each client moves its own ``v_j`` by Hamiltonian
   Monte Carlo on ``p(v_j | u, y_j)`` in the coordinates ``L_j(u)`` whitens, with its own key,
   no communication.

One round: the server broadcasts the candidates and its decision about the previous ones (the
candidate chosen, or none); each client applies the decision, records its locals, moves them
given ``u`` and answers each candidate's scalar. Only the candidates (``d`` numbers each), the
decision and one scalar per candidate and client cross;
the locals, their draws, momenta and keys stay on the clients. A round in which a client did not
answer is repeated: the server decides nothing on part of the sum and sends its last decision
again with the same proposal; a client applies each decision once (they are counted), so one
that missed it applies it now and one that had it moves its locals once more and answers again.
The chain is the pooled chain whatever the network does.

During warmup the proposal's location and scale follow the chains' draws (in doubling windows)
and the random walk's step follows its acceptance (adaptation stops at the end of warmup, so the kept draws are from
a fixed, exact kernel).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax import random

from ..factor.blocks import block_hessian, scatter_blocks
from ..factor.tilted import conditional_slope, first_descent, inner_mode
from ..protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients

__all__ = ["MwGClientState", "MwGConfig", "MwGInfo", "MwGServerState", "federated_mwg", "laplace_map"]

T_DF = 5.0  # the independence proposal's Student-t degrees of freedom (heavier tails than the posterior's)
T_SCALE = 1.1 * ((T_DF - 2.0) / T_DF) ** 0.5  # its scale: a covariance 1.1^2 times the posterior's
TARGET_ACCEPT = 0.3  # the random walk's target acceptance during warmup
START_KEY = 0x6D77  # the chains' starts (global, known to every party)
RW_EVERY = 4  # every 4th global move a random walk (the others independence draws)
STEP_JITTER = 0.2  # each local HMC move's step is the set step times a uniform draw in [0.8, 1.2]
FLAT = 1e-10  # a curvature at most this is no curvature (a padded local latent)


class MwGConfig(NamedTuple):
    """Static settings."""

    num_warmup: int
    num_samples: int
    inner_steps: int  # Newton steps of the anchor m_j(u_0) from zero
    local_moves: int  # HMC moves of the locals per iteration
    local_steps: int  # leapfrog steps per local move
    local_step_size: float  # in whitened coordinates
    num_chains: int = 1
    candidates: int = 4  # the independence move's candidates per round (iterated sampling importance resampling)
    map_steps: int = 3  # Newton steps of m_j(u) from its first-order prediction


class MwGServerState(NamedTuple):
    u: jax.Array  # the chain's global position
    proposal: jax.Array  # (candidates, d): the points the clients are evaluating (a random walk: the first)
    kind: jax.Array  # 0: independence (candidates drawn from the Student-t), 1: random walk
    log_prior: jax.Array  # log p(u)
    mean: jax.Array  # the proposal's location
    chol: jax.Array  # its scale (lower Cholesky factor of the covariance)
    log_step: jax.Array  # the random walk's log step (times chol)
    stats: jax.Array  # (count, sum (d), outer sum (d, d)) of the window's warmup draws minus ``mean``, flattened
    iteration: jax.Array
    draws: jax.Array  # (num_samples, d)
    accepted: jax.Array  # (num_warmup + num_samples,) each iteration's decision
    kinds: jax.Array  # (num_warmup + num_samples,) each iteration's proposal kind
    sent: jax.Array  # (choice, slot) of the last decision sent: sent again while a round is repeated


class MwGClientState(NamedTuple):
    v: jax.Array  # the client's locals (never sent)
    value: jax.Array  # log p(y_j, v | u) at the chain's (u, v)
    mode: jax.Array  # m_j(u)
    lam: jax.Array  # |eigenvalues| of the curvature at m_j(u) (per block)
    vec: jax.Array  # its eigenvectors
    pending: tuple  # (v', value', mode', lam', vec') for each candidate being decided (stacked)
    draws: jax.Array  # (num_samples, n) the client's local draws
    local_accept: jax.Array  # the mean acceptance of its local moves
    applied: jax.Array  # how many of the server's decisions it has applied (a repeated one is not applied twice)
    anchor: jax.Array  # (n,) and (n, d): m_j's Newton start at u is anchor + slope @ u (fixed for the run)
    slope: jax.Array


class MwGInfo(NamedTuple):
    accepted: jax.Array
    kind: jax.Array
    log_ratio: jax.Array
    answered: jax.Array


# ---------------------------------------------------------------------- the locals' Laplace map
def _curvature(neg: Callable, mode, index):
    """``(|eigenvalues|, eigenvectors)`` of ``neg``'s Hessian at ``mode`` (floored), dense
    ``((n,), (n, n))`` or by blocks ``((K, b), (K, b, b))``."""
    if index is None:
        h = jax.hessian(neg)(mode)
        lam, vec = jnp.linalg.eigh((h + h.T) / 2)
    else:
        lam, vec = jax.vmap(jnp.linalg.eigh)(block_hessian(neg, mode, index))
    # a direction of no curvature (a padded entry, masked out of the model) is marked -1: the map
    # leaves it as it is (|-1| = 1, not a floor that moves with u: its Jacobian must cancel, the
    # density being flat there) and the local moves do not move it
    lam = jnp.abs(lam)
    return jnp.where(lam > FLAT, lam, -1.0), vec


def _whiten(x, lam, vec, index):
    """``L^-1 x`` with ``L = V |Lambda|^-1/2`` (per block)."""
    lam = jnp.abs(lam)
    if index is None:
        return jnp.sqrt(lam) * (vec.T @ x)
    return scatter_blocks(jnp.sqrt(lam) * jnp.einsum("kij,ki->kj", vec, x[index]), index, x.shape[0])


def _colour(w, lam, vec, index):
    """``L w``."""
    lam = jnp.abs(lam)
    if index is None:
        return vec @ (w / jnp.sqrt(lam))
    return scatter_blocks(jnp.einsum("kij,kj->ki", vec, w[index] / jnp.sqrt(lam)), index, w.shape[0])


def _log_det(lam):
    """``log |L|``."""
    return -0.5 * jnp.sum(jnp.log(jnp.abs(lam)))


def laplace_map(f: Callable, u, v0, steps: int, index):
    """``(m(u), lam, vec)``: the deterministic Laplace map of ``v | u`` (``steps`` Newton steps from ``v0``)."""
    neg = lambda v: -f(u, v)  # noqa: E731
    mode = inner_mode(neg, v0, steps, index, search=first_descent)
    lam, vec = _curvature(neg, mode, index)
    return mode, lam, vec


def _local_moves(key, f: Callable, u, v, value, mode, lam, vec, index, config: MwGConfig):
    """``config.local_moves`` HMC moves of ``v`` on ``p(v | u, y_j)`` in the whitened coordinates."""
    def potential(w):
        return -f(u, mode + _colour(w, lam, vec, index))

    grad = jax.grad(potential)
    free = (lam > 0) if index is None else scatter_blocks(lam > 0, index, v.shape[0])  # (flat ones stay)

    def move(carry, k):
        w, pot, acc = carry
        k_p, k_a, k_e = random.split(k, 3)
        p = random.normal(k_p, w.shape, w.dtype) * free
        # the step jittered (drawn apart from the state: the move stays reversible): a fixed trajectory
        # near half the whitened target's period sends w to about -w, and two such moves back to w
        eps = config.local_step_size * random.uniform(k_e, (), w.dtype, 1.0 - STEP_JITTER, 1.0 + STEP_JITTER)

        def leapfrog(state, _):
            x, r = state
            r = r - 0.5 * eps * grad(x)
            x = x + eps * r
            r = r - 0.5 * eps * grad(x)
            return (x, r), None

        (w_new, p_new), _ = jax.lax.scan(leapfrog, (w, p), None, length=config.local_steps)
        pot_new = potential(w_new)
        log_a = pot - pot_new + 0.5 * (p @ p - p_new @ p_new)
        log_a = jnp.where(jnp.isfinite(log_a), log_a, -jnp.inf)
        take = jnp.log(random.uniform(k_a, (), w.dtype)) < log_a
        return (jnp.where(take, w_new, w), jnp.where(take, pot_new, pot), acc + take), None

    w0 = _whiten(v - mode, lam, vec, index)
    (w, pot, acc), _ = jax.lax.scan(move, (w0, -value, jnp.zeros((), v.dtype)),
                                    random.split(key, config.local_moves))
    return mode + _colour(w, lam, vec, index), -pot, acc / config.local_moves


# ---------------------------------------------------------------------- one round
def anchor_map(f: Callable, u0, num_local: int, steps: int, index):
    """``(anchor, slope)`` of a client's map: its locals' conditional mode at ``u0`` (``steps``
    Newton steps from zero) and the mode's slope there (``dv*/du``, the implicit function theorem;
    zero where it is not finite), so that ``anchor + slope @ u`` predicts the mode at ``u`` to first
    order. Computed once per run from ``u0`` alone: the map stays a deterministic function of ``u``."""
    dtype = u0.dtype
    d = u0.shape[0]
    if not num_local:
        return jnp.zeros(0, dtype), jnp.zeros((0, d), dtype)
    mode = inner_mode(lambda v: -f(u0, v), jnp.zeros(num_local, dtype), steps, index, search=first_descent)
    slope = conditional_slope(lambda w: f(w[:d], w[d:]), u0, mode, index)
    slope = jnp.where(jnp.isfinite(slope), slope, 0.0)
    return mode - slope @ u0, slope


def _client_step(rng_key, s: MwGClientState, broadcast: Broadcast, data, *, log_joint_of: Callable, index,
                 config: MwGConfig):
    f = log_joint_of(data)
    b = broadcast.shared
    new = b["decided"] > s.applied  # (a repeated round carries a decision this client may have applied)
    take = new & (b["choice"] >= 0)
    chosen = jnp.clip(b["choice"], 0, s.pending[1].shape[0] - 1)
    pv, pval, pmode, plam, pvec = (x[chosen] for x in s.pending)
    v, value, mode, lam, vec = (jnp.where(take, new, old) for new, old in
                                ((pv, s.v), (pval, s.value), (pmode, s.mode), (plam, s.lam), (pvec, s.vec)))
    slot = b["slot"]
    draws = jnp.where(new & (slot >= 0), s.draws.at[jnp.clip(slot, 0, s.draws.shape[0] - 1)].set(v), s.draws)
    u = b["current"]
    local_acc = s.local_accept
    if v.shape[0]:
        v, value, local_acc = _local_moves(rng_key, f, u, v, value, mode, lam, vec, index, config)
    eps = _whiten(v - mode, lam, vec, index) if v.shape[0] else v  # the standardised locals, carried along

    def carry(u_new):  # the locals carried to a candidate, and the log ratio of the joint terms
        if v.shape[0]:
            m2, lam2, vec2 = laplace_map(f, u_new, s.anchor + s.slope @ u_new, config.map_steps, index)
            v2 = m2 + _colour(eps, lam2, vec2, index)
            jac = _log_det(lam2) - _log_det(lam)
        else:
            m2, lam2, vec2, v2, jac = mode, lam, vec, v, jnp.zeros((), v.dtype)
        value2 = f(u_new, v2)
        return (v2, value2, m2, lam2, vec2), value2 - value + jac

    pending, ell = jax.vmap(carry)(b["proposal"])
    ok = jnp.isfinite(ell)
    state = MwGClientState(v, value, mode, lam, vec, pending, draws, local_acc, jnp.maximum(s.applied, b["decided"]),
                           s.anchor, s.slope)
    return state, {"ell": jnp.where(ok, ell, jnp.zeros((), ell.dtype)), "ok": ok}


def _propose(key, s: MwGServerState, kind):
    """``(candidates, d)``: independent draws of the Student-t (``kind`` 0), or the random walk's
    proposal in every row (1: only the first is decided on)."""
    n, d = s.proposal.shape
    k_t, k_w = random.split(key)
    t = dist.MultivariateStudentT(T_DF, s.mean, T_SCALE * s.chol).sample(k_t, (n,))
    walk = s.u + jnp.exp(s.log_step) * (s.chol @ random.normal(k_w, (d,), s.u.dtype))
    return jnp.where(kind == 0, t, jnp.broadcast_to(walk, (n, d)))


def _server_step(rng_key, s: MwGServerState, messages, view, *, log_prior: Callable, config: MwGConfig,
                 secure: bool = False):
    """One chain's decision. ``secure``: ``messages`` hold the clients' sums (secure aggregation):
    ``ell`` summed, ``ok`` the count of clients whose term was finite."""
    k_accept, k_next = random.split(rng_key)
    complete = jnp.all(view.answered)
    total = config.num_warmup + config.num_samples
    if secure:
        ok = complete & (messages["ok"] == view.answered.shape[0])
        ell = messages["ell"]
    else:
        ok = complete & jnp.all(messages["ok"], axis=0)  # (candidates,)
        ell = jnp.sum(messages["ell"], axis=0)
    lp_new = jax.vmap(log_prior)(s.proposal)
    gain = ell + lp_new - s.log_prior  # log pi(candidate) / pi(current)
    gain = jnp.where(ok & jnp.isfinite(gain), gain, -jnp.inf)
    # a random walk: Metropolis-Hastings on its one proposal (the first row)
    walk_ratio = gain[0]
    # the independence move: iterated sampling importance resampling over the current point and the
    # candidates, each weighted by pi / q (the current point's weight relative to itself: 1 / q(u))
    t = dist.MultivariateStudentT(T_DF, s.mean, T_SCALE * s.chol)
    log_w = jnp.concatenate([-t.log_prob(s.u)[None], gain - t.log_prob(s.proposal)])
    log_w = jnp.where(jnp.isfinite(log_w), log_w, -jnp.inf)
    pick = random.categorical(k_accept, log_w) - 1  # -1: stay
    move = 1.0 - jnp.exp(log_w[0] - jax.scipy.special.logsumexp(log_w))  # the chance of moving
    walk_take = jnp.log(random.uniform(k_accept, (), s.u.dtype)) < walk_ratio
    choice = jnp.where(s.kind == 0, pick, jnp.where(walk_take, 0, -1))
    log_ratio = jnp.where(s.kind == 0, jnp.log(jnp.maximum(move, 1e-300)), walk_ratio)
    # (the closing round, after the last iteration, only delivers that iteration's decision: it decides nothing)
    decide = complete & (s.iteration < total)
    choice = jnp.where(decide, choice, -1).astype(jnp.int32)
    accept = choice >= 0
    at = jnp.clip(choice, 0, s.proposal.shape[0] - 1)
    u = jnp.where(accept, s.proposal[at], s.u)
    lp = jnp.where(accept, lp_new[at], s.log_prior)
    it = s.iteration
    warm = it < config.num_warmup
    # warmup: the random walk's step towards TARGET_ACCEPT; the proposal's moments from the second half's draws
    rate = jnp.exp(jnp.minimum(log_ratio, 0.0))
    log_step = jnp.where(warm & (s.kind == 1) & complete,
                         s.log_step + (rate - TARGET_ACCEPT) / jnp.sqrt(1.0 + it), s.log_step)
    d = u.shape[0]
    count, total_sum, outer = s.stats[0], s.stats[1:1 + d], s.stats[1 + d:].reshape(d, d)
    collect = warm & complete
    # the window's moments about the proposal's location (fixed within a window, the same in every chain): raw
    # moments about zero lose a posterior whose sd is small against its mean to float32 cancellation
    c = u - s.mean
    count, total_sum, outer = (jnp.where(collect, a, b) for a, b in
                               ((count + 1, count), (total_sum + c, total_sum), (outer + jnp.outer(c, c), outer)))
    mean, chol = s.mean, s.chol  # (refreshed from every chain's warmup draws by the caller: _pooled_refresh)
    slot_index = it - config.num_warmup
    keep = complete & (slot_index >= 0) & (slot_index < config.num_samples)
    draws = jnp.where(keep, s.draws.at[jnp.clip(slot_index, 0, config.num_samples - 1)].set(u), s.draws)
    record = jnp.where(complete, it, total)  # (an out-of-range index is dropped)
    accepted = s.accepted.at[record].set(accept, mode="drop")
    kinds = s.kinds.at[record].set(s.kind, mode="drop")
    it_new = jnp.where(complete, it + 1, it)
    kind = jnp.where(complete, (it_new % RW_EVERY) == RW_EVERY - 1, s.kind).astype(s.kind.dtype)
    proposal = jnp.where(complete, _propose(k_next, s._replace(u=u, mean=mean, chol=chol, log_step=log_step), kind),
                         s.proposal)
    stats = jnp.concatenate([count[None], total_sum, outer.ravel()])
    # a client that did not answer: the same round again: no decision, and the last one sent again
    # (a client that missed it applies it now; one that had it does not apply it twice)
    slot = jnp.where(complete, jnp.where(keep, slot_index, -1), s.sent[1]).astype(jnp.int32)
    sent_choice = jnp.where(complete, choice, s.sent[0]).astype(jnp.int32)
    new = MwGServerState(u, proposal, kind, lp, mean, chol, log_step, stats, it_new, draws, accepted, kinds,
                         jnp.stack([sent_choice, slot]))
    broadcast = Broadcast({"proposal": proposal, "current": u, "choice": sent_choice, "slot": slot,
                           "decided": it_new.astype(jnp.int32)})
    info = MwGInfo(accept, s.kind, log_ratio, view.answered.sum())
    return new, broadcast, info


def _pooled_refresh(rng_key, state: MwGServerState, shared, config: MwGConfig):
    """At the ends of warmup's windows (an eighth, a quarter, half and all of it, as Stan's
    doubling windows): the proposal's location and scale from every chain's draws in the window
    (their mean and covariance, the current scale counting as 10 draws), each chain's next
    proposal drawn from the refreshed one, and the window's sums cleared."""
    it = state.iteration[0]
    d = state.u.shape[-1]
    stats = jnp.sum(state.stats, 0)
    count, total_sum, outer = stats[0], stats[1:1 + d], stats[1 + d:].reshape(d, d)
    W = config.num_warmup
    end = (it == W // 8) | (it == W // 4) | (it == W // 2) | (it == W)
    refresh = end & (count > d + 2)
    shift = total_sum / jnp.maximum(count, 1.0)  # (the sums are about the window's location, state.mean)
    cov = outer / jnp.maximum(count, 1.0) - jnp.outer(shift, shift)
    mean = state.mean[0] + shift
    prior_weight = 10.0
    cov0 = state.chol[0] @ state.chol[0].T
    cov = (count * cov + prior_weight * cov0) / (count + prior_weight) + 1e-9 * jnp.eye(d, dtype=cov.dtype)
    chol = jnp.linalg.cholesky(cov)
    refresh = refresh & jnp.all(jnp.isfinite(chol))
    C = state.u.shape[0]
    new = state._replace(mean=jnp.where(refresh, jnp.broadcast_to(mean, state.mean.shape), state.mean),
                         chol=jnp.where(refresh, jnp.broadcast_to(chol, state.chol.shape), state.chol))
    proposal = jnp.where(refresh, jax.vmap(_propose)(random.split(rng_key, C), new, new.kind), new.proposal)
    stats = jnp.where(end, jnp.zeros_like(new.stats), new.stats)
    return new._replace(proposal=proposal, stats=stats), {**shared, "proposal": proposal}


def federated_mwg(log_prior: Callable, client_log_joint: Callable, num_clients: int, start, scale, *,
                  num_local: int, blocks=None, config: MwGConfig, secure: Optional[str] = None) -> FederatedAlgorithm:
    """Build the sampler's pure functions (see the module docstring).

    Args:
        log_prior: ``u -> log p(u)`` (Jacobians included), evaluated by the server.
        client_log_joint: ``(w = [u, v], data) -> log p(y_j, v | u)``, evaluated by the client.
        num_clients: J.
        start: the chain's first ``u`` (a Laplace fit's mode).
        scale: ``(d, d)`` the proposal's first covariance (the Laplace fit's).
        num_local: the size of ``v`` (padded clients: the largest).
        blocks: the locals' independent blocks (:func:`~numpyro_fed.factor.blocks.local_blocks`).
        config: :class:`MwGConfig`.
        secure: ``None``, or how the clients' log ratios are summed so that the server sees only
            their sum (:mod:`numpyro_fed.secure`): ``"trusted"`` or ``"masking"``.
    """
    d = start.shape[0]
    dtype = start.dtype
    index = None if blocks is None else jnp.asarray(blocks)
    log_joint = jax.jit(client_log_joint)
    v_start = jnp.zeros(num_local, dtype)
    total = config.num_warmup + config.num_samples

    def log_joint_of(data):
        return lambda u, v: log_joint(jnp.concatenate([u, v]), data)

    C, N = config.num_chains, config.candidates
    chol0 = jnp.linalg.cholesky(jnp.asarray(scale, dtype))
    # the chains' starts: the first at ``start``, the others a draw of N(start, scale) each, from a key
    # every party knows (the starts are global quantities, and each client needs them to start its locals)
    noise = random.normal(random.PRNGKey(START_KEY), (C, d), dtype).at[0].set(0.0)
    starts = start + noise @ chol0.T

    def init_chain(rng_key, u0):
        s = MwGServerState(u0, jnp.broadcast_to(u0, (N, d)), jnp.zeros((), jnp.int32), log_prior(u0), start, chol0,
                           jnp.log(jnp.asarray(2.38 / jnp.sqrt(d), dtype)), jnp.zeros(1 + d + d * d, dtype),
                           jnp.zeros((), jnp.int32), jnp.zeros((config.num_samples, d), dtype),
                           jnp.zeros(total, bool), jnp.zeros(total, jnp.int32), jnp.asarray([-1, -1], jnp.int32))
        proposal = _propose(rng_key, s, jnp.zeros((), jnp.int32))
        s = s._replace(proposal=proposal)
        return s, {"proposal": proposal, "current": u0, "choice": jnp.asarray(-1, jnp.int32),
                   "slot": jnp.asarray(-1, jnp.int32), "decided": jnp.zeros((), jnp.int32)}

    def init_server(rng_key):
        s, shared = jax.vmap(init_chain)(random.split(rng_key, C), starts)
        return s, Broadcast(shared)

    def init_client_chain(f, anchor, slope, u0):
        if num_local:
            mode, lam, vec = laplace_map(f, u0, anchor + slope @ u0, config.map_steps, index)
        else:
            mode, lam, vec = v_start, jnp.ones(0, dtype), jnp.zeros((0, 0), dtype)
        value = f(u0, mode)
        pending = tuple(jnp.broadcast_to(x, (N,) + x.shape) for x in (mode, value, mode, lam, vec))
        return MwGClientState(mode, value, mode, lam, vec, pending,
                              jnp.zeros((config.num_samples, num_local), dtype), jnp.zeros((), dtype),
                              jnp.zeros((), jnp.int32), anchor, slope)

    def init_client(rng_key, data):
        del rng_key
        f = log_joint_of(data)
        anchor, slope = anchor_map(f, start, num_local, config.inner_steps, index)  # the same for every chain
        return jax.vmap(partial(init_client_chain, f, anchor, slope))(starts)

    one_client = partial(_client_step, log_joint_of=log_joint_of, index=index, config=config)

    def client_step(rng_key, state, broadcast: Broadcast, data):
        def chain(key, st, shared):
            return one_client(key, st, Broadcast(shared), data)

        return jax.vmap(chain)(random.split(rng_key, C), state, broadcast.shared)

    one_server = partial(_server_step, log_prior=log_prior, config=config, secure=secure is not None)
    chain_axis = 0 if secure is not None else 1  # summed messages have no client axis

    def server_step(rng_key, state, messages, view):
        def chain(key, st, ell, ok):
            new, b, info = one_server(key, st, {"ell": ell, "ok": ok}, view)
            return new, b.shared, info

        k_chains, k_refresh = random.split(rng_key)
        new, shared, info = jax.vmap(chain, in_axes=(0, 0, chain_axis, chain_axis))(
            random.split(k_chains, C), state, messages["ell"], messages["ok"])
        new, shared = _pooled_refresh(k_refresh, new, shared, config)
        return new, Broadcast(shared), info

    return FederatedAlgorithm(
        init_server, init_client, all_clients(num_clients),
        (Exchange(client_step, server_step, "mwg", ("ell", "ok") if secure is not None else (), secure or "trusted"),),
        monitor=lambda info: jnp.mean(info.accepted.astype(dtype)), monitor_name="accepted", name="mwg",
        done=lambda s: jnp.all(s.iteration > total),  # one round more: the clients record the last locals
        describe=lambda s: f"iteration {min(int(jnp.min(s.iteration)), total)} of {total}",
        progress=lambda s: (min(int(jnp.min(s.iteration)), total), config.num_warmup, total),
    )


def run_on_state(state, num_warmup: int, num_samples: int):
    """A finished run's :class:`~numpyro_fed.protocol.RunState` as the start of the same chains run on
    to ``num_samples`` kept iterations (more than it kept): the draw buffers grown, nothing else
    changed, so the next round continues each chain where it stopped (its adaptation ended with
    warmup).

    The finished run's last round decided no global move (it delivered the last decision): that
    iteration's state, the globals unchanged and the locals after their moves, is recorded in the
    first new slot by every party from its own state (the server its ``u``, each client its ``v``),
    so the kept draws are the chain's states at consecutive iterations."""
    s = state.server
    old = int(s.draws.shape[-2])
    if s.accepted.shape[-1] != num_warmup + old:
        raise ValueError(f"run on: the run kept {old} draws after {s.accepted.shape[-1] - old} warmup iterations, "
                         f"not {num_warmup}: run the same chains on with the same num_warmup")
    if num_samples <= old:
        raise ValueError(f"run on: num_samples={num_samples} is not more than the {old} draws the run kept")
    if not bool(jnp.all(s.iteration == num_warmup + old + 1)):
        raise ValueError("run on: the run has not finished (every chain's last iteration done): resume it with "
                         "init_state= instead")
    pad = num_samples - old

    def grow(x, axis):
        shape = list(x.shape)
        shape[axis] = pad
        return jnp.concatenate([x, jnp.zeros(shape, x.dtype)], axis=axis)

    server = s._replace(draws=grow(s.draws, -2).at[..., old, :].set(s.u), accepted=grow(s.accepted, -1),
                        kinds=grow(s.kinds, -1).at[..., num_warmup + old].set(s.kind))

    def client(c):  # (a client's key passes as it is)
        if not isinstance(c, MwGClientState):
            return c
        return c._replace(draws=grow(c.draws, -2).at[..., old, :].set(c.v))

    clients = jax.tree_util.tree_map(client, state.clients, is_leaf=lambda x: isinstance(x, MwGClientState))
    return state._replace(server=server, clients=clients)

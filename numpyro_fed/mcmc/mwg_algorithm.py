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
from jax import random

from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients
from .mwg_locals import anchor_map, colour, laplace_map, local_moves, log_det, marginal_grad, whiten
from .mwg_proposals import T_DF, T_SCALE, block_chol, block_conditional, propose, ridge_log_jacobian, t_log_prob  # noqa: F401
from .surrogate import Surrogate, accumulate, laplace_surrogate, metric, refit, surrogate_move, surrogate_value

__all__ = ["MwGClientState", "MwGConfig", "MwGInfo", "MwGServerState", "federated_mwg", "laplace_map"]

TARGET_ACCEPT = 0.3  # the random walk's target acceptance during warmup
TARGET_SURROGATE = 0.6  # the surrogate move's (both stages') target acceptance during warmup
START_KEY = 0x6D77  # the chains' starts (global, known to every party)
DISPERSE = 2.0
"""The chains after the first start at draws of ``N(start, DISPERSE^2 scale)``: over-dispersed against
the Laplace Gaussian, so that chains that cannot reach one another (a funnel's neck, a second mode)
disagree, and split R-hat says so."""


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
    schedule: tuple = (0, 0, 0, 1)  # the global moves' kinds, in turn (0: independence, 1: random walk, 2: surrogate,
    # 3: independence of the small sites' block, 4: the ridge move)
    leapfrog_steps: int = 4  # the surrogate move's leapfrog steps
    small: tuple = ()  # the small sites' entries: moved by kind 3, held by kind 2 (empty: kind 2 moves every entry)
    ridges: tuple = ()  # ((scale entry, (effect entries)), ...): kind 4 moves each scale with its effects

    @property
    def gradients(self) -> bool:
        """Whether the clients return their term's gradient in warmup (the surrogate's refit)."""
        return 2 in self.schedule


class MwGServerState(NamedTuple):
    u: jax.Array  # the chain's global position
    proposal: jax.Array  # (candidates, d): the points the clients are evaluating (a random walk: the first)
    kind: jax.Array  # 0: independence (candidates drawn from the Student-t), 1: random walk
    log_prior: jax.Array  # log p(u)
    mean: jax.Array  # the proposal's location
    chol: jax.Array  # its scale (lower Cholesky factor of the covariance)
    prec: jax.Array  # the inverse of that covariance
    block_chol: jax.Array  # the Cholesky factor of the small sites' covariance given the others (:func:`_block`)
    log_step: jax.Array  # the random walk's log step (times chol)
    stats: jax.Array  # (count, sum (d), outer sum (d, d)) of the window's warmup draws minus ``mean``, flattened
    iteration: jax.Array
    draws: jax.Array  # (num_samples, d)
    accepted: jax.Array  # (num_warmup + num_samples,) each iteration's decision
    kinds: jax.Array  # (num_warmup + num_samples,) each iteration's proposal kind
    sent: jax.Array  # (choice, slot) of the last decision sent: sent again while a round is repeated
    log_eps: jax.Array  # the surrogate move's log leapfrog step (in the coordinates chol whitens)
    diverging: jax.Array  # whether the surrogate trajectory of the pending proposal diverged
    divergent: jax.Array  # (num_warmup + num_samples,) each iteration's
    sur_anchor: jax.Array  # the likelihood's quadratic surrogate (surrogate.Surrogate's fields; refitted in warmup)
    sur_grad: jax.Array
    sur_prec: jax.Array
    sur_chol: jax.Array  # the surrogate trajectory's metric
    reg: jax.Array  # the surrogate refit's sums over this window's points (surrogate.accumulate), or (1,) unused


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


# ---------------------------------------------------------------------- one round
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
        v, value, local_acc = local_moves(rng_key, f, u, v, value, mode, lam, vec, index, config)
    eps = whiten(v - mode, lam, vec, index) if v.shape[0] else v  # the standardised locals, carried along

    def carry(u_new):  # the locals carried to a candidate, and the log ratio of the joint terms
        if v.shape[0]:
            m2, lam2, vec2 = laplace_map(f, u_new, s.anchor + s.slope @ u_new, config.map_steps, index)
            v2 = m2 + colour(eps, lam2, vec2, index)
            jac = log_det(lam2) - log_det(lam)
        else:
            m2, lam2, vec2, v2, jac = mode, lam, vec, v, jnp.zeros((), v.dtype)
        value2 = f(u_new, v2)
        return (v2, value2, m2, lam2, vec2), value2 - value + jac

    pending, ell = jax.vmap(carry)(b["proposal"])
    ok = jnp.isfinite(ell)
    extra = {}
    if config.gradients:  # in warmup, the gradient of the term at the first point (the surrogate's refit)
        at = b["proposal"][0]
        grad = jax.lax.cond(b["decided"] < config.num_warmup,
                            lambda: marginal_grad(f, at, pending[2][0], index), lambda: jnp.zeros_like(at))
        extra["grad"] = jnp.where(jnp.all(jnp.isfinite(grad)), grad, 0.0)
    state = MwGClientState(v, value, mode, lam, vec, pending, draws, local_acc, jnp.maximum(s.applied, b["decided"]),
                           s.anchor, s.slope)
    return state, {"ell": jnp.where(ok, ell, jnp.zeros((), ell.dtype)), "ok": ok, **extra}


def _delayed_ratio(ell, gap):
    """The surrogate move's second-stage log ratio: the clients' exact terms' change ``ell`` less the
    surrogate's ``gap`` (the first stage, on the surrogate, was already accepted)."""
    return ell - gap


def _decide(key, s: MwGServerState, ell, ok, lp_new, config: MwGConfig, surrogate: bool):
    """``(choice, log ratio)`` of one chain's global move from the clients' summed terms ``ell`` at
    its candidates (``ok``: every client's was finite) and the prior there (``lp_new``): the
    candidate taken (-1: none) and the log of the move's acceptance probability (independence:
    its chance of moving)."""
    gain = ell + lp_new - s.log_prior  # log pi(candidate) / pi(current)
    gain = jnp.where(ok & jnp.isfinite(gain), gain, -jnp.inf)
    # a random walk: Metropolis-Hastings on its one proposal (the first row)
    walk_ratio = gain[0]
    # the independence move: iterated sampling importance resampling over the current point and the
    # candidates, each weighted by pi / q (the current point's weight relative to itself: 1 / q(u))
    log_q, log_q_u = (t_log_prob(x, s.mean, s.chol, s.prec) for x in (s.proposal, s.u))
    if config.small:  # the small sites' block: its conditional Student-t (the others are the same in every row)
        small = jnp.asarray(config.small)
        loc, b_chol, b_prec = block_conditional(s, small)
        log_q = jnp.where(s.kind == 3, t_log_prob(s.proposal[:, small], loc, b_chol, b_prec), log_q)
        log_q_u = jnp.where(s.kind == 3, t_log_prob(s.u[small], loc, b_chol, b_prec), log_q_u)
    log_w = jnp.concatenate([-log_q_u[None], gain - log_q])
    log_w = jnp.where(jnp.isfinite(log_w), log_w, -jnp.inf)
    pick = random.categorical(key, log_w) - 1  # -1: stay
    move = 1.0 - jnp.exp(log_w[0] - jax.scipy.special.logsumexp(log_w))  # the chance of moving
    # the surrogate move: delayed acceptance of its one point, the exact term's ratio over the surrogate's
    sur = Surrogate(s.sur_anchor, s.sur_grad, s.sur_prec)
    gap = surrogate_value(sur, s.proposal[0]) - surrogate_value(sur, s.u) if surrogate else jnp.zeros((), s.u.dtype)
    da_ratio = _delayed_ratio(ell[0], gap)
    da_ratio = jnp.where(ok[0] & jnp.isfinite(da_ratio), da_ratio, -jnp.inf)
    if config.ridges:  # the ridge move: Metropolis-Hastings with the map's Jacobian
        walk_ratio = jnp.where(s.kind == 4, walk_ratio + ridge_log_jacobian(s.u, s.proposal[0], config.ridges),
                               walk_ratio)
    one_ratio = jnp.where(s.kind == 2, da_ratio, walk_ratio)  # (a surrogate move that stayed: ratio 0, accepted)
    walk_take = jnp.log(random.uniform(key, (), s.u.dtype)) < one_ratio
    many = (s.kind == 0) | (s.kind == 3)
    choice = jnp.where(many, pick, jnp.where(walk_take, 0, -1))
    log_ratio = jnp.where(many, jnp.log(jnp.maximum(move, 1e-300)), one_ratio)
    return choice, log_ratio


def _server_step(rng_key, s: MwGServerState, messages, view, *, log_prior: Callable, config: MwGConfig,
                 secure: bool = False, surrogate=None):
    """One chain's decision. ``secure``: ``messages`` hold the clients' sums (secure aggregation):
    ``ell`` summed, ``ok`` the count of clients whose term was finite."""
    k_accept, k_next = random.split(rng_key)
    complete = jnp.all(view.answered)
    total = config.num_warmup + config.num_samples
    if secure:
        ok = complete & (messages["ok"] == view.answered.shape[0])
        ell = messages["ell"]
        grad = messages.get("grad")
    else:
        ok = complete & jnp.all(messages["ok"], axis=0)  # (candidates,)
        ell = jnp.sum(messages["ell"], axis=0)
        grad = None if "grad" not in messages else jnp.sum(messages["grad"], axis=0)
    lp_new = jax.vmap(log_prior)(s.proposal)
    choice, log_ratio = _decide(k_accept, s, ell, ok, lp_new, config, surrogate is not None)
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
    moved = jnp.any(s.proposal[0] != s.u)  # (the surrogate move's stage one accepted)
    log_eps = jnp.where(warm & (s.kind == 2) & complete,
                        s.log_eps + (rate * moved - TARGET_SURROGATE) / jnp.sqrt(1.0 + it), s.log_eps)
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
    divergent = s.divergent.at[record].set(s.diverging, mode="drop")
    it_new = jnp.where(complete, it + 1, it)
    kind = jnp.where(complete, jnp.asarray(config.schedule, jnp.int32)[it_new % len(config.schedule)],
                     s.kind).astype(s.kind.dtype)
    proposal, diverging = propose(k_next, s._replace(u=u, mean=mean, chol=chol, log_step=log_step, log_eps=log_eps),
                                  kind, surrogate, config.small, config.ridges)
    proposal = jnp.where(complete, proposal, s.proposal)
    diverging = jnp.where(complete, diverging, s.diverging)
    stats = jnp.concatenate([count[None], total_sum, outer.ravel()])
    reg = s.reg if grad is None else accumulate(s.reg, s.proposal[0], grad, s.sur_anchor,
                                                collect & ok[0] & (s.kind == 2))
    # a client that did not answer: the same round again: no decision, and the last one sent again
    # (a client that missed it applies it now; one that had it does not apply it twice)
    slot = jnp.where(complete, jnp.where(keep, slot_index, -1), s.sent[1]).astype(jnp.int32)
    sent_choice = jnp.where(complete, choice, s.sent[0]).astype(jnp.int32)
    new = s._replace(u=u, proposal=proposal, kind=kind, log_prior=lp, log_step=log_step, stats=stats,
                     iteration=it_new, draws=draws, accepted=accepted, kinds=kinds,
                     sent=jnp.stack([sent_choice, slot]), log_eps=log_eps, diverging=diverging,
                     divergent=divergent, reg=reg)
    broadcast = Broadcast({"proposal": proposal, "current": u, "choice": sent_choice, "slot": slot,
                           "decided": it_new.astype(jnp.int32)})
    info = MwGInfo(accept, s.kind, log_ratio, view.answered.sum())
    return new, broadcast, info


def _pooled_refresh(rng_key, state: MwGServerState, shared, config: MwGConfig, surrogate=None,
                    log_prior: Optional[Callable] = None):
    """At the ends of warmup's windows (an eighth, a quarter, half and all of it, as Stan's
    doubling windows): the proposal's location and scale from every chain's draws in the window
    (their mean and covariance, the current scale counting as 10 draws), each chain's next
    proposal drawn from the refreshed one, and the window's sums cleared. With the surrogate move,
    at an eighth, a quarter, half and three quarters of warmup: the surrogate refitted to every
    chain's points of the window and their summed gradients (:func:`~numpyro_fed.mcmc.surrogate.refit`),
    and its metric (the last quarter adapts the step to the final surrogate); at both kinds of ends
    the trajectory's step is set to its mean over the chains."""
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
    prec = jnp.linalg.inv(cov)
    new = state._replace(mean=jnp.where(refresh, jnp.broadcast_to(mean, state.mean.shape), state.mean),
                         chol=jnp.where(refresh, jnp.broadcast_to(chol, state.chol.shape), state.chol),
                         prec=jnp.where(refresh, jnp.broadcast_to(prec, state.prec.shape), state.prec),
                         block_chol=jnp.where(refresh, jnp.broadcast_to(block_chol(prec, config.small),
                                                                        state.block_chol.shape), state.block_chol))
    if surrogate is not None:
        refit_now = (it == W // 8) | (it == W // 4) | (it == W // 2) | (it == 3 * W // 4)
        old = Surrogate(state.sur_anchor[0], state.sur_grad[0], state.sur_prec[0])
        sur = refit(jnp.sum(state.reg, 0), old, old.anchor)
        free = jnp.ones(d, bool).at[jnp.asarray(config.small, jnp.int32)].set(False)
        chol_s = metric(log_prior, sur, state.sur_chol[0], free)
        fields = dict(zip(("sur_anchor", "sur_grad", "sur_prec", "sur_chol"), (*sur, chol_s)))
        new = new._replace(**{k: jnp.where(refit_now, jnp.broadcast_to(v, getattr(new, k).shape), getattr(new, k))
                              for k, v in fields.items()},
                           reg=jnp.where(refit_now, jnp.zeros_like(new.reg), new.reg))
        refresh = refresh | refit_now
        # the trajectory's step, one for every chain (each chain's own adaptation is noisy): their mean
        new = new._replace(log_eps=jnp.where(end | refit_now, jnp.mean(new.log_eps), new.log_eps))
    fresh, diverging = jax.vmap(partial(propose, surrogate=surrogate, small=config.small))(
        random.split(rng_key, C), new, new.kind)
    proposal = jnp.where(refresh, fresh, new.proposal)
    diverging = jnp.where(refresh, diverging, new.diverging)
    stats = jnp.where(end, jnp.zeros_like(new.stats), new.stats)
    return new._replace(proposal=proposal, stats=stats, diverging=diverging), {**shared, "proposal": proposal}


def _surrogate_setup(log_prior: Callable, start, scale, chol0, config: MwGConfig):
    """``(move, surrogate, sums, metric)``: the surrogate transition's end point ``(key, state) ->
    (point, diverged)`` (``None`` where the schedule has none) and its first state: the likelihood's
    surrogate from the start with the exact prior, the refit's empty sums and the trajectory's
    metric over the entries it moves (all but the scalar sites' block)."""
    d, dtype = start.shape[0], start.dtype
    if not config.gradients:
        return None, Surrogate(start, jnp.zeros(d, dtype), jnp.zeros((d, d), dtype)), jnp.zeros(1, dtype), chol0
    free = jnp.ones(d, bool).at[jnp.asarray(config.small, jnp.int32)].set(False)
    sur0 = laplace_surrogate(log_prior, start, jnp.asarray(scale, dtype))

    def move(key, st):
        sur = Surrogate(st.sur_anchor, st.sur_grad, st.sur_prec)
        point, _, diverged = surrogate_move(key, log_prior, sur, st.u, st.sur_chol, st.log_eps, config.leapfrog_steps,
                                            free)
        return point, diverged

    return move, sur0, jnp.zeros(1 + 2 * d + 2 * d * d, dtype), metric(log_prior, sur0, chol0, free)


def _first_state(u0, log_prior_u0, start, chol0, first_surrogate, config: MwGConfig) -> MwGServerState:
    """A chain's server state at ``u0`` before its first proposal (the proposal's location and scale
    the start's; ``first_surrogate``: ``(surrogate, sums, metric)`` of :func:`_surrogate_setup`)."""
    d, dtype = u0.shape[0], u0.dtype
    total = config.num_warmup + config.num_samples
    sur0, reg0, sur_chol0 = first_surrogate
    prec0 = jnp.linalg.inv(chol0 @ chol0.T)
    # the surrogate trajectory's first step: about HMC's on a standard normal in d dimensions, so that
    # its length (leapfrog_steps of it) is about one standard deviation
    eps0 = min(1.0, 1.2 * d ** -0.25, 1.5 / config.leapfrog_steps)
    return MwGServerState(u0, jnp.broadcast_to(u0, (config.candidates, d)), jnp.asarray(config.schedule[0], jnp.int32),
                          log_prior_u0, start, chol0, prec0, block_chol(prec0, config.small),
                          jnp.log(jnp.asarray(2.38 / jnp.sqrt(d), dtype)), jnp.zeros(1 + d + d * d, dtype),
                          jnp.zeros((), jnp.int32), jnp.zeros((config.num_samples, d), dtype),
                          jnp.zeros(total, bool), jnp.zeros(total, jnp.int32), jnp.asarray([-1, -1], jnp.int32),
                          jnp.log(jnp.asarray(eps0, dtype)), jnp.zeros((), bool), jnp.zeros(total, bool),
                          *sur0, sur_chol0, reg0)


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
        blocks: the locals' independent blocks (:func:`~numpyro_fed.terms.blocks.local_blocks`).
        config: :class:`MwGConfig`.
        secure: ``None``, or how the clients' log ratios are summed so that the server sees only
            their sum (:mod:`numpyro_fed.run.secure`): ``"trusted"`` or ``"masking"``.
    """
    d = start.shape[0]
    dtype = start.dtype
    index = None if blocks is None else jnp.asarray(blocks)
    log_joint = jax.jit(client_log_joint)
    total = config.num_warmup + config.num_samples

    def log_joint_of(data):
        return lambda u, v: log_joint(jnp.concatenate([u, v]), data)

    C, N = config.num_chains, config.candidates
    chol0 = jnp.linalg.cholesky(jnp.asarray(scale, dtype))
    # the chains' starts: the first at ``start``, the others a draw of N(start, DISPERSE^2 scale) each, from a
    # key every party knows (the starts are global quantities, and each client needs them to start its locals)
    noise = random.normal(random.PRNGKey(START_KEY), (C, d), dtype).at[0].set(0.0)
    starts = start + DISPERSE * noise @ chol0.T
    surrogate, *first_surrogate = _surrogate_setup(log_prior, start, scale, chol0, config)
    first = jnp.asarray(config.schedule[0], jnp.int32)

    def init_chain(rng_key, u0):
        s = _first_state(u0, log_prior(u0), start, chol0, first_surrogate, config)
        proposal, diverging = propose(rng_key, s, first, surrogate, config.small, config.ridges)
        s = s._replace(proposal=proposal, diverging=diverging)
        return s, {"proposal": proposal, "current": u0, "choice": jnp.asarray(-1, jnp.int32),
                   "slot": jnp.asarray(-1, jnp.int32), "decided": jnp.zeros((), jnp.int32)}

    def init_server(rng_key):
        s, shared = jax.vmap(init_chain)(random.split(rng_key, C), starts)
        return s, Broadcast(shared)

    def init_client_chain(f, anchor, slope, u0):
        if num_local:
            mode, lam, vec = laplace_map(f, u0, anchor + slope @ u0, config.map_steps, index)
        else:
            mode, lam, vec = jnp.zeros(0, dtype), jnp.ones(0, dtype), jnp.zeros((0, 0), dtype)
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

    one_server = partial(_server_step, log_prior=log_prior, config=config, secure=secure is not None,
                         surrogate=surrogate)
    chain_axis = 0 if secure is not None else 1  # summed messages have no client axis
    fields = ("ell", "ok", "grad") if config.gradients else ("ell", "ok")

    def server_step(rng_key, state, messages, view):
        def chain(key, st, msg):
            new, b, info = one_server(key, st, msg, view)
            return new, b.shared, info

        k_chains, k_refresh = random.split(rng_key)
        new, shared, info = jax.vmap(chain, in_axes=(0, 0, chain_axis))(
            random.split(k_chains, C), state, {k: messages[k] for k in fields})
        new, shared = _pooled_refresh(k_refresh, new, shared, config, surrogate, log_prior)
        return new, Broadcast(shared), info

    return FederatedAlgorithm(
        init_server, init_client, all_clients(num_clients),
        (Exchange(client_step, server_step, "mwg", fields if secure is not None else (), secure or "trusted"),),
        monitor=lambda info: jnp.mean(info.accepted.astype(dtype)), monitor_name="accepted", name="mwg",
        done=lambda s: jnp.all(s.iteration > total),  # one round more: the clients record the last locals
        describe=lambda s: f"iteration {min(int(jnp.min(s.iteration)), total)} of {total}",
        progress=lambda s: (min(int(jnp.min(s.iteration)), total), config.num_warmup, total),
    )


def run_on_state(state, num_warmup: int, num_samples: int):
    """A finished run's :class:`~numpyro_fed.run.protocol.RunState` as the start of the same chains run on
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
                        kinds=grow(s.kinds, -1).at[..., num_warmup + old].set(s.kind),
                        divergent=grow(s.divergent, -1).at[..., num_warmup + old].set(s.diverging))

    def client(c):  # (a client's key passes as it is)
        if not isinstance(c, MwGClientState):
            return c
        return c._replace(draws=grow(c.draws, -2).at[..., old, :].set(c.v))

    clients = jax.tree_util.tree_map(client, state.clients, is_leaf=lambda x: isinstance(x, MwGClientState))
    return state._replace(server=server, clients=clients)

"""The protocol PVI and EP share: Gaussian factors ``t_j``, cavities, one ``Delta t_j`` per client.

The global approximation is ``q = p * prod_j t_j`` in natural parameters. In a round the
server asks some clients (``schedule``) and broadcasts ``q``; each asked client forms its
cavity ``q / t_j``, fits its local posterior (PVI: the local-ELBO optimum; EP: the
moment-matched tilted distribution) and sends the single message
``{delta: q_new / q, valid}``. The server applies the answered updates with damping
``delta`` and a positive-definiteness safeguard (halve ``delta``, at most ``max_halvings``
times, then reject the round), optionally with a KL trust region (``max_kl``).

**Acknowledgement.** The server acknowledges each client's update in the per-client part
of its next broadcast: ``ack[j]`` is the damping it applied to client j's last update.
When client j is next asked it first moves its factor by that fraction
(``t_j <- t_j * Delta t_j^{ack_j}``), so ``q = p prod_j t_j`` holds throughout without an
extra message. :func:`current_factor` gives a client's factor as of the latest broadcast.

**A missing answer** (dropout): the client's factor stays as it was: the server applies
only the updates that arrived and leaves ``ack`` of the others unchanged, and a client that
did not answer keeps its state, so its pending update is still acknowledged correctly
next time.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm
from ..run.steps import carried_while
from ..terms import gaussian as G
from ..terms.gaussian import NaturalGaussian
from ..terms.tilted import FitCheck

__all__ = [
    "SCHEDULES",
    "VARIANTS",
    "FactorClientState",
    "FactorInfo",
    "FactorServerState",
    "current_factor",
    "factor_protocol",
]

SCHEDULES = ("sequential", "synchronous", "subset")
VARIANTS = ("plain", "local_averaging", "virtual")


class FactorServerState(NamedTuple):
    q: NaturalGaussian
    ack: jax.Array  # (J,): damping applied to each client's last received update
    round: jax.Array
    prior_site: Optional[NaturalGaussian] = None  # t_0, the server's factor of a non-Gaussian prior's residual


class FactorClientState(NamedTuple):
    factor: NaturalGaussian  # t_j: the client's own factor
    pending: NaturalGaussian  # Delta t_j sent last, applied once acknowledged
    releases: jax.Array  # updates this client has sent (its privacy ledger under DP)
    # under DP, what the client keeps to itself (its fit diagnostics depend on its data):
    # [shard fits released as a zero change (non-finite, or an improper own cavity),
    #  local fits that failed their own check (e.g. not converged)]
    withheld: jax.Array


class FactorInfo(NamedTuple):
    damping: jax.Array  # the damping applied (0: round rejected or nothing arrived)
    halvings: jax.Array
    invalid: jax.Array  # answered clients whose update was invalid (improper cavity or failed fit)
    valid: jax.Array  # (J,) the answered clients whose update was valid
    kl: jax.Array  # KL(q_new || q): how far the round moved q
    fit_ok: jax.Array  # (J,) the answered clients whose own check passed its local fit
    fit_stat: jax.Array  # (J,) its convergence statistic (NaN: not answered or not applicable)
    fit_k: jax.Array  # (J,) its Pareto k (NaN: not answered or not applicable)
    prior_damping: jax.Array = None  # the damping applied to the prior site's update (NaN: no prior site)


def current_factor(state: FactorClientState, ack: jax.Array) -> NaturalGaussian:
    """A client's factor after applying the acknowledged fraction of its pending update."""
    return state.factor + state.pending.scale(ack)


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
    perturb: Optional[Callable] = None,
    private_fit: bool = False,
    trusted_aggregator: bool = False,
    prior_site: Optional[Callable] = None,
    aggregation: str = "trusted",
) -> FederatedAlgorithm:
    """Build the shared protocol around a client's local fit.

    Args:
        log_prior_factor: ``p(theta)`` as a Gaussian factor (full or diagonal: the family).
        local_update: ``(rng_key, cavity, q, data, kl_weight) -> (q_new, check)``, the
            client's local fit and its own :class:`~numpyro_fed.terms.tilted.FitCheck`
            of it (sent with the update, reported per client and round in ``info``).
        num_clients: J.
        schedule: ``"sequential"`` (one client per round, in turn), ``"synchronous"``
            (all), ``"subset"`` (``subset_size`` chosen uniformly per round).
        damping: ``delta`` in ``(0, 1]``.
        max_halvings: PD safeguard: halve ``delta`` at most this often, then reject.
        subset_size: clients per round for ``"subset"``.
        variant: ``"plain"``, ``"local_averaging"`` or ``"virtual"`` (Heikkilä et al. (2023) Alg. 1-3;
            see :func:`~numpyro_fed.factor.pvi_algorithm.pvi`).
        num_shards: shards per client for the two variants.
        max_kl: optional trust region: the damping is also halved while
            ``KL(q_new || q) > max_kl`` nats (tames parallel EP over many clients).
        perturb: update perturbation (Heikkilä et al. (2023) §4.2): ``(rng_key, changes) -> (noised
            sum, noised changes)`` over the shards' changes ``lambda*_k - lambda`` (leading
            shard axis; one shard for ``"plain"``). The client sends the noised sum (divided
            by the shards for ``"local_averaging"``), drawn from its own key; its fit
            diagnostics, which depend on its data, stay out of the message and are counted
            in its own state (``withheld``).
        private_fit: the local fit is itself differentially private (DP-SGD, Heikkilä et al. (2023)
            §4.1): its change is sent as it is, but its fit diagnostics are withheld and
            counted as with ``perturb``.
        trusted_aggregator: the changes go through a trusted aggregator
            (:class:`~numpyro_fed.run.protocol.Exchange`'s ``secure_sum``): the server sees
            only their sum, so each client's message is its noised change alone, sent as
            it is (no validity flag or zeroing that would depend on the client's own,
            less noised, change); the server checks the sum.
        aggregation: with ``trusted_aggregator``: who sums the changes, ``"trusted"`` (a
            trusted aggregator) or ``"masking"`` (pairwise masking, no third party;
            :mod:`numpyro_fed.run.secure`).
        prior_site: for a non-Gaussian prior (:mod:`~numpyro_fed.terms.prior_site`):
            ``(rng_key, cavity, q) -> (q_new, ok)``, the server's tilted-moment step for its
            own factor ``t_0`` of the prior's residual, run after the clients' updates of
            every round (with ``log_prior_factor`` the prior's Gaussian part).
    """
    if trusted_aggregator and perturb is None:
        raise ValueError("trusted_aggregator=True scales the noise of update perturbation: it needs perturb=")
    config = FactorConfig(
        log_prior_factor, local_update, num_clients, schedule, damping, max_halvings, int(subset_size), variant,
        int(num_shards) if variant != "plain" else 1, max_kl, perturb, perturb is not None or private_fit,
        trusted_aggregator, prior_site,
    )
    bind = partial(partial, config=config)
    num_selected = {"synchronous": num_clients, "sequential": 1, "subset": int(subset_size)}[schedule]
    secure = ("delta",) if trusted_aggregator else ()
    return FederatedAlgorithm(
        bind(init_server), bind(init_client), bind(select),
        (Exchange(bind(client_step), bind(server_step), "factor_update", secure, aggregation),),
        num_selected=num_selected, monitor=lambda info: info.kl, monitor_name="KL(q_new||q)",
    )


class FactorConfig(NamedTuple):
    """The factor protocol's static settings (see :func:`factor_protocol`): the prior factor,
    the client's local fit, and how updates are scheduled, split, damped and privatised."""

    prior: NaturalGaussian
    local_update: Callable
    num_clients: int
    schedule: str
    damping: float
    max_halvings: int
    subset_size: int
    variant: str
    shards: int
    max_kl: Optional[float]
    perturb: Optional[Callable]
    private: bool
    trusted_aggregator: bool
    prior_site: Optional[Callable]


def select(rng_key, state: FactorServerState, *, config: FactorConfig):
    """Who is asked: everyone (synchronous), client ``round mod J`` (sequential), or a
    uniform subset drawn from the server's key."""
    J = config.num_clients
    if config.schedule == "synchronous":
        return jnp.ones(J, bool)
    if config.schedule == "sequential":
        return jnp.arange(J) == (state.round % J)
    order = random.permutation(rng_key, J)
    return jnp.zeros(J, bool).at[order[: config.subset_size]].set(True)


def init_server(rng_key, *, config: FactorConfig):
    """``q`` starts at the prior; no damping acknowledged yet; the prior's residual site at zero."""
    del rng_key
    prior = config.prior
    ack = jnp.zeros(config.num_clients, prior.shift.dtype)
    site = G.zeros(prior.shift.shape[0], prior.diagonal) if config.prior_site is not None else None
    return FactorServerState(prior, ack, jnp.zeros((), jnp.int32), site), Broadcast({"q": prior}, {"ack": ack})


def _zero_factor(config: FactorConfig):
    z = G.zeros(config.prior.shift.shape[0], config.prior.diagonal)
    return jax.tree_util.tree_map(lambda x: jnp.zeros((config.shards,) + x.shape), z) \
        if config.variant == "virtual" else z


def init_client(rng_key, data, *, config: FactorConfig) -> FactorClientState:
    """Every factor ``t_j`` (one per shard for virtual clients) starts at 1 (zero natural parameters)."""
    del rng_key, data
    return FactorClientState(_zero_factor(config), _zero_factor(config), jnp.zeros((), jnp.int32),
                             jnp.zeros(2, jnp.int32))


def _shard(data, k, shards: int):
    """Client data restricted to its k-th shard: a contiguous block of its real rows."""
    index = jnp.arange(data.row_mask.shape[0])
    block = jnp.floor(index * shards / data.num_rows)
    return data._replace(row_mask=data.row_mask * (block == k).astype(data.row_mask.dtype))


def _finite(nat):
    return jnp.all(jnp.isfinite(nat.shift)) & jnp.all(jnp.isfinite(nat.precision))


def _released(perturb, key, changes, usable):
    """Under DP: a shard whose fit failed (or whose own cavity is improper) adds a zero change,
    not NaN, so the release stays a noised sum of changes of norm at most C and says nothing
    about which shard failed. Returns ``(perturb's release, how many shards were zeroed)``."""
    ok = usable & jax.vmap(_finite)(changes)
    changes = jax.tree_util.tree_map(lambda x: jnp.where(ok.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0), changes)
    return perturb(key, changes), jnp.sum(~ok).astype(jnp.int32)


def _plain_update(config: FactorConfig, rng_key, noise_key, q, factor, data):
    """One fit under the client's cavity ``q / t_j``: ``(delta, pending, proper, check, failed fits, zeroed)``."""
    cavity = q - factor
    fit, check = config.local_update(rng_key, cavity, q, data, 1.0)
    pending, zeroed = fit - q, jnp.zeros((), jnp.int32)
    if config.perturb is not None:
        release, zeroed = _released(config.perturb, noise_key, jax.tree_util.tree_map(lambda x: x[None], pending),
                                    jnp.ones(1, bool))
        pending = release[0]
    return pending, pending, G.is_positive_definite(cavity), check, (~check.ok).astype(jnp.int32), zeroed


def _averaged_update(config: FactorConfig, rng_key, noise_key, q, factor, data):
    """Local averaging (Heikkilä et al. (2023) Alg. 2): one fit per shard under the shared cavity with the
    KL weighted ``1 / shards``; their mean (DP: eq. 4.7, the noised sum of clipped changes / N)."""
    shards = config.shards
    cavity = q - factor
    keys, ks = random.split(rng_key, shards), jnp.arange(shards)
    fits, checks = jax.vmap(lambda k, key: config.local_update(key, cavity, q, _shard(data, k, shards),
                                                               1.0 / shards))(ks, keys)
    zeroed = jnp.zeros((), jnp.int32)
    if config.perturb is None:
        pending = jax.tree_util.tree_map(lambda x: jnp.mean(x, 0), fits) - q
    else:  # eq. 4.7: (sum of clipped changes + noise) / N
        changes = jax.tree_util.tree_map(lambda x, q_: x - q_, fits, q)
        release, zeroed = _released(config.perturb, noise_key, changes, jnp.ones(shards, bool))
        pending = release[0].scale(1.0 / shards)
    check = FitCheck(jnp.all(checks.ok), jnp.max(checks.stat), jnp.max(checks.pareto_k))
    return pending, pending, G.is_positive_definite(cavity), check, jnp.sum(~checks.ok), zeroed


def _virtual_update(config: FactorConfig, rng_key, noise_key, q, factor, data):
    """Virtual clients (Heikkilä et al. (2023) Alg. 3): one factor and one cavity per shard; the client
    sends their changes' sum (DP: eq. 4.11, each keeps its clipped change plus its share of noise)."""
    shards = config.shards
    keys, ks = random.split(rng_key, shards), jnp.arange(shards)

    def one(k, key, t_k):
        cavity = q - t_k
        fit, check = config.local_update(key, cavity, q, _shard(data, k, shards), 1.0)
        return fit - q, G.is_positive_definite(cavity), check

    pending, proper, checks = jax.vmap(one)(ks, keys, factor)
    zeroed = jnp.zeros((), jnp.int32)
    if config.perturb is None:
        delta = jax.tree_util.tree_map(lambda x: jnp.sum(x, 0), pending)
    else:  # eq. 4.11: each virtual factor keeps its clipped change plus its share of the noise
        (delta, pending), zeroed = _released(config.perturb, noise_key, pending, proper)
    # whether the shards' own cavities were proper depends on their (data-
    # dependent) factors: under DP it is not part of the release
    proper = jnp.all(proper) if config.perturb is None else jnp.asarray(True)
    check = FitCheck(jnp.all(checks.ok), jnp.max(checks.stat), jnp.max(checks.pareto_k))
    return delta, pending, proper, check, jnp.sum(~checks.ok), zeroed


_VARIANT_UPDATES = {"plain": _plain_update, "local_averaging": _averaged_update, "virtual": _virtual_update}


def client_step(rng_key, state: FactorClientState, broadcast, data, *, config: FactorConfig):
    """The client acknowledges its last update, fits its variant's update, and sends
    ``delta`` with its validity and fit check (under DP: the noised change alone, the
    diagnostics withheld and counted in its own state)."""
    q = broadcast.shared["q"]
    factor = current_factor(state, broadcast.per_client["ack"])  # acknowledge the last update
    noise_key = random.fold_in(rng_key, config.shards)  # used only with perturb
    delta, pending, proper, check, failed_fits, zeroed = _VARIANT_UPDATES[config.variant](
        config, rng_key, noise_key, q, factor, data)
    releases = state.releases + 1
    if config.private:  # the fit's own check depends on the data: the client keeps it
        withheld = state.withheld + jnp.stack([zeroed, jnp.asarray(failed_fits, jnp.int32)])
        check = FitCheck(jnp.asarray(True), jnp.full((), jnp.nan, check.stat.dtype),
                         jnp.full((), jnp.nan, check.stat.dtype))
    else:
        withheld = state.withheld
    if config.trusted_aggregator:  # sent as noised; only the sum is released (see factor_protocol)
        return FactorClientState(factor, pending, releases, withheld), {"delta": delta}
    # an improper cavity has no local ELBO, and a failed local fit (not finite, or not
    # a proper Gaussian) is no update: the client sends zero and says so. A noised
    # update (perturb) is judged by the server instead, whose safeguard damps the sum
    # until q stays proper: rejecting it here would discard most noised updates early
    # on, when q's precision is still the prior's.
    proper_q = G.is_positive_definite(q + delta) if config.perturb is None else jnp.asarray(True)
    valid = proper & _finite(delta) & proper_q
    delta = jax.tree_util.tree_map(lambda x: jnp.where(valid, x, 0.0), delta)
    pending = jax.tree_util.tree_map(lambda x: jnp.where(valid, x, 0.0), pending)
    message = {"delta": delta, "valid": valid, "fit_ok": check.ok, "fit_stat": check.stat, "fit_k": check.pareto_k}
    return FactorClientState(factor, pending, releases, withheld), message


def _damping(config: FactorConfig, acceptable: Callable):
    """``damping`` halved until ``acceptable`` (at most ``max_halvings`` times): ``(delta, halvings)``."""
    def halve(carry):
        delta, halvings = carry
        return delta / 2, halvings + 1

    def keep_halving(carry):
        delta, halvings = carry
        return (~acceptable(delta)) & (halvings < config.max_halvings)

    return carried_while(keep_halving, halve, (jnp.asarray(config.damping, config.prior.shift.dtype), 0))


def _refine_prior_site(config: FactorConfig, rng_key, q, site):
    """The server's own site: ``t_0`` moved towards the tilted moments of the prior's
    residual, damped and halved until ``q`` stays positive definite (rejected otherwise)."""
    fit, ok = config.prior_site(rng_key, q - site, q)
    change = fit - q
    ok = ok & _finite(change)
    change = jax.tree_util.tree_map(lambda x: jnp.where(ok, x, 0.0), change)
    applied, _ = _damping(config, lambda delta: G.is_positive_definite(q + change.scale(delta)))
    applied = jnp.where(ok & G.is_positive_definite(q + change.scale(applied)), applied, 0.0)
    return q + change.scale(applied), site + change.scale(applied), applied


def server_step(rng_key, state: FactorServerState, messages, view, *, config: FactorConfig):
    """The answered clients' valid updates summed, damped and halved until ``q`` stays
    positive definite (and within ``max_kl``), then the prior's residual site (if any)."""
    answered = view.answered
    dtype = config.prior.shift.dtype
    if config.trusted_aggregator:  # the sum alone arrives; the server checks it below
        nan = jnp.full(answered.shape, jnp.nan, dtype)
        messages = {"delta": None, "valid": answered, "fit_ok": answered, "fit_stat": nan, "fit_k": nan,
                    "total": messages["delta"]}
    valid = answered & messages["valid"]
    w = answered.astype(dtype)
    total = messages["total"] if config.trusted_aggregator else jax.tree_util.tree_map(
        lambda x: jnp.tensordot(w, x, axes=1), messages["delta"])

    def acceptable(delta):
        new = state.q + total.scale(delta)
        pd = G.is_positive_definite(new)
        if config.max_kl is None:
            return pd
        safe = jax.tree_util.tree_map(lambda a, b: jnp.where(pd, a, b), new, state.q)
        return pd & (G.kl_divergence(safe, state.q) <= config.max_kl)

    applied, halvings = _damping(config, acceptable)
    applied = jnp.where(acceptable(applied) & jnp.any(valid), applied, 0.0)
    q = state.q + total.scale(applied)
    ack = jnp.where(answered, applied, state.ack)
    site, prior_damping = state.prior_site, jnp.full((), jnp.nan, dtype)
    if config.prior_site is not None:
        q, site, prior_damping = _refine_prior_site(config, rng_key, q, site)
    kl = G.kl_divergence(q, state.q)
    new = FactorServerState(q, ack, state.round + 1, site)
    fit_ok = answered & messages["fit_ok"]
    fit_stat = jnp.where(answered, messages["fit_stat"], jnp.nan)
    fit_k = jnp.where(answered, messages["fit_k"], jnp.nan)
    info = FactorInfo(applied, jnp.asarray(halvings), jnp.sum(answered & ~messages["valid"]), valid, kl, fit_ok,
                      fit_stat, fit_k, prior_damping)
    return new, Broadcast({"q": q}, {"ack": ack}), info

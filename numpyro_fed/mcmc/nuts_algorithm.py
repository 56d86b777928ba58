"""Exact federated NUTS and HMC: one leapfrog step per communication round.

The target is the pooled posterior of the global sites ``theta`` and every client's
local sites ``z_j``, whose potential energy is a sum of client terms,

.. math::

    U(\\theta, z_1, \\dots, z_J) = -\\sum_j \\big[w_j \\log p(\\theta)
        + \\log p(z_j, y_j \\mid \\theta)\\big], \\qquad \\sum_j w_j = 1

(unconstrained space, Jacobians included; the server never evaluates the model). With a
diagonal mass matrix the leapfrog step splits by owner. One round:

1. the server broadcasts the new global position ``theta'`` of the leaf in progress (it
   holds the global momentum and the summed gradient), the step and its decisions about
   the previous leaf (:class:`~numpyro_fed.mcmc.block.Decisions`);
2. client ``j`` applies the decisions to its copy of the tree, moves its own ``z_j`` with
   its own momentum (drawn from its own key at the start of an iteration), evaluates
   ``U_j(theta', z_j')`` and returns ``dU_j/dtheta``, ``U_j``, its kinetic energy and its
   share of the U-turn dot products (:class:`MCMCMessage`);
3. the server sums them, completes its own half step, and takes NumPyro's decisions
   (:mod:`~numpyro_fed.mcmc.tree`), adapting the step size during warmup.

Nothing a client sends depends on its local position other than through these sums and
``dU_j/dtheta``; its local draws, momenta and key stay on it. A round in which a client did
not answer is repeated (a client answers a repeated round with its stored message), so
the chain is the pooled chain whatever the network does.

Each chain's draws and per-iteration statistics are kept in the owners' states (the
server: global draws and the statistics; each client: its local draws), preallocated for
``num_warmup + num_samples`` iterations. Chains run side by side (vmapped), every chain
one leaf per round; ``done`` says when every chain has finished.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from .._typing import Array
from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients
from ..run.secure.fixed_point import saturate
from .adapt import MassState, StepState, adapt_mass, adapt_step, init_mass, init_step
from .block import (
    Block,
    Command,
    Decisions,
    LeafShares,
    apply_decisions,
    finish_leaf,
    init_block,
    new_iteration,
    start_leaf,
)
from .tree import LeafTotals, TreeState, hmc_decide, init_tree, nuts_decide, start_doubling, start_tree

__all__ = ["IterationStats", "MCMCBroadcast", "MCMCClientState", "MCMCConfig", "MCMCInfo", "MCMCMessage",
           "MCMCServerState", "federated_mcmc"]

EVALUATE, LEAPFROG, IDLE = 0, 1, 2
INIT, RUNNING, FLUSHING, DONE, FAILED = 0, 1, 2, 3, 4
INIT_RADIUS = 2.0  # NumPyro's init_to_uniform
MAX_INIT_TRIES = 100  # NumPyro's find_valid_initial_params


class MCMCConfig(NamedTuple):
    """Static settings and the model's pieces (bound by :func:`federated_mcmc`).

    ``potential(theta, z, data) -> U_j`` is a client's term of the potential energy;
    ``local_mask(data) -> (n_j,)`` marks its real local coordinates (0 on padding);
    ``global_size`` is the dimension of ``theta``."""

    potential: Callable
    local_mask: Callable
    global_size: int
    num_clients: int
    num_warmup: int
    num_samples: int
    num_chains: int
    algo: str  # "NUTS" or "HMC"
    max_tree_depth: int
    max_delta_energy: float
    target_accept_prob: float
    step_size: float
    adapt_step_size: bool
    adapt_mass_matrix: bool
    trajectory_length: float  # HMC (None: num_steps fixed)
    num_steps: int  # HMC with a fixed number of steps, else None
    windows: Array  # Stan's warmup windows (adapt.window_table)
    dtype: object
    init_position: Optional[Array] = None  # (d,): the chains start near it (e.g. a Laplace mode), not uniformly
    init_inv_mass: Optional[Array] = None  # (d,): the global block's starting diagonal M^-1 (e.g. Laplace variances)
    secure: Optional[str] = None  # how the clients' messages are summed (numpyro_fed.run.secure), or None: in the clear


class IterationStats(NamedTuple):
    """Per chain and iteration (warmup included), as NumPyro's ``HMCState`` reports them."""

    accept_prob: Array
    diverging: Array
    num_steps: Array
    tree_depth: Array
    energy: Array
    potential_energy: Array
    step_size: Array


class MCMCBroadcast(NamedTuple):
    """Per chain: the global position of the leaf in progress (or, for an evaluation, the
    chain's position), the command and the decisions about the previous leaf; ``seq``
    numbers the round's broadcast (a repeated round repeats it)."""

    theta: Array
    cmd: Command
    dec: Decisions
    seq: Array


class MCMCMessage(NamedTuple):
    """Per chain, what a client sends for a leaf: its potential term, its gradient w.r.t.
    the global position, and its shares of the kinetic energy and U-turn checks."""

    pe: Array
    grad: Array
    kinetic: Array
    kinetic0: Array
    turn: Array
    full: Array


class MCMCClientState(NamedTuple):
    block: Block
    mass: MassState
    draws: Array  # (chains, num_samples, n_j): the client's own local draws
    seq: Array
    last: MCMCMessage  # its answer to broadcast ``seq`` (sent again if that round repeats)


class MCMCServerState(NamedTuple):
    block: Block
    mass: MassState
    step: StepState
    tree: TreeState
    key: Array  # per chain, NumPyro's HMCState.rng_key
    phase: Array
    iteration: Array  # iterations completed
    pe: Array  # potential energy at the chain's position
    kinetic0: Array  # the server's kinetic energy of this iteration's momentum
    eps: Array  # this trajectory's step size
    tries: Array
    stats: IterationStats
    draws: Array  # (chains, num_samples, d): the global draws
    sent: MCMCBroadcast  # the pending broadcast


class MCMCInfo(NamedTuple):
    """Per round: each chain's completed iterations and potential energy, and whether
    every client answered (an incomplete round is repeated)."""

    iteration: Array
    potential_energy: Array
    complete: Array


def _pick(flag, a, b):
    return jax.tree_util.tree_map(lambda x, y: jnp.where(flag, x, y), a, b)


def _write_row(array, index, row):
    """``array[index] = row`` in place when ``index >= 0`` (else unchanged): one row is
    touched, where ``jnp.where`` over the whole array would copy it every round."""
    i = jnp.maximum(index, 0)
    return array.at[i].set(jnp.where(index >= 0, row, array[i]))


def _noop_decisions() -> Decisions:
    f = jnp.zeros((), bool)
    return Decisions(f, f, f, f, f, f, jnp.full((), -1, jnp.int32))


def _command(kind, new_iteration=False, new_doubling=False, going_right=False, step=0.0, leaf_idx=0, redraw=False,
             dtype=jnp.float32) -> Command:
    return Command(jnp.asarray(kind, jnp.int32), jnp.asarray(new_iteration, bool), jnp.asarray(new_doubling, bool),
                   jnp.asarray(going_right, bool), jnp.asarray(step, dtype), jnp.asarray(leaf_idx, jnp.int32),
                   jnp.asarray(redraw, bool))


def _uniform(rng_key, shape, dtype):
    return random.uniform(rng_key, shape, dtype, -INIT_RADIUS, INIT_RADIUS)


# ---------------------------------------------------------------------------- client
def client_chain(rng_key, block: Block, mass: MassState, draws, theta, cmd: Command, dec: Decisions, data, *,
                 config: MCMCConfig):
    """One chain's client step: apply the decisions about the last leaf, adapt and record,
    then the command (evaluate, or one leapfrog step of its own block)."""
    mask = config.local_mask(data).astype(block.z.dtype)
    block = apply_decisions(block, dec)
    mass = adapt_mass(mass, block.z, dec.welford, dec.window_end, config.adapt_mass_matrix)
    draws = _write_row(draws, dec.record, block.z)
    k_init, k_momentum = random.split(rng_key)
    block = block._replace(z=jnp.where(cmd.redraw, _uniform(k_init, block.z.shape, block.z.dtype) * mask, block.z))
    fresh, kinetic0 = new_iteration(block, k_momentum, mass.mass_sqrt, mask, mass.inv_mass)
    block = _pick(cmd.new_iteration, fresh, block)
    stepped, z_new = start_leaf(block, cmd, mass.inv_mass)
    leapfrog = cmd.kind == LEAPFROG
    z_eval = jnp.where(leapfrog, z_new, block.z)
    pe, (g_theta, g_z) = jax.value_and_grad(config.potential, argnums=(0, 1))(theta, z_eval, data)
    g_z = g_z * mask
    stepped, shares = finish_leaf(stepped, cmd, z_new, g_z, mass.inv_mass)
    block = _pick(leapfrog, stepped, block._replace(g=jnp.where(cmd.kind == EVALUATE, g_z, block.g)))
    active = cmd.kind != IDLE
    zero = jnp.zeros_like(pe)
    message = MCMCMessage(
        jnp.where(active, pe, zero), jnp.where(active, g_theta, 0.0), jnp.where(leapfrog, shares.kinetic, zero),
        jnp.where(cmd.new_iteration, kinetic0, zero), jnp.where(leapfrog, shares.turn, 0.0),
        jnp.where(leapfrog, shares.full, 0.0))
    if config.secure == "masking":  # a divergent leaf's huge terms are sent as the infinities they stand for
        message = jax.tree_util.tree_map(partial(saturate, num_clients=config.num_clients), message)
    return block, mass, draws, message


def client_step(rng_key, state: MCMCClientState, broadcast: Broadcast, data, *, config: MCMCConfig):
    """Every chain's client step; a repeated broadcast (same ``seq``) gets the stored answer."""
    b = broadcast.shared
    seen = b.seq == state.seq
    keys = random.split(rng_key, config.num_chains)
    chain = partial(client_chain, config=config)
    dec = b.dec._replace(record=jnp.where(seen, -1, b.dec.record))  # a repeated round records nothing again
    block, mass, draws, message = jax.vmap(chain, in_axes=(0, 0, 0, 0, 0, 0, 0, None))(
        keys, state.block, state.mass, state.draws, b.theta, b.cmd, dec, data)
    # the draws are written in place (a select over them would copy them every round)
    new = MCMCClientState(_pick(seen, state.block, block), _pick(seen, state.mass, mass), draws,
                          jnp.where(seen, state.seq, b.seq), _pick(seen, state.last, message))
    return new, new.last


def init_client(rng_key, data, *, config: MCMCConfig) -> MCMCClientState:
    """Each chain starts at a uniform draw in (-2, 2) of its unconstrained local space (NumPyro's
    ``init_to_uniform``), from the client's own key."""
    mask = config.local_mask(data)
    n, dtype = mask.shape[0], config.dtype
    depth = config.max_tree_depth if config.algo == "NUTS" else 0

    def one(key):
        return init_block(_uniform(key, (n,), dtype) * mask.astype(dtype), depth), init_mass(n, dtype)

    block, mass = jax.vmap(one)(random.split(rng_key, config.num_chains))
    message = _empty_message(config)
    return MCMCClientState(block, mass, jnp.zeros((config.num_chains, config.num_samples, n), dtype),
                           jnp.full((), -1, jnp.int32), message)


def _empty_message(config: MCMCConfig) -> MCMCMessage:
    C, d, dtype = config.num_chains, config.global_size, config.dtype
    depth = config.max_tree_depth if config.algo == "NUTS" else 0
    z = jnp.zeros(C, dtype)
    return MCMCMessage(z, jnp.zeros((C, d), dtype), z, z, jnp.zeros((C, depth, 2), dtype), jnp.zeros((C, 2), dtype))


# ---------------------------------------------------------------------------- server
def _trajectory(config: MCMCConfig, step_size):
    """HMC: the number of leaves and the step that makes the trajectory length exact
    (NumPyro's ``_get_num_steps``); NUTS: ``step_size`` (and no fixed count)."""
    if config.algo == "NUTS":
        return jnp.zeros((), jnp.int32), step_size
    if config.num_steps is not None:
        return jnp.asarray(config.num_steps, jnp.int32), step_size
    num = jnp.ceil(config.trajectory_length / step_size).astype(jnp.int32)
    return num, config.trajectory_length / num


def _start_iteration(s: MCMCServerState, config: MCMCConfig) -> MCMCServerState:
    """A new iteration: NumPyro's key split, the server's momentum, a one-point tree and the
    first doubling."""
    key, k_momentum, k_transition = random.split(s.key, 3)
    block, kinetic0 = new_iteration(s.block, k_momentum, s.mass.mass_sqrt, jnp.ones_like(s.block.z),
                                    s.mass.inv_mass)
    num_steps, eps = _trajectory(config, s.step.step_size)
    tree = start_doubling(start_tree(k_transition, s.pe, jnp.zeros_like(s.pe), num_steps), config.algo == "HMC")
    return s._replace(block=block, tree=tree, key=key, kinetic0=kinetic0, eps=eps)


def _end_iteration(s: MCMCServerState, config: MCMCConfig) -> tuple:
    """After an iteration: the warmup adaptation. Returns ``(state, welford, window_end, record
    index, the iteration's statistics)``; the caller writes the statistics and the draw."""
    t, tree = s.iteration, s.tree
    if config.algo == "NUTS":  # the mean over the tree's leaves (NumPyro's _nuts_next)
        accept, num_steps = tree.sum_accept / jnp.maximum(tree.num_proposals, 1), tree.num_proposals
    else:  # the last leaf's (NumPyro's _hmc_next)
        accept, num_steps = tree.sum_accept, tree.num_steps
    row = IterationStats(accept, tree.diverging, num_steps, tree.depth, tree.energy_prop, tree.pe_prop, s.eps)
    warm = t < config.num_warmup
    step, welford, window_end = adapt_step(s.step, t, accept, config.windows, config.num_warmup,
                                           config.target_accept_prob, config.adapt_step_size)
    step = _pick(warm, step, s.step)
    welford, window_end = welford & warm, window_end & warm
    mass = adapt_mass(s.mass, s.block.z, welford, window_end, config.adapt_mass_matrix)
    record = jnp.where(warm, -1, t - config.num_warmup).astype(jnp.int32)
    s = s._replace(step=step, mass=mass, pe=tree.pe_prop, iteration=t + 1)
    return s, welford, window_end, record, row


def _after_leaf(s: MCMCServerState, totals: MCMCMessage, config: MCMCConfig):
    """The server's half of a leapfrog step, then NumPyro's decisions about the leaf.
    Returns ``(state, decisions, iteration ended, subtree ended, the iteration's statistics)``."""
    cmd = s.sent.cmd
    block, own = finish_leaf(s.block, cmd, s.sent.theta, totals.grad, s.mass.inv_mass)
    energy0 = jnp.where(cmd.new_iteration, s.pe + s.kinetic0 + totals.kinetic0, s.tree.energy0)
    # (the start's energy is known once the clients' kinetic energies arrive: until a leaf is taken the
    # proposal is the start, whose energy is the iteration's recorded energy where none is)
    tree = s.tree._replace(energy0=energy0, energy_prop=jnp.where(cmd.new_iteration, energy0, s.tree.energy_prop))
    leaf = LeafTotals(totals.pe, LeafShares(own.kinetic + totals.kinetic, jnp.zeros_like(totals.pe),
                                            own.turn + totals.turn, own.full + totals.full))
    if config.algo == "NUTS":
        tree, dec, ended = nuts_decide(tree, leaf, config.max_tree_depth, config.max_delta_energy)
    else:
        tree, dec, ended = hmc_decide(tree, leaf, config.max_delta_energy)
    s = s._replace(block=apply_decisions(block, dec), tree=tree)
    done, welford, window_end, record, row = _end_iteration(s, config)
    s = _pick(ended, done, s)
    dec = dec._replace(welford=welford & ended, window_end=window_end & ended, record=jnp.where(ended, record, -1))
    return s, dec, ended, dec.sub_end, row


def _next_leaf(s: MCMCServerState, new_iteration, new_doubling, config: MCMCConfig):
    """The next leaf's command and the server's first half step (the broadcast position)."""
    started = _start_iteration(s, config)
    s = _pick(new_iteration, started, s)
    doubled = s._replace(tree=start_doubling(s.tree, config.algo == "HMC"))
    s = _pick(new_doubling & ~new_iteration, doubled, s)
    step = jnp.where(s.tree.going_right, s.eps, -s.eps)
    cmd = _command(LEAPFROG, new_iteration, new_doubling | new_iteration, s.tree.going_right, step,
                   s.tree.leaf_idx, dtype=config.dtype)
    block, theta = start_leaf(s.block, cmd, s.mass.inv_mass)
    return s._replace(block=block), theta, cmd


def server_chain(rng_key, s: MCMCServerState, totals: MCMCMessage, complete, *, config: MCMCConfig):
    """One chain's server step on the clients' summed message, by what the clients just did:
    an evaluation at the starting point (start the chain, or retry elsewhere as NumPyro's
    ``init_to_uniform`` does), a leapfrog step (NumPyro's decisions, then the next leaf or
    the final decisions), or nothing (the chain is done). An incomplete round (``complete``
    false) changes nothing: the same broadcast goes out again."""
    kind = s.sent.cmd.kind
    total = config.num_warmup + config.num_samples
    noop, idle = _noop_decisions(), _command(IDLE, dtype=config.dtype)
    stats, draws = s.stats, s.draws  # written in place at the end, never selected whole
    s = s._replace(stats=None, draws=None)
    evaluated = kind == EVALUATE
    ok = jnp.isfinite(totals.pe) & jnp.all(jnp.isfinite(totals.grad))
    at_start = s._replace(block=s.block._replace(g=totals.grad), pe=totals.pe)
    after_leaf, dec, ended, sub_end, row = _after_leaf(s, totals, config)
    finished = after_leaf.iteration >= total
    new_iteration = jnp.where(evaluated, ok, ended & ~finished)
    new_doubling = ~evaluated & sub_end & ~ended
    s_next, theta, cmd = _next_leaf(_pick(evaluated, at_start, after_leaf), new_iteration, new_doubling, config)
    dec = _pick(evaluated, noop, dec)
    s_next = s_next._replace(phase=jnp.where(evaluated & ok, RUNNING, s_next.phase))
    # the starting point was not finite: another one (the clients redraw theirs)
    retry = evaluated & ~ok
    retry_theta = _uniform(rng_key, s.block.z.shape, s.block.z.dtype)
    tries = s.tries + 1
    retried = s._replace(block=s.block._replace(z=retry_theta), tries=tries,
                         phase=jnp.where(tries >= MAX_INIT_TRIES, FAILED, INIT))
    s_next = _pick(retry, retried, s_next)
    theta = jnp.where(retry, retry_theta, theta)
    cmd = _pick(retry, _command(EVALUATE, redraw=True, dtype=config.dtype), cmd)
    # the last iteration ended: the clients apply the final decisions, and nothing else
    flush = (kind == LEAPFROG) & ended & finished
    s_next = s_next._replace(phase=jnp.where(flush, FLUSHING, s_next.phase))
    cmd = _pick(flush, idle, cmd)
    # the clients acknowledged the final decisions (or the chain had stopped): done
    stop = (kind == IDLE) | (s.phase >= DONE)
    s_next = _pick(stop, s._replace(phase=jnp.where(s.phase == FAILED, FAILED, DONE)), s_next)
    quiet = s_next.phase >= DONE
    sent = MCMCBroadcast(jnp.where(quiet | flush, s_next.block.z, theta), _pick(quiet, idle, cmd),
                         _pick(quiet, noop, dec), s.sent.seq)
    write = complete & (kind == LEAPFROG) & ended & (s.phase < DONE)
    t = jnp.where(write, s.iteration, -1)
    stats = jax.tree_util.tree_map(lambda a, v: _write_row(a, t, v), stats, row)
    draws = _write_row(draws, jnp.where(write, dec.record, -1), after_leaf.block.z)
    sent = sent._replace(seq=jnp.where(complete, s.sent.seq + 1, s.sent.seq))
    return _pick(complete, s_next._replace(sent=sent), s)._replace(stats=stats, draws=draws)


def server_step(rng_key, state: MCMCServerState, messages: MCMCMessage, view, *, config: MCMCConfig):
    """Every chain's server step on the summed messages; an incomplete round is repeated."""
    complete = jnp.all(view.answered)
    # (under secure aggregation the messages arrive summed over the clients)
    totals = messages if config.secure is not None else jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), messages)
    keys = random.split(rng_key, config.num_chains)
    new = jax.vmap(partial(server_chain, config=config), in_axes=(0, 0, 0, None))(keys, state, totals, complete)
    info = MCMCInfo(new.iteration, new.pe, complete)
    return new, Broadcast(_shared(new.sent)), info


def _shared(sent: MCMCBroadcast) -> MCMCBroadcast:
    """The broadcast as sent: per chain, with one round number."""
    return sent._replace(seq=sent.seq[0])


def init_server(rng_key, *, config: MCMCConfig) -> tuple:
    """Each chain at a uniform draw in (-2, 2) of the unconstrained global space; the first
    round evaluates the potential there (and at each client's own starting point)."""
    C, d, dtype, total = config.num_chains, config.global_size, config.dtype, config.num_warmup + config.num_samples
    depth = config.max_tree_depth if config.algo == "NUTS" else 0

    def one(key):
        k_init, k_chain = random.split(key)
        mass = init_mass(d, dtype)
        if config.init_position is None:
            theta = _uniform(k_init, (d,), dtype)
        else:  # near the given point, a quarter of its scale apart (chains that start apart show in R-hat)
            inv_mass = jnp.asarray(config.init_inv_mass, dtype)
            theta = jnp.asarray(config.init_position, dtype) + 0.25 * jnp.sqrt(inv_mass) * random.normal(k_init, (d,),
                                                                                                    dtype)
            mass = mass._replace(inv_mass=inv_mass, mass_sqrt=1.0 / jnp.sqrt(inv_mass))
        block = init_block(theta, depth)
        cmd = _command(EVALUATE, dtype=dtype)
        zero = jnp.zeros((), dtype)
        stats = IterationStats(*(jnp.zeros(total, t) for t in (dtype, bool, jnp.int32, jnp.int32, dtype, dtype,
                                                                  dtype)))
        return MCMCServerState(block, mass, init_step(config.step_size, dtype), init_tree(dtype),
                               k_chain, jnp.full((), INIT, jnp.int32), jnp.zeros((), jnp.int32), zero, zero, zero,
                               jnp.zeros((), jnp.int32), stats, jnp.zeros((config.num_samples, d), dtype),
                               MCMCBroadcast(theta, cmd, _noop_decisions(), jnp.zeros((), jnp.int32)))

    state = jax.vmap(one)(random.split(rng_key, C))
    return state, Broadcast(_shared(state.sent))


def chains_done(state: MCMCServerState) -> Array:
    """Has every chain finished (or failed to start)?"""
    return jnp.all(state.phase >= DONE)


def describe(state: MCMCServerState, *, config: MCMCConfig) -> str:
    """The bar's words: the slowest chain's iteration, warmup or sampling, the step size and the
    mean acceptance probability of the iterations done."""
    iterations = np.asarray(state.iteration)
    done = int(np.min(iterations))
    phase = "warmup" if done < config.num_warmup else "sampling"
    eps = float(np.mean(np.asarray(state.eps)))
    accept = np.asarray(state.stats.accept_prob).reshape(len(iterations), -1)
    seen = np.arange(accept.shape[1])[None, :] < iterations[:, None]
    rate = f", acceptance {float(np.mean(accept[seen])):.2f}" if seen.any() else ""
    return f"{phase} {done}/{config.num_warmup + config.num_samples}, step size {eps:.3g}{rate}"


def progress(state: MCMCServerState, *, config: MCMCConfig) -> tuple:
    """``(iterations the slowest chain has done, warmup, iterations in all)``: the run's pace
    (:class:`~numpyro_fed.run.budget.Pace`)."""
    return int(np.min(np.asarray(state.iteration))), config.num_warmup, config.num_warmup + config.num_samples


def _as_dict_message(client, server):
    """The steps with the client's :class:`MCMCMessage` sent as a dict of its fields."""
    def client_dict(rng_key, state, broadcast, data):
        state, message = client(rng_key, state, broadcast, data)
        return state, message._asdict()

    def server_dict(rng_key, state, messages, view):
        return server(rng_key, state, MCMCMessage(**messages), view)

    return client_dict, server_dict


def federated_mcmc(config: MCMCConfig) -> FederatedAlgorithm:
    """Federated NUTS (``config.algo == "NUTS"``) or HMC as a
    :class:`~numpyro_fed.run.protocol.FederatedAlgorithm`: one exchange per round, every client
    asked every round, ``done`` once every chain has its draws.

    References:
        Hoffman & Gelman (2014), the No-U-Turn sampler; Betancourt (2017), A Conceptual
        Introduction to Hamiltonian Monte Carlo, App. A (multinomial NUTS); NumPyro's
        ``numpyro/infer/hmc_util.py``, followed step for step.
    """
    steps = partial(client_step, config=config), partial(server_step, config=config)
    if config.secure is not None:  # a secure exchange's message is a dict of its fields, summed by the aggregator
        steps = _as_dict_message(*steps)
    exchange = Exchange(*steps, "leapfrog", MCMCMessage._fields if config.secure is not None else (),
                        config.secure or "trusted")
    return FederatedAlgorithm(
        partial(init_server, config=config), partial(init_client, config=config), all_clients(config.num_clients),
        (exchange,), num_selected=config.num_clients, monitor=lambda info: jnp.mean(info.potential_energy),
        monitor_name="potential_energy", done=chains_done, describe=partial(describe, config=config),
        progress=partial(progress, config=config))


"""SFVI with averaging (SFVI-Avg), Hassan et al. (2023) Algorithm 2.

Each round the server asks a fraction of the clients (drawn without replacement with the
server's key) and broadcasts ``(eta_G, theta)``. Every asked client runs ``m`` steps of
local stochastic-gradient VI on

.. math::

    \\log p(z_G) - \\log q(z_G) + \\frac{N}{N_j}\\big[\\log p(z_{L_j}, y_j \\mid z_G)
        - \\log q(z_{L_j} \\mid z_G)\\big]

and returns its updated ``(eta_G^{(j)}, theta^{(j)})`` with its row count ``N_j``. The whole
local objective is the client's computation on its own rows (the server never runs the model).
The server averages ``theta`` and sets ``q(z_G)`` to the 2-Wasserstein barycenter of the
clients' ``q^{(j)}(z_G)``, both with weights ``N_j / N`` (FedAvg's): the local objectives'
``N / N_j`` factors then cancel and the weighted average of the local objectives is the full
ELBO. The paper writes ``1/J``, its silos being of equal size; with unequal silos ``1/J``
over-weights the small ones (``tests/test_sfvi_avg.py::test_unequal_silos_reach_the_exact_posterior``:
mu 3.1 posterior sds off under ``1/J``).

**The optimiser state for the global parameters** (``optimizer_state``). An adaptive
optimiser (Adam) normalises each coordinate's step by its own gradient history. If every
client keeps a private state (or starts a fresh one each round, FedAvg's convention), the
averaged step is an average of per-client *normalised* steps: a vote on the sign, not the sum
of the gradients, so a shared scalar that most clients want up moves up even when the sum of
their gradients says down. On Hassan et al.'s (2023) hierarchical BNN that vote inflated the between-silo
scale to 0.48-0.67 (SFVI: 0.03) and every silo fell back to its dominant digit, even with one
local step per round (``benchmarks/sfvi_avg_explanations.py``). With ``"average"`` (the
default) the server averages the clients' optimiser states with the same weights as the
parameters and broadcasts the average, so every client starts its local steps from one shared
state: with one local step this is SFVI with Adam on the averaged gradient.

**A missing answer** (dropout): the server averages over the clients that answered; a
round in which nobody answered leaves the parameters as they were.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._typing import Array, PyTree
from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm
from ..run.steps import ascent, tree_weighted_sum
from .barycenter import diagonal_gaussian_barycenter, gaussian_barycenter
from .sfvi_algorithm import SFVIInfo

if TYPE_CHECKING:  # pragma: no cover
    from .objective import FederatedObjective

OPTIMIZER_STATES = ("average", "reset", "keep")

__all__ = ["OPTIMIZER_STATES", "SFVIAvgBroadcast", "SFVIAvgClientMessage", "SFVIAvgClientState",
           "SFVIAvgServerState", "sfvi_avg"]


class SFVIAvgServerState(NamedTuple):
    global_params: PyTree
    total_rows: Array
    step: Array
    opt_state: PyTree = ()  # the averaged optimiser state for the global parameters ("average"), else ()


class SFVIAvgClientState(NamedTuple):
    local_params: PyTree
    opt_state: PyTree
    global_opt_state: PyTree = ()  # the client's own optimiser state for the global parameters ("keep"), else ()


class SFVIAvgBroadcast(NamedTuple):
    global_params: PyTree
    total_rows: Array
    opt_state: PyTree = ()  # the averaged optimiser state for the global parameters ("average"), else ()


class SFVIAvgClientMessage(NamedTuple):
    global_params: PyTree  # the client's eta_G^(j), theta^(j) after its local steps
    elbo: Array  # client ELBO term at the broadcast parameters (one draw)
    rows: Array  # N_j, the weight of its answer in the average (FedAvg's)
    opt_state: PyTree = ()  # its optimiser state for the global parameters after its steps ("average"), else ()


def sfvi_avg(
    objective: "FederatedObjective",
    optim: optax.GradientTransformation,
    num_clients: int,
    total_rows: int,
    *,
    local_steps: int = 10,
    participation: float = 1.0,
    num_particles: int = 1,
    optimizer_state: str = "average",
) -> FederatedAlgorithm:
    """Build SFVI-Avg(m).

    Args:
        objective: server and client ELBO terms.
        optim: optax optimiser for the clients' local steps.
        optimizer_state: where a client's local steps on the global parameters start their
            optimiser state: ``"average"`` (default) from the server's average of the
            clients' states after the last round (sent with the parameters; the states are
            the optimiser's moments of the global parameters' gradients); ``"reset"`` a
            fresh state every round (FedAvg's convention); ``"keep"`` the client's own state
            from its last round (it never leaves the client). See the module docstring for
            why ``"reset"`` and ``"keep"`` bias an adaptive optimiser.
        num_clients: J.
        total_rows: N, the number of rows over all clients.
        local_steps: m, local optimisation steps per round.
        participation: fraction of clients asked (without replacement) each round.
        num_particles: Monte Carlo draws per local step.

    References:
        Hassan et al., Hassan et al. (2023), Algorithm 2.
    """
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state={optimizer_state!r}: choose one of {OPTIMIZER_STATES}")
    config = SFVIAvgConfig(num_clients, max(1, int(round(participation * num_clients))), total_rows, local_steps,
                           num_particles, optimizer_state)
    bind = partial(partial, objective=objective, optim=optim, config=config)
    return FederatedAlgorithm(
        bind(init_server), bind(init_client), bind(select),
        (Exchange(bind(client_step), bind(server_step), "local_fit"),),
        num_selected=config.num_active, monitor=lambda info: -info.elbo, monitor_name="loss",
    )


class SFVIAvgConfig(NamedTuple):
    """SFVI-Avg's static settings (see :func:`sfvi_avg`); ``num_active`` clients are asked per round."""

    num_clients: int
    num_active: int
    total_rows: int
    local_steps: int
    num_particles: int
    optimizer_state: str


def select(rng_key, state, *, objective, optim, config: SFVIAvgConfig):
    """``num_active`` clients drawn without replacement from the server's key (all when every one is asked)."""
    del state
    if config.num_active == config.num_clients:
        return jnp.ones(config.num_clients, bool)
    chosen = random.permutation(rng_key, config.num_clients)[: config.num_active]
    return jnp.zeros(config.num_clients, bool).at[chosen].set(True)


def init_server(rng_key, *, objective, optim, config: SFVIAvgConfig):
    """The global parameters, N and (``optimizer_state="average"``) the shared optimiser state."""
    del rng_key
    params = objective.init_global()
    n = jnp.asarray(config.total_rows, jnp.float32)
    shared = optim.init(params) if config.optimizer_state == "average" else ()
    return (SFVIAvgServerState(params, n, jnp.zeros((), jnp.int32), shared),
            Broadcast(SFVIAvgBroadcast(params, n, shared)))


def init_client(rng_key, data, *, objective, optim, config: SFVIAvgConfig):
    """A client's local parameters, their optimiser state and (``"keep"``) its own global one."""
    params = objective.init_local(data)
    kept = optim.init(objective.init_global()) if config.optimizer_state == "keep" else ()
    return SFVIAvgClientState(params, optim.init(params), kept)


def client_step(rng_key, state, broadcast, data, *, objective, optim, config: SFVIAvgConfig):
    """``local_steps`` optax steps on the client's local objective (its own terms weighed by
    ``N / N_j``, the prior in full), from the broadcast global parameters; sends the resulting
    global parameters, its ELBO term at the broadcast ones, its row count and (``"average"``)
    its optimiser state for the global parameters."""
    message = broadcast.shared
    n_global, n_local = objective.global_size, objective.local_size(data)
    weight = message.total_rows / data.num_rows

    def local_objective(g, l, key):
        kg, kl = random.split(key)
        eg = random.normal(kg, (config.num_particles, n_global))
        el = random.normal(kl, (config.num_particles, n_local))
        both = jax.vmap(
            lambda a, b: objective.server_term(g, a) + objective.client_term(g, l, a, b, data, 1.0, weight)
        )(eg, el)
        return jnp.mean(both)

    k0, k1, k2 = random.split(rng_key, 3)
    elbo = objective.client_term(
        message.global_params, state.local_params,
        random.normal(k0, (n_global,)), random.normal(k1, (n_local,)), data, 1.0 / config.num_clients,
    )
    grad_fn = jax.grad(local_objective, argnums=(0, 1))

    def body(carry, key):
        g, l, g_opt, l_opt = carry
        g_grad, l_grad = grad_fn(g, l, key)
        g, g_opt = ascent(optim, g_grad, g_opt, g)
        l, l_opt = ascent(optim, l_grad, l_opt, l)
        return (g, l, g_opt, l_opt), None

    g0 = message.global_params
    if config.optimizer_state == "reset":
        g_opt0 = optim.init(g0)
    else:  # the client's own state ("keep") or the server's average of the clients' ("average")
        g_opt0 = state.global_opt_state if config.optimizer_state == "keep" else message.opt_state
    carry = (g0, state.local_params, g_opt0, state.opt_state)
    (g, l, g_opt, l_opt), _ = jax.lax.scan(body, carry, random.split(k2, config.local_steps))
    kept = g_opt if config.optimizer_state == "keep" else ()
    sent = g_opt if config.optimizer_state == "average" else ()
    rows = jnp.asarray(data.num_rows, jnp.float32)
    return SFVIAvgClientState(l, l_opt, kept), SFVIAvgClientMessage(g, elbo, rows, sent)


def server_step(rng_key, state, messages, view, *, objective, optim, config: SFVIAvgConfig):
    """The answered clients' global parameters averaged with weights ``N_j / sum N_k``: the
    guide's Gaussian by its (diagonal) barycenter, ``theta`` linearly, the optimiser states
    (``"average"``) linearly; a round nobody answered changes nothing."""
    answered = view.answered.astype(jnp.float32)
    anyone = jnp.sum(answered) > 0
    # weights N_j / sum N_k over the clients that answered: each local objective weighs its
    # own terms by N / N_j, so this average of them is the full ELBO (the paper's 1/J is
    # the equal-silo case)
    rows = answered * messages.rows
    w = rows / jnp.maximum(jnp.sum(rows), 1.0)
    elbo_server = objective.server_term(state.global_params, random.normal(rng_key, (objective.global_size,)))
    elbo = elbo_server + jnp.dot(answered, messages.elbo)
    guide_params = messages.global_params["guide"]
    # rows of clients that did not answer are zeros (weight 0): give them a harmless unit scale
    if objective.guide.global_scale == "diagonal":  # closed form on the sds, O(J n_G): no n_G x n_G covariance
        means, sds = jax.vmap(objective.guide.global_mean_sd)(guide_params)
        sds = jnp.where(view.answered[:, None], sds, 1.0)
        guide = objective.guide.global_from_mean_sd(*diagonal_gaussian_barycenter(w, means, sds))
    else:
        means, covs = jax.vmap(objective.guide.global_moments)(guide_params)
        covs = jnp.where(view.answered[:, None, None], covs, jnp.eye(covs.shape[-1]))
        guide = objective.guide.global_from_moments(*gaussian_barycenter(w, means, covs))
    averaged = {
        "guide": guide,
        "theta": tree_weighted_sum(w, messages.global_params["theta"]),
    }
    opt_state = _average_state(w, messages.opt_state) if config.optimizer_state == "average" else ()
    # a round in which nobody answered leaves the parameters (and the shared state) as they were
    params, opt_state = jax.tree_util.tree_map(
        lambda a, b: jnp.where(anyone, a, b), (averaged, opt_state), (state.global_params, state.opt_state))
    new_state = SFVIAvgServerState(params, state.total_rows, state.step + 1, opt_state)
    return new_state, Broadcast(SFVIAvgBroadcast(params, state.total_rows, opt_state)), SFVIInfo(elbo, anyone)


def _average_state(weights, stacked):
    """The clients' optimiser states averaged with the parameters' weights: floating leaves
    (moments) as a weighted mean, integer leaves (step counts, equal on every client) as
    their maximum."""
    def mean(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.tensordot(weights.astype(x.dtype), x, axes=1)
        return jnp.max(x, axis=0)
    return jax.tree_util.tree_map(mean, stacked)

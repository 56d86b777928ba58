"""SFVI with averaging (SFVI-Avg), paper 001 Algorithm 2.

Each round the server broadcasts ``(eta_G, theta)``. Every participating client runs
``m`` steps of local stochastic-gradient VI on

.. math::

    \\log p(z_G) - \\log q(z_G) + \\frac{N}{N_j}\\big[\\log p(z_{L_j}, y_j \\mid z_G)
        - \\log q(z_{L_j} \\mid z_G)\\big]

and returns its updated ``(eta_G^{(j)}, theta^{(j)})``. The server averages ``theta`` and
sets ``q(z_G)`` to the 2-Wasserstein barycenter of the clients' ``q^{(j)}(z_G)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._typing import Array, PyTree
from ..barycenter import gaussian_barycenter
from .base import FederatedAlgorithm, ascent, tree_weighted_sum
from .sfvi import SFVIInfo

if TYPE_CHECKING:  # pragma: no cover
    from ..elbo import FederatedObjective

__all__ = [
    "SFVIAvgBroadcast",
    "SFVIAvgClientMessage",
    "SFVIAvgClientState",
    "SFVIAvgServerState",
    "sfvi_avg",
]


class SFVIAvgServerState(NamedTuple):
    global_params: PyTree
    total_rows: Array
    active: Array  # (J,) bool: clients asked to take part this round
    step: Array


class SFVIAvgClientState(NamedTuple):
    local_params: PyTree
    opt_state: PyTree


class SFVIAvgBroadcast(NamedTuple):
    global_params: PyTree
    total_rows: Array


class SFVIAvgClientMessage(NamedTuple):
    global_params: PyTree  # the client's eta_G^(j), theta^(j) after its local steps
    elbo: Array  # client ELBO term at the broadcast parameters (one draw)


def _participants(rng_key, num_clients, num_active):
    chosen = random.permutation(rng_key, num_clients)[:num_active]
    return jnp.zeros(num_clients, bool).at[chosen].set(True)


def sfvi_avg(
    objective: "FederatedObjective",
    optim: optax.GradientTransformation,
    num_clients: int,
    total_rows: int,
    *,
    local_steps: int = 10,
    participation: float = 1.0,
    num_particles: int = 1,
) -> FederatedAlgorithm:
    """Build SFVI-Avg(m).

    Args:
        objective: server and client ELBO terms.
        optim: optax optimiser for the clients' local steps (its state for the global
            parameters is reset every round, as in FedAvg).
        num_clients: J.
        total_rows: N, the number of rows over all clients.
        local_steps: m, local optimisation steps per round.
        participation: fraction of clients drawn (without replacement) each round.
        num_particles: Monte Carlo draws per local step.

    References:
        Hassan et al., paper 001, Algorithm 2.
    """
    n_global = objective.global_size
    num_active = max(1, int(round(participation * num_clients)))
    diagonal = objective.guide.global_scale == "diagonal"

    def init_server(rng_key):
        params = objective.init_global()
        n = jnp.asarray(total_rows, jnp.float32)
        active = _participants(rng_key, num_clients, num_active)
        state = SFVIAvgServerState(params, n, active, jnp.zeros((), jnp.int32))
        return state, SFVIAvgBroadcast(params, n)

    def init_client(rng_key, data):
        params = objective.init_local(data)
        return SFVIAvgClientState(params, optim.init(params))

    def client_step(rng_key, state, message, data):
        n_local = objective.local_size(data)
        weight = message.total_rows / data.num_rows

        def local_objective(g, l, key):
            kg, kl = random.split(key)
            eg = random.normal(kg, (num_particles, n_global))
            el = random.normal(kl, (num_particles, n_local))
            both = jax.vmap(
                lambda a, b: objective.server_term(g, a) + weight * objective.client_term(g, l, a, b, data)
            )(eg, el)
            return jnp.mean(both)

        k0, k1, k2 = random.split(rng_key, 3)
        elbo = objective.client_term(
            message.global_params, state.local_params,
            random.normal(k0, (n_global,)), random.normal(k1, (n_local,)), data,
        )
        grad_fn = jax.grad(local_objective, argnums=(0, 1))

        def body(carry, key):
            g, l, g_opt, l_opt = carry
            g_grad, l_grad = grad_fn(g, l, key)
            g, g_opt = ascent(optim, g_grad, g_opt, g)
            l, l_opt = ascent(optim, l_grad, l_opt, l)
            return (g, l, g_opt, l_opt), None

        g0 = message.global_params
        carry = (g0, state.local_params, optim.init(g0), state.opt_state)
        (g, l, _, l_opt), _ = jax.lax.scan(body, carry, random.split(k2, local_steps))
        return SFVIAvgClientState(l, l_opt), SFVIAvgClientMessage(g, elbo)

    def server_step(rng_key, state, messages, active):
        k_eps, k_next = random.split(rng_key)
        w = active.astype(jnp.float32)
        w = w / jnp.sum(w)
        elbo_server = objective.server_term(state.global_params, random.normal(k_eps, (n_global,)))
        elbo = elbo_server + jnp.dot(active.astype(jnp.float32), messages.elbo)
        guide_params = messages.global_params["guide"]
        means, covs = jax.vmap(objective.guide.global_moments)(guide_params)
        mean, cov = gaussian_barycenter(w, means, covs, diagonal=diagonal)
        params = {
            "guide": objective.guide.global_from_moments(mean, cov),
            "theta": tree_weighted_sum(w, messages.global_params["theta"]),
        }
        next_active = _participants(k_next, num_clients, num_active)
        new_state = SFVIAvgServerState(params, state.total_rows, next_active, state.step + 1)
        return new_state, SFVIAvgBroadcast(params, state.total_rows), SFVIInfo(elbo)

    return FederatedAlgorithm(init_server, init_client, client_step, server_step)

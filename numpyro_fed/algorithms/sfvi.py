"""Structured federated variational inference (SFVI), paper 001 Algorithm 1.

Each round the server draws ``eps_G`` and broadcasts ``(eta_G, theta, eps_G)``. Client
``j`` draws its own ``eps_Lj``, steps its local parameters ``eta_Lj`` and returns only the
vector-Jacobian product of its ELBO term with respect to the server's parameters. The
server adds the gradient of its own term (global prior, Jacobian, entropy: counted once)
and steps:

.. math::

    \\nabla_{\\eta_G} \\mathcal L = \\nabla_{\\eta_G}\\big[\\log p(z_G) - \\log q(z_G)\\big]
        + \\sum_{j=1}^J \\nabla_{\\eta_G}\\big[\\log p(z_{L_j}, y_j \\mid z_G)
        - \\log q(z_{L_j} \\mid z_G)\\big].

The gradient equals the centralised one on the pooled data for any partition, and with a
per-coordinate optimiser (Adam, SGD) the whole trajectory is partition invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._typing import Array, PyTree
from .base import FederatedAlgorithm, ascent, tree_weighted_sum

if TYPE_CHECKING:  # pragma: no cover
    from ..elbo import FederatedObjective

__all__ = [
    "SFVIBroadcast",
    "SFVIClientMessage",
    "SFVIClientState",
    "SFVIInfo",
    "SFVIServerState",
    "sfvi",
]


class SFVIServerState(NamedTuple):
    global_params: PyTree
    opt_state: PyTree
    eps_global: Array  # (num_particles, n_G): the noise broadcast this round
    active: Array  # (J,) bool: clients asked to take part this round
    step: Array


class SFVIClientState(NamedTuple):
    local_params: PyTree
    opt_state: PyTree


class SFVIBroadcast(NamedTuple):
    global_params: PyTree
    eps_global: Array


class SFVIClientMessage(NamedTuple):
    global_grad: PyTree  # d(client ELBO term) / d(server parameters)
    elbo: Array  # the client's scalar ELBO term (for the trace)


class SFVIInfo(NamedTuple):
    elbo: Array


def sfvi(
    objective: "FederatedObjective",
    optim: optax.GradientTransformation,
    num_clients: int,
    *,
    num_particles: int = 1,
) -> FederatedAlgorithm:
    """Build SFVI for a :class:`~numpyro_fed.elbo.FederatedObjective`.

    Args:
        objective: server and client ELBO terms.
        optim: an ``optax.GradientTransformation``, used by the server for the global
            parameters and by each client for its local ones.
        num_clients: J.
        num_particles: Monte Carlo draws per round.

    References:
        Hassan et al., paper 001, Algorithm 1 and supplement S1.
    """
    n_global = objective.global_size

    def draw(rng_key):
        return random.normal(rng_key, (num_particles, n_global))

    def init_server(rng_key):
        params = objective.init_global()
        eps = draw(rng_key)
        state = SFVIServerState(
            params, optim.init(params), eps, jnp.ones(num_clients, bool), jnp.zeros((), jnp.int32)
        )
        return state, SFVIBroadcast(params, eps)

    def init_client(rng_key, data):
        params = objective.init_local(data)
        return SFVIClientState(params, optim.init(params))

    def client_step(rng_key, state, message, data):
        eps_local = random.normal(rng_key, (num_particles, objective.local_size(data)))

        def term(g, l):
            values = jax.vmap(lambda eg, el: objective.client_term(g, l, eg, el, data))(
                message.eps_global, eps_local
            )
            return jnp.mean(values)

        elbo, (g_grad, l_grad) = jax.value_and_grad(term, argnums=(0, 1))(
            message.global_params, state.local_params
        )
        local_params, opt_state = ascent(optim, l_grad, state.opt_state, state.local_params)
        return SFVIClientState(local_params, opt_state), SFVIClientMessage(g_grad, elbo)

    def server_step(rng_key, state, messages, active):
        def term(g):
            return jnp.mean(jax.vmap(lambda e: objective.server_term(g, e))(state.eps_global))

        elbo_server, grad = jax.value_and_grad(term)(state.global_params)
        w = active.astype(elbo_server.dtype)
        grad = jax.tree_util.tree_map(jnp.add, grad, tree_weighted_sum(w, messages.global_grad))
        elbo = elbo_server + jnp.dot(w, messages.elbo)
        params, opt_state = ascent(optim, grad, state.opt_state, state.global_params)
        eps = draw(rng_key)
        new_state = SFVIServerState(params, opt_state, eps, state.active, state.step + 1)
        return new_state, SFVIBroadcast(params, eps), SFVIInfo(elbo)

    return FederatedAlgorithm(init_server, init_client, client_step, server_step)

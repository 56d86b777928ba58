"""Structured federated variational inference (SFVI), Hassan et al. (2023) Algorithm 1.

Each round the server broadcasts ``(eta_G, theta, eps_G)``. Client ``j`` draws its own
``eps_Lj`` (from its own key), steps its local parameters ``eta_Lj`` and returns only the
vector-Jacobian product of its ELBO term with respect to the server's parameters. The
server adds the gradient of its own term (global prior, Jacobian, entropy: counted once)
and steps:

.. math::

    \\nabla_{\\eta_G} \\mathcal L = \\nabla_{\\eta_G}\\big[\\log p(z_G) - \\log q(z_G)\\big]
        + \\sum_{j=1}^J \\nabla_{\\eta_G}\\big[\\log p(z_{L_j}, y_j \\mid z_G)
        - \\log q(z_{L_j} \\mid z_G)\\big].

The gradient equals the centralised one on the pooled data for any partition, and with a
per-coordinate optimiser (Adam, SGD) the whole trajectory is partition invariant.

**A missing answer** (dropout): the server never applies a gradient that lacks a client's
term, which would be biased towards the clients that answered. A round in which an asked
client did not answer is skipped: the server's parameters and optimiser state stay, fresh
noise is broadcast, and the clients that answered keep their local step (a valid
block-coordinate step on the same ELBO). ``SFVIInfo.complete`` records which rounds
counted; the fit needs proportionally more rounds.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._typing import Array, PyTree
from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients
from ..run.steps import ascent, tree_weighted_sum

if TYPE_CHECKING:  # pragma: no cover
    from .objective import FederatedObjective

__all__ = ["SFVIBroadcast", "SFVIClientMessage", "SFVIClientState", "SFVIInfo", "SFVIServerState", "client_step",
           "init_client", "init_server", "server_step", "server_update", "sfvi"]


class SFVIServerState(NamedTuple):
    global_params: PyTree
    opt_state: PyTree
    eps_global: Array  # (num_particles, n_G): the noise broadcast this round
    step: Array  # server updates applied


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
    complete: Array  # every asked client answered, so the server stepped


def _draw(num_particles: int, n_global: int, rng_key):
    return random.normal(rng_key, (num_particles, n_global))


def init_server(objective, optim, num_particles: int, rng_key):
    """The server's parameters at their start, its optimiser state, and the round's noise."""
    params = objective.init_global()
    eps = _draw(num_particles, objective.global_size, rng_key)
    state = SFVIServerState(params, optim.init(params), eps, jnp.zeros((), jnp.int32))
    return state, Broadcast(SFVIBroadcast(params, eps))


def server_update(objective, optim, num_particles: int, rng_key, state, client_grad, complete):
    """Add the gradient of the server's own term (``-log q(z_G)``) to the clients' summed
    gradient, step unless the round is incomplete, and broadcast fresh noise: ``(state,
    broadcast, server_term)`` (shared with DP federated SVI)."""
    def term(g):
        return jnp.mean(jax.vmap(lambda e: objective.server_term(g, e))(state.eps_global))

    elbo_server, grad = jax.value_and_grad(term)(state.global_params)
    grad = jax.tree_util.tree_map(jnp.add, grad, client_grad)
    stepped, opt_stepped = ascent(optim, grad, state.opt_state, state.global_params)
    params = jax.tree_util.tree_map(lambda a, b: jnp.where(complete, a, b), stepped, state.global_params)
    opt_state = jax.tree_util.tree_map(lambda a, b: jnp.where(complete, a, b), opt_stepped, state.opt_state)
    eps = _draw(num_particles, objective.global_size, rng_key)
    new_state = SFVIServerState(params, opt_state, eps, state.step + complete.astype(jnp.int32))
    return new_state, Broadcast(SFVIBroadcast(params, eps)), elbo_server


def init_client(objective, optim, rng_key, data):
    params = objective.init_local(data)
    return SFVIClientState(params, optim.init(params))


def client_step(objective, optim, num_particles: int, prior_share: float, rng_key, state, broadcast, data):
    """The client's ELBO term and its gradient w.r.t. the server's parameters (sent) and its own
    (one optax step, kept), from its own noise."""
    message = broadcast.shared
    eps_local = random.normal(rng_key, (num_particles, objective.local_size(data)))

    def term(g, l):
        values = jax.vmap(lambda eg, el: objective.client_term(g, l, eg, el, data, prior_share))(
            message.eps_global, eps_local
        )
        return jnp.mean(values)

    elbo, (g_grad, l_grad) = jax.value_and_grad(term, argnums=(0, 1))(message.global_params, state.local_params)
    local_params, opt_state = ascent(optim, l_grad, state.opt_state, state.local_params)
    return SFVIClientState(local_params, opt_state), SFVIClientMessage(g_grad, elbo)


def server_step(objective, optim, num_particles: int, num_clients: int, rng_key, state, messages, view):
    """The answered gradients summed with the server term's; one step in a complete round."""
    w = view.answered.astype(messages.elbo.dtype)
    complete = jnp.all(view.answered)
    new_state, broadcast, elbo_server = server_update(objective, optim, num_particles, rng_key, state,
                                                      tree_weighted_sum(w, messages.global_grad), complete)
    # the ELBO estimate of an incomplete round scales the answered terms up to J clients
    elbo = elbo_server + jnp.dot(w, messages.elbo) * num_clients / jnp.maximum(jnp.sum(w), 1.0)
    return new_state, broadcast, SFVIInfo(elbo, complete)


def _loss(info):
    return -info.elbo


def sfvi(
    objective: "FederatedObjective",
    optim: optax.GradientTransformation,
    num_clients: int,
    *,
    num_particles: int = 1,
) -> FederatedAlgorithm:
    """Build SFVI for a :class:`~numpyro_fed.horizontal.objective.FederatedObjective`: the
    module's steps bound to it.

    Args:
        objective: server and client ELBO terms.
        optim: an ``optax.GradientTransformation``, used by the server for the global
            parameters and by each client for its local ones.
        num_clients: J.
        num_particles: Monte Carlo draws per round.

    References:
        Hassan et al., Hassan et al. (2023), Algorithm 1 and supplement S1.
    """
    step = Exchange(partial(client_step, objective, optim, num_particles, 1.0 / num_clients),
                    partial(server_step, objective, optim, num_particles, num_clients), "gradient")
    return FederatedAlgorithm(
        partial(init_server, objective, optim, num_particles), partial(init_client, objective, optim),
        all_clients(num_clients), (step,), num_selected=num_clients, monitor=_loss, monitor_name="loss",
    )

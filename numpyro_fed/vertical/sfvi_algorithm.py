"""Vertical SFVI: Hassan et al. (2024) Algorithm 1 (augmented) and Algorithm 2 (power likelihood).

Pure functions over NamedTuple states. One iteration of Algorithm 1:

1. the server picks the rows of the round (``schedule``);
2. each client draws ``theta_j ~ q(theta_j)``, ``z_j ~ q(z_j | .)`` on those rows and
   sends ``z_j`` (``client_forward``);
3. the server computes ``L_0`` and returns ``dL_0/dz_j`` to client j (``server_step``);
4. each client ascends ``L_j + <dL_0/dz_j, z_j>`` with the same draws (``client_step``).

Algorithm 2 adds a round trip after step 2: the server relays every ``z`` (and its own
draw of the shared sites ``theta_0``), client j returns ``dL_{0,j}/dz_k`` for ``k != j``
(and ``dL_{0,j}/dtheta_0``), the server sums them into ``sum_{k != j} dL_{0,k}/dz_j``.

.. math::

    \\nabla_{\\phi_j,\\psi_j} \\mathcal L = \\nabla \\mathcal L_j
        + \\Big(\\frac{\\partial z_j}{\\partial(\\phi_j,\\psi_j)}\\Big)^{\\top}
          \\frac{\\partial \\mathcal L_0}{\\partial z_j}
    \\qquad \\text{(eqs. 11-12; eqs. 15-16 for the power form)}

The client's data, ``theta_j`` and network ``psi_j`` never leave it: messages carry only
``z_j`` on the round's rows, gradients with respect to ``z``, the row indices, and (power
form with server-held sites) the server's draw of ``theta_0`` and gradients for it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

from ..run.steps import ascent
from .objective import SERVER, VerticalObjective

if TYPE_CHECKING:  # pragma: no cover
    import optax

__all__ = ["VerticalClientState", "VerticalSFVI", "VerticalServerState", "vertical_sfvi"]


class VerticalClientState(NamedTuple):
    params: Dict[str, Any]  # {"theta": q(theta_j), "aux": q(z_j | .), "point": numpyro.param values}
    opt_state: Any


class VerticalServerState(NamedTuple):
    params: Dict[str, Any]  # {"theta": q(theta_0), "point": numpyro.param values}
    opt_state: Any


class VerticalSFVI(NamedTuple):
    """The pure functions of vertical SFVI (see the module docstring for the order)."""

    init_server: Callable
    init_client: Callable
    schedule: Callable
    server_noise: Callable
    client_noise: Callable
    client_forward: Callable
    server_step: Callable  # augmented (Alg. 1)
    relay: Callable  # power (Alg. 2), first server reply
    client_likelihood: Callable  # power (Alg. 2), gradients for the others' z -> (state, message)
    server_aggregate: Callable  # power (Alg. 2), sums them
    client_step: Callable
    elbo: Callable  # (rng_key, server_state, client_states, data_views) -> ELBO estimate, no update


def vertical_sfvi(
    objective: VerticalObjective, optim: "optax.GradientTransformation", batch_size: Optional[int] = None
) -> VerticalSFVI:
    """Build vertical SFVI for ``objective`` (augmented -> Alg. 1, power -> Alg. 2).

    Args:
        objective: a :class:`~numpyro_fed.vertical.objective.VerticalObjective`.
        optim: an optax optimiser, used by every party for its own parameters.
        batch_size: rows per iteration, drawn uniformly with replacement by the server
            (an unbiased estimate with cost independent of n); ``None`` uses all rows.

    References:
        Hassan, Sutton, Mira, Mengersen (Hassan et al. (2024)), §4.3-4.4, Algorithms 1-2.
    """
    bind = partial(partial, obj=objective, optim=optim, batch_size=batch_size)
    return VerticalSFVI(
        bind(init_server), bind(init_client), bind(schedule), bind(server_noise), bind(client_noise),
        bind(client_forward), bind(server_step), bind(relay), bind(client_likelihood), bind(server_aggregate),
        bind(client_step), bind(elbo),
    )


def _rows(obj: VerticalObjective, batch_size: Optional[int]) -> int:
    return obj.num_rows if batch_size is None else int(batch_size)


def init_server(rng_key, *, obj: VerticalObjective, optim, batch_size) -> VerticalServerState:
    """The server's parameters (its global sites' guide, its point sites) and optimiser state."""
    params = {"theta": obj.guide.theta.init(rng_key, obj.layouts[SERVER].size), "point": dict(obj.point_init[SERVER])}
    return VerticalServerState(params, optim.init(params))


def init_client(rng_key, client: str, *, obj: VerticalObjective, optim, batch_size) -> VerticalClientState:
    """A party's parameters (its sites' guide, its auxiliary guide, its point sites) and optimiser state."""
    k_t, k_a = random.split(rng_key)
    params = {
        "theta": obj.guide.theta.init(k_t, obj.layouts[client].size),
        "aux": obj.guide.aux.init(k_a, obj.num_rows, 2 if obj.use_response else 1),
        "point": dict(obj.point_init[client]),
    }
    return VerticalClientState(params, optim.init(params))


def schedule(rng_key, *, obj: VerticalObjective, optim, batch_size) -> Dict[str, jax.Array]:
    """The round's rows: all, or ``batch_size`` drawn uniformly with replacement."""
    if batch_size is None:
        return {"rows": jnp.arange(obj.num_rows)}
    return {"rows": random.randint(rng_key, (int(batch_size),), 0, obj.num_rows)}


def server_noise(rng_key, *, obj: VerticalObjective, optim, batch_size) -> jax.Array:
    return random.normal(rng_key, (obj.layouts[SERVER].size,))


def client_noise(rng_key, client: str, *, obj: VerticalObjective, optim, batch_size):
    k_e, k_t = random.split(rng_key)
    return random.normal(k_e, (obj.layouts[client].size,)), random.normal(k_t, (_rows(obj, batch_size),))


def _client_value(obj, client, params, noise, sched, own, others=None, server_u=None, terms=("local",)):
    eps, tau = noise
    u, log_q = obj.guide.theta.sample(params["theta"], eps)
    value, z = obj.client_term(client, u, params["aux"], tau, own, sched["rows"], others=others, server_u=server_u,
                               terms=terms, points=params["point"])
    return value - (log_q if "local" in terms else 0.0), z


def _server_value(obj, params, eps0, z, sched, own):
    u, log_q = obj.guide.theta.sample(params["theta"], eps0)
    return obj.server_term(u, z, own, sched["rows"], params["point"]) - log_q


def client_forward(client, state: VerticalClientState, noise, sched, own, *, obj: VerticalObjective, optim,
                   batch_size) -> Dict[str, jax.Array]:
    """A party's ``z_j`` on the round's rows."""
    return {"z": _client_value(obj, client, state.params, noise, sched, own)[1]}


def server_step(state: VerticalServerState, eps0, z_messages, sched, own, *, obj: VerticalObjective, optim,
                batch_size):
    """Augmented form: the server's step on its term and each party's ``d/dz_j``."""
    z = {c: z_messages[c]["z"] for c in obj.clients}
    value, (g_params, g_z) = jax.value_and_grad(partial(_server_value, obj), argnums=(0, 2))(
        state.params, eps0, z, sched, own)
    params, opt_state = ascent(optim, g_params, state.opt_state, state.params)
    replies = {c: {"grad_z": g_z[c]} for c in obj.clients}
    return VerticalServerState(params, opt_state), replies, value


def relay(state: VerticalServerState, eps0, z_messages, *, obj: VerticalObjective, optim,
          batch_size) -> Dict[str, jax.Array]:
    """Power form: every party's ``z`` (and the server's draw of its sites) for every party."""
    message = {"z": jnp.stack([z_messages[c]["z"] for c in obj.clients])}
    if obj.layouts[SERVER].size:
        message["theta"] = obj.guide.theta.sample(state.params["theta"], eps0)[0]
    return message


def _others(obj, client, relayed):
    return {c: relayed["z"][k] for k, c in enumerate(obj.clients) if c != client}


def client_likelihood(client, state: VerticalClientState, noise, relayed, sched, own, *, obj: VerticalObjective,
                      optim, batch_size):
    """Power form: a party's copy of the likelihood differentiated for the others' ``z``."""
    others = _others(obj, client, relayed)

    def lik(others_z, server_u):
        return _client_value(obj, client, state.params, noise, sched, own, others_z, server_u, ("likelihood",))[0]

    g_z, g_u = jax.grad(lik, argnums=(0, 1))(others, relayed.get("theta"))
    message = {"grad_z": jnp.stack([g_z[c] for c in obj.clients if c != client])}
    if obj.layouts[SERVER].size:
        message["grad_theta"] = g_u
    return state, message


def server_aggregate(state: VerticalServerState, eps0, lik_messages, sched, own, *, obj: VerticalObjective, optim,
                     batch_size):
    """Power form: each party's ``d/dz_j`` summed over the others' copies; the server's step."""
    clients, d0 = obj.clients, obj.layouts[SERVER].size
    totals = {c: jnp.zeros(_rows(obj, batch_size)) for c in clients}
    for sender in clients:
        others = [c for c in clients if c != sender]
        for i, c in enumerate(others):
            totals[c] = totals[c] + lik_messages[sender]["grad_z"][i]
    grad_u = sum(lik_messages[c]["grad_theta"] for c in clients) if d0 else None

    def surrogate(params):
        value = _server_value(obj, params, eps0, {}, sched, own)
        if d0:
            u = obj.guide.theta.sample(params["theta"], eps0)[0]
            return value + jnp.vdot(jax.lax.stop_gradient(grad_u), u), value
        return value, value

    g_params, value = jax.grad(surrogate, has_aux=True)(state.params)
    params, opt_state = ascent(optim, g_params, state.opt_state, state.params)
    return VerticalServerState(params, opt_state), {c: {"grad_z": totals[c]} for c in clients}, value


def client_step(client, state: VerticalClientState, noise, reply, sched, own, relayed=None, *,
                obj: VerticalObjective, optim, batch_size):
    """A party's step: its own terms plus ``d/dz_j`` from the server (chain rule through ``z_j``)."""
    power = obj.form == "power"
    others = _others(obj, client, relayed) if power else None
    server_u = relayed.get("theta") if power else None
    terms = ("local", "likelihood") if power else ("local",)

    def surrogate(params):
        value, z = _client_value(obj, client, params, noise, sched, own, others, server_u, terms)
        return value + jnp.vdot(jax.lax.stop_gradient(reply["grad_z"]), z), value

    grads, value = jax.grad(surrogate, has_aux=True)(state.params)
    params, opt_state = ascent(optim, grads, state.opt_state, state.params)
    return VerticalClientState(params, opt_state), value


def elbo(rng_key, server: VerticalServerState, states, sched, views, *, obj: VerticalObjective, optim, batch_size):
    """One-draw ELBO estimate at the current parameters (``views``: each party's data)."""
    clients, d0 = obj.clients, obj.layouts[SERVER].size
    k_s, k_c = random.split(rng_key)
    eps0 = server_noise(k_s, obj=obj, optim=optim, batch_size=batch_size)
    keys = random.split(k_c, len(clients))
    noise = {c: client_noise(keys[i], c, obj=obj, optim=optim, batch_size=batch_size) for i, c in enumerate(clients)}
    z = {c: _client_value(obj, c, states[c].params, noise[c], sched, views[c])[1] for c in clients}
    if obj.form != "power":
        total = _server_value(obj, server.params, eps0, z, sched, views[SERVER])
        return total + sum(_client_value(obj, c, states[c].params, noise[c], sched, views[c])[0] for c in clients)
    u0 = obj.guide.theta.sample(server.params["theta"], eps0)[0] if d0 else None
    total = _server_value(obj, server.params, eps0, {}, sched, views[SERVER])
    for c in clients:
        others = {k: v for k, v in z.items() if k != c}
        total = total + _client_value(obj, c, states[c].params, noise[c], sched, views[c], others, u0,
                                      ("local", "likelihood"))[0]
    return total

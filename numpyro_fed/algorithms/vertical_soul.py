"""Vertical SOUL: MAP for ``z`` with unadjusted-Langevin draws for ``theta`` (paper 000, App. A).

Stochastic optimisation via unadjusted Langevin (De Bortoli et al., 2021) treats the
auxiliary variables ``z`` (and any ``numpyro.param`` sites) as parameters, maximises
``log p(z, y)`` by a Robbins-Monro scheme, and draws ``theta`` from ``p(theta | z, y)``
with the unadjusted Langevin algorithm (ULA). By Fisher's identity

.. math::

    \\nabla_z \\log p(z, y) = \\mathbb E_{p(\\theta \\mid z, y)}\\big[\\nabla_z
        \\log p(\\theta, z, y)\\big]
    \\approx \\frac1M \\sum_{m=1}^M \\nabla_z \\log p(\\theta^{(m)}, z, y),

    \\theta^{(m+1)} = \\theta^{(m)} + \\gamma \\nabla_\\theta \\log p(\\theta^{(m)}, z, y)
        + \\sqrt{2\\gamma}\\, \\xi_m, \\qquad \\xi_m \\sim N(0, I).

Given ``z`` the parties' ``theta`` blocks are conditionally independent (eqs. 18 and the
power-form gradient of A.2), so every party runs its own chain on its own data, ``M``
Langevin steps per communication, warm-started from the previous iteration:

- **augmented** (A.1.1): client j's chain targets ``p(theta_j) p(z_j | theta_j)``; the
  server's chain (intercept, noise scale) targets ``p(theta_0) p(y | sum z, theta_0)``
  and it returns ``d/dz_j`` of that term averaged over its draws; server
  ``numpyro.param`` sites ascend their averaged gradient (A.3, eq. 26);
- **power** (A.2): client j's chain targets ``p(theta_j) p(z_j | theta_j)
  p(y | g_j + sum_{k != j} z_k)^{1/J}`` given the relayed ``z``; it returns the averaged
  ``d/dz_k`` (``k != j``) of its likelihood copy and the server sums them (eq. 24).
  Server-held sites are not supported in this form.

Each client then ascends ``z_j`` with ``optim`` using its own averaged gradient plus the
server's reply. The messages are those of vertical SFVI: ``z_j`` on the round's rows and
gradients with respect to ``z``; chains, data and ``z_j`` off the round's rows stay put.
With a row minibatch, row terms are scaled by ``n / b`` (the Langevin steps become
stochastic-gradient Langevin steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import random

from ..vertical_objective import SERVER, VerticalObjective
from .base import ascent

if TYPE_CHECKING:  # pragma: no cover
    import optax

__all__ = ["PointAux", "SOULClientState", "SOULServerState", "VerticalSOULAlgorithm", "vertical_soul"]

_POWER_SERVER_SITES = (
    "SOUL in the power form: sites {names} belong to the server, but every client's "
    "Langevin chain needs them; list them under one client's 'sites' in vertical_split"
)


class PointAux:
    """``z_j`` as a point estimate, one value per row (what SOUL optimises)."""

    amortized = False
    use_response = False

    def init(self, rng_key, num_rows: int, num_inputs: int) -> Dict[str, jax.Array]:
        del rng_key, num_inputs
        return {"z": jnp.zeros(num_rows)}

    def sample(self, params, rows, inputs, tau):
        """``(z[rows], 0)``: a point mass has no entropy term."""
        del inputs, tau
        return params["z"][rows], jnp.zeros(())


class _PointGuide:
    """What :class:`VerticalObjective` needs of a guide: the factor for ``z``."""

    def __init__(self) -> None:
        self.aux = PointAux()


class SOULClientState(NamedTuple):
    chain: jax.Array  # the current draw of theta_j (unconstrained, flat)
    params: Dict[str, Any]  # {"z": (n,) values of z_j, "point": numpyro.param values}
    opt_state: Any
    pending: Dict[str, Any]  # power form: averaged gradients and value of this iteration's draws


class SOULServerState(NamedTuple):
    chain: jax.Array  # the current draw of theta_0
    params: Dict[str, Any]  # {"point": numpyro.param values}
    opt_state: Any


class VerticalSOULAlgorithm(NamedTuple):
    """The pure functions of vertical SOUL, in the order of :func:`~numpyro_fed.vertical_protocol.protocol_round`."""

    init_server: Callable
    init_client: Callable
    schedule: Callable
    server_noise: Callable
    client_noise: Callable
    client_forward: Callable
    server_step: Callable  # augmented
    relay: Callable  # power
    client_likelihood: Callable  # power: chain + gradients for the others' z -> (state, message)
    server_aggregate: Callable  # power
    client_step: Callable
    client_chain: Callable  # (client, state, noise, z_all, own) -> draws with z held fixed
    server_chain: Callable  # (state, noise, z_all, own) -> draws with z held fixed


def _langevin(target, u, rest, noise, step_size):
    """``len(noise)`` ULA steps on ``u``; averages of ``target`` and ``d target / d rest``
    over the visited draws (the chain's state before each move).

    Returns ``(u_final, mean value, mean gradient for rest, draws)``.
    """
    grad = jax.value_and_grad(target, argnums=(0, 1))
    scale = jnp.sqrt(2.0 * step_size)

    def body(carry, xi):
        u, acc_v, acc_g = carry
        v, (g_u, g_rest) = grad(u, rest)
        acc_g = jax.tree_util.tree_map(jnp.add, acc_g, g_rest)
        return (u + step_size * g_u + scale * xi, acc_v + v, acc_g), u

    zero = jax.tree_util.tree_map(jnp.zeros_like, rest)
    (u, total, acc), draws = jax.lax.scan(body, (u, jnp.zeros(()), zero), noise)
    m = noise.shape[0]
    return u, total / m, jax.tree_util.tree_map(lambda g: g / m, acc), draws


def vertical_soul(
    objective: VerticalObjective,
    optim: "optax.GradientTransformation",
    step_size: Union[float, Mapping[str, float]],
    num_langevin: int = 5,
    batch_size: Optional[int] = None,
    init_radius: float = 0.5,
) -> VerticalSOULAlgorithm:
    """Build vertical SOUL for ``objective`` (built with a :class:`PointAux` guide).

    Args:
        objective: a :class:`~numpyro_fed.vertical_objective.VerticalObjective`.
        optim: optax optimiser for ``z`` and ``numpyro.param`` sites (ascent; a decaying
            schedule gives the Robbins-Monro conditions).
        step_size: ULA step ``gamma``, one float or ``{party: float}`` (``"server"`` for
            the server's chain).
        num_langevin: ULA steps per communication (``M``).
        batch_size: rows per iteration, drawn with replacement by the server.
        init_radius: chains start uniform in ``(-r, r)`` (unconstrained space).

    References:
        Hassan, Sutton, Mira, Mengersen (paper 000), Appendix A; De Bortoli, Durmus,
        Pereyra, Vidal (2021), Statistics and Computing 31.
    """
    obj = objective
    n = obj.num_rows
    b = n if batch_size is None else int(batch_size)
    clients = obj.clients
    power = obj.form == "power"
    d0 = obj.layouts[SERVER].size
    m = int(num_langevin)
    if power and d0:
        raise ValueError(_POWER_SERVER_SITES.format(names=sorted(obj.layouts[SERVER].names)))
    gammas = {p: float(step_size[p] if isinstance(step_size, Mapping) else step_size) for p in (SERVER,) + clients}

    def init_server(rng_key) -> SOULServerState:
        chain = random.uniform(rng_key, (d0,), minval=-init_radius, maxval=init_radius)
        params = {"point": dict(obj.point_init[SERVER])}
        return SOULServerState(chain, params, optim.init(params))

    def init_client(rng_key, client: str) -> SOULClientState:
        chain = random.uniform(rng_key, (obj.layouts[client].size,), minval=-init_radius, maxval=init_radius)
        params = {"z": jnp.zeros(n), "point": dict(obj.point_init[client])}
        pending = {"grad": jax.tree_util.tree_map(jnp.zeros_like, params), "value": jnp.zeros(())}
        return SOULClientState(chain, params, optim.init(params), pending)

    def schedule(rng_key) -> Dict[str, jax.Array]:
        if batch_size is None:
            return {"rows": jnp.arange(n)}
        return {"rows": random.randint(rng_key, (b,), 0, n)}

    def server_noise(rng_key) -> jax.Array:
        return random.normal(rng_key, (m, d0))

    def client_noise(rng_key, client: str) -> jax.Array:
        return random.normal(rng_key, (m, obj.layouts[client].size))

    def client_forward(client, state: SOULClientState, noise, sched, own) -> Dict[str, jax.Array]:
        del client, noise, own
        return {"z": state.params["z"][sched["rows"]]}

    def _client_target(client, own, rows, terms):
        def target(u, rest):
            params, others = rest
            return obj.client_term(
                client, u, {"z": params["z"]}, None, own, rows, others=others, terms=terms, points=params["point"]
            )[0]

        return target

    def _server_target(own, rows):
        def target(u, rest):
            z, points = rest
            return obj.server_term(u, z, own, rows, points)

        return target

    def server_step(state: SOULServerState, noise, z_messages, sched, own):
        z = {c: z_messages[c]["z"] for c in clients}
        target = _server_target(own, sched["rows"])
        # without server sites the target is deterministic: one evaluation suffices
        steps = noise if d0 else noise[:1]
        chain, value, (g_z, g_points), _ = _langevin(target, state.chain, (z, state.params["point"]), steps, gammas[SERVER])
        params, opt_state = ascent(optim, {"point": g_points}, state.opt_state, state.params)
        replies = {c: {"grad_z": g_z[c]} for c in clients}
        return SOULServerState(chain, params, opt_state), replies, value

    def relay(state: SOULServerState, noise, z_messages) -> Dict[str, jax.Array]:
        del state, noise
        return {"z": jnp.stack([z_messages[c]["z"] for c in clients])}

    def _others(client, relayed):
        return {c: relayed["z"][k] for k, c in enumerate(clients) if c != client}

    def client_likelihood(client, state: SOULClientState, noise, relayed, sched, own):
        target = _client_target(client, own, sched["rows"], ("local", "likelihood"))
        chain, value, (g_params, g_others), _ = _langevin(
            target, state.chain, (state.params, _others(client, relayed)), noise, gammas[client]
        )
        message = {"grad_z": jnp.stack([g_others[c] for c in clients if c != client])}
        return state._replace(chain=chain, pending={"grad": g_params, "value": value}), message

    def server_aggregate(state: SOULServerState, noise, lik_messages, sched, own):
        del noise, sched, own
        totals = {c: jnp.zeros(b) for c in clients}
        for sender in clients:
            for i, c in enumerate(k for k in clients if k != sender):
                totals[c] = totals[c] + lik_messages[sender]["grad_z"][i]
        return state, {c: {"grad_z": totals[c]} for c in clients}, jnp.zeros(())

    def client_step(client, state: SOULClientState, noise, reply, sched, own, relayed=None):
        if power:
            chain, grads, value = state.chain, state.pending["grad"], state.pending["value"]
        else:
            target = _client_target(client, own, sched["rows"], ("local",))
            chain, value, (grads, _), _ = _langevin(target, state.chain, (state.params, {}), noise, gammas[client])
        grads = {**grads, "z": grads["z"].at[sched["rows"]].add(reply["grad_z"])}
        params, opt_state = ascent(optim, grads, state.opt_state, state.params)
        return SOULClientState(chain, params, opt_state, state.pending), value

    def client_chain(client, state: SOULClientState, noise, z_all, own):
        """Draws of ``theta_j`` (one per row of ``noise``) with every ``z`` held at ``z_all``."""
        rows = jnp.arange(n)
        terms = ("local", "likelihood") if power else ("local",)
        others = {c: z_all[c] for c in clients if c != client} if power else {}
        target = _client_target(client, own, rows, terms)
        params = {**state.params, "z": z_all[client]}
        return _langevin(target, state.chain, (params, others), noise, gammas[client])[3]

    def server_chain(state: SOULServerState, noise, z_all, own):
        """Draws of ``theta_0`` with every ``z`` held at ``z_all``."""
        target = _server_target(own, jnp.arange(n))
        return _langevin(target, state.chain, (z_all, state.params["point"]), noise, gammas[SERVER])[3]

    return VerticalSOULAlgorithm(
        init_server, init_client, schedule, server_noise, client_noise, client_forward, server_step, relay,
        client_likelihood, server_aggregate, client_step, client_chain, server_chain,
    )

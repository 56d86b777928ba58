"""Vertical SOUL: MAP for ``z`` with unadjusted-Langevin draws for ``theta`` (Hassan et al. (2024), App. A).

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
  p(y | g_j + sum_{k != j} z_k, theta_0)^{1/J}`` given the relayed ``z`` (and the
  server's current ``theta_0``); it returns the averaged ``d/dz_k`` (``k != j``) of its
  likelihood copy and the server sums them (eq. 24). Server-held sites (an intercept)
  couple the copies, so they are updated block-wise: after the clients' ``M`` steps the
  server takes one Langevin step on ``theta_0`` with the clients' gradients
  ``d/dtheta_0`` of their copies at their last draws (Langevin-within-Gibbs; A.3's
  communication pattern). Server ``numpyro.param`` sites are not supported in this form.

Each client then ascends ``z_j`` with ``optim`` using its own averaged gradient plus the
server's reply. The messages are those of vertical SFVI: ``z_j`` on the round's rows and
gradients with respect to ``z``; chains, data and ``z_j`` off the round's rows stay put.
With a row minibatch, row terms are scaled by ``n / b`` (the Langevin steps become
stochastic-gradient Langevin steps).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import random

from ..run.steps import ascent
from .objective import SERVER, VerticalObjective

if TYPE_CHECKING:  # pragma: no cover
    import optax

__all__ = ["PointAux", "PointGuide", "SOULClientState", "SOULServerState", "VerticalSOULAlgorithm", "vertical_soul"]


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


class PointGuide:
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
    """The pure functions of vertical SOUL, in the order of :func:`~numpyro_fed.vertical.protocol.vertical_protocol`."""

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
    posterior_chain: Callable  # (server, clients, noise, z_all, views) -> draws with z held fixed


def _langevin(target, u, rest, noise, step_size):
    """``len(noise)`` ULA steps on ``u``; averages of ``target`` and ``d target / d rest``
    over the visited draws (the chain's state before each move).

    Returns ``(u_final, mean value, mean gradient for rest)``.
    """
    grad = jax.value_and_grad(target, argnums=(0, 1))
    scale = jnp.sqrt(2.0 * step_size)

    def body(carry, xi):
        u, acc_v, acc_g = carry
        v, (g_u, g_rest) = grad(u, rest)
        acc_g = jax.tree_util.tree_map(jnp.add, acc_g, g_rest)
        return (u + step_size * g_u + scale * xi, acc_v + v, acc_g), None

    zero = jax.tree_util.tree_map(jnp.zeros_like, rest)
    (u, total, acc), _ = jax.lax.scan(body, (u, jnp.zeros(()), zero), noise)
    m = noise.shape[0]
    return u, total / m, jax.tree_util.tree_map(lambda g: g / m, acc)


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
        objective: a :class:`~numpyro_fed.vertical.objective.VerticalObjective`.
        optim: optax optimiser for ``z`` and ``numpyro.param`` sites (ascent; a decaying
            schedule gives the Robbins-Monro conditions).
        step_size: ULA step ``gamma``, one float or ``{party: float}`` (``"server"`` for
            the server's chain).
        num_langevin: ULA steps per communication (``M``).
        batch_size: rows per iteration, drawn with replacement by the server.
        init_radius: chains start uniform in ``(-r, r)`` (unconstrained space).

    References:
        Hassan, Sutton, Mira, Mengersen (Hassan et al. (2024)), Appendix A; De Bortoli, Durmus,
        Pereyra, Vidal (2021), Statistics and Computing 31.
    """
    gammas = {p: float(step_size[p] if isinstance(step_size, Mapping) else step_size)
              for p in (SERVER,) + objective.clients}
    config = SOULConfig(batch_size, int(num_langevin), init_radius, gammas)
    bind = partial(partial, obj=objective, optim=optim, config=config)
    return VerticalSOULAlgorithm(
        bind(init_server), bind(init_client), bind(schedule), bind(server_noise), bind(client_noise),
        bind(client_forward), bind(server_step), bind(relay), bind(client_likelihood), bind(server_aggregate),
        bind(client_step), bind(posterior_chain),
    )


class SOULConfig(NamedTuple):
    """SOUL's static settings (see :func:`vertical_soul`); ``gammas``: the ULA step of each party."""

    batch_size: Optional[int]
    num_langevin: int
    init_radius: float
    gammas: Dict[str, float]


def init_server(rng_key, *, obj: VerticalObjective, optim, config: SOULConfig) -> SOULServerState:
    """The server's chain (uniform in ``(-r, r)``), its point sites and their optimiser state."""
    d0 = obj.layouts[SERVER].size
    chain = random.uniform(rng_key, (d0,), minval=-config.init_radius, maxval=config.init_radius)
    params = {"point": dict(obj.point_init[SERVER])}
    return SOULServerState(chain, params, optim.init(params))


def init_client(rng_key, client: str, *, obj: VerticalObjective, optim, config: SOULConfig) -> SOULClientState:
    """A party's chain, its ``z`` (zeros) and point sites, their optimiser state, the pending slot."""
    r = config.init_radius
    chain = random.uniform(rng_key, (obj.layouts[client].size,), minval=-r, maxval=r)
    params = {"z": jnp.zeros(obj.num_rows), "point": dict(obj.point_init[client])}
    pending = {"grad": jax.tree_util.tree_map(jnp.zeros_like, params), "value": jnp.zeros(())}
    return SOULClientState(chain, params, optim.init(params), pending)


def schedule(rng_key, *, obj: VerticalObjective, optim, config: SOULConfig) -> Dict[str, jax.Array]:
    """The round's rows: all, or ``batch_size`` drawn uniformly with replacement."""
    if config.batch_size is None:
        return {"rows": jnp.arange(obj.num_rows)}
    return {"rows": random.randint(rng_key, (int(config.batch_size),), 0, obj.num_rows)}


def server_noise(rng_key, *, obj: VerticalObjective, optim, config: SOULConfig) -> jax.Array:
    return random.normal(rng_key, (config.num_langevin, obj.layouts[SERVER].size))


def client_noise(rng_key, client: str, *, obj: VerticalObjective, optim, config: SOULConfig) -> jax.Array:
    return random.normal(rng_key, (config.num_langevin, obj.layouts[client].size))


def client_forward(client, state: SOULClientState, noise, sched, own, *, obj: VerticalObjective, optim,
                   config: SOULConfig) -> Dict[str, jax.Array]:
    """A party's point ``z_j`` on the round's rows."""
    del client, noise, own
    return {"z": state.params["z"][sched["rows"]]}


def _client_target(obj, client, own, rows, terms, server_u=None):
    def target(u, rest, server_u=server_u):
        params, others = rest
        return obj.client_term(
            client, u, {"z": params["z"]}, None, own, rows, others=others, server_u=server_u, terms=terms,
            points=params["point"],
        )[0]

    return target


def _server_prior(obj, u0, own, rows):
    return obj.server_term(u0, {}, own, rows)  # power form: log p(theta_0) only


def _server_target(obj, own, rows):
    def target(u, rest):
        z, points = rest
        return obj.server_term(u, z, own, rows, points)

    return target


def server_step(state: SOULServerState, noise, z_messages, sched, own, *, obj: VerticalObjective, optim,
                config: SOULConfig):
    """Augmented form: the server's Langevin steps and point-site step; each party's ``d/dz_j``."""
    z = {c: z_messages[c]["z"] for c in obj.clients}
    target = _server_target(obj, own, sched["rows"])
    # without server sites the target is deterministic: one evaluation suffices
    steps = noise if obj.layouts[SERVER].size else noise[:1]
    chain, value, (g_z, g_points) = _langevin(target, state.chain, (z, state.params["point"]), steps,
                                              config.gammas[SERVER])
    params, opt_state = ascent(optim, {"point": g_points}, state.opt_state, state.params)
    replies = {c: {"grad_z": g_z[c]} for c in obj.clients}
    return SOULServerState(chain, params, opt_state), replies, value


def relay(state: SOULServerState, noise, z_messages, *, obj: VerticalObjective, optim,
          config: SOULConfig) -> Dict[str, jax.Array]:
    """Power form: every party's ``z`` (and the server's chain) for every party."""
    del noise
    message = {"z": jnp.stack([z_messages[c]["z"] for c in obj.clients])}
    if obj.layouts[SERVER].size:
        message["theta"] = state.chain
    return message


def _others(obj, client, relayed):
    return {c: relayed["z"][k] for k, c in enumerate(obj.clients) if c != client}


def client_likelihood(client, state: SOULClientState, noise, relayed, sched, own, *, obj: VerticalObjective, optim,
                      config: SOULConfig):
    """Power form: a party's Langevin steps on its copy; gradients for the others' ``z``."""
    server_u = relayed.get("theta")
    target = _client_target(obj, client, own, sched["rows"], ("local", "likelihood"), server_u)
    rest = (state.params, _others(obj, client, relayed))
    chain, value, (g_params, g_others) = _langevin(target, state.chain, rest, noise, config.gammas[client])
    message = {"grad_z": jnp.stack([g_others[c] for c in obj.clients if c != client])}
    if obj.layouts[SERVER].size:  # d/dtheta_0 of the client's copy at its last draw, for the server's block step
        message["grad_theta"] = jax.grad(lambda s0: target(chain, rest, s0))(server_u)
    return state._replace(chain=chain, pending={"grad": g_params, "value": value}), message


def _server_block_step(obj, config: SOULConfig, u0, grad_clients, xi, own, rows):
    value, g = jax.value_and_grad(partial(_server_prior, obj))(u0, own, rows)
    gamma = config.gammas[SERVER]
    return u0 + gamma * (g + grad_clients) + jnp.sqrt(2.0 * gamma) * xi, value


def server_aggregate(state: SOULServerState, noise, lik_messages, sched, own, *, obj: VerticalObjective, optim,
                     config: SOULConfig):
    """Power form: each party's ``d/dz_j`` summed over the others' copies; the server's block step."""
    clients = obj.clients
    b = obj.num_rows if config.batch_size is None else int(config.batch_size)
    totals = {c: jnp.zeros(b) for c in clients}
    for sender in clients:
        for i, c in enumerate(k for k in clients if k != sender):
            totals[c] = totals[c] + lik_messages[sender]["grad_z"][i]
    value = jnp.zeros(())
    if obj.layouts[SERVER].size:
        grad_u = sum(lik_messages[c]["grad_theta"] for c in clients)
        chain, value = _server_block_step(obj, config, state.chain, grad_u, noise[0], own, sched["rows"])
        state = state._replace(chain=chain)
    return state, {c: {"grad_z": totals[c]} for c in clients}, value


def client_step(client, state: SOULClientState, noise, reply, sched, own, relayed=None, *, obj: VerticalObjective,
                optim, config: SOULConfig):
    """A party's Langevin steps (augmented form; the power form's were taken in ``client_likelihood``)
    and its ascent step on ``z`` and point sites with the server's ``d/dz_j``."""
    if obj.form == "power":
        chain, grads, value = state.chain, state.pending["grad"], state.pending["value"]
    else:
        target = _client_target(obj, client, own, sched["rows"], ("local",))
        chain, value, (grads, _) = _langevin(target, state.chain, (state.params, {}), noise, config.gammas[client])
    grads = {**grads, "z": grads["z"].at[sched["rows"]].add(reply["grad_z"])}
    params, opt_state = ascent(optim, grads, state.opt_state, state.params)
    return SOULClientState(chain, params, opt_state, state.pending), value


def posterior_chain(server: SOULServerState, states, noise, z_all, views, *, obj: VerticalObjective, optim,
                    config: SOULConfig):
    """Langevin draws of every party's ``theta`` with ``z`` held at ``z_all`` (all rows).

    ``noise``: ``{party: (K, d_party)}``. Returns ``{party: (K, d_party)}`` draws. In the
    augmented form the chains are independent; in the power form with server sites
    each step is a client step given ``theta_0`` then a server step (one exchange).
    """
    clients, d0, gammas = obj.clients, obj.layouts[SERVER].size, config.gammas
    power = obj.form == "power"
    rows = jnp.arange(obj.num_rows)
    terms = ("local", "likelihood") if power else ("local",)

    def step(carry, xi):
        u0, us = carry
        new_us = {}
        grad_u = jnp.zeros(d0)
        for c in clients:
            others = {k: z_all[k] for k in clients if k != c} if power else {}
            target = _client_target(obj, c, views[c], rows, terms, u0 if power and d0 else None)
            rest = ({**states[c].params, "z": z_all[c]}, others)
            g = jax.grad(target)(us[c], rest)
            new_us[c] = us[c] + gammas[c] * g + jnp.sqrt(2.0 * gammas[c]) * xi[c]
            if power and d0:
                grad_u = grad_u + jax.grad(lambda s0, c=c, t=target, r=rest: t(new_us[c], r, s0))(u0)
        if not d0:
            new_u0 = u0
        elif power:
            new_u0 = _server_block_step(obj, config, u0, grad_u, xi[SERVER], views[SERVER], rows)[0]
        else:
            target = _server_target(obj, views[SERVER], rows)
            g = jax.grad(target)(u0, (z_all, server.params["point"]))
            new_u0 = u0 + gammas[SERVER] * g + jnp.sqrt(2.0 * gammas[SERVER]) * xi[SERVER]
        return (new_u0, new_us), (u0, us)

    init = (server.chain, {c: states[c].chain for c in clients})
    _, (draws0, draws) = jax.lax.scan(step, init, noise)
    return {SERVER: draws0, **draws}

"""The exchanges of vertical federation, shared by vertical SFVI and SOUL.

A vertical algorithm (:func:`~numpyro_fed.vertical.sfvi_algorithm.vertical_sfvi`,
:func:`~numpyro_fed.vertical.soul_algorithm.vertical_soul`) is a NamedTuple of per-party
pure functions; :func:`vertical_protocol` turns it into a
:class:`~numpyro_fed.protocol.FederatedAlgorithm` whose clients are the parties. One
round (paper 000, Algorithms 1-2 and Appendix A):

1. ``forward``: the server's broadcast names the round's rows; each client draws its
   noise from its own key and sends ``z_j`` on those rows;
2. augmented form: the server steps and replies ``d/dz_j`` of its terms to client j
   (``grad_z``, the per-client part of its broadcast);
   power form: the server relays every ``z`` (and its draw of ``theta_0``), each client
   returns the gradients of its likelihood copy with respect to the other clients' ``z``
   (exchange ``likelihood``), and the server sums them into each client's ``grad_z``;
3. ``update``: each client updates its own parameters and answers with its scalar
   objective term (for the trace); the server picks the next round's rows.

**A missing answer** (dropout): no party can step without every ``z_j``, so a round in
which an asked party did not answer is skipped: the server's broadcasts carry
``proceed = False`` and no party changes its parameters (``VerticalInfo.complete``).

Client data are :class:`PartyData`: a party's arrays on all rows with its name as static
metadata, so one jit-compiled round serves parties of different shapes.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp

from ..protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients
from .objective import VerticalObjective

__all__ = ["PartyData", "VerticalInfo", "vertical_protocol"]


@jax.tree_util.register_pytree_node_class
class PartyData:
    """A party's data (all rows) and its name (static under ``jit``)."""

    def __init__(self, party: str, args: Dict[str, jax.Array]) -> None:
        self.party, self.args = party, args

    def rows(self, rows: jax.Array) -> Dict[str, jax.Array]:
        return {k: v[rows] for k, v in self.args.items()}

    def tree_flatten(self):
        return (self.args,), self.party

    @classmethod
    def tree_unflatten(cls, party, children):
        return cls(party, children[0])


class VerticalClientState(NamedTuple):
    inner: Any  # the algorithm's state of this party
    noise: Any  # this round's draws (kept between the round's exchanges)
    rows: jax.Array  # this round's rows
    relayed: Any  # power form: the relayed z (and theta_0) of this round


class VerticalServerState(NamedTuple):
    inner: Any
    noise: Any
    rows: jax.Array  # the rows of the coming round


class VerticalInfo(NamedTuple):
    value: jax.Array  # the parties' objective terms summed (ELBO for SFVI; log joint for SOUL)
    complete: jax.Array  # every party answered, so the round counted


def _keep(flag, new, old):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(flag, a, b), new, old)


def vertical_protocol(alg, obj: VerticalObjective) -> FederatedAlgorithm:
    """Exchanges of ``alg`` (vertical SFVI or SOUL functions) over the parties of ``obj``."""
    clients = obj.clients
    J = len(clients)
    power = obj.form == "power"

    def init_server(rng_key):
        k_init, k_rows = jax.random.split(rng_key)
        inner = alg.init_server(k_init)
        rows = alg.schedule(k_rows)["rows"]
        noise = jax.eval_shape(alg.server_noise, k_init)
        state = VerticalServerState(inner, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), noise), rows)
        return state, Broadcast({"rows": rows})

    def init_client(rng_key, data: PartyData):
        inner = alg.init_client(rng_key, data.party)
        noise = jax.eval_shape(lambda k: alg.client_noise(k, data.party), rng_key)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), noise)
        rows = jax.eval_shape(alg.schedule, rng_key)["rows"]
        relayed = None
        if power:
            relayed = {"z": jnp.zeros((J,) + rows.shape)}
            if obj.layouts["server"].size:
                relayed["theta"] = jnp.zeros(obj.layouts["server"].size)
        return VerticalClientState(inner, zeros, jnp.zeros(rows.shape, rows.dtype), relayed)

    def stacked_z(messages):
        return {c: {"z": messages["z"][j]} for j, c in enumerate(clients)}

    # 1. forward: z_j on the round's rows
    def forward_client(rng_key, state: VerticalClientState, broadcast, data: PartyData):
        rows = broadcast.shared["rows"]
        noise = alg.client_noise(rng_key, data.party)
        z = alg.client_forward(data.party, state.inner, noise, {"rows": rows}, data.rows(rows))
        return state._replace(noise=noise, rows=rows), z

    def forward_server(rng_key, state: VerticalServerState, messages, view):
        complete = jnp.all(view.answered)
        noise = alg.server_noise(rng_key)
        sched = {"rows": state.rows}
        if power:
            relayed = alg.relay(state.inner, noise, stacked_z(messages))
            info = VerticalInfo(jnp.zeros(()), complete)
            return state._replace(noise=noise), Broadcast({**relayed, "proceed": complete}), info
        own = {k: v[state.rows] for k, v in view.data.items()}
        inner, replies, value = alg.server_step(state.inner, noise, stacked_z(messages), sched, own)
        inner = _keep(complete, inner, state.inner)
        per_client = {"grad_z": jnp.stack([replies[c]["grad_z"] for c in clients])}
        return (state._replace(inner=inner, noise=noise), Broadcast({"proceed": complete}, per_client),
                VerticalInfo(value, complete))

    # 2 (power form). likelihood: gradients of each copy for the others' z
    def likelihood_client(rng_key, state: VerticalClientState, broadcast, data: PartyData):
        del rng_key
        relayed = {k: v for k, v in broadcast.shared.items() if k != "proceed"}
        sched = {"rows": state.rows}
        inner, message = alg.client_likelihood(data.party, state.inner, state.noise, relayed, sched,
                                               data.rows(state.rows))
        inner = _keep(broadcast.shared["proceed"], inner, state.inner)
        return state._replace(inner=inner, relayed=relayed), message

    def likelihood_server(rng_key, state: VerticalServerState, messages, view):
        del rng_key
        complete = jnp.all(view.answered)
        sched = {"rows": state.rows}
        own = {k: v[state.rows] for k, v in view.data.items()}
        lik = {c: jax.tree_util.tree_map(lambda x, j=j: x[j], messages) for j, c in enumerate(clients)}
        inner, replies, value = alg.server_aggregate(state.inner, state.noise, lik, sched, own)
        inner = _keep(complete, inner, state.inner)
        per_client = {"grad_z": jnp.stack([replies[c]["grad_z"] for c in clients])}
        return (state._replace(inner=inner), Broadcast({"proceed": complete}, per_client),
                VerticalInfo(value, complete))

    # 3. update: every party steps with the server's reply
    def update_client(rng_key, state: VerticalClientState, broadcast, data: PartyData):
        del rng_key
        sched = {"rows": state.rows}
        reply = {"grad_z": broadcast.per_client["grad_z"]}
        inner, value = alg.client_step(data.party, state.inner, state.noise, reply, sched, data.rows(state.rows),
                                       state.relayed)
        proceed = broadcast.shared["proceed"]
        return state._replace(inner=_keep(proceed, inner, state.inner)), {"value": value}

    def update_server(rng_key, state: VerticalServerState, messages, view):
        value = jnp.sum(jnp.where(view.answered, messages["value"], 0.0))
        rows = alg.schedule(rng_key)["rows"]
        return state._replace(rows=rows), Broadcast({"rows": rows}), VerticalInfo(value, jnp.all(view.answered))

    exchanges = [Exchange(forward_client, forward_server, "forward")]
    if power:
        exchanges.append(Exchange(likelihood_client, likelihood_server, "likelihood"))
    exchanges.append(Exchange(update_client, update_server, "update"))

    def round_info(infos):
        return VerticalInfo(sum(i.value for i in infos), infos[0].complete)

    return FederatedAlgorithm(
        init_server, init_client, all_clients(J), tuple(exchanges), num_selected=J, round_info=round_info,
        monitor=lambda info: -info.value, monitor_name="loss",
    )

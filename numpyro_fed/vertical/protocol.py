"""The exchanges of vertical federation, shared by vertical SFVI and SOUL.

A vertical algorithm (:func:`~numpyro_fed.vertical.sfvi_algorithm.vertical_sfvi`,
:func:`~numpyro_fed.vertical.soul_algorithm.vertical_soul`) is a NamedTuple of per-party
pure functions; :func:`vertical_protocol` turns it into a
:class:`~numpyro_fed.run.protocol.FederatedAlgorithm` whose clients are the parties. One
round (Hassan et al. (2024), Algorithms 1-2 and Appendix A):

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

from functools import partial
from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp

from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients
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
    """Exchanges of ``alg`` (vertical SFVI or SOUL functions) over the parties of ``obj``: the
    module's step functions bound to them (``forward``; in the power form ``likelihood``;
    ``update``)."""
    bind = partial(partial, alg=alg, obj=obj)
    exchanges = [Exchange(bind(forward_client), bind(forward_server), "forward")]
    if obj.form == "power":
        exchanges.append(Exchange(bind(likelihood_client), bind(likelihood_server), "likelihood"))
    exchanges.append(Exchange(bind(update_client), bind(update_server), "update"))
    J = len(obj.clients)
    return FederatedAlgorithm(
        bind(init_server), bind(init_client), all_clients(J), tuple(exchanges), num_selected=J,
        round_info=round_info, monitor=lambda info: -info.value, monitor_name="loss",
    )


def round_info(infos):
    """A round's info: the exchanges' values summed (the parties' scalar terms)."""
    return VerticalInfo(sum(i.value for i in infos), infos[0].complete)


def init_server(rng_key, *, alg, obj: VerticalObjective):
    """The server's state (its algorithm state, noise slot, the first round's rows) and the rows."""
    k_init, k_rows = jax.random.split(rng_key)
    inner = alg.init_server(k_init)
    rows = alg.schedule(k_rows)["rows"]
    noise = jax.eval_shape(alg.server_noise, k_init)
    state = VerticalServerState(inner, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), noise), rows)
    return state, Broadcast({"rows": rows})


def init_client(rng_key, data: PartyData, *, alg, obj: VerticalObjective):
    """A party's state: its algorithm state, noise and rows slots, and (power form) the relayed values."""
    inner = alg.init_client(rng_key, data.party)
    noise = jax.eval_shape(lambda k: alg.client_noise(k, data.party), rng_key)
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), noise)
    rows = jax.eval_shape(alg.schedule, rng_key)["rows"]
    relayed = None
    if obj.form == "power":
        relayed = {"z": jnp.zeros((len(obj.clients),) + rows.shape)}
        if obj.layouts["server"].size:
            relayed["theta"] = jnp.zeros(obj.layouts["server"].size)
    return VerticalClientState(inner, zeros, jnp.zeros(rows.shape, rows.dtype), relayed)


def _stacked_z(obj: VerticalObjective, messages):
    return {c: {"z": messages["z"][j]} for j, c in enumerate(obj.clients)}


# 1. forward: z_j on the round's rows
def forward_client(rng_key, state: VerticalClientState, broadcast, data: PartyData, *, alg, obj: VerticalObjective):
    """A party's ``z_j`` on the round's rows (its noise drawn from its own key)."""
    rows = broadcast.shared["rows"]
    noise = alg.client_noise(rng_key, data.party)
    z = alg.client_forward(data.party, state.inner, noise, {"rows": rows}, data.rows(rows))
    return state._replace(noise=noise, rows=rows), z


def forward_server(rng_key, state: VerticalServerState, messages, view, *, alg, obj: VerticalObjective):
    """Augmented form: the server's step on the parties' ``z`` and each party's ``d/dz_j``;
    power form: the ``z`` relayed to every party."""
    complete = jnp.all(view.answered)
    noise = alg.server_noise(rng_key)
    sched = {"rows": state.rows}
    if obj.form == "power":
        relayed = alg.relay(state.inner, noise, _stacked_z(obj, messages))
        info = VerticalInfo(jnp.zeros(()), complete)
        return state._replace(noise=noise), Broadcast({**relayed, "proceed": complete}), info
    own = {k: v[state.rows] for k, v in view.data.items()}
    inner, replies, value = alg.server_step(state.inner, noise, _stacked_z(obj, messages), sched, own)
    inner = _keep(complete, inner, state.inner)
    per_client = {"grad_z": jnp.stack([replies[c]["grad_z"] for c in obj.clients])}
    return (state._replace(inner=inner, noise=noise), Broadcast({"proceed": complete}, per_client),
            VerticalInfo(value, complete))


# 2 (power form). likelihood: gradients of each copy for the others' z
def likelihood_client(rng_key, state: VerticalClientState, broadcast, data: PartyData, *, alg,
                      obj: VerticalObjective):
    """A party's copy of the likelihood: its gradients for the others' ``z``."""
    del rng_key
    relayed = {k: v for k, v in broadcast.shared.items() if k != "proceed"}
    sched = {"rows": state.rows}
    inner, message = alg.client_likelihood(data.party, state.inner, state.noise, relayed, sched,
                                           data.rows(state.rows))
    inner = _keep(broadcast.shared["proceed"], inner, state.inner)
    return state._replace(inner=inner, relayed=relayed), message


def likelihood_server(rng_key, state: VerticalServerState, messages, view, *, alg, obj: VerticalObjective):
    """The copies' gradients aggregated into each party's ``d/dz_j``."""
    del rng_key
    complete = jnp.all(view.answered)
    sched = {"rows": state.rows}
    own = {k: v[state.rows] for k, v in view.data.items()}
    lik = {c: jax.tree_util.tree_map(lambda x, j=j: x[j], messages) for j, c in enumerate(obj.clients)}
    inner, replies, value = alg.server_aggregate(state.inner, state.noise, lik, sched, own)
    inner = _keep(complete, inner, state.inner)
    per_client = {"grad_z": jnp.stack([replies[c]["grad_z"] for c in obj.clients])}
    return (state._replace(inner=inner), Broadcast({"proceed": complete}, per_client),
            VerticalInfo(value, complete))


# 3. update: every party steps with the server's reply
def update_client(rng_key, state: VerticalClientState, broadcast, data: PartyData, *, alg, obj: VerticalObjective):
    """A party's step with the server's reply; sends its scalar term."""
    del rng_key
    sched = {"rows": state.rows}
    reply = {"grad_z": broadcast.per_client["grad_z"]}
    inner, value = alg.client_step(data.party, state.inner, state.noise, reply, sched, data.rows(state.rows),
                                   state.relayed)
    proceed = broadcast.shared["proceed"]
    return state._replace(inner=_keep(proceed, inner, state.inner)), {"value": value}


def update_server(rng_key, state: VerticalServerState, messages, view, *, alg, obj: VerticalObjective):
    """The parties' terms summed; the next round's rows."""
    value = jnp.sum(jnp.where(view.answered, messages["value"], 0.0))
    rows = alg.schedule(rng_key)["rows"]
    return state._replace(rows=rows), Broadcast({"rows": rows}), VerticalInfo(value, jnp.all(view.answered))

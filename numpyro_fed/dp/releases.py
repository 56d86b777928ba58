"""Every private release counted, and capped at the plan, in one place: a transform of a
:class:`~numpyro_fed.run.protocol.FederatedAlgorithm` (as ``optax.chain`` transforms an optimiser).

A private family calibrates its noise for a number of releases per client (its plan) and its
guarantee holds for that many. An algorithm whose server step needs every client's release
(:class:`~numpyro_fed.dp.dp_laplace.DPLaplace`'s Newton step, :class:`~numpyro_fed.mcmc.DPMetropolis`'s
acceptance) would, left alone, ask every client again in a round after one where some client
missed, and the clients that had answered would release a second time for the same step.
:func:`capped_releases` wraps such an algorithm so that

- **a client releases once per step**: the server gathers the step's releases over as many rounds
  as the clients take to answer (each client's own, or their sums under secure aggregation) and
  runs the wrapped server step when every client's has arrived; a client asked again for a step
  it has released for sends nothing (zeros, marked as no release), and where the server says its
  release did not arrive (lost in transit, or in a masked round too few answered to unmask) it
  sends **the same release again**, kept in its state: a value sent twice tells no more than
  once, so it is not another release;
- **no client releases past its plan**, whatever the server asks: the client counts its own
  releases in its state and refuses one that would pass ``cap`` (it sends nothing and says so);
  the server then ends the run and the family raises
  :class:`~numpyro_fed.dp.ledger.PrivacyBudgetError` naming the client and its spend.

The client's count is the ``releases`` of its state (the privacy report and the ledger read it,
over a network backend too); nothing else of the count leaves the client but the per-round flags
``released`` and ``over_plan``, which say only whether a release was made (public: the server
sees the message arrive).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp

from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm

__all__ = ["CappedClient", "CappedServer", "capped_releases", "over_plan"]


class CappedClient(NamedTuple):
    """A client's state under :func:`capped_releases`."""

    inner: Any  # the wrapped algorithm's client state (as it was after its last release)
    releases: jax.Array  # int32: Gaussian releases this client has made (its privacy ledger)
    step: jax.Array  # int32: the step of its last release (-1: none yet)
    over_plan: jax.Array  # bool: it was asked for a release past its plan and sent none
    last: Dict[str, jax.Array]  # its last release (sent again, unchanged, where it did not arrive; never new noise)


class CappedServer(NamedTuple):
    """The server's state under :func:`capped_releases`."""

    inner: Any  # the wrapped algorithm's server state
    broadcast: Broadcast  # the wrapped algorithm's pending broadcast (repeated until the step is gathered)
    pending: Dict[str, jax.Array]  # the step's releases so far: a client's own per client, a secure sum summed
    have: jax.Array  # (J,) bool: whose release for this step has arrived
    step: jax.Array  # int32: steps gathered (the wrapped server step run)
    over_plan: jax.Array  # (J,) bool: clients that refused a release past their plan


def _select(flag, new, old):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(flag, a, b), new, old)


def capped_releases(algorithm: FederatedAlgorithm, num_clients: int, message: Dict[str, Any], *,
                    cap: int, per_release: int = 1) -> FederatedAlgorithm:
    """``algorithm`` with each client's releases gathered once per step and capped at ``cap``.

    Args:
        algorithm: a private family's algorithm of one exchange, whose server step acts only on a
            round where every client answered (it reads ``view.answered``).
        num_clients: J.
        message: ``{field: jax.ShapeDtypeStruct}``, one client's message (its released fields).
        cap: Gaussian releases each client may make in the run (the plan its noise is calibrated for).
        per_release: Gaussian releases one message carries (a sampler's chains: one each).
    """
    if len(algorithm.exchanges) != 1:
        raise ValueError("capped_releases wraps an algorithm of one exchange")
    inner_ex = algorithm.exchanges[0]
    secure = set(inner_ex.secure_sum)
    J = int(num_clients)

    def zeros():
        return {k: jnp.zeros(v.shape if k in secure else (J,) + tuple(v.shape), v.dtype) for k, v in message.items()}

    def wrap(server, broadcast, pending, have, step, over):
        return CappedServer(server, broadcast, pending, have, step, over), Broadcast(
            {"inner": broadcast.shared, "step": step}, {"inner": broadcast.per_client, "have": have})

    def init_server(rng_key):
        s, b = algorithm.init_server(rng_key)
        return wrap(s, b, zeros(), jnp.zeros(J, bool), jnp.zeros((), jnp.int32), jnp.zeros(J, bool))

    def init_client(rng_key, data):
        return CappedClient(algorithm.init_client(rng_key, data), jnp.zeros((), jnp.int32),
                            jnp.full((), -1, jnp.int32), jnp.zeros((), bool),
                            {k: jnp.zeros(v.shape, v.dtype) for k, v in message.items()})

    def client_step(rng_key, state: CappedClient, broadcast: Broadcast, data):
        step, have = broadcast.shared["step"], broadcast.per_client["have"]
        due = state.step < step  # no release for this step yet
        again = (state.step == step) & ~have  # the server says the one it made did not arrive
        allowed = state.releases + per_release <= cap
        release = due & allowed
        inner = Broadcast(broadcast.shared["inner"], broadcast.per_client["inner"])
        new_inner, msg = inner_ex.client_step(rng_key, state.inner, inner, data)
        msg = {k: jnp.where(release, v, jnp.where(again, state.last[k], jnp.zeros_like(v)))
               for k, v in dict(msg).items()}
        new = CappedClient(_select(release, new_inner, state.inner),
                           state.releases + per_release * release.astype(jnp.int32),
                           jnp.where(release, step, state.step), state.over_plan | (due & ~allowed),
                           _select(release, {k: msg[k] for k in message}, state.last))
        return new, {**msg, "released": release | again, "over_plan": due & ~allowed}

    def server_step(rng_key, state: CappedServer, messages, view):
        fresh = messages["released"] & view.answered
        over = state.over_plan | (messages["over_plan"] & view.answered)
        pending = {}
        for k, v in state.pending.items():
            if k in secure:  # a sum over the clients that answered; those that did not release sent zeros
                pending[k] = v + messages[k]
            else:
                pick = fresh.reshape((J,) + (1,) * (v.ndim - 1))
                pending[k] = jnp.where(pick, messages[k], v)
        have = state.have | fresh
        complete = jnp.all(have)
        new_inner, new_b, info = inner_ex.server_step(rng_key, state.inner, pending, view._replace(answered=have))
        server = _select(complete, new_inner, state.inner)
        broadcast = _select(complete, new_b, state.broadcast)
        pending = _select(complete, zeros(), pending)
        have = jnp.where(complete, jnp.zeros_like(have), have)
        new, b = wrap(server, broadcast, pending, have, state.step + complete.astype(jnp.int32), over)
        return new, b, info

    def done(s: CappedServer):
        over = jnp.any(s.over_plan)
        return over if algorithm.done is None else algorithm.done(s.inner) | over

    return algorithm._replace(
        init_server=init_server, init_client=init_client,
        select=lambda key, s: algorithm.select(key, s.inner),
        exchanges=(Exchange(client_step, server_step, inner_ex.name, inner_ex.secure_sum, inner_ex.aggregation),),
        done=done,
        describe=None if algorithm.describe is None else (lambda s: algorithm.describe(s.inner)),
        progress=None if algorithm.progress is None else (lambda s: algorithm.progress(s.inner)),
    )


def over_plan(result) -> list:
    """The clients of a run under :func:`capped_releases` that refused a release past their plan
    (read from the server's state: each refusal arrived as a flag)."""
    server = result.state.server
    if not isinstance(server, CappedServer):
        return []
    return [int(j) for j in jax.numpy.flatnonzero(server.over_plan)]

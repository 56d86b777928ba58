"""The shape every federated algorithm takes."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from .._typing import ClientStepFn

__all__ = ["FederatedAlgorithm", "ascent", "tree_weighted_sum"]


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as four pure functions.

    - ``init_server(rng_key) -> (server_state, server_message)``
    - ``init_client(rng_key, data) -> client_state``
    - ``client_step(rng_key, client_state, server_message, data) -> (client_state, client_message)``
    - ``server_step(rng_key, server_state, client_messages, active) -> (server_state, server_message, info)``

    ``client_messages`` stacks every client's message along a leading axis and ``active``
    marks the clients that took part in the round. Messages are pytrees of arrays; a
    client's data and local parameters live only in its own state.
    """

    init_server: Callable
    init_client: Callable
    client_step: ClientStepFn
    server_step: Callable


def ascent(optim, grads, opt_state, params):
    """One optax step that *maximises* (optax minimises)."""
    import optax

    updates, opt_state = optim.update(jax.tree_util.tree_map(jnp.negative, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def tree_weighted_sum(weights, stacked):
    """``sum_j weights[j] * stacked[j]`` over every leaf."""
    return jax.tree_util.tree_map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), stacked)

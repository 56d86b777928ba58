"""Federated SVI's fit check: ``log p(z, y) - log q(z)`` at draws ``z ~ q``, each client's term
computed on its own rows (in this process, or on its node over a network backend)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import random

__all__ = ["client_log_weights", "client_log_weights_from_keys", "log_weight_estimator"]


def log_weight_estimator(setup, num_draws: int):
    """``(state, data, rng_key) -> (num_draws,)`` values of ``log p(z, y) - log q(z)`` at
    draws ``z ~ q``: the server's term plus every client's term, per draw.

    Each client evaluates its own term (with its share of the global prior) on its own
    rows and returns one scalar per draw; the server adds the entropy term.
    """
    obj, plan = setup.extra, setup.plan
    share = 1.0 / len(plan.names)

    def estimate(state, data, rng_key):
        k_g, k_l = random.split(rng_key)
        g = state.server.global_params
        eps_g = random.normal(k_g, (num_draws, obj.global_size))

        def client_value(key, local_params, d):
            return client_log_weights(obj, share, num_draws, g, eps_g, key, local_params, d)

        keys = random.split(k_l, len(plan.names))
        if plan.mapping == "vmap":
            values = jnp.sum(jax.vmap(client_value)(keys, state.clients.state.local_params, data), axis=0)
        else:
            values = sum(
                client_value(keys[j], s.state.local_params, d) for j, (s, d) in enumerate(zip(state.clients, data))
            )
        return jax.vmap(lambda e: obj.server_term(g, e))(eps_g) + values

    return estimate


def client_log_weights(obj, share, num_draws, g, eps_g, key, local_params, d):
    """One client's term of ``log p(z, y) - log q(z)`` per draw, over its own rows."""
    eps_l = random.normal(key, (num_draws, obj.local_size(d)))
    return jax.vmap(lambda a, b: obj.client_term(g, local_params, a, b, d, share))(eps_g, eps_l)


def client_log_weights_from_keys(obj, share, num_draws, g, k_g, key, local_params, d):
    """:func:`client_log_weights` with the global draws' noise from ``k_g`` (the server's key)."""
    eps_g = random.normal(k_g, (num_draws, obj.global_size))
    return client_log_weights(obj, share, num_draws, g, eps_g, key, local_params, d)

"""PVI's and EP's fit check over a network backend (Flower): the simulation's check
(:mod:`numpyro_fed.terms.local_check`) with each client's part computed on its own node.

Two exchanges after the run, both recorded in the transcript and counted in the run's traffic:

1. ``local_integral`` (only for models with continuous local latents): the server sends
   ``q``'s mean; each client answers whether its ``v | u`` is Gaussian on its own rows and
   the Pareto k of its Laplace proposal there (two scalars, from its own key). The server
   decides as the simulation does: exact Laplace, importance-sampled, or no check
   (``last_fit_check_skipped`` says why).
2. ``log_weights``: the server sends its 1000 draws ``u ~ q`` (the simulation's, from the same
   key) and ``q``'s mean; each client returns ``log p(y_j | u)`` per draw (1000 scalars), its
   local latents integrated on the node with its own key. The server adds the prior and
   ``-log q(u)``.

No row, local latent or client key leaves a client; the draws ``u`` are the server's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..terms import gaussian as G
from ..terms.local_check import client_log_likelihoods, local_integral_k, locals_are_gaussian
from ..terms.tilted import PARETO_K_LIMIT

__all__ = ["CHECK_DRAWS", "client_value", "network_check", "value_inputs"]

CHECK_DRAWS = 1000  # as diagnose's default
_CHECK_KEY = 0x51  # the simulation's: the server's draws, and each client's fold-in of its own key


def value_inputs(cls: str, name: str, setup, num_draws: int) -> Dict[str, Any]:
    """The structure of what the server sends for the client-side value ``name``."""
    d = setup.extra.terms.prior.shift.shape[0]
    mean = jax.ShapeDtypeStruct((d,), jnp.float32)
    if name == "local_integral":
        return {"mean": mean}
    if name == "log_weights":
        return {"mean": mean, "u": jax.ShapeDtypeStruct((num_draws, d), jnp.float32),
                "sampled": jax.ShapeDtypeStruct((), jnp.int32)}
    raise ValueError(f"{cls}: no client-side value {name!r}")


def client_value(name: str, setup, data, payload, rng_key) -> Dict[str, Any]:
    """On a client after a network run: its part of the fit check, from its own rows and its own
    key (``rng_key``, never sent)."""
    terms = setup.extra.terms
    d = terms.prior.shift.shape[0]
    key = random.fold_in(rng_key, _CHECK_KEY)
    if name == "local_integral":
        gaussian = jax.jit(locals_are_gaussian, static_argnums=(0, 1, 2))(
            terms.log_joint, d, terms.num_local, payload["mean"], data, random.PRNGKey(5))
        k = jax.jit(local_integral_k, static_argnums=(0, 1, 2))(terms.log_joint, d, terms.num_local,
                                                                payload["mean"], data, key)
        return {"gaussian": jnp.asarray(gaussian, jnp.int32), "k": jnp.asarray(k, jnp.float32),
                "k_ok": jnp.asarray(k <= PARETO_K_LIMIT, jnp.int32)}
    sampled = bool(int(payload["sampled"]))
    cache = ("client_check", sampled)
    if cache not in setup.cache:
        def values(mean, u, data, key):
            return client_log_likelihoods(terms.log_joint, d, terms.num_local, mean, u, data,
                                          key if sampled else None)

        setup.cache[cache] = jax.jit(values)
    return {"values": setup.cache[cache](payload["mean"], payload["u"], data, key)}


def network_check(network, setup, result, num_draws: int
                  ) -> Tuple[Optional[np.ndarray], Optional[np.ndarray], str, list]:
    """``(log_w, u, why, exchanges)``: the check's log weights and ``num_draws`` draws computed
    with the clients over ``network`` (``log_w`` None when some client did not answer, or ``why``
    says the check cannot be trusted), and each exchange's traffic (its ``(sent, got)`` messages,
    or the masking protocol's ``Traffic``). When the run summed its clients' terms securely, so
    does the check: each of its two exchanges is one sum over the clients by pairwise masking
    (the server learns how many clients' local integrals are Gaussian and have a Pareto k within
    the limit, and the sum of their log-likelihoods per draw)."""
    terms, J = setup.extra.terms, len(setup.plan.names)
    q = result.state.server.q
    mean, _ = G.to_moments(q)
    mean = jnp.asarray(mean, jnp.float32)
    rnd, exchanges = int(result.communication.rounds), []
    secure = any(ex.secure_sum for ex in setup.algorithm.exchanges)

    def ask(name, payload):  # the sum over the clients of each field, or None
        payloads = {j: payload for j in range(J)}
        like = ({"gaussian": jax.ShapeDtypeStruct((), jnp.int32), "k": jax.ShapeDtypeStruct((), jnp.float32),
                 "k_ok": jax.ShapeDtypeStruct((), jnp.int32)}
                if name == "local_integral" else {"values": jax.ShapeDtypeStruct((num_draws,), jnp.float32)})
        if secure:
            total, traffic = network.masked_values(name, payloads, like, result.transcript, rnd)
            exchanges.append(traffic)
            return total
        got = network.client_values(name, payloads, like, result.transcript, rnd)
        exchanges.append((payloads, got))
        if len(got) < J:
            return None
        return {k: sum(got[j][k] for j in range(J)) for k in like}  # in client order, as the simulation sums

    sampled = False
    if terms.num_local:
        got = ask("local_integral", {"mean": mean})
        if got is None:
            return None, None, "some clients did not answer", exchanges
        if int(got["gaussian"]) < J:
            if int(got["k_ok"]) < J:
                return None, None, "proposal", exchanges
            sampled = True
    d = mean.shape[0]
    u = jax.vmap(lambda e: G.sample(q, e))(random.normal(random.PRNGKey(_CHECK_KEY), (num_draws, d)))
    got = ask("log_weights", {"mean": mean, "u": jnp.asarray(u, jnp.float32),
                              "sampled": jnp.asarray(int(sampled), jnp.int32)})
    if got is None:
        return None, None, "some clients did not answer", exchanges
    server = jax.vmap(lambda x: terms.log_prior(x) - G.log_prob(q, x))(u)  # the model's own prior
    return np.asarray(server + got["values"], np.float64), np.asarray(u), "", exchanges

"""The vertical fit check (:mod:`numpyro_fed.vertical.check`) over a network backend
(Flower): each party computes its own part on its own node.

Two exchanges after the run, both recorded in the transcript and counted in the run's traffic:

1. ``vertical_terms``: each client draws ``S`` values of its own sites from its own ``q``
   (with its own key) and sends, per draw, its contribution ``g_j`` on every row and the
   scalar ``log p(theta_j) - log q(theta_j)`` (``S (n + 1)`` floats, as the simulation's
   check). The server draws its own sites, adds ``log p(y | sum_j g_j, theta_0) +
   log p(theta_0) - log q(theta_0)`` and has ``log w`` per draw: Pareto k, the ESS and the
   moment check of its own sites.
2. ``vertical_moments``: the server sends the ``S`` normalised PSIS weights and the ESS; each
   client redraws the same ``theta_j`` from the same key and runs the moment check of its own
   sites (:func:`~numpyro_fed.check.psis.moment_report`, in user and unconstrained space) and
   answers, per scalar, only the standardised figures: the mean gap in weighted sds, the sd
   ratio and whether it is off. Its coefficients' values, draws and ``q`` stay on the node, so
   the server's report shows client sites standardised (weighted mean 0, weighted sd 1).

A client's draws, data and key never leave it; ``g_j`` without the augmentation noise is what
training sends as ``z_j``. Corrected draws (``sample_posterior(..., corrected=True)``) need
every party's draws and stay a simulation feature.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..check.psis import FitDiagnostic, SiteMoments, fit_diagnostic, moment_report, smoothed_weights
from .check import CHECK_CHUNK, CHECK_DRAWS
from .objective import SERVER, VerticalObjective

__all__ = ["CHECK_KEY", "client_value", "network_check", "party_check_key", "value_inputs"]

CHECK_KEY = 0x51
"""What a party folds into its own key for the fit check's draws (the simulation does the same)."""


def party_check_key(rng_key: jax.Array) -> jax.Array:
    """A client's key for the fit check's draws, from its own key (never sent)."""
    return random.fold_in(rng_key, CHECK_KEY)


def _scalar_names(obj: VerticalObjective, party: str) -> Tuple[List[str], List[str]]:
    """The names of ``party``'s scalars as :func:`~numpyro_fed.check.psis.moment_report` gives
    them, in user space and (with the ``" (unconstrained)"`` suffix) unconstrained."""
    size = obj.layouts[party].size
    zeros = jnp.zeros((size,))
    user = jax.eval_shape(lambda x: obj.constrain(party, x), zeros)
    flat = jax.eval_shape(obj.layouts[party].unravel, zeros)

    def names(shapes, suffix=""):
        out = []
        for k, s in shapes.items():
            n = int(np.prod(s.shape))
            out.extend([f"{k}{suffix}"] if n == 1 else [f"{k}{suffix}[{i}]" for i in range(n)])
        return out

    return names(user), names(flat, " (unconstrained)")


def _standardised(moments, biased) -> np.ndarray:
    """``(m, 3)``: mean gap, sd ratio and 1 where the scalar is off, per scalar."""
    off = {m.site for m in biased}
    return np.asarray([[m.mean_gap, m.sd_ratio, float(m.site in off)] for m in moments], np.float32).reshape(-1, 3)


def _rebuild(names: List[str], rows: np.ndarray) -> Tuple[Tuple[SiteMoments, ...], Tuple[SiteMoments, ...]]:
    """The standardised :class:`~numpyro_fed.check.psis.SiteMoments` (weighted mean 0 and sd 1)."""
    moments = tuple(SiteMoments(n, float(g), float(r), 0.0, 1.0) for n, (g, r, _) in zip(names, rows))
    return moments, tuple(m for m, row in zip(moments, rows) if row[2] > 0.5)


def value_inputs(cls: str, name: str) -> Dict[str, Any]:
    """The structure of what the server sends for the client-side value ``name``."""
    if name == "vertical_terms":
        return {"draws": jax.ShapeDtypeStruct((), jnp.int32)}
    if name == "vertical_moments":
        return {"weights": jax.ShapeDtypeStruct((CHECK_DRAWS,), jnp.float32),
                "ess": jax.ShapeDtypeStruct((), jnp.float32)}
    raise ValueError(f"{cls}: no client-side value {name!r}")

def _client_draws(party_draw: Callable, setup, party: str, client_state, rng_key, num_draws: int):
    cache = ("network_draw", party, num_draws)
    if cache not in setup.cache:
        draw = party_draw(setup, num_draws)
        setup.cache[cache] = jax.jit(lambda params, key: draw(party, params, key))
    return setup.cache[cache](client_state.inner.params, party_check_key(rng_key))

def client_value(party_draw: Callable, name: str, setup, client_state, data, payload, rng_key) -> Dict[str, Any]:
    """On client ``data.party`` after a network run: its part of the vertical fit check,
    from its own ``q``, rows and key (``rng_key``, never sent); ``party_draw`` is the family's
    ``(setup, num_draws) -> draw(party, params, key) -> (u, log_q, point)``."""
    obj: VerticalObjective = setup.extra.objective
    party = data.party
    u, log_q, point = _client_draws(party_draw, setup, party, client_state, rng_key, CHECK_DRAWS)
    if name == "vertical_terms":
        cache = ("network_terms", party)
        if cache not in setup.cache:
            def terms(u, point, own):
                return jax.lax.map(lambda v: obj.true_client_term(party, v, own, point), u, batch_size=CHECK_CHUNK)

            setup.cache[cache] = jax.jit(terms)
        lp, g = setup.cache[cache](u, point, data.args)
        return {"lp": jnp.asarray(lp - log_q, jnp.float32), "g": jnp.asarray(g, jnp.float32)}
    weights = np.asarray(payload["weights"], np.float64)
    weights = weights / weights.sum()
    ess = float(payload["ess"])
    user = {k: np.asarray(v) for k, v in jax.vmap(lambda x: obj.constrain(party, x))(u).items()}
    flat = {k: np.asarray(v) for k, v in jax.vmap(obj.layouts[party].unravel)(u).items()}
    moments, biased = moment_report(user, weights, ess) if user else ((), ())
    transformed = {f"{k} (unconstrained)": flat[k] for k in flat if not np.allclose(flat[k], user[k])}
    u_moments, u_biased = moment_report(transformed, weights, ess) if transformed else ((), ())
    names = {m.site for m in u_moments}
    _, all_u = _scalar_names(obj, party)
    rows = {m.site: row for m, row in zip(u_moments, _standardised(u_moments, u_biased))}
    # fixed shape on the wire: every unconstrained scalar, with a flag for the transformed ones
    unconstrained = np.asarray([[*rows[n], 1.0] if n in names else [0.0, 1.0, 0.0, 0.0] for n in all_u],
                               np.float32).reshape(-1, 4)
    return {"user": jnp.asarray(_standardised(moments, biased)), "unconstrained": jnp.asarray(unconstrained)}

def network_check(party_draw: Callable, network, setup, result) -> Tuple[Optional[FitDiagnostic], str, list]:
    """``(check, why, exchanges)``: the fit check computed with the parties over ``network``
    (``None`` with the reason when some party did not answer) and the ``(sent, got)``
    messages of each exchange."""
    obj: VerticalObjective = setup.extra.objective
    J, rnd, exchanges = len(obj.clients), int(result.communication.rounds), []
    c0 = obj.clients[0]
    g_shape = jax.eval_shape(lambda v: obj.true_client_term(c0, v, setup.plan.data[0].args)[1],
                             jnp.zeros((obj.layouts[c0].size,))).shape  # every g_j has the rows' shape

    def ask(name, payload, like):
        payloads = {j: payload for j in range(J)}
        got = network.client_values(name, payloads, like, result.transcript, rnd)
        exchanges.append((payloads, got))
        return got if len(got) == J else None

    got = ask("vertical_terms", {"draws": jnp.asarray(CHECK_DRAWS, jnp.int32)},
              {"lp": jax.ShapeDtypeStruct((CHECK_DRAWS,), jnp.float32),
               "g": jax.ShapeDtypeStruct((CHECK_DRAWS,) + g_shape, jnp.float32)})
    if got is None:
        return None, "some parties did not answer", exchanges
    params = result.state.server.inner.params
    draw = party_draw(setup, CHECK_DRAWS)
    u0, log_q0, point0 = draw(SERVER, params, random.PRNGKey(CHECK_KEY))
    view = obj.party_args(SERVER, setup.cache["data"], jnp.arange(obj.num_rows))
    g = {c: jnp.asarray(got[j]["g"]) for j, c in enumerate(obj.clients)}
    server = jax.jit(lambda u, g: jax.lax.map(lambda a: obj.true_server_term(a[0], a[1], view, point0), (u, g),
                                              batch_size=CHECK_CHUNK))(u0, g)
    log_w = np.asarray(server - log_q0, np.float64) + sum(np.asarray(got[j]["lp"], np.float64) for j in range(J))
    user = {k: np.asarray(v) for k, v in jax.vmap(lambda x: obj.constrain(SERVER, x))(u0).items()}
    per_site = {k: np.asarray(v) for k, v in jax.vmap(obj.layouts[SERVER].unravel)(u0).items()}
    check = fit_diagnostic(log_w, user or None, None, per_site or None)
    if not np.all(np.isfinite(check.log_weights)):
        return check, "", exchanges
    weights, _ = smoothed_weights(log_w)
    names = [_scalar_names(obj, c) for c in obj.clients]
    likes = {j: {"user": jax.ShapeDtypeStruct((len(user), 3), jnp.float32),
                 "unconstrained": jax.ShapeDtypeStruct((len(unc), 4), jnp.float32)}
             for j, (user, unc) in enumerate(names)}
    got = ask("vertical_moments", {"weights": jnp.asarray(weights, jnp.float32),
                                   "ess": jnp.asarray(check.ess, jnp.float32)}, likes)
    if got is None:
        return None, "some parties did not answer", exchanges
    moments, biased, u_moments = list(check.moments), list(check.biased), list(check.unconstrained_moments)
    for j, (user_names, u_names) in enumerate(names):
        m, b = _rebuild(user_names, np.asarray(got[j]["user"]))
        rows = np.asarray(got[j]["unconstrained"])
        keep = rows[:, 3] > 0.5
        um, ub = _rebuild([n for n, k in zip(u_names, keep) if k], rows[keep, :3])
        moments += m
        u_moments += um
        biased += b + ub
    return check._replace(moments=tuple(moments), biased=tuple(biased),
                          unconstrained_moments=tuple(u_moments)), "", exchanges

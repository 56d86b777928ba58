"""The fit check of the vertical families against the **true** model.

A vertical fit approximates the augmented (or power) posterior; the user wants the true
model's. The check draws ``S`` values of every party's sites from a Gaussian ``q`` (the
guide's own for :class:`~numpyro_fed.VerticalSVI`; for
:class:`~numpyro_fed.VerticalSOUL`, each party's Gaussian fitted to its own Langevin draws)
and computes ``log w = log p(theta, y) - log q(theta)`` of the **true** model (``z_j = g_j``,
no augmentation noise), split as in training:

- client j draws its ``theta_j`` with its own key and sends, per draw, its contribution
  ``g_j(x_j, theta_j)`` on every row and the scalar ``log p(theta_j) - log q(theta_j)``
  (``theta_j``, ``x_j`` and its key stay on the client; the ``g_j`` are what training sends as
  ``z_j``, without the noise);
- the server adds ``log p(y | sum_j g_j, theta_0) + log p(theta_0) - log q(theta_0)``.

Its traffic is ``S (n + 1)`` floats per client (with ``S = 1000``, about as much as 1000
full-batch iterations send). The weights give Pareto k and the moment check of
:mod:`numpyro_fed.check.psis` in user space, per site, so one check sees both the guide's
error and the augmentation's (a ``rho`` too large for the data). In a deployment the server
sends the ``S`` normalised weights back and each party compares its own sites' moments; the
simulation does it in one place.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..check.psis import FitDiagnostic, fit_diagnostic
from .objective import SERVER, VerticalObjective

__all__ = ["CHECK_DRAWS", "check_function", "constrain_draws", "gaussian_draws", "split_flat", "true_log_joint",
           "vertical_fit_check"]

CHECK_DRAWS = 1000
"""Draws of the vertical fit check (each client sends ``CHECK_DRAWS x (n + 1)`` floats)."""

CHECK_CHUNK = 50  # draws evaluated at once (memory: n x CHECK_CHUNK per party)


def gaussian_draws(rng_key, loc: jax.Array, scale_tril: jax.Array, num: int) -> Tuple[jax.Array, jax.Array]:
    """``num`` draws of ``N(loc, L L^T)`` and their log densities."""
    d = loc.shape[0]
    eps = random.normal(rng_key, (num, d))
    u = loc + eps @ scale_tril.T
    log_q = (-0.5 * jnp.sum(eps**2, -1) - 0.5 * d * jnp.log(2 * jnp.pi)
             - jnp.sum(jnp.log(jnp.abs(jnp.diagonal(scale_tril)))))
    return u, log_q


def true_log_joint(obj: VerticalObjective, points: Mapping[str, Mapping], views: Mapping[str, Mapping],
                   u: Mapping[str, jax.Array]) -> jax.Array:
    """``log p(theta, y)`` of the true model for every draw, summed from the parties' terms.

    ``points``: each party's ``numpyro.param`` values (unconstrained); ``views``: each party's
    data on all rows; ``u``: ``{party: (S, d_party)}`` unconstrained draws.
    """
    total, g = 0.0, {}
    for c in obj.clients:
        def client(v, c=c):
            return obj.true_client_term(c, v, views[c], points[c])

        lp, g[c] = jax.lax.map(client, u[c], batch_size=CHECK_CHUNK)
        total = total + lp

    def server(args):
        v, gg = args
        return obj.true_server_term(v, gg, views[SERVER], points[SERVER])

    return total + jax.lax.map(server, (u[SERVER], g), batch_size=CHECK_CHUNK)


def vertical_fit_check(obj: VerticalObjective, log_p: jax.Array, log_q: jax.Array,
                       u: Mapping[str, jax.Array]) -> FitDiagnostic:
    """The :class:`~numpyro_fed.check.psis.FitDiagnostic` of the draws ``u`` (``{party: (S, d)}``),
    with the user-space draws of every party's sites for the moment check and the
    unconstrained ones (server first, then the clients in order) for corrected draws."""
    parties = (SERVER,) + obj.clients
    user = {k: np.asarray(v) for k, v in constrain_draws(obj, u).items()}
    flat = np.concatenate([np.asarray(u[p]) for p in parties], axis=1)
    per_site = {}
    for p in parties:
        if obj.layouts[p].size:
            per_site.update({k: np.asarray(v) for k, v in jax.vmap(obj.layouts[p].unravel)(u[p]).items()})
    log_w = np.asarray(log_p, np.float64) - np.asarray(log_q, np.float64)
    return fit_diagnostic(log_w, user, flat, per_site)


def split_flat(obj: VerticalObjective, flat: jax.Array) -> Dict[str, jax.Array]:
    """Inverse of the concatenation in :func:`vertical_fit_check`: ``{party: (S, d_party)}``."""
    out, start = {}, 0
    for p in (SERVER,) + obj.clients:
        size = obj.layouts[p].size
        out[p] = flat[:, start:start + size]
        start += size
    return out


def constrain_draws(obj: VerticalObjective, u: Mapping[str, jax.Array]) -> Dict[str, jax.Array]:
    """User-space draws of every party's sites from ``{party: (S, d_party)}``."""
    out = {}
    for p in (SERVER,) + obj.clients:
        if obj.layouts[p].size:
            out.update(jax.vmap(lambda x, p=p: obj.constrain(p, x))(u[p]))
    return out


def check_function(obj: VerticalObjective, draw: Callable) -> Callable:
    """A jit-able ``(state, arrays, rng_key, own_keys) -> (log_p, log_q, u)`` (``own_keys``
    static); ``draw(state, arrays, rng_key, own_keys)`` gives ``u = {party: (S, d)}``,
    ``log_q`` (S,) and each party's ``points`` (``own_keys``: each client draws from its own
    key, as over a network backend, and ``rng_key`` is the server's)."""

    def fn(state, arrays, rng_key, own_keys=False):
        rows = jnp.arange(obj.num_rows)
        views = {p: obj.party_args(p, arrays, rows) for p in (SERVER,) + obj.clients}
        u, log_q, points = draw(state, arrays, rng_key, own_keys)
        return true_log_joint(obj, points, views, u), log_q, u

    return fn

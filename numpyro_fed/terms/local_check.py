"""The fit check of PVI and EP: ``log w = log p(u, y) - log q(u)`` at draws ``u ~ q`` of the
global sites, summed from every client's own term (see :mod:`numpyro_fed.check.psis`).

The server draws ``u`` from ``q`` and sends the draws; each client returns one scalar per
draw, ``log p(y_j | u)``, over its own rows: exact for models whose local sites are
discrete (summed out), and with continuous local latents the integrated Laplace
approximation of ``log ∫ p(y_j, v | u) dv``, warm-started at the conditional mode at
``q``'s mean. That is exact when ``v | u`` is Gaussian (a Gaussian hierarchical model,
centred or not), which :func:`locals_are_gaussian` checks on each client. Where the local
latents form blocks of at most three coordinates (proposed from the layout, verified by
each client on its own rows), each block is integrated by adaptive Gauss-Hermite
quadrature (``index`` of :func:`client_log_likelihoods`), for any fitting algorithm.
Otherwise the client corrects it by importance sampling with the Laplace Gaussian as proposal
(:data:`LOCAL_DRAWS` draws per global draw), after checking on its own rows that this
proposal is good enough (:func:`local_integral_k`: Pareto k of the weights at ``q``'s mean
at most 0.7). Where it is not (the demo's logistic GLMM, 300 random intercepts of four
binary rows each in one dense proposal), the check of ``q`` is not run: the plain Laplace
term there flagged a right EP fit (beta0 1.1 weighted sds off for a fit within 0.04 NUTS
sds). The server adds the prior factor (read off the
model, exact up to a constant for the Gaussian priors these families take) and ``-log q(u)``.
Pure and jit-compatible.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax import random

from . import gaussian as G
from .blocks import quadrature_correction
from .gaussian import NaturalGaussian
from .tilted import conditional_slope, first_descent, inner_mode, integrated_laplace, pareto_k

__all__ = ["client_check_keys", "client_log_likelihoods", "local_integral_checks", "local_integral_k",
           "local_note", "locals_are_gaussian", "log_weight_estimator"]

INNER_STEPS = 30  # Newton steps to the conditional mode at q's mean (the warm start)
# Newton steps per draw from the first-order prediction of its mode (one: exact for a Gaussian v | u);
# beyond two, the check's log weights move by under 1e-3 in all (the six-cities GLMM, four silos: 4e-4;
# a random intercept on each of 1,000 clients: 2e-3), far inside its Monte Carlo error
WARM_STEPS = 2
GAUSSIAN_TOL = 1e-4  # relative change of the local Hessian between two points of a Gaussian v | u
LOCAL_DRAWS = 64  # importance draws of the local latents per global draw (non-Gaussian v | u)
PROPOSAL_DRAWS = 1000  # draws of the client's check of its Laplace proposal at q's mean
IS_BATCH = 25  # global draws whose local importance draws are evaluated at once


def laplace_proposal(log_joint, num_global, num_local, u, data, v0, steps):
    """The conditional mode ``v*(u)`` and the Cholesky factor of ``-H_vv`` there."""
    neg = lambda v: -log_joint(jnp.concatenate([u, v]), data)  # noqa: E731
    v = inner_mode(neg, v0, steps, search=first_descent)
    h = jax.hessian(neg)(v)
    return v, jnp.linalg.cholesky((h + h.T) / 2)


def _importance_log_lik(log_joint, u, data, v, chol, eps):
    """``log mean_m p(y, v_m | u) / N(v_m; v*, H^-1)`` with ``v_m = v* + L^-T eps_m``, and the log weights."""
    draws = v + jax.scipy.linalg.solve_triangular(chol.T, eps.T, lower=False).T
    log_q = (jnp.sum(jnp.log(jnp.diag(chol))) - 0.5 * jnp.sum(eps**2, 1)
             - 0.5 * v.shape[0] * jnp.log(2 * jnp.pi))
    log_w = jax.vmap(lambda x: log_joint(jnp.concatenate([u, x]), data))(draws) - log_q
    return jax.scipy.special.logsumexp(log_w) - jnp.log(eps.shape[0]), log_w


def local_integral_k(log_joint: Callable, num_global: int, num_local: int, mean, data, rng_key):
    """The client's check that its Laplace proposal holds ``p(v | u, y_j)`` at ``u = mean``:
    the Pareto k of :data:`PROPOSAL_DRAWS` importance weights (at most 0.7: the importance-
    sampled ``log p(y_j | u)`` of the fit check can be trusted)."""
    v, chol = laplace_proposal(log_joint, num_global, num_local, mean, data, jnp.zeros(num_local, mean.dtype),
                                INNER_STEPS)
    eps = random.normal(rng_key, (PROPOSAL_DRAWS, num_local), mean.dtype)
    return pareto_k(_importance_log_lik(log_joint, mean, data, v, chol, eps)[1])


def locals_are_gaussian(log_joint: Callable, num_global: int, num_local: int, mean, data, rng_key):
    """Whether ``v -> log p(y_j, v | u)`` is quadratic at ``u = mean`` (the client's own
    check on its own rows): its Hessian at 0 and at a random point agree."""
    if not num_local:
        return jnp.asarray(True)
    change = G.hessian_change(lambda v: log_joint(jnp.concatenate([mean, v]), data), num_local, rng_key)
    return change <= GAUSSIAN_TOL


def client_log_likelihoods(log_joint: Callable, num_global: int, num_local: int, mean, u, data, rng_key=None,
                           index=None):
    """One client's ``log p(y_j | u)`` at each row of ``u`` (``(S, d)``): its own term.
    Integrated Laplace (exact for a Gaussian ``v | u``), or with ``rng_key`` importance
    sampling with the Laplace proposal (:data:`LOCAL_DRAWS` draws per row of ``u``, from
    the client's own key), or with ``index`` (the local latents' blocks,
    :mod:`~numpyro_fed.terms.blocks`) block Laplace with adaptive Gauss-Hermite quadrature
    per block (:func:`~numpyro_fed.terms.blocks.quadrature_correction`): deterministic, and
    linear in the number of local latents."""
    own = partial(log_joint, data=data)
    marginal = integrated_laplace(own, num_global, num_local, index, first_descent)
    if not num_local:
        return jax.vmap(lambda x: marginal(x, jnp.zeros(0, u.dtype), WARM_STEPS)[0])(u)
    v0 = marginal(mean, jnp.zeros(num_local, u.dtype), INNER_STEPS)[1][1]
    slope = conditional_slope(own, mean, v0, index)

    def start(x):  # the conditional mode's first-order prediction at x
        return v0 + slope @ (x - mean)

    if index is not None:
        def quadrature(x):
            value, (_, v) = marginal(x, start(x), WARM_STEPS)
            return value + quadrature_correction(lambda z: log_joint(jnp.concatenate([x, z]), data), v, index)

        return jax.lax.map(quadrature, u, batch_size=min(u.shape[0], 100))
    if rng_key is None:
        return jax.vmap(lambda x: marginal(x, start(x), WARM_STEPS)[0])(u)

    def one(args):
        x, key = args
        v, chol = laplace_proposal(log_joint, num_global, num_local, x, data, start(x), WARM_STEPS)
        eps = random.normal(key, (LOCAL_DRAWS, num_local), x.dtype)
        return _importance_log_lik(log_joint, x, data, v, chol, eps)[0]

    # in batches: every global draw's LOCAL_DRAWS evaluations at once (times the clients under
    # vmap) was an array of gigabytes, whose copies took most of the check's time
    return jax.lax.map(one, (u, random.split(rng_key, u.shape[0])), batch_size=min(u.shape[0], IS_BATCH))


def log_weight_estimator(log_prior: Callable, log_joint: Callable, num_local: int, mapping: str,
                         num_draws: int, sampled: bool = False, index=None) -> Callable:
    """``(q, data, rng_key, client_keys) -> (log_w, u)``: the check's ``num_draws`` draws
    ``u ~ q`` and their ``log p(u, y) - log q(u)`` (up to a constant), every client's term
    summed; ``sampled``: the clients integrate their local latents by importance sampling,
    each from its own key in ``client_keys``; ``index``: by block quadrature instead.
    ``log_prior`` is the model's own prior of the
    global sites (not the Gaussian factor the fit uses), so the check's target is the
    model's posterior even where the fit approximates the prior."""

    def estimate(q: NaturalGaussian, data, rng_key, client_keys):
        d = q.shift.shape[0]
        u = jax.vmap(lambda e: G.sample(q, e))(random.normal(rng_key, (num_draws, d)))
        mean, _ = G.to_moments(q)

        def term(x, key):
            return client_log_likelihoods(log_joint, d, num_local, mean, u, x, key if sampled else None, index)

        if mapping == "vmap":
            values = jnp.sum(jax.vmap(term)(data, client_keys), axis=0)
        else:
            values = sum(term(x, k) for x, k in zip(data, client_keys))
        server = jax.vmap(lambda x: log_prior(x) - G.log_prob(q, x))(u)
        return server + values, u

    return estimate


def client_check_keys(plan, state):
    """Each client's key for the check, from its own key (the server never holds it)."""
    if plan.mapping == "vmap":
        return jax.vmap(lambda k: random.fold_in(k, 0x51))(state.clients.rng_key)
    return [random.fold_in(slot.rng_key, 0x51) for slot in state.clients]


def local_integral_checks(setup):
    """The clients' checks of whether their local latents are Gaussian given ``u`` and of their
    Laplace proposal's Pareto k, ``(mean, data, key)``, compiled once per set-up (``q``'s mean
    is an argument, not a constant, so a new ``q`` reuses them)."""
    if ("local_integral",) not in setup.cache:
        terms, vmapped = setup.extra.terms, setup.plan.mapping == "vmap"
        d, n = terms.prior.shift.shape[0], terms.num_local
        gaussian = partial(locals_are_gaussian, terms.log_joint, d, n)  # (mean, data, key)
        k_of = partial(local_integral_k, terms.log_joint, d, n)
        setup.cache[("local_integral",)] = (
            jax.jit(jax.vmap(gaussian, in_axes=(None, 0, None)) if vmapped else gaussian),
            jax.jit(jax.vmap(k_of, in_axes=(None, 0, 0)) if vmapped else k_of))
    return setup.cache[("local_integral",)]


def local_note(setup) -> str:
    """What the fit check's warning says of how the clients integrated their local latents."""
    if not setup.extra.terms.num_local:
        return ""
    if setup.cache.get(("blocks_hold",), False):
        return (" (local latents integrated out on each client, block by block, by Laplace with adaptive "
                "Gauss-Hermite quadrature)")
    return (" (local latents integrated out on each client, by Laplace with importance sampling where they are "
            "not Gaussian given the global sites)")

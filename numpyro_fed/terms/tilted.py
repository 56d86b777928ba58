"""Gaussian moments of a client's tilted distribution (EP's local step; PVI with local sites).

A client's tilted distribution over ``w = [u, v]`` (``u``: the ``d`` flat unconstrained
global sites, first; ``v``: its own local latent sites) is

.. math::

    \\tilde p(u, v) \\propto \\mathrm{cavity}(u)\\, p(y_j, v \\mid u),

and EP needs the mean and covariance of its ``u``-marginal, i.e. with the local latents
integrated out (Yue et al. (2022) eq. 4 with ``f_k(phi) = ∫ p(Y_k | theta_k, phi) p(theta_k | phi)
d theta_k``). Three estimators, chosen per run:

- :func:`laplace_moments`: the mode of ``log p~`` (L-BFGS) and the inverse negative
  Hessian there, marginalised to ``u``;
- :func:`nuts_moments`: sample moments of NumPyro NUTS draws of ``p~``;
- :func:`gaussian_vi_moments`: the Gaussian ``q(u, v)`` closest to ``p~`` in
  ``KL(q || p~)``, fitted by optax on a reparameterised ELBO whose cavity term and
  entropy are exact; its ``u``-marginal. This is PVI's local step with local latents.

``log_lik(w)`` is ``log p(y_j, v | u)`` with the Jacobians of the unconstrained local sites;
the cavity enters in natural parameters. All functions are pure, jit- and vmap-compatible.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from numpyro.infer.hmc import hmc

from .._typing import Array
from ..check.psis import PARETO_K_LIMIT  # Vehtari et al. (2024): above it the fit is unreliable
from ..run.steps import carried_while
from . import gaussian as G
from .blocks import block_hessian, block_logdet, block_solve, quadrature_correction, scatter_blocks
from .gaussian import NaturalGaussian

__all__ = [
    "FitCheck",
    "TiltedProblem",
    "backtrack",
    "first_descent",
    "integrated_derivatives",
    "integrated_value",
    "newton_direction",
    "conditional_slope",
    "cavity_log_density",
    "gaussian_pareto_k",
    "integrated_laplace",
    "objective_drift",
    "pareto_k",
    "gaussian_vi_moments",
    "laplace_moments",
    "moments_to_factor",
    "nuts_draws",
    "nuts_moments",
]

TILTED_METHODS = ("laplace", "nuts", "vi")


def cavity_log_density(cavity: NaturalGaussian, u: Array) -> Array:
    """``h^T u - u^T L u / 2`` (unnormalised)."""
    quad = jnp.sum(cavity.precision * u**2) if cavity.diagonal else u @ cavity.precision @ u
    return cavity.shift @ u - 0.5 * quad


def _tilted(log_lik: Callable, cavity: NaturalGaussian, d: int) -> Callable:
    return lambda w: log_lik(w) + cavity_log_density(cavity, w[:d])


def _marginal(mean: Array, cov: Array, d: int) -> Tuple[Array, Array]:
    return mean[:d], jnp.diag(cov[:d]) if cov.ndim == 1 else cov[:d, :d]  # cov: a matrix, or the variances


class FitCheck(NamedTuple):
    """A client's own check of its local fit, sent beside the update.

    ``ok`` is False when the fit should not be trusted. ``stat``: the share of divergent
    NUTS transitions (``tilted="nuts"``), how far the local objective and parameters still
    moved over the last quarter of the steps, in units of their limits
    (:func:`convergence_stat`; ``"vi"``, PVI's optax update), or how far the importance
    draws' missed inner modes could move their weights, over :data:`DRAW_TV` (``"laplace"``,
    see :func:`laplace_moments`); ``pareto_k``:
    the Pareto ``k`` of the fitted Gaussian's importance weights against the tilted
    distribution (``"laplace"``; ``"vi"`` and PVI with local latents). NaN where a check does
    not apply."""

    ok: Array
    stat: Array
    pareto_k: Array


DRAW_STEPS = 2  # Newton steps to each importance draw's inner mode, from its first-order prediction
DRAW_TV = 0.01  # how far (total variation) the draws' missed inner modes may move the importance weights
DRIFT_LIMIT = 4.0  # local objective still improving by more than this many standard errors
PARAMETER_DRIFT_LIMIT = 0.05  # a local fit's mean or sd still moving by more than this many sds per quarter


def parameter_drift(locs: Array, sds: Array) -> Array:
    """How far a local fit's parameters still moved between the last two quarters of its
    iterates (``(steps, n)`` means and sds), in units of its limit: per coordinate, the
    change of the quarters' average mean over ``PARAMETER_DRIFT_LIMIT`` sds, and of their
    average log sd over ``PARAMETER_DRIFT_LIMIT``, each limit raised to ``DRIFT_LIMIT``
    standard errors of the quarter averages (by batch means) when the optimiser's noise is larger; the
    largest. Above 1: still moving. The loss can look flat while Adam still moves a scale
    slowly; this judges the parameters."""
    n = locs.shape[0] // 4
    batches = max(min(n // 5, 10), 1)  # batch means: the iterates are autocorrelated (momentum)
    size = max(n // batches, 1)

    def se_of_mean(x):
        means = jnp.mean(x[-batches * size:].reshape((batches, size) + x.shape[1:]), 1)
        return jnp.sqrt(jnp.var(means, 0) / max(batches - 1, 1))

    def stat(x, unit):
        a, b = x[-2 * n:-n], x[-n:]
        se = jnp.sqrt(se_of_mean(a) ** 2 + se_of_mean(b) ** 2)
        return jnp.abs(jnp.mean(a, 0) - jnp.mean(b, 0)) / jnp.maximum(PARAMETER_DRIFT_LIMIT * unit, DRIFT_LIMIT * se)

    unit = jnp.mean(sds[-n:], 0)
    return jnp.maximum(jnp.max(stat(locs, unit)), jnp.max(stat(jnp.log(sds), jnp.ones_like(unit))))


def convergence_stat(values: Array, locs: Array, sds: Array) -> Array:
    """The local fit's convergence statistic in units of its limits: the larger of the
    objective's drift over :data:`DRIFT_LIMIT` and :func:`parameter_drift`. Above 1: not
    converged."""
    return jnp.maximum(objective_drift(values) / DRIFT_LIMIT, parameter_drift(locs, sds))


def pareto_k(log_weights: Array) -> Array:
    """The Pareto ``k`` of PSIS (Vehtari et al., 2024) for one vector of log weights.

    The generalized Pareto fit of Zhang & Stephens (2009) to the largest
    ``min(S/5, 3 sqrt(S))`` weights, with ArviZ's weakly informative prior on ``k``;
    jit-compatible (static sizes). Non-finite log weights give ``inf``; weights equal to
    rounding (no tail) give 0."""
    s = log_weights.shape[0]
    m = int(min(s / 5, 3 * s**0.5))
    x = jnp.sort(log_weights - jnp.max(log_weights))
    tail = jnp.exp(x[-m:]) - jnp.exp(x[-m - 1])  # ascending exceedances over the cutoff
    m_est = 30 + int(m**0.5)
    b = 1 - jnp.sqrt(m_est / (jnp.arange(1, m_est + 1) - 0.5))
    b = b / (3 * tail[int(m / 4 + 0.5) - 1]) + 1 / tail[-1]
    k = jnp.mean(jnp.log1p(-b[:, None] * tail), axis=1)
    len_scale = m * (jnp.log(-(b / k)) - k - 1)
    weights = 1 / jnp.sum(jnp.exp(len_scale - len_scale[:, None]), axis=1)
    weights = jnp.where(weights >= 10 * jnp.finfo(weights.dtype).eps, weights, 0.0)
    b_post = jnp.sum(b * weights) / jnp.sum(weights)
    k_post = jnp.mean(jnp.log1p(-b_post * tail))
    k_post = (m * k_post + 10 * 0.5) / (m + 10)
    # weights equal to rounding (an exactly Gaussian target in float32): the exceedances tie
    # at 0, the fit is 0/0; such weights have no tail at all
    flat = tail[int(m / 4 + 0.5) - 1] <= 0
    return jnp.where(jnp.all(jnp.isfinite(log_weights)), jnp.where(flat, 0.0, k_post), jnp.inf)


def newton_direction(h: Array, g: Array) -> Array:
    """``|H|^-1 g`` with ``|H|`` the Hessian with its eigenvalues replaced by their absolute
    values (floored): Newton's step where ``H`` is positive definite, a descent direction
    everywhere else (saddle-free Newton, Dauphin et al., 2014)."""
    lam, vec = jnp.linalg.eigh((h + h.T) / 2)
    lam = jnp.maximum(jnp.abs(lam), 1e-6 * jnp.max(jnp.abs(lam)) + 1e-12)
    step = vec @ ((vec.T @ g) / lam)
    return jnp.where(jnp.all(jnp.isfinite(step)), step, g)


_STEPS = np.concatenate([2.0 ** -np.arange(10), np.zeros(1)])  # backtracking: 1, 1/2, ..., 1/512, no move


def backtrack(neg: Callable, v: Array, dv: Array) -> Array:
    """The longest of the steps ``v - t dv`` that does not raise ``neg`` (to a relative
    1e-6, so that rounding never decides between steps near the optimum), else no move."""
    cands = v - _STEPS.astype(v.dtype)[:, None] * dv
    vals = jax.vmap(neg)(cands)
    vals = jnp.where(jnp.isfinite(vals), vals, jnp.inf)
    ok = vals <= vals[-1] + 1e-6 * (1 + jnp.abs(vals[-1]))
    return cands[jnp.argmax(ok)]  # the first acceptable (the last, no move, always is)


def _direction(neg: Callable, v: Array, index: Optional[Array]) -> Array:
    """The saddle-free Newton direction of ``neg`` at ``v``: dense, or block by block."""
    g = jax.grad(neg)(v)
    if index is None:
        return newton_direction(jax.hessian(neg)(v), g)
    steps = jax.vmap(newton_direction)(block_hessian(neg, v, index), g[index])
    return scatter_blocks(steps, index, v.shape[0])


def first_descent(neg: Callable, v: Array, dv: Array) -> Array:
    """:func:`backtrack`'s choice, its steps tried in order (``1, 1/2, ...``) until one does not raise
    ``neg``: the halvings needed (usually none), not eleven evaluations. Forward mode only."""
    f0 = jnp.where(jnp.isfinite(f0 := neg(v)), f0, jnp.inf)
    limit = f0 + 1e-6 * (1 + jnp.abs(f0))

    def worse(k):
        val = neg(v - jnp.asarray(_STEPS, v.dtype)[k] * dv)
        return ~(jnp.where(jnp.isfinite(val), val, jnp.inf) <= limit)

    k = carried_while(lambda k: (k < _STEPS.shape[0] - 1) & worse(k), lambda k: k + 1, jnp.zeros((), jnp.int32))
    return v - jnp.asarray(_STEPS, v.dtype)[k] * dv


def inner_mode(neg: Callable, v0: Array, steps: int, index: Optional[Array] = None,
               search: Optional[Callable] = None) -> Array:
    """Minimise ``neg(v)`` by (saddle-free) Newton with backtracking, ``steps`` iterations
    from ``v0``; with ``index`` (:func:`~numpyro_fed.terms.blocks.local_blocks`) the Hessian
    is block diagonal and each step costs ``K`` small factorisations. ``search``: the line
    search (default :func:`backtrack`; :func:`first_descent` picks the same step sequentially)."""
    search = backtrack if search is None else search

    def body(v, _):
        return search(neg, v, _direction(neg, v, index)), None

    return jax.lax.scan(body, v0, None, length=steps)[0]


def conditional_slope(f: Callable, u: Array, v: Array, index: Optional[Array] = None) -> Array:
    """``dv*/du = -H_vv^-1 H_vu`` at ``(u, v)`` (``v`` the conditional mode of ``f([u, v])``
    over ``v``): how the local latents' conditional mode moves with the global sites (implicit
    function theorem), ``(n, d)``; by blocks with ``index``. ``v*(u') ~ v + slope (u' - u)``
    starts a Newton search at ``u'`` within a step or two of its mode."""
    h_vu = jax.jacfwd(jax.grad(lambda a, b: f(jnp.concatenate([a, b])), argnums=1), argnums=0)(u, v)
    if index is None:
        h_vv = jax.hessian(lambda b: f(jnp.concatenate([u, b])))(v)
        return -jnp.linalg.solve((h_vv + h_vv.T) / 2, h_vu)
    return -block_solve(block_hessian(lambda b: f(jnp.concatenate([u, b])), v, index), h_vu, index)


def integrated_laplace(f: Callable, d: int, num_local: int, index: Optional[Array] = None,
                       search: Optional[Callable] = None) -> Callable:
    """The Laplace approximation of ``log ∫ exp f(u, v) dv`` (Tierney & Kadane, 1986; INLA's inner
    step): ``f(u, v*) - log det(-H_vv(u, v*)) / 2 + const``, ``v*(u)`` the conditional mode. Exact
    when ``v | u`` is Gaussian (a Gaussian hierarchical model, centred or not): no funnel of ``(u, v)``.

    Returns ``log_marginal(u, v0, steps, refine=0, volume_only=False) -> (value, (decrement,
    v*))``. ``v*`` is found by damped Newton from ``v0`` (``steps`` iterations, no gradient
    through them, each with the line search ``search``, :func:`inner_mode`), then refined by
    ``refine`` plain Newton steps with gradient: ``refine=1`` makes the first derivative of
    ``v*(u)``, and so the gradient of the value, exact at a converged mode. ``decrement``: the
    inner Newton decrement at the final point (about 0 at the inner mode). ``volume_only``: the
    value is ``-log det(-H_vv) / 2 + const`` alone. ``index``: ``H_vv`` is block diagonal in these
    blocks (:mod:`~numpyro_fed.terms.blocks`): cost linear in ``num_local``."""
    if num_local == 0:
        return lambda u, v0, steps, refine=0, volume_only=False: (
            jnp.zeros((), u.dtype) if volume_only else f(u), (jnp.zeros((), u.dtype), v0))

    def neg_v(u):
        return lambda v: -f(jnp.concatenate([u, v]))

    def hessian(neg, v):
        if index is None:
            h = jax.hessian(neg)(v)
            return (h + h.T) / 2
        return block_hessian(neg, v, index)

    def solve(h, rhs):
        return jnp.linalg.solve(h, rhs) if index is None else block_solve(h, rhs, index)

    def log_marginal(u, v0, steps, refine=0, volume_only=False):
        v = jax.lax.stop_gradient(inner_mode(neg_v(jax.lax.stop_gradient(u)), v0, steps, index, search))
        neg = neg_v(u)
        for _ in range(refine):
            v = v - solve(hessian(neg, v), jax.grad(neg)(v))
        g, h = jax.grad(neg)(v), hessian(neg, v)
        sign, logdet = jnp.linalg.slogdet(h) if index is None else block_logdet(h)
        value = 0.5 * num_local * jnp.log(2 * jnp.pi) - 0.5 * logdet + (0.0 if volume_only else -neg(v))
        decrement = jnp.sqrt(jnp.abs(g @ solve(h, jax.lax.stop_gradient(g))))
        aux = (jax.lax.stop_gradient(decrement), jax.lax.stop_gradient(v))
        return jnp.where(sign > 0, value, -jnp.inf), aux

    return log_marginal


def laplace_moments(log_lik: Callable, cavity: NaturalGaussian, w0: Array, d: int, rng_key: Array = None, *,
                    steps: int = 30, grad_tol: float = 1e-2, inner_steps: int = 8,
                    num_draws: int = 1000, index: Optional[Array] = None,
                    importance: bool = True) -> Tuple[Array, Array, FitCheck]:
    """Laplace approximation of the tilted distribution's ``u``-marginal, with its check.

    The local latents ``v`` are integrated out first by the inner Laplace approximation of
    :func:`integrated_laplace` (exact for Gaussian ``v | u``); the outer mode over ``u`` is
    found by at most ``steps`` Newton iterations with backtracking from ``w0[:d]`` (the
    inner mode warm-started from the last one, ``inner_steps`` Newton iterations each) and
    the covariance is the inverse negative Hessian there. (A joint mode over ``(u, v)`` is
    wrong on hierarchical models: on eight schools it sits in the funnel's neck,
    ``tau -> 0``.)

    The result is NaN (an invalid update) unless a mode was reached: the outer and inner
    Newton decrements ``sqrt(g^T H^-1 g)`` (in standard deviations) below ``grad_tol``.

    The check and the correction: ``num_draws`` draws from the Gaussian (whitened to its
    exact moments), importance-weighted against the integrated tilted density, with the local
    latents' blocks (``index``) integrated by adaptive Gauss-Hermite quadrature
    (:func:`~numpyro_fed.terms.blocks.quadrature_correction`) rather than Laplace alone. With
    ``importance`` (the default) the weighted mean and covariance are returned: Laplace is
    biased where the local latents' conditional is skewed (random intercepts of a few binary
    rows: on the six-cities GLMM, beta0 1.2 NUTS sds off; corrected, 0.1). The Pareto ``k``
    of the weights above :data:`PARETO_K_LIMIT` means the Gaussian misses the tilted mass
    (skew, a boundary, heavy tails): the Laplace moments are returned with
    ``FitCheck(ok=False, pareto_k=k)``. Each draw's inner mode starts from its first-order
    prediction ``v* + dv*/du (u - mode)`` (implicit function theorem) and takes
    :data:`DRAW_STEPS` Newton steps; a draw whose inner mode was missed by Newton decrement
    ``e`` has a log weight about ``e^2 / 2`` too low, and ``FitCheck.stat`` is the total
    variation between the weights and the weights with every such draw that much heavier, over
    :data:`DRAW_TV` (above 1: the check fails).
    """
    rng_key = random.PRNGKey(0) if rng_key is None else rng_key
    num_local = w0.shape[0] - d

    def tilted(w):
        return log_lik(w) + cavity_log_density(cavity, w[:d])

    log_marginal = integrated_laplace(tilted, d, num_local, index)
    problem = TiltedProblem(tilted, log_marginal, d, num_local, index, inner_steps)
    mode, v_mode, g, h, dec, slope = _outer_mode(problem, w0, steps, grad_tol)
    cov = jnp.linalg.inv(-h)
    cov = (cov + cov.T) / 2
    # a mode not reached is no Laplace approximation: NaN, which the protocol sends as an
    # invalid (zero) update
    reached = _converged(g, h, dec, grad_tol) & jnp.all(jnp.linalg.eigvalsh(cov) > 0)
    return _sampled_check(problem, rng_key, mode, cov, v_mode, slope, reached, num_draws, importance, w0.dtype)


class TiltedProblem(NamedTuple):
    """The tilted density of :func:`laplace_moments` and how its local latents are integrated."""

    tilted: Callable  # log tilted density of the flat (u, v)
    log_marginal: Callable  # integrated_laplace(tilted, ...)
    d: int
    num_local: int
    index: Optional[Array]
    inner_steps: int


def integrated_value(problem: TiltedProblem, u, v):
    return problem.log_marginal(u, v, problem.inner_steps)[0]


def _joint_terms(problem: TiltedProblem, u, v_star):
    """``f_u``, ``H_uu``, ``H_vu`` and ``H_vv^-1 [H_vu, f_v]`` at ``(u, v*)`` (dense, or by
    blocks: ``b`` Hessian-vector products and ``K`` small solves)."""
    f_uv = lambda a, b: problem.tilted(jnp.concatenate([a, b]))  # noqa: E731
    g_u, g_v = jax.grad(f_uv, argnums=(0, 1))(u, v_star)
    h_uu = jax.hessian(f_uv, argnums=0)(u, v_star)
    h_vu = jax.jacfwd(jax.grad(f_uv, argnums=1), argnums=0)(u, v_star)  # (n, d): d forward passes
    rhs = jnp.concatenate([h_vu, g_v[:, None]], 1)
    if problem.index is None:
        h_vv = jax.hessian(f_uv, argnums=1)(u, v_star)
        solve = jnp.linalg.solve((h_vv + h_vv.T) / 2, rhs)
    else:  # block diagonal
        solve = block_solve(block_hessian(lambda b: f_uv(u, b), v_star, problem.index), rhs, problem.index)
    return g_u, h_uu, h_vu, solve


def integrated_derivatives(problem: TiltedProblem, u, v):
    """Gradient, Hessian, inner decrement and mode of the integrated log density at ``u``,
    and the inner mode's slope ``dv*/du`` there (:func:`conditional_slope`).

    Its two terms are differentiated apart. ``f(u, v*(u))``: the gradient is ``f_u`` and
    the Hessian the Schur complement ``H_uu - H_uv H_vv^-1 H_vu`` (implicit function
    theorem), exact from second derivatives of the model. The volume term
    ``-log det(-H_vv(u, v*(u))) / 2``: exact gradient (one refining Newton step makes
    ``v*``'s derivative exact), Hessian by central differences of it (one batch of
    ``2d + 1``; an exact one would differentiate the model to fourth order and take
    minutes to compile). The differences see only the volume term, which is constant in
    ``u`` for Gaussian ``v | u``, so there the Hessian is exact to rounding."""
    d = problem.d
    if problem.num_local == 0:  # no inner problem: the exact Hessian is cheap
        g, h = jax.grad(partial(integrated_value, problem))(u, v), jax.hessian(partial(integrated_value, problem))(u, v)
        return g, (h + h.T) / 2, jnp.zeros((), u.dtype), v, jnp.zeros((0, d), u.dtype)
    h = 1e-3 * (1.0 + jnp.abs(u))
    points = jnp.concatenate([u[None], u + jnp.diag(h), u - jnp.diag(h)])
    vol = jax.grad(lambda x: problem.log_marginal(x, v, problem.inner_steps, 1, volume_only=True), has_aux=True)
    grads, (decs, vs) = jax.vmap(vol)(points)
    vol_hess = (grads[1:d + 1] - grads[d + 1:]) / (2 * h[:, None])
    g_u, h_uu, h_vu, solve = _joint_terms(problem, u, vs[0])
    # at the inner mode g_v = 0; the correction keeps the gradient first-order right
    # near it (it is the gradient after one more Newton step in v)
    grad = g_u - h_vu.T @ solve[:, d] + grads[0]
    hess = (h_uu + h_uu.T) / 2 - h_vu.T @ solve[:, :d] + (vol_hess + vol_hess.T) / 2
    # -solve[:, :d] is dv*/du at (u, v*), conditional_slope's value: the draws' warm start
    return grad, (hess + hess.T) / 2, decs[0], vs[0], -solve[:, :d]


def _converged(g, h, dec, tol):
    newton = jnp.sqrt(jnp.abs(g @ jnp.linalg.solve(-h, g)))
    return (newton < tol) & (dec < tol)


def _outer_mode(problem: TiltedProblem, w0, steps: int, grad_tol: float):
    """Newton ascent with backtracking on the integrated density from ``w0[:d]``, to 1/100 of
    ``grad_tol`` (quadratic convergence) or until stuck; ``(mode, v_mode, g, h, dec, slope)``."""
    d, num_local = problem.d, problem.num_local

    def cond(carry):
        i, _, _, g, h, dec, _, moved = carry
        return (i == 0) | ((i <= steps) & moved & ~_converged(g, h, dec, grad_tol / 100))

    def body(carry):  # Newton ascent with backtracking, then measure at the new point
        i, u, v, g, h, dec, _, _ = carry
        new = backtrack(lambda x: -integrated_value(problem, x, v), u, -newton_direction(-h, g))
        moved = (i == 0) | jnp.any(new != u)
        u = jnp.where(i == 0, u, new)
        g, h, dec, v, slope = integrated_derivatives(problem, u, v)
        return i + 1, u, v, g, h, dec, slope, moved

    zero = jnp.zeros((), w0.dtype)
    start = (jnp.zeros((), jnp.int32), w0[:d], w0[d:], jnp.zeros(d, w0.dtype), -jnp.eye(d, dtype=w0.dtype), zero,
             jnp.zeros((num_local, d), w0.dtype), jnp.asarray(True))
    _, mode, v_mode, g, h, dec, slope, _ = carried_while(cond, body, start)
    return mode, v_mode, g, h, dec, slope


def _sampled_check(problem: TiltedProblem, rng_key, mode, cov, v_mode, slope, reached, num_draws: int,
                   importance: bool, dtype):
    """The sampled check (does the Gaussian hold the tilted mass?) and the importance
    correction of :func:`laplace_moments`: ``(mean, cov, FitCheck)``."""
    d, index, num_local, tilted = problem.d, problem.index, problem.num_local, problem.tilted

    def corrected(u, v):
        """The integrated tilted density with the blocks' quadrature correction (Laplace
        alone without blocks or with blocks of more than three coordinates, or without
        ``importance``), and the inner Newton decrement where its inner mode was taken."""
        laplace, (dec, v_star) = problem.log_marginal(u, v, DRAW_STEPS)
        if not importance or index is None or num_local == 0:
            return laplace, dec
        return laplace + quadrature_correction(lambda x: tilted(jnp.concatenate([u, x])), v_star, index), dec

    chol = jnp.linalg.cholesky(cov)
    eps = _matched_normal(rng_key, num_draws, d, dtype)
    draws = mode + eps @ chol.T
    # each draw's inner mode starts from its first-order prediction v*(mode) + dv*/du (u - mode),
    # dv*/du = -H_vv^-1 H_vu (implicit function theorem, from the last Newton iterate's
    # derivatives), so a few Newton steps reach it

    def start(u):
        return v_mode + slope @ (u - mode)

    log_target, decrements = jax.lax.map(lambda u: corrected(u, start(u)), draws, batch_size=min(num_draws, 100))
    log_w = log_target + 0.5 * jnp.sum(eps**2, 1)
    k = jnp.where(reached, pareto_k(log_w), jnp.nan)
    finite = jnp.isfinite(log_w)
    log_w = jnp.where(finite, log_w, -jnp.inf)
    w = jax.nn.softmax(log_w)
    # a draw whose inner mode was missed by Newton decrement e has a log weight about e^2 / 2 too
    # low: how far could the weights move were every such draw that much heavier?
    heavier = jax.nn.softmax(log_w + jnp.minimum(jnp.where(finite, decrements, 0.0) ** 2 / 2, 50.0))
    missed = 0.5 * jnp.sum(jnp.abs(w - heavier)) / DRAW_TV
    if importance:  # the importance-weighted moments replace the Laplace ones where k allows
        mean_is = w @ draws
        r = draws - mean_is
        cov_is = (r * w[:, None]).T @ r
        use = (k <= PARETO_K_LIMIT) & jnp.all(jnp.isfinite(mean_is))
        mode = jnp.where(use, mean_is, mode)
        cov = jnp.where(use, (cov_is + cov_is.T) / 2, cov)
    mode = jnp.where(reached, mode, jnp.nan)
    ok = reached & (k <= PARETO_K_LIMIT) & (missed <= 1.0)
    return mode, cov, FitCheck(ok, jnp.where(reached, missed, jnp.nan), k)


def _matched_normal(rng_key: Array, num: int, d: int, dtype) -> Array:
    """``num`` standard normal draws in ``d`` dimensions, shifted and whitened so that their
    sample mean is 0 and their sample covariance the identity: importance moments of an
    exactly Gaussian target are then exact (not Monte Carlo estimates)."""
    eps = random.normal(rng_key, (num, d), dtype)
    eps = eps - jnp.mean(eps, 0)
    root = jnp.linalg.cholesky(eps.T @ eps / num)
    return jax.scipy.linalg.solve_triangular(root, eps.T, lower=True).T


def _nuts_chain(log_density: Callable, w0: Array, rng_key: Array, num_warmup: int, num_samples: int):
    init_kernel, sample_kernel = hmc(potential_fn=lambda w: -log_density(w), algo="NUTS")
    state = init_kernel(w0, num_warmup=num_warmup, rng_key=rng_key)

    def body(s, _):
        s = sample_kernel(s)
        return s, (s.z, s.diverging)

    state, _ = jax.lax.scan(body, state, None, length=num_warmup)
    return jax.lax.scan(body, state, None, length=num_samples)[1]


def nuts_draws(log_density: Callable, w0: Array, rng_key: Array, *, num_warmup: int = 500,
               num_samples: int = 500) -> Array:
    """``num_samples`` NUTS draws of ``exp(log_density)`` after ``num_warmup`` adaptation steps.

    NumPyro's functional ``hmc(potential_fn, algo="NUTS")`` (step size and diagonal mass
    matrix adapted during warm-up), in ``lax.scan``: jit- and vmap-compatible.
    """
    return _nuts_chain(log_density, w0, rng_key, num_warmup, num_samples)[0]


def nuts_moments(
    log_lik: Callable, cavity: NaturalGaussian, w0: Array, d: int, rng_key: Array, *,
    num_warmup: int = 500, num_samples: int = 500,
) -> Tuple[Array, Array, FitCheck]:
    """Sample mean and covariance of NUTS draws of the tilted distribution (``u`` part).

    The check: any divergent transition after warm-up (the sampler could not follow the
    geometry, e.g. a funnel) fails it; ``stat`` is the share of divergent draws."""
    draws, diverging = _nuts_chain(_tilted(log_lik, cavity, d), w0, rng_key, num_warmup, num_samples)
    draws = draws[:, :d]
    mean = jnp.mean(draws, 0)
    r = draws - mean
    share = jnp.mean(diverging.astype(mean.dtype))
    return mean, r.T @ r / (num_samples - 1), FitCheck(share == 0, share, jnp.full((), jnp.nan, mean.dtype))


def objective_drift(values: Array) -> Array:
    """How much a stochastic objective (to be minimised) still fell over the last quarter of
    its trace: ``(mean of the third quarter - mean of the last) / standard error``. Large
    and positive: still improving, i.e. not converged."""
    n = values.shape[0] // 4
    a, b = values[-2 * n:-n], values[-n:]
    se = jnp.sqrt((jnp.var(a) + jnp.var(b)) / max(n, 1)) + 1e-12 * (1 + jnp.abs(jnp.mean(b)))
    return (jnp.mean(a) - jnp.mean(b)) / se


def gaussian_vi_moments(
    log_lik: Callable, cavity: NaturalGaussian, w0: Array, d: int, rng_key: Array, *,
    optim: Any, steps: int = 2000, num_particles: int = 8, init_scale: float = 0.1, diagonal: bool = False,
    num_draws: int = 1000,
) -> Tuple[Array, Array, FitCheck]:
    """Moments of ``argmin_q KL(q || tilted)`` over Gaussians ``q(u, v)`` (full or diagonal).

    The objective ``E_q[log_lik] + E_q[log cavity(u)] + H[q]`` has its last two terms in
    closed form; the first is a reparameterised Monte Carlo estimate with
    ``num_particles`` draws. ``q`` starts at mean ``w0`` and scale ``init_scale``; the returned
    moments average the iterates of the second half
    of the ``steps``.

    The checks: the objective must have stopped falling and the parameters stopped moving
    (:func:`convergence_stat` at most 1; ``stat``), and the final Gaussian must hold the
    tilted mass: the Pareto ``k`` of ``num_draws`` importance weights at most
    :data:`PARETO_K_LIMIT` (``pareto_k``; a Gaussian over ``(u, v)`` cannot follow the
    funnel of a centred hierarchical model, and this is where it shows).
    """
    n = w0.shape[0]
    rows, cols = jnp.tril_indices(n, -1)
    init = {"loc": w0, "scale": jnp.full(n, jnp.log(jnp.expm1(init_scale)))}
    if not diagonal:
        init["lower"] = jnp.zeros(rows.shape[0])

    def root(params):
        s = jax.nn.softplus(params["scale"])
        return s if diagonal else jnp.diag(s).at[rows, cols].set(params["lower"])

    def neg_elbo(params, key):
        loc, r = params["loc"], root(params)
        eps = random.normal(key, (num_particles, n))
        draws = loc + (eps * r if diagonal else eps @ r.T)
        cov = jnp.diag(r**2) if diagonal else r @ r.T
        mu, c = loc[:d], cov[:d, :d]
        if cavity.diagonal:
            cav = cavity.shift @ mu - 0.5 * jnp.sum(cavity.precision * (jnp.diag(c) + mu**2))
        else:
            cav = cavity.shift @ mu - 0.5 * (jnp.trace(cavity.precision @ c) + mu @ cavity.precision @ mu)
        diag = r if diagonal else jnp.diag(r)
        entropy = jnp.sum(jnp.log(jnp.abs(diag)))
        return -(jnp.mean(jax.vmap(log_lik)(draws)) + cav + entropy)

    def step(carry, key):
        params, opt_state = carry
        value, grads = jax.value_and_grad(neg_elbo)(params, key)
        updates, opt_state = optim.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        r = root(params)
        return (params, opt_state), (params["loc"], r**2 if diagonal else r @ r.T, value)  # diagonal: variances

    fit_key, check_key = random.split(rng_key)
    _, (locs, covs, values) = jax.lax.scan(step, (init, optim.init(init)), random.split(fit_key, steps))
    half = steps // 2  # Polyak averaging over the second half damps the optimiser's noise
    sds = jnp.sqrt(jnp.diagonal(covs, axis1=1, axis2=2)) if covs.ndim == 3 else jnp.sqrt(covs)
    drift = convergence_stat(values, locs, sds)
    loc, cov = jnp.mean(locs[half:], 0), jnp.mean(covs[half:], 0)
    k = gaussian_pareto_k(lambda w: log_lik(w) + cavity_log_density(cavity, w[:d]), loc, cov, check_key, num_draws)
    mean, cov = _marginal(loc, cov, d)
    return mean, cov, FitCheck((drift <= 1.0) & (k <= PARETO_K_LIMIT), drift, k)


def gaussian_pareto_k(log_density: Callable, mean: Array, cov: Array, rng_key: Array, num_draws: int) -> Array:
    """The Pareto ``k`` of ``exp(log_density) / N(mean, cov)`` (``cov``: a matrix, or the variances)
    over ``num_draws`` draws of the Gaussian (PSIS's check of an approximation; Yao et al., 2018)."""
    eps = random.normal(rng_key, (num_draws, mean.shape[0]))
    draws = mean + (eps * jnp.sqrt(cov) if cov.ndim == 1 else eps @ jnp.linalg.cholesky((cov + cov.T) / 2).T)
    log_w = jax.vmap(log_density)(draws) + 0.5 * jnp.sum(eps**2, 1)  # up to a constant
    return pareto_k(log_w)


def moments_to_factor(mean: Array, cov: Array, diagonal: bool) -> NaturalGaussian:
    """Moment matching in the family: full, or the diagonal of ``cov`` (mean-field EP)."""
    return G.from_moments(mean, jnp.diag(cov) if diagonal else cov)

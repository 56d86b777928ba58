"""Gaussian moments of a client's tilted distribution (EP's local step; PVI with local sites).

A client's tilted distribution over ``w = [u, v]`` (``u``: the ``d`` flat unconstrained
global sites, first; ``v``: its own local latent sites) is

.. math::

    \\tilde p(u, v) \\propto \\mathrm{cavity}(u)\\, p(y_j, v \\mid u),

and EP needs the mean and covariance of its ``u``-marginal, i.e. with the local latents
integrated out (paper 004 eq. 4 with ``f_k(phi) = ∫ p(Y_k | theta_k, phi) p(theta_k | phi)
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

from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp
import optax
from jax import random
from numpyro.infer.hmc import hmc

from . import gaussian as G
from .._typing import Array
from .gaussian import NaturalGaussian

__all__ = [
    "cavity_log_density",
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
    return mean[:d], cov[:d, :d]


def laplace_moments(log_lik: Callable, cavity: NaturalGaussian, w0: Array, d: int, *, steps: int = 200,
                    grad_tol: float = 1e-2) -> Tuple[Array, Array]:
    """Laplace approximation of the tilted distribution: ``steps`` L-BFGS iterations from
    ``w0``, then the inverse negative Hessian at the mode (``u`` block).

    The result is NaN (an invalid update) unless the point reached is a mode: its Newton
    decrement ``sqrt(g^T H^-1 g)`` (in posterior standard deviations) is below
    ``grad_tol``."""
    f = _tilted(log_lik, cavity, d)

    def neg(w):
        return -f(w)

    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(neg)

    def body(carry, _):
        w, state = carry
        value, grad = value_and_grad(w, state=state)
        updates, state = opt.update(grad, state, w, value=value, grad=grad, value_fn=neg)
        return (optax.apply_updates(w, updates), state), None

    (mode, _), _ = jax.lax.scan(body, (w0, opt.init(w0)), None, length=steps)
    hess = jax.hessian(neg)(mode)
    cov = jnp.linalg.inv((hess + hess.T) / 2)
    # a mode L-BFGS did not reach is no Laplace approximation: return NaN, which the
    # protocol sends as an invalid (zero) update
    grad = jax.grad(neg)(mode)
    newton = jnp.sqrt(jnp.abs(grad @ cov @ grad))  # Newton decrement: ~0 at a mode
    mode = jnp.where(newton < grad_tol, mode, jnp.nan)
    return _marginal(mode, (cov + cov.T) / 2, d)


def nuts_draws(log_density: Callable, w0: Array, rng_key: Array, *, num_warmup: int = 500,
               num_samples: int = 500) -> Array:
    """``num_samples`` NUTS draws of ``exp(log_density)`` after ``num_warmup`` adaptation steps.

    NumPyro's functional ``hmc(potential_fn, algo="NUTS")`` (step size and diagonal mass
    matrix adapted during warm-up), in ``lax.scan``: jit- and vmap-compatible.
    """
    init_kernel, sample_kernel = hmc(potential_fn=lambda w: -log_density(w), algo="NUTS")
    state = init_kernel(w0, num_warmup=num_warmup, rng_key=rng_key)

    def body(s, _):
        s = sample_kernel(s)
        return s, s.z

    state, _ = jax.lax.scan(body, state, None, length=num_warmup)
    return jax.lax.scan(body, state, None, length=num_samples)[1]


def nuts_moments(
    log_lik: Callable, cavity: NaturalGaussian, w0: Array, d: int, rng_key: Array, *,
    num_warmup: int = 500, num_samples: int = 500,
) -> Tuple[Array, Array]:
    """Sample mean and covariance of NUTS draws of the tilted distribution (``u`` part)."""
    draws = nuts_draws(_tilted(log_lik, cavity, d), w0, rng_key, num_warmup=num_warmup,
                       num_samples=num_samples)[:, :d]
    mean = jnp.mean(draws, 0)
    r = draws - mean
    return mean, r.T @ r / (num_samples - 1)


def gaussian_vi_moments(
    log_lik: Callable, cavity: NaturalGaussian, w0: Array, d: int, rng_key: Array, *,
    optim: Any, steps: int = 500, num_particles: int = 8, init_scale: float = 0.1, diagonal: bool = False,
) -> Tuple[Array, Array]:
    """Moments of ``argmin_q KL(q || tilted)`` over Gaussians ``q(u, v)`` (full or diagonal).

    The objective ``E_q[log_lik] + E_q[log cavity(u)] + H[q]`` has its last two terms in
    closed form; the first is a reparameterised Monte Carlo estimate with
    ``num_particles`` draws. ``q`` starts at mean ``w0`` and scale ``init_scale``; the
    returned moments average the iterates of the second half of the ``steps``.
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
        grads = jax.grad(neg_elbo)(params, key)
        updates, opt_state = optim.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        r = root(params)
        return (params, opt_state), (params["loc"], jnp.diag(r**2) if diagonal else r @ r.T)

    _, (locs, covs) = jax.lax.scan(step, (init, optim.init(init)), random.split(rng_key, steps))
    half = steps // 2  # Polyak averaging over the second half damps the optimiser's noise
    return _marginal(jnp.mean(locs[half:], 0), jnp.mean(covs[half:], 0), d)


def moments_to_factor(mean: Array, cov: Array, diagonal: bool) -> NaturalGaussian:
    """Moment matching in the family: full, or the diagonal of ``cov`` (mean-field EP)."""
    return G.from_moments(mean, jnp.diag(cov) if diagonal else cov)

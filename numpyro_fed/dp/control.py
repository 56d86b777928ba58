"""A control variate for the DP sampler's releases: each row's log-likelihood ratio less its
second-order Taylor expansion about a public point whose derivatives were already released.

The exact DP sampler (:class:`~numpyro_fed.mcmc.DPMetropolis`) releases, every iteration, a clipped
sum of the rows' log-likelihood ratios ``lambda_i = l_i(u') - l_i(u)``. A random-walk move of a
posterior sd changes each row's term by about ``1 / sqrt(n)``, while the clip that keeps the
noise the penalty method corrects for near one nat is ``sqrt(2 / J) / noise multiplier``: at a few
thousand releases, far below it. So every row was clipped and the chains sampled another
posterior.

The private start (:class:`~numpyro_fed.dp.dp_laplace.DPLaplace`) has released, at its last point
``a``, each client's sum of its rows' gradients ``g_i`` and Hessians ``H_i``, each row's pair clipped
(``tilde g_i``, ``tilde H_i``) and the sum noised. With those, each client releases instead the
clipped sum of the residuals

.. math::

    r_i = \\lambda_i - \\tilde g_i^T (u' - u)
          - \\tfrac12 \\left[(u' - a)^T \\tilde H_i (u' - a) - (u - a)^T \\tilde H_i (u - a)\\right],

which are third order in the distance from ``a`` (about ``n^{-3/2}`` a row near the mode), and the
server adds back the same expansion with the released sums ``G``, ``H`` (:func:`taylor`). A
residual depends only on its row and on public points, so clipping it to ``C`` bounds the row's
share of the release as before (sensitivity ``2C``); the start's sums are not released again.

Where no residual is clipped, the chains target the posterior tilted by the start's noise
``xi_G``, ``Xi_H``: ``p(u | y) exp(xi_G^T (u - a) + (u - a)^T Xi_H (u - a) / 2)``. The tilt moves the
mean by, to first order, ``P^-1 (xi_G + Xi_H (m - a))``, whose covariance the start knows
(:func:`~numpyro_fed.dp.dp_laplace.noise_covariance`); the sampler adds an independent draw of that
shift to every draw (from a public key), so the answer carries the start's noise as uncertainty,
as the private Laplace fit's covariance does (Bernstein & Sheldon 2018, "Differentially Private
Bayesian Inference for Exponential Families", NeurIPS). Control variates of this kind for
subsampled MCMC: Bardenet, Doucet & Holmes (2017), "On Markov chain Monte Carlo methods for tall
data", JMLR 18 (§7.2).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ControlVariate", "from_text", "row_derivatives", "row_taylor", "taylor", "to_text", "upper_triangle",
           "widen"]


class ControlVariate(NamedTuple):
    """A public second-order expansion of the clients' summed log-likelihood (see the module).

    Attributes:
        anchor: ``(d,)`` the point the sums were released at (flat, unconstrained).
        gradient: ``(d,)`` the released sum of the rows' clipped gradients there (noise included).
        hessian: ``(d, d)`` the released sum of the rows' clipped Hessians (symmetric).
        clip: each row's ``(gradient, Hessian upper triangle)`` L2 clip at the anchor.
        noise_cov: ``(d, d)`` the covariance of the shift the release's noise gives the mean.
    """

    anchor: jax.Array
    gradient: jax.Array
    hessian: jax.Array
    clip: float
    noise_cov: jax.Array


def upper_triangle(d: int):
    """The upper triangle's indices of a ``d x d`` matrix, in the order a release lists them."""
    return np.triu_indices(d)


def row_derivatives(terms: Callable, u, mask, clip: float):
    """Each row's gradient ``(rows, d)`` and Hessian ``(rows, d, d)`` of ``terms`` (``u -> (rows,)``)
    at ``u``, the vector ``(gradient, Hessian upper triangle)`` of each clipped to L2 norm ``clip``
    (the same factor on both; non-finite entries 0, padded rows 0), which rows the clip bound, and
    each row's factor ``(rows,)`` (0 on padded rows)."""
    rows_u, cols_u = upper_triangle(u.shape[0])
    g = jax.jacfwd(terms)(u)  # (rows, d)
    h = jax.jacfwd(jax.jacfwd(terms))(u)  # (rows, d, d)
    real = mask > 0
    g = jnp.where(jnp.isfinite(g) & real[:, None], g, 0.0)
    h = jnp.where(jnp.isfinite(h) & real[:, None, None], h, 0.0)
    norm = jnp.sqrt(jnp.sum(g ** 2, 1) + jnp.sum(h[:, rows_u, cols_u] ** 2, 1))
    factor = jnp.minimum(1.0, clip / jnp.maximum(norm, 1e-30)) * real
    return g * factor[:, None], h * factor[:, None, None], (norm > clip) & real, factor


def _quadratic(h, anchor, u, proposal):
    a, b = u - anchor, proposal - anchor
    return 0.5 * (jnp.einsum("...i,...ij,...j->...", b, h, b) - jnp.einsum("...i,...ij,...j->...", a, h, a))


def row_taylor(terms: Callable, g, factor, anchor, u, proposal):
    """``(rows,)`` each row's expansion of ``l_i(proposal) - l_i(u)``: ``g`` ``(rows, d)`` its
    clipped gradient at ``anchor``, ``factor`` ``(rows,)`` its clip's factor, the Hessian's
    quadratic forms as second directional derivatives of ``terms`` (``u -> (rows,)``) at ``anchor``
    (memory ``rows x d``, not ``rows x d x d``: no row's Hessian is kept)."""
    def second(w):  # each row's w^T H_i w
        return jax.jvp(lambda x: jax.jvp(terms, (x,), (w,))[1], (anchor,), (w,))[1]

    curvature = jnp.nan_to_num(second(proposal - anchor) - second(u - anchor), nan=0.0, posinf=0.0, neginf=0.0)
    return g @ (proposal - u) + 0.5 * factor * curvature


def taylor(control: ControlVariate, u, proposal):
    """The released sums' expansion of ``L(proposal) - L(u)`` (what the server adds back)."""
    return control.gradient @ (proposal - u) + _quadratic(control.hessian, control.anchor, u, proposal)


def widen(rng_key, control: ControlVariate, draws):
    """``draws`` (``(..., d)``) each moved by an independent draw of the start's noise's shift."""
    cov = jnp.asarray(control.noise_cov, draws.dtype)
    chol = jnp.linalg.cholesky(cov + 1e-12 * jnp.trace(cov) * jnp.eye(cov.shape[0], dtype=cov.dtype))
    return draws + jax.random.normal(rng_key, draws.shape, draws.dtype) @ chol.T


def to_text(control: ControlVariate) -> dict:
    """The control variate as JSON-ready lists (a network backend's nodes rebuild it)."""
    return {k: np.asarray(v, np.float64).tolist() if k != "clip" else float(v) for k, v in control._asdict().items()}


def from_text(text: dict) -> ControlVariate:
    return ControlVariate(**{k: float(v) if k == "clip" else jnp.asarray(v, jnp.float32) for k, v in text.items()})

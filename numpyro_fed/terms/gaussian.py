"""Gaussian factors in natural parameters (the currency of PVI and EP).

A (possibly unnormalised) Gaussian factor ``t(u) = exp(h^T u - u^T L u / 2)`` is stored as
``NaturalGaussian(shift=h, precision=L)``; ``L`` is a ``(d, d)`` matrix (full) or a
``(d,)`` vector (diagonal, mean-field). Products and ratios of factors are sums and
differences of natural parameters, so ``q = p * prod_j t_j`` is a sum. All functions are
pure and jit-compatible.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Tuple

import jax
import jax.numpy as jnp

from .._typing import Array

__all__ = [
    "NaturalGaussian",
    "from_moments",
    "is_positive_definite",
    "kl_divergence",
    "log_prob",
    "project_diagonal",
    "hessian_change",
    "quadratic_factor",
    "sample",
    "to_moments",
    "zeros",
]

_NOT_QUADRATIC = (
    "{what} is not a Gaussian function of the unconstrained {sites} (its Hessian changes by "
    "{change:.2g} between 0 and random points at scales 1 and 3), so it has no closed-form Gaussian factor; {fix}"
)


class NaturalGaussian(NamedTuple):
    """``exp(shift^T u - u^T precision u / 2)``; ``precision`` is full ``(d, d)`` or diagonal ``(d,)``."""

    shift: Array
    precision: Array

    @property
    def diagonal(self) -> bool:
        return self.precision.ndim == 1

    def __add__(self, other: "NaturalGaussian") -> "NaturalGaussian":  # type: ignore[override]
        return NaturalGaussian(self.shift + other.shift, self.precision + other.precision)

    def __sub__(self, other: "NaturalGaussian") -> "NaturalGaussian":
        return NaturalGaussian(self.shift - other.shift, self.precision - other.precision)

    def scale(self, c: Array) -> "NaturalGaussian":
        return NaturalGaussian(c * self.shift, c * self.precision)


def zeros(d: int, diagonal: bool) -> NaturalGaussian:
    """The flat factor ``t(u) = 1``."""
    return NaturalGaussian(jnp.zeros(d), jnp.zeros(d) if diagonal else jnp.zeros((d, d)))


def from_moments(mean: Array, cov: Array) -> NaturalGaussian:
    """From a mean and a covariance matrix ``(d, d)`` or variance vector ``(d,)``."""
    if cov.ndim == 1:
        return NaturalGaussian(mean / cov, 1.0 / cov)
    precision = jnp.linalg.inv(cov)
    precision = (precision + precision.T) / 2
    return NaturalGaussian(precision @ mean, precision)


def to_moments(nat: NaturalGaussian) -> Tuple[Array, Array]:
    """``(mean, cov)`` (``cov`` a variance vector when diagonal). Needs a PD precision."""
    if nat.diagonal:
        return nat.shift / nat.precision, 1.0 / nat.precision
    chol = jnp.linalg.cholesky(nat.precision)
    mean = jax.scipy.linalg.cho_solve((chol, True), nat.shift)
    cov = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(nat.shift.shape[0], dtype=nat.shift.dtype))
    return mean, (cov + cov.T) / 2


def is_positive_definite(nat: NaturalGaussian) -> Array:
    """Whether the precision is positive definite (a normalisable Gaussian)."""
    if nat.diagonal:
        return jnp.all(nat.precision > 0)
    sym = (nat.precision + nat.precision.T) / 2
    return jnp.all(jnp.linalg.eigvalsh(sym) > 0)


def _scale_tril(nat: NaturalGaussian) -> Array:
    """``L`` with ``L L^T = cov``: the inverse transpose of the precision's Cholesky factor."""
    chol = jnp.linalg.cholesky(nat.precision)
    eye = jnp.eye(nat.shift.shape[0], dtype=nat.shift.dtype)
    return jax.scipy.linalg.solve_triangular(chol, eye, lower=True).T


def sample(nat: NaturalGaussian, eps: Array) -> Array:
    """``mean + L eps`` for standard-normal ``eps`` (reparameterised)."""
    mean, cov = to_moments(nat)
    if nat.diagonal:
        return mean + jnp.sqrt(cov) * eps
    # L = chol(P)^{-T} is upper-triangular; any square root of cov gives the right law
    return mean + _scale_tril(nat) @ eps


def log_prob(nat: NaturalGaussian, u: Array) -> Array:
    """Normalised log density of the Gaussian with these natural parameters at ``u``."""
    mean, cov = to_moments(nat)
    d = mean.shape[0]
    r = u - mean
    if nat.diagonal:
        return (
            -0.5 * jnp.sum(r**2 * nat.precision) - 0.5 * d * jnp.log(2 * jnp.pi) + 0.5 * jnp.sum(jnp.log(nat.precision))
        )
    _, logdet = jnp.linalg.slogdet(nat.precision)
    return -0.5 * r @ nat.precision @ r - 0.5 * d * jnp.log(2 * jnp.pi) + 0.5 * logdet


def kl_divergence(q: NaturalGaussian, p: NaturalGaussian) -> Array:
    """``KL(q || p)`` between two normalisable Gaussians (same structure)."""
    mq, cq = to_moments(q)
    mp, _ = to_moments(p)
    r = mq - mp
    if q.diagonal:
        return 0.5 * jnp.sum(p.precision * cq + p.precision * r**2 - 1.0 - jnp.log(p.precision * cq))
    d = mq.shape[0]
    _, ld_q = jnp.linalg.slogdet(q.precision)
    _, ld_p = jnp.linalg.slogdet(p.precision)
    return 0.5 * (jnp.trace(p.precision @ cq) + r @ p.precision @ r - d + ld_q - ld_p)


def project_diagonal(nat: NaturalGaussian) -> NaturalGaussian:
    """The diagonal Gaussian closest in ``KL(q || nat)``: same mean, precision ``diag(L)``."""
    if nat.diagonal:
        return nat
    mean, _ = to_moments(nat)
    d = jnp.diag(nat.precision)
    return NaturalGaussian(d * mean, d)


def hessian_change(f: Callable[[Array], Array], d: int, rng_key: Array) -> Array:
    """Largest relative change of ``f``'s Hessian between 0 and random points (0 for a quadratic ``f``).

    The points are drawn at scales 1 and 3 (two each): one point near 0 let a log density
    that is flat there and curved in the tails (an InverseGamma(0.001, 0.001) prior in log
    space) pass as quadratic. Jit-compatible.
    """
    hess = jax.hessian(f)
    h0 = hess(jnp.zeros(d))
    points = jax.random.normal(rng_key, (4, d)) * jnp.asarray([1.0, 1.0, 3.0, 3.0])[:, None]
    h = jax.lax.map(hess, points)
    return jnp.max(jnp.abs(h - h0)) / (1.0 + jnp.max(jnp.abs(h0)))


def check_quadratic(change: Array, *, what: str, sites: str, fix: str, tol: float = 1e-4) -> None:
    """Raise the error of a non-quadratic log density (``change`` from :func:`hessian_change`)."""
    if not float(change) <= tol:
        raise ValueError(_NOT_QUADRATIC.format(what=what, sites=sites, change=float(change), fix=fix))


def quadratic_factor(
    f: Callable[[Array], Array], d: int, rng_key: Array, *, what: str, sites: str, fix: str
) -> NaturalGaussian:
    """The Gaussian factor equal to ``exp(f)`` (up to a constant) for a quadratic ``f``.

    ``f(u) = -u^T L u / 2 + h^T u + c`` gives ``L = -Hessian``, ``h = grad f(0)``. The Hessian
    is compared at two random points; a non-quadratic ``f`` raises a ``ValueError``
    naming ``what`` and ``fix`` (compiles ``f``'s derivatives; not itself jit-compatible).
    """

    @jax.jit
    def derivatives():
        hess = jax.hessian(f)(jnp.zeros(d))
        return hessian_change(f, d, rng_key), jax.grad(f)(jnp.zeros(d)), -(hess + hess.T) / 2

    change, shift, precision = derivatives()
    check_quadratic(change, what=what, sites=sites, fix=fix)
    return NaturalGaussian(shift, precision)

"""2-Wasserstein barycenters of Gaussians, the averaging step of SFVI-Avg."""

from __future__ import annotations

from typing import Tuple

import jax.numpy as jnp

from .._typing import Array

__all__ = ["diagonal_gaussian_barycenter", "gaussian_barycenter"]


def gaussian_barycenter(
    weights: Array,
    means: Array,
    covs: Array,
    *,
    diagonal: bool = False,
    tolerance: float = 1e-10,
    min_iterations: int = 50,
    max_iterations: int = 500,
) -> Tuple[Array, Array]:
    """Barycenter of ``N(means[j], covs[j])`` under the 2-Wasserstein distance.

    The mean is the weighted mean of the means. For diagonal covariances the barycenter
    standard deviations are the weighted mean of the standard deviations (closed form);
    otherwise the covariance solves the fixed point
    ``S = sum_j w_j (S^{1/2} C_j S^{1/2})^{1/2}`` (Álvarez-Esteban et al., 2016), computed
    by ``ott.geometry.costs.Bures.barycenter``. ``min_iterations`` matters: without it
    ott 0.6 stops after one block of 5 iterations.

    Args:
        weights: ``(J,)`` non-negative weights (normalised here); zero drops a client.
        means: ``(J, d)``.
        covs: ``(J, d, d)``.
        diagonal: treat the covariances as diagonal and use the closed form.

    Returns:
        ``(mean, cov)`` of the barycenter. Jit-compatible.

    Examples:
        >>> import jax.numpy as jnp
        >>> m, c = gaussian_barycenter(jnp.ones(2), jnp.array([[0.0], [2.0]]),
        ...                            jnp.array([[[1.0]], [[9.0]]]), diagonal=True)
        >>> float(m[0]), float(c[0, 0])
        (1.0, 4.0)

    References:
        Hassan et al., Hassan et al. (2023) §3.2 (SFVI-Avg); Mallasto and Feragen (2017), Thm. 4.
    """
    weights = jnp.asarray(weights, dtype=means.dtype)
    weights = weights / jnp.sum(weights)
    mean = jnp.tensordot(weights, means, axes=1)
    if diagonal or means.shape[-1] == 1:  # in 1-D the barycenter is the closed form too
        _, sd = diagonal_gaussian_barycenter(weights, means, jnp.sqrt(jnp.diagonal(covs, axis1=-2, axis2=-1)))
        return mean, jnp.diag(sd**2)
    from ott.geometry.costs import Bures  # on first use: ott-jax costs every import of numpyro_fed ~0.1 s

    d = means.shape[-1]
    xs = jnp.concatenate([means, covs.reshape(covs.shape[0], d * d)], axis=1)
    x, _ = Bures(dimension=d).barycenter(
        weights, xs, tolerance=tolerance,
        min_iterations=min_iterations, max_iterations=max_iterations,
    )
    cov = x[d:].reshape(d, d)
    return mean, 0.5 * (cov + cov.T)


def diagonal_gaussian_barycenter(weights: Array, means: Array, sds: Array) -> Tuple[Array, Array]:
    """The 2-Wasserstein barycenter of ``N(means[j], diag(sds[j]^2))`` in closed form: the
    weighted means of the means and of the standard deviations (Mallasto and Feragen,
    2017). ``means`` and ``sds`` are ``(J, d)``; O(J d), no ``d x d`` matrix is formed,
    so it serves the high-dimensional diagonal guides of Hassan et al. (2023) S3.2 (n_G = 7850).

    Returns:
        ``(mean, sd)``, each ``(d,)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> m, s = diagonal_gaussian_barycenter(jnp.ones(2), jnp.array([[0.0], [2.0]]), jnp.array([[1.0], [3.0]]))
        >>> float(m[0]), float(s[0])
        (1.0, 2.0)
    """
    weights = jnp.asarray(weights, dtype=means.dtype)
    weights = weights / jnp.sum(weights)
    return jnp.tensordot(weights, means, axes=1), jnp.tensordot(weights, sds, axes=1)

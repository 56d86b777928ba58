"""Structured Gaussian variational families for federated models.

The family of Hassan et al. (2023) (Hassan et al., §3.1), in unconstrained space:

.. math::

    q(z_G) = \\mathcal N(\\mu_G, L_G L_G^\\top), \\qquad
    q(z_{L_j} \\mid z_G) = \\mathcal N\\big(\\bar\\mu_j + C_j (z_G - \\mu_G),\\; L_j L_j^\\top\\big),

with each factor ``L = T diag(s)`` for a lower-unitriangular ``T`` (``"full"``) or
``T = I`` (``"diagonal"``). With ``conditional_scale=True`` the local scales follow the
global sites too: ``log s_j(z_G) = log s_j + D_j (z_G - mu_G)``, so ``q(z_L | z_G)`` can
follow a funnel (a group scale ``tau`` and the effects it scales, whose conditional sd
grows with ``tau``), which a fixed ``s_j`` cannot. The guide's parameters split into a server-held part
(``mu_G``, ``L_G``) and a client-held part (``mu_bar_j``, ``C_j``, ``L_j``): the
conditional form makes the ELBO a sum of one server term and one term per client.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from .._typing import Array
from ..model.structure import with_improper_values

__all__ = ["SCALES", "MeanFieldGuide", "StructuredGuide", "softplus_inverse", "std_normal_logpdf"]

SCALES = ("full", "diagonal")
_MAX_LOG_SCALE_SHIFT = 30.0  # |D (z_G - mu_G)| bound: exp stays finite in float32
_HALF_LOG_2PI = float(0.5 * np.log(2 * np.pi))


def softplus_inverse(x: float) -> float:
    return float(np.log(np.expm1(np.float64(x))))


def _unit_lower(packed: Array, n: int, mask: Array | None = None) -> Array:
    rows, cols = jnp.tril_indices(n, k=-1)
    strict = jnp.zeros((n, n), packed.dtype).at[rows, cols].set(packed)
    if mask is not None:
        strict = strict * jnp.outer(mask, mask)
    return strict + jnp.eye(n, dtype=packed.dtype)


def std_normal_logpdf(eps: Array) -> Array:
    return -0.5 * eps**2 - _HALF_LOG_2PI


class StructuredGuide:
    """Conditionally structured Gaussian guide of Hassan et al. (2023) §3.1.

    Args:
        model: the federated model (kept for reference and symmetry with NumPyro's
            autoguides; the inference object discovers the sites).
        global_scale: ``"full"`` (dense ``L_G``) or ``"diagonal"``.
        local_scale: ``"diagonal"`` (default; right when local latents are
            conditionally independent given the globals) or ``"full"``.
        conditional: keep the coupling ``C_j`` of each client's local latents to the
            global ones. ``False`` gives ``q(z_G) q(z_L)``.
        conditional_scale: let each local scale depend on the global sites, log-affinely
            (``D_j`` above, started at 0; needs ``conditional``). Doubles the client's
            coupling parameters.
        init_scale: initial standard deviation of every factor.

    Examples:
        >>> import numpyro_fed as nf
        >>> g = nf.StructuredGuide(None, global_scale="full")
        >>> sorted(g.init_global(3))
        ['loc', 'lower', 'scale']
        >>> sorted(g.init_local(4, 3))
        ['coupling', 'loc', 'scale', 'scale_coupling']

    References:
        Hassan, Salomone, Mengersen. Federated variational inference methods for
        structured latent variable models, §3.1 and supplement S1.
    """

    def __init__(
        self,
        model: Optional[Callable] = None,
        *,
        global_scale: str = "full",
        local_scale: str = "diagonal",
        conditional: bool = True,
        conditional_scale: bool = True,
        init_scale: float = 0.1,
    ) -> None:
        for arg, value in (("global_scale", global_scale), ("local_scale", local_scale)):
            if value not in SCALES:
                raise ValueError(f"StructuredGuide({arg}={value!r}): choose one of {SCALES}")
        if not (init_scale > 0):
            raise ValueError(f"StructuredGuide(init_scale={init_scale}): must be > 0")
        self.model = with_improper_values(model)
        self.global_scale = global_scale
        self.local_scale = local_scale
        self.conditional = bool(conditional)
        self.conditional_scale = bool(conditional_scale) and self.conditional
        self.init_scale = float(init_scale)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(global_scale={self.global_scale!r}, "
            f"local_scale={self.local_scale!r}, conditional={self.conditional}, "
            f"conditional_scale={self.conditional_scale})"
        )

    # ----------------------------------------------------------------- parameters
    def init_global(self, size: int) -> Dict[str, Array]:
        """Server-held parameters for ``size`` unconstrained global dimensions."""
        params = {
            "loc": jnp.zeros(size),
            "scale": jnp.full(size, softplus_inverse(self.init_scale), dtype=jnp.zeros(()).dtype),
        }
        if self.global_scale == "full":
            params["lower"] = jnp.zeros(size * (size - 1) // 2)
        return params

    def init_local(self, size: int, global_size: int) -> Dict[str, Array]:
        """Client-held parameters for ``size`` unconstrained local dimensions."""
        params = {
            "loc": jnp.zeros(size),
            "scale": jnp.full(size, softplus_inverse(self.init_scale), dtype=jnp.zeros(()).dtype),
        }
        if self.local_scale == "full":
            params["lower"] = jnp.zeros(size * (size - 1) // 2)
        if self.conditional:
            params["coupling"] = jnp.zeros((size, global_size))
        if self.conditional_scale:
            params["scale_coupling"] = jnp.zeros((size, global_size))
        return params

    # ----------------------------------------------------------------- q(z_G)
    def global_scale_tril(self, params: Dict[str, Array]) -> Array:
        """``L_G`` such that ``Cov q(z_G) = L_G L_G^T``."""
        s = jax.nn.softplus(params["scale"])
        if "lower" not in params:
            return jnp.diag(s)
        return _unit_lower(params["lower"], s.shape[0]) * s[None, :]

    def sample_global(self, params: Dict[str, Array], eps: Array) -> Array:
        s = jax.nn.softplus(params["scale"])
        if "lower" not in params:
            return params["loc"] + s * eps
        return params["loc"] + self.global_scale_tril(params) @ eps

    def log_prob_global(self, params: Dict[str, Array], z: Array) -> Array:
        s = jax.nn.softplus(params["scale"])
        if "lower" not in params:
            eps = (z - params["loc"]) / s
        else:
            eps = solve_triangular(self.global_scale_tril(params), z - params["loc"], lower=True)
        return jnp.sum(std_normal_logpdf(eps) - jnp.log(s))

    def global_moments(self, params: Dict[str, Array]) -> Tuple[Array, Array]:
        """Mean and covariance of ``q(z_G)``."""
        L = self.global_scale_tril(params)
        return params["loc"], L @ L.T

    def global_mean_sd(self, params: Dict[str, Array]) -> Tuple[Array, Array]:
        """Mean and marginal standard deviations of ``q(z_G)``. For a diagonal ``q(z_G)``
        this is its whole description, in O(n_G), without forming its covariance."""
        if "lower" not in params:
            return params["loc"], jax.nn.softplus(params["scale"])
        return params["loc"], jnp.sqrt(jnp.sum(self.global_scale_tril(params) ** 2, axis=1))

    def global_from_mean_sd(self, loc: Array, sd: Array) -> Dict[str, Array]:
        """Server parameters of the diagonal ``q(z_G)`` with the given mean and sds."""
        if self.global_scale != "diagonal":
            raise ValueError("global_from_mean_sd is for global_scale='diagonal'; use global_from_moments")
        return {"loc": loc, "scale": jnp.log(jnp.expm1(sd))}

    def global_from_moments(self, loc: Array, cov: Array) -> Dict[str, Array]:
        """Server parameters whose ``q(z_G)`` has the given mean and covariance."""
        if self.global_scale == "diagonal":
            return self.global_from_mean_sd(loc, jnp.sqrt(jnp.diagonal(cov)))
        L = jnp.linalg.cholesky(cov)
        s = jnp.diagonal(L)
        unit = L / s[None, :]
        rows, cols = jnp.tril_indices(loc.shape[0], k=-1)
        return {"loc": loc, "scale": jnp.log(jnp.expm1(s)), "lower": unit[rows, cols]}

    # ----------------------------------------------------------------- q(z_L | z_G)
    def _local_mean(self, params, global_params, z_global):
        mean = params["loc"]
        if "coupling" in params:
            mean = mean + params["coupling"] @ (z_global - global_params["loc"])
        return mean

    def _local_scale(self, params, global_params, z_global):
        s = jax.nn.softplus(params["scale"])
        if "scale_coupling" in params:
            shift = params["scale_coupling"] @ (z_global - global_params["loc"])
            s = s * jnp.exp(jnp.clip(shift, -_MAX_LOG_SCALE_SHIFT, _MAX_LOG_SCALE_SHIFT))
        return s

    def _local_factor(self, params, global_params, z_global, mask):
        """``(L, s)`` of ``q(z_L | z_G)`` (``L`` ``None`` for a diagonal factor)."""
        s = self._local_scale(params, global_params, z_global)
        if "lower" not in params:
            return None, s
        return _unit_lower(params["lower"], s.shape[0], mask) * s[None, :], s

    def sample_local(self, params, global_params, z_global, eps, mask) -> Array:
        """Reparametrised draw of a client's local latents given ``z_G``.

        ``mask`` (1 for real entries, 0 for padding) keeps padded entries from
        influencing real ones.
        """
        mean = self._local_mean(params, global_params, z_global)
        L, s = self._local_factor(params, global_params, z_global, mask)
        if L is None:
            return mean + s * eps
        return mean + L @ eps

    def log_prob_local(self, params, global_params, z_global, z, mask) -> Array:
        """``log q(z_L | z_G)`` summed over unmasked entries."""
        mean = self._local_mean(params, global_params, z_global)
        L, s = self._local_factor(params, global_params, z_global, mask)
        if L is None:
            eps = (z - mean) / s
        else:
            eps = solve_triangular(L, z - mean, lower=True)
        return jnp.sum(mask * (std_normal_logpdf(eps) - jnp.log(s)))


class MeanFieldGuide(StructuredGuide):
    """Fully factorised Gaussian: ``C_j = 0`` and diagonal factors everywhere.

    The baseline that structured inference improves on: it cannot represent the
    posterior correlation between global and local latent variables.

    Examples:
        >>> import numpyro_fed as nf
        >>> sorted(nf.MeanFieldGuide(None).init_local(4, 3))
        ['loc', 'scale']
    """

    def __init__(self, model: Optional[Callable] = None, *, init_scale: float = 0.1) -> None:
        super().__init__(
            model,
            global_scale="diagonal",
            local_scale="diagonal",
            conditional=False,
            init_scale=init_scale,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

"""Variational families for vertically federated models (Hassan et al. (2024), §4.1-4.2).

Each party fits a Gaussian ``q(theta_j) = N(mu_j, L_j L_j^T)`` over its own sites (flat,
unconstrained space; ``L_j = T diag(s)`` with ``T`` lower-unitriangular or the identity).
The auxiliary variables of client j get either

- a **mean-field** factor ``q(z_ij) = N(m_ij, s_ij^2)`` with two parameters per row
  (eq. 10), or
- the **amortized** factor of §4.1 (eq. 9),

  .. math::

      q_{\\psi_j}(z_j \\mid \\theta_j) = \\mathcal N\\big(\\mu_{\\psi_j}(g_j),
          \\sigma_{\\psi_j}(g_j)^2\\big), \\qquad g_j = g_j(x_j, \\theta_j),

  a small MLP applied row by row to the client's contribution (and to ``y`` in the power
  form), whose size does not grow with the number of rows. Its output layer starts at
  zero, so at initialisation ``mu = g_j`` and ``sigma = init_scale``.

All functions here are pure and jit-compatible.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax import random
from jax.example_libraries import stax

from .._typing import Array
from .._validation import check_positive_int
from ..horizontal.guides import SCALES, softplus_inverse, std_normal_logpdf

__all__ = ["AmortizedAux", "GaussianFactor", "MeanFieldAux", "VerticalGuide"]


class GaussianFactor:
    """``N(loc, L L^T)`` over a flat vector, ``L = T diag(softplus(scale))``.

    ``sample`` returns the draw and its log density; by the change of variables
    ``log q(u) = sum log N(eps; 0, 1) - sum log s`` exactly, for every parameter value, so
    its gradient is the total (path) derivative.
    """

    def __init__(self, scale: str = "full", init_scale: float = 0.1, init_radius: float = 0.5) -> None:
        if scale not in SCALES:
            raise ValueError(f"scale={scale!r}: choose one of {SCALES}")
        if not init_scale > 0:
            raise ValueError(f"init_scale={init_scale}: must be > 0")
        self.scale = scale
        self.init_scale = float(init_scale)
        self.init_radius = float(init_radius)

    def init(self, rng_key: Array, size: int) -> Dict[str, Array]:
        params = {
            "loc": random.uniform(rng_key, (size,), minval=-self.init_radius, maxval=self.init_radius),
            "scale": jnp.full((size,), softplus_inverse(self.init_scale)),
        }
        if self.scale == "full":
            params["lower"] = jnp.zeros(size * (size - 1) // 2)
        return params

    def scale_tril(self, params: Dict[str, Array]) -> Array:
        s = jax.nn.softplus(params["scale"])
        n = s.shape[0]
        if "lower" not in params:
            return jnp.diag(s)
        rows, cols = jnp.tril_indices(n, k=-1)
        unit = jnp.eye(n, dtype=s.dtype).at[rows, cols].set(params["lower"])
        return unit * s[None, :]

    def sample(self, params: Dict[str, Array], eps: Array) -> Tuple[Array, Array]:
        """``(u, log q(u))`` for standard-normal ``eps``."""
        s = jax.nn.softplus(params["scale"])
        if "lower" in params:
            u = params["loc"] + self.scale_tril(params) @ eps
        else:
            u = params["loc"] + s * eps
        return u, jnp.sum(std_normal_logpdf(eps)) - jnp.sum(jnp.log(s))


class MeanFieldAux:
    """One Gaussian per row for ``z_j`` (Hassan et al. (2024) eq. 10); ``2 n`` parameters per client."""

    amortized = False

    def __init__(self, init_scale: float = 0.1) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale={init_scale}: must be > 0")
        self.init_scale = float(init_scale)

    def init(self, rng_key: Array, num_rows: int, num_inputs: int) -> Dict[str, Array]:
        del rng_key, num_inputs
        return {
            "loc": jnp.zeros(num_rows),
            "scale": jnp.full((num_rows,), softplus_inverse(self.init_scale)),
        }

    def sample(self, params, rows: Array, inputs: Array, tau: Array) -> Tuple[Array, Array]:
        """``(z, log q(z))`` for the rows ``rows``; ``inputs`` are unused."""
        del inputs
        s = jax.nn.softplus(params["scale"][rows])
        return params["loc"][rows] + s * tau, jnp.sum(std_normal_logpdf(tau)) - jnp.sum(jnp.log(s))


class AmortizedAux:
    """The amortized factor ``q(z_j | theta_j)`` of Hassan et al. (2024) §4.1 (eq. 9).

    Args:
        hidden: widths of the MLP's hidden layers.
        init_scale: initial ``sigma``.
        use_response: feed ``y`` to the network as a second input. ``None`` (default)
            does so when the response is shared with the clients and the model has the
            power form, as in the paper.
        response_transform: applied to ``y`` before it enters the network (e.g.
            ``jnp.log1p`` for counts); default identity.
    """

    amortized = True

    def __init__(
        self,
        hidden: Sequence[int] = (16,),
        init_scale: float = 0.1,
        use_response: Optional[bool] = None,
        response_transform: Optional[Callable[[Array], Array]] = None,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale={init_scale}: must be > 0")
        self.hidden = tuple(check_positive_int("hidden", h, what=f" (a layer width, in hidden={hidden})")
                            for h in hidden)
        self.init_scale = float(init_scale)
        self.use_response = use_response
        self.response_transform = response_transform or (lambda y: y)
        layers = []
        for h in self.hidden:
            layers += [stax.Dense(h), stax.Tanh]
        self._body_init, self._body_apply = stax.serial(*layers) if layers else (None, None)

    def init(self, rng_key: Array, num_rows: int, num_inputs: int) -> Dict[str, Array]:
        del num_rows
        width = num_inputs
        body = ()
        if self._body_init is not None:
            (_, width), body = self._body_init(rng_key, (-1, num_inputs))
        return {
            "body": body,
            "out_w": jnp.zeros((width, 2)),  # zero output layer: mu = g, sigma = init_scale
            "out_b": jnp.array([0.0, softplus_inverse(self.init_scale)]),
        }

    def sample(self, params, rows: Array, inputs: Array, tau: Array) -> Tuple[Array, Array]:
        """``(z, log q(z))``; ``inputs[:, 0]`` is the contribution ``g_j``."""
        del rows
        h = inputs if self._body_apply is None else self._body_apply(params["body"], inputs)
        out = h @ params["out_w"] + params["out_b"]
        s = jax.nn.softplus(out[:, 1])
        z = inputs[:, 0] + out[:, 0] + s * tau
        return z, jnp.sum(std_normal_logpdf(tau)) - jnp.sum(jnp.log(s))


class VerticalGuide:
    """The variational family of a vertical model: ``prod_j q(theta_j) q(z_j | .)``.

    Args:
        aux: ``"amortized"`` (default), ``"meanfield"``, or an :class:`AmortizedAux` /
            :class:`MeanFieldAux` instance.
        theta_scale: ``"full"`` (the paper's full ``Sigma_theta_j``) or ``"diagonal"``.
        init_scale: initial standard deviation of ``q(theta)``.
        init_radius: ``q(theta)`` means start uniform in ``(-r, r)`` (unconstrained space).

    Examples:
        >>> import numpyro_fed as nf
        >>> g = nf.VerticalGuide(aux="meanfield", theta_scale="diagonal")
        >>> type(g.aux).__name__, g.theta.scale
        ('MeanFieldAux', 'diagonal')

    References:
        Hassan, Sutton, Mira, Mengersen (Hassan et al. (2024)), §4.1-4.2.
    """

    def __init__(
        self,
        aux: Union[str, AmortizedAux, MeanFieldAux] = "amortized",
        *,
        theta_scale: str = "full",
        init_scale: float = 0.1,
        init_radius: float = 0.5,
    ) -> None:
        if isinstance(aux, str):
            if aux not in ("amortized", "meanfield"):
                raise ValueError(f"VerticalGuide(aux={aux!r}): choose 'amortized', 'meanfield' or an instance")
            aux = AmortizedAux() if aux == "amortized" else MeanFieldAux()
        if not isinstance(aux, (AmortizedAux, MeanFieldAux)):
            raise TypeError(f"VerticalGuide(aux=...): got {type(aux).__name__}; use AmortizedAux or MeanFieldAux")
        self.aux = aux
        self.theta = GaussianFactor(theta_scale, init_scale, init_radius)

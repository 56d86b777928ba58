"""The ELBO of a federated model as one server term plus one term per client.

With the guide of :class:`~numpyro_fed.StructuredGuide` and ``z_G = f(eta_G, eps_G)``,

.. math::

    \\mathcal L = \\mathbb E\\Big[\\underbrace{\\log p(z_G) - \\log q(z_G)}_{\\text{server}}
      + \\sum_j \\underbrace{\\log p(z_{L_j}, y_j \\mid z_G) - \\log q(z_{L_j} \\mid z_G)}
      _{\\text{client } j}\\Big],

so the gradient with respect to the server's parameters is the server's own gradient
plus each client's vector-Jacobian product (Hassan et al. (2023), supplement S1). All functions here
are pure and jit-compatible.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, substitute, trace

from ..clients import ClientData
from ..model.handlers import GLOBAL, LOCAL, site_role
from ..model.pointwise import enumeration_dependent, observed_terms
from ..model.structure import (
    ModelStructure,
    SiteLayout,
    constrain_params,
    is_latent,
    log_joint,
    trace_model,
    with_improper_values,
)
from ..model.trace import prior_median
from .guides import StructuredGuide

__all__ = ["ClientData", "FederatedObjective"]


def _client_weights(prior_share, scale):
    """Weight of each site's term in a client's ELBO term: ``scale`` for its observed and
    local sites, ``prior_share`` for the global latent sites."""

    def weight(site):
        if site["type"] != "sample":
            return False
        if site["is_observed"] or site_role(site) == LOCAL:
            return scale
        if is_latent(site) and site_role(site) == GLOBAL:
            return prior_share
        return False

    return weight


class FederatedObjective:
    """Server and client ELBO terms of a model under a structured guide.

    Args:
        model: the annotated NumPyro model.
        guide: a :class:`~numpyro_fed.StructuredGuide`.
        structure: the model's sites (see ``analyse_model``).
        model_kwargs: non-data keyword arguments shared by every party.
        stl: use the sticking-the-landing estimator (Roeder et al., 2017): the
            variational density is evaluated with its parameters held fixed.
    """

    def __init__(
        self,
        model: Callable,
        guide: StructuredGuide,
        structure: ModelStructure,
        model_kwargs: Optional[Mapping[str, Any]] = None,
        stl: bool = False,
    ) -> None:
        self.model = with_improper_values(model)
        self.guide = guide
        self.structure = structure
        self.model_kwargs = dict(model_kwargs or {})
        self.stl = bool(stl)
        self.global_constraints = {n: c for n, (_, c) in structure.global_param.items()}
        self._enum_dependent: Dict[tuple, Tuple[str, ...]] = {}
        self.global_start: Optional[jax.Array] = None  # the guide's starting global locations (set_global_start)

    # ------------------------------------------------------------- parameters
    @property
    def global_size(self) -> int:
        return self.structure.global_latent.size

    def init_global(self) -> Dict:
        """The server's starting parameters; the guide's locations at :attr:`global_start` (the
        prior medians of the global sites, as NumPyro's autoguides start) when set."""
        theta = {n: u for n, (u, _) in self.structure.global_param.items()}
        guide = self.guide.init_global(self.global_size)
        if self.global_start is not None and self.global_size:
            guide = {**guide, "loc": jnp.asarray(self.global_start, guide["loc"].dtype)}
        return {"guide": guide, "theta": theta}

    def set_global_start(self, args: Mapping) -> None:
        """:attr:`global_start` from the prior medians, traced at set-up on a client's arguments
        ``args`` (the global priors use no data: checked at set-up)."""
        self.global_start = prior_median(self.model, args, self.model_kwargs, self.structure.global_latent)

    def client_layout(self, args: Mapping) -> tuple:
        """Local layout and local-param constraints for a client's argument shapes."""
        tr = trace_model(self.model, args, self.model_kwargs)
        return (
            self.structure.local_layout(tr),
            self.structure.local_param_constraints(tr),
            tr,
        )

    def init_local(self, data: ClientData) -> Dict:
        layout, _, tr = self.client_layout(data.args)
        guide = self.guide.init_local(layout.size, self.global_size)
        if layout.size:  # the local locations at their prior medians given the global ones, on the client's rows
            loc = prior_median(self.model, data.args, self.model_kwargs, layout, exact=True).astype(guide["loc"].dtype)
            guide = {**guide, "loc": loc * layout.flat_mask(data.row_mask, data.args)}
        return {
            "guide": guide,
            "theta": self.structure.local_param_init(tr),
        }

    # ------------------------------------------------------------- sampling
    def global_latent(self, global_params, eps_global) -> jax.Array:
        return self.guide.sample_global(global_params["guide"], eps_global)

    def local_latent(self, global_params, local_params, z_global, eps_local, layout, row_mask, args=None):
        mask = layout.flat_mask(row_mask, args)
        return self.guide.sample_local(
            local_params["guide"], global_params["guide"], z_global, eps_local, mask
        )

    # ------------------------------------------------------------- ELBO terms
    def server_term(self, global_params, eps_global) -> jax.Array:
        """``- log q(z_G)`` at ``z_G = f(eta_G, eps_G)``: the server's own term, which
        never evaluates the model."""
        g = global_params["guide"]
        z = self.global_latent(global_params, eps_global)
        gq = jax.lax.stop_gradient(g) if self.stl else g
        return -self.guide.log_prob_global(gq, z)

    def client_term(
        self, global_params, local_params, eps_global, eps_local, data: ClientData,
        prior_share: float = 0.0, scale: float = 1.0,
    ):
        """``w_j [log p(z_G) + log|J_G|] + s [log p(z_Lj, y_j | z_G) + log|J_L| - log q(z_Lj | z_G)]``
        for one client, on its own rows, with ``w_j = prior_share`` and ``s = scale``."""
        layout, local_constraints, _ = self.client_layout(data.args)
        z_g = self.global_latent(global_params, eps_global)
        z_l = self.local_latent(global_params, local_params, z_g, eps_local, layout, data.row_mask, data.args)
        latent = {**self.structure.global_latent.unravel(z_g), **layout.unravel(z_l)}
        params = {
            **constrain_params(global_params["theta"], self.global_constraints),
            **constrain_params(local_params["theta"], local_constraints),
        }
        lp = log_joint(
            self.model, data.args, self.model_kwargs, latent, params, _client_weights(prior_share, scale),
            self.structure.row_plate, data.row_mask,
        )
        gq, lq = global_params["guide"], local_params["guide"]
        if self.stl:
            gq, lq = jax.lax.stop_gradient(gq), jax.lax.stop_gradient(lq)
        mask = layout.flat_mask(data.row_mask, data.args)
        return lp - scale * self.guide.log_prob_local(lq, gq, z_g, z_l, mask)

    def local_size(self, data: ClientData) -> int:
        return self.client_layout(data.args)[0].size

    def constrained_sample(
        self, global_params, local_params, z_global, z_local, args, layout: Optional[SiteLayout] = None
    ) -> Dict[str, jax.Array]:
        """Constrained values of the latent sites for given unconstrained draws, and the
        model's ``numpyro.deterministic`` sites computed from them on ``args``.

        Without ``layout`` only the global latent sites are substituted.
        """
        latent, tr = self._substituted_trace(global_params, local_params, z_global, z_local, args, layout)
        values = {n: tr[n]["value"] for n in latent}
        skip = self.enumeration_dependent(args) if self.structure.enumerated else ()
        values.update({n: site["value"] for n, site in tr.items() if site["type"] == "deterministic" and n not in skip})
        return values

    def enumeration_dependent(self, args) -> Tuple[str, ...]:
        """:func:`~numpyro_fed.model.pointwise.enumeration_dependent` on ``args``, once per argument shapes."""
        key = tuple(sorted((k, jnp.shape(v)) for k, v in dict(args).items()))
        if key not in self._enum_dependent:
            self._enum_dependent[key] = enumeration_dependent(self.model, args, self.model_kwargs)
        return self._enum_dependent[key]

    def observed_sites(
        self, global_params, local_params, z_global, z_local, args, layout: SiteLayout, rng_key
    ) -> tuple:
        """``(log_likelihood, predictive)`` of the observed sites at one posterior draw, on
        the client's rows ``args``: each observed site's pointwise log density of the
        client's data (enumerated sites summed out, :mod:`numpyro_fed.model.pointwise`), and a draw of
        new data from it (a client's computation)."""
        latent, tr = self._substituted_trace(global_params, local_params, z_global, z_local, args, layout)
        values = {n: tr[n]["value"] for n in latent}
        values.update({n: site["value"] for n, site in tr.items() if site["type"] == "param"})
        return observed_terms(self.model, args, self.model_kwargs, values, rng_key)

    def _substituted_trace(self, global_params, local_params, z_global, z_local, args, layout, rng_key=None):
        """The model on ``args`` at the given draws. Enumerated sites, which have no draw,
        take a value from their conditional prior with ``rng_key`` (a posterior predictive
        draw then comes from the marginal ``p(y | z)``, as NumPyro's ``Predictive`` does
        without ``infer_discrete``)."""
        latent = dict(self.structure.global_latent.unravel(z_global))
        params = constrain_params(global_params["theta"], self.global_constraints)
        if layout is not None:
            latent.update(layout.unravel(z_local))
            _, local_constraints, _ = self.client_layout(args)
            params.update(constrain_params(local_params["theta"], local_constraints))

        def sub(msg):
            if msg["type"] == "sample" and msg["name"] in latent:
                return biject_to(msg["fn"].support)(latent[msg["name"]])
            if msg["type"] == "param" and msg["name"] in params:
                return params[msg["name"]]
            return None

        rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        tr = trace(substitute(seed(self.model, rng_key), substitute_fn=sub)).get_trace(
            **dict(args), **self.model_kwargs
        )
        return latent, tr

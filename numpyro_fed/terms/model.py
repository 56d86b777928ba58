"""An annotated model as the terms a federated family works with: each client's log-likelihood
of the global sites, its joint with its own local sites (their layout, padded entries and
Jacobians), the model's prior of the global sites, and that prior's Gaussian factor.

Pure functions of the model, its data and its structure (:func:`~numpyro_fed.model.structure.analyse_model`,
:func:`~numpyro_fed.run.backends.mapping.plan_clients`); a family composes them rather than
inheriting a family that has them. :func:`model_terms` builds the whole :class:`ModelTerms`;
:func:`local_joint` a client's joint for any local layout (EP's predictive sampler uses it on a
new client); :func:`gaussian_prior_factor` the prior's Gaussian factor and the rest, for the
families that keep ``q ∝ p prod_j t_j`` in one Gaussian family (PVI, EP).

:func:`build_terms` is the whole set-up of such a family but its algorithm (the model's
structure checked, the clients laid out, the terms built): PVI, EP, BCM, the federated Laplace
fit and federated Metropolis-within-Gibbs all call it. :func:`site_supports` and
:func:`user_space` take draws of the flat unconstrained global sites back to the model's sites.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.distributions.transforms import biject_to

from ..model.handlers import GLOBAL, LOCAL, site_role
from ..model.structure import (
    SiteLayout,
    analyse_model,
    deterministic_of_globals,
    global_deterministic_sites,
    is_latent,
    latent_supports,
    log_joint,
    make_layout,
    trace_model,
)
from ..model.trace import prior_median
from ..run.backends.mapping import client_data, plan_clients
from . import gaussian as G
from .prior_site import check_prior_is_data_free, check_prior_is_proper, split_prior

__all__ = ["PRIOR_FACTORS", "ModelTerms", "TermsSetup", "build_terms", "gaussian_prior_factor", "largest_layout",
           "local_joint", "model_terms", "own_entries", "global_values", "site_supports", "user_space"]

PRIOR_FACTORS = ("gaussian", "none")
"""``model_terms``'s ``prior_factor``: the prior's Gaussian factor read off the model, or none
(a zero factor: the family's server evaluates the prior itself, flat priors welcome)."""

_PARAMS = "{cls} approximates latent sites only; numpyro.param sites {names} have no prior. Give them one"

_PRIOR_FIX = (
    "{cls} keeps q = p * prod_j t_j in one Gaussian family, so every global site needs a "
    "Gaussian prior in unconstrained space (Normal; LogNormal for positive sites), or use "
    "nf.FederatedSVI"
)


class ModelTerms(NamedTuple):
    """A model's terms over the flat unconstrained global sites ``u`` (and a client's locals ``v``)."""

    prior: G.NaturalGaussian  # the prior's Gaussian factor (zero where the family evaluates the prior itself)
    log_lik: Callable  # (u, data) -> log p(y_j | u); global sites only (discrete local ones summed out)
    log_joint: Callable  # (w = [u, v], data) -> log p(y_j, v | u) with local Jacobians
    num_local: int
    local: SiteLayout
    sites: str
    log_prior: Callable  # u -> the model's own log p(u) of the global sites (Jacobians included): the check's target
    residual: Optional[Callable] = None  # u -> log p(u) - log prior(u): the server's site (non-Gaussian priors)
    layout: Optional[SiteLayout] = None  # the global sites' flat layout


def model_terms(model: Callable, model_kwargs: Mapping, clients, plan, structure, *, cls: str,
                prior_factor: str = "gaussian", diagonal: bool = False) -> ModelTerms:
    """The :class:`ModelTerms` of ``model`` on ``clients`` laid out by ``plan``.

    The prior of the global sites is read off the model by a client on its own rows (the server
    never runs the model), and a prior that moves with the data is refused. ``prior_factor``:
    ``"gaussian"`` (its Gaussian factor and the non-Gaussian rest, :func:`gaussian_prior_factor`;
    ``diagonal`` keeps the diagonal, refusing correlated priors) or ``"none"``. ``cls``: the
    family's name, for the messages."""
    if prior_factor not in PRIOR_FACTORS:
        raise ValueError(f"prior_factor={prior_factor!r}: choose one of {PRIOR_FACTORS}")
    layout, kwargs = structure.global_latent, dict(model_kwargs)
    d = layout.size

    def prior_on(args):
        def log_prior(u):
            return log_joint(model, args, kwargs, layout.unravel(u), {},
                             lambda s: is_latent(s) and site_role(s) == GLOBAL)
        return log_prior

    log_prior = prior_on(clients[clients.names[0]])
    check_prior_is_data_free(log_prior, prior_on(clients[clients.names[-1]]), d, clients.names, layout.names)

    def log_lik(u, data):  # (local sites, if any, are discrete and summed out with the data)
        return log_joint(model, data.args, kwargs, layout.unravel(u), {},
                         lambda s: s["type"] == "sample" and (s["is_observed"] or site_role(s) == LOCAL),
                         structure.row_plate, data.row_mask)

    local = largest_layout([structure.local_layout(trace_model(model, client_data(plan, j).args, kwargs))
                            for j in range(1 if plan.mapping == "vmap" else len(plan.names))])
    if prior_factor == "none":
        dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
        prior, residual = G.NaturalGaussian(jnp.zeros(d, dtype), jnp.zeros((d, d), dtype)), None
    else:
        start = prior_median(model, clients[clients.names[0]], kwargs, layout)
        prior, residual = gaussian_prior_factor(log_prior, layout, start, cls)
        if diagonal:
            if bool(jnp.any(jnp.abs(prior.precision - jnp.diag(jnp.diag(prior.precision))) > 0)):
                raise ValueError("family='diagonal' needs independent priors across the global sites")
            prior = G.NaturalGaussian(prior.shift, jnp.diag(prior.precision))
    # the check's target: the model's own prior (data-free, checked above), never the Gaussian factor
    return ModelTerms(prior, log_lik, local_joint(model, kwargs, structure, local), local.size, local,
                      ", ".join(layout.names), log_prior, residual, layout)


def gaussian_prior_factor(log_prior: Callable, layout: SiteLayout, start, cls: str):
    """``(prior, residual)``: the prior's Gaussian factor (where ``q`` starts) and the
    non-Gaussian rest, the server's site (``None`` for a Gaussian prior). A flat site is refused."""
    d = layout.size
    try:
        prior = G.quadratic_factor(log_prior, d, random.PRNGKey(1), what="the prior", sites=", ".join(layout.names),
                                   fix=_PRIOR_FIX.format(cls=cls))
        check_prior_is_proper(prior, layout, cls)
        return prior, None
    except ValueError as err:  # not Gaussian (or flat): its Gaussian part, and the rest a server site
        if "flat" in str(err):
            raise
        # a flat site among non-Gaussian ones (a Stan program's unstated prior): no curvature at all
        hess = np.asarray(jax.hessian(log_prior)(jnp.asarray(start)))
        check_prior_is_proper(G.NaturalGaussian(jnp.zeros(d), -jnp.asarray(hess)), layout, cls)
        return split_prior(log_prior, d, layout, cls, start)


def local_joint(model: Callable, model_kwargs: Mapping, structure, local: SiteLayout) -> Callable:
    """``(w = [u, v], data) -> log p(y_j, v | u)`` with the local sites' Jacobians, ``v`` laid out
    as ``local`` (a client with fewer local entries cuts its own; padded entries are a proper
    ``N(0, 1)``)."""
    layout, d, kwargs = structure.global_latent, structure.global_latent.size, dict(model_kwargs)

    def count(site):
        return site["type"] == "sample" and (site["is_observed"] or site_role(site) == LOCAL)

    def log_joint_local(w, data):
        u, v = w[:d], w[d:]
        own = local
        if local.size:  # a client with fewer local entries than the largest (unpadded, one by one)
            own = structure.local_layout(trace_model(model, data.args, kwargs))
        values, real = own_entries(local, own, v, data)
        lp = log_joint(model, data.args, kwargs, {**layout.unravel(u), **values}, {}, count,
                       structure.row_plate, data.row_mask)
        return lp - 0.5 * jnp.sum((1.0 - real) * v**2)  # padded local entries: a proper N(0, 1)

    return log_joint_local


class TermsSetup(NamedTuple):
    """``Setup.extra`` of the families built on a model's terms: its structure and its terms."""

    structure: Any
    terms: ModelTerms


def build_terms(model: Callable, model_kwargs: Mapping, clients, *, cls: str, client_mapping: str,
                row_plate: Optional[str], prior_factor: str = "gaussian", diagonal: bool = False,
                check_structure: Optional[Callable] = None,
                adjust_structure: Optional[Callable] = None):
    """``(plan, TermsSetup)``: ``model`` on ``clients`` as a family of class ``cls`` fits it.

    The model's structure (:func:`~numpyro_fed.model.structure.analyse_model`) must have global
    latent sites and no ``numpyro.param`` sites; ``check_structure(structure)`` may refuse more,
    and ``adjust_structure(clients, structure)`` change it once the clients are laid out
    (:func:`~numpyro_fed.run.backends.mapping.plan_clients`, ``client_mapping`` and ``row_plate``
    as the families take them). A family without a DP mechanism refuses a ``dp_noise``-marked model
    before it calls this (:func:`~numpyro_fed.dp.plan.refuse_dp`). ``prior_factor`` and
    ``diagonal``: as :func:`model_terms`."""
    structure = analyse_model(model, clients, model_kwargs)
    if structure.global_param or structure.local_param_names:
        names = sorted(structure.global_param) + list(structure.local_param_names)
        raise ValueError(_PARAMS.format(cls=cls, names=names))
    if not structure.global_latent.names:
        raise ValueError(f"{cls} approximates the global latent sites, and the model has none")
    if check_structure is not None:
        check_structure(structure)
    plan, structure = plan_clients(model, model_kwargs, clients, structure, client_mapping, row_plate)
    if adjust_structure is not None:
        structure = adjust_structure(clients, structure)
    terms = model_terms(model, model_kwargs, clients, plan, structure, cls=cls, prior_factor=prior_factor,
                        diagonal=diagonal)
    return plan, TermsSetup(structure, terms)


def site_supports(model: Callable, model_kwargs: Mapping, setup, args=None) -> Dict[str, Any]:
    """The latent sites' supports, from a trace on ``args`` (default: the first client's data of
    ``setup``, traced once per set-up and kept in ``setup.cache``)."""
    if args is not None:
        return latent_supports(trace_model(model, args, model_kwargs))
    if "supports" not in setup.cache:
        setup.cache["supports"] = site_supports(model, model_kwargs, setup, setup.inputs[setup.inputs.names[0]])
    return setup.cache["supports"]


def user_space(model: Callable, model_kwargs: Mapping, setup, u) -> Dict[str, np.ndarray]:
    """Draws ``u`` (``(n, d)``) of the flat unconstrained global sites as the model's sites,
    constrained: ``{site: (n, *shape)}``."""
    layout, supports = setup.extra.structure.global_latent, site_supports(model, model_kwargs, setup)
    return {k: np.asarray(biject_to(supports[k])(v)) for k, v in jax.vmap(layout.unravel)(u).items()}


def global_values(model: Callable, model_kwargs: Mapping, setup, u) -> Dict[str, jax.Array]:
    """Draws ``u`` (``(..., d)``) of the flat unconstrained global sites as the model reads
    them: the global sites, constrained, and the ``numpyro.deterministic`` sites that are
    functions of the global sites alone (computed on the first client's rows; per-row and local
    ones have no value at a global draw and are left out): ``{site: (..., *shape)}``. The
    reading every family's global draws share, a Gaussian's or a chain's; compiled once per
    set-up."""
    if "global_values" not in setup.cache:
        layout, supports = setup.extra.structure.global_latent, site_supports(model, model_kwargs, setup)
        names = global_deterministic_sites(model, model_kwargs, setup.inputs, layout.names)
        first = setup.inputs[setup.inputs.names[0]]
        deterministic = deterministic_of_globals(model, model_kwargs, first, names) if names else None

        def one(z):
            values = {k: biject_to(supports[k])(v) for k, v in layout.unravel(z).items()}
            return {**values, **deterministic(values)} if deterministic is not None else values

        setup.cache["global_values"] = jax.jit(jax.vmap(one))
    u = jnp.asarray(u)
    flat = setup.cache["global_values"](jnp.reshape(u, (-1, u.shape[-1])))
    return {k: jnp.reshape(v, u.shape[:-1] + v.shape[1:]) for k, v in flat.items()}


def largest_layout(layouts) -> SiteLayout:
    """The local layout whose every site has the largest of the clients' shapes (clients laid out
    one by one may hold different numbers of rows or groups)."""
    first = layouts[0]
    shapes = [tuple(max(dims) for dims in zip(*(lay.shapes[i] for lay in layouts))) for i in range(len(first.names))]
    if all(tuple(s) == tuple(f) for s, f in zip(shapes, first.shapes)):
        return first
    groups = first.group_axes or ((),) * len(first.names)
    plates = first.plate_axes or ((),) * len(first.names)
    return make_layout([(n, s, a, g, p) for n, s, a, g, p in zip(first.names, shapes, first.row_axes, groups, plates)])


def own_entries(local: SiteLayout, own: SiteLayout, v, data):
    """A client's own local values cut from the flat ``v`` of the largest layout, and the mask
    (in ``v``'s layout) of its real entries (1) against padding (0)."""
    full = local.unravel(v)
    mask = own.flat_mask(data.row_mask, data.args) if own.size else jnp.zeros(0)
    values, real, at = {}, [], 0
    for name, shape, own_shape in zip(local.names, local.shapes, own.shapes):
        cut = tuple(slice(0, k) for k in own_shape)
        values[name] = full[name][cut]
        n = int(np.prod(own_shape))
        part = jnp.reshape(mask[at:at + n], own_shape)
        at += n
        real.append(jnp.reshape(jnp.zeros(shape, v.dtype).at[cut].set(part), -1))
    return values, (jnp.concatenate(real) if real else jnp.zeros(0, v.dtype))

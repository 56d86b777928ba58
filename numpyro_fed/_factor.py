"""What PVI and EP share at the model level: Gaussian factors over the global sites.

Both keep ``q(theta) ∝ p(theta) prod_j t_j(theta)`` in one Gaussian family over the flat
unconstrained global latent sites, run the same protocol
(:func:`~numpyro_fed.algorithms.pvi.factor_protocol`) and differ only in the client's local
fit. This module turns an annotated model and an :class:`~numpyro_fed.Clients` into that
protocol's inputs (the prior factor, each client's log-likelihood with and without its
local latent sites) and runs it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.distributions.transforms import biject_to

from . import gaussian as G
from ._structure import SiteLayout, analyse_model, is_latent, log_joint, trace_model
from .algorithms.pvi import SCHEDULES, PVIInfo
from .clients import Clients
from .handlers import GLOBAL, LOCAL, site_role
from .simulation import client_data, init_clients, keep_active, map_clients, plan_clients
from .transcript import Communication, message_bytes

__all__ = ["FactorInference", "FactorRunResult", "FactorState", "ModelTerms"]

_CLIENTS = "{cls}.run/init need an nf.Clients object (e.g. nf.Clients.split(groups, x=x, y=y)); got {kind}"
_PARAMS = "{cls} approximates latent sites only; numpyro.param sites {names} have no prior. Give them one"
_PRIOR_FIX = (
    "{cls} keeps q = p * prod_j t_j in one Gaussian family, so every global site needs a "
    "Gaussian prior in unconstrained space (Normal; LogNormal for positive sites), or use "
    "nf.FederatedSVI"
)


class FactorState(NamedTuple):
    server: Any
    clients: Any
    message: Any
    rng_key: jax.Array


class FactorRunResult(NamedTuple):
    """What ``PVI.run`` and ``EP.run`` return.

    Attributes:
        mean, cov: moments of ``q`` over the flat unconstrained global sites (``cov`` is a
            variance vector for ``family="diagonal"``).
        state: the final state (pass as ``init_state=``).
        info: per round, the damping applied (0 = rejected), the halvings it took and the
            number of active clients whose cavity was improper.
        communication: rounds, bytes and messages each way (active clients only).
    """

    mean: jax.Array
    cov: jax.Array
    state: FactorState
    info: PVIInfo
    communication: Communication


class ModelTerms(NamedTuple):
    """The protocol's inputs, built from the model (see :meth:`FactorInference._terms`)."""

    prior: G.NaturalGaussian
    log_lik: Callable  # (u, data) -> log p(y_j | u); global sites only
    log_joint: Callable  # (w = [u, v], data) -> log p(y_j, v | u) with local Jacobians
    num_local: int
    local: SiteLayout
    sites: str


class _Setup(NamedTuple):
    clients: Clients
    plan: Any
    structure: Any
    terms: ModelTerms
    algorithm: Any
    round_fn: Any
    scan_fn: Any
    cache: dict  # per-round message bytes; the sites' supports


class FactorInference:
    """Base of :class:`~numpyro_fed.PVI` and :class:`~numpyro_fed.EP` (not used directly)."""

    method = "factor"

    def __init__(self, model, *, family, schedule, damping, subset_size, max_halvings, backend, row_plate,
                 model_kwargs) -> None:
        if family not in ("full", "diagonal"):
            raise ValueError(f"family={family!r}: choose 'full' or 'diagonal'")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
        if not 0 < damping <= 1:
            raise ValueError(f"damping={damping}: must be in (0, 1]")
        self.model = model
        self.family, self.schedule = family, schedule
        self.damping, self.subset_size, self.max_halvings = float(damping), int(subset_size), int(max_halvings)
        self.backend, self.row_plate = backend, row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self._setup_cache: Optional[_Setup] = None

    # ------------------------------------------------------------------ hooks
    def _check_structure(self, structure) -> None:
        """Raise for models this method cannot fit."""

    def _adjust_structure(self, clients: Clients, structure):
        return structure

    def _algorithm(self, terms: ModelTerms, plan, num_clients: int):
        raise NotImplementedError

    # ------------------------------------------------------------------ set-up
    def _terms(self, clients: Clients, plan, structure) -> ModelTerms:
        layout, kwargs, template = structure.global_latent, self.model_kwargs, clients.template()
        d, cls = layout.size, type(self).__name__

        def log_prior(u):
            return log_joint(self.model, template, kwargs, layout.unravel(u), {},
                             lambda s: is_latent(s) and site_role(s) == GLOBAL)

        def log_lik(u, data):
            return log_joint(self.model, data.args, kwargs, layout.unravel(u), {},
                             lambda s: s["type"] == "sample" and s["is_observed"], structure.row_plate, data.row_mask)

        local = structure.local_layout(trace_model(self.model, client_data(plan, 0).args, kwargs))
        log_joint_local = self._joint(structure, local)

        sites = ", ".join(layout.names)
        prior = G.quadratic_factor(log_prior, d, random.PRNGKey(1), what="the prior", sites=sites,
                                   fix=_PRIOR_FIX.format(cls=cls))
        if self.family == "diagonal":
            if bool(jnp.any(jnp.abs(prior.precision - jnp.diag(jnp.diag(prior.precision))) > 0)):
                raise ValueError("family='diagonal' needs independent priors across the global sites")
            prior = G.NaturalGaussian(prior.shift, jnp.diag(prior.precision))
        return ModelTerms(prior, log_lik, log_joint_local, local.size, local, sites)

    def _joint(self, structure, local: SiteLayout) -> Callable:
        """``(w = [u, v], data) -> log p(y_j, v | u)`` with the local sites' Jacobians."""
        layout, d = structure.global_latent, structure.global_latent.size

        def count(site):
            return site["type"] == "sample" and (site["is_observed"] or site_role(site) == LOCAL)

        def log_joint_local(w, data):
            u, v = w[:d], w[d:]
            values = {**layout.unravel(u), **local.unravel(v)}
            lp = log_joint(self.model, data.args, self.model_kwargs, values, {}, count, structure.row_plate,
                           data.row_mask)
            pad = 1.0 - local.flat_mask(data.row_mask) if local.size else jnp.zeros(0)
            return lp - 0.5 * jnp.sum(pad * v**2)  # padded local entries: a proper N(0, 1)

        return log_joint_local

    def _setup(self, clients: Clients) -> _Setup:
        cls = type(self).__name__
        if not isinstance(clients, Clients):
            raise TypeError(_CLIENTS.format(cls=cls, kind=type(clients).__name__))
        if self._setup_cache is not None and self._setup_cache.clients is clients:
            return self._setup_cache
        first = clients.names[0]
        structure = analyse_model(self.model, clients[first], clients.template(), self.model_kwargs, first)
        if structure.global_param or structure.local_param_names:
            names = sorted(structure.global_param) + list(structure.local_param_names)
            raise ValueError(_PARAMS.format(cls=cls, names=names))
        if not structure.global_latent.names:
            raise ValueError(f"{cls} approximates the global latent sites, and the model has none")
        self._check_structure(structure)
        plan, structure = plan_clients(self.model, self.model_kwargs, clients, structure, self.backend, self.row_plate)
        structure = self._adjust_structure(clients, structure)
        terms = self._terms(clients, plan, structure)
        alg = self._algorithm(terms, plan, len(clients))

        def one_round(state: FactorState, data):
            key, k_clients, k_server = random.split(state.rng_key, 3)
            active = state.server.active
            keys = random.split(k_clients, len(clients))
            new_clients, messages = map_clients(plan, alg.client_step, keys, state.clients, state.message, data)
            new_clients = keep_active(plan, active, new_clients, state.clients)
            server, message, info = alg.server_step(k_server, state.server, messages, active)
            if plan.backend == "vmap":
                accepted = jax.vmap(alg.client_accept, in_axes=(0, None))(new_clients, info.damping)
            else:
                accepted = tuple(alg.client_accept(s, info.damping) for s in new_clients)
            new_clients = keep_active(plan, active, accepted, new_clients)
            return FactorState(server, new_clients, message, key), (info, messages, active)

        @partial(jax.jit, static_argnums=2)
        def scan_fn(state, data, num_rounds):
            def body(s, _):
                s, (info, _, active) = one_round(s, data)
                return s, (info, jnp.sum(active))

            return jax.lax.scan(body, state, None, length=num_rounds)

        self._setup_cache = _Setup(clients, plan, structure, terms, alg, jax.jit(one_round), scan_fn, {})
        return self._setup_cache

    # ------------------------------------------------------------------ API
    def init(self, rng_key: jax.Array, clients: Clients) -> FactorState:
        """``q`` starts at the prior and every ``t_j`` at 1."""
        setup = self._setup(clients)
        k_server, k_clients, key = random.split(rng_key, 3)
        server, message = setup.algorithm.init_server(k_server)
        keys = random.split(k_clients, len(clients))
        states = init_clients(setup.plan, setup.algorithm.init_client, keys, setup.plan.data)
        return FactorState(server, states, message, key)

    def update(self, state: FactorState, clients: Clients) -> tuple:
        """One round (jit-compiled). Returns ``(state, info)``."""
        setup = self._setup(clients)
        state, (info, _, _) = setup.round_fn(state, setup.plan.data)
        return state, info

    def run(self, rng_key: jax.Array, num_rounds: int, clients: Clients, *,
            init_state: Optional[FactorState] = None) -> FactorRunResult:
        """``num_rounds`` rounds in one ``lax.scan``."""
        if int(num_rounds) != num_rounds or num_rounds < 1:
            raise ValueError(f"num_rounds={num_rounds}: must be a positive integer")
        setup = self._setup(clients)
        state = self.init(rng_key, clients) if init_state is None else init_state
        if "bytes_up" not in setup.cache:  # traced once per set-up
            msg_shape = jax.eval_shape(lambda s: setup.round_fn(s, setup.plan.data)[1][1], state)
            setup.cache["bytes_up"] = message_bytes(msg_shape) // len(clients)  # stacked over clients
        state, (info, n_active) = setup.scan_fn(state, setup.plan.data, int(num_rounds))
        per_up = setup.cache["bytes_up"]
        per_down = message_bytes(state.message)
        n = int(np.sum(np.asarray(n_active)))
        comm = Communication(int(num_rounds), per_up * n, (per_down + 4) * n, n, 2 * n)
        mean, cov = G.to_moments(state.server.q)
        return FactorRunResult(mean, cov, state, info, comm)

    def _fitted(self) -> _Setup:
        if self._setup_cache is None:
            raise ValueError(f"sample_posterior needs a fitted {type(self).__name__}: call run() or init() first")
        return self._setup_cache

    def _supports(self, args=None) -> Dict[str, Any]:
        """Latent sites' supports, from a trace on ``args`` (default: the template, traced
        once per set-up)."""
        if args is not None:
            return _latent_supports(trace_model(self.model, args, self.model_kwargs))
        setup = self._fitted()
        if "supports" not in setup.cache:
            setup.cache["supports"] = self._supports(setup.clients.template())
        return setup.cache["supports"]

    def sample_posterior(self, rng_key: jax.Array, result, num_samples: int) -> Dict[str, jax.Array]:
        """Draws of the global sites from ``q``, constrained."""
        setup = self._fitted()
        state = result.state if isinstance(result, FactorRunResult) else result
        q = state.server.q
        eps = random.normal(rng_key, (num_samples, q.shift.shape[0]))
        u = jax.vmap(lambda e: G.sample(q, e))(eps)
        layout = setup.structure.global_latent
        supports = self._supports()
        return {k: biject_to(supports[k])(v) for k, v in jax.vmap(layout.unravel)(u).items()}


def _latent_supports(tr) -> Dict[str, Any]:
    return {n: s["fn"].support for n, s in tr.items() if is_latent(s)}

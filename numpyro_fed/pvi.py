"""``PVI``: partitioned variational inference over a model's global sites (paper 002 §3.1)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.distributions.transforms import biject_to

from . import gaussian as G
from ._structure import analyse_model, is_latent, log_joint, trace_model
from .algorithms.pvi import SCHEDULES, VARIANTS, PVIInfo, pvi
from .clients import Clients
from .handlers import GLOBAL, site_role
from .simulation import init_clients, keep_active, map_clients, plan_clients
from .transcript import Communication, message_bytes

__all__ = ["PVI", "PVIRunResult", "PVIState"]

_CLIENTS = "PVI.run/init need an nf.Clients object (e.g. nf.Clients.split(groups, x=x, y=y)); got {kind}"
_LOCAL = (
    "PVI does not support local latent sites yet ({names}): only global sites are "
    "approximated; fit this model with nf.FederatedSVI"
)
_PARAMS = "PVI approximates latent sites only; numpyro.param sites {names} have no prior. Give them one"
_PRIOR_FIX = (
    "PVI keeps q = p * prod_j t_j in one Gaussian family, so every global site needs a "
    "Gaussian prior in unconstrained space (Normal; LogNormal for positive sites), or use "
    "nf.FederatedSVI"
)
_CONJ_FIX = "use update='optax' (stochastic optimisation of the local ELBO)"
_SHARDS = "client '{client}' has {rows} rows, fewer than num_shards={n}; use fewer shards"
_SHARD_PLATE = (
    "variant= splits each client's rows into shards, which needs the plate that indexes rows; "
    "plates of the client's row count: {found}. Pass row_plate="
)
_OPTIM = "update='optax' needs optim=, an optax GradientTransformation such as optax.adam(1e-2)"


class PVIState(NamedTuple):
    server: Any
    clients: Any
    message: Any
    rng_key: jax.Array


class PVIRunResult(NamedTuple):
    """What :meth:`PVI.run` returns.

    Attributes:
        mean, cov: moments of ``q`` over the flat unconstrained global sites (``cov`` is a
            variance vector for ``family="diagonal"``).
        state: the final :class:`PVIState` (pass as ``init_state=``).
        info: per round, the damping applied (0 = rejected) and the halvings it took.
        communication: rounds, bytes and messages each way (active clients only).
    """

    mean: jax.Array
    cov: jax.Array
    state: PVIState
    info: PVIInfo
    communication: Communication


class _Setup(NamedTuple):
    clients: Clients
    plan: Any
    structure: Any
    algorithm: Any
    round_fn: Any
    scan_fn: Any
    cache: dict  # per-round message bytes; the global sites' supports


class PVI:
    """Partitioned variational inference (Ashman et al., 2022; paper 002 Algorithm 1).

    Approximates the posterior of the model's global latent sites by
    ``q(theta) ∝ p(theta) prod_j t_j(theta)``, Gaussian in unconstrained space. Each round the
    chosen clients fit their local ELBO against the cavity ``q / t_j`` on their own data and
    send one natural-parameter update ``Delta t_j``; the server applies them with damping and
    a positive-definiteness safeguard.

    Args:
        model: a NumPyro model whose latent sites are global (``local_site`` sites are not
            supported yet) with Gaussian priors in unconstrained space.
        family: ``"full"`` or ``"diagonal"`` covariance.
        update: ``"conjugate"`` (closed form; the model's log-likelihood must be quadratic
            in the global sites, e.g. Bayesian linear regression with known noise) or
            ``"optax"``.
        schedule: ``"sequential"``, ``"synchronous"`` or ``"subset"``.
        damping: ``delta`` in ``(0, 1]``.
        subset_size: clients per round for ``schedule="subset"``.
        optim: optax optimiser for ``update="optax"``.
        local_steps: optimiser steps per local update.
        num_particles: Monte Carlo draws per local ELBO estimate.
        max_halvings: PD safeguard (see :func:`~numpyro_fed.algorithms.pvi`).
        variant: ``"plain"`` (Alg. 1), ``"local_averaging"`` (paper 002 Alg. 2) or
            ``"virtual"`` (Alg. 3, virtual clients); see :func:`~numpyro_fed.algorithms.pvi`.
        num_shards: shards per client for the two variants (every client needs at least
            that many rows).
        backend: how clients are mapped, as in :class:`~numpyro_fed.FederatedSVI`.
        row_plate: the plate that indexes rows (for padding unequal clients).
        model_kwargs: non-data keyword arguments of the model.

    Examples:
        >>> import jax, numpy as np, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x, y):
        ...     w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)
        >>> x = np.random.default_rng(0).normal(size=(60, 2)); y = x @ np.array([1.0, -1.0])
        >>> clients = nf.Clients.split(np.repeat([0, 1, 2], 20), x=x, y=y)
        >>> res = nf.PVI(model, schedule="sequential").run(jax.random.PRNGKey(0), 3, clients)
        >>> np.round(res.mean, 1)
        Array([ 1., -1.], dtype=float32)

    References:
        Ashman, Bui, Nguyen, Markou, Weller, Swaroop, Turner (2022), "Partitioned
        variational inference: a framework for probabilistic federated learning"; paper
        002 §3.1.
    """

    def __init__(
        self,
        model: Callable,
        *,
        family: str = "full",
        update: str = "conjugate",
        schedule: str = "synchronous",
        damping: float = 1.0,
        subset_size: int = 1,
        optim: Any = None,
        local_steps: int = 100,
        num_particles: int = 8,
        max_halvings: int = 10,
        variant: str = "plain",
        num_shards: int = 1,
        backend: str = "auto",
        row_plate: Optional[str] = None,
        model_kwargs: Optional[dict] = None,
    ) -> None:
        if family not in ("full", "diagonal"):
            raise ValueError(f"family={family!r}: choose 'full' or 'diagonal'")
        if update not in ("conjugate", "optax"):
            raise ValueError(f"update={update!r}: choose 'conjugate' or 'optax'")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
        if not 0 < damping <= 1:
            raise ValueError(f"damping={damping}: must be in (0, 1]")
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: choose one of {VARIANTS}")
        if int(num_shards) != num_shards or num_shards < 1 or (variant == "plain" and num_shards != 1):
            raise ValueError(f"num_shards={num_shards}: a positive integer, and 1 unless variant= splits the data")
        if update == "optax" and not (hasattr(optim, "init") and hasattr(optim, "update")):
            raise ValueError(_OPTIM)
        self.model = model
        self.family, self.update_kind, self.schedule = family, update, schedule
        self.damping, self.subset_size, self.max_halvings = float(damping), int(subset_size), int(max_halvings)
        self.optim, self.local_steps, self.num_particles = optim, int(local_steps), int(num_particles)
        self.variant, self.num_shards = variant, int(num_shards)
        self.backend, self.row_plate = backend, row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self._setup_cache: Optional[_Setup] = None

    # ------------------------------------------------------------------ set-up
    def _setup(self, clients: Clients) -> _Setup:
        if not isinstance(clients, Clients):
            raise TypeError(_CLIENTS.format(kind=type(clients).__name__))
        if self._setup_cache is not None and self._setup_cache.clients is clients:
            return self._setup_cache
        first = clients.names[0]
        structure = analyse_model(self.model, clients[first], clients.template(), self.model_kwargs, first)
        if structure.local_latent_names:
            raise ValueError(_LOCAL.format(names=list(structure.local_latent_names)))
        if structure.global_param or structure.local_param_names:
            raise ValueError(_PARAMS.format(names=sorted(structure.global_param) + list(structure.local_param_names)))
        plan, structure = plan_clients(self.model, self.model_kwargs, clients, structure, self.backend, self.row_plate)
        if self.variant != "plain":
            structure = structure._replace(row_plate=self._shard_plate(clients, structure.row_plate))
        layout, kwargs, template = structure.global_latent, self.model_kwargs, clients.template()
        d = layout.size

        def log_prior(u):
            return log_joint(self.model, template, kwargs, layout.unravel(u), {},
                             lambda s: is_latent(s) and site_role(s) == GLOBAL)

        def client_log_lik(u, data):
            return log_joint(self.model, data.args, kwargs, layout.unravel(u), {},
                             lambda s: s["type"] == "sample" and s["is_observed"], structure.row_plate, data.row_mask)

        sites = ", ".join(layout.names)
        prior = G.quadratic_factor(log_prior, d, random.PRNGKey(1), what="the prior", sites=sites, fix=_PRIOR_FIX)
        if self.family == "diagonal":
            if bool(jnp.any(jnp.abs(prior.precision - jnp.diag(jnp.diag(prior.precision))) > 0)):
                raise ValueError("family='diagonal' needs independent priors across the global sites")
            prior = G.NaturalGaussian(prior.shift, jnp.diag(prior.precision))
        if self.update_kind == "conjugate":  # each client checks its own likelihood

            def change(data):
                return G.hessian_change(partial(client_log_lik, data=data), d, random.PRNGKey(2))

            if plan.backend == "vmap":
                changes = jax.jit(jax.vmap(change))(plan.data)
            else:
                changes = [jax.jit(change)(data) for data in plan.data]
            for name, c in zip(plan.names, changes):
                G.check_quadratic(c, what=f"client '{name}''s log-likelihood", sites=sites, fix=_CONJ_FIX)
        alg = pvi(
            prior, client_log_lik, len(clients), update=self.update_kind, schedule=self.schedule,
            damping=self.damping, max_halvings=self.max_halvings, subset_size=self.subset_size,
            optim=self.optim, local_steps=self.local_steps, num_particles=self.num_particles,
            variant=self.variant, num_shards=self.num_shards,
        )

        def one_round(state: PVIState, data):
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
            return PVIState(server, new_clients, message, key), (info, messages, active)

        @partial(jax.jit, static_argnums=2)
        def scan_fn(state, data, num_rounds):
            def body(s, _):
                s, (info, _, active) = one_round(s, data)
                return s, (info, jnp.sum(active))

            return jax.lax.scan(body, state, None, length=num_rounds)

        self._setup_cache = _Setup(clients, plan, structure, alg, jax.jit(one_round), scan_fn, {})
        return self._setup_cache

    def _shard_plate(self, clients: Clients, plate: Optional[str]) -> str:
        """The plate that indexes rows, needed to mask a client's shards."""
        for name, rows in clients.num_rows.items():
            if rows < self.num_shards:
                raise ValueError(_SHARDS.format(client=name, rows=rows, n=self.num_shards))
        if plate is not None:
            return plate
        first = clients.names[0]
        tr = trace_model(self.model, clients[first], self.model_kwargs)
        found = [n for n, site in tr.items() if site["type"] == "plate" and site["args"][0] == clients.num_rows[first]]
        if len(found) != 1:
            raise ValueError(_SHARD_PLATE.format(found=found))
        return found[0]

    # ------------------------------------------------------------------ API
    def init(self, rng_key: jax.Array, clients: Clients) -> PVIState:
        """``q`` starts at the prior and every ``t_j`` at 1."""
        setup = self._setup(clients)
        k_server, k_clients, key = random.split(rng_key, 3)
        server, message = setup.algorithm.init_server(k_server)
        keys = random.split(k_clients, len(clients))
        states = init_clients(setup.plan, setup.algorithm.init_client, keys, setup.plan.data)
        return PVIState(server, states, message, key)

    def update(self, state: PVIState, clients: Clients) -> tuple:
        """One round (jit-compiled). Returns ``(state, info)``."""
        setup = self._setup(clients)
        state, (info, _, _) = setup.round_fn(state, setup.plan.data)
        return state, info

    def run(self, rng_key: jax.Array, num_rounds: int, clients: Clients, *, init_state: Optional[PVIState] = None) -> PVIRunResult:
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
        return PVIRunResult(mean, cov, state, info, comm)

    def sample_posterior(self, rng_key: jax.Array, result: "PVIRunResult | PVIState", num_samples: int) -> Dict[str, jax.Array]:
        """Draws of the global sites from ``q``, constrained."""
        if self._setup_cache is None:
            raise ValueError("sample_posterior needs a fitted PVI: call run() or init() first")
        state = result.state if isinstance(result, PVIRunResult) else result
        q = state.server.q
        eps = random.normal(rng_key, (num_samples, q.shift.shape[0]))
        u = jax.vmap(lambda e: G.sample(q, e))(eps)
        layout = self._setup_cache.structure.global_latent
        cache = self._setup_cache.cache
        if "supports" not in cache:  # the model is traced once per set-up
            cache["supports"] = _supports(self.model, self._setup_cache.clients.template(), self.model_kwargs,
                                          layout.names)
        supports = cache["supports"]
        return {k: biject_to(supports[k])(v) for k, v in jax.vmap(layout.unravel)(u).items()}


def _supports(model, template, kwargs, names):
    tr = trace_model(model, template, kwargs)
    return {n: tr[n]["fn"].support for n in names}

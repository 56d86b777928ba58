"""``FederatedSVI``: the class layer over SFVI and SFVI-Avg, mirroring ``numpyro.infer.SVI``."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._structure import analyse_model, trace_model
from ..backends.mapping import client_data, client_item, plan_clients
from ..clients import Clients
from ..inference import FederatedInference, Setup
from ..protocol import RunResult, RunState
from .guides import StructuredGuide
from .objective import FederatedObjective
from .sfvi_algorithm import sfvi
from .sfvi_avg_algorithm import sfvi_avg

__all__ = ["FederatedSVI"]

METHODS = ("sfvi", "sfvi_avg")
_OPTIM = (
    "optim must be an optax GradientTransformation such as optax.adam(1e-2); got {kind}. "
    "NumPyro optimisers (numpyro.optim.Adam) are not accepted: use the optax equivalent"
)
_CLIENTS = "clients must be an nf.Clients; got {kind}. Build one with nf.Clients({{...}}) or nf.Clients.split(...)"
_UNKNOWN_CLIENT = "no client named {name!r}; clients are {names}"


def check_positive_int(name: str, value) -> int:
    """``value`` as an int, or a ValueError naming the argument."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name}={value}: must be a positive integer")
    return int(value)


class FederatedSVI(FederatedInference):
    """Federated stochastic variational inference.

    Args:
        model: a NumPyro model annotated with :func:`~numpyro_fed.global_site` /
            :func:`~numpyro_fed.local_site`, called as ``model(**client_args, **model_kwargs)``.
        guide: a :class:`~numpyro_fed.StructuredGuide` (or ``MeanFieldGuide``).
        optim: an ``optax.GradientTransformation``.
        method: ``"sfvi"`` (paper 001 Alg. 1; exact, one gradient exchange per step) or
            ``"sfvi_avg"`` (Alg. 2; ``local_steps`` local steps, then barycenter averaging).
        num_particles: Monte Carlo draws per step.
        stl: sticking-the-landing gradient estimator.
        local_steps: m for ``"sfvi_avg"``.
        participation: fraction of clients asked per round for ``"sfvi_avg"``.
        client_mapping: how the simulation maps clients: ``"auto"``, ``"vmap"`` or
            ``"loop"`` (see :mod:`numpyro_fed.backends.mapping`).
        row_plate: the plate that indexes rows, when clients of unequal size are padded
            and more than one plate follows the row count.
        model_kwargs: non-data keyword arguments passed to every call of the model.

    Examples:
        >>> import numpy as np, optax, jax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> clients = nf.Clients.split(np.arange(40) % 2, y=np.linspace(0.0, 2.0, 40))
        >>> svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.1))
        >>> result = svi.run(jax.random.PRNGKey(0), 300, clients, progress_bar=False)
        >>> bool(abs(result.params["guide"]["loc"][0] - 1.0) < 0.2)
        True
    """

    def __init__(
        self,
        model: Callable,
        guide: StructuredGuide,
        optim: optax.GradientTransformation,
        *,
        method: str = "sfvi",
        num_particles: int = 1,
        stl: bool = False,
        local_steps: int = 10,
        participation: float = 1.0,
        client_mapping: str = "auto",
        row_plate: Optional[str] = None,
        model_kwargs: Optional[dict] = None,
    ) -> None:
        if not callable(model):
            raise TypeError(f"model must be a callable NumPyro model; got {type(model).__name__}")
        if not isinstance(guide, StructuredGuide):
            raise TypeError(
                f"guide must be an nf.StructuredGuide or nf.MeanFieldGuide; got {type(guide).__name__}"
            )
        if not (hasattr(optim, "init") and hasattr(optim, "update")) or hasattr(optim, "get_params"):
            raise TypeError(_OPTIM.format(kind=type(optim).__name__))
        if method not in METHODS:
            raise ValueError(f"method={method!r}: choose one of {METHODS}")
        if not (0.0 < participation <= 1.0):
            raise ValueError(f"participation={participation}: must be in (0, 1]")
        if method == "sfvi" and participation != 1.0:
            raise ValueError(
                "participation < 1 is for method='sfvi_avg'; SFVI's gradient is exact only "
                "when every client answers each round"
            )
        self.model = model
        self.guide = guide
        self.optim = optim
        self.method = method
        self.num_particles = check_positive_int("num_particles", num_particles)
        self.stl = stl
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.participation = float(participation)
        self.client_mapping = client_mapping
        self.row_plate = row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self._init_inference()

    # ------------------------------------------------------------------ set-up
    def _validate_inputs(self, clients) -> None:
        if not isinstance(clients, Clients):
            raise TypeError(_CLIENTS.format(kind=type(clients).__name__))

    def _build(self, clients: Clients) -> Setup:
        structure = analyse_model(self.model, clients, self.model_kwargs)
        plan, structure = plan_clients(
            self.model, self.model_kwargs, clients, structure, self.client_mapping, self.row_plate
        )
        objective = FederatedObjective(
            self.model, self.guide, structure, clients.template(), self.model_kwargs, self.stl
        )
        J = len(clients)
        if self.method == "sfvi":
            algorithm = sfvi(objective, self.optim, J, num_particles=self.num_particles)
        else:
            algorithm = sfvi_avg(
                objective, self.optim, J, clients.total_rows,
                local_steps=self.local_steps, participation=self.participation,
                num_particles=self.num_particles,
            )
        return Setup(clients, algorithm, plan, objective, {})

    def _params(self, setup: Setup, state: RunState) -> Dict:
        return state.server.global_params

    # ------------------------------------------------------------------ SVI API
    def init(self, rng_key, clients: Clients) -> RunState:
        """Initial states: the server's, and every client's (each initialises its own
        parameters and keeps its own PRNG key)."""
        return self._init(rng_key, clients)

    def update(self, state: RunState, clients: Clients):
        """One communication round (jit-compiled). Returns ``(state, loss)`` with ``loss = -ELBO``."""
        state, info = self._update(state, clients)
        return state, -info.elbo

    def get_params(self, state: RunState) -> Dict:
        """The server-held parameters."""
        return state.server.global_params

    def run(self, rng_key: jax.Array, num_rounds: int, clients: Clients, **options: Any) -> RunResult:
        """Run ``num_rounds`` communication rounds on the simulation backend.

        Args:
            rng_key: the run's key; the server's and every client's own key derive from it.
            num_rounds: communication rounds.
            clients: an :class:`~numpyro_fed.Clients`.
            **options: the backend's run options: ``progress_bar`` (default ``True``; a
                tqdm bar with the running loss; without it, a transcript, callbacks or
                checkpoints all rounds run in one ``lax.scan``), ``init_state`` (resume),
                ``record_transcript`` / ``keep_values``, ``availability`` (simulated
                dropout), ``checkpoint`` / ``checkpoint_every``, ``on_nonfinite``
                (``"raise"`` or ``"warn"``), ``callbacks`` and ``backend``. See
                :meth:`numpyro_fed.backends.SimulationBackend.run`.

        Returns:
            a :class:`~numpyro_fed.RunResult`: ``params`` are the server's, ``trace`` the
            per-round ``-ELBO`` (also ``losses``), ``client_states`` each client's
            local parameters.
        """
        return self._run(rng_key, num_rounds, clients, **options)

    def load(self, path: str, clients: Clients) -> RunState:
        """A run state saved by :meth:`save`, for ``clients`` (pass as ``init_state=``)."""
        return self._load(path, clients)

    def evaluate(self, state: RunState, clients: Clients, num_particles: int = 16, rng_key=None):
        """Negative ELBO estimate at ``state``: a server term plus every client's term (jit-compiled)."""
        setup = self._setup(clients)
        num_particles = check_positive_int("num_particles", num_particles)
        rng_key = state.server_key if rng_key is None else rng_key
        key = ("elbo", num_particles)
        if key not in setup.cache:
            setup.cache[key] = jax.jit(_elbo_estimator(setup, num_particles))
        return -setup.cache[key](state, setup.plan.data, rng_key)

    # ------------------------------------------------------------------ posterior
    def sample_posterior(
        self,
        rng_key: jax.Array,
        result: Union[RunResult, RunState],
        num_samples: int,
        client: Optional[str] = None,
    ) -> Dict[str, jax.Array]:
        """Draws from the fitted approximation, in constrained space.

        Without ``client``: the global latent sites (what the server can compute). With a
        client name: that client's local latent sites as well, drawn from
        ``q(z_L | z_G)``; this uses the client's local state and data and is the client's
        own computation.

        Args:
            result: a :class:`RunResult` or a :class:`RunState`.
        """
        state = result.state if isinstance(result, RunResult) else result
        num_samples = check_positive_int("num_samples", num_samples)
        setup = self._fitted()
        obj, plan = setup.extra, setup.plan
        g = self.get_params(state)
        k_g, k_l = random.split(rng_key)
        eps_g = random.normal(k_g, (num_samples, obj.global_size))
        z_g = jax.vmap(lambda e: obj.global_latent(g, e))(eps_g)
        if client is None:
            args = setup.inputs.template()
            draw = jax.jit(jax.vmap(lambda z: obj.constrained_sample(g, None, z, None, args)))
            return draw(z_g)
        if client not in setup.inputs:
            raise KeyError(_UNKNOWN_CLIENT.format(name=client, names=list(setup.inputs.names)))
        j = plan.names.index(client)
        data = client_data(plan, j)
        local = client_item(plan, state.clients, j).state.local_params
        layout, _, _ = obj.client_layout(data.args)
        eps_l = random.normal(k_l, (num_samples, layout.size))
        z_l = jax.vmap(lambda zg, e: obj.local_latent(g, local, zg, e, layout, data.row_mask))(z_g, eps_l)
        n = int(plan.num_rows[j])
        args = setup.inputs[client]
        real_layout = obj.client_layout(args)[0]

        def unpad(z):
            values = layout.unravel(z)
            for name, axis in zip(layout.names, layout.row_axes):
                if axis is not None:
                    values[name] = jax.lax.slice_in_dim(values[name], 0, n, axis=axis)
            return real_layout.ravel(values)

        z_real = jax.vmap(unpad)(z_l)
        draw = jax.jit(jax.vmap(lambda zg, zl: obj.constrained_sample(g, local, zg, zl, args, real_layout)))
        return draw(z_g, z_real)

    def observed(self, clients: Clients, client: str) -> Dict[str, jax.Array]:
        """Values of a client's observed sites (the client's own data)."""
        tr = trace_model(self.model, clients[client], self.model_kwargs)
        return {n: s["value"] for n, s in tr.items() if s["type"] == "sample" and s["is_observed"]}


def _elbo_estimator(setup: Setup, num_particles: int):
    """``(state, data, rng_key) -> ELBO``: the server term plus every client's term."""
    obj, plan = setup.extra, setup.plan

    def estimate(state: RunState, data, rng_key):
        k_g, k_l = random.split(rng_key)
        g = state.server.global_params
        eps_g = random.normal(k_g, (num_particles, obj.global_size))

        def client_value(key, local_params, d):
            eps_l = random.normal(key, (num_particles, obj.local_size(d)))
            return jnp.mean(jax.vmap(lambda a, b: obj.client_term(g, local_params, a, b, d))(eps_g, eps_l))

        keys = random.split(k_l, len(plan.names))
        if plan.mapping == "vmap":
            values = jax.vmap(client_value)(keys, state.clients.state.local_params, data)
        else:
            values = jnp.stack([client_value(keys[j], s.state.local_params, d)
                                for j, (s, d) in enumerate(zip(state.clients, data))])
        return jnp.mean(jax.vmap(lambda e: obj.server_term(g, e))(eps_g)) + jnp.sum(values)

    return estimate

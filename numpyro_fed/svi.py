"""``FederatedSVI``: the class layer over SFVI and SFVI-Avg, mirroring ``numpyro.infer.SVI``."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

from ._structure import analyse_model, trace_model
from .algorithms import sfvi, sfvi_avg
from .clients import Clients
from .elbo import FederatedObjective
from .guides import StructuredGuide
from .simulation import (
    client_data,
    client_state,
    init_clients,
    keep_active,
    map_clients,
    plan_clients,
)
from .transcript import Communication, Transcript, message_bytes

__all__ = ["FederatedSVI", "FederatedSVIState", "RunResult"]

METHODS = ("sfvi", "sfvi_avg")
_OPTIM = (
    "optim must be an optax GradientTransformation such as optax.adam(1e-2); got {kind}. "
    "NumPyro optimisers (numpyro.optim.Adam) are not accepted: use the optax equivalent"
)
_CLIENTS = "clients must be an nf.Clients; got {kind}. Build one with nf.Clients({{...}}) or nf.Clients.split(...)"
_UNKNOWN_CLIENT = "no client named {name!r}; clients are {names}"


class FederatedSVIState(NamedTuple):
    server: Any
    clients: Any  # stacked over clients (vmap backend) or a tuple (loop backend)
    message: Any  # the server's pending broadcast
    rng_key: jax.Array


class RunResult(NamedTuple):
    """What :meth:`FederatedSVI.run` returns.

    Attributes:
        params: the server-held parameters ``{"guide": ..., "theta": ...}``.
        state: the final :class:`FederatedSVIState` (pass as ``init_state=`` to resume).
        losses: negative ELBO estimate per round (``-elbo``), as in NumPyro.
        communication: rounds, bytes and messages sent each way.
        client_states: ``{client name: that client's final local state}``.
        transcript: a :class:`~numpyro_fed.Transcript` when ``record_transcript`` was set.
    """

    params: Dict
    state: FederatedSVIState
    losses: jax.Array
    communication: Communication
    client_states: Dict[str, Any]
    transcript: Optional[Transcript] = None


class _Setup(NamedTuple):
    clients: Clients
    plan: Any
    objective: FederatedObjective
    algorithm: Any
    round_fn: Any
    scan_fn: Any
    message_bytes: dict  # filled on first run: bytes per client message each way

    def __hash__(self) -> int:  # identity: a set-up is static configuration under jit
        return id(self)

    def __eq__(self, other) -> bool:
        return self is other


@partial(jax.jit, static_argnums=(0, 3))
def _estimate_elbo(setup: "_Setup", state: FederatedSVIState, rng_key, num_particles: int):
    """Server term plus every client's term, clients mapped as in a round."""
    obj = setup.objective
    k_g, k_l = random.split(rng_key)
    g = state.server.global_params
    eps_g = random.normal(k_g, (num_particles, obj.global_size))

    def client_value(key, cstate, eps, data):
        eps_l = random.normal(key, (num_particles, obj.local_size(data)))
        values = jax.vmap(lambda a, b: obj.client_term(g, cstate.local_params, a, b, data))(eps, eps_l)
        return cstate, jnp.mean(values)

    keys = random.split(k_l, len(setup.plan.names))
    _, values = map_clients(setup.plan, client_value, keys, state.clients, eps_g, setup.plan.data)
    return jnp.mean(jax.vmap(lambda e: obj.server_term(g, e))(eps_g)) + jnp.sum(values)


class FederatedSVI:
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
        participation: fraction of clients per round for ``"sfvi_avg"``.
        backend: ``"auto"``, ``"vmap"`` or ``"loop"`` (see :mod:`numpyro_fed.simulation`).
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
        backend: str = "auto",
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
        if int(num_particles) != num_particles or num_particles < 1:
            raise ValueError(f"num_particles={num_particles}: must be a positive integer")
        if int(local_steps) != local_steps or local_steps < 1:
            raise ValueError(f"local_steps={local_steps}: must be a positive integer")
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
        self.num_particles = int(num_particles)
        self.stl = stl
        self.local_steps = int(local_steps)
        self.participation = float(participation)
        self.backend = backend
        self.row_plate = row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self._setup_cache: Optional[_Setup] = None

    # ------------------------------------------------------------------ set-up
    def _setup(self, clients) -> _Setup:
        if not isinstance(clients, Clients):
            raise TypeError(_CLIENTS.format(kind=type(clients).__name__))
        if self._setup_cache is not None and self._setup_cache.clients is clients:
            return self._setup_cache
        first = clients.names[0]
        structure = analyse_model(
            self.model, clients[first], clients.template(), self.model_kwargs, client_name=first
        )
        plan, structure = plan_clients(
            self.model, self.model_kwargs, clients, structure, self.backend, self.row_plate
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

        def one_round(state: FederatedSVIState, data):
            key, k_clients, k_server = random.split(state.rng_key, 3)
            active = state.server.active
            keys = random.split(k_clients, J)
            new_clients, messages = map_clients(plan, algorithm.client_step, keys, state.clients, state.message, data)
            new_clients = keep_active(plan, active, new_clients, state.clients)
            server, message, info = algorithm.server_step(k_server, state.server, messages, active)
            return FederatedSVIState(server, new_clients, message, key), (info, messages, active)

        round_fn = jax.jit(one_round)

        @partial(jax.jit, static_argnums=2)
        def scan_fn(state, data, num_rounds):
            def body(s, _):
                s, (info, _, active) = one_round(s, data)
                return s, (info.elbo, jnp.sum(active))

            return jax.lax.scan(body, state, None, length=num_rounds)

        self._setup_cache = _Setup(clients, plan, objective, algorithm, round_fn, scan_fn, {})
        return self._setup_cache

    # ------------------------------------------------------------------ SVI API
    def init(self, rng_key, clients: Clients) -> FederatedSVIState:
        """Initial server and client states (clients initialise their own parameters)."""
        setup = self._setup(clients)
        k_server, k_clients, key = random.split(rng_key, 3)
        server, message = setup.algorithm.init_server(k_server)
        keys = random.split(k_clients, len(clients))
        states = init_clients(setup.plan, setup.algorithm.init_client, keys, setup.plan.data)
        return FederatedSVIState(server, states, message, key)

    def update(self, state: FederatedSVIState, clients: Clients):
        """One communication round. Returns ``(state, loss)`` with ``loss = -ELBO``."""
        setup = self._setup(clients)
        state, (info, _, _) = setup.round_fn(state, setup.plan.data)
        return state, -info.elbo

    def get_params(self, state: FederatedSVIState) -> Dict:
        """The server-held parameters."""
        return state.server.global_params

    def _per_round_bytes(self, setup, state):
        if "up" in setup.message_bytes:
            return setup.message_bytes["up"], setup.message_bytes["down"]
        up = jax.eval_shape(
            lambda s: setup.round_fn(s, setup.plan.data)[1][1], state
        )
        per_client_up = message_bytes(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), up))
        per_client_down = message_bytes(state.message)
        setup.message_bytes.update(up=per_client_up, down=per_client_down)
        return per_client_up, per_client_down

    def run(
        self,
        rng_key,
        num_rounds: int,
        clients: Clients,
        *,
        progress_bar: bool = True,
        init_state: Optional[FederatedSVIState] = None,
        record_transcript: bool = False,
        keep_values: bool = False,
    ) -> RunResult:
        """Run ``num_rounds`` communication rounds.

        Args:
            progress_bar: a tqdm bar with the running average loss; without it (and
                without a transcript) all rounds run in one ``lax.scan``.
            init_state: resume from a previous state.
            record_transcript: record every message (name, shape, bytes) per round.
            keep_values: with ``record_transcript``, keep the sent arrays too.
        """
        if int(num_rounds) != num_rounds or num_rounds < 1:
            raise ValueError(f"num_rounds={num_rounds}: must be a positive integer")
        setup = self._setup(clients)
        state = self.init(rng_key, clients) if init_state is None else init_state
        up_each, down_each = self._per_round_bytes(setup, state)
        transcript = Transcript(keep_values) if record_transcript else None
        if progress_bar or record_transcript:
            elbos, counts = [], []
            iterator = range(num_rounds)
            bar = None
            refresh, last = max(1, num_rounds // 20), 0
            if progress_bar:
                from tqdm.auto import trange

                bar = iterator = trange(num_rounds)
            for i in iterator:
                if transcript is not None:
                    for j, name in enumerate(setup.plan.names):
                        if bool(state.server.active[j]):
                            transcript.record(i, "server", name, state.message)
                new_state, (info, messages, active) = setup.round_fn(state, setup.plan.data)
                if transcript is not None:
                    for j, name in enumerate(setup.plan.names):
                        if bool(active[j]):
                            transcript.record(i, name, "server", jax.tree_util.tree_map(lambda x: x[j], messages))
                state = new_state
                elbos.append(info.elbo)
                counts.append(jnp.sum(active))
                if bar is not None and (i % refresh == 0 or i == num_rounds - 1):
                    window = -jnp.stack(elbos[last:])
                    bar.set_postfix_str(
                        "init loss: {:.4f}, avg. loss [{}-{}]: {:.4f}".format(
                            float(-elbos[0]), last + 1, i + 1, float(jnp.mean(window))
                        )
                    )
                    last = i + 1
            elbo = jnp.stack(elbos)
            active_counts = np.asarray(jnp.stack(counts))
        else:
            state, (elbo, active_counts) = setup.scan_fn(state, setup.plan.data, int(num_rounds))
            active_counts = np.asarray(active_counts)
        n_msgs = int(active_counts.sum())
        comm = Communication(
            rounds=int(num_rounds),
            bytes_up=n_msgs * up_each,
            bytes_down=n_msgs * down_each,
            messages_up=n_msgs,
            messages_down=n_msgs,
        )
        client_states = {
            name: client_state(setup.plan, state.clients, j) for j, name in enumerate(setup.plan.names)
        }
        return RunResult(self.get_params(state), state, -elbo, comm, client_states, transcript)

    def evaluate(self, state: FederatedSVIState, clients: Clients, num_particles: int = 16, rng_key=None):
        """Negative ELBO estimate at ``state``: a server term plus every client's term."""
        setup = self._setup(clients)
        rng_key = state.rng_key if rng_key is None else rng_key
        return -_estimate_elbo(setup, state, rng_key, int(num_particles))

    # ------------------------------------------------------------------ posterior
    def sample_posterior(
        self,
        rng_key: jax.Array,
        result: Union["RunResult", FederatedSVIState],
        num_samples: int,
        client: Optional[str] = None,
    ) -> Dict[str, jax.Array]:
        """Draws from the fitted approximation, in constrained space.

        Without ``client``: the global latent sites (what the server can compute). With a
        client name: that client's local latent sites as well, drawn from
        ``q(z_L | z_G)``; this uses the client's local state and data and is the client's
        own computation.

        Args:
            result: a :class:`RunResult` or a :class:`FederatedSVIState`.
        """
        state = result.state if isinstance(result, RunResult) else result
        setup = self._setup_cache
        if setup is None:
            raise ValueError("sample_posterior needs a fitted FederatedSVI: call run() or init() first")
        obj = setup.objective
        g = self.get_params(state)
        k_g, k_l = random.split(rng_key)
        eps_g = random.normal(k_g, (num_samples, obj.global_size))
        z_g = jax.vmap(lambda e: obj.global_latent(g, e))(eps_g)
        if client is None:
            args = setup.clients.template()
            draw = jax.jit(jax.vmap(lambda z: obj.constrained_sample(g, None, z, None, args)))
            return draw(z_g)
        if client not in setup.clients:
            raise KeyError(_UNKNOWN_CLIENT.format(name=client, names=list(setup.clients.names)))
        j = setup.plan.names.index(client)
        data = client_data(setup.plan, j)
        local = client_state(setup.plan, state.clients, j).local_params
        layout, _, _ = obj.client_layout(data.args)
        eps_l = random.normal(k_l, (num_samples, layout.size))
        z_l = jax.vmap(lambda zg, e: obj.local_latent(g, local, zg, e, layout, data.row_mask))(z_g, eps_l)
        n = int(setup.plan.num_rows[j])
        args = setup.clients[client]
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

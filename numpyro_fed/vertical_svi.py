"""``VerticalSVI``: the class layer over vertical SFVI, mirroring ``numpyro.infer.SVI``."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import random

from .algorithms.vertical_sfvi import vertical_sfvi
from .transcript import Communication, Transcript, message_bytes
from .vertical_guides import VerticalGuide
from .vertical_objective import SERVER, VerticalObjective

__all__ = ["VerticalRunResult", "VerticalSVI", "VerticalSVIState"]

_OPTIM = "optim must be an optax GradientTransformation such as optax.adam(1e-2); got {kind}"
_GUIDE = "guide must be an nf.VerticalGuide (e.g. nf.VerticalGuide('amortized')); got {kind}"
_BATCH = "batch_size={b}: must be a positive integer no larger than the {n} rows (or None for all rows)"
_NO_DATA = "VerticalSVI needs the model's data as keyword arguments, e.g. svi.run(key, 1000, x_a=..., x_b=..., y=...)"


class VerticalSVIState(NamedTuple):
    server: Any
    clients: Dict[str, Any]
    rng_key: jax.Array


class VerticalRunResult(NamedTuple):
    """What :meth:`VerticalSVI.run` returns.

    Attributes:
        params: ``{party: its variational parameters}`` (``"server"`` and each client).
            In a deployment each party keeps its own; the simulation gathers them.
        state: the final :class:`VerticalSVIState` (pass as ``init_state=``).
        losses: ``-ELBO`` estimate per iteration (a simulation diagnostic: the per-party
            terms are not messages of the protocol).
        communication: iterations, bytes and messages each way.
        transcript: a :class:`~numpyro_fed.Transcript` when ``record_transcript`` was set.
    """

    params: Dict[str, Any]
    state: VerticalSVIState
    losses: jax.Array
    communication: Communication
    transcript: Optional[Transcript] = None


class _Setup(NamedTuple):
    objective: VerticalObjective
    algorithm: Any
    round_fn: Any
    scan_fn: Any
    key: tuple
    cache: dict  # compiled ELBO estimators by num_particles; message shapes

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other) -> bool:
        return self is other


def _views(obj: VerticalObjective, data, rows):
    views = {c: obj.party_args(c, data, rows) for c in obj.clients}
    views[SERVER] = obj.party_args(SERVER, data, rows)
    return views


class VerticalSVI:
    """Vertical federated SVI (paper 000, Algorithms 1 and 2).

    ``form="augmented"`` models run Algorithm 1 (the server holds the likelihood; ``y``
    may be shared or the server's alone); ``form="power"`` models run Algorithm 2 (``y``
    shared, two exchanges per iteration).

    Args:
        model: a :func:`~numpyro_fed.vertical_split` model.
        guide: a :class:`~numpyro_fed.VerticalGuide`.
        optim: an ``optax.GradientTransformation`` (each party runs its own copy).
        batch_size: rows per iteration, chosen by the server (``None``: all rows).
        model_kwargs: non-data keyword arguments of the model.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(xa, xb, y):
        ...     ba = numpyro.sample("ba", dist.Normal(0, 1).expand([2]).to_event(1))
        ...     bb = numpyro.sample("bb", dist.Normal(0, 1).expand([1]).to_event(1))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         ga = numpyro.deterministic("ga", xa @ ba)
        ...         gb = numpyro.deterministic("gb", xb @ bb)
        ...         numpyro.sample("y", dist.Normal(ga + gb, 1.0), obs=y)
        >>> spec = {"a": dict(data="xa", sites="ba", contribution="ga"),
        ...         "b": dict(data="xb", sites="bb", contribution="gb")}
        >>> vmodel = nf.vertical_split(model, clients=spec, rho=0.5, response="y")
        >>> x = np.random.default_rng(0).normal(size=(50, 3))
        >>> y = x @ np.array([1.0, -1.0, 0.5])
        >>> svi = nf.VerticalSVI(vmodel, nf.VerticalGuide("meanfield"), optax.adam(0.05))
        >>> res = svi.run(jax.random.PRNGKey(0), 1500, progress_bar=False, xa=x[:, :2], xb=x[:, 2:], y=y)
        >>> draws = svi.sample_posterior(jax.random.PRNGKey(1), res, 500)
        >>> bool(abs(draws["ba"][:, 0].mean() - 1.0) < 0.3)
        True

    References:
        Hassan, Sutton, Mira, Mengersen (paper 000), §4.
    """

    def __init__(
        self,
        model: Callable,
        guide: VerticalGuide,
        optim: optax.GradientTransformation,
        *,
        batch_size: Optional[int] = None,
        model_kwargs: Optional[dict] = None,
    ) -> None:
        if not isinstance(guide, VerticalGuide):
            raise TypeError(_GUIDE.format(kind=type(guide).__name__))
        if not (hasattr(optim, "init") and hasattr(optim, "update")) or hasattr(optim, "get_params"):
            raise TypeError(_OPTIM.format(kind=type(optim).__name__))
        self.model, self.guide, self.optim = model, guide, optim
        self.batch_size = batch_size
        self.model_kwargs = dict(model_kwargs or {})
        self._setup_cache: Optional[_Setup] = None

    # ------------------------------------------------------------------ set-up
    def _setup(self, data: Dict[str, Any]) -> _Setup:
        if not data:
            raise ValueError(_NO_DATA)
        key = tuple((k, id(v)) for k, v in sorted(data.items()))
        if self._setup_cache is not None and self._setup_cache.key == key:
            return self._setup_cache
        obj = VerticalObjective(self.model, self.guide, data, self.model_kwargs)
        b = self.batch_size
        if b is not None and (int(b) != b or not 1 <= b <= obj.num_rows):
            raise ValueError(_BATCH.format(b=b, n=obj.num_rows))
        alg = vertical_sfvi(obj, self.optim, b)
        clients = obj.clients
        power = obj.form == "power"

        def one_round(state: VerticalSVIState, data):
            key, k_sched, k_server, k_clients = random.split(state.rng_key, 4)
            sched = alg.schedule(k_sched)
            eps0 = alg.server_noise(k_server)
            keys = random.split(k_clients, len(clients))
            noise = {c: alg.client_noise(keys[i], c) for i, c in enumerate(clients)}
            views = _views(obj, data, sched["rows"])
            up_z = {c: alg.client_forward(c, state.clients[c], noise[c], sched, views[c]) for c in clients}
            relayed, up_lik = None, None
            if power:
                relayed = alg.relay(state.server, eps0, up_z)
                up_lik = {
                    c: alg.client_likelihood(c, state.clients[c], noise[c], relayed, sched, views[c])
                    for c in clients
                }
                server, replies, value = alg.server_aggregate(state.server, eps0, up_lik, sched, views[SERVER])
            else:
                server, replies, value = alg.server_step(state.server, eps0, up_z, sched, views[SERVER])
            new_clients = {}
            for c in clients:
                new_clients[c], v = alg.client_step(c, state.clients[c], noise[c], replies[c], sched, views[c], relayed)
                value = value + v
            messages = {"schedule": sched, "z": up_z, "relay": relayed, "likelihood": up_lik, "grad_z": replies}
            return VerticalSVIState(server, new_clients, key), (value, messages)

        @partial(jax.jit, static_argnums=2)
        def scan_fn(state, data, num_steps):
            def body(s, _):
                s, (value, _) = one_round(s, data)
                return s, value

            return jax.lax.scan(body, state, None, length=num_steps)

        self._setup_cache = _Setup(obj, alg, jax.jit(one_round), scan_fn, key, {})
        return self._setup_cache

    @staticmethod
    def _data(data):
        return {k: jnp.asarray(v) for k, v in data.items()}

    # ------------------------------------------------------------------ SVI API
    def init(self, rng_key, **data) -> VerticalSVIState:
        """Every party initialises its own parameters."""
        setup = self._setup(data)
        alg, clients = setup.algorithm, setup.objective.clients
        k_s, k_c, key = random.split(rng_key, 3)
        keys = random.split(k_c, len(clients))
        states = {c: alg.init_client(keys[i], c) for i, c in enumerate(clients)}
        return VerticalSVIState(alg.init_server(k_s), states, key)

    def update(self, state: VerticalSVIState, **data):
        """One iteration. Returns ``(state, loss)`` with ``loss = -ELBO`` estimate."""
        setup = self._setup(data)
        state, (value, _) = setup.round_fn(state, self._data(data))
        return state, -value

    def get_params(self, state: VerticalSVIState) -> Dict[str, Any]:
        params = {c: s.params for c, s in state.clients.items()}
        params[SERVER] = state.server.params
        return params

    def _messages_shape(self, setup, state, data):
        if "shapes" not in setup.cache:
            setup.cache["shapes"] = jax.eval_shape(lambda s: setup.round_fn(s, data)[1][1], state)
        return setup.cache["shapes"]

    def run(
        self,
        rng_key,
        num_steps: int,
        *,
        progress_bar: bool = True,
        init_state: Optional[VerticalSVIState] = None,
        record_transcript: bool = False,
        keep_values: bool = False,
        **data,
    ) -> VerticalRunResult:
        """Run ``num_steps`` iterations; the model's data go in as keyword arguments.

        Args:
            progress_bar: tqdm bar; without it (and without a transcript) every iteration
                runs in one ``lax.scan``.
            init_state: resume from a previous state.
            record_transcript: record every message; ``keep_values`` keeps the arrays.
        """
        if int(num_steps) != num_steps or num_steps < 1:
            raise ValueError(f"num_steps={num_steps}: must be a positive integer")
        setup = self._setup(data)
        arrays = self._data(data)
        state = self.init(rng_key, **data) if init_state is None else init_state
        shapes = self._messages_shape(setup, state, arrays)
        clients = setup.objective.clients
        transcript = Transcript(keep_values) if record_transcript else None
        if progress_bar or record_transcript:
            values = []
            iterator = range(num_steps)
            if progress_bar:
                from tqdm.auto import trange

                iterator = trange(num_steps)
            for i in iterator:
                state, (value, messages) = setup.round_fn(state, arrays)
                values.append(value)
                if transcript is not None:
                    _record(transcript, i, clients, messages)
                if progress_bar and (i % max(1, num_steps // 20) == 0 or i == num_steps - 1):
                    iterator.set_postfix_str(f"loss: {float(-value):.4f}")
            values = jnp.stack(values)
        else:
            state, values = setup.scan_fn(state, arrays, int(num_steps))
        up, down, n_up, n_down = _round_bytes(shapes, clients)
        comm = Communication(int(num_steps), up * num_steps, down * num_steps, n_up * num_steps, n_down * num_steps)
        return VerticalRunResult(self.get_params(state), state, -values, comm, transcript)

    def evaluate(self, state: VerticalSVIState, num_particles: int = 16, rng_key=None, **data):
        """``-ELBO`` on all rows, averaged over ``num_particles`` draws (jit-compiled)."""
        setup = self._setup(data)
        rng_key = state.rng_key if rng_key is None else rng_key
        key = ("elbo", int(num_particles))
        if key not in setup.cache:  # compile once per set-up and particle count
            obj = setup.objective
            full = vertical_sfvi(obj, self.optim, None)

            @jax.jit
            def estimate(state, arrays, k):
                sched = full.schedule(k)
                views = _views(obj, arrays, sched["rows"])
                keys = random.split(k, int(num_particles))
                return jnp.mean(jax.vmap(lambda kk: full.elbo(kk, state.server, state.clients, sched, views))(keys))

            setup.cache[key] = estimate
        estimate = setup.cache[key]
        return -estimate(state, self._data(data), rng_key)

    def sample_posterior(self, rng_key, result, num_samples: int) -> Dict[str, jax.Array]:
        """Draws of every party's sites from ``q(theta)``, constrained.

        Each party can draw its own block; the simulation gathers them for analysis.
        """
        state = result.state if isinstance(result, VerticalRunResult) else result
        if self._setup_cache is None:
            raise ValueError("sample_posterior needs a fitted VerticalSVI: call run() or init() first")
        obj = self._setup_cache.objective
        out = {}
        keys = random.split(rng_key, len(obj.clients) + 1)
        for key, party in zip(keys, (SERVER,) + obj.clients):
            size = obj.layouts[party].size
            if size == 0:
                continue
            params = state.server.params if party == SERVER else state.clients[party].params
            eps = random.normal(key, (num_samples, size))
            u = jax.vmap(lambda e: self.guide.theta.sample(params["theta"], e)[0])(eps)
            out.update(jax.vmap(lambda v: obj.constrain(party, v))(u))
        return out


def _record(transcript: Transcript, i: int, clients, messages) -> None:
    for c in clients:
        transcript.record(i, "server", c, messages["schedule"])
    for c in clients:
        transcript.record(i, c, "server", messages["z"][c])
    if messages["relay"] is not None:
        for c in clients:
            transcript.record(i, "server", c, messages["relay"])
        for c in clients:
            transcript.record(i, c, "server", messages["likelihood"][c])
    for c in clients:
        transcript.record(i, "server", c, messages["grad_z"][c])


def _round_bytes(shapes, clients):
    up = down = n_up = n_down = 0
    for c in clients:
        down += message_bytes(shapes["schedule"]) + message_bytes(shapes["grad_z"][c])
        up += message_bytes(shapes["z"][c])
        n_down += 2
        n_up += 1
        if shapes["relay"] is not None:
            down += message_bytes(shapes["relay"])
            up += message_bytes(shapes["likelihood"][c])
            n_down += 1
            n_up += 1
    return up, down, n_up, n_down

"""The message protocol of vertical federation, shared by vertical SFVI and SOUL.

One iteration (paper 000, Algorithms 1-2 and Appendix A):

1. the server picks the rows of the round (``schedule``) and sends their indices;
2. each client sends ``z_j`` on those rows (``client_forward``);
3. augmented form: the server replies ``d/dz_j`` of its terms (``server_step``);
   power form: the server relays every ``z`` (``relay``), each client returns the
   gradients of its likelihood copy with respect to the other clients' ``z``
   (``client_likelihood``), and the server sums them into each client's reply
   (``server_aggregate``);
4. each client updates its own parameters (``client_step``).

An algorithm is a NamedTuple of pure functions with those names; :func:`protocol_round`
composes them into one jit-compatible iteration and :class:`VerticalRunner` is the
``init / update / run`` layer both :class:`~numpyro_fed.VerticalSVI` and
:class:`~numpyro_fed.VerticalSOUL` share.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import random

from .transcript import Communication, Transcript, message_bytes
from .vertical_objective import SERVER, VerticalObjective

__all__ = ["VerticalRunResult", "VerticalRunner", "VerticalSVIState", "protocol_round"]

_NO_DATA = "{cls} needs the model's data as keyword arguments, e.g. .run(key, 1000, x_a=..., x_b=..., y=...)"
_BATCH = "batch_size={b}: must be a positive integer no larger than the {n} rows (or None for all rows)"
_OPTIM = "optim must be an optax GradientTransformation such as optax.adam(1e-2); got {kind}"


class VerticalSVIState(NamedTuple):
    """Every party's state plus the simulation's key (used by VerticalSVI and VerticalSOUL)."""

    server: Any
    clients: Dict[str, Any]
    rng_key: jax.Array


class VerticalRunResult(NamedTuple):
    """What ``VerticalSVI.run`` and ``VerticalSOUL.run`` return.

    Attributes:
        params: ``{party: its parameters}`` (``"server"`` and each client). In a
            deployment each party keeps its own; the simulation gathers them.
        state: the final :class:`VerticalSVIState` (pass as ``init_state=``).
        losses: per iteration, ``-ELBO`` (SFVI) or ``-log p(theta, z, y)`` averaged over
            the iteration's Langevin draws (SOUL). A simulation diagnostic: the per-party
            terms are not messages of the protocol.
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
    cache: dict  # the data of the set-up; compiled estimators; message shapes

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other) -> bool:
        return self is other


def party_views(obj: VerticalObjective, data, rows) -> Dict[str, Dict[str, jax.Array]]:
    """What each party holds of the rows ``rows``."""
    views = {c: obj.party_args(c, data, rows) for c in obj.clients}
    views[SERVER] = obj.party_args(SERVER, data, rows)
    return views


def protocol_round(alg, obj: VerticalObjective, state: VerticalSVIState, data) -> Tuple[VerticalSVIState, Tuple]:
    """One iteration of the protocol. Returns ``(state, (value, messages))``.

    ``value`` is the sum of every party's objective term; ``messages`` holds every
    message of the iteration (``schedule``, ``z``, ``relay``, ``likelihood``, ``grad_z``).
    """
    clients = obj.clients
    key, k_sched, k_server, k_clients = random.split(state.rng_key, 4)
    sched = alg.schedule(k_sched)
    eps0 = alg.server_noise(k_server)
    keys = random.split(k_clients, len(clients))
    noise = {c: alg.client_noise(keys[i], c) for i, c in enumerate(clients)}
    views = party_views(obj, data, sched["rows"])
    client_states = dict(state.clients)
    up_z = {c: alg.client_forward(c, client_states[c], noise[c], sched, views[c]) for c in clients}
    relayed, up_lik = None, None
    if obj.form == "power":
        relayed = alg.relay(state.server, eps0, up_z)
        up_lik = {}
        for c in clients:
            client_states[c], up_lik[c] = alg.client_likelihood(c, client_states[c], noise[c], relayed, sched, views[c])
        server, replies, value = alg.server_aggregate(state.server, eps0, up_lik, sched, views[SERVER])
    else:
        server, replies, value = alg.server_step(state.server, eps0, up_z, sched, views[SERVER])
    for c in clients:
        client_states[c], v = alg.client_step(c, client_states[c], noise[c], replies[c], sched, views[c], relayed)
        value = value + v
    messages = {"schedule": sched, "z": up_z, "relay": relayed, "likelihood": up_lik, "grad_z": replies}
    return VerticalSVIState(server, client_states, key), (value, messages)


class VerticalRunner:
    """``init / update / run / get_params`` over a vertical algorithm (see subclasses).

    Subclasses set ``self.optim``, ``self.batch_size``, ``self.model_kwargs`` and
    implement ``_build(data) -> (objective, algorithm)``.
    """

    optim: Any
    batch_size: Optional[int]
    model_kwargs: dict
    method: str = "vertical"
    loss_name: str = "loss"

    def _init_runner(self, optim, batch_size, model_kwargs) -> None:
        if not (hasattr(optim, "init") and hasattr(optim, "update")) or hasattr(optim, "get_params"):
            raise TypeError(_OPTIM.format(kind=type(optim).__name__))
        self.optim = optim
        self.batch_size = batch_size
        self.model_kwargs = dict(model_kwargs or {})
        self._setup_cache: Optional[_Setup] = None

    def _build(self, data):  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_batch(self, obj: VerticalObjective) -> None:
        b = self.batch_size
        if b is not None and (int(b) != b or not 1 <= b <= obj.num_rows):
            raise ValueError(_BATCH.format(b=b, n=obj.num_rows))

    def _setup(self, data: Dict[str, Any]) -> _Setup:
        if not data:
            raise ValueError(_NO_DATA.format(cls=type(self).__name__))
        key = tuple((k, id(v)) for k, v in sorted(data.items()))
        if self._setup_cache is not None and self._setup_cache.key == key:
            return self._setup_cache
        obj, alg = self._build(data)
        one_round = partial(protocol_round, alg, obj)

        @partial(jax.jit, static_argnums=2)
        def scan_fn(state, data, num_steps):
            def body(s, _):
                s, (value, _) = one_round(s, data)
                return s, value

            return jax.lax.scan(body, state, None, length=num_steps)

        self._setup_cache = _Setup(obj, alg, jax.jit(one_round), scan_fn, key, {"data": self._data(data)})
        return self._setup_cache

    @staticmethod
    def _data(data):
        return {k: jnp.asarray(v) for k, v in data.items()}

    def init(self, rng_key, **data) -> VerticalSVIState:
        """Every party initialises its own parameters."""
        setup = self._setup(data)
        alg, clients = setup.algorithm, setup.objective.clients
        k_s, k_c, key = random.split(rng_key, 3)
        keys = random.split(k_c, len(clients))
        states = {c: alg.init_client(keys[i], c) for i, c in enumerate(clients)}
        return VerticalSVIState(alg.init_server(k_s), states, key)

    def update(self, state: VerticalSVIState, **data):
        """One iteration (jit-compiled). Returns ``(state, loss)``."""
        setup = self._setup(data)
        state, (value, _) = setup.round_fn(state, self._data(data))
        return state, -value

    def get_params(self, state: VerticalSVIState) -> Dict[str, Any]:
        """``{party: parameters}`` gathered from every party's state."""
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

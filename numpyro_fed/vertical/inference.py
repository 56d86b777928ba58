"""What :class:`~numpyro_fed.VerticalSVI` and :class:`~numpyro_fed.VerticalSOUL` share:
party data, set-up and the ``init / update / run`` layer over the backend."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import jax.numpy as jnp
import numpy as np

from ..backends.mapping import ClientPlan
from ..inference import FederatedInference, Setup
from ..dp.plan import refuse_dp
from ..protocol import RunResult, RunState
from .objective import SERVER, VerticalObjective
from .protocol import PartyData, vertical_protocol

__all__ = ["VerticalInference", "validate_party_data"]

_NO_DATA = "{cls} needs the model's data as keyword arguments, e.g. .run(key, 1000, x_a=..., x_b=..., y=...)"
_BATCH = "batch_size={b}: must be a positive integer no larger than the {n} rows (or None for all rows)"
_OPTIM = "optim must be an optax GradientTransformation such as optax.adam(1e-2); got {kind}"
_DTYPE = (
    "argument '{arg}' of {party} has dtype {dtype}; vertical data must be numeric arrays (convert "
    "categories to codes or one-hot columns first)"
)
_NONFINITE = (
    "argument '{arg}' of {party} holds {count} non-finite value(s) (NaN/inf); clean or impute them before "
    "federating"
)


def _party_label(model, arg: str) -> str:
    owner = model.owner_of_argument(arg) if hasattr(model, "owner_of_argument") else None
    if owner is not None:
        return f"party '{owner}'"
    if arg == getattr(model, "response", None):
        return "the response holder" if getattr(model, "response_access", "") == "server" else "every party (response)"
    return "every party (shared argument)"


def validate_party_data(model, data: Mapping[str, Any]) -> Dict[str, np.ndarray]:
    """Copies of the parties' arrays, checked as :class:`~numpyro_fed.Clients` checks
    horizontal data: numeric dtypes and finite values, with errors naming the party and
    the argument."""
    clean = {}
    for arg, value in data.items():
        arr = np.array(value, copy=True)
        if arr.dtype.kind not in "biuf":
            raise TypeError(_DTYPE.format(arg=arg, party=_party_label(model, arg), dtype=arr.dtype))
        if arr.dtype.kind == "f":
            bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            if bad:
                raise ValueError(_NONFINITE.format(arg=arg, party=_party_label(model, arg), count=bad))
        clean[arg] = arr
    return clean


class VerticalInference(FederatedInference):
    """``init / update / run / get_params`` over a vertical algorithm (see subclasses).

    Subclasses set ``self.optim``, ``self.batch_size``, ``self.model_kwargs`` and
    implement ``_build_algorithm(data) -> (objective, party functions)``.
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
        self._init_inference()

    def _build_algorithm(self, data):  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_batch(self, obj: VerticalObjective) -> None:
        b = self.batch_size
        if b is not None and (isinstance(b, bool) or int(b) != b or not 1 <= b <= obj.num_rows):
            raise ValueError(_BATCH.format(b=b, n=obj.num_rows))

    def _validate_inputs(self, data) -> None:
        if not data:
            raise ValueError(_NO_DATA.format(cls=type(self).__name__))

    def _build(self, data: Mapping[str, Any]) -> Setup:
        arrays = {k: jnp.asarray(v) for k, v in validate_party_data(self.model, data).items()}
        refuse_dp(type(self).__name__, self.model, arrays, getattr(self, "model_kwargs", {}))
        obj, alg = self._build_algorithm(arrays)
        rows = jnp.arange(obj.num_rows)
        parties = tuple(PartyData(c, obj.party_args(c, arrays, rows)) for c in obj.clients)
        plan = ClientPlan(obj.clients, parties, "loop", obj.row_plate, np.full(len(obj.clients), obj.num_rows),
                          server_data=obj.party_args(SERVER, arrays, rows))
        return Setup(dict(data), vertical_protocol(alg, obj), plan, (obj, alg), {"data": arrays})

    def _params(self, setup: Setup, state: RunState) -> Dict[str, Any]:
        if state.clients is None:  # a network backend: each party keeps its own parameters
            return {SERVER: state.server.inner.params}
        params = {c: slot.state.inner.params for c, slot in zip(setup.plan.names, state.clients)}
        params[SERVER] = state.server.inner.params
        return params

    def _client_view(self, setup: Setup, client_state):
        return client_state.inner

    @property
    def objective(self) -> VerticalObjective:
        return self._fitted().extra[0]

    def init(self, rng_key, **data) -> RunState:
        """Every party initialises its own parameters and keeps its own key."""
        return self._init(rng_key, data)

    def update(self, state: RunState, **data):
        """One iteration (jit-compiled). Returns ``(state, loss)``."""
        state, info = self._update(state, data)
        return state, -info.value

    def get_params(self, state: RunState) -> Dict[str, Any]:
        """``{party: parameters}`` gathered from every party's state."""
        return self._params(self._fitted(), state)

    def run(self, rng_key, num_steps: int, *, progress_bar: bool = True, init_state: Optional[RunState] = None,
            record_transcript: bool = False, keep_values: bool = False, availability: Any = None,
            checkpoint: Optional[str] = None, checkpoint_every: Optional[int] = None, on_nonfinite: str = "raise",
            callbacks=(), backend: Any = None, **data) -> RunResult:
        """Run ``num_steps`` iterations; the model's data go in as keyword arguments.

        The run options are the backend's (see
        :meth:`numpyro_fed.backends.SimulationBackend.run`): ``progress_bar`` (without it,
        a transcript, callbacks or checkpoints every iteration runs in one ``lax.scan``),
        ``init_state``, ``record_transcript`` / ``keep_values``, ``availability``
        (simulated dropout: a round missing a party is skipped), ``checkpoint`` /
        ``checkpoint_every``, ``on_nonfinite``, ``callbacks``, ``backend``.

        Returns:
            a :class:`~numpyro_fed.RunResult` with ``params = {party: its parameters}``
            (in a deployment each party keeps its own; the simulation gathers them) and
            ``trace`` the per-iteration loss: ``-ELBO`` (SFVI) or ``-log p(theta, z, y)``
            averaged over the iteration's Langevin draws (SOUL), summed from the
            parties' scalar terms.
        """
        return self._run(rng_key, num_steps, data, progress_bar=progress_bar, init_state=init_state,
                         record_transcript=record_transcript, keep_values=keep_values, availability=availability,
                         checkpoint=checkpoint, checkpoint_every=checkpoint_every, on_nonfinite=on_nonfinite,
                         callbacks=callbacks, backend=backend)

    def load(self, path: str, **data) -> RunState:
        """A run state saved by :meth:`save`, for the same data (pass as ``init_state=``)."""
        return self._load(path, data)

    @staticmethod
    def _party_states(setup: Setup, state: RunState) -> Dict[str, Any]:
        return {c: slot.state.inner for c, slot in zip(setup.plan.names, state.clients)}

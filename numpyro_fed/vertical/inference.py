"""What :class:`~numpyro_fed.VerticalSVI` and :class:`~numpyro_fed.VerticalSOUL` share:
party data, set-up and the ``init / update / run`` layer over the backend."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from .._validation import check_optimizer, check_positive_int
from ..check import Verdict, from_diagnostic, register_check, unchecked
from ..check.psis import (
    MEAN_MARGIN,
    PARETO_K_LIMIT,
    SD_MARGIN,
    FitDiagnostic,
    describe_biased,
    importance_resample,
    state_fingerprint,
)
from ..dp.plan import refuse_dp
from ..run.backends.mapping import ClientPlan
from ..run.inference import FederatedInference, Setup, checked_network, fitted, state_of, with_exchange_traffic
from ..run.params import VerticalParams
from ..run.protocol import RunResult, RunState
from ..warnings import BiasedFitWarning, UncheckedFitWarning, UnreliableFitWarning, find_stack_level
from . import network_check
from .check import CHECK_DRAWS, check_function, constrain_draws, split_flat, vertical_fit_check
from .network_check import CHECK_KEY
from .objective import SERVER, VerticalObjective
from .protocol import PartyData, vertical_protocol

__all__ = ["VerticalInference", "check_batch", "corrected_draws", "held_params", "party_draws", "vertical_check",
           "validate_party_data"]

_NO_DATA = "{cls} needs the model's data as keyword arguments, e.g. .run(key, num_rounds=1000, x_a=..., x_b=..., y=...)"
_BATCH = " no larger than the {n} rows (or None for all rows)"
_DTYPE = (
    "argument '{arg}' of {party} has dtype {dtype}; vertical data must be numeric arrays (convert "
    "categories to codes or one-hot columns first)"
)
_NONFINITE = (
    "argument '{arg}' of {party} holds {count} non-finite value(s) (NaN/inf); clean or impute them before "
    "federating"
)


_UNRELIABLE = (
    "{cls}: the fit is unreliable as a posterior of the true model: Pareto k = {k:.2f} > {limit} for p(theta, y) / "
    "q(theta) of the true model (z_j = g_j; effective sample size {ess:.0f} of {n} draws), so q misses mass the true "
    "posterior has. Common causes: rho too large for the data's scale (the augmented posterior is not the true "
    "model's; see last_rho_check), a mean-field auxiliary guide that narrows the coefficients, too few iterations, "
    "or a posterior outside the Gaussian family. Lower rho, use nf.VerticalGuide('amortized'), fit longer, or check "
    "against NUTS on pooled data; check_fit=False silences this"
)
_BIASED = (
    "{cls}: Pareto k = {k:.2f} is below {limit}, but q's moments disagree with the importance-weighted moments of the "
    "true model at the same {n} draws (means more than {mean_margin} weighted sds apart or sds more than "
    "{sd_margin:.0%}) at {sites}: the fit is biased there ({why}). Use sample_posterior(..., corrected=True) for "
    "importance-resampled draws, {fix}; check_fit=False silences this"
)
_WHY = {
    "vertical_sfvi": ("rho too large, a mean-field auxiliary guide, or too few iterations",
                      "lower rho, use nf.VerticalGuide('amortized') or fit longer"),
    "vertical_soul": ("SOUL's draws condition on the point z_hat, so they are narrower than the true posterior, and "
                      "the Langevin step adds a bias of order step_size",
                      "lower rho or step_size"),
}
_NETWORK = (
    "{cls}: the fit check of the true model needs every party's part, and {why}; check the fit in simulation "
    "(diagnose), or pass check_fit=False to silence this"
)
_NO_NETWORK_CHECK = {
    "vertical_soul": "over a network backend SOUL's check is not built yet (each party would fit its Gaussian to its "
                     "own Langevin chain at z_hat on its node; with server sites or the power form those chains need "
                     "the other parties' values, an exchange per step with server sites)",
}
_NOT_CORRECTABLE_STATE = "corrected=True needs check_fit=True and every party's state (simulation)"


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


class VerticalParts(NamedTuple):
    """``Setup.extra`` of the vertical families: the rewritten model's objective and the
    algorithm's party functions (``_build_algorithm``'s pair)."""

    objective: VerticalObjective
    algorithm: Any


class VerticalInference(FederatedInference):
    """``init / update / run / get_params`` over a vertical algorithm (see subclasses).

    Subclasses set ``self.optim``, ``self.batch_size``, ``self.model_kwargs`` and
    implement ``_build_algorithm(data) -> (objective, party functions)``.
    """

    optim: Any
    batch_size: Optional[int]
    model_kwargs: dict
    method: str = "vertical"
    setup_extra = VerticalParts  # Setup.extra
    params_type = VerticalParams
    loss_name: str = "loss"
    check_fit: bool = True  # run's fit check (the families' check_fit=)
    _checked_state = None  # the fingerprint of the state the last fit check was of

    def __init__(self, optim, batch_size, model_kwargs) -> None:
        self.optim = check_optimizer(optim)
        self.batch_size = batch_size
        self.model_kwargs = dict(model_kwargs or {})
        self.last_fit_check: Optional[FitDiagnostic] = None
        super().__init__()

    def _build_algorithm(self, data):  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_draws_fn(self, setup: Setup, num_draws: int) -> Callable:  # pragma: no cover - abstract
        """``(state, arrays, rng_key) -> (u, log_q, points)``: the check's Gaussian draws of every party."""
        raise NotImplementedError

    def _party_draw(self, setup: Setup, num_draws: int) -> Callable:  # pragma: no cover - abstract
        """``draw(party, params, key) -> (u, log_q, point)``: one party's check draws from its ``q``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the check over a network
    def client_value_inputs(self, name: str, setup, data) -> Dict[str, Any]:
        """The structure of what the server sends for :meth:`client_value` ``name``."""
        return network_check.value_inputs(type(self).__name__, name)

    def client_value(self, name: str, setup, client_state, data, payload, rng_key=None) -> Dict[str, Any]:
        """On a party after a network run: its part of the vertical fit check, from its own
        ``q``, rows and key (``rng_key``, never sent)."""
        self.client_value_inputs(name, setup, data)
        return network_check.client_value(self._party_draw, name, setup, client_state, data, payload, rng_key)

    def network_check(self, network, setup, result):
        """``(check, why, exchanges)`` of the fit check computed with the parties over ``network``."""
        return network_check.network_check(self._party_draw, network, setup, result)

    # ------------------------------------------------------------------ fit check (true model)
    def diagnose(self, result: Union[RunResult, RunState], num_draws: int = CHECK_DRAWS,
                 rng_key=None) -> FitDiagnostic:
        """How far the fit is from the **true** model's posterior (see
        :mod:`numpyro_fed.vertical.check`): Pareto k and the per-site moment check of
        ``p(theta, y) / q(theta)`` with ``z_j = g_j``, each client sending its ``g_j`` and one
        scalar per draw. Simulation only (every party's state is needed; a network run is
        checked on the parties' nodes after ``run``). Without ``rng_key`` each client draws
        from its own key, as on its node, so the check equals the network's; a given
        ``rng_key`` draws every party's values from it."""
        setup = fitted(self)
        state = state_of(self, result)
        check_positive_int("num_draws", num_draws, minimum=2)
        if state.clients is None:
            raise ValueError(f"{type(self).__name__}.diagnose needs every party's state (a simulation run)")
        own_keys = rng_key is None  # the default draws are the network check's: each client from its own key
        rng_key = random.PRNGKey(CHECK_KEY) if rng_key is None else rng_key
        obj = setup.extra.objective
        key = ("fit_check", int(num_draws))
        if key not in setup.cache:  # compiled once per set-up and draw count
            setup.cache[key] = jax.jit(check_function(obj, self._check_draws_fn(setup, int(num_draws))),
                                       static_argnums=3)
        log_p, log_q, u = setup.cache[key](state, setup.cache["data"], rng_key, own_keys)
        return vertical_fit_check(obj, log_p, log_q, u)

    def _warn_verdict(self, diag: FitDiagnostic) -> None:
        cls = type(self).__name__
        if diag.verdict == "unreliable":
            warnings.warn(_UNRELIABLE.format(cls=cls, k=diag.pareto_k, limit=PARETO_K_LIMIT, ess=diag.ess,
                                             n=len(diag.log_weights)), UnreliableFitWarning,
                          stacklevel=find_stack_level())
        elif diag.verdict == "biased":
            why, fix = _WHY[self.method]
            warnings.warn(_BIASED.format(cls=cls, k=diag.pareto_k, limit=PARETO_K_LIMIT, n=len(diag.log_weights),
                                         mean_margin=MEAN_MARGIN, sd_margin=SD_MARGIN,
                                         sites=describe_biased(diag.biased), why=why, fix=fix),
                          BiasedFitWarning, stacklevel=find_stack_level())

    def _validate_inputs(self, data) -> None:
        if not data:
            raise ValueError(_NO_DATA.format(cls=type(self).__name__))

    def _build(self, data: Mapping[str, Any]) -> Setup[VerticalParts]:
        arrays = {k: jnp.asarray(v) for k, v in validate_party_data(self.model, data).items()}
        refuse_dp(type(self).__name__, self.model, arrays, getattr(self, "model_kwargs", {}))
        obj, alg = self._build_algorithm(arrays)
        rows = jnp.arange(obj.num_rows)
        parties = tuple(PartyData(c, obj.party_args(c, arrays, rows)) for c in obj.clients)
        plan = ClientPlan(obj.clients, parties, "loop", obj.row_plate, np.full(len(obj.clients), obj.num_rows),
                          server_data=obj.party_args(SERVER, arrays, rows))
        return Setup(dict(data), vertical_protocol(alg, obj), plan, VerticalParts(obj, alg), {"data": arrays})

    def _params(self, setup: Setup, state: RunState) -> VerticalParams:
        """Every party's parameters, its ``numpyro.param`` sites (``"point"``) constrained as
        the model sees them (the algorithm holds them unconstrained)."""
        obj = setup.extra.objective

        def shown(params):
            return {**params, "point": obj.constrain_points(params["point"])} if "point" in params else params

        held = held_params(setup, state)
        return VerticalParams({c: shown(p) for c, p in held.items() if c != SERVER}, shown(held[SERVER]))

    def _client_view(self, setup: Setup, client_state):
        return client_state.inner

    @property
    def objective(self) -> VerticalObjective:
        return fitted(self).extra.objective

    def _inputs(self, clients, data: dict):
        """The model's data, passed as keyword arguments (a vertical federation has no Clients)."""
        if clients is not None:
            raise TypeError(f"{type(self).__name__} takes the model's data as keyword arguments (e.g. "
                            f"run(rng_key, num_rounds, x=x, y=y)), not a {type(clients).__name__}")
        return data

    def get_params(self, state: RunState) -> VerticalParams:
        """A :class:`~numpyro_fed.run.params.VerticalParams`: every party's parameters (gathered
        from their states) and the server's."""
        return self._params(fitted(self), state)


def party_draws(inference, draws: Dict[str, jax.Array], client: Optional[str]) -> Dict[str, jax.Array]:
    """``draws`` of every party's sites, or (``client``) of that party's own sites only."""
    if client is None:
        return draws
    obj = fitted(inference).extra.objective
    if client not in (SERVER,) + tuple(obj.clients):
        raise ValueError(f"{type(inference).__name__}: no party named {client!r}; parties are "
                         f"{[SERVER, *obj.clients]}")
    own = set(obj.layouts[client].names)
    return {k: v for k, v in draws.items() if k in own}


@register_check(VerticalInference)
def vertical_check(inference, result: RunResult) -> Verdict:
    """The vertical families' fit check against the true model's posterior (``diagnose``), kept
    as ``last_fit_check``, and the warning its verdict calls for. Over a network backend each
    party computes its part on its node (:mod:`numpyro_fed.vertical.network_check`); the
    verdict counts that traffic."""
    setup = fitted(inference)
    inference.last_fit_check = None
    if not inference.check_fit:
        return unchecked("check_fit=False")
    cls = type(inference).__name__
    communication = None
    if result.state.clients is None:
        network = checked_network(inference)
        why = _NO_NETWORK_CHECK.get(inference.method, "this backend cannot ask the parties")
        diag, exchanges = None, []
        if network is not None and inference.method not in _NO_NETWORK_CHECK:
            diag, why, exchanges = inference.network_check(network, setup, result)
        communication = with_exchange_traffic(result.communication, exchanges)
        if diag is None:
            warnings.warn(_NETWORK.format(cls=cls, why=why), UncheckedFitWarning, stacklevel=find_stack_level())
            return unchecked(why, communication)
        inference.last_fit_check = diag
    else:
        diag = inference.last_fit_check = inference.diagnose(result)
    inference._checked_state = state_fingerprint((result.state.server, result.state.clients))
    inference._warn_verdict(diag)
    return from_diagnostic(diag, communication)


def corrected_draws(inference, rng_key, state: RunState, num_samples: int) -> Dict[str, jax.Array]:
    """Every party's sites, importance-resampled from the check of ``state`` (its own
    check: the run's when ``state`` is the run's result, otherwise computed now)."""
    if not getattr(inference, "check_fit", True) or state.clients is None:
        raise ValueError(f"{type(inference).__name__}: {_NOT_CORRECTABLE_STATE}")
    check = inference.last_fit_check
    if check is None or getattr(inference, "_checked_state", None) != state_fingerprint((state.server, state.clients)):
        check = inference.diagnose(state)
    obj = fitted(inference).extra.objective
    flat = importance_resample(rng_key, check, num_samples, type(inference).__name__)
    return constrain_draws(obj, split_flat(obj, flat))


def check_batch(inference, obj: VerticalObjective) -> None:
    b = inference.batch_size
    if b is not None and check_positive_int("batch_size", b, what=_BATCH.format(n=obj.num_rows)) > obj.num_rows:
        raise ValueError(f"batch_size={b!r}: must be{_BATCH.format(n=obj.num_rows)}")


def held_params(setup: Setup, state: RunState) -> Dict[str, Any]:
    """``{party: its parameters}`` as the algorithm holds them (the server's under
    ``"server"``; over a network each party keeps its own, so only the server's)."""
    parties = {} if state.clients is None else {
        c: slot.state.inner.params for c, slot in zip(setup.plan.names, state.clients)}
    return {**parties, SERVER: state.server.inner.params}

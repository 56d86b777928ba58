"""What every inference object shares: set-up caching and ``init / update / run / save / load``.

An inference object (:class:`~numpyro_fed.FederatedSVI`, :class:`~numpyro_fed.PVI`,
:class:`~numpyro_fed.EP`, :class:`~numpyro_fed.HM1`, :class:`~numpyro_fed.VerticalSVI`,
:class:`~numpyro_fed.VerticalSOUL`) builds, once per set of clients, a
:class:`~numpyro_fed.run.protocol.FederatedAlgorithm` and a client plan, and hands both to a
backend, which owns the round loop. The class layers keep set-up, ``evaluate``,
``sample_posterior`` and friends.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Generic, Iterator, Mapping, NamedTuple, Optional, Sequence, TypeVar

import jax
import numpy as np

from .._typing import Structured
from ..check import run_check
from . import checkpoint as ckpt
from .backends.base import Backend, NetworkBackend
from .backends.mapping import ClientPlan
from .backends.simulation import SimulationBackend
from .posterior import ChainPosterior, DrawnPosterior
from .protocol import ClientStates, FederatedAlgorithm, RunResult, RunState
from .summary import print_summary
from .transcript import message_bytes

__all__ = ["FederatedInference", "NUM_SAMPLES", "Setup"]


Extra = TypeVar("Extra")


class Setup(NamedTuple, Generic[Extra]):
    """What an inference object builds once per set of clients. ``extra`` is the family's own
    part, of the type its class names in ``setup_extra`` (checked when the set-up is built):
    ``FederatedObjective`` (SFVI, SFVI-Avg), ``FactorSetup`` (PVI, EP, BCM),
    ``VerticalParts`` (vertical SVI, SOUL), ``int`` (HM1: the number of covariates)."""

    inputs: Any  # the clients (or vertical data) this set-up was built for
    algorithm: FederatedAlgorithm
    plan: ClientPlan
    extra: Extra
    cache: dict  # derived values computed on demand (compiled estimators, supports, ...)


def _shapes(tree) -> tuple:
    """A pytree's structure and leaf shapes (what two fits of one family and model share)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(tuple(getattr(x, "shape", ())) for x in leaves)


def with_exchange_traffic(comm, exchanges):
    """``comm`` plus the messages of the after-run exchanges (``[(sent, got), ...]``, each
    ``{client: message}``, as serialised; or a protocol's counted traffic, with ``up``,
    ``down``, ``msgs_up`` and ``msgs_down``): a fit check's traffic over a network backend."""

    for exchange in exchanges:
        if hasattr(exchange, "msgs_up"):
            comm = comm._replace(bytes_up=comm.bytes_up + exchange.up, bytes_down=comm.bytes_down + exchange.down,
                                 messages_up=comm.messages_up + exchange.msgs_up,
                                 messages_down=comm.messages_down + exchange.msgs_down)
            continue
        sent, got = exchange
        comm = comm._replace(bytes_up=comm.bytes_up + sum(message_bytes(m) for m in got.values()),
                             bytes_down=comm.bytes_down + sum(message_bytes(m) for m in sent.values()),
                             messages_up=comm.messages_up + len(got), messages_down=comm.messages_down + len(sent))
    return comm


def _same_inputs(a, b) -> bool:
    """Set-ups are reused for the very same inputs: the same object, or a mapping of the
    same objects (compared by identity while the set-up holds them, so never by a reused id)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping) and not hasattr(a, "names"):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return a is b


#: draws ``sample_posterior`` gives without ``num_samples`` (every family)
NUM_SAMPLES = 1000

#: the backend's run options, taken by every ``run`` (see :meth:`FederatedInference.run`)
RUN_OPTIONS = ("progress_bar", "init_state", "record_transcript", "keep_values", "availability", "checkpoint",
               "checkpoint_every", "on_nonfinite", "callbacks", "backend", "stage")


def fitted(inference) -> Setup:
    """The set-up of ``inference``'s last ``init``/``run`` (its model, clients, plan and compiled
    algorithm), refused with an error when it has not been fitted."""
    if inference._setup_cache is None:
        raise ValueError(f"this needs a fitted {type(inference).__name__}: call run() or init() first")
    return inference._setup_cache


def checked_network(inference) -> Optional[NetworkBackend]:
    """The network backend whose run ``inference`` is checking (set by ``run`` while its fit
    check (:func:`numpyro_fed.check.check_for`) runs, so that a check may ask the clients for
    values computed on their nodes); ``None`` in simulation and outside ``run``."""
    return inference._network


@contextmanager
def checking_over(inference, network: Optional[NetworkBackend]) -> Iterator[None]:
    """While open, ``inference``'s fit check asks ``network``'s clients for the values computed on
    their nodes (:func:`checked_network`; ``None``: the simulation's rows), as ``run`` does over a
    network backend."""
    inference._network = network
    try:
        yield
    finally:
        inference._network = None


def reset_setup(inference) -> None:
    """Drop ``inference``'s set-up: its next ``init`` or ``run`` builds it anew (for a family whose
    algorithm depends on more than its inputs, e.g. the start of FederatedMwG's chains)."""
    inference._setup_cache = None


def setup_for(inference, inputs) -> Setup:
    """``inference``'s set-up for ``inputs`` (the clients, or the vertical families' data):
    the last one when the inputs are the same, else built anew."""
    return inference._setup(inputs)


def state_of(inference, result, check_shapes: bool = True) -> RunState:
    """The run state of ``result`` (a :class:`RunResult` or :class:`RunState`), refused with
    an error naming both when it is another family's (or another fit's: its server state
    has another structure than this object's runs give)."""
    cls = type(inference).__name__
    if isinstance(result, RunResult):
        other = result.fitted_by
        if other and other != cls:
            raise ValueError(f"{cls} was given a result of {other}.run: each family's state holds its own "
                             f"parameters, so pass it to the {other} that produced it (or run this {cls})")
        state = result.state
    elif isinstance(result, RunState):
        state = result
    else:
        raise TypeError(f"{cls} needs a RunResult or RunState from its own run/init; got {type(result).__name__}")
    want = fitted(inference).cache.get("server_shapes") if check_shapes else None
    if want is not None and _shapes(state.server) != want:
        raise ValueError(f"{cls} was given a state whose server part does not match this {cls}'s fit (another "
                         f"family's, or a fit of another model or data): pass the result of this object's own "
                         f"run or init")
    return state


class FederatedInference:
    """Base class of the inference objects (not used directly).

    It implements the public contract once, as NumPyro's ``SVI.run`` drives ``SVI.update``:
    ``init``, ``update``, ``run``, ``save`` and ``load``. The inputs are the clients
    (horizontal families: ``Clients``, passed positionally) or the model's data as keyword
    arguments (vertical families); ``_inputs`` turns what was passed into them. Subclasses
    implement ``_build(inputs) -> Setup`` and may override ``_inputs``, ``_before_run``,
    ``_params`` and ``_client_view``; each family registers its fit check beside its class
    (:func:`numpyro_fed.check.register_check`), which ``run`` ends with.
    """

    method = "federated"
    #: ``run``'s default for ``progress_bar``
    progress_bar = True
    #: the type of ``Setup.extra`` that this family's ``_build`` returns
    setup_extra: ClassVar[type] = object
    #: the type of ``RunResult.params`` (one of :mod:`numpyro_fed.run.params`)
    params_type: ClassVar[type] = tuple
    #: the differentially private mechanisms the family offers (``dp=``); none: a model marked
    #: with ``dp_noise`` is refused
    dp_mechanisms: ClassVar[tuple] = ()
    #: ``run`` takes no number of rounds: the algorithm says when it is done (federated MCMC)
    open_ended: ClassVar[bool] = False
    #: ``run``'s keyword arguments of this family beyond the backend's (HM1: ``truth``)
    family_run_options: ClassVar[tuple] = ()
    #: the family's differential privacy (``numpyro_fed.dp.plan.DPPlan``), held by the families that offer it
    dp_plan: Any = None
    #: the network backend whose run is being checked (set by ``run`` for the family's fit check)
    _network: Optional[NetworkBackend] = None

    def __init__(self) -> None:
        """Every family's ``__init__`` calls this: no set-up yet, the simulation backend."""
        self._setup_cache: Optional[Setup] = None
        self._backend = SimulationBackend()

    # ------------------------------------------------------------------ public contract
    def init(self, rng_key: jax.Array, clients=None, **data) -> RunState:
        """The run state before round 1: the server's state and every client's (each
        initialises its own parameters and keeps its own PRNG key)."""
        return self._init(rng_key, self._inputs(clients, data))

    def update(self, state: RunState, clients=None, **data):
        """One communication round (jit-compiled). Returns ``(state, figure)``: the family's
        per-round figure, the one ``run`` records in ``RunResult.trace`` (``-ELBO`` for the SVI
        families, ``KL(q_new || q)`` for PVI and EP, the change in ``Theta`` for HM1)."""
        inputs = self._inputs(clients, data)
        state, info = self._update(state, inputs)
        return state, fitted(self).algorithm.monitor(info)

    def run(self, rng_key: jax.Array, clients=None, num_rounds: Optional[int] = None, **kwargs: Any) -> RunResult:
        """Run ``num_rounds`` communication rounds (on the simulation backend unless
        ``backend=`` names another).

        Args:
            rng_key: the run's key; the server's and every client's own key derive from it.
            clients: an :class:`~numpyro_fed.Clients` (horizontal families); the vertical
                families take the model's data as keyword arguments instead.
            num_rounds: communication rounds. The families that end when they are done
                (federated MCMC, Laplace) take it as a cap and have a default; a run that
                reaches the cap unfinished raises.
            **kwargs: the backend's run options (:data:`RUN_OPTIONS`): ``progress_bar``
                (default: the class's ``progress_bar``; a tqdm bar with the running figure;
                without it, a transcript, callbacks or checkpoints all rounds run in one
                ``lax.while_loop``), ``init_state`` (resume), ``record_transcript`` /
                ``keep_values``, ``availability`` (simulated dropout), ``checkpoint`` /
                ``checkpoint_every``, ``on_nonfinite`` (``"raise"`` or ``"warn"``),
                ``callbacks`` and ``backend`` (see
                :meth:`numpyro_fed.run.backends.SimulationBackend.run`), ``stage`` (the text of the
                ``nf.fit`` rung this run is, which a network backend's nodes build the same
                rung from: :meth:`numpyro_fed.fitting.ladder.Ladder.stage`); the family's own
                (:attr:`family_run_options`, e.g. HM1's ``truth``); for the vertical
                families, the model's data too.

        Returns:
            a :class:`~numpyro_fed.RunResult`: ``params`` (the family's, see its class),
            ``trace`` the per-round figure (also ``losses``), ``client_states`` each client's
            final state (gathered by the simulation).
        """
        options = {k: kwargs.pop(k) for k in RUN_OPTIONS + self.family_run_options if k in kwargs}
        options.setdefault("progress_bar", self.progress_bar)
        inputs = self._inputs(clients, kwargs)
        num_rounds = self._rounds(num_rounds, options)
        self._before_run(rng_key, num_rounds, inputs, options)
        return self._run(rng_key, num_rounds, inputs, **options)

    @property
    def draws_are_chains(self) -> bool:
        """Whether the family's draws are Markov chains (a sampler: it defines :meth:`posterior`;
        ``get_samples`` gives its chains, summarised with n_eff and R-hat)."""
        return type(self).posterior is not FederatedInference.posterior

    def posterior(self, result) -> ChainPosterior:
        """The fit's posterior (:mod:`numpyro_fed.run.posterior`), which :meth:`get_samples` and
        :meth:`sample_posterior` read: a sampler's chains (a
        :class:`~numpyro_fed.run.posterior.ChainPosterior`); for an approximate family a
        :class:`~numpyro_fed.run.posterior.DrawnPosterior` of its :meth:`draw`, whose chains are one
        "chain" of :data:`NUM_SAMPLES` draws from a key derived from the run's own server key (the
        same draws at every call)."""
        if type(self).draw is FederatedInference.draw:
            raise NotImplementedError(f"{type(self).__name__}: a family defines posterior or draw")

        def draw(rng_key, num_samples, client, **options):
            return self.draw(rng_key, result, num_samples, client=client, **options)

        return DrawnPosterior(draw, lambda: jax.random.fold_in(state_of(self, result).server_key, 0x5A))

    def draw(self, rng_key: jax.Array, result, num_samples: Optional[int] = None, *, client: Optional[str] = None,
             **options: Any) -> dict:
        """New draws of an approximate family's posterior (``num_samples``, default
        :data:`NUM_SAMPLES`), constrained: what :meth:`sample_posterior` gives. Each approximate
        family defines it and documents its draws and options (e.g. ``corrected=``); a sampler
        defines :meth:`posterior` instead."""
        raise NotImplementedError(f"{type(self).__name__} does not draw: its posterior is {type(self).posterior}")

    def sample_posterior(self, rng_key: jax.Array, result, num_samples: Optional[int] = None, *,
                         client: Optional[str] = None, **options: Any) -> dict:
        """``num_samples`` draws of the fit's posterior, constrained: the global sites, and with
        ``client`` that client's local sites at the same draws (its own computation). A sampler
        picks them from its chains without replacement (all of them when ``None``); an
        approximate family draws them anew (:meth:`draw`, default :data:`NUM_SAMPLES`, with its
        ``options``, e.g. ``corrected=True``), as its ``draw`` documents."""
        return self.posterior(result).sample_posterior(rng_key, num_samples, client=client, **options)

    def get_samples(self, result, group_by_chain: bool = False, *, client: Optional[str] = None) -> dict:
        """The fit's posterior draws, as NumPyro's ``MCMC.get_samples``, read from
        :meth:`posterior`: ``{site: (num_chains * num_samples, ...)}``, or ``(num_chains,
        num_samples, ...)`` with ``group_by_chain``; with ``client``, that client's local sites
        at the same draws as well."""
        return self.posterior(result).get_samples(group_by_chain, client=client)

    @property
    def differentially_private(self) -> bool:
        """Does the fit send differentially private updates (planned at set-up: ``dp=``, or a
        model marked with ``dp_noise``)? Its clients then keep their data-dependent diagnostics."""
        return self.dp_plan is not None and self.dp_plan.privacy is not None

    def privacy_report(self, result):
        """Per client: epsilon at ``delta`` for the rows it holds, the mechanism, the
        releases composed (DP-SGD: local steps or gradients; update perturbation: global
        updates), the sampling rate; and the global guarantee by parallel composition (the
        max over clients). Computed from each client's own ledger (``releases`` in its
        state: what it sent, whether or not the server used it); under a trusted aggregator
        each release is charged the noise of the fewest clients that answered in any round
        of the run (a bound, since a client does not know who else answered)."""
        if self.dp_plan is None:
            raise ValueError(f"privacy_report: {type(self).__name__} has no differentially private mechanism "
                             f"(PVI, BCM and FederatedSVI have one: dp=)")
        return self.dp_plan.report(type(self).__name__, fitted(self).plan.names, result)

    def print_summary(self, result: RunResult, *, prob: float = 0.9, num_samples: int = 1000,
                      rng_key: Optional[jax.Array] = None) -> None:
        """Print the posterior of the global sites (mean, sd, median, the central ``prob``
        interval; ESS and R-hat for MCMC) and the fit check's verdict; see
        :func:`numpyro_fed.print_summary`."""

        print_summary(self, result, prob=prob, num_samples=num_samples, rng_key=rng_key)

    def load(self, path: str, clients=None, **data) -> RunState:
        """A run state saved by :meth:`save`, for the same clients (or vertical data): pass it
        as ``init_state=``."""
        return self._load(path, self._inputs(clients, data))

    # ------------------------------------------------------------------ hooks
    def _inputs(self, clients, data: dict):
        """What ``init``/``update``/``run``/``load`` were given, as this family's inputs: the
        clients (horizontal families; the vertical ones override this to take ``data``)."""
        if data:
            raise TypeError(f"{type(self).__name__}: unexpected keyword arguments {sorted(data)} (the run options "
                            f"are {list(RUN_OPTIONS)}; the data go in as the Clients)")
        return clients

    def _rounds(self, num_rounds: Optional[int], options: dict) -> int:
        """The run's rounds: ``num_rounds``, or the cap of a family that ends when it is done."""
        if num_rounds is None:
            raise TypeError(f"{type(self).__name__}.run() needs num_rounds, the number of communication rounds")
        return num_rounds

    def _before_run(self, rng_key: Optional[jax.Array], num_rounds: int, inputs, options: dict) -> None:
        """Prepare a run before its set-up (a family takes its own run options,
        :attr:`family_run_options`, out of ``options``). A noise calibrated to ``epsilon=``
        plans for this run's rounds (a new plan builds the set-up again)."""
        if self.dp_plan is not None:
            self.dp_plan.ledger = options.pop("ledger", None)  # (run(ledger=...): charged in _run)
            if self.dp_plan.before_run(inputs, num_rounds, options):
                self._setup_cache = None

    def node_setup(self, inputs, num_rounds: int) -> Setup:
        """The set-up a node of a network deployment builds for its part of a run of
        ``num_rounds`` rounds (a DP family plans its noise for the run first): what a network
        backend's node calls where the simulation calls ``run``."""
        self._before_run(None, num_rounds, inputs, {})
        return self._setup(inputs)

    def _validate_inputs(self, inputs) -> None:
        """Raise a clear error for inputs of the wrong kind."""

    def _build(self, inputs) -> Setup:  # pragma: no cover - abstract
        raise NotImplementedError

    def _params(self, setup: Setup, state: RunState) -> dict:
        return state.server

    def _client_view(self, setup: Setup, client_state):
        """What ``RunResult.client_states`` shows of a client's algorithm state."""
        return client_state

    # ------------------------------------------------------------------ set-up
    def _setup(self, inputs) -> Setup:
        self._validate_inputs(inputs)
        cached = self._setup_cache
        if cached is not None and _same_inputs(cached.inputs, inputs):
            return cached
        self._size_group_plates(inputs)
        setup = self._build(inputs)
        if not isinstance(setup.extra, self.setup_extra):
            raise TypeError(f"{type(self).__name__}._build: Setup.extra is a {type(setup.extra).__name__}, not the "
                            f"{self.setup_extra.__name__} its class declares (setup_extra)")
        algorithm = setup.algorithm._replace(name=self.method, layout=self._layout(setup))
        self._setup_cache = setup._replace(algorithm=algorithm)
        return self._setup_cache

    def _layout(self, setup: Setup) -> str:
        """The model's sites whose values the run state's flat vectors hold, in order
        (:func:`~numpyro_fed.run.checkpoint.site_layout`): recorded in a checkpoint, checked on resume.
        ``""`` for a family whose set-up lays out no model sites."""
        extra = setup.extra
        return ckpt.site_layout(extra.structure) if isinstance(extra, Structured) else ""

    def _size_group_plates(self, inputs) -> None:
        """Size the model's group plates (:func:`numpyro_fed.group_plate`) for these inputs; the
        families whose model is split by rows set this to :func:`numpyro_fed.model.groups.size_group_plates`."""

    def _remember_shapes(self, setup: Setup, state: RunState) -> None:
        setup.cache["server_shapes"] = _shapes(state.server)

    # ------------------------------------------------------------------ API
    def _init(self, rng_key: jax.Array, inputs) -> RunState:
        setup = self._setup(inputs)
        state = self._backend.init(setup.algorithm, setup.plan, rng_key)
        self._remember_shapes(setup, state)
        return state

    def _update(self, state: RunState, inputs):
        setup = self._setup(inputs)
        state = state_of(self, state)
        self._before_round(setup, state)
        return self._backend.step(setup.algorithm, setup.plan, state)

    def _before_round(self, setup: Setup, state: RunState) -> None:
        """Refuse a round before it runs: a private fit's client that has spent its planned
        releases (:meth:`~numpyro_fed.dp.plan.DPPlan.before_round`)."""
        if self.dp_plan is not None:
            self.dp_plan.before_round(type(self).__name__, setup.plan.names, state)

    def _run(
        self,
        rng_key: jax.Array,
        num_rounds: int,
        inputs,
        *,
        backend: Any = None,
        progress_bar: bool = True,
        init_state: Optional[RunState] = None,
        record_transcript: bool = False,
        keep_values: bool = False,
        availability: Any = None,
        checkpoint: Optional[str] = None,
        checkpoint_every: Optional[int] = None,
        on_nonfinite: str = "raise",
        callbacks: Sequence[Callable] = (),
        stage: str = "",
    ) -> RunResult:
        _check_backend(backend, self)
        setup = self._setup(inputs)
        if init_state is not None:
            init_state = self._conform(setup, init_state)
        backend = self._backend if backend is None else backend
        if self.dp_plan is not None:  # a ledger given to this run refuses it before any round
            if getattr(self.dp_plan, "ledger", None) is not None:  # each client's spend kept under its rows
                self.dp_plan.ledger.identify_clients(inputs)
            self.dp_plan.before_start(type(self).__name__, setup.plan.names, num_rounds)
        result = backend.run(
            setup.algorithm, setup.plan, num_rounds, rng_key, init_state=init_state, progress_bar=progress_bar,
            record_transcript=record_transcript, keep_values=keep_values, checkpoint=checkpoint,
            checkpoint_every=checkpoint_every, callbacks=callbacks, availability=availability,
            on_nonfinite=on_nonfinite, **({"stage": stage} if stage else {}),
        )
        _check_someone_answered(result, type(self).__name__)
        states = result.client_states
        result = result._replace(
            params=self._params(setup, result.state),
            client_states=ClientStates(
                setup.plan.names, lambda j: self._client_view(setup, states[setup.plan.names[j]])
            ),
            fitted_by=type(self).__name__,
        )
        self._remember_shapes(setup, result.state)
        if self.dp_plan is not None:
            self.dp_plan.after_run(type(self).__name__, setup.plan.names, result)
        network = backend if isinstance(backend, NetworkBackend) else None  # a network backend's clients
        with checking_over(self, network):  # the family's fit check (numpyro_fed.check): it warns or raises, and
            return run_check(self, result)  # its verdict goes in the result

    def save(self, path: str, state: "RunState | RunResult") -> None:
        """Save a run state to ``path`` (an ``.npz`` file; see :mod:`numpyro_fed.run.checkpoint`)."""
        setup = fitted(self)
        state = state_of(self, state)
        ckpt.save(path, state, setup.plan.names, family=self.method, layout=setup.algorithm.layout)

    def _load(self, path: str, inputs) -> RunState:
        setup = self._setup(inputs)
        meta = ckpt.read_meta(path)
        if meta.get("family") not in ("", self.method):
            raise ValueError(f"the checkpoint at {path} is of a {meta['family']} run, not {self.method}")
        template = self.state_template(setup, meta.get("typed_keys", {}).get("server_key"))
        return ckpt.load(path, template, setup.plan.names, layout=setup.algorithm.layout)

    def state_template(self, setup: Setup, key_impl: Optional[str] = None):
        """The shapes and dtypes of this set-up's run state (nothing is computed); its keys
        typed (``jax.random.key`` with ``key_impl``) or raw."""
        key = jax.random.PRNGKey(0) if key_impl is None else jax.random.key(0, impl=key_impl)
        return jax.eval_shape(lambda k: self._backend.init(setup.algorithm, setup.plan, k), key)

    def _conform(self, setup: Setup, init_state) -> RunState:
        """``init_state`` (a RunResult or RunState) checked as :meth:`load` checks a file:
        this family's, the same clients, every leaf's shape and dtype."""
        saved = (
            list(init_state.client_states)
            if isinstance(init_state, RunResult) and init_state.client_states is not None
            else None
        )
        state = state_of(self, init_state, check_shapes=False)  # conform checks every leaf
        typed = jax.numpy.issubdtype(state.server_key.dtype, jax.dtypes.prng_key)
        template = self.state_template(setup, str(jax.random.key_impl(state.server_key)) if typed else None)
        return ckpt.conform(state, template, setup.plan.names, saved)


_BACKEND_STRING = (
    "{cls}.run(backend={value!r}): backend= takes a backend object (e.g. numpyro_fed.flower.FlowerBackend inside "
    "a ServerApp), not a string. How the simulation maps its clients is set on the inference object: "
    "{cls}(..., client_mapping={mapping!r})"
)


def _check_backend(backend, inference) -> None:
    """Refuse the old spelling ``backend="vmap"`` (and anything that is not a backend)."""
    if backend is None:
        return
    cls = type(inference).__name__
    if isinstance(backend, str):
        mapping = backend if backend in ("vmap", "loop", "auto") else "auto"
        raise ValueError(_BACKEND_STRING.format(cls=cls, value=backend, mapping=mapping))
    if not isinstance(backend, Backend):
        raise TypeError(
            f"{cls}.run(backend=...): a {type(backend).__name__} is not a backend (it has no run method); "
            f"leave backend= out to simulate, or pass numpyro_fed.flower.FlowerBackend"
        )


def _check_someone_answered(result: RunResult, cls: str) -> None:
    """A run in which no client ever answered has fitted nothing: raise, for every family."""
    answered = result.rounds_answered
    if answered is None or np.size(answered) == 0 or np.any(np.asarray(answered) > 0):
        return
    raise ValueError(
        f"{cls}.run: no client answered in any of the {np.size(answered)} round(s) (every client was unavailable, "
        f"dropped out or timed out), so the result would be the initial state, not a fit. Check availability= "
        f"(or, in a deployment, that the nodes are up and reachable) and run again"
    )

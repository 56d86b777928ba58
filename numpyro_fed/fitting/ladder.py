"""``nf.fit``: one call that returns the posterior of a federated model, checked.

A ladder, the cheapest right answer first, every rung checked against the posterior:

1. **Laplace** (:class:`~numpyro_fed.factor.Laplace`): Newton rounds on the global sites, the
   local latents integrated on their clients; typically 5-20 rounds. Flat priors are accepted
   where the posterior is proper; an improper posterior (no mode) is refused, naming the sites.
2. **Two fit checks** of that Gaussian ``q`` against the posterior (Pareto-smoothed importance
   sampling, each client computing its own term; :mod:`numpyro_fed.check.psis`): ``q``'s own
   (draws from ``q``), and a widened one (draws from ``q`` with its sd times :data:`WIDEN`, which
   reach the tails a too-narrow ``q`` never draws from). ``q`` is accepted when its own verdict is
   ``ok`` (Pareto k at most :data:`ACCEPT_K`, no biased site) and its means and sds agree with the
   widened check's weighted ones (within the tolerance :func:`fit` promises, means within 0.2 sds
   and sds within 15 %, with three of the check's Monte Carlo standard errors to spare);
   otherwise the widened check's importance-resampled draws are accepted when its Pareto k is
   at most :data:`CORRECT_K`, its ESS at least :data:`CORRECT_MIN_ESS` of :data:`CORRECT_DRAWS`,
   and both checks' importance-weighted moments agree (where they differ, the posterior's tails
   reach past what the draws see). Over a network backend (Flower) both checks run on the
   clients, each computing its own term on its own node.
3. Otherwise **exact federated Metropolis-within-Gibbs** (:mod:`~numpyro_fed.mcmc.mwg_algorithm`):
   one round per iteration, :data:`MWG_CHAINS` chains side by side, started at the Laplace mode;
   with few globals proposing by its covariance (4 candidates a round, resampled by their
   importance weights, or a random walk with a Metropolis-Hastings test), with more (from
   :data:`~numpyro_fed.mcmc.mwg_inference.SURROGATE_FROM` global scalars, where importance
   sampling around one Gaussian fails) by the surrogate transition (:mod:`~numpyro_fed.mcmc.surrogate`:
   the server's Hamiltonian trajectories on the exact prior and a quadratic surrogate of the
   likelihood, each corrected by delayed acceptance in one round); every move exact,
   the local latents moved on their clients; :data:`MWG_WARMUP` warmup rounds. Then by cost:
   chains that barely move (acceptance under 5 %) go to NUTS; chains short of
   :data:`MWG_MIN_ESS` effective draws at a global scalar, or not converged (split R-hat above
   1.05), run on once where their own rounds per effective draw are at most
   :data:`~numpyro_fed.run.budget.NUTS_ROUNDS_PER_DRAW`, and go to NUTS where they cost more or
   still disagree after running on.
   Where the Laplace search found no mode but stopped where the curvature is positive definite, it starts there.
4. Otherwise (or where it is not) **exact federated NUTS**, started at the Laplace mode (or where the user said) and
   preconditioned by the Laplace covariance (the chain runs in ``z = L^-1 (u - mode)``, ``L
   L^T`` the covariance: a dense mass matrix); ``num_warmup`` defaults to :data:`WARM_WARMUP`
   instead of NumPyro's 500. It pays one round per leapfrog step of its slowest chain, whatever the
   number of chains, so it runs :data:`NUTS_CHAINS` short chains side by side (each of
   ``2 num_samples / NUTS_CHAINS`` draws, at least :data:`NUTS_MIN_DRAWS`: the draws of two long
   chains for the rounds of one short one; :mod:`numpyro_fed.fitting.rung_choice`), and warns, naming the
   scalars, where its chains have a split R-hat above 1.05 or a bulk ESS under 100
   (:mod:`~numpyro_fed.check.chains`), and where their E-BFMI is under 0.3, naming the scalars that
   carry the energy (:mod:`~numpyro_fed.check.energy`).

Every rung together spends at most ``max_rounds`` rounds (:data:`~numpyro_fed.run.budget.MAX_ROUNDS`
by default): a sampler whose pace projects more stops before spending them and :func:`fit`
raises :class:`~numpyro_fed.run.budget.RoundBudgetError` (:mod:`numpyro_fed.run.budget`).

``exact=True`` skips the Laplace checks: the Laplace search only finds the samplers' start, and
the answer is rung 3's (or 4's).

What was tried, in order, and why the ladder moved on is in :attr:`Fit.log`.

In simulation, a second :func:`fit` of the same model, options and data (by content) in the same
process runs the rungs the first built, which compiles nothing (:mod:`numpyro_fed.fitting.cache`: the
model is traced once first, so that one reading a changed global builds anew).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Optional, Sequence

import jax

from .._validation import check_init, check_positive_int
from ..check.advice import advice
from ..check.laplace import ACCEPT_K, CORRECT_DRAWS, CORRECT_K, CORRECT_MIN_ESS, WIDEN
from ..dp.private_fit import PrivateFit
from ..model.groups import sized_model
from ..model.trace import content_digest
from ..run.backends.base import NetworkBackend
from ..run.budget import MAX_ROUNDS, RoundBudgetError, over_budget
from ..run.inference import RUN_OPTIONS, fitted
from .cache import kept_rungs
from .private_rungs import PRIVATE_RUNGS
from .result import Fit
from .rung_choice import MWG_MAX_LONGER, MWG_MIN_ESS, NUTS_CHAINS, NUTS_MIN_DRAWS
from .rungs import MWG_CHAINS, MWG_WARMUP, RUNGS, WARM_WARMUP, Climb, Rung, warm_settings

__all__ = ["ACCEPT_K", "CORRECT_DRAWS", "CORRECT_K", "CORRECT_MIN_ESS", "Fit", "Ladder", "MWG_CHAINS", "MWG_MAX_LONGER",
           "MWG_MIN_ESS", "MWG_WARMUP", "NUTS_CHAINS", "NUTS_MIN_DRAWS", "RUNG_OPTIONS", "WARM_WARMUP", "WIDEN", "fit",
           "split_options"]

RUNG_OPTIONS = {k: tuple(r.name for r in RUNGS + PRIVATE_RUNGS if k in r.takes)
                for k in dict.fromkeys(k for r in RUNGS + PRIVATE_RUNGS for k in r.takes)}
"""The options :func:`fit` passes to its rungs' classes: name -> the rungs that take it (each rung's
:attr:`~numpyro_fed.fitting.rungs.Rung.takes`; ``"laplace"``: :class:`~numpyro_fed.factor.Laplace`;
``"mwg"``: federated Metropolis-within-Gibbs; ``"nuts"``: :class:`~numpyro_fed.FederatedNUTS`;
``"dp_laplace"``, ``"dp_metropolis"``: the private rungs)."""

_UNKNOWN_OPTION = (
    "nf.fit: no rung takes {names} and no backend runs with it. A rung's options (each passed to the rungs that take "
    "it): {rungs}; the run options (passed to every rung): {run}; and fit's own arguments (exact, num_samples, "
    "num_warmup, num_chains, model_kwargs, row_plate, client_mapping, progress_bar, max_rounds, dp, init)"
)
_PRIVATE_OPTIONS = "nf.fit(dp=...) runs a private start and DPMetropolis; it takes no {names} (its own: {own})"


def split_options(options: Dict[str, Any]):
    """``(rung options, run options)`` of :func:`fit`'s keyword options (see :data:`RUNG_OPTIONS`);
    a name in neither raises ``TypeError`` naming both lists."""
    rung = {k: v for k, v in options.items() if k in RUNG_OPTIONS}
    run = {k: v for k, v in options.items() if k not in RUNG_OPTIONS}
    unknown = sorted(set(run) - set(RUN_OPTIONS))
    if unknown:
        raise TypeError(_UNKNOWN_OPTION.format(names=unknown, rungs=sorted(RUNG_OPTIONS), run=sorted(RUN_OPTIONS)))
    return rung, run


def fit(model: Callable, clients: Any, rng_key: jax.Array, *, exact: bool = False, num_samples: int = 1000,
        num_warmup: Optional[int] = None, num_chains: Optional[int] = None, model_kwargs: Optional[dict] = None,
        row_plate: Optional[str] = None, client_mapping: str = "auto", progress_bar: Optional[bool] = None,
        max_rounds: Optional[int] = MAX_ROUNDS, dp: Any = None, init: Any = None, **options: Any) -> Fit:
    """Fit ``model`` to the federation ``clients``: the posterior of its global sites, checked.

    Tries the Laplace approximation (a few Newton rounds), keeps it when the fit checks pass,
    and otherwise samples the pooled posterior exactly, started from it: federated
    Metropolis-within-Gibbs (one round per iteration), and federated NUTS where that fails its
    mixing check or there is no mode (see :mod:`numpyro_fed.fitting.ladder` for the thresholds).
    ``fit(model, clients, key, **options)`` is ``Ladder(model, **options).run(key, clients)``;
    over Flower, a task whose ``make_inference`` returns a :class:`Ladder` runs the same
    ladder, every rung over the network (``docs/flower.md``).

    Args:
        model: a NumPyro model, annotated as for any family (``nf.local_site``, ``nf.group_plate``).
        clients: the :class:`~numpyro_fed.Clients`.
        rng_key: the key every rung's keys derive from.
        exact: skip the Laplace checks: the answer is an exact sampler's (exact up to Monte
            Carlo error), started from the Laplace search.
        num_samples: draws kept (Metropolis-within-Gibbs: per chain; NUTS: ``2 num_samples`` over its
            chains, :func:`~numpyro_fed.fitting.rung_choice.nuts_draws`, per chain where ``num_chains`` is
            given; Laplace: draws of :meth:`Fit.get_samples`).
        num_warmup: the samplers' warmup (default: :data:`MWG_WARMUP` for Metropolis-within-Gibbs;
            for NUTS :data:`WARM_WARMUP` from the Laplace fit, 500 from no mode).
        num_chains: the samplers' chains (default: :data:`MWG_CHAINS` for
            Metropolis-within-Gibbs, :data:`NUTS_CHAINS` for NUTS; the chains share each round).
        model_kwargs: non-data keyword arguments of the model, as every family's.
        row_plate: the plate that indexes rows, when padding is ambiguous, as every family's.
        client_mapping: how the simulation lays clients out, as every family's.
        progress_bar: show each rung's progress (default: the families' default, on); a sampler's
            bar shows the rounds its whole run is projected to need, from its own pace.
        max_rounds: the bound on the rounds of every rung together (default
            :data:`~numpyro_fed.run.budget.MAX_ROUNDS`, about 20 minutes over a network at 58 ms a
            round; ``None``: no bound). A sampler whose pace projects more stops before it spends
            them and ``fit`` raises :class:`~numpyro_fed.run.budget.RoundBudgetError` with the
            projection, the draws it has and what to do.
        init: where the fit starts: a dict ``{global site: value}`` (constrained values; the global
            sites it leaves out start at their prior's mean), or a NumPyro init strategy
            (``numpyro.infer.init_to_value(values=...)``, ``init_to_median()``,
            ``init_to_uniform()``, ...). The Laplace search starts there, and so the samplers started
            from its mode; where it finds no mode, federated NUTS starts there too. A posterior with
            several modes (a mixture, whose components the prior treats alike) needs it: from the
            prior's mean, where the components coincide, the search stops at that symmetric point.
        dp: a :class:`~numpyro_fed.dp.PrivateFit`: fit the ``dp_noise``-marked model under
            differential privacy: its whole budget on a private Laplace fit
            (:class:`~numpyro_fed.dp.dp_laplace.DPLaplace`), or with ``exact=True`` on a private
            start and the exact DP sampler from it (:class:`~numpyro_fed.mcmc.DPMetropolis`), every
            client's releases composed (:mod:`numpyro_fed.fitting.private_rungs`;
            :meth:`Fit.privacy_report`; ``ledger=`` a :class:`~numpyro_fed.dp.PrivacyLedger` refuses the
            fit before it starts where it would take a client past its budget, and is charged both
            stages). A ``dp_noise``-marked model without ``dp=`` is refused.
        **options: a rung's own options (:data:`RUNG_OPTIONS`: e.g. ``target_accept_prob``,
            ``max_tree_depth``, ``step_size`` for federated NUTS; ``inner_steps``, ``local_blocks``
            for the Laplace search and Metropolis-within-Gibbs; ``tol`` for the Laplace search),
            each passed to the rungs that take it; and the backend's run options (``backend``,
            ``record_transcript``, ``availability``, ``on_nonfinite``, ...), passed to every rung.

    Returns:
        a :class:`Fit`.

    Raises:
        ValueError: the posterior is improper (no mode; naming the sites), or the model is one
            no rung can fit (as the families' own errors say).
        RoundBudgetError: the answer would need more than ``max_rounds`` rounds.
        TypeError: an option no rung takes and no backend runs with (naming the accepted ones).

    Example:
        >>> import jax, numpy as np, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x, y):
        ...     b = numpyro.sample("b", dist.Normal(0.0, 10.0))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(b * x, 1.0), obs=y)
        >>> x = np.linspace(-1, 1, 60); y = 2.0 * x
        >>> result = nf.fit(model, nf.Clients.split(np.repeat([0, 1, 2], 20), x=x, y=y), jax.random.PRNGKey(0),
        ...                 progress_bar=False)
        >>> result.method, result.check.verdict
        ('laplace', 'ok')
    """
    ledger = options.pop("ledger", None)  # a private fit's run option (nf.dp.PrivacyLedger)
    rung_options, run_options = split_options(options)

    if ledger is not None:
        if dp is None:
            raise ValueError("nf.fit(ledger=...) accounts a differentially private fit: mark the model with dp_noise "
                             "and pass dp=nf.dp.PrivateFit(...)")
        run_options = dict(run_options, ledger=ledger)
    ladder = Ladder(model, exact=exact, num_samples=num_samples, num_warmup=num_warmup, num_chains=num_chains,
                    model_kwargs=model_kwargs, row_plate=row_plate, client_mapping=client_mapping,
                    progress_bar=progress_bar, max_rounds=max_rounds, dp=dp, init=init, **rung_options)
    return ladder.run(rng_key, clients, **run_options)


class Ladder:
    """:func:`fit`'s ladder as an object: its options, its rungs
    (:class:`~numpyro_fed.fitting.rungs.Rung` objects, :data:`~numpyro_fed.fitting.rungs.RUNGS` by
    default), the inference object of each (:meth:`rung`), and :meth:`run`, one loop over them.

    Over Flower, a :class:`~numpyro_fed.flower.FlowerTask` whose ``make_inference`` returns a
    ``Ladder`` runs :func:`fit` over the network: before each rung the server tells the clients
    which one (its :meth:`stage` text, in the set-up message: the rung's name and, for NUTS
    started from the Laplace fit, that fit's mode and covariance, which are global), and every
    party builds the same inference object from it with :meth:`rung`.

    With ``dp=`` (a :class:`~numpyro_fed.dp.PrivateFit`, on a ``dp_noise``-marked model) it is
    :func:`fit`'s private form (:mod:`numpyro_fed.fitting.private_rungs`): its stages, the private start
    and the exact DP sampler, are announced and built the same way.

    Args: those of :func:`fit` but the model's data and the run options (a rung's own options,
    such as ``target_accept_prob``, by keyword); and ``rungs``, the rungs to climb (default
    :data:`~numpyro_fed.fitting.rungs.RUNGS`, with ``dp=``
    :data:`~numpyro_fed.fitting.private_rungs.PRIVATE_RUNGS`): the first runs with its
    :meth:`~numpyro_fed.fitting.rungs.Rung.start` settings, and each one's judge names the next.
    """

    #: an open-ended family (runs until it is done): a Flower task passes no round count
    open_ended = True

    def __init__(self, model: Callable, *, exact: bool = False, num_samples: int = 1000,
                 num_warmup: Optional[int] = None, num_chains: Optional[int] = None,
                 model_kwargs: Optional[dict] = None,
                 row_plate: Optional[str] = None, client_mapping: str = "auto",
                 progress_bar: Optional[bool] = None, max_rounds: Optional[int] = MAX_ROUNDS,
                 dp: Optional[Any] = None, init: Any = None, rungs: Optional[Sequence[Rung]] = None,
                 **rung_options: Any) -> None:
        self.init = check_init("nf.fit", init)
        self.dp = None if dp is None else PrivateFit(*dp).checked()
        if self.dp is not None and init is not None:
            raise ValueError("nf.fit(dp=..., init=...): a private fit starts from its own private Laplace fit "
                             "(nf.dp.PrivateFit); drop init=")
        self.rungs = tuple(rungs) if rungs is not None else PRIVATE_RUNGS if self.dp is not None else RUNGS
        taken = {k for rung in self.rungs for k in rung.takes}
        unknown = sorted(set(rung_options) - taken)
        if unknown:
            raise TypeError(_UNKNOWN_OPTION.format(names=unknown, rungs=sorted(taken), run=sorted(RUN_OPTIONS))
                            if self.dp is None else _PRIVATE_OPTIONS.format(names=unknown, own=sorted(taken)))
        self.model, self.exact = model, bool(exact)
        self.rung_options = dict(rung_options)
        self.num_samples, self.num_warmup = int(num_samples), num_warmup
        self.num_chains = None if num_chains is None else int(num_chains)
        self.model_kwargs, self.row_plate, self.client_mapping = dict(model_kwargs or {}), row_plate, client_mapping
        self.progress_bar = progress_bar
        self.max_rounds = None if max_rounds is None else check_positive_int("max_rounds", max_rounds)
        self.default_warmup = MWG_WARMUP  # a private fit's sampler's warmup where num_warmup is not given

    @property
    def differentially_private(self) -> bool:
        """Whether this is :func:`fit`'s private form (``dp=``)."""
        return self.dp is not None

    # ------------------------------------------------------------------ rungs
    def named(self, name: str) -> Rung:
        """This ladder's rung called ``name``."""
        for rung in self.rungs:
            if rung.name == name:
                return rung
        raise ValueError(f"Ladder.rung: no rung {name!r} (its rungs: {[r.name for r in self.rungs]})")

    def stage(self, name: str, warm: Optional[tuple] = None, **settings: Any) -> str:
        """The public text naming a rung and its settings (``warm``: the ``(mean, cov)`` of the
        unconstrained global sites a sampler starts from, or is preconditioned by): ``"rung"``, its
        name; ``"key"``, the number the rung's key folds into the ladder's (a seeded Flower node
        derives its own key for the rung as the simulation does); and its settings. Every party
        builds the same inference object from it (:meth:`rung`)."""
        return json.dumps({"rung": name, "key": self.named(name).key, **settings, **warm_settings(warm)})

    def rung(self, stage: Optional[str] = None):
        """The inference object of the rung named by ``stage`` (:meth:`stage`; default: the first,
        with its default settings)."""
        settings = json.loads(stage) if stage else {"rung": self.rungs[0].name}
        inference = self.named(settings["rung"]).build(self, settings)
        if self.progress_bar is not None:
            inference.progress_bar = bool(self.progress_bar)
        return inference

    def common(self, rung: Rung) -> Dict[str, Any]:
        """What every rung's class takes from this ladder (the model's layout) and the options of
        :attr:`rung_options` that ``rung`` takes."""
        return dict(model_kwargs=self.model_kwargs, row_plate=self.row_plate, client_mapping=self.client_mapping,
                    **{k: v for k, v in self.rung_options.items() if k in rung.takes})

    def rounds_left(self, climb: Climb) -> Optional[int]:
        """What ``max_rounds`` leaves after the rungs ``climb`` has climbed (``None``: no bound)."""
        return None if self.max_rounds is None else self.max_rounds - climb.rounds

    def _settings(self) -> Dict[str, Any]:
        """What :meth:`rung` builds from beside the rung options and ``model_kwargs``."""
        return {"MWG_WARMUP": MWG_WARMUP, "MWG_CHAINS": MWG_CHAINS, "NUTS_CHAINS": NUTS_CHAINS,
                "WARM_WARMUP": WARM_WARMUP, "WIDEN": WIDEN, "CORRECT_DRAWS": CORRECT_DRAWS, "exact": self.exact,
                "num_samples": self.num_samples, "num_warmup": self.num_warmup, "num_chains": self.num_chains,
                "row_plate": self.row_plate, "client_mapping": self.client_mapping, "progress_bar": self.progress_bar,
                "rungs": " ".join(f"{type(r).__module__}.{type(r).__qualname__}" for r in self.rungs),
                "init": self.init if self.init is None or callable(self.init) else content_digest(self.init)}

    def _rung_of(self, stage: str, kept: Optional[Dict[str, Any]]):
        """:meth:`rung`, or the object an earlier fit of the same model, options and data built for
        ``stage`` (``kept``: :func:`numpyro_fed.fitting.cache.kept_rungs`), its compiled programs kept."""
        if kept is None:
            return self.rung(stage)
        if stage not in kept:
            kept[stage] = self.rung(stage)
        return kept[stage]

    # ------------------------------------------------------------------ run
    def run(self, rng_key: jax.Array, clients: Any, **run_options: Any) -> Fit:
        """Climb the ladder on ``clients`` (see :func:`fit`); ``run_options`` go to every rung.

        The first rung runs with its :meth:`~numpyro_fed.fitting.rungs.Rung.start` settings; each
        rung's :meth:`~numpyro_fed.fitting.rungs.Rung.judge` returns the answer or the rungs to climb
        next. Each rung's stage text reaches the backend as the run option ``stage`` (a network
        backend's nodes build the same rung from it)."""
        run_options = _without_checkpoints(run_options)
        climb = Climb(clients, run_options, isinstance(run_options.get("backend"), NetworkBackend), self.num_samples)
        if self.dp is None:
            climb.kept = kept_rungs(self, clients, run_options, self._settings())  # an earlier equal fit's rungs
            climb.clients = clients if climb.kept is None else climb.kept["clients"]
        first = self.rungs[0]
        queue = [(first.name, first.start(self, climb))]
        while queue:
            name, climb.settings = queue.pop(0)
            rung, stage = self.named(name), self.stage(name, **climb.settings)
            inference = self._rung_of(stage, climb.kept)
            try:
                options = rung.options(self, inference, climb)
                result = rung.run(inference, jax.random.fold_in(rng_key, rung.key), climb, dict(options, stage=stage))
            except RoundBudgetError as err:
                raise over_budget(err, name, {"rounds": climb.rounds, "bytes": climb.bytes}, climb.log,
                                  self.max_rounds, self.advice(climb), rung.title) from err
            outcome = rung.judge(self, inference, result, climb)
            if isinstance(outcome, Fit):
                return outcome
            queue[:0] = outcome
        raise ValueError(f"nf.fit: the last rung climbed ({name!r}) gave no answer")

    def advice(self, climb: Climb) -> str:
        """What to change, from what ``climb`` measured (:func:`numpyro_fed.check.advice.advice`): the
        sites whose chains did not mix, a symmetric Laplace point, each hierarchy's parameterisation by
        its rows. Over a network the server holds no rows to count: no advice."""
        laplace = climb.measured.get("laplace")
        if climb.network or laplace is None:
            return ""
        try:
            structure = fitted(laplace).extra.structure
        except ValueError:  # (not set up: nothing was measured)
            return ""
        model = sized_model(self.model, climb.clients, self.model_kwargs)
        return advice(model, climb.clients, self.model_kwargs, structure, climb.measured.get("mode"),
                      climb.measured.get("cov"), climb.measured["failed"])


def _without_checkpoints(run_options: Dict[str, Any]) -> Dict[str, Any]:
    """The run options every rung takes: nf.fit refuses a checkpoint or a state to resume from."""
    if run_options.get("checkpoint") is not None or run_options.get("init_state") is not None:
        raise ValueError("nf.fit takes no checkpoint= or init_state= (it runs several rungs, each from its start); "
                         "checkpoint a family's run instead")
    return {k: v for k, v in run_options.items() if k not in ("checkpoint", "checkpoint_every", "init_state")}


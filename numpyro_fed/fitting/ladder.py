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
import warnings
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

from .._validation import check_clients, check_init, check_positive_int
from ..check.advice import advice, warn_unmixed
from ..check.laplace import ACCEPT_K, CORRECT_DRAWS, CORRECT_K, CORRECT_MIN_ESS, WIDEN, judge
from ..dp.private_fit import PrivateFit, marked_spec
from ..factor import Laplace
from ..factor.laplace_inference import NoModeError
from ..mcmc import FederatedMwG, FederatedNUTS
from ..mcmc.mwg_inference import moves_text, ridge_text
from ..model.groups import sized_model
from ..run.backends.base import NetworkBackend
from ..run.budget import MAX_ROUNDS, RoundBudgetError, over_budget
from ..run.inference import RUN_OPTIONS, fitted
from ..warnings import FitWarning
from .cache import content, kept_rungs
from .private_ladder import private_fit, private_rung
from .result import Fit, chain_check, check_text, traffic
from .rung_choice import MWG_MAX_LONGER, MWG_MIN_ESS, NUTS_CHAINS, NUTS_MIN_DRAWS, mwg_next, nuts_draws, per_draw

__all__ = ["ACCEPT_K", "CORRECT_DRAWS", "CORRECT_K", "CORRECT_MIN_ESS", "Fit", "Ladder", "MWG_CHAINS", "MWG_MAX_LONGER",
           "MWG_MIN_ESS", "MWG_WARMUP", "NUTS_CHAINS", "NUTS_MIN_DRAWS", "RUNG_KEYS", "RUNG_OPTIONS", "WARM_WARMUP",
           "WIDEN", "fit", "split_options"]

WARM_WARMUP = 100
"""Warmup iterations of federated NUTS started from the Laplace fit."""
MWG_WARMUP = 300
"""Warmup iterations (rounds) of federated Metropolis-within-Gibbs started from the Laplace fit."""
RUNG_KEYS = {"laplace": 0, "mwg": 1, "nuts": 2}
"""Each rung runs with ``fold_in(rng_key, RUNG_KEYS[rung])``."""
MWG_CHAINS = 4
"""Chains of federated Metropolis-within-Gibbs (side by side: one round carries every chain's move)."""

# the rungs' own options a caller may set through nf.fit: option -> the rungs that take it (the
# ladder sets the others itself: the start, the checks, the draws, the data's layout)
RUNG_OPTIONS = {
    "tol": ("laplace",),
    "inner_steps": ("laplace", "mwg"),
    "local_blocks": ("laplace", "mwg"),
    "local_moves": ("mwg",),
    "local_steps": ("mwg",),
    "local_step_size": ("mwg",),
    "candidates": ("mwg",),
    "moves": ("mwg",),
    "leapfrog_steps": ("mwg",),
    "map_steps": ("mwg",),
    "step_size": ("nuts",),
    "adapt_step_size": ("nuts",),
    "adapt_mass_matrix": ("nuts",),
    "target_accept_prob": ("nuts",),
    "max_tree_depth": ("nuts",),
    "secure_aggregation": ("laplace", "mwg", "nuts"),
}
"""The options :func:`fit` passes to its rungs' classes: name -> the rungs that take it
(``"laplace"``: :class:`~numpyro_fed.factor.Laplace`; ``"mwg"``: federated
Metropolis-within-Gibbs; ``"nuts"``: :class:`~numpyro_fed.FederatedNUTS`)."""

_UNKNOWN_OPTION = (
    "nf.fit: no rung takes {names} and no backend runs with it. A rung's options (each passed to the rungs that take "
    "it): {rungs}; the run options (passed to every rung): {run}; and fit's own arguments (exact, num_samples, "
    "num_warmup, num_chains, model_kwargs, row_plate, client_mapping, progress_bar, max_rounds, dp, init)"
)


def _run_options():

    return RUN_OPTIONS


def split_options(options: Dict[str, Any]):
    """``(rung options, run options)`` of :func:`fit`'s keyword options (see :data:`RUNG_OPTIONS`);
    a name in neither raises ``TypeError`` naming both lists."""
    rung = {k: v for k, v in options.items() if k in RUNG_OPTIONS}
    run = {k: v for k, v in options.items() if k not in RUNG_OPTIONS}
    unknown = sorted(set(run) - set(_run_options()))
    if unknown:
        raise TypeError(_UNKNOWN_OPTION.format(names=unknown, rungs=sorted(RUNG_OPTIONS), run=sorted(_run_options())))
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
            client's releases composed (:mod:`numpyro_fed.fitting.private_ladder`;
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

    network = isinstance(run_options.get("backend"), NetworkBackend)
    if dp is None and not network:  # a marked model without dp= is refused by marked_spec
        check_clients(clients, "nf.fit")
        marked_spec(model, clients, dict(model_kwargs or {}), None)
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
    """:func:`fit`'s ladder as an object: its options, the inference object of each rung
    (:meth:`rung`), and :meth:`run`.

    Over Flower, a :class:`~numpyro_fed.flower.FlowerTask` whose ``make_inference`` returns a
    ``Ladder`` runs :func:`fit` over the network: before each rung the server tells the clients
    which one (its :meth:`stage` text, in the set-up message: the rung's name and, for NUTS
    started from the Laplace fit, that fit's mode and covariance, which are global), and every
    party builds the same inference object from it with :meth:`rung`.

    With ``dp=`` (a :class:`~numpyro_fed.dp.PrivateFit`, on a ``dp_noise``-marked model) it is
    :func:`fit`'s private form (:mod:`numpyro_fed.fitting.private_ladder`): its stages, the private start
    and the exact DP sampler, are announced and built the same way.

    Args: those of :func:`fit` but the model's data and the run options (a rung's own options,
    such as ``target_accept_prob``, by keyword).
    """

    #: an open-ended family (runs until it is done): a Flower task passes no round count
    open_ended = True

    def __init__(self, model: Callable, *, exact: bool = False, num_samples: int = 1000,
                 num_warmup: Optional[int] = None, num_chains: Optional[int] = None,
                 model_kwargs: Optional[dict] = None,
                 row_plate: Optional[str] = None, client_mapping: str = "auto",
                 progress_bar: Optional[bool] = None, max_rounds: Optional[int] = MAX_ROUNDS,
                 dp: Optional[Any] = None, init: Any = None, **rung_options: Any) -> None:
        self.init = check_init("nf.fit", init)
        unknown = sorted(set(rung_options) - set(RUNG_OPTIONS))
        if unknown:
            raise TypeError(_UNKNOWN_OPTION.format(names=unknown, rungs=sorted(RUNG_OPTIONS),
                                                   run=sorted(_run_options())))
        self.model, self.exact = model, bool(exact)
        self.rung_options = dict(rung_options)
        self.num_samples, self.num_warmup = int(num_samples), num_warmup
        self.num_chains = None if num_chains is None else int(num_chains)
        self.model_kwargs, self.row_plate, self.client_mapping = dict(model_kwargs or {}), row_plate, client_mapping
        self.progress_bar = progress_bar
        self.max_rounds = None if max_rounds is None else check_positive_int("max_rounds", max_rounds)
        self._kept = None  # (run: the rungs kept for this model, options and data, numpyro_fed.fitting.cache)
        self._measured: Dict[str, Any] = {}  # (run: what the advice of an error reads, Ladder._advice)

        self.dp = None if dp is None else PrivateFit(*dp).checked()
        if self.dp is not None and init is not None:
            raise ValueError("nf.fit(dp=..., init=...): a private fit starts from its own private Laplace fit "
                             "(nf.dp.PrivateFit); drop init=")

    @property
    def differentially_private(self) -> bool:
        """Whether this is :func:`fit`'s private form (``dp=``)."""
        return self.dp is not None

    # ------------------------------------------------------------------ rungs
    @staticmethod
    def stage(rung: str, warm: Optional[tuple] = None, check: bool = True,
              num_samples: Optional[int] = None) -> str:
        """The text naming a rung: ``"laplace"`` (``check``: with its two fit checks), or
        ``"mwg"`` / ``"nuts"`` with the ``(mean, cov)`` of the unconstrained global sites the
        chains start from and propose by (``mwg``: needed) or are preconditioned by (``nuts``;
        ``None``: cold); and ``"key"``, the number the rung's key folds into the ladder's
        (:data:`RUNG_KEYS`: a seeded Flower node derives its own key for the rung as the
        simulation does); ``num_samples``: the sampler's draws per chain, where not the
        ladder's (chains run on to reach :data:`MWG_MIN_ESS`)."""
        spec: Dict[str, Any] = {"rung": rung, "key": RUNG_KEYS.get(rung, 0)}
        if rung == "laplace" and not check:
            spec["check"] = False
        if num_samples is not None:
            spec["num_samples"] = int(num_samples)
        if warm is not None:
            spec["mean"], spec["cov"] = (np.asarray(a, np.float64).tolist() for a in warm)
        return json.dumps(spec)

    def rung(self, stage: Optional[str] = None):
        """The inference object of the rung named by ``stage`` (:meth:`stage`; default: the first)."""

        if self.dp is not None:  # a private fit's stage

            return private_rung(self.model, stage, model_kwargs=self.model_kwargs, row_plate=self.row_plate,
                                rung_options=self.rung_options)
        spec = json.loads(stage) if stage else {"rung": "laplace", **({"check": False} if self.exact else {})}
        common = dict(model_kwargs=self.model_kwargs, row_plate=self.row_plate, client_mapping=self.client_mapping)
        warm = (np.asarray(spec["mean"]), np.asarray(spec["cov"])) if "mean" in spec else None
        if spec["rung"] == "laplace":
            if spec.get("check", True):
                inference = Laplace(self.model, widen=WIDEN, init=self.init, **common, **self._own("laplace"))
                inference.check_draws = CORRECT_DRAWS  # both checks: one compiled program
            else:  # the exact rungs' start: the mode and covariance only
                inference = Laplace(self.model, check_fit=False, init=self.init, **common, **self._own("laplace"))
        elif spec["rung"] == "mwg":
            if warm is None:
                raise ValueError("Ladder.rung: the 'mwg' rung starts from a (mean, cov): Ladder.stage('mwg', warm)")
            warmup = MWG_WARMUP if self.num_warmup is None else self.num_warmup
            samples = spec.get("num_samples", self.num_samples)
            inference = FederatedMwG(self.model, num_warmup=warmup, num_samples=samples,
                                     num_chains=MWG_CHAINS if self.num_chains is None else self.num_chains,
                                     init=warm, **common, **self._own("mwg"))
        elif spec["rung"] == "nuts":
            warmup = (WARM_WARMUP if warm is not None else 500) if self.num_warmup is None else self.num_warmup
            chains = NUTS_CHAINS if self.num_chains is None else self.num_chains
            draws = nuts_draws(self.num_samples, chains) if self.num_chains is None else self.num_samples
            inference = FederatedNUTS(self.model, num_warmup=warmup, num_samples=draws, num_chains=chains, **common,
                                      init=warm, **self._own("nuts"))
        else:
            raise ValueError(f"Ladder.rung: no rung {spec['rung']!r} (its rungs: 'laplace', 'mwg', 'nuts')")
        if self.progress_bar is not None:
            inference.progress_bar = bool(self.progress_bar)
        return inference

    def _settings(self) -> Dict[str, Any]:
        """What :meth:`rung` builds from beside the rung options and ``model_kwargs``."""
        return {"MWG_WARMUP": MWG_WARMUP, "MWG_CHAINS": MWG_CHAINS, "NUTS_CHAINS": NUTS_CHAINS,
                "WARM_WARMUP": WARM_WARMUP, "WIDEN": WIDEN, "CORRECT_DRAWS": CORRECT_DRAWS, "exact": self.exact,
                "num_samples": self.num_samples, "num_warmup": self.num_warmup, "num_chains": self.num_chains,
                "row_plate": self.row_plate, "client_mapping": self.client_mapping, "progress_bar": self.progress_bar,
                "init": self.init if self.init is None or callable(self.init) else content(self.init)}

    def _rung_of(self, stage: str):
        """:meth:`rung`, or the object an earlier fit of the same model, options and data built for
        ``stage`` (:mod:`numpyro_fed.fitting.cache`), its compiled programs kept."""
        kept = self._kept
        if kept is None:
            return self.rung(stage)
        if stage not in kept:
            kept[stage] = self.rung(stage)
        return kept[stage]

    def _own(self, rung: str) -> Dict[str, Any]:
        """The options of :attr:`rung_options` that ``rung``'s class takes."""
        return {k: v for k, v in self.rung_options.items() if rung in RUNG_OPTIONS[k]}

    # ------------------------------------------------------------------ run
    def run(self, rng_key: jax.Array, clients: Any, **run_options: Any) -> Fit:
        """Climb the ladder on ``clients`` (see :func:`fit`); ``run_options`` go to every rung."""

        if self.dp is not None:

            return private_fit(self.model, clients, rng_key, self.dp, num_samples=self.num_samples,
                               num_warmup=self.num_warmup, num_chains=self.num_chains, model_kwargs=self.model_kwargs,
                               row_plate=self.row_plate, client_mapping=self.client_mapping,
                               progress_bar=self.progress_bar, rung_options=self.rung_options,
                               run_options=run_options, exact=self.exact, default_warmup=MWG_WARMUP)

        run_options = _without_checkpoints(run_options)
        self._kept = kept_rungs(self, clients, run_options, self._settings())  # an earlier equal fit's rungs
        clients = clients if self._kept is None else self._kept["clients"]
        backend = run_options.get("backend")
        network = isinstance(backend, NetworkBackend)
        log: List[str] = []
        results: List[Any] = []
        rounds, bytes_ = 0, (0, 0)
        warm = None
        k_laplace, k_mwg, k_nuts = (jax.random.fold_in(rng_key, RUNG_KEYS[r]) for r in ("laplace", "mwg", "nuts"))

        def announce(stage: str) -> None:  # a network backend's clients build the same rung
            if network:
                backend.stage = stage

        stage = self.stage("laplace", check=not self.exact)
        announce(stage)
        laplace = self._rung_of(stage)
        self._measured = {"laplace": laplace, "clients": None if network else clients, "failed": []}
        mode = start = False
        try:
            with warnings.catch_warnings():  # the ladder acts on the check itself (other warnings pass)
                warnings.filterwarnings("ignore", category=FitWarning)
                result = laplace.run(k_laplace, clients, **run_options)
        except NoModeError as err:
            if err.improper:
                raise
            warm = err.last
            self._measured.update(zip(("mode", "cov"), warm or (None, None)))
            if warm is None and self.init is not None:  # NUTS starts where the user said, unpreconditioned
                warm = (laplace.start, np.ones_like(laplace.start))
            rounds, bytes_ = int(err.communication.rounds), traffic(err)
            start = err.last is not None  # MwG starts there (exact from any start; over-dispersed chains)
            log.append(f"laplace: no mode reached ({str(err).split('. ')[0]}); moving to "
                       + ("federated Metropolis-within-Gibbs, started at the search's last point and proposing by "
                          "the curvature there" if start else "federated NUTS"
                          + (", started where the user said" if warm is not None else "")))
        else:
            results.append(result)
            rounds, bytes_ = int(result.communication.rounds), traffic(result)
            warm, mode = (np.asarray(result.params.mean), np.asarray(result.params.cov)), True
            self._measured.update(mode=warm[0], cov=warm[1])
            if self.exact:
                log.append(f"laplace: {rounds} rounds; mode found (the exact sampler's start)")
            else:
                accepted = judge(laplace, result, log)
                if accepted is not None:
                    method, answer, check, corrected = accepted
                    return Fit(method, laplace, answer, rounds, bytes_, check, log, corrected=corrected,
                               num_samples=self.num_samples, clients=None if network else clients, results=results)
            log.append("moving to federated Metropolis-within-Gibbs, started at the Laplace mode")
        mwg = mode or start
        if mwg:

            log.append(moves_text(int(np.size(warm[0])), self.rung_options.get("moves", "auto")))
        done = {"rounds": rounds, "bytes": bytes_}
        samplers = [("mwg", None), ("nuts", None)] if mwg else [("nuts", None)]
        return self._sample(samplers, warm, {"mwg": k_mwg, "nuts": k_nuts}, clients, run_options, announce, done,
                            log, results, network)

    def _sample(self, samplers, warm, keys, clients, run_options, announce, done, log, results, network) -> Fit:
        """The exact rungs, in turn (:func:`~numpyro_fed.fitting.rung_choice.mwg_next` decides after
        Metropolis-within-Gibbs): the first whose answer stands is returned; every rung's rounds count
        against ``max_rounds``."""
        last_mwg = None  # MwG's last result: chains run on continue from it (in simulation)
        chain_rounds = 0
        while samplers:
            rung, samples = samplers.pop(0)
            stage = self.stage(rung, warm, num_samples=samples)
            announce(stage)
            sampler = self._rung_of(stage)
            left = None if self.max_rounds is None else self.max_rounds - done["rounds"]
            # the same chains run on from where they stopped (over a network, where each client keeps its
            # own state, they run again from the start: the same keys give the same first draws)
            go_on = rung == "mwg" and samples is not None and last_mwg is not None and not network
            options = dict(run_options, init_state=sampler.run_on(last_mwg)) if go_on else run_options
            if rung == "mwg" and left is not None:
                planned = (sampler.rounds_to_run_on(last_mwg) if go_on else  # one round per iteration: known
                           sampler.num_warmup + sampler.num_samples + 1)
                if planned > left:
                    raise self._over_budget(RoundBudgetError("", rounds=0, max_rounds=left, projected_rounds=planned),
                                            rung, done, log)
            try:
                with warnings.catch_warnings(record=True) as caught:  # the ladder acts on MwG's mixing itself
                    warnings.simplefilter("always")
                    result = sampler.run(keys[rung], clients,
                                         **({} if left is None else {"num_rounds": max(left, 1)}), **options)
            except RoundBudgetError as err:
                raise self._over_budget(err, rung, done, log) from err
            results.append(result)
            spent = int(result.communication.rounds)
            done["rounds"] += spent
            done["bytes"] = tuple(a + b for a, b in zip(done["bytes"], traffic(result)))
            check = chain_check(result)
            self._measured["failed"] = list(result.verdict.sites)
            chain_rounds = chain_rounds + spent if go_on else spent  # the rounds of these chains' draws
            log.append(f"{rung}: {'ran on ' if go_on else ''}{spent} rounds; " + check_text(check)
                       + f"; {per_draw(chain_rounds, check):.3g} rounds per effective draw")
            if rung == "mwg":
                if sampler.ridge_sites and not go_on:

                    log.append(ridge_text(sampler.ridge_sites))
                last_mwg = result
                longer = mwg_next(sampler.num_warmup, sampler.num_samples, check, chain_rounds, samples is not None,
                                  done["rounds"], log, self.max_rounds, go_on=not network)
                if longer == "nuts":
                    continue
                if longer is not None:  # the same chains run on (the same keys): their first draws are these
                    samplers.insert(0, ("mwg", longer))
                    continue
            for w in caught:  # the answer's own warnings reach the caller
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            if rung == "nuts":
                warn_unmixed(sampler, result, self._advice())
            log.append(f"{rung}: the answer, {done['rounds']} rounds in all (every rung), "
                       f"{per_draw(done['rounds'], check):.3g} rounds per effective draw of the worst global scalar")
            return Fit(rung, sampler, result, done["rounds"], done["bytes"], check, log,
                       num_samples=self.num_samples, clients=None if network else clients, results=results)
        raise AssertionError("unreachable: the last rung returns")


    def _advice(self) -> str:
        """What to change, from what this run measured (:func:`numpyro_fed.check.advice.advice`): the sites whose
        chains did not mix, a symmetric Laplace point, each hierarchy's parameterisation by its rows."""

        measured = self._measured
        if measured.get("clients") is None:  # (over a network the server holds no rows to count)
            return ""
        laplace, clients = measured["laplace"], measured["clients"]
        try:
            structure = fitted(laplace).extra.structure
        except ValueError:  # (not set up: nothing was measured)
            return ""
        model = sized_model(self.model, clients, self.model_kwargs)
        return advice(model, clients, self.model_kwargs, structure, measured.get("mode"), measured.get("cov"),
                      measured["failed"])

    def _over_budget(self, err: RoundBudgetError, rung: str, done: Dict[str, Any], log: List[str]):
        """``nf.fit``'s :class:`~numpyro_fed.run.budget.RoundBudgetError` (:func:`~numpyro_fed.run.budget.over_budget`),
        with the advice this run's measures give."""
        return over_budget(err, rung, done, log, self.max_rounds, self._advice())


def _without_checkpoints(run_options: Dict[str, Any]) -> Dict[str, Any]:
    """The run options every rung takes: nf.fit refuses a checkpoint or a state to resume from."""
    if run_options.get("checkpoint") is not None or run_options.get("init_state") is not None:
        raise ValueError("nf.fit takes no checkpoint= or init_state= (it runs several rungs, each from its start); "
                         "checkpoint a family's run instead")
    return {k: v for k, v in run_options.items() if k not in ("checkpoint", "checkpoint_every", "init_state")}


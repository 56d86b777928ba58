"""The rungs of ``nf.fit``'s ladder, each an object: its name, the inference object it builds from
its stage's text, how it runs, its projected cost in rounds and its judgement of its own answer.

:class:`~numpyro_fed.fitting.ladder.Ladder` climbs a list of rungs (:data:`RUNGS`, or
:data:`~numpyro_fed.fitting.private_rungs.PRIVATE_RUNGS` under ``dp=``) with one loop: it runs the
first, and each rung's :meth:`Rung.judge` returns the answer (a :class:`~numpyro_fed.fitting.result.Fit`)
or the rungs to climb next, each with its settings. A rung's settings are public (a network
backend's nodes build the same rung from them, :meth:`~numpyro_fed.fitting.ladder.Ladder.rung`);
what a run measured on the way (the mode, the chains run so far, the rounds spent) is the
:class:`Climb`'s.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import jax
import numpy as np

from .._validation import check_clients
from ..check.advice import warn_unmixed
from ..check.laplace import CORRECT_DRAWS, WIDEN
from ..check.laplace import judge as judge_laplace
from ..dp.private_fit import marked_spec
from ..factor import Laplace
from ..factor.laplace_inference import NoModeError
from ..mcmc import FederatedMwG, FederatedNUTS
from ..mcmc.mwg_inference import moves_text, ridge_text
from ..run.budget import RoundBudgetError
from ..warnings import FitWarning
from .result import Fit, chain_check, check_text, traffic
from .rung_choice import NUTS_CHAINS, mwg_next, nuts_draws, per_draw

__all__ = ["MWG_CHAINS", "MWG_WARMUP", "RUNGS", "WARM_WARMUP", "Climb", "LaplaceRung", "MwGRung", "NUTSRung", "Rung",
           "warm_settings"]

WARM_WARMUP = 100
"""Warmup iterations of federated NUTS started from the Laplace fit."""
MWG_WARMUP = 300
"""Warmup iterations (rounds) of federated Metropolis-within-Gibbs started from the Laplace fit."""
MWG_CHAINS = 4
"""Chains of federated Metropolis-within-Gibbs (side by side: one round carries every chain's move)."""

Next = List[Tuple[str, Dict[str, Any]]]
"""The rungs to climb next: ``[(rung name, its settings)]``."""


class Climb:
    """One climb of a ladder: what its rungs measured and spent so far.

    Attributes:
        clients, run_options: the run's; ``network``: whether a network backend runs it (the server
            then holds no rows).
        rounds, bytes: every rung's so far (``(up, down)``); ``log``: what was tried, and why;
            ``results``: every rung's result, in order.
        measured: what the advice of an error reads (the Laplace rung, the mode and covariance, the
            sites whose chains failed); ``caught``: the warnings of the last run, which its judge
            re-raises with the answer or not; ``state``: what one rung leaves the next (e.g. the
            chains to run on, a private fit's calibrated noise); ``settings``: those of the rung
            climbed now.
    """

    def __init__(self, clients: Any, run_options: Dict[str, Any], network: bool, num_samples: int) -> None:
        self.clients, self.run_options, self.network, self.num_samples = clients, run_options, network, num_samples
        self.rounds, self.bytes = 0, (0, 0)
        self.log: List[str] = []
        self.results: List[Any] = []
        self.measured: Dict[str, Any] = {"failed": []}
        self.caught: Sequence[Any] = ()
        self.state: Dict[str, Any] = {}
        self.settings: Dict[str, Any] = {}  # the settings of the rung climbed now
        self.kept: Optional[Dict[str, Any]] = None  # the rungs an earlier equal fit built (numpyro_fed.fitting.cache)

    def spent(self, result: Any) -> int:
        """Count ``result``'s rounds and bytes (a run's, or a :class:`NoModeError`'s); its rounds."""
        rounds = int(result.communication.rounds)
        self.rounds += rounds
        self.bytes = tuple(a + b for a, b in zip(self.bytes, traffic(result)))
        return rounds

    def answer(self, rung: "Rung", inference: Any, result: Any, check: Any, corrected: bool = False,
               **kwargs: Any) -> Fit:
        """The :class:`~numpyro_fed.fitting.result.Fit` of ``inference``'s ``result``, every rung's
        rounds, bytes, log and results with it."""
        method = f"{rung.name} (importance-corrected)" if corrected else rung.name
        answer = "importance-corrected" if corrected else rung.answer
        return Fit(method, inference, result, self.rounds, self.bytes, check, self.log, num_samples=self.num_samples,
                   clients=None if self.network else self.clients, results=self.results, corrected=corrected,
                   answer=answer, **kwargs)


def warm_settings(warm: Optional[tuple]) -> Dict[str, Any]:
    """A rung's settings of the ``(mean, cov)`` of the unconstrained global sites it starts from."""
    if warm is None:
        return {}
    mean, cov = (np.asarray(a, np.float64).tolist() for a in warm)
    return {"mean": mean, "cov": cov}


def _warm(settings: Dict[str, Any]) -> Optional[tuple]:
    return (np.asarray(settings["mean"]), np.asarray(settings["cov"])) if "mean" in settings else None


class Rung:
    """One rung of a :class:`~numpyro_fed.fitting.ladder.Ladder`.

    Attributes:
        name: the rung's name (its stage's ``"rung"``, and :attr:`Fit.method` of its answer);
            ``title``: the same in words; ``answer``: what its answer's draws are (:attr:`Fit.answer`).
        key: the number the rung's key folds into the fit's (a seeded network node derives the same).
        takes: the options of ``nf.fit`` the rung's class takes (each passed to the rungs that take it).

    A rung defines :meth:`build` and :meth:`judge`; :meth:`start`, :meth:`options` and :meth:`run`
    have defaults.
    """

    name: str = ""
    title: str = ""
    answer: str = "exact"
    key: int = 0
    takes: Tuple[str, ...] = ()

    def start(self, ladder: Any, climb: Climb) -> Dict[str, Any]:
        """The settings of this rung as the first of a climb (checks that refuse the fit go here)."""
        return {}

    def build(self, ladder: Any, settings: Dict[str, Any]) -> Any:
        """The inference object of this rung from its (public) settings; every party builds the same."""
        raise NotImplementedError

    def options(self, ladder: Any, inference: Any, climb: Climb) -> Dict[str, Any]:
        """The run options of this rung's run: the climb's, its rounds bounded by what ``max_rounds``
        leaves. Raises :class:`~numpyro_fed.run.budget.RoundBudgetError` where its projected cost is more."""
        left = ladder.rounds_left(climb)
        return dict(climb.run_options, **({} if left is None else {"num_rounds": max(left, 1)}))

    def run(self, inference: Any, rng_key: jax.Array, climb: Climb, options: Dict[str, Any]) -> Any:
        """Run ``inference``; its warnings are kept in ``climb.caught`` for :meth:`judge`."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = inference.run(rng_key, climb.clients, **options)
        climb.caught = list(caught)
        return result

    def judge(self, ladder: Any, inference: Any, result: Any, climb: Climb) -> Union[Fit, Next]:
        """The answer, or the rungs to climb next (before those already queued)."""
        raise NotImplementedError

    @staticmethod
    def reraise(climb: Climb) -> None:
        """The kept warnings of the answer's run reach the caller."""
        for w in climb.caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


class LaplaceRung(Rung):
    """The Laplace fit (:class:`~numpyro_fed.factor.Laplace`) and its two fit checks
    (:func:`numpyro_fed.check.laplace.judge`); with ``exact=True`` only the samplers' start."""

    name, key, title, answer = "laplace", 0, "the Laplace fit", "as is"
    takes = ("tol", "inner_steps", "local_blocks", "secure_aggregation")

    def start(self, ladder, climb):
        if not climb.network:  # a dp_noise-marked model is refused without dp= (its rows are protected)
            check_clients(climb.clients, "nf.fit")
            marked_spec(ladder.model, climb.clients, ladder.model_kwargs, None)
        return {"check": False} if ladder.exact else {}

    def build(self, ladder, settings):
        common = ladder.common(self)
        if settings.get("check", not ladder.exact):
            inference = Laplace(ladder.model, widen=WIDEN, init=ladder.init, **common)
            inference.check_draws = CORRECT_DRAWS  # both checks: one compiled program
            return inference
        return Laplace(ladder.model, check_fit=False, init=ladder.init, **common)  # the mode and covariance only

    def options(self, ladder, inference, climb):
        return dict(climb.run_options)

    def run(self, inference, rng_key, climb, options):
        climb.measured["laplace"] = inference
        try:
            with warnings.catch_warnings():  # the ladder acts on the check itself (other warnings pass)
                warnings.filterwarnings("ignore", category=FitWarning)
                return inference.run(rng_key, climb.clients, **options)
        except NoModeError as err:
            if err.improper:
                raise
            return err

    def judge(self, ladder, inference, result, climb):
        rounds = climb.spent(result)
        if isinstance(result, NoModeError):
            warm = result.last
            climb.measured.update(zip(("mode", "cov"), warm or (None, None)))
            if warm is None and ladder.init is not None:  # NUTS starts where the user said, unpreconditioned
                warm = (inference.start, np.ones_like(inference.start))
            start = result.last is not None  # MwG starts there (exact from any start; over-dispersed chains)
            climb.log.append(f"laplace: no mode reached ({str(result).split('. ')[0]}); moving to "
                             + ("federated Metropolis-within-Gibbs, started at the search's last point and proposing "
                                "by the curvature there" if start else "federated NUTS"
                                + (", started where the user said" if warm is not None else "")))
        else:
            climb.results.append(result)
            warm, start = (np.asarray(result.params.mean), np.asarray(result.params.cov)), True
            climb.measured.update(mode=warm[0], cov=warm[1])
            if ladder.exact:
                climb.log.append(f"laplace: {rounds} rounds; mode found (the exact sampler's start)")
            else:
                accepted = judge_laplace(inference, result, climb.log)
                if accepted is not None:
                    _, answer, check, corrected = accepted
                    return climb.answer(self, inference, answer, check, corrected=corrected)
            climb.log.append("moving to federated Metropolis-within-Gibbs, started at the Laplace mode")
        if not start:
            return [("nuts", warm_settings(warm))]
        climb.log.append(moves_text(int(np.size(warm[0])), ladder.rung_options.get("moves", "auto")))
        return [("mwg", warm_settings(warm)), ("nuts", warm_settings(warm))]


class MwGRung(Rung):
    """Exact federated Metropolis-within-Gibbs (:class:`~numpyro_fed.mcmc.FederatedMwG`) from a
    ``(mean, cov)``; after it :func:`~numpyro_fed.fitting.rung_choice.mwg_next` decides whether its
    answer stands, its chains run on (settings ``num_samples``), or the ladder moves on."""

    name, key, title = "mwg", 1, "federated Metropolis-within-Gibbs"
    takes = ("inner_steps", "local_blocks", "local_moves", "local_steps", "local_step_size", "candidates", "moves",
             "leapfrog_steps", "map_steps", "secure_aggregation")

    def build(self, ladder, settings):
        warm = _warm(settings)
        if warm is None:
            raise ValueError("Ladder.rung: the 'mwg' rung starts from a (mean, cov): Ladder.stage('mwg', warm)")
        warmup = MWG_WARMUP if ladder.num_warmup is None else ladder.num_warmup
        samples = settings.get("num_samples", ladder.num_samples)
        return FederatedMwG(ladder.model, num_warmup=warmup, num_samples=samples,
                            num_chains=MWG_CHAINS if ladder.num_chains is None else ladder.num_chains, init=warm,
                            **ladder.common(self))

    def options(self, ladder, inference, climb):
        last = climb.state.get("mwg")  # chains run on continue from where they stopped (in simulation; over a
        # network, where each client keeps its own state, they run again from the start: the same keys give the
        # same first draws)
        go_on = "num_samples" in climb.settings and last is not None and not climb.network
        climb.state["go_on"] = go_on
        left = ladder.rounds_left(climb)
        if left is not None:
            planned = (inference.rounds_to_run_on(last) if go_on else  # one round per iteration: known
                       inference.num_warmup + inference.num_samples + 1)
            if planned > left:
                raise RoundBudgetError("", rounds=0, max_rounds=left, projected_rounds=planned)
        options = super().options(ladder, inference, climb)
        return dict(options, init_state=inference.run_on(last)) if go_on else options

    def judge(self, ladder, inference, result, climb):
        climb.results.append(result)
        spent, go_on, check = climb.spent(result), climb.state["go_on"], chain_check(result)
        climb.measured["failed"] = list(result.verdict.sites)
        chain_rounds = climb.state.get("chain_rounds", 0) + spent if go_on else spent  # these chains' rounds
        climb.state.update(mwg=result, chain_rounds=chain_rounds)
        climb.log.append(f"mwg: {'ran on ' if go_on else ''}{spent} rounds; " + check_text(check)
                         + f"; {per_draw(chain_rounds, check):.3g} rounds per effective draw")
        if inference.ridge_sites and not go_on:
            climb.log.append(ridge_text(inference.ridge_sites))
        ran_on = "num_samples" in climb.settings
        longer = mwg_next(inference.num_warmup, inference.num_samples, check, chain_rounds, ran_on, climb.rounds,
                          climb.log, ladder.max_rounds, go_on=not climb.network)
        if longer == "nuts":
            return []
        if longer is not None:  # the same chains run on (the same keys): their first draws are these
            return [("mwg", dict(climb.settings, num_samples=int(longer)))]
        return exact_answer(self, inference, result, check, climb)


class NUTSRung(Rung):
    """Exact federated NUTS (:class:`~numpyro_fed.FederatedNUTS`), many short chains
    (:func:`~numpyro_fed.fitting.rung_choice.nuts_draws`), preconditioned by a ``(mean, cov)`` where
    one is given."""

    name, key, title = "nuts", 2, "federated NUTS"
    takes = ("step_size", "adapt_step_size", "adapt_mass_matrix", "target_accept_prob", "max_tree_depth",
             "secure_aggregation")

    def build(self, ladder, settings):
        warm = _warm(settings)
        warmup = (WARM_WARMUP if warm is not None else 500) if ladder.num_warmup is None else ladder.num_warmup
        chains = NUTS_CHAINS if ladder.num_chains is None else ladder.num_chains
        draws = nuts_draws(ladder.num_samples, chains) if ladder.num_chains is None else ladder.num_samples
        return FederatedNUTS(ladder.model, num_warmup=warmup, num_samples=draws, num_chains=chains, init=warm,
                             **ladder.common(self))

    def judge(self, ladder, inference, result, climb):
        climb.results.append(result)
        spent, check = climb.spent(result), chain_check(result)
        climb.measured["failed"] = list(result.verdict.sites)
        climb.log.append(f"nuts: {spent} rounds; " + check_text(check)
                         + f"; {per_draw(spent, check):.3g} rounds per effective draw")
        return exact_answer(self, inference, result, check, climb, ladder.advice(climb))


def exact_answer(rung: Rung, inference: Any, result: Any, check: Dict[str, float], climb: Climb,
                 unmixed: Optional[str] = None) -> Fit:
    """An exact sampler's answer: its run's warnings re-raised (and, with ``unmixed``, the advice of
    :func:`~numpyro_fed.check.advice.warn_unmixed` where its chains did not mix), logged."""
    rung.reraise(climb)
    if unmixed is not None:
        warn_unmixed(inference, result, unmixed)
    climb.log.append(f"{rung.name}: the answer, {climb.rounds} rounds in all (every rung), "
                     f"{per_draw(climb.rounds, check):.3g} rounds per effective draw of the worst global scalar")
    return climb.answer(rung, inference, result, check)


RUNGS: Tuple[Rung, ...] = (LaplaceRung(), MwGRung(), NUTSRung())
"""``nf.fit``'s rungs: the Laplace fit and its checks, then the exact samplers."""

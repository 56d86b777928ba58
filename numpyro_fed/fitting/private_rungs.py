"""``nf.fit`` under differential privacy: the same ladder with private rungs, a private Laplace fit
or (``exact=True``) a private start and the exact DP sampler from it.

A ``dp_noise``-marked model says which rows are protected and the whole budget
``(epsilon, delta)``. ``nf.fit(..., dp=PrivateFit(start_clip=...))`` spends all of it on the
private Laplace fit of the first rung (an approximation, not checked against the posterior: a check
would cost privacy); ``nf.fit(..., dp=..., exact=True)`` spends it on two rungs, each client's
releases composed with ``dp-accounting``:

1. **the start** (:class:`PrivateStartRung`): ``start_rounds`` Newton rounds of
   :class:`~numpyro_fed.dp.dp_laplace.DPLaplace`: each client releases the sum of its rows'
   gradients and Hessians of the global sites, each row's clipped to ``start_clip`` and the sum
   noised from its own key (a row's local latents found on the client, never sent); ``start_share``
   of epsilon, calibrated for those rounds;
2. **the answer** (:class:`PrivateSamplerRung`): :class:`~numpyro_fed.mcmc.DPMetropolis` from the
   start's mean and covariance, each row's log-likelihood ratio clipped to the model's ``dp_noise``
   clip, the noise calibrated so that both rungs together spend exactly ``epsilon`` (the penalty
   method corrects the acceptance for it: Yildirim & Ermis (2019), "Exact MCMC with differentially
   private moves", Statistics and Computing 29). On a model without local latents each client
   releases its ratios less the start's released second-order expansion
   (:mod:`numpyro_fed.dp.control`), with the clip ``PrivateFit.sampler_clip`` (by default the one
   at which the noise corrected for is 2 nats^2), and the draws carry the start's noise; the start
   costs nothing more for it.

The whole fit's spend is calibrated, and checked against a ``ledger=``, before the first release.
With ``secure_aggregation=`` the releases of every rung are summed before the server (pairwise
masking or a trusted aggregator); each client still adds the whole noise. The answer is the
sampler's where its verdict is ``"ok"``; where it is not (its chains did not mix, or a clip bound,
so that they sampled the posterior of clipped ratios) the answer is the start, with a warning that
says so (the sampler's own check names the clients whose clips bound).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

import numpy as np

from .._validation import check_clients
from ..dp.accounting import ClientPrivacy, calibrate_after, calibrate_noise_multiplier, epsilon_composed, report
from ..dp.annotation import DPSpec
from ..dp.control import from_text, to_text
from ..dp.dp_laplace import DPLaplace
from ..dp.private_fit import PrivateFit, marked_spec, with_spec
from ..mcmc import DPMetropolis
from ..warnings import UncheckedFitWarning, UnreliableFitWarning, find_stack_level
from .result import chain_check
from .rungs import Rung

__all__ = ["PRIVATE_RUNGS", "SAMPLER_NOISE", "PrivateSamplerRung", "PrivateStartRung", "noise_text"]

_NOT_OK = (
    "nf.fit(dp=...): the exact DP sampler's verdict is {status!r} ({why}): with clip {clip:g} and sigma/C {nm:.4g} its "
    "chains either did not mix (the noise it corrects for leaves too few accepted moves) or sampled the posterior of "
    "clipped ratios. The answer is the private start, a Laplace approximation that is not checked against the "
    "posterior, whose covariance carries the privacy noise (the budget is spent either way; Fit.results holds both "
    "runs). More epsilon or more rows per client help the sampler")
_UNSEEN = ("; over a network backend each client's count of clipped rows stays on its node, so whether the start's "
           "clip bound is not known here")
_EXACT_UNIT = ("nf.fit(dp=..., exact=True): the exact DP sampler protects rows, and dp_noise(unit={unit!r}) protects "
               "groups; the private Laplace fit (exact=False) takes a group as the unit")

SAMPLER_NOISE = 2.0
"""The noise (``J sigma^2``, nats^2) the exact sampler's default clip allows: the penalty method then
keeps about ``exp(-SAMPLER_NOISE / 8)`` of the acceptance."""


def _report(events: Dict[str, list], label: str, delta: float, nm: float):
    """Each client's guarantee over ``events`` (``{client: [(sigma / C, releases, rate)]}``)."""
    return report([ClientPrivacy(n, label, epsilon_composed(e, delta), delta, nm, sum(x[1] for x in e), 1.0)
                   for n, e in events.items()])


def noise_text(start, result) -> str:
    """The line of a private Laplace answer that says how far the privacy noise may move it."""
    site, k = max(start.noise_sds(result).items(), key=lambda kv: kv[1])
    return (f"private: the privacy noise adds {k:.2g} posterior sd(s) to the mean of {site} (the answer's covariance "
            f"carries it, so its intervals are wider than the posterior's)")


def _common(ladder, rung: Rung) -> Dict[str, Any]:
    return dict(model_kwargs=ladder.model_kwargs, row_plate=ladder.row_plate,
                secure_aggregation=ladder.rung_options.get("secure_aggregation"))


class PrivateStartRung(Rung):
    """The private Laplace fit (:class:`~numpyro_fed.dp.dp_laplace.DPLaplace`): the answer at the whole
    epsilon, or with ``exact=True`` the sampler's start at ``start_share`` of it. As the first rung it
    calibrates the whole fit's noise and checks it against a ledger before any release."""

    name, key, title, answer = "dp_laplace", 0, "the private Laplace fit", "as is (unchecked, private)"
    takes = ("secure_aggregation",)

    def start(self, ladder, climb):
        plan: PrivateFit = ladder.dp
        if not climb.network:
            check_clients(climb.clients, "nf.fit")
        spec = marked_spec(ladder.model, climb.clients, ladder.model_kwargs, plan)
        if ladder.exact and spec.unit is not None:
            raise ValueError(_EXACT_UNIT.format(unit=spec.unit))
        share = plan.start_share if ladder.exact else 1.0
        start_clip = spec.clip if plan.start_clip is None else plan.start_clip
        start_spec = DPSpec(float(start_clip), spec.delta, epsilon=spec.epsilon * share, unit=spec.unit)
        chains = 2 if ladder.num_chains is None else int(ladder.num_chains)
        warmup = ladder.default_warmup if ladder.num_warmup is None else int(ladder.num_warmup)
        releases = (warmup + ladder.num_samples) * chains
        nm_start = calibrate_noise_multiplier(start_spec.epsilon, spec.delta, plan.start_rounds)  # as the start does
        events = [(nm_start, plan.start_rounds, 1.0)]
        nm = calibrate_after(events, spec.epsilon, spec.delta, releases) if ladder.exact else None
        ledger = climb.run_options.get("ledger")
        if ledger is not None:  # the whole fit, every rung, refused before anything is sent
            ledger.identify_clients(climb.clients)
            ledger.check("nf.fit", {n: events + ([(nm, releases, 1.0)] if ladder.exact else [])
                                    for n in climb.clients.names})
        climb.state.update(spec=spec, share=share, start_clip=start_clip, nm_start=nm_start, nm=nm, chains=chains,
                           warmup=warmup)
        return {"spec": list(start_spec), "num_steps": plan.start_rounds}

    def build(self, ladder, settings):
        if "spec" not in settings:  # the model's own dp_noise settings (a node asks before any rung)
            return DPLaplace(ladder.model, **_common(ladder, self))
        return DPLaplace(with_spec(ladder.model, DPSpec(*settings["spec"])), num_steps=int(settings["num_steps"]),
                         **_common(ladder, self))

    def options(self, ladder, inference, climb):
        return dict(climb.run_options)

    def run(self, inference, rng_key, climb, options):
        with warnings.catch_warnings():
            if climb.state.get("nm") is not None:  # the start's own "not checked" is moot: the sampler checks,
                warnings.filterwarnings("ignore", category=UncheckedFitWarning)  # or the fallback warns
            return inference.run(rng_key, climb.clients, **options)

    def judge(self, ladder, inference, result, climb):
        plan, s = ladder.dp, climb.state
        climb.results.append(result)
        climb.spent(result)
        s.update(start=inference, first=result)
        exact = s["nm"] is not None
        climb.log.append(f"private {'start' if exact else 'Laplace fit'}: {plan.start_rounds} Newton rounds of "
                         f"DPLaplace (clip {s['start_clip']:g}, sigma/C {s['nm_start']:.4g}, {s['share']:.0%} of "
                         f"epsilon {s['spec'].epsilon:g}); verdict {result.verdict.status}")
        if not exact:  # the approximate answer at the whole budget (as nf.fit's Laplace rung, unchecked)
            climb.log.append(noise_text(inference, result))
            unit = "" if s["spec"].unit is None else f", protected unit: one group of {s['spec'].unit!r}"
            privacy = _report(inference.dp_plan.events(list(climb.clients.names), result),
                              f"DPLaplace ({plan.start_rounds} rounds{unit})", s["spec"].delta, s["nm_start"])
            return climb.answer(self, inference, result, None, privacy=privacy)
        control, clip, cov = self._sampler_settings(plan, inference, result, s["nm"], len(climb.clients.names),
                                                    s["spec"])
        s.update(control=control, clip=clip)
        sampler_spec = DPSpec(clip, s["spec"].delta, noise_multiplier=s["nm"], unit=s["spec"].unit)
        return [("dp_metropolis", {"spec": list(sampler_spec), "num_warmup": s["warmup"],
                                   "num_samples": ladder.num_samples, "num_chains": s["chains"],
                                   "mean": np.asarray(result.params.mean).tolist(), "cov": cov.tolist(),
                                   "control": None if control is None else to_text(control)})]

    @staticmethod
    def _sampler_settings(plan: PrivateFit, start, first, nm: float, num_clients: int, spec: DPSpec):
        """The exact sampler's control variate (``None`` with local latents), clip and proposal covariance."""
        control, cov = start.control_variate(first), np.asarray(first.params.cov)
        clip = spec.clip if plan.sampler_clip is None and control is None else (
            plan.sampler_clip or float(np.sqrt(SAMPLER_NOISE / num_clients) / nm))
        if control is not None:  # the chains target the posterior tilted by the start's noise: its covariance P^-1,
            # from the start's precision (not its covariance less the noise's: where the noise is many posterior
            # sds, that difference in single precision is not positive definite)
            cov = np.linalg.inv(np.asarray(first.state.server.inner.precision, np.float64))
            cov = (cov + cov.T) / 2
        return control, clip, cov


class PrivateSamplerRung(Rung):
    """The exact DP sampler (:class:`~numpyro_fed.mcmc.DPMetropolis`) from the private start, its
    noise calibrated so that both rungs spend the whole epsilon; the start answers where its verdict
    is not ``"ok"``."""

    name, key, title, answer = "dp_metropolis", 1, "the exact DP sampler", "exact (noise-corrected)"
    takes = ("secure_aggregation", "local_steps")

    def build(self, ladder, settings):
        init = (np.asarray(settings["mean"], np.float64), np.asarray(settings["cov"], np.float64))
        control = from_text(settings["control"]) if settings.get("control") else None
        own = {"local_steps": ladder.rung_options["local_steps"]} if "local_steps" in ladder.rung_options else {}
        return DPMetropolis(with_spec(ladder.model, DPSpec(*settings["spec"])), num_warmup=int(settings["num_warmup"]),
                            num_samples=int(settings["num_samples"]), num_chains=int(settings["num_chains"]),
                            init=init, control=control, **own, **_common(ladder, self))

    def options(self, ladder, inference, climb):
        return dict(climb.run_options)

    def run(self, inference, rng_key, climb, options):
        return inference.run(rng_key, climb.clients, **options)

    def judge(self, ladder, inference, result, climb):
        plan, s = ladder.dp, climb.state
        start, first = s["start"], s["first"]
        climb.results.append(result)
        spent, check, names = climb.spent(result), chain_check(result), list(climb.clients.names)
        climb.log.append(f"dp_metropolis: {spent} rounds from the start (clip {s['clip']:g}"
                         + (", residuals about the start's released expansion" if s["control"] is not None else "")
                         + f", sigma/C {s['nm']:.4g}); verdict {result.verdict.status}")
        started, sampled = start.dp_plan.events(names, first), inference.dp_plan.events(names, result)
        secure = ladder.rung_options.get("secure_aggregation")
        label = (f"private start (DPLaplace, {plan.start_rounds} rounds) + DPMetropolis"
                 + (f", {secure} aggregation" if secure else ""))
        privacy = _report({n: started[n] + sampled[n] for n in names}, label, s["spec"].delta, s["nm"])
        if result.verdict.status != "ok":  # not mixed, or its clip bound (another target): the start answers
            warnings.warn(_NOT_OK.format(status=result.verdict.status, why=result.verdict.why, clip=s["clip"],
                                         nm=s["nm"]) + (_UNSEEN if climb.network else ""),
                          UnreliableFitWarning, stacklevel=find_stack_level())
            climb.log += [f"the answer: the private start (the sampler's verdict: {result.verdict.status})",
                          noise_text(start, first)]
            return climb.answer(PRIVATE_RUNGS[0], start, first, None, privacy=privacy)
        if s["control"] is not None:  # the draws carry the start's noise (dp/control.py)
            climb.log.append(noise_text(start, first).replace("the answer's covariance carries it",
                                                              "the draws carry it"))
        return climb.answer(self, inference, result, check, privacy=privacy)


PRIVATE_RUNGS = (PrivateStartRung(), PrivateSamplerRung())
"""``nf.fit(dp=...)``'s rungs: the private start (the answer without ``exact=True``), then the exact DP sampler."""


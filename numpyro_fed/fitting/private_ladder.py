"""``nf.fit`` under differential privacy: a private Laplace fit, or (``exact=True``) a private
start and the exact DP sampler from it.

A ``dp_noise``-marked model says which rows are protected and the whole budget
``(epsilon, delta)``. ``nf.fit(..., dp=PrivateFit(start_clip=...))`` spends all of it on the
private Laplace fit of stage 1 (an approximation, not checked against the posterior: a check would
cost privacy); ``nf.fit(..., dp=..., exact=True)`` spends it in two stages, each client's releases
composed with ``dp-accounting``:

1. **the start**: ``start_rounds`` Newton rounds of :class:`~numpyro_fed.dp.dp_laplace.DPLaplace`:
   each client releases the sum of its rows' gradients and Hessians of the global sites, each row's
   clipped to ``start_clip`` and the sum noised from its own key (a row's local latents found on
   the client, never sent); ``start_share`` of epsilon, calibrated for those rounds;
2. **the answer**: :class:`~numpyro_fed.mcmc.DPMetropolis` from the start's mean and covariance,
   each row's log-likelihood ratio clipped to the model's ``dp_noise`` clip, the noise calibrated
   so that both stages together spend exactly ``epsilon`` (the penalty method corrects the
   acceptance for it: Yildirim & Ermis (2019), "Exact MCMC with differentially private moves",
   Statistics and Computing 29). On a model without local latents each client releases its
   ratios less the start's released second-order expansion (:mod:`numpyro_fed.dp.control`), with
   the clip ``PrivateFit.sampler_clip`` (by default the one at which the noise corrected for is 2
   nats^2), and the draws carry the start's noise; the start costs nothing more for it.

With ``secure_aggregation=`` the releases of every stage are summed before the server (pairwise
masking or a trusted aggregator); each client still adds the whole noise. The answer is the
sampler's where its verdict is ``"ok"``; where it is not (its chains did not mix, or a clip bound,
so that they sampled the posterior of clipped ratios) the answer is the start, with a warning that
says so (the sampler's own check names the clients whose clips bound).
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

from ..dp.accounting import ClientPrivacy, calibrate_after, calibrate_noise_multiplier, epsilon_composed, report
from ..dp.annotation import DPSpec
from ..dp.control import from_text, to_text
from ..dp.dp_laplace import DPLaplace
from ..dp.private_fit import STAGE_KEYS, PrivateFit, marked_spec, stage_text, with_spec
from ..mcmc import DPMetropolis
from ..run.backends.base import NetworkBackend
from ..warnings import UncheckedFitWarning, UnreliableFitWarning, find_stack_level
from .result import Fit, chain_check, traffic

__all__ = ["SAMPLER_NOISE", "noise_text", "private_fit", "private_rung"]

_OPTIONS = "nf.fit(dp=...) runs a private start and DPMetropolis; it takes no {names} (its own: {own})"
_OWN = ("secure_aggregation", "local_steps")
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


def private_rung(model: Callable, stage: Optional[str], *, model_kwargs: Optional[dict] = None,
                 row_plate: Optional[str] = None, rung_options: Optional[Dict[str, Any]] = None):
    """The inference object of the stage ``stage`` names (:func:`stage_text`; ``None``: the
    model's own ``dp_noise`` settings in a ``DPLaplace``, as a node asks before any stage)."""
    options = dict(rung_options or {})
    common = dict(model_kwargs=model_kwargs, row_plate=row_plate, secure_aggregation=options.get("secure_aggregation"))
    if not stage:
        return DPLaplace(model, **common)
    settings = json.loads(stage)
    marked = with_spec(model, DPSpec(*settings["spec"]))
    if settings["rung"] == "dp_laplace":
        return DPLaplace(marked, num_steps=int(settings["num_steps"]), **common)
    if settings["rung"] == "dp_metropolis":
        init = (np.asarray(settings["mean"], np.float64), np.asarray(settings["cov"], np.float64))
        control = from_text(settings["control"]) if settings.get("control") else None
        return DPMetropolis(marked, num_warmup=int(settings["num_warmup"]), num_samples=int(settings["num_samples"]),
                            num_chains=int(settings["num_chains"]), init=init, control=control,
                            **({"local_steps": options["local_steps"]} if "local_steps" in options else {}), **common)
    raise ValueError(f"private_rung: no stage {settings['rung']!r} (its stages: {sorted(STAGE_KEYS)})")


def _report(events: Dict[str, list], label: str, delta: float, nm: float):
    """Each client's guarantee over ``events`` (``{client: [(sigma / C, releases, rate)]}``)."""
    return report([ClientPrivacy(n, label, epsilon_composed(e, delta), delta, nm, sum(x[1] for x in e), 1.0)
                   for n, e in events.items()])


def noise_text(start, result) -> str:
    """The line of a private Laplace answer that says how far the privacy noise may move it."""
    site, k = max(start.noise_sds(result).items(), key=lambda kv: kv[1])
    return (f"private: the privacy noise adds {k:.2g} posterior sd(s) to the mean of {site} (the answer's covariance "
            f"carries it, so its intervals are wider than the posterior's)")


def _checked(model, clients, model_kwargs: dict, plan, exact: bool, rung_options: Dict[str, Any]):
    """The plan checked and the model's one spec, refusing before any release what the fit cannot take."""
    plan = PrivateFit(*plan).checked()
    spec = marked_spec(model, clients, model_kwargs, plan)
    if exact and spec.unit is not None:
        raise ValueError(_EXACT_UNIT.format(unit=spec.unit))
    other = sorted(set(rung_options) - set(_OWN))
    if other:
        raise TypeError(_OPTIONS.format(names=other, own=list(_OWN)))
    return plan, spec


def _sampler_settings(plan: PrivateFit, spec: DPSpec, start, first, nm: float, num_clients: int):
    """The exact sampler's control variate (``None`` with local latents), clip and proposal covariance."""
    control, cov = start.control_variate(first), np.asarray(first.params.cov)
    clip = spec.clip if plan.sampler_clip is None and control is None else (
        plan.sampler_clip or float(np.sqrt(SAMPLER_NOISE / num_clients) / nm))
    if control is not None:  # the chains target the posterior tilted by the start's noise: its covariance P^-1,
        # from the start's precision (not its covariance less the noise's: where the noise is many posterior sds,
        # that difference in single precision is not positive definite)
        cov = np.linalg.inv(np.asarray(first.state.server.inner.precision, np.float64))
        cov = (cov + cov.T) / 2
    return control, clip, cov


def private_fit(model: Callable, clients: Any, rng_key: jax.Array, plan: PrivateFit, *, num_samples: int,
                num_warmup: Optional[int], num_chains: Optional[int], model_kwargs: Optional[dict],
                row_plate: Optional[str], client_mapping: str, progress_bar: Optional[bool],
                rung_options: Dict[str, Any], run_options: Dict[str, Any], exact: bool = False,
                default_warmup: int = 300):
    """:func:`numpyro_fed.fit` with ``dp=plan`` (see the module docstring); returns a
    :class:`~numpyro_fed.fitting.result.Fit` whose :meth:`~numpyro_fed.fitting.result.Fit.privacy_report`
    covers every stage. ``exact=False``: the private Laplace fit alone, at the whole epsilon;
    ``exact=True``: the start at ``start_share`` of it, then the DP sampler."""
    model_kwargs = dict(model_kwargs or {})
    plan, spec = _checked(model, clients, model_kwargs, plan, exact, rung_options)
    backend, secure = run_options.get("backend"), rung_options.get("secure_aggregation")
    network = isinstance(backend, NetworkBackend)

    def rung(stage: str):  # one stage, as every party builds it (a network backend's nodes from its text)
        if network:
            backend.stage = stage
        return private_rung(model, stage, model_kwargs=model_kwargs, row_plate=row_plate, rung_options=rung_options)

    run_options = dict(run_options)
    ledger = run_options.pop("ledger", None)
    names = list(clients.names)
    share, start_clip = plan.start_share if exact else 1.0, spec.clip if plan.start_clip is None else plan.start_clip
    start_spec = DPSpec(float(start_clip), spec.delta, epsilon=spec.epsilon * share, unit=spec.unit)
    start = rung(stage_text("dp_laplace", start_spec, num_steps=plan.start_rounds))
    chains = 2 if num_chains is None else int(num_chains)
    warmup = default_warmup if num_warmup is None else int(num_warmup)
    releases = (warmup + int(num_samples)) * chains
    nm_start = calibrate_noise_multiplier(start_spec.epsilon, spec.delta, plan.start_rounds)  # as the start does
    start_events = [(nm_start, plan.start_rounds, 1.0)]
    nm = calibrate_after(start_events, spec.epsilon, spec.delta, releases) if exact else None
    if ledger is not None:  # the whole fit, every stage, refused before anything is sent
        ledger.identify_clients(clients)
        ledger.check("nf.fit", {n: start_events + ([(nm, releases, 1.0)] if exact else []) for n in names})
    log: List[str] = []
    start.progress_bar = start.progress_bar if progress_bar is None else bool(progress_bar)
    with warnings.catch_warnings():
        if exact:  # the start's own "not checked" is moot: the sampler checks, or the fallback warns
            warnings.filterwarnings("ignore", category=UncheckedFitWarning)
        first = start.run(jax.random.fold_in(rng_key, STAGE_KEYS["dp_laplace"]), clients, ledger=ledger, **run_options)
    mean, cov = np.asarray(first.params.mean), np.asarray(first.params.cov)
    control, clip, cov = _sampler_settings(plan, spec, start, first, nm, len(names)) if exact else (None, None, cov)
    log.append(f"private {'start' if exact else 'Laplace fit'}: {plan.start_rounds} Newton rounds of DPLaplace (clip "
               f"{start_clip:g}, sigma/C {nm_start:.4g}, {share:.0%} of epsilon {spec.epsilon:g}); verdict "
               f"{first.verdict.status}")
    if not exact:  # the approximate answer at the whole budget (as nf.fit's Laplace rung, unchecked)
        log.append(noise_text(start, first))
        unit = "" if spec.unit is None else f", protected unit: one group of {spec.unit!r}"
        privacy = _report(start.dp_plan.events(names, first), f"DPLaplace ({plan.start_rounds} rounds{unit})",
                          spec.delta, nm_start)
        return Fit("dp_laplace", start, first, int(first.communication.rounds), traffic(first), None, log,
                   num_samples=int(num_samples), clients=None if network else clients, results=[first],
                   privacy=privacy)
    sampler = rung(stage_text("dp_metropolis", DPSpec(clip, spec.delta, noise_multiplier=nm, unit=spec.unit),
                              num_warmup=warmup, num_samples=int(num_samples), num_chains=chains, mean=mean.tolist(),
                              cov=cov.tolist(), control=None if control is None else to_text(control)))
    sampler.progress_bar = sampler.progress_bar if progress_bar is None else bool(progress_bar)
    k_sampler = jax.random.fold_in(rng_key, STAGE_KEYS["dp_metropolis"])
    result = sampler.run(k_sampler, clients, ledger=ledger, **run_options)
    rounds, check = int(first.communication.rounds) + int(result.communication.rounds), chain_check(result)
    both = tuple(a + b for a, b in zip(traffic(first), traffic(result)))
    log.append(f"dp_metropolis: {int(result.communication.rounds)} rounds from the start (clip {clip:g}"
               + (", residuals about the start's released expansion" if control is not None else "")
               + f", sigma/C {nm:.4g}); verdict {result.verdict.status}")
    started, sampled = start.dp_plan.events(names, first), sampler.dp_plan.events(names, result)
    label = (f"private start (DPLaplace, {plan.start_rounds} rounds) + DPMetropolis"
             + (f", {secure} aggregation" if secure else ""))
    privacy = _report({n: started[n] + sampled[n] for n in names}, label, spec.delta, nm)
    if result.verdict.status != "ok":  # not mixed, or its clip bound (another target): the start answers
        warnings.warn(_NOT_OK.format(status=result.verdict.status, why=result.verdict.why, clip=clip, nm=nm)
                      + (_UNSEEN if network else ""), UnreliableFitWarning, stacklevel=find_stack_level())
        log += [f"the answer: the private start (the sampler's verdict: {result.verdict.status})",
                noise_text(start, first)]
        return Fit("dp_laplace", start, first, rounds, both, None, log, num_samples=int(num_samples),
                   clients=None if network else clients, results=[first, result], privacy=privacy)
    if control is not None:  # the draws carry the start's noise (dp/control.py)
        log.append(noise_text(start, first).replace("the answer's covariance carries it", "the draws carry it"))
    return Fit("dp_metropolis", sampler, result, rounds, both, check, log, num_samples=int(num_samples),
               clients=None if network else clients, results=[first, result], privacy=privacy)

"""``nf.fit`` under differential privacy: a private start, then the exact DP sampler from it.

A ``dp_noise``-marked model says which rows are protected and the whole budget
``(epsilon, delta)``; ``nf.fit(..., dp=PrivateFit(start_clip=...))`` spends it in two stages,
each client's releases composed with ``dp-accounting``:

1. **the start**: ``start_rounds`` synchronous rounds of PVI with update perturbation
   (Heikkilä et al. (2023) §4.2): each client's change in ``q`` of the global sites, clipped to
   ``start_clip`` in natural parameters and noised from its own key, its local latents fitted on the
   client and never sent; ``start_share`` of epsilon, calibrated for those rounds;
2. **the answer**: :class:`~numpyro_fed.mcmc.DPMetropolis` from the start's mean and covariance,
   each row's log-likelihood ratio clipped to the model's ``dp_noise`` clip, the noise calibrated
   so that both stages together spend exactly ``epsilon`` (the penalty method corrects the
   acceptance for it: Yildirim & Ermis (2019), "Exact MCMC with differentially private moves",
   Statistics and Computing 29).

With ``secure_aggregation=`` both stages' releases are summed before the server (pairwise masking
or a trusted aggregator) and each client adds its share of the noise. The answer is the sampler's,
with its own check: a clip that bound (the chains then target the posterior of clipped ratios)
is ``"biased"`` and warns naming the clients; chains that did not mix warn.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional

import jax
import numpy as np
from numpyro.primitives import Messenger

from .._structure import trace_model
from .._validation import check_positive_int
from .accounting import ClientPrivacy, calibrate_after, epsilon_composed, report
from .annotation import DP_KEY, DPSpec, dp_sites

__all__ = ["PrivateFit", "private_fit", "with_spec"]

_UNMARKED = (
    "nf.fit(dp=...) fits a model whose protected rows are marked: wrap its observed site(s) in "
    "nf.dp_noise(clip=..., delta=..., epsilon=...) (clip: the bound on each row's log-likelihood ratio "
    "between two points the exact sampler compares; epsilon: the budget of the whole fit)"
)
_NO_PLAN = (
    "the model marks observed site(s) {sites} with dp_noise, so nf.fit must be differentially private: pass "
    "dp=nf.dp.PrivateFit(start_clip=...) (the clip of the private start's updates, in natural parameters; see "
    "docs/differential_privacy.md)"
)
_NEEDS_EPSILON = (
    "nf.fit(dp=...) splits one budget between its private start and its sampler: give dp_noise(epsilon=...) (not "
    "noise_multiplier=)"
)
_OPTIONS = "nf.fit(dp=...) runs a private start and DPMetropolis; it takes no {names} (its own: {own})"
_OWN = ("secure_aggregation", "local_steps")


class PrivateFit(NamedTuple):
    """How :func:`numpyro_fed.fit` spends a ``dp_noise`` budget (see :mod:`numpyro_fed.dp.private_fit`).

    Args:
        start_clip: the clip of each client's update in the private start (the L2 norm of its
            change in ``q``'s canonical natural parameters; Heikkilä et al. (2023) §4.2). Choose it
            near the typical norm of a client's change: below it every update is shrunk towards
            the prior, above it the noise swamps the signal.
        start_share: the share of epsilon the start spends (the sampler spends the rest).
        start_rounds: synchronous rounds of the start (one release per client each).
        start_local_steps: optimiser steps of each client's local fit in the start (free: only the
            clipped, noised change leaves the client).
        start_family: the start's Gaussian, ``"full"`` or ``"diagonal"``; ``"auto"``: full without
            local latents, diagonal with them (the local fit is then one Gaussian over the global
            and every local latent of the client, whose full covariance grows as the square of its
            rows; only the start's covariance, the sampler's proposal, is mean-field).
    """

    start_clip: float
    start_share: float = 0.25
    start_rounds: int = 3
    start_local_steps: int = 500
    start_family: str = "auto"

    def checked(self) -> "PrivateFit":
        if not (np.isfinite(self.start_clip) and self.start_clip > 0):
            raise ValueError(f"PrivateFit(start_clip={self.start_clip!r}): must be a finite number > 0")
        if not 0 < self.start_share < 1:
            raise ValueError(f"PrivateFit(start_share={self.start_share!r}): must lie in (0, 1)")
        check_positive_int("start_rounds", self.start_rounds)
        check_positive_int("start_local_steps", self.start_local_steps)
        if self.start_family not in ("auto", "full", "diagonal"):
            raise ValueError(f"PrivateFit(start_family={self.start_family!r}): choose 'auto', 'full' or 'diagonal'")
        return self


class with_spec(Messenger):
    """The model with every ``dp_noise`` mark replaced by ``spec`` (one stage's clip and noise)."""

    def __init__(self, fn: Callable, spec: DPSpec) -> None:
        self.spec = spec
        super().__init__(fn)

    def process_message(self, msg):
        infer = msg.get("infer") or {}
        if msg["type"] == "sample" and DP_KEY in infer:
            msg["infer"] = {**infer, DP_KEY: self.spec}


def _spec(model, clients, model_kwargs, plan: Optional[PrivateFit]) -> Optional[DPSpec]:
    """The model's one ``dp_noise`` spec (``None``: unmarked and no ``dp=``), checked against ``plan``."""
    specs = dp_sites(trace_model(model, clients[clients.names[0]], model_kwargs))
    if plan is None:
        if specs:
            raise ValueError(_NO_PLAN.format(sites=sorted(specs)))
        return None
    if not specs:
        raise ValueError(_UNMARKED)
    if len(set(specs.values())) > 1:
        raise ValueError(f"dp_noise marks {sorted(specs)} with different settings; mark them with one")
    spec = next(iter(specs.values()))
    if spec.epsilon is None:
        raise ValueError(_NEEDS_EPSILON)
    return spec


def _has_locals(model, clients, model_kwargs) -> bool:
    from .._structure import is_latent
    from ..handlers import LOCAL, site_role

    tr = trace_model(model, clients[clients.names[0]], model_kwargs)
    return any(is_latent(s) and site_role(s) == LOCAL for s in tr.values())


def private_fit(model: Callable, clients: Any, rng_key: jax.Array, plan: PrivateFit, *, num_samples: int,
                num_warmup: Optional[int], num_chains: Optional[int], model_kwargs: Optional[dict],
                row_plate: Optional[str], client_mapping: str, progress_bar: Optional[bool],
                rung_options: Dict[str, Any], run_options: Dict[str, Any]):
    """:func:`numpyro_fed.fit` with ``dp=plan`` (see the module docstring); returns a
    :class:`~numpyro_fed.fit_result.Fit` whose :meth:`~numpyro_fed.fit_result.Fit.privacy_report`
    covers both stages."""
    from ..backends.base import NetworkBackend
    from ..factor import PVI
    from ..fit_result import Fit
    from ..ladder import MWG_WARMUP, _bytes, _mcmc_check
    from ..mcmc import DPMetropolis
    from .plan import client_events

    plan = PrivateFit(*plan).checked()
    model_kwargs = dict(model_kwargs or {})
    spec = _spec(model, clients, model_kwargs, plan)
    other = sorted(set(rung_options) - set(_OWN))
    if other:
        raise TypeError(_OPTIONS.format(names=other, own=list(_OWN)))
    if isinstance(run_options.get("backend"), NetworkBackend):
        raise NotImplementedError("nf.fit(dp=...) runs in simulation only for now (DPMetropolis's clip counts and "
                                  "the start's masking are not yet carried over a network backend)")
    secure = rung_options.get("secure_aggregation")
    run_options = dict(run_options)
    ledger = run_options.pop("ledger", None)
    names = list(clients.names)
    common = dict(model_kwargs=model_kwargs, row_plate=row_plate)

    start_spec = DPSpec(float(plan.start_clip), spec.delta, epsilon=spec.epsilon * plan.start_share)
    family = plan.start_family
    if family == "auto":
        family = "diagonal" if _has_locals(model, clients, model_kwargs) else "full"
    start = PVI(with_spec(model, start_spec), dp="update_perturbation", schedule="synchronous", family=family,
                local_steps=plan.start_local_steps, secure_aggregation=secure, client_mapping=client_mapping,
                **common)
    chains = 2 if num_chains is None else int(num_chains)
    warmup = MWG_WARMUP if num_warmup is None else int(num_warmup)
    releases = (warmup + int(num_samples)) * chains
    start.dp_plan.rounds = plan.start_rounds  # calibrated for the planned rounds (as its run would)
    start.dp_plan.plan(clients)
    nm_start = start.dp_plan.privacy.noise_multiplier
    start_events = [(nm_start, plan.start_rounds, 1.0)]
    nm = calibrate_after(start_events, spec.epsilon, spec.delta, releases)
    if ledger is not None:  # the whole fit, both stages, refused before anything is sent
        ledger.check("nf.fit", {n: start_events + [(nm, releases, 1.0)] for n in names})
    log: List[str] = []
    if progress_bar is not None:
        start.progress_bar = bool(progress_bar)
    first = start.run(jax.random.fold_in(rng_key, 0), clients, plan.start_rounds, ledger=ledger, **run_options)
    mean, cov = np.asarray(first.params.mean), np.asarray(first.params.cov)
    cov = np.diag(cov) if cov.ndim == 1 else cov  # a diagonal start's variances
    log.append(f"private start: {plan.start_rounds} rounds of PVI with update perturbation (clip {plan.start_clip:g}, "
               f"sigma/C {nm_start:.4g}, {plan.start_share:.0%} of epsilon {spec.epsilon:g})")
    sampler_spec = DPSpec(spec.clip, spec.delta, noise_multiplier=nm)
    sampler = DPMetropolis(with_spec(model, sampler_spec), num_warmup=warmup, num_samples=int(num_samples),
                           num_chains=chains, init=(mean, cov), secure_aggregation=secure,
                           **({"local_steps": rung_options["local_steps"]} if "local_steps" in rung_options else {}),
                           **common)
    if progress_bar is not None:
        sampler.progress_bar = bool(progress_bar)
    result = sampler.run(jax.random.fold_in(rng_key, 1), clients, ledger=ledger, **run_options)
    rounds = int(first.communication.rounds) + int(result.communication.rounds)
    traffic = tuple(a + b for a, b in zip(_bytes(first), _bytes(result)))
    check = _mcmc_check(result)
    log.append(f"dp_metropolis: {int(result.communication.rounds)} rounds from the start (clip {spec.clip:g}, "
               f"sigma/C {nm:.4g}); verdict {result.verdict.status}")
    started = client_events(start.dp_plan.privacy, names, first)
    sampled = sampler.dp_plan.events(names, result)
    label = (f"private start (update perturbation, {plan.start_rounds} rounds) + DPMetropolis"
             + (f", {secure} aggregation" if secure else ""))
    privacy = report([ClientPrivacy(n, label, epsilon_composed(started[n] + sampled[n], spec.delta), spec.delta, nm,
                                    sum(e[1] for e in started[n] + sampled[n]), 1.0) for n in names])
    return Fit("dp_metropolis", sampler, result, rounds, traffic, check, log, num_samples=int(num_samples),
               clients=clients, results=[first, result], privacy=privacy)

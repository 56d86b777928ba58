"""From a ``dp_noise``-annotated model and an inference object's ``dp=`` choice to a
mechanism: the noise (given, or calibrated to a target epsilon for the planned releases),
the client-side transform, and after the fit the per-client privacy report.

The annotation says what is protected (one row of the row plate, held by one client) and
how much; the inference object says how (Heikkilä et al. (2023) §4): ``dp="optimisation"`` (DP-SGD in
the local optimisation, privacy paid per local step) or ``dp="update_perturbation"``
(clip and noise each shard's change in natural parameters, privacy paid per global update;
with ``variant="local_averaging"`` or ``"virtual"``, and optionally a trusted aggregator).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, NamedTuple, Optional

import numpy as np

from .._structure import trace_model
from .._validation import check_positive_int
from ..warnings import UncheckedFitWarning, find_stack_level
from .accounting import ClientPrivacy, PrivacyReport, calibrate_noise_multiplier, epsilon_composed, report
from .annotation import DPSpec, dp_sites
from .batch import batch_size
from .mechanisms import DPSGD, update_perturbation

__all__ = ["MECHANISMS", "Privacy", "PrivateFit", "check_dp_options", "check_sgd_options", "dp_specs",
           "plan_privacy", "privacy_report", "refuse_dp"]

MECHANISMS = ("optimisation", "update_perturbation")  # PVI's; FederatedSVI's is "sgd"

_CHOOSE = (
    "the model marks observed site(s) {sites} with dp_noise, so the fit must be differentially private: "
    "choose the mechanism with dp='optimisation' (DP-SGD in each client's local optimisation; update='optax', "
    "dp_batch_size=) or dp='update_perturbation' (clip and noise each update; variant='local_averaging' or "
    "'virtual' with num_shards=, optionally trusted_aggregator=True)"
)
_CHOOSE_SVI = (
    "the model marks observed site(s) {sites} with dp_noise, so the fit must be differentially private: "
    "choose the mechanism with dp='sgd' and dp_sampling_rate= (DP federated SVI, method='sfvi'; "
    "optionally trusted_aggregator=True), or use nf.PVI(dp=...)"
)
_UNMARKED = (
    "dp={dp!r}: observed site(s) {sites} are not marked by dp_noise, so their rows would not be protected; "
    "wrap every observed site in nf.dp_noise(clip=..., delta=..., epsilon=... or noise_multiplier=...)"
)
_NO_MARKS = (
    "dp={dp!r} needs to know which rows are protected, and how much: wrap the observed site(s) in "
    "nf.dp_noise(clip=..., delta=..., epsilon=... or noise_multiplier=...)"
)
_RESUME_CALIBRATED = (
    "a noise calibrated to dp_noise(epsilon=...) covers one run of the planned rounds; to resume, give "
    "dp_noise(noise_multiplier=...) (the calibrated sigma/C is in privacy_report(result)) and account the "
    "rounds together"
)
_BUDGET_SPENT = (
    "{cls}.update: the noise was calibrated to epsilon={eps:g}, delta={delta:g} for {rounds} round(s) ({planned} "
    "release(s) per client), and client(s) {clients} have made them all: another round would release past that "
    "claim. Plan a longer run (run(key, num_rounds, clients) calibrates for num_rounds), or give "
    "dp_noise(noise_multiplier=...) and account every round with privacy_report"
)
_WITHHELD = (
    "{cls}: under DP, clients keep their own fit diagnostics (they depend on their data); client(s) {clients} "
    "recorded {zeroed} shard fit(s) sent as a zero change (non-finite, or an improper own cavity) and {failed} "
    "local fit(s) that failed their own check (e.g. not converged). A zeroed shard added noise only; a failed "
    "fit's update is in q, so q may be off. In a deployment each client reads its own ledger "
    "(state.withheld); raise local_steps or the learning rate, use damping < 1, or a larger clip"
)


class Privacy(NamedTuple):
    """The mechanism an inference object runs, as planned at set-up."""

    mechanism: str  # one of MECHANISMS
    label: str  # what the report says
    spec: DPSpec
    noise_multiplier: float  # sigma / C of each release (of the sum, under a trusted aggregator)
    perturb: Optional[Callable]  # update perturbation, or None
    dp_sgd: Optional[DPSGD]  # DP-SGD settings, or None
    steps_per_release: int  # compositions per update a client sends (local steps for DP-SGD)
    sampling_rates: Dict[str, float]  # per client: rows per release / rows held
    trusted: bool
    num_aggregated: int  # M: clients whose noise adds up in one release (trusted aggregator)


def check_sgd_options(inference, dp, sampling_rate, trusted) -> Optional[str]:
    """:class:`~numpyro_fed.FederatedSVI`'s checks of ``dp=``, ``dp_sampling_rate=`` and
    ``trusted_aggregator=``."""
    if dp is not None and dp != "sgd":
        raise ValueError(f"dp={dp!r}: FederatedSVI's private mechanism is dp='sgd' (DP-SGD gradients)")
    if dp is None and (sampling_rate is not None or trusted):
        raise ValueError("dp_sampling_rate= and trusted_aggregator= configure a DP fit: pass dp='sgd'")
    if dp == "sgd":
        if inference.method != "sfvi":
            raise ValueError("dp='sgd' is DP federated SVI: one private gradient per round (method='sfvi')")
        if sampling_rate is None or not 0 < sampling_rate <= 1:
            raise ValueError(f"dp='sgd' needs dp_sampling_rate= in (0, 1] (the share of each client's rows in "
                             f"every step); got {sampling_rate!r}")
    return dp


def check_dp_options(inference, dp, batch_size, trusted) -> Optional[str]:
    """PVI's checks of ``dp=``, ``dp_batch_size=`` and ``trusted_aggregator=``."""
    if dp is not None and dp not in MECHANISMS:
        raise ValueError(f"dp={dp!r}: choose one of {MECHANISMS} (or None without dp_noise)")
    if dp is None and (batch_size is not None or trusted):
        raise ValueError("dp_batch_size= and trusted_aggregator= configure a DP fit: pass dp=")
    if dp == "optimisation":
        if inference.update_kind != "optax":
            raise ValueError("dp='optimisation' runs DP-SGD in the local optimisation: it needs update='optax'")
        if inference.variant != "plain":
            raise ValueError("dp='optimisation' is DP-SGD on a client's whole local ELBO (variant='plain'); "
                             "local averaging and virtual clients are private with dp='update_perturbation'")
        check_positive_int("dp_batch_size", batch_size,
                           what=" (dp='optimisation' needs it: the fixed number of rows in every DP-SGD step)")
        if trusted:
            raise ValueError("dp='optimisation' gains nothing from a trusted aggregator (each gradient depends on one "
                             "client's data only; Heikkilä et al. (2023) §4.1); use dp='update_perturbation' with "
                             "trusted_aggregator=True")
    if dp == "update_perturbation":
        if batch_size is not None:
            raise ValueError("dp_batch_size= is for dp='optimisation' (update perturbation uses every row)")
        if trusted and inference.schedule != "synchronous":
            raise ValueError("trusted_aggregator=True sums the updates of all clients in a round: it needs "
                             "schedule='synchronous'")
    return dp


def dp_specs(model, clients, model_kwargs) -> Dict[str, DPSpec]:
    """``{observed site: DPSpec}`` of the model on the first client's rows."""
    return dp_sites(trace_model(model, clients[clients.names[0]], model_kwargs))


def has_dp_sites(model, clients, model_kwargs) -> bool:
    return bool(dp_specs(model, clients, model_kwargs))


def planned_releases(schedule: str, num_rounds: int, num_clients: int) -> int:
    """The most updates one client sends in ``num_rounds`` rounds (``"subset"``: every
    round, the worst case)."""
    if schedule == "sequential":
        return math.ceil(num_rounds / num_clients)
    return int(num_rounds)


def plan_privacy(inference, clients) -> Privacy:
    """Check the annotation against the clients and the mechanism, and plan the noise."""
    tr = trace_model(inference.model, clients[clients.names[0]], inference.model_kwargs)
    specs = dp_sites(tr)
    dp = inference.dp
    if dp is None:
        if hasattr(inference, "dp_sampling_rate"):  # FederatedSVI
            raise ValueError(_CHOOSE_SVI.format(sites=sorted(specs)))
        raise ValueError(_CHOOSE.format(sites=sorted(specs)))
    if not specs:
        raise ValueError(_NO_MARKS.format(dp=dp))
    observed = [n for n, s in tr.items() if s["type"] == "sample" and s.get("is_observed")]
    unmarked = [n for n in observed if n not in specs]
    if unmarked:
        raise ValueError(_UNMARKED.format(dp=dp, sites=unmarked))
    if len(set(specs.values())) > 1:
        raise ValueError(f"dp_noise marks {sorted(specs)} with different settings; one row is one individual, so "
                         f"mark them with one dp_noise")
    spec = next(iter(specs.values()))
    rows = clients.num_rows
    for name in clients.names:
        spec.check_rows(rows[name], name)
    J = len(clients)
    if dp == "sgd":  # DP federated SVI: one DP-SGD gradient per client and round
        q = inference.dp_sampling_rate
        sizes = {n: batch_size(q, rows[n]) for n in clients.names}  # the clients' own b_j, to the row
        rates = {n: sizes[n] / rows[n] for n in clients.names}
        steps = 1
        label = f"DP-SGD gradients (federated SVI, sampling rate {q:g})"
    elif dp == "optimisation":
        b = inference.dp_batch_size
        small = min(rows, key=rows.get)
        if b > rows[small]:
            raise ValueError(f"dp_batch_size={b} exceeds client '{small}''s {rows[small]} rows: every DP-SGD step "
                             f"draws that many distinct rows")
        rates = {n: b / rows[n] for n in clients.names}
        steps = inference.local_steps
        label = f"DP-SGD (local optimisation, {b} rows per step)"
    else:
        rates = {n: 1.0 for n in clients.names}
        steps = 1
        label = {"plain": "update perturbation",
                 "local_averaging": f"update perturbation (local averaging, {inference.num_shards} shards)",
                 "virtual": f"update perturbation (virtual clients, {inference.num_shards} shards)"}[inference.variant]
    trusted = inference.trusted_aggregator
    if trusted:
        label += f", trusted aggregator ({J} clients)"
    if spec.epsilon is not None:
        if inference._dp_rounds is None:
            raise ValueError("dp_noise(epsilon=...) calibrates the noise for the planned rounds: call run(key, "
                             "num_rounds, clients), or give dp_noise(noise_multiplier=...) for init()/update()")
        releases = planned_releases(getattr(inference, "schedule", "synchronous"), inference._dp_rounds, J)
        nm = calibrate_noise_multiplier(spec.epsilon, spec.delta, releases * steps, max(rates.values()))
    else:
        nm = spec.noise_multiplier
    perturb = dp_sgd = None
    if dp == "update_perturbation":
        perturb = update_perturbation(spec.clip, nm / math.sqrt(J) if trusted else nm)
    elif dp == "optimisation":
        dp_sgd = DPSGD(spec.clip, nm, inference.dp_batch_size)
    else:
        dp_sgd = DPSGD(spec.clip, nm, max(sizes.values()))
    return Privacy(dp, label, spec, float(nm), perturb, dp_sgd, steps, rates, trusted, J)


def privacy_report(privacy: Privacy, names, result) -> PrivacyReport:
    """Per-client guarantees from each client's own ledger (its ``releases``)."""
    spec, nm = privacy.spec, privacy.noise_multiplier
    entries = []
    answered = None
    if privacy.trusted:
        answered = np.sort(np.asarray(result.rounds_answered))  # worst case: the emptiest rounds
    for name in names:
        releases = int(result.client_states[name].releases)
        if privacy.trusted:
            if releases > len(answered):
                raise ValueError("privacy_report: under a trusted aggregator the report needs every round's "
                                 "answers; this result resumed an earlier run, so report the runs together")
            # a round's sum carries the noise of the clients that answered in it
            counts: Dict[float, int] = {}
            for m in answered[:releases]:
                key = nm * math.sqrt(int(m) / privacy.num_aggregated)
                counts[key] = counts.get(key, 0) + 1
            rate = privacy.sampling_rates[name]
            events = [(k, c * privacy.steps_per_release, rate) for k, c in counts.items()]
        else:
            events = [(nm, releases * privacy.steps_per_release, privacy.sampling_rates[name])]
        eps = epsilon_composed(events, spec.delta)
        entries.append(ClientPrivacy(name, privacy.label, eps, spec.delta, nm, releases * privacy.steps_per_release,
                                     privacy.sampling_rates[name]))
    return report(entries)


def ledger_field(clients, field: str) -> np.ndarray:
    """One field of every client's ledger, ``(J, ...)``, read in one pass (per-client
    states stacked under ``vmap``, a tuple under the loop mapping)."""
    if type(clients) is tuple:
        return np.stack([np.asarray(getattr(slot.state, field)) for slot in clients])
    return np.asarray(getattr(clients.state, field))


def ledgers(clients) -> np.ndarray:
    """Every client's ``releases`` (its privacy ledger), ``(J,)``."""
    return ledger_field(clients, "releases").reshape(-1)


def _few(names):
    return list(names) if len(names) <= 10 else list(names[:10]) + [f"... ({len(names)} in all)"]


def warn_withheld(cls: str, result, category: Any = None) -> None:
    """Warn with what the clients' own ledgers recorded (the simulation gathers them)."""
    if result.state.clients is None:  # a network backend: each ledger stays on its client
        warnings.warn(f"{cls}: under DP each client keeps its fit diagnostics in its own ledger, which stays on its "
                      f"node over a network backend, so the server cannot report withheld diagnostics or failed "
                      f"local fits (each client warns about its own in its node's log); check the fit there or in "
                      f"simulation",
                      category or UncheckedFitWarning, stacklevel=find_stack_level())
        return
    withheld = ledger_field(result.state.clients, "withheld").reshape(-1, 2)  # one pass, not one read per client
    names = list(result.client_states)
    bad = [names[j] for j in np.flatnonzero(withheld.sum(axis=1) > 0)]
    zeroed, failed = (int(x) for x in withheld.sum(axis=0))
    if bad:
        warnings.warn(_WITHHELD.format(cls=cls, clients=_few(bad), zeroed=zeroed, failed=failed),
                      category or UncheckedFitWarning, stacklevel=find_stack_level())


class PrivateFit:
    """What :class:`~numpyro_fed.PVI` and :class:`~numpyro_fed.FederatedSVI` share under
    DP: planning at set-up, recalibration per run, the report and the withheld diagnostics."""

    dp: Optional[str] = None
    _privacy: Optional[Privacy] = None
    _dp_rounds: Optional[int] = None

    def _plan_privacy(self, clients) -> None:
        self._privacy = None
        if self.dp is not None or has_dp_sites(self.model, clients, self.model_kwargs):
            self._privacy = plan_privacy(self, clients)

    def _before_run(self, num_rounds: int, clients, options) -> None:
        """(``run``'s hook) A noise calibrated to ``epsilon=`` plans for this run's rounds (a new plan
        rebuilds the set-up); resuming a calibrated run is refused."""
        if self.dp is None or not self._calibrating(clients):
            return
        if options.get("init_state") is not None:
            raise ValueError(_RESUME_CALIBRATED)
        if self._dp_rounds != int(num_rounds):
            self._dp_rounds, self._setup_cache = int(num_rounds), None

    def _before_round(self, setup, state) -> None:
        """No release past the claim: after a run calibrated to ``epsilon`` for its planned
        rounds, a client whose own ledger has reached the planned releases must not be
        asked again (``update`` refuses; a new ``run`` plans again)."""
        super()._before_round(setup, state)
        if self._privacy is None or self._dp_rounds is None or self._privacy.spec.epsilon is None:
            return
        names = setup.plan.names
        planned = planned_releases(getattr(self, "schedule", "synchronous"), self._dp_rounds, len(names))
        ledger = ledgers(state.clients)
        spent = [n for n, r in zip(names, ledger) if r >= planned]
        if spent:
            spec = self._privacy.spec
            raise ValueError(_BUDGET_SPENT.format(cls=type(self).__name__, eps=spec.epsilon, delta=spec.delta,
                                                  rounds=self._dp_rounds, planned=planned, clients=_few(spent)))

    def _calibrating(self, clients) -> bool:
        specs = dp_specs(self.model, clients, self.model_kwargs)
        return bool(specs) and next(iter(specs.values())).epsilon is not None

    def privacy_report(self, result) -> PrivacyReport:
        """Per client: epsilon at ``delta`` for the rows it holds, the mechanism, the
        releases composed (DP-SGD: local steps or gradients; update perturbation: global
        updates), the sampling rate; and the global guarantee by parallel composition (the
        max over clients). Computed from each client's own ledger (``releases`` in its
        state: what it sent, whether or not the server used it); under a trusted aggregator
        each release is charged the noise of the fewest clients that answered in any round
        of the run (a bound, since a client does not know who else answered)."""
        setup = self._fitted()
        if self._privacy is None:
            raise ValueError(f"privacy_report: this {type(self).__name__} is not differentially private "
                             f"(no dp=, no dp_noise)")
        return privacy_report(self._privacy, setup.plan.names, result)


_NOT_PRIVATE = (
    "{cls} has no differentially private mechanism, and the model marks observed site(s) {sites} with dp_noise: "
    "fitting it would send updates computed from those rows without noise. Use nf.PVI(dp=...), nf.BCM(dp=...) or "
    "nf.FederatedSVI(dp='sgd'), or remove dp_noise"
)


def refuse_dp(cls: str, model, args, model_kwargs) -> None:
    """Raise when a family without a DP mechanism is given a ``dp_noise``-marked model
    (never fit it silently without the protection the model asks for)."""
    sites = dp_sites(trace_model(model, args, model_kwargs))
    if sites:
        raise ValueError(_NOT_PRIVATE.format(cls=cls, sites=sorted(sites)))

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

from .._validation import check_positive_int
from ..model.structure import trace_model
from ..warnings import UncheckedFitWarning, find_stack_level
from .accounting import ClientPrivacy, PrivacyReport, calibrate_noise_multiplier, epsilon_composed, report
from .annotation import DPSpec, dp_sites
from .batch import batch_size
from .mechanisms import DPSGD, update_perturbation

__all__ = ["DPPlan", "MECHANISMS", "Privacy", "check_dp_options", "check_sgd_options", "client_events", "dp_specs",
           "plan_privacy", "planned_events", "privacy_report", "refuse_dp"]

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
    "claim. Plan a longer run (run(key, clients, num_rounds) calibrates for num_rounds), or give "
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


def check_sgd_options(method: str, dp, sampling_rate, trusted) -> Optional[str]:
    """:class:`~numpyro_fed.FederatedSVI`'s checks of ``dp=``, ``dp_sampling_rate=`` and
    ``trusted_aggregator=``."""
    if dp is not None and dp != "sgd":
        raise ValueError(f"dp={dp!r}: FederatedSVI's private mechanism is dp='sgd' (DP-SGD gradients)")
    if dp is None and (sampling_rate is not None or trusted):
        raise ValueError("dp_sampling_rate= and trusted_aggregator= configure a DP fit: pass dp='sgd'")
    if dp == "sgd":
        if method != "sfvi":
            raise ValueError("dp='sgd' is DP federated SVI: one private gradient per round (method='sfvi')")
        if sampling_rate is None or not 0 < sampling_rate <= 1:
            raise ValueError(f"dp='sgd' needs dp_sampling_rate= in (0, 1] (the share of each client's rows in "
                             f"every step); got {sampling_rate!r}")
    return dp


def check_dp_options(dp, batch_size, trusted, *, update_kind: str, variant: str, schedule: str) -> Optional[str]:
    """PVI's checks of ``dp=``, ``dp_batch_size=`` and ``trusted_aggregator=`` (with its ``update``,
    ``variant`` and ``schedule``)."""
    if dp is not None and dp not in MECHANISMS:
        raise ValueError(f"dp={dp!r}: choose one of {MECHANISMS} (or None without dp_noise)")
    if dp is None and (batch_size is not None or trusted):
        raise ValueError("dp_batch_size= and trusted_aggregator= configure a DP fit: pass dp=")
    if dp == "optimisation":
        if update_kind != "optax":
            raise ValueError("dp='optimisation' runs DP-SGD in the local optimisation: it needs update='optax'")
        if variant != "plain":
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
        if trusted and schedule != "synchronous":
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


def plan_privacy(dp_plan: DPPlan, model, clients, model_kwargs) -> Privacy:
    """Check the annotation against the clients and the mechanism, and plan the noise."""
    tr = trace_model(model, clients[clients.names[0]], model_kwargs)
    specs = dp_sites(tr)
    dp = dp_plan.dp
    if dp is None:
        if dp_plan.svi:
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
    if spec.unit is not None:
        raise ValueError(f"dp={dp!r} protects rows, and dp_noise(unit={spec.unit!r}) protects groups: the private "
                         f"Laplace fit (nf.fit(dp=...), exact=False) takes a group as the unit")
    rows = clients.num_rows
    for name in clients.names:
        spec.check_rows(rows[name], name)
    J = len(clients)
    if dp == "sgd":  # DP federated SVI: one DP-SGD gradient per client and round
        q = dp_plan.sampling_rate
        sizes = {n: batch_size(q, rows[n]) for n in clients.names}  # the clients' own b_j, to the row
        rates = {n: sizes[n] / rows[n] for n in clients.names}
        steps = 1
        label = f"DP-SGD gradients (federated SVI, sampling rate {q:g})"
    elif dp == "optimisation":
        b = dp_plan.batch_size
        small = min(rows, key=rows.get)
        if b > rows[small]:
            raise ValueError(f"dp_batch_size={b} exceeds client '{small}''s {rows[small]} rows: every DP-SGD step "
                             f"draws that many distinct rows")
        rates = {n: b / rows[n] for n in clients.names}
        steps = dp_plan.local_steps
        label = f"DP-SGD (local optimisation, {b} rows per step)"
    else:
        rates = {n: 1.0 for n in clients.names}
        steps = 1
        label = {"plain": "update perturbation",
                 "local_averaging": f"update perturbation (local averaging, {dp_plan.num_shards} shards)",
                 "virtual": f"update perturbation (virtual clients, {dp_plan.num_shards} shards)"}[dp_plan.variant]
    masking = getattr(dp_plan, "masking", False)
    trusted = dp_plan.trusted_aggregator and not masking  # the noise is shared only with a trusted aggregator
    if trusted:
        label += f", trusted aggregator ({J} clients)"
    elif masking:
        label += ", summed by pairwise masking (each client adds the whole noise)"
    if spec.epsilon is not None:
        if dp_plan.rounds is None:
            raise ValueError("dp_noise(epsilon=...) calibrates the noise for the planned rounds: call run(key, "
                             "num_rounds, clients), or give dp_noise(noise_multiplier=...) for init()/update()")
        releases = planned_releases(dp_plan.schedule, dp_plan.rounds, J)
        nm = calibrate_noise_multiplier(spec.epsilon, spec.delta, releases * steps, max(rates.values()))
    else:
        nm = spec.noise_multiplier
    perturb = dp_sgd = None
    if dp == "update_perturbation":
        perturb = update_perturbation(spec.clip, nm / math.sqrt(J) if trusted else nm)
    elif dp == "optimisation":
        dp_sgd = DPSGD(spec.clip, nm, dp_plan.batch_size)
    else:
        dp_sgd = DPSGD(spec.clip, nm, max(sizes.values()))
    return Privacy(dp, label, spec, float(nm), perturb, dp_sgd, steps, rates, trusted, J)


def client_events(privacy: Privacy, names, result) -> Dict[str, list]:
    """Per client, its releases in ``result`` as ``[(sigma / C, compositions, sampling rate)]``,
    from its own ledger (its ``releases``); under a trusted aggregator each release is charged the
    noise of the fewest clients that answered in any round of the run."""
    nm = privacy.noise_multiplier
    answered = None
    if privacy.trusted:
        answered = np.sort(np.asarray(result.rounds_answered))  # worst case: the emptiest rounds
    out = {}
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
            out[name] = [(k, c * privacy.steps_per_release, rate) for k, c in counts.items()]
        else:
            out[name] = [(nm, releases * privacy.steps_per_release, privacy.sampling_rates[name])]
    return out


def planned_events(privacy: Privacy, names, schedule: str, num_rounds: int) -> Dict[str, list]:
    """Per client, the releases a run of ``num_rounds`` rounds plans (every client answering)."""
    releases = planned_releases(schedule, num_rounds, len(names)) * privacy.steps_per_release
    return {name: [(privacy.noise_multiplier, releases, privacy.sampling_rates[name])] for name in names}


def privacy_report(privacy: Privacy, names, result) -> PrivacyReport:
    """Per-client guarantees from each client's own ledger (its ``releases``)."""
    spec, nm = privacy.spec, privacy.noise_multiplier
    entries = []
    for name, events in client_events(privacy, names, result).items():
        eps = epsilon_composed(events, spec.delta)
        entries.append(ClientPrivacy(name, privacy.label, eps, spec.delta, nm, sum(e[1] for e in events),
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


class DPPlan:
    """A family's differential privacy, held by :class:`~numpyro_fed.PVI` and
    :class:`~numpyro_fed.FederatedSVI` (composed, not inherited): the mechanism ``dp`` and its
    settings, the noise planned for the clients at set-up (:attr:`privacy`), and the rounds a
    calibration to ``epsilon=`` plans for (:attr:`rounds`).

    Args:
        model: the family's model (its ``dp_noise`` marks say which rows are protected, and how
            much).
        model_kwargs: the model's keyword arguments.
        dp: the mechanism (``None``: no DP unless the model marks rows with ``dp_noise``, which is
            then refused naming the choices).
        trusted_aggregator: the updates are summed by a trusted aggregator before the server.
        masking: they are summed by pairwise masking instead (no third party): each client then
            adds the whole noise, since sharing it would rest the guarantee on the server following
            the protocol and reporting truthfully who answered, which no client can check.
        schedule: the family's schedule (how many releases a client makes in a run).
        sampling_rate: DP-SGD's share of rows per step (``dp="sgd"``).
        batch_size: rows per DP-SGD step (``dp="optimisation"``).
        local_steps: DP-SGD steps per release (``dp="optimisation"``).
        variant: PVI's data split (its label in the report).
        num_shards: the shards of that split.
        svi: the family is federated SVI (its mechanism is ``dp="sgd"``).
    """

    def __init__(self, model: Callable, model_kwargs: Dict[str, Any], dp: Optional[str], *,
                 trusted_aggregator: bool = False, schedule: str = "synchronous", sampling_rate: Optional[float] = None,
                 batch_size: Optional[int] = None, local_steps: int = 1, variant: str = "plain", num_shards: int = 1,
                 svi: bool = False, masking: bool = False) -> None:
        self.svi, self.model, self.model_kwargs = svi, model, model_kwargs
        self.masking = bool(masking)
        self.dp, self.trusted_aggregator, self.schedule = dp, bool(trusted_aggregator), schedule
        self.sampling_rate = None if sampling_rate is None else float(sampling_rate)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.local_steps, self.variant, self.num_shards = int(local_steps), variant, int(num_shards)
        self.privacy: Optional[Privacy] = None  # planned at set-up
        self.rounds: Optional[int] = None  # the rounds a calibration to epsilon= plans for
        self.ledger = None  # the PrivacyLedger the current run is charged to (run(ledger=...))

    def plan(self, clients) -> Optional[Privacy]:
        """At set-up: the noise for these clients (``None`` without DP)."""
        self.privacy = None
        if self.dp is not None or has_dp_sites(self.model, clients, self.model_kwargs):
            self.privacy = plan_privacy(self, self.model, clients, self.model_kwargs)
        return self.privacy

    def before_run(self, clients, num_rounds: int, options) -> bool:
        """(``run``'s hook) A noise calibrated to ``epsilon=`` plans for this run's rounds: True when
        that changed the plan (the set-up must be rebuilt); resuming a calibrated run is refused."""
        specs = dp_specs(self.model, clients, self.model_kwargs) if self.dp is not None else {}
        if not (specs and next(iter(specs.values())).epsilon is not None):
            return False
        if options.get("init_state") is not None:
            raise ValueError(_RESUME_CALIBRATED)
        if self.rounds == int(num_rounds):
            return False
        self.rounds = int(num_rounds)
        return True

    def before_round(self, cls: str, names, state) -> None:
        """No release past the claim: after a run calibrated to ``epsilon`` for its planned
        rounds, a client whose own ledger has reached the planned releases must not be
        asked again (``update`` refuses; a new ``run`` plans again)."""
        if self.privacy is None or self.rounds is None or self.privacy.spec.epsilon is None:
            return
        planned = planned_releases(self.schedule, self.rounds, len(names))
        spent = [n for n, r in zip(names, ledgers(state.clients)) if r >= planned]
        if spent:
            spec = self.privacy.spec
            raise ValueError(_BUDGET_SPENT.format(cls=cls, eps=spec.epsilon, delta=spec.delta, rounds=self.rounds,
                                                  planned=planned, clients=_few(spent)))

    def planned(self, names, num_rounds: int) -> Dict[str, list]:
        """Per client, the releases a run of ``num_rounds`` rounds plans, as ``[(sigma / C, releases, rate)]``."""
        return planned_events(self.privacy, names, self.schedule, num_rounds)

    def release_cap(self, num_clients: int, num_rounds: int) -> int:
        """The most updates one client sends in the run (the count its state's ``releases`` keeps)."""
        return planned_releases(self.schedule, num_rounds, num_clients)

    @property
    def clip(self) -> float:
        return float(self.privacy.spec.clip)

    def before_start(self, cls: str, names, num_rounds: int) -> None:
        """(After the set-up, before any round.) With a :class:`~numpyro_fed.dp.ledger.PrivacyLedger`
        given to this run: refuse it when its planned releases would take a client past its
        budget."""
        if self.ledger is None:
            return
        if self.privacy is None:
            raise ValueError(f"{cls}.run(ledger=...): the ledger accounts a differentially private fit, and this "
                             f"{cls} is not one (no dp=, no dp_noise)")
        self.ledger.open_run(cls, self.planned(names, num_rounds),
                             f"{cls}, {self.privacy.label}, {num_rounds} rounds")

    def after_run(self, cls: str, names, result) -> None:
        """Settle the run's charge on its ledger, if any: its actual releases (each client's own
        count) replace the planned ones."""
        ledger, self.ledger = self.ledger, None
        if ledger is None:
            return
        ledger.close_run(client_events(self.privacy, names, result),
                         f"{cls}, {self.privacy.label}, {int(result.communication.rounds)} rounds")

    def report(self, cls: str, names, result) -> PrivacyReport:
        """:func:`privacy_report` of this plan (refused when the fit is not private)."""
        if self.privacy is None:
            raise ValueError(f"privacy_report: this {cls} is not differentially private (no dp=, no dp_noise)")
        return privacy_report(self.privacy, names, result)


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

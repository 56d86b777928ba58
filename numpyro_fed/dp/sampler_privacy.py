"""A private sampler's privacy plan (:class:`SamplerPrivacy`): what a family whose every release
carries the whole noise (:class:`~numpyro_fed.mcmc.DPMetropolis`,
:class:`~numpyro_fed.dp.dp_laplace.DPLaplace`) hands the run as its ``dp_plan``: the ledger
checked before the run and charged after, the report from each client's own count of releases,
and the refusal of a run where a client was asked past its plan.
"""

from __future__ import annotations

from typing import Any, Dict

from ..run.backends.base import NetworkBackend
from .accounting import ClientPrivacy, PrivacyReport, epsilon_composed, report
from .ledger import PrivacyBudgetError
from .releases import over_plan

__all__ = ["SamplerPrivacy", "may_drop"]

_OVER_PLAN = (
    "{cls}: client(s) {clients} refused a release past their plan of {plan} (the noise is calibrated for that many; "
    "a client asked for another step than the plan has, by a server that deviates or after its own state was taken "
    "back over a network, refuses); the run stopped there and returns no answer. Spent (epsilon at delta={delta:g}, "
    "from the releases each made): {spent}"
)


def may_drop(options: dict) -> bool:
    """Whether a run with these options may miss clients in a round: simulated ``availability=``,
    or a network backend, where dropout is real."""
    return options.get("availability") is not None or isinstance(options.get("backend"), NetworkBackend)


class SamplerPrivacy:
    """The sampler's privacy plan in the form :class:`~numpyro_fed.run.inference.FederatedInference`
    calls it (the ``dp_plan`` hooks: a ledger checked before the run and charged after, the
    report from each client's own count of releases)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.ledger = sampler, None

    @property
    def privacy(self):
        return self.sampler.privacy

    def before_run(self, inputs, num_rounds: int, options) -> bool:
        return False

    def before_round(self, cls: str, names, state) -> None:
        pass

    def _events(self, releases: Dict[str, int]) -> Dict[str, list]:
        """Per client ``[(sigma / C, releases, 1)]``: every release carries the whole noise."""
        nm = self.sampler.privacy[1]
        return {name: [(nm, int(r), 1.0)] for name, r in releases.items()}

    def planned(self, names, num_rounds: int) -> Dict[str, list]:
        """Per client, the most releases the run may make (its cap), as ``[(sigma / C, releases, 1)]``."""
        return self._events({n: self.sampler.releases_per_client for n in names})

    def release_cap(self, num_clients: int, num_rounds: int) -> int:
        """The most releases one client makes in the run (the count its state's ``releases`` keeps)."""
        return int(self.sampler.releases_per_client)

    @property
    def clip(self) -> float:
        return float(self.sampler.privacy[0].clip)

    def before_start(self, cls: str, names, num_rounds: int) -> None:
        if self.ledger is None:
            return
        self.ledger.open_run(cls, self.planned(names, num_rounds),
                             f"{cls}, {self.sampler.releases_per_client} releases")

    def after_run(self, cls: str, names, result) -> None:
        ledger, self.ledger = self.ledger, None
        if ledger is not None:
            ledger.close_run(self.events(names, result), f"{cls}, {int(result.communication.rounds)} rounds")
        refused = [names[j] for j in over_plan(result)]
        if refused:
            spec, nm = self.sampler.privacy
            events = self.events(names, result)
            spent = {n: round(epsilon_composed(events[n], spec.delta), 4) for n in refused}
            raise PrivacyBudgetError(
                _OVER_PLAN.format(cls=cls, clients=refused, plan=self.sampler.releases_per_client, spent=spent,
                                  delta=spec.delta), refused[0], spent[refused[0]], 0.0, spent[refused[0]])

    def events(self, names, result) -> Dict[str, list]:
        """Each client's releases in ``result`` as ``[(sigma / C, releases, sampling rate)]``."""
        return self._events(_releases(names, result))

    def report(self, cls: str, names, result) -> PrivacyReport:
        spec, nm = self.sampler.privacy
        label = getattr(self.sampler, "privacy_label",
                        "DPMetropolis (clipped log-likelihood ratios, penalty-corrected)")
        if self.sampler.secure_aggregation:
            label += f", summed by {self.sampler.secure_aggregation} aggregation"
        if getattr(spec, "unit", None) is not None:
            label += f", protected unit: one group of {spec.unit!r}"
        events = self.events(names, result)
        return report([ClientPrivacy(name, label, epsilon_composed(events[name], spec.delta), spec.delta, nm,
                                     sum(e[1] for e in events[name]), 1.0) for name in names])


def _releases(names, result) -> Dict[str, int]:
    return {name: int(result.client_states[name].releases) for name in names}

"""Privacy accounting with Google's ``dp-accounting`` (Heikkilä et al. (2023) §3.2, Definition 5).

One individual is one row of a client's row plate; neighbouring data sets differ by the
*substitution* of one row (Heikkilä et al.'s (2023) sample-level DP). A release of a clipped sum with
Gaussian noise of standard deviation ``sigma`` and clipping bound ``C`` has sensitivity
``2C`` under substitution; the privacy loss distribution accountant with
``NeighboringRelation.REPLACE_ONE`` and ``GaussianDpEvent(sigma / C)`` accounts for the
``2C`` itself.

A fixed-size subset of ``b`` of a client's ``n`` rows drawn without replacement at every
step (DP-SGD, Heikkilä et al. (2023) Definition 4) is accounted as ``PoissonSampledDpEvent(b / n, ...)``
under ``REPLACE_ONE``: this gives the same bound as the paper's Fourier accountant for
sampling without replacement under substitution. (``SampledWithoutReplacementDpEvent`` is
supported by the RDP accountant only and, given ``sigma / C``, under-reports; it is not
used.)

Examples:
    >>> round(epsilon(1.0, 1e-5, 1000, sampling_rate=0.01), 3)
    2.843
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence, Tuple

from .._validation import check_positive_int

__all__ = ["ClientPrivacy", "PrivacyReport", "calibrate_after", "calibrate_noise_multiplier", "epsilon",
           "epsilon_composed"]

#: PLD discretisation for reported epsilons (dp-accounting's default).
REPORT_DISCRETIZATION = 1e-4
#: PLD discretisation while calibrating: coarser is pessimistic (never under-reports) and
#: about 10x faster; the calibrated noise is then re-accounted at REPORT_DISCRETIZATION.
CALIBRATION_DISCRETIZATION = 1e-3


def _check(noise_multiplier: float, delta: float, compositions: int, sampling_rate: float) -> None:
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier={noise_multiplier!r}: must be a finite number >= 0 (sigma / clip)")
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r}: must lie in (0, 1)")
    check_positive_int("compositions", compositions, minimum=0)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate={sampling_rate!r}: must lie in (0, 1] (subset size / rows)")


def _dp():
    """dp-accounting, imported on first use (with its scipy/mpmath stack it costs every process
    that imports numpyro_fed about 1 s and 100 MB otherwise: a Flower executor that never
    accounts, say)."""
    import dp_accounting
    import dp_accounting.pld  # noqa: F401  the PLD accountant's subpackage

    return dp_accounting


def _event(noise_multiplier: float, compositions: int, sampling_rate: float):
    dp_accounting = _dp()
    event = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_rate < 1:
        event = dp_accounting.PoissonSampledDpEvent(sampling_rate, event)
    return dp_accounting.SelfComposedDpEvent(event, int(compositions))


VACUOUS_EPSILON = 30.0
"""Above this epsilon (by the RDP bound) a report gives the RDP bound instead of the PLD figure:
a guarantee of ``exp(30)`` protects nothing, and the PLD of so little noise composed many times
needs minutes and gigabytes (0.46 x 800 releases: 130 s, 17 GB)."""


def _vacuous(events, delta: float):
    """The RDP upper bound on epsilon of full-batch Gaussian ``events`` when it exceeds
    :data:`VACUOUS_EPSILON` (else ``None``: account with the PLD). Under substitution a sum
    clipped to ``C`` has sensitivity ``2C``: the Gaussian mechanism of ``sigma / (2C)`` at
    sensitivity 1, which RDP accounts (add-or-remove, sensitivity 1). Sampled events: ``None``."""
    if any(r < 1 for _, _, r in events):
        return None
    from dp_accounting.rdp import RdpAccountant

    dp_accounting = _dp()
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(nm / 2.0), int(c)) for nm, c, _ in events]))
    bound = float(accountant.get_epsilon(delta))
    return bound if bound > VACUOUS_EPSILON else None


def _accountant(discretization: float):
    dp_accounting = _dp()
    return dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE,
                             value_discretization_interval=discretization)


def epsilon(noise_multiplier: float, delta: float, compositions: int, sampling_rate: float = 1.0, *,
            discretization: float = REPORT_DISCRETIZATION) -> float:
    """Epsilon at ``delta`` of ``compositions`` Gaussian releases (noise ``sigma = noise_multiplier * C``
    on a sum clipped to ``C`` per row), each on a uniformly random ``sampling_rate`` share
    of the rows, under substitution of one row.

    ``noise_multiplier = 0`` releases without noise: epsilon is infinite. No release
    (``compositions = 0``) costs nothing. Where the guarantee is vacuous (above
    :data:`VACUOUS_EPSILON` by the RDP bound) the RDP bound is returned, an upper bound on the
    PLD figure that costs milliseconds instead of minutes.
    """
    _check(noise_multiplier, delta, compositions, sampling_rate)
    if compositions == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    vacuous = _vacuous([(float(noise_multiplier), int(compositions), float(sampling_rate))], delta)
    if vacuous is not None:
        return vacuous
    accountant = _accountant(discretization)
    accountant.compose(_event(float(noise_multiplier), int(compositions), float(sampling_rate)))
    return float(accountant.get_epsilon(delta))


def epsilon_composed(events: Sequence[Tuple[float, int, float]], delta: float, *,
                     discretization: float = REPORT_DISCRETIZATION) -> float:
    """Epsilon at ``delta`` of releases of different kinds composed:
    ``events = [(noise_multiplier, compositions, sampling_rate), ...]`` (see :func:`epsilon`)."""
    events = [(float(nm), int(c), float(r)) for nm, c, r in events if c > 0]
    for nm, c, r in events:
        _check(nm, delta, c, r)
    if not events:
        return 0.0
    if any(nm == 0 for nm, _, _ in events):
        return math.inf
    if len(events) == 1:
        nm, c, r = events[0]
        return epsilon(nm, delta, c, r, discretization=discretization)
    vacuous = _vacuous(events, delta)
    if vacuous is not None:
        return vacuous
    accountant = _accountant(discretization)
    accountant.compose(_dp().ComposedDpEvent([_event(nm, c, r) for nm, c, r in events]))
    return float(accountant.get_epsilon(delta))


def calibrate_noise_multiplier(target_epsilon: float, delta: float, compositions: int,
                               sampling_rate: float = 1.0, *, tol: float = 1e-3) -> float:
    """The smallest noise multiplier ``sigma / C`` (to ``tol``) whose ``compositions``
    releases are ``(target_epsilon, delta)``-DP under substitution
    (``dp_accounting.calibrate_dp_mechanism`` on the PLD accountant). Cached per
    arguments (a pure function; calibrating can take seconds)."""
    return _calibrate(float(target_epsilon), float(delta), int(compositions), float(sampling_rate), float(tol))


@functools.lru_cache(maxsize=256)
def _calibrate(target_epsilon: float, delta: float, compositions: int, sampling_rate: float, tol: float) -> float:
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"epsilon={target_epsilon!r}: must be a finite number > 0")
    _check(1.0, delta, compositions, sampling_rate)
    if compositions == 0:
        return 0.0

    def eps(nm):
        return epsilon(nm, delta, compositions, sampling_rate, discretization=CALIBRATION_DISCRETIZATION)

    # bracket by doubling/halving from 1 (small multipliers are slow to account: search
    # upwards first), then bisect with dp-accounting
    hi = 1.0
    if eps(hi) > target_epsilon:
        while eps(hi) > target_epsilon:
            hi *= 2.0
            if hi > 1e6:
                raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon={target_epsilon} at delta={delta}")
        lo = hi / 2.0
    else:
        lo = hi / 2.0
        while lo > 1e-3 and eps(lo) <= target_epsilon:
            hi, lo = lo, lo / 2.0
    dp_accounting = _dp()
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: _accountant(CALIBRATION_DISCRETIZATION),
        lambda nm: _event(nm, int(compositions), float(sampling_rate)),
        target_epsilon, delta, dp_accounting.ExplicitBracketInterval(lo, hi), tol=tol))


class ClientPrivacy(NamedTuple):
    """One client's guarantee for the rows it holds."""

    client: str
    mechanism: str  # e.g. "DP-SGD (local optimisation)", "update perturbation (local averaging)"
    epsilon: float
    delta: float
    noise_multiplier: float  # sigma / C of each release
    compositions: int  # releases composed: local steps (DP-SGD) or global updates
    sampling_rate: float  # rows used per release / rows held


class PrivacyReport(NamedTuple):
    """Per-client guarantees and the global one by parallel composition: each row is held
    by exactly one client, so the fit is ``(max epsilon, max delta)``-DP for any row."""

    clients: Tuple[ClientPrivacy, ...]

    @property
    def epsilon(self) -> float:
        return max(c.epsilon for c in self.clients)

    @property
    def delta(self) -> float:
        return max(c.delta for c in self.clients)

    def __str__(self) -> str:
        head = "client | mechanism | epsilon | delta | sigma/C | releases | sampling rate"
        rows = [f"{c.client} | {c.mechanism} | {c.epsilon:.4g} | {c.delta:.3g} | {c.noise_multiplier:.4g} | "
                f"{c.compositions} | {c.sampling_rate:.4g}" for c in self.clients]
        tail = f"global (parallel composition, max over clients): ({self.epsilon:.4g}, {self.delta:.3g})-DP"
        return "\n".join([head, *rows, tail, *(f"assumes: {a}" for a in self.assumptions)])

    @property
    def assumptions(self) -> Tuple[str, ...]:
        """What the guarantee above rests on beyond the mechanism, stated for the mechanisms used."""
        labels = " ".join(c.mechanism for c in self.clients)
        out = []
        if "masking" in labels:
            out.append("pairwise masking hides each release only from a server that follows the protocol and colludes "
                       "with no client (or, where the nodes pin their peers' signing keys, one that does not collude); "
                       "the epsilon above does not rely on it: every client adds the whole noise")
        if "trusted aggregator" in labels:
            out.append("the aggregator is trusted: the clients share the noise, so an aggregator that deviates or "
                       "reports who answered falsely voids the epsilon above")
        return tuple(out)


def report(entries: Sequence[ClientPrivacy]) -> PrivacyReport:
    if not entries:
        raise ValueError("a privacy report needs at least one client")
    return PrivacyReport(tuple(entries))


def calibrate_after(spent: Sequence[Tuple[float, int, float]], target_epsilon: float, delta: float,
                    compositions: int, *, tol: float = 1e-3) -> float:
    """The noise multiplier of ``compositions`` further full-batch Gaussian releases such that,
    composed with the releases ``spent`` (``[(noise_multiplier, compositions, sampling_rate)]``),
    the whole is ``(target_epsilon, delta)``-DP (dp-accounting's PLD, substitution of one row). A
    budget the spent releases already use up raises, naming both."""
    spent = [(float(nm), int(c), float(r)) for nm, c, r in spent if c > 0]
    already = epsilon_composed(spent, delta, discretization=CALIBRATION_DISCRETIZATION) if spent else 0.0
    if not already < target_epsilon:
        raise ValueError(f"the releases already made spend epsilon={already:.4g} of the target {target_epsilon:g}: "
                         f"nothing is left for {compositions} more")
    if compositions == 0:
        return 0.0
    dp_accounting = _dp()

    def make(nm):
        return dp_accounting.ComposedDpEvent([_event(*e) for e in spent] + [_event(nm, compositions, 1.0)])

    def eps(nm):
        accountant = _accountant(CALIBRATION_DISCRETIZATION)
        accountant.compose(make(nm))
        return accountant.get_epsilon(delta)

    hi = 1.0
    while eps(hi) > target_epsilon:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon={target_epsilon} at delta={delta}")
    lo = hi / 2.0
    while lo > 1e-3 and eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2.0
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: _accountant(CALIBRATION_DISCRETIZATION), make, target_epsilon, delta,
        dp_accounting.ExplicitBracketInterval(lo, hi), tol=tol))

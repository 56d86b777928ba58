"""One fit-check protocol for every family: a check is ``(inference, result) -> Verdict``.

Every inference object's ``run`` ends with its family's check, found here by the family's class
(the nearest registered class in its method resolution order), and returns the run's result with
the verdict in ``result.verdict``. A family registers its check with :func:`register_check`:

    >>> from numpyro_fed.check import Verdict, check_for, register_check
    >>> class MyFamily:  # a FederatedInference subclass in practice
    ...     pass
    >>> @register_check(MyFamily)
    ... def my_check(inference, result):
    ...     return Verdict("ok", "convergence", "the estimate stopped moving")
    >>> check_for(MyFamily()) is my_check
    True

A check warns (a :class:`~numpyro_fed.warnings.FitWarning` naming the site, client or setting and
the fix) or raises where the fit is wrong or unfinished; its :class:`Verdict` says the same in a
form a program reads (``nf.fit``'s ladder decides on it). The checks themselves:

- :mod:`numpyro_fed.check.psis`: ``q`` against the posterior by Pareto-smoothed importance sampling,
  and the moment check (the variational and factor families);
- :mod:`numpyro_fed.check.chains`: split R-hat, bulk ESS and the scalars that never move (the samplers);
- :mod:`numpyro_fed.check.laplace`: the Laplace rung's judge of its two checks (``nf.fit``).

Each family computes its clients' terms of a check on their own rows (``terms/local_check.py``,
``horizontal/check.py``, ``vertical/check.py``, and their network forms) and registers the
function that turns them into a verdict beside its class.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Mapping, NamedTuple, Protocol, Tuple

from ..warnings import FitWarning

__all__ = ["STATUSES", "Check", "Verdict", "check_for", "from_diagnostic", "register_check", "run_check",
           "unchecked"]

STATUSES = ("ok", "biased", "unreliable", "unconverged", "unchecked")
"""A verdict's ``status``: ``"ok"`` (the check passed); ``"biased"`` (``q``'s moments are off the
importance-weighted ones though importance sampling can correct it); ``"unreliable"`` (importance
sampling cannot correct ``q``, or the chains have not mixed); ``"unconverged"`` (the estimate was
still moving when the run ended); ``"unchecked"`` (no check ran: ``why`` says why)."""


class Verdict(NamedTuple):
    """What a family's fit check found about one run (``result.verdict``).

    Attributes:
        status: one of :data:`STATUSES`.
        check: the check that ran: ``"psis"`` (``q`` against the posterior), ``"chains"`` (the
            samplers' mixing), ``"convergence"`` (the last change of the estimate) or ``"none"``.
        why: one line, what was found or why no check ran.
        sites: the sites the check names (biased, unmixed), in the model's names.
        figures: the check's figures by name (``pareto_k``, ``ess``; ``max_r_hat``, ``min_n_eff``,
            ``divergences`` or ``acceptance``, ``e_bfmi``; ``change``).
        reports: the check's full reports by name: ``"q"`` (a
            :class:`~numpyro_fed.check.psis.FitDiagnostic`), ``"widened"`` (Laplace's widened check),
            ``"chains"`` (the samplers' ``mixing``), ``"rho"`` (vertical SVI's augmentation check).
        communication: the run's communication with the check's own exchanges added (``None``: the
            check exchanged nothing).
        warned: every fit warning the check gave (``"Category: message"``; each is also shown as a
            warning). ``status`` judges the answer; a check may also warn of how the fit got there
            (a client's local fit, a client's local chains, an invalid update) while the answer
            passes: read them.
    """

    status: str
    check: str
    why: str = ""
    sites: Tuple[str, ...] = ()
    figures: Mapping[str, float] = {}
    reports: Mapping[str, Any] = {}
    communication: Any = None
    warned: Tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether the check ran and passed."""
        return self.status == "ok"

    def __repr__(self) -> str:
        """The status, the check, its figures and sites and how many warnings it gave; not the reports."""
        figures = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.figures.items())
        sites = f", sites={list(self.sites[:6])}" if self.sites else ""
        warned = f", warned={len(self.warned)}" if self.warned else ""
        return f"Verdict({self.status!r}, check={self.check!r}{', ' + figures if figures else ''}{sites}{warned})"


class Check(Protocol):
    """A family's fit check: warn or raise where the run's answer is wrong or unfinished, and say so."""

    def __call__(self, inference: Any, result: Any) -> Verdict: ...


_CHECKS: Dict[type, Check] = {}


def register_check(family: type) -> Callable[[Check], Check]:
    """Register the decorated function as the check of ``family`` and of its subclasses that register none."""

    def register(check: Check) -> Check:
        _CHECKS[family] = check
        return check

    return register


def check_for(inference: Any) -> Check:
    """The check registered for ``inference``'s class, or for its nearest registered base."""
    for cls in type(inference).__mro__:
        if cls in _CHECKS:
            return _CHECKS[cls]
    raise TypeError(f"{type(inference).__name__} has no registered fit check: register one with "
                    f"numpyro_fed.check.register_check({type(inference).__name__}) (one that checks nothing "
                    f"returns numpyro_fed.check.unchecked(why))")


def run_check(inference: Any, result: Any) -> Any:
    """``result`` after ``inference``'s check: its ``verdict`` set (with the fit warnings the check
    gave), the check's traffic counted."""
    check, caught = check_for(inference), []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            verdict = check(inference, result)
    finally:  # every warning reaches the caller as the check gave it, where it pointed
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if not isinstance(verdict, Verdict) or verdict.status not in STATUSES:
        raise TypeError(f"the fit check of {type(inference).__name__} returned {verdict!r}, not a Verdict whose "
                        f"status is one of {STATUSES}")
    communication = result.communication if verdict.communication is None else verdict.communication
    warned = tuple(f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, FitWarning))
    return result._replace(verdict=verdict._replace(communication=None, warned=warned), communication=communication)


def unchecked(why: str, communication: Any = None) -> Verdict:
    """The verdict of a run no check could judge, saying why."""
    return Verdict("unchecked", "none", why, communication=communication)


def from_diagnostic(diagnostic: Any, communication: Any = None, **reports: Any) -> Verdict:
    """The verdict of a PSIS check (a :class:`~numpyro_fed.check.psis.FitDiagnostic`): its own
    verdict, Pareto k and ESS, its biased sites; ``reports`` beside it (Laplace's ``widened``)."""
    status = diagnostic.verdict
    sites = tuple(dict.fromkeys(m.site for m in diagnostic.biased))
    why = {"ok": "q matches the importance-weighted posterior",
           "biased": "q's moments are off the importance-weighted ones",
           "unreliable": "Pareto k is above the limit: importance sampling cannot correct q"}[status]
    figures = {"pareto_k": float(diagnostic.pareto_k), "ess": float(diagnostic.ess)}
    return Verdict(status, "psis", why, sites, figures, {"q": diagnostic, **reports}, communication)

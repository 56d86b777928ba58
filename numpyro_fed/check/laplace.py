"""The Laplace rung's verdict: the fit as it is, its importance-corrected draws, or neither.

:func:`judge` reads the two fit checks :class:`~numpyro_fed.factor.Laplace` ran (``widen``) and
decides, logging why; ``nf.fit``'s ladder (:mod:`numpyro_fed.fitting.ladder`) moves to an exact sampler
when it returns ``None``.
"""

from __future__ import annotations

from typing import List

from . import from_diagnostic
from .psis import MEAN_MARGIN, SD_MARGIN, answer_check, within_tolerance

__all__ = ["ACCEPT_K", "CORRECT_DRAWS", "CORRECT_K", "CORRECT_MIN_ESS", "WIDEN", "disagreeing", "judge"]

ACCEPT_K = 0.7
"""The Laplace fit is accepted as it is when the check's verdict is ``ok``: Pareto k at most
this (Vehtari et al., 2024) and no site biased (means within 0.2 weighted sds, sds within 15 %)."""
CORRECT_K = 0.7
"""The widened check's Pareto k at most this: importance sampling from it is reliable (Vehtari et
al., 2024), for the agreement test and for corrected draws."""
CORRECT_DRAWS = 4000
"""Draws of the widened check (the corrected draws are resampled from them)."""
CORRECT_MIN_ESS = 400
"""The corrected draws need an importance-sampling effective sample size of at least this."""
WIDEN = 1.5
"""The widened check draws from ``q`` with its sd times this."""


def judge(laplace, result, log: List[str]):
    """Accept the Laplace fit (``(method, result, check, corrected)``) or not (``None``), logging why.

    Two checks, both run by :class:`~numpyro_fed.factor.Laplace` (``widen``; the verdict's
    ``reports["q"]`` and ``reports["widened"]``), each client computing its own term: the fit check
    of ``q`` itself (its verdict), and one from ``q`` widened to :data:`WIDEN` times its sd with
    :data:`CORRECT_DRAWS` draws, whose importance weights reach the tails a too-narrow ``q`` never
    draws from. ``q`` is kept when its verdict is ``ok`` and its user-space means and sds agree with
    the widened check's weighted ones (means within 0.2 sds, sds within 15 %, with three Monte Carlo
    standard errors of the estimate to spare: an accepted ``q`` never sits on the tolerance);
    otherwise the widened check's importance-resampled draws are the answer when its Pareto k is at
    most :data:`CORRECT_K`, its ESS at least :data:`CORRECT_MIN_ESS`, and the two checks'
    importance-weighted moments agree (the same margins): two importance estimates of one posterior
    from proposals of different widths differ where its tails reach past the narrower, and may reach
    past the wider too (a precision with a Gamma(0.001, 0.001) prior: the weighted sd from ``q``
    half the widened one's, itself 0.73 of the posterior's)."""

    rounds = int(result.communication.rounds)
    verdict = result.verdict
    check, wide = verdict.reports.get("q"), verdict.reports.get("widened")
    if check is None:
        log.append(f"laplace: {rounds} rounds; not checked ({verdict.why})")
        return None
    off = f"; biased: {', '.join(m.site for m in check.biased[:4])}" if check.biased else ""
    log.append(f"laplace: {rounds} rounds; check {check.verdict} (Pareto k {check.pareto_k:.2f}{off})")
    if wide is None:
        log.append("laplace: no widened check (some client did not answer)")
        return None
    disagree = disagreeing(check, wide)
    log.append(f"laplace: widened check ({WIDEN}x sd, {CORRECT_DRAWS} draws): Pareto k {wide.pareto_k:.2f}, ESS "
               f"{wide.ess:.0f}" + (f"; q's moments off at {', '.join(disagree[:4])}" if disagree else
                                    "; q's moments agree"))
    if check.verdict == "ok" and not disagree and wide.pareto_k <= CORRECT_K:
        log.append("laplace: accepted")
        return "laplace", result, check, False
    if wide.pareto_k <= CORRECT_K and wide.ess >= CORRECT_MIN_ESS:
        unstable = disagreeing(check, wide, weighted=True)
        if unstable:  # two importance estimates of one posterior: where they differ, its tails reach past both
            log.append(f"laplace: the importance-weighted moments from q and from the widened q disagree at "
                       f"{', '.join(unstable[:4])}: the posterior's tails reach beyond what either draws; "
                       f"corrected draws are not offered")
            return None
        log.append("laplace: accepted with importance-corrected draws (from the widened check)")
        answer = answer_check(wide)
        corrected = laplace.widened_result(result)._replace(verdict=from_diagnostic(answer, widened=wide))
        return "laplace (importance-corrected)", corrected, answer, True
    return None


def disagreeing(check, wide, weighted: bool = False) -> List[str]:
    """The sites whose moments under ``q`` (``check``) are not within the promised tolerance of
    the widened check's weighted ones (means within 0.2 sds, sds within 15 %) with three Monte
    Carlo standard errors of that estimate to spare (:func:`~numpyro_fed.check.psis.within_tolerance`);
    ``weighted``: whose importance-weighted moments under ``q`` are off the widened check's by
    more than the tolerance itself (two estimates of one posterior that disagree)."""

    ours = {m.site: m for m in check.moments}
    out = []
    for m in wide.moments:
        q = ours.get(m.site)
        if q is None or not m.weighted_sd > 0:
            continue
        if weighted:  # two estimates of one posterior: they agree within the tolerance itself
            ok = (abs(q.weighted_mean - m.weighted_mean) <= MEAN_MARGIN * m.weighted_sd
                  and abs(q.weighted_sd / m.weighted_sd - 1) <= SD_MARGIN)
        else:  # q as it is: within the tolerance with the estimate's Monte Carlo error to spare
            ok = within_tolerance(q.q_mean, q.q_sd, m)
        if not ok:
            out.append(m.site)
    return out

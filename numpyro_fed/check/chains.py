"""The chains' diagnostics over the global scalars, one definition for every sampler.

Split R-hat and bulk ESS (NumPyro's :func:`~numpyro.diagnostics.split_gelman_rubin` and
:func:`~numpyro.diagnostics.effective_sample_size`) per scalar of every site, as a careful NumPyro
user would check them. A scalar that never moves (the fixed entries of an ``LKJCholesky``
factor, a constant ``numpyro.deterministic``) has no R-hat or ESS: it is left out and named in
``constant``, never turned into a NaN. Split R-hat needs no second chain (each chain is split in
halves), so one chain is judged too; :data:`R_HAT_LIMIT` and :data:`MIN_ESS` are the limits the
samplers warn at.
"""

from __future__ import annotations

from typing import List, Mapping, NamedTuple

import numpy as np

from . import Verdict
from .energy import E_BFMI_LIMIT

__all__ = ["ChainReport", "MIN_ESS", "R_HAT_LIMIT", "chain_report", "chains_verdict", "describe_unmixed"]

R_HAT_LIMIT = 1.05  # a global scalar's split R-hat above this warns
MIN_ESS = 100  # a global scalar's bulk ESS below this warns


class ChainReport(NamedTuple):
    """What :func:`chain_report` found.

    Attributes:
        max_r_hat, min_n_eff: over the scalars that move (``nan`` when none does).
        not_converged: the scalars whose split R-hat is above :data:`R_HAT_LIMIT`.
        unmixed: ``"name (R-hat r, ESS e)"`` of those and of the scalars whose ESS is below :data:`MIN_ESS`.
        constant: the scalars left out because they never move.
        num_chains: the chains judged.
    """

    max_r_hat: float
    min_n_eff: float
    not_converged: List[str]
    unmixed: List[str]
    constant: List[str]
    num_chains: int


def chain_report(draws: Mapping[str, np.ndarray]) -> ChainReport:
    """Diagnose ``draws`` (``site -> (chains, samples, ...)``), scalar by scalar.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> r = chain_report({"a": rng.normal(size=(2, 500)), "L": np.ones((2, 500, 2))})
        >>> r.constant, bool(r.max_r_hat < 1.05), r.unmixed
        (['L[0]', 'L[1]'], True, [])
    """
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin

    r_hats, ess_all, not_converged, unmixed, constant = [], [], [], [], []
    chains = 0
    for site, x in draws.items():
        x = np.asarray(x, np.float64)
        chains = x.shape[0]
        x = x.reshape(x.shape[:2] + (-1,))
        for k in range(x.shape[-1]):
            name = f"{site}[{k}]" if x.shape[-1] > 1 else site
            xk = x[..., k]
            if np.all(xk == xk.reshape(-1)[0]):
                constant.append(name)
                continue
            r_hat = float(split_gelman_rubin(xk)) if xk.shape[1] >= 4 else float("nan")
            ess = float(effective_sample_size(xk))
            r_hats.append(r_hat)
            ess_all.append(ess)
            if not r_hat <= R_HAT_LIMIT:
                not_converged.append(name)
            if not (r_hat <= R_HAT_LIMIT and ess >= MIN_ESS):
                unmixed.append(f"{name} (R-hat {r_hat:.3g}, ESS {ess:.0f})")
    return ChainReport(max(r_hats) if r_hats else float("nan"), min(ess_all) if ess_all else float("nan"),
                       not_converged, unmixed, constant, chains)


def describe_unmixed(unmixed: List[str], limit: int = 6) -> str:
    """``"a (R-hat 1.2, ESS 9), b ..."``: the first ``limit`` unmixed scalars (a report's ``unmixed``)."""
    more = len(unmixed) - limit
    return ", ".join(unmixed[:limit]) + (f" and {more} more" if more > 0 else "")


def chains_verdict(report: Mapping) -> Verdict:
    """The verdict of a sampler's ``mixing`` report: ``"unreliable"`` where a global scalar has not
    mixed (split R-hat above :data:`~numpyro_fed.check.chains.R_HAT_LIMIT` or bulk ESS under
    :data:`~numpyro_fed.check.chains.MIN_ESS`), a post-warmup iteration diverged, or (Hamiltonian
    chains) the E-BFMI is under :data:`~numpyro_fed.check.energy.E_BFMI_LIMIT` (the sites: the
    scalars that carry the energy)."""

    keys = ("max_r_hat", "min_n_eff", "divergences", "acceptance", "e_bfmi")
    figures = {k: float(report[k]) for k in keys if k in report}
    carried = [entry.split(" (")[0] for entry in report.get("energy_sites", [])]
    unmixed = list(dict.fromkeys(entry.split(" (")[0] for entry in report["unmixed"]))
    sites = tuple(dict.fromkeys(unmixed + carried))
    diverged = figures.get("divergences", 0.0) > 0
    low_energy = figures.get("e_bfmi", 1.0) < E_BFMI_LIMIT
    why = ("the chains have mixed" if not (sites or diverged or low_energy) else
           "; ".join(([f"not mixed at {', '.join(unmixed[:6])}"] if unmixed else [])
                     + ([f"{figures['divergences']:.0f} divergent iterations"] if diverged else [])
                     + ([f"E-BFMI {figures['e_bfmi']:.2f} under {E_BFMI_LIMIT}"
                         + (f", the energy carried by {', '.join(carried)}" if carried else "")]
                        if low_energy else [])))
    bad = bool(sites) or diverged or low_energy
    return Verdict("unreliable" if bad else "ok", "chains", why, sites, figures, {"chains": report})

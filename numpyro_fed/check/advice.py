"""What to change in a model the samplers could not sample in the rounds allowed, from what was measured.

:func:`numpyro_fed.fit` raises :class:`~numpyro_fed.run.budget.RoundBudgetError` (and warns of chains
that did not mix) with advice that fits the model at hand, not a fixed list:

- **a symmetric point**: the Laplace search stopped where the entries of a site coincide (a
  mixture's component means, started at the prior's mean where they are equal): that point is a
  saddle of a posterior whose components the prior treats alike, and ``init=`` starts the search
  apart;
- **the parameterisation of each hierarchy**, by the rows each of its effects sees: an effect
  with many rows per entry (at least :data:`MANY_ROWS`) is pinned by its own data, and its
  centred form (``b ~ Normal(0, tau)``) samples well where the non-centred one (``b = tau * z``,
  ``z ~ Normal(0, 1)``) ties ``tau`` and ``z`` into a funnel; an effect with few rows per entry (at
  most :data:`FEW_ROWS`) is the other way round. Whether a site is centred is read off the model:
  its prior density moves with the global sites (centred) or does not (non-centred).

Each line names the sites and the figures it rests on.
"""

from __future__ import annotations

import warnings
from typing import List, Mapping, Optional, Sequence

import numpy as np
from numpyro.handlers import seed, substitute, trace

from ..model.trace import finite_point, unwrapped
from ..warnings import MCMCDiagnosticWarning, find_stack_level
from .chains import MIN_ESS, R_HAT_LIMIT, describe_unmixed

__all__ = ["FEW_ROWS", "GENERIC_FIX", "MANY_ROWS", "advice", "effect_sites", "fix_text", "symmetric_sites",
           "warn_unmixed"]

MANY_ROWS = 5
"""Rows per entry from which an effect is advised centred (its own data pin it)."""
FEW_ROWS = 2
"""Rows per entry up to which an effect is advised non-centred (its prior dominates)."""
_LOCATION_SCALE = ("Normal", "StudentT", "Cauchy", "Laplace", "Logistic")


def symmetric_sites(layout, mode: np.ndarray, cov: Optional[np.ndarray], tol: float = 1e-3) -> List[str]:
    """``"'mu' (entries 0 and 1 both -0.316)"``: the global sites of ``layout`` (flat unconstrained
    ``mode``) with two entries equal to within ``tol`` of their sd."""
    out, at = [], 0
    sd = np.sqrt(np.abs(np.diag(cov))) if cov is not None else np.ones_like(mode)
    for name, shape in zip(layout.names, layout.shapes):
        size = int(np.prod(shape))
        x, s = np.asarray(mode[at:at + size]), np.asarray(sd[at:at + size])
        at += size
        for i in range(size):
            j = next((j for j in range(i + 1, size) if abs(x[i] - x[j]) <= tol * max(s[i], s[j], 1e-12)), None)
            if j is not None:
                out.append(f"'{name}' (entries {i} and {j} both {x[i]:.3g})")
                break
    return out


def effect_sites(model, clients, kwargs: Mapping, structure) -> List[tuple]:
    """``(site, centred, rows per entry)`` of each effect of the model: a latent site with a
    location-scale prior (normal, Student t, ...) and more than one entry (a global vector, or a
    local site per group or row). ``centred``: its prior density moves with the global sites;
    rows per entry: the median rows of a group (``nf.group_plate``), 1 in the row plate, a client's
    rows outside plates, the rows over the entries for a global vector."""
    first = clients[clients.names[0]]
    base = trace(substitute(seed(model, 0), substitute_fn=finite_point)).get_trace(**dict(first), **dict(kwargs))
    names = [n for n, s in base.items() if s["type"] == "sample" and not s["is_observed"]
             and _kind(s["fn"]) in _LOCATION_SCALE and np.size(s["value"]) > 1]
    if not names:
        return []
    keep = {n: base[n]["value"] for n in names}
    moved = trace(substitute(seed(substitute(model, data=keep), 1), substitute_fn=finite_point)).get_trace(
        **dict(first), **dict(kwargs))
    total = sum(int(clients.num_rows[c]) for c in clients.names)
    out = []
    for name in names:
        site = base[name]
        centred = not np.allclose(np.asarray(site["fn"].log_prob(site["value"])),
                                  np.asarray(moved[name]["fn"].log_prob(keep[name])), rtol=1e-6, atol=1e-6)
        if centred or _standard(site["fn"]):  # (a fixed prior of another scale is no hierarchy's effect)
            out.append((name, centred, _rows_per_entry(site, structure, clients, total)))
    return out


def _kind(fn) -> str:
    return type(unwrapped(fn)).__name__


def _standard(fn) -> bool:
    """A location-scale prior at location 0 and scale 1: a non-centred effect's ``z``."""
    inner = unwrapped(fn)
    loc, scale = getattr(inner, "loc", None), getattr(inner, "scale", None)
    return (loc is not None and scale is not None and bool(np.all(np.asarray(loc) == 0))
            and bool(np.all(np.asarray(scale) == 1)))


def _rows_per_entry(site, structure, clients, total: int) -> float:
    plates = {f.name for f in site["cond_indep_stack"]}
    for plate, codes in structure.group_plates.items():
        if plate in plates:
            counts = [np.bincount(np.asarray(clients[c][codes]).astype(int)) for c in clients.names]
            return float(np.median(np.concatenate([k[k > 0] for k in counts])))
    if structure.row_plate in plates:
        return 1.0
    if site["name"] in structure.local_latent_names:
        return float(np.median([int(clients.num_rows[c]) for c in clients.names]))
    return total / float(np.size(site["value"]))


def advice(model, clients, kwargs: Mapping, structure, mode=None, cov=None, failed: Sequence[str] = ()) -> str:
    """The advice for a model the samplers could not sample (see the module docstring): the sites
    whose checks failed (``failed``), a symmetric point of the Laplace mode (``mode``, ``cov``: flat
    unconstrained), and each effect's parameterisation by its rows; ``""`` where nothing was found."""
    lines = []
    if failed:
        lines.append(f"the sites whose checks failed: {', '.join(failed)}")
    if mode is not None:
        symmetric = symmetric_sites(structure.global_latent, np.asarray(mode), cov)
        if symmetric:
            lines.append(f"the Laplace search stopped where entries of {', '.join(symmetric)} coincide: a symmetric "
                         f"point (a mixture's components made one), not a mode of the posterior; start the fit apart, "
                         f"nf.fit(..., init={{site: values with distinct entries}})")
    try:
        effects = effect_sites(model, clients, kwargs, structure)
    except Exception:  # noqa: BLE001  (a model that cannot be probed so: no parameterisation advice)
        effects = []
    for name, centred, rows in effects:
        if not centred and rows >= MANY_ROWS:
            lines.append(f"'{name}' is non-centred (its prior does not move with the global sites) and each of its "
                         f"entries has {rows:g} rows: its own data pin it, so centre it (sample the effect "
                         f"itself with the hierarchy's scale in its prior, b ~ Normal(0, tau), instead of tau * z)")
        elif centred and rows <= FEW_ROWS:
            lines.append(f"'{name}' is centred (its prior moves with the global sites) and each of its entries has "
                         f"{rows:g} row(s): its prior dominates, so non-centre it (z ~ Normal(0, 1) and "
                         f"tau * z in the likelihood)")
    return "; ".join(lines)


GENERIC_FIX = ("reparameterise the model (a hierarchy's effects centred where their groups have many rows, "
               "non-centred where few; a scale with a lighter-tailed prior)")
"""The advice where nothing was measured (a network run, whose rows the server does not hold)."""


def fix_text(measured: str) -> str:
    """What to change: the measured advice (:func:`advice`), else :data:`GENERIC_FIX`."""
    return f"change the model where it was measured ({measured})" if measured else GENERIC_FIX


_UNMIXED = (
    "nf.fit: the exact answer's {chains} chain(s) of federated NUTS have not mixed at {sites} (split R-hat above "
    "{r_hat} or bulk ESS under {ess}): their draws do not represent the posterior there. Run longer (num_warmup=, "
    "num_samples=), raise target_accept_prob= (e.g. 0.95) where NUTS diverged, or {fix}"
)


def warn_unmixed(sampler, result, measured: str = "") -> None:
    """Warn, naming the scalars, where ``nf.fit``'s exact answer's chains have a split R-hat above
    :data:`~numpyro_fed.check.chains.R_HAT_LIMIT` or a bulk ESS under
    :data:`~numpyro_fed.check.chains.MIN_ESS` (Metropolis-within-Gibbs warns of it itself), with the
    advice ``measured`` (:func:`advice`)."""

    unmixed = result.verdict.reports["chains"]["unmixed"]
    if unmixed:
        warnings.warn(_UNMIXED.format(chains=sampler.num_chains, sites=describe_unmixed(unmixed), r_hat=R_HAT_LIMIT,
                                      ess=MIN_ESS, fix=fix_text(measured)), MCMCDiagnosticWarning,
                      stacklevel=find_stack_level())

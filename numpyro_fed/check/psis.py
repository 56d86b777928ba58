"""The fit check every family shares: Pareto-smoothed importance sampling of ``q`` against
the posterior, and a moment check that sees bias, not only tails.

A family draws ``S`` values ``z ~ q`` (the server's draws of the global sites; local
latents integrated or drawn on their clients), each client computes its own term of
``log w = log p(z, y) - log q(z)`` per draw over its own rows, and the server sums them.
From ``log w`` and the server's own draws this module computes:

- **Pareto k** (Vehtari et al., 2024): above :data:`PARETO_K_LIMIT` importance sampling
  cannot correct ``q``: ``q`` misses mass the posterior has.
- **The moment check**: per global site, in user (constrained) space, ``q``'s mean and sd
  against the PSIS-weighted mean and sd of the same draws. k below the limit says
  importance sampling *can* correct ``q``; it does not say ``q`` is right. When ``q`` is
  too narrow or shifted, the weighted moments move away from ``q``'s; a mean more than
  :data:`MEAN_MARGIN` weighted sds away, or an sd off by more than :data:`SD_MARGIN` of the
  weighted sd (each widened to 3 Monte Carlo standard errors of the self-normalised weighted
  moments when those are larger: a heavy-tailed scale gets a wider margin), is reported as
  a biased site. The same comparison runs in unconstrained space (``log tau`` for a
  positive ``tau``), where ``q`` is Gaussian and the weighted moments are far better
  estimated: a heavy-tailed scale whose user-space margin the Monte Carlo error widens
  (a precision with a ``Gamma(0.001, 0.001)`` prior, q's sd 0.75x the weighted one) is
  still seen there, and reported as ``"tau (unconstrained)"``.
- **Corrected draws**: importance resampling of the check's draws by their smoothed
  weights (``sample_posterior(..., corrected=True)``), usable when k is below the limit.

What it cannot see: posterior mass that none of the ``S`` draws reaches (a mode ``q``
never visits, a tail far beyond ``q``'s); and local latents, which stay on their clients
(only the global sites' moments are compared).

Example:
    >>> import numpy as np

from ..labels import scalar_label
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(0.0, 0.8, 2000)          # q = N(0, 0.8^2), posterior N(0, 1)
    >>> log_w = -0.5 * z**2 + 0.5 * (z / 0.8) ** 2
    >>> check = fit_diagnostic(log_w, {"x": z})
    >>> [m.site for m in check.biased], check.pareto_k < PARETO_K_LIMIT
    (['x'], True)
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np

from ..model.labels import scalar_label

__all__ = ["FitDiagnostic", "MCSE_FACTOR", "MEAN_MARGIN", "PARETO_K_LIMIT", "SD_MARGIN", "SiteMoments", "answer_check",
           "fit_diagnostic", "within_tolerance",
           "importance_resample", "moment_report", "state_fingerprint"]

PARETO_K_LIMIT = 0.7
"""Pareto k above which importance sampling cannot correct ``q`` (Vehtari et al., 2024)."""

MEAN_MARGIN = 0.2
"""A site is biased when ``q``'s mean is more than this many weighted sds from the
weighted mean (the suite's tolerance for a wrong fit is 0.3 sd, so the check fires before
it while a fit within 0.15 sd, e.g. PVI on non-centred eight schools, passes)."""

SD_MARGIN = 0.15
"""A site is biased when ``q``'s sd is off by more than this fraction of the weighted sd
(the suite's tolerance is 20 %)."""

CURVATURE_MARGIN = 0.2
"""The shape test (:func:`curvature_report`) reports a site whose sd under ``q`` is off by more than
this fraction of the posterior's sd that the curvature of ``log w`` implies (a 0.7x sd is reported;
a fit within 15 % is not)."""

CURVATURE_FULL = 12  # dimensions up to which the shape test fits a full quadratic (else diagonal)

MCSE_FACTOR = 3.0
"""A check's margin never falls below this many Monte Carlo standard errors, and an accepted fit
keeps this many of them inside the tolerance (:func:`within_tolerance`)."""


class SiteMoments(NamedTuple):
    """One scalar of a global site, in user space: ``q``'s moments and the PSIS-weighted ones."""

    site: str
    q_mean: float
    q_sd: float
    weighted_mean: float
    weighted_sd: float
    se_mean: float = float("nan")  # Monte Carlo standard error of weighted_mean, in weighted sds
    se_log_sd: float = float("nan")  # Monte Carlo standard error of log(weighted_sd)

    @property
    def mean_gap(self) -> float:
        """``(q_mean - weighted_mean) / weighted_sd``."""
        return (self.q_mean - self.weighted_mean) / max(self.weighted_sd, 1e-300)

    @property
    def sd_ratio(self) -> float:
        """``q_sd / weighted_sd``."""
        return self.q_sd / max(self.weighted_sd, 1e-300)


#: log weights that all lie within this of each other (or within :data:`EXACT_RELATIVE` of their
#: magnitude, for large log densities) are equal weights: ``p / q`` varies by less than 0.1 % over
#: q's draws, i.e. by float round-off of ``log p`` (a float32 log density near -70 carries ~1e-5 of
#: it), so q is the posterior up to its constant. A generalised Pareto fit to such a tail is
#: undefined (ArviZ returns k = inf): k is reported as -inf and the verdict is ``ok``.
EXACT_SPREAD = 1e-3
EXACT_RELATIVE = 2e-6  # about 16 float32 units in the last place of the log weights


class FitDiagnostic(NamedTuple):
    """PSIS check of a fit: ``pareto_k``, ``ess`` (of the smoothed weights), ``elbo`` (mean
    ``log w``), the ``log_weights``, per-scalar ``moments`` of the global sites and the
    ``biased`` ones among them and among the ``unconstrained_moments`` of the sites whose
    support is not the real line (see :data:`MEAN_MARGIN`, :data:`SD_MARGIN`), and the
    check's unconstrained global ``draws`` (for corrected draws)."""

    pareto_k: float
    ess: float
    elbo: float
    log_weights: np.ndarray
    moments: Tuple[SiteMoments, ...] = ()
    biased: Tuple[SiteMoments, ...] = ()
    draws: Optional[np.ndarray] = None
    unconstrained_moments: Tuple[SiteMoments, ...] = ()

    def __repr__(self) -> str:
        """The verdict and its figures, not the log weights or draws."""
        off = ", ".join(m.site for m in self.biased[:5]) + (" ..." if len(self.biased) > 5 else "")
        return (f"FitDiagnostic(verdict={self.verdict!r}, pareto_k={self.pareto_k:.3g}, "
                f"ess={self.ess:.1f} of {len(self.log_weights)} draws, elbo={self.elbo:.4g}"
                + (f", biased=[{off}]" if off else "") + ")")

    @property
    def verdict(self) -> str:
        """``"ok"``, ``"biased"`` (k below the limit, moments off) or ``"unreliable"`` (k above it)."""
        if not self.pareto_k <= PARETO_K_LIMIT:
            return "unreliable"
        return "biased" if self.biased else "ok"


def smoothed_weights(log_w: np.ndarray) -> Tuple[np.ndarray, float]:
    """Normalised PSIS weights and Pareto k of ``log_w``."""
    import arviz as az

    log_w = np.asarray(log_w, np.float64)
    # q is the posterior up to its constant: equal weights (ArviZ would say k = inf)
    if np.ptp(log_w) <= max(EXACT_SPREAD, EXACT_RELATIVE * float(np.max(np.abs(log_w)))):
        return np.full(len(log_w), 1.0 / len(log_w)), float("-inf")
    smoothed, k = az.psislw(log_w)
    w = np.exp(smoothed - smoothed.max())
    return w / w.sum(), float(k)


def _flat_sites(draws: Dict[str, np.ndarray], num_draws: int):
    for name, value in draws.items():
        value = np.asarray(value, np.float64).reshape(num_draws, -1)
        for i in range(value.shape[1]):
            yield scalar_label(name, i, value.shape[1]), value[:, i]


def moment_report(draws: Dict[str, np.ndarray], weights: np.ndarray, ess: float):
    """Per-scalar :class:`SiteMoments` of ``draws`` (user space, ``(S, ...)`` each) under
    equal weights and under ``weights``, and the biased ones."""
    moments, biased = [], []
    for site, x in _flat_sites(draws, len(weights)):
        wm = float(np.sum(weights * x))
        r2 = (x - wm) ** 2
        var = float(np.sum(weights * r2))
        wsd = float(np.sqrt(var))
        if wsd <= 0:
            moments.append(SiteMoments(site, float(x.mean()), float(x.std()), wm, wsd))
            continue
        # Monte Carlo standard errors of the self-normalised estimates (Owen, 2013, eq. 9.8; the
        # delta method for the sd): heavy-tailed sites (a scale) get wider margins than 1/sqrt(ESS)
        se_mean = float(np.sqrt(np.sum(weights**2 * r2))) / wsd
        se_log_sd = float(np.sqrt(np.sum(weights**2 * (r2 - var) ** 2))) / (2.0 * var)
        m = SiteMoments(site, float(x.mean()), float(x.std()), wm, wsd, se_mean, se_log_sd)
        moments.append(m)
        mean_margin = max(MEAN_MARGIN, MCSE_FACTOR * se_mean)
        sd_margin = max(np.log1p(SD_MARGIN), MCSE_FACTOR * se_log_sd)
        if abs(m.mean_gap) > mean_margin or abs(np.log(m.sd_ratio)) > sd_margin:
            biased.append(m)
    return tuple(moments), tuple(biased)


def fit_diagnostic(log_w: np.ndarray, draws: Optional[Dict[str, np.ndarray]] = None,
                   unconstrained: Optional[np.ndarray] = None,
                   unconstrained_sites: Optional[Dict[str, np.ndarray]] = None,
                   shape: bool = False) -> FitDiagnostic:
    """The check from ``log w`` per draw and, optionally, the server's draws of the global
    sites in user space (``draws``, for the moment check), flat and unconstrained (kept
    for corrected draws) and unconstrained per site (``unconstrained_sites``, for the
    moment check in unconstrained space of the sites whose support is not the real line).
    ``shape``: also run the shape test (:func:`curvature_report`; needs ``unconstrained`` and
    ``unconstrained_sites``), reporting only sites the moment checks did not."""
    log_w = np.asarray(log_w, np.float64)
    if not np.all(np.isfinite(log_w)):
        return FitDiagnostic(float("inf"), 0.0, float("nan"), log_w)
    w, k = smoothed_weights(log_w)
    ess = float(1.0 / np.sum(w**2))
    moments, biased = moment_report(draws, w, ess) if draws else ((), ())
    u_moments = ()
    if draws and unconstrained_sites:
        transformed = {f"{k} (unconstrained)": np.asarray(v) for k, v in unconstrained_sites.items()
                       if k in draws and not _same(v, draws[k])}
        if transformed:
            u_moments, u_biased = moment_report(transformed, w, ess)
            biased = biased + u_biased
    keep = None if unconstrained is None else np.asarray(unconstrained)
    if shape and keep is not None and unconstrained_sites and draws:
        known = {m.site.split("[")[0].replace(" (unconstrained)", "") for m in biased}
        biased = biased + tuple(m for m in curvature_report(log_w, keep, unconstrained_sites)
                                if m.site.split("[")[0].replace(" (curvature)", "") not in known)
    return FitDiagnostic(k, ess, float(np.mean(log_w)), log_w, moments, biased, keep, u_moments)


def curvature_report(log_w: np.ndarray, u: np.ndarray, sites: Dict[str, np.ndarray]) -> Tuple[SiteMoments, ...]:
    """The shape test: the sites (unconstrained, ``"name (curvature)"``) whose sd under ``q`` is
    off by more than :data:`CURVATURE_MARGIN` from the posterior's, or whose mean is more than
    :data:`MEAN_MARGIN` posterior sds away, as a quadratic fit of ``log w`` over ``q``'s own draws
    sees them.

    With ``z`` the draws whitened by their own mean and covariance, ``log w(z) ~ a + b z +
    z^T C z / 2`` by least squares (full ``C`` up to :data:`CURVATURE_FULL` dimensions, else
    diagonal) gives the posterior's Gaussian shape where ``q`` has its draws: precision ``I - C``,
    mean ``(I - C)^-1 b``. Unlike importance-weighted moments it does not need the weights' tail:
    a ``q`` too narrow by 0.7x has Pareto k about 0.5 (importance sampling still "works") while
    the weighted sd, estimated from draws that never reach the posterior's tail, stays near
    ``q``'s; the curvature of ``log w`` across ``q``'s draws shows it at once. A direction where
    ``I - C`` is not positive definite (the posterior wider than any Gaussian ``q``'s draws can
    see) reports every site along it."""
    u = np.asarray(u, np.float64)
    log_w = np.asarray(log_w, np.float64)
    num, d = u.shape
    names = []
    for name, value in sites.items():
        names += [name] * int(np.prod(np.shape(value)[1:], dtype=int))
    if len(names) != d or num < 4 * d + 10 or not np.all(np.isfinite(log_w)):
        return ()
    mean = u.mean(0)
    cov = np.atleast_2d(np.cov(u, rowvar=False))
    try:
        chol = np.linalg.cholesky(cov)
    except np.linalg.LinAlgError:
        return ()
    z = np.linalg.solve(chol, (u - mean).T).T
    full = d <= CURVATURE_FULL
    pairs = [(i, j) for i in range(d) for j in range(i, d)] if full else [(i, i) for i in range(d)]
    quad = np.stack([z[:, i] * z[:, j] * (0.5 if i == j else 1.0) for i, j in pairs], 1)
    design = np.concatenate([np.ones((num, 1)), z, quad], 1)
    if design.shape[1] * 3 > num:
        return ()
    coef, *_ = np.linalg.lstsq(design, log_w - log_w.mean(), rcond=None)
    b, c = coef[1:d + 1], np.zeros((d, d))
    for (i, j), value in zip(pairs, coef[d + 1:]):
        c[i, j] = c[j, i] = value
    precision = np.eye(d) - c
    lam, vec = np.linalg.eigh(precision)
    out = []
    if lam.min() <= 1e-6:  # flatter than any Gaussian along vec[:, k]: q far too narrow there
        loading = np.abs(chol @ vec[:, lam <= 1e-6]).max(1)
        for i in np.flatnonzero(loading >= 0.3 * loading.max()):
            out.append(SiteMoments(f"{_scalar(names, i)} (curvature)", float(mean[i]), float(np.sqrt(cov[i, i])),
                                   float("nan"), float("inf")))
        return _unique(out)
    post_cov = chol @ (vec / lam) @ vec.T @ chol.T
    post_mean = mean + chol @ (vec @ ((vec.T @ b) / lam))
    for i in range(d):
        q_sd, p_sd = float(np.sqrt(cov[i, i])), float(np.sqrt(post_cov[i, i]))
        if abs(np.log(q_sd / p_sd)) > np.log1p(CURVATURE_MARGIN) or abs(mean[i] - post_mean[i]) > MEAN_MARGIN * p_sd:
            out.append(SiteMoments(f"{_scalar(names, i)} (curvature)", float(mean[i]), q_sd, float(post_mean[i]),
                                   p_sd))
    return _unique(out)


def _scalar(names, i) -> str:
    first = names.index(names[i])
    count = names.count(names[i])
    return names[i] if count == 1 else f"{names[i]}[{i - first}]"


def _unique(moments):
    seen, out = set(), []
    for m in moments:
        if m.site not in seen:
            seen.add(m.site)
            out.append(m)
    return tuple(out)


def _same(a, b) -> bool:
    """Are a site's unconstrained draws its user-space draws (a real-line site)? A simplex or
    a correlation matrix has fewer unconstrained coordinates than user-space ones."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.allclose(a, b)


def state_fingerprint(server_state) -> str:
    """A digest of a server state's arrays: which fit a check belongs to (corrected draws must
    come from the check of the state they are asked for, not from the last run's)."""
    import hashlib

    import jax

    digest = hashlib.sha1()
    for leaf in jax.tree_util.tree_leaves(server_state):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


_NOT_CORRECTABLE = (
    "{cls}: corrected draws resample the fit check's draws by their importance weights, which needs a fit "
    "check with Pareto k <= {limit}; {why}. Use uncorrected draws (corrected=False), or improve the fit"
)


def importance_resample(rng_key, check: Optional[FitDiagnostic], num_samples: int, cls: str):
    """Unconstrained global draws resampled (with replacement) from ``check``'s draws by
    their smoothed weights, or a ValueError saying why they cannot be trusted."""
    import jax

    if check is None or check.draws is None:
        raise ValueError(_NOT_CORRECTABLE.format(cls=cls, limit=PARETO_K_LIMIT,
                                                 why="there is none (run with check_fit=True)"))
    if not check.pareto_k <= PARETO_K_LIMIT:
        raise ValueError(_NOT_CORRECTABLE.format(cls=cls, limit=PARETO_K_LIMIT,
                                                 why=f"the last check has k = {check.pareto_k:.2f}"))
    w, _ = smoothed_weights(check.log_weights)
    idx = jax.random.choice(rng_key, len(w), (int(num_samples),), p=jax.numpy.asarray(w))
    return jax.numpy.asarray(check.draws)[idx]


def describe_biased(biased: Tuple[SiteMoments, ...], limit: int = 6) -> str:
    """``"tau (q mean 3.1 sd 1.2; weighted 3.6 sd 2.2), ..."`` for a warning."""
    parts = [f"{m.site} (q mean {m.q_mean:.3g} sd {m.q_sd:.3g}; weighted mean {m.weighted_mean:.3g} "
             f"sd {m.weighted_sd:.3g})" for m in biased[:limit]]
    more = len(biased) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def within_tolerance(mean: float, sd: float, reference: SiteMoments) -> bool:
    """Whether ``(mean, sd)`` is within the promised tolerance of the weighted moments of
    ``reference`` (mean within :data:`MEAN_MARGIN` weighted sds, sd within :data:`SD_MARGIN`) with
    :data:`MCSE_FACTOR` Monte Carlo standard errors of that estimate to spare: so an accepted
    fit never sits on the tolerance it is promised to meet."""
    if not reference.weighted_sd > 0:
        return True
    se_m, se_s = float(np.nan_to_num(reference.se_mean)), float(np.nan_to_num(reference.se_log_sd))
    gap = abs(mean - reference.weighted_mean) / reference.weighted_sd + MCSE_FACTOR * se_m
    ratio = abs(np.log(max(sd, 1e-300) / reference.weighted_sd)) + MCSE_FACTOR * se_s
    return bool(gap <= MEAN_MARGIN and ratio <= np.log1p(SD_MARGIN))


def answer_check(check: FitDiagnostic) -> FitDiagnostic:
    """The check of importance-corrected draws resampled from ``check``'s: their moments are the
    weighted ones (so none is off), with ``check``'s Pareto k and ESS."""
    moments = tuple(m._replace(q_mean=m.weighted_mean, q_sd=m.weighted_sd) for m in check.moments)
    unconstrained = tuple(m._replace(q_mean=m.weighted_mean, q_sd=m.weighted_sd) for m in check.unconstrained_moments)
    return check._replace(moments=moments, biased=(), unconstrained_moments=unconstrained)

"""Any prior under PVI and EP: the prior's Gaussian part exact, the rest one more factor held
by the server.

PVI and EP keep ``q`` in one Gaussian family over the unconstrained global sites. A prior that
is Gaussian there (Normal; LogNormal on a positive site) is one exact factor of ``q``. Any other
proper prior (HalfNormal, HalfCauchy, Exponential, Gamma, StudentT, Beta, ...) is split as

``p(u) = p0(u) * exp(r(u))``,

with ``p0`` the Laplace approximation of the prior at its mode (the exact part of ``q``, and
where ``q`` starts) and the residual ``r = log p - log p0`` one more site of the product, held by
the server: ``q = p0 * t_0 * prod_j t_j``. After the clients' updates of a round the server
refines ``t_0`` by the tilted-moment step a client uses (EP's standard treatment of a
non-Gaussian prior; Vehtari et al. 2020, §4): cavity ``q / t_0``, tilted
``exp(r) * q / t_0 = p * prod_j t_j * p0 / p0``, its moments by Laplace refined by importance
sampling from the Laplace Gaussian (1000 draws; Laplace alone when the weights' Pareto k is
above 0.7), and ``t_0 <- t_0 * (q_new / q)^delta`` under the round's damping with the same
positive-definiteness safeguard as the clients' updates. The site uses no data and no client
value: it costs no message and, under DP, no privacy.

A prior with no mode in unconstrained space (a flat direction) is refused naming those sites.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from . import gaussian as G
from .gaussian import NaturalGaussian
from .tilted import PARETO_K_LIMIT, backtrack, laplace_moments, moments_to_factor, newton_direction, pareto_k

__all__ = ["PriorSplit", "check_prior_is_data_free", "check_prior_is_proper", "prior_site_step", "prior_site_update",
           "split_prior"]

_MODE_STEPS = 100
_NO_MODE = (
    "{cls}: the prior of the global site(s) {sites} has no mode in unconstrained space (Newton's method with "
    "backtracking did not reach one in {steps} steps, or the curvature there is not negative: a flat or "
    "unbounded prior density), so it has no Gaussian part to start q from; give {them} a prior with a mode in "
    "unconstrained space, or use nf.fit, which needs a proper posterior, not a proper prior"
)


class PriorSplit(NamedTuple):
    """``base``: the prior's Gaussian part (exact in ``q``; the prior itself when it is
    Gaussian); ``residual``: ``u -> log p(u) - log base(u)`` for the server's site, or
    ``None`` when the prior is Gaussian."""

    base: NaturalGaussian
    residual: Optional[Callable]


def _site_names(layout, mask: np.ndarray) -> str:
    sizes = [int(np.prod(s)) for s in layout.shapes]
    owners = np.repeat(np.arange(len(sizes)), sizes)
    return ", ".join(layout.names[i] for i in sorted(set(owners[mask].tolist())))


def split_prior(log_prior: Callable, d: int, layout, cls: str, start=None) -> PriorSplit:
    """The prior's Gaussian part and its residual (see the module docstring); the mode search
    starts at ``start`` (default 0; the prior's median where the caller has it)."""
    start = jnp.zeros(d) if start is None else jnp.asarray(start)

    @jax.jit
    def mode_and_curvature():
        def step(u, _):
            # saddle-free Newton with backtracking on the log prior: a full step wherever the prior is
            # locally quadratic (a Normal(250, 100) location is reached in one), never uphill
            g, h = jax.grad(log_prior)(u), jax.hessian(log_prior)(u)
            return backtrack(lambda x: -log_prior(x), u, -newton_direction(-(h + h.T) / 2, g)), None

        u, _ = jax.lax.scan(step, start, None, length=_MODE_STEPS)
        g, h = jax.grad(log_prior)(u), jax.hessian(log_prior)(u)
        return u, g, -(h + h.T) / 2

    u, g, precision = (np.asarray(x, np.float64) for x in mode_and_curvature())
    eig = np.linalg.eigvalsh(precision) if np.all(np.isfinite(precision)) else np.array([-1.0])
    scale = np.sqrt(np.maximum(np.diag(precision), 1e-300))
    bad = ~np.isfinite(u) | (np.abs(g) / scale > 1e-2) | (np.diag(precision) <= 0)
    if bad.any() or eig.min() <= 1e-12 * max(1.0, eig.max()):
        mask = bad if bad.any() else np.ones(d, bool)
        names = _site_names(layout, mask)
        raise ValueError(_NO_MODE.format(cls=cls, sites=names, steps=_MODE_STEPS,
                                         them="it" if "," not in names else "them"))
    dtype = jax.dtypes.canonicalize_dtype(jnp.float64)  # float32 unless the user enabled x64
    base = NaturalGaussian(jnp.asarray(precision @ u, dtype), jnp.asarray(precision, dtype))

    def residual(x):
        return log_prior(x) - (base.shift @ x - 0.5 * x @ base.precision @ x)

    return PriorSplit(base, residual)


def prior_site_update(residual: Callable, d: int, diagonal: bool, num_draws: int = 1000) -> Callable:
    """``(rng_key, cavity, q) -> (q_new, ok)``: the server's tilted-moment step for the prior
    site (``exp(residual) * cavity``), jit-compatible."""

    def update(rng_key, cavity: NaturalGaussian, q: NaturalGaussian) -> Tuple[NaturalGaussian, jax.Array]:
        start, _ = G.to_moments(q)
        k_laplace, k_is = random.split(rng_key)
        mode, cov, check = laplace_moments(residual, cavity, start, d, k_laplace, importance=False)
        reached = jnp.all(jnp.isfinite(mode))
        mode = jnp.where(reached, mode, start)
        cov = jnp.where(reached, cov, jnp.eye(d))
        chol = jnp.linalg.cholesky(cov)
        eps = random.normal(k_is, (num_draws, d))
        u = mode + eps @ chol.T
        cav = jax.vmap(lambda x: cavity.shift @ x - 0.5 * (jnp.sum(cavity.precision * x**2) if cavity.diagonal
                                                            else x @ cavity.precision @ x))(u)
        log_w = jax.vmap(residual)(u) + cav + 0.5 * jnp.sum(eps**2, 1)
        k = pareto_k(log_w)
        w = jax.nn.softmax(log_w)
        mean_is = w @ u
        centred = u - mean_is
        cov_is = (centred * w[:, None]).T @ centred
        use_is = k <= PARETO_K_LIMIT
        mean = jnp.where(use_is, mean_is, mode)
        cov = jnp.where(use_is, (cov_is + cov_is.T) / 2, cov)
        ok = reached & jnp.all(jnp.isfinite(mean)) & jnp.all(jnp.linalg.eigvalsh(cov) > 0)
        del check
        return moments_to_factor(mean, cov, diagonal), ok

    return update


_PRIOR_DEPENDS_ON_DATA = (
    "the prior of the global site(s) {sites} differs between client '{a}' and client '{b}' "
    "(log density {va:.6g} vs {vb:.6g} at the same point): a global prior must not depend on a "
    "client's data. Pass shared constants as model_kwargs="
)


_IMPROPER = (
    "{cls}: the prior of the global site(s) {sites} is flat (improper: zero prior precision in "
    "unconstrained space). {cls} starts q at the prior, and an improper q has no cavity or local "
    "ELBO, so the first round cannot be formed. Give those sites a proper Gaussian prior (e.g. "
    "dist.Normal(0, 10) for a location, dist.LogNormal(0, 2) for a scale), or use nf.fit (a Laplace "
    "approximation, checked, else federated NUTS), which needs a proper posterior, not a proper prior"
)


def prior_site_step(terms, diagonal: bool) -> Optional[Callable]:
    """The server's step for the residual of a non-Gaussian prior of ``terms``
    (:class:`~numpyro_fed.terms.model.ModelTerms`; :func:`prior_site_update`), ``None`` for a
    Gaussian prior."""
    if terms.residual is None:
        return None
    return prior_site_update(terms.residual, terms.prior.shift.shape[0], diagonal)


def check_prior_is_proper(prior, layout, cls) -> None:
    """Refuse a prior with a flat direction (``dist.ImproperUniform``), naming the sites."""
    diag = np.asarray(jnp.diag(prior.precision) if prior.precision.ndim == 2 else prior.precision)
    flat = diag <= 1e-12 * max(1.0, float(np.max(np.abs(diag), initial=0.0)))
    if not flat.any():
        return
    sizes = [int(np.prod(s)) for s in layout.shapes]
    owners = np.repeat(np.arange(len(sizes)), sizes)
    names = [layout.names[i] for i in sorted(set(owners[flat].tolist()))]
    raise ValueError(_IMPROPER.format(cls=cls, sites=", ".join(names)))


def check_prior_is_data_free(first, last, d, names, sites) -> None:
    if len(names) < 2:
        return
    u = 0.3 * random.normal(random.PRNGKey(7), (d,))
    try:  # one compiled program each, not one per operation of the model's prior
        va, vb = float(jax.jit(first)(u)), float(jax.jit(last)(u))
    except Exception:  # noqa: BLE001  a prior that reads a concrete value: evaluated as it runs (raising there)
        va, vb = float(first(u)), float(last(u))
    if not np.isclose(va, vb, rtol=1e-5, atol=1e-6):
        raise ValueError(_PRIOR_DEPENDS_ON_DATA.format(sites=list(sites), a=names[0], b=names[-1], va=va, vb=vb))

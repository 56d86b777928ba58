"""``DPLaplace``: a differentially private Laplace approximation of the global sites, by noised
Newton steps on clipped per-row terms.

Each round the server sends the point ``u`` (flat, unconstrained global sites). Every client
computes, on each of its rows ``i``, the row's term ``l_i(u)`` and its gradient ``g_i`` and Hessian
``h_i`` in ``u``; it clips the vector ``z_i = (g_i, upper triangle of h_i)`` to L2 norm ``C`` and
releases ``sum_i clip_C(z_i) + sigma xi`` (``xi`` standard normal from its own key): a Gaussian
mechanism of sensitivity ``2C`` under the substitution of one row, noise multiplier ``sigma / C``.
The server adds the prior's gradient and Hessian and takes a saddle-free Newton step (the
Hessian's eigenvalues by their absolute values, at least the prior's least curvature; the step at
most :data:`TRUST` long, the limit halved after a step the new gradient says overshot). After the
last round the approximation is ``N(u, (-H)^-1)``.

The noise does not grow with the rows while the sums do: with ``n`` rows a Newton step's error is
about ``sigma / n`` of the per-row information, so many rows per client make the start accurate at
a small epsilon (unlike update perturbation of the whole client's change, whose signal is the
clip itself).

**Local latents that belong to rows** (a patient's random effect): the row's term is its Laplace
marginal ``l_i(u) = log p(y_i, v_i* | u) - 1/2 log det(-H_vv,i)`` with ``v_i*`` the row's own mode,
found on the client by Newton steps on the row's block (warm-started from the last round; never
sent). Its derivatives in ``u`` go through one Newton step from ``v_i*``, which at the mode has the
implicit derivative ``-H_vv^-1 H_vu``. A row's term depends only on that row's data and the public
``u``, so clipping it bounds the row's share of the release.

Clipping changes the terms it binds on: each client counts the rows whose ``z_i`` was clipped
(never sent); the check reports them.

**The answer carries the noise** (a noise-aware approximation, in the spirit of Bernstein and
Sheldon 2018, "Differentially Private Bayesian Inference for Exponential Families", NeurIPS): the
server knows the noise each release carries, and the mean it returns is the last Newton step
from noised sums, ``u + P^-1 g`` with ``g`` and ``P`` each off by the noise of ``J`` releases
(variance ``J sigma^2`` per entry). To first order the step's error is
``P^-1 (xi_g - Xi_H v)`` (``v`` the step, ``xi_g`` and ``Xi_H`` the gradient's and the Hessian's
noise), of covariance :func:`noise_covariance`; the earlier steps' errors contract under the
later steps. The returned covariance is ``P^-1`` plus that, so the draws carry the privacy
noise as uncertainty. The account is first order: where the noise in the released curvature is
comparable to the curvature itself (:meth:`DPLaplace.curvature_noise`, a high-probability bound on
the noise's spectral norm over the curvature's least eigenvalue, above 0.5) the Newton steps are
driven by the noise and the interval may not cover; the check then warns, naming the remedies;
:meth:`DPLaplace.noise_sds` says, per global scalar, how many posterior sds the noise adds to its
mean.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from .._validation import check_positive_int
from ..check import Verdict, register_check
from ..model.groups import size_group_plates
from ..model.labels import scalar_label
from ..model.trace import prior_median
from ..run.backends.mapping import client_data
from ..run.inference import FederatedInference, Setup, fitted
from ..run.params import GaussianParams
from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm, RunResult, all_clients
from ..run.secure import check_aggregation
from ..terms.model import TermsSetup, global_values
from ..warnings import UncheckedFitWarning, UnreliableFitWarning, find_stack_level
from .control import ControlVariate, row_derivatives, upper_triangle
from .releases import capped_releases
from .rows import row_locals, row_terms, unit_locals, unit_mask
from .sampler_privacy import SamplerPrivacy, may_drop

__all__ = ["DPLaplace", "dp_laplace", "dp_laplace_check"]

TRUST = 2.0
"""A Newton step moves ``u`` by at most this far (Euclidean, unconstrained space)."""
INNER_STEPS = 20
"""Newton steps on each row's local latents per round (warm-started from the last round's mode)."""

_LOCALS = (
    "DPLaplace clips each row's term, and local site(s) {names} are not in the row plate: a latent shared by "
    "several rows makes their terms one term, which no per-row clip bounds. Local latents that belong to rows "
    "(inside the row plate) are supported"
)
_NO_DP = (
    "DPLaplace protects the rows of the model's observed sites, and the model marks none: wrap it in "
    "nf.dp_noise(model, clip=..., delta=..., epsilon=... or noise_multiplier=...). clip bounds each row's "
    "(gradient, Hessian) vector"
)
_UNEVEN = ("DPLaplace: the rows hold different numbers of local entries ({counts}); every row's local latents must "
           "have the same shape")
_UNCHECKED = (
    "DPLaplace: the private Laplace approximation is not checked against the posterior (the check's terms would "
    "cost privacy), and no row's term was clipped. Where the posterior is far from Gaussian in the global sites it "
    "can be off without a sign: check the same model on non-private or synthetic data of the same shape"
)
_CLIPPED = (
    "DPLaplace: client(s) {clients} clipped {rows} {unit} term(s) in the last round (|(gradient, Hessian)| > clip = "
    "{clip:g}): the approximation is then of the clipped terms, shrunk towards the prior. Raise that clip (more noise "
    "for the same epsilon): dp_noise(clip=...) of the model, or under nf.fit(dp=...) the private start's own "
    "nf.dp.PrivateFit(start_clip=...)"
)


CURVATURE_NOISE = 0.5
"""Above this :meth:`DPLaplace.curvature_noise` the check warns that the noise drives the steps."""
_SWAMPED = (
    "DPLaplace: the privacy noise in the released curvature is about {ratio:.2g} times the curvature's least "
    "eigenvalue, so the Newton steps were driven by the noise and the answer's covariance, which carries the noise "
    "to first order only, may not cover the posterior. More epsilon, fewer Newton rounds "
    "(nf.dp.PrivateFit(start_rounds=...)), a smaller clip, or more rows (groups) per client"
)


class DPLaplaceConfig(NamedTuple):
    num_steps: int
    clip: float
    sigma: float  # each client's noise sd (the whole noise, summed securely or not)
    secure: Optional[str] = None


class DPLaplaceServer(NamedTuple):
    u: jax.Array
    precision: jax.Array  # (d, d) -(H) made positive definite, at the last point evaluated
    step: jax.Array
    radius: jax.Array  # the trust region's radius: halved when a step overshot, regrown when not
    last: jax.Array  # (d,) the last step taken
    anchor: jax.Array  # (d,) the point of the last step's releases (public)
    released: jax.Array  # their sum over the clients, noise included: (gradient, Hessian upper triangle)


class DPLaplaceClient(NamedTuple):
    releases: jax.Array
    clipped: jax.Array  # rows clipped in the last round (never sent)
    v: jax.Array = None  # its rows' local modes (never sent)


def noise_covariance(precision, step, noise_var):
    """The covariance, to first order, of the error a last Newton step ``P^-1 g`` takes from
    noise of variance ``noise_var`` on every entry of ``g`` and of the upper triangle of ``H``
    (``v = step``): ``P^-1 noise_var ((1 + |v|^2) I + v v^T) P^-1`` (each row of ``Xi_H v`` sums
    ``|v|^2`` of the entries' variance; two rows share one entry)."""
    d = precision.shape[0]
    inv = jnp.linalg.inv(precision)
    inner = noise_var * ((1.0 + step @ step) * jnp.eye(d, dtype=precision.dtype) + jnp.outer(step, step))
    cov = inv @ inner @ inv
    return (cov + cov.T) / 2


def curvature_floor(log_prior: Callable, start):
    """The smallest curvature a step trusts: the prior's least at the start, in ``[1e-4, 1]``."""
    floor = jnp.minimum(jnp.min(jnp.abs(jnp.linalg.eigvalsh(-jax.hessian(log_prior)(start)))), 1.0)
    return jnp.maximum(floor, 1e-4)


def noise_bound(num_clients: int, sigma: float, d: int) -> float:
    """A high-probability bound on the spectral norm of the noise in the summed Hessian (``d x d``,
    each entry of sd ``sqrt(J) sigma``): ``sqrt(J) sigma (2 sqrt(d) + 2)`` (a symmetric Gaussian
    matrix's norm concentrates at ``2 sqrt(d)`` entry sds)."""
    return float(np.sqrt(num_clients) * sigma * (2.0 * np.sqrt(d) + 2.0))


def _row_blocks(f_sum: Callable, v, index, k: int):
    """The rows' ``k x k`` Hessian blocks of ``f_sum`` in ``v`` (block diagonal by rows): ``k``
    Hessian-vector products with one slot of every row set."""
    cols = []
    for s in range(k):
        e = jnp.zeros_like(v).at[index[:, s]].set(1.0)
        hv = jax.jvp(jax.grad(f_sum), (v,), (e,))[1]
        cols.append(hv[index])  # (rows, k): column s of every block
    return jnp.stack(cols, axis=-1)


def _row_newton(row_joint, u, v, data, index, k: int, mask):
    """One Newton step on every row's local block (each row's step at most 1 in norm)."""
    f_sum = lambda x: jnp.sum(row_joint(u, x, data))  # noqa: E731
    g = jax.grad(f_sum)(v)[index]  # (rows, k)
    h = _row_blocks(f_sum, v, index, k)
    h = jnp.where(mask[:, None, None] > 0, h, -jnp.eye(k, dtype=v.dtype))
    step = jnp.linalg.solve(h, g[..., None])[..., 0]
    norm = jnp.linalg.norm(step, axis=-1, keepdims=True)
    step = jnp.where(norm > 1.0, step / norm, step) * (mask[:, None] > 0)
    return v.at[index].add(-step), h


def _terms(row_term: Callable, locals_index, u, v, data, mask):
    """``(rows,)`` each row's (or group's) term at ``u`` (its local modes ``v`` held fixed): its
    log-likelihood, or with local latents its Laplace marginal."""
    if locals_index is None:
        return row_term(u, data)
    index = jnp.asarray(locals_index)
    k = index.shape[1]
    v1, _ = _row_newton(row_term, u, v, data, index, k, mask)  # at the mode: the implicit derivative
    # the curvature at (u, v1(u)): its log-determinant moves with the mode as well
    h = _row_blocks(lambda x: jnp.sum(row_term(u, x, data)), v1, index, k)
    h = jnp.where(mask[:, None, None] > 0, h, -jnp.eye(k, dtype=h.dtype))
    _, logdet = jnp.linalg.slogdet(-h)
    return jnp.where(mask > 0, row_term(u, v1, data) - 0.5 * logdet, 0.0)


def _client_step(rng_key, state: DPLaplaceClient, broadcast: Broadcast, data, *, row_term: Callable,
                 config: DPLaplaceConfig, locals_index, mask_of: Callable):
    """The client's release: its rows' (or groups') clipped ``(gradient, Hessian)`` vectors summed,
    noised from its key."""
    u = broadcast.shared["u"]
    v, mask = state.v, mask_of(data)
    if locals_index is not None:
        index = jnp.asarray(locals_index)

        def inner(x, _):
            return jax.lax.stop_gradient(_row_newton(row_term, u, x, data, index, index.shape[1], mask)[0]), None

        v, _ = jax.lax.scan(inner, v, None, length=INNER_STEPS)
    terms = partial(_terms, row_term, locals_index, v=v, data=data, mask=mask)
    g, h, clipped, _ = row_derivatives(terms, u, mask, config.clip)
    rows_u, cols_u = upper_triangle(u.shape[0])
    z = jnp.concatenate([g, h[:, rows_u, cols_u]], axis=1)
    released = jnp.sum(z, 0) + config.sigma * random.normal(rng_key, z.shape[1:], u.dtype)
    new = DPLaplaceClient(state.releases + 1, jnp.sum(clipped & (mask > 0)).astype(jnp.int32), v)
    return new, {"z": released}


def dp_laplace(log_prior: Callable, row_term: Callable, num_clients: int, start, *, config: DPLaplaceConfig,
               locals_index=None, mask_of: Optional[Callable] = None) -> FederatedAlgorithm:
    """Build the pure functions (see the module docstring).

    Args:
        log_prior: ``u -> log p(u)`` (Jacobians included), evaluated by the server.
        row_term: ``(u, data) -> (rows,)`` each row's log-likelihood; with ``locals_index``
            ``(u, v, data) -> (rows,)`` each row's joint term with its local latents ``v``.
        num_clients: J.
        start: ``(d,)`` the first point (public).
        config: :class:`DPLaplaceConfig`.
        locals_index: ``(rows, k)`` the entries of ``v`` of each row (``None``: no local latents).
        mask_of: ``data -> (rows,)`` 1 on a client's real terms (default: its ``row_mask``); with
            a group as the protected unit (``dp_noise(unit=)``), ``row_term`` and ``locals_index``
            are per group and this marks the client's real groups.
    """
    mask_of = mask_of or (lambda data: data.row_mask)
    start = jnp.asarray(start)
    d, dtype = start.shape[0], start.dtype
    rows_u, cols_u = upper_triangle(d)
    # the smallest curvature a step trusts: the prior's least, at the start (at most 1)
    prior_floor = curvature_floor(log_prior, start)

    client_step = partial(_client_step, row_term=row_term, config=config, locals_index=locals_index,
                          mask_of=mask_of)

    def init_server(rng_key):
        del rng_key
        eye = jnp.eye(d, dtype=dtype)
        s = DPLaplaceServer(start, eye, jnp.zeros((), jnp.int32), jnp.asarray(TRUST, dtype), jnp.zeros(d, dtype),
                            start, jnp.zeros(d + d * (d + 1) // 2, dtype))
        return s, Broadcast({"u": start})

    def init_client(rng_key, data):
        del rng_key
        zero = jnp.zeros((), jnp.int32)
        if locals_index is None:
            return DPLaplaceClient(zero, zero)
        n = int(np.max(np.asarray(locals_index))) + 1
        return DPLaplaceClient(zero, zero, jnp.zeros(n, dtype))

    def server_step(rng_key, state: DPLaplaceServer, messages, view):
        del rng_key
        z = messages["z"] if config.secure else jnp.sum(messages["z"], axis=0)
        complete = jnp.all(view.answered)
        u = state.u
        g = z[:d] + jax.grad(log_prior)(u)
        upper = jnp.zeros((d, d), dtype).at[rows_u, cols_u].set(z[d:])
        h = upper + jnp.triu(upper, 1).T + jax.hessian(log_prior)(u)
        w, vec = jnp.linalg.eigh(-(h + h.T) / 2)
        # saddle-free Newton (Dauphin et al. 2014): |curvature|, so a direction where the noised or
        # far-from-the-mode Hessian is not concave still goes uphill; floored at the prior's
        w = jnp.maximum(jnp.abs(w), prior_floor)
        step = vec @ ((vec.T @ g) / w)
        # the gradient here against the last step (public, released sums only): negative, it overshot
        radius = jnp.where(g @ state.last < 0, state.radius / 2, jnp.minimum(state.radius * 1.5, TRUST))
        size = jnp.linalg.norm(step)  # in the unconstrained space
        step = jnp.where(size > radius, step * radius / size, step)
        ok = complete & jnp.all(jnp.isfinite(step))
        new = DPLaplaceServer(jnp.where(ok, u + step, u), jnp.where(ok, (vec * w) @ vec.T, state.precision),
                              state.step + ok.astype(jnp.int32), jnp.where(ok, radius, state.radius),
                              jnp.where(ok, step, state.last), jnp.where(ok, u, state.anchor),
                              jnp.where(ok, z, state.released))
        return new, Broadcast({"u": new.u}), {"moved": size, "complete": complete}

    return FederatedAlgorithm(
        init_server, init_client, all_clients(num_clients), (Exchange(
            client_step, server_step, "dp_laplace", ("z",) if config.secure else (), config.secure or "trusted"),),
        monitor=lambda info: info["moved"], monitor_name="step (sds)", name="dp_laplace",
        done=lambda s: s.step >= config.num_steps,
        describe=lambda s: f"Newton step {int(s.step)} of {config.num_steps}",
    )


class DPLaplace(FederatedInference):
    """A differentially private Laplace approximation of the global sites: ``num_steps`` Newton
    rounds on each client's clipped, noised sums of its rows' gradients and Hessians (see
    :mod:`numpyro_fed.dp.dp_laplace`). :func:`numpyro_fed.fit` uses it as the private start of
    ``dp=``.

    Privacy: the model's ``dp_noise``: ``clip`` bounds each row's ``(gradient, Hessian upper
    triangle)`` vector in L2 norm; ``epsilon`` (calibrated with ``dp-accounting`` for ``num_steps``
    releases per client, substitution of one row) or ``noise_multiplier``. With
    ``secure_aggregation`` the server sees only the sum; each client still adds the whole noise, so
    the guarantee holds against a server that deviates from the masking protocol. Local latents
    that belong to rows stay on their client (their modes found there).

    Args:
        model: a ``dp_noise``-marked NumPyro model (observed sites, and local latent sites if any,
            in the row plate).
        num_steps: Newton rounds (one release per client each).
        init: the first point, flat unconstrained (default: the prior's median; public).
        row_plate: the plate that indexes rows (default: the one plate of the row count that every
            marked site is in).
        model_kwargs: keyword arguments of every model call.
        secure_aggregation: ``None``, ``"trusted"`` or ``"masking"`` (:mod:`numpyro_fed.run.secure`).
    """

    method = "dp_laplace"
    setup_extra = TermsSetup
    _size_group_plates = size_group_plates
    params_type = GaussianParams
    family_run_options = ("ledger",)

    def __init__(self, model: Callable, *, num_steps: int = 8, init: Optional[Any] = None,
                 row_plate: Optional[str] = None,
                 model_kwargs: Optional[dict] = None, secure_aggregation: Optional[str] = None) -> None:
        super().__init__()
        self.model, self.row_plate = model, row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self.num_steps = check_positive_int("num_steps", num_steps)
        self.init = init
        self.secure_aggregation = check_aggregation(secure_aggregation, "DPLaplace")
        self.num_chains = 1
        self.privacy = None
        self.local_rows = False  # whether a row's term is a Laplace marginal of its local latents (set at build)
        self.privacy_label = "DPLaplace (clipped per-row gradients and Hessians, Newton steps)"
        self.dp_plan = SamplerPrivacy(self)

    @property
    def releases_per_client(self) -> int:
        return self.num_steps

    def _rounds(self, num_rounds: Optional[int], options: dict) -> int:
        if num_rounds is None:  # a round a client misses is repeated, where one may
            return 20 * self.num_steps if may_drop(options) else self.num_steps
        return num_rounds

    def _build(self, clients) -> Setup:
        terms = row_terms("DPLaplace", self.model, self.model_kwargs, clients, self.row_plate, self.num_steps, _NO_DP,
                          _LOCALS)
        spec, nm, setup, local, row_term = terms.spec, terms.noise_multiplier, terms.setup, terms.local, terms.row_term
        self.privacy = (spec, nm)
        self.local_rows = local is not None or terms.unit is not None
        plan, layout = setup.plan, setup.extra.structure.global_latent
        index = None
        if local is not None and terms.unit is not None:  # a group's own effects: its block
            index = unit_locals(local, terms.unit)
        elif local is not None:
            padded = client_data(plan, 0).row_mask.shape[0]
            row_of = np.asarray(row_locals(local, padded, padded).row_of)
            counts = np.bincount(row_of, minlength=padded)
            if len(set(counts.tolist())) != 1:
                raise ValueError(_UNEVEN.format(counts=sorted(set(counts.tolist()))))
            index = np.stack([np.flatnonzero(row_of == i) for i in range(padded)])
        start = (jnp.asarray(self.init, jnp.float32) if self.init is not None else
                 jnp.asarray(prior_median(self.model, client_data(plan, 0).args, self.model_kwargs, layout,
                                          exact=True), jnp.float32))
        config = DPLaplaceConfig(self.num_steps, float(spec.clip), float(nm * spec.clip),
                                 self.secure_aggregation)
        algorithm = dp_laplace(setup.extra.terms.log_prior, row_term, len(clients), start, config=config,
                               locals_index=index, mask_of=unit_mask(terms.unit))
        d = start.shape[0]
        message = {"z": jax.ShapeDtypeStruct((d + d * (d + 1) // 2,), start.dtype)}
        return setup._replace(algorithm=capped_releases(algorithm, len(clients), message, cap=self.num_steps))

    def _params(self, setup, state) -> GaussianParams:
        """``N(u, P^-1 + the privacy noise's covariance)`` (see the module docstring)."""
        s = state.server.inner
        posterior, noise = self._moments(s, len(setup.plan.names))
        return GaussianParams(s.u, posterior + noise)

    def _moments(self, s, num_clients: int):
        """``(P^-1, the noise's covariance)`` at the server state ``s``."""
        sigma = float(self.privacy[0].clip) * float(self.privacy[1])  # each release's noise sd
        return jnp.linalg.inv(s.precision), noise_covariance(s.precision, s.last, num_clients * sigma ** 2)

    def control_variate(self, result: RunResult) -> Optional[ControlVariate]:
        """The released sums of the last round as the DP sampler's control variate
        (:mod:`numpyro_fed.dp.control`; public: the server's own state), or ``None`` where the rows'
        terms were Laplace marginals of local latents (not the sampler's joint terms) or a group's."""
        if self.privacy is None or self.local_rows:
            return None
        s = result.state.server.inner
        d = int(s.u.shape[0])
        rows_u, cols_u = upper_triangle(d)
        upper = jnp.zeros((d, d), s.released.dtype).at[rows_u, cols_u].set(s.released[d:])
        _, noise = self._moments(s, len(fitted(self).plan.names))
        return ControlVariate(s.anchor, s.released[:d], upper + jnp.triu(upper, 1).T, float(self.privacy[0].clip),
                              noise)

    def curvature_noise(self, result: RunResult) -> float:
        """The bound on the noise in the released curvature (:func:`noise_bound`) over the
        curvature's smallest eigenvalue: above about 0.5 the Newton steps are driven by the noise
        and the answer's first-order account of it may not cover the posterior."""
        s, sigma = result.state.server.inner, float(self.privacy[0].clip) * float(self.privacy[1])
        least = float(np.min(np.linalg.eigvalsh(np.asarray(s.precision, np.float64))))
        return noise_bound(len(fitted(self).plan.names), sigma, int(s.precision.shape[0])) / max(least, 1e-30)

    def noise_sds(self, result: RunResult) -> Dict[str, float]:
        """Per global scalar (``site`` or ``site[i]``, unconstrained), the privacy noise's sd in
        the mean as a multiple of the posterior sd: ``sqrt(noise var / posterior var)``."""
        posterior, noise = self._moments(result.state.server.inner, len(fitted(self).plan.names))
        ratio = np.sqrt(np.diag(np.asarray(noise)) / np.diag(np.asarray(posterior)))
        layout = fitted(self).extra.structure.global_latent
        names = [scalar_label(n, i, int(np.prod(shape))) for n, shape in zip(layout.names, layout.shapes)
                 for i in range(int(np.prod(shape)))]
        return dict(zip(names, ratio.tolist()))

    def draw(self, rng_key, result: RunResult, num_samples: Optional[int] = None, *,
                         client: Optional[str] = None, corrected: bool = False) -> Dict[str, jax.Array]:
        """Draws of ``N(mean, cov)``, constrained: the global sites and the deterministic sites of
        the global sites alone (``corrected``: no importance correction exists under DP, it would
        cost privacy)."""
        if corrected:
            raise ValueError("DPLaplace: no importance-corrected draws (the correction's terms would cost privacy)")

        if client is not None:
            raise ValueError("DPLaplace: a client's local latents stay on it (their modes are never sent)")
        mean, cov = result.params.mean, result.params.cov
        n = 1000 if num_samples is None else int(num_samples)
        draws = random.multivariate_normal(rng_key, mean, cov, (n,))
        return global_values(self.model, self.model_kwargs, fitted(self), draws)


@register_check(DPLaplace)
def dp_laplace_check(inference: DPLaplace, result: RunResult) -> Verdict:
    """No check against the posterior (it would cost privacy); a warning where the noise swamps the
    released curvature (:meth:`DPLaplace.curvature_noise`); the clients' own counts of clipped
    rows in the last round (read where the simulation holds the clients' states): ``"biased"``
    where a clip bound (a warning names the clients), ``"unchecked"`` otherwise (a warning says so)."""
    names = list(fitted(inference).plan.names)
    ratio = inference.curvature_noise(result)  # public: the server's own state
    if ratio > CURVATURE_NOISE:
        warnings.warn(_SWAMPED.format(ratio=ratio), UnreliableFitWarning, stacklevel=find_stack_level())
    try:
        clipped = {n: int(result.client_states[n].inner.clipped) for n in names}
    except (AttributeError, KeyError, TypeError):
        warnings.warn("DPLaplace: each client's count of clipped rows stays on its node over a network backend",
                      UncheckedFitWarning, stacklevel=find_stack_level())
        return Verdict("unchecked", "none", "a private fit is not checked against the posterior")
    bad = [n for n, c in clipped.items() if c > 0]
    if bad:
        spec = inference.privacy[0]
        unit = "row" if spec.unit is None else f"group ({spec.unit})"
        warnings.warn(_CLIPPED.format(clients=bad, rows=sum(clipped.values()), clip=spec.clip, unit=unit),
                      UnreliableFitWarning, stacklevel=find_stack_level())
        return Verdict("biased", "none", f"{sum(clipped.values())} {unit} terms were clipped in the last round")
    warnings.warn(_UNCHECKED, UncheckedFitWarning, stacklevel=find_stack_level())
    return Verdict("unchecked", "none", "a private fit is not checked against the posterior (no clip bound)")

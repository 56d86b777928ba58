"""A federated Laplace approximation: Newton rounds on the global sites, local latents
integrated on their clients.

The log posterior of the flat unconstrained global sites ``u`` is
``log p(u) + sum_j L_j(u)`` with ``L_j(u) = log ∫ p(y_j, v_j | u) dv_j`` client ``j``'s term,
its local latents ``v_j`` integrated out by the inner Laplace approximation of
:func:`~numpyro_fed.terms.tilted.integrated_laplace` (exact when ``v_j | u`` is Gaussian; the
block structure of :mod:`~numpyro_fed.terms.blocks` keeps it linear in the number of groups).
A round:

1. the server broadcasts a point ``u``;
2. every client returns ``L_j(u)``, its gradient and its Hessian (``d + d(d+1)/2`` numbers; its
   inner mode ``v_j*`` stays on the client as the next round's warm start);
3. the server adds the prior's terms (the prior uses no data) and takes a step of Newton's
   method with backtracking spread over rounds: an accepted point (the log posterior did not
   fall) gives the saddle-free Newton direction (:func:`~numpyro_fed.terms.tilted.newton_direction`)
   and the full step is proposed; a rejected one halves the step.

The run stops when the Newton decrement ``sqrt(g^T (-H)^-1 g)`` (the distance to the mode in
posterior standard deviations) is below ``tol`` at a point where ``-H`` is positive definite:
``q = N(u + (-H)^-1 g, (-H)^-1)`` (the last Newton step taken on the server). A flat prior
needs no special case: the posterior's curvature is the clients' plus the prior's, and where it
is not positive definite the posterior is improper (or the mode is not reached) and the server
state says so (``proper``). Rounds: typically 5-20 (quadratic convergence from a start the
prior or the model gives).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm, all_clients
from ..terms.gaussian import NaturalGaussian
from ..terms.tilted import (
    TiltedProblem,
    inner_mode,
    integrated_derivatives,
    integrated_laplace,
    integrated_value,
    newton_direction,
)

__all__ = ["SECURE_FIELDS", "LaplaceClientState", "LaplaceInfo", "LaplaceServerState", "federated_laplace"]

SECURE_FIELDS = ("value", "grad", "hess", "ok", "inner_sq")  # every field, under secure aggregation
MAX_HALVINGS = 30  # a step halved this often without the log posterior rising: the search is stuck


class LaplaceServerState(NamedTuple):
    q: NaturalGaussian  # N(mode, (-H)^-1) at the last accepted point (improper until -H is positive definite)
    u: jax.Array  # the last accepted point
    value: jax.Array  # the log posterior there (up to a constant)
    grad: jax.Array
    hess: jax.Array
    direction: jax.Array  # the Newton direction from u
    step: jax.Array  # the fraction of it proposed now
    halvings: jax.Array
    decrement: jax.Array  # the Newton decrement at u (posterior sds to the mode)
    inner: jax.Array  # the largest inner (local latents) Newton decrement of the clients at u
    converged: jax.Array
    stuck: jax.Array
    round: jax.Array


class LaplaceClientState(NamedTuple):
    v: jax.Array  # the client's inner mode (its local latents), its warm start; never sent


class LaplaceInfo(NamedTuple):
    value: jax.Array
    decrement: jax.Array
    accepted: jax.Array
    step: jax.Array
    answered: jax.Array


def _inner_start(problem: TiltedProblem, u, v_warm):
    """Where the client's inner search at ``u`` starts: its last inner mode (the warm start) or
    the fixed cold start (zeros), whichever the inner Newton steps from it take higher.

    The last inner mode is that of the last point evaluated, which may be a proposal the server
    then rejected: a full Newton step along a weakly curved direction can land far out, where a
    client's locals go to thousands; warm-started from there, the inner search does not come back
    in its steps, every later point's value is too low (or not finite) and the server halves its
    step forever. The cold start bounds that damage to one round."""
    if problem.num_local == 0:
        return v_warm

    def neg(x):
        return -problem.tilted(jnp.concatenate([u, x]))

    warm = inner_mode(neg, v_warm, problem.inner_steps, problem.index)
    cold = inner_mode(neg, jnp.zeros_like(v_warm), problem.inner_steps, problem.index)
    f_warm, f_cold = -neg(warm), -neg(cold)
    keep = jnp.all(jnp.isfinite(warm)) & jnp.isfinite(f_warm) & ~(f_cold > f_warm)
    return jnp.where(keep, warm, cold)


def _client_step(rng_key, state: LaplaceClientState, broadcast: Broadcast, data, *, problem_of: Callable,
                 secure: bool = False):
    del rng_key
    problem = problem_of(data)
    u = broadcast.shared["u"]
    start = _inner_start(problem, u, state.v)
    value = integrated_value(problem, u, start)
    grad, hess, dec, v, _ = integrated_derivatives(problem, u, start)
    ok = jnp.isfinite(value) & jnp.all(jnp.isfinite(grad)) & jnp.all(jnp.isfinite(hess))
    v = jnp.where(jnp.all(jnp.isfinite(v)), v, state.v)
    # a point where the term is not finite is sent as zeros with ok=False (the server halves its step)
    zero = jnp.zeros((), value.dtype)
    inner = {"inner_sq": jnp.where(ok, dec * dec, zero)} if secure else {"inner": jnp.where(ok, dec, zero)}
    return LaplaceClientState(v), {"value": jnp.where(ok, value, zero), "grad": jnp.where(ok, grad, zero),
                                   "hess": jnp.where(ok, hess, zero), "ok": ok, **inner}


def _server_step(rng_key, s: LaplaceServerState, messages, view, *, log_prior: Callable, tol: float,
                 secure: bool = False):
    """The Newton step. ``secure``: the clients' fields arrive summed (secure aggregation): the
    inner decrement is then the root sum of the clients' squares (at least their largest)."""
    del rng_key
    proposal = s.u + s.step * s.direction
    answered = view.answered
    if secure:
        total = messages
        complete = total["ok"] == answered.shape[0]
        inner_now = jnp.sqrt(total["inner_sq"])
    else:
        mask = {"value": answered, "grad": answered[:, None], "hess": answered[:, None, None]}
        total = {k: jnp.sum(jnp.where(m, messages[k], 0.0), 0) for k, m in mask.items()}
        complete = jnp.all(answered) & jnp.all(messages["ok"])
        inner_now = jnp.max(jnp.where(answered, messages["inner"], 0.0))
    lp = log_prior(proposal)
    value = lp + total["value"]
    grad = jax.grad(log_prior)(proposal) + total["grad"]
    h_prior = jax.hessian(log_prior)(proposal)
    hess = (h_prior + h_prior.T) / 2 + total["hess"]
    finite = jnp.isfinite(value) & jnp.all(jnp.isfinite(grad)) & jnp.all(jnp.isfinite(hess))
    # not lower than where it stands, to a relative 1e-6 (rounding never decides between points near the mode)
    accept = complete & finite & (value >= s.value - 1e-6 * (1.0 + jnp.abs(s.value)))
    missing = ~jnp.all(answered)  # a client missing: the same point again next round
    u = jnp.where(accept, proposal, s.u)
    value_, grad_, hess_ = (jnp.where(accept, a, b) for a, b in ((value, s.value), (grad, s.grad), (hess, s.hess)))
    inner = jnp.where(accept, inner_now, s.inner)
    # Newton's step in the scale-free form D^-1/2 (-H) D^-1/2 (D its diagonal): in float32 an eigen-
    # decomposition of -H itself loses the small eigenvalues of a badly scaled posterior (a covariate in
    # the thousands), which then look negative and the search never stops
    scale = 1.0 / jnp.sqrt(jnp.maximum(jnp.abs(jnp.diag(hess_)), jnp.finfo(hess_.dtype).tiny))
    scaled = -hess_ * scale[:, None] * scale[None, :]
    lam, vec = jnp.linalg.eigh((scaled + scaled.T) / 2)
    proper = jnp.all(lam > 0) & jnp.all(jnp.diag(hess_) < 0)
    newton = scale * (vec @ ((vec.T @ (scale * grad_)) / jnp.where(proper, lam, 1.0)))
    # (the backend's guard refuses non-finite server states: "no mode yet" is the largest float)
    decrement = jnp.where(proper, jnp.sqrt(jnp.abs(grad_ @ newton)), jnp.finfo(grad_.dtype).max)
    direction = jnp.where(accept, scale * newton_direction(-scaled, scale * grad_), s.direction)
    halvings = jnp.where(accept, 0, jnp.where(missing, s.halvings, s.halvings + 1))
    step = jnp.where(accept, 1.0, jnp.where(missing, s.step, s.step / 2)).astype(s.step.dtype)
    # (before the first accepted point the state holds the start's placeholders, not a mode: a first
    # round with a client missing must not stop the search there)
    visited = value_ > jnp.finfo(value_.dtype).min
    converged = visited & proper & (decrement < tol) & (inner < tol)
    stuck = (halvings > MAX_HALVINGS) & ~converged
    # q: the Laplace approximation at the Newton-predicted mode (one more Newton step, on the server)
    precision = -hess_
    mode = u + jnp.where(proper, newton, 0.0)
    q = NaturalGaussian(precision @ mode, precision)
    new = LaplaceServerState(q, u, value_, grad_, hess_, direction, step, halvings, decrement, inner,
                             converged, stuck, s.round + 1)
    info = LaplaceInfo(value_, decrement, accept, s.step, answered.sum())
    return new, Broadcast({"u": u + step * direction}), info


def federated_laplace(log_prior: Callable, client_log_joint: Callable, num_clients: int, start: jax.Array, *,
                      num_local: int = 0, blocks: Optional[jax.Array] = None, inner_steps: int = 8,
                      tol: float = 1e-2, secure: Optional[str] = None) -> FederatedAlgorithm:
    """Build the federated Laplace approximation's pure functions (see the module docstring).

    Args:
        log_prior: ``u -> log p(u)`` of the flat unconstrained global sites (Jacobians
            included; ``0`` for flat priors); data-free, evaluated by the server.
        client_log_joint: ``(w = [u, v], data) -> log p(y_j, v | u)``; evaluated only by the
            client on its own data.
        num_clients: J.
        start: the first point ``u`` (the prior's median, or the model's initial values).
        num_local: size of ``v``.
        blocks: the local latents' independent blocks (:func:`~numpyro_fed.terms.blocks.local_blocks`).
        inner_steps: Newton steps of a client's inner mode per round (warm-started).
        tol: the Newton decrement (posterior sds) at which the search stops.
        secure: ``None``, or how the clients' terms are summed so that the server sees only
            their sum (:mod:`numpyro_fed.run.secure`): ``"trusted"`` or ``"masking"``. The inner
            decrement is then the root sum of the clients' squares instead of their largest.
    """
    d = start.shape[0]
    index = None if blocks is None else jnp.asarray(blocks)
    log_joint = jax.jit(client_log_joint)  # one trace per shape (differentiated to third order)

    def problem_of(data):
        f = partial(log_joint, data=data)
        return TiltedProblem(f, integrated_laplace(f, d, num_local, index), d, num_local, index, inner_steps)

    def init_server(rng_key):
        del rng_key
        dtype = start.dtype
        zero, big = jnp.zeros((), dtype), jnp.asarray(jnp.finfo(dtype).max, dtype)
        eye = jnp.eye(d, dtype=dtype)
        state = LaplaceServerState(NaturalGaussian(jnp.zeros(d, dtype), jnp.zeros((d, d), dtype)), start, -big,
                                   jnp.zeros(d, dtype), -eye, jnp.zeros(d, dtype), jnp.ones((), dtype),
                                   jnp.zeros((), jnp.int32), big, zero,
                                   jnp.asarray(False), jnp.asarray(False), jnp.zeros((), jnp.int32))
        return state, Broadcast({"u": start})

    def init_client(rng_key, data):
        del rng_key, data
        return LaplaceClientState(jnp.zeros(num_local, start.dtype))

    return FederatedAlgorithm(
        init_server, init_client, all_clients(num_clients),
        (Exchange(partial(_client_step, problem_of=problem_of, secure=secure is not None),
                  partial(_server_step, log_prior=log_prior, tol=tol, secure=secure is not None), "laplace_newton",
                  SECURE_FIELDS if secure is not None else (), secure or "trusted"),),
        monitor=lambda info: jnp.minimum(info.decrement, 1e3), monitor_name="Newton decrement", name="laplace",
        done=lambda s: s.converged | s.stuck,
        describe=lambda s: f"decrement {float(s.decrement):.3g}",
    )

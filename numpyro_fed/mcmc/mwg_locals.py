"""A client's side of federated Metropolis-within-Gibbs (see :mod:`~numpyro_fed.mcmc.mwg_algorithm`):
the deterministic Laplace map of its locals given the globals (their conditional mode from a fixed
anchor's first-order prediction, and the curvature there), the map's whitening, its locals'
Hamiltonian moves given the globals, and the gradient of its Laplace-marginal term that the
surrogate transition's refit asks for in warmup. Everything here runs on the client, on its own
rows and locals."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import random

from ..run.steps import leapfrog
from ..terms.blocks import block_hessian, scatter_blocks
from ..terms.tilted import conditional_slope, first_descent, inner_mode

__all__ = ["FLAT", "STEP_JITTER", "anchor_map", "colour", "curvature", "laplace_map", "local_moves", "log_det",
           "marginal_grad", "whiten"]

STEP_JITTER = 0.2  # each local HMC move's step is the set step times a uniform draw in [0.8, 1.2]
FLAT = 1e-10  # a curvature at most this is no curvature (a padded local latent)


# ---------------------------------------------------------------------- the locals' Laplace map
def curvature(neg: Callable, mode, index):
    """``(|eigenvalues|, eigenvectors)`` of ``neg``'s Hessian at ``mode`` (floored), dense
    ``((n,), (n, n))`` or by blocks ``((K, b), (K, b, b))``."""
    if index is None:
        h = jax.hessian(neg)(mode)
        lam, vec = jnp.linalg.eigh((h + h.T) / 2)
    else:
        lam, vec = jax.vmap(jnp.linalg.eigh)(block_hessian(neg, mode, index))
    # a direction of no curvature (a padded entry, masked out of the model) is marked -1: the map
    # leaves it as it is (|-1| = 1, not a floor that moves with u: its Jacobian must cancel, the
    # density being flat there) and the local moves do not move it
    lam = jnp.abs(lam)
    return jnp.where(lam > FLAT, lam, -1.0), vec


def whiten(x, lam, vec, index):
    """``L^-1 x`` with ``L = V |Lambda|^-1/2`` (per block)."""
    lam = jnp.abs(lam)
    if index is None:
        return jnp.sqrt(lam) * (vec.T @ x)
    return scatter_blocks(jnp.sqrt(lam) * jnp.einsum("kij,ki->kj", vec, x[index]), index, x.shape[0])


def colour(w, lam, vec, index):
    """``L w``."""
    lam = jnp.abs(lam)
    if index is None:
        return vec @ (w / jnp.sqrt(lam))
    return scatter_blocks(jnp.einsum("kij,kj->ki", vec, w[index] / jnp.sqrt(lam)), index, w.shape[0])


def log_det(lam):
    """``log |L|``."""
    return -0.5 * jnp.sum(jnp.log(jnp.abs(lam)))


def laplace_map(f: Callable, u, v0, steps: int, index):
    """``(m(u), lam, vec)``: the deterministic Laplace map of ``v | u`` (``steps`` Newton steps from ``v0``)."""
    neg = lambda v: -f(u, v)  # noqa: E731
    mode = inner_mode(neg, v0, steps, index, search=first_descent)
    lam, vec = curvature(neg, mode, index)
    return mode, lam, vec


def local_moves(key, f: Callable, u, v, value, mode, lam, vec, index, config):
    """``config.local_moves`` HMC moves of ``v`` on ``p(v | u, y_j)`` in the whitened coordinates."""
    def potential(w):
        return -f(u, mode + colour(w, lam, vec, index))

    grad = jax.grad(potential)
    free = (lam > 0) if index is None else scatter_blocks(lam > 0, index, v.shape[0])  # (flat ones stay)

    def move(carry, k):
        w, pot, acc = carry
        k_p, k_a, k_e = random.split(k, 3)
        p = random.normal(k_p, w.shape, w.dtype) * free
        # the step jittered (drawn apart from the state: the move stays reversible): a fixed trajectory
        # near half the whitened target's period sends w to about -w, and two such moves back to w
        eps = config.local_step_size * random.uniform(k_e, (), w.dtype, 1.0 - STEP_JITTER, 1.0 + STEP_JITTER)

        w_new, p_new = leapfrog(grad, w, p, eps, config.local_steps)
        pot_new = potential(w_new)
        log_a = pot - pot_new + 0.5 * (p @ p - p_new @ p_new)
        log_a = jnp.where(jnp.isfinite(log_a), log_a, -jnp.inf)
        take = jnp.log(random.uniform(k_a, (), w.dtype)) < log_a
        return (jnp.where(take, w_new, w), jnp.where(take, pot_new, pot), acc + take), None

    w0 = whiten(v - mode, lam, vec, index)
    (w, pot, acc), _ = jax.lax.scan(move, (w0, -value, jnp.zeros((), v.dtype)),
                                    random.split(key, config.local_moves))
    return mode + colour(w, lam, vec, index), -pot, acc / config.local_moves


def anchor_map(f: Callable, u0, num_local: int, steps: int, index):
    """``(anchor, slope)`` of a client's map: its locals' conditional mode at ``u0`` (``steps``
    Newton steps from zero) and the mode's slope there (``dv*/du``, the implicit function theorem;
    zero where it is not finite), so that ``anchor + slope @ u`` predicts the mode at ``u`` to first
    order. Computed once per run from ``u0`` alone: the map stays a deterministic function of ``u``."""
    dtype = u0.dtype
    d = u0.shape[0]
    if not num_local:
        return jnp.zeros(0, dtype), jnp.zeros((0, d), dtype)
    mode = inner_mode(lambda v: -f(u0, v), jnp.zeros(num_local, dtype), steps, index, search=first_descent)
    slope = conditional_slope(lambda w: f(w[:d], w[d:]), u0, mode, index)
    slope = jnp.where(jnp.isfinite(slope), slope, 0.0)
    return mode - slope @ u0, slope


def marginal_grad(f: Callable, u, mode, index):
    """The gradient at ``u`` of the client's Laplace-marginal term ``f(u, m) - log|H(u, m)| / 2``
    (``m``: its locals' mode there, held fixed: at the mode ``f``'s own change through ``m`` is
    zero), the term the global move's conditional target equals where ``v | u`` is Gaussian."""
    if not mode.shape[0]:
        return jax.grad(lambda w: f(w, mode))(u)

    def term(w):
        neg = lambda v: -f(w, v)  # noqa: E731
        if index is None:
            h = jax.hessian(neg)(mode)
            lam = jnp.linalg.eigvalsh((h + h.T) / 2)
        else:
            lam = jax.vmap(jnp.linalg.eigvalsh)(block_hessian(neg, mode, index))
        lam = jnp.abs(lam)
        return f(w, mode) - 0.5 * jnp.sum(jnp.log(jnp.where(lam > FLAT, lam, 1.0)))

    return jax.grad(term)(u)

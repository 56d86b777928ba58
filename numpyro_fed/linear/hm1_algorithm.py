"""HM1: multi-task linear regression with a learned device covariance (Yue et al. (2022) §3, Alg. 1).

Device parameters ``Theta = [theta_1 ... theta_K]`` (d x K) get the structural prior
``Vec(Theta) ~ N(0, Omega ⊗ I)``; the MAP of ``(Theta, Omega)`` minimises

.. math::

    L = \\sum_k \\|Y_k - X_k \\theta_k\\|^2 / \\sigma_k^2 + \\mathrm{Tr}(\\Theta \\Omega^{-1}
        \\Theta^T) + d \\log|\\Omega|.

One round (Algorithm 1): the server sends each asked device, in the per-client part of its
broadcast, only its own column ``theta_k`` and the aggregate
``s_k = sum_i theta_i (Omega^-1)_{ik}`` (it never shares ``Omega`` or other columns); the
device takes ``local_steps`` minibatch gradient steps, by default Algorithm 1's **summed**
step ``theta_k <- theta_k + 2 eta X_b^T (Y_b - X_b theta_k)`` on ``b = batch_size`` rows
drawn without replacement (the ``1 / sigma_k^2`` of Stage 1 folded into ``eta``;
``gradient="mean"`` divides by ``b``), then the prior shrinkage
``theta_k <- theta_k - 2 eta_2 s_k``, and returns ``theta_k``; the server updates
``Omega <- (1 - alpha) Omega + (alpha / d) Theta^T Theta`` (the closed form of Zhang and
Yeung, 2012, relaxed). Partial participation: ``subset_size`` devices per round.

**A well-behaved variant** (not in the paper), two switches:

- ``noise_scaled=True``: the shrinkage, scaled by the device's own noise estimate
  ``sigma_k^2`` (the residual variance ``RSS / (n_k - d)`` of the ``theta_k`` it received,
  which never leaves the device), is taken inside every local step in proportion to the
  batch: ``theta_k <- theta_k + 2 eta (X_b^T (Y_b - X_b theta_k) - (b / n_k) sigma_k^2 s_k)``.
  A full-batch round then leaves ``theta_k`` unchanged exactly where §3's ``L`` (its data
  term weighted by ``1 / sigma_k^2``) is stationary in ``theta_k``, and minibatch rounds do
  so in expectation. Algorithm 1's separate shrinkage step weights the prior by ``eta_2``
  against ``T`` steps on ``b`` rows in noise-free units, so its fixed point moves with
  ``eta_2``, ``T``, ``b`` and the noise level.
- ``omega_df=nu``: ``Omega``'s target is ``(Theta^T Theta + nu s^2 I) / (d + nu)``, the
  posterior mean under an inverse-Wishart prior with ``nu + K + 1`` degrees of freedom and
  mean ``s^2 I`` (``s^2 = ||Theta||_F^2 / (K d)``, the mean square of the current entries).
  With ``K > d``, ``Theta^T Theta`` has rank at most ``d``, so the paper's target is singular
  and ``Omega^-1`` grows like ``(1 - alpha)^-c`` after ``c`` rounds; the prior keeps every
  eigenvalue of the target at least ``nu s^2 / (d + nu)``.

**A missing answer** (dropout): the server keeps the device's last returned ``theta_k``.

All functions are pure and jit-compatible; the data of device k enter only ``client_step``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

from ..run.protocol import Broadcast, Exchange, FederatedAlgorithm

__all__ = ["GRADIENTS", "HM1Config", "HM1Info", "HM1ServerState", "client_step", "hm1", "init_client", "init_server",
           "minibatch_weights", "select", "server_step"]

GRADIENTS = ("sum", "mean")


class HM1ServerState(NamedTuple):
    theta: jax.Array  # (K, d): the server's copy of every device's last returned theta_k
    omega: jax.Array  # (K, K)
    round: jax.Array


class HM1Info(NamedTuple):
    change: jax.Array  # ||Theta_new - Theta|| / sqrt(K)
    distance: jax.Array  # ||Theta - truth|| / sqrt(K) (Yue et al. (2022) Figure 3); 0 without a truth


def minibatch_weights(rng_key: jax.Array, mask: jax.Array, batch_size: Optional[int]) -> jax.Array:
    """0/1 weights of one minibatch: ``min(batch_size, rows)`` of the real rows
    (``mask > 0``) drawn uniformly without replacement; ``None`` gives every real row (a
    full-batch step)."""
    if batch_size is None:
        return mask
    b = min(int(batch_size), mask.shape[0])
    scores = jnp.where(mask > 0, random.uniform(rng_key, mask.shape), -1.0)
    _, chosen = jax.lax.top_k(scores, b)  # real rows first: a device with fewer rows takes them all
    return jnp.zeros_like(mask).at[chosen].set(1.0) * mask


class HM1Config(NamedTuple):
    """:func:`hm1`'s settings, bound to the module's steps."""

    num_clients: int
    dim: int
    lr: float
    eta2: float  # the prior-shrinkage step
    alpha: float
    local_steps: int
    batch_size: Optional[int]
    gradient: str
    noise_scaled: bool
    omega_df: Optional[float]
    num_selected: int
    init_scale: float
    truth: Optional[jax.Array]


def select(config: HM1Config, rng_key, state):
    del state
    if config.num_selected == config.num_clients:
        return jnp.ones(config.num_clients, bool)
    order = random.permutation(rng_key, config.num_clients)
    return jnp.zeros(config.num_clients, bool).at[order[:config.num_selected]].set(True)


def _broadcast(theta, omega):
    """Per device: its own column and the aggregated shrinkage direction s_k."""
    s = jnp.linalg.solve(omega, theta)  # (K, d): row k = sum_i (Omega^-1)_{ki} theta_i
    return Broadcast(None, {"theta": theta, "shrink": s})


def init_server(config: HM1Config, rng_key):
    theta = config.init_scale * random.normal(rng_key, (config.num_clients, config.dim))
    omega = jnp.eye(config.num_clients, dtype=theta.dtype)
    return HM1ServerState(theta, omega, jnp.zeros((), jnp.int32)), _broadcast(theta, omega)


def init_client(rng_key, data):
    del rng_key, data
    return ()


def client_step(config: HM1Config, rng_key, state, message, data):
    """``data``: ``x`` (n, d), ``y`` (n,), ``mask`` (n,) with 0 on padded rows."""
    x, y, mask = data["x"], data["y"], data["mask"]
    mine = message.per_client
    rows = jnp.sum(mask)

    if config.noise_scaled:  # the prior's gradient, weighted by the device's noise estimate (module docstring)
        sigma2 = jnp.sum(mask * (y - x @ mine["theta"]) ** 2) / jnp.maximum(rows - config.dim, 1.0)
        prior = sigma2 * mine["shrink"] / rows
    else:
        prior = jnp.zeros_like(mine["theta"])

    def step(theta, key):
        w = minibatch_weights(key, mask, config.batch_size)
        grad = x.T @ ((y - x @ theta) * w) - jnp.sum(w) * prior
        if config.gradient == "mean":
            grad = grad / jnp.maximum(jnp.sum(w), 1.0)
        return theta + 2 * config.lr * grad, None

    theta, _ = jax.lax.scan(step, mine["theta"], random.split(rng_key, config.local_steps))
    if config.noise_scaled:
        return state, {"theta": theta}
    return state, {"theta": theta - 2 * config.eta2 * mine["shrink"]}


def server_step(config: HM1Config, rng_key, state: HM1ServerState, messages, view):
    del rng_key
    K = config.num_clients
    theta = jnp.where(view.answered[:, None], messages["theta"], state.theta)
    gram = theta @ theta.T
    if config.omega_df is None:
        goal = gram / config.dim
    else:  # the inverse-Wishart posterior mean (module docstring)
        mean_square = jnp.trace(gram) / (K * config.dim)
        goal = (gram + config.omega_df * mean_square * jnp.eye(K, dtype=gram.dtype)) / (config.dim + config.omega_df)
    omega = (1 - config.alpha) * state.omega + config.alpha * goal
    scale = jnp.sqrt(K)
    change = jnp.linalg.norm(theta - state.theta) / scale
    distance = jnp.zeros(()) if config.truth is None else jnp.linalg.norm(theta - config.truth) / scale
    new = HM1ServerState(theta, omega, state.round + 1)
    return new, _broadcast(theta, omega), HM1Info(change, distance)


def _change(info):
    return info.change


def hm1(
    num_clients: int, dim: int, *, lr: float = 0.01, shrinkage: Optional[float] = None, alpha: float = 0.1,
    local_steps: int = 20, batch_size: Optional[int] = None, gradient: str = "sum", noise_scaled: bool = False,
    omega_df: Optional[float] = None, subset_size: Optional[int] = None, init_scale: float = 0.01,
    truth: Optional[jax.Array] = None,
) -> FederatedAlgorithm:
    """Build Algorithm 1's pure functions.

    Args:
        num_clients: K devices.
        dim: d covariates.
        lr: ``eta`` of the local gradient steps.
        shrinkage: ``eta_2`` of the prior-shrinkage step (default ``lr``, as in Algorithm 1;
            0 gives K separate models).
        alpha: the ``Omega`` update's proportion.
        local_steps: T.
        batch_size: rows per local step, drawn without replacement (a device with fewer
            rows uses all of them; ``None``: all of the device's rows).
        gradient: ``"sum"`` (Algorithm 1: ``2 eta X_b^T (Y_b - X_b theta)``) or ``"mean"``
            (the same divided by the rows in the batch).
        noise_scaled: the variant's shrinkage, scaled by the device's own noise estimate and
            taken inside every local step (module docstring); ``shrinkage`` is then unused.
        omega_df: ``nu`` of the inverse-Wishart prior on ``Omega`` (``None``: the paper's
            update, no prior).
        subset_size: devices per round (``None``: all; partial participation otherwise).
        init_scale: ``Theta`` starts at ``N(0, init_scale^2)`` draws (the server's key) and
            ``Omega`` at ``I``.
        truth: ``(K, d)`` true parameters of a simulation: ``HM1Info.distance`` tracks them.
    """
    if gradient not in GRADIENTS:
        raise ValueError(f"gradient={gradient!r}: choose one of {GRADIENTS}")
    if noise_scaled and shrinkage is not None:
        raise ValueError(f"shrinkage={shrinkage} with noise_scaled=True: the variant weights the prior by the "
                         "device's noise estimate; leave shrinkage unset")
    m = num_clients if subset_size is None else int(subset_size)
    config = HM1Config(num_clients, dim, lr, lr if shrinkage is None else shrinkage, alpha, local_steps, batch_size,
                       gradient, noise_scaled, omega_df, m, init_scale,
                       None if truth is None else jnp.asarray(truth, jnp.float32))
    return FederatedAlgorithm(
        partial(init_server, config), init_client, partial(select, config),
        (Exchange(partial(client_step, config), partial(server_step, config), "local_steps"),),
        num_selected=m, monitor=_change, monitor_name="change",
    )

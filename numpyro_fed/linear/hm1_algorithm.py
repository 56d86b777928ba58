"""HM1: multi-task linear regression with a learned device covariance (paper 004 §3, Alg. 1).

Device parameters ``Theta = [theta_1 ... theta_K]`` (d x K) get the structural prior
``Vec(Theta) ~ N(0, Omega ⊗ I)``; the MAP of ``(Theta, Omega)`` minimises

.. math::

    L = \\sum_k \\|Y_k - X_k \\theta_k\\|^2 / \\sigma_k^2 + \\mathrm{Tr}(\\Theta \\Omega^{-1}
        \\Theta^T) + d \\log|\\Omega|.

One round (Algorithm 1): the server sends each asked device, in the per-client part of its
broadcast, only its own column ``theta_k`` and the aggregate
``s_k = sum_i theta_i (Omega^-1)_{ik}`` (it never shares ``Omega`` or other columns); the
device takes ``local_steps`` (minibatch) gradient steps on its mean squared error,
``theta_k <- theta_k + 2 eta X_b^T (Y_b - X_b theta_k) / b``, then the prior shrinkage
``theta_k <- theta_k - 2 eta_2 s_k``, and returns ``theta_k``; the server updates
``Omega <- (1 - alpha) Omega + (alpha / d) Theta^T Theta`` (the closed form of Zhang and
Yeung, 2012, relaxed). Partial participation: ``subset_size`` devices per round.

**A missing answer** (dropout): the server keeps the device's last returned ``theta_k``.

All functions are pure and jit-compatible; the data of device k enter only ``client_step``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

from ..protocol import Broadcast, Exchange, FederatedAlgorithm

__all__ = ["HM1Info", "HM1ServerState", "hm1"]


class HM1ServerState(NamedTuple):
    theta: jax.Array  # (K, d): the server's copy of every device's last returned theta_k
    omega: jax.Array  # (K, K)
    round: jax.Array


class HM1Info(NamedTuple):
    change: jax.Array  # ||Theta_new - Theta|| / sqrt(K)
    distance: jax.Array  # ||Theta - truth|| / sqrt(K) (paper 004 Figure 3); 0 without a truth


def hm1(
    num_clients: int, dim: int, *, lr: float = 0.01, shrinkage: Optional[float] = None, alpha: float = 0.1,
    local_steps: int = 20, batch_size: Optional[int] = None, subset_size: Optional[int] = None,
    init_scale: float = 0.01, truth: Optional[jax.Array] = None,
) -> FederatedAlgorithm:
    """Build Algorithm 1's pure functions.

    Args:
        num_clients: K devices.
        dim: d covariates.
        lr: ``eta`` of the local gradient steps on the mean squared error.
        shrinkage: ``eta_2`` of the prior-shrinkage step (default ``lr``; 0 gives K
            separate models).
        alpha: the ``Omega`` update's proportion.
        local_steps: T.
        batch_size: rows per local step (``None``: all of the device's rows).
        subset_size: devices per round (``None``: all; partial participation otherwise).
        init_scale: ``Theta`` starts at ``N(0, init_scale^2)`` draws (the server's key) and
            ``Omega`` at ``I``.
        truth: ``(K, d)`` true parameters of a simulation: ``HM1Info.distance`` tracks them.
    """
    eta2 = lr if shrinkage is None else shrinkage
    m = num_clients if subset_size is None else int(subset_size)
    target = None if truth is None else jnp.asarray(truth, jnp.float32)

    def select(rng_key, state):
        del state
        if m == num_clients:
            return jnp.ones(num_clients, bool)
        order = random.permutation(rng_key, num_clients)
        return jnp.zeros(num_clients, bool).at[order[:m]].set(True)

    def broadcast(theta, omega):
        """Per device: its own column and the aggregated shrinkage direction s_k."""
        s = jnp.linalg.solve(omega, theta)  # (K, d): row k = sum_i (Omega^-1)_{ki} theta_i
        return Broadcast(None, {"theta": theta, "shrink": s})

    def init_server(rng_key):
        theta = init_scale * random.normal(rng_key, (num_clients, dim))
        omega = jnp.eye(num_clients, dtype=theta.dtype)
        return HM1ServerState(theta, omega, jnp.zeros((), jnp.int32)), broadcast(theta, omega)

    def init_client(rng_key, data):
        del rng_key, data
        return ()

    def client_step(rng_key, state, message, data):
        """``data``: ``x`` (n, d), ``y`` (n,), ``mask`` (n,) with 0 on padded rows."""
        x, y, mask = data["x"], data["y"], data["mask"]
        mine = message.per_client

        def step(theta, key):
            if batch_size is None:
                w = mask
            else:  # a minibatch of the device's real rows, without replacement
                scores = jnp.where(mask > 0, random.uniform(key, mask.shape), -1.0)
                w = (scores >= jnp.sort(scores)[-batch_size]).astype(x.dtype) * mask
            resid = (y - x @ theta) * w
            return theta + 2 * lr * x.T @ resid / jnp.maximum(jnp.sum(w), 1.0), None

        theta, _ = jax.lax.scan(step, mine["theta"], random.split(rng_key, local_steps))
        return state, {"theta": theta - 2 * eta2 * mine["shrink"]}

    def server_step(rng_key, state: HM1ServerState, messages, view):
        del rng_key
        theta = jnp.where(view.answered[:, None], messages["theta"], state.theta)
        omega = (1 - alpha) * state.omega + alpha / dim * theta @ theta.T
        scale = jnp.sqrt(num_clients)
        change = jnp.linalg.norm(theta - state.theta) / scale
        distance = jnp.zeros(()) if target is None else jnp.linalg.norm(theta - target) / scale
        new = HM1ServerState(theta, omega, state.round + 1)
        return new, broadcast(theta, omega), HM1Info(change, distance)

    return FederatedAlgorithm(
        init_server, init_client, select, (Exchange(client_step, server_step, "local_steps"),),
        num_selected=m, monitor=lambda info: info.change, monitor_name="change",
    )

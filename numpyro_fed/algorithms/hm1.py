"""HM1: multi-task linear regression with a learned device covariance (paper 004 §3, Alg. 1).

Device parameters ``Theta = [theta_1 ... theta_K]`` (d x K) get the structural prior
``Vec(Theta) ~ N(0, Omega ⊗ I)``; the MAP of ``(Theta, Omega)`` minimises

.. math::

    L = \\sum_k \\|Y_k - X_k \\theta_k\\|^2 / \\sigma_k^2 + \\mathrm{Tr}(\\Theta \\Omega^{-1}
        \\Theta^T) + d \\log|\\Omega|.

One round (Algorithm 1): the server sends each chosen device its column ``theta_k`` and the
aggregate ``s_k = sum_i theta_i (Omega^-1)_{ik}`` (it never shares ``Omega`` or other
columns); the device takes ``local_steps`` (minibatch) gradient steps on its mean squared
error, ``theta_k <- theta_k + 2 eta X_b^T (Y_b - X_b theta_k) / b``, then the prior
shrinkage ``theta_k <- theta_k - 2 eta_2 s_k``, and returns ``theta_k``; the server updates
``Omega <- (1 - alpha) Omega + (alpha / d) Theta^T Theta`` (the closed form of Zhang and
Yeung, 2012, relaxed). Partial participation: ``subset_size`` devices per round.

All functions are pure and jit-compatible; the data of device k enter only ``client_step``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

__all__ = ["HM1ServerState", "hm1"]


class HM1ServerState(NamedTuple):
    theta: jax.Array  # (K, d): the server's copy of every device's last returned theta_k
    omega: jax.Array  # (K, K)
    active: jax.Array  # (K,) devices chosen for the coming round
    round: jax.Array


class HM1(NamedTuple):
    init_server: callable
    broadcast: callable
    client_step: callable
    server_step: callable


def hm1(
    num_clients: int, dim: int, *, lr: float = 0.01, shrinkage: Optional[float] = None, alpha: float = 0.1,
    local_steps: int = 20, batch_size: Optional[int] = None, subset_size: Optional[int] = None,
) -> HM1:
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
    """
    eta2 = lr if shrinkage is None else shrinkage
    m = num_clients if subset_size is None else int(subset_size)

    def choose(rng_key):
        if m == num_clients:
            return jnp.ones(num_clients, bool)
        order = random.permutation(rng_key, num_clients)
        return jnp.zeros(num_clients, bool).at[order[:m]].set(True)

    def init_server(rng_key, theta0):
        return HM1ServerState(theta0, jnp.eye(num_clients, dtype=theta0.dtype), choose(rng_key), jnp.zeros((), jnp.int32))

    def broadcast(state: HM1ServerState):
        """Per device: its own column and the aggregated shrinkage direction s_k."""
        s = jnp.linalg.solve(state.omega, state.theta)  # (K, d): row k = sum_i (Omega^-1)_{ki} theta_i
        return {"theta": state.theta, "shrink": s}

    def client_step(rng_key, message, data):
        """``data``: ``x`` (n, d), ``y`` (n,), ``mask`` (n,) with 0 on padded rows."""
        x, y, mask = data["x"], data["y"], data["mask"]

        def step(theta, key):
            if batch_size is None:
                w = mask
            else:  # a minibatch of the device's real rows, without replacement
                scores = jnp.where(mask > 0, random.uniform(key, mask.shape), -1.0)
                w = (scores >= jnp.sort(scores)[-batch_size]).astype(x.dtype) * mask
            resid = (y - x @ theta) * w
            return theta + 2 * lr * x.T @ resid / jnp.maximum(jnp.sum(w), 1.0), None

        theta, _ = jax.lax.scan(step, message["theta"], random.split(rng_key, local_steps))
        return {"theta": theta - 2 * eta2 * message["shrink"]}

    def server_step(rng_key, state: HM1ServerState, messages):
        theta = jnp.where(state.active[:, None], messages["theta"], state.theta)
        omega = (1 - alpha) * state.omega + alpha / dim * theta @ theta.T
        return HM1ServerState(theta, omega, choose(rng_key), state.round + 1)

    return HM1(init_server, broadcast, client_step, server_step)

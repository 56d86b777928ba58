"""``HM1``: paper 004's structural-covariance multi-task linear regression (§3, Algorithm 1)."""

from __future__ import annotations

from functools import partial
from typing import Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from .algorithms.hm1 import HM1ServerState, hm1
from .clients import Clients
from .transcript import Communication

__all__ = ["HM1", "HM1Result"]

_DATA = (
    "HM1 fits y = x @ theta_k on every client: client {client!r} needs arrays '{x}' of shape "
    "(rows, d) and '{y}' of shape (rows,); got {got}"
)


class HM1Result(NamedTuple):
    """What :meth:`HM1.run` returns.

    Attributes:
        theta: ``(K, d)`` device parameters, row k for ``clients.names[k]``.
        omega: ``(K, K)`` learned device covariance (held by the server).
        state: the final server state (pass as ``init_state=``).
        distance: per round, ``||Theta - truth|| / sqrt(K)`` when ``truth`` was given
            (paper 004 Figure 3), else empty.
        communication: rounds, bytes and messages each way (chosen devices only).
    """

    theta: jax.Array
    omega: jax.Array
    state: HM1ServerState
    distance: jax.Array
    communication: Communication


class HM1:
    """Multi-task linear regression with a learned device covariance ``Omega`` (paper 004 HM1).

    The MAP of ``Theta ~ MN(0, I, Omega)``, ``Y_k ~ N(X_k theta_k, sigma_k^2 I)`` by
    Algorithm 1 (see :mod:`numpyro_fed.algorithms.hm1`): devices take ``local_steps``
    gradient steps on their own mean squared error plus a prior-shrinkage step towards the
    server's aggregate ``sum_i theta_i (Omega^-1)_{ik}``; the server updates ``Omega``.
    ``shrinkage=0`` gives K separate models trained the same way (the paper's baseline).

    Args:
        lr: local step size ``eta`` (on the mean squared error).
        shrinkage: ``eta_2`` (default ``lr``).
        alpha: ``Omega`` update proportion (paper default 0.1).
        local_steps: T gradient steps per round.
        batch_size: rows per local step (``None``: full-batch gradient descent).
        subset_size: devices per round (``None``: full participation).
        x: the name of the covariate array (rows, d) in each client's data.
        y: the name of the response array (rows,).

    Examples:
        >>> import jax, numpy as np, numpyro_fed as nf
        >>> rng = np.random.default_rng(0)
        >>> theta = rng.normal(size=(2, 3))
        >>> x = rng.normal(size=(120, 3)); g = np.repeat([0, 1], 60)
        >>> y = np.einsum("nd,nd->n", x, theta[g])
        >>> clients = nf.Clients.split(g, x=x, y=y)
        >>> res = nf.HM1(lr=0.05).run(jax.random.PRNGKey(0), 30, clients)
        >>> res.theta.shape, res.omega.shape
        ((2, 3), (2, 2))
        >>> separate = nf.HM1(lr=0.05, shrinkage=0.0).run(jax.random.PRNGKey(0), 30, clients)
        >>> bool(np.abs(separate.theta - theta).max() < 1e-4)  # noise-free least squares
        True
    """

    method = "hm1"

    def __init__(self, *, lr: float = 0.01, shrinkage: Optional[float] = None, alpha: float = 0.1,
                 local_steps: int = 20, batch_size: Optional[int] = None, subset_size: Optional[int] = None,
                 x: str = "x", y: str = "y") -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr}: must be positive")
        if shrinkage is not None and shrinkage < 0:
            raise ValueError(f"shrinkage={shrinkage}: must be >= 0 (0 gives separate models)")
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha={alpha}: must be in [0, 1]")
        if int(local_steps) != local_steps or local_steps < 1:
            raise ValueError(f"local_steps={local_steps}: must be a positive integer")
        self.lr, self.shrinkage, self.alpha = float(lr), shrinkage, float(alpha)
        self.local_steps, self.batch_size, self.subset_size = int(local_steps), batch_size, subset_size
        self.x, self.y = x, y
        self._algs: dict = {}

    def _data(self, clients: Clients):
        if not isinstance(clients, Clients):
            raise TypeError(f"HM1.run needs an nf.Clients object; got {type(clients).__name__}")
        n_max = max(clients.num_rows.values())
        xs, ys, masks = [], [], []
        dims = set()
        for name in clients.names:
            data = clients[name]
            x, y = np.asarray(data.get(self.x)), np.asarray(data.get(self.y))
            if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
                got = {k: np.shape(v) for k, v in data.items()}
                raise ValueError(_DATA.format(client=name, x=self.x, y=self.y, got=got))
            dims.add(x.shape[1])
            pad = n_max - x.shape[0]
            xs.append(np.pad(x, [(0, pad), (0, 0)]))
            ys.append(np.pad(y, [(0, pad)]))
            masks.append(np.arange(n_max) < x.shape[0])
        if len(dims) != 1:
            raise ValueError(f"HM1: every client needs the same number of covariates; got {sorted(dims)}")
        if self.subset_size is not None and not 1 <= self.subset_size <= len(clients):
            raise ValueError(f"subset_size={self.subset_size}: must be between 1 and {len(clients)} clients")
        f = jnp.float32
        return {"x": jnp.asarray(np.stack(xs), f), "y": jnp.asarray(np.stack(ys), f),
                "mask": jnp.asarray(np.stack(masks), f)}, dims.pop()

    def run(self, rng_key: jax.Array, num_rounds: int, clients: Clients, *,
            truth: Optional[jax.Array] = None, init_state: Optional[HM1ServerState] = None) -> HM1Result:
        """``num_rounds`` communication rounds (one jit-compiled ``lax.scan``).

        ``Theta`` starts at small random values (``N(0, 0.01^2)``) and ``Omega`` at ``I``.
        ``truth`` (``(K, d)``, for simulations) records ``||Theta - truth|| / sqrt(K)``.
        """
        if int(num_rounds) != num_rounds or num_rounds < 1:
            raise ValueError(f"num_rounds={num_rounds}: must be a positive integer")
        data, d = self._data(clients)
        k = len(clients)
        if (k, d) not in self._algs:  # one compiled round per shape
            self._algs[(k, d)] = hm1(k, d, lr=self.lr, shrinkage=self.shrinkage, alpha=self.alpha,
                                     local_steps=self.local_steps, batch_size=self.batch_size,
                                     subset_size=self.subset_size)
        alg = self._algs[(k, d)]
        k_init, k_theta, key = random.split(rng_key, 3)
        state = init_state
        if state is None:
            state = alg.init_server(k_init, 0.01 * random.normal(k_theta, (k, d)))
        target = jnp.zeros((k, d)) if truth is None else jnp.asarray(truth, jnp.float32)
        state, distance, n_active = _scan(alg, state, data, key, target, int(num_rounds))
        n = int(np.sum(np.asarray(n_active)))
        per = 4 * d  # theta_k up; theta_k and s_k down
        comm = Communication(int(num_rounds), per * n, 2 * per * n, n, n)
        return HM1Result(state.theta, state.omega, state, distance if truth is not None else jnp.zeros(0), comm)

    @staticmethod
    def predict(result: HM1Result, x: jax.Array, client_index: int) -> jax.Array:
        """``x @ theta_k`` for the client at ``client_index`` (run by that client)."""
        return jnp.asarray(x) @ result.theta[client_index]

    def as_dict(self, result: HM1Result, clients: Clients) -> Dict[str, jax.Array]:
        """``theta_k`` by client name."""
        return {name: result.theta[i] for i, name in enumerate(clients.names)}


@partial(jax.jit, static_argnums=(0, 5))
def _scan(alg, state, data, key, target, num_rounds):
    k = state.theta.shape[0]

    def body(carry, rng):
        s = carry
        k_clients, k_server = random.split(rng)
        msg = alg.broadcast(s)
        out = jax.vmap(alg.client_step)(random.split(k_clients, k), msg, data)
        n_active = jnp.sum(s.active)
        s = alg.server_step(k_server, s, out)
        return s, (jnp.linalg.norm(s.theta - target) / jnp.sqrt(k), n_active)

    state, (distance, n_active) = jax.lax.scan(body, state, random.split(key, num_rounds))
    return state, distance, n_active

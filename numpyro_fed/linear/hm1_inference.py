"""``HM1``: paper 004's structural-covariance multi-task linear regression (§3, Algorithm 1)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..backends.mapping import ClientPlan
from ..clients import Clients
from ..horizontal.inference import check_positive_int
from ..inference import FederatedInference, Setup
from ..protocol import RunResult, RunState
from .hm1_algorithm import hm1

__all__ = ["HM1"]

_DATA = (
    "HM1 fits y = x @ theta_k on every client: client {client!r} needs arrays '{x}' of shape "
    "(rows, d) and '{y}' of shape (rows,); got {got}"
)


class HM1(FederatedInference):
    """Multi-task linear regression with a learned device covariance ``Omega`` (paper 004 HM1).

    The MAP of ``Theta ~ MN(0, I, Omega)``, ``Y_k ~ N(X_k theta_k, sigma_k^2 I)`` by
    Algorithm 1 (see :mod:`numpyro_fed.linear.hm1_algorithm`): devices take ``local_steps``
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
        >>> res.params["theta"].shape, res.params["omega"].shape
        ((2, 3), (2, 2))
        >>> separate = nf.HM1(lr=0.05, shrinkage=0.0).run(jax.random.PRNGKey(0), 30, clients)
        >>> bool(np.abs(separate.params["theta"] - theta).max() < 1e-4)  # noise-free least squares
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
        self.lr, self.shrinkage, self.alpha = float(lr), shrinkage, float(alpha)
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.batch_size = None if batch_size is None else check_positive_int("batch_size", batch_size)
        self.subset_size = None if subset_size is None else check_positive_int("subset_size", subset_size)
        self.x, self.y = x, y
        self._truth = None
        self._init_inference()

    def _validate_inputs(self, clients) -> None:
        if not isinstance(clients, Clients):
            raise TypeError(f"HM1.run needs an nf.Clients object; got {type(clients).__name__}")

    def _build(self, clients: Clients) -> Setup:
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
        if self.batch_size is not None and self.batch_size > min(clients.num_rows.values()):
            raise ValueError(f"batch_size={self.batch_size}: larger than the smallest client's "
                             f"{min(clients.num_rows.values())} rows")
        f = jnp.float32
        data = {"x": jnp.asarray(np.stack(xs), f), "y": jnp.asarray(np.stack(ys), f),
                "mask": jnp.asarray(np.stack(masks), f)}
        d = dims.pop()
        plan = ClientPlan(clients.names, data, "vmap", None, np.array([clients.num_rows[n] for n in clients.names]))
        algorithm = hm1(len(clients), d, lr=self.lr, shrinkage=self.shrinkage, alpha=self.alpha,
                        local_steps=self.local_steps, batch_size=self.batch_size, subset_size=self.subset_size,
                        truth=self._truth)
        return Setup(clients, algorithm, plan, d, {})

    def _params(self, setup: Setup, state: RunState) -> Dict[str, jax.Array]:
        return {"theta": state.server.theta, "omega": state.server.omega}

    def _with_truth(self, truth) -> None:
        truth = None if truth is None else np.asarray(truth, np.float32)
        same = (truth is None and self._truth is None) or (
            truth is not None and self._truth is not None and np.array_equal(truth, self._truth))
        if not same:
            self._truth, self._setup_cache = truth, None  # the algorithm tracks another truth

    def init(self, rng_key: jax.Array, clients: Clients) -> RunState:
        """``Theta`` starts at small random values (``N(0, 0.01^2)``, the server's key) and ``Omega`` at ``I``."""
        return self._init(rng_key, clients)

    def run(self, rng_key: jax.Array, num_rounds: int, clients: Clients, *, truth: Optional[jax.Array] = None,
            **options: Any) -> RunResult:
        """``num_rounds`` communication rounds (one jit-compiled ``lax.scan`` by default).

        Args:
            truth: ``(K, d)`` true parameters of a simulation: ``info.distance`` records
                ``||Theta - truth|| / sqrt(K)`` per round (paper 004 Figure 3).
            **options: the backend's run options (``progress_bar`` defaults to ``False``).

        Returns:
            a :class:`~numpyro_fed.RunResult` with ``params = {"theta": (K, d), "omega": (K, K)}``
            (row k of ``theta`` is ``clients.names[k]``'s) and ``trace`` the change in ``Theta``
            per round.
        """
        self._with_truth(truth)
        options.setdefault("progress_bar", False)
        return self._run(rng_key, num_rounds, clients, **options)

    def load(self, path: str, clients: Clients) -> RunState:
        """A run state saved by :meth:`save`, for ``clients`` (pass as ``init_state=``)."""
        return self._load(path, clients)

    @staticmethod
    def predict(result: RunResult, x: jax.Array, client_index: int) -> jax.Array:
        """``x @ theta_k`` for the client at ``client_index`` (run by that client)."""
        return jnp.asarray(x) @ result.params["theta"][client_index]

    def as_dict(self, result: RunResult, clients: Clients) -> Dict[str, jax.Array]:
        """``theta_k`` by client name."""
        return {name: result.params["theta"][i] for i, name in enumerate(clients.names)}

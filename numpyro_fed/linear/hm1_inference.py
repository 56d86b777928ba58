"""``HM1``: Yue et al.'s (2022) structural-covariance multi-task linear regression (§3, Algorithm 1)."""

from __future__ import annotations

import warnings
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._validation import check_clients, check_positive_int
from ..check import Verdict, register_check, unchecked
from ..clients import Clients
from ..run.backends.mapping import ClientPlan
from ..run.inference import FederatedInference, Setup, reset_setup
from ..run.params import HM1Params
from ..run.protocol import RunResult, RunState
from ..warnings import UnconvergedWarning, find_stack_level
from .hm1_algorithm import GRADIENTS, hm1

__all__ = ["HM1", "UnconvergedWarning", "hm1_check"]

_MOVING = (
    "HM1: Theta still moved by {rel:.1%} of its root mean square in the last round (round {round}; the "
    "warning threshold is {tol:.0%}), so the result is not a converged estimate. Run more rounds, or "
    "lower lr (constant-step minibatch SGD keeps moving by about sqrt(lr * batch_size) times the noise; "
    "batch_size=None with gradient='mean' converges exactly). A change that grows from round to round "
    "means lr is too large for the summed step: keep lr * batch_size * E[x^2] well below 1."
)


_DATA = (
    "HM1 fits y = x @ theta_k on every client: client {client!r} needs arrays '{x}' of shape "
    "(rows, d) and '{y}' of shape (rows,); got {got}"
)


class HM1(FederatedInference):
    """Multi-task linear regression with a learned device covariance ``Omega`` (Yue et al. (2022) HM1).

    The MAP of ``Theta ~ MN(0, I, Omega)``, ``Y_k ~ N(X_k theta_k, sigma_k^2 I)`` by
    Algorithm 1 (see :mod:`numpyro_fed.linear.hm1_algorithm`): devices take ``local_steps``
    minibatch gradient steps on their own data, by default Algorithm 1's summed step
    ``theta_k += 2 lr X_b^T (Y_b - X_b theta_k)`` on ``batch_size`` rows, then a
    prior-shrinkage step towards the server's aggregate ``sum_i theta_i (Omega^-1)_{ik}``;
    the server updates ``Omega``. ``shrinkage=0`` gives K separate models trained the same
    way (the paper's baseline).

    The summed step is stable when ``lr`` times the largest eigenvalue of ``X_b^T X_b``
    stays below 1 (about ``lr * batch_size * E[x^2] < 1`` for standardised covariates):
    scale ``lr`` with ``1 / batch_size``. A run that blows up stops with
    :class:`~numpyro_fed.run.backends.NonFiniteError`; one whose ``Theta`` still moves in the last round
    warns (:class:`~numpyro_fed.warnings.UnconvergedWarning`).

    Algorithm 1's prior weight relative to the data depends on ``shrinkage``, ``local_steps``,
    ``batch_size`` and the (unit-free) noise level, so it is not the MAP of §3's ``L``; and
    with more devices than covariates (``K > d``) its ``Omega`` update is singular.
    ``noise_scaled=True`` and ``omega_df=nu`` give a well-behaved variant (see
    :mod:`~numpyro_fed.linear.hm1_algorithm` and docs/linear_models.md).

    Args:
        lr: local step size ``eta`` (Algorithm 1's ``eta_2``, which also scales its
            local steps).
        shrinkage: ``eta_2`` of the prior-shrinkage step (default ``lr``).
        alpha: ``Omega`` update proportion (paper default 0.1).
        local_steps: T gradient steps per round.
        batch_size: rows per local step, drawn without replacement; the paper does not
            state it. Default 10; a device with fewer rows uses all of them; ``None``:
            full-batch steps.
        gradient: ``"sum"`` (Algorithm 1, default) or ``"mean"`` (the summed step divided
            by the batch's rows: a step on the mean squared error).
        noise_scaled: the variant's shrinkage, scaled by each device's own noise estimate
            (which stays on the device) and taken inside every local step, so that a
            full-batch round's fixed point is §3's stationary point (``shrinkage`` unused).
        omega_df: ``nu`` of the variant's inverse-Wishart prior on ``Omega``
            (``None``: the paper's update).
        subset_size: devices per round (``None``: full participation).
        x: the name of the covariate array (rows, d) in each client's data.
        y: the name of the response array (rows,).
        convergence_tol: warn (:class:`UnconvergedWarning`) when ``Theta``'s change in the
            last round exceeds this fraction of its root mean square.

    Examples:
        >>> import jax, numpy as np, numpyro_fed as nf
        >>> rng = np.random.default_rng(0)
        >>> theta = rng.normal(size=(2, 3))
        >>> x = rng.normal(size=(120, 3)); g = np.repeat([0, 1], 60)
        >>> y = np.einsum("nd,nd->n", x, theta[g])
        >>> clients = nf.Clients.split(g, x=x, y=y)
        >>> res = nf.HM1().run(jax.random.PRNGKey(0), clients, 30)
        >>> res.params.theta.shape, res.params.omega.shape
        ((2, 3), (2, 2))
        >>> separate = nf.HM1(shrinkage=0.0).run(jax.random.PRNGKey(0), clients, 30)
        >>> bool(np.abs(separate.params.theta - theta).max() < 1e-4)  # noise-free least squares
        True
    """

    method = "hm1"
    family_run_options = ("truth",)
    setup_extra = int  # Setup.extra: the number of covariates
    params_type = HM1Params

    def __init__(self, *, lr: float = 0.01, shrinkage: Optional[float] = None, alpha: float = 0.1,
                 local_steps: int = 20, batch_size: Optional[int] = 10, gradient: str = "sum",
                 noise_scaled: bool = False, omega_df: Optional[float] = None, subset_size: Optional[int] = None,
                 x: str = "x", y: str = "y", convergence_tol: float = 0.05) -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr}: must be positive")
        if shrinkage is not None and shrinkage < 0:
            raise ValueError(f"shrinkage={shrinkage}: must be >= 0 (0 gives separate models)")
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha={alpha}: must be in [0, 1]")
        if gradient not in GRADIENTS:
            raise ValueError(f"gradient={gradient!r}: choose one of {GRADIENTS}")
        if noise_scaled and shrinkage is not None:
            raise ValueError(f"shrinkage={shrinkage} with noise_scaled=True: the variant weights the prior by each "
                             "device's noise estimate; leave shrinkage unset")
        if omega_df is not None and not omega_df > 0:
            raise ValueError(f"omega_df={omega_df}: must be positive (None: the paper's Omega update)")
        self.lr, self.shrinkage, self.alpha = float(lr), shrinkage, float(alpha)
        if not convergence_tol > 0:
            raise ValueError(f"convergence_tol={convergence_tol}: must be positive")
        self.gradient, self.noise_scaled = gradient, bool(noise_scaled)
        self.convergence_tol = float(convergence_tol)
        self.omega_df = None if omega_df is None else float(omega_df)
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.batch_size = None if batch_size is None else check_positive_int("batch_size", batch_size)
        self.subset_size = None if subset_size is None else check_positive_int("subset_size", subset_size)
        self.x, self.y = x, y
        self._truth = None
        super().__init__()

    def _validate_inputs(self, clients) -> None:
        check_clients(clients, "HM1.run/init")

    def _build(self, clients: Clients) -> Setup[int]:
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
        d = next(iter(dims))
        small = [n for n in clients.names if clients.num_rows[n] <= d]
        if self.noise_scaled and small:
            raise ValueError(f"noise_scaled=True needs more rows than covariates on every device to estimate "
                             f"its noise; clients {small} have at most d = {d} rows")
        f = jnp.float32
        data = {"x": jnp.asarray(np.stack(xs), f), "y": jnp.asarray(np.stack(ys), f),
                "mask": jnp.asarray(np.stack(masks), f)}
        plan = ClientPlan(clients.names, data, "vmap", None, np.array([clients.num_rows[n] for n in clients.names]))
        # one algorithm (so one compilation) per number of clients, dimension and truth: new
        # Clients of the same shape reuse it (the data are the compiled program's arguments)
        config = tuple(repr(getattr(self, a)) for a in ("lr", "shrinkage", "alpha", "local_steps", "batch_size",
                                                        "gradient", "noise_scaled", "omega_df", "subset_size"))
        key = (len(clients), d, config, None if self._truth is None else (self._truth.shape, self._truth.tobytes()))
        algorithms = self.__dict__.setdefault("_algorithms", {})
        if key not in algorithms:
            algorithms[key] = hm1(len(clients), d, lr=self.lr, shrinkage=self.shrinkage, alpha=self.alpha,
                                  local_steps=self.local_steps, batch_size=self.batch_size, gradient=self.gradient,
                                  noise_scaled=self.noise_scaled, omega_df=self.omega_df,
                                  subset_size=self.subset_size, truth=self._truth)
        algorithm = algorithms[key]
        return Setup(clients, algorithm, plan, int(d), {})

    def _params(self, setup: Setup, state: RunState) -> Dict[str, jax.Array]:
        return HM1Params(state.server.theta, state.server.omega)

    def _with_truth(self, truth) -> None:
        truth = None if truth is None else np.asarray(truth, np.float32)
        same = (truth is None and self._truth is None) or (
            truth is not None and self._truth is not None and np.array_equal(truth, self._truth))
        if not same:
            self._truth = truth
            reset_setup(self)  # the algorithm tracks another truth

    def _before_run(self, rng_key, num_rounds: int, clients, options: dict) -> None:
        """``run(..., truth=)``: ``(K, d)`` true parameters of a simulation: ``info.distance``
        records ``||Theta - truth|| / sqrt(K)`` per round (Yue et al. (2022) Figure 3). HM1's
        ``params`` are ``HM1Params(theta (K, d), omega (K, K))`` (row k of ``theta`` is
        ``clients.names[k]``'s) and its ``trace`` the change in ``Theta`` per round."""
        self._with_truth(options.pop("truth", None))

    def draw(self, rng_key, result, num_samples=None, *, client=None):
        """HM1 has no posterior to sample: it fits the MAP of ``Theta`` and ``Omega`` (Yue et al.
        (2022) Algorithm 1), a point estimate. Raises, naming where the estimate is."""
        raise TypeError("HM1 fits a point estimate (the MAP of Theta and Omega by Yue et al. (2022) Algorithm 1), "
                        "not a posterior: read result.params.theta (row k is client k's) and "
                        "result.params.omega; for posterior draws of a hierarchical linear model use nf.fit or "
                        "nf.EP")

    @staticmethod
    def predict(result: RunResult, x: jax.Array, client_index: int) -> jax.Array:
        """``x @ theta_k`` for the client at ``client_index`` (run by that client)."""
        return jnp.asarray(x) @ result.params.theta[client_index]

    def as_dict(self, result: RunResult, clients: Clients) -> Dict[str, jax.Array]:
        """``theta_k`` by client name."""
        return {name: result.params.theta[i] for i, name in enumerate(clients.names)}


@register_check(HM1)
def hm1_check(inference: HM1, result: RunResult) -> Verdict:
    """HM1's check: ``"unconverged"`` (and a warning) when ``Theta``'s last change exceeds
    ``convergence_tol`` of its size."""
    change = np.asarray(result.info.change)
    if change.size == 0:
        return unchecked("the run had no round")
    theta = np.asarray(result.state.server.theta)
    size = float(np.sqrt(np.mean(theta ** 2)))
    rel = float(change[-1]) / max(size, 1e-12)
    figures = {"change": rel}
    if rel > inference.convergence_tol:
        warnings.warn(_MOVING.format(rel=rel, round=int(result.state.server.round), tol=inference.convergence_tol),
                      UnconvergedWarning, stacklevel=find_stack_level())
        return Verdict("unconverged", "convergence", f"Theta's last change was {rel:.3g} of its size", (), figures)
    return Verdict("ok", "convergence", f"Theta's last change was {rel:.3g} of its size", (), figures)

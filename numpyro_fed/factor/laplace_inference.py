"""``Laplace``: the federated Laplace approximation of a model's global sites, checked.

The first rung of :func:`numpyro_fed.fit`; usable on its own. The algorithm is
:func:`~numpyro_fed.factor.laplace_algorithm.federated_laplace`; this class turns a model into
its inputs and shares PVI's and EP's fit check, draws, ArviZ export and summaries (``q`` is
one Gaussian over the unconstrained global sites).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np

from .._validation import check_init, check_positive_int
from ..check import Verdict, register_check
from ..check.psis import FitDiagnostic
from ..model.structure import trace_model
from ..model.trace import nonfinite_sites, start_point
from ..run.backends.mapping import client_data
from ..run.inference import checked_network, fitted, with_exchange_traffic
from ..run.protocol import RunResult
from ..run.secure import check_aggregation
from ..terms.blocks import local_blocks as propose_blocks
from . import network_check
from .inference import FactorInference, keep_fit_check, q_check, q_diagnostic
from .laplace_algorithm import MAX_HALVINGS, federated_laplace

__all__ = ["Laplace", "NoModeError", "laplace_check"]

_NO_MODE = (
    "Laplace: no posterior mode was reached in {rounds} rounds ({why}). The log posterior is flat or rising along "
    "{sites}: with a flat (improper) prior on a site the data do not pin down the posterior is improper (give it a "
    "proper prior, e.g. dist.Normal(0, 10)); a logistic regression whose classes a covariate separates has no "
    "finite maximum (a proper prior fixes that too). Or the model's log density is not smooth there: use "
    "nf.fit(..., exact=True) (federated NUTS)"
)


_NO_START = (
    "Laplace: the log posterior is not finite at the search's start ({start}), so there is nothing to search "
    "from{where}. The model has no density there: where a parameter overflows, scale the covariates that enter it "
    "(centre each and divide by its sd) or give the sites a prior that starts where the model is defined; where "
    "it is nan or outside its support, the model computes it outside its domain. Or start elsewhere: "
    "nf.fit(..., init={{site: value}})"
)


def _start_message(inference: "Laplace", setup, result: RunResult) -> str:
    """Why the search never had a finite point: in simulation, the sites whose log density (or its
    gradient) is not finite at the start on the first client where the term is not (local latents
    at 0 in unconstrained space), and the parameters that overflowed there."""

    start = "init=" if inference.start_from is not None else "the prior's mean"
    if result.state.clients is None or inference.start is None:  # a network backend: the rows are on the nodes
        return _NO_START.format(start=start, where="")
    structure = setup.extra.structure
    for name in setup.inputs.names:
        args = setup.inputs[name]
        local = structure.local_layout(trace_model(inference.model, args, inference.model_kwargs))
        latent = {**structure.global_latent.unravel(np.asarray(inference.start, np.float32)),
                  **(local.unravel(np.zeros(local.size, np.float32)) if local.size else {})}
        kinds, parts = nonfinite_sites(inference.model, args, inference.model_kwargs, latent)
        if parts:
            return _NO_START.format(start=start, where=f": on client '{name}', " + "; ".join(parts))
    return _NO_START.format(start=start, where="")


class NoModeError(ValueError):
    """No posterior mode was reached; ``improper``: the weakest direction is one the prior leaves
    flat (the posterior is improper there), ``sites``: the sites along it; ``last``: ``(u, cov)``,
    the last point and the inverse of the negative Hessian there where that is positive definite
    (a preconditioner for MCMC), else ``None``."""

    def __init__(self, message: str, improper: bool, sites, last=None) -> None:
        super().__init__(message)
        self.improper, self.sites, self.last = improper, tuple(sites), last


class Laplace(FactorInference):
    """The federated Laplace approximation ``q = N(mode, (-H)^-1)`` of the global sites.

    Each round the server sends a point, every client returns its log-likelihood term there,
    with gradient and Hessian (its local latents integrated out on the client by an inner
    Laplace approximation, exact when they are conditionally Gaussian, block by block where
    they lie in a plate), and the server takes a Newton step with backtracking (see
    :mod:`~numpyro_fed.factor.laplace_algorithm`). Flat (improper) priors are accepted
    wherever the posterior is proper; an improper posterior (no mode) is refused, naming the
    sites. After ``run`` the fit is checked against the posterior as PVI's and EP's are
    (Pareto k and moments; ``last_fit_check``) and a poor fit warns.

    The search starts at the prior's mean where it is finite, else its median (NumPyro's
    ``init_to_median``; a flat prior: a uniform draw in (-2, 2) of unconstrained space), so a prior
    far from 0 costs no rounds; or where ``init`` says.

    Args:
        model: a NumPyro model; ``local_site`` latents never leave their client.
        tol: stop when the Newton decrement (the distance to the mode in posterior sds) is
            below this.
        inner_steps: Newton steps per round of each client's inner mode (warm-started).
        local_blocks: use the local latents' block structure (as :class:`~numpyro_fed.EP`).
        widen: also check ``q`` widened to this many times its sd (``None``: not), with the
            same number of draws, each client computing its term on its own rows as for the
            check of ``q`` itself; the result is :attr:`widened_check`. A too-narrow ``q`` never
            draws from the tails its own check would need to see; the widened draws reach them,
            and their weights correct ``q`` (:meth:`widened_result`). :func:`numpyro_fed.fit`
            uses ``widen=1.5``.
        secure_aggregation: ``None`` (each client's value, gradient and Hessian reach the
            server), or how they are summed so that the server sees only their sum each round:
            ``"masking"`` (pairwise masking with dropout recovery, no third party; Bonawitz et
            al. 2017) or ``"trusted"`` (a trusted aggregator); see :mod:`numpyro_fed.run.secure`.
            The inner decrement the stopping rule reads is then the root sum of the clients'
            squares.
        init: where the search starts: a dict ``{global site: value}`` (constrained; the other
            global sites at the prior's mean), or a NumPyro init strategy
            (``numpyro.infer.init_to_value(values=...)``, ``init_to_median()``,
            ``init_to_uniform()``, ...). A posterior with several modes (a mixture, whose
            components the prior treats alike) is searched from there; :attr:`start` is the flat
            unconstrained start after ``run``.
        client_mapping, row_plate, model_kwargs, check_fit: as :class:`~numpyro_fed.EP`.

    Examples:
        >>> import jax, numpy as np, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x, y):
        ...     b = numpyro.sample("b", dist.Normal(250.0, 100.0))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(b + x, 1.0), obs=y)
        >>> x = np.zeros(40); y = np.full(40, 260.0)
        >>> clients = nf.Clients.split(np.repeat([0, 1], 20), x=x, y=y)
        >>> laplace = nf.factor.Laplace(model)
        >>> res = laplace.run(jax.random.PRNGKey(0), clients)
        >>> print(f"{float(res.params.mean[0]):.2f}")  # 260 / (1 + 1 / (40 * 100**2)), about 260
        260.00
    """

    method = "laplace"
    open_ended = True
    prior_factor = "none"  # the server evaluates the prior itself each round (flat priors welcome)
    check_draws = 4000  # nf.fit's widened check uses as many: one compiled check serves both

    def __init__(self, model: Callable, *, tol: float = 1e-2, inner_steps: int = 8, local_blocks: bool = True,
                 client_mapping: str = "auto", row_plate: Optional[str] = None, model_kwargs: Optional[dict] = None,
                 check_fit: bool = True, widen: Optional[float] = None,
                 secure_aggregation: Optional[str] = None, init: Any = None) -> None:
        super().__init__(model, client_mapping=client_mapping, row_plate=row_plate, model_kwargs=model_kwargs,
                         check_fit=check_fit)
        self.start_from, self.start = check_init("Laplace", init), None  # (init: the method, as every family's)
        self.secure_aggregation = check_aggregation(secure_aggregation, "Laplace")
        if not tol > 0:
            raise ValueError(f"tol={tol}: must be positive")
        self.tol, self.inner_steps = float(tol), check_positive_int("inner_steps", inner_steps)
        self.local_blocks = bool(local_blocks)
        if widen is not None and not float(widen) > 1.0:
            raise ValueError(f"widen={widen}: must be above 1 (the widened q's sd over q's), or None")
        self.widen = None if widen is None else float(widen)
        self.widened_check: Optional[FitDiagnostic] = None
        self.blocks = None

    def _rounds(self, num_rounds: Optional[int], options: dict) -> int:
        """``run``: Newton rounds until the mode is reached, at most ``num_rounds`` (default 100),
        then the fit check; ``params`` are ``{"mean", "cov"}`` of ``q`` over the flat
        unconstrained global sites."""
        return 100 if num_rounds is None else num_rounds

    # ------------------------------------------------------------------ hooks
    def _algorithm(self, terms, plan, num_clients: int):

        self.blocks = propose_blocks(terms.local) if self.local_blocks else None
        start = start_point(self.model, client_data(plan, 0).args, self.model_kwargs, terms.layout, self.start_from,
                            local_names=terms.local.names)
        self.start = np.asarray(start)
        return federated_laplace(terms.log_prior, terms.log_joint, num_clients, start, num_local=terms.num_local,
                                 blocks=self.blocks, inner_steps=self.inner_steps, tol=self.tol,
                                 secure=self.secure_aggregation)

    def _widened(self, state):
        return state._replace(server=state.server._replace(q=state.server.q.scale(1.0 / self.widen**2)))

    def widened_result(self, result: RunResult) -> RunResult:
        """``result`` with ``q`` widened (``widen`` times its sd) and :attr:`widened_check` as its
        fit check, so that ``sample_posterior(..., corrected=True)`` (and ``nf.to_arviz(...,
        corrected=True)``) resample the widened check's draws by their importance weights."""
        if self.widened_check is None:
            raise ValueError("Laplace.widened_result needs the widened check of the last run: run with widen=...")
        wide = self._widened(result.state)
        keep_fit_check(self, self.widened_check, wide.server)
        return result._replace(state=wide)


@register_check(Laplace)
def laplace_check(inference: Laplace, result: RunResult) -> Verdict:
    """Laplace's fit check: raise :class:`NoModeError` where no mode was reached (naming the sites
    along the flat direction, and whether the prior leaves it improper); else the fit check of ``q``
    (:func:`~numpyro_fed.factor.inference.q_check`), then, with ``widen``, the widened one (the
    verdict's ``reports["widened"]``; ``None`` where some client did not answer)."""
    setup = fitted(inference)
    s = result.state.server
    if not bool(s.converged) and not float(s.value) > -np.finfo(np.asarray(s.value).dtype).max:
        raise ValueError(_start_message(inference, setup, result))  # never a finite point: nothing to search from
    if not bool(s.converged):
        layout = setup.extra.structure.global_latent
        owners = [n for n, shape in zip(layout.names, layout.shapes) for _ in range(int(np.prod(shape)))]
        # the weakest direction of the curvature, scale-free (unit diagonal): the sites along it
        precision = -np.asarray(s.hess, np.float64)
        diag = np.diag(precision)
        scaled = precision / np.sqrt(np.outer(np.abs(diag), np.abs(diag)) + 1e-300)
        lam, vec = np.linalg.eigh(scaled)
        weak = vec[:, 0] ** 2
        sites = sorted({owners[i] for i in np.flatnonzero((weak > 0.1) | (diag <= 0))})
        if float(s.decrement) >= 1e30:
            why = "the curvature of the log posterior at the last point is not negative definite"
        elif bool(s.stuck):
            why = f"the step was halved {MAX_HALVINGS} times without the log posterior rising"
        else:
            why = f"the last Newton decrement was {float(s.decrement):.3g} posterior sds, above tol={inference.tol}"
        # improper: no curvature along a direction the prior leaves flat (not a mode that Newton's
        # method did not reach in float precision, which exact NUTS can still sample)
        prior_hess = np.asarray(jax.hessian(setup.extra.terms.log_prior)(s.u), np.float64)
        flat = {owners[i] for i in np.flatnonzero(np.abs(np.diag(prior_hess)) <= 1e-12)}
        improper = bool(set(sites) & flat) and bool(np.any(diag <= 0) or lam[0] <= 1e-6)
        last = None
        if np.all(diag > 0) and lam[0] > 0:  # positive definite: its inverse, by the scale-free form
            inv = np.linalg.inv(scaled) / np.sqrt(np.outer(diag, diag))
            last = (np.asarray(s.u, np.float64), (inv + inv.T) / 2)
        err = NoModeError(_NO_MODE.format(rounds=int(s.round), why=why, sites=", ".join(sites)), improper, sites,
                          last)
        err.communication = result.communication  # what the search cost
        raise err
    verdict = q_check(inference, setup, result)
    inference.widened_check = None
    if inference.widen is None or inference.last_fit_check is None:
        return verdict
    wide = inference._widened(result.state)
    if wide.clients is not None:
        inference.widened_check = inference.diagnose(wide, num_draws=inference.check_draws)
        return verdict._replace(reports={**verdict.reports, "widened": inference.widened_check})
    checked = result._replace(state=wide, communication=verdict.communication or result.communication)
    log_w, u, _, exchanges = network_check.network_check(checked_network(inference), setup, checked,
                                                         inference.check_draws)
    communication = with_exchange_traffic(checked.communication, exchanges)
    if log_w is not None:  # (else some client did not answer: no widened check, as the caller sees)
        inference.widened_check = q_diagnostic(inference.model, inference.model_kwargs, setup, log_w, u)
    return verdict._replace(reports={**verdict.reports, "widened": inference.widened_check},
                            communication=communication)

"""``FederatedNUTS`` and ``FederatedHMC``: exact MCMC of the pooled posterior, mirroring
``numpyro.infer.MCMC(NUTS(model))``.

The chain is NumPyro's NUTS (or HMC) on the pooled model with a diagonal mass matrix,
run as one leapfrog step per communication round (:mod:`~numpyro_fed.mcmc.nuts_algorithm`):
the server holds the global sites' draws, each client its own local sites' draws, and
nothing but the global position, gradients with respect to it and scalars crosses.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, substitute, trace

from .._validation import check_clients, check_model, check_positive_int, check_positive_number
from ..check import Verdict, register_check
from ..check.chains import R_HAT_LIMIT, chain_report, chains_verdict
from ..check.energy import E_BFMI_LIMIT, energy_report
from ..clients import Clients
from ..model.groups import size_group_plates, trim_groups
from ..model.handlers import GLOBAL, LOCAL, site_role
from ..model.pointwise import enumeration_dependent, observed_terms
from ..model.structure import (
    ModelStructure,
    analyse_model,
    is_latent,
    log_joint,
    trace_model,
    with_improper_values,
)
from ..model.trace import or_finite_point
from ..run.backends.mapping import client_data, client_item, plan_clients, unpadder
from ..run.budget import RoundBudgetError, partial_draws, stopped_message, traffic
from ..run.inference import FederatedInference, Setup, fitted, state_of
from ..run.params import DrawParams
from ..run.posterior import ChainPosterior
from ..run.protocol import RunResult, RunState
from ..run.secure import check_aggregation
from ..terms.model import global_values
from ..warnings import MCMCDiagnosticWarning, find_stack_level
from .adapt import window_table
from .nuts_algorithm import DONE, FAILED, MAX_INIT_TRIES, MCMCConfig, federated_mcmc

__all__ = ["FederatedHMC", "FederatedNUTS", "MCMCSetup", "mcmc_check"]

_UNKNOWN_CLIENT = "no client named {name!r}; clients are {names}"
_PARAMS = (
    "{cls}: the model has numpyro.param sites {names}; MCMC samples latent sites only (as NumPyro's MCMC, which "
    "would hold them at their initial values). Make them latent sample sites with a prior, or fit them with "
    "nf.FederatedSVI"
)
_FAILED_INIT = (
    "{cls}: chain(s) {chains} found no starting point with a finite potential energy and gradient in {tries} "
    "uniform draws in (-2, 2) of the unconstrained space (NumPyro's init_to_uniform): check the priors and the "
    "data (a likelihood that is -inf everywhere, an observed value outside its distribution's support)"
)
_UNFINISHED = (
    "Raise num_rounds, or make the trees shorter: a reparameterisation (a hierarchy's effects centred where their "
    "groups have many rows, non-centred where few) or a lower max_tree_depth (the draws then mix more slowly)"
)
_DIVERGED = (
    "{cls}: {count} of {total} post-warmup iterations diverged (chains {chains}): the draws may miss part of the "
    "posterior (a funnel or sharp curvature). Raise target_accept_prob (e.g. 0.95) or reparameterise (a "
    "hierarchy's effects non-centred where their groups have few rows, centred where many); "
    "sample_stats(result)['diverging'] and nf.to_arviz show where"
)
_R_HAT = (
    "{cls}: the chains disagree: split R-hat {r_hat:.3f} > {limit} for site '{site}' (unconstrained): they have "
    "not mixed. Run more warmup and draws, or check for a multimodal posterior"
)
_LOW_E_BFMI = (
    "{cls}: E-BFMI {e_bfmi:.2f} < {limit}: each iteration's momentum barely changes the energy against its spread "
    "over the posterior, so the chains explore it by a random walk and can miss part of it even where R-hat looks "
    "fine{carried}. Reparameterise the scale (a non-centred hierarchy: numpyro.infer.reparam.LocScaleReparam), or "
    "run longer"
)



class MCMCSetup(NamedTuple):
    """A federated MCMC set-up: the model's sites and the algorithm's configuration; ``affine``:
    ``(m, L)`` when the chains run in ``w`` with the global sites ``u = m + L w`` (preconditioned
    by a Laplace fit's covariance ``L L^T``), else ``None``."""

    structure: ModelStructure
    config: MCMCConfig
    affine: Optional[Tuple[jax.Array, jax.Array]] = None


def _potential_weight(prior_share: float):
    """A client's share of the pooled log density: its observed and local sites, and
    ``prior_share`` of the global prior (shares sum to 1 over the clients)."""

    def weight(site):
        if site["type"] != "sample":
            return False
        if site["is_observed"] or site_role(site) == LOCAL:
            return 1.0
        if is_latent(site) and site_role(site) == GLOBAL:
            return prior_share
        return False

    return weight


def _checked_init(cls: str, init) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """``init`` as ``(mean, scale)`` arrays: a 1-d finite mean and, of the same size, a vector of
    positive variances or a square covariance (``None`` stays ``None``)."""
    if init is None:
        return None
    try:
        mean, scale = init
    except (TypeError, ValueError):
        raise ValueError(f"{cls}: init must be a pair (mean, cov) of the flat unconstrained global sites, "
                         f"e.g. a Laplace fit's (params.mean, params.cov)") from None
    mean, scale = np.asarray(mean), np.asarray(scale)
    d = mean.shape[0] if mean.ndim == 1 else -1
    if d < 0 or not np.all(np.isfinite(mean)) or scale.shape not in ((d,), (d, d)) or not np.all(np.isfinite(scale)):
        raise ValueError(f"{cls}: init=(mean, cov) needs a finite 1-d mean and, of its size, finite variances "
                         f"(a vector) or a covariance (a square matrix); got shapes {mean.shape} and {scale.shape}")
    if scale.ndim == 1 and not np.all(scale > 0):
        raise ValueError(f"{cls}: init's variances must be positive")
    return mean, scale


class FederatedMCMC(FederatedInference):
    """Base class of :class:`FederatedNUTS` and :class:`FederatedHMC` (not used directly)."""

    algo = "NUTS"
    setup_extra = MCMCSetup
    params_type = DrawParams
    open_ended = True
    _num_rounds = 0  # the bound of the last run (its num_rounds)

    def __init__(
        self,
        model: Callable,
        *,
        num_warmup: int = 500,
        num_samples: int = 1000,
        num_chains: int = 1,
        step_size: float = 1.0,
        adapt_step_size: bool = True,
        adapt_mass_matrix: bool = True,
        target_accept_prob: float = 0.8,
        max_tree_depth: int = 10,
        trajectory_length: Optional[float] = 2 * np.pi,
        num_steps: Optional[int] = None,
        client_mapping: str = "auto",
        row_plate: Optional[str] = None,
        model_kwargs: Optional[dict] = None,
        init: Optional[Tuple[Any, Any]] = None,
        secure_aggregation: Optional[str] = None,
    ) -> None:
        check_model(model)
        self.secure_aggregation = check_aggregation(secure_aggregation, type(self).__name__)
        self.model = with_improper_values(model)
        self.num_warmup = int(num_warmup)
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup={num_warmup}: must be 0 or more")
        self.num_samples = check_positive_int("num_samples", num_samples)
        self.num_chains = check_positive_int("num_chains", num_chains)
        self.step_size = check_positive_number(type(self).__name__, "step_size", step_size)
        self.adapt_step_size, self.adapt_mass_matrix = bool(adapt_step_size), bool(adapt_mass_matrix)
        self.target_accept_prob = float(target_accept_prob)
        if not 0.0 < self.target_accept_prob < 1.0:
            raise ValueError(f"target_accept_prob={target_accept_prob}: must be in (0, 1)")
        self.max_tree_depth = check_positive_int("max_tree_depth", max_tree_depth)
        self.num_steps = None if num_steps is None else check_positive_int("num_steps", num_steps)
        self.trajectory_length = None if self.num_steps is not None else float(trajectory_length)
        self.client_mapping, self.row_plate = client_mapping, row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self.init_moments = _checked_init(type(self).__name__, init)
        super().__init__()

    # ------------------------------------------------------------------ run
    def _rounds(self, num_rounds: Optional[int], options: dict) -> int:
        """``run``'s ``num_rounds`` is a bound (default: enough for every tree at ``max_tree_depth``):
        the run ends when every chain has its ``num_warmup + num_samples`` iterations, one
        leapfrog step per round; a run whose pace projects more rounds than the bound stops
        before it spends them (:class:`~numpyro_fed.run.budget.Pace`) and raises
        :class:`~numpyro_fed.run.budget.RoundBudgetError` with the draws it has."""
        if num_rounds is None:  # every tree at full depth (HMC: 1024 steps), the set-up's retries, the last round
            per_iteration = 2 ** self.max_tree_depth if self.algo == "NUTS" else (self.num_steps or 2 ** 10)
            num_rounds = (self.num_warmup + self.num_samples) * per_iteration + MAX_INIT_TRIES + 2
        self._num_rounds = int(num_rounds)
        return num_rounds

    # ------------------------------------------------------------------ set-up
    _size_group_plates = size_group_plates

    def _validate_inputs(self, clients) -> None:
        check_clients(clients, type(self).__name__)

    def _build(self, clients: Clients) -> Setup[MCMCSetup]:
        structure = analyse_model(self.model, clients, self.model_kwargs)
        params = sorted(structure.global_param) + list(structure.local_param_names)
        if params:
            raise ValueError(_PARAMS.format(cls=type(self).__name__, names=params))
        plan, structure = plan_clients(self.model, self.model_kwargs, clients, structure, self.client_mapping,
                                       self.row_plate)
        model, kwargs, weight = self.model, self.model_kwargs, _potential_weight(1.0 / len(clients))

        def layout_of(data):
            return structure.local_layout(trace_model(model, data.args, kwargs))

        def potential(theta, z, data):
            latent = {**structure.global_latent.unravel(theta), **layout_of(data).unravel(z)}
            return -log_joint(model, data.args, kwargs, latent, {}, weight, structure.row_plate, data.row_mask)

        def local_mask(data):
            return layout_of(data).flat_mask(data.row_mask, data.args)

        start, scale, affine = *(self.init_moments or (None, None)), None
        if self.init_moments is not None and np.shape(start) != (structure.global_latent.size,):
            raise ValueError(f"{type(self).__name__}: init's mean has shape {np.shape(start)}; the model's flat "
                             f"unconstrained global sites ({', '.join(structure.global_latent.names)}) have "
                             f"{structure.global_latent.size} entries")
        if scale is not None and np.ndim(scale) == 2:  # a dense covariance: run the chains in w, u = m + L w
            dtype = jnp.result_type(float)
            m, chol = jnp.asarray(start, dtype), jnp.linalg.cholesky(jnp.asarray(scale, dtype))
            if not bool(jnp.all(jnp.isfinite(chol))):
                raise ValueError(f"{type(self).__name__}: the covariance to precondition with is not positive definite")
            affine, base = (m, chol), potential

            def potential(w, z, data):  # noqa: F811 - the model's potential at u = m + L w (constant Jacobian)
                return base(m + chol @ w, z, data)

            start, scale = jnp.zeros_like(m), jnp.ones_like(m)
        config = MCMCConfig(
            potential, local_mask, structure.global_latent.size, len(clients), self.num_warmup, self.num_samples,
            self.num_chains, self.algo, self.max_tree_depth, 1000.0, self.target_accept_prob, self.step_size,
            self.adapt_step_size, self.adapt_mass_matrix, self.trajectory_length, self.num_steps,
            jnp.asarray(window_table(self.num_warmup)), jnp.result_type(float), start, scale,
            self.secure_aggregation)
        return Setup(clients, federated_mcmc(config), plan, MCMCSetup(structure, config, affine), {})

    def _params(self, setup: Setup, state: RunState) -> Dict[str, jax.Array]:
        return DrawParams(global_values(self.model, self.model_kwargs, setup, self._positions(setup, state)))

    @staticmethod
    def _positions(setup: Setup, state: RunState) -> jax.Array:
        """The chains' draws of the flat unconstrained global sites, ``(chains, samples, d)``
        (mapped back from the preconditioned coordinates when the chains ran in them)."""
        draws = state.server.draws
        if setup.extra.affine is None:
            return draws
        m, chol = setup.extra.affine
        return m + draws @ chol.T

    def _warn_diagnostics(self, setup: Setup, result: RunResult) -> None:
        """Warn, as a careful NumPyro user would check, when post-warmup iterations diverged, the
        E-BFMI is low (:mod:`~numpyro_fed.check.energy`), or (several chains) a global coordinate's
        split R-hat is above :data:`R_HAT_LIMIT`."""
        cls = type(self).__name__
        diverging = self.sample_stats(result)["diverging"]
        if diverging.any():
            warnings.warn(_DIVERGED.format(cls=cls, count=int(diverging.sum()), total=diverging.size,
                                           chains=np.nonzero(diverging.any(axis=1))[0].tolist()),
                          MCMCDiagnosticWarning, stacklevel=find_stack_level())
        draws = np.asarray(self._positions(setup, result.state))
        layout, at, by_site = setup.extra.structure.global_latent, 0, {}
        for name, shape in zip(layout.names, layout.shapes):
            size = int(np.prod(shape))
            by_site[name], at = draws[..., at:at + size], at + size
        energy = energy_report(self.sample_stats(result)["energy"], by_site)
        if energy["e_bfmi"] < E_BFMI_LIMIT:
            carried = energy["energy_sites"]
            warnings.warn(_LOW_E_BFMI.format(cls=cls, e_bfmi=energy["e_bfmi"], limit=E_BFMI_LIMIT,
                                             carried=f" (the energy is carried by {', '.join(carried)})"
                                             if carried else ""), MCMCDiagnosticWarning, stacklevel=find_stack_level())
        if draws.shape[0] > 1 and draws.shape[1] > 3:
            report = chain_report(by_site)
            if report.not_converged:
                warnings.warn(_R_HAT.format(cls=cls, r_hat=report.max_r_hat, site=report.not_converged[0],
                                            limit=R_HAT_LIMIT), MCMCDiagnosticWarning, stacklevel=find_stack_level())

    # ------------------------------------------------------------------ draws
    def posterior(self, result: Union[RunResult, RunState]) -> ChainPosterior:
        """The chains' draws, constrained (:class:`~numpyro_fed.run.posterior.ChainPosterior`, read by
        ``get_samples`` and ``sample_posterior``): the global sites (and the deterministic sites
        of the global sites alone); with ``client``, that client's local latent sites and the
        model's deterministic sites on its rows as well, read from the client's own state (in a
        deployment, run on that client)."""
        state = state_of(self, result)
        setup = fitted(self)

        def draws(client):
            if client is None:
                return global_values(self.model, self.model_kwargs, setup, self._positions(setup, state))
            return self._client_draws(setup, state, client)

        return ChainPosterior(draws)

    def _client_unpadded(self, setup: Setup, state: RunState, client: str):
        """Client ``client``'s local draws ``(chains, samples, n_j)`` in the layout of its
        real rows, the layout and its real data."""
        if client not in setup.inputs:
            raise KeyError(_UNKNOWN_CLIENT.format(name=client, names=list(setup.inputs.names)))
        plan, structure = setup.plan, setup.extra.structure
        j = plan.names.index(client)
        data = client_data(plan, j)
        layout = structure.local_layout(trace_model(self.model, data.args, self.model_kwargs))
        args = setup.inputs[client]
        real = structure.local_layout(trace_model(self.model, args, self.model_kwargs))
        n = int(plan.num_rows[j])
        z = client_item(plan, state.clients, j).state.draws

        return jax.vmap(jax.vmap(unpadder(layout, real, n)))(z), real, args

    def _client_trace(self, setup: Setup, theta, z, real, args, rng_key):
        """The model on the client's rows at one draw (unconstrained global and local values)."""
        structure = setup.extra.structure
        latent = {**structure.global_latent.unravel(theta), **real.unravel(z)}

        def sub(msg):
            if msg["type"] == "sample" and msg["name"] in latent:
                return biject_to(msg["fn"].support)(latent[msg["name"]])
            return None

        return trace(substitute(seed(self.model, rng_key), substitute_fn=or_finite_point(sub))).get_trace(
            **dict(args), **self.model_kwargs), latent

    def _client_draws(self, setup: Setup, state: RunState, client: str) -> Dict[str, jax.Array]:
        z_local, real, args = self._client_unpadded(setup, state, client)
        key = ("client_draws", client)
        if key not in setup.cache:  # probed and compiled once per client and set-up
            # a deterministic site of an enumerated (summed-out) site has no draw: left out, never computed at
            # a value of it drawn from its prior
            enumerated = setup.extra.structure.enumerated
            skip = enumeration_dependent(self.model, args, self.model_kwargs) if enumerated else ()

            def one(theta, z):
                tr, latent = self._client_trace(setup, theta, z, real, args, random.PRNGKey(0))
                values = {n: tr[n]["value"] for n in latent}
                values.update({n: s["value"] for n, s in tr.items() if s["type"] == "deterministic" and n not in skip})
                return values

            setup.cache[key] = jax.jit(jax.vmap(jax.vmap(one)))
        return trim_groups(setup.cache[key](self._positions(setup, state), z_local), real, args)

    def log_likelihood(self, rng_key: jax.Array, result: Union[RunResult, RunState],
                       num_samples: Optional[int] = None, client: Optional[str] = None) -> tuple:
        """Pointwise log-likelihood and posterior predictive draws on ``client``'s rows at every
        draw of the chains (``num_samples`` is not used: the draws are the chains'), the
        client's own computation on its own data and local draws.

        Returns:
            ``(log_likelihood, posterior_predictive)``: dicts ``observed site ->
            (num_chains * num_samples, *site batch shape)``.
        """
        state = state_of(self, result)
        setup = fitted(self)
        z_local, real, args = self._client_unpadded(setup, state, client)
        positions = self._positions(setup, state)
        theta = jnp.reshape(positions, (-1, positions.shape[-1]))
        z_local = jnp.reshape(z_local, (theta.shape[0], z_local.shape[-1]))  # (no local sites: width 0)
        keys = random.split(rng_key, theta.shape[0])

        def one(th, z, key):
            tr, latent = self._client_trace(setup, th, z, real, args, random.PRNGKey(0))
            return observed_terms(self.model, args, self.model_kwargs, {n: tr[n]["value"] for n in latent}, key)

        key = ("pointwise", client)
        if key not in setup.cache:  # compiled once per client and set-up
            setup.cache[key] = jax.jit(jax.vmap(one))
        return setup.cache[key](theta, z_local, keys)

    def observed(self, clients: Clients, client: str) -> Dict[str, jax.Array]:
        """Values of a client's observed sites (the client's own data)."""
        tr = trace_model(self.model, clients[client], self.model_kwargs)
        return {n: s["value"] for n, s in tr.items() if s["type"] == "sample" and s["is_observed"]}

    def communication_per_draw(self, result: RunResult) -> Dict[str, float]:
        """What the run's draws cost in communication: rounds and bytes (both ways) in all,
        per draw (over every chain) and per effective sample (the smallest bulk ESS over the
        global scalars, NumPyro's ``effective_sample_size`` over the chains)."""
        from numpyro.diagnostics import effective_sample_size

        draws = np.asarray(self._positions(fitted(self), state_of(self, result)))  # (chains, samples, d)
        ess = min(float(effective_sample_size(draws[..., i])) for i in range(draws.shape[-1]))
        comm = result.communication
        total_bytes = comm.bytes_up + comm.bytes_down
        n = draws.shape[0] * draws.shape[1]
        return {"rounds": comm.rounds, "bytes": total_bytes, "draws": n, "min_ess": ess,
                "rounds_per_draw": comm.rounds / n, "bytes_per_draw": total_bytes / n,
                "rounds_per_ess": comm.rounds / ess, "bytes_per_ess": total_bytes / ess}

    def mixing(self, result: RunResult) -> Dict:
        """The chains' diagnostics over the global scalars, as :meth:`FederatedMwG.mixing
        <numpyro_fed.mcmc.FederatedMwG.mixing>` gives them: ``{"max_r_hat", "min_n_eff",
        "divergences", "not_converged", "unmixed", "constant"}`` (split R-hat, bulk ESS and the
        scalars that never move: :func:`~numpyro_fed.check.chains.chain_report`; the post-warmup
        divergent iterations, summed over the chains), and ``"e_bfmi"`` and ``"energy_sites"``: the
        chains' E-BFMI and, where it is low, the scalars that carry the energy
        (:func:`~numpyro_fed.check.energy.energy_report`)."""
        draws = {k: np.asarray(v) for k, v in self.get_samples(result, group_by_chain=True).items()}
        report = chain_report(draws)
        stats = self.sample_stats(result)
        return {"max_r_hat": report.max_r_hat, "min_n_eff": report.min_n_eff,
                "divergences": float(stats["diverging"].sum()), "not_converged": report.not_converged,
                "unmixed": report.unmixed, "constant": report.constant, **energy_report(stats["energy"], draws)}

    def sample_stats(self, result: Union[RunResult, RunState]) -> Dict[str, np.ndarray]:
        """Per chain and post-warmup iteration, as NumPyro's MCMC reports them (``diverging``,
        ``accept_prob``, ``num_steps``, ``tree_depth``, ``energy``, ``potential_energy``,
        ``step_size``), ``(num_chains, num_samples)``."""
        stats = state_of(self, result).server.stats
        return {k: np.asarray(v)[:, self.num_warmup:] for k, v in stats._asdict().items()}


class FederatedNUTS(FederatedMCMC):
    """Exact federated NUTS: NumPyro's iterative NUTS on the pooled posterior of the global
    and every client's local sites, one leapfrog step per communication round.

    The server holds the global position and momentum, draws the tree's directions and
    transitions and adapts the step size (dual averaging on the summed acceptance
    statistic) and the global block of a diagonal mass matrix; each client holds its local
    positions and momenta, draws its momenta from its own key, adapts its own mass block
    and keeps its local draws. Per round each client sends its potential term, its gradient
    with respect to the global sites, its kinetic energy and its share of the U-turn dot
    products; see :mod:`~numpyro_fed.mcmc.nuts_algorithm`. The chain equals NumPyro's
    ``NUTS(model, dense_mass=False)`` on the pooled model given the same starting point,
    momenta and key (``tests/test_federated_nuts.py``). Not differentially private: the
    sequence of gradients is a function of the clients' data (``docs/federated_mcmc.md``).

    Args:
        model: a NumPyro model annotated with :func:`~numpyro_fed.global_site` /
            :func:`~numpyro_fed.local_site`, called as ``model(**client_args, **model_kwargs)``;
            latent sample sites only (no ``numpyro.param``).
        num_warmup: warmup iterations per chain (adaptation; not kept), as NumPyro's ``MCMC``.
        num_samples: draws kept per chain.
        num_chains: chains, run side by side (vmapped), one leaf each per round.
        step_size: the initial step size.
        adapt_step_size: dual averaging of the step size during warmup (the server's).
        adapt_mass_matrix: Welford adaptation of the diagonal mass matrix during warmup (each
            party its own block).
        target_accept_prob: the dual averaging's target acceptance statistic.
        max_tree_depth: the largest tree is ``2**max_tree_depth - 1`` leapfrog steps (rounds).
        client_mapping: how the simulation maps clients (see :class:`~numpyro_fed.FederatedSVI`).
        row_plate: the plate that indexes rows, when padding is ambiguous.
        model_kwargs: non-data keyword arguments passed to every call of the model.
        init: ``(mean, cov)`` of the flat unconstrained global sites (in the model's site order),
            e.g. a :class:`~numpyro_fed.factor.Laplace` fit's ``(params.mean, params.cov)``: every
            chain starts at ``mean`` and runs preconditioned by ``cov`` (a covariance matrix: the
            chains move ``w`` with the global sites ``mean + L w``, ``L L^T = cov``, a constant
            Jacobian; a vector: the initial diagonal inverse mass matrix). ``None``: NumPyro's
            start, a uniform draw in (-2, 2) of the unconstrained space.
        secure_aggregation: ``None`` (each client's potential terms and gradients reach the
            server), or how they are summed so that the server sees only their sum each round:
            ``"masking"`` (pairwise masking with dropout recovery, no third party; Bonawitz et al.
            2017) or ``"trusted"`` (a trusted aggregator); see :mod:`numpyro_fed.run.secure`.

    Example:
        >>> import numpy as np, jax, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> clients = nf.Clients.split(np.arange(40) % 2, y=np.linspace(0.0, 2.0, 40))
        >>> nuts = nf.FederatedNUTS(model, num_warmup=100, num_samples=200)
        >>> result = nuts.run(jax.random.PRNGKey(0), clients)
        >>> draws = nuts.get_samples(result)
        >>> bool(abs(draws["mu"].mean() - 1.0) < 0.1), draws["mu"].shape
        (True, (200,))
    """

    method = "nuts"
    algo = "NUTS"

    def __init__(self, model: Callable, *, num_warmup: int = 500, num_samples: int = 1000, num_chains: int = 1,
                 step_size: float = 1.0, adapt_step_size: bool = True, adapt_mass_matrix: bool = True,
                 target_accept_prob: float = 0.8, max_tree_depth: int = 10, client_mapping: str = "auto",
                 row_plate: Optional[str] = None, model_kwargs: Optional[dict] = None,
                 init: Optional[Tuple[Any, Any]] = None, secure_aggregation: Optional[str] = None) -> None:
        super().__init__(model, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                         step_size=step_size, adapt_step_size=adapt_step_size, adapt_mass_matrix=adapt_mass_matrix,
                         target_accept_prob=target_accept_prob, max_tree_depth=max_tree_depth,
                         client_mapping=client_mapping, row_plate=row_plate, model_kwargs=model_kwargs, init=init,
                         secure_aggregation=secure_aggregation)


class FederatedHMC(FederatedMCMC):
    """Exact federated HMC with a fixed trajectory length (NumPyro's ``HMC``): every
    iteration ``ceil(trajectory_length / step_size)`` leapfrog steps (or ``num_steps``),
    one per round, then the server accepts or rejects from the summed energy. Arguments as
    :class:`FederatedNUTS`, plus ``trajectory_length`` (default ``2 pi``) or ``num_steps``."""

    method = "hmc"
    algo = "HMC"

    def __init__(self, model: Callable, *, num_warmup: int = 500, num_samples: int = 1000, num_chains: int = 1,
                 step_size: float = 1.0, adapt_step_size: bool = True, adapt_mass_matrix: bool = True,
                 target_accept_prob: float = 0.8, trajectory_length: float = 2 * np.pi,
                 num_steps: Optional[int] = None, client_mapping: str = "auto", row_plate: Optional[str] = None,
                 model_kwargs: Optional[dict] = None, init: Optional[Tuple[Any, Any]] = None,
                 secure_aggregation: Optional[str] = None) -> None:
        super().__init__(model, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                         step_size=step_size, adapt_step_size=adapt_step_size, adapt_mass_matrix=adapt_mass_matrix,
                         target_accept_prob=target_accept_prob, trajectory_length=trajectory_length,
                         num_steps=num_steps, client_mapping=client_mapping, row_plate=row_plate,
                         model_kwargs=model_kwargs, init=init, secure_aggregation=secure_aggregation)


@register_check(FederatedMCMC)
def mcmc_check(inference: FederatedMCMC, result: RunResult) -> Verdict:
    """Federated NUTS's and HMC's fit check: raise where a chain found no finite start or the run
    stopped before every chain finished; warn of divergences and of split R-hat above
    :data:`~numpyro_fed.check.chains.R_HAT_LIMIT`; the verdict from :meth:`FederatedMCMC.mixing`."""
    setup = fitted(inference)
    phase = np.asarray(result.state.server.phase)
    cls = type(inference).__name__
    if np.any(phase == FAILED):
        raise ValueError(_FAILED_INIT.format(cls=cls, chains=list(np.nonzero(phase == FAILED)[0]),
                                            tries=MAX_INIT_TRIES))
    done = np.asarray(result.state.server.iteration)
    if np.any(phase < DONE):
        positions = partial_draws(FederatedMCMC._positions(setup, result.state), done, inference.num_warmup)
        raise RoundBudgetError(
            stopped_message(cls, int(result.communication.rounds), inference._num_rounds, result.projected_rounds,
                            done.tolist(), inference.num_warmup + inference.num_samples, inference.num_warmup,
                            _UNFINISHED, traffic(result)),
            rounds=int(result.communication.rounds), max_rounds=inference._num_rounds,
            projected_rounds=result.projected_rounds, bytes=traffic(result),
            samples=global_values(inference.model, inference.model_kwargs, setup, jnp.asarray(positions))
            if positions.shape[1] else {})
    inference._warn_diagnostics(setup, result)
    return chains_verdict(inference.mixing(result))

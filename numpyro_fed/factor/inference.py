"""What PVI and EP share at the model level: Gaussian factors over the global sites.

Both keep ``q(theta) ∝ p(theta) prod_j t_j(theta)`` in one Gaussian family over the flat
unconstrained global latent sites, run the same protocol
(:func:`~numpyro_fed.factor.updates.factor_protocol`) and differ only in the client's local
fit. This module turns an annotated model and an :class:`~numpyro_fed.Clients` into that
protocol's inputs (the prior factor, each client's log-likelihood with and without its
local latent sites) and hands the algorithm to the backend.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Dict, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from .._validation import check_clients, check_positive_int
from ..check import Verdict, from_diagnostic, register_check, unchecked
from ..check.psis import (
    MEAN_MARGIN,
    SD_MARGIN,
    FitDiagnostic,
    describe_biased,
    fit_diagnostic,
    importance_resample,
    state_fingerprint,
)
from ..clients import Clients
from ..dp.plan import refuse_dp
from ..model.groups import size_group_plates
from ..model.structure import (
    latent_supports,
    with_improper_values,
)
from ..run.inference import (
    NUM_SAMPLES,
    FederatedInference,
    Setup,
    checked_network,
    fitted,
    state_of,
    with_exchange_traffic,
)
from ..run.params import GaussianParams
from ..run.protocol import RunResult, RunState
from ..terms import gaussian as G
from ..terms.blocks import QUADRATURE_NODES, blocks_hold
from ..terms.blocks import local_blocks as propose_blocks
from ..terms.local_check import client_check_keys, local_integral_checks, local_note, log_weight_estimator
from ..terms.model import ModelTerms, TermsSetup, build_terms, global_values, local_joint, user_space
from ..terms.tilted import PARETO_K_LIMIT
from ..warnings import (
    BiasedFitWarning,
    InvalidUpdateWarning,
    UncheckedFitWarning,
    UnreliableFitWarning,
    find_stack_level,
)
from . import network_check
from .messages import ALL_INVALID, K_ADVICE, NEVER_APPLIED, NOT_CHECKED, Q_BIASED, Q_UNRELIABLE, REJECTED, UNCHECKED_FIT
from .pointwise import client_pass, observed_terms_at
from .updates import SCHEDULES

__all__ = ["FactorInference", "ModelTerms", "factor_check", "latent_supports", "q_check", "set_schedule"]

_SUBSET = "subset_size={size}: must be between 1 and the {J} clients"


FactorSetup = TermsSetup  # Setup.extra of PVI, EP, BCM and Laplace: the model's structure and its terms


class FactorInference(FederatedInference):
    """Base of :class:`~numpyro_fed.PVI` and :class:`~numpyro_fed.EP` (not used directly)."""

    method = "factor"
    setup_extra = FactorSetup  # Setup.extra
    params_type = GaussianParams
    check_draws = 1000  # draws of run's fit check
    prior_factor = "gaussian"  # model_terms's prior factor: q = p prod_j t_j keeps the prior's Gaussian factor
    _checked_state = None  # the fingerprint of the state the last fit check was of
    #: the factor protocol's schedule of client updates (EP and PVI set it, :func:`set_schedule`; a Laplace
    #: search has none)
    schedule: Optional[str] = None
    _size_group_plates = size_group_plates

    def __init__(self, model, *, client_mapping, row_plate, model_kwargs, family: str = "full",
                 check_fit: bool = True) -> None:
        if family not in ("full", "diagonal"):
            raise ValueError(f"family={family!r}: choose 'full' or 'diagonal'")
        self.model = with_improper_values(model)
        self.family = family
        self.client_mapping, self.row_plate = client_mapping, row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self.check_fit = bool(check_fit)
        self.last_fit_check: Optional[FitDiagnostic] = None  # the last run's check of q (check_fit)
        self.last_fit_check_skipped: Optional[str] = None  # why the last run's q was not checked
        super().__init__()

    # ------------------------------------------------------------------ hooks
    def _check_structure(self, structure) -> None:
        """Raise for models this method cannot fit."""

    def _adjust_structure(self, clients: Clients, structure):
        return structure

    def _algorithm(self, terms: ModelTerms, plan, num_clients: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def _fit_advice(self) -> Dict[str, Any]:
        """What a failed local-fit check means for this method: ``stat`` (``what``,
        ``stat_name``, ``fix``: the convergence/divergence check), ``k`` (``what``, ``fix``:
        the Pareto-k check) and ``invalid`` (why a fit can come back invalid)."""
        return {"stat": ("the local fit failed its check", "statistic", ""), "k": K_ADVICE, "invalid": ""}

    # ------------------------------------------------------------------ set-up
    def _validate_inputs(self, clients) -> None:
        check_clients(clients, f"{type(self).__name__}.run/init")

    def _build(self, clients: Clients) -> Setup[FactorSetup]:
        if self.schedule == "subset" and self.subset_size > len(clients):
            raise ValueError(_SUBSET.format(size=self.subset_size, J=len(clients)))
        if not self.dp_mechanisms:
            refuse_dp(type(self).__name__, self.model, clients[clients.names[0]], self.model_kwargs)
        plan, extra = build_terms(self.model, self.model_kwargs, clients, cls=type(self).__name__,
                                  client_mapping=self.client_mapping, row_plate=self.row_plate,
                                  prior_factor=self.prior_factor, diagonal=self.family == "diagonal",
                                  check_structure=self._check_structure,
                                  adjust_structure=self._adjust_structure)
        algorithm = self._algorithm(extra.terms, plan, len(clients))
        return Setup(clients, algorithm, plan, extra, {})

    def _params(self, setup: Setup, state: RunState) -> Dict:
        return GaussianParams(*G.to_moments(state.server.q))

    def max_kl_for(self, dim: int) -> Optional[float]:
        """The trust region (nats) the server applies to a ``dim``-dimensional ``q``; ``None``: none."""
        value = getattr(self, "max_kl", None)
        return None if value == "auto" else value

    def _warn_rejected(self, setup: Setup, result: RunResult, start: int) -> None:
        """Warn of rounds whose valid updates the server's safeguard (positive definiteness, the
        trust region ``max_kl``) refused outright, naming them and their clients."""
        valid = np.asarray(result.info.valid)
        rejected = (valid.sum(axis=-1) > 0) & (np.asarray(result.info.damping) == 0)
        if not rejected.any():
            return
        max_kl = self.max_kl_for(setup.extra.terms.prior.shift.shape[0])
        names = setup.plan.names
        clients = sorted({names[j] for r in np.flatnonzero(rejected) for j in np.flatnonzero(valid[r])}, key=str)
        fix = ("Under dp='update_perturbation' a rejected round is one client's noise outweighing its change: more "
               "rows per shard (fewer num_shards), a larger epsilon, or trusted_aggregator=True lower the noise. "
               if getattr(self, "dp", None) == "update_perturbation" else "")
        fix += "Use damping < 1, or raise max_kl or max_halvings." if max_kl is not None else \
            "Use damping < 1, or raise max_halvings."
        warnings.warn(REJECTED.format(cls=type(self).__name__, rounds=_shown([int(start + r + 1) for r in
                                                                                 np.flatnonzero(rejected)]),
                                       clients=clients, halvings=self.max_halvings,
                                       kl=f" or moved it by more than max_kl={max_kl:g} nats" if max_kl else "",
                                       fix=fix), InvalidUpdateWarning, stacklevel=find_stack_level())

    def local_integral(self, setup: Setup, result) -> Optional[str]:
        """How the clients compute ``log p(y_j | theta)`` for the check: ``"exact"`` (no
        continuous local latents, or Gaussian ones given the global sites: Laplace is
        exact), ``"sampled"`` (importance sampling with the Laplace proposal, which every
        client found good enough on its own rows) or ``None`` (some client's proposal is
        not: the check would not be trustworthy). Each client decides on its own rows at
        ``q``'s mean; cached per state."""
        terms, plan = setup.extra.terms, setup.plan
        if not terms.num_local:
            return "exact"
        state = state_of(self, result)
        if self._blocks_verified(setup, state):
            return "quadrature"
        mean, _ = G.to_moments(state.server.q)
        gaussian, k_of = local_integral_checks(setup)
        keys = client_check_keys(setup.plan, state)
        if plan.mapping == "vmap":
            if bool(jnp.all(gaussian(mean, plan.data, random.PRNGKey(5)))):
                return "exact"
            k = np.asarray(k_of(mean, plan.data, keys))
        else:
            if all(bool(gaussian(mean, data, random.PRNGKey(5))) for data in plan.data):
                return "exact"
            k = np.array([float(k_of(mean, data, key)) for data, key in zip(plan.data, keys)])
        return "sampled" if np.all(k <= PARETO_K_LIMIT) else None

    def _check_blocks(self):
        """The local latents' blocks for block quadrature in the check: the fit's own (EP's
        block Laplace), else those the layout proposes (:func:`~numpyro_fed.terms.blocks.local_blocks`,
        for every algorithm and tilted method); ``None`` where there are none, a block has
        more than three coordinates, or EP was given ``local_blocks=False``."""
        blocks = getattr(self, "_blocks", None)
        if not getattr(self, "local_blocks", True):  # the user's word that the locals are coupled
            return None
        if blocks is None:
            blocks = propose_blocks(fitted(self).extra.terms.local)
        return blocks if blocks is not None and blocks.shape[1] in QUADRATURE_NODES else None

    def _blocks_verified(self, setup: Setup, state: RunState) -> bool:
        """Whether every client finds the proposed blocks true of its own rows (one exact
        Hessian-vector product at ``q``'s mean and a random point of the local latents, from
        the client's own key; :func:`~numpyro_fed.terms.blocks.blocks_hold`). Cached per set-up."""
        blocks = self._check_blocks()
        if blocks is None:
            return False
        if ("blocks_hold",) not in setup.cache:
            terms, plan = setup.extra.terms, setup.plan
            mean, _ = G.to_moments(state.server.q)
            index = jnp.asarray(blocks)

            def hold(data, key):
                point, probe = random.normal(key, (2, terms.num_local), mean.dtype)
                return blocks_hold(lambda v: terms.log_joint(jnp.concatenate([mean, v]), data), point, index, probe)

            keys = client_check_keys(setup.plan, state)
            if plan.mapping == "vmap":
                ok = bool(jnp.all(jax.jit(jax.vmap(hold))(plan.data, keys)))
            else:
                ok = all(bool(jax.jit(hold)(data, key)) for data, key in zip(plan.data, keys))
            setup.cache[("blocks_hold",)] = ok
        return setup.cache[("blocks_hold",)]

    def check_of(self, state: RunState) -> Optional[FitDiagnostic]:
        """The fit check of ``state``: the run's own when ``state`` is the run's result,
        otherwise computed now where it can be trusted, so corrected draws never come from
        another fit (``None``: no trustworthy check)."""
        if self.last_fit_check is not None and self._checked_state == state_fingerprint(
                state.server):
            return self.last_fit_check
        if not self.check_fit or state.clients is None or self.local_integral(fitted(self), state) is None:
            return None
        return self.diagnose(state, num_draws=self.check_draws)

    def diagnose(self, result: Union[RunResult, RunState], num_draws: int = 1000, rng_key=None) -> FitDiagnostic:
        """How far ``q`` is from the posterior of the global sites, by Pareto-smoothed
        importance sampling: the server draws ``u ~ q``, each client returns its own
        ``log p(y_j | u)`` per draw (local latents integrated by Laplace, importance-
        corrected where they are not Gaussian given the global sites; see
        :mod:`numpyro_fed.terms.local_check`), the server adds the prior and ``-log q(u)``. Also
        compares ``q``'s user-space moments with the weighted ones (see
        :mod:`numpyro_fed.check.psis`). ``run`` calls this (``check_fit=True``) and warns,
        unless some client's importance proposal for its local latents fails its own
        check (then ``last_fit_check_skipped`` says why, and a call here gives the
        plain-Laplace, approximate check). Simulation only.

        Returns:
            a :class:`~numpyro_fed.FitDiagnostic`.
        """
        setup = fitted(self)
        state = state_of(self, result)
        num_draws = check_positive_int("num_draws", num_draws)
        if state.clients is None:
            raise ValueError(f"{type(self).__name__}.diagnose needs the simulation's client states")
        rng_key = random.PRNGKey(0x51) if rng_key is None else rng_key
        how = self.local_integral(setup, state)
        key = ("log_weights", num_draws, how)
        if key not in setup.cache:  # compiled once per set-up
            terms = setup.extra.terms
            index = self._check_blocks() if how == "quadrature" else None
            setup.cache[key] = jax.jit(log_weight_estimator(terms.log_prior, terms.log_joint, terms.num_local,
                                                            setup.plan.mapping, num_draws, how == "sampled",
                                                            None if index is None else jnp.asarray(index)))
        log_w, u = setup.cache[key](state.server.q, setup.plan.data, rng_key, client_check_keys(setup.plan, state))
        return q_diagnostic(self.model, self.model_kwargs, setup, np.asarray(log_w, np.float64), u)

    def _check_local_fits(self, setup: Setup, result: RunResult, start: int) -> None:
        """Warn, naming clients and rounds, when a client's own check failed the local fit
        of its latest applied update (the one its factor in ``q`` mostly reflects; an
        earlier failure that a later passing fit superseded stays in ``info.fit_ok``). An
        invalid update is reported above."""
        info, names = result.info, setup.plan.names
        applied = np.asarray(info.valid) & (np.asarray(info.damping) > 0)[:, None]
        failed = applied & ~np.asarray(info.fit_ok)
        last = [np.flatnonzero(applied[:, j])[-1] if applied[:, j].any() else None for j in range(len(names))]
        bad = [j for j, r in enumerate(last) if r is not None and failed[r, j]]
        if not bad:
            return
        advice = self._fit_advice()
        k = np.asarray(info.fit_k)
        stat = np.asarray(info.fit_stat)
        # a failure with no statistic of its own (tilted="laplace" reports only k) is k's
        by_k = [j for j in bad if k[last[j], j] > PARETO_K_LIMIT or not np.isfinite(stat[last[j], j])]
        by_stat = [j for j in bad if j not in by_k]
        k_what, k_fix = advice["k"]
        for group, (what, stat_name, fix), values in ((by_stat, advice["stat"], stat),
                                                      (by_k, (k_what, "Pareto k", k_fix), k)):
            if not group:
                continue
            got = values[[last[j] for j in group], group]
            worst = float(np.nanmax(got)) if np.isfinite(got).any() else float("inf")
            rounds = sorted({int(start + last[j] + 1) for j in group})
            warnings.warn(UNCHECKED_FIT.format(cls=type(self).__name__, what=what, clients=[names[j] for j in group],
                                                rounds=_shown(rounds), stat_name=stat_name, stat=worst, fix=fix),
                          UnreliableFitWarning, stacklevel=find_stack_level())

    # ------------------------------------------------------------------ API
    # ------------------------------------------------------------------ a client's posterior
    def log_likelihood(self, rng_key: jax.Array, result, num_samples: int, client, corrected: bool = False) -> tuple:
        """Pointwise log-likelihood and posterior predictive draws on ``client``'s rows, at
        the draws of ``sample_posterior(..., client=client)`` (the global draws are the same for every client,
        so the clients' matrices stack into the pooled one). Computed by the client on its
        own rows; federated model comparison sends only sums (:func:`numpyro_fed.federated_loo`).
        ``corrected=True``: at the draws of ``sample_posterior(rng_key, result, num_samples,
        corrected=True)`` instead (the client's locals drawn given each).

        Returns:
            ``(log_likelihood, posterior_predictive)``: dicts ``observed site ->
            (num_samples, *site batch shape)``.
        """
        u = None
        if corrected:
            u = importance_resample(rng_key, self.check_of(state_of(self, result)),
                                    check_positive_int("num_samples", num_samples), type(self).__name__)
        _, log_lik, predictive = self._client_pass(rng_key, result, num_samples, client, u)
        return log_lik, predictive

    def pointwise_at(self, rng_key: jax.Array, draws: Dict[str, jax.Array], client) -> tuple:
        """``(log_likelihood, predictive)`` of ``client``'s rows at given constrained draws of
        every latent site (e.g. EP's ``local_posterior`` draws)."""
        return observed_terms_at(fitted(self), self.model, self.model_kwargs, rng_key, draws, client)

    def _client_pass(self, rng_key, result, num_samples, client, u=None):
        setup = fitted(self)
        joint = partial(local_joint, self.model, self.model_kwargs, setup.extra.structure)
        return client_pass(setup, state_of(self, result), self.model, self.model_kwargs, joint, type(self).__name__,
                           rng_key, check_positive_int("num_samples", num_samples), client, u)

    # ------------------------------------------------------------------ the check over a network
    def client_value_inputs(self, name: str, setup, data) -> Dict[str, Any]:
        """The structure of what the server sends for :meth:`client_value` ``name``."""
        return network_check.value_inputs(type(self).__name__, name, setup, self.check_draws)

    def client_value(self, name: str, setup, client_state, data, payload, rng_key=None) -> Dict[str, Any]:
        """On a client after a network run: its part of the fit check, from its own rows and
        its own key (``rng_key``, never sent)."""
        self.client_value_inputs(name, setup, data)
        return network_check.client_value(name, setup, data, payload, rng_key)

    def network_check(self, network, setup, result):
        """``(log_w, u, why, exchanges)`` of the fit check computed with the clients over
        ``network`` (:func:`numpyro_fed.factor.network_check.network_check`)."""
        return network_check.network_check(network, setup, result, self.check_draws)

    def draw(self, rng_key: jax.Array, result, num_samples: Optional[int] = None, *,
                         client: Optional[str] = None, corrected: bool = False) -> Dict[str, jax.Array]:
        """``num_samples`` (default 1000) draws of the global sites from ``q``, constrained, and
        of the model's ``numpyro.deterministic`` sites that are functions of the global sites
        alone (computed by the first client on its own rows; per-row and local ones have no
        value under ``q(z_G)`` and are left out). With ``client``: the same global draws and
        that client's local sites from the Laplace approximation of ``p(v | theta, y_j)`` at each
        draw (:mod:`numpyro_fed.factor.pointwise`; the client's own computation, on its own rows).

        ``corrected=True``: PSIS-corrected draws instead, the last fit check's draws
        resampled by their importance weights (needs that check, with Pareto k <= 0.7); with
        ``client``, that client's local sites drawn given each of them, as above."""
        setup = fitted(self)
        num_samples = check_positive_int("num_samples", NUM_SAMPLES if num_samples is None else num_samples)
        state = state_of(self, result)
        if client is not None:  # (corrected: the client's locals drawn given each corrected global draw)
            u = importance_resample(rng_key, self.check_of(state), num_samples, type(self).__name__) \
                if corrected else None
            return self._client_pass(rng_key, result, num_samples, client, u)[0]
        q = state.server.q
        if corrected:
            u = importance_resample(rng_key, self.check_of(state), num_samples, type(self).__name__)
        else:
            eps = random.normal(rng_key, (num_samples, q.shift.shape[0]))
            u = jax.vmap(lambda e: G.sample(q, e))(eps)
        return global_values(self.model, self.model_kwargs, setup, u)


def _shown(rounds):
    return rounds if len(rounds) <= 10 else rounds[:10] + ["..."]


def q_diagnostic(model, model_kwargs, setup, log_w, u) -> FitDiagnostic:
    """The fit check of draws ``u`` (``(n, d)``, flat unconstrained global sites) of ``q`` with
    log importance weights ``log_w``: Pareto k, and the moments per site and in the model's own
    sites (:func:`~numpyro_fed.check.psis.fit_diagnostic`)."""
    per_site = {k: np.asarray(v) for k, v in jax.vmap(setup.extra.structure.global_latent.unravel)(u).items()}
    return fit_diagnostic(log_w, user_space(model, model_kwargs, setup, u), np.asarray(u), per_site, shape=True)


def keep_fit_check(inference, check: FitDiagnostic, server) -> None:
    """Keep ``check`` as ``inference``'s fit check of the run state whose server part is ``server``:
    ``last_fit_check``, and what ``sample_posterior(..., corrected=True)`` resamples for that state."""
    inference.last_fit_check, inference._checked_state = check, state_fingerprint(server)


def set_schedule(inference: FactorInference, schedule: str, damping: float, subset_size: int,
                 max_halvings: int) -> None:
    """EP's and PVI's settings of the factor protocol (:func:`~numpyro_fed.factor.updates.factor_protocol`),
    checked: which clients update each round (``schedule``, ``subset_size``), the damping of their
    updates and how often the server may halve it."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
    if not 0 < damping <= 1:
        raise ValueError(f"damping={damping}: must be in (0, 1]")
    inference.schedule, inference.damping = schedule, float(damping)
    inference.subset_size = check_positive_int("subset_size", subset_size)
    inference.max_halvings = int(max_halvings)


@register_check(FactorInference)
def factor_check(inference: FactorInference, result: RunResult) -> Verdict:
    """The factor families' fit check: raise where no client's update ever applied; warn of rounds
    whose every update was invalid or refused, of local fits that stopped early; then
    :func:`q_check`."""
    setup = fitted(inference)
    cls, names = type(inference).__name__, setup.plan.names
    info = result.info
    answered = np.asarray(info.invalid) + np.asarray(info.valid).sum(axis=-1)
    damping = np.asarray(info.damping)
    dead = (answered > 0) & (np.asarray(info.valid).sum(axis=-1) == 0)
    start = int(result.state.round) - len(damping)
    # no client's update ever applied: q holds no data (the server's refinement of a non-Gaussian
    # prior's site may have moved it, but only towards the prior)
    applied = (np.asarray(info.valid).sum(axis=-1) > 0) & (damping > 0)
    if not applied.any() and int(result.state.round) == len(damping):
        why = ""
        if dead.any():
            bad = sorted({names[j] for r in np.flatnonzero(dead) for j in range(len(names))
                          if not np.asarray(info.valid)[r, j]})
            why = f"Every update was invalid (clients {bad}). {inference._fit_advice()['invalid']}"
        raise ValueError(NEVER_APPLIED.format(cls=cls, rounds=len(damping), why=why))
    if dead.any():
        rounds = [int(start + r + 1) for r in np.flatnonzero(dead)]
        warnings.warn(ALL_INVALID.format(cls=cls, rounds=_shown(rounds), clients=list(names),
                                          hint=inference._fit_advice()["invalid"]), InvalidUpdateWarning,
                      stacklevel=find_stack_level())
    inference._warn_rejected(setup, result, start)
    inference._check_local_fits(setup, result, start)
    return q_check(inference, setup, result)


def q_check(inference: FactorInference, setup: Setup, result: RunResult) -> Verdict:
    """The fit check of the final ``q`` against the full posterior (``diagnose``; over a network
    backend, each client computing its term on its node), and its warning."""
    inference.last_fit_check, inference.last_fit_check_skipped = None, None
    cls = type(inference).__name__
    if not inference.check_fit:
        return unchecked("check_fit=False")
    if inference.differentially_private:  # under DP: data-dependent sums
        return unchecked("a differentially private fit is not checked (the check sums data-dependent terms)")
    communication = None
    if result.state.clients is None:  # a network backend: each client computes its term on its node
        network = checked_network(inference)
        log_w, u, why, exchanges = (None, None, "this backend cannot ask the clients", []) if network is None \
            else inference.network_check(network, setup, result)
        communication = with_exchange_traffic(result.communication, exchanges)
        if why == "proposal":
            inference.last_fit_check_skipped = NOT_CHECKED.format(cls=cls)
            return unchecked(inference.last_fit_check_skipped, communication)
        if log_w is None:
            warnings.warn(f"{cls}: the fit check of q (Pareto k and moments against the posterior) needs every "
                          f"client's term, and {why}; check the fit in simulation, or pass check_fit=False to "
                          f"silence this", UncheckedFitWarning, stacklevel=find_stack_level())
            return unchecked(f"the check needs every client's term, and {why}", communication)
        check = inference.last_fit_check = q_diagnostic(inference.model, inference.model_kwargs, setup, log_w, u)
    else:
        if inference.local_integral(setup, result) is None:
            inference.last_fit_check_skipped = NOT_CHECKED.format(cls=cls)
            return unchecked(inference.last_fit_check_skipped)
        check = inference.last_fit_check = inference.diagnose(result, num_draws=inference.check_draws)
    keep_fit_check(inference, check, result.state.server)
    if check.verdict == "unreliable":
        warnings.warn(Q_UNRELIABLE.format(cls=cls, k=check.pareto_k, ess=check.ess, n=len(check.log_weights),
                                           local=local_note(setup)), UnreliableFitWarning,
                      stacklevel=find_stack_level())
    elif check.verdict == "biased":
        warnings.warn(Q_BIASED.format(cls=cls, k=check.pareto_k, n=len(check.log_weights),
                                       mean_margin=MEAN_MARGIN, sd_margin=SD_MARGIN,
                                       sites=describe_biased(check.biased), local=local_note(setup)),
                      BiasedFitWarning, stacklevel=find_stack_level())
    return from_diagnostic(check, communication)

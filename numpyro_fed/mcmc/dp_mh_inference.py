"""``DPMetropolis``: differentially private exact federated MCMC of the global sites.

The sampler is :mod:`~numpyro_fed.mcmc.dp_mh_algorithm` (random-walk Metropolis whose
acceptance each client feeds with a clipped, noised sum of its rows' log-likelihood ratios, the
server correcting for the noise by the penalty method). This module turns a ``dp_noise``-marked
model into its inputs, plans and accounts its privacy (one Gaussian release per chain, round
and client, accounted with ``dp-accounting``; a :class:`~numpyro_fed.dp.ledger.PrivacyLedger`
composes runs), and checks the chains.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .._validation import check_positive_int
from ..check import Verdict, register_check
from ..check.chains import chain_report, chains_verdict
from ..dp.control import ControlVariate, row_derivatives, widen
from ..dp.releases import capped_releases
from ..dp.rows import row_locals, row_terms
from ..dp.sampler_privacy import SamplerPrivacy, may_drop
from ..model.trace import prior_median
from ..run.backends.mapping import client_data
from ..run.inference import FederatedInference, Setup, fitted
from ..run.params import DrawParams
from ..run.posterior import ChainPosterior
from ..run.protocol import RunResult
from ..run.secure import check_aggregation
from ..terms.model import TermsSetup, user_space
from ..warnings import UncheckedFitWarning, UnreliableFitWarning, find_stack_level
from .dp_mh_algorithm import DPMHConfig, dp_metropolis

__all__ = ["DPMetropolis", "dp_metropolis_check"]

START_KEY = 0x5D  # the chains' starts are drawn from this public key (every party can rebuild them)

_NO_DP = (
    "DPMetropolis protects the rows of the model's observed sites, and the model marks none: wrap it in "
    "nf.dp_noise(model, clip=..., delta=..., epsilon=... or noise_multiplier=...). clip bounds each row's "
    "log-likelihood ratio between two points the chain compares"
)
_LOCALS = (
    "DPMetropolis protects rows, and local site(s) {names} are not in the row plate: a local latent shared by "
    "several rows (a per-client or per-group effect) is updated on its client from all those rows, so its hidden "
    "state carries every one of them into each release and a row-level guarantee does not follow from clipping "
    "each row's term. Local latents that belong to rows (inside the row plate) are supported"
)
_UNSEEN = (
    "{cls}: each client's count of clipped row ratios stays on its node (over a network backend), so the server "
    "cannot tell whether the clip bound; where it did, the chains target the posterior with those ratios clipped. "
    "Check the same fit in simulation, where the counts are read"
)
_LOCAL_DRAWS = (
    "DPMetropolis: client {client!r}'s local latents are drawn on it and never sent, and reading them back is not "
    "offered: the draws here are the global sites'"
)
_CLIPPED = (
    "{cls}: client(s) {clients} clipped {rows} row log-likelihood ratio(s) in all (|ratio| > clip = {clip:g}): the "
    "chains then target the posterior with those ratios clipped, not the posterior itself. Raise dp_noise's clip "
    "(more noise for the same epsilon), or start nearer the mode (init=) with a smaller proposal"
)


_CONTROL_LOCALS = (
    "DPMetropolis(control=...) expands each row's log-likelihood about the private start, and local site(s) "
    "{names} make a row's term depend on its latents, which move every round (the start's released sums are of "
    "their Laplace marginals, not of the sampler's joint terms): leave control=None for a model with local latents"
)
_UNIT = (
    "DPMetropolis protects rows, and dp_noise(unit={unit!r}) protects groups: the private Laplace fit "
    "(nf.fit(dp=...) with exact=False, its default) takes a group as the unit"
)


class DPMetropolis(FederatedInference):
    """Differentially private federated random-walk Metropolis of the global sites, exact for
    its noise (the penalty method of Yildirim & Ermis, 2019).

    Every round is one iteration of every chain: each client releases, per chain, the clipped
    sum of its rows' log-likelihood ratios between the chain's point and its proposal plus
    Gaussian noise from its own key; the server accepts by the noisy ratio less half its known
    variance, which keeps the posterior (with the ratios clipped) the chain's target. See
    :mod:`~numpyro_fed.mcmc.dp_mh_algorithm`.

    Privacy: the model's ``dp_noise`` says which rows are protected and how much: ``clip`` is
    ``C``, each row's log-likelihood ratio's bound; ``epsilon`` (the noise calibrated with
    ``dp-accounting`` for the run's ``(num_warmup + num_samples) * num_chains`` releases per
    client, under substitution of one row) or ``noise_multiplier`` (``sigma / C``). Only the
    released sums cross; rows, ratios and the count of clipped rows stay on the client.
    :meth:`privacy_report` gives each client's guarantee from its own count of releases;
    ``run(..., ledger=PrivacyLedger)`` composes runs.

    The noise costs acceptance (the server subtracts ``J sigma^2 / 2``): keep ``J sigma^2`` of a
    few units at most, by a small ``clip`` with a proposal whose steps move each row's
    log-likelihood by less than ``clip`` (``init=`` a good covariance; the step adapts in
    warmup).

    Local latents that belong to rows (inside the row plate: a patient's random effect) stay on
    their client: every round each row's latents move on their own (``local_steps`` random-walk
    Metropolis steps on the row's joint term given the chain's point, the step adapted in warmup
    on that row's acceptance), and the released ratio is the rows' joint terms' (see the
    algorithm's module for why the guarantee holds). A local latent shared by several rows is
    refused.

    Args:
        model: a ``dp_noise``-marked NumPyro model whose observed sites, and local latent sites
            if any, lie in the row plate.
        num_warmup: iterations (rounds) whose draws are discarded; the step adapts in them.
        num_samples: iterations kept.
        num_chains: chains side by side (each costs every client one release per round).
        init: ``(mean, cov)`` of the flat unconstrained global sites (public): the chains start
            at draws of ``N(mean, cov / 4)`` from a public key and propose with ``cov``.
            ``None``: the prior's median and an identity covariance.
        local_steps: each row's local random-walk steps per round.
        control: a :class:`~numpyro_fed.dp.control.ControlVariate` (public: a private start's
            released sums of its rows' gradients and Hessians at one point,
            :meth:`~numpyro_fed.dp.dp_laplace.DPLaplace.control_variate`): each client then
            releases the clipped sum of its ratios' residuals about that expansion, third order
            near the mode, so a clip far below one row's ratio binds on none; the draws carry the
            start's noise (see :mod:`numpyro_fed.dp.control`). Models without local latents.
        row_plate: the plate that indexes rows (default: the one the clients are padded along).
        model_kwargs: keyword arguments of every model call.
        secure_aggregation: ``None`` (each client's noised release reaches the server), or how the
            releases are summed so that the server sees only their sum each round: ``"masking"``
            (pairwise masking with dropout recovery, Bonawitz et al. 2017) or ``"trusted"`` (a trusted
            aggregator); see :mod:`numpyro_fed.run.secure`. Each client still adds the whole noise: the
            guarantee rests on each release alone, so it holds against a server that deviates from
            the masking protocol or misreports who answered (the summing is protection in depth,
            not a discount on the noise).

    References:
        Yildirim & Ermis (2019), "Exact MCMC with differentially private moves", Statistics and
        Computing 29; Ceperley & Dewing (1999), "The penalty method for random walks with
        uncertain energies", J. Chem. Phys. 110.
    """

    method = "dp_metropolis"
    setup_extra = TermsSetup
    params_type = DrawParams
    open_ended = True
    family_run_options = ("ledger",)
    _penalty = True  # the penalty correction (a test turns it off to show what it corrects)

    def __init__(self, model: Callable, *, num_warmup: int = 1000, num_samples: int = 1000, num_chains: int = 2,
                 init: Optional[Tuple] = None, local_steps: int = 5, row_plate: Optional[str] = None,
                 model_kwargs: Optional[dict] = None, secure_aggregation: Optional[str] = None,
                 control: Optional[ControlVariate] = None) -> None:
        super().__init__()
        self.secure_aggregation = check_aggregation(secure_aggregation, "DPMetropolis")
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.model, self.row_plate = model, row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self.num_warmup, self.num_samples = int(num_warmup), int(num_samples)
        self.num_chains = int(num_chains)
        if self.num_warmup < 0 or self.num_samples < 1 or self.num_chains < 1:
            raise ValueError("DPMetropolis: num_warmup >= 0, num_samples >= 1 and num_chains >= 1")
        self.init_moments, self.control = init, control
        self.privacy: Optional[Tuple] = None  # (spec, noise multiplier) planned at set-up
        self.dp_plan = SamplerPrivacy(self)

    @property
    def releases_per_client(self) -> int:
        """Gaussian releases each client makes in a full run (one per chain and iteration)."""
        return (self.num_warmup + self.num_samples) * self.num_chains

    def _rounds(self, num_rounds: Optional[int], options: dict) -> int:
        """``run``'s ``num_rounds`` is a bound (default: ``num_warmup + num_samples``, 20 times that
        where clients may drop, under simulated ``availability=`` or a network backend: a round a
        client misses is repeated)."""
        if num_rounds is None:
            total = self.num_warmup + self.num_samples
            num_rounds = 20 * total if may_drop(options) else total
        return num_rounds

    def _build(self, clients) -> Setup:
        terms = row_terms("DPMetropolis", self.model, self.model_kwargs, clients, self.row_plate,
                          self.releases_per_client, _NO_DP, _LOCALS)
        spec, nm, setup, local, row_log_lik = terms.spec, terms.noise_multiplier, terms.setup, terms.local, \
            terms.row_term
        if terms.unit is not None:
            raise ValueError(_UNIT.format(unit=terms.unit[0]))
        if self.control is not None and local is not None:
            raise ValueError(_CONTROL_LOCALS.format(names=sorted(local.names)))
        self.privacy = (spec, nm)
        plan, layout = setup.plan, setup.extra.structure.global_latent
        rows = None if local is None else row_locals(local, int(np.max(np.asarray(plan.num_rows))),
                                                     client_data(plan, 0).row_mask.shape[0])
        d = layout.size
        if self.init_moments is None:
            mean = jnp.asarray(prior_median(self.model, client_data(plan, 0).args, self.model_kwargs, layout,
                                            exact=True), jnp.float32)
            cov = jnp.eye(d, dtype=jnp.float32)
        else:
            mean, cov = (jnp.asarray(a, jnp.float32) for a in self.init_moments)
            cov = (cov + cov.T) / 2
        noise = jax.random.normal(jax.random.PRNGKey(START_KEY), (self.num_chains, d), jnp.float32)
        starts = mean + 0.5 * noise @ jnp.linalg.cholesky(cov).T
        # every release carries the whole noise, summed securely or not (see secure_aggregation)
        config = DPMHConfig(self.num_warmup, self.num_samples, self.num_chains, float(spec.clip),
                            float(nm * spec.clip), self._penalty, self.local_steps, self.secure_aggregation)
        control = self.control

        def derivatives(u, data):  # each row's clipped gradient and clip factor at the anchor, as the start's release
            g, _, _, factor = row_derivatives(lambda x: row_log_lik(x, data), u, data.row_mask, control.clip)
            return g, factor

        algorithm = dp_metropolis(setup.extra.terms.log_prior, row_log_lik, len(clients), starts, cov, config=config,
                                  rows=rows, control=control, derivatives=derivatives)
        message = {"llr": jax.ShapeDtypeStruct((self.num_chains,), jnp.float32)}
        return setup._replace(algorithm=capped_releases(algorithm, len(clients), message,
                                                        cap=self.releases_per_client, per_release=self.num_chains))

    def _params(self, setup, state) -> DrawParams:
        draws = state.server.inner.draws  # (chains, samples, d)
        if self.control is not None:  # the start's noise as uncertainty (dp/control.py), from a public key
            draws = widen(jax.random.PRNGKey(START_KEY + 1), self.control, draws)
        user = user_space(self.model, self.model_kwargs, setup, draws.reshape(-1, draws.shape[-1]))
        return DrawParams({k: jnp.asarray(v).reshape(draws.shape[:2] + v.shape[1:]) for k, v in user.items()})

    def posterior(self, result: RunResult) -> ChainPosterior:
        """The chains' draws per global site, constrained (:class:`~numpyro_fed.run.posterior.ChainPosterior`,
        read by ``get_samples`` and ``sample_posterior``). A client's local draws stay on it
        (``client=`` raises)."""

        def draws(client):
            if client is not None:
                raise ValueError(_LOCAL_DRAWS.format(client=client))
            return dict(result.params.samples)

        return ChainPosterior(draws)

    def acceptance(self, result: RunResult) -> float:
        """The kept iterations' acceptance rate (public: the server's decisions)."""
        return float(np.asarray(result.state.server.inner.accepted)[:, self.num_warmup:].mean())

    @property
    def noise_multiplier(self) -> float:
        """``sigma / C`` of every release, as planned at set-up."""
        if self.privacy is None:
            raise ValueError("DPMetropolis.noise_multiplier: run first (the noise is planned at set-up)")
        return self.privacy[1]


@register_check(DPMetropolis)
def dp_metropolis_check(inference: DPMetropolis, result: RunResult) -> Verdict:
    """The chains' split R-hat and ESS (public: the server's draws) and the clients' own counts
    of clipped ratios (read where the simulation holds the clients' states): a clipped ratio
    changes the target, so the verdict is then ``"biased"``, with a warning naming the clients."""
    draws = {k: np.asarray(v) for k, v in inference.get_samples(result, group_by_chain=True).items()}
    accepted = np.asarray(result.state.server.inner.accepted)[:, inference.num_warmup:]
    chains = chain_report(draws)
    verdict = chains_verdict({"max_r_hat": chains.max_r_hat, "min_n_eff": chains.min_n_eff,
                              "acceptance": float(accepted.mean()), "not_converged": chains.not_converged,
                              "unmixed": chains.unmixed, "constant": chains.constant})
    names = list(fitted(inference).plan.names)
    try:
        clipped = {n: int(result.client_states[n].inner.clipped) for n in names}
    except (AttributeError, KeyError, TypeError):  # a network backend: each count stays on its node
        warnings.warn(_UNSEEN.format(cls=type(inference).__name__), UncheckedFitWarning,
                      stacklevel=find_stack_level())
        return verdict._replace(status="unchecked" if verdict.ok else verdict.status,
                                why=verdict.why + "; whether the clip bound is not known here")
    bad = [n for n, c in clipped.items() if c > 0]
    if bad:
        spec = inference.privacy[0]
        warnings.warn(_CLIPPED.format(cls=type(inference).__name__, clients=bad, rows=sum(clipped.values()),
                                      clip=spec.clip), UnreliableFitWarning, stacklevel=find_stack_level())
        verdict = verdict._replace(status="biased", why=f"{sum(clipped.values())} row ratios were clipped")
    if chains.unmixed:
        warnings.warn(f"{type(inference).__name__}: the chains have not mixed at {', '.join(chains.unmixed[:6])}: "
                      f"run longer (num_warmup, num_samples), or propose with a better covariance (init=)",
                      UnreliableFitWarning, stacklevel=find_stack_level())
    return verdict

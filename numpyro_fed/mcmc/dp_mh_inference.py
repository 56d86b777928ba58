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
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions.transforms import biject_to
from numpyro.distributions.util import sum_rightmost
from numpyro.handlers import seed, substitute, trace

from .._structure import trace_model
from .._trace import prior_median
from .._validation import check_positive_int
from ..backends.mapping import client_data
from ..check import Verdict, register_check
from ..check.chains import chain_report, chains_verdict
from ..dp.accounting import ClientPrivacy, PrivacyReport, calibrate_noise_multiplier, epsilon_composed, report
from ..dp.annotation import dp_sites
from ..dp.control import ControlVariate, row_derivatives, widen
from ..dp.ledger import PrivacyBudgetError
from ..dp.releases import capped_releases, over_plan
from ..inference import FederatedInference, Setup, fitted
from ..params import DrawParams
from ..protocol import RunResult
from ..secure import check_aggregation
from ..terms.model import TermsSetup, build_terms, site_supports, user_space
from ..warnings import UncheckedFitWarning, UnreliableFitWarning, find_stack_level
from .dp_mh_algorithm import DPMHConfig, RowLocals, dp_metropolis
from .inference import pick_draws

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
_OUTSIDE = (
    "DPMetropolis clips each row's term, and observed site {name!r} is not in the row plate {plate!r} (a "
    "term over several rows, such as a numpyro.factor outside the plate, has no per-row bound): put it inside "
    "the plate, or leave it out of the model"
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
_OVER_PLAN = (
    "{cls}: client(s) {clients} refused a release past their plan of {plan} (the noise is calibrated for that many; "
    "a client asked for another step than the plan has, by a server that deviates or after its own state was taken "
    "back over a network, refuses); the run stopped there and returns no answer. Spent (epsilon at delta={delta:g}, "
    "from the releases each made): {spent}"
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
_NOT_IN_UNIT = (
    "dp_noise(unit={unit!r}) protects each group of that plate as one term, and local site(s) {names} are not in "
    "group_plate({unit!r}): a group's term takes its own effects as one block (a latent shared by several groups "
    "joins their terms, which no clip of one group's term bounds; a latent per row makes the blocks ragged). Put "
    "them in group_plate({unit!r}), or protect rows (dp_noise without unit=)"
)
_OUTSIDE_UNIT = (
    "observed site '{name}' is in neither the row plate '{plate}' nor group_plate('{unit}'): each group's term sums "
    "its rows' log densities, so every observed site must be in one of them"
)


class RowTerms(NamedTuple):
    """What a per-row private family builds from a ``dp_noise``-marked model (:func:`row_terms`)."""

    spec: Any  # the model's one DPSpec
    noise_multiplier: float  # sigma / C, calibrated to the spec's epsilon for the releases, or given
    setup: Setup  # the clients' layout and the model's terms (no algorithm yet)
    local: Any  # the local latents' layout, or None
    row_term: Callable  # (u, data) -> (units,), or (u, v, data) -> (units,) with local latents
    unit: Optional[Tuple[str, str, int]] = None  # dp_noise(unit=): (group plate, codes argument, groups); None: rows


def row_terms(cls: str, model: Callable, model_kwargs: Dict, clients, row_plate: Optional[str], releases: int,
              no_dp: str, shared_locals: str) -> RowTerms:
    """Check a ``dp_noise``-marked model for a family that clips each row's term (one spec; local
    latents, if any, in the row plate; ``delta`` below ``1/n``), lay the clients out, plan the noise
    for ``releases`` releases per client, and build each row's term. With ``dp_noise(unit=plate)``
    the protected unit is a group of that ``group_plate``: each term is a group's (its rows' and its
    local latents' together; every local latent in that plate)."""
    first = clients.names[0]
    tr = trace_model(model, clients[first], model_kwargs)
    specs = dp_sites(tr)
    if not specs:
        raise ValueError(no_dp)
    if len(set(specs.values())) > 1:
        raise ValueError(f"dp_noise marks {sorted(specs)} with different settings; mark them with one")
    spec = next(iter(specs.values()))
    plan, extra = build_terms(model, model_kwargs, clients, cls=cls, client_mapping="vmap",
                              row_plate=marked_row_plate(row_plate, tr, clients.num_rows[first]),
                              prior_factor="none")
    local = extra.terms.local if extra.terms.num_local else None
    unit = protected_unit(model, spec)
    if local is not None:  # each local latent in the unit: its row (row plate) or its group (the unit's plate)
        groups = local.group_axes or ((),) * len(local.names)
        shared = [n for n, a, g in zip(local.names, local.row_axes, groups)
                  if (a is None if unit is None else not any(p == unit[0] for p, _, _ in g))]
        if shared:
            raise ValueError(shared_locals.format(names=shared) if unit is None else _NOT_IN_UNIT.format(
                names=shared, unit=unit[0]))
    for name in clients.names:
        spec.check_rows(clients.num_rows[name] if unit is None else
                        int(np.max(np.asarray(clients[name][unit[1]]))) + 1, name)
    row_plate = plan.row_plate or extra.structure.row_plate or row_plate
    if row_plate is None:
        raise ValueError(f"{cls}: name the plate that indexes rows (row_plate=...)")
    nm = (calibrate_noise_multiplier(spec.epsilon, spec.delta, releases) if spec.epsilon is not None
          else float(spec.noise_multiplier))
    setup = Setup(clients, None, plan, extra, {})
    supports = site_supports(model, model_kwargs, setup, client_data(plan, 0).args)
    row_term = row_log_lik_fn(model, model_kwargs, extra.structure.global_latent, supports, row_plate, local, unit)
    return RowTerms(spec, nm, setup, local, row_term, unit)


def protected_unit(model: Callable, spec) -> Optional[Tuple[str, str, int]]:
    """``dp_noise(unit=plate)``'s ``(plate, codes argument, groups)`` (groups: the largest client's,
    the others' padded); ``None``: the unit is one row."""
    if getattr(spec, "unit", None) is None:
        return None
    sizes, args = getattr(model, "group_sizes", {}), getattr(model, "group_args", {})
    if spec.unit not in sizes:
        raise ValueError(f"dp_noise(unit={spec.unit!r}): the model has no group_plate of that name (its group "
                         f"plates: {sorted(sizes)}); name the nf.group_plate whose groups are the protected unit")
    return spec.unit, args[spec.unit], int(sizes[spec.unit])


def unit_mask(unit: Optional[Tuple[str, str, int]]) -> Callable:
    """``data -> (units,)``: 1 on a client's real rows (or, with ``unit``, its real groups), 0 on padding."""
    if unit is None:
        return lambda data: data.row_mask

    def groups(data):
        codes = jnp.where(data.row_mask > 0, jnp.asarray(data.args[unit[1]]), -1)
        return (jnp.arange(unit[2]) <= jnp.max(codes)).astype(data.row_mask.dtype)

    return groups


def marked_row_plate(row_plate: Optional[str], tr, num_rows: int) -> Optional[str]:
    """The plate that indexes rows: ``row_plate`` when given, else the one plate of the client's
    row count that every ``dp_noise``-marked site sits in (clients of equal size are not padded,
    so the clients' layout does not find it)."""
    if row_plate is not None:
        return row_plate
    marked = [s for s in tr.values() if s["type"] == "sample" and "dp" in (s.get("infer") or {})]
    if not marked:
        return None
    plates = set.intersection(*({f.name for f in s["cond_indep_stack"] if f.size == num_rows} for s in marked))
    return next(iter(plates)) if len(plates) == 1 else None


def unit_locals(local, unit: Tuple[str, str, int]) -> np.ndarray:
    """``(groups, k)``: the entries of a client's flat locals that belong to each group of ``unit``
    (every local site is in the unit's plate: :func:`row_terms` checked it)."""
    index = local.unravel(jnp.arange(local.size, dtype=jnp.float32))
    unit_of = np.full(local.size, -1, np.int64)
    for name, axes in zip(local.names, local.group_axes or ((),) * len(local.names)):
        axis = next(a for p, a, _ in axes if p == unit[0])
        entries = np.moveaxis(np.asarray(index[name]).astype(np.int64), axis, 0)
        for g in range(entries.shape[0]):
            unit_of[np.ravel(entries[g])] = g
    counts = np.bincount(unit_of, minlength=unit[2])
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"dp_noise(unit={unit[0]!r}): the groups hold different numbers of local entries "
                         f"({sorted(set(counts.tolist()))}); every group's local latents must have the same shape")
    return np.stack([np.flatnonzero(unit_of == g) for g in range(unit[2])])


def row_locals(local, num_rows: int, padded_rows: int) -> RowLocals:
    """The row of each entry of a client's flat locals (every local site has a row axis)."""
    del num_rows
    index = local.unravel(jnp.arange(local.size, dtype=jnp.float32))
    row_of = np.zeros(local.size, np.int32)
    for name, axis in zip(local.names, local.row_axes):
        entries = np.moveaxis(np.asarray(index[name]).astype(np.int64), axis, 0)
        for i in range(entries.shape[0]):
            row_of[np.ravel(entries[i])] = i
    return RowLocals(jnp.asarray(row_of), int(padded_rows))


def _per_unit(lp, site, row_plate: str, unit: Tuple[str, str, int], data, name: str):
    """``(groups,)`` a site's log density summed within each group of ``unit``: by its rows' codes
    (a site in the row plate; padded rows left out) or along the group plate itself."""
    if any(f.name == row_plate for f in site["cond_indep_stack"]):
        rows = jnp.where(data.row_mask > 0, _per_row(lp, site, row_plate, name), 0.0)
        return jax.ops.segment_sum(rows, jnp.asarray(data.args[unit[1]]), unit[2])
    frames = [f for f in site["cond_indep_stack"] if f.name == unit[0]]
    if not frames:
        raise ValueError(_OUTSIDE_UNIT.format(name=name, plate=row_plate, unit=unit[0]))
    lp = jnp.moveaxis(jnp.broadcast_to(lp, tuple(site["fn"].batch_shape)), frames[0].dim, 0)
    return jnp.sum(jnp.reshape(lp, (lp.shape[0], -1)), axis=1)


def _per_row(lp, site, row_plate: str, name: str):
    frames = [f for f in site["cond_indep_stack"] if f.name == row_plate]
    if not frames:
        raise ValueError(_OUTSIDE.format(name=name, plate=row_plate))
    lp = jnp.moveaxis(jnp.broadcast_to(lp, tuple(site["fn"].batch_shape)), frames[0].dim, 0)
    return jnp.sum(jnp.reshape(lp, (lp.shape[0], -1)), axis=1)


def row_log_lik_fn(model: Callable, model_kwargs: Dict, layout, supports, row_plate: str,
                   local=None, unit: Optional[Tuple[str, str, int]] = None) -> Callable:
    """``(u, data) -> (rows,)``: each row's log-likelihood (every observed site's log density,
    summed over the row's entries) at the flat unconstrained global sites ``u``; padded rows 0.
    With ``local`` (the local sites' layout, every one in the row plate): ``(u, v, data) ->
    (rows,)``, each row's joint term with its local latents ``v`` (their log densities and
    Jacobians added). With ``unit`` (:func:`protected_unit`): ``(groups,)``, each group's term,
    its rows' summed by their codes and its local latents' (in that group plate) added."""
    mask_of = unit_mask(unit)

    def row_joint(u, v, data):
        values = {k: biject_to(supports[k])(x) for k, x in layout.unravel(u).items()}
        ladj = {}
        if local is not None:
            for k, x in local.unravel(v).items():
                t = biject_to(supports[k])
                values[k] = t(x)
                ladj[k] = t.log_abs_det_jacobian(x, values[k])
        tr = trace(seed(substitute(model, data=values), 0)).get_trace(**dict(data.args), **dict(model_kwargs))
        total = 0.0
        for name, site in tr.items():
            if site["type"] != "sample" or not (site["is_observed"] or name in ladj):
                continue
            lp = site["fn"].log_prob(site["value"])
            if name in ladj:  # the Jacobian, summed over the site's event dimensions
                j = ladj[name]
                lp = lp + sum_rightmost(j, jnp.ndim(j) - jnp.ndim(site["value"]) + len(site["fn"].event_shape))
            total = total + (_per_row(lp, site, row_plate, name) if unit is None else
                             _per_unit(lp, site, row_plate, unit, data, name))
        mask = mask_of(data) if data.row_mask is not None else jnp.ones_like(total)
        return jnp.where(mask > 0, total, 0.0)

    if local is not None:
        return row_joint
    return lambda u, data: row_joint(u, None, data)


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
            aggregator); see :mod:`numpyro_fed.secure`. Each client still adds the whole noise: the
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
    draws_are_chains = True
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

    def get_samples(self, result: RunResult, group_by_chain: bool = False, *, client: Optional[str] = None):
        """The draws per global site, constrained, ``(num_chains * num_samples, ...)`` (grouped:
        ``(num_chains, num_samples, ...)``). A client's local draws stay on it (``client=`` raises)."""
        if client is not None:
            raise ValueError(_LOCAL_DRAWS.format(client=client))
        draws = dict(result.params.samples)
        return draws if group_by_chain else {k: v.reshape((-1,) + v.shape[2:]) for k, v in draws.items()}

    def sample_posterior(self, rng_key, result: RunResult, num_samples: Optional[int] = None, *,
                         client: Optional[str] = None):
        """``num_samples`` of the chains' draws (all when ``None``), picked without replacement (the
        global sites; ``client=`` raises, as for :meth:`get_samples`)."""
        return pick_draws(rng_key, self.get_samples(result, client=client), num_samples)

    def acceptance(self, result: RunResult) -> float:
        """The kept iterations' acceptance rate (public: the server's decisions)."""
        return float(np.asarray(result.state.server.inner.accepted)[:, self.num_warmup:].mean())

    @property
    def noise_multiplier(self) -> float:
        """``sigma / C`` of every release, as planned at set-up."""
        if self.privacy is None:
            raise ValueError("DPMetropolis.noise_multiplier: run first (the noise is planned at set-up)")
        return self.privacy[1]


def may_drop(options: dict) -> bool:
    """Whether a run with these options may miss clients in a round: simulated ``availability=``,
    or a network backend, where dropout is real."""
    from ..backends.base import NetworkBackend

    return options.get("availability") is not None or isinstance(options.get("backend"), NetworkBackend)


class SamplerPrivacy:
    """The sampler's privacy plan in the form :class:`~numpyro_fed.inference.FederatedInference`
    calls it (the ``dp_plan`` hooks: a ledger checked before the run and charged after, the
    report from each client's own count of releases)."""

    def __init__(self, sampler: DPMetropolis) -> None:
        self.sampler, self.ledger = sampler, None

    @property
    def privacy(self):
        return self.sampler.privacy

    def before_run(self, inputs, num_rounds: int, options) -> bool:
        return False

    def before_round(self, cls: str, names, state) -> None:
        pass

    def _events(self, releases: Dict[str, int]) -> Dict[str, list]:
        """Per client ``[(sigma / C, releases, 1)]``: every release carries the whole noise."""
        nm = self.sampler.privacy[1]
        return {name: [(nm, int(r), 1.0)] for name, r in releases.items()}

    def planned(self, names, num_rounds: int) -> Dict[str, list]:
        """Per client, the most releases the run may make (its cap), as ``[(sigma / C, releases, 1)]``."""
        return self._events({n: self.sampler.releases_per_client for n in names})

    def release_cap(self, num_clients: int, num_rounds: int) -> int:
        """The most releases one client makes in the run (the count its state's ``releases`` keeps)."""
        return int(self.sampler.releases_per_client)

    @property
    def clip(self) -> float:
        return float(self.sampler.privacy[0].clip)

    def before_start(self, cls: str, names, num_rounds: int) -> None:
        if self.ledger is None:
            return
        self.ledger.open_run(cls, self.planned(names, num_rounds),
                             f"{cls}, {self.sampler.releases_per_client} releases")

    def after_run(self, cls: str, names, result) -> None:
        ledger, self.ledger = self.ledger, None
        if ledger is not None:
            ledger.close_run(self.events(names, result), f"{cls}, {int(result.communication.rounds)} rounds")
        refused = [names[j] for j in over_plan(result)]
        if refused:
            spec, nm = self.sampler.privacy
            events = self.events(names, result)
            spent = {n: round(epsilon_composed(events[n], spec.delta), 4) for n in refused}
            raise PrivacyBudgetError(
                _OVER_PLAN.format(cls=cls, clients=refused, plan=self.sampler.releases_per_client, spent=spent,
                                  delta=spec.delta), refused[0], spent[refused[0]], 0.0, spent[refused[0]])

    def events(self, names, result) -> Dict[str, list]:
        """Each client's releases in ``result`` as ``[(sigma / C, releases, sampling rate)]``."""
        return self._events(_releases(names, result))

    def report(self, cls: str, names, result) -> PrivacyReport:
        spec, nm = self.sampler.privacy
        label = getattr(self.sampler, "privacy_label",
                        "DPMetropolis (clipped log-likelihood ratios, penalty-corrected)")
        if self.sampler.secure_aggregation:
            label += f", summed by {self.sampler.secure_aggregation} aggregation"
        if getattr(spec, "unit", None) is not None:
            label += f", protected unit: one group of {spec.unit!r}"
        events = self.events(names, result)
        return report([ClientPrivacy(name, label, epsilon_composed(events[name], spec.delta), spec.delta, nm,
                                     sum(e[1] for e in events[name]), 1.0) for name in names])


def _releases(names, result) -> Dict[str, int]:
    return {name: int(result.client_states[name].releases) for name in names}


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

"""``PVI``: partitioned variational inference over a model's global sites (Heikkilä et al. (2023) §3.1)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Optional

import jax
from jax import random

from .._validation import check_optimizer, check_positive_int
from ..check import Verdict, register_check
from ..clients import Clients
from ..dp.plan import MECHANISMS, DPPlan, check_dp_options, warn_withheld
from ..model.structure import trace_model
from ..run.protocol import RunResult
from ..run.secure import check_aggregation
from ..terms import gaussian as G
from ..terms.prior_site import prior_site_step
from .ep_algorithm import ep, tilted_moments
from .inference import FactorInference, factor_check, set_schedule
from .messages import K_ADVICE
from .pvi_algorithm import pvi
from .updates import VARIANTS

__all__ = ["BCM", "PVI", "pvi_check"]

_LOCAL_CONJ = (
    "update='conjugate' has no closed form with local latent sites ({names}); use "
    "update='optax', which fits a Gaussian over the global and local sites jointly"
)
_LOCAL_VARIANT = (
    "variant='local_averaging' weights each shard's KL to the cavity by 1/N, which the joint fit over the global "
    "and local sites ({names}) does not split; use variant='virtual' (one factor per shard, local latents that "
    "belong to rows) or 'plain'"
)
_SHARED_LOCALS = (
    "variant='virtual' splits a client's rows into shards, each fitted on its own rows, and local site(s) {names} "
    "are not in the row plate {plate!r}: a latent shared by rows of several shards would be fitted once per shard. "
    "Use variant='plain'"
)
_LOCAL_DP_SGD = (
    "dp='optimisation' clips each row's gradient of the global sites, but with local latent sites ({names}) the "
    "local fit is one Gaussian over the global and local sites together, whose shared parameters every row moves, "
    "so no per-row bound holds; use dp='update_perturbation', which clips and noises the only release, the change "
    "in q of the global sites (the local fit never leaves the client)"
)
_SECURE = (
    "secure_aggregation={value!r} sums the clients' noised updates so that the server sees only their sum, the "
    "form of update perturbation whose noise shrinks with the clients (Heikkilä et al. (2023) Theorems 11, 14): "
    "it needs dp='update_perturbation' (and schedule='synchronous')"
)
_CONJ_FIX = "use update='optax' (stochastic optimisation of the local ELBO)"
_SHARDS = "client '{client}' has {rows} rows, fewer than num_shards={n}; use fewer shards"
_SHARD_PLATE = (
    "variant= splits each client's rows into shards, which needs the plate that indexes rows; "
    "plates of the client's row count: {found}. Pass row_plate="
)
_UPDATES = ("auto", "conjugate", "optax")
DEFAULT_LEARNING_RATE = 0.05  # the local ELBO's first Adam step when update='auto' chooses 'optax' and optim= is unset
# ... decayed over each local fit's local_steps to this fraction of it: a constant step leaves the fitted
# Gaussian jittering by about the step, so the sd of a well-determined site (a standardised regression's
# intercept or noise scale, posterior sd 0.03) came out 2.5-3.5x too wide; decayed, within 2 %
DEFAULT_DECAY = 0.01
_QUADRATIC_TOL = 1e-4
# max_kl="auto" under update perturbation without a trusted aggregator: nats per dimension of q. Chosen on the
# Heikkilä et al. (2023) stand-in (benchmarks/dp_adult.py, d = 8): 1/8 per dimension halved the damage, 1/16 ended every
# divergence of local averaging and virtual clients on both unbalanced splits (5 seeds) and never binds on the
# balanced split (identical figures); the noise's own KL grows with the dimension, hence per dimension.
DP_MAX_KL_PER_DIM = 1.0 / 16


def _default_optim(local_steps=None):
    """Adam at :data:`DEFAULT_LEARNING_RATE`, decayed over ``local_steps`` to :data:`DEFAULT_DECAY` of
    it (a local fit restarts the schedule); constant when ``local_steps`` is ``None`` (DP-SGD)."""
    import optax

    if local_steps is None:
        return optax.adam(DEFAULT_LEARNING_RATE)
    return optax.adam(optax.exponential_decay(DEFAULT_LEARNING_RATE, int(local_steps), DEFAULT_DECAY,
                                              end_value=DEFAULT_LEARNING_RATE * DEFAULT_DECAY))


class PVI(FactorInference):
    """Partitioned variational inference (Ashman et al., 2022; Heikkilä et al. (2023) Algorithm 1).

    Approximates the posterior of the model's global latent sites by
    ``q(theta) ∝ p(theta) prod_j t_j(theta)``, Gaussian in unconstrained space. Each round the
    chosen clients fit their local ELBO against the cavity ``q / t_j`` on their own data and
    send one natural-parameter update ``Delta t_j``; the server applies them with damping and
    a positive-definiteness safeguard.

    Args:
        model: a NumPyro model whose global latent sites have Gaussian priors in
            unconstrained space. Latent sites marked ``local_site`` stay on their client:
            with them, each local step fits one Gaussian over the global and the client's
            local sites, which maximises the local ELBO
            ``E_q[log p(y_j, v | theta)] + H[q(theta, v)] - KL``-to-cavity, i.e. minimises
            ``KL(q || cavity * p(y_j, v | theta))`` (needs ``update="optax"`` and
            ``variant="plain"``); only ``q(theta)``'s factor leaves the client. Such a
            model is private with ``dp="update_perturbation"``: that factor's change, the
            only release, is clipped and noised, and the local fit needs no noise of its own.
        family: ``"full"`` or ``"diagonal"`` covariance.
        update: ``"auto"`` (default), ``"conjugate"`` or ``"optax"``. ``"conjugate"`` is the
            closed form, for a log-likelihood quadratic in the global sites (Bayesian linear
            regression with known noise) and no local latent sites; ``"optax"`` fits each
            local ELBO by stochastic optimisation with ``optim``. ``"auto"`` chooses per
            model: ``"conjugate"`` when every client's log-likelihood is quadratic (checked
            on the client's own rows, as the conjugate update itself does) and there are no
            local latent sites or DP-SGD, otherwise ``"optax"`` with ``optim`` (default
            ``optax.adam(0.05)``). The choice made is kept in :attr:`update_used`.
        schedule: ``"sequential"``, ``"synchronous"`` or ``"subset"``.
        damping: ``delta`` in ``(0, 1]``.
        subset_size: clients per round for ``schedule="subset"``.
        optim: optax optimiser for ``update="optax"`` (and for ``"auto"`` when it chooses
            ``"optax"``; default Adam from 0.05, decayed exponentially over each local fit's
            ``local_steps`` to 0.0005: a constant step leaves the fit jittering by about the step,
            which inflates the sds of well-determined sites).
        local_steps: optimiser steps per local update.
        max_local_steps: with ``update="optax"`` (global sites only, no DP), a local fit whose
            objective or parameters still move over the last quarter of its steps runs
            another ``local_steps``, up to this many in all (default ``4 * local_steps``;
            under ``dp=`` no extension, as every step is accounted); one still moving then is
            reported (``UnreliableFitWarning`` naming the client
            and round).
        num_particles: Monte Carlo draws per local ELBO estimate.
        max_halvings: PD safeguard (see :func:`~numpyro_fed.factor.updates.factor_protocol`).
        max_kl: trust region: also halve ``delta`` while a round would move ``q`` by more than
            ``max_kl`` nats (``KL(q_new || q)``, computed by the server from the released update
            alone, so it costs no privacy), and reject the round after ``max_halvings``. ``"auto"``
            (default): ``d / 16`` nats for a ``d``-dimensional ``q`` under
            ``dp="update_perturbation"`` without a trusted aggregator and with a sequential or
            subset schedule, where one client's noised update can throw ``q`` far off (a small
            client's noise is large against its signal); none otherwise (a synchronous first
            round moves ``q`` from the prior in one step). ``None``: no trust region.
        variant: ``"plain"`` (Alg. 1), ``"local_averaging"`` (Heikkilä et al. (2023) Alg. 2) or
            ``"virtual"`` (Alg. 3, virtual clients); see :func:`~numpyro_fed.factor.pvi_algorithm.pvi`.
        num_shards: shards per client for the two variants (every client needs at least
            that many rows).
        dp: differential privacy (Heikkilä et al. (2023); the model marks its protected rows with
            :class:`~numpyro_fed.dp_noise`, which carries the budget): ``"optimisation"``
            (DP-SGD in each local optimisation, §4.1; needs ``update="optax"``,
            ``variant="plain"``, ``dp_batch_size`` and global latent sites only) or
            ``"update_perturbation"`` (each shard's change in natural parameters clipped to
            ``clip`` and noised, §4.2; any ``variant``, and ``"plain"`` on models with local
            latent sites). ``None`` (default) with a ``dp_noise``-marked model is an error.
            See :meth:`privacy_report` and ``docs/differential_privacy.md``. A private run takes
            ``ledger=`` (a :class:`~numpyro_fed.dp.ledger.PrivacyLedger`): the run is refused
            before it starts when it would take a client past its budget over all its runs,
            and is charged to it.
        dp_batch_size: rows in every DP-SGD step (a fresh uniformly random subset of that
            fixed size, drawn without replacement).
        trusted_aggregator: with ``dp="update_perturbation"`` and ``schedule="synchronous"``:
            the updates are summed by a trusted aggregator, the server sees only the sum
            and each of the M clients adds noise ``sigma / sqrt(M)`` (Theorems 11, 14).
        secure_aggregation: who sums the updates under ``trusted_aggregator``: ``"trusted"``
            (a trusted aggregator; the default of ``trusted_aggregator=True``) or ``"masking"``
            (no third party: pairwise masking with dropout recovery, Bonawitz et al. 2017; see
            :mod:`numpyro_fed.run.secure`; each client then adds the whole noise, not ``sigma / sqrt(M)``:
            the guarantee does not rest on the server following the protocol). Given, it implies
            ``trusted_aggregator=True`` for the summing; it needs
            ``dp="update_perturbation"``. In simulation; a network backend refuses masking.
        client_mapping: how the simulation maps clients, as in :class:`~numpyro_fed.FederatedSVI`.
        row_plate: the plate that indexes rows (for padding unequal clients).
        model_kwargs: non-data keyword arguments of the model.
        check_fit: after ``run``, check ``q`` against the posterior of the global sites
            (:meth:`diagnose`: Pareto k and the moment check; each client's term computed on
            its own rows) and warn
            (``UnreliableFitWarning`` / ``BiasedFitWarning``); kept as ``last_fit_check``.
            Not run under DP.
        committee: ``None`` (default): PVI. ``"same"`` or ``"split"``: the Bayesian committee
            machine with that prior (:func:`BCM` builds it so): one synchronous round from the
            prior with damping 1, and ``method`` is ``"bcm"``.

    Examples:
        >>> import jax, numpy as np, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x, y):
        ...     w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)
        >>> x = np.random.default_rng(0).normal(size=(60, 2)); y = x @ np.array([1.0, -1.0])
        >>> clients = nf.Clients.split(np.repeat([0, 1, 2], 20), x=x, y=y)
        >>> res = nf.PVI(model, schedule="sequential").run(jax.random.PRNGKey(0), clients, 3)
        >>> np.round(res.params.mean, 1)
        Array([ 1., -1.], dtype=float32)

    References:
        Ashman, Bui, Nguyen, Markou, Weller, Swaroop, Turner (2022), "Partitioned
        variational inference: a framework for probabilistic federated learning"; Heikkilä
        et al. (2023) §3.1.
    """

    method = "pvi"
    dp_mechanisms = MECHANISMS
    family_run_options = ("ledger",)  # run(..., ledger=PrivacyLedger): one budget per client over runs

    def __init__(
        self,
        model: Callable,
        *,
        family: str = "full",
        update: str = "auto",
        schedule: str = "synchronous",
        damping: float = 1.0,
        subset_size: int = 1,
        optim: Any = None,
        local_steps: int = 1000,
        max_local_steps: Optional[int] = None,
        num_particles: int = 8,
        max_halvings: int = 10,
        max_kl: "Optional[float] | str" = "auto",
        variant: str = "plain",
        num_shards: int = 1,
        dp: Optional[str] = None,
        dp_batch_size: Optional[int] = None,
        trusted_aggregator: bool = False,
        client_mapping: str = "auto",
        row_plate: Optional[str] = None,
        model_kwargs: Optional[dict] = None,
        check_fit: bool = True,
        committee: Optional[str] = None,
        secure_aggregation: Optional[str] = None,
    ) -> None:
        if committee is not None and (committee not in ("same", "split") or schedule != "synchronous"
                                      or damping != 1.0):
            raise ValueError(f"committee={committee!r}: BCM's prior is 'same' or 'split', and it runs one synchronous "
                             f"round with damping 1 (use BCM(model, prior=...))")
        super().__init__(model, family=family, client_mapping=client_mapping, row_plate=row_plate,
                         model_kwargs=model_kwargs, check_fit=check_fit)
        set_schedule(self, schedule, damping, subset_size, max_halvings)
        if update not in _UPDATES:
            raise ValueError(f"update={update!r}: choose one of {_UPDATES}")
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: choose one of {VARIANTS}")
        if check_positive_int("num_shards", num_shards) != 1 and variant == "plain":
            raise ValueError(f"num_shards={num_shards}: must be 1 unless variant= splits the data")
        if update == "auto" and dp == "optimisation":  # DP-SGD runs inside the local optimisation
            update, optim = "optax", _default_optim() if optim is None else optim
        if update == "optax" or optim is not None:
            check_optimizer(optim, needed_by="update='optax'")
        self.update_kind = update
        #: the update the fit uses: ``update`` as given, or what ``"auto"`` chose (set when built)
        self.update_used: Optional[str] = None if update == "auto" else update
        self.optim = optim
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.num_particles = check_positive_int("num_particles", num_particles)
        self.variant, self.num_shards = variant, int(num_shards)
        self.secure_aggregation = check_aggregation(secure_aggregation, type(self).__name__)
        if self.secure_aggregation is not None:
            if dp != "update_perturbation":
                raise ValueError(_SECURE.format(value=secure_aggregation))
            trusted_aggregator = True
        self.dp = check_dp_options(dp, dp_batch_size, trusted_aggregator, update_kind=self.update_kind,
                                   variant=variant, schedule=schedule)
        self.max_local_steps = self._local_budget(max_local_steps)
        self.dp_batch_size = None if dp_batch_size is None else int(dp_batch_size)
        self.trusted_aggregator = bool(trusted_aggregator)
        self.dp_plan = DPPlan(self.model, self.model_kwargs, self.dp, trusted_aggregator=trusted_aggregator,
                              masking=self.secure_aggregation == "masking", schedule=schedule,
                              batch_size=self.dp_batch_size, local_steps=self.local_steps, variant=variant,
                              num_shards=self.num_shards)
        self.max_kl = self._trust_region(max_kl)
        self.committee = committee
        if committee is not None:
            self.method = "bcm"

    def _trust_region(self, max_kl) -> "Optional[float] | str":
        """``max_kl``: ``"auto"`` stays ``"auto"`` until the dimension is known (:meth:`max_kl_for`)."""
        if max_kl is None or max_kl == "auto":
            return max_kl
        if isinstance(max_kl, str) or not max_kl > 0:
            raise ValueError(f"max_kl={max_kl!r}: must be positive, 'auto' or None")
        return float(max_kl)

    def max_kl_for(self, dim: int) -> Optional[float]:
        """The trust region a fit of ``dim`` global dimensions uses: ``"auto"`` is
        :data:`DP_MAX_KL_PER_DIM` nats per dimension when each client's noised update is applied on its
        own, in turn (``dp="update_perturbation"`` without a trusted aggregator, ``schedule="sequential"``
        or ``"subset"``), none otherwise. (A synchronous first round moves ``q`` from the prior in one
        step, which so small a region would split over many rounds; it was not measured there.)"""
        if self.max_kl != "auto":
            return self.max_kl
        if self.dp == "update_perturbation" and not self.trusted_aggregator and self.schedule != "synchronous":
            return DP_MAX_KL_PER_DIM * dim
        return None

    def _local_budget(self, max_local_steps: Optional[int]) -> int:
        """``max_local_steps``: 4 x ``local_steps`` by default; ``local_steps`` under DP, where
        every local step is accounted and a fit is never extended."""
        if max_local_steps is None:
            return self.local_steps if self.dp is not None else 4 * self.local_steps
        value = check_positive_int("max_local_steps", max_local_steps)
        if value < self.local_steps:
            raise ValueError(f"max_local_steps={max_local_steps}: must be at least local_steps={self.local_steps}")
        if self.dp is not None and value != self.local_steps:
            raise ValueError(
                f"max_local_steps={max_local_steps}: under dp={self.dp!r} every local step is accounted, "
                f"so a local fit is never extended; leave max_local_steps unset"
            )
        return value

    def _check_structure(self, structure) -> None:
        if not structure.local_latent_names:
            return
        names = list(structure.local_latent_names)
        if self.dp == "optimisation":
            raise ValueError(_LOCAL_DP_SGD.format(names=names))
        if self.update_kind == "conjugate":
            raise ValueError(_LOCAL_CONJ.format(names=names))
        if self.variant == "local_averaging":
            raise ValueError(_LOCAL_VARIANT.format(names=names))

    def _adjust_structure(self, clients: Clients, structure):
        if self.variant == "plain":
            return structure
        return structure._replace(row_plate=self._shard_plate(clients, structure.row_plate))

    def _fit_advice(self) -> Dict[str, Any]:
        return {
            "stat": (
                "the local optimisation had not converged (the local ELBO still rising or q's mean or sd "
                "still moving over the last quarter of the steps)",
                "convergence statistic (objective and parameter drift over their limits; above 1 fails)",
                f"Raise local_steps (now {self.local_steps}) or max_local_steps (now "
                f"{self.max_local_steps}), or change the optimiser's learning rate.",
            ),
            "k": K_ADVICE,
            "invalid": "",
        }

    def _algorithm(self, terms, plan, num_clients: int):
        d = terms.prior.shift.shape[0]
        common = dict(
            schedule=self.schedule,
            damping=self.damping,
            max_halvings=self.max_halvings,
            max_kl=self.max_kl_for(d),
            subset_size=self.subset_size,
            prior_site=prior_site_step(terms, self.family == "diagonal"),
        )
        private = self.dp_plan.privacy
        common["split_prior"] = self.committee == "split"
        common["perturb"] = private.perturb if private else None
        common["trusted_aggregator"] = self.trusted_aggregator
        common["aggregation"] = self.secure_aggregation or "trusted"
        if terms.num_local:  # joint Gaussian over (global, local): KL(q || tilted), see the class doc
            self._use("optax")
            shared = [n for n, axis in zip(terms.local.names, terms.local.row_axes) if axis is None]
            if self.variant == "virtual" and shared:
                raise ValueError(_SHARED_LOCALS.format(names=shared, plate=plan.row_plate))
            moments = tilted_moments(
                "vi",
                optim=self.optim,
                vi_steps=self.local_steps,
                num_particles=self.num_particles,
                diagonal=self.family == "diagonal",
            )
            return ep(terms.prior, terms.log_joint, num_clients, num_local=terms.num_local, moments=moments,
                      variant=self.variant, num_shards=self.num_shards, **common)
        update = self._choose_update(terms, plan, d)
        return pvi(
            terms.prior,
            terms.log_lik,
            num_clients,
            update=update,
            optim=self.optim,
            local_steps=self.local_steps,
            max_local_steps=self.max_local_steps,
            num_particles=self.num_particles,
            variant=self.variant,
            num_shards=self.num_shards,
            dp_sgd=private.dp_sgd if private else None,
            **common,
        )

    def _use(self, update: str) -> str:
        """Record the update the fit uses (``"auto"`` resolved); ``"optax"`` gets the default optimiser."""
        if update == "optax" and self.optim is None:
            self.optim = _default_optim(self.local_steps)
        self.update_used = update
        return update

    def _choose_update(self, terms, plan, d: int) -> str:
        """``"conjugate"`` or ``"optax"``: each client tests its own log-likelihood for being quadratic
        in the global sites (the test the conjugate update needs anyway). With ``update="conjugate"`` a
        client whose likelihood is not quadratic raises naming it; with ``"auto"`` it selects ``"optax"``."""
        if self.update_kind == "optax":
            return self._use("optax")

        def change(data):
            return G.hessian_change(partial(terms.log_lik, data=data), d, random.PRNGKey(2))

        if plan.mapping == "vmap":
            changes = jax.jit(jax.vmap(change))(plan.data)
        else:
            changes = [jax.jit(change)(data) for data in plan.data]
        if self.update_kind == "auto":
            quadratic = all(float(c) <= _QUADRATIC_TOL for c in changes)
            return self._use("conjugate" if quadratic else "optax")
        for name, c in zip(plan.names, changes):
            G.check_quadratic(
                c, what=f"client '{name}''s log-likelihood", sites=terms.sites, fix=_CONJ_FIX, tol=_QUADRATIC_TOL
            )
        return self._use("conjugate")

    # ------------------------------------------------------------------ BCM's one round; privacy
    def _before_run(self, rng_key, num_rounds: int, clients, options: dict) -> None:
        if self.committee is not None and (num_rounds != 1 or options.get("init_state") is not None):
            raise ValueError("BCM is one round from the prior: num_rounds=1 and no init_state")
        super()._before_run(rng_key, num_rounds, clients, options)

    def _build(self, clients: Clients):
        self.dp_plan.plan(clients)
        return super()._build(clients)

    def _shard_plate(self, clients: Clients, plate: Optional[str]) -> str:
        """The plate that indexes rows, needed to mask a client's shards."""
        for name, rows in clients.num_rows.items():
            if rows < self.num_shards:
                raise ValueError(_SHARDS.format(client=name, rows=rows, n=self.num_shards))
        if plate is not None:
            return plate
        first = clients.names[0]
        tr = trace_model(self.model, clients[first], self.model_kwargs)
        found = [n for n, site in tr.items() if site["type"] == "plate" and site["args"][0] == clients.num_rows[first]]
        if len(found) != 1:
            raise ValueError(_SHARD_PLATE.format(found=found))
        return found[0]


def BCM(model: Callable, *, prior: str = "same", **kwargs: Any) -> PVI:
    """Bayesian committee machine (Tresp, 2000): one round, every client fits its own
    posterior, the server multiplies them (Heikkilä et al.'s (2023) minimal-communication baselines).

    - ``prior="same"``: each client fits ``q_j ≈ p(theta | y_j)`` under the full prior and
      ``q = prod_j q_j / p^(J-1)``;
    - ``prior="split"``: each client fits under ``p^(1/J)`` and ``q = prod_j q_j``.

    It is PVI's first synchronous round with damping 1 (every factor starts at 1, so the
    cavity is the prior), with PVI's local fits, checks and DP mechanisms (Heikkilä et al. (2023) trains
    BCM with DP-SGD: ``dp="optimisation"``). So it returns that :class:`PVI` (its ``method`` is
    ``"bcm"``), whose ``run`` runs exactly one round.

    Args:
        model: as for :class:`PVI`.
        prior: ``"same"`` or ``"split"``.
        **kwargs: :class:`PVI`'s arguments, except ``schedule`` and ``damping``.
    """
    if prior not in ("same", "split"):
        raise ValueError(f"prior={prior!r}: choose 'same' or 'split'")
    for fixed in ("schedule", "damping", "subset_size", "variant", "num_shards"):
        if fixed in kwargs:
            raise ValueError(f"BCM is one synchronous round with damping 1 on whole clients; {fixed}= does not apply")
    return PVI(model, schedule="synchronous", damping=1.0, committee=prior, **kwargs)


@register_check(PVI)
def pvi_check(inference: PVI, result: RunResult) -> Verdict:
    """PVI's (and BCM's) fit check: the factor families' (:func:`~numpyro_fed.factor.inference.factor_check`),
    and under DP a warning naming the clients whose releases were withheld."""
    verdict = factor_check(inference, result)
    if inference.differentially_private:
        warn_withheld(type(inference).__name__, result)
    return verdict

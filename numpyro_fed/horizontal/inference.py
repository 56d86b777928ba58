"""``FederatedSVI``: the class layer over SFVI and SFVI-Avg, mirroring ``numpyro.infer.SVI``."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Callable, Dict, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

from .._validation import check_clients, check_model, check_optimizer, check_positive_int
from ..check import Verdict, from_diagnostic, register_check, unchecked
from ..check.psis import (
    MEAN_MARGIN,
    PARETO_K_LIMIT,
    SD_MARGIN,
    FitDiagnostic,
    describe_biased,
    fit_diagnostic,
    importance_resample,
    state_fingerprint,
)
from ..clients import Clients
from ..dp.plan import DPPlan, check_sgd_options
from ..model.groups import size_group_plates, trim_groups
from ..model.structure import (
    analyse_model,
    constrain_params,
    deterministic_of_globals,
    global_deterministic_sites,
    trace_model,
    with_improper_values,
)
from ..run.backends.mapping import client_data, client_item, plan_clients, shape_key, traced_args, unpadder
from ..run.inference import (
    NUM_SAMPLES,
    FederatedInference,
    Setup,
    checked_network,
    fitted,
    setup_for,
    state_of,
    with_exchange_traffic,
)
from ..run.params import GuideParams
from ..run.protocol import RunResult, RunState
from ..warnings import BiasedFitWarning, UncheckedFitWarning, UnreliableFitWarning, find_stack_level
from .check import client_log_weights_from_keys, log_weight_estimator
from .dp_sfvi_algorithm import dp_sfvi
from .guides import StructuredGuide
from .objective import FederatedObjective
from .sfvi_algorithm import sfvi
from .sfvi_avg_algorithm import OPTIMIZER_STATES, sfvi_avg

__all__ = ["FederatedSVI", "FitDiagnostic", "UnreliableFitWarning", "svi_check"]

METHODS = ("sfvi", "sfvi_avg")
FIT_CHECK_DRAWS = 1000  # draws of the fit check run after a network run (diagnose's default)
_UNKNOWN_CLIENT = "no client named {name!r}; clients are {names}"
_UNRELIABLE = (
    "{cls}: the fitted approximation is unreliable: Pareto k = {k:.2f} > {limit} for the importance "
    "ratios p(z, y) / q(z) (effective sample size {ess:.0f} of {n} draws), so q misses posterior mass "
    "and its means and sds can be far off. Common causes: a funnel (a scale parameter and the "
    "variables it scales, e.g. a centred hierarchical model: use the non-centred form or "
    "numpyro.infer.reparam.LocScaleReparam), a heavy-tailed or bounded posterior, or too few rounds. "
    "Check against NUTS (see svi.diagnose); check_fit=False silences this"
)
_BIASED = (
    "{cls}: Pareto k = {k:.2f} is below {limit}, but q's moments disagree with the importance-weighted moments "
    "of the same {n} draws (means more than {mean_margin} weighted sds apart or sds more than {sd_margin:.0%}) "
    "at {sites}: q is biased there (a Gaussian too narrow for a hierarchical scale, a skewed marginal, "
    "or too few rounds). Use "
    "sample_posterior(..., corrected=True) / nf.to_arviz(..., corrected=True) for importance-resampled draws, "
    "fit longer or with a richer guide, or check against NUTS; check_fit=False silences this"
)


class FederatedSVI(FederatedInference):
    """Federated stochastic variational inference.

    Args:
        model: a NumPyro model annotated with :func:`~numpyro_fed.global_site` /
            :func:`~numpyro_fed.local_site`, called as ``model(**client_args, **model_kwargs)``.
        guide: a :class:`~numpyro_fed.StructuredGuide` (or ``MeanFieldGuide``).
        optim: an ``optax.GradientTransformation``.
        method: ``"sfvi"`` (Hassan et al. (2023) Alg. 1; exact, one gradient exchange per step) or
            ``"sfvi_avg"`` (Alg. 2; ``local_steps`` local steps, then barycenter averaging).
        num_particles: Monte Carlo draws per step.
        stl: sticking-the-landing gradient estimator (Roeder et al., 2017; Hassan et al. (2023)
            eq. 6), the default: the variational density's own score term, whose mean is
            zero, is left out, so the gradient noise vanishes as ``q`` reaches a posterior
            inside its family. ``False`` gives the plain reparameterised estimator.
        check_fit: after ``run``, check the fit by Pareto-smoothed importance sampling
            (:meth:`diagnose`) and warn (``UnreliableFitWarning``) when ``q`` is far from
            the posterior; the diagnostic is kept as ``last_fit_check``. Over a network
            backend (Flower) each client computes its own term of ``log w`` per draw on its
            node and sends those 1000 scalars, as the ELBO's terms travel.
        local_steps: m for ``"sfvi_avg"``.
        optimizer_state: for ``"sfvi_avg"``: where each client's optimiser state for the
            global parameters starts its local steps. ``"average"`` (default): the server
            averages the clients' states and sends the average with the parameters, so an
            adaptive optimiser steps along the averaged gradient; ``"reset"``: fresh every
            round (FedAvg's convention); ``"keep"``: the client's own, from its last round.
            ``"reset"`` and ``"keep"`` make Adam's averaged step a vote of the clients'
            normalised steps, which collapsed Hassan et al.'s (2023) hierarchical BNN (see
            :mod:`~numpyro_fed.horizontal.sfvi_avg_algorithm`).
        participation: fraction of clients asked per round for ``"sfvi_avg"``.
        dp: ``"sgd"``: DP federated SVI (Heikkilä et al.'s (2023) "global VI" baseline; the model marks
            its protected rows with :class:`~numpyro_fed.dp_noise`): each round every
            client sends the sum of its rows' clipped gradients on a fixed-size random
            subset, plus Gaussian noise from its own key (see
            :mod:`~numpyro_fed.horizontal.dp_sfvi_algorithm`). Global sites only;
            ``method="sfvi"``; the PSIS check is not run (it sums data-dependent terms). A
            private run takes ``ledger=`` (a :class:`~numpyro_fed.dp.ledger.PrivacyLedger`):
            refused before it starts when it would take a client past its budget over all its
            runs, and charged to it.
        dp_sampling_rate: ``q``: each client uses ``round(q n_j)`` rows per round.
        trusted_aggregator: the gradients are summed by a trusted aggregator; each of the
            M clients adds noise ``sigma / sqrt(M)`` and the server sees only the sum.
        client_mapping: how the simulation maps clients: ``"auto"``, ``"vmap"`` or
            ``"loop"`` (see :mod:`numpyro_fed.run.backends.mapping`).
        row_plate: the plate that indexes rows, when clients of unequal size are padded
            and more than one plate follows the row count.
        model_kwargs: non-data keyword arguments passed to every call of the model.

    Examples:
        >>> import numpy as np, optax, jax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> clients = nf.Clients.split(np.arange(40) % 2, y=np.linspace(0.0, 2.0, 40))
        >>> svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.1))
        >>> result = svi.run(jax.random.PRNGKey(0), clients, 300, progress_bar=False)
        >>> bool(abs(result.params.guide["loc"][0] - 1.0) < 0.2)
        True
    """

    setup_extra = FederatedObjective  # Setup.extra
    params_type = GuideParams
    dp_mechanisms = ("sgd",)
    family_run_options = ("ledger",)  # run(..., ledger=PrivacyLedger): one budget per client over runs

    def __init__(
        self,
        model: Callable,
        guide: StructuredGuide,
        optim: optax.GradientTransformation,
        *,
        method: str = "sfvi",
        num_particles: int = 1,
        stl: bool = True,
        check_fit: bool = True,
        local_steps: int = 10,
        participation: float = 1.0,
        optimizer_state: str = "average",
        dp: Optional[str] = None,
        dp_sampling_rate: Optional[float] = None,
        trusted_aggregator: bool = False,
        client_mapping: str = "auto",
        row_plate: Optional[str] = None,
        model_kwargs: Optional[dict] = None,
    ) -> None:
        check_model(model)
        if not isinstance(guide, StructuredGuide):
            raise TypeError(f"guide must be an nf.StructuredGuide or nf.MeanFieldGuide; got {type(guide).__name__}")
        check_optimizer(optim)
        _check_guide_model(guide, model)
        if method not in METHODS:
            raise ValueError(f"method={method!r}: choose one of {METHODS}")
        if not (0.0 < participation <= 1.0):
            raise ValueError(f"participation={participation}: must be in (0, 1]")
        if method == "sfvi" and participation != 1.0:
            raise ValueError(
                "participation < 1 is for method='sfvi_avg'; SFVI's gradient is exact only "
                "when every client answers each round"
            )
        self.model = with_improper_values(model)
        self.guide = guide
        self.optim = optim
        self.method = method
        self.num_particles = check_positive_int("num_particles", num_particles)
        self.stl = bool(stl)
        self.check_fit = bool(check_fit)
        self.last_fit_check: Optional[FitDiagnostic] = None  # the last run's fit check (check_fit)
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.participation = float(participation)
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state={optimizer_state!r}: choose one of {OPTIMIZER_STATES}")
        self.optimizer_state = optimizer_state
        self.client_mapping = client_mapping
        self.row_plate = row_plate
        self.model_kwargs = dict(model_kwargs or {})
        self.dp = check_sgd_options(method, dp, dp_sampling_rate, trusted_aggregator)
        self.dp_sampling_rate = None if dp_sampling_rate is None else float(dp_sampling_rate)
        self.trusted_aggregator = bool(trusted_aggregator)
        self.dp_plan = DPPlan(self.model, self.model_kwargs, self.dp, trusted_aggregator=trusted_aggregator,
                          sampling_rate=self.dp_sampling_rate, svi=True)
        super().__init__()

    # ------------------------------------------------------------------ set-up
    _size_group_plates = size_group_plates
    _checked_state = None  # the fingerprint of the server state the last fit check judged

    def _validate_inputs(self, clients) -> None:
        check_clients(clients, type(self).__name__)

    def _build(self, clients: Clients) -> Setup[FederatedObjective]:
        structure = analyse_model(self.model, clients, self.model_kwargs)
        plan, structure = plan_clients(
            self.model, self.model_kwargs, clients, structure, self.client_mapping, self.row_plate
        )
        objective = FederatedObjective(self.model, self.guide, structure, self.model_kwargs, self.stl)
        objective.set_global_start(clients[clients.names[0]])
        J = len(clients)
        if self.dp_plan.plan(clients) is not None:
            local = list(structure.local_latent_names) + list(structure.local_param_names)
            if local:
                raise ValueError(
                    f"dp='sgd' (DP federated SVI) fits models with global sites only; {local} are "
                    f"local. Use nf.PVI(dp=...) or drop the local sites"
                )
            p = self.dp_plan.privacy
            algorithm = dp_sfvi(
                objective,
                self.optim,
                J,
                clip=p.spec.clip,
                noise_multiplier=p.noise_multiplier,
                sampling_rate=self.dp_sampling_rate,
                max_batch=p.dp_sgd.batch_size,
                trusted_aggregator=self.trusted_aggregator,
                num_particles=self.num_particles,
            )
        elif self.method == "sfvi":
            algorithm = sfvi(objective, self.optim, J, num_particles=self.num_particles)
        else:
            algorithm = sfvi_avg(
                objective,
                self.optim,
                J,
                clients.total_rows,
                local_steps=self.local_steps,
                participation=self.participation,
                num_particles=self.num_particles,
                optimizer_state=self.optimizer_state,
            )
        return Setup(clients, algorithm, plan, objective, {})

    def _params(self, setup: Setup, state: RunState) -> Dict:
        g = state.server.global_params
        return GuideParams(g["guide"], constrain_params(g["theta"], setup.extra.global_constraints))

    # ------------------------------------------------------------------ SVI API
    def get_params(self, state: RunState) -> Dict:
        """The server-held parameters, a :class:`~numpyro_fed.run.params.GuideParams`: the guide's
        (``guide``, in its own unconstrained parametrisation) and the global ``numpyro.param``
        sites (``theta``, constrained, as the model sees them)."""
        return self._params(fitted(self), state)

    def client_params(self, result: Union[RunResult, RunState], client: str) -> Dict[str, jax.Array]:
        """A client's own ``numpyro.param`` sites (marked local), constrained: the client's
        computation on its own state."""
        state = state_of(self, result)
        setup = fitted(self)
        if client not in setup.inputs:
            raise KeyError(_UNKNOWN_CLIENT.format(name=client, names=list(setup.inputs.names)))
        j = setup.plan.names.index(client)
        local = client_item(setup.plan, state.clients, j).state.local_params
        constraints = setup.extra.client_layout(setup.inputs[client])[1]
        return constrain_params(local["theta"], constraints)

    def check_of(self, state: RunState) -> Optional[FitDiagnostic]:
        """The fit check of ``state``: the run's own when ``state`` is the run's result,
        otherwise computed now (simulation), so corrected draws never come from another fit."""
        if self.last_fit_check is not None and getattr(self, "_checked_state", None) == state_fingerprint(state.server):
            return self.last_fit_check
        return self.diagnose(state) if self.check_fit and state.clients is not None else None

    def _check_draws(self, setup: Setup, state: RunState, num_draws: int, rng_key):
        """The fit check's draws of the global sites (the server's own: the same ``k_g`` as
        the clients' terms use), in user space, unconstrained flat and unconstrained per site."""
        if "check_draws" not in setup.cache:  # compiled once per set-up
            obj = setup.extra

            def draws(g, k_g, num):
                z = jax.vmap(lambda e: obj.global_latent(g, e))(random.normal(k_g, (num, obj.global_size)))
                return jax.vmap(obj.structure.constrain_global)(z), z

            setup.cache["check_draws"] = jax.jit(draws, static_argnums=2)
        k_g, _ = random.split(rng_key)
        user, z = setup.cache["check_draws"](state.server.global_params, k_g, num_draws)
        per_site = jax.vmap(setup.extra.structure.global_latent.unravel)(z)
        return (
            {k: np.asarray(v) for k, v in user.items()},
            np.asarray(z),
            {k: np.asarray(v) for k, v in per_site.items()},
        )

    # ------------------------------------------------------------------ fit check over a network
    def _network_log_weights(self, network, setup: Setup, result: RunResult, num_draws: int = 1000):
        """:meth:`diagnose`'s ``log w`` (its default key and draws) with each client's term
        computed on its node (:meth:`client_value`), or ``None`` if a client did not answer."""
        obj, J = setup.extra, len(setup.plan.names)
        k_g, k_l = random.split(random.PRNGKey(0x51))
        keys = random.split(k_l, J)
        g = result.state.server.global_params
        payloads = {j: {"global_params": g, "k_g": k_g, "key": keys[j]} for j in range(J)}
        like = {"values": jax.ShapeDtypeStruct((FIT_CHECK_DRAWS,), jnp.float32)}
        got = network.client_values("log_weights", payloads, like, result.transcript, int(result.communication.rounds))
        self._fit_check_messages = (payloads, got)
        if len(got) < J:
            return None
        eps_g = random.normal(k_g, (num_draws, obj.global_size))
        values = sum(got[j]["values"] for j in range(J))  # in client order, as the simulation sums them
        return np.asarray(jax.vmap(lambda e: obj.server_term(g, e))(eps_g) + values, np.float64)

    def _fit_check_traffic(self, comm):
        """The run's communication plus the fit check's messages (as serialised)."""
        return with_exchange_traffic(comm, [self._fit_check_messages])

    def client_value_inputs(self, name: str, setup: Setup, data) -> Dict[str, Any]:
        """The structure of what the server sends for :meth:`client_value` ``name``."""
        if name != "log_weights":
            raise ValueError(f"{type(self).__name__}: no client-side value {name!r}")
        g = jax.eval_shape(lambda: setup.algorithm.init_server(random.PRNGKey(0))[0]).global_params
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        return {"global_params": g, "k_g": key, "key": key}

    def client_value(self, name: str, setup: Setup, client_state, data, payload, rng_key=None) -> Dict[str, Any]:
        """On a client after a network run: its term of the fit check's ``log w`` per draw,
        summed over its own rows (what :meth:`diagnose` computes for it in simulation)."""
        self.client_value_inputs(name, setup, data)
        key = ("client_log_weights", FIT_CHECK_DRAWS)
        if key not in setup.cache:
            setup.cache[key] = jax.jit(
                partial(client_log_weights_from_keys, setup.extra, 1.0 / len(setup.plan.names), FIT_CHECK_DRAWS)
            )
        values = setup.cache[key](
            payload["global_params"], payload["k_g"], payload["key"], client_state.local_params, data
        )
        return {"values": values}

    def evaluate(self, state: RunState, clients: Clients, num_particles: int = 16, rng_key=None):
        """Negative ELBO estimate at ``state``: a server term plus every client's term (jit-compiled)."""
        setup = setup_for(self, clients)
        num_particles = check_positive_int("num_particles", num_particles)
        rng_key = state.server_key if rng_key is None else rng_key
        return -jnp.mean(self._log_weights(setup, state, num_particles, rng_key))

    def _log_weights(self, setup: Setup, state: RunState, num_draws: int, rng_key) -> jax.Array:
        key = ("log_weights", num_draws)
        if key not in setup.cache:
            setup.cache[key] = jax.jit(log_weight_estimator(setup, num_draws))
        return setup.cache[key](state, setup.plan.data, rng_key)

    def diagnose(self, result: Union[RunResult, RunState], num_draws: int = 1000, rng_key=None) -> FitDiagnostic:
        """How far the fitted ``q`` is from the posterior, by Pareto-smoothed importance
        sampling (Yao et al., 2018, "Yes, but did it work?").

        Draws ``z ~ q`` and computes ``log w = log p(z, y) - log q(z)``, each client
        summing its own term over its own rows (one scalar per draw leaves a client, as
        in the ELBO). ``pareto_k`` above 0.7 means ``q`` misses mass the posterior has:
        its means and variances can be far off (e.g. a funnel, a heavy tail, a
        posterior outside the Gaussian family). Below it, the moment check compares
        ``q``'s mean and sd of every global site (user space) with the PSIS-weighted ones
        of the same draws (``moments``, ``biased``; see :mod:`numpyro_fed.check.psis`).
        ``run`` calls this and warns (``UnreliableFitWarning``, ``BiasedFitWarning``).

        Returns:
            a :class:`FitDiagnostic` (``pareto_k``, ``ess``, ``elbo``, ``log_weights``,
            ``moments``, ``biased``, ``draws``, ``verdict``).
        """
        setup = fitted(self)
        state = state_of(self, result)
        num_draws = check_positive_int("num_draws", num_draws)
        rng_key = random.PRNGKey(0x51) if rng_key is None else rng_key
        if state.clients is None:
            raise ValueError(
                f"{type(self).__name__}.diagnose needs every client's state; over a network backend "
                f"the run itself checks the fit (see last_fit_check)"
            )
        log_w = np.asarray(self._log_weights(setup, state, num_draws, rng_key), np.float64)
        return fit_diagnostic(log_w, *self._check_draws(setup, state, num_draws, rng_key), shape=True)

    # ------------------------------------------------------------------ posterior
    def draw(
        self,
        rng_key: jax.Array,
        result: Union[RunResult, RunState],
        num_samples: Optional[int] = None,
        *,
        client: Optional[str] = None,
        corrected: bool = False,
    ) -> Dict[str, jax.Array]:
        """``num_samples`` (default 1000) draws from the fitted approximation, in constrained space.

        Without ``client``: the global latent sites, and the model's ``numpyro.deterministic``
        sites that are functions of the global sites (and global ``numpyro.param`` sites)
        alone, computed by the first client on its own rows (the server never runs the
        model; per-row and local deterministic sites have no value under ``q(z_G)``).
        With a client name: that client's local latent sites as well, drawn from
        ``q(z_L | z_G)``, and the model's ``numpyro.deterministic`` sites computed on the
        client's rows; this uses the client's local state and data and is the client's own
        computation.

        Args:
            result: a :class:`RunResult` or a :class:`RunState`.
            corrected: PSIS-corrected draws of the global sites instead of draws from
                ``q``: the last fit check's draws resampled by their smoothed importance
                weights (:func:`numpyro_fed.check.psis.importance_resample`). Needs the
                check of the run that gave ``result`` (``check_fit=True``) with Pareto k
                at most 0.7; only as many distinct values as the check drew (1000).
                Global sites only (a client's local draws are not reweighted).
        """
        state = state_of(self, result)
        num_samples = check_positive_int("num_samples", NUM_SAMPLES if num_samples is None else num_samples)
        setup = fitted(self)
        obj = setup.extra
        g = state.server.global_params
        k_g, k_l = random.split(rng_key)
        if corrected:
            if client is not None:
                raise ValueError(
                    f"{type(self).__name__}.sample_posterior: corrected=True gives the global sites' "
                    f"draws only (a client's local draws are not reweighted); drop client= or "
                    f"corrected=True"
                )
            z_g = importance_resample(k_g, self.check_of(state), num_samples, type(self).__name__)
        else:
            eps_g = random.normal(k_g, (num_samples, obj.global_size))
            z_g = jax.vmap(lambda e: obj.global_latent(g, e))(eps_g)
        if client is None:
            if "server_draws" not in setup.cache:  # compiled once per set-up
                setup.cache["server_draws"] = jax.jit(jax.vmap(obj.structure.constrain_global))
                names = global_deterministic_sites(
                    self.model,
                    self.model_kwargs,
                    setup.inputs,
                    obj.structure.global_latent.names,
                    obj.global_constraints,
                )
                first = setup.inputs[setup.inputs.names[0]]
                fn = deterministic_of_globals(self.model, self.model_kwargs, first, names)
                setup.cache["deterministic"] = jax.jit(jax.vmap(fn, in_axes=(0, None))) if names else None
            draws = setup.cache["server_draws"](z_g)
            if setup.cache["deterministic"] is not None:
                params = constrain_params(g["theta"], obj.global_constraints)
                draws.update(setup.cache["deterministic"](draws, params))
            return draws
        _, local, z_g, z_real, real_layout, args = self._client_latents(setup, state, client, k_l, z_g)
        arrays, fixed = traced_args(args)
        key = ("client_draws", shape_key(real_layout, arrays, fixed))
        if key not in setup.cache:  # compiled once per client shape and set-up (not once per client)
            setup.cache[key] = jax.jit(
                jax.vmap(
                    lambda g_, l_, zg, zl, a: obj.constrained_sample(g_, l_, zg, zl, {**a, **fixed}, real_layout),
                    in_axes=(None, None, 0, 0, None),
                )
            )
        return trim_groups(setup.cache[key](g, local, z_g, z_real, arrays), real_layout, args)  # its own groups only

    def _client_latents(self, setup: Setup, state: RunState, client: str, rng_key, z_g):
        """Client ``client``'s draws of its local latents given the global draws ``z_g``
        (unpadded), with what it needs to run the model on its own rows."""
        obj, plan = setup.extra, setup.plan
        if client not in setup.inputs:
            raise KeyError(_UNKNOWN_CLIENT.format(name=client, names=list(setup.inputs.names)))
        g = state.server.global_params
        j = plan.names.index(client)
        data = client_data(plan, j)
        local = client_item(plan, state.clients, j).state.local_params
        layout, _, _ = obj.client_layout(data.args)
        eps_l = random.normal(rng_key, (z_g.shape[0], layout.size))
        z_l = jax.vmap(lambda zg, e: obj.local_latent(g, local, zg, e, layout, data.row_mask, data.args))(z_g, eps_l)
        n = int(plan.num_rows[j])
        args = setup.inputs[client]
        real_layout = obj.client_layout(args)[0]

        return g, local, z_g, jax.vmap(unpadder(layout, real_layout, n))(z_l), real_layout, args

    def log_likelihood(
        self, rng_key: jax.Array, result: Union[RunResult, RunState], num_samples: int, client: str
    ) -> tuple:
        """Pointwise log-likelihood and posterior predictive draws on ``client``'s rows.

        The draws are those of :meth:`sample_posterior` with the same ``rng_key`` (the
        global draws are the same for every client, so the clients' matrices stack into
        the pooled one). This runs the model on the client's data: it is the client's
        own computation, and its output stays with the client (federated model comparison
        sends only sums, see :func:`numpyro_fed.federated_loo`).

        Returns:
            ``(log_likelihood, posterior_predictive)``: dicts ``observed site ->
            (num_samples, *site batch shape)``.
        """
        state = state_of(self, result)
        num_samples = check_positive_int("num_samples", num_samples)
        setup = fitted(self)
        obj = setup.extra
        k_g, k_l = random.split(rng_key)
        g = state.server.global_params
        eps_g = random.normal(k_g, (num_samples, obj.global_size))
        z_g = jax.vmap(lambda e: obj.global_latent(g, e))(eps_g)
        g, local, z_g, z_real, real_layout, args = self._client_latents(setup, state, client, k_l, z_g)
        keys = random.split(random.fold_in(k_l, 1), num_samples)
        arrays, fixed = traced_args(args)
        key = ("observed_sites", shape_key(real_layout, arrays, fixed))
        if key not in setup.cache:  # compiled once per client shape and set-up (not once per client)
            setup.cache[key] = jax.jit(
                jax.vmap(
                    lambda g_, l_, zg, zl, k, a: obj.observed_sites(g_, l_, zg, zl, {**a, **fixed}, real_layout, k),
                    in_axes=(None, None, 0, 0, 0, None),
                )
            )
        return setup.cache[key](g, local, z_g, z_real, keys, arrays)

    def observed(self, clients: Clients, client: str) -> Dict[str, jax.Array]:
        """Values of a client's observed sites (the client's own data)."""
        tr = trace_model(self.model, clients[client], self.model_kwargs)
        return {n: s["value"] for n, s in tr.items() if s["type"] == "sample" and s["is_observed"]}


_OTHER_MODEL = (
    "FederatedSVI: the guide was built for another model ({guide}) than the one fitted ({model}): build it for "
    "this one, nf.StructuredGuide({model}) (or nf.StructuredGuide(None); the sites are read off the model fitted)"
)


def _innermost(fn):
    """The user's function under any handlers (NumPyro's ``Messenger`` keeps it as ``fn``)."""
    while callable(getattr(fn, "fn", None)) and hasattr(fn, "process_message"):
        fn = fn.fn
    return fn


def _check_guide_model(guide: StructuredGuide, model: Callable) -> None:
    """Refuse a guide built for another model (the function under any handlers differs)."""
    if guide.model is None:
        return
    built, fitted_fn = _innermost(guide.model), _innermost(model)
    if built is not fitted_fn:
        raise ValueError(_OTHER_MODEL.format(guide=getattr(built, "__name__", repr(built)),
                                             model=getattr(fitted_fn, "__name__", repr(fitted_fn))))


@register_check(FederatedSVI)
def svi_check(inference: FederatedSVI, result: RunResult) -> Verdict:
    """Federated SVI's fit check: ``q`` against the posterior (:meth:`FederatedSVI.diagnose`; over a
    network backend, each client computing its term on its node), and its warning."""
    setup = fitted(inference)
    inference.last_fit_check = None
    cls = type(inference).__name__
    if not inference.check_fit:
        return unchecked("check_fit=False")
    if inference.differentially_private:  # under DP: the check sums data-dependent terms
        return unchecked("a differentially private fit is not checked (the check sums data-dependent terms)")
    communication = None
    if result.state.clients is None:  # a network backend: the clients' states stay on their nodes
        network = checked_network(inference)
        log_w = None if network is None else inference._network_log_weights(network, setup, result)
        communication = inference._fit_check_traffic(result.communication) if network is not None else None
        if log_w is None:
            why = "this backend cannot ask the clients" if network is None else "some clients did not answer"
            warnings.warn(f"{cls}: the fit check (Pareto k of q against the posterior) needs every client's term, "
                          f"and {why}; check the fit in simulation, or pass check_fit=False to silence this",
                          UncheckedFitWarning, stacklevel=find_stack_level())
            return unchecked(f"the check needs every client's term, and {why}", communication)
        diag = fit_diagnostic(log_w, *inference._check_draws(setup, result.state, FIT_CHECK_DRAWS,
                                                             random.PRNGKey(0x51)), shape=True)
    else:
        diag = inference.diagnose(result)
    inference.last_fit_check = diag
    inference._checked_state = state_fingerprint(result.state.server)
    if diag.verdict == "unreliable":
        warnings.warn(_UNRELIABLE.format(cls=cls, k=diag.pareto_k, limit=PARETO_K_LIMIT, ess=diag.ess,
                                         n=len(diag.log_weights)), UnreliableFitWarning, stacklevel=find_stack_level())
    elif diag.verdict == "biased":
        warnings.warn(_BIASED.format(cls=cls, k=diag.pareto_k, limit=PARETO_K_LIMIT, n=len(diag.log_weights),
                                     mean_margin=MEAN_MARGIN, sd_margin=SD_MARGIN, sites=describe_biased(diag.biased)),
                      BiasedFitWarning, stacklevel=find_stack_level())
    return from_diagnostic(diag, communication)

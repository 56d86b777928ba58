"""``VerticalSVI``: the class layer over vertical SFVI, mirroring ``numpyro.infer.SVI``."""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._validation import check_positive_int
from ..check import Verdict, register_check
from ..run.inference import NUM_SAMPLES, Setup, fitted, setup_for, state_of
from ..run.protocol import RunResult, RunState
from ..warnings import UnreliableFitWarning, find_stack_level
from .guides import VerticalGuide
from .inference import VerticalInference, check_batch, corrected_draws, held_params, party_draws, vertical_check
from .network_check import party_check_key
from .objective import SERVER, VerticalObjective
from .rho import RHO_SHIFT_LIMIT, AugmentationCheck, augmentation_check
from .sfvi_algorithm import vertical_sfvi

__all__ = ["VerticalSVI", "vertical_svi_check"]

_GUIDE = "guide must be an nf.VerticalGuide (e.g. nf.VerticalGuide('amortized')); got {kind}"
_RHO_TOO_LARGE = (
    "VerticalSVI: rho = {rho:g} is too large for this data: the augmented model adds predictor noise of variance "
    "J rho^2 = {added:.3g}, {excess:.1%} of the likelihood's own (mean curvature {curv:.3g}), which moves the "
    "likelihood's scale by about {shift:.1f} posterior sds and biases the coefficients with it, so the augmented "
    "posterior is not the true model's. Use rho <= {rho_max:.3g} (the rule in nf.vertical.rho: shift <= "
    "{limit}); check_rho=False silences this"
)

class VerticalSVI(VerticalInference):
    """Vertical federated SVI (Hassan et al. (2024), Algorithms 1 and 2).

    ``form="augmented"`` models run Algorithm 1 (the server holds the likelihood; ``y``
    may be shared or the server's alone); ``form="power"`` models run Algorithm 2 (``y``
    shared, two exchanges per iteration).

    Args:
        model: a :func:`~numpyro_fed.vertical_split` model.
        guide: a :class:`~numpyro_fed.VerticalGuide`.
        optim: an ``optax.GradientTransformation`` (each party runs its own copy).
        batch_size: rows per iteration, chosen by the server (``None``: all rows).
        model_kwargs: non-data keyword arguments of the model.
        check_rho: after ``run`` (augmented form, simulation), compare ``rho`` with the
            data's scale (:mod:`numpyro_fed.vertical.rho`) and warn
            (``UnreliableFitWarning``, with the ``rho`` that would do) when the augmented
            posterior is measurably not the true model's; kept as ``last_rho_check``.
        check_fit: after ``run`` (simulation), check ``q`` against the **true** model's
            posterior (:meth:`diagnose`, :mod:`numpyro_fed.vertical.check`: each client sends
            its contribution ``g_j`` on every row and one scalar per draw, 1000 draws) and
            warn (``UnreliableFitWarning`` when Pareto k > 0.7, ``BiasedFitWarning`` naming
            the sites whose moments are off); kept as ``last_fit_check``.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(xa, xb, y):
        ...     ba = numpyro.sample("ba", dist.Normal(0, 1).expand([2]).to_event(1))
        ...     bb = numpyro.sample("bb", dist.Normal(0, 1).expand([1]).to_event(1))
        ...     with numpyro.plate("rows", y.shape[0]):
        ...         ga = numpyro.deterministic("ga", xa @ ba)
        ...         gb = numpyro.deterministic("gb", xb @ bb)
        ...         numpyro.sample("y", dist.Normal(ga + gb, 1.0), obs=y)
        >>> spec = {"a": dict(data="xa", sites="ba", contribution="ga"),
        ...         "b": dict(data="xb", sites="bb", contribution="gb")}
        >>> vmodel = nf.vertical_split(model, clients=spec, rho=0.5, response="y")
        >>> x = np.random.default_rng(0).normal(size=(50, 3))
        >>> y = x @ np.array([1.0, -1.0, 0.5])
        >>> svi = nf.VerticalSVI(vmodel, nf.VerticalGuide("meanfield"), optax.adam(0.05))
        >>> res = svi.run(jax.random.PRNGKey(0), num_rounds=1500, progress_bar=False, xa=x[:, :2], xb=x[:, 2:], y=y)
        >>> draws = svi.sample_posterior(jax.random.PRNGKey(1), res, 500)
        >>> bool(abs(draws["ba"][:, 0].mean() - 1.0) < 0.3)
        True

    References:
        Hassan, Sutton, Mira, Mengersen (Hassan et al. (2024)), §4.
    """

    method = "vertical_sfvi"
    loss_name = "elbo"

    def __init__(
        self,
        model: Callable,
        guide: VerticalGuide,
        optim: optax.GradientTransformation,
        *,
        batch_size: Optional[int] = None,
        model_kwargs: Optional[dict] = None,
        check_rho: bool = True,
        check_fit: bool = True,
    ) -> None:
        if not isinstance(guide, VerticalGuide):
            raise TypeError(_GUIDE.format(kind=type(guide).__name__))
        self.model, self.guide = model, guide
        self.check_rho = bool(check_rho)
        self.check_fit = bool(check_fit)
        self.last_rho_check: Optional[AugmentationCheck] = None
        super().__init__(optim, batch_size, model_kwargs)

    def _build_algorithm(self, data):
        obj = VerticalObjective(self.model, self.guide, data, self.model_kwargs)
        check_batch(self, obj)
        return obj, vertical_sfvi(obj, self.optim, self.batch_size)

    def _party_draw(self, setup: Setup, num_draws: int):
        """``draw(party, params, key) -> (u, log_q, point)``: ``num_draws`` draws of one
        party's sites from its own ``q`` (on its own node over a network backend)."""
        obj = setup.extra.objective
        theta = self.guide.theta

        def draw(party, params, key):
            eps = random.normal(key, (num_draws, obj.layouts[party].size))
            u, log_q = jax.vmap(lambda e: theta.sample(params["theta"], e))(eps)
            return u, log_q, params["point"]

        return draw

    def _check_draws_fn(self, setup: Setup, num_draws: int):
        obj = setup.extra.objective
        draw = self._party_draw(setup, num_draws)

        def fn(state, arrays, rng_key, own_keys):
            params = held_params(setup, state)
            keys = {SERVER: rng_key}
            if own_keys:  # each client from its own key, as on its node (network_check.party_check_key)
                keys.update({c: party_check_key(slot.rng_key) for c, slot in zip(obj.clients, state.clients)})
            else:
                keys.update(zip(obj.clients, random.split(random.fold_in(rng_key, 1), len(obj.clients))))
            u, log_q, points = {}, 0.0, {}
            for p in (SERVER,) + obj.clients:
                u[p], lq, points[p] = draw(p, params[p], keys[p])
                log_q = log_q + lq
            return u, log_q, points

        return fn

    def rho_check(self, result) -> AugmentationCheck:
        """How far the augmented posterior is from the true model's at this fit (see
        :mod:`numpyro_fed.vertical.rho`): the server's likelihood curvature at the fitted
        ``z`` (each client's ``z`` at its ``q``'s mean, the z it sends). Simulation only."""
        state = state_of(self, result)
        setup = fitted(self)
        obj = setup.extra.objective
        params = held_params(setup, state)
        data, rows = setup.cache["data"], jnp.arange(obj.num_rows)
        z = {}
        for c in obj.clients:
            p = params[c]
            u, _ = self.guide.theta.sample(p["theta"], jnp.zeros(obj.layouts[c].size))
            own = obj.party_args(c, data, rows)
            z[c] = obj.client_term(c, u, p["aux"], jnp.zeros(obj.num_rows), own, rows, points=p["point"])[1]
        server = params[SERVER]
        u0, _ = self.guide.theta.sample(server["theta"], jnp.zeros(obj.layouts[SERVER].size))
        own0 = obj.party_args(SERVER, data, rows)

        def log_lik(zz):  # the server's term; its prior part does not depend on z
            return obj.server_term(u0, zz, own0, rows, server["point"])

        return augmentation_check(log_lik, z, self.model.rho, obj.num_rows)

    def evaluate(self, state: RunState, num_particles: int = 16, rng_key=None, **data):
        """``-ELBO`` on all rows, averaged over ``num_particles`` draws (jit-compiled)."""
        setup = setup_for(self, data)
        rng_key = state.server_key if rng_key is None else rng_key
        key = ("elbo", int(num_particles))
        if key not in setup.cache:  # compile once per set-up and particle count
            obj = setup.extra.objective
            full = vertical_sfvi(obj, self.optim, None)
            names = setup.plan.names

            @jax.jit
            def estimate(state, arrays, k):
                sched = full.schedule(k)
                views = {c: obj.party_args(c, arrays, sched["rows"]) for c in (SERVER,) + names}
                parties = {c: slot.state.inner for c, slot in zip(names, state.clients)}
                keys = random.split(k, int(num_particles))
                return jnp.mean(jax.vmap(lambda kk: full.elbo(kk, state.server.inner, parties, sched, views))(keys))

            setup.cache[key] = estimate
        estimate = setup.cache[key]
        return -estimate(state, setup.cache["data"], rng_key)

    def draw(self, rng_key, result, num_samples: Optional[int] = None, *, client: Optional[str] = None,
                         corrected: bool = False) -> Dict[str, jax.Array]:
        """``num_samples`` (default 1000) draws of every party's sites from ``q(theta)``, constrained
        (with ``client``: that party's sites only).

        Each party can draw its own block; the simulation gathers them for analysis.
        ``corrected=True``: the fit check's draws importance-resampled towards the true
        model's posterior (needs the check's Pareto k <= 0.7; a ValueError says why not).
        """
        state = state_of(self, result)
        num_samples = check_positive_int("num_samples", NUM_SAMPLES if num_samples is None else num_samples)
        if corrected:
            return party_draws(self, corrected_draws(self, rng_key, state, int(num_samples)), client)
        setup = fitted(self)
        obj = setup.extra.objective
        params_of = held_params(setup, state)
        out = {}
        keys = random.split(rng_key, len(obj.clients) + 1)
        for key, party in zip(keys, (SERVER,) + obj.clients):
            size = obj.layouts[party].size
            if size == 0:
                continue
            params = params_of[party]
            eps = random.normal(key, (num_samples, size))
            u = jax.vmap(lambda e: self.guide.theta.sample(params["theta"], e)[0])(eps)
            out.update(jax.vmap(lambda v: obj.constrain(party, v))(u))
        return party_draws(self, out, client)


@register_check(VerticalSVI)
def vertical_svi_check(inference: VerticalSVI, result: RunResult) -> Verdict:
    """Vertical SVI's fit check: the vertical families' (:func:`~numpyro_fed.vertical.inference.vertical_check`),
    then, in the augmented form, whether ``rho`` moves the augmented posterior too far from the true
    model's (:meth:`VerticalSVI.rho_check`; simulation only): ``"biased"`` and a warning naming the
    ``rho`` that would do."""
    inference.last_rho_check = None
    obj = fitted(inference).extra.objective
    verdict = vertical_check(inference, result)
    if not inference.check_rho or obj.form != "augmented" or result.state.clients is None:
        return verdict
    check = inference.last_rho_check = inference.rho_check(result)
    verdict = verdict._replace(reports={**verdict.reports, "rho": check})
    if not check.ok:
        warnings.warn(_RHO_TOO_LARGE.format(rho=check.rho, added=len(obj.clients) * check.rho**2,
                                            excess=check.excess, curv=check.curvature, shift=check.shift,
                                            rho_max=check.rho_max, limit=RHO_SHIFT_LIMIT),
                      UnreliableFitWarning, stacklevel=find_stack_level())
        verdict = verdict._replace(status="biased" if verdict.status == "ok" else verdict.status,
                                   why=f"rho={check.rho:g} moves the augmented posterior; {verdict.why}")
    return verdict

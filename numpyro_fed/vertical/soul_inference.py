"""``VerticalSOUL``: the class layer over vertical SOUL (Hassan et al. (2024), Appendix A)."""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._validation import check_positive_int
from ..run.inference import NUM_SAMPLES, fitted, state_of
from .check import gaussian_draws
from .inference import VerticalInference, check_batch, corrected_draws, party_draws
from .objective import SERVER, VerticalObjective
from .soul_algorithm import PointGuide, vertical_soul

__all__ = ["VerticalSOUL"]

_STEP = "step_size={value!r}: the Langevin step must be a positive float (or {{party: float}})"
_STEP_PARTY = (
    "step_size names {bad}, which are not parties of this model; the parties are {parties}"
)
_STEP_MISSING = "step_size has no entry for {missing}; give every party with sites a Langevin step"
_NOT_FITTED = "sample_posterior needs a fitted VerticalSOUL: call run() or init() first"


class VerticalSOUL(VerticalInference):
    """Vertical SOUL: MAP estimates of the auxiliary ``z`` and unadjusted-Langevin draws of
    ``theta`` from ``p(theta | z_hat, y)`` (Hassan et al. (2024), Appendix A).

    Runs on the same protocol as :class:`~numpyro_fed.VerticalSVI`: clients send ``z_j``
    on the round's rows, the server returns gradients with respect to ``z``. Between two
    exchanges every party takes ``num_langevin`` Langevin steps on its own ``theta``
    block (warm-started), which is where SOUL's local computation lies. The augmented
    form supports server-held sites (a server chain for latent sites, ascent for
    ``numpyro.param`` sites, A.3); in the power form server-held latent sites (an
    intercept) take one Langevin step per exchange from the clients' gradients, and
    server ``numpyro.param`` sites are not supported.

    The draws condition on the point ``z_hat``, so they are narrower than the augmented
    model's marginal posterior of ``theta`` (the paper's caveat); the Langevin
    discretisation adds a bias of order ``step_size``.

    Args:
        model: a :func:`~numpyro_fed.vertical_split` model.
        optim: an optax optimiser for ``z`` and ``numpyro.param`` sites, used as ascent.
            A decaying schedule (e.g. ``optax.sgd(optax.polynomial_schedule(...))``)
            gives the Robbins-Monro conditions.
        step_size: the Langevin step, one float or ``{party: float}`` (``"server"`` for the
            server's chain). Unconstrained space.
        num_langevin: Langevin steps per communication (``M``); the ``z`` gradient averages
            over them.
        batch_size: rows per iteration, chosen by the server (``None``: all rows).
        model_kwargs: non-data keyword arguments of the model.
        init_radius: chains start uniform in ``(-r, r)`` (unconstrained space).
        check_fit: after ``run`` (simulation), check the draws against the **true** model's
            posterior (:meth:`diagnose`): every party fits a Gaussian to 2000 steps of its own
            chain (``z`` held at ``z_hat``), and that Gaussian is checked as
            :class:`~numpyro_fed.VerticalSVI`'s ``q`` is (Pareto k and the per-site moment
            check; :mod:`numpyro_fed.vertical.check`); warns ``UnreliableFitWarning`` or
            ``BiasedFitWarning`` and keeps ``last_fit_check``. Non-Gaussian draws are judged
            through their Gaussian summary.

    Examples:
        >>> import jax, numpy as np, optax
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
        >>> soul = nf.VerticalSOUL(vmodel, optax.sgd(0.1), step_size=2e-3, num_langevin=5)
        >>> res = soul.run(jax.random.PRNGKey(0), num_rounds=500, progress_bar=False, xa=x[:, :2], xb=x[:, 2:], y=y)
        >>> draws = soul.sample_posterior(jax.random.PRNGKey(1), res, 500)
        >>> bool(abs(draws["ba"][:, 0].mean() - 1.0) < 0.3)
        True

    References:
        Hassan, Sutton, Mira, Mengersen (Hassan et al. (2024)), Appendix A; De Bortoli, Durmus,
        Pereyra, Vidal (2021), "Efficient stochastic optimisation by unadjusted Langevin
        Monte Carlo", Statistics and Computing 31.
    """

    method = "vertical_soul"
    loss_name = "log_joint"

    def __init__(
        self,
        model: Callable,
        optim: optax.GradientTransformation,
        *,
        step_size: Union[float, Mapping[str, float]],
        num_langevin: int = 5,
        batch_size: Optional[int] = None,
        model_kwargs: Optional[dict] = None,
        init_radius: float = 0.5,
        check_fit: bool = True,
    ) -> None:
        steps = step_size.values() if isinstance(step_size, Mapping) else [step_size]
        for value in steps:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(_STEP.format(value=step_size))
        self.num_langevin = check_positive_int("num_langevin", num_langevin, what=" (Langevin steps per communication)")
        self.model = model
        self.step_size = step_size
        self.init_radius = float(init_radius)
        self.check_fit = bool(check_fit)
        super().__init__(optim, batch_size, model_kwargs)

    def _build_algorithm(self, data):
        obj = VerticalObjective(self.model, PointGuide(), data, self.model_kwargs)
        check_batch(self, obj)
        if isinstance(self.step_size, Mapping):
            parties = (SERVER,) + obj.clients
            bad = sorted(set(self.step_size) - set(parties))
            if bad:
                raise ValueError(_STEP_PARTY.format(bad=bad, parties=list(parties)))
            missing = [p for p in parties if obj.layouts[p].size and p not in self.step_size]
            if missing:
                raise ValueError(_STEP_MISSING.format(missing=missing))
            step = {p: self.step_size.get(p, 1.0) for p in parties}
        else:
            step = float(self.step_size)
        alg = vertical_soul(obj, self.optim, step, self.num_langevin, self.batch_size, self.init_radius)
        return obj, alg

    def _check_draws_fn(self, setup, num_draws: int):
        obj = setup.extra.objective
        chains = self._chains_fn(setup, 2 * num_draws)
        parties = (SERVER,) + obj.clients

        def draw(state, arrays, rng_key, own_keys=False):  # simulation only: one key for every party's chain
            k_chain, k_q = random.split(rng_key)
            runs = chains(state, arrays, k_chain)
            u, log_q = {}, jnp.zeros(num_draws)
            for key, p in zip(random.split(k_q, len(parties)), parties):  # each party summarises its own chain
                d = obj.layouts[p].size
                if not d:
                    u[p] = jnp.zeros((num_draws, 0))
                    continue
                x = runs[p]
                cov = jnp.atleast_2d(jnp.cov(x, rowvar=False)) + 1e-9 * jnp.eye(d)
                u[p], lq = gaussian_draws(key, x.mean(0), jnp.linalg.cholesky(cov), num_draws)
                log_q = log_q + lq
            points = {c: slot.state.inner.params["point"] for c, slot in zip(obj.clients, state.clients)}
            points[SERVER] = state.server.inner.params["point"]
            return u, log_q, points

        return draw

    def draw(
        self, rng_key, result, num_samples: Optional[int] = None, *, client: Optional[str] = None, thinning: int = 1,
        num_warmup: int = 0, corrected: bool = False,
    ) -> Dict[str, jax.Array]:
        """``num_samples`` (default 1000) Langevin draws of every party's sites from
        ``p(theta | z_hat, y)``, constrained (with ``client``: that party's sites only).

        ``z`` is held at its final value, so the chains need no further communication
        (in the power form each client needs the others' ``z_hat`` once; with server
        sites each step is one more exchange of ``theta_0`` and its gradient). Each chain
        continues from the run's final state on all rows of the data of the last
        ``run``; ``num_warmup`` steps are discarded, then every ``thinning``-th is kept.
        Jit-compiled once per set of arguments. ``corrected=True``: draws of the fit check's
        Gaussian importance-resampled towards the true model's posterior (Pareto k <= 0.7).
        """
        try:
            setup = fitted(self)
        except ValueError:
            raise ValueError(_NOT_FITTED) from None
        num_samples = NUM_SAMPLES if num_samples is None else num_samples
        for name, value in (("num_samples", num_samples), ("thinning", thinning)):
            check_positive_int(name, value)
        check_positive_int("num_warmup", num_warmup, minimum=0)
        state = state_of(self, result)
        if corrected:
            return party_draws(self, corrected_draws(self, rng_key, state, int(num_samples)), client)
        key = ("draws", int(num_samples), int(thinning), int(num_warmup))
        if key not in setup.cache:
            setup.cache[key] = jax.jit(self._draws_fn(setup, int(num_samples), int(thinning), int(num_warmup)))
        return party_draws(self, setup.cache[key](state, setup.cache["data"], rng_key), client)

    @staticmethod
    def _chains_fn(setup, length: int):
        """``(state, arrays, rng_key) -> {party: (length, d_party)}``: unconstrained Langevin
        draws continuing from ``state`` with ``z`` held at its final value."""
        obj, alg = setup.extra

        def run(state, arrays, rng_key):
            parties = (SERVER,) + obj.clients
            rows = jnp.arange(obj.num_rows)
            views = {c: obj.party_args(c, arrays, rows) for c in parties}
            states = {c: slot.state.inner for c, slot in zip(obj.clients, state.clients)}
            z_all = {c: states[c].params["z"] for c in obj.clients}
            keys = random.split(rng_key, len(parties))
            noise = {p: random.normal(k, (length, obj.layouts[p].size)) for k, p in zip(keys, parties)}
            return alg.posterior_chain(state.server.inner, states, noise, z_all, views)

        return run

    @classmethod
    def _draws_fn(cls, setup, num_samples, thinning, num_warmup):
        obj = setup.extra.objective
        run = cls._chains_fn(setup, num_warmup + num_samples * thinning)

        def draws(state, arrays, rng_key):
            chains = run(state, arrays, rng_key)
            out = {}
            for party in (SERVER,) + obj.clients:
                if obj.layouts[party].size:
                    u = chains[party][num_warmup::thinning]
                    out.update(jax.vmap(lambda v, p=party: obj.constrain(p, v))(u))
            return out

        return draws

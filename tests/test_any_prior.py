"""Issue 26, item 1: any proper prior under PVI and EP. The prior's Gaussian part (Laplace at
its mode) is exact in q and the residual is one more factor held by the server, refined each
round by the tilted-moment step (:mod:`numpyro_fed.terms.prior_site`).

Truth: NumPyro NUTS on the pooled data (4000 draws), tolerance 0.3 reference sds for means and
20 % for sds in user space (the trust issue's). PVI runs ``update="optax"`` (its local ELBO is
exact KL(q || tilted)); EP runs ``tilted="nuts"`` (exact tilted moments) because EP's default
Laplace tilted step is itself biased on a log-scale site (z -0.3 with a LogNormal prior too,
where there is no prior site: measured, see the closing note).
"""

import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.run.inference import fitted

from .references import nuts_reference

N = 40
_rng = np.random.default_rng(0)
X = _rng.normal(size=N).astype(np.float32)
Y = (0.5 + 0.8 * X + 0.7 * _rng.normal(size=N)).astype(np.float32)

SCALE_PRIORS = {"HalfNormal": dist.HalfNormal(1.0), "HalfCauchy": dist.HalfCauchy(1.0),
                "Exponential": dist.Exponential(1.0), "Gamma": dist.Gamma(2.0, 2.0)}


def _regression(scale_prior, slope_prior=None):
    slope_prior = dist.Normal(0.0, 2.0) if slope_prior is None else slope_prior

    def model(x, y):
        a = numpyro.sample("a", dist.Normal(0.0, 2.0))
        b = numpyro.sample("b", slope_prior)
        s = numpyro.sample("s", scale_prior)
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Normal(a + b * x, s), obs=y)

    return model


def _nuts(model):
    return nuts_reference("any_prior", model, X, Y, num_warmup=1000, num_samples=4000, seed=0)


def _fit(cls, model):
    clients = nf.Clients.split(np.arange(N) % 3, x=X, y=Y)
    if cls == "PVI":
        inference, rounds = nf.PVI(model, update="optax", optim=optax.adam(0.05)), 10
    else:
        inference, rounds = nf.EP(model, tilted="nuts"), 9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = inference.run(jax.random.PRNGKey(1), clients, rounds, progress_bar=False)
    return inference, result, caught


CASES = [(name, None) for name in SCALE_PRIORS] + [("StudentT", dist.StudentT(3.0, 0.0, 1.0))]


@pytest.mark.xla_optimised  # Exponential-EP's sd ratio: 1.204 (limit 1.2) with most optimisations off
@pytest.mark.parametrize("cls", ["PVI", "EP"])
@pytest.mark.parametrize("name,slope", CASES, ids=[c[0] for c in CASES])
def test_a_non_gaussian_prior_matches_nuts(cls, name, slope):
    scale = SCALE_PRIORS.get(name, dist.HalfNormal(1.0))
    model = _regression(scale, slope)
    ref = _nuts(model)
    inference, result, caught = _fit(cls, model)
    assert fitted(inference).extra.terms.residual is not None  # the prior is not Gaussian: a server site
    assert np.all(np.asarray(result.info.prior_damping) > 0)  # ... refined every round
    draws = inference.sample_posterior(jax.random.PRNGKey(2), result, 4000)
    for site in ("a", "b", "s"):
        z = (draws[site].mean() - ref[site].mean()) / ref[site].std()
        ratio = draws[site].std() / ref[site].std()
        assert abs(z) < 0.3 and abs(ratio - 1) < 0.2, (site, z, ratio)


def test_a_gaussian_prior_has_no_server_site():
    model = _regression(dist.LogNormal(0.0, 1.0))
    inference, result, _ = _fit("PVI", model)
    assert fitted(inference).extra.terms.residual is None and result.state.server.prior_site is None
    assert np.all(np.isnan(np.asarray(result.info.prior_damping)))


def test_a_prior_without_a_mode_is_refused_naming_only_that_site():
    def model(x, y):
        a = numpyro.sample("a", dist.Normal(0.0, 2.0))
        b = numpyro.sample("b", dist.ImproperUniform(dist.constraints.real, (), ()))
        s = numpyro.sample("s", dist.HalfCauchy(1.0))
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Normal(a + b * x, s), obs=y)

    clients = nf.Clients.split(np.arange(N) % 3, x=X, y=Y)
    with pytest.raises(ValueError, match=r"global site\(s\) b is flat"):  # only b, and why
        nf.EP(model).run(jax.random.PRNGKey(0), clients, 1, progress_bar=False)


def _bernoulli_categorical():
    rng = np.random.default_rng(0)
    n = 60
    yb = (rng.uniform(size=n) < 0.3).astype(np.float32)
    yc = rng.choice(3, size=n, p=[0.5, 0.3, 0.2])

    def model(yb, yc):
        p = numpyro.sample("p", dist.Beta(2.0, 2.0))
        w = numpyro.sample("w", dist.Dirichlet(np.full(3, 1.5, np.float32)))
        with numpyro.plate("rows", yb.shape[0]):
            numpyro.sample("b", dist.Bernoulli(p), obs=yb)
            numpyro.sample("c", dist.Categorical(w), obs=yc)

    a, b = 2.0 + yb.sum(), 2.0 + n - yb.sum()
    alpha = 1.5 + np.bincount(yc, minlength=3)
    truth = {"p": (np.array([a / (a + b)]), np.array([np.sqrt(a * b / (a + b) ** 2 / (a + b + 1))])),
             "w": (alpha / alpha.sum(), np.sqrt(alpha * (alpha.sum() - alpha) / alpha.sum() ** 2 / (alpha.sum() + 1)))}
    return model, nf.Clients.split(np.arange(n) % 3, yb=yb, yc=yc), truth


@pytest.mark.parametrize("cls", ["PVI", "EP"])
def test_beta_and_dirichlet_priors_match_the_analytic_posterior(cls):
    """Beta and Dirichlet priors (a simplex has one unconstrained coordinate fewer than its
    user-space ones) under the defaults of PVI and EP: the conjugate posteriors Beta and
    Dirichlet, 0.3 sd in mean and 20 % in sd per coordinate, in user space."""
    model, clients, truth = _bernoulli_categorical()
    inference = nf.PVI(model) if cls == "PVI" else nf.EP(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.UnreliableFitWarning)
        result = inference.run(jax.random.PRNGKey(1), clients, 10 if cls == "PVI" else 8, progress_bar=False)
    draws = inference.sample_posterior(jax.random.PRNGKey(2), result, 4000)
    for site, (mean, sd) in truth.items():
        v = np.asarray(draws[site]).reshape(4000, -1)
        z, ratio = (v.mean(0) - mean) / sd, v.std(0) / sd
        assert np.all(np.abs(z) < 0.3) and np.all(np.abs(ratio - 1) < 0.2), (site, z, ratio)


def test_a_non_gaussian_prior_runs_in_float64():
    """Under ``jax.enable_x64`` with float64 data, EP's default (Laplace) run with a prior site
    keeps one dtype: the prior's Gaussian part was built in float32 and the round loop refused
    the float64 state it came back as ("the input carry ... has type float32 ... float64")."""
    model = _regression(dist.Gamma(2.0, 2.0))
    with jax.enable_x64(True):
        clients = nf.Clients.split(np.arange(N) % 3, x=X.astype(np.float64), y=Y.astype(np.float64))
        inference = nf.EP(model, check_fit=False)
        result = inference.run(jax.random.PRNGKey(1), clients, 3, progress_bar=False)
        assert result.params.mean.dtype == np.float64 and np.all(np.isfinite(np.asarray(result.params.mean)))
        assert np.all(np.asarray(result.info.damping) > 0)  # every round applied its update

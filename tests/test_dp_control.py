"""The exact DP sampler with the private start's released expansion as a control variate
(``numpyro_fed.dp.control``): each client releases its rows' log-likelihood ratios less their
second-order Taylor expansion about the start's last point, the server adds back the start's
released sums.

- the expansion the sampler adds back is the start's release, entry for entry: without noise and
  with a clip that never binds, jax's gradient and Hessian of NumPyro's own log-likelihood;
- on a linear regression with an analytic posterior, ``nf.fit(dp=..., exact=True)`` answers with the
  sampler (no residual clipped, chains mixed) and its draws, which carry the start's noise, cover the
  analytic mean;
- on a logistic regression of 100,000 rows (long), the same against pooled NumPyro NUTS;
- a model with local latents is refused a control variate, naming why.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import log_likelihood

import numpyro_fed as nf
from numpyro_fed.dp.control import ControlVariate
from numpyro_fed.dp.dp_laplace import DPLaplace
from numpyro_fed.mcmc import DPMetropolis
from numpyro_fed.warnings import UnreliableFitWarning

from .test_dp_metropolis import patients

DELTA = 1e-5


def regression(x, y=None, logistic=False):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 5.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("rows", x.shape[0]):
        eta = b0 + x @ w
        numpyro.sample("y", dist.Bernoulli(logits=eta) if logistic else dist.Normal(eta, 1.0), obs=y)


def rows(n, logistic, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, 2)).astype(np.float32) if not logistic else rng.normal(size=(n, 4)).astype(np.float32)
    eta = x @ np.array([1.0, -0.5, 0.25, 0.0][:x.shape[1]]) - 0.5
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-eta))) if logistic else eta + rng.normal(size=n)
    return x, y.astype(np.float32)


def test_the_expansion_the_sampler_adds_back_is_the_starts_release_of_numpyros_derivatives():
    x, y = rows(600, logistic=True)
    clients = nf.Clients.split(np.arange(600) % 3, x=x, y=y)
    model = nf.dp_noise(regression, clip=1e6, delta=DELTA, noise_multiplier=0.0)
    start = DPLaplace(model, num_steps=3, model_kwargs={"logistic": True})
    control = start.control_variate(start.run(jax.random.PRNGKey(0), clients, progress_bar=False))

    def total(u):  # NumPyro's own log-likelihood of the pooled rows
        lik = log_likelihood(regression, {"b0": u[None, 0], "w": u[None, 1:]}, x, y, logistic=True)["y"]
        return jnp.sum(lik)

    anchor = jnp.asarray(control.anchor)
    np.testing.assert_allclose(control.gradient, jax.grad(total)(anchor), rtol=1e-3, atol=1e-2)
    np.testing.assert_allclose(control.hessian, jax.hessian(total)(anchor), rtol=1e-3, atol=1e-2)
    assert np.allclose(control.noise_cov, 0.0)  # no noise, no shift to carry


def test_the_exact_private_fit_answers_with_the_sampler_and_covers_an_analytic_posterior():
    n = 20_000
    x, y = rows(n, logistic=False)
    clients = nf.Clients.split(np.arange(n) % 4, x=x, y=y)
    design = np.c_[np.ones(n), x].astype(np.float64)
    precision = design.T @ design + np.eye(3) / 25
    mean = np.linalg.solve(precision, design.T @ y)
    sd = np.sqrt(np.diag(np.linalg.inv(precision)))
    model = nf.dp_noise(regression, clip=9.0, delta=DELTA, epsilon=4.0)  # above every row's (gradient, Hessian)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreliableFitWarning)
        fit = nf.fit(model, clients, dp=nf.dp.PrivateFit(start_rounds=4), exact=True, rng_key=jax.random.PRNGKey(0),
                     progress_bar=False)
    assert fit.method == "dp_metropolis"  # the sampler answered: chains mixed, no residual clipped
    sampler, result = fit.inference, fit.result
    assert sampler.control is not None and result.verdict.status == "ok"
    assert {int(result.client_states[c].inner.clipped) for c in clients.names} == {0}
    assert fit.privacy_report().epsilon <= 4.0 + 1e-6
    draws = sampler.get_samples(result)
    got = np.c_[draws["b0"], draws["w"]]
    z = np.abs(got.mean(0) - mean) / got.std(0)
    assert np.all(z < 3.5), z  # within the draws' own spread, which carries the start's noise
    assert np.all(got.std(0) > 0.9 * sd)  # never narrower than the posterior
    carried = np.sqrt(sd ** 2 + np.diag(np.asarray(sampler.control.noise_cov)))  # and wider by the start's noise
    np.testing.assert_allclose(got.std(0), carried, rtol=0.25)
    assert any("draws carry it" in line for line in fit.log)


def test_a_control_variate_is_refused_for_a_model_with_local_latents():
    y = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    clients = nf.Clients.split(np.arange(40) % 2, y=y)
    control = ControlVariate(jnp.zeros(1), jnp.zeros(1), jnp.zeros((1, 1)), 1.0, jnp.zeros((1, 1)))
    sampler = DPMetropolis(nf.dp_noise(patients, clip=0.1, delta=1e-3, noise_multiplier=1.0), num_warmup=5,
                           num_samples=5, control=control)
    with pytest.raises(ValueError, match=r"local site\(s\) \['b'\].*leave control=None"):
        sampler.run(jax.random.PRNGKey(0), clients, progress_bar=False)


@pytest.mark.slow
def test_on_a_logistic_regression_of_100000_rows_the_exact_private_fit_answers_near_pooled_nuts():
    n = 100_000
    x, y = rows(n, logistic=True)
    clients = nf.Clients.split(np.arange(n) % 4, x=x, y=y)
    model = nf.dp_noise(regression, clip=6.0, delta=DELTA, epsilon=4.0)
    fit = nf.fit(model, clients, dp=nf.dp.PrivateFit(), exact=True, rng_key=jax.random.PRNGKey(0),
                 progress_bar=False, model_kwargs={"logistic": True})
    assert fit.method == "dp_metropolis" and fit.result.verdict.status == "ok"
    mcmc = MCMC(NUTS(regression), num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), x, y, logistic=True)
    ref = mcmc.get_samples()
    draws = fit.inference.get_samples(fit.result)
    for k in ("b0", "w"):
        got, want = np.asarray(draws[k]).reshape(len(draws[k]), -1), np.asarray(ref[k]).reshape(len(ref[k]), -1)
        z = np.abs(got.mean(0) - want.mean(0)) / got.std(0)
        assert np.all(z < 3.5), (k, z)
        assert np.all(got.std(0) > 0.9 * want.std(0))

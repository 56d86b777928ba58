"""The surrogate transition of federated Metropolis-within-Gibbs (``numpyro_fed.mcmc.surrogate``):
the server's Hamiltonian trajectories on the exact prior and a quadratic surrogate of the clients'
likelihood, each corrected exactly by delayed acceptance in one round. Checked against analytic
posteriors and NumPyro's NUTS on the pooled data; the correction's removal is caught."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS
from scipy import stats

import numpyro_fed as nf
from numpyro_fed.mcmc import FederatedMwG

K, A, B = 20, 2.0, 1.0  # rates, and their Gamma(A, B) prior


def _poisson_model(y):
    lam = numpyro.sample("lam", dist.Gamma(A, B).expand([K]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Poisson(lam).to_event(1), obs=y)


def _poisson_data():
    """Four rows of 20 counts over three clients of unequal size: each rate's likelihood (in the
    sampler's unconstrained log rate, ``s eta - 4 exp(eta)``) is far from quadratic."""
    rng = np.random.default_rng(0)
    sizes = (2, 1, 1)
    y = rng.poisson(0.5, size=(sum(sizes), K)).astype(np.float32)
    return nf.Clients.split(np.repeat(np.arange(3), sizes), y=y), y


def _poisson_run(num_warmup=300, num_samples=1000, **run_options):
    """Every rate's chi-square of (chain mean - exact mean) in Monte Carlo standard errors, the
    largest |sd ratio - 1|, and the run's acceptance."""
    clients, y = _poisson_data()
    a_post, b_post = A + y.sum(0), B + y.shape[0]
    mean, sd = a_post / b_post, np.sqrt(a_post) / b_post
    mwg = FederatedMwG(_poisson_model, moves="surrogate", num_warmup=num_warmup, num_samples=num_samples)
    mwg.progress_bar = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mwg.run(jax.random.PRNGKey(0), clients, **run_options)
    lam = np.asarray(mwg.get_samples(result, group_by_chain=True)["lam"])
    ess = np.asarray(effective_sample_size(lam))
    z = (lam.reshape(-1, K).mean(0) - mean) / (sd / np.sqrt(ess))
    return float(np.sum(z**2)), float(np.max(np.abs(lam.reshape(-1, K).std(0) / sd - 1))), mwg, result


CHI2_LIMIT = float(stats.chi2.ppf(0.999, K))  # 45.3: a false alarm once in a thousand runs of an exact sampler


def test_the_surrogate_transition_draws_an_analytic_skewed_posterior_in_twenty_dimensions():
    """Twenty Poisson rates with Gamma priors (the posterior Gamma(A + sum y, B + n), exactly): the
    sampler moves all twenty by the surrogate transition; the chains' means are within Monte Carlo
    error of the exact ones jointly (chi-square of the twenty z-scores under its 0.999 quantile),
    every sd within 12 %, and the moves are accepted often (the surrogate's error between nearby
    points is small)."""
    chi2, sd_error, mwg, result = _poisson_run()
    assert chi2 < CHI2_LIMIT, chi2
    assert sd_error < 0.12, sd_error
    assert mwg.sample_stats(result)["proposal"].max() == 2  # every move the surrogate transition
    assert mwg.mixing(result)["acceptance"] > 0.4


def test_the_surrogate_transition_stays_exact_when_clients_miss_rounds():
    """The same posterior with each client answering a round with probability 0.8: a round some
    client missed decides nothing and is repeated (its gradients, in warmup, not added to the
    surrogate's sums), so the draws still follow the exact posterior; the run takes more rounds."""
    chi2, sd_error, mwg, result = _poisson_run(availability=0.8)
    answered = np.asarray(result.rounds_answered)
    assert int(result.communication.rounds) > 300 + 1000 + 1 and not answered.all()
    assert chi2 < CHI2_LIMIT, chi2
    assert sd_error < 0.12, sd_error


def test_dropping_the_delayed_acceptance_leaves_the_posterior(monkeypatch):
    """The same run with the second stage's correction dropped (every trajectory the surrogate
    accepted taken as it is: the chain then samples the prior times the surrogate) is caught by the
    test above: its chi-square is past the limit."""
    from numpyro_fed.mcmc import mwg_algorithm

    monkeypatch.setattr(mwg_algorithm, "_delayed_ratio", lambda ell, gap: jnp.zeros_like(ell))
    chi2, _, mwg, result = _poisson_run()
    assert mwg.mixing(result)["acceptance"] > 0.99  # (the mutant accepts every move that reached the clients)
    assert chi2 > CHI2_LIMIT, chi2


def _logistic(x, y=None):
    beta = numpyro.sample("beta", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
    b0 = numpyro.sample("b0", dist.Normal(0, 2))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.local_site():
        a = numpyro.sample("a", dist.Normal(0, tau))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + a + x @ beta), obs=y)


def _pooled_logistic(x, client, y=None):
    beta = numpyro.sample("beta", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
    b0 = numpyro.sample("b0", dist.Normal(0, 2))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("clients", 4):
        a = numpyro.sample("a", dist.Normal(0, tau))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + a[client] + x @ beta), obs=y)


def test_nf_fit_answers_a_logistic_regression_with_100_covariates_and_a_client_effect():
    """100 covariates, an intercept and a client effect's scale (102 globals; each client's effect
    local) over 8,000 rows in 4 clients of unequal size, where importance sampling around the
    Laplace Gaussian fails (its checks reject it). nf.fit at its defaults answers with the surrogate
    transition (its log says so), with no RoundBudgetError, and every global scalar's mean is within
    0.25 pooled sds of NumPyro's NUTS on the pooled data and its sd within 20 % (both with Monte
    Carlo error on either side)."""
    rng = np.random.default_rng(0)
    p, sizes = 100, (1000, 1500, 2500, 3000)
    x = (rng.normal(size=(8000, p)) * 1.5 / np.sqrt(p)).astype(np.float32)
    client = np.repeat(np.arange(4), sizes)
    a = 0.5 * rng.normal(size=4)
    y = rng.binomial(1, 1 / (1 + np.exp(-(x @ rng.normal(size=p) + a[client] - 0.3)))).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = nf.fit(_logistic, nf.Clients.split(client, x=x, y=y), jax.random.PRNGKey(0), progress_bar=False)
    assert fit.method == "mwg", fit.log
    assert any("surrogate transition" in line for line in fit.log), fit.log
    mcmc = MCMC(NUTS(_pooled_logistic), num_warmup=500, num_samples=1000, num_chains=2, chain_method="vectorized",
                progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), x=x, client=client, y=y)
    ref = mcmc.get_samples()
    got = fit.get_samples()
    for site in ("beta", "b0", "tau"):
        want = np.asarray(ref[site]).reshape(len(ref[site]), -1)
        ours = np.asarray(got[site]).reshape(len(got[site]), -1)
        z = np.abs(ours.mean(0) - want.mean(0)) / want.std(0)
        ratio = ours.std(0) / want.std(0)
        assert z.max() < 0.25, (site, z.max())
        assert np.abs(ratio - 1).max() < 0.2, (site, ratio.min(), ratio.max())


def _funnel(g, k, y):
    tau = numpyro.sample("tau", dist.HalfCauchy(3.0).expand([2]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0, 5))
    theta = numpyro.sample("theta", dist.Normal(mu, tau[:, None]).expand([2, 8]).to_event(2))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta[g, k], 4.0), obs=y)


def test_a_funnel_the_sampler_cannot_enter_is_reported_naming_the_sites():
    """Two groups of eight effects centred on their scales, one weak observation each (a funnel
    whose neck pooled NUTS diverges in too), no mode for a Laplace start: started by hand, the
    chains do not mix and the check says so, naming the sites (split R-hat over chains from
    different starts); the run's verdict is not ``ok``."""
    rng = np.random.default_rng(1)
    g, k = np.repeat([0, 1], 8), np.tile(np.arange(8), 2)
    y = (rng.normal(size=16) * 2 + 1).astype(np.float32)
    clients = nf.Clients.split(np.arange(16) % 3, g=g, k=k, y=y)
    mwg = FederatedMwG(_funnel, moves="surrogate", num_warmup=300, num_samples=500,
                       init=(np.r_[0.7, 0.7, 1.0, np.ones(16)], np.eye(19)))
    mwg.progress_bar = False
    with pytest.warns(nf.warnings.UnreliableFitWarning, match="not mixed at .*(tau|mu|theta)"):
        result = mwg.run(jax.random.PRNGKey(0), clients)
    assert result.verdict.status != "ok"
    assert result.verdict.sites


def test_the_divergent_iterations_name_the_scalars_they_are_most_unlike():
    """Where the surrogate trajectories diverged, the report names the global scalars whose draws at
    those iterations lie furthest from all their draws (a funnel's neck: its scale's small values),
    largest first, and names nothing where none diverged."""
    from numpyro_fed.mcmc.mwg_inference import divergent_sites

    rng = np.random.default_rng(0)
    tau = np.exp(rng.normal(size=(2, 500)))
    theta = rng.normal(size=(2, 500, 3))
    divergent = np.zeros((2, 500), bool)
    divergent[np.where(tau < 0.2)] = True
    named = divergent_sites({"tau": tau, "theta": theta}, divergent)
    assert named[0][0] == "tau" and named[0][1] < -0.5, named
    assert divergent_sites({"tau": tau, "theta": theta}, np.zeros_like(divergent)) == []

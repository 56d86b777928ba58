"""Exact federated Metropolis-within-Gibbs (``numpyro_fed.mcmc.mwg_inference``): the chain's
draws follow the pooled posterior, checked against the analytic one."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size

import numpyro_fed as nf
from numpyro_fed.mcmc.mwg_inference import FederatedMwG

TAU, R = 0.7, 3  # the groups' known scale; rows per group


def _model(g, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with nf.group_plate("groups", g):
        with nf.local_site():
            th = numpyro.sample("th", dist.Normal(mu, TAU))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(th[g], 1.0), obs=y)


def _data(J=3, G=(6, 4, 5), seed=0):
    rng = np.random.default_rng(seed)
    g = np.concatenate([np.repeat(np.arange(n), R) for n in G])
    cl = np.concatenate([np.full(n * R, j) for j, n in enumerate(G)])
    th = 1.0 + TAU * rng.normal(size=g.size // R)
    y = (np.repeat(th, R) + rng.normal(size=g.size)).astype(np.float32)
    return nf.Clients.split(cl, g=g, y=y), y.reshape(-1, R).mean(1)


def test_mwg_draws_the_analytic_posterior_of_a_gaussian_hierarchy_in_one_round_per_iteration():
    """mu's posterior is Gaussian (each group's mean ~ N(mu, tau^2 + 1/R)); a group's effect given
    mu is Gaussian too. The chain's mean and sd of mu are within 4 MCSE and 10 % of the truth,
    4 chains, one round per iteration (plus the start's Laplace rounds and one closing round), and the
    clients' groups (3 clients, unequal, so padded groups) leave no mark."""
    clients, means = _data()
    mwg = FederatedMwG(_model, num_warmup=150, num_samples=500, num_chains=4)
    result = mwg.run(jax.random.PRNGKey(0), clients)
    assert int(result.communication.rounds) == 150 + 500 + 1
    var = TAU**2 + 1.0 / R
    post_prec = 1.0 / 25.0 + means.size / var
    mean, sd = means.sum() / var / post_prec, post_prec**-0.5
    grouped = np.asarray(mwg.get_samples(result, group_by_chain=True)["mu"])
    mu = grouped.reshape(-1)
    ess = float(effective_sample_size(grouped))
    assert ess > 300, ess
    assert abs(mu.mean() - mean) < 4 * sd / np.sqrt(ess), (mu.mean(), mean, ess)
    assert abs(mu.std() / sd - 1) < 0.1, (mu.std(), sd)
    assert mwg.acceptance(result)["independence"] > 0.3

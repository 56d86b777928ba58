"""SFVI against the exact posterior of a Normal-Normal hierarchy with known variances."""

import numpy as np
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed_examples.models import normal_hierarchical

TAU0, TAU, SIGMA = 2.0, 1.0, 2.0


def exact_posterior(y):
    G, m = y.shape
    prec = np.zeros((G + 1, G + 1))
    prec[0, 0] = 1 / TAU0**2 + G / TAU**2
    prec[0, 1:] = prec[1:, 0] = -1 / TAU**2
    prec[np.arange(1, G + 1), np.arange(1, G + 1)] = 1 / TAU**2 + m / SIGMA**2
    h = np.concatenate([[0.0], y.sum(1) / SIGMA**2])
    cov = np.linalg.inv(prec)
    return cov @ h, cov


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    G, m = 12, 1
    b = 1.5 + TAU * rng.normal(size=G)
    y = (b[:, None] + SIGMA * rng.normal(size=(G, m))).astype(np.float32)
    groups = np.repeat([0, 1, 2], [5, 4, 3])  # unequal silos: padding path
    return y, nf.Clients.split(groups, y=y)


def fit(guide, clients, rounds=4000):
    sched = optax.exponential_decay(0.05, rounds, 0.02)
    svi = nf.FederatedSVI(
        normal_hierarchical, guide, optax.adam(sched), num_particles=8, model_kwargs=dict(sigma=SIGMA)
    )
    result = svi.run(random.PRNGKey(0), clients, rounds, progress_bar=False)
    return svi, result


def moments(svi, result, clients, num_samples=40000):
    mus, bs = [], []
    for c in clients.names:
        s = svi.sample_posterior(random.PRNGKey(1), result, num_samples, client=c)
        mus.append(np.asarray(s["mu"]))
        bs.append(np.asarray(s["b"]))
    mu = mus[0]
    b = np.concatenate(bs, axis=1)
    draws = np.concatenate([mu[:, None], b], axis=1)
    return draws.mean(0), draws.std(0), np.corrcoef(draws.T)


def test_structured_sfvi_matches_exact_posterior(data):
    y, clients = data
    mean, cov = exact_posterior(clients.pooled()["y"])
    sd = np.sqrt(np.diag(cov))
    svi, result = fit(nf.StructuredGuide(normal_hierarchical, global_scale="full"), clients)
    m, s, corr = moments(svi, result, clients)
    mc = 3 * sd / np.sqrt(40000)  # Monte Carlo error of the draws
    np.testing.assert_array_less(np.abs(m - mean), 0.05 * sd + mc)
    np.testing.assert_array_less(np.abs(s / sd - 1), 0.05)
    exact_corr = cov[0, 1:] / (sd[0] * sd[1:])
    np.testing.assert_allclose(corr[0, 1:], exact_corr, atol=0.05)


def test_mean_field_misses_the_correlation(data):
    y, clients = data
    mean, cov = exact_posterior(clients.pooled()["y"])
    sd = np.sqrt(np.diag(cov))
    exact_corr = cov[0, 1:] / (sd[0] * sd[1:])
    assert exact_corr.min() > 0.3  # the posterior couples mu and every b_i
    svi, result = fit(nf.MeanFieldGuide(normal_hierarchical), clients)
    m, s, corr = moments(svi, result, clients)
    assert np.abs(corr[0, 1:]).max() < 0.05  # no coupling by construction
    assert s[0] / sd[0] < 0.6  # and it understates the global uncertainty
    np.testing.assert_array_less(np.abs(m - mean), 0.1 * sd)  # means are still right here


def test_default_settings_converge_to_the_exact_posterior(data):
    """Defaults only (one particle, the STL estimator, constant Adam 5e-3 for 6000 rounds):
    the last iterate is the exact posterior. The plain estimator's noise left the global
    mean 0.185 posterior sd away at the same settings."""
    y, clients = data
    mean, cov = exact_posterior(clients.pooled()["y"])
    sd = np.sqrt(np.diag(cov))
    model = normal_hierarchical
    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(5e-3), model_kwargs=dict(sigma=SIGMA))
    assert svi.stl and svi.num_particles == 1
    result = svi.run(random.PRNGKey(0), clients, 6000, progress_bar=False)
    m, s, _ = moments(svi, result, clients)
    mc = 3 * sd / np.sqrt(40000)
    np.testing.assert_array_less(np.abs(m - mean), 0.05 * sd + mc)
    np.testing.assert_array_less(np.abs(s / sd - 1), 0.05)
    assert svi.diagnose(result).pareto_k < 0.5

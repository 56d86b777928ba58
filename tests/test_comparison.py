"""Federated PSIS-LOO equals ArviZ's on the pooled pointwise matrix; arviz groups."""

import warnings

import arviz as az
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf


def random_intercepts(x, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("rows", x.shape[0]):
        with nf.local_site():
            b = numpyro.sample("b", dist.Normal(0.0, tau))
        numpyro.sample("y", dist.Normal(beta * x + b, 0.5), obs=y)


def slope_only(x, y):
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(beta * x, 0.5), obs=y)


@pytest.fixture(scope="module")
def fits():
    rng = np.random.default_rng(0)
    n = 36
    x = rng.normal(size=n).astype(np.float32)
    y = (0.8 * x + 0.5 * rng.normal(size=n)).astype(np.float32)
    clients = nf.Clients.split(np.repeat([0, 1, 2], [15, 12, 9]), x=x, y=y)
    out = {}
    for name, model in (("intercepts", random_intercepts), ("slope", slope_only)):
        svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.02))
        out[name] = (svi, svi.run(random.PRNGKey(0), clients, 600, progress_bar=False))
    return clients, out


def pooled_loo(svi, result, clients, key, num_samples):
    mats = [np.asarray(svi.log_likelihood(key, result, num_samples, c)[0]["y"]) for c in clients.names]
    idata = az.from_dict(log_likelihood={"y": np.concatenate(mats, axis=1)[None]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return az.loo(idata, reff=1.0, pointwise=True), mats


def test_federated_loo_equals_pooled_arviz(fits):
    clients, out = fits
    key = random.PRNGKey(3)
    for name, (svi, result) in out.items():
        fed = nf.federated_loo(svi, result, key, num_samples=400, name=name)
        ref, _ = pooled_loo(svi, result, clients, key, 400)
        assert fed.num_rows == 36
        np.testing.assert_allclose(fed.elpd_loo, ref.elpd_loo, rtol=1e-10)
        np.testing.assert_allclose(fed.se, ref.se, rtol=1e-8)
        np.testing.assert_allclose(fed.p_loo, ref.p_loo, rtol=1e-5)  # ArviZ's lppd is float32 here
        # what left each client: five numbers, no row-level value
        for msg in fed.per_client.values():
            assert len(msg) == 5


def test_federated_compare_matches_arviz_compare(fits):
    clients, out = fits
    key = random.PRNGKey(3)
    table = nf.federated_compare(out, key, num_samples=400)
    assert [r.elpd_diff for r in table][0] == 0.0 and len(table) == 2
    loos = {name: pooled_loo(svi, res, clients, key, 400)[0] for name, (svi, res) in out.items()}
    best, other = table[0].name, table[1].name
    diff = np.asarray(loos[other].loo_i) - np.asarray(loos[best].loo_i)
    np.testing.assert_allclose(table[1].elpd_diff, diff.sum(), rtol=1e-8)
    np.testing.assert_allclose(table[1].dse, np.sqrt(diff.size * np.var(diff)), rtol=1e-8)


def test_log_likelihood_is_the_model_density_at_the_draws(fits):
    clients, out = fits
    svi, result = out["slope"]
    log_lik, predictive = svi.log_likelihood(random.PRNGKey(1), result, 50, "1")
    beta = np.asarray(svi.sample_posterior(random.PRNGKey(1), result, 50, client="1")["beta"])
    x, y = clients["1"]["x"], clients["1"]["y"]
    expected = -0.5 * ((y - beta[:, None] * x) / 0.5) ** 2 - np.log(0.5) - 0.5 * np.log(2 * np.pi)
    np.testing.assert_allclose(log_lik["y"], expected, rtol=1e-4, atol=1e-4)
    assert predictive["y"].shape == (50, clients.num_rows["1"])
    resid = np.asarray(predictive["y"]) - beta[:, None] * x
    assert abs(resid.std() - 0.5) < 0.05  # draws of new data from the model at the draws


def test_numpyro_predictive_on_a_clients_draws(fits):
    """The supported way to use numpyro.infer.Predictive: the client's own posterior draws
    (global, local and deterministic sites) and the client's own data."""
    from numpyro.infer import Predictive

    clients, out = fits
    svi, result = out["intercepts"]
    draws = svi.sample_posterior(random.PRNGKey(5), result, 200, client="2")
    data = clients["2"]
    pred = Predictive(random_intercepts, posterior_samples=draws, return_sites=["y"])(
        random.PRNGKey(6), x=data["x"], y=None)
    assert pred["y"].shape == (200, clients.num_rows["2"])
    # the predictive mean is the draws' linear predictor
    mean = np.asarray(draws["beta"])[:, None] * data["x"] + np.asarray(draws["b"])
    assert np.abs(np.asarray(pred["y"]).mean(0) - mean.mean(0)).max() < 4 * 0.5 / np.sqrt(200) + 0.05


def test_non_finite_log_likelihood_is_an_error(fits, monkeypatch):
    clients, out = fits
    svi, result = out["slope"]
    real = svi.log_likelihood

    def broken(key, res, n, client):
        log_lik, pred = real(key, res, n, client)
        return {"y": log_lik["y"].at[0, 0].set(np.nan)}, pred

    monkeypatch.setattr(svi, "log_likelihood", broken)
    with pytest.raises(ValueError, match=r"client '0': the log-likelihood of site 'y' is not finite at 1"):
        nf.federated_loo(svi, result, random.PRNGKey(3), num_samples=100)


@pytest.fixture(scope="module")
def factor_fits(fits):
    """PVI and EP fits of the same clients (issue 26 item 3): local latents per row."""
    clients, _ = fits
    out = {}
    for name, model in (("intercepts", random_intercepts), ("slope", slope_only)):
        pvi = nf.PVI(model, local_steps=300, schedule="sequential")
        out["pvi_" + name] = (pvi, pvi.run(random.PRNGKey(0), clients, 3))
    ep = nf.EP(random_intercepts)
    out["ep_intercepts"] = (ep, ep.run(random.PRNGKey(0), clients, 6))
    return clients, out


def test_federated_loo_of_pvi_and_ep_fits_equals_pooled_arviz(factor_fits):
    clients, out = factor_fits
    key = random.PRNGKey(3)
    for name, (inference, result) in out.items():
        fed = nf.federated_loo(inference, result, key, num_samples=400, name=name)
        ref, mats = pooled_loo(inference, result, clients, key, 400)
        assert [m.shape for m in mats] == [(400, clients.num_rows[c]) for c in clients.names]
        np.testing.assert_allclose(fed.elpd_loo, ref.elpd_loo, rtol=1e-10)
        np.testing.assert_allclose(fed.se, ref.se, rtol=1e-8)
        np.testing.assert_allclose(fed.p_loo, ref.p_loo, rtol=1e-5)
    table = nf.federated_compare(out, key, num_samples=400)
    assert sorted(r.name for r in table) == sorted(out) and table[0].elpd_diff == 0.0


def test_a_clients_local_draws_follow_their_conditional_posterior(factor_fits):
    """Given each global draw (beta, tau), the model's b_i | beta, tau, y_i is Gaussian with
    precision 1/tau^2 + 1/0.5^2: the client's local draws, standardised by that conditional,
    have mean 0 and sd 1 (a draw from q's marginal of b, or the mode alone, would not)."""
    clients, out = factor_fits
    for name in ("pvi_intercepts", "ep_intercepts"):
        inference, result = out[name]
        draws = inference.sample_posterior(random.PRNGKey(4), result, 2000, client="1")
        beta, tau, b = (np.asarray(draws[k], np.float64) for k in ("beta", "tau", "b"))
        x, y = (np.asarray(clients["1"][k], np.float64) for k in ("x", "y"))
        precision = 1 / tau[:, None] ** 2 + 1 / 0.25
        mean = (y - beta[:, None] * x) / 0.25 / precision
        z = (b - mean) * np.sqrt(precision)
        assert abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.05, (name, z.mean(), z.std())
        # and the pointwise log-likelihood is the model's density at those draws
        log_lik, _ = inference.log_likelihood(random.PRNGKey(4), result, 2000, "1")
        expected = -0.5 * ((y - beta[:, None] * x - b) / 0.5) ** 2 - np.log(0.5) - 0.5 * np.log(2 * np.pi)
        np.testing.assert_allclose(log_lik["y"], expected, rtol=1e-4, atol=1e-3)


def test_to_arviz_of_a_factor_fit_has_the_log_likelihood_or_says_why_not(factor_fits):
    clients, out = factor_fits
    pvi, result = out["pvi_intercepts"]
    key = random.PRNGKey(7)
    pvi._warned_log_likelihood = False
    with pytest.warns(nf.warnings.ArvizGroupWarning, match="needs the clients' data. Pass client="):
        bare = nf.to_arviz(pvi, result, key, num_samples=100)
    assert not hasattr(bare, "log_likelihood") and "needs the clients" in bare.attrs["log_likelihood"]
    with warnings.catch_warnings():  # once per fit, not at every call
        warnings.simplefilter("error", nf.warnings.ArvizGroupWarning)
        nf.to_arviz(pvi, result, key, num_samples=100)
    everyone = nf.to_arviz(pvi, result, key, num_samples=100, clients=clients)
    assert everyone.log_likelihood["y"].shape == (4, 100, 36) and everyone.attrs["log_likelihood"] == "included"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pooled = az.loo(everyone, reff=1.0)
    fed = nf.federated_loo(pvi, result, key, num_samples=400)
    np.testing.assert_allclose(fed.elpd_loo, pooled.elpd_loo, rtol=1e-10)
    one = nf.to_arviz(pvi, result, key, num_samples=100, client="2", clients=clients)
    assert one.log_likelihood["y"].shape == (4, 100, clients.num_rows["2"])
    assert one.posterior["b"].shape == (4, 100, clients.num_rows["2"]) and "y" in one.observed_data
    ep, ep_result = out["ep_intercepts"]  # EP with a client: its NUTS draws of eq. 8, scored at those draws
    local = nf.to_arviz(ep, ep_result, key, num_samples=50, client="0")
    assert local.log_likelihood["y"].shape == (4, 50, clients.num_rows["0"])
    # user space: tau's draws are positive (q is Gaussian in log tau)
    assert float(everyone.posterior["tau"].min()) > 0

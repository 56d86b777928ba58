"""Federated EP (paper 004 §4.2): conjugate truth, local latents integrated out, local
posteriors and fast adaptation against closed forms, HM2 against pooled NUTS, errors,
and what crosses to the server."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf

from .references import nuts_reference
from .test_privacy import contains
from .test_pvi import D, linear_model, make_linear

TAU, NOISE, K, DL = 0.5, 0.3, 4, 2  # hierarchical: theta_k ~ N(mu, TAU^2), y ~ N(x theta_k, NOISE^2)


@pytest.fixture(scope="module")
def linear():
    return make_linear()


@pytest.mark.parametrize("tilted,rounds,mean_tol,sd_tol", [("laplace", 3, 1e-4, 1e-4), ("nuts", 3, 0.1, 0.1),
                                                          ("vi", 3, 0.08, 0.06)])
def test_ep_on_a_conjugate_model_gives_the_exact_posterior(linear, tilted, rounds, mean_tol, sd_tol):
    """Bayesian linear regression over 3 clients: one sequential EP pass equals the exact
    posterior (Laplace: to numerical error; NUTS and VI: to Monte Carlo error, in sds)."""
    clients, mean, cov, _ = linear
    # NUTS: 4000 draws per tilted distribution. With 1000, the Monte Carlo error of the
    # mean alone was 0.03-0.17 sd over seeds 0-5 (three of six above the 0.1 tolerance);
    # the old key order happened to pass. 4000 draws: 0.03-0.05 sd over seeds 0-3.
    ep = nf.EP(linear_model, tilted=tilted, optim=optax.adam(0.02), vi_steps=600, num_particles=16,
               num_warmup=300, num_samples=4000)
    res = ep.run(random.PRNGKey(0), clients, rounds)
    sd = np.sqrt(np.diag(cov))
    assert np.max(np.abs(np.asarray(res.params.mean) - mean) / sd) < mean_tol
    assert np.max(np.abs(np.sqrt(np.diag(res.params.cov)) / sd - 1)) < sd_tol
    if tilted == "laplace":
        np.testing.assert_allclose(res.params.cov, cov, rtol=1e-4, atol=1e-8)


def hier_model(x, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([DL]).to_event(1))
    with nf.local_site():
        theta = numpyro.sample("theta", dist.Normal(mu, TAU).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ theta, NOISE), obs=y)


def _joint_posterior(xs, ys):
    """Exact Gaussian posterior of (mu, theta_1, ..., theta_K) for ``hier_model``."""
    k = len(xs)
    n = DL * (k + 1)
    prec = np.zeros((n, n))
    shift = np.zeros(n)
    prec[:DL, :DL] += np.eye(DL)
    for j, (x, y) in enumerate(zip(xs, ys)):
        s = slice(DL * (j + 1), DL * (j + 2))
        prec[:DL, :DL] += np.eye(DL) / TAU**2
        prec[s, s] += np.eye(DL) / TAU**2 + x.T @ x / NOISE**2
        prec[:DL, s] -= np.eye(DL) / TAU**2
        prec[s, :DL] -= np.eye(DL) / TAU**2
        shift[s] += x.T @ y / NOISE**2
    cov = np.linalg.inv(prec)
    return cov @ shift, cov


@pytest.fixture(scope="module")
def hier():
    rng = np.random.default_rng(3)
    sizes = [6, 10, 14, 20, 8]  # the last client is held out (the new client)
    mu = np.array([1.0, -0.5])
    xs, ys = [], []
    for n in sizes:
        x = rng.normal(size=(n, DL)).astype(np.float32)
        theta = mu + TAU * rng.normal(size=DL)
        xs.append(x)
        ys.append((x @ theta + NOISE * rng.normal(size=n)).astype(np.float32))
    clients = nf.Clients.split(np.repeat(np.arange(K), sizes[:K]), x=np.concatenate(xs[:K]), y=np.concatenate(ys[:K]))
    return clients, xs, ys


def test_ep_integrates_out_local_latents_exactly(hier):
    """With local latents theta_k, f_k(mu) = ∫ p(y_k | theta_k) p(theta_k | mu) d theta_k is
    Gaussian here, so one sequential EP pass (Laplace tilted) gives the exact marginal
    posterior of mu (clients of unequal size: padded and masked), and damped synchronous
    EP converges to it. PVI with local sites (joint Gaussian local step) lands there too."""
    clients, xs, ys = hier
    mean, cov = _joint_posterior(xs[:K], ys[:K])
    m, c = mean[:DL], cov[:DL, :DL]
    res = nf.EP(hier_model).run(random.PRNGKey(0), clients, K)
    np.testing.assert_allclose(res.params.mean, m, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res.params.cov, c, rtol=1e-4, atol=1e-7)
    once = nf.EP(hier_model, schedule="synchronous", damping=0.5).run(random.PRNGKey(0), clients, 1)
    assert np.max(np.abs(np.asarray(once.params.mean) - m) / np.sqrt(np.diag(c))) > 0.05  # not there after one round
    sync = nf.EP(hier_model, schedule="synchronous", damping=0.5).run(random.PRNGKey(0), clients, 25)
    np.testing.assert_allclose(sync.params.mean, m, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(sync.params.cov, c, rtol=1e-3, atol=1e-6)
    pvi = nf.PVI(hier_model, update="optax", optim=optax.adam(0.02), local_steps=800, num_particles=16,
                 schedule="sequential").run(random.PRNGKey(1), clients, 2 * K)
    sd = np.sqrt(np.diag(c))
    assert np.max(np.abs(np.asarray(pvi.params.mean) - m) / sd) < 0.15
    assert np.max(np.abs(np.sqrt(np.diag(pvi.params.cov)) / sd - 1)) < 0.1


def test_local_posteriors_and_fast_adaptation_match_the_closed_form(hier):
    """Paper 004 §4.2.1: after (exact) EP, eq. 8 with the cavity q_-k is the exact
    p(theta_k | Y); a new client starting from q(mu) gets p(theta_new | Y, Y_new)."""
    clients, xs, ys = hier
    ep = nf.EP(hier_model)
    res = ep.run(random.PRNGKey(0), clients, K)
    mean, cov = _joint_posterior(xs[:K], ys[:K])
    draws = ep.local_posterior(random.PRNGKey(1), res, num_samples=2000, num_warmup=300)
    assert draws["theta"].shape == (K, 2000, DL) and draws["mu"].shape == (K, 2000, DL)
    for k in range(K):
        s = slice(DL * (k + 1), DL * (k + 2))
        sd = np.sqrt(np.diag(cov[s, s]))
        got = np.asarray(draws["theta"][k])
        assert np.max(np.abs(got.mean(0) - mean[s]) / sd) < 0.15
        assert np.max(np.abs(got.std(0) / sd - 1)) < 0.1
    one = ep.local_posterior(random.PRNGKey(2), res, client="2", num_samples=2000, num_warmup=300)
    s = slice(DL * 3, DL * 4)
    assert np.max(np.abs(np.asarray(one["theta"]).mean(0) - mean[s]) / np.sqrt(np.diag(cov[s, s]))) < 0.15
    new = ep.adapt(random.PRNGKey(3), res, {"x": xs[K], "y": ys[K]}, num_samples=2000, num_warmup=300)
    mean5, cov5 = _joint_posterior(xs, ys)
    s = slice(DL * (K + 1), DL * (K + 2))
    sd = np.sqrt(np.diag(cov5[s, s]))
    assert np.max(np.abs(np.asarray(new["theta"]).mean(0) - mean5[s]) / sd) < 0.15
    assert np.max(np.abs(np.asarray(new["theta"]).std(0) / sd - 1)) < 0.1


def test_only_the_factor_update_crosses(hier):
    """A client's message is {delta, valid, fit_ok, fit_stat}: the change of its factor over
    the global sites only (no local-site dimensions), a flag and its own fit check (one flag,
    one number), and none of its data appear in it."""
    clients, xs, ys = hier
    ep = nf.EP(hier_model, schedule="synchronous", damping=0.5)
    state = ep.init(random.PRNGKey(0), clients)
    res = ep.run(random.PRNGKey(0), clients, 1, record_transcript=True, keep_values=True)
    up = [e for e in res.transcript.entries if e.receiver == "server"]
    assert {e.name for e in up} == {"['delta'].shift", "['delta'].precision", "['valid']", "['fit_ok']",
                                    "['fit_stat']", "['fit_k']"}
    assert {e.shape for e in up if "fit_" in e.name} == {()}
    assert {e.shape for e in up if e.name.endswith("shift")} == {(DL,)}
    assert {e.shape for e in up if e.name.endswith("precision")} == {(DL, DL)}
    sent = np.concatenate([np.ravel(e.value) for e in res.transcript.entries]).astype(np.float32)
    for j in range(K):
        for arr in (xs[j], ys[j]):
            assert not contains(sent, arr)
    new_state, _ = ep.update(state, clients)
    assert jnp.all(new_state.server.q.precision != state.server.q.precision)


def test_ep_clear_errors(linear):
    clients = linear[0]
    with pytest.raises(ValueError, match="tilted='mcmc'"):
        nf.EP(linear_model, tilted="mcmc")
    with pytest.raises(ValueError, match="tilted='vi' needs optim="):
        nf.EP(linear_model, tilted="vi")
    with pytest.raises(ValueError, match="num_samples=0"):
        nf.EP(linear_model, tilted="nuts", num_samples=0)
    with pytest.raises(ValueError, match="damping=1.5"):
        nf.EP(linear_model, damping=1.5)
    with pytest.raises(ValueError, match="max_kl='big': must be positive, 'auto' or None"):
        nf.EP(linear_model, max_kl="big")
    ep = nf.EP(linear_model)
    with pytest.raises(ValueError, match="needs a fitted EP"):
        ep.sample_posterior(random.PRNGKey(0), None, 10)
    res = ep.run(random.PRNGKey(0), clients, 3)
    with pytest.raises(ValueError, match="client '7' is not one of the fitted clients"):
        ep.local_posterior(random.PRNGKey(0), res, client="7")

    def with_param(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        s = numpyro.param("s", 1.0)
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, s), obs=y)

    with pytest.raises(ValueError, match=r"EP approximates latent sites only; numpyro.param sites \['s'\]"):
        nf.EP(with_param).init(random.PRNGKey(0), clients)

    def half_normal(x, y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    # a non-Gaussian prior is no longer refused (issue 26): its residual is the server's own site
    assert nf.EP(half_normal).init(random.PRNGKey(0), clients).server.prior_site is not None


def test_parallel_ep_has_a_trust_region_by_default():
    """max_kl="auto": 20 nats when more than one client may answer in a round (their summed
    updates can overshoot, benchmarks/hm2_ep.py), off for one client per round."""
    assert nf.EP(linear_model, schedule="synchronous").max_kl == nf.factor.ep_inference.DEFAULT_MAX_KL == 20.0
    assert nf.EP(linear_model, schedule="subset", subset_size=3).max_kl == 20.0
    assert nf.EP(linear_model).max_kl is None  # sequential
    assert nf.EP(linear_model, schedule="subset", subset_size=1).max_kl is None
    assert nf.EP(linear_model, schedule="synchronous", max_kl=None).max_kl is None
    assert nf.EP(linear_model, schedule="synchronous", max_kl=5.0).max_kl == 5.0


def test_ep_on_hm2_matches_pooled_nuts():
    """Paper 004 Example 4.1 (HM2) at test size (12 devices x 40 rows, known noise): EP with
    Laplace tilted moments against NUTS on the pooled hierarchical model (the full-size
    K = 100 design is benchmarks/hm2_ep.py). The Laplace tilted moments of the variance
    hyperparameters log tau are skewed when few devices inform them (with the old joint-mode
    Laplace: 0.31-0.39 NUTS sds; at K = 100: under 0.19), hence the wider tolerance on them
    than on mu."""
    from numpyro_fed_examples.models import hm2_regression

    k, n, noise = 12, 40, 0.5
    rng = np.random.default_rng(0)
    mu, var = np.array([1.0, 3.0, 0.5, 2.0]), np.array([1.17, 2.35, 2.52, 0.67])
    theta = mu + np.sqrt(var) * rng.normal(size=(k, 4))
    x = rng.normal(size=(k, n, 4)).astype(np.float32)
    y = (np.einsum("knd,kd->kn", x, theta) + noise * rng.normal(size=(k, n))).astype(np.float32)
    clients = nf.Clients.split(np.repeat(np.arange(k), n), x=x.reshape(-1, 4), y=y.reshape(-1))
    res = nf.EP(hm2_regression, schedule="synchronous", damping=0.5, model_kwargs={"noise": noise}).run(
        random.PRNGKey(0), clients, 20)

    def pooled(x, y):
        m = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        tau = numpyro.sample("tau", dist.LogNormal(0.0, 1.0).expand([4]).to_event(1))
        with numpyro.plate("devices", k):
            th = numpyro.sample("theta", dist.Normal(m, jnp.sqrt(tau)).to_event(1))
            numpyro.sample("y", dist.Normal(jnp.einsum("knd,kd->kn", x, th), noise).to_event(1), obs=y)

    s = nuts_reference("hm2_pooled", pooled, x, y, num_warmup=500, num_samples=2000, seed=1)
    u = np.concatenate([np.asarray(s["mu"]), np.log(np.asarray(s["tau"]))], 1)
    z = (np.asarray(res.params.mean) - u.mean(0)) / u.std(0)
    ratio = np.sqrt(np.diag(np.asarray(res.params.cov))) / u.std(0)
    assert np.max(np.abs(z[:4])) < 0.2, z  # mu
    assert np.max(np.abs(z[4:])) < 0.5, z  # log tau
    assert np.max(np.abs(ratio - 1)) < 0.2, ratio
    assert int(np.sum(np.asarray(res.info.invalid))) == 0


def test_one_model_under_three_inference_objects(hier):
    """The same annotated model runs under FederatedSVI, PVI and EP by swapping the
    inference object, and each result converts with nf.to_arviz."""
    import arviz as az

    clients, xs, ys = hier
    mean, cov = _joint_posterior(xs[:K], ys[:K])
    svi = nf.FederatedSVI(hier_model, nf.StructuredGuide(hier_model), optax.adam(0.05), local_steps=5)
    pvi = nf.PVI(hier_model, update="optax", optim=optax.adam(0.02), local_steps=200, schedule="sequential")
    ep = nf.EP(hier_model)
    fits = [(svi, svi.run(random.PRNGKey(0), clients, 200, progress_bar=False)),
            (pvi, pvi.run(random.PRNGKey(0), clients, K)), (ep, ep.run(random.PRNGKey(0), clients, K))]
    for method, res in fits:
        data = nf.to_arviz(method, res, random.PRNGKey(1), num_samples=500)
        summary = az.summary(data, var_names=["mu"], kind="stats")
        assert np.max(np.abs(summary["mean"].to_numpy() - mean[:DL]) / np.sqrt(np.diag(cov[:DL, :DL]))) < 0.5
        assert data.attrs["method"] == method.method
    local = nf.to_arviz(ep, fits[2][1], random.PRNGKey(2), num_samples=50, client="1")
    assert local.posterior["theta"].shape == (4, 50, DL)


def test_inclusion_rule_and_variable_selection_model_errors():
    """Paper 004 §4.3: include a coefficient unless its 90% interval covers 0."""
    from numpyro_fed_examples.models import inclusion, variable_selection

    rng = np.random.default_rng(0)
    draws = np.stack([rng.normal(3.0, 1.0, 4000), rng.normal(1.0, 1.0, 4000), rng.normal(-2.0, 1.0, 4000)], -1)
    np.testing.assert_array_equal(inclusion(draws, 0.9), [True, False, True])  # 1 +- 1.645 covers 0
    np.testing.assert_array_equal(inclusion(draws[None], 0.5), [[True, True, True]])
    with pytest.raises(ValueError, match="prior='elastic'"):
        numpyro.handlers.seed(variable_selection, 0)(np.ones((3, 2)), np.ones(3), prior="elastic")

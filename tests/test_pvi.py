"""PVI (paper 002 §3.1): conjugate truth, damping, PD safeguard, privacy, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed import gaussian as G
from numpyro_fed.factor.pvi_algorithm import pvi

from .test_privacy import contains

SIGMA, PRIOR_SD, D = 0.7, 2.0, 3


def linear_model(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([D]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, SIGMA), obs=y)


@pytest.fixture(scope="module")
def linear():
    return make_linear()


def make_linear():
    """90 rows over 3 clients (20/30/40) and the exact posterior (mean, cov, precision)."""
    rng = np.random.default_rng(0)
    n = 90
    x = rng.normal(size=(n, D)).astype(np.float32)
    y = (x @ np.array([1.0, -0.5, 0.3]) + SIGMA * rng.normal(size=n)).astype(np.float32)
    precision = x.T @ x / SIGMA**2 + np.eye(D) / PRIOR_SD**2
    cov = np.linalg.inv(precision)
    clients = nf.Clients.split(np.repeat([0, 1, 2], [20, 30, 40]), x=x, y=y)
    return clients, cov @ x.T @ y / SIGMA**2, cov, precision


@pytest.mark.parametrize("schedule,damping,rounds", [("sequential", 1.0, 3), ("synchronous", 1.0, 1)])
def test_one_pass_gives_the_exact_posterior(linear, schedule, damping, rounds):
    """Conjugate model: one pass of sequential PVI (3 rounds, one client each) or one
    undamped synchronous round equals the exact posterior."""
    clients, mean, cov, _ = linear
    res = nf.PVI(linear_model, schedule=schedule, damping=damping).run(random.PRNGKey(0), clients, rounds)
    np.testing.assert_allclose(res.params.mean, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.params.cov, cov, rtol=1e-4, atol=1e-8)
    assert res.communication.messages_up == rounds * (1 if schedule == "sequential" else 3)


@pytest.mark.parametrize("variant", ["local_averaging", "virtual"])
@pytest.mark.parametrize("schedule,rounds", [("sequential", 3), ("synchronous", 1)])
def test_local_averaging_and_virtual_clients_are_exact_for_a_conjugate_model(linear, variant, schedule, rounds):
    """Paper 002 Algs. 2-3 with 4 shards per client: the shards' tempered fits average to
    the client's likelihood (eq. 4.1-4.2), and the virtual factors sum to it (eq. 4.10).
    Wrong shard masks (overlapping or missing rows) would change the result."""
    clients, mean, cov, _ = linear
    res = nf.PVI(linear_model, schedule=schedule, variant=variant, num_shards=4).run(random.PRNGKey(0), clients, rounds)
    np.testing.assert_allclose(res.params.mean, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.params.cov, cov, rtol=1e-4, atol=1e-8)
    if variant == "virtual":  # each client keeps one factor per shard; they sum to its likelihood
        factors = res.state.clients.state.factor
        assert factors.precision.shape == (3, 4, D, D)


def test_damped_synchronous_pvi_converges_to_the_exact_posterior(linear):
    clients, mean, cov, _ = linear
    pvi_ = nf.PVI(linear_model, schedule="synchronous", damping=0.5)
    first = pvi_.run(random.PRNGKey(0), clients, 1)
    assert np.abs(first.params.cov - cov).max() > 0.3 * np.abs(cov).max()  # one damped round is not there yet
    res = pvi_.run(random.PRNGKey(0), clients, 30)
    np.testing.assert_allclose(res.params.mean, mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res.params.cov, cov, rtol=1e-3, atol=1e-7)
    assert np.all(np.asarray(res.info.damping) == 0.5)


def test_mean_field_fixed_point_is_the_global_mean_field_optimum(linear):
    """For a Gaussian posterior the mean-field KL optimum has the exact mean and precision
    diag(P); diagonal PVI reaches it."""
    clients, mean, _, precision = linear
    res = nf.PVI(linear_model, family="diagonal", schedule="sequential").run(random.PRNGKey(0), clients, 60)
    np.testing.assert_allclose(res.params.mean, mean, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(res.params.cov, 1 / np.diag(precision), rtol=1e-4)


def test_optax_local_updates_approach_the_exact_posterior(linear):
    clients, mean, cov, _ = linear
    res = nf.PVI(linear_model, update="optax", optim=optax.adam(0.01), local_steps=300, num_particles=16,
                 schedule="sequential").run(random.PRNGKey(0), clients, 6)
    sd = np.sqrt(np.diag(cov))
    assert np.max(np.abs(res.params.mean - mean) / sd) < 0.3
    assert np.max(np.abs(np.sqrt(np.diag(res.params.cov)) / sd - 1)) < 0.15
    assert int(np.sum(res.info.invalid)) == 0
    draws = nf.PVI(linear_model).sample_posterior
    with pytest.raises(ValueError, match="fitted PVI"):
        draws(random.PRNGKey(0), res, 10)


def _one_update_at(precision, **options):
    """PVI's server step on one client's update of natural precision ``precision * I``."""
    prior = G.NaturalGaussian(jnp.zeros(2), jnp.eye(2))
    alg = pvi(prior, lambda u, data: 0.0, 1, **options)
    state, _ = alg.init_server(random.PRNGKey(0))
    delta = G.NaturalGaussian(jnp.ones((1, 2)), precision * jnp.eye(2)[None])
    messages = {"delta": delta, "valid": jnp.ones(1, bool), "fit_ok": jnp.ones(1, bool), "fit_stat": jnp.zeros(1),
                "fit_k": jnp.zeros(1)}
    _, message, info = alg.exchanges[0].server_step(random.PRNGKey(1), state, messages,
                                                    nf.run.protocol.ServerView(jnp.ones(1, bool)))
    return message, info


def test_positive_definiteness_safeguard():
    """The server halves the damping until the precision is PD, and rejects otherwise."""
    for precision, want in ((-1.5, 0.5), (-3.0, 0.25)):
        message, info = _one_update_at(precision)
        assert float(info.damping) == want and bool(G.is_positive_definite(message.shared["q"]))
    message, info = _one_update_at(-1.5, max_halvings=0)
    assert float(info.damping) == 0.0  # rejected: q unchanged
    np.testing.assert_array_equal(message.shared["q"].precision, jnp.eye(2))


def test_trust_region_halves_damping_for_a_far_move():
    """With max_kl, a PD update that would move q by more than max_kl nats is damped until
    it does not (a mean shift of 8 sds is 32 nats: damping 1/2 for <= 8 nats, 1/4 for <= 2)."""
    from numpyro_fed.factor.updates import factor_protocol

    prior = G.NaturalGaussian(jnp.zeros(1), jnp.eye(1))
    delta = G.NaturalGaussian(jnp.full((1, 1), 8.0), jnp.zeros((1, 1, 1)))
    msgs = {
        "delta": delta,
        "valid": jnp.ones(1, bool),
        "fit_ok": jnp.ones(1, bool),
        "fit_stat": jnp.zeros(1),
        "fit_k": jnp.zeros(1),
    }
    for max_kl, want in ((None, 1.0), (8.0, 0.5), (2.0, 0.25)):
        alg = factor_protocol(prior, None, 1, max_kl=max_kl)
        state, _ = alg.init_server(random.PRNGKey(0))
        _, message, info = alg.exchanges[0].server_step(
            random.PRNGKey(1), state, msgs, nf.run.protocol.ServerView(jnp.ones(1, bool))
        )
        assert float(info.damping) == want
        assert float(G.kl_divergence(message.shared["q"], prior)) <= (max_kl or np.inf)


def test_client_update_is_one_natural_parameter_message(linear):
    """What a client sends is Delta t_j (d + d^2 numbers), a validity flag and its fit check
    (a flag and one number): no data."""
    clients, *_ = linear
    p = nf.PVI(linear_model, schedule="synchronous")
    res = p.run(random.PRNGKey(0), clients, 1, record_transcript=True, keep_values=True)
    up = [e for e in res.transcript.entries if e.receiver == "server"]
    assert {e.name for e in up} == {
        "['delta'].shift",
        "['delta'].precision",
        "['valid']",
        "['fit_ok']",
        "['fit_stat']",
        "['fit_k']",
    }
    assert {e.shape for e in up if e.name.endswith("shift")} == {(D,)}
    assert {e.shape for e in up if e.name.endswith("precision")} == {(D, D)}
    for name in clients.names:
        for arr in clients[name].values():
            for e in up:
                assert not contains(e.value, arr)


def test_clear_errors(linear):
    clients, *_ = linear

    def logistic(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=(y > 0).astype(jnp.float32))

    with pytest.raises(ValueError, match="client '0''s log-likelihood is not a Gaussian function"):
        nf.PVI(logistic, update="conjugate").init(random.PRNGKey(0), clients)

    def half_normal_prior(x, y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, s), obs=y)

    # a non-Gaussian prior is no longer refused (issue 26): its residual is the server's own site
    state = nf.PVI(half_normal_prior, update="optax", optim=optax.adam(0.01)).init(random.PRNGKey(0), clients)
    assert state.server.prior_site is not None

    def with_local(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with nf.local_site(sites=["b"]):
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w + b, 1.0), obs=y)

    with pytest.raises(ValueError, match=r"no closed form with local latent sites \(\['b'\]\)"):
        nf.PVI(with_local, update="conjugate").init(random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match=r"variant='virtual' splits a client's rows into shards.*local site\(s\) "
                                         r"\['b'\] are not in the row plate"):
        nf.PVI(with_local, update="optax", optim=optax.adam(0.01), variant="virtual", num_shards=2).init(
            random.PRNGKey(0), clients
        )
    with pytest.raises(ValueError, match="optim="):
        nf.PVI(linear_model, update="optax")
    with pytest.raises(TypeError, match="optim .*must be an optax GradientTransformation"):
        nf.PVI(linear_model, optim=0.01)
    with pytest.raises(ValueError, match="update='newton'"):
        nf.PVI(linear_model, update="newton")
    with pytest.raises(ValueError, match="damping=0"):
        nf.PVI(linear_model, damping=0.0)
    with pytest.raises(ValueError, match="num_shards=2"):
        nf.PVI(linear_model, num_shards=2)
    with pytest.raises(ValueError, match="client '0' has 20 rows, fewer than num_shards=25"):
        nf.PVI(linear_model, variant="virtual", num_shards=25).init(random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="variant='dp'"):
        nf.PVI(linear_model, variant="dp")
    with pytest.raises(ValueError, match="schedule='random'"):
        nf.PVI(linear_model, schedule="random")
    with pytest.raises(TypeError, match="nf.Clients"):
        nf.PVI(linear_model).init(random.PRNGKey(0), {"x": 1})


def test_default_update_is_chosen_per_model(linear):
    """Issue 26 item 4: ``nf.PVI(model)`` runs on any annotated model. The default
    ``update="auto"`` is the closed form where the likelihood is quadratic (exact in one
    pass), and the stochastic local ELBO otherwise: a logistic likelihood, and local latent
    sites (where it fits q over the global and local sites jointly) -- both of which the
    conjugate update refuses."""
    clients, mean, cov, _ = linear
    exact = nf.PVI(linear_model)
    res = exact.run(random.PRNGKey(0), clients, 1)
    assert exact.update_used == "conjugate"
    np.testing.assert_allclose(res.params.mean, mean, rtol=1e-5, atol=1e-6)

    def logistic(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=(y > 0).astype(jnp.float32))

    def with_local(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([D]).to_event(1))
        with nf.local_site(sites=["b"]):
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w + b, SIGMA), obs=y)

    for model in (logistic, with_local):
        pvi_ = nf.PVI(model, local_steps=300, schedule="sequential")
        res = pvi_.run(random.PRNGKey(1), clients, 3)
        assert pvi_.update_used == "optax", model.__name__
        assert np.all(np.isfinite(np.asarray(res.params.mean)))
    # the local-latent model is Gaussian: its exact marginal of w is the reference
    xs = [np.asarray(clients[n]["x"]) for n in clients.names]
    ys = [np.asarray(clients[n]["y"]) for n in clients.names]
    # y_j ~ N(x_j w, SIGMA^2 I + 1 1^T): the client offset b_j ~ N(0, 1) integrated out
    precision = np.eye(D) / PRIOR_SD**2
    shift = np.zeros(D)
    for x, y in zip(xs, ys):
        inv = np.linalg.inv(SIGMA**2 * np.eye(len(y)) + np.ones((len(y), len(y))))
        precision += x.T @ inv @ x
        shift += x.T @ inv @ y
    exact_cov = np.linalg.inv(precision)
    exact_mean = exact_cov @ shift
    sd = np.sqrt(np.diag(exact_cov))
    assert np.max(np.abs((np.asarray(res.params.mean) - exact_mean) / sd)) < 0.3


def test_lognormal_prior_is_gaussian_in_unconstrained_space(linear):
    clients, *_ = linear

    def model(x, y):
        s = numpyro.sample("s", dist.LogNormal(0.0, 0.5))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, s), obs=y)

    p = nf.PVI(model, update="optax", optim=optax.adam(0.01), local_steps=200, schedule="sequential")
    res = p.run(random.PRNGKey(0), clients, 3)
    draws = p.sample_posterior(random.PRNGKey(1), res, 200)
    assert set(draws) == {"s", "w"}
    assert draws["s"].shape == (200,) and bool(jnp.all(draws["s"] > 0))
    assert abs(float(jnp.median(draws["s"])) - SIGMA) < 0.2
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x: bool(jnp.all(jnp.isfinite(x))), res.params.mean))


def _global_vi_logistic(x, y, steps=5000):
    """Full-covariance Gaussian VI on the pooled data, with the ELBO made deterministic by
    Gauss-Hermite quadrature of each row's 1-D expectation (the reference fixed point)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(40)
    weights = weights / weights.sum()

    def moments(p):
        tril = jnp.tril(p["L"], -1) + jnp.diag(jax.nn.softplus(jnp.diag(p["L"])))
        return p["m"], tril @ tril.T

    def neg_elbo(p):
        m, s = moments(p)
        mu, sd = x @ m, jnp.sqrt(jnp.einsum("ni,ij,nj->n", x, s, x))
        f = mu[:, None] + sd[:, None] * nodes[None]
        ll = jnp.sum((y[:, None] * jax.nn.log_sigmoid(f) + (1 - y[:, None]) * jax.nn.log_sigmoid(-f)) @ weights)
        kl = 0.5 * (jnp.trace(s) + m @ m - D - jnp.linalg.slogdet(s)[1])
        return kl - ll

    opt = optax.adam(0.01)

    def body(carry, _):
        p, st = carry
        u, st = opt.update(jax.grad(neg_elbo)(p), st, p)
        return (optax.apply_updates(p, u), st), None

    p = {"m": jnp.zeros(D), "L": 0.5 * jnp.eye(D)}
    (p, _), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=steps))((p, opt.init(p)))
    return [np.asarray(a) for a in moments(p)]


@pytest.mark.parametrize(
    "schedule,damping,rounds,variant",
    [
        ("sequential", 1.0, 9, "plain"),
        ("synchronous", 0.5, 6, "plain"),
        ("synchronous", 0.5, 12, "virtual"),
        ("sequential", 1.0, 9, "local_averaging"),
    ],
)
def test_pvi_fixed_point_is_global_vi_on_logistic_regression(schedule, damping, rounds, variant):
    """Non-conjugate model: PVI's fixed point is the global VI optimum of the same family
    on the pooled data (Ashman et al., 2022), reached here with optax local updates."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(120, D)).astype(np.float32)
    y = (rng.random(120) < 1 / (1 + np.exp(-(x @ np.array([1.0, -1.0, 0.5]))))).astype(np.float32)

    def logistic(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    clients = nf.Clients.split(np.repeat([0, 1, 2], [30, 40, 50]), x=x, y=y)
    mean, cov = _global_vi_logistic(jnp.asarray(x), jnp.asarray(y))
    res = nf.PVI(
        logistic,
        update="optax",
        optim=optax.adam(0.01),
        local_steps=500,
        num_particles=32,
        schedule=schedule,
        damping=damping,
        variant=variant,
        num_shards=1 if variant == "plain" else 3,
    ).run(random.PRNGKey(0), clients, rounds)
    sd = np.sqrt(np.diag(cov))
    print(
        schedule,
        variant,
        "|mean - global VI| / sd =",
        np.abs(res.params.mean - mean) / sd,
        "sd ratio =",
        np.sqrt(np.diag(res.params.cov)) / sd,
    )
    assert np.max(np.abs(res.params.mean - mean) / sd) < 0.25
    np.testing.assert_allclose(np.sqrt(np.diag(res.params.cov)), sd, rtol=0.05)


def test_deterministic_sites_of_the_globals_are_in_the_draws(linear):
    """PVI/EP draws of ``q(z_G)`` carry the model's deterministic sites that are functions
    of the global sites alone (``w_sq``), computed from the draws; per-row ones (``mean``)
    have no value under ``q(z_G)`` and are left out."""
    clients, *_ = linear

    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        numpyro.deterministic("w_sq", jnp.sum(w**2))
        with numpyro.plate("rows", y.shape[0]):
            mean = numpyro.deterministic("mean", x @ w)
            numpyro.sample("y", dist.Normal(mean, SIGMA), obs=y)

    for inference in (nf.PVI(model, schedule="sequential"), nf.EP(model)):
        res = inference.run(random.PRNGKey(0), clients, 1)
        draws = inference.sample_posterior(random.PRNGKey(1), res, 50)
        assert set(draws) == {"w", "w_sq"}, type(inference).__name__
        np.testing.assert_allclose(draws["w_sq"], jnp.sum(draws["w"] ** 2, -1), rtol=1e-5)
        idata = nf.to_arviz(inference, res, random.PRNGKey(1), num_samples=25)
        assert "w_sq" in idata.posterior and "mean" not in idata.posterior

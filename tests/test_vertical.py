"""The vertical_split rewrite against hand-written models and closed-form posteriors."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.infer.util import log_density

import numpyro_fed as nf

from .references import nuts_reference

SIGMA = 1.0
PRIOR_SD = 2.0


def true_model(xa, xb, y):
    ba = numpyro.sample("ba", dist.Normal(0.0, PRIOR_SD).expand([xa.shape[1]]).to_event(1))
    bb = numpyro.sample("bb", dist.Normal(0.0, PRIOR_SD).expand([xb.shape[1]]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        ga = numpyro.deterministic("ga", xa @ ba)
        gb = numpyro.deterministic("gb", xb @ bb)
        numpyro.sample("y", dist.Normal(ga + gb, SIGMA), obs=y)


SPEC = {
    "a": dict(data=["xa"], sites=["ba"], contribution="ga"),
    "b": dict(data=["xb"], sites=["bb"], contribution="gb"),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    n = 40
    xa = rng.normal(size=(n, 2)).astype(np.float32)
    xb = rng.normal(size=(n, 1)).astype(np.float32)
    y = (xa @ np.array([1.0, -1.0]) + 0.5 * xb[:, 0] + SIGMA * rng.normal(size=n)).astype(np.float32)
    return dict(xa=jnp.asarray(xa), xb=jnp.asarray(xb), y=jnp.asarray(y))


def hand_written(form, rho, params, data):
    """log p of paper 000 eqs. (6) and (7), written out directly."""
    ba, bb, za, zb = params["ba"], params["bb"], params["z_a"], params["z_b"]
    ga, gb = data["xa"] @ ba, data["xb"] @ bb
    prior = dist.Normal(0, PRIOR_SD).log_prob(ba).sum() + dist.Normal(0, PRIOR_SD).log_prob(bb).sum()
    aux = dist.Normal(ga, rho).log_prob(za).sum() + dist.Normal(gb, rho).log_prob(zb).sum()
    y = data["y"]
    if form == "augmented":
        lik = dist.Normal(za + zb, SIGMA).log_prob(y).sum()
    else:
        lik = 0.5 * (dist.Normal(ga + zb, SIGMA).log_prob(y).sum() + dist.Normal(za + gb, SIGMA).log_prob(y).sum())
    return prior + aux + lik


@pytest.mark.parametrize("form", ["augmented", "power"])
@pytest.mark.parametrize("style", ["wrapper", "decorator"])
def test_rewrite_equals_hand_written_log_density(data, form, style):
    rho = 0.7
    if style == "wrapper":
        model = nf.vertical_split(true_model, clients=SPEC, form=form, rho=rho, response="y")
    else:
        model = nf.vertical_split(clients=SPEC, form=form, rho=rho, response="y")(true_model)
    rng = np.random.default_rng(1)
    n = data["y"].shape[0]
    for _ in range(3):
        params = {
            "ba": jnp.asarray(rng.normal(size=2), jnp.float32),
            "bb": jnp.asarray(rng.normal(size=1), jnp.float32),
            "z_a": jnp.asarray(rng.normal(size=n), jnp.float32),
            "z_b": jnp.asarray(rng.normal(size=n), jnp.float32),
        }
        lp, tr = log_density(model, (), data, params)
        np.testing.assert_allclose(lp, hand_written(form, rho, params, data), rtol=1e-5)
        assert tr["z_a"]["infer"]["vertical_client"] == "a"
        assert tr["ba"]["infer"]["vertical_client"] == "a"


def closed_form(data, noise_var):
    X = np.concatenate([np.asarray(data["xa"]), np.asarray(data["xb"])], axis=1).astype(np.float64)
    prec = X.T @ X / noise_var + np.eye(X.shape[1]) / PRIOR_SD**2
    cov = np.linalg.inv(prec)
    return cov @ X.T @ np.asarray(data["y"], np.float64) / noise_var, np.sqrt(np.diag(cov))


def nuts_theta(model, data, seed=0):
    s = nuts_reference("vertical_theta", model, num_warmup=500, num_samples=1500, seed=seed, sites=("ba", "bb"),
                       nuts_kwargs=dict(dense_mass=True), **data)
    return np.concatenate([np.asarray(s["ba"]), np.asarray(s["bb"])], axis=1)


@pytest.mark.parametrize("rho", [1.0, 0.1])
def test_augmented_posterior_matches_closed_form(data, rho):
    """Integrating z out: y | theta ~ N(sum_j x_j theta_j, sigma^2 + J rho^2)."""
    model = nf.vertical_split(true_model, clients=SPEC, rho=rho, response="y")
    draws = nuts_theta(model, data)
    mean, sd = closed_form(data, SIGMA**2 + 2 * rho**2)
    ess = np.asarray(effective_sample_size(draws[None]))
    assert ess.min() > 100
    mc = 4 * sd / np.sqrt(ess)  # 4 Monte Carlo standard errors of the NUTS mean
    np.testing.assert_array_less(np.abs(draws.mean(0) - mean), mc)
    np.testing.assert_allclose(draws.std(0), sd, rtol=0.15)


def test_rewrites_tend_to_true_posterior_as_rho_shrinks(data):
    true_mean, true_sd = closed_form(data, SIGMA**2)
    gaps = {}
    for form in ("augmented", "power"):
        for rho in (2.0, 0.05):
            model = nf.vertical_split(true_model, clients=SPEC, form=form, rho=rho, response="y")
            draws = nuts_theta(model, data, seed=1)
            gaps[form, rho] = np.max(np.abs(draws.std(0) / true_sd - 1) + np.abs(draws.mean(0) - true_mean) / true_sd)
    for form in ("augmented", "power"):
        assert gaps[form, 0.05] < 0.25, gaps
        assert gaps[form, 0.05] < gaps[form, 2.0], gaps


def test_power_likelihood_sees_every_copy(data):
    model = nf.vertical_split(true_model, clients=SPEC, form="power", rho=1.0, response="y")
    tr = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(**data)
    assert tr["y"]["fn"].batch_shape == (2, data["y"].shape[0])
    assert tr["y"]["scale"] == 0.5


def test_power_form_counts_a_factor_once(data):
    """A ``numpyro.factor`` (here a ridge penalty; NumPyro's own potential energy adds one
    per constrained site) is counted once in the power form, like a prior."""

    def penalised(xa, xb, y):
        true_model(xa, xb, y)
        ba = numpyro.sample("sd_shift", dist.HalfNormal(1.0))
        numpyro.factor("penalty", -0.5 * ba**2)

    model = nf.vertical_split(penalised, clients=SPEC, form="power", rho=1.0, response="y")
    params = {"ba": jnp.array([0.3, -0.2]), "bb": jnp.array([0.1]), "sd_shift": jnp.array(0.7),
              "z_a": jnp.zeros(40), "z_b": jnp.ones(40)}
    got = log_density(model, (), data, params)[0]
    want = hand_written("power", 1.0, params, data) + dist.HalfNormal(1.0).log_prob(0.7) - 0.5 * 0.7**2
    np.testing.assert_allclose(got, want, rtol=1e-5)
    tr = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(**data)
    assert tr["penalty"]["scale"] is None


def test_true_model_is_untouched(data):
    tr = numpyro.handlers.trace(numpyro.handlers.seed(true_model, 0)).get_trace(**data)
    assert "z_a" not in tr


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rho=0.0), r"rho=0.0\): rho must be > 0"),
        (dict(rho=-1.0), "rho must be > 0"),
        (dict(form="power", response_access="server"), "form='power' needs the response on every client"),
        (dict(form="exact"), "form='exact'"),
        (
            dict(clients={"a": SPEC["a"], "b": dict(SPEC["b"], sites=["ba"])}),
            "site 'ba' is owned by clients 'a' and 'b'",
        ),
        (
            dict(clients={"a": SPEC["a"], "b": dict(SPEC["b"], contribution="ga")}),
            "contribution 'ga' is owned by clients",
        ),
        (dict(clients={"a": SPEC["a"], "b": dict(SPEC["b"], data=["xa"])}), "data argument 'xa' is owned by clients"),
        (dict(clients={"a": SPEC["a"], "b": dict(data=["xb"])}), "client 'b' needs a mapping"),
        (
            dict(row_ids={"a": np.arange(5), "b": np.array([0, 1, 2, 4, 3])}),
            "row ids of client 'b' differ .* position 3",
        ),
    ],
)
def test_construction_errors(kwargs, match):
    args = dict(clients=SPEC, rho=1.0, response="y")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        nf.vertical_split(true_model, **args)


def test_call_errors(data):
    model = nf.vertical_split(true_model, clients=SPEC, rho=1.0, response="y")
    with pytest.raises(ValueError, match="argument 'xb' of client 'b' has 39 rows but 'xa' has 40"):
        model(xa=data["xa"], xb=data["xb"][:-1], y=data["y"])
    with pytest.raises(TypeError, match="keyword arguments"):
        model(data["xa"], data["xb"], data["y"])
    no_owner = nf.vertical_split(true_model, clients=SPEC, rho=1.0)
    with pytest.raises(ValueError, match="argument 'y' is owned by no client"):
        numpyro.handlers.seed(no_owner, 0)(**data)

    def forgot(xa, xb, y):
        ba = numpyro.sample("ba", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            ga = numpyro.deterministic("ga", xa @ ba)
            numpyro.sample("y", dist.Normal(ga + xb[:, 0], 1.0), obs=y)

    with pytest.raises(ValueError, match="contribution site 'gb' of client 'b' was not reached"):
        numpyro.handlers.seed(nf.vertical_split(forgot, clients=SPEC, rho=1.0, response="y"), 0)(**data)

    def bypass(xa, xb, y):
        ba = numpyro.sample("ba", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        bb = numpyro.sample("bb", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.deterministic("ga", xa @ ba)
            numpyro.deterministic("gb", xb @ bb)
            numpyro.sample("y", dist.Normal(xa @ ba + xb @ bb, 1.0), obs=y)

    power = nf.vertical_split(bypass, clients=SPEC, form="power", rho=1.0, response="y")
    with pytest.raises(ValueError, match="observed site 'y' has batch shape"):
        numpyro.handlers.seed(power, 0)(**data)

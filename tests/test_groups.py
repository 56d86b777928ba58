"""Group effects inside a client (issue 26 item 2): ``nf.group_plate`` sized per client.

Three hospitals (clients) hold 1, 3 and 7 wards; a ward effect ``a_g ~ N(mu, TAU)`` is a
local site in the wards plate. The Gaussian version has an analytic posterior: each
ward's mean ``ybar_g | mu ~ N(mu, TAU^2 + SIGMA^2 / n_g)`` gives ``mu``'s, and
``a_g | mu, y`` is Gaussian, which gives each ward's."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro.infer.util import log_density

import numpyro_fed as nf
from numpyro_fed.model.groups import sized_model

SIGMA, TAU, PRIOR = 0.5, 0.8, 2.0
GROUPS = (1, 3, 7)


def wards_model(ward, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR))
    with nf.group_plate("wards", ward), nf.local_site():
        a = numpyro.sample("a", dist.Normal(mu, TAU))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a[ward], SIGMA), obs=y)


def make_wards(seed=0):
    rng = np.random.default_rng(seed)
    hospital, ward = [], []
    for j, count in enumerate(GROUPS):
        for k in range(count):
            n = int(rng.integers(2, 6))
            hospital += [j] * n
            ward += [sum(GROUPS[:j]) + k] * n
    hospital, ward = np.array(hospital), np.array(ward) * 3 + 10  # pooled codes need not be 0..G-1
    codes = np.unique(ward, return_inverse=True)[1]
    a_true = 1.0 + TAU * rng.normal(size=codes.max() + 1)
    y = (a_true[codes] + SIGMA * rng.normal(size=len(codes))).astype(np.float32)
    return hospital, ward, codes, y


def exact_posterior(codes, y):
    """``mu``'s mean and sd; per ward ``(mean, sd)`` of ``a_g``."""
    precision, shift, stats = 1 / PRIOR**2, 0.0, []
    for g in range(codes.max() + 1):
        yg = y[codes == g].astype(np.float64)
        v = TAU**2 + SIGMA**2 / len(yg)
        precision, shift = precision + 1 / v, shift + yg.mean() / v
        stats.append((len(yg), yg.mean()))
    m, var = shift / precision, 1 / precision
    wards = []
    for n, ybar in stats:  # a_g | mu, y_g ~ N(s2 (mu / TAU^2 + n ybar / SIGMA^2), s2)
        s2 = 1 / (1 / TAU**2 + n / SIGMA**2)
        slope = s2 / TAU**2
        wards.append((s2 * (m / TAU**2 + n * ybar / SIGMA**2), np.sqrt(s2 + slope**2 * var)))
    return m, np.sqrt(var), np.array(wards)


@pytest.fixture(scope="module")
def wards():
    hospital, ward, codes, y = make_wards()
    clients = nf.Clients.split(hospital, groups="ward", ward=ward, y=y)
    return clients, codes, y


def test_clients_split_recodes_each_clients_groups(wards):
    clients, codes, _ = wards
    assert [int(clients[c]["ward"].max()) + 1 for c in clients.names] == list(GROUPS)
    for c in clients.names:
        values = clients.group_values[c]["ward"]
        assert np.all(np.diff(values) > 0) and len(values) == int(clients[c]["ward"].max()) + 1


@pytest.mark.parametrize("family", ["ep", "pvi", "sfvi"])
def test_group_effects_with_1_3_7_groups_match_the_analytic_posterior(wards, family):
    """The global ``mu`` and the 7-ward client's ward effects against the exact posterior:
    EP (integrated Laplace, exact for a Gaussian model) to 1e-4 sd; PVI (joint Gaussian
    local ELBO by Adam) and SFVI (structured guide) within Monte Carlo error (0.1 sd, sd
    within 10 %)."""
    clients, codes, y = wards
    m, s, ward_stats = exact_posterior(codes, y)
    key = random.PRNGKey(1)
    if family == "ep":
        inference = nf.EP(wards_model)
        res = inference.run(random.PRNGKey(0), clients, 3)  # one sequential sweep
        mean, sd = float(res.params.mean[0]), float(np.sqrt(res.params.cov[0, 0]))
        local = inference.sample_posterior(key, res, 20000, client="2")
        tol = 1e-4
    elif family == "pvi":
        inference = nf.PVI(wards_model, schedule="sequential", local_steps=1000)
        res = inference.run(random.PRNGKey(0), clients, 6)
        mean, sd = float(res.params.mean[0]), float(np.sqrt(res.params.cov[0, 0]))
        local = inference.sample_posterior(key, res, 20000, client="2")
        tol = 0.1
    else:
        inference = nf.FederatedSVI(wards_model, nf.StructuredGuide(wards_model), optax.adam(0.02))
        res = inference.run(random.PRNGKey(0), clients, 3000, progress_bar=False)
        draws = inference.sample_posterior(key, res, 20000)
        mean, sd = float(draws["mu"].mean()), float(draws["mu"].std())
        local = inference.sample_posterior(key, res, 20000, client="2")
        tol = 0.1
    assert abs(mean - m) / s < tol and abs(sd / s - 1) < max(tol, 1e-3), (mean, m, sd, s)
    a = np.asarray(local["a"])
    assert a.shape == (20000, 7)  # the client's own wards only, not the padded plate
    first = sum(GROUPS[:2])
    exact = ward_stats[first:first + 7]
    mc = 4 * exact[:, 1] / np.sqrt(20000)  # Monte Carlo error of the draws' mean
    assert np.all(np.abs(a.mean(0) - exact[:, 0]) < tol * exact[:, 1] + mc), (a.mean(0), exact[:, 0])
    assert np.all(np.abs(a.std(0) / exact[:, 1] - 1) < max(tol, 0.03)), (a.std(0), exact[:, 1])


def test_padded_groups_add_nothing_to_the_density(wards):
    """Client '0' holds one ward, its plate is sized to 7: the sized model's log density
    equals the plain model's on its own ward, whatever the padded entries hold."""
    clients, *_ = wards
    sized = sized_model(wards_model, clients, {})
    assert sized.group_sizes == {"wards": 7} and sized.group_args == {"wards": "ward"}
    data = clients["0"]
    own, _ = log_density(wards_model, (), dict(data), {"mu": 0.3, "a": np.array([1.1])})
    for pad in (np.zeros(6), 50.0 * np.ones(6)):
        padded, _ = log_density(sized, (), dict(data), {"mu": 0.3, "a": np.concatenate([[1.1], pad])})
        np.testing.assert_allclose(padded, own, rtol=1e-6)


def test_group_plate_errors_name_the_plate_and_client(wards):
    clients, *_ = wards
    gappy = nf.Clients({"a": dict(ward=np.array([0, 2, 2]), y=np.zeros(3)),
                        "b": dict(ward=np.array([0]), y=np.ones(1))})
    with pytest.raises(ValueError, match=r"group_plate\('wards'\) on client 'a'.*codes \[1\] used by no row"):
        nf.EP(wards_model).init(random.PRNGKey(0), gappy)

    shifted = nf.Clients({"a": dict(ward=np.array([0, 1]), y=np.zeros(2)), "b": dict(ward=np.array([0]), y=np.ones(1))})

    def shifted_codes(ward, y):
        mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR))
        with nf.group_plate("wards", ward * 2), nf.local_site():
            numpyro.sample("a", dist.Normal(mu, TAU))
        numpyro.sample("y", dist.Normal(mu, SIGMA).expand([y.shape[0]]).to_event(1), obs=y)

    with pytest.raises(ValueError, match="must be one of the model's data arguments"):
        nf.EP(shifted_codes).init(random.PRNGKey(0), shifted)

    def global_effects(ward, y):
        mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR))
        with nf.group_plate("wards", ward):
            a = numpyro.sample("a", dist.Normal(mu, TAU))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(a[ward], SIGMA), obs=y)

    with pytest.raises(ValueError, match=r"site 'a' is inside group_plate\('wards'\) but is not marked local_site"):
        nf.PVI(global_effects).init(random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match=r"group_plate\('wards'\): the group codes are traced.*pass size="):
        jax.jit(lambda w, y: log_density(wards_model, (), dict(ward=w, y=y), {"mu": 0.0, "a": np.zeros(3)})[0])(
            clients["1"]["ward"], clients["1"]["y"]
        )

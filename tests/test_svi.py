import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.run.inference import checking_over, fitted

from .models import linear_local, logistic_local


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(26, 2)).astype(np.float32)
    y = (X @ np.array([1.0, -0.5]) + 0.3 * rng.normal(size=26)).astype(np.float32)
    return X, y


@pytest.fixture(scope="module")
def unequal(data):
    X, y = data
    return nf.Clients.split(np.repeat([0, 1, 2], [11, 9, 6]), X=X, y=y)


def test_vmap_padding_equals_loop(unequal):
    runs = {}
    for mapping in ("auto", "loop"):
        svi = nf.FederatedSVI(linear_local, nf.StructuredGuide(linear_local), optax.adam(0.05),
                              client_mapping=mapping)
        runs[mapping] = svi.run(random.PRNGKey(0), unequal, 30, progress_bar=False)
        assert fitted(svi).plan.mapping == ("vmap" if mapping == "auto" else "loop")
    a, b = runs["auto"], runs["loop"]
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-4, atol=1e-4)
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_partition_invariance_of_trajectory(data):
    """SFVI with Adam: the server's trajectory does not depend on how rows are split."""
    X, y = data
    two = nf.Clients.split(np.arange(26) % 2, X=X, y=y)
    one = nf.Clients.split(np.zeros(26, int), X=X, y=y)

    def model(X, y):  # no local latents: the noise draws are then partition free
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("rows", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta, 0.5), obs=y)

    out = []
    for clients in (one, two):
        svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
        out.append(svi.run(random.PRNGKey(3), clients, 50, progress_bar=False))
    for x, y in zip(jax.tree_util.tree_leaves(out[0].params), jax.tree_util.tree_leaves(out[1].params)):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)


@pytest.fixture(scope="module")
def binary(data):
    X, y = data
    return nf.Clients.split(np.repeat([0, 1, 2], [11, 9, 6]), X=X, y=(y > 0).astype(np.float32))


def test_scan_path_equals_python_loop_and_resume(binary):
    """(A logistic model on a continuous response has log-likelihood -inf; before the
    runtime's guards this test compared infinite losses, so it now uses a binary y.)"""
    unequal = binary
    svi = nf.FederatedSVI(logistic_local, nf.StructuredGuide(logistic_local), optax.adam(0.05))
    fast = svi.run(random.PRNGKey(0), unequal, 20, progress_bar=False)
    slow = svi.run(random.PRNGKey(0), unequal, 20, progress_bar=True)
    np.testing.assert_allclose(fast.losses, slow.losses, rtol=1e-5)
    first = svi.run(random.PRNGKey(0), unequal, 10, progress_bar=False)
    second = svi.run(random.PRNGKey(0), unequal, 10, progress_bar=False, init_state=first.state)
    np.testing.assert_allclose(jnp.concatenate([first.losses, second.losses]), fast.losses, rtol=1e-5)
    assert np.isfinite(fast.losses).all()


def test_round_compiles_once(unequal):
    svi = nf.FederatedSVI(linear_local, nf.StructuredGuide(linear_local), optax.adam(0.05))
    state = svi.init(random.PRNGKey(0), unequal)
    state, loss = svi.update(state, unequal)
    compiles = []  # XLA's own count of programs compiled (jax.monitoring), over four more rounds
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    for _ in range(4):
        state, loss = svi.update(state, unequal)
    assert np.isfinite(float(loss))
    assert compiles == [], compiles


def test_update_under_jit_and_evaluate(unequal):
    svi = nf.FederatedSVI(linear_local, nf.StructuredGuide(linear_local), optax.adam(0.05))
    result = svi.run(random.PRNGKey(0), unequal, 200, progress_bar=False)
    loss = svi.evaluate(result.state, unequal, num_particles=64)
    assert abs(float(loss) - float(result.losses[-20:].mean())) < 0.1 * abs(float(loss)) + 5.0


def test_sample_posterior_shapes(unequal):
    svi = nf.FederatedSVI(linear_local, nf.StructuredGuide(linear_local), optax.adam(0.05))
    result = svi.run(random.PRNGKey(0), unequal, 20, progress_bar=False)
    g = svi.sample_posterior(random.PRNGKey(1), result, 7)
    assert set(g) == {"beta", "sigma"} and g["beta"].shape == (7, 2) and (g["sigma"] > 0).all()
    c = svi.sample_posterior(random.PRNGKey(1), result, 7, client="2")
    assert c["b"].shape == (7, 6)  # unpadded: client '2' holds 6 rows
    with pytest.raises(KeyError, match="no client named 'x'"):
        svi.sample_posterior(random.PRNGKey(1), result, 7, client="x")


def test_to_arviz(unequal):
    import arviz as az

    svi = nf.FederatedSVI(linear_local, nf.StructuredGuide(linear_local), optax.adam(0.05))
    result = svi.run(random.PRNGKey(0), unequal, 15, progress_bar=False)
    idata = nf.to_arviz(svi, result, random.PRNGKey(1), num_samples=50, client="0", clients=unequal)
    assert idata.posterior["beta"].shape == (4, 50, 2)
    assert idata.sample_stats["elbo"].shape[-1] == 15
    assert "y" in idata.observed_data
    summary = az.summary(idata, var_names=["beta", "sigma"], kind="stats")
    assert list(summary.index) == ["beta[0]", "beta[1]", "sigma"]
    idata_server = nf.to_arviz(svi, result, random.PRNGKey(1), num_samples=50)
    assert "b" not in idata_server.posterior and not hasattr(idata_server, "observed_data")
    # independent draws as four chains: a full summary with no chain warning, finite R-hat
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = az.summary(idata_server, var_names=["beta"])
    assert np.all(np.abs(full["r_hat"].to_numpy() - 1) < 0.05)
    # the client's pointwise log-likelihood and predictive draws, at the posterior draws
    assert idata.log_likelihood["y"].shape == (4, 50, unequal.num_rows["0"])
    assert idata.posterior_predictive["y"].shape == (4, 50, unequal.num_rows["0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isfinite(az.loo(idata).elpd_loo) and np.isfinite(az.waic(idata).elpd_waic)


def test_local_param_stays_on_the_client(unequal):
    def model(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with nf.local_site():
            shift = numpyro.param("shift", 0.0)  # a client's own offset, never shared
        with numpyro.plate("rows", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta + shift, 0.3), obs=y)

    X = np.concatenate([unequal[c]["X"] for c in unequal.names])
    offsets = {"0": -1.0, "1": 0.0, "2": 2.0}
    shifted = nf.Clients({c: dict(X=unequal[c]["X"], y=unequal[c]["y"] + offsets[c]) for c in unequal.names})
    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    result = svi.run(random.PRNGKey(0), shifted, 600, progress_bar=False, record_transcript=True)
    assert X.shape[0] == 26 and "shift" not in result.params.theta
    for c, want in offsets.items():
        assert abs(float(result.client_states[c].local_params["theta"]["shift"]) - want) < 0.3
        assert abs(float(svi.client_params(result, c)["shift"]) - want) < 0.3
    assert not any("shift" in e.name for e in result.transcript.entries)


def test_hand_written_role_is_rejected(unequal):
    def model(X, y):
        numpyro.sample("beta", dist.Normal(0.0, 1.0), infer={"federation": "server"})
        with numpyro.plate("rows", X.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, 1.0), obs=y)

    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    with pytest.raises(ValueError, match=r"site 'beta' has infer\['federation'\] = 'server'"):
        svi.init(random.PRNGKey(0), unequal)


def test_global_site_that_depends_on_rows_names_the_fix(unequal):
    def model(X, y):
        with numpyro.plate("rows", X.shape[0]):
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Normal(b, 1.0), obs=y)

    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    match = r"site 'b' sits in plate 'rows'.* Mark it local with nf.local_site\(model, sites=\['b'\]\)"
    with pytest.raises(ValueError, match=match):
        svi.init(random.PRNGKey(0), unequal)


def test_ambiguous_row_plate_needs_row_plate(unequal):
    def model(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", X.shape[0]), numpyro.plate("again", X.shape[0], dim=-2):
            pass
        with numpyro.plate("rows", X.shape[0]):
            numpyro.sample("y", dist.Normal(beta, 1.0), obs=y)

    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    with pytest.raises(ValueError, match=r"pass row_plate="):
        svi.init(random.PRNGKey(0), unequal)
    ok = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05), row_plate="rows")
    assert np.isfinite(ok.run(random.PRNGKey(0), unequal, 3, progress_bar=False).losses).all()


def test_no_row_plate_falls_back_to_loop(unequal):
    def model(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(beta, 1.0).expand([y.shape[0]]).to_event(1), obs=y)

    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    svi.run(random.PRNGKey(0), unequal, 3, progress_bar=False)
    assert fitted(svi).plan.mapping == "loop"
    strict = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05), client_mapping="vmap")
    with pytest.raises(ValueError, match="client_mapping='vmap' pads clients"):
        strict.init(random.PRNGKey(0), unequal)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(optim=numpyro.optim.Adam(0.1)), TypeError, "optax GradientTransformation"),
        (dict(method="avg"), ValueError, r"method='avg': choose one of"),
        (dict(num_particles=0), ValueError, "num_particles=0"),
        (dict(local_steps=0), ValueError, "local_steps=0"),
        (dict(client_mapping="gpu"), ValueError, r"client_mapping='gpu': choose one of"),
        (dict(guide=object()), TypeError, "guide must be an nf.StructuredGuide"),
    ],
)
def test_argument_errors(unequal, kwargs, error, match):
    args = dict(model=linear_local, guide=nf.StructuredGuide(linear_local), optim=optax.adam(0.1))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        svi = nf.FederatedSVI(args.pop("model"), args.pop("guide"), args.pop("optim"), **args)
        svi.init(random.PRNGKey(0), unequal)


def test_clients_must_be_clients():
    svi = nf.FederatedSVI(linear_local, nf.StructuredGuide(linear_local), optax.adam(0.1))
    with pytest.raises(TypeError, match="clients must be an nf.Clients"):
        svi.init(random.PRNGKey(0), {"a": {}})


def test_guide_option_errors():
    with pytest.raises(ValueError, match=r"global_scale='dense'"):
        nf.StructuredGuide(global_scale="dense")
    with pytest.raises(ValueError, match="init_scale"):
        nf.StructuredGuide(init_scale=0.0)


def test_params_come_back_constrained(unequal):
    """numpyro.param values are returned as the model sees them (a positive sigma is
    positive), globally and per client."""

    def model(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        sigma = numpyro.param("sigma", 1.0, constraint=dist.constraints.positive)
        with nf.local_site():
            lo = numpyro.param("lo", 0.5, constraint=dist.constraints.interval(0.0, 1.0))
        with numpyro.plate("rows", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta + lo, sigma), obs=y)

    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    result = svi.run(random.PRNGKey(0), unequal, 400, progress_bar=False)
    sigma = float(result.params.theta["sigma"])
    assert sigma > 0 and float(svi.get_params(result.state).theta["sigma"]) == sigma
    # the noise of the data (0.3 around X @ [1, -0.5] in the fixture) is what sigma finds
    assert 0.1 < sigma < 0.8
    raw = float(result.state.server.global_params["theta"]["sigma"])
    assert np.isclose(np.log(sigma), raw, atol=1e-5)  # the server's own state stays unconstrained
    for c in unequal.names:
        assert 0.0 < float(svi.client_params(result, c)["lo"]) < 1.0


def test_deterministic_sites_in_client_draws_and_arviz(unequal):
    def model(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        numpyro.deterministic("ratio", beta[0] / beta[1])
        with numpyro.plate("rows", X.shape[0]):
            mean = numpyro.deterministic("mean", X @ beta)
            numpyro.sample("y", dist.Normal(mean, 0.3), obs=y)

    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    result = svi.run(random.PRNGKey(0), unequal, 200, progress_bar=False)
    draws = svi.sample_posterior(random.PRNGKey(1), result, 100, client="1")
    beta = np.asarray(draws["beta"])
    np.testing.assert_allclose(draws["ratio"], beta[:, 0] / beta[:, 1], rtol=1e-5)
    np.testing.assert_allclose(draws["mean"], beta @ np.asarray(unequal["1"]["X"]).T, rtol=1e-4, atol=1e-5)
    idata = nf.to_arviz(svi, result, random.PRNGKey(1), num_samples=100, client="1")
    assert idata.posterior["mean"].shape == (4, 100, unequal.num_rows["1"]) and "ratio" in idata.posterior


def test_server_draws_carry_the_deterministic_sites_of_the_global_sites(unequal):
    """Without a client, draws of q(z_G) carry the deterministic sites that are functions
    of the global latent and global param sites alone, at the fitted param values; those
    that depend on the rows or on a client's own param are left out."""

    def model(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        sigma = numpyro.param("sigma", 1.0, constraint=dist.constraints.positive)
        with nf.local_site():
            lo = numpyro.param("lo", 0.0)
        numpyro.deterministic("ratio", beta[0] / beta[1])
        numpyro.deterministic("snr", beta[0] / sigma)  # global param: fitted value
        numpyro.deterministic("shifted", beta[0] + lo)  # a client's own param: left out
        with numpyro.plate("rows", X.shape[0]):
            mean = numpyro.deterministic("mean", X @ beta + lo)
            numpyro.sample("y", dist.Normal(mean, sigma), obs=y)

    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.05))
    result = svi.run(random.PRNGKey(0), unequal, 200, progress_bar=False)
    draws = svi.sample_posterior(random.PRNGKey(1), result, 50)
    assert set(draws) == {"beta", "ratio", "snr"}
    beta, sigma = np.asarray(draws["beta"]), float(result.params.theta["sigma"])
    assert abs(sigma - 1.0) > 0.05  # fitted, not the initial value
    np.testing.assert_allclose(draws["ratio"], beta[:, 0] / beta[:, 1], rtol=1e-5)
    np.testing.assert_allclose(draws["snr"], beta[:, 0] / sigma, rtol=1e-5)


def test_fit_check_over_a_network_equals_the_simulations():
    """Over a network backend each client computes its term of the fit check's ``log w``
    on its node (``client_value``, what ``diagnose`` computes for it in simulation): the
    server's sum equals ``diagnose``'s, the traffic is counted, and a client that does not
    answer makes the run warn instead of skipping the check."""
    from numpyro_fed.check import run_check
    from numpyro_fed.run.backends.mapping import client_item

    from .families import sfvi

    inference, clients = sfvi()
    inference.client_mapping = "loop"
    result = inference.run(random.PRNGKey(0), clients, 3, progress_bar=False)
    setup = fitted(inference)
    want = inference.last_fit_check

    class Network:  # stands in for FlowerBackend: each client's value from its own state and data
        def __init__(self, answering):
            self.answering = answering

        def client_values(self, name, payloads, like, transcript=None, rnd=0):
            out = {}
            for j, payload in payloads.items():
                if j in self.answering:
                    slot = client_item(setup.plan, result.state.clients, j)
                    data = client_item(setup.plan, setup.plan.data, j)
                    like_in = inference.client_value_inputs(name, setup, data)
                    assert jax.tree_util.tree_structure(like_in) == jax.tree_util.tree_structure(payload)
                    out[j] = inference.client_value(name, setup, slot.state, data, payload)
            return out

    remote = result._replace(state=result.state._replace(clients=None))
    with checking_over(inference, Network({0, 1, 2})):
        checked = run_check(inference, remote)
    assert checked.verdict.check == "psis" and checked.verdict.figures["pareto_k"] == inference.last_fit_check.pareto_k
    np.testing.assert_allclose(inference.last_fit_check.log_weights, want.log_weights, rtol=1e-5, atol=1e-4)
    assert inference.last_fit_check.pareto_k == pytest.approx(want.pareto_k, abs=1e-3)
    # 3 clients x (1000 float32 values + header) up; global params and two keys down
    assert checked.communication.bytes_up == result.communication.bytes_up + 3 * (4000 + 128)
    assert checked.communication.messages_down == result.communication.messages_down + 3
    with checking_over(inference, Network({0, 2})):
        with pytest.warns(nf.warnings.UnreliableFitWarning, match="some clients did not answer"):
            unanswered = run_check(inference, remote)
    assert inference.last_fit_check is None and unanswered.verdict.status == "unchecked"

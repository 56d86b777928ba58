"""Bad inputs a user would try get a clear error at construction or call (issue 10's list)."""

import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf


def linear(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 2)).astype(np.float32)
    return nf.Clients.split(np.repeat([0, 1, 2], 10), x=x, y=(x @ np.array([1.0, -1.0])).astype(np.float32))


@pytest.mark.parametrize("sizes", [(1, 5), (5, 5), (1, 1)])
def test_unmarked_per_row_site_is_caught_on_any_client(sizes):
    """An unmarked latent site in the plate of the rows is an error whatever the client
    sizes (equal sizes used to share it silently across clients)."""

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            b = numpyro.sample("b", dist.Normal(mu, 1.0))  # per row, not marked local
            numpyro.sample("y", dist.Normal(b, 1.0), obs=y)

    clients = nf.Clients({"a": dict(y=np.zeros(sizes[0])), "b": dict(y=np.zeros(sizes[1]))})
    for inference in (nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.1)), nf.EP(model)):
        with pytest.raises(
            ValueError, match=r"latent site 'b' sits in plate 'rows'.* nf.local_site\(model, sites=\['b'\]\)"
        ):
            inference.init(random.PRNGKey(0), clients)
    # an explicit global_site is the way to say one value really is shared
    marked = nf.global_site(model, sites=["b"])
    if sizes[0] == sizes[1]:
        nf.FederatedSVI(marked, nf.StructuredGuide(marked), optax.adam(0.1)).init(random.PRNGKey(0), clients)


@pytest.mark.parametrize("sizes", [(10, 10, 10), (10, 8, 6)])
def test_row_plate_must_name_a_plate_whatever_the_sizes(sizes):
    x = np.zeros((sum(sizes), 2), np.float32)
    clients = nf.Clients.split(np.repeat([0, 1, 2], sizes), x=x, y=np.zeros(sum(sizes), np.float32))
    svi = nf.FederatedSVI(linear, nf.StructuredGuide(linear), optax.adam(0.1), row_plate="rowz")
    with pytest.raises(ValueError, match=r"row_plate='rowz' is not a plate of the model .* client '0'"):
        svi.init(random.PRNGKey(0), clients)


def test_factor_inference_arguments(clients):
    with pytest.raises(ValueError, match=r"subset_size=4: must be between 1 and the 3 clients"):
        nf.PVI(linear, schedule="subset", subset_size=4).init(random.PRNGKey(0), clients)
    with pytest.raises(ValueError, match="subset_size=0"):
        nf.EP(linear, schedule="subset", subset_size=0)
    with pytest.raises(ValueError, match="local_steps=0"):
        nf.PVI(linear, update="optax", optim=optax.adam(0.1), local_steps=0)
    with pytest.raises(ValueError, match="num_particles=0"):
        nf.PVI(linear, update="optax", optim=optax.adam(0.1), num_particles=0)
    with pytest.raises(ValueError, match="num_particles=0"):
        nf.EP(linear, tilted="vi", optim=optax.adam(0.1), num_particles=0)
    pvi = nf.PVI(linear)
    res = pvi.run(random.PRNGKey(0), clients, 1)
    with pytest.raises(ValueError, match="num_samples=0"):
        pvi.sample_posterior(random.PRNGKey(0), res, 0)
    ep = nf.EP(linear)
    fit = ep.run(random.PRNGKey(0), clients, 1)
    with pytest.raises(ValueError, match="num_samples=0"):
        ep.local_posterior(random.PRNGKey(0), fit, num_samples=0)


def test_svi_sample_posterior_needs_a_positive_count(clients):
    svi = nf.FederatedSVI(linear, nf.StructuredGuide(linear), optax.adam(0.1))
    res = svi.run(random.PRNGKey(0), clients, 2, progress_bar=False)
    with pytest.raises(ValueError, match="num_samples=0"):
        svi.sample_posterior(random.PRNGKey(0), res, 0)


def test_run_options_are_checked(clients):
    svi = nf.FederatedSVI(linear, nf.StructuredGuide(linear), optax.adam(0.1))
    with pytest.raises(ValueError, match="num_rounds=0"):
        svi.run(random.PRNGKey(0), clients, 0)
    with pytest.raises(ValueError, match="on_nonfinite='ignore'"):
        svi.run(random.PRNGKey(0), clients, 2, on_nonfinite="ignore")
    with pytest.raises(ValueError, match=r"availability=1.5: a probability must be in \(0, 1\]"):
        svi.run(random.PRNGKey(0), clients, 2, availability=1.5)
    with pytest.raises(ValueError, match="availability has shape"):
        svi.run(random.PRNGKey(0), clients, 2, availability=np.ones((2, 5), bool))
    with pytest.raises(ValueError, match="schedule covers 2 rounds but the run reaches round 3"):
        svi.run(random.PRNGKey(0), clients, 3, availability=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="checkpoint_every= needs checkpoint="):
        svi.run(random.PRNGKey(0), clients, 2, checkpoint_every=1)


def _vertical_model(xa, xb, y):
    ba = numpyro.sample("ba", dist.Normal(0, 1).expand([1]).to_event(1))
    bb = numpyro.sample("bb", dist.Normal(0, 1).expand([1]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        ga = numpyro.deterministic("ga", xa @ ba)
        gb = numpyro.deterministic("gb", xb @ bb)
        numpyro.sample("y", dist.Normal(ga + gb, 1.0), obs=y)


@pytest.mark.parametrize("arg, party", [("xb", "party 'b'"), ("y", "every party")])
def test_vertical_party_data_are_validated(arg, party):
    spec = {"a": dict(data="xa", sites="ba", contribution="ga"), "b": dict(data="xb", sites="bb", contribution="gb")}
    vmodel = nf.vertical_split(_vertical_model, clients=spec, rho=0.5, response="y")
    data = dict(xa=np.zeros((6, 1)), xb=np.zeros((6, 1)), y=np.zeros(6))
    data[arg] = np.where(np.arange(data[arg].size).reshape(data[arg].shape) == 2, np.nan, data[arg])
    svi = nf.VerticalSVI(vmodel, nf.VerticalGuide("meanfield"), optax.adam(0.1))
    with pytest.raises(ValueError, match=f"argument '{arg}' of {party}.* holds 1 non-finite"):
        svi.init(random.PRNGKey(0), **data)
    data[arg] = np.array(["a"] * 6).reshape(data[arg].shape)
    with pytest.raises(TypeError, match=f"argument '{arg}' of {party}.* has dtype"):
        svi.init(random.PRNGKey(0), **data)


def test_discrete_sites_get_a_clear_error():
    def global_discrete(y):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(k, 1.0), obs=y)

    def local_discrete(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]), nf.local_site():
            z = numpyro.sample("z", dist.Bernoulli(0.5))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu * z, 1.0), obs=y)

    clients = nf.Clients({"a": dict(y=np.zeros(3)), "b": dict(y=np.ones(3))})
    with pytest.raises(ValueError, match=r"global latent site 'k' is discrete .* Marginalise it out"):
        nf.FederatedSVI(global_discrete, nf.StructuredGuide(), optax.adam(0.1)).init(random.PRNGKey(0), clients)
    with pytest.raises(
        ValueError,
        match=r"local latent site 'z' is discrete .* not enumerated.*"
        r"infer=\{'enumerate': 'parallel'\}",
    ):
        nf.FederatedSVI(local_discrete, nf.StructuredGuide(), optax.adam(0.1)).init(random.PRNGKey(0), clients)
    sequential = numpyro.handlers.infer_config(
        local_discrete, lambda site: {"enumerate": "sequential"} if site["name"] == "z" else {}
    )
    with pytest.raises(ValueError, match=r"'z' has infer\['enumerate'\] = 'sequential'; only 'parallel'"):
        nf.FederatedSVI(sequential, nf.StructuredGuide(), optax.adam(0.1)).init(random.PRNGKey(0), clients)


def test_client_names_equal_after_str_are_refused():
    """Issue 26, item 6: ``0`` and ``"0"`` both became client ``"0"`` and the second silently
    replaced the first (a client's rows lost)."""
    with pytest.raises(ValueError, match=r"both named '0'.*int.*str"):
        nf.Clients({0: dict(y=np.zeros(2)), "0": dict(y=np.ones(2))})


def test_one_familys_result_passed_to_another_is_refused_naming_both():
    """Issue 26, item 6: ``FederatedSVI.sample_posterior(pvi_result)`` raised deep inside a tree
    map (or, with matching shapes, would read another family's state as its own); it now
    names both classes. A bare state of another fit is refused by its structure."""
    import warnings

    from tests.families import pvi, sfvi

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        svi, clients = sfvi()
        svi_result = svi.run(random.PRNGKey(0), clients, 3, progress_bar=False)
        factor, clients = pvi()
        pvi_result = factor.run(random.PRNGKey(0), clients, 2, progress_bar=False)
    assert svi_result.fitted_by == "FederatedSVI" and pvi_result.fitted_by == "PVI"
    with pytest.raises(ValueError, match="FederatedSVI was given a result of PVI.run"):
        svi.sample_posterior(random.PRNGKey(1), pvi_result, 5)
    with pytest.raises(ValueError, match="PVI was given a result of FederatedSVI.run"):
        factor.sample_posterior(random.PRNGKey(1), svi_result, 5)
    with pytest.raises(ValueError, match="PVI was given a state whose server part does not match"):
        factor.sample_posterior(random.PRNGKey(1), svi_result.state, 5)
    with pytest.raises(ValueError, match="FederatedSVI was given a result of PVI.run"):
        svi.run(random.PRNGKey(0), clients, 1, init_state=pvi_result, progress_bar=False)
    with pytest.raises(ValueError, match="PVI was given a state whose server part does not match"):
        factor.update(svi_result.state, clients)
    assert svi.sample_posterior(random.PRNGKey(1), svi_result, 5)  # its own result still works
    assert factor.sample_posterior(random.PRNGKey(1), pvi_result.state, 5)

"""Every client's term on exactly its own rows, whatever the model computes outside its plates.

Clients of unequal size are laid side by side by padding them to the largest with a row mask;
a term outside the row plate (a ``numpyro.factor`` summing over a client's rows, ``len(y)``)
is not masked. The references here are independent of the package: the analytic posterior of a
conjugate linear model, and NumPyro's own ``log_density``."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.factor import Laplace
from numpyro_fed.model.groups import sized_model
from numpyro_fed.model.structure import analyse_model
from numpyro_fed.run.backends.mapping import first_term_mismatch, plan_clients

SIGMA, PRIOR = 0.7, 5.0
SIZES = (5, 40, 200)


def half_in_factor(x, y, in_plate):
    """Half the rows through the row plate (masked), the other half through one factor
    outside it: the common way to write a censored likelihood."""
    beta = numpyro.sample("beta", dist.Normal(0.0, PRIOR).expand([2]).to_event(1))
    mu = beta[0] + beta[1] * x
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, SIGMA).mask(in_plate > 0), obs=y)
    numpyro.factor("rest", jnp.sum(jnp.where(in_plate > 0, 0.0, dist.Normal(mu, SIGMA).log_prob(y))))


def counted_by_len(x, y, in_plate):
    """A term that counts the rows (``len(y)``) outside any plate: the Gaussian normaliser
    written out by hand, as a user may."""
    beta = numpyro.sample("beta", dist.Normal(0.0, PRIOR).expand([2]).to_event(1))
    resid = y - beta[0] - beta[1] * x
    numpyro.factor("gauss", -0.5 * jnp.sum(resid**2) / SIGMA**2 - y.shape[0] * jnp.log(SIGMA))


def in_plate_only(x, y, in_plate):
    beta = numpyro.sample("beta", dist.Normal(0.0, PRIOR).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(beta[0] + beta[1] * x, SIGMA), obs=y)


def unequal_clients(seed=1):
    rng = np.random.default_rng(seed)
    n = sum(SIZES)
    x = rng.normal(size=n).astype(np.float32)
    y = (1.0 + 0.5 * x + SIGMA * rng.normal(size=n)).astype(np.float32)
    in_plate = (rng.random(n) < 0.5).astype(np.float32)
    return nf.Clients.split(np.repeat(np.arange(len(SIZES)), SIZES), x=x, y=y, in_plate=in_plate)


def analytic(clients):
    """The posterior of ``beta`` on the pooled rows (all of them observed, one way or the other)."""
    pooled = clients.pooled()
    X = np.stack([np.ones_like(pooled["x"]), pooled["x"]], 1).astype(np.float64)
    precision = X.T @ X / SIGMA**2 + np.eye(2) / PRIOR**2
    cov = np.linalg.inv(precision)
    return cov @ X.T @ pooled["y"].astype(np.float64) / SIGMA**2, np.sqrt(np.diag(cov))


@pytest.mark.parametrize("model", [half_in_factor, counted_by_len], ids=["factor_over_rows", "len_of_rows"])
def test_a_term_outside_the_row_plate_gives_the_pooled_posterior_on_unequal_clients(model):
    clients = unequal_clients()
    mean, sd = analytic(clients)
    fit = nf.fit(model, clients, jax.random.PRNGKey(0), progress_bar=False)
    draws = np.asarray(fit.get_samples()["beta"])
    # a Gaussian posterior: Laplace is exact up to the draws' Monte Carlo error (1000 draws)
    assert np.all(np.abs(draws.mean(0) - mean) <= 4 * sd / np.sqrt(draws.shape[0]) + 1e-3), (draws.mean(0), mean)
    assert np.all(np.abs(draws.std(0) / sd - 1.0) <= 0.08), (draws.std(0), sd)


def test_ep_and_federated_nuts_on_the_factor_model_are_right_too():
    clients = unequal_clients()
    mean, sd = analytic(clients)
    ep = nf.EP(half_in_factor).run(jax.random.PRNGKey(0), clients, 6)
    assert np.all(np.abs(np.asarray(ep.params.mean) - mean) <= 0.05 * sd), (ep.params.mean, mean)
    np.testing.assert_allclose(np.sqrt(np.diag(ep.params.cov)) / sd, 1.0, atol=0.02)
    nuts = nf.FederatedNUTS(half_in_factor, num_warmup=200, num_samples=400)
    result = nuts.run(jax.random.PRNGKey(1), clients)
    draws = np.asarray(nuts.get_samples(result)["beta"])
    assert np.all(np.abs(draws.mean(0) - mean) <= 0.3 * sd), (draws.mean(0), mean)
    assert np.all(np.abs(draws.std(0) / sd - 1.0) <= 0.2), (draws.std(0), sd)


def test_auto_lays_clients_out_one_by_one_where_padding_would_reach_a_term():
    clients = unequal_clients()
    for model, mapping in ((half_in_factor, "loop"), (in_plate_only, "vmap")):
        plan, _ = plan_clients(model, {}, clients, analyse_model(model, clients, {}))
        assert plan.mapping == mapping, model.__name__


def test_vmap_asked_for_raises_naming_the_client_and_the_factor():
    clients = unequal_clients()
    with pytest.raises(ValueError, match=r"client '[01]'.*'rest'.*padded to 200.*client_mapping='loop'"):
        nf.EP(half_in_factor, client_mapping="vmap").run(jax.random.PRNGKey(0), clients, 1)


def test_the_identity_catches_a_padding_that_is_counted():
    """A layout whose row mask counts the padded rows (the mistake the identity is there for)
    is caught, naming the smallest client and the likelihood site."""
    clients = unequal_clients()
    structure = analyse_model(in_plate_only, clients, {})
    plan, structure = plan_clients(in_plate_only, {}, clients, structure)
    assert first_term_mismatch(in_plate_only, {}, clients, plan, structure) is None
    wrong = plan._replace(data=plan.data._replace(row_mask=jnp.ones_like(plan.data.row_mask)))
    bad = first_term_mismatch(in_plate_only, {}, clients, wrong, structure)
    assert bad is not None and bad.client == "0" and bad.sites == ("y",) and bad.what == "value"


def sum_to_zero(ward, y):
    """A soft sum-to-zero constraint over a client's ward effects, outside the ward plate: the
    client's own term, not a sum over its rows."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with nf.group_plate("wards", ward), nf.local_site():
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    numpyro.factor("sum_to_zero", -0.5 * (jnp.sum(a) / 0.01) ** 2)
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + a[ward], 0.5), obs=y)


def reads_padded_groups(ward, y):
    """A sum over rows outside the plates that reads every group effect (the padded ones too)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with nf.group_plate("wards", ward), nf.local_site():
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    numpyro.factor("shrink", -jnp.sum(y**2) * jnp.sum(a**2))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + a[ward], 0.5), obs=y)


def _two_hospitals():
    rng = np.random.default_rng(0)
    hospital = np.repeat([0, 1], [6, 12])
    ward = np.concatenate([np.arange(6) % 2, np.arange(12) % 4])
    return nf.Clients.split(hospital, ward=ward, y=rng.normal(size=18).astype(np.float32))


def test_a_term_over_padded_groups_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"client '0'.*'shrink'.*groups were padded"):
        Laplace(reads_padded_groups).run(jax.random.PRNGKey(0), _two_hospitals(), 2)


def test_a_clients_own_constraint_over_its_effects_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'sum_to_zero' does not depend on the client's rows.*client's own effects"):
        Laplace(sum_to_zero).run(jax.random.PRNGKey(0), _two_hospitals(), 2)


def enumerated_mixture(y):
    mu = numpyro.sample("mu", dist.Normal(jnp.array([-1.0, 1.0]), 1.0).to_event(1))
    with numpyro.plate("rows", y.shape[0]), nf.local_site():
        k = numpyro.sample("k", dist.Categorical(probs=jnp.array([0.4, 0.6])), infer={"enumerate": "parallel"})
        numpyro.sample("y", dist.Normal(mu[k], 0.5), obs=y)


def wards(ward, y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with nf.group_plate("wards", ward), nf.local_site():
        a = numpyro.sample("a", dist.Normal(0.0, s))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a[ward], 0.5), obs=y)


@pytest.mark.parametrize("model", [enumerated_mixture, wards])
def test_padded_models_whose_terms_are_all_in_plates_pass_the_identity(model):
    """No false alarm: padded rows and padded groups inside their plates, and an enumerated
    site, match NumPyro's density on each client's own rows (so they stay vectorised)."""
    rng = np.random.default_rng(0)
    data = {"a": dict(ward=np.array([0, 1, 1]), y=rng.normal(size=3)),
            "b": dict(ward=np.array([0, 0, 1, 2, 2, 3, 3]), y=rng.normal(size=7))}
    if model is enumerated_mixture:
        data = {c: dict(y=v["y"]) for c, v in data.items()}
    clients = nf.Clients(data)
    sized = sized_model(model, clients, {})
    structure = analyse_model(sized, clients, {})
    plan, structure = plan_clients(sized, {}, clients, structure)
    assert plan.mapping == "vmap" and plan.row_plate == "rows"
    assert first_term_mismatch(sized, {}, clients, plan, structure) is None


def standardised(x, y, in_plate):
    """Outcomes standardised by the client's own mean and sd: a different model per client."""
    beta = numpyro.sample("beta", dist.Normal(0.0, PRIOR).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(beta[0] + beta[1] * x, SIGMA), obs=(y - y.mean()) / y.std())


def test_a_term_that_is_not_a_sum_over_rows_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"client '2'.*term 'y' is not a sum over the client's rows.*model_kwargs="):
        nf.EP(standardised).run(jax.random.PRNGKey(0), unequal_clients(), 1)


@pytest.mark.parametrize("model", [half_in_factor, counted_by_len, in_plate_only])
def test_sums_over_rows_pass_the_split_check(model):
    from numpyro_fed.model.term_identity import split_rows_mismatch

    clients = unequal_clients()
    structure = analyse_model(model, clients, {})
    assert split_rows_mismatch(model, {}, structure, clients["2"], "2", jax.random.PRNGKey(0)) is None


def test_group_effects_are_kept_whole_on_each_half():
    from numpyro_fed.model.term_identity import split_rows_mismatch

    rng = np.random.default_rng(0)
    clients = nf.Clients({"a": dict(ward=np.arange(12) % 3, y=rng.normal(size=12))})
    sized = sized_model(wards, clients, {})
    structure = analyse_model(sized, clients, {})
    assert split_rows_mismatch(sized, {}, structure, clients["a"], "a", jax.random.PRNGKey(0)) is None


def soft_constraint(x, y, in_plate):
    """A factor of the global sites alone (no data): every client would add it."""
    beta = numpyro.sample("beta", dist.Normal(0.0, PRIOR).expand([2]).to_event(1))
    numpyro.factor("sum_to_zero", -0.5 * (jnp.sum(beta) / 0.1) ** 2)
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(beta[0] + beta[1] * x, SIGMA), obs=y)


def test_a_term_of_the_global_sites_alone_is_refused_as_counted_once_per_client():
    with pytest.raises(ValueError, match=r"'sum_to_zero' does not depend on the client's rows.*once per client"):
        nf.fit(soft_constraint, unequal_clients(), jax.random.PRNGKey(0), progress_bar=False)


def test_a_layout_unravels_its_sites_in_the_order_it_ravels_them():
    """Sites traced in an order that is not sorted (``theta`` before ``sigma``, as in the HM2
    model): a flat vector laid out and read back gives every site its own entries, and a padded
    client's local entries cut to its rows keep their sites (a dict's pytree order would give
    ``sigma`` the first entry of ``theta``)."""
    from numpyro_fed.model.structure import make_layout
    from numpyro_fed.run.backends.mapping import unpadder

    padded = make_layout([("theta", (6, 3), 0), ("sigma", (), None), ("b", (2,), None)])
    real = make_layout([("theta", (4, 3), 0), ("sigma", (), None), ("b", (2,), None)])
    values = {"theta": jnp.arange(18.0).reshape(6, 3), "sigma": jnp.asarray(-7.0), "b": jnp.asarray([100.0, 200.0])}
    back = padded.unravel(padded.ravel(values))
    for name, v in values.items():
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(v))
    cut = real.unravel(unpadder(padded, real, 4)(padded.ravel(values)))
    np.testing.assert_array_equal(np.asarray(cut["theta"]), np.arange(12.0).reshape(4, 3))
    assert float(cut["sigma"]) == -7.0
    np.testing.assert_array_equal(np.asarray(cut["b"]), [100.0, 200.0])
    with pytest.raises(ValueError, match="cannot be laid out"):
        padded.unravel(jnp.zeros(3))


def test_local_sites_traced_out_of_sorted_order_pass_the_identity():
    """The HM2 regression's local sites are traced ``theta`` then ``sigma``; each client's term
    equals NumPyro's density on its rows (equal and unequal clients)."""
    from numpyro_fed_examples.models import hm2_regression

    rng = np.random.default_rng(3)
    for sizes in [(30, 30), (7, 30)]:
        n = sum(sizes)
        x = rng.normal(size=(n, 2)).astype(np.float32)
        y = (x @ np.array([1.0, -1.0]) + 0.5 * rng.normal(size=n)).astype(np.float32)
        clients = nf.Clients.split(np.repeat(np.arange(len(sizes)), sizes), x=x, y=y)
        structure = analyse_model(hm2_regression, clients, {})
        assert structure.local_latent_names == ("theta", "sigma")
        plan, _ = plan_clients(hm2_regression, {}, clients, structure)
        assert len(plan.names) == len(sizes)

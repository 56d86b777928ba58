"""A group as the protected unit (``dp_noise(unit=...)``): user-level privacy for the hierarchical
models users write, README's first model among them (a ward effect shared by the ward's patients).

- Each group's term (its rows' log-likelihoods and its own local effects' log densities) is
  NumPyro's own ``log_density`` of that group's rows alone, at the same values, less the global
  prior; the groups' terms add up to the client's whole term.
- README's ward model, a ward the unit, at epsilon 4 over ``nf.fit(dp=...)``: the reported epsilon
  is at most 4 and equals dp-accounting's on the releases made; the noise-aware 90 % interval
  of every global scalar covers pooled NUTS's posterior mean; and since 24 wards carry little
  signal against the noise, the fit warns that the noise drove its Newton steps (over more keys,
  benchmarks/dp_unit_utility.py, the interval does not always cover, which that warning says).
- The families that protect rows refuse a group unit, before any release, naming the one that takes it.
"""

import warnings

import dp_accounting
import dp_accounting.pld
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import log_density

import numpyro_fed as nf
from numpyro_fed.dp.dp_laplace import DPLaplace
from numpyro_fed.dp.rows import row_terms, unit_locals
from numpyro_fed.model.groups import sized_model
from numpyro_fed.run.backends.mapping import client_data

from .test_fit import _glmm as model  # README's first model
from .test_fit import _glmm_data as readme_data

DELTA = 1e-5


def _private(epsilon=4.0, clip=20.0):
    return nf.dp_noise(model, clip=clip, delta=DELTA, epsilon=epsilon, unit="wards")


def test_each_groups_term_is_numpyros_log_density_of_that_groups_rows():
    hospital, ward, x, y = readme_data()
    keep = ~((hospital == 1) & (ward == 5))  # hospital 1 has 5 wards: its plate padded to 6
    clients = nf.Clients.split(hospital[keep], ward=ward[keep], x=x[keep], y=y[keep])
    sized = sized_model(_private(), clients, {})
    terms = row_terms("DPLaplace", sized, {}, clients, None, 8, "", "")
    assert terms.unit == ("wards", "ward", 6)
    rng = np.random.default_rng(1)
    beta, log_tau = np.array([0.3, -0.7], np.float32), np.float32(-0.4)
    u = jnp.asarray(np.r_[beta, log_tau], jnp.float32)  # the layout: beta, then tau unconstrained
    index = unit_locals(terms.local, terms.unit)
    for j, name in enumerate(clients.names):
        data = client_data(terms.setup.plan, j)
        own = clients[name]
        groups = int(own["ward"].max()) + 1
        z = rng.normal(size=6).astype(np.float32)
        v = jnp.zeros(index.size, jnp.float32).at[jnp.asarray(index[:, 0])].set(z)
        got = np.asarray(terms.row_term(u, v, data))
        prior = float(dist.Normal(0, 2).log_prob(beta).sum() + dist.HalfNormal(1.0).log_prob(np.exp(log_tau)))
        for g in range(6):
            if g >= groups:  # a padded group adds nothing
                assert got[g] == 0.0
                continue
            rows = own["ward"] == g
            want, _ = log_density(model, (np.zeros(int(rows.sum()), np.int32), own["x"][rows], own["y"][rows]), {},
                                  {"beta": beta, "tau": np.exp(log_tau), "z": z[g:g + 1]})
            np.testing.assert_allclose(got[g], float(want) - prior, rtol=1e-5, atol=1e-4)


def _pld(noise_multiplier, releases):
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), releases))
    return accountant.get_epsilon(DELTA)


def test_readmes_ward_model_with_the_ward_as_the_unit_at_epsilon_4_covers_pooled_nuts(capsys):
    hospital, ward, x, y = readme_data()
    clients = nf.Clients.split(hospital, ward=ward, x=x, y=y)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", nf.warnings.FitWarning)
        fit = nf.fit(_private(), clients, jax.random.PRNGKey(0), dp=nf.dp.PrivateFit(), progress_bar=False)
    # 24 wards of 25 patients: the noise swamps the curvature, and the fit says its interval may not cover
    assert fit.inference.curvature_noise(fit.result) > 0.5
    assert any("noise in the released curvature" in str(w.message) for w in warned)
    report = fit.privacy_report()
    for c in report.clients:
        assert c.epsilon <= 4.0 + 1e-9 and "protected unit: one group of 'wards'" in c.mechanism
        assert c.epsilon == pytest.approx(_pld(c.noise_multiplier, c.compositions), abs=2e-3)
        assert c.compositions == 8
    fit.print_summary()
    assert "private: the privacy noise adds" in capsys.readouterr().out
    pooled = NUTS(model)  # plain NumPyro on the pooled rows: one ward code per (hospital, ward)
    mcmc = MCMC(pooled, num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), hospital * 6 + ward, x, y)
    reference = mcmc.get_samples()
    draws = fit.get_samples()
    for site in ("beta", "tau"):
        lo, hi = np.quantile(np.asarray(draws[site]), [0.05, 0.95], axis=0)
        mean = np.asarray(reference[site]).mean(0)
        assert np.all((lo <= mean) & (mean <= hi)), (site, lo, hi, mean)


@pytest.mark.parametrize("how", ["exact", "pvi"])
def test_a_family_that_protects_rows_refuses_a_group_unit_before_any_release(how):
    hospital, ward, x, y = readme_data()
    clients = nf.Clients.split(hospital, ward=ward, x=x, y=y)
    with pytest.raises(ValueError, match=r"dp_noise\(unit='wards'\) protects groups.*private Laplace fit"):
        if how == "exact":
            nf.fit(_private(), clients, jax.random.PRNGKey(0), dp=nf.dp.PrivateFit(), exact=True, progress_bar=False)
        else:
            nf.PVI(_private(), dp="update_perturbation").run(jax.random.PRNGKey(0), clients, 2, progress_bar=False)


def test_a_unit_that_is_no_group_plate_is_refused_naming_the_plates():
    hospital, ward, x, y = readme_data()
    clients = nf.Clients.split(hospital, ward=ward, x=x, y=y)
    wrong = nf.dp_noise(model, clip=20.0, delta=DELTA, epsilon=4.0, unit="patients")
    with pytest.raises(ValueError, match=r"unit='patients'\): the model has no group_plate of that name \(its group "
                                         r"plates: \['wards'\]\)"):
        DPLaplace(wrong).run(jax.random.PRNGKey(0), clients, progress_bar=False)


def test_a_local_latent_outside_the_units_plate_is_refused_naming_it():
    """A per-row effect under a group unit would make a group's block ragged: refused before any
    release, naming the site and both fixes."""
    hospital, ward, x, y = readme_data()
    clients = nf.Clients.split(hospital, ward=ward, x=x, y=y)

    def with_row_effect(ward, x, y):
        beta = numpyro.sample("beta", dist.Normal(0, 2).expand([2]).to_event(1))
        with nf.group_plate("wards", ward), nf.local_site():
            z = numpyro.sample("z", dist.Normal(0, 1))
        with numpyro.plate("rows", y.shape[0]):
            with nf.local_site():
                e = numpyro.sample("e", dist.Normal(0, 0.5))
            numpyro.sample("y", dist.Bernoulli(logits=beta[0] + beta[1] * x + z[ward] + e), obs=y)

    private = nf.dp_noise(with_row_effect, clip=20.0, delta=DELTA, epsilon=4.0, unit="wards")
    with pytest.raises(ValueError, match=r"local site\(s\) \['e'\] are not in group_plate\('wards'\).*protect rows"):
        DPLaplace(private).run(jax.random.PRNGKey(0), clients, progress_bar=False)

"""The energy diagnostic of Hamiltonian chains (E-BFMI): its estimator against an analytic value and
ArviZ's, federated NUTS's recorded energy against the canonical distribution's, and a funnel that
pooled NumPyro's NUTS also finds hard flagged, naming its scale, where a non-centred one is not."""

from __future__ import annotations

import warnings

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS
from numpyro.infer.reparam import LocScaleReparam

import numpyro_fed as nf
from numpyro_fed.check.chains import chains_verdict
from numpyro_fed.check.energy import E_BFMI_LIMIT, e_bfmi, energy_sites


@pytest.mark.parametrize("rho", [0.2, 0.6, 0.9])
def test_e_bfmi_of_an_autoregressive_energy_is_two_times_one_minus_rho(rho):
    """For a stationary AR(1) energy ``E_t = rho E_{t-1} + noise``, ``E[(E_t - E_{t-1})^2] / Var E =
    2 (1 - rho)``; over 64 chains of 2,000 the estimate is within 0.03 of it. One chain: ArviZ's."""
    rng = np.random.default_rng(int(rho * 10))
    e = np.zeros((64, 2000))
    e[:, 0] = rng.normal(size=64) / np.sqrt(1 - rho**2)
    for t in range(1, e.shape[1]):
        e[:, t] = rho * e[:, t - 1] + rng.normal(size=64)
    assert abs(e_bfmi(e) - 2 * (1 - rho)) < 0.03
    np.testing.assert_allclose(e_bfmi(e[3]), az.bfmi(e[3:4])[0], rtol=1e-10)


def test_the_scalars_named_are_those_the_energy_follows():
    rng = np.random.default_rng(0)
    energy = rng.normal(size=(4, 500))
    draws = {"scale": 0.9 * energy[..., None] + 0.3 * rng.normal(size=(4, 500, 1)),
             "effects": rng.normal(size=(4, 500, 3))}
    named = energy_sites(energy, draws)
    assert len(named) == 1 and named[0].startswith("scale (correlation 0.9")
    verdict = chains_verdict({"max_r_hat": 1.0, "min_n_eff": 900.0, "unmixed": [], "divergences": 0.0,
                              "e_bfmi": 0.12, "energy_sites": named})
    assert verdict.status == "unreliable" and verdict.sites == ("scale",) and "E-BFMI 0.12" in verdict.why


def _funnel(y):
    v = numpyro.sample("v", dist.Normal(0.0, 3.0))
    with numpyro.plate("units", y.shape[0]):
        with nf.local_site():
            x = numpyro.sample("x", dist.Normal(0.0, jnp.exp(v / 2)))
        numpyro.sample("y", dist.Normal(x, 100.0), obs=y)


_NON_CENTRED = numpyro.handlers.reparam(_funnel, config={"x": LocScaleReparam(0)})


def _run(model, seed=1):
    clients = nf.Clients.split(np.arange(10), y=np.zeros(10, np.float32))
    nuts = nf.FederatedNUTS(model, num_warmup=300, num_samples=300, num_chains=4)
    nuts.progress_bar = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = nuts.run(jax.random.PRNGKey(seed), clients)
    return nuts, result, [str(w.message) for w in caught if "E-BFMI" in str(w.message)]


def test_federated_nuts_records_the_energy_of_its_draws():
    """Federated NUTS's recorded energy less its potential energy is the kinetic energy of a draw
    from the canonical distribution (NUTS keeps it invariant): never negative, and its mean over
    the draws is d / 2 (here 11 unconstrained sites: the scale and ten locals) within 4 standard errors."""
    nuts, result, _ = _run(_NON_CENTRED)
    stats = nuts.sample_stats(result)
    kinetic = np.asarray(stats["energy"]) - np.asarray(stats["potential_energy"])
    assert kinetic.min() > 0, kinetic.min()
    se = np.sqrt(11 / 2) / np.sqrt(kinetic.size / 2)  # (draws autocorrelated: half counted)
    assert abs(kinetic.mean() - 11 / 2) < 4 * se, kinetic.mean()


def test_a_funnel_is_reported_by_its_e_bfmi_naming_its_scale_and_a_non_centred_one_is_not():
    """Neal's funnel (a scale ``v`` and ten effects each client holds, data that say nothing): NumPyro's
    NUTS on the pooled model has an E-BFMI under 0.3 (ArviZ's), and so do federated NUTS's chains,
    which warn and name ``v`` (its draws follow the energy); non-centred, neither warns."""
    pooled = MCMC(NUTS(_funnel), num_warmup=300, num_samples=300, num_chains=4, chain_method="sequential",
                  progress_bar=False)
    pooled.run(jax.random.PRNGKey(1), np.zeros(10, np.float32), extra_fields=("energy",))
    assert np.mean(az.bfmi(np.asarray(pooled.get_extra_fields(group_by_chain=True)["energy"]))) < E_BFMI_LIMIT

    nuts, result, messages = _run(_funnel)
    report = nuts.mixing(result)
    assert report["e_bfmi"] < E_BFMI_LIMIT and report["energy_sites"][0].startswith("v (correlation")
    assert len(messages) == 1 and "the energy is carried by v (correlation" in messages[0], messages
    assert result.verdict.status == "unreliable" and "v" in result.verdict.sites

    nuts, result, messages = _run(_NON_CENTRED)
    assert nuts.mixing(result)["e_bfmi"] > E_BFMI_LIMIT and not messages

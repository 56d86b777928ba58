"""Posteriors whose hard part is their geometry, beside the suite's: logistic regressions with 100
and 500 covariates and a client effect, crossed random effects, an enumerated mixture, a
horseshoe logistic regression and the centred eight schools. Real data where it exists (lme4's
Penicillin, R's faithful, scikit-learn's breast cancer, posteriordb's eight schools), clients of
unequal sizes. Their references are this suite's own long NUTS runs on the pooled data
(``reference/<name>.nuts.json``); where NumPyro's NUTS diverges on the pooled data (the centred
eight schools) the reference is the non-centred program's, the same posterior. Used by
``benchmarks/posteriordb_suite.py``."""

from __future__ import annotations

from typing import List

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from pdb_models import Posterior, eight_schools, uneven_groups
from user_models import _rdata, _split, _std

import numpyro_fed as nf

# ---- logistic regressions with many covariates and a client effect ----

def _logistic(covariates: int, rows: int, seed: int):
    """Synthetic rows (standard normal covariates, a sparse-ish truth), 4 clients of unequal sizes; an
    intercept per client ``b0 + tau * a_j`` with ``a_j`` local. The pooled model indexes the client."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, covariates)).astype(np.float32)
    truth = rng.standard_normal(covariates) * (rng.random(covariates) < 0.3) * 0.5
    client = uneven_groups(rows, 4, seed)
    eta = X @ truth - 0.3 + 0.5 * np.array([-1.0, -0.3, 0.4, 0.9])[client]
    y = (rng.random(rows) < 1 / (1 + np.exp(-eta))).astype(np.float32)

    def globals_(k):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([k]).to_event(1))
        b0 = numpyro.sample("b0", dist.Normal(0.0, 2.0))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        return beta, b0, tau

    def model(X, y):
        beta, b0, tau = globals_(X.shape[1])
        with nf.local_site():
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b0 + tau * a), obs=y)

    def pooled(X, y, client):
        beta, b0, tau = globals_(X.shape[1])
        with numpyro.plate("clients", 4):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b0 + tau * a[client]), obs=y)

    sites = {"b0": "b0", "tau": "tau", **{f"beta[{i}]": f"beta[{i}]" for i in range(covariates)}}
    post = _split(f"synthetic-logistic_{covariates}_covariates_client_effect", model, pooled, dict(X=X, y=y), 4,
                  sites, hierarchical=True, groups=client)
    return post._replace(pooled_data=dict(X=X, y=y, client=client.astype(np.int32)))


def logistic_100():
    return _logistic(100, 8000, 100)._replace(nuts_draws=2000)


def logistic_500():
    return _logistic(500, 5000, 500)._replace(nuts_draws=1000)


# ---- crossed random effects ----

def penicillin_crossed():
    """lme4's Penicillin: inhibition diameter of 6 penicillin samples on each of 24 plates (144 rows),
    an effect per plate and one per sample, crossed. Four labs hold 3, 5, 7 and 9 plates; a plate's
    effect is local to its lab (an ``nf.group_plate``), the samples' effects (every lab tests all six)
    are global, each scale a global half-normal."""
    d = _rdata("lme4", "Penicillin")
    plates = np.unique(d["plate"].to_numpy())
    plate = np.searchsorted(plates, d["plate"].to_numpy())
    sample = np.searchsorted(np.unique(d["sample"].to_numpy()), d["sample"].to_numpy()).astype(np.int32)
    lab_of_plate = np.repeat([0, 1, 2, 3], [3, 5, 7, 9])
    lab = lab_of_plate[plate]
    within = np.zeros_like(plate)
    for c in range(4):
        own = np.unique(plate[lab == c])
        within[lab == c] = np.searchsorted(own, plate[lab == c])
    y = ((d["diameter"].to_numpy() - 23.0) / 2.0).astype(np.float32)

    def globals_():
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        sd_plate = numpyro.sample("sd_plate", dist.HalfNormal(2.0))
        sd_sample = numpyro.sample("sd_sample", dist.HalfNormal(2.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        s_raw = numpyro.sample("s_raw", dist.Normal(0.0, 1.0).expand([6]).to_event(1))
        return mu, sd_plate, sd_sample, sigma, s_raw

    def model(y, sample, plate):
        mu, sd_plate, sd_sample, sigma, s_raw = globals_()
        with nf.group_plate("plates", plate), nf.local_site():
            p_raw = numpyro.sample("p_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu + sd_sample * s_raw[sample] + sd_plate * p_raw[plate], sigma), obs=y)

    def pooled(y, sample, plate):
        mu, sd_plate, sd_sample, sigma, s_raw = globals_()
        with numpyro.plate("plates", 24):
            p_raw = numpyro.sample("p_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu + sd_sample * s_raw[sample] + sd_plate * p_raw[plate], sigma), obs=y)

    sites = {"mu": "mu", "sd_plate": "sd_plate", "sd_sample": "sd_sample", "sigma": "sigma",
             **{f"s_raw[{i}]": f"s_raw[{i}]" for i in range(6)}}
    post = _split("Penicillin-crossed_random_effects", model, pooled,
                  dict(y=y, sample=sample, plate=within.astype(np.int32)), 4, sites, hierarchical=True, groups=lab)
    return post._replace(pooled_data=dict(y=y, sample=sample, plate=plate.astype(np.int32)))


# ---- an enumerated mixture ----

def faithful_mixture():
    """R's faithful: eruption durations (272 rows, standardised), a two-component normal mixture
    with the assignments enumerated (each row's component summed out on its client), the means
    ordered (identified), 5 clients of unequal sizes."""
    y = _std(_rdata("datasets", "faithful")["eruptions"].to_numpy())

    def model(y):
        w = numpyro.sample("w", dist.Beta(2.0, 2.0))
        mu = numpyro.sample("mu", dist.TransformedDistribution(
            dist.Normal(0.0, 2.0).expand([2]).to_event(1), dist.transforms.OrderedTransform()))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0).expand([2]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            with nf.local_site():
                z = numpyro.sample("z", dist.Bernoulli(w), infer={"enumerate": "parallel"})
            k = z.astype(jnp.int32)
            numpyro.sample("y", dist.Normal(mu[k], sigma[k]), obs=y)

    sites = {"w": "w", "mu[0]": "mu[0]", "mu[1]": "mu[1]", "sigma[0]": "sigma[0]", "sigma[1]": "sigma[1]"}
    return _split("faithful-enumerated_normal_mixture", model, model, dict(y=y), 5, sites)


# ---- a horseshoe logistic regression ----

def breast_cancer_horseshoe_logistic():
    """scikit-learn's breast cancer data (569 rows, 30 standardised covariates): a logistic
    regression with a (non-centred) horseshoe prior, 4 clients of unequal sizes."""
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = ((X - X.mean(0)) / X.std(0)).astype(np.float32)
    y = y.astype(np.float32)

    def model(X, y):
        k = X.shape[1]
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(0.1))
        lam = numpyro.sample("lambda", dist.HalfCauchy(1.0).expand([k]).to_event(1))
        z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([k]).to_event(1))
        beta = numpyro.deterministic("beta", tau * lam * z)
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=alpha + X @ beta), obs=y)

    sites = {"alpha": "alpha", "tau": "tau", **{f"beta[{i}]": f"beta[{i}]" for i in range(30)}}
    return _split("breast_cancer-horseshoe_logistic", model, model, dict(X=X, y=y), 4, sites)


# ---- the centred eight schools ----

def eight_schools_centred():
    """posteriordb's eight schools in the centred form (``theta_j ~ N(mu, tau)``, local: one school
    per client): the funnel between tau and the thetas is in the model as users write it."""
    base = eight_schools()  # its data, clients and (non-centred, the same posterior) pooled reference model

    def model(y, sigma):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with nf.local_site():
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(theta, sigma), obs=y)

    return base._replace(name="eight_schools-eight_schools_centered", model=model)


def geometry_classes() -> List[Posterior]:
    return [logistic_100(), logistic_500(), penicillin_crossed(), faithful_mixture(),
            breast_cancer_horseshoe_logistic(), eight_schools_centred()]

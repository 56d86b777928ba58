"""Simulation-based calibration of federated Metropolis-within-Gibbs (Talts et al., 2018,
"Validating Bayesian inference algorithms with simulation-based calibration", arXiv:1804.06788).

Run as a script by ``tests/test_mwg.py`` (its own process: it turns JAX's persistent compilation
cache on, so each replicate, the same programs on new data, compiles once):
``python tests/sbc_mwg.py REPLICATES SEED CACHE_DIR [MOVES]`` prints one JSON object, the rank of each
replicate's true ``mu`` and ``sigma`` (and with ``MOVES=surrogate`` of its two coefficients
``beta``) among its thinned draws and the number of draws.

With ``MOVES=surrogate`` the model has two covariates' coefficients too, and the sampler moves them
by the surrogate transition (delayed acceptance) and ``mu`` and ``sigma`` by the scalar sites'
independence move.

Each replicate draws ``mu``, ``sigma`` and every group's effect from the prior and rows from the
model, splits the rows over three clients, and runs ``FederatedMwG`` (started from a federated
Laplace fit, as in ``nf.fit(..., exact=True)``). If the chain's stationary distribution is the
posterior, the rank of the truth among posterior draws is uniform.
"""

import json
import sys
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.mcmc import FederatedMwG

GROUPS, ROWS, CLIENTS, TAU = 4, 3, 3, 0.7
WARMUP, SAMPLES, CHAINS, THIN = 100, 100, 4, 4


def model(g, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 0.3))
    with nf.group_plate("groups", g):
        with nf.local_site():
            th = numpyro.sample("th", dist.Normal(mu, TAU))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(th[g], sigma), obs=y)


def covariate_model(g, x, y):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 0.3))
    with nf.group_plate("groups", g):
        with nf.local_site():
            th = numpyro.sample("th", dist.Normal(mu, TAU))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(th[g] + x @ beta, sigma), obs=y)


def replicate(rng, key, mwg, covariates: bool = False):
    g = np.tile(np.repeat(np.arange(GROUPS), ROWS), CLIENTS)
    client = np.repeat(np.arange(CLIENTS), GROUPS * ROWS)
    mu, sigma = rng.normal(), float(np.exp(0.3 * rng.normal()))
    th = mu + TAU * rng.normal(size=CLIENTS * GROUPS)
    beta = rng.normal(size=2)
    x = rng.normal(size=(g.size, 2)).astype(np.float32)
    y = (th[client * GROUPS + g] + covariates * (x @ beta) + sigma * rng.normal(size=g.size)).astype(np.float32)
    data = dict(g=g, x=x, y=y) if covariates else dict(g=g, y=y)
    with warnings.catch_warnings():  # a short chain's low-ESS warning: the ranks are what is tested
        warnings.simplefilter("ignore")
        result = mwg.run(key, nf.Clients.split(client, **data))
    draws = {k: np.asarray(v) for k, v in mwg.get_samples(result, group_by_chain=True).items()}
    truths = [("mu", draws["mu"], mu), ("sigma", draws["sigma"], sigma)]
    if covariates:
        truths += [(f"beta[{i}]", draws["beta"][..., i], beta[i]) for i in range(2)]
    return {site: int(np.sum(d[:, ::THIN] < truth)) for site, d, truth in truths}


def main(replicates: int, seed: int, cache: str, moves: str = "auto") -> dict:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    rng = np.random.default_rng(seed)
    covariates = moves == "surrogate"
    mwg = FederatedMwG(covariate_model if covariates else model, num_warmup=WARMUP, num_samples=SAMPLES,
                       num_chains=CHAINS, moves=moves)
    mwg.progress_bar = False
    ranks = [replicate(rng, jax.random.PRNGKey(seed * 100_000 + i), mwg, covariates) for i in range(replicates)]
    return {"draws": CHAINS * len(range(0, SAMPLES, THIN)),
            "ranks": {site: [r[site] for r in ranks] for site in ranks[0]}}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:5])))

"""Hassan et al. (2024) §5.2: multilevel Poisson regression with an offset, 2 clients, rho in {1, 2}.

Synthetic design of the paper: N = 2000 areas; each client holds 2 standard-normal
covariates; public population counts pop_i ~ U{250..350} (offset log pop) and a remoteness
level r_i in {0..4} known to every party. Slopes vary by remoteness level,
beta_j^r ~ N(mu_j, sigma_j), mu_j ~ N(0, 1), sigma_j ~ HalfNormal(1), b ~ N(0, 1).

Reference: NUTS on the true model. Compared: mean-field VI on the true model
(centralised, NumPyro AutoNormal), NUTS on the augmented model, and vertical SFVI with the
amortized guide on the augmented model (y shared with the clients and fed to the
network as log(1 + y)); the same without y as an input; and vertical SFVI with the
mean-field guide (one Gaussian per auxiliary variable). Reported: mean / sd of mu_1 (client 1's first covariate) and of
the level-0 slope beta_1^0, next to the true values.

Usage: python benchmarks/vertical_poisson.py [--steps 20000] [--samples 1000] [--out PATH]
"""

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

N, LEVELS, K = 2000, 5, 2


def model(x1, x2, r, log_pop, y=None):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    gs = []
    for j, x in ((1, x1), (2, x2)):
        mu = numpyro.sample(f"mu{j}", dist.Normal(0.0, 1.0).expand([K]).to_event(1))
        sigma = numpyro.sample(f"sigma{j}", dist.HalfNormal(1.0).expand([K]).to_event(1))
        beta = numpyro.sample(f"beta{j}", dist.Normal(mu, sigma).expand([LEVELS, K]).to_event(2))
        with numpyro.plate("areas", x.shape[0]):
            gs.append(numpyro.deterministic(f"g{j}", jnp.sum(x * beta[r], -1)))
    with numpyro.plate("areas", x1.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b + log_pop + gs[0] + gs[1])), obs=y)


SPEC = {"c1": dict(data="x1", sites=["mu1", "sigma1", "beta1"], contribution="g1"),
        "c2": dict(data="x2", sites=["mu2", "sigma2", "beta2"], contribution="g2")}


def simulate(seed=0):
    rng = np.random.default_rng(seed)
    truth = {"b": -1.0, "mu1": np.array([0.3, -0.2]), "mu2": np.array([0.1, 0.25]), "sigma": 0.15}
    beta1 = truth["mu1"] + truth["sigma"] * rng.standard_normal((LEVELS, K))
    beta2 = truth["mu2"] + truth["sigma"] * rng.standard_normal((LEVELS, K))
    x1, x2 = rng.standard_normal((N, K)), rng.standard_normal((N, K))
    r = rng.integers(0, LEVELS, N)
    pop = rng.integers(250, 351, N)
    eta = truth["b"] + np.log(pop) + (x1 * beta1[r]).sum(-1) + (x2 * beta2[r]).sum(-1)
    y = rng.poisson(np.exp(eta))
    data = {"x1": jnp.asarray(x1, jnp.float32), "x2": jnp.asarray(x2, jnp.float32), "r": jnp.asarray(r),
            "log_pop": jnp.asarray(np.log(pop), jnp.float32), "y": jnp.asarray(y, jnp.float32)}
    return data, {"mu1_1": float(truth["mu1"][0]), "beta1_level0_1": float(beta1[0, 0])}


GUIDES = {  # vertical SFVI's guides for the auxiliary variables (see the module docstring)
    "amortized VI (vertical SFVI)": lambda: nf.VerticalGuide(
        nf.AmortizedAux(hidden=(16,), use_response=True, response_transform=jnp.log1p)),
    "amortized VI, no response input": lambda: nf.VerticalGuide(nf.AmortizedAux(hidden=(16,), use_response=False)),
    "mean-field VI (vertical SFVI)": lambda: nf.VerticalGuide("meanfield"),
}


def summary(draws):
    mu = np.asarray(draws["mu1"])[:, 0]
    beta = np.asarray(draws["beta1"])[:, 0, 0]
    return {"mu1_1_mean": float(mu.mean()), "mu1_1_sd": float(mu.std()),
            "beta1_level0_1_mean": float(beta.mean()), "beta1_level0_1_sd": float(beta.std())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--rhos", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "vertical_poisson.json"))
    args = parser.parse_args()
    data, truth = simulate()
    rows = []

    def record(model_name, method, draws, t0, **extra):
        rows.append({"model": model_name, "method": method, "seconds": time.perf_counter() - t0,
                     **summary(draws), **extra})
        print(json.dumps(rows[-1]), flush=True)

    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(model), num_warmup=args.samples, num_samples=args.samples, progress_bar=False)
    mcmc.run(random.PRNGKey(0), **data)
    record("true", "nuts", mcmc.get_samples(), t0, divergences=int(mcmc.get_extra_fields()["diverging"].sum()))
    t0 = time.perf_counter()
    guide = AutoNormal(model)
    res = SVI(model, guide, optax.adam(optax.exponential_decay(0.02, args.steps, 0.05)), Trace_ELBO()).run(
        random.PRNGKey(0), args.steps, progress_bar=False, **data)
    record("true", "mean-field VI (centralised)", guide.sample_posterior(random.PRNGKey(1), res.params,
                                                                         sample_shape=(4000,)), t0)
    for rho in args.rhos:
        vmodel = nf.vertical_split(model, clients=SPEC, rho=rho, response="y", shared=["r", "log_pop"])
        t0 = time.perf_counter()
        mcmc = MCMC(NUTS(vmodel), num_warmup=args.samples, num_samples=args.samples, progress_bar=False)
        mcmc.run(random.PRNGKey(0), **data)
        record(f"augmented rho={rho:g}", "nuts", mcmc.get_samples(), t0,
               divergences=int(mcmc.get_extra_fields()["diverging"].sum()))
        for method, guide in GUIDES.items():
            svi = nf.VerticalSVI(vmodel, guide(), optax.adam(optax.exponential_decay(0.01, args.steps, 0.05)))
            t0 = time.perf_counter()
            res = svi.run(random.PRNGKey(0), num_rounds=args.steps, progress_bar=False, **data)
            record(f"augmented rho={rho:g}", method, svi.sample_posterior(random.PRNGKey(1), res, 4000),
                   t0, elbo=-float(svi.evaluate(res.state, num_particles=200, **data)))
    out = {"benchmark": "vertical_poisson (Hassan et al. (2024) §5.2)", "N": N, "truth": truth, "steps": args.steps,
           "nuts_samples": args.samples, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

"""Rounds and wall time to convergence: PVI, EP and SFVI on the same logistic model.

Bayesian logistic regression, ``w ~ N(0, 2^2 I_4)``, 50 rows per client, J = 10 and 100
clients (500 and 5000 rows), one data set per J. Reference: NUTS on the pooled data (500
warm-up, 2000 draws). A method has converged at the first round after which the global
approximation's means are within 0.2 reference sds of NUTS's and its sds within 15% of
NUTS's (checked every round for PVI and EP, every 10 rounds for SFVI).

- PVI: synchronous, damping 0.5, optax local updates (adam 0.01, 300 steps, 16 draws).
- EP: synchronous, damping 0.5, Laplace tilted moments.
- SFVI: ``FederatedSVI`` with the structured guide (full-covariance global block),
  adam 0.01, 4 draws per ELBO estimate, 10 local steps per round (at adam 0.05 with one
  draw its global means wandered by 0.4-1.1 sds between rounds and never met the criterion).

Each round is one jit-compiled ``update``; the first call's compile time is reported apart
(``compile_s``) and ``seconds`` is the wall time of the rounds up to convergence. Timing is
on this machine; compare ratios, not absolute values.

Usage: python benchmarks/rounds_to_convergence.py [--clients 10 100] [--out PATH]
"""

import argparse
import json
import os
import platform
import time

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

D, ROWS = 4, 50


def model(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([D]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def data(j, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(j * ROWS, D)).astype(np.float32)
    y = (rng.uniform(size=j * ROWS) < 1 / (1 + np.exp(-x @ np.array([1.0, -0.5, 0.25, 0.0])))).astype(np.float32)
    return x, y, nf.Clients.split(np.repeat(np.arange(j), ROWS), x=x, y=y)


def converged(mean, sd, ref_mean, ref_sd):
    return bool(np.max(np.abs(mean - ref_mean) / ref_sd) < 0.2 and np.max(np.abs(sd / ref_sd - 1)) < 0.15)


def follow(step, moments, max_rounds, every, ref):
    """Run ``step`` round by round; return rounds, seconds to convergence and compile time."""
    t0 = time.perf_counter()
    jax.block_until_ready(step())
    compile_s = time.perf_counter() - t0
    seconds, rounds = 0.0, 1
    if converged(*moments(), *ref):
        return {"rounds": rounds, "seconds": 0.0, "compile_s": compile_s, "converged": True}
    while rounds < max_rounds:
        t0 = time.perf_counter()
        for _ in range(every):
            jax.block_until_ready(step())
        seconds += time.perf_counter() - t0
        rounds += every
        if converged(*moments(), *ref):
            return {"rounds": rounds, "seconds": seconds, "compile_s": compile_s, "converged": True}
    return {"rounds": rounds, "seconds": seconds, "compile_s": compile_s, "converged": False}


def run_factor(method, clients, max_rounds, ref):
    box = {"state": method.init(random.PRNGKey(0), clients)}

    def step():
        box["state"], info = method.update(box["state"], clients)
        return box["state"].server.q.shift

    def moments():
        mean, cov = nf.gaussian.to_moments(box["state"].server.q)
        return np.asarray(mean), np.sqrt(np.diag(np.asarray(cov)))

    return follow(step, moments, max_rounds, 1, ref)


def run_sfvi(clients, max_rounds, ref):
    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.01), num_particles=4, local_steps=10)
    box = {"state": svi.init(random.PRNGKey(0), clients)}

    def step():
        box["state"], loss = svi.update(box["state"], clients)
        return loss

    def moments():
        w = np.asarray(svi.sample_posterior(random.PRNGKey(1), box["state"], 4000)["w"])
        return w.mean(0), w.std(0)

    return follow(step, moments, max_rounds, 10, ref)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "rounds_to_convergence.json")
    )
    args = parser.parse_args()
    out = {"design": __doc__.splitlines()[2:5], "machine": platform.platform(), "results": {}}
    for j in args.clients:
        x, y, clients = data(j)
        mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=2000, progress_bar=False)
        mcmc.run(random.PRNGKey(2), x, y)
        w = np.asarray(mcmc.get_samples()["w"])
        ref = (w.mean(0), w.std(0))
        row = {
            "pvi": run_factor(
                nf.PVI(model, update="optax", optim=optax.adam(0.01), local_steps=300, num_particles=16, damping=0.5),
                clients,
                30,
                ref,
            ),
            "ep": run_factor(nf.EP(model, schedule="synchronous", damping=0.5), clients, 30, ref),
            "sfvi": run_sfvi(clients, 1000, ref),
        }
        out["results"][str(j)] = row
        print(j, row, flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

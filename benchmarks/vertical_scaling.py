"""Vertical SFVI step time and step memory against the number of rows n.

Logistic regression with an intercept, 2 clients with 10 covariates each, augmented form
(Hassan et al. (2024) Alg. 1, y at the server), fixed minibatch of rows. For each n in
10^3 ... 10^6 we time one iteration (inside ``lax.scan``) and read XLA's memory analysis
of the compiled iteration: ``temp`` is the working memory one step allocates, and the
step's arguments are split into the row data (which any method must store) and
everything else (parameters and optimiser state).

The amortized guide's parameters do not depend on n, so its step time and step memory
should not either; the mean-field guide (two parameters per row and client) is run
beside it for contrast. The baseline is the same model's amortized step at n = 10^3.

Usage: python benchmarks/vertical_scaling.py [--batch 256] [--steps 200] [--out PATH]
"""

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

P = 10


def model(xa, xb, y):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    ba = numpyro.sample("ba", dist.Normal(0.0, 1.0).expand([xa.shape[1]]).to_event(1))
    bb = numpyro.sample("bb", dist.Normal(0.0, 1.0).expand([xb.shape[1]]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        ga = numpyro.deterministic("ga", xa @ ba)
        gb = numpyro.deterministic("gb", xb @ bb)
        numpyro.sample("y", dist.Bernoulli(logits=b + ga + gb), obs=y)


SPEC = {"a": dict(data="xa", sites="ba", contribution="ga"), "b": dict(data="xb", sites="bb", contribution="gb")}


def make_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 2 * P), dtype=np.float32)
    beta = rng.standard_normal(2 * P).astype(np.float32) / np.sqrt(P)
    y = (rng.random(n) < 1 / (1 + np.exp(-(x @ beta)))).astype(np.float32)
    return dict(xa=jnp.asarray(x[:, :P]), xb=jnp.asarray(x[:, P:]), y=jnp.asarray(y))


def measure(n, aux, batch, steps):
    data = make_data(n)
    vmodel = nf.vertical_split(model, clients=SPEC, rho=1.0, response="y", response_access="server")
    svi = nf.VerticalSVI(vmodel, nf.VerticalGuide(aux), optax.adam(1e-2), batch_size=batch)
    state = svi.init(random.PRNGKey(0), **data)
    setup = svi._setup_cache
    mem = svi._backend.lower_round(setup.algorithm, setup.plan, state).compile().memory_analysis()
    # every party's copy of its own arrays (the plan holds them once per party)
    data_bytes = int(sum(x.nbytes for x in jax.tree_util.tree_leaves((setup.plan.data, setup.plan.server_data))))

    def steps_run():
        return svi.run(random.PRNGKey(0), num_rounds=steps, progress_bar=False, **data).trace

    jax.block_until_ready(steps_run())  # compile
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(steps_run())
        best = min(best, time.perf_counter() - t0)
    return {
        "rows": n,
        "aux": aux,
        "step_seconds": best / steps,
        "step_temp_bytes": int(mem.temp_size_in_bytes),
        "step_argument_bytes_excluding_data": int(mem.argument_size_in_bytes) - data_bytes,
        "data_bytes": data_bytes,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, nargs="+", default=[10**3, 10**4, 10**5, 10**6])
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "vertical_scaling.json")
    )
    args = parser.parse_args()
    results = []
    for aux in ("amortized", "meanfield"):
        for n in args.rows:
            r = measure(n, aux, args.batch, args.steps)
            results.append(r)
            print(json.dumps(r), flush=True)
    base = {
        aux: next(r for r in results if r["aux"] == aux and r["rows"] == min(args.rows))
        for aux in ("amortized", "meanfield")
    }
    for r in results:
        b = base[r["aux"]]
        r["time_ratio_vs_smallest_n"] = r["step_seconds"] / b["step_seconds"]
        r["temp_memory_ratio_vs_smallest_n"] = r["step_temp_bytes"] / max(b["step_temp_bytes"], 1)
    out = {
        "benchmark": "vertical_scaling",
        "model": "logistic regression, intercept at the server, 2 clients x 10 covariates, augmented form, rho=1",
        "batch_size": args.batch,
        "steps_timed": args.steps,
        "results": results,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "device": str(jax.devices()[0]),
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for r in results:
        print(
            f"{r['aux']:>9} n={r['rows']:>8}: {1e3 * r['step_seconds']:.3f} ms/step "
            f"(x{r['time_ratio_vs_smallest_n']:.2f}), temp {r['step_temp_bytes'] / 1e3:.1f} kB "
            f"(x{r['temp_memory_ratio_vs_smallest_n']:.2f}), "
            f"params+opt {r['step_argument_bytes_excluding_data'] / 1e3:.1f} kB"
        )


if __name__ == "__main__":
    main()

"""Sequential PVI and EP: a round's time against the number of clients J.

A sequential round asks one client, so only that client should compute: the round time
should not grow with J (the runtime gathers the asked client under ``vmap``). Bayesian
logistic regression, ``w ~ N(0, 2^2 I_4)``, 50 rows per client, J = 10 and 100.

- PVI: sequential, optax local updates (adam 0.01, 100 steps, 8 draws);
- EP: sequential, integrated-Laplace tilted moments (Newton, at most 100 outer steps).

Each method runs ``--rounds`` rounds through ``run(progress_bar=False)`` (one compiled
loop) after a warm-up run that compiles; the best of 3 is reported per round, with the
ratio J=100 / J=10 (1 means flat). The baseline in the same process is one client's local
fit alone (PVI with J = 1, one round per fit).

Usage: python benchmarks/sequential_round_time.py [--clients 10 100] [--rounds 40] [--out PATH]
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

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

D, ROWS = 4, 50


def model(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([D]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def clients_for(j, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(j * ROWS, D)).astype(np.float32)
    p = 1 / (1 + np.exp(-x @ np.array([1.0, -0.5, 0.25, 0.0])))
    y = (rng.uniform(size=j * ROWS) < p).astype(np.float32)
    return nf.Clients.split(np.repeat(np.arange(j), ROWS), x=x, y=y)


def methods():
    return {
        "pvi": lambda: nf.PVI(model, update="optax", optim=optax.adam(0.01), local_steps=100, num_particles=8,
                              schedule="sequential"),
        "ep": lambda: nf.EP(model, schedule="sequential", laplace_steps=100),
    }


def round_seconds(make, clients, rounds, repeats=3):
    method = make()
    jax.block_until_ready(method.run(random.PRNGKey(0), clients, rounds).mean)  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(method.run(random.PRNGKey(0), clients, rounds).mean)
        best = min(best, time.perf_counter() - t0)
    return best / rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sequential_round_time.json"))
    args = ap.parse_args()
    one = clients_for(1)
    results = []
    for name, make in methods().items():
        base = round_seconds(make, one, args.rounds)
        times = {}
        for j in args.clients:
            times[j] = round_seconds(make, clients_for(j), args.rounds)
            print(f"{name:>4} J={j:4d}: round {times[j] * 1e3:8.3f} ms ({times[j] / base:5.2f} x one client alone)")
        first, last = args.clients[0], args.clients[-1]
        results.append(dict(method=name, one_client_round_seconds=base,
                            round_seconds={str(j): t for j, t in times.items()},
                            ratio_to_one_client={str(j): t / base for j, t in times.items()},
                            growth=times[last] / times[first]))
        print(f"{name:>4}: J={last} / J={first} round time = {times[last] / times[first]:.2f}")
    out = dict(benchmark="sequential_round_time", rows_per_client=ROWS, rounds_timed=args.rounds,
               baseline="the same method with one client (its local fit alone), same process",
               results=results,
               machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
                            numpyro=numpyro.__version__))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

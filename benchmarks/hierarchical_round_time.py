"""PVI and EP round time on hierarchical posteriors at J = 10 and 100 clients.

Two hierarchical models of ``benchmarks/ep_vs_nuts.py``, each split into J clients:

- the demo's six-cities logistic GLMM (537 children, a random intercept per child: local),
  children (rows) dealt to J silos at random;
- HM2 of Yue et al. (2022) (one device per client: ``theta_k`` and its noise scale local; 100 rows per
  device), J = K devices (``benchmarks/hm2_ep.py``'s simulation, seed 0).

Each method runs with its defaults (``EP()``: integrated Laplace with the importance step and
block quadrature, sequential, one client per round; ``PVI()``: Gaussian VI local fits with
optax, synchronous, every client per round), ``check_fit=False`` (the fit check is a per-run
cost, not a round's). A round's time is the best of ``--repeats`` warm calls of
``run(progress_bar=False)`` (one compiled loop) over ``--rounds`` rounds, divided by the rounds.
Baseline, same process: the same method with the pooled data as one client (its local fit is
the whole fit). For EP a round asks one client, so it should shrink as J grows; for PVI every
client computes, vectorised, so it should stay near the pooled fit's.

Usage: python benchmarks/hierarchical_round_time.py [--clients 10 100] [--rounds 4] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
import warnings

import jax
import numpy as np
import numpyro
from jax import random

import numpyro_fed as nf
from numpyro_fed_examples.datasets import load_six_cities
from numpyro_fed_examples.models import hm2_regression, logistic_glmm

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from hm2_ep import simulate as hm2_simulate  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

OUT = HERE / "results" / "hierarchical_round_time.json"


def six_cities(num_clients):
    data = load_six_cities()  # a row is a child (four visits)
    silo = np.random.default_rng(0).integers(0, num_clients, size=len(data["smoke"]))
    silo[:num_clients] = np.arange(num_clients)  # every silo holds at least one child
    return logistic_glmm, nf.Clients.split(silo, **data)


def hm2(num_clients):
    x, y = hm2_simulate(0, k=num_clients)
    k, n, d = x.shape
    return hm2_regression, nf.Clients.split(np.repeat(np.arange(k), n), x=x.reshape(-1, d), y=y.reshape(-1))


def pooled(make, num_clients):
    """The same data as one client (for HM2: the J devices' rows under one device's model would
    be another model, so HM2's baseline is one device alone)."""
    model, clients = make(num_clients)
    if make is hm2:
        return hm2(1)
    everything = {
        k: np.concatenate([np.asarray(clients[n][k]) for n in clients.names]) for k in clients[clients.names[0]]
    }
    return model, nf.Clients.split(np.zeros(len(next(iter(everything.values()))), int), **everything)


CASES = {"six_cities_glmm": six_cities, "hm2": hm2}
METHODS = {"ep": lambda model: nf.EP(model, check_fit=False), "pvi": lambda model: nf.PVI(model, check_fit=False)}


def round_seconds(make_method, model, clients, rounds, repeats):
    """Best warm time per round; the short runs' fit warnings (unconverged after a few rounds)
    are timing runs' business only and are not shown."""
    method = make_method(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax.block_until_ready(method.run(random.PRNGKey(0), clients, rounds, progress_bar=False).mean)  # compile
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(method.run(random.PRNGKey(0), clients, rounds, progress_bar=False).mean)
            best = min(best, time.perf_counter() - t0)
    return best / rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    rows = []
    for case in args.only:
        make = CASES[case]
        for name in args.methods:
            model, one = pooled(make, max(args.clients))
            base = round_seconds(METHODS[name], model, one, args.rounds, args.repeats)
            row = dict(case=case, method=name, pooled_round_seconds=base, round_seconds={}, ratio_to_pooled={})
            for j in args.clients:
                model, clients = make(j)
                t = round_seconds(METHODS[name], model, clients, args.rounds, args.repeats)
                row["round_seconds"][str(j)] = t
                row["ratio_to_pooled"][str(j)] = t / base
                print(
                    f"{case} {name:>3} J={j:4d}: round {t * 1e3:9.1f} ms ({t / base:5.2f} x the pooled fit's "
                    f"{base * 1e3:.1f} ms)",
                    flush=True,
                )
            rows.append(row)
            out = dict(
                benchmark="hierarchical_round_time",
                command=" ".join(sys.argv),
                rounds_timed=args.rounds,
                baseline="the same method on the pooled data as one client (HM2: one device), same process",
                results=rows,
                machine=dict(
                    platform=platform.platform(),
                    cpus=os.cpu_count(),
                    jax=jax.__version__,
                    numpyro=numpyro.__version__,
                    xla_flags=os.environ.get("XLA_FLAGS", ""),
                ),
            )
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

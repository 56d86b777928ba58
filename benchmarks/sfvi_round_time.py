"""SFVI round time / centralised NumPyro SVI step time on the same model and pooled data.

Hierarchical logistic regression with a random intercept per row (local) and 5 fixed
effects plus a scale (global); N rows split evenly over J clients. Centralised baseline:
``numpyro.infer.SVI`` with ``AutoNormal`` on the pooled data, stepped inside one
``lax.scan`` (as ``FederatedSVI.run(progress_bar=False)`` is). Federated: ``FederatedSVI``
with ``MeanFieldGuide`` (the same family as AutoNormal) and with the structured guide.

XLA's CPU flags change the figures (``XLA_FLAGS`` is recorded in the JSON): with jaxlib 0.10
the YNNPACK reduce fusion is slow on the clients' per-row sums at J = 1000 (see
docs/benchmarks.md); ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-reduce`` turns it off.

Usage: python benchmarks/sfvi_round_time.py [--rows 10000] [--rounds 300] [--clients 10 100 1000] [--out PATH]
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
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes


def model(X, y):
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("rows", X.shape[0]):
        with nf.local_site():
            b = numpyro.sample("b", dist.Normal(0.0, tau))
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b), obs=y)


def time_it(fn, repeats=3):
    fn()  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def centralised_step_time(X, y, rounds):
    svi = SVI(model, AutoNormal(model), optax.adam(0.01), Trace_ELBO())
    state = svi.init(random.PRNGKey(0), X, y)

    @jax.jit
    def many(s):
        return jax.lax.scan(lambda s, _: svi.update(s, X, y), s, None, length=rounds)

    return time_it(lambda: many(state)[1]) / rounds


def federated_round_time(clients, guide, rounds):
    """``FederatedSVI.run`` without a progress bar (its compiled loop), per round: what a user
    gets, guards and byte counting included; the fit check after the run is a per-run cost,
    not a round's, and is left out (``check_fit=False``)."""
    svi = nf.FederatedSVI(model, guide, optax.adam(0.01), check_fit=False)
    return time_it(lambda: svi.run(random.PRNGKey(0), clients, rounds, progress_bar=False).trace) / rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sfvi_round_time.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    X = rng.normal(size=(args.rows, 5)).astype(np.float32)
    y = (rng.random(args.rows) < 1 / (1 + np.exp(-(X @ rng.normal(size=5))))).astype(np.float32)
    base = centralised_step_time(jnp.asarray(X), jnp.asarray(y), args.rounds)
    rows = []
    for J in args.clients:
        clients = nf.Clients.split(np.arange(args.rows) % J, X=X, y=y)
        for name, guide in (("meanfield", nf.MeanFieldGuide(model)), ("structured", nf.StructuredGuide(model))):
            t = federated_round_time(clients, guide, args.rounds)
            rows.append(dict(clients=J, guide=name, round_seconds=t, ratio=t / base))
            print(f"J={J:5d} {name:>10}: round {t * 1e3:8.3f} ms, ratio to centralised step {t / base:6.2f}")
    out = dict(
        benchmark="sfvi_round_time",
        rows_total=args.rows,
        rounds_timed=args.rounds,
        centralised_step_seconds=base,
        baseline="numpyro.infer.SVI + AutoNormal on pooled data, lax.scan",
        results=rows,
        machine=dict(
            platform=platform.platform(),
            cpus=os.cpu_count(),
            jax=jax.__version__,
            numpyro=numpyro.__version__,
            xla_flags=os.environ.get("XLA_FLAGS", ""),
        ),
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"centralised step {base * 1e3:.3f} ms; wrote {args.out}")


if __name__ == "__main__":
    main()

"""Where an SFVI round's time goes at many clients.

Same model and data as ``sfvi_round_time.py``. Four timings per round, same process:

- ``centralised``: NumPyro SVI + AutoNormal on the pooled data (the baseline);
- ``runtime``: ``FederatedSVI.run(progress_bar=False, check_fit=False)`` with ``MeanFieldGuide``;
- ``bare_scan``: the same algorithm's client and server steps in a bare ``lax.scan`` (no guards,
  byte counts, masks or result), each client splitting its own key every round;
- ``bare_fixed_keys``: the bare scan with every client's key held fixed (no per-round split).

runtime / bare_scan is the runtime's own overhead; bare_scan / bare_fixed_keys the clients'
key handling; bare_fixed_keys / centralised the clients' own arithmetic vectorised over J
clients of N / J rows. Uses private attributes of ``FederatedSVI`` (a profiling script).

Usage: python benchmarks/sfvi_round_ablation.py [--clients 1000] [--rounds 300] [--out PATH]
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

sys.path.insert(0, os.path.dirname(__file__))
from sfvi_round_time import centralised_step_time, model, time_it  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.run.protocol import Broadcast, ServerView  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes


def bare_loop(ex, plan, num_clients, rounds, split_keys):
    """A jit-compiled ``lax.scan`` of ``rounds`` rounds of the exchange ``ex``: every client's step
    under vmap, then the server's."""
    client = jax.vmap(ex.client_step, in_axes=(0, 0, Broadcast(None, None), 0))
    everyone = ServerView(jnp.ones(num_clients, bool), None)

    @jax.jit
    def loop(server, bc, cstates, keys):
        def body(carry, _):
            server, bc, cstates, keys = carry
            if split_keys:
                pairs = jax.vmap(random.split)(keys)
                keys, step_keys = pairs[:, 0], pairs[:, 1]
            else:
                step_keys = keys
            new, msgs = client(step_keys, cstates, bc, plan.data)
            server, bc, info = ex.server_step(random.PRNGKey(0), server, msgs, everyone)
            return (server, bc, new, keys), info.elbo

        return jax.lax.scan(body, (server, bc, cstates, keys), None, length=rounds)[1]

    return loop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sfvi_round_ablation.json"))
    args = ap.parse_args()
    n, J, R = args.rows, args.clients, args.rounds
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 5)).astype(np.float32)
    y = (rng.random(n) < 1 / (1 + np.exp(-(X @ rng.normal(size=5))))).astype(np.float32)
    base = centralised_step_time(jnp.asarray(X), jnp.asarray(y), R)
    clients = nf.Clients.split(np.arange(n) % J, X=X, y=y)
    svi = nf.FederatedSVI(model, nf.MeanFieldGuide(model), optax.adam(0.01), check_fit=False)
    runtime = time_it(lambda: svi.run(random.PRNGKey(0), clients, R, progress_bar=False).trace) / R
    setup = svi._setup_cache
    alg, plan = setup.algorithm, setup.plan
    ex = alg.exchanges[0]
    server, bc = alg.init_server(random.PRNGKey(1))
    keys = random.split(random.PRNGKey(2), J)
    cstates = jax.vmap(alg.init_client)(keys, plan.data)
    times = dict(centralised=base, runtime=runtime)
    for name, split in (("bare_scan", True), ("bare_fixed_keys", False)):
        loop = bare_loop(ex, plan, J, R, split)
        times[name] = time_it(lambda: loop(server, bc, cstates, keys)) / R
    for name, t in times.items():
        print(f"J={J} {name:>16}: {t * 1e3:7.3f} ms per round/step ({t / base:5.2f} x centralised)")
    out = dict(benchmark="sfvi_round_ablation", clients=J, rows_total=n, rounds_timed=R,
               seconds_per_round=times, ratio_to_centralised={k: v / base for k, v in times.items()},
               machine=dict(cpus=os.cpu_count(), jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", "")))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

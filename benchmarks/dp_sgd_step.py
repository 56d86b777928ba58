"""DP-SGD local step against the non-private step at the same batch size.

PVI's local optimisation (``nf.PVI(update="optax")``) on Bayesian logistic regression,
``d = 8`` (intercept and the 7 standardised covariates of the k401ksubs stand-in, 7,420
training rows on one client), 4 Monte Carlo draws, Adam:

- baseline: a non-private step on a fixed-size random subset of ``--batch`` rows (the
  minibatch ELBO's gradient by one ``value_and_grad``, scaled to the client's rows);
- DP-SGD: the library's step (``numpyro_fed.factor.pvi_algorithm._local_dp_sgd``):
  per-example gradients by ``vmap``, clipping over the pytree, noise from the client's key
  (optax's ``differentially_private_aggregate``), KL gradient added after it.

Both run ``--steps`` steps in one compiled ``lax.scan`` (the way a client runs them); each
is timed after a warm-up call that compiles, best of ``--repeats``. Reported: seconds per
step and the ratio DP / non-private (target <= 2.0). Written as JSON.

Usage: python benchmarks/dp_sgd_step.py [--batch 256] [--steps 500] [--out PATH]
"""

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax import random

import numpyro_fed as nf
from numpyro_fed.dp.mechanisms import DPSGD, fixed_size_subset
from numpyro_fed.factor.pvi_algorithm import _draws, _gaussian_params, _local_dp_sgd, _optimise
from numpyro_fed.run.backends.mapping import pad_client
from numpyro_fed.run.inference import fitted
from numpyro_fed.terms import gaussian as G

sys.path.insert(0, os.path.dirname(__file__))
from dp_adult import data, model  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dp_sgd_step.json"))
    args = parser.parse_args()

    clients, _, _ = data(0, 1, "balanced")
    pvi = nf.PVI(model, update="optax", optim=optax.adam(0.05), family="diagonal")
    pvi.init(random.PRNGKey(0), clients)
    terms = fitted(pvi).extra.terms
    client = clients[clients.names[0]]
    cd = pad_client(client, len(client["y"]))
    prior = terms.prior
    d = prior.shift.shape[0]
    optim = optax.adam(0.05)
    particles, b, n = 4, args.batch, cd.num_rows

    @jax.jit
    def plain(key):
        init, moments = _gaussian_params(prior)

        def gradient(params, k):
            eps = random.normal(k, (particles, d))
            rows = jax.tree_util.tree_map(lambda x: x[fixed_size_subset(random.fold_in(k, 1), cd.row_mask, b)], cd.args)
            batch = cd._replace(args=rows, row_mask=jnp.ones(b), num_rows=jnp.asarray(b, jnp.float32))

            def neg(params):
                loc, cov, _ = moments(params)
                draws = _draws(moments, params, eps)
                ll = jnp.mean(jax.vmap(lambda u: terms.log_lik(u, batch))(draws))
                return -(n / b * ll - G.kl_divergence(G.from_moments(loc, cov), prior))

            return jax.value_and_grad(neg)(params)

        return _optimise(init, moments, optim, args.steps, key, gradient)[0]

    @jax.jit
    def private(key):
        return _local_dp_sgd(terms.log_lik, cd, prior, prior, optim, args.steps, particles, key,
                             DPSGD(1.0, 1.0, b))[0]

    def best(fn):
        jax.block_until_ready(fn(random.PRNGKey(0)))  # compile
        times = []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(random.PRNGKey(r + 1)))
            times.append(time.perf_counter() - t0)
        return min(times) / args.steps

    t_plain, t_dp = best(plain), best(private)
    out = {"benchmark": "dp_sgd_step", "batch": b, "steps": args.steps, "rows": int(n), "dim": int(d),
           "particles": particles, "plain_step_s": t_plain, "dp_sgd_step_s": t_dp, "ratio": t_dp / t_plain,
           "target_ratio": 2.0, "platform": platform.platform(), "jax": jax.__version__,
           "cpu_count": os.cpu_count(), "device": str(jax.devices()[0])}
    print(json.dumps(out, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Hassan et al. (2024) §5.1 on its synthetic design: true / augmented / power x NUTS / mean-field / amortized.

Logistic regression, n = 500 rows, p = 20 standard-normal covariates, a standard-normal
noise term added to the linear predictor when simulating y. J = 2 clients with 10
covariates each and J = 10 clients with 2 each; rho in {0.5, 1, 2}. The intercept b is the
server's (y is shared). For every cell we record the final ELBO (VI) and the posterior
means / sds of theta = (b, beta) against NUTS on the true model.

Usage: python benchmarks/vertical_logistic.py [--steps 6000] [--samples 1000] [--out PATH]
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
from numpyro.infer.autoguide import AutoMultivariateNormal

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

N, P = 500, 20


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, P)).astype(np.float32)
    beta = rng.standard_normal(P).astype(np.float32)
    b = np.float32(rng.standard_normal())
    eta = b + x @ beta + rng.standard_normal(N)
    y = (rng.random(N) < 1 / (1 + np.exp(-eta))).astype(np.float32)
    return x, y, b, beta


def split_model(J):
    """The true model with client j's covariates in ``x{j}`` and its contribution ``g{j}``."""

    def model(y, **xs):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        gs = []
        betas = [numpyro.sample(f"beta{j}", dist.Normal(0.0, 1.0).expand([xs[f"x{j}"].shape[1]]).to_event(1))
                 for j in range(J)]
        with numpyro.plate("rows", y.shape[0]):
            for j in range(J):
                gs.append(numpyro.deterministic(f"g{j}", xs[f"x{j}"] @ betas[j]))
            numpyro.sample("y", dist.Bernoulli(logits=b + sum(gs)), obs=y)

    spec = {f"c{j}": dict(data=f"x{j}", sites=f"beta{j}", contribution=f"g{j}") for j in range(J)}
    return model, spec


def theta_of(draws, J):
    return np.concatenate([np.asarray(draws["b"])[:, None]] + [np.asarray(draws[f"beta{j}"]) for j in range(J)], 1)


def nuts(model, data, samples, seed=0):
    mcmc = MCMC(NUTS(model, dense_mass=False), num_warmup=samples, num_samples=samples, progress_bar=False)
    mcmc.run(random.PRNGKey(seed), **data)
    return mcmc.get_samples()


def summarise(theta, ref_mean, ref_sd):
    mean, sd = theta.mean(0), theta.std(0)
    return {
        "beta1_mean": float(mean[1]), "beta1_sd": float(sd[1]),
        "rmse_of_means_vs_true_nuts_in_sds": float(np.sqrt(np.mean(((mean - ref_mean) / ref_sd) ** 2))),
        "mean_sd_ratio_vs_true_nuts": float(np.mean(sd / ref_sd)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 10])
    parser.add_argument("--rhos", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "vertical_logistic.json"))
    args = parser.parse_args()
    x, y, b_true, beta_true = make_data()
    rows = []
    lr = optax.exponential_decay(0.02, args.steps, 0.05)
    for J in args.clients:
        model, spec = split_model(J)
        cols = np.array_split(np.arange(P), J)
        data = {"y": jnp.asarray(y), **{f"x{j}": jnp.asarray(x[:, c]) for j, c in enumerate(cols)}}
        t0 = time.perf_counter()
        ref = theta_of(nuts(model, data, args.samples), J)
        ref_mean, ref_sd = ref.mean(0), ref.std(0)
        rows.append({"J": J, "rho": None, "model": "true", "method": "nuts", "elbo": None,
                     "seconds": time.perf_counter() - t0, **summarise(ref, ref_mean, ref_sd)})
        print(json.dumps(rows[-1]), flush=True)
        guide = AutoMultivariateNormal(model)
        svi = SVI(model, guide, optax.adam(lr), Trace_ELBO())
        t0 = time.perf_counter()
        res = svi.run(random.PRNGKey(0), args.steps, progress_bar=False, **data)
        elbo = -float(Trace_ELBO(num_particles=500).loss(random.PRNGKey(2), res.params, model, guide, **data))
        draws = guide.sample_posterior(random.PRNGKey(1), res.params, sample_shape=(4000,))
        rows.append({"J": J, "rho": None, "model": "true", "method": "full-rank VI (centralised)", "elbo": elbo,
                     "seconds": time.perf_counter() - t0, **summarise(theta_of(draws, J), ref_mean, ref_sd)})
        print(json.dumps(rows[-1]), flush=True)
        for rho in args.rhos:
            for form in ("augmented", "power"):
                vmodel = nf.vertical_split(model, clients=spec, form=form, rho=rho, response="y")
                t0 = time.perf_counter()
                draws = nuts(vmodel, data, args.samples)
                rows.append({"J": J, "rho": rho, "model": form, "method": "nuts", "elbo": None,
                             "seconds": time.perf_counter() - t0, **summarise(theta_of(draws, J), ref_mean, ref_sd)})
                print(json.dumps(rows[-1]), flush=True)
                for aux in ("meanfield", "amortized"):
                    vsvi = nf.VerticalSVI(vmodel, nf.VerticalGuide(aux), optax.adam(lr))
                    t0 = time.perf_counter()
                    res = vsvi.run(random.PRNGKey(0), num_rounds=args.steps, progress_bar=False, **data)
                    elbo = -float(vsvi.evaluate(res.state, num_particles=500, **data))
                    draws = vsvi.sample_posterior(random.PRNGKey(1), res, 4000)
                    rows.append({"J": J, "rho": rho, "model": form, "method": f"{aux} VI (vertical SFVI)",
                                 "elbo": elbo, "seconds": time.perf_counter() - t0,
                                 **summarise(theta_of(draws, J), ref_mean, ref_sd)})
                    print(json.dumps(rows[-1]), flush=True)
    out = {"benchmark": "vertical_logistic (Hassan et al. (2024) §5.1)", "n": N, "p": P, "steps": args.steps,
           "nuts_samples": args.samples, "true_b": float(b_true), "true_beta1": float(beta_true[0]), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

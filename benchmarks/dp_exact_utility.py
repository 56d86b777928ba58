"""The exact private fit (``nf.fit(dp=..., exact=True)``) on a model without local latents, where
the DP sampler releases its rows' log-likelihood ratios less the private start's released
second-order expansion (``numpyro_fed.dp.control``).

Posterior: a Bayesian logistic regression (an intercept and 4 slopes, ``N(0, 5^2)`` priors), rows
with standard normal covariates and slopes (1, -0.5, 0.25, 0), intercept -0.5, split evenly over
four clients, at 20,000 and 100,000 rows; the reference is NumPyro's NUTS on the pooled rows (2
chains of 500 warmup and 1,000 draws). ``dp_noise(clip=6, delta=1e-5, epsilon)`` for epsilon in
{1, 4} (the start's clip: above every row's (gradient, Hessian) norm here; the sampler's clip the
default, ``sqrt(2 / J) / (sigma / C)``), ``PrivateFit()`` otherwise (a quarter of epsilon to 8
Newton rounds, 2 chains of 300 warmup and 1,000 draws), over ``KEYS`` keys each.

Reported per run: which stage answered and its verdict, the residuals clipped in kept iterations,
the largest ``|z|`` of a global's mean against NUTS's (in the answer's sds, which carry the
start's noise, and in NUTS's sds), the answer's sd over NUTS's, whether each global's 90 %
interval covers NUTS's mean, the acceptance, the reported epsilon, and the seconds against pooled
NUTS's in the same process.

    python benchmarks/dp_exact_utility.py

Writes ``benchmarks/results/dp_exact_utility.json``.
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys
import time
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from provenance import provenance  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "dp_exact_utility.json"
SIZES = (20_000, 100_000)
EPSILONS = (1.0, 4.0)
KEYS = 4
CLIP, DELTA = 6.0, 1e-5


def logistic(x, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 5.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + x @ w), obs=y)


def rows(n: int):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    p = 1 / (1 + np.exp(-(x @ np.array([1.0, -0.5, 0.25, 0.0]) - 0.5)))
    return x, (rng.uniform(size=n) < p).astype(np.float32)


def flat(draws: dict) -> np.ndarray:
    return np.c_[np.asarray(draws["b0"]), np.asarray(draws["w"])]


def reference(x, y):
    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(logistic), num_warmup=500, num_samples=1000, num_chains=2, chain_method="sequential",
                progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), x, y)
    return flat(mcmc.get_samples()), time.perf_counter() - t0


def run(n: int, epsilon: float, key: int, x, y, ref: np.ndarray) -> dict:
    clients = nf.Clients.split(np.arange(n) % 4, x=x, y=y)
    model = nf.dp_noise(logistic, clip=CLIP, delta=DELTA, epsilon=epsilon)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = nf.fit(model, clients, dp=nf.dp.PrivateFit(), exact=True, rng_key=jax.random.PRNGKey(key),
                     progress_bar=False)
    seconds = time.perf_counter() - t0
    sampled = fit.results[-1]  # the sampler's run (the start's is fit.results[0])
    got = flat(fit.inference.get_samples(fit.result)) if fit.method == "dp_metropolis" else \
        flat(fit.inference.sample_posterior(jax.random.PRNGKey(99), fit.result, 2000))
    lo, hi = np.quantile(got, 0.05, 0), np.quantile(got, 0.95, 0)
    mean, sd = ref.mean(0), ref.std(0)
    clipped = sum(int(sampled.client_states[c].inner.clipped) for c in clients.names)
    return {"rows": n, "epsilon": epsilon, "key": key, "answered": fit.method, "verdict": sampled.verdict.status,
            "clipped_residuals": clipped,
            "max_abs_z_own_sd": float(np.max(np.abs(got.mean(0) - mean) / got.std(0))),
            "max_abs_z_reference_sd": float(np.max(np.abs(got.mean(0) - mean) / sd)),
            "sd_ratio": [float(v) for v in got.std(0) / sd],
            "covered": [bool(v) for v in (lo <= mean) & (mean <= hi)],
            "reported_epsilon": float(fit.privacy_report().epsilon), "seconds": seconds,
            "warnings": sorted({w.category.__name__ for w in caught})}


def table_rows(results: dict) -> list:
    """docs/differential_privacy.md's rows (a test holds the docs to them): per size and epsilon,
    over the keys."""
    rows = []
    for n in SIZES:
        for eps in EPSILONS:
            rs = [r for r in results["runs"] if r["rows"] == n and r["epsilon"] == eps]
            ok = sum(r["answered"] == "dp_metropolis" and r["verdict"] == "ok" for r in rs)
            covered = np.mean([c for r in rs for c in r["covered"]])
            z = [r["max_abs_z_own_sd"] for r in rs]
            ratio = [s for r in rs for s in r["sd_ratio"]]
            cost = np.median([r["seconds"] for r in rs]) / results["nuts_seconds"][str(n)]
            rows.append(f"| {n:,} | {eps:g} | {ok} of {len(rs)} | {sum(r['clipped_residuals'] for r in rs)} | "
                        f"{100 * covered:.0f} % | {min(z):.2f}-{max(z):.2f} | {min(ratio):.2f}-{max(ratio):.2f} | "
                        f"{max(r['reported_epsilon'] for r in rs):.3g} | {cost:.1f}x |")
    return rows


def main():
    runs, nuts_seconds = [], {}
    for n in SIZES:
        x, y = rows(n)
        ref, nuts_seconds[str(n)] = reference(x, y)
        for eps in EPSILONS:
            for key in range(KEYS):
                runs.append(run(n, eps, key, x, y, ref))
                print(json.dumps(runs[-1]))
    out = {**provenance(), "machine": platform.platform(), "keys": KEYS, "clip": CLIP, "delta": DELTA,
           "nuts_seconds": nuts_seconds, "runs": runs}
    RESULTS.write_text(json.dumps(out, indent=1))
    print("\n".join(table_rows(out)))


if __name__ == "__main__":
    main()

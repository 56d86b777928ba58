"""A group as the protected unit (``dp_noise(unit=...)``): what ``nf.fit(dp=...)`` answers when a
whole group of rows is protected together, at epsilon 1 and 4, delta 1e-5, over ``KEYS`` keys.

Posteriors:

- ``wards``: README's first model (a logistic regression with a ward effect shared by the ward's
  patients; 600 patients in 24 wards of 4 hospitals), the ward the unit (each ward's 25 patients
  and its effect are one term, clipped to 20). Reference: NumPyro's NUTS on the pooled rows.
- ``visits``: 2,000 patients with three visits each (6,000 rows over four clients of 40/30/20/10 %),
  ``y_iv ~ N(b_i, 1)``, ``b_i ~ N(mu, 1)``, ``mu ~ N(0, 5^2)``, the patient the unit (all of a
  patient's visits and its effect one term, clipped to 3). The posterior of ``mu`` is analytic
  (each patient's mean visit is ``N(mu, 4/3)``).

Reported per posterior and epsilon, over the keys: the median and range of the largest ``|z|``
of a global scalar's mean against the reference (in reference sds), the share of (key, global
scalar) pairs whose 90 % interval covers the reference mean, the median of the largest number of
posterior sds the privacy noise adds to a mean (``DPLaplace.noise_sds``, as the summary prints it),
the median noise in the released curvature over its least eigenvalue (``DPLaplace.curvature_noise``;
above 0.5 the fit warns that the noise drove its steps) and which keys warned, and the largest
epsilon reported.

    python benchmarks/dp_unit_utility.py

Writes ``benchmarks/results/dp_unit_utility.json``.
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

RESULTS = HERE / "results" / "dp_unit_utility.json"
EPSILONS = (1.0, 4.0)
KEYS = 8
DELTA = 1e-5


def ward_model(ward, x, y=None):  # README's first model
    beta = numpyro.sample("beta", dist.Normal(0, 2).expand([2]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.group_plate("wards", ward), nf.local_site():
        z = numpyro.sample("z", dist.Normal(0, 1))
    with numpyro.plate("rows", x.shape[0]):
        logits = beta[0] + beta[1] * x + tau * z[ward]
        numpyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def visits_model(patient, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with nf.group_plate("patients", patient), nf.local_site():
        b = numpyro.sample("b", dist.Normal(mu, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(b[patient], 1.0), obs=y)


def wards_case():
    rng = np.random.default_rng(0)
    hospital, ward = np.repeat(np.arange(4), 150), np.tile(np.arange(6), 100)
    x = rng.normal(size=600).astype("float32")
    effect = rng.normal(0, 0.8, size=(4, 6))[hospital, ward]
    y = (rng.random(600) < 1 / (1 + np.exp(0.5 - x - effect))).astype("float32")
    mcmc = MCMC(NUTS(ward_model), num_warmup=1000, num_samples=4000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), hospital * 6 + ward, x, y)
    ref = {k: (np.asarray(v).mean(0), np.asarray(v).std(0)) for k, v in mcmc.get_samples().items() if k != "z"}
    clients = nf.Clients.split(hospital, ward=ward, x=x, y=y)
    return "wards", ward_model, "wards", 20.0, clients, ref, "NUTS on the pooled rows (1,000 + 4,000)"


def visits_case(patients=2000):
    rng = np.random.default_rng(1)
    b = rng.normal(1.5, 1.0, size=patients)
    y = (np.repeat(b, 3) + rng.normal(size=3 * patients)).astype("float32")
    client = np.repeat(np.repeat([0, 1, 2, 3], (patients * np.array([0.4, 0.3, 0.2, 0.1])).astype(int)), 3)
    means = y.reshape(patients, 3).mean(1)
    precision = 1 / 25.0 + patients / (4 / 3)
    ref = {"mu": (np.asarray(means.sum() / (4 / 3) / precision), np.asarray(precision ** -0.5))}
    codes = np.concatenate([np.repeat(np.arange((client == c).sum() // 3), 3) for c in range(4)])
    clients = nf.Clients.split(client, patient=codes.astype(np.int32), y=y)
    return "visits", visits_model, "patients", 3.0, clients, ref, "analytic"


def run(case, epsilon, key):
    name, model, unit, clip, clients, ref, _ = case
    private = nf.dp_noise(model, clip=clip, delta=DELTA, epsilon=epsilon, unit=unit)
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        fit = nf.fit(private, clients, jax.random.PRNGKey(key), dp=nf.dp.PrivateFit(), progress_bar=False)
    seconds = time.perf_counter() - t
    draws = fit.get_samples()
    z, covered = [], []
    for site, (mean, sd) in ref.items():
        d = np.asarray(draws[site]).reshape(len(draws[site]), -1)
        lo, hi = np.quantile(d, [0.05, 0.95], axis=0)
        z += (np.abs(d.mean(0) - np.ravel(mean)) / np.ravel(sd)).tolist()
        covered += ((lo <= np.ravel(mean)) & (np.ravel(mean) <= hi)).tolist()
    noise = max(fit.inference.noise_sds(fit.result).values())
    return {"max_abs_z": float(max(z)), "covered": covered, "noise_sds": float(noise), "seconds": seconds,
            "epsilon_reported": max(c.epsilon for c in fit.privacy_report().clients),
            "curvature_noise": float(fit.inference.curvature_noise(fit.result)),
            "clipped_warning": any("clipped" in str(w.message) for w in warned),
            "curvature_warning": any("released curvature" in str(w.message) for w in warned)}


def table_rows(results: dict) -> list:
    """The docs' table rows (one per posterior and epsilon)."""
    out = []
    for r in results["runs"]:
        lo, hi = r["max_abs_z_range"]
        out.append(f"| {r['posterior']} | {r['unit']} | {r['epsilon']:g} | {r['clip']:g} | {r['max_abs_z']:.2f} "
                   f"({lo:.2f}-{hi:.2f}) | {r['covered']:.0%} | {r['noise_sds']:.3g} | {r['curvature_noise']:.2g} | "
                   f"{sum(r['curvature_warning'])} of {len(r['curvature_warning'])} |")
    return out


def main():
    runs = []
    for case in (wards_case(), visits_case()):
        for eps in EPSILONS:
            keyed = [run(case, eps, k) for k in range(1, KEYS + 1)]
            zs = [r["max_abs_z"] for r in keyed]
            covered = [c for r in keyed for c in r["covered"]]
            row = {"posterior": case[0], "unit": case[2], "clip": case[3], "reference": case[6], "epsilon": eps,
                   "delta": DELTA, "max_abs_z": float(np.median(zs)), "max_abs_z_range": [min(zs), max(zs)],
                   "covered": float(np.mean(covered)), "noise_sds": float(np.median([r["noise_sds"] for r in keyed])),
                   "epsilon_reported": max(r["epsilon_reported"] for r in keyed),
                   "clipped_warning": any(r["clipped_warning"] for r in keyed),
                   "curvature_noise": float(np.median([r["curvature_noise"] for r in keyed])),
                   "curvature_warning": [r["curvature_warning"] for r in keyed],
                   "seconds": float(np.median([r["seconds"] for r in keyed]))}
            runs.append(row)
            print(row, flush=True)
    out = {**provenance(), "machine": platform.platform(), "keys": KEYS, "runs": runs}
    RESULTS.write_text(json.dumps(out, indent=1))
    print("\n".join(table_rows(out)))


if __name__ == "__main__":
    main()

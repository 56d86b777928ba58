"""Is SFVI's error on the demo's GLMM federated, or the Gaussian family's?

The six-cities logistic GLMM (Hassan et al. (2023) S3.1; 537 children, 4 binary visits each, a random
intercept per child with sd ``exp(-omega)``), against NUTS on the pooled data
(1000 warm-up + 2000 draws). Fits, all with Gaussian families over (beta, omega, b):

- centralised NumPyro SVI on the pooled data with ``AutoMultivariateNormal`` (full rank, the
  richest Gaussian family), 20000 steps, centred and non-centred;
- federated SFVI over the demo's two silos with ``StructuredGuide`` at its old default
  (fixed local scale) and its new one (``conditional_scale=True``: the local log-scales
  affine in the global sites), the demo's 3000 rounds, centred and non-centred.

Writes ``benchmarks/results/glmm_gaussian_vi.json``: per fit the z of each global site
((mean - NUTS mean) / NUTS sd), omega's sd ratio, the fit check's verdict and seconds.
About 12 minutes on 2 cores.
"""

from __future__ import annotations

import json
import pathlib
import time
import warnings

import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal

import numpyro_fed as nf
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed_examples.models import logistic_glmm

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

OUT = pathlib.Path(__file__).parent / "results" / "glmm_gaussian_vi.json"


def summary(beta, omega, ref):
    rb, ro = ref
    z = np.concatenate([(beta.mean(0) - rb.mean(0)) / rb.std(0), [(omega.mean() - ro.mean()) / ro.std()]])
    return {"z": dict(zip(["beta0", "beta1", "beta2", "beta3", "omega"], np.round(z, 3).tolist())),
            "max_abs_z": float(np.abs(z).max()), "omega_sd_ratio": float(omega.std() / ro.std())}


def main():
    data = load_six_cities()
    pooled = {k: jnp.asarray(v) for k, v in data.items()}
    clients = nf.Clients.split(six_cities_silos(0), **data)
    t = time.perf_counter()
    mcmc = MCMC(NUTS(logistic_glmm), num_warmup=1000, num_samples=2000, progress_bar=False)
    mcmc.run(random.PRNGKey(2), **pooled)
    s = mcmc.get_samples()
    ref = (np.asarray(s["beta"]), np.asarray(s["omega"]))
    rows = {"nuts": {"seconds": time.perf_counter() - t, "omega_mean": float(ref[1].mean()),
                     "omega_sd": float(ref[1].std())}}
    for centered in (True, False):
        def model(**kw):
            return logistic_glmm(**kw, centered=centered)

        guide = AutoMultivariateNormal(model, init_scale=0.05)
        svi = SVI(model, guide, optax.adam(optax.exponential_decay(0.02, 20000, 0.05)), Trace_ELBO(8))
        t = time.perf_counter()
        fit = svi.run(random.PRNGKey(0), 20000, progress_bar=False, **pooled)
        d = guide.sample_posterior(random.PRNGKey(1), fit.params, sample_shape=(4000,))
        rows[f"centralised_auto_mvn_{'centred' if centered else 'noncentred'}"] = dict(
            summary(np.asarray(d["beta"]), np.asarray(d["omega"]), ref), seconds=time.perf_counter() - t)
        print(rows, flush=True)
        for cond in (False, True):
            sched = optax.exponential_decay(0.05, 3000, 0.05)
            fed = nf.FederatedSVI(logistic_glmm, nf.StructuredGuide(logistic_glmm, conditional_scale=cond),
                                  optax.adam(sched), num_particles=4, model_kwargs={"centered": centered})
            t = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", nf.FitWarning)
                res = fed.run(random.PRNGKey(0), clients, 3000, progress_bar=False)
            seconds = time.perf_counter() - t
            d = fed.sample_posterior(random.PRNGKey(1), res, 4000)
            check = fed.last_fit_check
            rows[f"sfvi_{'conditional' if cond else 'fixed'}_scale_{'centred' if centered else 'noncentred'}"] = dict(
                summary(np.asarray(d["beta"]), np.asarray(d["omega"]), ref), seconds=seconds,
                verdict=None if check is None else check.verdict,
                pareto_k=None if check is None else float(check.pareto_k),
                warnings=sorted({type(w.message).__name__ for w in caught}))
            print(rows, flush=True)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"command": "python benchmarks/glmm_gaussian_vi.py", "fits": rows}, indent=1))
    for name, row in rows.items():
        print(name, {k: v for k, v in row.items() if k != "z"})


if __name__ == "__main__":
    main()

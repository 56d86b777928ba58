"""EP with its default settings against NumPyro NUTS on the pooled data.

Wall time and accuracy, same machine, same process. EP: ``EP(model)`` (integrated Laplace on
the local latents' blocks, the importance-corrected tilted moments, sequential schedule,
``check_fit=True``) for three sweeps over the clients (``3 J`` rounds), as the posteriordb suite
runs it. NUTS: ``MCMC(NUTS(pooled), num_warmup=1000, num_samples=1000)`` on the pooled data.
Each is timed cold (first call in this process: tracing and compilation included, what a user
waits for) and warm (the same call again). Accuracy: each global scalar's EP posterior mean
minus the NUTS mean, in NUTS sds (``z``), and the sd ratio, in user space (EP: 4000 draws of
``sample_posterior``).

Cases: the demo's six-cities logistic GLMM (two silos of 300 / 237 children, a random
intercept per child), HM2 of Yue et al. (2022) (K = 100 devices of 100 rows, ``theta_k`` and the noise
scale local; the data of ``benchmarks/hm2_ep.py`` rep 0) and two hierarchical posteriors of the
posteriordb suite (radon: 85 counties, Gaussian; seeds: 21 plates, binomial with a random
effect).

Usage: python benchmarks/ep_vs_nuts.py [--only six_cities hm2 ...] [--sweeps 3] [--out PATH]
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
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed_examples.models import hm2_regression, logistic_glmm

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "posteriordb"))
from hm2_ep import pooled_model as hm2_pooled  # noqa: E402
from hm2_ep import simulate as hm2_simulate  # noqa: E402
from pdb_models import radon, seeds  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

OUT = HERE / "results" / "ep_vs_nuts.json"
NUTS_WARMUP, NUTS_SAMPLES = 1000, 1000


def six_cities():
    data = load_six_cities()
    clients = nf.Clients.split(six_cities_silos(0), **data)
    sites = ["beta", "omega"]
    return "six_cities_glmm", logistic_glmm, logistic_glmm, {k: jnp.asarray(v) for k, v in data.items()}, clients, sites


def hm2():
    x, y = hm2_simulate(0)
    k, n, d = x.shape
    clients = nf.Clients.split(np.repeat(np.arange(k), n), x=x.reshape(-1, d), y=y.reshape(-1))
    return "hm2_k100", hm2_regression, hm2_pooled, dict(x=jnp.asarray(x), y=jnp.asarray(y)), clients, \
        ["mu", "tau"]


def from_suite(make):
    def case():
        p = make()
        data = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in p.pooled_data.items()}
        return p.name, p.model, p.pooled, data, p.clients, sorted({s.split("[")[0] for s in p.sites})
    return case


CASES = {"six_cities": six_cities, "hm2": hm2, "radon": from_suite(radon), "seeds": from_suite(seeds)}


def scalars(draws, sites):
    out = {}
    for site in sites:
        a = np.asarray(draws[site])
        if a.ndim == 1:
            out[site] = a
        else:
            for i in range(a.shape[1]):
                out[f"{site}[{i}]"] = a[:, i]
    return out


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree_util.tree_leaves(out))
    return out, time.perf_counter() - t0


def run_case(name, sweeps, seed=0):
    label, model, pooled, data, clients, sites = CASES[name]()
    rounds = sweeps * len(clients)
    ep = nf.EP(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res, ep_cold = timed(lambda: ep.run(random.PRNGKey(seed), clients, rounds, progress_bar=False))
        _, ep_warm = timed(lambda: ep.run(random.PRNGKey(seed), clients, rounds, progress_bar=False))
    flagged = sorted({f"{w.category.__name__}: {w.message}" for w in caught
                      if w.category.__module__.startswith("numpyro_fed")})
    ep_draws = scalars(ep.sample_posterior(random.PRNGKey(seed + 1), res, 4000), sites)

    def nuts():
        mcmc = MCMC(NUTS(pooled), num_warmup=NUTS_WARMUP, num_samples=NUTS_SAMPLES, progress_bar=False)
        mcmc.run(random.PRNGKey(seed + 2), **data)
        return mcmc

    mcmc, nuts_cold = timed(nuts)
    _, nuts_warm = timed(nuts)
    ref = scalars(mcmc.get_samples(), sites)
    z = {k: float((ep_draws[k].mean() - ref[k].mean()) / ref[k].std()) for k in ref}
    sd_ratio = {k: float(ep_draws[k].std() / ref[k].std()) for k in ref}
    check = ep.last_fit_check
    row = dict(case=label, clients=len(clients), rows=int(clients.total_rows), rounds=rounds,
               ep_seconds_cold=ep_cold, ep_seconds_warm=ep_warm, nuts_seconds_cold=nuts_cold,
               nuts_seconds_warm=nuts_warm, ratio_cold=ep_cold / nuts_cold, ratio_warm=ep_warm / nuts_warm,
               z=z, sd_ratio=sd_ratio, max_abs_z=max(abs(v) for v in z.values()),
               fit_check=None if check is None else dict(verdict=check.verdict, pareto_k=float(check.pareto_k)),
               fit_check_skipped=ep.last_fit_check_skipped, warnings=flagged)
    print(f"{label}: EP {ep_cold:.1f} s cold / {ep_warm:.1f} s warm, NUTS {nuts_cold:.1f} / {nuts_warm:.1f} s; "
          f"ratio {row['ratio_cold']:.2f} cold, {row['ratio_warm']:.2f} warm; max |z| {row['max_abs_z']:.3f}, "
          f"sd ratio {min(sd_ratio.values()):.2f}-{max(sd_ratio.values()):.2f}; "
          f"check {row['fit_check']}; {len(flagged)} warning(s)", flush=True)
    for message in flagged:
        print("   ", message[:300], flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--sweeps", type=int, default=3)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    path = pathlib.Path(args.out)
    # rows of cases not run now are kept, each with the command and date that measured it
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    for name in args.only:
        row = run_case(name, args.sweeps)
        row.update(command=" ".join(sys.argv), measured=time.strftime("%Y-%m-%d"))
        rows = [r for r in rows if r["case"] != row["case"]] + [row]
        out = dict(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", jax=jax.__version__,
                   nuts=dict(warmup=NUTS_WARMUP, samples=NUTS_SAMPLES), sweeps=args.sweeps, rows=rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""Cold start: ``nf.fit`` and EP at their defaults on the six-cities GLMM split over J silos,
against NumPyro's NUTS on the pooled data, in the same process.

Each method is timed cold (its first call in this process: tracing and compilation included,
what a user waits for): ``nf.fit(logistic_glmm, clients, key)``; ``EP(logistic_glmm)`` for three
sweeps (``3 J`` sequential rounds, as the posteriordb suite runs it); ``MCMC(NUTS(logistic_glmm),
num_warmup=500, num_samples=1000)`` on the pooled data (NumPyro's defaults). EP is stopped at
``--ep-timeout`` seconds (a subprocess; reported as not finished). Accuracy: each global scalar's
mean minus the pooled NUTS mean, in NUTS sds.

Usage: python benchmarks/fit_cold_start.py [--silos 4] [--ep-timeout 600]
Writes ``benchmarks/results/fit_cold_start.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import platform
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results" / "fit_cold_start.json"


def _flat(draws):
    beta = np.asarray(draws["beta"]).reshape(-1, 4)
    return {**{f"beta{k}": beta[:, k] for k in range(4)}, "omega": np.asarray(draws["omega"]).reshape(-1)}


def _split(num_silos: int):
    from numpyro_fed.datasets import load_six_cities, six_cities_silos

    data = load_six_cities()
    n = len(data["smoke"])
    sizes = [n // num_silos + (1 if k < n % num_silos else 0) for k in range(num_silos)]
    return data, six_cities_silos(0, tuple(sizes))


def _ep(num_silos: int, queue) -> None:
    import numpyro_fed as nf
    from numpyro_fed.models import logistic_glmm

    data, silos = _split(num_silos)
    clients = nf.Clients.split(silos, **data)
    ep = nf.EP(logistic_glmm)
    ep.progress_bar = False
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", nf.FederatedWarning)
        result = ep.run(jax.random.PRNGKey(0), clients, 3 * num_silos)
        draws = _flat(ep.sample_posterior(jax.random.PRNGKey(1), result, 4000))
    queue.put({"seconds": time.perf_counter() - start, "rounds": int(result.communication.rounds),
               "verdict": None if ep.last_fit_check is None else ep.last_fit_check.verdict,
               "warnings": sorted({w.category.__name__ for w in caught}),
               "means": {k: float(v.mean()) for k, v in draws.items()},
               "sds": {k: float(v.std()) for k, v in draws.items()}})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--silos", type=int, default=4)
    parser.add_argument("--ep-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    from numpyro.infer import MCMC, NUTS

    import numpyro_fed as nf
    from numpyro_fed.models import logistic_glmm

    data, silos = _split(args.silos)
    out = {"command": f"python benchmarks/fit_cold_start.py --silos {args.silos}", "silos": args.silos,
           "rows_per_silo": np.bincount(silos).tolist(), "machine": platform.processor() or platform.machine(),
           "jax": jax.__version__, "cpus": mp.cpu_count()}
    start = time.perf_counter()
    mcmc = MCMC(NUTS(logistic_glmm), num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), **{k: jnp.asarray(v) for k, v in data.items()})
    ref = _flat(mcmc.get_samples())
    out["pooled_nuts"] = {"seconds": time.perf_counter() - start}

    start = time.perf_counter()
    fit = nf.fit(logistic_glmm, nf.Clients.split(silos, **data), jax.random.PRNGKey(0), progress_bar=False)
    draws = _flat(fit.get_samples() if fit.answer == "exact" else fit.sample_posterior(jax.random.PRNGKey(1), 4000))
    out["fit"] = {"seconds": time.perf_counter() - start, "method": fit.method, "rounds": fit.rounds,
                  "bytes": fit.bytes, "log": fit.log,
                  "max_abs_z": max(abs(float(draws[k].mean() - ref[k].mean()) / float(ref[k].std())) for k in ref),
                  "sd_ratios": {k: float(draws[k].std() / ref[k].std()) for k in ref}}

    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_ep, args=(args.silos, queue))
    start = time.perf_counter()
    proc.start()
    proc.join(args.ep_timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join()
        out["ep"] = {"finished": False, "seconds": time.perf_counter() - start,
                     "note": f"stopped at --ep-timeout {args.ep_timeout:g} s (a fresh process: compile included)"}
    else:
        ep = queue.get()
        ep.update(finished=True, max_abs_z=max(abs(ep["means"][k] - float(ref[k].mean())) / float(ref[k].std())
                                                for k in ref))
        out["ep"] = ep
    for name in ("fit", "ep"):
        out[name]["seconds_over_pooled_nuts"] = out[name]["seconds"] / out["pooled_nuts"]["seconds"]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

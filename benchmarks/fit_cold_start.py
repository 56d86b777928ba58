"""Cold start: ``nf.fit`` and EP at their defaults on the six-cities GLMM split over J silos,
against NumPyro's NUTS on the pooled data, each in a fresh process.

Each method is timed cold (its first call in a fresh Python process: tracing and compilation
included, what a user waits for): ``nf.fit(logistic_glmm, clients, key)``; ``EP(logistic_glmm)``
for three sweeps (``3 J`` sequential rounds, as the posteriordb suite runs it);
``MCMC(NUTS(logistic_glmm), num_warmup=500, num_samples=1000)`` on the pooled data (NumPyro's
defaults; ``MCMC.run`` compiles on every call). In the same processes each is then called a second
time on the same data (``nf.fit`` anew, ``mcmc.run`` again): what a second fit of the same model
costs. Then with the persistent compilation cache on (``NUMPYRO_FED_COMPILATION_CACHE``, an empty
directory): one fresh process fills it (pooled NUTS, then ``nf.fit``) and a second fresh process
runs both again, reading it. EP is stopped at ``--ep-timeout`` seconds (reported as not finished).
Accuracy: each global scalar's mean minus the pooled NUTS mean, in NUTS sds.

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


def _pooled_and_fit(num_silos: int, cache: str, queue) -> None:
    """In a fresh process: pooled NUTS twice, then ``nf.fit`` twice (``cache``: with the persistent
    compilation cache in that directory)."""
    import os

    if cache:
        os.environ["NUMPYRO_FED_COMPILATION_CACHE"] = cache
    from numpyro.infer import MCMC, NUTS

    import numpyro_fed as nf
    from numpyro_fed.models import logistic_glmm

    data, silos = _split(num_silos)
    out = {}
    mcmc = MCMC(NUTS(logistic_glmm), num_warmup=500, num_samples=1000, progress_bar=False)
    for name in ("pooled_nuts", "pooled_nuts_second"):
        start = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(2), **{k: jnp.asarray(v) for k, v in data.items()})
        ref = _flat(mcmc.get_samples())
        out[name] = {"seconds": time.perf_counter() - start}
    for name in ("fit", "fit_second"):
        start = time.perf_counter()
        fit = nf.fit(logistic_glmm, nf.Clients.split(silos, **data), jax.random.PRNGKey(0), progress_bar=False)
        draws = _flat(fit.get_samples() if fit.answer == "exact"
                      else fit.sample_posterior(jax.random.PRNGKey(1), 4000))
        out[name] = {"seconds": time.perf_counter() - start, "method": fit.method, "rounds": fit.rounds,
                     "bytes": fit.bytes, "log": fit.log,
                     "max_abs_z": max(abs(float(draws[k].mean() - ref[k].mean()) / float(ref[k].std()))
                                      for k in ref),
                     "sd_ratios": {k: float(draws[k].std() / ref[k].std()) for k in ref}}
    out["reference_means"] = {k: float(v.mean()) for k, v in ref.items()}
    out["reference_sds"] = {k: float(v.std()) for k, v in ref.items()}
    queue.put(out)


def _fresh(target, *args, timeout: float = 1800.0):
    """``target(*args, queue)`` in a fresh (spawned) process: what it put, or ``None`` past ``timeout``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    try:
        return queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - a run past its time: reported as not finished
        return None
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def main(argv=None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--silos", type=int, default=4)
    parser.add_argument("--ep-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    data, silos = _split(args.silos)
    out = {"command": f"python benchmarks/fit_cold_start.py --silos {args.silos}", "silos": args.silos,
           "rows_per_silo": np.bincount(silos).tolist(), "machine": platform.processor() or platform.machine(),
           "jax": jax.__version__, "cpus": mp.cpu_count(), "provenance": _provenance()}
    cold = _fresh(_pooled_and_fit, args.silos, "")
    out.update({k: cold[k] for k in ("pooled_nuts", "pooled_nuts_second", "fit", "fit_second")})
    with tempfile.TemporaryDirectory() as cache:
        filling = _fresh(_pooled_and_fit, args.silos, cache)
        cached = _fresh(_pooled_and_fit, args.silos, cache)
    out["with_cache"] = {
        "note": "NUMPYRO_FED_COMPILATION_CACHE set to an empty directory: the first fresh process fills it, the "
                "second reads it",
        "filling": {k: filling[k]["seconds"] for k in ("pooled_nuts", "fit")},
        "second_process": {k: cached[k]["seconds"] for k in ("pooled_nuts", "fit")},
        "second_process_fit_max_abs_z": cached["fit"]["max_abs_z"]}

    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_ep, args=(args.silos, queue))
    start = time.perf_counter()
    proc.start()
    proc.join(args.ep_timeout)
    ref_mean, ref_sd = cold["reference_means"], cold["reference_sds"]
    if proc.is_alive():
        proc.terminate()
        proc.join()
        out["ep"] = {"finished": False, "seconds": time.perf_counter() - start,
                     "note": f"stopped at --ep-timeout {args.ep_timeout:g} s (a fresh process: compile included)"}
    else:
        ep = queue.get()
        ep.update(finished=True, max_abs_z=max(abs(ep["means"][k] - ref_mean[k]) / ref_sd[k] for k in ref_mean))
        out["ep"] = ep
    nuts = out["pooled_nuts"]["seconds"]
    for name in ("fit", "ep"):
        out[name]["seconds_over_pooled_nuts"] = out[name]["seconds"] / nuts
    out["fit_second"]["seconds_over_pooled_nuts_second"] = (out["fit_second"]["seconds"]
                                                            / out["pooled_nuts_second"]["seconds"])
    out["with_cache"]["second_process_fit_over_pooled_nuts_cold"] = out["with_cache"]["second_process"]["fit"] / nuts
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def _provenance() -> dict:
    """The commit measured (and whether the tree had changes) and the date."""
    import datetime
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=HERE).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "date": datetime.date.today().isoformat()}


if __name__ == "__main__":
    main()

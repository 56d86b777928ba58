"""Cold start: ``nf.fit`` and EP at their defaults on the six-cities GLMM split over J silos,
against NumPyro's NUTS on the pooled data, every method timed in a fresh Python process.

What a user waits for, measured as a user meets it:

- **cold**: the first call in a fresh process (imports done before the clock starts; tracing and
  compilation included): ``nf.fit(logistic_glmm, clients, key)``, ``EP(logistic_glmm)`` for three
  sweeps (``3 J`` sequential rounds, as the posteriordb suite runs it), and
  ``MCMC(NUTS(logistic_glmm), num_warmup=500, num_samples=1000)`` on the pooled data (NumPyro's
  defaults; its ``run`` compiles on every call, so cold is compared with cold);
- **second call**: the same call again in the same process, on new objects (``nf.fit`` again;
  a new ``MCMC(NUTS(...))``);
- **cache, second process**: with the persistent compilation cache on
  (``NUMPYRO_FED_COMPILATION_CACHE``), one process fills an empty cache and a second, fresh
  process is timed (the same for pooled NUTS, with JAX's cache at the same thresholds).

Accuracy: each global scalar's mean minus the pooled NUTS mean, in NUTS sds. Every child process
is started by its own process handle and stopped at ``--timeout`` seconds.

Usage: python benchmarks/fit_cold_start.py [--silos 4] [--timeout 900]   (``--table``: the docs' table)
Writes ``benchmarks/results/fit_cold_start.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from provenance import provenance  # noqa: E402

RESULTS = HERE / "results" / "fit_cold_start.json"


def _flat(draws):
    beta = np.asarray(draws["beta"]).reshape(-1, 4)
    return {**{f"beta{k}": beta[:, k] for k in range(4)}, "omega": np.asarray(draws["omega"]).reshape(-1)}


def _moments(draws):
    flat = _flat(draws)
    return {"means": {k: float(v.mean()) for k, v in flat.items()}, "sds": {k: float(v.std()) for k, v in flat.items()}}


def _split(num_silos: int):
    from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos

    data = load_six_cities()
    n = len(data["smoke"])
    sizes = [n // num_silos + (1 if k < n % num_silos else 0) for k in range(num_silos)]
    return data, six_cities_silos(0, tuple(sizes))


def _child(what: str, num_silos: int, twice: bool) -> dict:
    """One method in this (fresh) process: its first call, and with ``twice`` its second."""
    import jax
    import jax.numpy as jnp
    from numpyro.infer import MCMC, NUTS

    import numpyro_fed as nf
    nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes
    from numpyro_fed_examples.models import logistic_glmm

    data, silos = _split(num_silos)

    def nuts():
        mcmc = MCMC(NUTS(logistic_glmm), num_warmup=500, num_samples=1000, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(2), **{k: jnp.asarray(v) for k, v in data.items()})
        return {"draws": _moments(mcmc.get_samples())}

    def fit():
        result = nf.fit(logistic_glmm, nf.Clients.split(silos, **data), jax.random.PRNGKey(0), progress_bar=False)
        draws = result.get_samples() if result.answer == "exact" else result.sample_posterior(jax.random.PRNGKey(1),
                                                                                               4000)
        return {"draws": _moments(draws), "method": result.method, "rounds": result.rounds, "bytes": result.bytes,
                "log": result.log}

    def ep():
        inference = nf.EP(logistic_glmm)
        inference.progress_bar = False
        result = inference.run(jax.random.PRNGKey(0), nf.Clients.split(silos, **data), 3 * num_silos)
        check = inference.last_fit_check
        return {"draws": _moments(inference.sample_posterior(jax.random.PRNGKey(1), result, 4000)),
                "rounds": int(result.communication.rounds), "verdict": None if check is None else check.verdict}

    call = {"nuts": nuts, "fit": fit, "ep": ep}[what]
    out = {}
    for name in ("cold", "second")[: 1 + twice]:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", nf.FederatedWarning)
            got = call()
        got.update(seconds=time.perf_counter() - start, warnings=sorted({w.category.__name__ for w in caught}))
        out[name] = got
    return out


def _fresh(what: str, num_silos: int, twice: bool, timeout: float, cache: str | None = None) -> dict:
    """``_child`` in a fresh interpreter (its own process handle; killed at ``timeout``)."""
    env = dict(os.environ)
    env.pop("NUMPYRO_FED_COMPILATION_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache is not None:
        env["NUMPYRO_FED_COMPILATION_CACHE"] = cache  # numpyro_fed turns it on at import, for NUTS too
    cmd = [sys.executable, __file__, "--child", what, "--silos", str(num_silos)] + (["--twice"] if twice else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"finished": False, "note": f"stopped at --timeout {timeout:g} s"}
    if proc.returncode:
        raise RuntimeError(f"{what}: the child process failed:\n{err[-3000:]}")
    return {"finished": True, **json.loads(out.strip().splitlines()[-1])}


def _accuracy(run: dict, ref: dict) -> dict:
    means, sds = run["draws"]["means"], run["draws"]["sds"]
    return {"max_abs_z": max(abs(means[k] - ref["means"][k]) / ref["sds"][k] for k in ref["means"]),
            "sd_ratios": {k: sds[k] / ref["sds"][k] for k in ref["sds"]}}


def table_rows(results: dict) -> list:
    """The docs' table (markdown rows) from the results JSON."""
    nuts, fit, ep = results["pooled_nuts"], results["fit"], results["ep"]
    cache_fit, cache_nuts = results["fit_cache_second_process"], results["pooled_nuts_cache_second_process"]
    rows = ["| method | rounds | cold, fresh process | / pooled NUTS cold | second call, same process | "
            "/ pooled NUTS second | cache on, second process | max abs z vs pooled NUTS | answered by |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| pooled NUTS (NumPyro) | - | {nuts['cold']['seconds']:.1f} s | 1 | "
            f"{nuts['second']['seconds']:.1f} s | 1 | {cache_nuts['cold']['seconds']:.1f} s | - | - |",
            f"| `nf.fit` | {fit['cold']['rounds']} | {fit['cold']['seconds']:.1f} s | "
            f"{fit['cold']['seconds'] / nuts['cold']['seconds']:.2f} | {fit['second']['seconds']:.1f} s | "
            f"{fit['second']['seconds'] / nuts['second']['seconds']:.2f} | {cache_fit['cold']['seconds']:.1f} s | "
            f"{fit['cold']['max_abs_z']:.2f} | {fit['cold']['method']} |"]
    if ep["finished"]:
        rows.append(f"| `EP(logistic_glmm)`, 3 J rounds | {ep['cold']['rounds']} | {ep['cold']['seconds']:.1f} s | "
                    f"{ep['cold']['seconds'] / nuts['cold']['seconds']:.2f} | - | - | - | "
                    f"{ep['cold']['max_abs_z']:.2f} | check {ep['cold']['verdict']} |")
    else:
        rows.append(f"| `EP(logistic_glmm)`, 3 J rounds | - | not finished ({ep['note']}) | - | - | - | - | - | - |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--silos", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a child process may run")
    parser.add_argument("--child", choices=("nuts", "fit", "ep"), help=argparse.SUPPRESS)
    parser.add_argument("--twice", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true", help="print the docs' table from the last results")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(table_rows(json.loads(RESULTS.read_text()))))
        return
    if args.child:
        print(json.dumps(_child(args.child, args.silos, args.twice)))
        return
    import jax

    _, silos = _split(args.silos)
    out = {"command": f"python benchmarks/fit_cold_start.py --silos {args.silos}", **provenance(),
           "silos": args.silos, "rows_per_silo": np.bincount(silos).tolist(),
           "machine": platform.processor() or platform.machine(), "jax": jax.__version__, "cpus": mp.cpu_count(),
           "load_average_at_start": list(os.getloadavg()),
           "timing": "each method in a fresh Python process, imports before the clock starts; cold = its first "
                     "call (tracing and compilation included), second = the same call again in that process"}
    out["pooled_nuts"] = _fresh("nuts", args.silos, True, args.timeout)
    ref = out["pooled_nuts"]["cold"]["draws"]
    out["fit"] = _fresh("fit", args.silos, True, args.timeout)
    out["ep"] = _fresh("ep", args.silos, False, args.timeout)
    with tempfile.TemporaryDirectory() as fit_cache, tempfile.TemporaryDirectory() as nuts_cache:
        _fresh("fit", args.silos, False, args.timeout, fit_cache)  # fills the cache
        out["fit_cache_second_process"] = _fresh("fit", args.silos, False, args.timeout, fit_cache)
        _fresh("nuts", args.silos, False, args.timeout, nuts_cache)
        out["pooled_nuts_cache_second_process"] = _fresh("nuts", args.silos, False, args.timeout, nuts_cache)
    nuts_cold = out["pooled_nuts"]["cold"]["seconds"]
    ratios = {"fit_cold": out["fit"]["cold"]["seconds"] / nuts_cold,
              "fit_second": out["fit"]["second"]["seconds"] / out["pooled_nuts"]["second"]["seconds"],
              "fit_cache_second_process": out["fit_cache_second_process"]["cold"]["seconds"] / nuts_cold,
              "fit_cache_second_process_over_nuts_cache":
                  out["fit_cache_second_process"]["cold"]["seconds"]
                  / out["pooled_nuts_cache_second_process"]["cold"]["seconds"]}
    if out["ep"]["finished"]:
        ratios["ep_cold"] = out["ep"]["cold"]["seconds"] / nuts_cold
    out["seconds_over_pooled_nuts"] = ratios
    for name, run in (("fit", out["fit"]["cold"]), ("fit_second", out["fit"]["second"]),
                      ("fit_cache_second_process", out["fit_cache_second_process"]["cold"]),
                      ("ep", out["ep"].get("cold"))):
        if run is not None:
            run.update(_accuracy(run, ref))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["seconds_over_pooled_nuts"], indent=1))


if __name__ == "__main__":
    main()

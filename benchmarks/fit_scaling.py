"""How ``nf.fit``'s cost grows with the rows and with the clients, against NumPyro's NUTS on the
pooled data, both cold, in the same fresh Python process.

The model: a logistic regression with 10 covariates, an intercept and a random intercept per
client (``a_j ~ N(0, tau)``, local: never sent; ``tau ~ HalfNormal(1)``), the rows split evenly
over the clients. Pooled NUTS runs the same model with the clients' intercepts in a plate
(NumPyro's defaults: 500 warmup, 1,000 draws, one chain). Each cell is one fresh process:
pooled NUTS cold (its ``run`` compiles on every call), then ``nf.fit`` cold (tracing and
compilation included, results waited for), then the accuracy of ``nf.fit``'s draws: each
global scalar's mean minus the pooled NUTS mean, in NUTS sds, and the sd ratio.

- ``--rows``: total rows over 4 clients (default 1,000, 10,000, 100,000; 1,000,000 with
  ``--rows 1000000``);
- ``--clients``: clients over 20,000 rows (default 10, 100, 1,000).

Every child process is started by its own process handle and stopped at ``--timeout`` seconds.

Usage: python benchmarks/fit_scaling.py [--rows 1000 10000 100000] [--clients 10 100 1000]
       [--timeout 1800]      (``--table``: the docs' table; ``--plot``: the docs' figure)
Writes ``benchmarks/results/fit_scaling.json`` (cells measured before are kept unless re-run).
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
import time
import warnings

import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from provenance import provenance  # noqa: E402

RESULTS = HERE / "results" / "fit_scaling.json"
FIGURE = HERE.parent / "docs" / "fit_scaling.svg"
COVARIATES = 10
CLIENT_ROWS = 20_000  # total rows of the clients' axis


def _data(rows: int, clients: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, COVARIATES)) * 1.5 / np.sqrt(COVARIATES)
    client = np.arange(rows) * clients // rows  # contiguous, even blocks
    a = 0.5 * rng.normal(size=clients)
    y = rng.binomial(1, 1 / (1 + np.exp(-(x @ rng.normal(size=COVARIATES) + a[client] - 0.3))))
    return x.astype(np.float32), y.astype(np.float32), client


def _scalars(draws) -> dict:
    beta = np.asarray(draws["beta"]).reshape(-1, COVARIATES)
    return {**{f"beta[{k}]": beta[:, k] for k in range(COVARIATES)}, "b0": np.asarray(draws["b0"]).reshape(-1),
            "tau": np.asarray(draws["tau"]).reshape(-1)}


def _child(rows: int, clients: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import MCMC, NUTS

    import numpyro_fed as nf
    nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

    def pooled(x, client, y=None):
        beta = numpyro.sample("beta", dist.Normal(0, 1).expand([COVARIATES]).to_event(1))
        b0 = numpyro.sample("b0", dist.Normal(0, 2))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with numpyro.plate("clients", clients):
            a = numpyro.sample("a", dist.Normal(0, tau))
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=b0 + a[client] + x @ beta), obs=y)

    def model(x, y=None):
        beta = numpyro.sample("beta", dist.Normal(0, 1).expand([COVARIATES]).to_event(1))
        b0 = numpyro.sample("b0", dist.Normal(0, 2))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with nf.local_site():
            a = numpyro.sample("a", dist.Normal(0, tau))
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=b0 + a + x @ beta), obs=y)

    x, y, client = _data(rows, clients)
    out = {}
    start = time.perf_counter()
    mcmc = MCMC(NUTS(pooled), num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), jnp.asarray(x), jnp.asarray(client), jnp.asarray(y))
    ref = {k: v for k, v in _scalars(jax.block_until_ready(mcmc.get_samples())).items()}
    out["pooled_nuts_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", nf.FederatedWarning)
        result = nf.fit(model, nf.Clients.split(client, x=x, y=y), jax.random.PRNGKey(0), progress_bar=False)
        draws = jax.block_until_ready(result.get_samples())
    out["fit_seconds"] = time.perf_counter() - start
    got = _scalars(draws)
    out.update(method=result.method, answer=result.answer, rounds=result.rounds, log=result.log,
               warnings=sorted({w.category.__name__ for w in caught}),
               max_abs_z=float(max(abs(got[k].mean() - ref[k].mean()) / ref[k].std() for k in ref)),
               sd_ratio_range=[float(min(got[k].std() / ref[k].std() for k in ref)),
                               float(max(got[k].std() / ref[k].std() for k in ref))])
    out["ratio"] = out["fit_seconds"] / out["pooled_nuts_seconds"]
    return out


def _fresh(rows: int, clients: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", str(rows), str(clients)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"rows": rows, "clients": clients, "finished": False, "note": f"stopped at --timeout {timeout:g} s"}
    if proc.returncode:
        return {"rows": rows, "clients": clients, "finished": False, "note": f"failed: {err.strip()[-500:]}"}
    return {"rows": rows, "clients": clients, "finished": True, **json.loads(out.strip().splitlines()[-1])}


def table_rows(results: dict) -> list:
    """The docs' table (markdown rows) from the results JSON."""
    rows = ["| rows | clients | pooled NUTS, cold | `nf.fit`, cold | / pooled NUTS | answered by | max abs z | "
            "sd ratio |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cell in results["cells"]:
        if not cell["finished"]:
            rows.append(f"| {cell['rows']:,} | {cell['clients']:,} | - | not finished ({cell['note']}) | "
                        "- | - | - | - |")
            continue
        lo, hi = cell["sd_ratio_range"]
        rows.append(f"| {cell['rows']:,} | {cell['clients']:,} | {cell['pooled_nuts_seconds']:.1f} s | "
                    f"{cell['fit_seconds']:.1f} s | {cell['ratio']:.2f} | {cell['method']} | "
                    f"{cell['max_abs_z']:.2f} | {lo:.2f}-{hi:.2f} |")
    return rows


def plot(results: dict, path: pathlib.Path = FIGURE) -> None:
    """Seconds against rows (4 clients) and against clients (20,000 rows), both methods, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in results["cells"] if c["finished"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (axis, fixed, label) in zip(axes, (("rows", ("clients", 4), "rows (4 clients)"),
                                               ("clients", ("rows", CLIENT_ROWS), f"clients ({CLIENT_ROWS:,} rows)"))):
        cells = sorted((c for c in done if c[fixed[0]] == fixed[1]), key=lambda c: c[axis])
        xs = [c[axis] for c in cells]
        ax.loglog(xs, [c["pooled_nuts_seconds"] for c in cells], "o-", label="pooled NUTS (NumPyro)")
        ax.loglog(xs, [c["fit_seconds"] for c in cells], "s-", label="nf.fit")
        ax.set_xlabel(label)
        ax.set_ylabel("seconds, cold")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"nf.fit and pooled NUTS, cold (commit {results['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1000, 10_000, 100_000])
    parser.add_argument("--clients", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a child process may run")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true", help="print the docs' table from the last results")
    parser.add_argument("--plot", action="store_true", help="draw the docs' figure from the last results")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    if args.table or args.plot:
        results = json.loads(RESULTS.read_text())
        print("\n".join(table_rows(results))) if args.table else plot(results)
        return
    import jax

    wanted = [(r, 4) for r in args.rows] + [(CLIENT_ROWS, j) for j in args.clients]
    old = json.loads(RESULTS.read_text())["cells"] if RESULTS.exists() else []
    cells = {(c["rows"], c["clients"]): c for c in old}
    for rows, clients in wanted:
        print(f"{rows} rows, {clients} clients", flush=True)
        cells[(rows, clients)] = {**_fresh(rows, clients, args.timeout), "commit": provenance()["commit"]}
        print(json.dumps({k: v for k, v in cells[(rows, clients)].items() if k != "log"}), flush=True)
    out = {"command": "python benchmarks/fit_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv),
           **provenance(), "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
           "cpus": mp.cpu_count(), "load_average_at_start": list(os.getloadavg()),
           "timing": "each cell in a fresh Python process, imports before the clock starts: pooled NUTS cold, then "
                     "nf.fit cold, in that process (compilation included, results waited for)",
           "cells": sorted(cells.values(), key=lambda c: (c["clients"] != 4, c["clients"], c["rows"]))}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    plot(out)


if __name__ == "__main__":
    main()

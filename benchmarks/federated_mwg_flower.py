"""The demo's exact fit, ``nf.fit(..., exact=True)``, over a real loopback Flower federation, end to end.

Two SuperNodes on 127.0.0.1 (numpyro_fed's paced SuperNode and executor, the rounds over the
run's stream: ``LocalFederation``'s defaults), each holding one silo of the six-cities wheeze
data (the demo's model, ``numpyro_fed_examples.models.logistic_glmm``, and silos); the task is
``nf.fitting.ladder.Ladder(logistic_glmm, exact=True)``: the federated Laplace search, then federated
Metropolis-within-Gibbs from its mode (4 chains x (300 + 1000) iterations, one round each).

Reported: the end-to-end wall time (the federation started, ``flwr run`` submitted, the result
read, every process stopped), the ServerApp's run time, the rounds and the warm round's time;
against the simulation backend's run with the same keys (``client_mapping="loop"``, one client per
node as over Flower): the same rungs (log, figures masked), the same rounds, the first round whose
figure (the chains' acceptance) differs and the largest draw difference (a client step compiled
alone on a node and inside the simulation's loop can differ in the last bits of float32, and a
long chain's local Hamiltonian moves amplify that, so a run of a thousand rounds parts from the
simulation; what must hold then is that both are draws of the same posterior: per global scalar
the difference of the means in its standard error and the sd ratio); the rounds per effective
sample; and the projected time over a wide-area network: every round plus a 50 ms round trip
(``rounds * (warm round + 0.05 s)``).
Writes ``benchmarks/results/federated_mwg_flower.json``.

    python benchmarks/federated_mwg_flower.py
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re
import time
import warnings

import jax
import numpy as np
from numpyro.diagnostics import effective_sample_size

import numpyro_fed as nf
from numpyro_fed.fitting.ladder import Ladder
from numpyro_fed.flower import LocalFederation
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed_examples.models import logistic_glmm

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results" / "federated_mwg_flower.json"
RTT = 0.05  # seconds: a wide-area round trip

TASKS = '''
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed.flower import FlowerTask
from numpyro_fed.fitting.ladder import Ladder
from numpyro_fed_examples.models import logistic_glmm
import numpyro_fed as nf


def _load(node_config):
    clients = nf.Clients.split(six_cities_silos(0), **load_six_cities())
    name = clients.names[int(node_config["partition-id"])]
    return name, dict(clients[name])


exact = FlowerTask(lambda: Ladder(logistic_glmm, exact=True, progress_bar=False), _load)
'''


def main() -> dict:
    clients = nf.Clients.split(six_cities_silos(0), **load_six_cities())
    configs = [{"partition-id": j, "numpyro-fed-seed": 0} for j in range(len(clients.names))]
    t0 = time.perf_counter()
    with LocalFederation(configs, app_files={"mwg_tasks.py": TASKS}) as fed:
        started = time.perf_counter() - t0
        flower = fed.run("mwg_tasks:exact", 1, seed=0, timeout=900, transcript=False)
    end_to_end = time.perf_counter() - t0
    got = flower["fit"]
    ladder = Ladder(logistic_glmm, exact=True, client_mapping="loop", progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = ladder.run(jax.random.PRNGKey(0), clients)
    masked = lambda log: [re.sub(r"-?\d+(\.\d+)?(e[+-]\d+)?", "#", line) for line in log]  # noqa: E731
    want = sim.get_samples()
    diff = max(float(np.max(np.abs(np.asarray(got["samples"][k]) - np.asarray(want[k])))) for k in want)
    # the per-round figure (the chains' acceptance) of both runs: the first round they part
    ft, st = np.asarray(flower["trace"]), np.asarray(sim.result.trace)
    n = min(len(ft), len(st))
    apart = np.flatnonzero(np.abs(ft[:n] - st[:n]) > 1e-6)
    # both runs as draws of one posterior: per global scalar, the difference of the means in its
    # standard error (each run's sd / sqrt(ESS)) and the sd ratio
    z, ratio = {}, {}
    for k, w in want.items():
        a = np.asarray(got["samples"][k]).reshape(4, -1, *np.shape(w)[1:])
        b = np.asarray(w).reshape(4, -1, *np.shape(w)[1:])
        for i in np.ndindex(np.shape(w)[1:]):
            x, y = a[(slice(None), slice(None)) + i], b[(slice(None), slice(None)) + i]
            se = np.sqrt(x.var() / effective_sample_size(x) + y.var() / effective_sample_size(y))
            name = f"{k}{list(i) if i else ''}"
            z[name], ratio[name] = float(abs(x.mean() - y.mean()) / se), float(x.std() / y.std())
    secs = np.asarray(flower["round_seconds"])
    warm = float(np.median(secs[1:]))
    row = {
        "posterior": "six_cities_glmm (the demo's model and silos)", "clients": len(clients.names),
        "method": got["method"], "log": got["log"], "rounds": int(got["rounds"]), "bytes": int(got["bytes"]),
        "federation_start_seconds": started, "end_to_end_seconds": end_to_end,
        "server_run_seconds": flower["seconds"], "warm_round_median_seconds": warm,
        "first_round_seconds": float(secs[0]) if secs.size else None,
        "min_ess": sim.check["min_n_eff"], "rounds_per_ess": int(got["rounds"]) / sim.check["min_n_eff"],
        "simulation_rounds": int(sim.rounds), "same_rungs_as_simulation": masked(got["log"]) == masked(sim.log),
        "max_abs_difference_to_simulation": diff,
        "first_round_apart_from_simulation": int(apart[0]) + 1 if apart.size else None,
        "mcse_z_to_simulation": max(z.values()), "sd_ratio_to_simulation": [min(ratio.values()), max(ratio.values())],
        "projected_seconds_at_50ms_round_trips": int(got["rounds"]) * (warm + RTT),
        "warnings": flower["warnings"],
    }
    RESULTS.write_text(json.dumps({
        "command": "python benchmarks/federated_mwg_flower.py", "machine": platform.platform(),
        "cpus": os.cpu_count(), "jax": jax.__version__,
        "times_include": "end_to_end_seconds: starting the SuperLink and SuperNodes, submitting the run, every "
                         "round (the Laplace search and the sampler, compiling included), reading the result and "
                         "stopping every process; projected_seconds_at_50ms_round_trips: rounds x (the median "
                         "warm loopback round + 0.05 s)",
        "results": [row]}, indent=1))
    print(json.dumps({k: v for k, v in row.items() if k not in ("log", "warnings")}, indent=1))
    return row


if __name__ == "__main__":
    main()

"""Federated NUTS over a real loopback Flower federation, timed end to end.

One SuperNode per client on 127.0.0.1 (numpyro_fed's paced SuperNode and executor, the rounds
over the run's stream: ``LocalFederation``'s defaults), ``nf.FederatedNUTS``. Per posterior:

- six-cities GLMM (2 SuperNodes) and eight schools non-centred (8): the whole run of
  ``benchmarks/federated_nuts.py`` (4 chains x (500 + 1000)), measured end to end;
- Poisson GLMM (40 SuperNodes on a 2-core machine): a shortened run (1 chain x (20 + 20):
  688 rounds; 1 x (60 + 60) takes tens of thousands, its short warm-up windows leave the step
  size small), measured end to end, and the whole run projected: its rounds (from the
  simulation backend's whole run) times the measured warm round.

Reported: the end-to-end wall time (``flwr run`` submitted to result read), the ServerApp's run
time, rounds and warm round; against the simulation backend's runs with the same keys and
settings (``numpyro-fed-seed``), once with ``client_mapping="loop"`` and once with ``"vmap"``,
the first round whose figure differs by more than 1e-4 (relative) and the largest draw
difference: in float32 a client step compiled alone, inside the simulation's loop, or vmapped
can differ in the last bits, and NUTS's decisions amplify that (on the Poisson GLMM the two
simulations part at round 71, and the Flower run equals the vmapped one), so long runs may
part from a simulation (equality to float tolerance is a test, ``tests/test_flower.py``, over
500 rounds); what must hold is the posterior: for whole runs, max |z| against NumPyro's NUTS
on the pooled data (global scalars). With ``--workdir`` the Flower run's per-round figure and
draws go to ``WORKDIR/<posterior>-flower.npz``. Writes ``benchmarks/results/federated_nuts_flower.json``.

    python benchmarks/federated_nuts_flower.py [--only eight] [--chains 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

import jax
import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from federated_nuts import SAMPLES, WARMUP, pooled_nuts, problems, scalars  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.flower import FederationError, LocalFederation  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "federated_nuts_flower.json"
WHOLE = ("six_cities_glmm", "eight_schools-eight_schools_noncentered")  # measured whole
SHORT = {"GLMM_Poisson_data-GLMM_Poisson_model": (1, 20, 20)}  # chains, warmup, samples measured

TASKS = '''
import sys
sys.path.insert(0, {bench!r})
from federated_nuts import WARMUP, SAMPLES, problems
from numpyro_fed import FederatedNUTS
from numpyro_fed.flower import FlowerTask

CHAINS, WARMUP, SAMPLES = {chains}, {warmup}, {samples}


def _task(name):
    problem = next(p for p in problems() if p[0] == name)
    clients = problem[4]

    def load_client(node_config):
        site = clients.names[int(node_config["partition-id"])]
        return site, dict(clients[site])

    return FlowerTask(lambda: FederatedNUTS(problem[1], num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS),
                      load_client)


def __getattr__(name):
    return _task(name)
'''


def one(problem, chains, warmup=WARMUP, samples=SAMPLES, seed=0, workdir=None):
    name, model, pooled_model, pooled_data, clients, sites = problem
    whole = (warmup, samples) == (WARMUP, SAMPLES)
    J = len(clients.names)
    configs = [{"partition-id": j, "numpyro-fed-seed": seed} for j in range(J)]
    app = {"nuts_tasks.py": TASKS.format(bench=str(HERE), chains=chains, warmup=warmup, samples=samples)}
    t0 = time.perf_counter()
    with LocalFederation(configs, app_files=app, workdir=workdir) as fed:
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        flower = fed.run(f"nuts_tasks:{name}", num_rounds=2_000_000, seed=seed, timeout=6 * 3600,
                         transcript=False)  # 10^4-10^5 rounds: the byte counts come from the traffic
        wall = time.perf_counter() - t1
    if workdir is not None:  # the per-round figure and the draws, for a later comparison
        np.savez(pathlib.Path(workdir) / f"{name}-flower.npz", trace=np.asarray(flower["trace"]),
                 **{k: np.asarray(v) for k, v in flower["params"].samples.items()})
    compared = {}
    for mapping in ("loop", "vmap"):  # one client a node (Flower's layout), and the default
        sim = nf.FederatedNUTS(model, num_warmup=warmup, num_samples=samples, num_chains=chains,
                               client_mapping=mapping).run(jax.random.PRNGKey(seed), clients)
        ours, theirs = flower["params"].samples, sim.params.samples
        diff = max(float(np.max(np.abs(np.asarray(ours[k]) - np.asarray(theirs[k]))))
                   if np.shape(ours[k]) == np.shape(theirs[k]) else float("inf") for k in theirs)
        ft, st = np.asarray(flower["trace"]), np.asarray(sim.trace)  # the per-round figure of each backend
        n = min(len(ft), len(st))
        apart = np.flatnonzero(np.abs(ft[:n] - st[:n]) > 1e-4 * (1.0 + np.abs(st[:n])))
        compared[mapping] = (int(sim.communication.rounds), int(apart[0]) + 1 if apart.size else None, diff)
    secs = flower["round_seconds"]
    warm = float(np.mean(secs[1:]))
    row = {"posterior": name, "clients": J, "chains": chains, "warmup": warmup, "samples": samples,
           "whole_run": whole, "federation_start_seconds": started, "end_to_end_seconds": wall,
           "server_run_seconds": flower["seconds"], "rounds": len(secs), "first_round_seconds": secs[0],
           "warm_round_seconds": warm, "warm_round_median": float(np.median(secs[1:])),
           "setup_seconds": flower["timings"]["setup"], "bytes_up": flower["communication"]["bytes_up"],
           "bytes_down": flower["communication"]["bytes_down"], "simulation_rounds": compared["loop"][0],
           "first_round_apart_from_simulation": compared["loop"][1],
           "max_abs_difference_to_simulation": compared["loop"][2],
           "vmap_simulation_rounds": compared["vmap"][0],
           "first_round_apart_from_vmap_simulation": compared["vmap"][1],
           "max_abs_difference_to_vmap_simulation": compared["vmap"][2],
           "warnings": flower["warnings"]}
    if whole:
        ref = scalars(pooled_nuts(pooled_model, pooled_data, 2), sites)
        ours = scalars({k: np.asarray(v) for k, v in flower["params"].samples.items()}, sites)  # (chains, samples)
        z = {k: abs(float(ours[k].mean() - ref[k].mean())) / float(ref[k].std()) for k in ref}
        row.update(max_abs_z_to_pooled_nuts=max(z.values()), worst_site=max(z, key=z.get))
    else:  # the whole run's rounds (simulation backend, the same schedule) times the warm round
        rounds, source = whole_run_rounds(problem, seed)
        row.update(whole_run_rounds=rounds, whole_run_rounds_from=source,
                   projected_whole_run_hours=rounds * warm / 3600.0)
    return row


def whole_run_rounds(problem, seed):
    """Rounds of the whole run (4 chains x (WARMUP + SAMPLES)) and where the figure comes from:
    ``federated_nuts.json``'s row when that benchmark has run (its run with key 2), else a
    simulation run here with key ``seed``."""
    name, model = problem[0], problem[1]
    path = HERE / "results" / "federated_nuts.json"
    rows = {r["posterior"]: r for r in json.loads(path.read_text())["results"]} if path.exists() else {}
    if name in rows and (rows[name]["warmup"], rows[name]["samples"]) == (WARMUP, SAMPLES):
        return int(rows[name]["communication"]["rounds"]), "federated_nuts.json"
    full = nf.FederatedNUTS(model, num_warmup=WARMUP, num_samples=SAMPLES, num_chains=4)
    fit = full.run(jax.random.PRNGKey(seed), problem[4])
    return int(full.communication_per_draw(fit)["rounds"]), f"simulation, key {seed}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the posteriors whose name contains this")
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--merge-only", action="store_true",
                        help="only copy this script's last results into federated_nuts.json")
    parser.add_argument("--iterations", type=int, nargs=2, metavar=("WARMUP", "SAMPLES"),
                        help="shorten every run to these (a smoke test; the JSON then says whole_run false)")
    parser.add_argument("--workdir", default=None, help="keep the federation's folder (its logs) here")
    args = parser.parse_args(argv)
    if args.merge_only:
        return merge()
    out = []
    for problem in problems():
        if args.only in problem[0] and (problem[0] in WHOLE or problem[0] in SHORT):
            chains, warmup, samples = SHORT.get(problem[0], (args.chains, WARMUP, SAMPLES))
            if args.iterations:
                warmup, samples = args.iterations
            try:
                row = one(problem, chains, warmup, samples, workdir=args.workdir)
            except FederationError as err:  # recorded, not hidden: e.g. a set-up the server cannot do
                row = {"posterior": problem[0], "error": str(err).splitlines()[0]}
            out.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "warnings"}), flush=True)
    kept = json.loads(RESULTS.read_text())["results"] if RESULTS.exists() else []  # rows not rerun stay
    ran = {row["posterior"] for row in out}
    out = [row for row in kept if row["posterior"] not in ran] + out
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                                   "results": out}, indent=1))
    merge()


def merge():
    """Fill ``flower_stream`` / ``measured_flower_seconds`` of ``federated_nuts.json``'s rows from
    this script's results (``federated_nuts.py`` reads them the same way when it runs)."""
    from federated_nuts import flower_stream

    path = HERE / "results" / "federated_nuts.json"
    if not path.exists():
        return
    doc = json.loads(path.read_text())
    for row in doc["results"]:
        row.update(flower_stream(row["posterior"], row["communication"]["rounds"]))
    path.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

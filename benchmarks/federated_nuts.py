"""Federated NUTS against NumPyro's NUTS on the pooled data: the demo's GLMM and two
posteriors of the external suite, in simulation, in one process.

    python benchmarks/federated_nuts.py              # all three
    python benchmarks/federated_nuts.py --only eight # posteriors whose name contains it

For each posterior both samplers run the same chains, warmup and draws (4 x (500 + 1000)); each
is timed twice and the second (warm: compiled) run's time is the one used. Reported:

- ``max_abs_z``: over the global scalars, |federated mean - pooled mean| / pooled sd (target <= 0.1);
- ``ess_per_second_ratio``: (min bulk ESS / warm seconds) federated over pooled (target >= 0.5);
- rounds and bytes in all, per draw and per effective sample (``communication_per_draw``);
- ``projected_flower_hours``: rounds times the stock Flower warm round on loopback
  (``benchmarks/results/flower_rounds.json``, 3 SuperNodes): days at that latency;
- ``flower_stream``: over the run's stream (``LocalFederation``'s default), from
  ``benchmarks/results/federated_nuts_flower.json`` (``benchmarks/federated_nuts_flower.py``,
  which also fills it in here): the measured warm round, the projected hours (this run's
  rounds times it) and the measured end-to-end seconds of a whole run over Flower (or of the
  shortened run it measured, named), and ``measured_flower_seconds`` the whole run's.

Writes ``benchmarks/results/federated_nuts.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import jax
import numpy as np
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed_examples.models import logistic_glmm

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "posteriordb"))
from pdb_models import eight_schools, glmm_poisson  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "federated_nuts.json"
CHAINS, WARMUP, SAMPLES = 4, 500, 1000


def six_cities():
    """The demo's GLMM (non-centred), two silos; the pooled model is the same model on the pooled rows."""
    data = load_six_cities()
    clients = nf.Clients.split(six_cities_silos(), **data)

    def model(wheeze, age, smoke):
        return logistic_glmm(wheeze, age, smoke, centered=False)

    return "six_cities_glmm", model, model, data, clients, {"beta": 4, "omega": None}


def suite(post, sites):
    return post.name, post.model, post.pooled, post.pooled_data, post.clients, sites


def problems():
    return [six_cities(), suite(eight_schools(), {"mu": None, "tau": None}),
            suite(glmm_poisson(), {s: None for s in ("alpha", "beta1", "beta2", "beta3", "sigma")})]


def scalars(draws, sites):
    """``{name: (chains, samples)}`` for every global scalar."""
    out = {}
    for site, size in sites.items():
        x = np.asarray(draws[site])
        if size is None:
            out[site] = x
        else:
            out.update({f"{site}[{k}]": x[..., k] for k in range(size)})
    return out


def pooled_nuts(model, data, seed):
    mcmc = MCMC(NUTS(model), num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), **data)
    jax.block_until_ready(mcmc.get_samples())
    return mcmc.get_samples(group_by_chain=True)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def cold_then_warm(inference, clients, seeds):
    """``inference.run`` twice with the keys ``seeds``: the second reuses the first's compiled
    programs. Returns ``(the second result, cold seconds, warm seconds)``."""
    def fit(seed):
        result = inference.run(jax.random.PRNGKey(seed), clients)
        jax.block_until_ready(result.state)
        return result

    _, cold = timed(lambda: fit(seeds[0]))
    result, warm = timed(lambda: fit(seeds[1]))
    return result, cold, warm


def min_ess(draws):
    return min(float(effective_sample_size(x)) for x in draws.values())


def bench(name, model, pooled_model, pooled_data, clients, sites, round_seconds):
    _, cold_pooled = timed(lambda: pooled_nuts(pooled_model, pooled_data, 1))
    ref, warm_pooled = timed(lambda: pooled_nuts(pooled_model, pooled_data, 2))
    ref = scalars(ref, sites)
    fed = nf.FederatedNUTS(model, num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS)
    result, cold_fed, warm_fed = cold_then_warm(fed, clients, (1, 2))
    ours = scalars(fed.get_samples(result, group_by_chain=True), sites)
    z = {k: abs(float(ours[k].mean() - ref[k].mean())) / float(ref[k].std()) for k in ref}
    ess_fed, ess_pooled = min_ess(ours), min_ess(ref)
    comm = fed.communication_per_draw(result)
    divergences = int(fed.sample_stats(result)["diverging"].sum())
    return {
        "posterior": name, "clients": len(clients), "chains": CHAINS, "warmup": WARMUP, "samples": SAMPLES,
        "max_abs_z": max(z.values()), "worst_site": max(z, key=z.get),
        "sd_ratio_min": min(float(ours[k].std() / ref[k].std()) for k in ref),
        "sd_ratio_max": max(float(ours[k].std() / ref[k].std()) for k in ref),
        "min_ess_federated": ess_fed, "min_ess_pooled": ess_pooled,
        "seconds_federated": {"cold": cold_fed, "warm": warm_fed},
        "seconds_pooled": {"cold": cold_pooled, "warm": warm_pooled},
        "ess_per_second_ratio": (ess_fed / warm_fed) / (ess_pooled / warm_pooled),
        "divergences_federated": divergences,
        "communication": comm,
        "flower_round_seconds": round_seconds,
        "projected_flower_hours": comm["rounds"] * round_seconds / 3600.0,
        **flower_stream(name, comm["rounds"]),
    }


def flower_stream(name, rounds):
    """``{"flower_stream": ..., "measured_flower_seconds": ...}`` for one posterior from
    ``benchmarks/federated_nuts_flower.py``'s results (``None`` where it has no row)."""
    path = HERE / "results" / "federated_nuts_flower.json"
    rows = {r["posterior"]: r for r in json.loads(path.read_text())["results"]} if path.exists() else {}
    row = rows.get(name)
    if row is None or "warm_round_seconds" not in row:
        return {"flower_stream": None, "measured_flower_seconds": None}
    whole = bool(row.get("whole_run"))
    return {"flower_stream": {
        "clients_supernodes": row["clients"], "warm_round_seconds": row["warm_round_seconds"],
        "projected_hours": rounds * row["warm_round_seconds"] / 3600.0,
        "measured_run": "whole" if whole else f"{row['chains']} x ({row['warmup']} + {row['samples']})"
        + ("" if row.get("completed", True) else f", stopped at round {row['stopped_at_round']}"),
        "measured_end_to_end_seconds": row.get("end_to_end_seconds"),
        "measured_rounds": row.get("rounds", row.get("stopped_at_round"))},
        "measured_flower_seconds": row["end_to_end_seconds"] if whole else None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the posteriors whose name contains this")
    args = parser.parse_args(argv)
    rounds = json.loads((HERE / "results" / "flower_rounds.json").read_text())
    latency = next(s["pvi_warm_round_seconds"] for s in rounds["sizes"] if s["nodes"] == 3)
    out = []
    for problem in problems():
        if args.only not in problem[0]:
            continue
        row = bench(*problem, latency)
        out.append(row)
        print(f"{row['posterior']}: max|z| {row['max_abs_z']:.3f} ({row['worst_site']}), ESS/s ratio "
              f"{row['ess_per_second_ratio']:.2f}, rounds {row['communication']['rounds']}, "
              f"rounds/ESS {row['communication']['rounds_per_ess']:.1f}, bytes/ESS "
              f"{row['communication']['bytes_per_ess']:.0f}, projected Flower {row['projected_flower_hours']:.0f} h",
              flush=True)
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "cpus": 2, "jax": jax.__version__,
                                   "results": out}, indent=1))


if __name__ == "__main__":
    main()

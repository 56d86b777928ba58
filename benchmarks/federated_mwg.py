"""Exact federated Metropolis-within-Gibbs (``numpyro_fed.mcmc.mwg_inference.FederatedMwG``)
against NumPyro's NUTS on the pooled data, in simulation, in one process.

    python benchmarks/federated_mwg.py              # every posterior
    python benchmarks/federated_mwg.py --only eight # posteriors whose name contains it
    python benchmarks/federated_mwg.py --table      # the docs' table from the last results

Posteriors: the demo's GLMM (six cities, 2 silos), every posterior of the external suite with
local latents (eight schools, radon, surgical, seeds, rats, the Poisson GLMM) and a synthetic
logistic GLMM over 1000 clients. Pooled NUTS runs 4 x (500 + 1000); the sampler 4 chains of
``WARMUP + SAMPLES`` iterations (one round each) after its Laplace start. Each is run twice,
cold (compiling) and warm, and both times are reported; the ESS-per-second ratio uses the warm
runs of both. Reported per posterior:

- exactness: per global scalar, |mean - pooled mean| in the standard error of that difference
  (``sqrt(MCSE^2 + MCSE_pooled^2)``, each sd / sqrt(ESS); target <= 3) and the sd ratio (target
  within 10 %); for the suite's posteriors the same against the suite's reference as well
  (posteriordb's draws, or its own long NUTS run: ``reference``);
- ``rounds_per_ess``: all rounds (the Laplace start's, warmup and sampling) over the smallest
  bulk ESS of the global scalars (target <= 3 on the demo's GLMM, <= 5 on the suite); bytes the same;
- ``ess_per_second_ratio``: (min ESS / warm seconds) of the sampler over pooled NUTS's (target >= 0.5);
- ``federated_nuts``: ``FederatedNUTS`` (4 x (500 + 1000)) run in this process, cold and warm, on
  the demo's GLMM, eight schools, radon, the Poisson GLMM and the 1000-client GLMM: its rounds,
  bytes and ESS per round and per warm second; ``ess_per_second_ratio_to_federated_nuts`` the
  sampler's warm ESS per second over its.

Writes ``benchmarks/results/federated_mwg.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size

import numpyro_fed as nf
from numpyro_fed.mcmc import FederatedMwG
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed_examples.models import logistic_glmm

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "posteriordb"))
sys.path.insert(0, str(HERE))
import pdb_models  # noqa: E402
from federated_nuts import cold_then_warm, pooled_nuts, timed  # noqa: E402  (NUTS on the pooled data: 4 x (500 + 1000))
from provenance import provenance  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "federated_mwg.json"
NUTS_RESULTS = HERE / "results" / "federated_nuts.json"
CHAINS, WARMUP, SAMPLES = 4, 300, 1000
#: posteriors on which FederatedNUTS runs too, in the same process (4 x (500 + 1000))
WITH_FEDERATED_NUTS = ("six_cities_glmm", "eight_schools-eight_schools_noncentered",
                       "radon_mn-radon_variable_intercept_noncentered", "GLMM_Poisson_data-GLMM_Poisson_model",
                       "logistic_glmm_1000_clients")


def six_cities():
    data = load_six_cities()

    def model(wheeze, age, smoke):
        return logistic_glmm(wheeze, age, smoke, centered=False)

    return "six_cities_glmm", model, model, data, nf.Clients.split(six_cities_silos(), **data), \
        {"beta": 4, "omega": None}


def many_clients(num_clients=1000, groups=2, rows=5, seed=0):
    """A logistic GLMM over ``num_clients`` clients, ``groups`` groups each (their intercepts
    local), ``rows`` rows per group; data synthesised from the model."""
    rng = np.random.default_rng(seed)
    G = num_clients * groups
    x = rng.normal(size=(G, rows)).astype(np.float32)
    b = 0.8 * rng.normal(size=G)
    y = (rng.uniform(size=(G, rows)) < 1 / (1 + np.exp(-(-0.5 + 1.0 * x + b[:, None])))).astype(np.float32)

    def model(x, y):
        a = numpyro.sample("a", dist.Normal(0.0, 5.0))
        slope = numpyro.sample("slope", dist.Normal(0.0, 5.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        with numpyro.plate("groups", y.shape[0]):
            with nf.local_site():
                eta = numpyro.sample("eta", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Bernoulli(logits=a + slope * x + sigma * eta[:, None]).to_event(1), obs=y)

    def pooled(x, y):
        a = numpyro.sample("a", dist.Normal(0.0, 5.0))
        slope = numpyro.sample("slope", dist.Normal(0.0, 5.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        with numpyro.plate("groups", y.shape[0]):
            eta = numpyro.sample("eta", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Bernoulli(logits=a + slope * x + sigma * eta[:, None]).to_event(1), obs=y)

    clients = nf.Clients.split(np.repeat(np.arange(num_clients), groups), x=x, y=y)
    return f"logistic_glmm_{num_clients}_clients", model, pooled, dict(x=x, y=y), clients, \
        {"a": None, "slope": None, "sigma": None}


def suite_problems():
    out = []
    for post in (pdb_models.eight_schools(), pdb_models.radon(), pdb_models.surgical(), pdb_models.seeds(),
                 pdb_models.rats(), pdb_models.glmm_poisson()):
        sites = {}
        for key in post.sites:  # "alpha[2]": the site alpha, a vector of at least 3
            base, _, rest = key.partition("[")
            sites[base] = max(sites.get(base) or 0, int(rest.rstrip("]")) + 1) if rest else None
        out.append((post.name, post.model, post.pooled, post.pooled_data, post.clients, sites, post))
    return out


def problems():
    return [six_cities(), *suite_problems(), many_clients()]


def scalars(draws, sites):
    """``{name: (chains, samples)}`` for every global scalar."""
    out = {}
    for site, size in sites.items():
        x = np.asarray(draws[site])
        if size is None and x.ndim > 2:
            size = x.shape[-1]
        if size is None:
            out[site] = x
        else:
            out.update({f"{site}[{k}]": x[..., k] for k in range(size)})
    return out


def federated_nuts_figure(name):
    if not NUTS_RESULTS.exists():
        return None
    rows = json.loads(NUTS_RESULTS.read_text()).get("results", [])
    for row in rows:
        if row.get("posterior") == name:
            return row.get("communication", {}).get("rounds_per_ess")
    return None


def against_reference(ours, ess, post):
    """The suite's reference (posteriordb's draws, or its own long NUTS run): per scalar the
    mean's difference in its standard error and the sd ratio."""
    from posteriordb_suite import reference

    ref, source = reference(post)
    z, ratio = {}, {}
    for k, x in ours.items():
        r = ref[k]
        ref_ess = float(r.get("ess_bulk", 10000.0))  # posteriordb: 10,000 draws
        z[k] = abs(float(x.mean()) - r["mean"]) / float(np.sqrt(x.var() / ess[k] + r["sd"] ** 2 / ref_ess))
        ratio[k] = float(x.std(ddof=1)) / r["sd"]
    return {"source": source, "mcse_z": z, "sd_ratio": ratio,
            "within": bool(max(z.values()) <= 3 and all(abs(v - 1) <= 0.1 for v in ratio.values()))}


def federated_nuts(model, clients, sites):
    """``FederatedNUTS`` in this process, 4 chains x (500 + 1000), cold then warm: its rounds,
    bytes and ESS per round and per warm second."""
    fed = nf.FederatedNUTS(model, num_warmup=500, num_samples=1000, num_chains=CHAINS)
    fed.progress_bar = False
    result, cold, warm = cold_then_warm(fed, clients, (3, 4))
    draws = scalars(fed.get_samples(result, group_by_chain=True), sites)
    min_ess = min(float(effective_sample_size(v)) for v in draws.values())
    c = result.communication
    return {"rounds": int(c.rounds), "min_ess": min_ess, "rounds_per_ess": int(c.rounds) / min_ess,
            "bytes_per_ess": (int(c.bytes_up) + int(c.bytes_down)) / min_ess,
            "seconds": {"cold": cold, "warm": warm}, "ess_per_warm_second": min_ess / warm}


def bench(name, model, pooled_model, pooled_data, clients, sites, post=None):
    _, cold_pooled = timed(lambda: pooled_nuts(pooled_model, pooled_data, 1))
    ref, warm_pooled = timed(lambda: pooled_nuts(pooled_model, pooled_data, 2))
    ref = scalars(ref, sites)
    fed_nuts = federated_nuts(model, clients, sites) if name in WITH_FEDERATED_NUTS else None
    try:
        row = _mwg(name, model, clients, sites, post, ref, cold_pooled, warm_pooled, fed_nuts)
    except ValueError as err:  # e.g. no Laplace mode to start from: recorded, not hidden
        row = {"posterior": name, "clients": len(clients), "error": f"{type(err).__name__}: {err}"}
    row["federated_nuts"] = fed_nuts
    return row


def _mwg(name, model, clients, sites, post, ref, cold_pooled, warm_pooled, fed_nuts):
    mwg = FederatedMwG(model, num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS)
    mwg.progress_bar = False

    result, cold, warm = cold_then_warm(mwg, clients, (1, 2))
    ours = scalars(mwg.get_samples(result, group_by_chain=True), sites)
    ess = {k: float(effective_sample_size(v)) for k, v in ours.items()}
    ess_ref = {k: float(effective_sample_size(v)) for k, v in ref.items()}
    # the difference of two Monte Carlo estimates, in its own standard error (both chains' MCSEs)
    mcse_z = {k: abs(float(ours[k].mean() - ref[k].mean()))
              / float(np.sqrt(ours[k].var() / ess[k] + ref[k].var() / ess_ref[k])) for k in ref}
    sd_ratio = {k: float(ours[k].std() / ref[k].std()) for k in ref}
    laplace = mwg.start_communication  # the Laplace start's rounds (also when it found no mode)
    rounds = int(result.communication.rounds) + int(laplace.rounds)
    bytes_ = sum(int(c.bytes_up) + int(c.bytes_down) for c in (result.communication, laplace))
    min_ess = min(ess.values())
    ess_pooled = min(float(effective_sample_size(v)) for v in ref.values())
    return {
        "posterior": name, "clients": len(clients), "chains": CHAINS, "warmup": WARMUP, "samples": SAMPLES,
        "max_mcse_z": max(mcse_z.values()), "worst_site": max(mcse_z, key=mcse_z.get),
        "sd_ratio_min": min(sd_ratio.values()), "sd_ratio_max": max(sd_ratio.values()),
        "within": bool(max(mcse_z.values()) <= 3 and all(abs(r - 1) <= 0.1 for r in sd_ratio.values())),
        "mcse_z": mcse_z, "sd_ratio": sd_ratio,
        "min_ess": min_ess, "min_ess_pooled": ess_pooled, "ess": ess,
        "acceptance": mwg.acceptance(result),
        "rounds": rounds, "laplace_rounds": int(laplace.rounds), "rounds_per_ess": rounds / min_ess,
        "bytes": bytes_, "bytes_per_ess": bytes_ / min_ess,
        "seconds": {"cold": cold, "warm": warm}, "seconds_pooled": {"cold": cold_pooled, "warm": warm_pooled},
        "ess_per_second_ratio": (min_ess / warm) / (ess_pooled / warm_pooled),
        "federated_nuts_rounds_per_ess": fed_nuts["rounds_per_ess"] if fed_nuts else federated_nuts_figure(name),
        "ess_per_second_ratio_to_federated_nuts": (min_ess / warm) / fed_nuts["ess_per_warm_second"]
        if fed_nuts else None,
        "reference": against_reference(ours, ess, post) if post is not None else None,
    }


LABELS = {"six_cities_glmm": "six-cities GLMM (demo, non-centred)",
          "eight_schools-eight_schools_noncentered": "eight schools non-centred",
          "radon_mn-radon_variable_intercept_noncentered": "radon (varying intercept)",
          "surgical_data-surgical_model": "surgical", "seeds_data-seeds_model": "seeds", "rats_data-rats_model": "rats",
          "GLMM_Poisson_data-GLMM_Poisson_model": "Poisson GLMM",
          "logistic_glmm_1000_clients": "logistic GLMM, synthetic"}


def table_rows(results: dict) -> list:
    """docs/benchmarks.md's table (markdown rows) from the results JSON."""
    rows = ["| posterior | clients | vs pooled: max z / sd ratio | vs reference: max z / sd ratio | min ESS / pooled | "
            "rounds (Laplace) | rounds per ESS | FederatedNUTS rounds per ESS | kB per ESS (FederatedNUTS) | "
            "seconds cold / warm / pooled warm / FederatedNUTS warm | ESS/s vs pooled NUTS | ESS/s vs FederatedNUTS |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["results"]:
        if "error" in r:
            rows.append(f"| {LABELS.get(r['posterior'], r['posterior'])} | {r['clients']} | {r['error']} |"
                        + " – |" * 9)
            continue
        ref = r.get("reference")
        if ref:
            z, ratio = ref["mcse_z"], ref["sd_ratio"]
            source = "posteriordb" if ref["source"] == "posteriordb" else "own NUTS"
            vs_ref = (f"{max(z.values()):.2f} / {min(ratio.values()):.2f}-{max(ratio.values()):.2f} ({source})")
        else:
            vs_ref = "–"
        fed = r.get("federated_nuts")
        fed_per = r.get("federated_nuts_rounds_per_ess")
        kb = f"{r['bytes_per_ess'] / 1e3:,.1f}" + (f" ({fed['bytes_per_ess'] / 1e3:,.0f})" if fed else "")
        warm_fed = f"{fed['seconds']['warm']:.1f}" if fed else "–"
        to_fed = r.get("ess_per_second_ratio_to_federated_nuts")
        rows.append(
            f"| {LABELS.get(r['posterior'], r['posterior'])} | {r['clients']} | {r['max_mcse_z']:.2f} / "
            f"{r['sd_ratio_min']:.2f}-{r['sd_ratio_max']:.2f} | {vs_ref} | "
            f"{r['min_ess']:.0f} / {r['min_ess_pooled']:.0f} | "
            f"{r['rounds']:,} ({r['laplace_rounds']}) | **{r['rounds_per_ess']:.2f}** | "
            f"{f'{fed_per:.1f}' if fed_per else '–'} | {kb} | "
            f"{r['seconds']['cold']:.1f} / {r['seconds']['warm']:.1f} / "
            f"{r['seconds_pooled']['warm']:.1f} / {warm_fed} | **{r['ess_per_second_ratio']:.2f}** | "
            f"{f'**{to_fed:.2f}**' if to_fed else '–'} |")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--table", action="store_true", help="print the docs' table from the last results")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(table_rows(json.loads(RESULTS.read_text()))))
        return
    old = json.loads(RESULTS.read_text()).get("results", []) if RESULTS.exists() else []
    rows = {r["posterior"]: r for r in old}
    for problem in problems():
        if args.only and args.only not in problem[0]:
            continue
        row = bench(*problem)
        rows[row["posterior"]] = row
        print(json.dumps({k: v for k, v in row.items() if k != "ess"}), flush=True)
    out = {"command": "python benchmarks/federated_mwg.py", **provenance(), "machine": platform.machine(),
           "cpus": __import__("os").cpu_count(), "jax": jax.__version__,
           "times_include": "cold: the whole run (the Laplace start, compiling, sampling); warm: the same run again, "
                            "compiled; pooled NUTS: MCMC.run, cold and then warm",
           "results": list(rows.values())}
    RESULTS.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

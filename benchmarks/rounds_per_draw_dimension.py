"""Rounds per effective draw against the number of global sites, on a logistic regression with a
random intercept per client, for the exact federated samplers, in simulation, in one process.

    python benchmarks/rounds_per_draw_dimension.py                 # 10, 30, 100, 300, 1000 covariates
    python benchmarks/rounds_per_draw_dimension.py --covariates 10 30
    python benchmarks/rounds_per_draw_dimension.py --samplers federated_nuts_chains   # one sampler, others kept
    python benchmarks/rounds_per_draw_dimension.py --table         # the docs' table from the last results
    python benchmarks/rounds_per_draw_dimension.py --plot          # docs/img/rounds_per_draw_dimension.png from them

The model: ``beta ~ N(0, 1)`` per covariate, an intercept ``b0 ~ N(0, 2)``, the clients' intercepts
``a_j ~ N(0, tau)`` (local: never sent) with ``tau ~ HalfNormal(1)``; 8,000 rows over 4 clients of
unequal size (1,000, 1,500, 2,500 and 3,000 rows), covariates scaled so that the linear predictor's sd
is about 1.5 whatever their number. The globals are the covariates plus two.

Each sampler starts from the same federated Laplace fit (its rounds counted) and runs 4 chains of
300 warmup and 1,000 kept iterations, one round each:

- ``surrogate``: ``FederatedMwG(moves="surrogate")``, the globals moved by the surrogate transition
  with delayed acceptance (:mod:`numpyro_fed.mcmc.surrogate`), the intercept and scale by an
  independence move of their block every other round;
- ``independence``: ``FederatedMwG(moves="independence")``, every global moved at once by the
  independence (i-SIR) and random-walk moves;
- ``federated_nuts``: projected, not run: federated NUTS spends one round per leapfrog step, the
  chains side by side, so its rounds are the sum over iterations of the most leapfrog steps any
  chain took, counted on NumPyro's NUTS on the pooled data (4 chains of 500 + 1,000, the same
  algorithm), over that run's smallest bulk ESS;
- ``federated_nuts_chains``: run: federated NUTS as ``nf.fit`` runs it, many short chains side by
  side (``numpyro_fed.fitting.rung_choice.NUTS_CHAINS``, 100 warmup and 64 draws each) from the Laplace fit.

Reported per size: rounds over the smallest bulk ESS of the global scalars (every round, the
Laplace start's included), split R-hat, and for the samplers the largest |mean - pooled NUTS's
mean| in pooled posterior sds and the largest |sd ratio - 1| over the global scalars (pooled NUTS
is run where it fits in the time: up to 300 covariates). Writes
``benchmarks/results/rounds_per_draw_dimension.json`` (merged by size with earlier runs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.fitting.ladder import WARM_WARMUP
from numpyro_fed.fitting.rung_choice import NUTS_CHAINS, nuts_draws
from numpyro_fed.mcmc import FederatedMwG

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from provenance import provenance  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "rounds_per_draw_dimension.json"
ROWS, SIZES = 8000, (1000, 1500, 2500, 3000)
CHAINS, WARMUP, SAMPLES = 4, 300, 1000
NUTS_UP_TO = 300  # covariates up to which pooled NUTS runs (its cost grows like rows x covariates x steps)
SAMPLERS = ("federated_nuts", "surrogate", "independence", "federated_nuts_chains")


def pooled_model(x, client, y=None):
    beta = numpyro.sample("beta", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
    b0 = numpyro.sample("b0", dist.Normal(0, 2))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("clients", len(SIZES)):
        a = numpyro.sample("a", dist.Normal(0, tau))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + a[client] + x @ beta), obs=y)


def model(x, y=None):
    beta = numpyro.sample("beta", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
    b0 = numpyro.sample("b0", dist.Normal(0, 2))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with nf.local_site():
        a = numpyro.sample("a", dist.Normal(0, tau))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + a + x @ beta), obs=y)


def data(p: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, p)) * 1.5 / np.sqrt(p)
    client = np.repeat(np.arange(len(SIZES)), SIZES)
    a = 0.5 * rng.normal(size=len(SIZES))
    y = rng.binomial(1, 1 / (1 + np.exp(-(x @ rng.normal(size=p) + a[client] - 0.3))))
    return x.astype(np.float32), y.astype(np.float32), client


def scalars(draws):
    """``{name: (chains, samples)}`` of every global scalar."""
    out = {}
    for k in ("b0", "tau", "beta"):
        v = np.asarray(draws[k])
        flat = v.reshape(v.shape[0], v.shape[1], -1)
        for i in range(flat.shape[-1]):
            out[k if flat.shape[-1] == 1 else f"{k}[{i}]"] = flat[..., i]
    return out


def chain_figures(draws, rounds):
    s = scalars(draws)
    ess = {k: float(effective_sample_size(v[..., None])[0]) for k, v in s.items()}
    worst = min(ess, key=ess.get)
    return {"rounds": int(rounds), "min_ess": ess[worst], "worst_scalar": worst,
            "rounds_per_ess": float(rounds) / max(ess[worst], 1.0),
            "median_rounds_per_ess": float(rounds) / max(float(np.median(list(ess.values()))), 1.0),
            "max_r_hat": max(float(split_gelman_rubin(v[..., None])[0]) for v in s.values())}


def against(draws, reference):
    s, r = scalars(draws), scalars(reference)
    z = [abs(s[k].mean() - r[k].mean()) / r[k].std() for k in r]
    sd = [abs(s[k].std() / r[k].std() - 1) for k in r]
    return {"max_mean_error_in_sd": float(max(z)), "max_sd_ratio_error": float(max(sd))}


def run_size(p: int, samplers=SAMPLERS) -> dict:
    x, y, client = data(p)
    clients = nf.Clients.split(client, x=x, y=y)
    out = {"covariates": p, "globals": p + 2}
    reference = None
    if p <= NUTS_UP_TO and "federated_nuts" in samplers:
        t0 = time.perf_counter()
        mcmc = MCMC(NUTS(pooled_model), num_warmup=500, num_samples=SAMPLES, num_chains=CHAINS,
                    chain_method="vectorized", progress_bar=False)
        mcmc.run(jax.random.PRNGKey(3), x=x, client=client, y=y, extra_fields=("num_steps",))
        reference = mcmc.get_samples(group_by_chain=True)
        steps = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["num_steps"])  # (chains, samples)
        # (the warmup's steps are not kept by NumPyro: counted as the kept iterations' mean per iteration)
        lockstep = float(steps.max(axis=0).sum()) * (500 + SAMPLES) / SAMPLES
        figures = chain_figures(reference, lockstep)
        out["federated_nuts"] = dict(figures, seconds_pooled=time.perf_counter() - t0,
                                     divergences=int(mcmc.get_extra_fields()["diverging"].sum())
                                     if "diverging" in mcmc.get_extra_fields() else None)
    start, laplace_rounds = None, 0
    for moves in [m for m in ("surrogate", "independence") if m in samplers]:
        t0 = time.perf_counter()
        mwg = FederatedMwG(model, moves=moves, num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS,
                           init=start)
        mwg.progress_bar = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = mwg.run(jax.random.PRNGKey(1), clients)
        if start is None:  # the second sampler starts from the same Laplace fit
            start = mwg._start
            laplace_rounds = int(mwg.start_communication.rounds)
        rounds = int(result.communication.rounds) + laplace_rounds
        draws = mwg.get_samples(result, group_by_chain=True)
        figures = chain_figures(draws, rounds)
        figures.update(seconds=time.perf_counter() - t0, laplace_rounds=laplace_rounds,
                       acceptance=mwg.mixing(result)["acceptance"], verdict=result.verdict.status,
                       warnings=len([w for w in caught if "mixed" in str(w.message) or "accepted" in str(w.message)]))
        if moves == "surrogate":
            figures["divergences"] = int(np.asarray(result.state.server.divergent)[:, WARMUP:].sum())
        if reference is not None:
            figures.update(against(draws, reference))
        out[moves] = figures
        print(json.dumps({p: {moves: figures}}), flush=True)
    if "federated_nuts_chains" in samplers:
        out["federated_nuts_chains"] = many_chains(clients, start, laplace_rounds, reference)
        print(json.dumps({p: {"federated_nuts_chains": out["federated_nuts_chains"]}}), flush=True)
    return out


def many_chains(clients, start, laplace_rounds: int, reference) -> dict:
    """Federated NUTS as ``nf.fit`` runs it: :data:`~numpyro_fed.fitting.rung_choice.NUTS_CHAINS` short chains
    side by side from the Laplace fit (its mode and covariance; fitted here where no sampler ran),
    :data:`~numpyro_fed.fitting.ladder.WARM_WARMUP` warmup, ``nuts_draws(SAMPLES)`` draws each; every round
    counted, the Laplace fit's included."""
    from numpyro_fed.factor import Laplace

    if start is None:
        laplace = Laplace(model, check_fit=False)
        laplace.progress_bar = False
        fit = laplace.run(jax.random.PRNGKey(1), clients)
        start = (np.asarray(fit.params.mean), np.asarray(fit.params.cov))
        laplace_rounds = int(fit.communication.rounds)
    t0 = time.perf_counter()
    nuts = nf.FederatedNUTS(model, num_warmup=WARM_WARMUP, num_samples=nuts_draws(SAMPLES, NUTS_CHAINS),
                            num_chains=NUTS_CHAINS, init=start)
    nuts.progress_bar = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = nuts.run(jax.random.PRNGKey(2), clients)
    draws = nuts.get_samples(result, group_by_chain=True)
    figures = chain_figures(draws, int(result.communication.rounds) + laplace_rounds)
    report = nuts.mixing(result)
    figures.update(seconds=time.perf_counter() - t0, laplace_rounds=laplace_rounds, chains=NUTS_CHAINS,
                   warmup=WARM_WARMUP, draws_per_chain=nuts_draws(SAMPLES, NUTS_CHAINS),
                   divergences=int(report["divergences"]), e_bfmi=report["e_bfmi"], verdict=result.verdict.status,
                   bytes=int(result.communication.bytes_up + result.communication.bytes_down),
                   warnings=len([w for w in caught if "mixed" in str(w.message) or "E-BFMI" in str(w.message)]))
    if reference is not None:
        figures.update(against(draws, reference))
    return figures


def table(results: dict) -> str:
    rows = ["| globals | surrogate transition | independence (i-SIR) | federated NUTS, 4 chains (projected) "
            f"| federated NUTS, {NUTS_CHAINS} short chains (nf.fit's) |", "| --- | --- | --- | --- | --- |"]
    for key in sorted(results["sizes"], key=int):
        r = results["sizes"][key]
        cell = {k: f"{r[k]['rounds_per_ess']:.3g}" if k in r else "not run"
                for k in SAMPLERS}
        rows.append(f"| {r['globals']} | {cell['surrogate']} | {cell['independence']} | {cell['federated_nuts']} "
                    f"| {cell['federated_nuts_chains']} |")
    return "\n".join(rows)


def plot(results: dict, path: pathlib.Path) -> None:
    """Rounds per effective draw of the worst global scalar against the number of globals, log-log,
    one line per sampler, from ``results``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results["sizes"].values(), key=lambda r: r["globals"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("surrogate", "surrogate transition (delayed acceptance)"),
                       ("independence", "independence moves (i-SIR)"),
                       ("federated_nuts", "federated NUTS, 4 chains (projected)"),
                       ("federated_nuts_chains", f"federated NUTS, {NUTS_CHAINS} short chains (nf.fit's)")):
        pts = [(r["globals"], r[key]["rounds_per_ess"]) for r in sizes if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [r["globals"] for r in sizes]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("global scalars")
    ax.set_ylabel("rounds per effective draw (worst global scalar)")
    ax.set_title(f"logistic regression with a client effect, {ROWS:,} rows over {len(SIZES)} clients", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--covariates", type=int, nargs="*", default=[10, 30, 100, 300, 1000])
    parser.add_argument("--samplers", nargs="*", default=list(SAMPLERS), choices=SAMPLERS,
                        help="which to run (the others' results for a size are kept)")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"sizes": {}}
    if args.table:
        print(table(old))
        return
    if args.plot:
        plot(old, HERE.parent / "docs" / "img" / "rounds_per_draw_dimension.png")
        return
    sizes = dict(old.get("sizes", {}))
    for p in args.covariates:
        before = sizes.get(str(p), {})  # (a sampler not run now keeps its figures and the commit they came from)
        kept = {k: dict(v, commit=v.get("commit", before.get("commit"))) for k, v in before.items()
                if k in SAMPLERS and k not in args.samplers}
        fresh = run_size(p, tuple(args.samplers))
        now = provenance()
        fresh = {k: dict(v, commit=now["commit"]) if k in SAMPLERS else v for k, v in fresh.items()}
        sizes[str(p)] = dict(fresh, **kept, **now)
    results = {"benchmark": "rounds_per_draw_dimension", **provenance(), "machine": platform.machine(),
               "python": platform.python_version(), "jax": jax.__version__, "numpyro": numpyro.__version__,
               "chains": CHAINS, "warmup": WARMUP, "samples": SAMPLES, "rows": ROWS, "client_rows": list(SIZES),
               "sizes": sizes}
    RESULTS.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()

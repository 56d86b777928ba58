"""The main job: the six-cities wheeze data split over two silos, fitted by ``nf.fit`` (the one call),
by ``nf.fit(..., exact=True)`` (exact federated Metropolis-within-Gibbs), by exact federated NUTS and
by EP (a few rounds), next to NUTS on the pooled data; SFVI, SFVI-Avg and PVI with ``--all-methods``."""

from __future__ import annotations

import time
import warnings
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

from numpyro_fed import EP, PVI, Clients, FederatedNUTS, FederatedSVI, FitWarning, StructuredGuide, fit

from .datasets import load_six_cities, six_cities_silos
from .models import logistic_glmm

__all__ = ["run_demo"]

PARAMS = ["beta0", "beta1", "beta2", "beta3", "omega"]


def _flatten(draws) -> Dict[str, np.ndarray]:
    beta = np.asarray(draws["beta"])
    out = {f"beta{k}": beta[:, k] for k in range(4)}
    out["omega"] = np.asarray(draws["omega"]).reshape(-1)
    return out


METHODS = {  # key: (label, what it is), in the order the demo runs them
    "fit": ("nf.fit", "the one call: a federated Laplace approximation in a few Newton rounds, kept if its fit check "
                      "passes, else an exact federated sampler started from it"),
    "fit_exact": ("nf.fit exact", "nf.fit(..., exact=True): exact federated Metropolis-within-Gibbs started at the "
                                  "Laplace mode, one round per iteration, 4 chains side by side"),
    "fed_nuts": ("fed. NUTS", "exact federated NUTS, one leapfrog step per round: the pooled posterior by "
                          "construction, at the price of many rounds"),
    "ep": ("EP", "expectation propagation; each silo integrates its local latents out (block Laplace, "
                 "importance-corrected)"),
    "sfvi": ("SFVI", "structured VI, one gradient exchange per round"),
    "sfvi_avg": ("SFVI-Avg", "structured VI, local steps then averaging"),
    "pvi": ("PVI", "partitioned VI; one Gaussian over global and local sites per silo"),
}


DEFAULT_METHODS = ("fit", "fit_exact", "fed_nuts", "ep")
LEFT_OUT = (
    "Left out by default: {names}. Each fits one Gaussian over (beta, omega, b) jointly, and on this model\n"
    "every Gaussian family is biased for omega, even fitted centrally on the pooled data with NumPyro's\n"
    "full-rank AutoMultivariateNormal (docs/benchmarks.md, 'Gaussian VI on the six-cities GLMM';\n"
    "benchmarks/glmm_gaussian_vi.py). So they are not within 0.3 NUTS sds here, and their fit checks\n"
    "warn saying so. 'python -m numpyro_fed_examples demo --all-methods' runs them too."
)


def _timed(fn):
    """Run ``fn`` and return ``(result, seconds, warnings raised)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FitWarning)
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out.result.state if hasattr(out, "result") else out.state)
        seconds = time.perf_counter() - t0
    flagged = [str(w.message) for w in caught if issubclass(w.category, FitWarning)]
    return out, seconds, flagged


def run_demo(rounds=3000, avg_rounds=100, local_steps=20, ep_rounds=6, ep_tilted="laplace", ep_draws=300,
             pvi_rounds=4, pvi_steps=1000, nuts_warmup=500, nuts_samples=1000, seed=0, plot="six_cities_posterior.png",
             quiet=False, methods=DEFAULT_METHODS) -> dict:
    """Fit the six-cities GLMM federated over two silos (300 / 237 children) with the chosen
    ``methods`` (default federated NUTS and EP; any of ``"fed_nuts"``, ``"ep"``, ``"sfvi"``,
    ``"sfvi_avg"``, ``"pvi"``), next to
    NUTS on the pooled data. The methods left out are named with the reason.

    EP runs with its default tilted method (``ep_tilted="laplace"``: block Laplace with the
    importance correction); ``ep_tilted="nuts"`` fits each silo's tilted distribution by NUTS
    with ``ep_draws`` warm-up steps and draws instead.

    Returns a dict of the printed figures (posterior summaries, communication, times,
    warnings).
    """
    say = (lambda *a, **k: None) if quiet else print
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ValueError(f"methods={list(methods)}: choose one or more of {list(METHODS)}")
    data = load_six_cities()
    clients = Clients.split(six_cities_silos(seed), **data)
    say(f"six-cities wheeze data: {clients.total_rows} children in silos {clients.num_rows}")
    every = _methods(rounds, local_steps, ep_tilted, ep_draws, pvi_steps, nuts_warmup, nuts_samples)
    fits = {name: every[name] for name in METHODS if name in methods}
    left_out = [METHODS[name][0] for name in METHODS if name not in methods and name not in ("fit", "fit_exact")]
    num_rounds = {"fit": None, "fit_exact": None, "sfvi": rounds, "sfvi_avg": avg_rounds, "ep": ep_rounds,
                  "pvi": pvi_rounds,
                  "fed_nuts": None}
    draws, comm, flagged, checks = _fit_all(fits, num_rounds, clients, seed, say, quiet)
    if "sfvi_avg" in comm:
        comm["sfvi_avg"]["local_steps"] = local_steps
    say(f"\nNUTS on the pooled data ({nuts_warmup} warm-up steps, {nuts_samples} draws): the reference", flush=True)
    d_nuts, comm["nuts"] = _nuts(data, nuts_warmup, nuts_samples, seed, not quiet)
    summary, closest = _report(say, fits, draws, d_nuts, comm, flagged, checks, ep_tilted, left_out)
    if plot:
        _plot(plot, draws, d_nuts)
        say(f"\nplot saved to {plot}")
    say("\nfit check: the fitted q against the full posterior, each silo computing its own term (Pareto k and\n"
        "q's moments against the importance-weighted ones); see docs/concepts.md for what it cannot see.")
    return {"summary": summary, "communication": comm, "max_abs_z": closest, "warnings": flagged, "checks": checks,
            "left_out": left_out}


def _methods(rounds, local_steps, ep_tilted, ep_draws, pvi_steps, nuts_warmup, nuts_samples) -> dict:
    """Every method the demo can run, configured as the demo runs it."""
    guide = StructuredGuide(logistic_glmm)
    sched = optax.exponential_decay(0.05, rounds, 0.05)
    return {
        "sfvi": FederatedSVI(logistic_glmm, guide, optax.adam(sched), num_particles=4),
        "sfvi_avg": FederatedSVI(logistic_glmm, guide, optax.adam(0.02), method="sfvi_avg",
                                 local_steps=local_steps, num_particles=2),
        "ep": EP(logistic_glmm) if ep_tilted == "laplace" else
        EP(logistic_glmm, tilted=ep_tilted, num_warmup=ep_draws, num_samples=ep_draws),
        "pvi": PVI(logistic_glmm, update="optax", optim=optax.adam(0.02), local_steps=pvi_steps, num_particles=4,
                   schedule="sequential"),
        "fed_nuts": FederatedNUTS(logistic_glmm, num_warmup=nuts_warmup, num_samples=nuts_samples),
        "fit": None,  # nf.fit: a function, not an inference object
        "fit_exact": None,
    }


def _fit_all(fits, num_rounds, clients, seed, say=print, quiet=False):
    """Run each method; its posterior draws, communication and time, warnings and fit-check verdict."""
    key = random.PRNGKey(seed)
    draws, comm, flagged, checks = {}, {}, {}, {}
    for name, method in fits.items():
        label, what = METHODS[name]
        if name in ("fit", "fit_exact"):  # nf.fit: the ladder says which rung answered
            say(f"\n{label} ({what}):", flush=True)
            res, seconds, flagged[name] = _timed(lambda: fit(logistic_glmm, clients, key, exact=name == "fit_exact",
                                                             progress_bar=not quiet))
            exact = res.answer == "exact"  # the chains' draws; else 4000 draws of the Laplace answer
            draws[name] = _flatten(res.get_samples() if exact else res.sample_posterior(random.PRNGKey(1), 4000))
            comm[name] = dict(rounds=res.rounds, bytes_up=res.bytes_up, bytes_down=res.bytes_down, seconds=seconds)
            if isinstance(res.check, dict):  # a sampler: its rounds per effective sample (worst global scalar)
                comm[name]["per_draw"] = dict(min_ess=res.check["min_n_eff"],
                                              rounds_per_ess=res.rounds / res.check["min_n_eff"])
            checks[name] = f"{res.method}: " + "; ".join(res.log)
            continue
        rounds = "until every draw is in" if method.open_ended else f"{num_rounds[name]} rounds"
        say(f"\n{label} ({what}), {rounds}:", flush=True)
        if method.open_ended:  # federated NUTS: as many rounds as its trees have leaves; its own draws
            res, seconds, flagged[name] = _timed(lambda: method.run(key, clients, progress_bar=not quiet))
            draws[name] = _flatten(method.get_samples(res))
            comm[name] = dict(res.communication._asdict(), seconds=seconds,
                              per_draw=method.communication_per_draw(res))
        else:
            res, seconds, flagged[name] = _timed(lambda: method.run(key, clients, num_rounds[name],
                                                                    progress_bar=not quiet))
            draws[name] = _flatten(method.sample_posterior(random.PRNGKey(seed + 1), res, 4000))
            comm[name] = dict(res.communication._asdict(), seconds=seconds)
        checks[name] = _verdict(method)
    return draws, comm, flagged, checks


def _nuts(data, num_warmup, num_samples, seed, progress_bar=False):
    """NUTS on the pooled data: its draws and time."""
    from numpyro.infer import MCMC, NUTS

    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(logistic_glmm), num_warmup=num_warmup, num_samples=num_samples, progress_bar=progress_bar)
    mcmc.run(random.PRNGKey(seed + 2), **{k: jnp.asarray(v) for k, v in data.items()})
    return _flatten(mcmc.get_samples()), dict(seconds=time.perf_counter() - t0)


def _report(say, fits, draws, d_nuts, comm, flagged, checks, ep_tilted, left_out):
    """Print the comparison with NUTS; the summary and each method's largest |z|."""
    say("\nposterior mean (sd) of each method; z = (mean - NUTS mean) / NUTS sd")
    head = " | ".join(f"{METHODS[m][0]:>16} {'z':>5}" for m in fits)
    say(f"{'param':>6} | {head} | {'NUTS (pooled)':>16}")
    summary = {}
    for p in PARAMS:
        ref_m, ref_s = d_nuts[p].mean(), d_nuts[p].std()
        row = {m: dict(mean=float(d[p].mean()), sd=float(d[p].std()), z=float((d[p].mean() - ref_m) / ref_s))
               for m, d in draws.items()}
        row["nuts"] = dict(mean=float(ref_m), sd=float(ref_s))
        summary[p] = row
        cells = " | ".join(f"{row[m]['mean']:8.3f} ({row[m]['sd']:.3f}) {row[m]['z']:5.2f}" for m in fits)
        say(f"{p:>6} | {cells} | {ref_m:8.3f} ({ref_s:.3f})")
    closest = {m: float(max(abs(summary[p][m]["z"]) for p in PARAMS)) for m in fits}
    say("\ncommunication, time and the largest |z| (distance from NUTS in NUTS sds)")
    for name in fits:
        c = comm[name]
        say(f"  {METHODS[name][0]:>8}: {c['rounds']:5d} rounds, {c['bytes_up'] / 1e3:8.1f} kB up, "
            f"{c['bytes_down'] / 1e3:8.1f} kB down, {c['seconds']:5.1f} s, max |z| {closest[name]:.2f}"
            f", fit check: {checks[name]}{'  (warned, see below)' if flagged[name] else ''}")
    for name in ("fit_exact", "fit"):
        if "per_draw" in comm.get(name, {}):
            per = comm[name]["per_draw"]
            say(f"  {'':>8}  {METHODS[name][0]}: {per['rounds_per_ess']:.1f} rounds per effective sample (ESS "
                f"{per['min_ess']:.0f}, the Laplace start and warmup included)")
    if "fed_nuts" in comm:
        per = comm["fed_nuts"]["per_draw"]
        say(f"  {'':>8}  fed. NUTS: {per['rounds_per_draw']:.1f} rounds and {per['bytes_per_draw'] / 1e3:.1f} kB per "
            f"draw, {per['rounds_per_ess']:.1f} rounds per effective sample (ESS {per['min_ess']:.0f})")
    say(f"  {'NUTS':>8}: pooled data (no federation), {comm['nuts']['seconds']:.1f} s")
    best = min(closest, key=closest.get)
    say(f"\nclosest to NUTS: {METHODS[best][0]} ({METHODS[best][1]}), max |z| {closest[best]:.2f}.")
    if "fed_nuts" in fits:
        say("Federated NUTS is NumPyro's NUTS on the pooled data run without pooling (tested equal given the same\n"
            "randomness); here its keys differ, so it differs from the pooled run by Monte Carlo error only.")
    say("EP integrates each silo's random intercepts out and matches the marginal moments"
        + (" (tilted moments by block Laplace, importance-corrected on each silo)." if ep_tilted == "laplace"
           else f" (tilted moments by {ep_tilted} on each silo)."))
    if left_out:
        say("\n" + LEFT_OUT.format(names=", ".join(left_out)))
    for name, messages in flagged.items():
        for message in messages:
            say(f"\n{METHODS[name][0]} warned: {message}")
    return summary, closest


def _verdict(method) -> str:
    """The method's fit-check verdict, with Pareto k, or why it was not run."""
    if method.open_ended:
        return "none needed (exact MCMC; ESS and R-hat: print_summary or nf.to_arviz)"
    check = getattr(method, "last_fit_check", None)
    if check is not None:
        return f"{check.verdict} (k {check.pareto_k:.2f})"
    return "not run (no silo could integrate its local latents reliably; the silos' own local-fit checks ran)" \
        if getattr(method, "last_fit_check_skipped", None) else "not run"


LABELS = {"beta0": "beta0 (intercept)", "beta1": "beta1 (smoking mother)", "beta2": "beta2 (age)",
          "beta3": "beta3 (smoke x age)", "omega": "omega (-log sd of b)"}


def _plot(path, draws, d_nuts):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(11, 6.5))
    styles = {"sfvi": ("tab:blue", "-"), "sfvi_avg": ("tab:orange", "--"), "ep": ("tab:green", "-"),
              "pvi": ("tab:red", ":"), "fed_nuts": ("tab:purple", "-."),
              "fit": ("black", "-"), "fit_exact": ("tab:brown", "--")}
    for ax, p in zip(axes.flat, PARAMS):
        everything = [d_nuts[p]] + [d[p] for d in draws.values()]
        lo, hi = np.percentile(np.concatenate(everything), [0.2, 99.8])
        bins = np.linspace(lo, hi, 45)
        ax.hist(d_nuts[p], bins=bins, density=True, color="0.8", label="NUTS (pooled data)")
        for name, d in draws.items():
            color, line = styles[name]
            ax.hist(d[p], bins=bins, density=True, histtype="step", color=color, linestyle=line, linewidth=1.6,
                    label=METHODS[name][0])
        ax.set_xlabel(LABELS[p])
        ax.set_ylabel("posterior density")
    legend = axes.flat[-1]
    legend.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    legend.legend(handles, labels, loc="center", title="federated over 2 silos\nvs pooled NUTS", frameon=False)
    fig.suptitle("Six-cities wheeze, logistic GLMM: posterior of each method against NUTS on the pooled data")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

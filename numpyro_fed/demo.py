"""The main job: federated SFVI on the six-cities wheeze data next to centralised NUTS."""

from __future__ import annotations

import time
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

from .clients import Clients
from .datasets import load_six_cities, six_cities_silos
from .horizontal import StructuredGuide
from .models import logistic_glmm
from .horizontal import FederatedSVI

__all__ = ["run_demo"]

PARAMS = ["beta0", "beta1", "beta2", "beta3", "omega"]


def _flatten(draws) -> Dict[str, np.ndarray]:
    beta = np.asarray(draws["beta"])
    out = {f"beta{k}": beta[:, k] for k in range(4)}
    out["omega"] = np.asarray(draws["omega"]).reshape(-1)
    return out


def run_demo(rounds=3000, avg_rounds=100, local_steps=20, nuts_warmup=500, nuts_samples=1000,
             seed=0, plot="six_cities_posterior.png", quiet=False) -> dict:
    """Fit the six-cities GLMM federated over two silos (300 / 237 children).

    Returns a dict of the printed figures (posterior summaries, communication, times).
    """
    say = (lambda *a: None) if quiet else print
    data = load_six_cities()
    clients = Clients.split(six_cities_silos(seed), **data)
    say(f"six-cities wheeze data: {clients.total_rows} children in silos {clients.num_rows}")

    guide = StructuredGuide(logistic_glmm)
    sched = optax.exponential_decay(0.05, rounds, 0.05)
    sfvi = FederatedSVI(logistic_glmm, guide, optax.adam(sched), num_particles=4)
    t0 = time.perf_counter()
    res = sfvi.run(random.PRNGKey(seed), rounds, clients, progress_bar=False)
    jax.block_until_ready(res.losses)
    t_sfvi = time.perf_counter() - t0
    d_sfvi = _flatten(sfvi.sample_posterior(random.PRNGKey(seed + 1), res, 4000))

    avg = FederatedSVI(logistic_glmm, guide, optax.adam(0.02), method="sfvi_avg",
                       local_steps=local_steps, num_particles=2)
    t0 = time.perf_counter()
    res_avg = avg.run(random.PRNGKey(seed), avg_rounds, clients, progress_bar=False)
    jax.block_until_ready(res_avg.losses)
    t_avg = time.perf_counter() - t0
    d_avg = _flatten(avg.sample_posterior(random.PRNGKey(seed + 1), res_avg, 4000))

    from numpyro.infer import MCMC, NUTS

    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(logistic_glmm), num_warmup=nuts_warmup, num_samples=nuts_samples, progress_bar=False)
    mcmc.run(random.PRNGKey(seed + 2), **{k: jnp.asarray(v) for k, v in data.items()})
    t_nuts = time.perf_counter() - t0
    d_nuts = _flatten(mcmc.get_samples())

    say("\nposterior mean (sd); z = (federated mean - NUTS mean) / NUTS sd")
    say(f"{'param':>6} | {'SFVI':>16} {'z':>6} | {'SFVI-Avg':>16} {'z':>6} | {'NUTS (pooled)':>16}")
    summary = {}
    for p in PARAMS:
        ref_m, ref_s = d_nuts[p].mean(), d_nuts[p].std()
        row = {}
        for name, d in (("sfvi", d_sfvi), ("sfvi_avg", d_avg)):
            row[name] = dict(mean=float(d[p].mean()), sd=float(d[p].std()), z=float((d[p].mean() - ref_m) / ref_s))
        row["nuts"] = dict(mean=float(ref_m), sd=float(ref_s))
        summary[p] = row
        say(f"{p:>6} | {row['sfvi']['mean']:8.3f} ({row['sfvi']['sd']:.3f}) {row['sfvi']['z']:6.2f} | "
            f"{row['sfvi_avg']['mean']:8.3f} ({row['sfvi_avg']['sd']:.3f}) {row['sfvi_avg']['z']:6.2f} | "
            f"{ref_m:8.3f} ({ref_s:.3f})")
    comm = {
        "sfvi": dict(res.communication._asdict(), seconds=t_sfvi),
        "sfvi_avg": dict(res_avg.communication._asdict(), seconds=t_avg, local_steps=local_steps),
        "nuts": dict(seconds=t_nuts),
    }
    say("\ncommunication and time")
    for name in ("sfvi", "sfvi_avg"):
        c = comm[name]
        say(f"  {name:>8}: {c['rounds']} rounds, {c['bytes_up'] / 1e6:.2f} MB up, "
            f"{c['bytes_down'] / 1e6:.2f} MB down, {c['seconds']:.1f} s")
    say(f"  {'NUTS':>8}: pooled data (no federation), {t_nuts:.1f} s")
    if plot:
        _plot(plot, d_sfvi, d_avg, d_nuts)
        say(f"\nplot saved to {plot}")
    return {"summary": summary, "communication": comm}


def _plot(path, d_sfvi, d_avg, d_nuts):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PARAMS), figsize=(3.2 * len(PARAMS), 3))
    for ax, p in zip(axes, PARAMS):
        lo = min(d[p].min() for d in (d_sfvi, d_avg, d_nuts))
        hi = max(d[p].max() for d in (d_sfvi, d_avg, d_nuts))
        bins = np.linspace(lo, hi, 50)
        for d, label in ((d_nuts, "NUTS (pooled)"), (d_sfvi, "SFVI"), (d_avg, "SFVI-Avg")):
            ax.hist(d[p], bins=bins, density=True, histtype="step", label=label)
        ax.set_title(p)
    axes[0].legend(fontsize=7)
    fig.suptitle("Six-cities logistic GLMM: federated (2 silos) vs centralised NUTS")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

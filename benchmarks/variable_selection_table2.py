"""Yue et al. (2022) Table 2: federated Bayesian lasso (HM2, §4.3) variable selection, Cases I-III.

Designs (Yue et al. (2022) §5.2, after Van Erp et al., 2019), every device sharing ``theta_true``,
``x ~ N(0, I)``, noise 0.05:

- Case I: K = 10, ``theta_true = (3, 1.5, 0, 0, 2, 0, 0, 0)``, 100 training rows per device.
- Case II: as I, but devices 1-2 have 20 rows and the others 200.
- Case III: K = 20, ``theta_true = (3 x 10, 0 x 10, 3 x 10)``, 40 training rows per device.

Fit: :func:`numpyro_fed_examples.models.variable_selection` (``prior="lasso"`` or ``"ridge"``) by
federated EP (synchronous, damping 0.5, trust region ``max_kl=20``, ``--rounds`` rounds, tilted moments by NUTS with 300
warm-up steps and 300 draws; with ``--tilted laplace`` the lasso's kink leaves no smooth
local mode, which EP reports as invalid updates: it warns of rounds with no valid one and raises
when none was ever applied); then
each device samples its local posterior of ``theta_k`` (Yue et al. (2022) eq. 8, NUTS) and
includes a coefficient unless its 90% credible interval covers 0. Reported per case,
averaged over devices and ``--runs`` runs: A-RMSE of ``x theta_hat`` (posterior mean) on
1000 (Case III: 400) test rows per device against the noisy test responses, the correct
inclusion rate (share of nonzero coefficients included) and the false inclusion rate
(share of zero coefficients included), beside the paper's lasso row.

Usage: python benchmarks/variable_selection_table2.py [--runs 30] [--prior lasso] [--out PATH]
"""

import argparse
import json
import os
import time

import numpy as np
from jax import random

import numpyro_fed as nf
from numpyro_fed_examples.models import inclusion, variable_selection

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

PAPER = {  # Table 2, Lasso (HM2): A-RMSE, correct inclusion, false inclusion (sd)
    "I": {"a_rmse": (0.055, 0.001), "correct": (0.880, 0.003), "false": (0.095, 0.001)},
    "II": {"a_rmse": (0.062, 0.002), "correct": (0.875, 0.004), "false": (0.101, 0.001)},
    "III": {"a_rmse": (0.088, 0.001), "correct": (0.891, 0.005), "false": (0.115, 0.001)},
}
NOISE = 0.05


def design(case, rng):
    if case == "III":
        theta, sizes, n_test = np.array([3.0] * 10 + [0.0] * 10 + [3.0] * 10), [40] * 20, 400
    else:
        theta, n_test = np.array([3.0, 1.5, 0, 0, 2.0, 0, 0, 0]), 1000
        sizes = [100] * 10 if case == "I" else [20, 20] + [200] * 8
    d = theta.size
    xs = [rng.normal(size=(n, d)) for n in sizes]
    ys = [x @ theta + NOISE * rng.normal(size=n) for x, n in zip(xs, sizes)]
    clients = nf.Clients.split(np.repeat(np.arange(len(sizes)), sizes), x=np.concatenate(xs).astype(np.float32),
                               y=np.concatenate(ys).astype(np.float32))
    x_test = rng.normal(size=(len(sizes), n_test, d))
    y_test = x_test @ theta + NOISE * rng.normal(size=(len(sizes), n_test))
    order = np.array([int(c) for c in clients.names])
    return clients, theta, x_test[order], y_test[order]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tilted", default="nuts", choices=["nuts", "laplace", "vi"])
    parser.add_argument("--prior", default="lasso", choices=["lasso", "ridge"])
    parser.add_argument("--cases", nargs="+", default=["I", "II", "III"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out_path = args.out or os.path.join(os.path.dirname(__file__), "results", f"variable_selection_{args.prior}.json")
    ep = nf.EP(variable_selection, tilted=args.tilted, schedule="synchronous", damping=0.5,
               num_warmup=300, num_samples=300, max_kl=20.0, model_kwargs={"prior": args.prior})
    results = {}
    for case in args.cases:
        t0 = time.time()
        rows = {"a_rmse": [], "correct": [], "false": [], "rejected_rounds": [], "invalid_updates": []}
        for run in range(args.runs):
            rng = np.random.default_rng(100 * run + len(case))
            clients, theta, x_test, y_test = design(case, rng)
            res = ep.run(random.PRNGKey(run), clients, args.rounds)
            draws = np.asarray(ep.local_posterior(random.PRNGKey(run + 1), res, num_samples=1000,
                                                  num_warmup=300)["theta"])  # (K, draws, d)
            included = inclusion(draws, 0.9)  # (K, d)
            theta_hat = draws.mean(1)
            pred = np.einsum("knd,kd->kn", x_test, theta_hat)
            rows["a_rmse"].append(float(np.mean(np.sqrt(np.mean((pred - y_test) ** 2, 1)))))
            rows["correct"].append(float(included[:, theta != 0].mean()))
            rows["false"].append(float(included[:, theta == 0].mean()))
            rows["rejected_rounds"].append(int(np.sum(np.asarray(res.info.damping) == 0)))
            rows["invalid_updates"].append(int(np.sum(np.asarray(res.info.invalid))))
        results[case] = {k: {"mean": float(np.mean(v)), "sd": float(np.std(v))} for k, v in rows.items()}
        results[case]["paper_lasso"] = {k: {"mean": v[0], "sd": v[1]} for k, v in PAPER[case].items()}
        results[case]["seconds"] = time.time() - t0
        print(case, {k: round(v["mean"], 4) for k, v in results[case].items() if k in rows}, "paper", PAPER[case],
              f"{results[case]['seconds']:.0f}s", flush=True)
    out = {"design": "Yue et al. (2022) §5.2 Cases I-III",
           "prior": args.prior, "runs": args.runs, "rounds": args.rounds,
           "tilted": args.tilted, "local_posterior": "NUTS, 300 warm-up, 1000 draws", "cases": results}
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

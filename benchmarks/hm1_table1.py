"""Yue et al. (2022) Table 1: HM1 (Algorithm 1) against separate models, Cases I-IV, 30 runs.

Designs (Yue et al. (2022) §5.1):

- Case I: K = 2, Omega = [[1, .7], [.7, 1]], d = 5, noise 0.05, N = (20, 200); RMSE on
  device 1.
- Case II: K = 100, Omega a random 100 x 100 PD matrix (as R's clusterGeneration
  ``genPositiveDefMat``, "eigen" method: eigenvalues U(1, 10), random rotation), d = 8,
  noise 0.1; 30 devices with 40 rows and 70 with 275; A-RMSE over devices 1-30.
- Case III: as II with 20 rows per device; A-RMSE over all devices.
- Case IV: as III with 200 rows per device.

``Theta ~ MN(0, I, Omega)`` (each of the d rows of the d x K matrix is N(0, Omega)),
``x ~ N(0, I)``. Each device has 1000 test rows. Methods (``METHODS``):

- ``hm1``: Algorithm 1 as written, ``nf.HM1()``: C = 30 rounds, T = 20 local steps of the
  summed minibatch gradient on b = 10 rows (the paper does not state b), eta = eta_2 = 0.01,
  alpha = 0.1; ``hm1_b5`` and ``hm1_b20`` change only b.
- ``separate``: the same 600 SGD steps at 0.01 per device with no shrinkage (the paper's
  baseline, ``HM1(shrinkage=0)``).
- ``variant``: the well-behaved variant (``noise_scaled=True``, ``omega_df=K``), same SGD.
- ``variant_full_batch``: the variant with full-batch steps on the mean squared error
  (``gradient="mean"``, ``batch_size=None``, lr 0.25), which converges exactly.
- ``mean_gradient``: the previous release's reading (full-batch mean-gradient steps, lr =
  eta_2 = 0.01).
- ``oracle``: the Bayes-optimal estimate, the posterior mean of ``Theta`` with the true
  ``Omega`` and noise (a closed form, K d x K d).
- ``least_squares``: each device's own least squares.

The paper does not say whether its RMSE is against noisy test responses; with noise 0.1
its Case IV value 0.035 can only be against the noise-free mean ``x theta_k``, so both are
reported: ``rmse_mean`` (against ``x theta_k``) and ``rmse_noisy`` (against ``y``).

Usage: python benchmarks/hm1_table1.py [--runs 30] [--out PATH]
"""

import argparse
import json
import os
import time
import warnings

import numpy as np
from jax import random

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes

PAPER = {  # Table 1: mean (sd) over 30 runs
    "I": {"hm1": (0.081, 0.001), "separate": (0.094, 0.001)},
    "II": {"hm1": (0.050, 0.000), "separate": (0.056, 0.001)},
    "III": {"hm1": (0.044, 0.002), "separate": (0.072, 0.004)},
    "IV": {"hm1": (0.035, 0.000), "separate": (0.035, 0.000)},
}


def random_pd(k, rng):
    """clusterGeneration::genPositiveDefMat(k, covMethod="eigen"): Q diag(U(1, 10)) Q^T."""
    q, r = np.linalg.qr(rng.normal(size=(k, k)))
    q = q * np.sign(np.diag(r))
    return q @ np.diag(rng.uniform(1, 10, size=k)) @ q.T


def design(case, rng):
    """The case's simulated devices; returns clients, the truth (client order), test inputs,
    noise-free and noisy test responses, the scored devices, Omega and the noise."""
    if case == "I":
        omega, d, noise, sizes, scored = np.array([[1.0, 0.7], [0.7, 1.0]]), 5, 0.05, [20, 200], [0]
    else:
        omega, d, noise = random_pd(100, rng), 8, 0.1
        sizes = {"II": [40] * 30 + [275] * 70, "III": [20] * 100, "IV": [200] * 100}[case]
        scored = list(range(30)) if case == "II" else list(range(100))
    k = len(sizes)
    theta = rng.multivariate_normal(np.zeros(k), omega, size=d).T  # (K, d): rows of Theta ~ N(0, Omega)
    xs = [rng.normal(size=(n, d)) for n in sizes]
    ys = [x @ theta[j] + noise * rng.normal(size=n) for j, (x, n) in enumerate(zip(xs, sizes))]
    groups = np.repeat(np.arange(k), sizes)
    clients = nf.Clients.split(groups, x=np.concatenate(xs).astype(np.float32), y=np.concatenate(ys).astype(np.float32))
    x_test = rng.normal(size=(k, 1000, d))
    mean_test = np.einsum("knd,kd->kn", x_test, theta)
    y_test = mean_test + noise * rng.normal(size=mean_test.shape)
    order = np.array([int(c) for c in clients.names])  # clients are named by group id
    return clients, theta[order], x_test[order], mean_test[order], y_test[order], scored, omega, noise


def oracle(clients, omega, noise):
    """Posterior mean of Theta given the true Omega and noise: prior precision
    Omega^-1 ⊗ I_d (device-major), likelihood precision blockdiag(X_k^T X_k) / noise^2."""
    xs = [np.asarray(clients[n]["x"], np.float64) for n in clients.names]
    ys = [np.asarray(clients[n]["y"], np.float64) for n in clients.names]
    k, d = len(xs), xs[0].shape[1]
    order = np.array([int(c) for c in clients.names])
    precision = np.kron(np.linalg.inv(omega[np.ix_(order, order)]), np.eye(d))
    shift = np.zeros(k * d)
    for j in range(k):
        precision[j * d:(j + 1) * d, j * d:(j + 1) * d] += xs[j].T @ xs[j] / noise ** 2
        shift[j * d:(j + 1) * d] = xs[j].T @ ys[j] / noise ** 2
    return np.linalg.solve(precision, shift).reshape(k, d)


def least_squares(clients):
    return np.stack([np.linalg.lstsq(np.asarray(clients[n]["x"], np.float64), np.asarray(clients[n]["y"], np.float64),
                                     rcond=None)[0] for n in clients.names])


def methods(k):
    return {
        "hm1": nf.HM1(),
        "hm1_b5": nf.HM1(batch_size=5),
        "hm1_b20": nf.HM1(batch_size=20),
        "separate": nf.HM1(shrinkage=0.0),
        "variant": nf.HM1(noise_scaled=True, omega_df=k),
        "variant_full_batch": nf.HM1(gradient="mean", batch_size=None, lr=0.25, noise_scaled=True, omega_df=k),
        "mean_gradient": nf.HM1(gradient="mean", batch_size=None, lr=0.01, shrinkage=0.01),
    }


def rmse(theta_hat, x_test, target, scored):
    pred = np.einsum("knd,kd->kn", x_test, np.asarray(theta_hat))
    return float(np.mean([np.sqrt(np.mean((pred[k] - target[k]) ** 2)) for k in scored]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "hm1_table1.json"))
    args = parser.parse_args()
    results = {}
    for case in ("I", "II", "III", "IV"):
        t0 = time.time()
        rows, warned = {}, {}
        fitters = methods(2 if case == "I" else 100)
        for run in range(args.runs):
            rng = np.random.default_rng(1000 * run + ord(case[-1]))
            clients, theta, x_test, mean_test, y_test, scored, omega, noise = design(case, rng)
            fits = {"oracle": oracle(clients, omega, noise), "least_squares": least_squares(clients)}
            for name, method in fitters.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", nf.warnings.UnconvergedWarning)
                    fits[name] = method.run(random.PRNGKey(run), clients, 30, truth=theta).theta
                unconverged = nf.warnings.UnconvergedWarning
                warned[name] = warned.get(name, 0) + sum(issubclass(w.category, unconverged) for w in caught)
            for name, fit in fits.items():
                row = rows.setdefault(name, {"rmse_mean": [], "rmse_noisy": [], "theta_error": []})
                row["rmse_mean"].append(rmse(fit, x_test, mean_test, scored))
                row["rmse_noisy"].append(rmse(fit, x_test, y_test, scored))
                row["theta_error"].append(float(np.linalg.norm(np.asarray(fit) - theta) / np.sqrt(len(theta))))
        results[case] = {
            m: {k: {"mean": float(np.mean(v)), "sd": float(np.std(v))} for k, v in r.items()} for m, r in rows.items()
        }
        for m, n in warned.items():
            results[case][m]["unconverged_warnings"] = n
        gap = np.abs(np.array(rows["oracle"]["rmse_mean"]) - np.array(rows["least_squares"]["rmse_mean"]))
        results[case]["oracle_vs_least_squares_max_gap"] = float(gap.max())
        results[case]["paper"] = {m: {"mean": v[0], "sd": v[1]} for m, v in PAPER[case].items()}
        results[case]["seconds"] = time.time() - t0
        print(case, {m: round(results[case][m]["rmse_mean"]["mean"], 4) for m in rows},
              "paper", PAPER[case], f"{results[case]['seconds']:.1f}s", flush=True)
    out = {"design": "Yue et al. (2022) §5.1, Cases I-IV",
           "runs": args.runs, "rounds": 30, "local_steps": 20, "lr": 0.01,
           "alpha": 0.1, "batch_size": 10, "gradient": "sum", "cases": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

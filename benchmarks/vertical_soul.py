"""Vertical SOUL (Hassan et al. (2024), Appendix A) on the §5.1 logistic design, against NUTS.

Same data as ``vertical_logistic.py`` (n = 500, p = 20, seed 0). For each J and rho, SOUL
runs on the augmented and the power form; its Langevin draws of theta given z_hat are
compared with NUTS on the true model (RMSE of means in NUTS sds, mean sd ratio), next to
NUTS on the same augmented / power model, which marginalises z. The paper's caveat is
that SOUL's draws condition on the point z_hat and are therefore narrower.

The Langevin step is ``gamma = 0.1 rho^2 / n`` (the stiffest direction of
``p(theta_j | z_j)`` has curvature about ``n / rho^2``); z ascends with SGD whose rate
decays polynomially from ``0.5 rho^2`` to ``0.05 rho^2``.

Usage: python benchmarks/vertical_soul.py [--steps 4000] [--langevin 10] [--samples 1000] [--out PATH]
"""

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from vertical_logistic import N, P, make_data, nuts, split_model, summarise, theta_of

import numpyro_fed as nf

nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--langevin", type=int, default=10)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 10])
    parser.add_argument("--rhos", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "vertical_soul.json"))
    args = parser.parse_args()
    x, y, _, _ = make_data()
    rows = []
    for J in args.clients:
        model, spec = split_model(J)
        cols = np.array_split(np.arange(P), J)
        data = {"y": jnp.asarray(y), **{f"x{j}": jnp.asarray(x[:, c]) for j, c in enumerate(cols)}}
        ref = theta_of(nuts(model, data, args.samples), J)
        ref_mean, ref_sd = ref.mean(0), ref.std(0)
        for rho in args.rhos:
            for form in ("augmented", "power"):
                vmodel = nf.vertical_split(model, clients=spec, form=form, rho=rho, response="y")
                t0 = time.perf_counter()
                draws = nuts(vmodel, data, args.samples)
                rows.append({"J": J, "rho": rho, "model": form, "method": "nuts", "seconds": time.perf_counter() - t0,
                             **summarise(theta_of(draws, J), ref_mean, ref_sd)})
                print(json.dumps(rows[-1]), flush=True)
                gamma = 0.1 * rho**2 / N
                lr = optax.polynomial_schedule(0.5 * rho**2, 0.05 * rho**2, 1.0, args.steps)
                soul = nf.VerticalSOUL(vmodel, optax.sgd(lr), step_size=gamma, num_langevin=args.langevin)
                t0 = time.perf_counter()
                res = soul.run(random.PRNGKey(0), num_rounds=args.steps, progress_bar=False, **data)
                draws = soul.sample_posterior(random.PRNGKey(1), res, args.draws, thinning=5, num_warmup=2000)
                seconds = time.perf_counter() - t0
                rows.append({"J": J, "rho": rho, "model": form, "method": "SOUL (vertical)", "seconds": seconds,
                             "step_size": gamma, "final_log_joint": float(-res.losses[-200:].mean()),
                             **summarise(theta_of(draws, J), ref_mean, ref_sd)})
                print(json.dumps(rows[-1]), flush=True)
    out = {"benchmark": "vertical_soul (Hassan et al. (2024) App. A on the §5.1 design)",
           "n": N, "p": P, "steps": args.steps,
           "langevin_steps_per_round": args.langevin, "nuts_samples": args.samples, "soul_draws": args.draws,
           "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

"""Command line: ``python -m numpyro_fed_examples demo``, the six-cities demo (README's first command)."""

from __future__ import annotations

import argparse
import json
import sys

from numpyro_fed import tune_cpu_flags


def _add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="six-cities logistic GLMM federated over two silos with nf.fit, nf.fit(exact=True), exact federated "
        "NUTS and EP "
        "(--all-methods: "
        "SFVI, SFVI-Avg and PVI too), next to NUTS",
        description="Fit the logistic mixed model of Hassan et al. (2023), arXiv:2302.03314, S3.1, on the six-cities "
        "wheeze data split into two silos (300 / 237 children) with nf.fit (the one call: Laplace, checked, else "
        "an exact federated sampler started from it), nf.fit(..., exact=True) (exact federated Metropolis-within-"
        "Gibbs, one round per iteration), exact federated NUTS (one round per leapfrog step) and EP (a few "
        "rounds) (and with --all-methods SFVI, SFVI-Avg and PVI), and compare each with NUTS on the pooled "
        "data: posterior means and sds, "
        "distance from NUTS, communication and time.",
    )
    demo.add_argument("--rounds", type=int, default=3000, help="SFVI rounds (default 3000)")
    demo.add_argument("--avg-rounds", type=int, default=100, help="SFVI-Avg rounds (default 100)")
    demo.add_argument("--local-steps", type=int, default=20, help="SFVI-Avg local steps per round")
    demo.add_argument("--ep-rounds", type=int, default=6, help="EP rounds (sequential, default 6)")
    demo.add_argument("--ep-tilted", choices=("laplace", "nuts"), default="laplace",
                      help="EP's tilted method (default laplace, EP's own default: block Laplace, "
                      "importance-corrected)")
    demo.add_argument("--ep-draws", type=int, default=300,
                      help="with --ep-tilted nuts: NUTS warm-up steps and draws of each EP tilted fit (default 300)")
    demo.add_argument("--pvi-rounds", type=int, default=4, help="PVI rounds (sequential, default 4)")
    demo.add_argument("--pvi-steps", type=int, default=1000, help="PVI local optimiser steps (default 1000)")
    demo.add_argument("--nuts-warmup", type=int, default=500, help="warmup of pooled and federated NUTS")
    demo.add_argument("--nuts-samples", type=int, default=1000, help="draws of pooled and federated NUTS")
    demo.add_argument("--seed", type=int, default=0, help="the key of every fit (default 0)")
    demo.add_argument("--plot", default="six_cities_posterior.png", help="where to save the plot ('' for none)")
    demo.add_argument("--json", default="", help="also write the figures to this JSON file")
    demo.add_argument("--all-methods", action="store_true",
                      help="also run SFVI, SFVI-Avg and PVI (Gaussian VI: biased for omega on this model, and warn)")


def _write_json(path: str, out) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=2)


def _run_demo(args) -> int:
    from .demo import run_demo

    out = run_demo(
        rounds=args.rounds, avg_rounds=args.avg_rounds, local_steps=args.local_steps,
        ep_rounds=args.ep_rounds, ep_tilted=args.ep_tilted, ep_draws=args.ep_draws, pvi_rounds=args.pvi_rounds,
        pvi_steps=args.pvi_steps,
        nuts_warmup=args.nuts_warmup, nuts_samples=args.nuts_samples, seed=args.seed, plot=args.plot,
        methods=("fit", "fit_exact", "sfvi", "sfvi_avg", "ep", "pvi", "fed_nuts") if args.all_methods else
        ("fit", "fit_exact", "ep", "fed_nuts"),
    )
    _write_json(args.json, out)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numpyro_fed_examples",
                                     description="numpyro_fed's worked examples")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    args = parser.parse_args(argv)
    tune_cpu_flags()  # an application may set XLA's process-wide flags, before anything computes
    return _run_demo(args)


if __name__ == "__main__":
    sys.exit(main())

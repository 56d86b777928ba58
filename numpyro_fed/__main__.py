"""Command line: ``python -m numpyro_fed demo``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m numpyro_fed", description="numpyro_fed: federated Bayesian inference for NumPyro"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="six-cities logistic GLMM federated over two silos with SFVI / SFVI-Avg, next to NUTS",
        description="Fit the paper-001 S3.1 logistic mixed model on the six-cities wheeze data "
        "split into two silos (300 / 237 children) with SFVI and SFVI-Avg, and compare with "
        "NUTS on the pooled data.",
    )
    demo.add_argument("--rounds", type=int, default=3000, help="SFVI rounds (default 3000)")
    demo.add_argument("--avg-rounds", type=int, default=100, help="SFVI-Avg rounds (default 100)")
    demo.add_argument("--local-steps", type=int, default=20, help="SFVI-Avg local steps per round")
    demo.add_argument("--nuts-warmup", type=int, default=500)
    demo.add_argument("--nuts-samples", type=int, default=1000)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", default="six_cities_posterior.png", help="where to save the plot ('' for none)")
    demo.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        out = run_demo(
            rounds=args.rounds, avg_rounds=args.avg_rounds, local_steps=args.local_steps,
            nuts_warmup=args.nuts_warmup, nuts_samples=args.nuts_samples, seed=args.seed, plot=args.plot,
        )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

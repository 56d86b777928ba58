"""The demo's figures (``python -m numpyro_fed_examples demo``, README's Quickstart) as docs/index.md quotes
them: the demo run once, in one fresh process, at its defaults, its figures written with the commit
and date.

Each time is that method's first call in the process (tracing and compilation included) except
where a method reuses what an earlier one compiled; pooled NUTS runs last, also cold.

Usage: python benchmarks/demo_figures.py            (runs the demo: a few minutes)
       python benchmarks/demo_figures.py --table    (the docs' table from the last results)
Writes ``benchmarks/results/demo.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import platform
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from provenance import provenance  # noqa: E402

RESULTS = HERE / "results" / "demo.json"
ORDER = (("fit", "**`nf.fit`**"), ("fit_exact", "**`nf.fit(..., exact=True)`**"),
         ("fed_nuts", "**federated NUTS** (one leapfrog step per round)"), ("ep", "**EP** (its defaults)"))


def _kb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} kB"


def per_draw(rounds: float) -> str:
    """Rounds per effective draw as the docs print them."""
    return f"{rounds:,.0f}" if rounds >= 100 else f"{rounds:.2f}"


def _answer(name: str, check: str) -> str:
    """``nf.fit``'s rung that answered (its log is in the JSON), or the method's fit-check verdict."""
    return check.split(": ")[0] if name.startswith("fit") else check.split(" (exact MCMC")[0]


def table_rows(results: dict) -> list:
    """docs/index.md's table (markdown rows) from the results JSON."""
    out = results["demo"]
    comm, summary, checks = out["communication"], out["summary"], out["checks"]
    rows = ["| method | rounds | sent up / down | time | max \\|z\\| vs NUTS | beta0 (z) | omega (z) | "
            "rounds per effective draw | answered by / fit check |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, label in ORDER:
        c = comm[name]
        per = c.get("per_draw", {}).get("rounds_per_ess")
        rows.append(f"| {label} | {c['rounds']:,} | {_kb(c['bytes_up'])} / {_kb(c['bytes_down'])} | "
                    f"{c['seconds']:.1f} s | **{out['max_abs_z'][name]:.2f}** | "
                    f"{summary['beta0'][name]['mean']:.3f} ({summary['beta0'][name]['z']:.2f}) | "
                    f"{summary['omega'][name]['mean']:.3f} ({summary['omega'][name]['z']:.2f}) | "
                    f"{'-' if per is None else per_draw(per)} | {_answer(name, checks[name])} |")
    nuts = summary["beta0"]["nuts"], summary["omega"]["nuts"]
    rows.append(f"| NUTS on the pooled data | - | - | {comm['nuts']['seconds']:.1f} s | - | "
                f"{nuts[0]['mean']:.3f} (sd {nuts[0]['sd']:.3f}) | {nuts[1]['mean']:.3f} (sd {nuts[1]['sd']:.3f}) "
                f"| - | - |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print the docs' table from the last results")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(table_rows(json.loads(RESULTS.read_text()))))
        return
    import jax

    from numpyro_fed_examples.demo import run_demo

    out = run_demo(plot="", methods=("fit", "fit_exact", "ep", "fed_nuts"))
    results = {"command": "python benchmarks/demo_figures.py", **provenance(),
               "machine": platform.processor() or platform.machine(), "cpus": mp.cpu_count(), "jax": jax.__version__,
               "demo": out}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1, default=float))
    print("\n".join(table_rows(results)))


if __name__ == "__main__":
    main()

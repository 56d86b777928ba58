"""Where a cold ``nf.fit`` spends its time: JAX's own compile events over one first call in a
fresh process, attributed to the package's functions that asked for each program.

The demo's six-cities logistic GLMM split over 4 silos (as ``fit_cold_start.py``), ``nf.fit`` at its
defaults, then the same call again. Recorded from ``jax.monitoring``: the programs XLA compiled
(``backend_compile`` events) and the seconds of tracing, lowering and compiling; each program is
attributed to the innermost frames of ``numpyro_fed`` (outside the user's model) on the stack
when it was compiled, so an eager set-up check's many small programs and a compiled round loop's
one large program are told apart. The rest of the wall time is Python and the runs themselves.

    python benchmarks/cold_call_profile.py

Writes ``benchmarks/results/cold_call_profile.json``.
"""

from __future__ import annotations

import collections
import json
import pathlib
import platform
import sys
import time
import traceback
import warnings

from jax import monitoring

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from provenance import provenance  # noqa: E402

RESULTS = HERE / "results" / "cold_call_profile.json"
EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
          "/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}
TOP = 15

_seconds: collections.Counter = collections.Counter()
_programs: collections.Counter = collections.Counter()
_program_seconds: collections.Counter = collections.Counter()


def _origin() -> str:
    """The innermost package function (outside the ready-made models) that asked for a program."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/numpyro_fed/" in frame.filename and "/models/" not in frame.filename:
            return f"{frame.filename.split('/numpyro_fed/')[1]}:{frame.name}"
    return "outside the package"


def _listen(event: str, seconds: float, **kwargs) -> None:
    if event in EVENTS:
        _seconds[EVENTS[event]] += seconds
    if event == "/jax/core/compile/backend_compile_duration":
        origin = _origin()
        _programs[origin] += 1
        _program_seconds[origin] += seconds


def _call(fit_once) -> dict:
    _seconds.clear(), _programs.clear(), _program_seconds.clear()
    t0 = time.perf_counter()
    method = fit_once()
    wall = time.perf_counter() - t0
    by_origin = sorted(_programs, key=lambda o: -_program_seconds[o])
    return {"seconds": wall, "method": method, "programs": sum(_programs.values()),
            **{f"{k}_seconds": _seconds[k] for k in EVENTS.values()},
            "top": [{"origin": o, "programs": _programs[o], "compile_seconds": _program_seconds[o]}
                    for o in by_origin[:TOP]],
            "small_programs": sum(c for o, c in _programs.items() if c > 1),
            "small_programs_compile_seconds": sum(_program_seconds[o] for o, c in _programs.items() if c > 1)}


def main():
    monitoring.register_event_duration_secs_listener(_listen)
    import jax

    import numpyro_fed as nf
    nf.tune_cpu_flags()  # README's recommended XLA CPU flags, before anything computes
    from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
    from numpyro_fed_examples.models import logistic_glmm

    data = load_six_cities()
    n = len(data["smoke"])
    clients = nf.Clients.split(six_cities_silos(0, tuple(n // 4 + (1 if k < n % 4 else 0) for k in range(4))), **data)

    def fit_once():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return nf.fit(logistic_glmm, clients, jax.random.PRNGKey(0), progress_bar=False).method

    out = {**provenance(), "machine": platform.platform(), "jax": jax.__version__, "posterior": "six cities, 4 silos",
           "cold": _call(fit_once), "second": _call(fit_once)}
    RESULTS.write_text(json.dumps(out, indent=1))
    print("\n".join(table_rows(out)))


def table_rows(results: dict) -> list:
    """The docs' rows: the cold call's programs by the function that asked for them."""
    cold = results["cold"]
    rows = [f"| {r['origin']} | {r['programs']} | {r['compile_seconds']:.2f} |" for r in cold["top"]]
    rows.append(f"| all ({cold['seconds']:.1f} s wall; tracing {cold['trace_seconds']:.1f} s, lowering "
                f"{cold['lower_seconds']:.1f} s) | {cold['programs']} | {cold['compile_seconds']:.2f} |")
    return rows


if __name__ == "__main__":
    main()

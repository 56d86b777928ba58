"""How many programs a cold ``nf.fit`` compiles, counted from JAX's own compile events.

Every program XLA compiles on a first call is time a user waits for; the count is what the
set-up's eager checks and the rungs' compiled loops add up to, and, unlike a time, it does not
depend on the machine's load. The count is held to the one ``benchmarks/cold_call_profile.py``
recorded (the figure the docs show), so a change that adds programs to a cold call fails here
until the profile, and the docs with it, are measured again.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_COUNT = """
import warnings
from jax import monitoring
count = [0]
COMPILE = "/jax/core/compile/backend_compile_duration"
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: count.__setitem__(0, count[0] + (event == COMPILE)))
import jax
import numpyro_fed as nf
from numpyro_fed_examples.datasets import load_six_cities, six_cities_silos
from numpyro_fed_examples.models import logistic_glmm
data = load_six_cities()
n = len(data["smoke"])
clients = nf.Clients.split(six_cities_silos(0, tuple(n // 4 + (1 if k < n % 4 else 0) for k in range(4))), **data)
imported = count[0]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    nf.fit(logistic_glmm, clients, jax.random.PRNGKey(0), progress_bar=False)
first = count[0] - imported
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    nf.fit(logistic_glmm, clients, jax.random.PRNGKey(0), progress_bar=False)
print(imported, first, count[0] - first - imported)
"""


@pytest.mark.slow
def test_a_cold_fit_compiles_no_more_programs_than_its_profile_records_and_a_second_compiles_none():
    """The demo's GLMM over four silos, ``nf.fit`` at its defaults in a fresh process: importing the
    package (and loading the data) compiles nothing, the first call at most the programs the
    cold-call profile recorded, the second none."""
    recorded = json.loads((ROOT / "benchmarks" / "results" / "cold_call_profile.json").read_text())["cold"]["programs"]
    caches = ("NUMPYRO_FED_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")  # a cache hit compiles nothing
    env = {k: v for k, v in os.environ.items() if k not in caches}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _COUNT], capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    imported, first, second = (int(v) for v in run.stdout.split()[-3:])
    assert imported == 0, f"importing numpyro_fed and building the clients compiled {imported} programs"
    assert first <= recorded, (f"a cold nf.fit compiled {first} programs, more than the {recorded} the profile "
                               f"recorded: run benchmarks/cold_call_profile.py and see what was added")
    assert second == 0, f"the second call compiled {second} programs (each rung's programs should be reused)"

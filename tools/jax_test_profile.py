"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time and
JAX's own compile events (tracing, lowering to MLIR, XLA backend compilation, persistent-cache
hits and misses), and a summary by test file.

Record (each xdist worker writes its own JSON file into ``JAX_TEST_PROFILE_DIR``, default
``.jax_test_profile/``)::

    PYTHONPATH=tools python -m pytest -q -n 2 -p jax_test_profile

Summarise::

    python tools/jax_test_profile.py [DIR] [--top N]

Write the list of tests that the quick loop (``pytest -m "not slow"``, README) leaves out
(tests/conftest.py reads it): the slowest tests, taken from the top until the others' summed
wall time, shared by ``--workers`` workers, fits in ``--budget`` seconds::

    python tools/jax_test_profile.py --write-slow tests/slow_tests.txt --budget 480

Time spent in child processes (Flower's ServerApp and ClientApps, notebook kernels, the CLI)
is in a test's wall time but not in its compile columns: the ``other`` column holds it, with
the runs themselves and Python.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import time

import pytest

DIR = os.environ.get("JAX_TEST_PROFILE_DIR", ".jax_test_profile")
EVENTS = {"compile": "/jax/core/compile/backend_compile_duration",
          "trace": "/jax/core/compile/jaxpr_trace_duration",
          "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration"}
COUNTS = {"misses": "/jax/compilation_cache/cache_misses", "hits": "/jax/compilation_cache/cache_hits"}

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_tests: dict = {}


def pytest_configure(config):
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(lambda event, secs, **kw: _seconds.update({event: secs}))
    monitoring.register_event_listener(lambda event, **kw: _counts.update({event: 1}))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds, counts, start = dict(_seconds), dict(_counts), time.perf_counter()
    yield
    row = {"wall": time.perf_counter() - start}
    row.update({k: _seconds[e] - seconds.get(e, 0.0) for k, e in EVENTS.items()})
    row.update({k: _counts[e] - counts.get(e, 0) for k, e in COUNTS.items()})
    _tests[item.nodeid] = row


def pytest_sessionfinish(session):
    if not _tests:
        return
    os.makedirs(DIR, exist_ok=True)
    with open(os.path.join(DIR, f"worker-{os.getpid()}.json"), "w") as fh:
        json.dump(_tests, fh)


def _read(directory: str) -> dict:
    rows = {}
    for path in glob.glob(os.path.join(directory, "worker-*.json")):
        with open(path) as fh:
            rows.update(json.load(fh))
    return rows


def summarise(directory: str = DIR, top: int = 20) -> str:
    rows = _read(directory)
    if not rows:
        return f"no profile in {directory}: run pytest with -p jax_test_profile first"
    for r in rows.values():
        r["other"] = r["wall"] - r["compile"] - r["trace"] - r["lower"]
    cols = ("wall", "compile", "trace", "lower", "other")
    total = {c: sum(r[c] for r in rows.values()) for c in cols}
    lines = [f"{len(rows)} tests; seconds summed over the workers: "
             + ", ".join(f"{c} {total[c]:.0f}" for c in cols)
             + f"; persistent-cache misses {sum(r['misses'] for r in rows.values())}, "
               f"hits {sum(r['hits'] for r in rows.values())}", "", "by file:"]
    files: dict = collections.defaultdict(lambda: collections.Counter())
    for nodeid, r in rows.items():
        f = files[nodeid.split("::")[0]]
        f.update({c: r[c] for c in cols})
        f["tests"] += 1
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        lines.append(f"  {name:45s} {f['tests']:4d} tests " + " ".join(f"{c} {f[c]:7.0f}" for c in cols))
    lines += ["", f"slowest {top} tests:"]
    for nodeid, r in sorted(rows.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        lines.append(f"  {r['wall']:7.1f} s (compile {r['compile']:5.1f}, other {r['other']:6.1f})  {nodeid}")
    return "\n".join(lines)


def slowest_until(rows: dict, budget: float, workers: int = 2) -> list:
    """The slowest tests, from the top, until the rest's wall time over ``workers`` is <= ``budget``."""
    order = sorted(rows, key=lambda k: -rows[k]["wall"])
    rest = sum(r["wall"] for r in rows.values())
    slow = []
    for nodeid in order:
        if rest / workers <= budget:
            break
        slow.append(nodeid)
        rest -= rows[nodeid]["wall"]
    return slow


def write_slow(path: str, directory: str, budget: float, workers: int) -> str:
    rows = _read(directory)
    if not rows:
        raise SystemExit(f"no profile in {directory}: run pytest with -p jax_test_profile first")
    slow = slowest_until(rows, budget, workers)
    kept = sum(r["wall"] for k, r in rows.items() if k not in slow)
    with open(path, "w") as fh:
        fh.write(f"# tests/conftest.py marks these `slow`; `pytest -m \"not slow\"` leaves them out.\n"
                 f"# Written by `python tools/jax_test_profile.py --write-slow {path} --budget {budget:g}`\n"
                 f"# from a full profiled run: the slowest {len(slow)} of {len(rows)} tests; the other"
                 f" {len(rows) - len(slow)} summed {kept:.0f} s of wall over {workers} workers.\n")
        for nodeid in sorted(slow):
            fh.write(f"{nodeid}  # {rows[nodeid]['wall']:.0f} s\n")
    return f"{len(slow)} slow tests written to {path}; the other {len(rows) - len(slow)} summed {kept:.0f} s"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Summarise a profiled test run, or write the slow-test list.")
    parser.add_argument("directory", nargs="?", default=DIR)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--write-slow", metavar="PATH")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds of wall for the tests left in")
    parser.add_argument("--workers", type=int, default=2)
    a = parser.parse_args()
    print(write_slow(a.write_slow, a.directory, a.budget, a.workers) if a.write_slow else summarise(a.directory, a.top))

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# One persistent XLA compilation cache for this test session, shared by the xdist workers
# (they inherit the controller's environment), subprocesses and notebook kernels: each test
# builds its own models and closures, so the in-memory caches miss where the program is the
# same; this cache does not. The cache key is the compiled program itself: results are identical.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="numpyro_fed_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    _owner = os.getpid()
    atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_cache, ignore_errors=True))

# Tests run short fits: compiling dominates their time, running them does not. JAX's own switch
# for that trade (XLA's backend optimisation level 0 and no expensive LLVM passes) roughly
# halves compile time; it changes no semantics, and every tolerance stays as it was. Workers,
# Flower nodes and notebook kernels inherit it; tests/test_xla_flags.py probes without it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# copied into a Flower app folder and imported there as a top-level module (not a test module)
collect_ignore = ["flower_tasks.py", "deviating_server.py"]  # Flower app files (the second patches the masking)

import gc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import numpyro_fed  # noqa: E402

# README's recommended XLA CPU flags (numpyro_fed sets nothing on import), before anything computes;
# the workers, subprocesses, Flower nodes and notebook kernels inherit them from the environment
numpyro_fed.tune_cpu_flags()

# A pytest plugin (jaxtyping's) imports JAX before this file runs, so JAX has already read its
# configuration from the environment: hand it the cache settings directly (for this process;
# the workers and subprocesses read them from the environment).
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")))
_FAST_COMPILE = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", "")

# Progress bars are on by default for users (as NumPyro's); tests run quietly. A test of the
# default itself sets it back with monkeypatch.
from numpyro_fed.run.inference import FederatedInference  # noqa: E402

FederatedInference.progress_bar = False
from numpyro_fed.fitting import cache as fit_cache  # noqa: E402

jax.config.update("jax_disable_most_optimizations", _FAST_COMPILE)


@pytest.fixture(autouse=True)
def _xla_optimised(request):
    """``@pytest.mark.xla_optimised``: this test's statistical figure was set on XLA's optimised
    programs (as users run them) and sits near its tolerance there, so it runs with them."""
    if request.node.get_closest_marker("xla_optimised") is None:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", _FAST_COMPILE)


@pytest.fixture(autouse=True)
def _seed_and_leaks():
    np.random.seed(0)
    fit_cache.clear()  # each test's nf.fit builds its own rungs (a test may patch what they compile)
    yield
    fit_cache.clear()
    # no tracer may outlive a test (a leaked tracer means impure code under jit)
    if not _tracers():  # the usual case: no cache clearing or full collection needed
        return
    # compilation caches legitimately hold traced closures, and a tracer in unreachable garbage
    # is not a leak. Clearing the caches only here (not after every test) keeps JAX's compiled
    # eager ops and jitted helpers between tests: each test recompiled ~100 of them before.
    jax.clear_caches()
    gc.collect()
    leaked = _tracers()
    assert not leaked, f"{len(leaked)} JAX tracers leaked out of the test"


_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def _slow_seconds():
    """Seconds measured for each listed slow test (the number after ``#`` on its line, else None)."""
    out = {}
    if os.path.exists(_SLOW_LIST):
        with open(_SLOW_LIST) as fh:
            for line in fh:
                test, _, note = line.partition("#")
                seconds = note.strip().split(" ")[0] if note.strip() else ""
                if test.strip():
                    out[test.strip()] = float(seconds) if seconds.replace(".", "", 1).isdigit() else None
    return out


def _slow_ids():
    return set(_slow_seconds())


UNTIMED_SECONDS = 120.0  # what a slow test with no measured time is assumed to take, for the shards


def slow_shards(nodeids, count: int):
    """The slow tests dealt into ``count`` shards of about equal measured time: whole files (a
    file's tests share module fixtures, e.g. one Flower deployment), the longest file first into
    the shard with the least time so far. Returns one set of nodeids per shard."""
    seconds = _slow_seconds()
    files = {}
    for nodeid in nodeids:
        t = seconds.get(nodeid)
        files.setdefault(nodeid.split("::")[0], []).append((nodeid, UNTIMED_SECONDS if t is None else t))
    shards = [(0.0, i, set()) for i in range(count)]
    for name, tests in sorted(files.items(), key=lambda kv: (-sum(t for _, t in kv[1]), kv[0])):
        total, i, members = min(shards)
        members.update(n for n, _ in tests)
        shards[i] = (total + sum(t for _, t in tests), i, members)
    return [members for _, _, members in shards]


def pytest_collection_modifyitems(config, items):
    """``slow``: the tests listed in tests/slow_tests.txt (the slowest of a measured full run,
    each with its seconds) and every real Flower run. README's test command,
    ``pytest -m "not slow"``, leaves them out; ``pytest -m slow`` runs them.

    ``NUMPYRO_FED_SLOW_SHARD=K/N`` (1 <= K <= N) keeps, of the slow tests, only shard K of N
    (:func:`slow_shards`); the others are deselected. CI runs one shard per commit in turn."""
    slow = _slow_ids()
    for item in items:
        if item.nodeid in slow or item.get_closest_marker("flower") is not None:
            item.add_marker(pytest.mark.slow)
    shard = os.environ.get("NUMPYRO_FED_SLOW_SHARD", "").strip()
    if not shard:
        return
    k, _, n = shard.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"NUMPYRO_FED_SLOW_SHARD={shard!r}: write K/N with 1 <= K <= N, e.g. 1/2")
    marked = [item.nodeid for item in items if item.get_closest_marker("slow") is not None]
    keep = slow_shards(marked, int(n))[int(k) - 1]
    kept = [item for item in items if item.get_closest_marker("slow") is None or item.nodeid in keep]
    kept_ids = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in kept_ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _tracers():
    return [a for a in gc.get_objects() if isinstance(a, jax.core.Tracer)]


@pytest.fixture(scope="module")
def data3():
    """24 rows split over three vertical clients: xa (2 columns), xb (1), xc (2), and y."""
    rng = np.random.default_rng(1)
    n = 24
    x = rng.normal(size=(n, 5)).astype(np.float32)
    y = (0.3 + x @ np.array([1.0, -0.5, 0.8, 0.2, -1.0]) + 0.5 * rng.normal(size=n)).astype(np.float32)
    return dict(xa=jnp.asarray(x[:, :2]), xb=jnp.asarray(x[:, 2:3]), xc=jnp.asarray(x[:, 3:]), y=jnp.asarray(y))

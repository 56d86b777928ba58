"""``nf.fit`` keeps its rungs for the process (numpyro_fed/fitting/cache.py): a second fit of the same
model, options and data reuses them, compiling nothing; a changed global the model reads, changed
data or other options build anew, and every answer is checked against the analytic posterior."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.fitting import cache as fit_cache

PRIOR = {"scale": 10.0}  # a global the model reads, as a notebook's cell would set it


def model(x, y):
    b = numpyro.sample("b", dist.Normal(0.0, PRIOR["scale"]))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(b * x, 1.0), obs=y)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=60)
    return x, 0.7 * x + rng.normal(size=60)


def _clients(x, y):  # a new Clients object every time, as a user's second cell makes
    return nf.Clients.split(np.repeat([0, 1, 2], [10, 20, 30]), x=x, y=y)


def _analytic(x, y, scale):
    precision = x @ x + 1.0 / scale ** 2
    return (x @ y) / precision, precision ** -0.5


def _fit(x, y, **options):
    return nf.fit(model, _clients(x, y), jax.random.PRNGKey(0), progress_bar=False, **options)


def _check(result, x, y, scale):
    draws = np.asarray(result.get_samples()["b"])
    mean, sd = _analytic(x, y, scale)
    assert abs(draws.mean() - mean) < 0.1 * sd, (draws.mean(), mean, sd)
    assert abs(draws.std() / sd - 1.0) < 0.1, (draws.std(), sd)


@pytest.fixture(autouse=True)
def _fresh():
    fit_cache.clear()
    PRIOR["scale"] = 10.0
    yield
    fit_cache.clear()
    PRIOR["scale"] = 10.0


def _compiles(fn):
    """``(fn(), the XLA programs compiled while it ran)``."""
    compiled = []

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    was = jax.config.jax_enable_compilation_cache  # (a program from a persistent cache is not compiled: off)
    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        return fn(), len(compiled)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        jax.config.update("jax_enable_compilation_cache", was)


def test_a_second_fit_of_the_same_model_and_data_reuses_the_rungs_and_compiles_nothing():
    x, y = _data()
    first, compiled_first = _compiles(lambda: _fit(x, y))
    _check(first, x, y, 10.0)
    second, compiled_second = _compiles(lambda: _fit(x, y))
    assert compiled_first > 0  # (the listener hears compilations)
    assert compiled_second == 0, f"the second fit compiled {compiled_second} programs"
    assert second.inference is first.inference
    np.testing.assert_array_equal(np.asarray(second.get_samples()["b"]), np.asarray(first.get_samples()["b"]))


def test_a_changed_global_the_model_reads_builds_anew():
    x, y = _data()
    first = _fit(x, y)
    PRIOR["scale"] = 0.1  # a strong prior: the posterior mean moves to about a third of the wide prior's
    second = _fit(x, y)
    _check(second, x, y, 0.1)
    assert second.inference is not first.inference


NOISE = {"sd": 1.0}  # read only on the middle client's rows (a branch on its number of rows)


def branching_model(x, y):
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sd = NOISE["sd"] if y.shape[0] == 20 else 1.0
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(b * x, sd), obs=y)


@pytest.mark.parametrize("cleared", [False, True])
def test_a_changed_global_read_only_on_a_middle_clients_rows_builds_anew(cleared):
    """The guard traces one client of each kind, not only the first and last: the global here is
    read on the 20-row client alone. ``cleared``: with the kept rungs dropped between the fits, the
    set-up checks' remembered verdicts (padding these clients gives each its own terms) must not be
    reused either: padded to 30 rows, the 20-row client's branch is never taken. Checked against the
    analytic posterior with each row's sd."""
    x, y = _data()
    fits = []
    for noise in (1.0, 0.2):
        NOISE["sd"] = noise
        if cleared:
            fit_cache.clear()
        fits.append(nf.fit(branching_model, _clients(x, y), jax.random.PRNGKey(0), progress_bar=False))
    NOISE["sd"] = 1.0
    assert fits[1].inference is not fits[0].inference
    sd = np.where(np.repeat([0, 1, 2], [10, 20, 30]) == 1, 0.2, 1.0)
    precision = np.sum(x ** 2 / sd ** 2) + 1.0 / 100.0
    mean, post_sd = np.sum(x * y / sd ** 2) / precision, precision ** -0.5
    draws = np.asarray(fits[1].get_samples()["b"])
    assert abs(draws.mean() - mean) < 0.1 * post_sd, (draws.mean(), mean, post_sd)
    assert abs(draws.std() / post_sd - 1.0) < 0.1, (draws.std(), post_sd)


def test_changed_data_or_options_build_anew_and_clear_drops_everything():
    x, y = _data()
    first = _fit(x, y)
    x2, y2 = _data(seed=1)
    other = _fit(x2, y2)
    assert other.inference is not first.inference
    _check(other, x2, y2, 10.0)
    assert _fit(x, y, inner_steps=6).inference is not first.inference
    assert _fit(x, y).inference is first.inference  # (kept: the last few ladders)
    fit_cache.clear()
    again = _fit(x, y)
    assert again.inference is not first.inference
    _check(again, x, y, 10.0)


@pytest.mark.parametrize("exact", [False, True])
def test_a_kept_rung_run_with_another_key_gives_what_a_fresh_one_gives(exact):
    """Nothing of the first run leaks into the next: the kept objects run with key 1 give the draws
    new objects give with key 1 (the Laplace rung and its checks; the exact sampler and its start)."""
    x, y = _data()
    clients = _clients(x, y)
    nf.fit(model, clients, jax.random.PRNGKey(0), progress_bar=False, exact=exact)
    kept = nf.fit(model, _clients(x, y), jax.random.PRNGKey(1), progress_bar=False, exact=exact)
    fit_cache.clear()
    fresh = nf.fit(model, _clients(x, y), jax.random.PRNGKey(1), progress_bar=False, exact=exact)
    assert kept.method == fresh.method and kept.rounds == fresh.rounds
    np.testing.assert_array_equal(np.asarray(kept.get_samples()["b"]), np.asarray(fresh.get_samples()["b"]))
    _check(fresh, x, y, 10.0)

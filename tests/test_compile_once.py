"""Issue 27 item 3: compile once per shape, not once per client or per ``Clients``.

Counted with JAX's own monitoring event for a backend (XLA) compilation: after the first
client (or the first ``Clients``), another one of the same shape compiles nothing."""

import contextlib
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax

import numpyro_fed as nf

_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)


@contextlib.contextmanager
def compiles():
    """The number of XLA compilations inside the block (``counted[0]`` after it)."""
    counted = [0]
    start = len(_COMPILES)
    yield counted
    counted[0] = len(_COMPILES) - start


def _model(x, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with nf.local_site():
        b = numpyro.sample("b", dist.Normal(mu, 0.5))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(b * x, 0.3), obs=y)


def _clients(seed, num_clients=3, rows=8):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=num_clients * rows).astype(np.float32)
    y = (0.8 * x + 0.3 * rng.normal(size=x.shape)).astype(np.float32)
    return nf.Clients.split(np.repeat(np.arange(num_clients), rows), x=x, y=y)


def test_ep_client_draws_compile_once_per_shape():
    clients = _clients(0)
    ep = nf.EP(_model, check_fit=False)
    res = ep.run(jax.random.PRNGKey(0), clients, 3, progress_bar=False)
    first, second, third = clients.names
    with compiles() as n_first:
        ep.local_posterior(jax.random.PRNGKey(1), res, first, num_samples=20, num_warmup=20)
    with compiles() as n_next:
        ep.local_posterior(jax.random.PRNGKey(2), res, second, num_samples=20, num_warmup=20)
        draws = ep.local_posterior(jax.random.PRNGKey(3), res, third, num_samples=20, num_warmup=20)
    assert n_first[0] >= 1 and n_next[0] == 0, (n_first, n_next)
    assert np.all(np.isfinite(np.asarray(draws["b"])))


def test_sfvi_client_draws_compile_once_per_shape():
    clients = _clients(1)
    svi = nf.FederatedSVI(_model, nf.StructuredGuide(_model), optax.adam(0.05), check_fit=False)
    res = svi.run(jax.random.PRNGKey(0), clients, 20, progress_bar=False)
    first, second, third = clients.names
    with compiles() as n_first:
        svi.sample_posterior(jax.random.PRNGKey(1), res, 50, client=first)
        svi.log_likelihood(jax.random.PRNGKey(1), res, 50, client=first)
    with compiles() as n_next:
        a = svi.sample_posterior(jax.random.PRNGKey(1), res, 50, client=second)
        svi.log_likelihood(jax.random.PRNGKey(1), res, 50, client=second)
        b = svi.sample_posterior(jax.random.PRNGKey(1), res, 50, client=third)
    assert n_first[0] >= 1 and n_next[0] == 0, (n_first, n_next)
    # each client's own data still enters its draws (the cache is by shape, not by values)
    assert not np.allclose(np.asarray(a["b"]), np.asarray(b["b"]))


def test_hm1_compiles_once_for_new_clients_of_the_same_shape():
    rng = np.random.default_rng(2)

    def clients():
        x = rng.normal(size=(60, 3)).astype(np.float32)
        y = (x @ np.array([1.0, -0.5, 0.2], np.float32) + 0.1 * rng.normal(size=60)).astype(np.float32)
        return nf.Clients.split(np.repeat(np.arange(3), 20), x=x, y=y)

    method = nf.HM1(lr=0.002, local_steps=2, batch_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nf.warnings.UnconvergedWarning)
        with compiles() as n_first:
            method.run(jax.random.PRNGKey(0), clients(), 5)
        with compiles() as n_next:
            a = method.run(jax.random.PRNGKey(0), clients(), 5)
            b = method.run(jax.random.PRNGKey(0), clients(), 5)
    assert n_first[0] >= 1 and n_next[0] == 0, (n_first, n_next)
    assert not np.allclose(np.asarray(a.params.theta), np.asarray(b.params.theta))  # their own data

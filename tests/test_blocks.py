"""Issue 27 item 1: integrated Laplace on block-diagonal local latents.

The block path must give the dense path's answer (it is the same computation, organised by
the structure), be proposed only where the layout allows it, and refuse (an invalid update,
named in the run's warning) where a model couples the entries the layout would split."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.run.backends.mapping import client_data
from numpyro_fed.run.inference import fitted
from numpyro_fed.terms.blocks import block_hessian, blocks_hold, local_blocks, quadrature_correction
from numpyro_fed.terms.tilted import inner_mode, laplace_moments
from numpyro_fed_examples.models import logistic_glmm

_rng = np.random.default_rng(0)
N = 24
WHEEZE = (_rng.uniform(size=(N, 4)) < 0.3).astype(np.float32)
AGE = np.tile(np.arange(-2.0, 2.0, 1.0, dtype=np.float32), (N, 1))
SMOKE = (_rng.uniform(size=N) < 0.4).astype(np.float32)


def _terms(model, clients, **kw):
    inference = nf.EP(model, **kw)
    inference.init(jax.random.PRNGKey(0), clients)
    setup = fitted(inference)
    return inference, setup.extra.terms, client_data(setup.plan, 0)


def _intercept_slope(x, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("groups", y.shape[0]):
        with nf.local_site():
            a = numpyro.sample("a", dist.Normal(mu, 1.0))
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(a[:, None] + b[:, None] * x, 0.5).to_event(1), obs=y)


def _random_walk(y):
    s = numpyro.sample("s", dist.LogNormal(-1.0, 0.5))
    with nf.local_site():
        z = numpyro.sample("z", dist.GaussianRandomWalk(s, y.shape[0]))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(z, 0.3), obs=y)


def test_blocks_are_proposed_from_the_plates_every_local_site_shares():
    clients = nf.Clients.split(np.arange(N) % 2, wheeze=WHEEZE, age=AGE, smoke=SMOKE)
    _, terms, _ = _terms(logistic_glmm, clients)
    index = local_blocks(terms.local)
    assert index.shape == (N // 2, 1) and sorted(index.ravel().tolist()) == list(range(N // 2))
    x = _rng.normal(size=(10, 3)).astype(np.float32)
    y = (x + _rng.normal(size=(10, 1))).astype(np.float32)
    _, terms, _ = _terms(_intercept_slope, nf.Clients.split(np.arange(10) % 2, x=x, y=y))
    index = local_blocks(terms.local)  # a's and b's entry of group k form block k
    np.testing.assert_array_equal(index, np.stack([np.arange(5), 5 + np.arange(5)], 1))
    _, terms, _ = _terms(_random_walk, nf.Clients.split(np.arange(10) % 2, y=y[:, 0]))
    assert local_blocks(terms.local) is None  # the walk's entries are in no plate


@pytest.mark.parametrize("model", ["glmm", "intercept_slope"])
def test_the_block_path_equals_the_dense_path(model):
    """Tilted mean, covariance and Pareto k of one client, float64: the same to 1e-6."""
    with jax.enable_x64(True):
        if model == "glmm":
            clients = nf.Clients.split(np.arange(N) % 2, wheeze=WHEEZE, age=AGE, smoke=SMOKE)
            _, terms, data = _terms(logistic_glmm, clients)
        else:
            x = _rng.normal(size=(12, 3))
            _, terms, data = _terms(_intercept_slope, nf.Clients.split(np.arange(12) % 2, x=x, y=x + 0.5))
        d, n = terms.prior.shift.shape[0], terms.num_local
        f = jax.jit(lambda w: terms.log_joint(w, data))
        w0 = jnp.zeros(d + n, jnp.float64)
        cavity = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), terms.prior)
        index = jnp.asarray(local_blocks(terms.local))
        assert bool(blocks_hold(lambda v: f(jnp.concatenate([w0[:d], v])), jnp.ones(n), index,
                                jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float64)))
        # the Laplace computation alone (the block path adds quadrature to the importance step)
        dense = laplace_moments(f, cavity, w0, d, jax.random.PRNGKey(2), importance=False)
        block = laplace_moments(f, cavity, w0, d, jax.random.PRNGKey(2), index=index, importance=False)
        assert np.all(np.isfinite(np.asarray(dense[0])))
        np.testing.assert_allclose(block[0], dense[0], rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(block[1], dense[1], rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(block[2].pareto_k, dense[2].pareto_k, rtol=1e-6)


def test_coupled_entries_give_an_invalid_update_that_names_the_fix():
    """A local site whose entries are coupled (a random walk over a client's wards) in a plate
    the layout would split into blocks: each client's check fails, its update is invalid, and
    the run (every update invalid) raises saying to pass local_blocks=False; with it, the fit
    is valid. (The rows' terms are a sum over rows: each row reads its own ward's value.)"""

    def model(ward, y):
        s = numpyro.sample("s", dist.LogNormal(-1.0, 0.5))
        with nf.group_plate("wards", ward), nf.local_site():
            z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        walk = jnp.cumsum(s * z)  # coupled across the wards
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(walk[ward], 0.3), obs=y)

    ward = np.tile(np.repeat(np.arange(5), 2), 2).astype(np.int32)  # 5 wards of 2 rows per client
    y = (np.cumsum(0.3 * _rng.normal(size=10))[ward] + 0.3 * _rng.normal(size=20)).astype(np.float32)
    clients = nf.Clients.split(np.arange(20) // 10, ward=ward, y=y)
    inference = nf.EP(model, check_fit=False)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="check of the block structure failed"):
        warnings.simplefilter("ignore")  # every update invalid: the run raises, naming the fix
        inference.run(jax.random.PRNGKey(0), clients, 2, progress_bar=False)
    assert inference.blocks is not None
    dense = nf.EP(model, local_blocks=False, check_fit=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = dense.run(jax.random.PRNGKey(0), clients, 2, progress_bar=False)
    assert not any(issubclass(w.category, nf.warnings.InvalidUpdateWarning) for w in caught)
    assert np.all(np.isfinite(np.asarray(result.params.mean)))


def _per_block_integrals(f_k, v_grid):
    """``log ∫ exp f_k(v) dv`` for each block by the trapezoid rule on a fine grid."""
    vals = jax.vmap(f_k)(v_grid)  # (grid, K)
    top = jnp.max(vals, 0)
    return top + jnp.log(jnp.trapezoid(jnp.exp(vals - top), v_grid, axis=0))


@pytest.mark.parametrize("K", [1, 3, 40])
def test_block_quadrature_integrates_each_block(K):
    """Random intercepts of four binary rows (the six-cities shape): block Laplace plus the
    quadrature correction equals the sum of the per-block integrals (fine grid) to 1e-4 per
    block, where Laplace alone is off by more than 0.01 per block; a Gaussian block gets no
    correction (1e-9). One and three blocks take the block-by-block evaluations, forty the path
    integral."""
    with jax.enable_x64(True):
        y = jnp.asarray(np.random.default_rng(K).uniform(size=(K, 4)) < 0.25, jnp.float64)
        eta = jnp.linspace(-2.5, -0.5, 4)

        def f_k(v):  # (K,) -> per-block values
            return jnp.sum(dist.Bernoulli(logits=eta + v[:, None]).log_prob(y), 1) + dist.Normal(0, 2.0).log_prob(v)

        f = lambda v: jnp.sum(f_k(v))  # noqa: E731
        index = jnp.arange(K)[:, None]
        v = inner_mode(lambda x: -f(x), jnp.zeros(K), 30, index)
        h = -block_hessian(f, v, index)
        laplace = f(v) + 0.5 * K * jnp.log(2 * jnp.pi) - 0.5 * jnp.sum(jnp.log(h[:, 0, 0]))
        exact = jnp.sum(_per_block_integrals(lambda x: f_k(jnp.full(K, x)), jnp.linspace(-40.0, 30.0, 40001)))
        corrected = laplace + quadrature_correction(f, v, index)
        assert abs(float(corrected - exact)) < 1e-4 * K
        assert abs(float(laplace - exact)) > 0.005 * K  # 0.007-0.024 per block
        gauss = lambda x: jnp.sum(dist.Normal(0.3 * jnp.arange(K), 1.5).log_prob(x))  # noqa: E731
        assert abs(float(quadrature_correction(gauss, 0.3 * jnp.arange(K), index))) < 1e-9

"""Mechanism correctness (issue 12, item 2, part): clipping bounds every per-example
contribution (property test), noise off and a large clip give the non-private result
exactly, subsets are uniform, fixed-size and never padded rows."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numpyro_fed.dp.mechanisms import clip_per_example, dp_sgd_transform, fixed_size_subset, perturbed_sum


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.floats(1e-3, 1e3), st.floats(1e-2, 1e2), st.integers(0, 2**31 - 1))
def test_clipping_bounds_every_example(n, scale, clip, seed):
    rng = np.random.default_rng(seed)
    tree = {"a": jnp.asarray(scale * rng.normal(size=(n, 3)), jnp.float32),
            "b": jnp.asarray(scale * rng.normal(size=(n, 2, 2)), jnp.float32)}
    clipped, norms = clip_per_example(tree, clip)
    after = np.sqrt(np.sum(np.asarray(clipped["a"]) ** 2, 1) + np.sum(np.asarray(clipped["b"]) ** 2, (1, 2)))
    assert np.all(after <= clip * (1 + 1e-5))
    small = np.asarray(norms) <= clip  # examples inside the bound are untouched
    np.testing.assert_array_equal(np.asarray(clipped["a"])[small], np.asarray(tree["a"])[small])


def test_noise_off_and_large_clip_is_the_plain_sum_and_mean():
    tree = {"w": jnp.arange(12.0).reshape(4, 3)}
    out = perturbed_sum(tree, 1e9, 0.0, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(out["w"], jnp.sum(tree["w"], 0))
    tx = dp_sgd_transform(1e9, 0.0, jax.random.PRNGKey(0))
    upd, _ = tx.update(tree, tx.init({"w": jnp.zeros(3)}))
    np.testing.assert_allclose(upd["w"], jnp.mean(tree["w"], 0), rtol=1e-6)


def test_noise_comes_from_the_key_with_the_stated_scale():
    tree = {"w": jnp.zeros((5, 20000))}
    a = perturbed_sum(tree, 1.0, 2.0, jax.random.PRNGKey(1))["w"]
    b = perturbed_sum(tree, 1.0, 2.0, jax.random.PRNGKey(1))["w"]
    c = perturbed_sum(tree, 1.0, 2.0, jax.random.PRNGKey(2))["w"]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert abs(float(jnp.std(a)) - 2.0) < 0.05


def test_fixed_size_subsets_are_uniform_without_replacement_and_skip_padding():
    mask = jnp.asarray([1, 1, 1, 1, 1, 0, 0], jnp.float32)
    draw = jax.jit(jax.vmap(lambda k: fixed_size_subset(k, mask, 2)))
    idx = np.asarray(draw(jax.random.split(jax.random.PRNGKey(0), 20000)))
    assert idx.shape == (20000, 2) and np.all(idx[:, 0] != idx[:, 1]) and idx.max() < 5
    freq = np.bincount(idx.ravel(), minlength=5) / idx.size
    np.testing.assert_allclose(freq, 0.2, atol=0.01)


def test_factor_perturbation_clips_in_natural_parameters_and_is_exact_without_noise():
    from numpyro_fed.dp.mechanisms import from_natural_vector, natural_vector, perturbed_factor_sum
    from numpyro_fed.terms import gaussian as G
    rng = np.random.default_rng(0)
    for diagonal in (False, True):
        a = rng.normal(size=(3, 4, 4))
        prec = jnp.asarray(a @ np.swapaxes(a, 1, 2), jnp.float32)
        changes = G.NaturalGaussian(jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                                    jax.vmap(jnp.diag)(prec) if diagonal else prec)
        one = jax.tree_util.tree_map(lambda x: x[0], changes)
        back = from_natural_vector(natural_vector(one), one)
        np.testing.assert_array_equal(back.precision, one.precision)
        exact, same = perturbed_factor_sum(changes, 1e9, 0.0, jax.random.PRNGKey(0))
        np.testing.assert_allclose(exact.precision, jnp.sum(changes.precision, 0), rtol=1e-6)
        np.testing.assert_allclose(exact.shift, jnp.sum(changes.shift, 0), rtol=1e-6)
        clipped, parts = perturbed_factor_sum(changes, 0.5, 0.0, jax.random.PRNGKey(0))
        assert float(jnp.linalg.norm(natural_vector(clipped))) <= 3 * 0.5 * (1 + 1e-5)
        noisy, _ = perturbed_factor_sum(changes, 0.5, 1.0, jax.random.PRNGKey(0))
        np.testing.assert_array_equal(same.precision, changes.precision)
        assert np.all(np.linalg.norm(np.asarray(jax.vmap(natural_vector)(parts)), axis=1) <= 0.5 * (1 + 1e-5))
        total, shares = perturbed_factor_sum(changes, 0.5, 1.0, jax.random.PRNGKey(3))
        np.testing.assert_allclose(total.shift, jnp.sum(shares.shift, 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(noisy.precision, np.swapaxes(np.asarray(noisy.precision), -1, -2)
                                   if not diagonal else noisy.precision)

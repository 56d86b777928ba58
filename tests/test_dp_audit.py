"""Empirical privacy audit (issue 12, item 3) of the library's real mechanism functions:
neighbouring data sets differ in one canary row whose contribution is +C in one and -C in
the other (given 100x larger, so clipping must act); 200,000 runs on each; the empirical
lower bound on epsilon (Clopper-Pearson, 95%) must not exceed the accounted epsilon, and the
same audit must catch a broken variant whose noise is halved."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.dp.accounting import calibrate_noise_multiplier, epsilon
from numpyro_fed.dp.audit import empirical_epsilon
from numpyro_fed.dp.mechanisms import dp_sgd_transform, fixed_size_subset, perturbed_sum

C, DELTA, RUNS, TARGET = 1.0, 1e-5, 200_000, 2.0


def _canary_rows(n, sign):
    return jnp.zeros((n, 3)).at[0, 0].set(sign * 100.0 * C)


def update_perturbation(key, sign, noise_multiplier):
    """One release: 10 shards' clipped changes summed, noised (local averaging's release
    before the average)."""
    return perturbed_sum({"w": _canary_rows(10, sign)}, C, noise_multiplier * C, key)["w"][0]


def dp_sgd(key, sign, noise_multiplier, n=10, b=5, steps=4):
    """``steps`` DP-SGD aggregations on fixed-size subsets of ``b`` of ``n`` rows; the
    statistic sums the releases' canary coordinate."""
    grads = _canary_rows(n, sign)
    k_init, k_steps = jax.random.split(key)
    tx = dp_sgd_transform(C, noise_multiplier, k_init)

    def step(state, k):
        update, state = tx.update({"w": grads[fixed_size_subset(k, jnp.ones(n), b)]}, state)
        return state, update["w"][0] * b

    return jnp.sum(jax.lax.scan(step, tx.init({"w": jnp.zeros(3)}), jax.random.split(k_steps, steps))[1])


CASES = {"update_perturbation": (update_perturbation, 1, 1.0), "dp_sgd": (dp_sgd, 4, 0.5)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_audit_bounds_the_claim_and_catches_halved_noise(case):
    mechanism, compositions, rate = CASES[case]
    nm = calibrate_noise_multiplier(TARGET, DELTA, compositions, rate)
    claimed = epsilon(nm, DELTA, compositions, rate)
    run = jax.jit(jax.vmap(mechanism, in_axes=(0, None, None)))

    def audit(noise_multiplier, seed):
        keys = jax.random.split(jax.random.PRNGKey(seed), 2 * RUNS)
        first = np.asarray(run(keys[:RUNS], 1.0, noise_multiplier))
        second = np.asarray(run(keys[RUNS:], -1.0, noise_multiplier))
        return empirical_epsilon(first, second, DELTA)

    honest, broken = audit(nm, 0), audit(nm / 2, 1)
    assert claimed <= TARGET
    assert 0.5 < honest <= claimed, (honest, claimed)  # not vacuous, not above the claim
    assert broken > claimed, (broken, claimed)

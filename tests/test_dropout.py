"""Dropout: clients asked but not answering (each answers with probability 0.7 per round).

Each family reaches the reference posterior of its no-dropout test within the same
tolerance (more rounds); exact SFVI and vertical federation skip a round with a missing
answer, which is tested by a schedule."""

import jax
import numpy as np
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed_examples.models import normal_hierarchical

from .families import FAMILIES, run
from .test_ep import _joint_posterior, hier_model
from .test_ep import hier as hier  # noqa: F401  (fixture)
from .test_hm1 import devices as devices  # noqa: F401  (fixture)
from .test_pvi import linear as linear  # noqa: F401  (fixture)
from .test_pvi import linear_model
from .test_sfvi_avg import clients as normal_clients  # noqa: F401  (fixture)
from .test_sfvi_avg import exact_mu

P = 0.7


def test_sfvi_avg_with_dropout_reaches_the_posterior(normal_clients):  # noqa: F811 (the fixture)
    """As test_sfvi_avg_approaches_sfvi (0.25 sd of the exact mu), 120 rounds instead of 60."""
    guide = nf.StructuredGuide(normal_hierarchical)
    avg = nf.FederatedSVI(normal_hierarchical, guide, optax.adam(0.02), method="sfvi_avg", local_steps=25,
                          num_particles=2)
    res = avg.run(random.PRNGKey(0), normal_clients, 120, progress_bar=False, availability=P)
    answered = res.rounds_answered
    assert 0.5 < answered.mean() / 4 < 0.9 and answered.min() < 4  # dropout happened
    assert res.communication.messages_up == int(answered.sum())
    mu = avg.sample_posterior(random.PRNGKey(1), res, 20000)["mu"]
    y = np.concatenate([normal_clients[c]["y"] for c in normal_clients.names])
    truth, sd = exact_mu(y)
    assert abs(float(mu.mean()) - truth) < 0.25 * sd


def test_damped_synchronous_pvi_with_dropout_is_exact(linear):
    """As test_damped_synchronous_pvi_converges_to_the_exact_posterior (same tolerances),
    100 rounds instead of 30: a missing client's factor simply stays as it was."""
    clients, mean, cov, _ = linear
    res = nf.PVI(linear_model, damping=0.5).run(random.PRNGKey(0), clients, 100, availability=P)
    assert res.rounds_answered.min() < 3
    np.testing.assert_allclose(res.params.mean, mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res.params.cov, cov, rtol=1e-3, atol=1e-7)


def test_damped_synchronous_ep_with_dropout_is_exact(hier):
    """As test_ep_integrates_out_local_latents_exactly's damped synchronous case (same
    tolerances), 80 rounds instead of 25."""
    clients, xs, ys = hier
    K = len(clients)
    mean, cov = _joint_posterior(xs[:K], ys[:K])
    d = 2
    res = nf.EP(hier_model, schedule="synchronous", damping=0.5).run(random.PRNGKey(0), clients, 80, availability=P)
    assert res.rounds_answered.min() < K
    np.testing.assert_allclose(res.params.mean, mean[:d], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(res.params.cov, cov[:d, :d], rtol=1e-3, atol=1e-6)


def test_hm1_with_dropout_keeps_the_last_theta(devices):
    """As test_separate_models_are_least_squares (same tolerances), 60 rounds instead of 20;
    the server keeps a missing device's last theta_k."""
    clients, xs, ys, _ = devices
    res = nf.HM1(lr=0.1, shrinkage=0.0, local_steps=50, gradient="mean", batch_size=None).run(
        random.PRNGKey(0), clients, 60, availability=P)
    assert res.rounds_answered.min() < 4
    for j in range(4):
        ls = np.linalg.lstsq(xs[j], ys[j], rcond=None)[0]
        np.testing.assert_allclose(res.params.theta[j], ls, rtol=1e-3, atol=1e-4)


def _schedule(rounds, clients, missing):
    table = np.ones((rounds, clients), bool)
    for r, j in missing:
        table[r, j] = False
    return table


def test_exact_sfvi_skips_a_round_with_a_missing_client():
    """SFVI never applies a gradient missing a client's term: round 2 (client 1 silent) leaves
    the server's parameters as they were; the clients that answered keep their local step."""
    svi, clients = FAMILIES["sfvi"]()
    table = _schedule(3, 3, [(1, 1)])
    one = svi.run(random.PRNGKey(0), clients, 1, progress_bar=False, availability=table)
    two = svi.run(random.PRNGKey(0), clients, 2, progress_bar=False, availability=table)
    three = svi.run(random.PRNGKey(0), clients, 3, progress_bar=False, availability=table)
    assert np.asarray(three.info.complete).tolist() == [True, False, True]
    for a, b in zip(jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(two.params)):
        np.testing.assert_array_equal(a, b)
    assert int(two.state.server.step) == 1 and int(three.state.server.step) == 2
    moved = [not np.array_equal(one.client_states[c].local_params["guide"]["loc"],
                                two.client_states[c].local_params["guide"]["loc"]) for c in clients.names]
    assert moved == [True, False, True]  # client 1 did not answer, so its state is as it was
    assert two.communication.messages_up == 3 + 2


@pytest.mark.parametrize("availability, rounds", [(None, 1000), (P, 3000)])
def test_exact_sfvi_with_dropout_converges_to_the_exact_posterior(availability, rounds):
    """Normal-Normal model (exact posterior inside the structured family), 0.1 sd and 10%
    with and without dropout: with dropout only complete rounds (0.7^3 of them) step, so
    the run is three times longer (the learning-rate schedule counts applied steps)."""
    rng = np.random.default_rng(0)
    y = (1.0 + rng.normal(size=(24, 2))).astype(np.float32)
    clients = nf.Clients.split(np.arange(24) % 3, y=y)
    svi = nf.FederatedSVI(normal_hierarchical, nf.StructuredGuide(normal_hierarchical),
                          optax.adam(optax.exponential_decay(0.05, 1000, 0.02)), num_particles=4)
    res = svi.run(random.PRNGKey(0), clients, rounds, progress_bar=False, availability=availability)
    complete = np.asarray(res.info.complete)
    assert complete.all() if availability is None else 0.2 < complete.mean() < 0.5
    mu = svi.sample_posterior(random.PRNGKey(1), res, 20000)["mu"]
    truth, sd = exact_mu(y)
    assert abs(float(mu.mean()) - truth) < 0.1 * sd and abs(float(mu.std()) / sd - 1) < 0.1


@pytest.mark.parametrize("family", ["vertical_sfvi", "vertical_soul"])
def test_vertical_round_with_a_missing_party_is_skipped(family):
    """No party can step without every z_j: in round 2 party 'b' is silent, and every
    party's parameters stay as they were after round 1."""
    inference, data = FAMILIES[family]()
    table = _schedule(3, 2, [(1, 1)])
    one = run(inference, data, random.PRNGKey(0), 1, availability=table)
    two = run(inference, data, random.PRNGKey(0), 2, availability=table)
    three = run(inference, data, random.PRNGKey(0), 3, availability=table)
    assert np.asarray(three.info.complete).tolist() == [True, False, True]
    for a, b in zip(jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(two.params)):
        np.testing.assert_array_equal(a, b)
    changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(two.params),
                                                          jax.tree_util.tree_leaves(three.params)))
    assert changed

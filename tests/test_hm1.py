"""HM1 (paper 004 §3, Algorithm 1): one round against a hand-written NumPy round,
separate models against least squares, partial participation, messages, errors."""

import numpy as np
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.algorithms import hm1


@pytest.fixture(scope="module")
def devices():
    rng = np.random.default_rng(0)
    k, d, sizes = 4, 3, [15, 25, 40, 30]
    theta = rng.normal(size=(k, d))
    xs = [rng.normal(size=(n, d)) for n in sizes]
    ys = [x @ theta[j] + 0.1 * rng.normal(size=n) for j, (x, n) in enumerate(zip(xs, sizes))]
    clients = nf.Clients.split(np.repeat(np.arange(k), sizes), x=np.concatenate(xs).astype(np.float32),
                               y=np.concatenate(ys).astype(np.float32))
    return clients, [x.astype(np.float32) for x in xs], [y.astype(np.float32) for y in ys], theta


def numpy_round(theta, omega, xs, ys, lr, eta2, alpha, steps):
    """Algorithm 1, one round with full participation and full-batch steps, in NumPy (float64)."""
    k, d = theta.shape
    shrink = np.linalg.solve(omega, theta)
    new = theta.copy()
    for j in range(k):
        t = theta[j].copy()
        for _ in range(steps):
            t = t + 2 * lr * xs[j].T @ (ys[j] - xs[j] @ t) / len(ys[j])
        new[j] = t - 2 * eta2 * shrink[j]
    return new, (1 - alpha) * omega + alpha / d * new @ new.T


def test_rounds_equal_algorithm_1_by_hand(devices):
    """Three rounds of nf.HM1 equal Algorithm 1 written out in NumPy (padded, unequal devices)."""
    clients, xs, ys, _ = devices
    method = nf.HM1(lr=0.02, shrinkage=0.05, alpha=0.3, local_steps=5)
    res = method.run(random.PRNGKey(0), 3, clients)
    theta = np.asarray(method.init(random.PRNGKey(0), clients).server.theta, np.float64)  # N(0, 0.01^2) draws
    omega = np.eye(4)
    for _ in range(3):
        theta, omega = numpy_round(theta, omega, xs, ys, 0.02, 0.05, 0.3, 5)
    np.testing.assert_allclose(res.theta, theta, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res.omega, omega, rtol=1e-4, atol=1e-5)
    assert res.communication.messages_up == 12


def test_separate_models_are_least_squares(devices):
    """shrinkage=0: every device's own gradient descent, which converges to its least squares."""
    clients, xs, ys, _ = devices
    res = nf.HM1(lr=0.1, shrinkage=0.0, local_steps=50).run(random.PRNGKey(0), 20, clients)
    for j in range(4):
        ls = np.linalg.lstsq(xs[j], ys[j], rcond=None)[0]
        np.testing.assert_allclose(res.theta[j], ls, rtol=1e-3, atol=1e-4)


def test_partial_participation_and_messages(devices):
    """With subset_size=2 only the two chosen devices' columns change in a round; a device
    receives only its own column and its shrinkage direction (d numbers each)."""
    clients, _, _, _ = devices
    method = nf.HM1(subset_size=2)
    one = method.run(random.PRNGKey(1), 1, clients, record_transcript=True, keep_values=True)
    start = np.asarray(method.init(random.PRNGKey(1), clients).server.theta)
    changed = np.any(np.abs(np.asarray(one.theta) - start) > 1e-7, axis=1)
    assert changed.sum() == 2
    assert one.communication.messages_up == 2
    down = [e for e in one.transcript.entries if e.sender == "server"]
    assert len({e.receiver for e in down}) == 2  # only the asked devices hear from the server
    assert {e.name for e in down} == {"per_client['theta']", "per_client['shrink']"}
    assert {e.shape for e in down} == {(3,)}  # its own column and its s_k, d numbers each
    alg = hm1(4, 3)
    state, broadcast = alg.init_server(random.PRNGKey(0))
    assert broadcast.shared is None and broadcast.per_client["theta"].shape == (4, 3)


def test_hm1_clear_errors(devices):
    clients = devices[0]
    with pytest.raises(ValueError, match="lr=0"):
        nf.HM1(lr=0.0)
    with pytest.raises(ValueError, match="shrinkage=-1"):
        nf.HM1(shrinkage=-1.0)
    with pytest.raises(ValueError, match="alpha=2"):
        nf.HM1(alpha=2.0)
    with pytest.raises(ValueError, match="subset_size=9"):
        nf.HM1(subset_size=9).run(random.PRNGKey(0), 1, clients)
    bad = nf.Clients.split(np.repeat([0, 1], 5), x=np.ones((10, 2, 2)), y=np.ones(10))
    with pytest.raises(ValueError, match="client '0' needs arrays 'x' of shape"):
        nf.HM1().run(random.PRNGKey(0), 1, bad)
    with pytest.raises(TypeError, match="nf.Clients"):
        nf.HM1().run(random.PRNGKey(0), 1, {"x": 1})

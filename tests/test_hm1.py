"""HM1 (paper 004 §3, Algorithm 1): one round against a hand-written NumPy round,
separate models against least squares, partial participation, messages, errors."""

import numpy as np
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.linear.hm1_algorithm import hm1, minibatch_weights
from numpyro_fed.run.inference import fitted
from numpyro_fed.run.protocol import Broadcast


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


def numpy_round(theta, omega, xs, ys, lr, eta2, alpha, steps, omega_df=None):
    """Algorithm 1, one round with full participation and full-batch summed steps, in NumPy
    (float64); ``omega_df``: the variant's inverse-Wishart Omega target."""
    k, d = theta.shape
    shrink = np.linalg.solve(omega, theta)
    new = theta.copy()
    for j in range(k):
        t = theta[j].copy()
        for _ in range(steps):
            t = t + 2 * lr * xs[j].T @ (ys[j] - xs[j] @ t)
        new[j] = t - 2 * eta2 * shrink[j]
    gram = new @ new.T
    if omega_df is None:
        goal = gram / d
    else:
        goal = (gram + omega_df * np.trace(gram) / (k * d) * np.eye(k)) / (d + omega_df)
    return new, (1 - alpha) * omega + alpha * goal


@pytest.mark.parametrize("omega_df", [None, 3.0])
def test_rounds_equal_algorithm_1_by_hand(devices, omega_df):
    """Three rounds of nf.HM1 (full-batch summed steps) equal Algorithm 1 written out in
    NumPy (padded, unequal devices); with ``omega_df`` the variant's Omega update."""
    clients, xs, ys, _ = devices
    method = nf.HM1(lr=0.004, shrinkage=0.05, alpha=0.3, local_steps=5, batch_size=None, omega_df=omega_df)
    res = method.run(random.PRNGKey(0), clients, 3)
    theta = np.asarray(method.init(random.PRNGKey(0), clients).server.theta, np.float64)  # N(0, 0.01^2) draws
    omega = np.eye(4)
    for _ in range(3):
        theta, omega = numpy_round(theta, omega, xs, ys, 0.004, 0.05, 0.3, 5, omega_df)
    np.testing.assert_allclose(res.params.theta, theta, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res.params.omega, omega, rtol=1e-4, atol=1e-5)
    assert res.communication.messages_up == 12


def test_default_step_is_algorithm_1s_summed_minibatch_gradient(devices):
    """nf.HM1()'s device step, by hand: T = 20 steps ``theta += 2 eta X_b^T (Y_b - X_b theta)``
    on b = 10 rows drawn without replacement (summed, not averaged), then
    ``theta -= 2 eta_2 s_k`` with eta = eta_2 = 0.01."""
    clients, xs, ys, _ = devices
    method = nf.HM1()
    assert (method.lr, method.batch_size, method.local_steps, method.gradient) == (0.01, 10, 20, "sum")
    method.init(random.PRNGKey(0), clients)
    setup = fitted(method)
    client_step = setup.algorithm.exchanges[0].client_step
    rng = np.random.default_rng(1)
    start, shrink = rng.normal(size=(3,)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)
    for j in (0, 3):  # 15 and 30 real rows, padded to 40
        data = {k: v[j] for k, v in setup.plan.data.items()}
        key = random.PRNGKey(10 + j)
        message = Broadcast(None, {"theta": start, "shrink": shrink})
        _, out = client_step(key, (), message, data)
        theta = start.astype(np.float64)
        for sub in random.split(key, 20):
            w = np.asarray(minibatch_weights(sub, data["mask"], 10))
            rows = np.flatnonzero(w)
            assert len(rows) == 10 and rows.max() < len(ys[j])  # ten distinct real rows
            xb, yb = xs[j][rows].astype(np.float64), ys[j][rows].astype(np.float64)
            theta = theta + 2 * 0.01 * xb.T @ (yb - xb @ theta)
        theta = theta - 2 * 0.01 * shrink
        np.testing.assert_allclose(out["theta"], theta, rtol=1e-5, atol=1e-6)


def test_minibatches_are_uniform_without_replacement():
    """Each of 15 real rows (of 20, 5 padded) is drawn with probability 10 / 15; a batch
    larger than the rows takes them all."""
    mask = (np.arange(20) < 15).astype(np.float32)
    keys = random.split(random.PRNGKey(0), 3000)
    draws = np.stack([np.asarray(minibatch_weights(k, mask, 10)) for k in keys[:1500]])
    assert set(draws.sum(axis=1)) == {10.0} and draws[:, 15:].sum() == 0
    np.testing.assert_allclose(draws[:, :15].mean(axis=0), 10 / 15, atol=0.05)
    np.testing.assert_array_equal(np.asarray(minibatch_weights(keys[0], mask, 40)), mask)


def test_noise_scaled_variant_reaches_a_stationary_point_of_L(devices):
    """noise_scaled=True with Omega held at I (alpha = 0): the fixed point satisfies §3's
    stationarity ``X_k^T (Y_k - X_k theta_k) / sigma_k^2 = theta_k`` with the device's own
    ``sigma_k^2 = RSS / (n_k - d)``; Algorithm 1's weighting does not."""
    clients, xs, ys, _ = devices
    kwargs = dict(lr=0.2, gradient="mean", batch_size=None, alpha=0.0, local_steps=10)
    res = nf.HM1(noise_scaled=True, **kwargs).run(random.PRNGKey(0), clients, 200)
    paper = nf.HM1(**kwargs).run(random.PRNGKey(0), clients, 200)
    for j in range(4):
        x, y = xs[j].astype(np.float64), ys[j].astype(np.float64)

        def gap(t):
            sigma2 = np.sum((y - x @ t) ** 2) / (len(y) - 3)
            return np.abs(x.T @ (y - x @ t) / sigma2 - t).max()

        assert gap(np.asarray(res.params.theta[j], np.float64)) < 2e-2 * np.abs(res.params.theta[j]).max()
        assert gap(np.asarray(paper.params.theta[j], np.float64)) > 0.5


def test_a_too_large_step_warns_or_stops(devices):
    """A summed full-batch step with lr too large for the rows blows up: NonFiniteError; a
    run stopped early, while Theta still moves, warns naming the round."""
    clients = devices[0]
    with pytest.raises(nf.run.backends.NonFiniteError):
        nf.HM1(lr=0.5, batch_size=None).run(random.PRNGKey(0), clients, 30)
    with pytest.warns(nf.warnings.UnconvergedWarning, match="round 2"):
        nf.HM1(lr=0.001).run(random.PRNGKey(0), clients, 2)


def test_separate_models_are_least_squares(devices):
    """shrinkage=0: every device's own gradient descent, which converges to its least squares."""
    clients, xs, ys, _ = devices
    res = nf.HM1(lr=0.1, shrinkage=0.0, local_steps=50, gradient="mean", batch_size=None).run(
        random.PRNGKey(0), clients, 20)
    for j in range(4):
        ls = np.linalg.lstsq(xs[j], ys[j], rcond=None)[0]
        np.testing.assert_allclose(res.params.theta[j], ls, rtol=1e-3, atol=1e-4)


def test_partial_participation_and_messages(devices):
    """With subset_size=2 only the two chosen devices' columns change in a round; a device
    receives only its own column and its shrinkage direction (d numbers each)."""
    clients, _, _, _ = devices
    method = nf.HM1(subset_size=2)
    one = method.run(random.PRNGKey(1), clients, 1, record_transcript=True, keep_values=True)
    start = np.asarray(method.init(random.PRNGKey(1), clients).server.theta)
    changed = np.any(np.abs(np.asarray(one.params.theta) - start) > 1e-7, axis=1)
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
    with pytest.raises(ValueError, match="gradient='median'"):
        nf.HM1(gradient="median")
    with pytest.raises(ValueError, match="omega_df=0"):
        nf.HM1(omega_df=0)
    tiny = nf.Clients.split(np.repeat([0, 1], [3, 10]), x=np.ones((13, 3)), y=np.ones(13))
    with pytest.raises(ValueError, match=r"noise_scaled=True needs more rows.*\['0'\]"):
        nf.HM1(noise_scaled=True).run(random.PRNGKey(0), tiny, 1)
    with pytest.raises(ValueError, match="subset_size=9"):
        nf.HM1(subset_size=9).run(random.PRNGKey(0), clients, 1)
    bad = nf.Clients.split(np.repeat([0, 1], 5), x=np.ones((10, 2, 2)), y=np.ones(10))
    with pytest.raises(ValueError, match="client '0' needs arrays 'x' of shape"):
        nf.HM1().run(random.PRNGKey(0), bad, 1)
    with pytest.raises(TypeError, match="nf.Clients"):
        nf.HM1().run(random.PRNGKey(0), {"x": 1}, 1)

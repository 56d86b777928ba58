"""Vertical SOUL (paper 000, Appendix A): exactness, truth, privacy, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
import scipy.linalg
from jax import random
from numpyro.infer.util import potential_energy

import numpyro_fed as nf

from .test_vertical_svi import (
    SPEC3,
    _round_noise,
    _RowScale,
    assert_only_z_crosses,
    power_model,
    privacy_model,
    three_client_model,
)

GAMMA = 0.01


def pooled_soul_round(vmodel, obj, data, rows, state, noise0, noise, gamma, m):
    """One SOUL iteration computed on the pooled data from NumPyro's potential energy:
    ``m`` joint Langevin steps on every party's theta, then the averaged ``d/dz``."""
    scale = obj.num_rows / rows.shape[0]
    sub = {k: v[rows] for k, v in data.items()}
    parties = ("server",) + obj.clients

    def log_joint(us, zs):
        params = {}
        for party in parties:
            params.update(obj.layouts[party].unravel(us[party]))
        params.update({f"z_{c}": zs[c][rows] for c in obj.clients})
        return -potential_energy(_RowScale(vmodel, scale), (), sub, params)

    parts = {c: slot.state.inner for c, slot in zip(obj.clients, state.clients)}
    us = {"server": state.server.inner.chain, **{c: parts[c].chain for c in obj.clients}}
    zs = {c: parts[c].params["z"] for c in obj.clients}
    xi = {"server": noise0, **noise}
    acc = {c: jnp.zeros_like(zs[c]) for c in obj.clients}
    # power form with server sites: theta_0 is held during the clients' steps, then takes one step
    block = obj.form == "power" and obj.layouts["server"].size > 0
    for i in range(m):
        g_u, g_z = jax.grad(log_joint, argnums=(0, 1))(us, zs)
        acc = {c: acc[c] + g_z[c] for c in obj.clients}
        us = {p: us[p] if block and p == "server" else us[p] + gamma * g_u[p] + jnp.sqrt(2 * gamma) * xi[p][i]
              for p in parties}
    if block:
        g0 = jax.grad(log_joint)(us, zs)["server"]
        us["server"] = us["server"] + gamma * g0 + jnp.sqrt(2 * gamma) * noise0[0]
    return us, {c: acc[c] / m for c in obj.clients}


CASES = [  # y at the server with its b0, sigma; power with and without server sites; a minibatch
    ("augmented", "server", None, three_client_model),
    ("power", "shared", None, three_client_model),
    ("power", "shared", 10, power_model),
]


@pytest.mark.parametrize("form,access,batch_size,model", CASES)
def test_soul_round_equals_pooled_langevin(data3, form, access, batch_size, model):
    """Federated SOUL = SOUL on the pooled data: every chain ends where the joint Langevin
    chain ends (block-wise for the power form's server sites), and one SGD(1) step moves
    z_j by the pooled, draw-averaged d log p / dz_j."""
    vmodel = nf.vertical_split(model, clients=SPEC3, form=form, rho=0.7, response="y", response_access=access)
    soul = nf.VerticalSOUL(vmodel, optax.sgd(1.0), step_size=GAMMA, num_langevin=3, batch_size=batch_size)
    state = soul.init(random.PRNGKey(3), **data3)
    def moved(i, slot):
        inner = slot.state.inner
        inner = inner._replace(params={**inner.params, "z": random.normal(random.PRNGKey(i), (24,))})
        return slot._replace(state=slot.state._replace(inner=inner))

    state = state._replace(clients=tuple(moved(i, slot) for i, slot in enumerate(state.clients)))
    rows, noise0, noise = _round_noise(soul, state)
    new, _ = soul.update(state, **data3)
    obj = soul.objective
    chains, grad_z = pooled_soul_round(vmodel, obj, data3, rows, state, noise0, noise, GAMMA, 3)
    before = {c: slot.state.inner for c, slot in zip(obj.clients, state.clients)}
    after = {c: slot.state.inner for c, slot in zip(obj.clients, new.clients)}
    for c in obj.clients:
        step = after[c].params["z"] - before[c].params["z"]
        err = float(jnp.linalg.norm(step - grad_z[c]) / jnp.linalg.norm(grad_z[c]))
        assert err < 1e-5, (c, err)
        np.testing.assert_allclose(after[c].chain, chains[c], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.server.inner.chain, chains["server"], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- truth


def _linear_gaussian(intercept, n=40, rho=0.5, sigma=1.0, prior_sd=2.0):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (0.5 * intercept + x @ np.array([1.0, -1.0, 0.5]) + sigma * rng.normal(size=n)).astype(np.float32)

    def model(xa, xb, y):
        b0 = numpyro.sample("b0", dist.Normal(0.0, prior_sd)) if intercept else 0.0
        ba = numpyro.sample("ba", dist.Normal(0.0, prior_sd).expand([2]).to_event(1))
        bb = numpyro.sample("bb", dist.Normal(0.0, prior_sd).expand([1]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            ga = numpyro.deterministic("ga", xa @ ba)
            gb = numpyro.deterministic("gb", xb @ bb)
            numpyro.sample("y", dist.Normal(b0 + ga + gb, sigma), obs=y)

    spec = {"a": dict(data="xa", sites="ba", contribution="ga"), "b": dict(data="xb", sites="bb", contribution="gb")}
    return model, spec, dict(xa=x[:, :2], xb=x[:, 2:], y=y)


def langevin_stationary_cov(prec, gamma, server):
    """Exact stationary covariance of (block) ULA on a Gaussian with precision ``prec``:
    the clients' coordinates move first, then the ``server`` coordinates given them."""
    d = prec.shape[0]
    clients = [i for i in range(d) if i not in server]

    def step(e, xi):
        e = e.copy()
        for block in (clients, server):
            e[block] = e[block] - gamma * (prec @ e)[block] + np.sqrt(2 * gamma) * xi[block]
        return e

    a = np.stack([step(np.eye(d)[i], np.zeros(d)) for i in range(d)], 1)
    b = np.stack([step(np.zeros(d), np.eye(d)[i]) for i in range(d)], 1)
    return scipy.linalg.solve_discrete_lyapunov(a, b @ b.T)


@pytest.mark.parametrize("form,intercept", [("augmented", False), ("power", True)])
def test_soul_finds_the_map_of_z_and_samples_theta_given_it(form, intercept):
    """With known noise, log p(theta, z, y) is quadratic in both forms, so

    - the MAP of p(z, y) is the z-part of the joint mode ``m``;
    - p(theta | z, y) is Gaussian with precision ``P_tt`` and mean
      ``m_t - P_tt^{-1} P_tz (z - m_z)``;
    - (block) ULA with step gamma has a stationary covariance known exactly (discrete
      Lyapunov equation; ``(P_tt - gamma P_tt^2 / 2)^{-1}`` without server sites).

    The power case has a server-held intercept, sampled block-wise after the clients.
    """
    model, spec, data = _linear_gaussian(intercept)
    n, k = data["y"].shape[0], 3 + intercept
    vmodel = nf.vertical_split(model, clients=spec, rho=0.5, response="y", form=form)

    def log_joint(flat):
        params = {"ba": flat[k - 3:k - 1], "bb": flat[k - 1:k], "z_a": flat[k:k + n], "z_b": flat[k + n:]}
        if intercept:
            params["b0"] = flat[0]
        return -potential_energy(vmodel, (), data, params)

    zero = jnp.zeros(k + 2 * n)
    prec = -np.asarray(jax.hessian(log_joint)(zero), np.float64)
    mode = np.linalg.solve(prec, np.asarray(jax.grad(log_joint)(zero), np.float64))
    p_tt, p_tz = prec[:k, :k], prec[:k, k:]
    sd_z = np.sqrt(np.diag(np.linalg.inv(prec))[k:])  # marginal posterior sd of z

    gamma = 2e-3
    sched = optax.polynomial_schedule(0.1, 0.005, 1.0, 3000)
    soul = nf.VerticalSOUL(vmodel, optax.sgd(sched), step_size=gamma, num_langevin=10)
    res = soul.run(random.PRNGKey(0), num_rounds=3000, progress_bar=False, **data)
    z_hat = np.concatenate([res.params.parties["a"]["z"], res.params.parties["b"]["z"]])
    z_err = np.abs(z_hat - mode[k:]) / sd_z
    print(form, "max |z_hat - MAP| / sd(z) =", z_err.max())
    assert z_err.max() < 0.25

    draws = soul.sample_posterior(random.PRNGKey(1), res, 20_000, num_warmup=500)
    theta = np.concatenate(([draws["b0"][:, None]] if intercept else []) + [draws["ba"], draws["bb"]], axis=1)
    cond_mean = mode[:k] - np.linalg.solve(p_tt, p_tz @ (z_hat - mode[k:]))
    ula_sd = np.sqrt(np.diag(langevin_stationary_cov(p_tt, gamma, [0] if intercept else [])))
    exact_sd = np.sqrt(np.diag(np.linalg.inv(p_tt)))
    mean_err = np.abs(theta.mean(0) - cond_mean) / ula_sd
    print(form, "|mean - E[theta | z_hat]| / sd =", mean_err, "sd / ULA sd =", theta.std(0) / ula_sd,
          "ULA sd / exact sd =", ula_sd / exact_sd)
    assert mean_err.max() < 0.1
    np.testing.assert_allclose(theta.std(0), ula_sd, rtol=0.07)
    # the paper's caveat: conditioning on z_hat is narrower than the augmented posterior of theta
    marginal_sd = np.sqrt(np.diag(np.linalg.inv(prec))[:k])
    assert np.all(theta.std(0)[-3:] < 0.8 * marginal_sd[-3:]), (theta.std(0), marginal_sd)
    assert res.losses[-100:].mean() < res.losses[:100].mean()


def test_server_chain_and_server_param(data3):
    """Augmented form, y at the server: the server's Langevin chain draws the intercept and
    a server ``numpyro.param`` ascends its draw-averaged gradient (A.3). (A Gaussian
    likelihood with a learned noise scale is avoided on purpose: there ``log p(z, y)`` is
    unbounded as ``sum_j z_j -> y``, so the MAP of z does not exist.)"""

    def model(xa, xb, xc, y):
        b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
        scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
        ba = numpyro.sample("ba", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        bb = numpyro.sample("bb", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        bc = numpyro.sample("bc", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("rows", y.shape[0]):
            g = [numpyro.deterministic(f"g{c}", xx @ bx) for c, xx, bx in (("a", xa, ba), ("b", xb, bb), ("c", xc, bc))]
            numpyro.sample("y", dist.Bernoulli(logits=b0 + scale * sum(g)), obs=y)

    spec = {c: dict(data=f"x{c}", sites=f"b{c}", contribution=f"g{c}") for c in ("a", "b", "c")}
    data = {**data3, "y": (data3["y"] > 0.3).astype(jnp.float32)}
    vmodel = nf.vertical_split(model, clients=spec, rho=0.5, response="y", response_access="server")
    soul = nf.VerticalSOUL(vmodel, optax.adam(0.02), step_size={"server": 0.01, "a": 0.01, "b": 0.01, "c": 0.01},
                           num_langevin=4)
    res = soul.run(random.PRNGKey(0), num_rounds=600, progress_bar=False, **data)
    scale = float(res.params.server["point"]["scale"])  # constrained, as the model sees it
    np.testing.assert_allclose(scale, float(jnp.exp(res.state.server.inner.params["point"]["scale"])), rtol=1e-6)
    assert np.isfinite(scale) and abs(scale - 1.0) > 1e-2  # it moved
    assert np.all(np.isfinite(res.losses)) and res.losses[-50:].mean() < res.losses[:50].mean()
    draws = soul.sample_posterior(random.PRNGKey(1), res, 400, thinning=2)
    assert set(draws) == {"b0", "ba", "bb", "bc"}
    assert draws["b0"].shape == (400,) and float(draws["b0"].std()) > 0
    idata = nf.to_arviz(soul, res, random.PRNGKey(2), num_samples=100)
    assert idata.attrs["method"] == "vertical_soul" and "log_joint" in idata.sample_stats


# ---------------------------------------------------------------------------- privacy and errors


@pytest.mark.parametrize("form,access", [("augmented", "server"), ("power", "shared")])
def test_soul_sends_only_z_and_gradients_wrt_z(data3, form, access):
    vmodel = nf.vertical_split(privacy_model(form), clients=SPEC3, form=form, rho=0.7,
                               response="y", response_access=access)
    soul = nf.VerticalSOUL(vmodel, optax.adam(0.05), step_size=GAMMA, num_langevin=3, batch_size=8)
    res = soul.run(random.PRNGKey(0), num_rounds=4, progress_bar=False, record_transcript=True, keep_values=True,
                   **data3)
    assert_only_z_crosses(res, data3, form, access, secrets={})


def test_soul_clear_errors(data3):
    vmodel = nf.vertical_split(three_client_model, clients=SPEC3, rho=0.5, response="y")
    with pytest.raises(ValueError, match="step_size=0"):
        nf.VerticalSOUL(vmodel, optax.sgd(0.1), step_size=0.0)
    with pytest.raises(ValueError, match="num_langevin=0"):
        nf.VerticalSOUL(vmodel, optax.sgd(0.1), step_size=0.01, num_langevin=0)
    with pytest.raises(TypeError, match="optax"):
        nf.VerticalSOUL(vmodel, numpyro.optim.Adam(0.1), step_size=0.01)
    with pytest.raises(ValueError, match=r"names \['d'\]"):
        nf.VerticalSOUL(vmodel, optax.sgd(0.1), step_size={"d": 0.1}).init(random.PRNGKey(0), **data3)
    with pytest.raises(ValueError, match=r"no entry for \['server', 'c'\]"):
        nf.VerticalSOUL(vmodel, optax.sgd(0.1), step_size={"a": 0.1, "b": 0.1}).init(random.PRNGKey(0), **data3)
    with pytest.raises(ValueError, match="fitted VerticalSOUL"):
        nf.VerticalSOUL(vmodel, optax.sgd(0.1), step_size=0.01).sample_posterior(random.PRNGKey(0), None, 10)

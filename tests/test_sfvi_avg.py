import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed_examples.models import normal_hierarchical

from .test_privacy import contains


def test_barycenter_diagonal_closed_form_matches_bures():
    rng = np.random.default_rng(0)
    means = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    sds = jnp.asarray(rng.uniform(0.5, 2.0, size=(3, 2)), jnp.float32)
    covs = jnp.stack([jnp.diag(s**2) for s in sds])
    w = jnp.array([0.2, 0.3, 0.5])
    m1, c1 = nf.horizontal.gaussian_barycenter(w, means, covs, diagonal=True)
    m2, c2 = nf.horizontal.gaussian_barycenter(w, means, covs, diagonal=False)
    np.testing.assert_allclose(m1, w @ means, rtol=1e-6)
    np.testing.assert_allclose(jnp.sqrt(jnp.diag(c1)), w @ sds, rtol=1e-6)
    np.testing.assert_allclose(c2, c1, rtol=1e-3, atol=1e-4)


def test_bures_barycenter_fixed_point():
    rng = np.random.default_rng(1)
    A = rng.normal(size=(3, 3, 3))
    covs = jnp.asarray(np.einsum("kij,klj->kil", A, A) + np.eye(3), jnp.float32)
    w = jnp.ones(3) / 3
    _, S = nf.horizontal.gaussian_barycenter(w, jnp.zeros((3, 3)), covs)
    vals, vecs = np.linalg.eigh(np.asarray(S, np.float64))
    root = vecs @ np.diag(np.sqrt(vals)) @ vecs.T

    def sqrtm(M):
        v, U = np.linalg.eigh(M)
        return U @ np.diag(np.sqrt(np.clip(v, 0, None))) @ U.T

    fixed = sum(sqrtm(root @ np.asarray(C, np.float64) @ root) for C in covs) / 3
    np.testing.assert_allclose(fixed, S, rtol=2e-3, atol=2e-3)


def test_identical_clients_barycenter_is_identity():
    covs = jnp.stack([jnp.array([[2.0, 0.5], [0.5, 1.0]])] * 4)
    m, c = nf.horizontal.gaussian_barycenter(jnp.ones(4), jnp.ones((4, 2)), covs)
    np.testing.assert_allclose(c, covs[0], rtol=1e-3)


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(0)
    y = (1.0 + rng.normal(size=(24, 2))).astype(np.float32)
    return nf.Clients.split(np.arange(24) % 4, y=y)


def exact_mu(y, tau0=2.0, tau=1.0, sigma=1.0):
    """Mean and sd of mu's exact posterior under ``normal_hierarchical``."""
    g, m = y.shape
    prec = np.zeros((g + 1, g + 1))
    prec[0, 0] = 1 / tau0**2 + g / tau**2
    prec[0, 1:] = prec[1:, 0] = -1 / tau**2
    prec[np.arange(1, g + 1), np.arange(1, g + 1)] = 1 / tau**2 + m / sigma**2
    cov = np.linalg.inv(prec)
    return (cov @ np.concatenate([[0.0], y.sum(1) / sigma**2]))[0], np.sqrt(cov[0, 0])


@pytest.mark.parametrize("global_scale", ["full", "diagonal"])
def test_sfvi_avg_approaches_sfvi(clients, global_scale):
    """SFVI-Avg's q(mu) against SFVI's and the exact posterior, 0.25 sd.

    The SFVI reference decays its learning rate: at a constant adam(0.05) its last iterate
    wanders by up to 0.45 sd around the optimum (seed-dependent), which is optimiser noise
    in the reference, not an SFVI-Avg error."""
    guide = nf.StructuredGuide(normal_hierarchical, global_scale=global_scale)
    exact = nf.FederatedSVI(normal_hierarchical, guide, optax.adam(optax.exponential_decay(0.05, 1500, 0.05)),
                            num_particles=4)
    r_exact = exact.run(random.PRNGKey(0), clients, 1500, progress_bar=False)
    avg = nf.FederatedSVI(
        normal_hierarchical, guide, optax.adam(0.02), method="sfvi_avg", local_steps=25, num_particles=2
    )
    r_avg = avg.run(random.PRNGKey(0), clients, 60, progress_bar=False)
    mu_exact = exact.sample_posterior(random.PRNGKey(1), r_exact, 20000)["mu"]
    mu_avg = avg.sample_posterior(random.PRNGKey(1), r_avg, 20000)["mu"]
    assert abs(float(mu_avg.mean() - mu_exact.mean())) < 0.25 * float(mu_exact.std())
    truth, sd = exact_mu(np.stack([clients[c]["y"] for c in clients.names], 0).reshape(-1, 2))
    assert abs(float(mu_avg.mean()) - truth) < 0.25 * sd
    assert r_avg.communication.rounds == 60
    assert r_avg.communication.messages_up == 60 * 4


def test_partial_participation_counts_and_frozen_clients(clients):
    guide = nf.StructuredGuide(normal_hierarchical)
    svi = nf.FederatedSVI(
        normal_hierarchical, guide, optax.adam(0.02), method="sfvi_avg", local_steps=3, participation=0.5
    )
    result = svi.run(random.PRNGKey(0), clients, 10, progress_bar=False, record_transcript=True)
    assert result.communication.messages_up == 10 * 2
    senders_per_round = {}
    for e in result.transcript.entries:
        if e.receiver == "server":
            senders_per_round.setdefault(e.round, set()).add(e.sender)
    assert all(len(s) == 2 for s in senders_per_round.values())


def test_participation_rejected_for_sfvi():
    with pytest.raises(ValueError, match="participation < 1 is for method='sfvi_avg'"):
        nf.FederatedSVI(normal_hierarchical, nf.StructuredGuide(), optax.adam(0.1), participation=0.5)


def test_unequal_silos_reach_the_exact_posterior(clients):
    """Silos of 2, 4, 6 and 12 groups: each client's local objective weighs its own terms by
    N / N_j (paper 001, Alg. 2), so the server averages with weights N_j / N; then the average
    of the local objectives is the full ELBO and q(mu) reaches the exact posterior (0.25 sd).
    A plain 1/J average over-weights the small silos."""
    rng = np.random.default_rng(3)
    sizes = [2, 4, 6, 12]
    y = (rng.normal(size=(24, 2)) + np.repeat([3.0, 1.0, 0.0, -1.0], sizes)[:, None]).astype(np.float32)
    unequal = nf.Clients.split(np.repeat(np.arange(4), sizes), y=y)
    svi = nf.FederatedSVI(normal_hierarchical, nf.StructuredGuide(normal_hierarchical), optax.adam(0.02),
                          method="sfvi_avg", local_steps=25, num_particles=2)
    result = svi.run(random.PRNGKey(0), unequal, 80, progress_bar=False)
    mu = svi.sample_posterior(random.PRNGKey(1), result, 20000)["mu"]
    truth, sd = exact_mu(y)
    assert abs(float(mu.mean()) - truth) < 0.25 * sd, (float(mu.mean()), truth, sd)


NU_LOC = "opt_state[0].nu['guide']['loc']"


@pytest.mark.parametrize("mode", ["average", "keep", "reset"])
def test_optimizer_state_modes(clients, mode):
    """``optimizer_state`` (issue 26 item 7). ``"average"`` (the default): the clients' Adam
    states for the global parameters travel up, the server keeps their weighted average and
    sends it down, so every client starts from the same state and Adam's count runs over
    every round. ``"keep"``: each client's own state, never in a message. ``"reset"``: fresh
    every round. Every mode still reaches the exact posterior of mu on this model."""
    guide = nf.StructuredGuide(normal_hierarchical)
    kw = {} if mode == "average" else {"optimizer_state": mode}
    svi = nf.FederatedSVI(normal_hierarchical, guide, optax.adam(0.02), method="sfvi_avg", local_steps=25,
                          num_particles=2, **kw)
    result = svi.run(random.PRNGKey(0), clients, 60, progress_bar=False, record_transcript=True, keep_values=True)
    server = result.state.server
    up = [e for e in result.transcript.entries if e.receiver == "server"]
    if mode == "average":
        assert int(server.opt_state[0].count) == 60 * 25  # one shared count over every round
        assert all(c.global_opt_state == () for c in result.client_states.values())
        last = max(e.round for e in up)
        nu = [e.value for e in up if e.round == last and e.name == NU_LOC]
        assert len(nu) == 4  # every client sent its state; equal silos: the plain mean
        np.testing.assert_allclose(np.asarray(server.opt_state[0].nu["guide"]["loc"]), np.mean(nu, 0), rtol=1e-5)
        down = [e for e in result.transcript.entries if e.sender == "server" and e.name == "shared." + NU_LOC]
        assert len(down) == 60 * 4
    else:
        assert server.opt_state == ()
        assert not any("opt_state" in e.name for e in result.transcript.entries)
    if mode == "keep":
        counts = [int(c.global_opt_state[0].count) for c in result.client_states.values()]
        assert counts == [60 * 25] * 4
        for c in result.client_states.values():  # the client's own moments never travel
            moments = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(c.global_opt_state)])
            assert not any(contains(entry.value, moments) for entry in result.transcript.entries)
    mu = svi.sample_posterior(random.PRNGKey(1), result, 20000)["mu"]
    truth, sd = exact_mu(np.stack([clients[c]["y"] for c in clients.names], 0).reshape(-1, 2))
    assert abs(float(mu.mean()) - truth) < 0.25 * sd


def test_optimizer_state_is_checked():
    with pytest.raises(ValueError, match=r"optimizer_state='shared': choose one of \('average', 'reset', 'keep'\)"):
        nf.FederatedSVI(normal_hierarchical, nf.StructuredGuide(), optax.adam(0.1), method="sfvi_avg",
                        optimizer_state="shared")

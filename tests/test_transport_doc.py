"""docs/architecture.md's "Adding a transport", as a reader would paste it: a transport that runs
each client's step in a thread of its own, with PVI run over it."""

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import numpyro_fed as nf

from .doc_code import architecture_example

SIGMA, PRIOR_SD = 0.7, 2.0


def _linear(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([3]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, SIGMA), obs=y)


def _documented_backend():
    return architecture_example("Adding a transport", 100)["ThreadBackend"]


def test_pvi_over_the_documented_thread_transport_is_the_simulations_run():
    """Synchronous PVI on a conjugate linear regression over three clients of unequal size, run
    over the documented transport: its posterior is the exact one (computed here in closed form)
    and the simulation's, and it counts the same rounds, bytes and messages; a sequential
    schedule (one client asked a round) and dropout are refused by name."""
    ThreadBackend = _documented_backend()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -0.5, 0.3]) + SIGMA * rng.normal(size=90)).astype(np.float32)
    precision = x.T @ x / SIGMA**2 + np.eye(3) / PRIOR_SD**2
    cov = np.linalg.inv(precision)
    clients = nf.Clients.split(np.repeat([0, 1, 2], [20, 30, 40]), x=x, y=y)

    def pvi():
        return nf.PVI(_linear, schedule="synchronous", client_mapping="loop")

    threads = pvi().run(random.PRNGKey(0), clients, 3, backend=ThreadBackend(), progress_bar=False)
    simulation = pvi().run(random.PRNGKey(0), clients, 3, progress_bar=False)
    np.testing.assert_allclose(threads.params.mean, cov @ x.T @ y / SIGMA**2, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(threads.params.cov, cov, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(threads.params.mean, simulation.params.mean, rtol=1e-5, atol=1e-6)
    assert threads.communication == simulation.communication
    assert threads.verdict.status == simulation.verdict.status
    with pytest.raises(ValueError, match="every client is asked"):
        sequential = nf.PVI(_linear, schedule="sequential", client_mapping="loop")
        sequential.run(random.PRNGKey(0), clients, 3, backend=ThreadBackend(), progress_bar=False)
    with pytest.raises(ValueError, match="no simulated dropout"):
        pvi().run(random.PRNGKey(0), clients, 3, backend=ThreadBackend(), availability=0.5,
                  progress_bar=False)
    with pytest.raises(ValueError, match="client_mapping='loop'"):
        nf.PVI(_linear, schedule="synchronous", client_mapping="vmap").run(random.PRNGKey(0), clients, 3,
                                                                           backend=ThreadBackend(),
                                                                           progress_bar=False)

"""Nothing a client holds privately (data, local variational parameters) is ever sent."""

import jax
import numpy as np
import optax
import pytest
from jax import random

import numpyro_fed as nf

from .models import logistic_local


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 3)).astype(np.float32)
    y = (rng.random(30) < 0.5).astype(np.float32)
    return nf.Clients.split(np.repeat([0, 1, 2], [12, 10, 8]), X=X, y=y)


def private_arrays(result, clients):
    arrays = []
    for name in clients.names:
        arrays += [v for v in clients[name].values()]
        arrays += [np.asarray(x) for x in jax.tree_util.tree_leaves(result.client_states[name].local_params)]
    return arrays


def contains(haystack: np.ndarray, needle: np.ndarray) -> bool:
    """Does any run of ``needle``'s values (3 or more, non-trivial) appear in ``haystack``?"""
    h = np.ravel(haystack).astype(np.float32)
    n = np.ravel(needle).astype(np.float32)
    n = n[(n != 0) & (np.abs(n) != 1)]  # constants like 0/1 are not evidence
    if n.size < 3 or h.size < 3:
        return False
    return np.isin(n, h).mean() > 0.5


@pytest.mark.parametrize("method", ["sfvi", "sfvi_avg"])
def test_transcript_carries_only_global_quantities(clients, method):
    svi = nf.FederatedSVI(
        logistic_local, nf.StructuredGuide(logistic_local), optax.adam(0.05),
        method=method, local_steps=3,
    )
    result = svi.run(random.PRNGKey(0), 5, clients, progress_bar=False, record_transcript=True, keep_values=True)
    t = result.transcript
    sent_by_clients = [e for e in t.entries if e.receiver == "server"]
    assert sent_by_clients, "clients sent nothing?"
    # 1. names: only global parameters / gradients and the scalar ELBO term
    allowed = ("global_grad", "global_params", "elbo")
    assert all(e.name.startswith(allowed) for e in sent_by_clients), {e.name for e in sent_by_clients}
    # 2. shapes: nothing that scales with a client's rows
    n_global = svi._setup_cache.extra.global_size
    for e in t.entries:
        assert all(d <= max(n_global * n_global, n_global) for d in e.shape), e
    # 3. values: no client's data and no local variational parameter appears in any message
    for secret in private_arrays(result, clients):
        for e in t.entries:
            assert not contains(e.value, secret), (e.name, e.sender)
    # 4. accounting agrees with the run's communication counts
    assert t.bytes_up == result.communication.bytes_up
    assert t.bytes_down == result.communication.bytes_down


def test_audit_detects_a_leak(clients):
    """The audit above is not vacuous: it flags a message that carries client data."""
    secret = clients["0"]["X"]
    assert contains(np.concatenate([np.zeros(4), secret.ravel()]), secret)


def test_message_round_trip_as_ndarrays(clients):
    svi = nf.FederatedSVI(logistic_local, nf.StructuredGuide(logistic_local), optax.adam(0.05))
    state = svi.init(random.PRNGKey(0), clients)
    arrays = nf.message_to_ndarrays(state.broadcast)
    assert all(isinstance(a, np.ndarray) for a in arrays)
    back = nf.message_from_ndarrays(state.broadcast, arrays)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state.broadcast)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="leaves"):
        nf.message_from_ndarrays(state.broadcast, arrays[:-1])

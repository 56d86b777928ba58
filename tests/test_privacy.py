"""Nothing a client holds privately (data, local variational parameters, its PRNG key) is
ever sent or held by the server: a transcript audit of every algorithm core."""

import jax
import numpy as np
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.run.inference import fitted

from .families import DP_FAMILIES, FAMILIES, run
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
    if haystack is None:
        return False
    haystack, needle = np.asarray(haystack), np.asarray(needle)
    if haystack.dtype.kind in "ui" and needle.dtype.kind in "ui":  # keys: compare exactly
        n = np.ravel(needle).astype(np.int64)
        return n.size >= 2 and np.isin(n, np.ravel(haystack).astype(np.int64)).mean() > 0.5
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
    result = svi.run(random.PRNGKey(0), clients, 5, progress_bar=False, record_transcript=True, keep_values=True)
    t = result.transcript
    sent_by_clients = [e for e in t.entries if e.receiver == "server"]
    assert sent_by_clients, "clients sent nothing?"
    # 1. names: only global parameters / gradients, the scalar ELBO term and, for SFVI-Avg,
    # the optimiser's moments of the global parameters' gradients (optimizer_state="average")
    # and the client's row count N_j (the weight of its answer, as in FedAvg)
    allowed = ("global_grad", "global_params", "elbo") + (("opt_state", "rows") if method == "sfvi_avg" else ())
    assert all(e.name.startswith(allowed) for e in sent_by_clients), {e.name for e in sent_by_clients}
    # 2. shapes: nothing that scales with a client's rows
    n_global = fitted(svi).extra.global_size
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
    arrays = nf.run.transcript.message_to_ndarrays(state.broadcast)
    assert all(isinstance(a, np.ndarray) for a in arrays)
    back = nf.run.transcript.message_from_ndarrays(state.broadcast, arrays)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state.broadcast)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="leaves"):
        nf.run.transcript.message_from_ndarrays(state.broadcast, arrays[:-1])


def _client_secrets(family, inference, inputs, result):
    """Per client: its data and its local variational parameters (what never leaves it)."""
    names = fitted(inference).plan.names
    if isinstance(inputs, dict):  # vertical: each party's own covariates and its q parameters
        data = {"a": [inputs["xa"]], "b": [inputs["xb"]]}
        return {c: data[c] + jax.tree_util.tree_leaves(result.params.parties[c]) for c in names}
    secrets = {c: list(inputs[c].values()) for c in names}
    if family in ("sfvi", "sfvi_avg"):
        for c in names:
            secrets[c] += jax.tree_util.tree_leaves(result.client_states[c].local_params)
    if family.startswith("mwg"):  # its local latents' draws, which never leave the client
        for c in names:
            secrets[c].append(np.asarray(result.client_states[c].draws))
    return secrets


# What each core sends by design (so not a leak): HM1's device parameter theta_k (Alg. 1),
# vertical z_j on the round's rows (paper 000's protocol).
_BY_DESIGN = {"hm1": ("['theta']",), "vertical_sfvi": ("['z']",), "vertical_soul": ("['z']",)}


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(DP_FAMILIES))
@pytest.mark.filterwarnings("ignore::numpyro_fed.warnings.UnreliableFitWarning", "ignore:.*every update that arrived")
def test_privacy_audit_of_every_core(family):
    """No client data value, no local variational parameter and no client PRNG key (at any
    round) appears in any message, or in the server's state or pending broadcast. The DP
    variants (issue 12, item 6) also send nothing but their noised update (and, without a
    trusted aggregator, its validity flag and constant placeholders for the withheld fit
    diagnostics); under a trusted aggregator the server receives only the sum."""
    inference, inputs = {**FAMILIES, **DP_FAMILIES}[family]()
    keys = []  # every client's own key after each round (the client splits it each exchange)

    def grab(rnd, state, info):
        keys.extend(np.asarray(slot.rng_key) for slot in _slots(state, inference))

    result = run(inference, inputs, random.PRNGKey(0), 4, record_transcript=True, keep_values=True, callbacks=[grab])
    t = result.transcript
    assert t.entries and any(e.receiver == "server" for e in t.entries)
    server_held = [np.asarray(x) for x in jax.tree_util.tree_leaves(
        (result.state.server, result.state.server_key, result.state.broadcast))]
    for owner, secrets in _client_secrets(family, inference, inputs, result).items():
        for secret in secrets:
            for e in t.entries:
                if e.sender == owner and e.name in _BY_DESIGN.get(family, ()):
                    continue
                assert not contains(e.value, secret), (family, owner, e.name, e.sender, e.receiver)
            if family != "hm1":  # HM1's server keeps each device's last theta_k by design
                assert not any(contains(leaf, secret) for leaf in server_held), (family, owner)
    for key in keys:
        for e in t.entries:
            assert not contains(e.value, key), (family, e.name)
        assert not any(contains(leaf, key) for leaf in server_held), family
    assert t.bytes_up == result.communication.bytes_up and t.bytes_down == result.communication.bytes_down
    if family in DP_FAMILIES:
        sent = [e for e in t.entries if e.sender not in ("server", "aggregator")]
        allowed = {"['delta'].shift", "['delta'].precision", "['valid']", "['fit_ok']", "['fit_stat']", "['fit_k']"}
        assert all(e.name in allowed or e.name.startswith("['global_grad']") for e in sent), {e.name for e in sent}
        for e in sent:  # the fit diagnostics are constants: True, NaN
            if e.name in ("['fit_ok']",):
                assert bool(e.value)
            if e.name in ("['fit_stat']", "['fit_k']"):
                assert np.isnan(e.value)
        if inference.trusted_aggregator:
            assert {e.sender for e in t.entries if e.receiver == "server"} == {"aggregator"}


def _slots(state, inference):
    plan = fitted(inference).plan
    if plan.mapping == "loop":
        return list(state.clients)
    return [jax.tree_util.tree_map(lambda x, j=j: x[j], state.clients) for j in range(len(plan.names))]


def haystacks(result):
    """Every value sent (``result.transcript``) and every value the server holds, as two
    haystacks: ``(floats, integers)``."""
    held = jax.tree_util.tree_leaves((result.state.server, result.state.server_key, result.state.broadcast))
    leaves = [np.asarray(e.value) for e in result.transcript.entries] + [np.asarray(x) for x in held]
    floats = np.concatenate([np.ravel(x).astype(np.float32) for x in leaves if x.dtype.kind == "f"])
    ints = np.concatenate([np.ravel(x).astype(np.int64) for x in leaves if x.dtype.kind in "ui"])
    return floats, ints


def test_key_audit_is_not_vacuous():
    key = np.asarray(random.PRNGKey(123))
    assert contains(np.concatenate([np.zeros(3, np.uint32), key]), key)


@pytest.mark.parametrize("algo", ["nuts", "hmc"])
def test_privacy_audit_of_federated_mcmc(algo):
    """Issue 30, item 4: federated NUTS/HMC sends up only each client's potential term, its
    gradient w.r.t. the global position and scalars (kinetic energies, U-turn dot products),
    and down only the global position, the step and the server's decisions. No client's data,
    local position, momentum, local draw or key appears in any message or in the server's state."""
    from .families import hierarchical, horizontal_data

    short = dict(max_tree_depth=4) if algo == "nuts" else dict(num_steps=4)  # a few rounds per iteration
    cls = nf.FederatedNUTS if algo == "nuts" else nf.FederatedHMC
    inference, clients = cls(hierarchical, num_warmup=5, num_samples=5, **short), horizontal_data()
    keys, positions = [], []

    def grab(rnd, state, info):
        for slot in _slots(state, inference):
            keys.append(np.asarray(slot.rng_key))
            block = slot.state.block
            positions.extend(np.asarray(x) for x in (block.z, block.r0, block.pending.z, block.pending.r))

    result = inference.run(random.PRNGKey(0), clients, record_transcript=True, keep_values=True, callbacks=[grab])
    t = result.transcript
    up = {e.name for e in t.entries if e.receiver == "server"}
    assert up == {"pe", "grad", "kinetic", "kinetic0", "turn", "full"}, up
    down = {e.name for e in t.entries if e.sender == "server"}
    assert down == {"shared.theta", "shared.seq"} | {f"shared.cmd.{f}" for f in nf.mcmc.block.Command._fields} | {
        f"shared.dec.{f}" for f in nf.mcmc.block.Decisions._fields}, down
    d = fitted(inference).extra.config.global_size
    for e in t.entries:  # nothing scales with a client's rows or local sites: (chains, d) at most
        if e.name != "turn":  # (chains, max_tree_depth, 2) scalars
            assert int(np.prod(e.shape)) <= d, e
    floats, ints = haystacks(result)
    secrets = [np.asarray(v) for c in clients.names for v in list(clients[c].values())
               + [result.client_states[c].draws]]
    assert len(positions) > 20 and any(np.size(p) >= 3 for p in positions)
    for secret in secrets + positions:
        assert not contains(floats, secret)
    for key in keys:
        assert not contains(ints, key)
    assert contains(floats, np.asarray(result.state.server.draws))  # the audit sees what is there
    assert t.bytes_up == result.communication.bytes_up and t.bytes_down == result.communication.bytes_down

"""Issue 13: the algorithms over a real Flower federation (a SuperLink and SuperNodes on
127.0.0.1, each node holding one client's data), against the simulation backend.

Network tests (marked ``flower``): each run costs about a minute (the ServerApp process
starts, the clients build and compile), so they are few: one federation for the equality
and transcript tests, one for the dropout test.
"""

import os
import re
import warnings
from pathlib import Path

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

pytest.importorskip("flwr")

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.flower import LocalFederation  # noqa: E402
from numpyro_fed.flower.runtime.launcher import descendants, pid_exists  # noqa: E402
from numpyro_fed.flower.sealed import OVERHEAD  # noqa: E402
from numpyro_fed.run.inference import fitted

from .families import DP_FAMILIES, FAMILIES, FIT_FAMILIES, MCMC_FAMILIES, run  # noqa: E402
from .test_privacy import _BY_DESIGN, _client_secrets, _slots, contains  # noqa: E402

pytestmark = pytest.mark.flower
HERE = Path(__file__).parent
APP_FILES = {name: (HERE / name).read_text() for name in ("families.py", "flower_tasks.py")}
# float tolerance of Flower == simulation: the same jit-compiled client and server steps run
# on the same inputs; measured equal to the bit (max |difference| 0.0), asserted to 1e-6
RTOL, ATOL = 1e-6, 1e-6
ROUNDS = 2


def _federation(num_nodes, aggregator=False, tls=False, **options):
    # numpyro-fed-seed: each node derives its key from run seed 0 as the simulation does
    return LocalFederation([{"partition-id": i, "numpyro-fed-seed": 0} for i in range(num_nodes)],
                           app_files=APP_FILES, aggregator=aggregator, tls=tls, **options)


# Flower's own deployment path, unchanged: flower-supernode, every message through the SuperLink
# (about 3.6 s a round); the other tests use the defaults (paced SuperNode, rounds over a stream)
FLOWER_PATH = dict(supernode="flower", stream=False)


@pytest.fixture(scope="module")
def federation():
    # runs without secure_sum leave the aggregator out; every executor link is TLS (issue 28, item 13)
    with _federation(3, aggregator=True, tls=True) as fed:
        pids = [p.pid for p in fed.procs]
        yield fed
    for pid in pids:  # every process it started is gone, and none of theirs is left
        assert not pid_exists(pid) and descendants(pid) == []


def _first_missed(table, j):
    """The first round (1-based) client ``j`` missed in a ``(rounds, J)`` answered table."""
    missed = np.flatnonzero(~table[:, j])
    return int(missed[0]) + 1 if missed.size else None


ALL = {**FAMILIES, **DP_FAMILIES, **MCMC_FAMILIES}


def _simulate(family, num_rounds, **options):
    inference, inputs = ALL[family]()
    if hasattr(inference, "client_mapping"):
        inference.client_mapping = "loop"  # one client per node, unpadded
    keys = []

    def grab(rnd, state, info):
        keys.extend(np.asarray(slot.rng_key) for slot in _slots(state, inference))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(inference, inputs, random.PRNGKey(0), num_rounds, callbacks=[grab], **options)
    return inference, inputs, result, keys


def _assert_same(flower, result):
    got, want = jax.tree_util.tree_leaves(flower["server_state"]), jax.tree_util.tree_leaves(result.state.server)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
    # the running figure (a KL, an energy) is a float32 reduction of those leaves, computed by processes compiled
    # with other XLA settings: it agrees to a few float32 ulps more than the leaves it reads (measured 2.8e-6)
    np.testing.assert_allclose(flower["trace"], np.asarray(result.trace), rtol=10 * RTOL, atol=ATOL)


def _audit(family, inference, inputs, result, keys, flower):
    """The transcript recorded at the server, from the messages as they arrived through the
    SuperLink, carries no client data value, local variational parameter or client key (the
    simulation's audit), and its byte count is what Flower's ArrayRecords carried."""
    t = flower["transcript"]
    senders = {e.sender for e in t.entries}
    assert "server" in senders and senders <= {"server", "aggregator"} | set(flower["clients"])  # HM1 asks 2 of 3
    for owner, secrets in _client_secrets(family, inference, inputs, result).items():
        for secret in secrets:
            for e in t.entries:
                if e.sender == owner and e.name in _BY_DESIGN.get(family, ()):
                    continue
                assert not contains(e.value, secret), (family, owner, e.name, e.sender)
    for key in keys:
        assert not any(contains(e.value, key) for e in t.entries), family
    comm = flower["communication"]
    assert t.bytes_up == comm["bytes_up"] > 0 and t.bytes_down == comm["bytes_down"] > 0


# PVI's equality is shown by the dropout test (rounds 1-2 with every client, then without one)
@pytest.mark.parametrize("family", ["pvi_dp_optimisation", "svi_dp_trusted", "ep", "laplace", "sfvi_avg", "sfvi",
                                    "vertical_sfvi", "hm1", "vertical_soul"])
def test_flower_equals_the_simulation_and_sends_only_the_algorithms_messages(federation, family):
    """Item 1: the Flower run's server state and trace equal the simulation's (loop mapping,
    the same client keys, so DP noise too). Item 2: the server-side transcript audit. Under
    DP each client sends its privacy ledger (one int32 ``releases``) after the last round,
    and ``privacy_report`` on the server equals the simulation's. Under a trusted aggregator
    (``svi_dp_trusted``) each client seals its secure part for the aggregator node; the
    server relays it unread and receives only the sum."""
    inference, inputs, result, keys = _simulate(family, ROUNDS)
    J = len(fitted(inference).plan.names)
    flower = federation.run(f"flower_tasks:{family}", ROUNDS, seed=0, num_clients=J, keep_values=True)
    assert flower["clients"] == list(fitted(inference).plan.names)
    _assert_same(flower, result)
    assert flower["missing"] == []
    np.testing.assert_array_equal(flower["rounds_answered"], result.rounds_answered)  # SFVI-Avg asks 2 of 3
    _audit(family, inference, inputs, result, keys, flower)
    entries = flower["transcript"].entries
    ledger = [e for e in entries if e.exchange == "ledger"]
    sealed = [e for e in entries if e.receiver == "aggregator"]
    assert all(e.name == "['sealed']" and e.dtype == "uint8" for e in sealed)
    secure = {k for ex in fitted(inference).algorithm.exchanges for k in ex.secure_sum}
    assert bool(sealed) == bool(secure) == (family == "svi_dp_trusted")
    to_server = {e.name for e in entries if e.receiver == "server" and e.sender != "aggregator"}
    assert not any(n.startswith(f"['{k}']") for k in secure for n in to_server)  # the server never saw a part
    check = [e for e in entries if e.exchange in ("log_weights", "local_integral", "vertical_terms",
                                                  "vertical_moments")]  # the fit check, after the run
    comm = flower["communication"]
    assert comm["bytes_down"] == result.communication.bytes_down + sum(e.nbytes for e in check if e.sender == "server")
    # a sealed part is one uint8 array (a 128-byte .npy header) of the secure leaves' bytes and the envelope
    assert comm["bytes_up"] == (result.communication.bytes_up + sum(e.nbytes for e in ledger + check
                                                                    if e.sender != "server")
                                + len(sealed) * (128 + OVERHEAD))
    if family in ("sfvi", "sfvi_avg", "ep", "laplace", "vertical_sfvi"):  # the fit check, each client's term
        assert {e.sender for e in check if e.sender != "server"} == set(flower["clients"])
        # (vertical: the parties' float32 terms are summed in another order than the simulation's)
        np.testing.assert_allclose(flower["fit_check"].log_weights, inference.last_fit_check.log_weights,
                                   rtol=1e-5, atol=1e-3 if family == "vertical_sfvi" else 1e-4)
        assert not any("fit check" in w and "needs every" in w for w in flower["warnings"])
        if family == "vertical_sfvi":  # its terms, then its own sites' moments, standardised
            assert sorted({e.exchange for e in check}) == ["vertical_moments", "vertical_terms"]
            got, want = flower["fit_check"], inference.last_fit_check
            assert {m.site for m in got.moments} == {m.site for m in want.moments}
            assert {m.site for m in got.biased} == {m.site for m in want.biased} and got.verdict == want.verdict
    else:
        assert check == []
    if family == "vertical_soul":  # SOUL's check over a network is not built, and it says so
        assert any("SOUL's check is not built" in w for w in flower["warnings"])
    if family in DP_FAMILIES:
        assert [e.name for e in ledger] == ["['releases']"] * J
        want = inference.privacy_report(result)
        assert flower["privacy_report"].clients == want.clients and want.epsilon < np.inf
        assert [int(e.value) for e in ledger] == [int(result.client_states[n].releases) for n in flower["clients"]]
    else:
        assert ledger == [] and "privacy_report" not in flower


def test_the_executor_link_hands_tasks_only_to_the_holder_of_the_nodes_secret(federation):
    # item 13: the node's runtime API gives a task (its messages, its context: the client's key and state) only
    # to an AcquireTask signed with the node's own SuperExec secret; LocalFederation gives each node a fresh one
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    from numpyro_fed.flower.runtime.executor import ACQUIRE_METHODS

    secret = (federation.workdir / "secrets" / "superexec0.key").read_bytes()
    assert len(secret) == 32 and (os.stat(federation.workdir / "secrets" / "superexec0.key").st_mode & 0o077) == 0
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP], agentapp_fab_hashes=[])
    ca = federation.certificates["ca"].read_bytes()  # the link is TLS: a plain-HTTP client gets no answer

    def client_with(key, tls=True):
        signer = [] if key is None else [SuperExecAuthHttpInterceptor(master_secret=key,
                                                                      protected_methods=ACQUIRE_METHODS)]
        return RuntimeHttpClient.from_server_address(
            server_address=federation.runtime_apis[0], insecure=not tls, root_certificates=ca if tls else None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec"), *signer])

    for key, refused in ((None, True), (b"another secret", True), (secret, False)):
        client = client_with(key)
        try:
            if refused:
                with pytest.raises(httpx.HTTPStatusError, match="401 Unauthorized"):
                    client.AcquireTask(request)
            else:  # the node's own secret: answered (no task waits now, so none is taken from its executor)
                assert not client.AcquireTask(request).HasField("task")
        finally:
            client.close()
    plain = client_with(secret, tls=False)
    try:
        with pytest.raises(httpx.HTTPError):  # even with the secret: the server speaks TLS only
            plain.AcquireTask(request)
    finally:
        plain.close()


def test_flower_demo_command_matches_the_simulation_and_leaves_no_process(tmp_path):
    """Item 5: ``python -m numpyro_fed flower-demo --clients 3`` (as README says) fits over a
    real federation, equals the simulation, and every process it started is gone after."""
    import json
    import subprocess
    import sys

    out = tmp_path / "demo.json"
    run = subprocess.run([sys.executable, "-m", "numpyro_fed", "flower-demo", "--method", "pvi", "--clients", "3",
                          "--rounds", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert "Flower vs simulation" in run.stdout and figures["left_running"] == []
    assert len(figures["pids"]) >= 7  # a SuperLink, 3 SuperNodes, 3 executors, flwr run, ...
    assert not any(pid_exists(pid) for pid in figures["pids"])
    assert figures["max_abs_difference"] <= 1e-6
    np.testing.assert_allclose(figures["flower_mean"], figures["exact_mean"], atol=1e-4)  # conjugate: exact


def test_flower_demo_runs_nf_fit_over_supernodes_on_a_model_with_local_latents(tmp_path):
    """``python -m numpyro_fed flower-demo`` at its defaults: nf.fit of a ward GLMM (each
    hospital's ward effects on its node) over three SuperNodes takes the same rungs and rounds as
    the simulation, is within 0.3 pooled sds of NumPyro's NUTS on the pooled rows, and leaves no
    process running."""
    import json
    import subprocess
    import sys

    out = tmp_path / "demo.json"
    run = subprocess.run([sys.executable, "-m", "numpyro_fed", "flower-demo", "--clients", "3", "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert "pooled NUTS" in run.stdout and figures["left_running"] == []
    assert not any(pid_exists(pid) for pid in figures["pids"])
    assert figures["flower_method"] == figures["simulation_method"], figures["log"]
    assert figures["rounds"] == figures["simulation_rounds"]
    assert figures["max_abs_z_to_pooled_nuts"] <= 0.3, figures["table"]


def test_a_party_keeps_its_own_arrays_over_the_templates_zeros():
    """Each party builds the algorithm from the template with zeros for what it does not
    hold, and its own arrays win over those zeros (the power form gives the response to
    every party and the server alike)."""
    from numpyro_fed.flower.wire import Template, inputs_from_template

    shapes = {"xa": ((4, 2), "<f4"), "y": ((4,), "<f4")}
    template = Template("vertical", {"a": shapes, "b": {"xb": ((4, 1), "<f4"), "y": ((4,), "<f4")}},
                        {"y": ((4,), "<f4")})
    y = np.arange(4, dtype=np.float32)
    mine = inputs_from_template(template, own=("a", {"xa": np.ones((4, 2), np.float32), "y": y}))
    np.testing.assert_array_equal(mine["y"], y)
    assert not mine["xb"].any() and mine["xa"].all()
    server = inputs_from_template(template, server={"y": y})
    np.testing.assert_array_equal(server["y"], y)


def _wards(ward, sigma, y):
    """Data enter a distribution's parameters (a known scale per row, eight schools' shape)
    and a group plate (a ward effect per ward, ``G_j`` per client)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with nf.group_plate("wards", ward), nf.local_site():
        a = numpyro.sample("a", dist.Normal(mu, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Normal(a[ward], sigma), obs=y)


@pytest.mark.parametrize("family", ["nuts", "sfvi", "pvi", "ep"])
def test_every_party_builds_the_simulations_algorithm_from_the_template(family):
    """The class behind eight schools failing over Flower: a party builds the algorithm with
    placeholders for the data it does not hold, and set-up read their values. Zeros are no
    valid scale (NumPyro validates by default) and zero group codes size every group plate
    to one. Now the server and each client build, from the template alone (group sizes
    measured by each node on its own codes), the algorithm the simulation builds on the
    pooled clients: the same group sizes and every message of the same structure."""
    import jax
    import optax

    from numpyro_fed.flower import FlowerTask
    from numpyro_fed.flower.task import build, own_groups_of
    from numpyro_fed.flower.wire import Template, describe, parse_template, shapes_of, wire_structures
    from numpyro_fed.run.backends.mapping import client_item

    rng = np.random.default_rng(0)
    groups = {"a": 3, "b": 5, "c": 2}
    data = {}
    for name, G in groups.items():
        ward = np.concatenate([np.arange(G), rng.integers(0, G, 4)]).astype(np.int32)
        sigma = rng.uniform(0.5, 2.0, ward.size).astype(np.float32)
        data[name] = dict(ward=ward, sigma=sigma, y=rng.normal(size=ward.size).astype(np.float32))
    clients = nf.Clients(data)
    make = {"nuts": lambda: nf.FederatedNUTS(_wards, num_warmup=5, num_samples=5),
            "sfvi": lambda: nf.FederatedSVI(_wards, nf.StructuredGuide(_wards), optax.adam(0.05)),
            "pvi": lambda: nf.PVI(_wards, update="optax", optim=optax.adam(0.05), local_steps=5),
            "ep": lambda: nf.EP(_wards, schedule="synchronous")}[family]
    task = FlowerTask(make, lambda cfg: None)
    said = {n: own_groups_of(task, n, clients[n]) for n in clients.names}  # each node's hello
    assert said == {n: {"wards": [G, ["ward"]]} for n, G in groups.items()}
    shapes = {n: shapes_of(clients[n]) for n in clients.names}
    template = parse_template(describe(Template("horizontal", shapes, {}, said)))

    def structures(inference, setup):
        plan = setup.plan
        items = [client_item(plan, plan.data, i) for i in range(len(plan.names))]
        built = wire_structures(setup.algorithm, items, plan.server_data)
        return inference.model.group_sizes, jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), built)

    reference = make()
    reference.init(jax.random.PRNGKey(0), clients)
    want = structures(reference, fitted(reference))
    assert want[0] == {"wards": 5}
    parties = [None] + [(n, clients[n]) for n in clients.names]  # the server, then each client
    for own in parties:
        inference, _, setup = build(task, template, 10, own=own)
        assert structures(inference, setup) == want, own and own[0]


def test_a_client_refuses_its_own_invalid_data_at_set_up_as_the_simulation_does():
    """Validation is off only for the placeholders: a client whose own ``sigma`` holds a zero
    fails its set-up with NumPyro's message, naming the site, as the simulation does."""
    from numpyro_fed.flower import FlowerTask
    from numpyro_fed.flower.task import build
    from numpyro_fed.flower.wire import Template, shapes_of

    ward = np.array([0, 1, 0], np.int32)
    good = dict(ward=ward, sigma=np.ones(3, np.float32), y=np.zeros(3, np.float32))
    bad = dict(good, sigma=np.array([1.0, 0.0, 1.0], np.float32))
    template = Template("horizontal", {"a": shapes_of(good), "b": shapes_of(bad)}, {},
                        {"a": {"wards": (2, ("ward",))}, "b": {"wards": (2, ("ward",))}})
    task = FlowerTask(lambda: nf.FederatedNUTS(_wards, num_warmup=5, num_samples=5), lambda cfg: None)
    build(task, template, 10, own=("a", good))
    with pytest.raises(ValueError, match="invalid scale parameter"):
        build(task, template, 10, own=("b", bad))
    with pytest.raises(ValueError, match="invalid scale parameter"):
        nf.FederatedNUTS(_wards, num_warmup=5, num_samples=5).init(jax.random.PRNGKey(0), nf.Clients({"a": good,
                                                                                                "b": bad}))


def test_a_sealed_part_opens_only_with_the_aggregators_key_and_its_own_round():
    """The envelope of the trusted aggregator's parts: only the aggregator's private key
    opens it, and only with the run, round, exchange and client it was sealed for (a part
    the server swaps between clients or replays in another round does not open)."""
    from cryptography.exceptions import InvalidTag

    from numpyro_fed.flower.sealed import associated_data, new_keypair, open_sealed, seal, split_leaves
    from numpyro_fed.run.transcript import message_to_bytes

    private, public = new_keypair()
    message = {"g": np.arange(3, dtype=np.float32), "n": np.asarray(2, np.int32)}
    plain = message_to_bytes(message)
    blob = seal(public, plain, associated_data(7, 1, 0, 2))
    assert len(blob) == len(plain) + OVERHEAD and plain not in blob
    assert seal(public, plain, associated_data(7, 1, 0, 2)) != blob  # a fresh key and nonce per part
    leaves = split_leaves(open_sealed(private, blob, associated_data(7, 1, 0, 2)))
    np.testing.assert_array_equal(leaves[0], message["g"])
    assert int(leaves[1]) == 2
    for aad in (associated_data(7, 1, 0, 1), associated_data(7, 2, 0, 2), associated_data(8, 1, 0, 2)):
        with pytest.raises(InvalidTag):
            open_sealed(private, blob, aad)
    with pytest.raises(InvalidTag):
        open_sealed(new_keypair()[0], blob, associated_data(7, 1, 0, 2))
    tampered = bytearray(blob)
    tampered[-1] ^= 1
    with pytest.raises(InvalidTag):
        open_sealed(private, bytes(tampered), associated_data(7, 1, 0, 2))


def test_a_site_whose_set_up_fails_stops_the_run_naming_it_and_sends_no_text():
    """Issue 28, items 11-12: node 2 is misconfigured (its ``numpyro-fed-seed`` is not a
    number), so its set-up fails. The run stops before round 1 naming the client, its node
    and the category; the client's own exception text (which names the bad value) stays in
    the node's log and never reaches the server's result."""
    from numpyro_fed.flower.runtime.launcher import FederationError

    configs = [{"partition-id": i, "numpyro-fed-seed": 0} for i in range(3)]
    configs[2]["numpyro-fed-seed"] = "not-a-seed-7781"
    with LocalFederation(configs, app_files=APP_FILES) as fed:
        with pytest.raises(FederationError) as failed:
            fed.run("flower_tasks:sfvi", 2, seed=0, timeout=400)
        result_file = sorted(Path(fed.workdir).glob("run*.pkl"))[-1].read_bytes()
    message = str(failed.value)
    assert "set-up failed on 1 of 3 client(s): client '2' (node " in message
    assert "numpyro_fed client: its set-up failed (ValueError); the reason is in the node's own log" in message
    assert "on_setup_failure='absent'" in message
    assert b"not-a-seed-7781" not in result_file and "not-a-seed-7781" not in message


def test_flower_runs_federated_nuts_equal_to_the_simulation(federation):
    """Issue 30: federated NUTS over a real loopback Flower federation stops when its chains are
    done and equals the simulation (every server leaf: global draws, statistics, tree, keys), in
    as many rounds; the transcript at the server carries no client data value or key."""
    inference, inputs, result, keys = _simulate("nuts", 500)
    flower = federation.run("flower_tasks:nuts", 500, seed=0, num_clients=3, keep_values=True)
    _assert_same(flower, result)
    assert flower["communication"]["rounds"] == result.communication.rounds < 500
    assert flower["missing"] == []
    _audit("nuts", inference, inputs, result, keys, flower)


@pytest.mark.parametrize("family", ["fit", "fit_nuts", "fit_exact"])
def test_nf_fit_over_flower_equals_the_simulation(federation, family):
    """``nf.fit`` as one Flower task (its ``make_inference`` returns a ``Ladder``): the server
    announces each rung at set-up and every node builds it, so the ladder takes the same steps
    as in simulation (its log), in as many rounds, and returns the same draws. ``fit``: the
    Laplace fit accepted (both checks computed on the nodes); ``fit_exact``: ``exact=True``,
    Metropolis-within-Gibbs from the Laplace search's mode (announced in the set-up); a seeded
    node derives its key for each rung as the simulation does, so its local moves are the
    simulation's. ``fit_nuts``: a ring-shaped posterior whose centre, where the Laplace search
    starts, is a minimum of the log posterior: the search reaches no mode and the curvature there
    is not negative definite, so no MwG start exists and federated NUTS runs (64 short chains);
    there the rungs (log, figures masked) are compared, not the rounds or draws (the trees of 64
    chains over some 2,000 rounds follow float32 rounding). The processes of the federation need not
    compile with the same XLA settings as this one (the test session turns most optimisations off), so the figures agree
    to float32 rounding, not to the bit: measured 1.7e-5 at most on NUTS's draws after 220
    rounds, asserted to 1e-4; the log is compared with its figures masked, the rounds exactly.
    Where ``exact=True``'s chains run on, over the network they run again from the start (each
    client keeps its own state): :func:`_assert_restarted_run_on`. No client's rows appear in any
    rung's transcript."""
    ladder, inputs = FIT_FAMILIES[family]()
    ladder.client_mapping, ladder.progress_bar = "loop", False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = ladder.run(random.PRNGKey(0), inputs, record_transcript=True)
    flower = federation.run(f"flower_tasks:{family}", 1, seed=0, num_clients=3, keep_values=True)
    got = flower["fit"]
    assert got["method"] == sim.method == {"fit": "laplace", "fit_nuts": "nuts", "fit_exact": "mwg"}[family], got["log"]
    masked = lambda log: [re.sub(r"-?\d+(\.\d+)?(e[+-]\d+)?", "#", line) for line in log]  # noqa: E731
    want = sim.get_samples()
    assert set(got["samples"]) == set(want)
    restarted = [i for i, line in enumerate(got["log"]) if "again from the start" in line]
    if family == "fit_exact" and restarted:  # chains run on: over a network they run again from the start
        _assert_restarted_run_on(ladder, sim, got, restarted, masked, want)
    else:
        assert masked(got["log"]) == masked(sim.log)
    if family != "fit_nuts" and not restarted:
        assert got["rounds"] == sim.rounds
        for k in want:
            np.testing.assert_allclose(got["samples"][k], np.asarray(want[k]), rtol=1e-4, atol=1e-4)
    assert flower["missing"] == []
    assert len(got["transcripts"]) == len(sim.results)
    for transcript in got["transcripts"]:
        assert transcript.entries
        for name in inputs.names:
            for value in inputs[name].values():
                assert not any(contains(e.value, value) for e in transcript.entries if e.sender == name), name


def _assert_restarted_run_on(ladder, sim, got, restarted, masked, want):
    """Chains short of their effective draws run on: in simulation they continue where they stopped;
    over a network (each client keeps its own state) they run again from the start with the same
    keys (documented in ``MwGRung.options``). The logs agree but for that line and what follows from
    it; the network pays the first run's rounds again (warmup + draws + 1); the first run's draws,
    which both keep, agree to float32 rounding."""
    (i,) = restarted
    assert masked(got["log"][:i]) == masked(sim.log[:i])
    assert masked([got["log"][i].replace(", again from the start)", ")")]) == masked([sim.log[i]])
    first = ladder.rung(ladder.stage("mwg", (np.zeros(1), np.eye(1))))  # the first run's chains and draws
    extra = first.num_warmup + first.num_samples + 1
    assert got["rounds"] == sim.rounds + extra
    for k in want:
        ours = np.asarray(got["samples"][k]).reshape((first.num_chains, -1) + np.shape(want[k])[1:])
        theirs = np.asarray(want[k]).reshape(ours.shape[:1] + (-1,) + ours.shape[2:])
        np.testing.assert_allclose(ours[:, :first.num_samples], theirs[:, :first.num_samples], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mwg", "mwg_surrogate"])
def test_flower_runs_federated_mwg_equal_to_the_simulation(federation, family):
    """Federated Metropolis-within-Gibbs over the loopback federation (its start given as init=,
    so every node builds the same chains): every server leaf equal to the simulation's with the
    same keys, in as many rounds (iterations + 1); the server-side transcript carries no client
    data value or key (nor, being local, any of the clients' latents). ``mwg_surrogate``: the
    surrogate transition, its clients' gradients in warmup and the surrogate refitted from them."""
    inference, inputs, result, keys = _simulate(family, 100)
    flower = federation.run(f"flower_tasks:{family}", 100, seed=0, num_clients=3, keep_values=True)
    _assert_same(flower, result)
    assert flower["communication"]["rounds"] == result.communication.rounds == 16 + 16 + 1
    assert flower["missing"] == []
    _audit(family, inference, inputs, result, keys, flower)

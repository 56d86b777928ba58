"""Faults in a real Flower federation (a SuperLink and SuperNodes on 127.0.0.1): a SuperNode
killed or restarted, a stream cut, a reply past the timeout, a run resumed from its checkpoint.
Each fit continues as the simulation would, and says what happened."""

import os
import time
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flwr")

from numpyro_fed.flower import LocalFederation  # noqa: E402

from .test_flower import (  # noqa: E402
    APP_FILES,
    ATOL,
    FLOWER_PATH,
    RTOL,
    _assert_same,
    _audit,
    _federation,
    _first_missed,
    _simulate,
)
from .test_privacy import _slots  # noqa: E402

pytestmark = pytest.mark.flower


def _pvi_killing_node_2_after_round_2(fed, rounds):
    """Submit a PVI run (reply timeout 8 s) and kill SuperNode 2 (SIGKILL) once round 2 is done."""
    handle = fed.submit("flower_tasks:pvi", rounds, seed=0, reply_timeout=8.0, keep_values=True)
    deadline = time.monotonic() + 400
    while fed.progress(handle) < 2 and time.monotonic() < deadline and handle[0].poll() is None:
        time.sleep(0.1)
    assert fed.progress(handle) == 2
    fed.kill_node(2)
    return handle


def test_a_killed_supernode_drops_out_and_is_reported():
    """Item 3: SuperNode 2 is killed (SIGKILL) after round 2 of 5; the fit continues with the
    other two (the dropout policy: a client that does not answer within the reply timeout
    is left out of that round's server step), the result says which rounds lacked which
    client, and it equals the simulation with client 2 unavailable from round 3 on (item 1
    for PVI: rounds 1-2 ran with every client). The transcript audit (item 2) holds. On
    Flower's own deployment path (flower-supernode, every message through the SuperLink)."""
    rounds = 5
    with _federation(3, **FLOWER_PATH) as fed:
        handle = _pvi_killing_node_2_after_round_2(fed, rounds)
        flower = fed.wait(handle, timeout=400)
    lacked = [(r, names) for r, kind, names in flower["missing"] if kind == "round"]
    assert [r for r, _ in lacked] == [3, 4, 5] and all(names == ["2"] for _, names in lacked)
    assert list(flower["rounds_answered"]) == [3, 3, 2, 2, 2]
    assert any("MissingClientsWarning" in w and "'2' missed round(s) [3, 4, 5]" in w for w in flower["warnings"])
    schedule = np.ones((rounds, 3), bool)
    schedule[2:, 2] = False
    inference, inputs, result, keys = _simulate("pvi", rounds, availability=schedule)
    _assert_same(flower, result)  # item 1 for PVI: rounds 1-2 with every client, then without '2'
    _audit("pvi", inference, inputs, result, keys, flower)
    # after the run the fit check asks every client for its term; '2' is gone, so q is unchecked, and says so
    check = [e for e in flower["transcript"].entries if e.exchange == "log_weights" and e.sender != "server"]
    assert sorted({e.sender for e in check}) == ["0", "1"]
    assert flower["communication"]["bytes_up"] == result.communication.bytes_up + sum(e.nbytes for e in check)
    assert any("UncheckedFitWarning" in w and "did not answer" in w for w in flower["warnings"])


def _schedule(flower, rounds, names):
    """The (rounds, J) table of who answered, read from the result's ``missing`` list."""
    table = np.ones((rounds, len(names)), bool)
    for r, kind, lacked in flower["missing"]:
        if kind == "round":
            for n in lacked:
                table[r - 1, names.index(n)] = False
    return table


def test_a_restarted_supernode_rejoins_under_its_site_name_with_its_stored_state(tmp_path):
    """Issue 28, item 15: SuperNode 2 is killed (SIGKILL) after round 2 of 6 and started again
    with the same node config; Flower gives it a new node id. Before a later round the server
    finds it, it answers the hello with site '2', gets the site's set-up as a ``rejoin`` and
    takes its state from the node's own storage (``numpyro-fed-state-dir``, the checkpoint
    format). The site answers again from then on, and the run equals the simulation in which
    '2' was unavailable exactly in the rounds it missed (its state untouched meanwhile). On
    Flower's own deployment path; the stream's dropout and rejoin have their own test."""
    rounds = 6
    configs = [{"partition-id": i, "numpyro-fed-seed": 0, "numpyro-fed-state-dir": str(tmp_path / f"site{i}")}
               for i in range(3)]
    with LocalFederation(configs, app_files=APP_FILES, **FLOWER_PATH) as fed:
        handle = _pvi_killing_node_2_after_round_2(fed, rounds)
        fed.restart_node(2)
        flower = fed.wait(handle, timeout=600)
    assert [(name, old != new) for _, name, old, new in flower["rejoined"]] == [("2", True)]
    back = flower["rejoined"][0][0]
    assert 4 <= back <= rounds  # it missed round 3 at least, then answered again
    names = flower["clients"]
    schedule = _schedule(flower, rounds, names)
    assert not schedule[2, 2] and schedule[back - 1:, 2].all() and schedule[:, :2].all()
    assert any("client '2' rejoined before round" in w for w in flower["warnings"])
    run_id = next((tmp_path / "site2").iterdir()).name.split("-")[1]  # the latest state and the one before it
    assert sorted(p.name for p in (tmp_path / "site2").iterdir()) == [f"run-{run_id}-2.npz",
                                                                       f"run-{run_id}-2.previous.npz"]
    inference, inputs, result, keys = _simulate("pvi", rounds, availability=schedule)
    _assert_same(flower, result)  # the rejoined client went on from its stored state, not a fresh one


def test_a_client_killed_mid_stream_is_left_out_at_once_and_rejoins_over_a_new_invitation(tmp_path):
    """Issue 30, item 5: over the run's stream (the default), SuperNode 2 is killed (SIGKILL)
    after round 2, so its stream breaks: it is left out of the next round at once (no reply
    timeout to wait), the others go on. Started again, it answers the hello under its site
    name, rejoins with its stored state, is invited to the stream again and answers from
    then on. The run equals the simulation in which '2' was unavailable exactly in the rounds
    it missed, and the warning names them."""
    rounds = 400  # fast rounds: enough of them for the node to be restarted while the run goes on
    configs = [{"partition-id": i, "numpyro-fed-seed": 0, "numpyro-fed-state-dir": str(tmp_path / f"site{i}")}
               for i in range(3)]
    with LocalFederation(configs, app_files=APP_FILES) as fed:
        handle = fed.submit("flower_tasks:pvi", rounds, seed=0, reply_timeout=30.0, keep_values=True)
        deadline = time.monotonic() + 400
        while fed.progress(handle) < 2 and time.monotonic() < deadline and handle[0].poll() is None:
            time.sleep(0.05)
        fed.kill_node(2)
        killed_after = fed.progress(handle)
        fed.restart_node(2)
        flower = fed.wait(handle, timeout=600)
    assert 2 <= killed_after < rounds
    names = flower["clients"]
    schedule = _schedule(flower, rounds, names)
    missed = _first_missed(schedule, 2)
    assert missed is not None and missed > 2 and schedule[: missed - 1, 2].all() and schedule[:, :2].all()
    assert [(name, old != new) for _, name, old, new in flower["rejoined"]] == [("2", True)]
    back = flower["rejoined"][0][0]
    assert missed < back <= rounds and schedule[back - 1:, 2].all() and not schedule[missed - 1: back - 1, 2].any()
    # the broken stream left it out at once: the rounds it missed took no reply timeout
    assert max(flower["round_seconds"][missed - 1: back - 2] or [0.0]) < 30.0
    assert any("client '2' rejoined before round" in w for w in flower["warnings"])
    inference, inputs, result, keys = _simulate("pvi", rounds, availability=schedule)
    _assert_same(flower, result)
    _audit("pvi", inference, inputs, result, keys, flower)


def _stored_slot(folder, name, like):
    """The client state a node keeps in ``numpyro-fed-state-dir`` (its latest) for site ``name``."""
    from numpyro_fed.run import checkpoint
    from numpyro_fed.run.protocol import ClientSlot, RunState

    (path,) = [p for p in Path(folder).iterdir() if p.name.endswith(f"-{name}.npz")]
    shape = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), like)
    zero = jax.ShapeDtypeStruct((2,), np.uint32)
    template = RunState(jax.ShapeDtypeStruct((), np.int32), (), zero, (), (ClientSlot(zero, shape),), zero)
    return checkpoint.load(str(path), template, [name]).clients[0]


@pytest.mark.parametrize("family", ["pvi", "ep"])
def test_a_reply_past_the_timeout_takes_its_step_back_so_q_stays_the_product_of_the_factors(tmp_path, family):
    """A client whose reply came after the reply timeout had computed a step the server never
    counted. It kept that state: a PVI client then applied, at its next round, an update the
    server had never applied, and ``q = p * prod_j t_j`` no longer held for the rest of the
    run (a wrong posterior, with no more than the missed-round warning). Here SuperNode 2's
    executor is paused (SIGSTOP) for three reply timeouts and resumed: its replies to the rounds
    it was paused in arrive late. Each round's first message tells a client after which round
    the server holds its state, and the client takes the uncounted step back (its node warns).
    At the end the server's ``q`` is the prior times every node's own factor (read from its
    node's storage), to float tolerance; for PVI and for EP (the same factor protocol)."""
    import signal

    from numpyro_fed.factor.updates import current_factor

    rounds, timeout = 60, 4.0  # a reply timeout a loaded CI machine does not hit by chance
    configs = [{"partition-id": i, "numpyro-fed-seed": 0, "numpyro-fed-state-dir": str(tmp_path / f"site{i}")}
               for i in range(3)]
    with LocalFederation(configs, app_files=APP_FILES) as fed:
        handle = fed.submit(f"flower_tasks:{family}", rounds, seed=0, reply_timeout=timeout, keep_values=True)
        deadline = time.monotonic() + 400
        while fed.progress(handle) < 3 and time.monotonic() < deadline and handle[0].poll() is None:
            time.sleep(0.05)
        executor = fed.nodes[2][1].pid
        os.kill(executor, signal.SIGSTOP)
        try:
            time.sleep(3 * timeout)
        finally:
            os.kill(executor, signal.SIGCONT)
        flower = fed.wait(handle, timeout=600)
        node_log = (fed.workdir / "executor2.log").read_text()
    names = flower["clients"]
    schedule = _schedule(flower, rounds, names)
    missed = _first_missed(schedule, 2)
    # (under load another client may miss a round too: the identity below covers every client)
    assert missed is not None and schedule[-1, 2], flower["missing"]
    assert flower["rejoined"] == []  # the same node all along: late, not gone
    # the prior, from the simulation (the same model): q minus every client's factor there
    inference, inputs, result, keys = _simulate(family, 2)
    sim = _slots(result.state, inference)
    ack = np.asarray(result.state.server.ack)
    prior = result.state.server.q
    for j, slot in enumerate(sim):
        prior = jax.tree_util.tree_map(lambda a, b: a - b, prior, current_factor(slot.state, ack[j]))
    q, ack = flower["server_state"].q, np.asarray(flower["server_state"].ack)
    product = prior
    for j, name in enumerate(names):
        state = _stored_slot(tmp_path / f"site{j}", name, sim[j].state).state
        product = jax.tree_util.tree_map(lambda a, b: a + b, product, current_factor(state, ack[j]))
    for a, b in zip(jax.tree_util.tree_leaves(q), jax.tree_util.tree_leaves(product)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    assert "came after the server's timeout" in node_log  # its node says so


def test_a_flower_run_resumes_from_its_checkpoint_as_if_uninterrupted(tmp_path):
    """Issue 28, item 15: a Flower run with ``checkpoint=`` writes the server's part (its state,
    broadcast, keys and round, with the run id and sites) each round, and each site keeps its
    state per round on its node. A new run with ``resume=`` that checkpoint goes on from it:
    2 rounds, then 2 resumed rounds, equal the simulation's 4 rounds in one run."""
    configs = [{"partition-id": i, "numpyro-fed-seed": 0, "numpyro-fed-state-dir": str(tmp_path / f"site{i}")}
               for i in range(3)]
    server_ckpt = tmp_path / "server.npz"
    with LocalFederation(configs, app_files=APP_FILES) as fed:
        first = fed.run("flower_tasks:pvi", 2, seed=0, checkpoint=str(server_ckpt))
        resumed = fed.run("flower_tasks:pvi", 2, seed=5, resume=str(server_ckpt),  # the checkpoint's keys win
                          checkpoint=str(tmp_path / "again.npz"))
    from numpyro_fed.run.checkpoint import read_meta

    for part in (first, resumed):  # a site left out (e.g. a reply past its timeout) is named, not a number apart
        assert part["missing"] == [], (part["missing"], part["warnings"])
    meta, again = read_meta(str(server_ckpt)), read_meta(str(tmp_path / "again.npz"))
    assert meta["family"] == "flower.server" and meta["sites"] == first["clients"] and meta["round"] == 2
    assert again["round"] == 4 and again["run_id"] != meta["run_id"]
    stored = sorted(p.name.split("-round-")[1] for p in (tmp_path / "site0").glob("*-round-*"))
    assert stored  # per-round states on the node, pruned to those a resume could need
    _, _, result, _ = _simulate("pvi", 4)
    got, want = jax.tree_util.tree_leaves(resumed["server_state"]), jax.tree_util.tree_leaves(result.state.server)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.concatenate([first["trace"], resumed["trace"]]), np.asarray(result.trace),
                               rtol=RTOL, atol=ATOL)

"""Issue 30, item 5, without a federation: the pacing of polls, numpyro_fed's SuperNode entry
point (its patch of Flower's loop and its version pin), and the run's stream (frames, tokens,
late replies, broken connections, TLS, loopback-only plain TCP). The runs over a real loopback
federation are in test_flower.py."""

import pathlib
import socket
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, RecordDict  # noqa: E402

from numpyro_fed.flower.runtime import stream as st  # noqa: E402
from numpyro_fed.flower.runtime.pace import Pacer  # noqa: E402


def test_a_pacer_doubles_while_idle_up_to_its_cap_and_starts_over_after_activity():
    waits = []
    pacer = Pacer(0.002, 0.05, sleep=waits.append)
    for _ in range(7):
        pacer.wait()
    pacer.active()
    pacer.wait()
    assert waits == pytest.approx([0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.002])
    for first, idle in ((0.0, 1.0), (0.5, 0.1), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="need 0 < first <= idle"):
            Pacer(first, idle)


@pytest.fixture
def flower_loop(monkeypatch):
    """Flower's SuperNode module, its patched names restored after the test."""
    from flwr.supernode import start_client_internal as module

    for name in ("time", "_push_messages", "pull_objects"):
        monkeypatch.setattr(module, name, getattr(module, name))
    return module


def test_the_paced_supernode_replaces_flowers_three_sleeps_and_its_object_backoff(flower_loop, monkeypatch):
    from numpyro_fed.flower.runtime import supernode

    slept, pulled, pushed = [], [], []

    def pull_objects(ids, pull_object_fn, max_time=7200, max_tries_per_object=500, initial_backoff=1.0,
                     backoff_cap=10.0):  # Flower's signature
        pulled.append((initial_backoff, backoff_cap, max_tries_per_object, max_time))
        return {}

    monkeypatch.setattr(flower_loop, "pull_objects", pull_objects)
    monkeypatch.setattr(flower_loop, "_push_messages", lambda **kw: pushed.append(kw))
    idle = supernode.pace_supernode(poll=0.002, idle_poll=0.5, sleep=slept.append)
    loop_time = flower_loop.time
    for _ in range(10):
        loop_time.sleep(3)  # Flower's idle pull
    loop_time.sleep(0.5)  # Flower's wait for the executor's reply
    assert slept[:10] == pytest.approx([0.002 * 2**i for i in range(8)] + [0.5, 0.5])
    assert slept[10] == pytest.approx(0.002)
    assert loop_time.monotonic() > 0  # every other name is the real module's
    flower_loop._push_messages(state=None)  # a message was pulled: poll fast again
    assert pushed == [{"state": None}] and idle.delay == pytest.approx(0.002)
    flower_loop.pull_objects(["id"], pull_object_fn=None)
    # fast retries, for as long as Flower's own default allows (not 500 tries: 2 minutes at 0.25 s)
    assert pulled == [(0.002, 0.25, None, 7200)]


def test_the_paced_supernode_refuses_a_flower_it_was_not_tested_with(flower_loop, monkeypatch, capsys):
    import flwr

    from numpyro_fed.flower.runtime import supernode

    monkeypatch.setattr(flwr, "__version__", "1.99.0", raising=False)
    with pytest.raises(supernode.FlowerVersionError, match="not 1.99.0: run Flower's own flower-supernode"):
        supernode.pace_supernode()
    assert flower_loop.time is supernode.time  # nothing was patched
    assert supernode.run(["--insecure"]) == 2  # the command says so and exits 2
    assert "not 1.99.0" in capsys.readouterr().err


def test_the_supernode_command_passes_flowers_own_options_through(monkeypatch):
    from numpyro_fed import __main__ as cli
    from numpyro_fed.flower.runtime import supernode

    seen = {}
    def fake(args, poll, idle, parent_pid=0):
        seen.update(args=args, poll=poll, idle=idle, parent=parent_pid)
        return 0

    monkeypatch.setattr(supernode, "run", fake)
    assert cli.main(["flower-supernode", "--poll", "0.01", "--parent-pid", "7", "--", "--insecure", "--superlink",
                     "127.0.0.1:1"]) == 0
    assert seen == {"args": ["--insecure", "--superlink", "127.0.0.1:1"], "poll": 0.01, "idle": 0.5, "parent": 7}
    # the launcher's command (no numpyro_fed import) parses the same
    light = supernode.light_command("python", poll=0.01, parent_pid=7) + ["--insecure", "--superlink", "127.0.0.1:1"]
    assert light[1:4] == [str(pathlib.Path(supernode.__file__).with_name("lifeline.py")), "7",
                          "numpyro_fed.flower.runtime.supernode:cli"]
    seen.clear()
    monkeypatch.setattr(sys, "argv", ["cli", *light[4:]])
    assert supernode.cli() == 0
    assert seen == {"args": ["--insecure", "--superlink", "127.0.0.1:1"], "poll": 0.01, "idle": 0.5, "parent": 0}
    monkeypatch.undo()
    with pytest.raises(ValueError, match="need 0 < poll <= idle_poll"):
        supernode.run([], poll=1.0, idle_poll=0.1)


def _content(value):
    return RecordDict({"nf": ConfigRecord({"kind": "exchange", "round": 1}),
                       "broadcast": ArrayRecord([np.full(3, value, np.float32)])})


def _double(frame, context):
    """A client handler: doubles the array; an error frame for a negative one."""
    x = frame.content["broadcast"].to_numpy_ndarrays()[0]
    if x[0] < 0:
        return st.FrameReply(error=st.FrameError(2, "numpyro_fed client: its step failed"))
    context.append(frame.message_type)
    return st.FrameReply(content=RecordDict({"message": ArrayRecord([2 * x])}))


def _client(address, token, ca=None):
    seen, out = [], {}
    thread = threading.Thread(target=lambda: out.update(served=st.serve(address, token, seen, _double, ca_file=ca)))
    thread.start()
    return thread, seen, out


def test_the_stream_carries_requests_and_replies_and_refuses_a_wrong_token():
    server = st.StreamServer("127.0.0.1:0")
    tokens = server.tokens([7, 8])
    intruder = socket.create_connection(st.split_address(server.address))
    intruder.sendall(st.HEADER.pack(st.HELLO, 0, 32) + b"x" * 32)  # no valid token: closed
    threads = [_client(server.address, tokens[n]) for n in (7, 8)]
    assert server.accept(tokens, timeout=20.0) == {7, 8}
    assert intruder.recv(1) == b""
    intruder.close()
    replies = server.exchange({7: ("train", _content(1.0)), 8: ("query", _content(-1.0))}, timeout=20.0)
    np.testing.assert_array_equal(replies[7].content["message"].to_numpy_ndarrays()[0], [2.0, 2.0, 2.0])
    assert replies[8].has_error() and replies[8].error == (2, "numpyro_fed client: its step failed")
    server.close()
    for thread, seen, out in threads:
        thread.join(10.0)
    assert threads[0][2]["served"] == 1 and threads[0][1] == ["train"] and threads[1][2]["served"] == 1


def test_a_late_reply_is_dropped_and_a_broken_connection_leaves_the_node_out():
    server = st.StreamServer("127.0.0.1:0")
    tokens = server.tokens([1])
    sock = socket.create_connection(st.split_address(server.address))
    st.send_frame(sock, st.HELLO, 0, tokens[1])
    assert server.accept(tokens, timeout=20.0) == {1}
    assert server.exchange({1: ("train", _content(1.0))}, timeout=0.2) == {}  # no answer in time
    kind, seq1, _ = st.recv_frame(sock)
    st.send_frame(sock, st.REPLY, seq1, st.encode_frame("train", _content(5.0)))  # the late answer to request 1
    got = {}
    late = st.encode_frame("train", _content(6.0))
    threading.Timer(0.3, lambda: (got.update(req=st.recv_frame(sock)),
                                  st.send_frame(sock, st.REPLY, got["req"][1], late))).start()
    replies = server.exchange({1: ("train", _content(2.0))}, timeout=20.0)  # request 2: only its own reply counts
    assert got["req"][1] == seq1 + 1
    assert replies[1].content["broadcast"].to_numpy_ndarrays()[0][0] == 6.0
    sock.close()  # the node dies
    assert server.exchange({1: ("train", _content(3.0))}, timeout=20.0) == {}
    assert 1 in server.broken and 1 not in server.conns
    server.close()


def test_plain_tcp_only_on_loopback_and_tls_verified_against_the_ca(tmp_path):
    with pytest.raises(ValueError, match="not a loopback address: over a network the stream must be TLS"):
        st.StreamServer("10.1.2.3:0")
    with pytest.raises(ValueError, match="refusing to send over plain TCP"):
        st.serve("10.1.2.3:9", b"t" * 32, None, _double)
    from numpyro_fed.flower.runtime.launcher import loopback_certificates

    certs = loopback_certificates(tmp_path / "c")
    server = st.StreamServer("127.0.0.1:0", str(certs["cert"]), str(certs["key"]))
    tokens = server.tokens([3])
    thread, seen, out = _client(server.address, tokens[3], ca=str(certs["ca"]))
    assert server.accept(tokens, timeout=20.0) == {3} and server.tls
    replies = server.exchange({3: ("train", _content(4.0))}, timeout=20.0)
    assert replies[3].content["message"].to_numpy_ndarrays()[0][0] == 8.0
    server.close()
    thread.join(10.0)
    assert out["served"] == 1
    other = loopback_certificates(tmp_path / "other")  # a client that trusts another CA does not connect
    server = st.StreamServer("127.0.0.1:0", str(certs["cert"]), str(certs["key"]))
    tokens, accepted = server.tokens([4]), {}
    acceptor = threading.Thread(target=lambda: accepted.update(nodes=server.accept(tokens, timeout=2.0)))
    acceptor.start()
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        st.serve(server.address, tokens[4], None, _double, ca_file=str(other["ca"]), connect_timeout=10.0)
    acceptor.join(10.0)
    assert accepted["nodes"] == set()
    server.close()


def test_a_started_process_stops_with_its_launcher_and_imports_no_jax(tmp_path):
    """What LocalFederation starts (SuperLink, SuperNodes) stops once the process that started
    it is gone, killed with no chance to clean up; and it runs without numpyro_fed's package
    (JAX, NumPyro), at Flower's own memory cost."""
    import os
    import subprocess

    from numpyro_fed.flower.runtime.lifeline import command

    (tmp_path / "sleeper.py").write_text(
        "import sys, time\n"
        "def main():\n"
        "    heavy = sorted(m for m in ('jax', 'numpyro', 'numpyro_fed.flower.client') if m in sys.modules)\n"
        "    open(sys.argv[1], 'w').write(repr(heavy))\n"
        "    time.sleep(120)\n")
    seen = tmp_path / "seen"
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child = subprocess.Popen(command(sys.executable, "sleeper:main", [str(seen)], parent_pid=launcher.pid),
                             env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not (seen.exists() and seen.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert seen.read_text() == "[]"
        assert child.poll() is None  # runs while its launcher does
        launcher.kill()
        launcher.wait()
        assert child.wait(timeout=30) != 0  # stopped by its lifeline, not by the sleep's end
    finally:
        for proc in (launcher, child):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_progress_file_is_never_read_empty_while_the_server_rewrites_it(tmp_path):
    """LocalFederation.progress polls the ServerApp's progress file while the ServerApp
    rewrites it every round. Rewritten in place (truncate, then write), a read between the two
    found it empty and gave 0 rounds (a stop-48 CI failure: the killed-mid-stream test saw
    0 rounds after round 2). Written whole and renamed, every read gives a round, and the
    rounds read never go back."""
    from numpyro_fed.flower.app import write_progress
    from numpyro_fed.flower.runtime.launcher import read_progress

    path = str(tmp_path / "run.pkl.progress")
    assert read_progress(path) == 0  # before the first round
    write_progress(path, 1, 0.0, ["0", "1"])
    rounds = 3000
    writer = threading.Thread(target=lambda: [write_progress(path, r, 0.01 * r, ["0", "1"])
                                              for r in range(2, rounds + 1)])
    writer.start()
    seen = []
    while writer.is_alive():
        seen.append(read_progress(path))
    writer.join()
    assert min(seen) >= 1 and seen == sorted(seen)
    assert read_progress(path) == rounds
    (tmp_path / "bad.progress").write_text("")  # a damaged file is an error, not "no round yet"
    with pytest.raises((IndexError, ValueError)):
        read_progress(str(tmp_path / "bad.progress"))


def test_a_client_takes_back_a_step_the_server_did_not_count_and_refuses_a_state_older_than_its():
    """The node's side of ``kept`` (``client._counted``), without a federation: a client that
    stepped in round 4 (index 3) whose reply the server did not count (``kept`` 3) returns to
    its slot before that step, keeping its spent key and its privacy ledger's count; a counted
    step stays; a state older than the one the server counted is an error, not an answer."""
    from types import SimpleNamespace
    from typing import NamedTuple

    from flwr.app import RecordDict

    from numpyro_fed.flower import client as cl
    from numpyro_fed.run.protocol import ClientSlot
    from numpyro_fed.warnings import MissingClientsWarning

    class State(NamedTuple):
        x: float
        releases: int

    built = SimpleNamespace(name="2", checkpoint_every=0)
    context = SimpleNamespace(node_config={}, state=RecordDict(), run_id=1)

    def ask(kept):
        cl._counted(SimpleNamespace(content={"nf": {"kept": kept}}), context, built)

    before, after = ClientSlot("key 1", State(1.0, 4)), ClientSlot("key 2", State(2.0, 5))
    live = {"slot": after, "base": before, "rounds": {"after": 4, "began": 3}}
    token = cl._LIVE.set(live)
    try:
        ask(4)  # counted: nothing changes
        assert live["slot"] is after and live["rounds"] == {"after": 4, "began": 3}
        with pytest.warns(MissingClientsWarning, match="its reply in round 4 came after the server's timeout"):
            ask(3)  # not counted: back to the state after round 3
        assert live["slot"] == ClientSlot("key 2", State(1.0, 5)) and live["rounds"] == {"after": 3, "began": -1}
        ask(3)  # taken back once
        assert live["slot"] == ClientSlot("key 2", State(1.0, 5))
        with pytest.raises(ValueError, match="holds its state after round 3, and the server counted .* round 5"):
            ask(5)
    finally:
        cl._LIVE.reset(token)

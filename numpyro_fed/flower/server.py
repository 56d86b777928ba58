"""The server's side: :class:`FlowerBackend`, the round loop over Flower's ``Grid``.

:class:`FlowerBackend` offers the simulation backend's ``run`` (same arguments, same
:class:`~numpyro_fed.protocol.RunResult`), so an inference object's ``run(...,
backend=FlowerBackend(grid))`` drives a real federation. A round does what
``SimulationBackend`` does, with the client computations on the nodes:

1. the server splits its own key and asks ``select``'s clients;
2. per exchange it pushes each asked client its broadcast (``shared`` and its own
   ``per_client`` row) and pulls the replies until every asked client answered or the
   reply timeout passed; a client that did not answer (a dead node, an error, a timeout)
   is treated as not having answered (the runtime's dropout policy: its row of the
   messages is zeros and the server step sees it in ``view.answered``); a later exchange
   of the round asks only the clients that answered the earlier ones;
3. the server step runs here (jit-compiled).

Rounds that lacked clients are reported by name (a warning and ``backend.missing``). A
client that computed but whose answer arrived late takes its step back, as the simulation
leaves a client that did not answer as it was: each round's first message tells it after
which round the server holds its state (``kept``), and a client that stepped in a later round
returns to its state before that step (its key and privacy ledger stay spent, see
``client._counted``).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._validation import check_callable, check_positive_number
from ..backends.driver import checkpoint_interval, drive
from ..protocol import RunResult, RunState
from ..warnings import MissingClientsWarning, find_stack_level
from .messaging import Messenger
from .rounds import OverFlower
from .sealed import ROLE_KEY
from .task import FlowerTask
from .wire import Template, WireStructures, describe, from_record

__all__ = ["ClientLedger", "FlowerBackend", "MissingClientsWarning"]


SERVER_CHECKPOINT = "flower.server"  # the family of a Flower run's server checkpoint
_UNSUPPORTED = ("FlowerBackend.run does not support {what} yet (it is supported by the simulation backend); "
                "run without it")


class FlowerBackend(Messenger):
    """Runs an algorithm's rounds over a Flower ``Grid`` (inside a ServerApp's ``main``).

    Args:
        grid: the ServerApp's ``Grid``.
        reply_timeout: seconds to wait for the clients' answers to one exchange.
        first_timeout: the same for the set-up and the first round (clients compile then).
        poll: the longest wait between two pulls of the replies: the first pull after a push
            waits 1 ms (or ``poll`` if shorter), each further one twice the last
            (:class:`~numpyro_fed.flower.runtime.pace.Pacer`).
        progress: a callable ``(round, answered names)`` after each round (e.g. to write
            a progress file).
        on_setup_failure: ``"raise"`` (default): a client whose set-up fails stops the run,
            naming it, its node and the reason's category; ``"absent"``: the run goes on
            without it, which is warned and recorded as absent from every round.
        stream: ``"HOST:PORT"`` (port 0: any free one): after the set-up, the run's messages go
            over one stream per client (:mod:`numpyro_fed.flower.runtime.stream`), each opened by an
            invitation sent through Flower, instead of through the SuperLink; ``None``
            (default): every message through Flower. A client that does not connect counts as
            a failed set-up; one whose stream breaks is left out until its site rejoins.
        stream_certfile: the stream's TLS certificate (PEM; required for a non-loopback
            ``stream``; the clients name the CA in ``numpyro-fed-stream-ca``).
        stream_keyfile: its key (PEM).

    Set ``collect_ledgers = True`` for a differentially private run (numpyro_fed's
    ServerApp does): after the last round each client sends its privacy ledger (its
    ``releases`` count, one int32), so that ``privacy_report(result)`` works on the server;
    ``result.client_states[name]`` is then that :class:`ClientLedger`. Nothing else of a
    client's state leaves its node.
    """

    def __init__(self, grid: Any, *, reply_timeout: float = 60.0, first_timeout: float = 600.0, poll: float = 0.05,
                 progress: Optional[Callable] = None, on_setup_failure: str = "raise",
                 resume_from: Optional[str] = None, run_id: int = 0, stream: Optional[str] = None,
                 stream_certfile: Optional[str] = None, stream_keyfile: Optional[str] = None) -> None:
        if grid is None or not callable(getattr(grid, "push_messages", None)):
            raise TypeError(f"FlowerBackend(grid=...): expected the ServerApp's flwr Grid, got a {type(grid).__name__}")
        self.grid = grid
        self.reply_timeout = check_positive_number("FlowerBackend", "reply_timeout", reply_timeout)
        self.first_timeout = check_positive_number("FlowerBackend", "first_timeout", first_timeout)
        self.poll = check_positive_number("FlowerBackend", "poll", poll)
        if self.poll >= self.reply_timeout:
            raise ValueError(f"FlowerBackend(poll={poll!r}, reply_timeout={reply_timeout!r}): poll must be shorter "
                             f"than reply_timeout (every exchange would time out after one pull)")
        self.progress = check_callable("FlowerBackend", "progress", progress)
        if on_setup_failure not in ("raise", "absent"):
            raise ValueError(f"FlowerBackend(on_setup_failure={on_setup_failure!r}): choose 'raise' (default: a site "
                             f"whose set-up fails stops the run) or 'absent' (fit without it, reported)")
        self.on_setup_failure = on_setup_failure
        if resume_from is not None and not os.path.isfile(resume_from):
            raise FileNotFoundError(f"FlowerBackend(resume_from={resume_from!r}): no checkpoint there")
        self.resume_from = resume_from  # a server checkpoint (checkpoint= of an earlier Flower run)
        self.run_id = int(run_id)  # this Flower run's id (the ServerApp's context.run_id): in checkpoints
        self.template: Optional[Template] = None
        self.nodes: List[int] = []
        self.missing: List[tuple] = []  # (round, exchange, [client names]) that did not answer
        self.errors: Dict[str, str] = {}  # client name -> last error it reported
        self._unavailable: set = set()  # nodes Flower last answered for with NODE_UNAVAILABLE (late heartbeat)
        self.round_seconds: List[float] = []
        self.timings: Dict[str, float] = {}  # seconds: connect, setup
        self.collect_ledgers = False  # ask each client for its privacy ledger after the last round (DP runs)
        self.aggregator: Optional[int] = None  # the trusted aggregator's node (numpyro-fed-role = "aggregator")
        self.aggregator_key = ""  # its public key (hex), relayed to the clients at set-up
        self.rejoined: List[tuple] = []  # (round, client name, old node, new node): sites that came back
        self._seen: set = set()  # nodes asked for their name already (ours, the aggregator, strangers)
        self._last_round: Optional[List[int]] = None  # per site, during a run: the round after which it holds its state
        if stream is not None:
            from .runtime.stream import split_address

            split_address(stream)  # checked now, opened by run()
        self.stream = stream  # HOST:PORT: the run's exchanges over one stream per client (module stream)
        self.stream_tls = (stream_certfile, stream_keyfile)
        self._stream = None  # the RunStream while a run streams
        self.stage = ""  # the nf.fit rung the next run is (numpyro_fed.ladder.Ladder.stage), sent at set-up

    # ------------------------------------------------------------------ messaging
    def connect(self, task: FlowerTask, num_clients: int, timeout: float = 120.0):
        """Wait for ``num_clients`` nodes, ask every connected node for its name and data
        shapes (no values; a node whose ``load_client`` returns ``None`` takes no part),
        and build the template (clients ordered by ``partition-id``, then name)."""
        from flwr.app import ConfigRecord, RecordDict

        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        nodes = list(self.grid.get_node_ids())
        while len(nodes) < num_clients and time.monotonic() < deadline:
            time.sleep(0.2)
            nodes = list(self.grid.get_node_ids())
        if len(nodes) < num_clients:
            raise TimeoutError(f"only {len(nodes)} of {num_clients} SuperNodes connected within {timeout:.0f} s")
        hello = [RecordDict({"nf": ConfigRecord({"kind": "hello"})}) for _ in nodes]
        # a node that died lingers in Flower's list until its heartbeat expires: once num_clients sites
        # have answered, the others get a short grace (e.g. for the aggregator), not first_timeout
        named = (lambda got: sum(bool(str(r.content["nf"]["name"])) for r in got.values()) >= num_clients)
        replies = self._query(nodes, hello, self.first_timeout, enough=named)
        aggregators = [n for n, r in replies.items() if str(r.content["nf"].get("role", "")) == "aggregator"]
        if len(aggregators) > 1:
            raise RuntimeError(f"{len(aggregators)} nodes say they are the trusted aggregator; start one")
        self.aggregator = aggregators[0] if aggregators else None
        self.aggregator_key = str(replies[self.aggregator].content["nf"]["key"]) if aggregators else ""
        info = {n: r.content["nf"] for n, r in replies.items() if str(r.content["nf"]["name"])}
        failed = {n: self.errors.get(self._name(n), "no answer within first_timeout")
                  for n in nodes if n not in replies}
        nodes = [n for n in nodes if n in info]  # nodes whose load_client returned None take no part
        if len(nodes) != num_clients:
            why = "; ".join(f"{self._name(n)}: {reason}" for n, reason in failed.items())
            raise RuntimeError(f"{len(nodes)} node(s) answered the hello with data for this task, not {num_clients}"
                               + (f". The hello failed on {why}. Fix that node (its log has the full reason) and "
                                  f"run again" if failed else ""))
        order = sorted(nodes, key=lambda n: (int(info[n]["order"]), str(info[n]["name"])))
        names = [str(info[n]["name"]) for n in order]
        if len(set(names)) != len(names):
            raise ValueError(f"two nodes gave the same client name: {names}")
        shapes = {str(info[n]["name"]): {k: (tuple(s), dt) for k, (s, dt) in json.loads(str(info[n]["shapes"])).items()}
                  for n in order}
        from .task import kind_of

        kind = kind_of(task.make_inference())
        server = {}
        if task.load_server is not None:
            from .wire import shapes_of

            server = shapes_of(task.load_server())
        groups = {str(info[n]["name"]): {p: (int(g), tuple(a)) for p, (g, a) in
                                         json.loads(str(info[n].get("groups", "{}"))).items()} for n in order}
        self.nodes, self.template = order, Template(kind, shapes, server, {c: g for c, g in groups.items() if g})
        self.timings["connect"] = time.perf_counter() - t0
        return self.template

    def _check_setup(self, names: Sequence[str], alive: Sequence[bool]) -> None:
        """A site whose set-up failed stops the run, naming it, its node and the reason;
        with ``on_setup_failure="absent"`` it is reported absent from every round instead."""
        failed = [n for n, ok in zip(names, alive) if not ok]
        if not failed:
            return
        why = "; ".join(f"client {n!r} (node {self.nodes[names.index(n)]}): "
                        f"{self.errors.get(n, 'no answer within first_timeout')}" for n in failed)
        if self.on_setup_failure == "raise" or len(failed) == len(names):
            raise RuntimeError(f"set-up failed on {len(failed)} of {len(names)} client(s): {why}. Fix that node "
                               f"(its log has the full reason) and run again, or pass on_setup_failure='absent' "
                               f"(run config 'on-setup-failure') to fit without it")
        self.missing.append((0, "setup", failed))
        warnings.warn(f"client(s) {failed} failed their set-up and are absent from every round of this run "
                      f"(on_setup_failure='absent'): {why}", MissingClientsWarning, stacklevel=find_stack_level())

    # ------------------------------------------------------------------ run
    def run(self, algorithm, clients, num_rounds: int, rng_key=None, *, init_state=None, availability: Any = None,
            **options: Any) -> RunResult:
        """The simulation backend's ``run`` over the network (``clients``: the plan built from
        :meth:`connect`'s template), through the same round loop
        (:func:`~numpyro_fed.backends.driver.drive`). Dropout is real here, so ``availability``
        is refused; so is ``init_state`` (resume with ``FlowerBackend(resume_from=...)``: the
        clients' states are on their nodes). ``checkpoint=`` saves the server's part; each client
        keeps its own on its node."""
        self._checked_run(algorithm, clients, availability, init_state)
        every = checkpoint_interval(num_rounds, options.get("checkpoint"), options.get("checkpoint_every"))
        return drive(OverFlower(self, algorithm, clients, num_rounds, every), algorithm, num_rounds, rng_key,
                     **options)

    def _checked_run(self, algorithm, plan, availability, init_state) -> None:
        """``run``'s options checked against this backend and its connected clients."""
        for what, value in (("availability= (dropout is real over Flower)", availability),
                            ("init_state= (resume with FlowerBackend(resume_from=...): the clients' states are on "
                             "their nodes)", init_state)):
            if value is not None:
                raise ValueError(_UNSUPPORTED.format(what=what))
        if self.template is None:
            raise ValueError("FlowerBackend.run needs connect() first (it builds the clients' template)")
        names = list(plan.names)
        if names != self.template.names:
            raise ValueError(f"the plan's clients {names} are not the connected clients {self.template.names}")
        if any(ex.secure_sum for ex in algorithm.exchanges) and self.aggregator is None:
            raise ValueError("this algorithm sends parts of its messages through a trusted aggregator (secure_sum, "
                             "e.g. trusted_aggregator=True), and no SuperNode is one: start a SuperNode with "
                             f"node_config '{ROLE_KEY}=\"aggregator\"' (LocalFederation(..., aggregator=True))")

    def _set_up(self, names: Sequence[str], num_rounds: int, rng_key, algorithm, every: int) -> tuple:
        """Every client builds the same algorithm from the template and keys itself (or, resuming,
        loads its stored state). Returns ``(the set-up records, the resumed server checkpoint or
        None, which clients answered)``; a client that did not stops the run or is left out
        (``on_setup_failure``)."""
        from flwr.app import ConfigRecord, RecordDict

        text = describe(self.template)
        resumed = self._resumed(algorithm, names, rng_key) if self.resume_from is not None else None
        kind = {"kind": "setup"} if resumed is None else {"kind": "resume", "from_run": resumed[1],
                                                            "round": int(resumed[0].round)}
        setup = [RecordDict({"nf": ConfigRecord({**kind, "template": text, "index": j, "num_rounds": int(num_rounds),
                                                 "aggregator_key": self.aggregator_key,
                                                 "checkpoint_every": int(every), "stage": self.stage})})
                 for j in range(len(names))]
        ready = self._query(self.nodes, setup, self.first_timeout)
        alive = [n in ready for n in self.nodes]
        self._check_setup(names, alive)
        return setup, resumed, alive

    # ------------------------------------------------------------------ the stream
    def _open_stream(self, names: Sequence[str], alive: List[bool]) -> None:
        """Invite every client that answered its set-up (and the trusted aggregator) to the run's
        stream (:mod:`numpyro_fed.flower.runtime.runstream`); a client that does not connect within
        ``first_timeout`` is a failed set-up (it stops the run, or is absent with
        ``on_setup_failure="absent"``)."""
        from .runtime.runstream import RunStream

        self._stream = RunStream(self.grid, self.stream, *self.stream_tls, poll=self.poll)
        t0 = time.perf_counter()
        nodes = [n for n, a in zip(self.nodes, alive) if a] + ([self.aggregator] if self.aggregator is not None else [])
        connected = self._stream.invite(nodes, self.first_timeout)
        self.timings["stream"] = time.perf_counter() - t0
        if self.aggregator is not None and self.aggregator not in connected:
            raise RuntimeError(f"the trusted aggregator (node {self.aggregator}) did not connect to the run's stream "
                               f"at {self._stream.address} within first_timeout ({self.first_timeout:.0f} s)")
        for j, node in enumerate(self.nodes):
            if alive[j] and node not in connected:
                alive[j] = False
                self.errors.setdefault(names[j], f"did not connect to the run's stream at {self._stream.address}")
        self._check_setup(names, alive)

    def _close_stream(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.close(self.reply_timeout)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, path: str, state: RunState, names: Sequence[str]) -> None:
        """The server's part of a checkpoint: its state, its broadcast and keys, the round, and (in
        ``meta``) this Flower run's id and its sites. Each client keeps its own part on its node
        (``numpyro-fed-state-dir``), one file per round it completed."""
        from .. import checkpoint as ckpt

        ckpt.save(path, state._replace(clients=()), [], family=SERVER_CHECKPOINT,
                  extra={"run_id": int(self.run_id), "sites": list(names)})

    def _resumed(self, algorithm, names: Sequence[str], rng_key) -> tuple:
        """``(state, run id)`` of the server checkpoint at :attr:`resume_from`, checked against this
        run's sites and algorithm (every leaf's shape and dtype)."""
        from .. import checkpoint as ckpt

        meta = ckpt.read_meta(self.resume_from)
        if meta.get("family") != SERVER_CHECKPOINT:
            raise ValueError(f"the checkpoint at {self.resume_from} is not a Flower server checkpoint (family "
                             f"{meta.get('family')!r}); write one with checkpoint= in a Flower run")
        if list(meta.get("sites", ())) != list(names):
            raise ValueError(f"the checkpoint at {self.resume_from} was written with sites {meta.get('sites')}; this "
                             f"run has {list(names)}. Resume with the same sites")
        key_impl = meta.get("typed_keys", {}).get("server_key")
        key = jax.random.PRNGKey(0) if key_impl is None else jax.random.key(0, impl=key_impl)

        def init(k):
            server, broadcast = algorithm.init_server(k)
            return RunState(jnp.zeros((), jnp.int32), server, k, broadcast, (), k)

        state = ckpt.load(self.resume_from, jax.eval_shape(init, key), [])
        return state, int(meta["run_id"])

    def _take_back(self, r: int, setup: Sequence, alive: List[bool], lost: List[bool]) -> None:
        """Before round ``r + 1``: a node that joined since (a restarted SuperNode has a new node id)
        and answers the hello with the name of a site that stopped answering is that site again. It
        is sent the site's set-up as a ``rejoin`` (its state comes from its node's own storage), and
        from then on asked in its place; the old node id is dropped. Recorded in :attr:`rejoined`."""
        from flwr.app import ConfigRecord, RecordDict

        new = [int(n) for n in self.grid.get_node_ids() if int(n) not in self._seen]
        if not new:
            return
        names = self.template.names
        hello = [RecordDict({"nf": ConfigRecord({"kind": "hello"})}) for _ in new]
        replies = self._send(new, hello, "query", self.reply_timeout)
        for node in new:
            reply = replies.get(node)
            if reply is None:  # not ready, or failed: asked again before the next round
                continue
            self._seen.add(node)
            name = str(reply.content["nf"]["name"])
            if name not in names or not lost[names.index(name)]:
                continue  # another task's node, or a duplicate of a site that still answers: left out
            j = names.index(name)
            content = RecordDict({"nf": ConfigRecord({**dict(setup[j]["nf"].items()), "kind": "rejoin",
                                                      "round": int(self._last_round[j])})})
            if node in self._send([node], [content], "query", self.first_timeout) and (
                    self._stream is None or node in self._stream.invite([node], self.first_timeout)):
                old, self.nodes[j] = self.nodes[j], node
                alive[j], lost[j] = True, False
                self.rejoined.append((r + 1, name, old, node))
            else:
                self.errors[name] = self.errors.pop(f"node {node}", "no answer to its rejoin")

    def _ledgers(self, structures: WireStructures, alive, transcript, last_round: int) -> Dict[str, ClientLedger]:
        """Each client's privacy ledger (its ``releases`` count), asked for after the last
        round when the algorithm's client state keeps one (the DP families); recorded in the
        transcript as what it is, a client -> server message."""
        from flwr.app import ConfigRecord, RecordDict

        names = self.template.names
        keeps = [j for j in range(len(names)) if alive[j] and hasattr(structures.client_states[j], "releases")]
        if not keeps:
            return {}
        query = [RecordDict({"nf": ConfigRecord({"kind": "ledger", **self._kept(j)})}) for j in keeps]
        replies = self._send([self.nodes[j] for j in keeps], query, "query", self.reply_timeout)
        ledgers, lacked = {}, []
        like = {"releases": jax.ShapeDtypeStruct((), np.int32)}
        for j in keeps:
            reply = replies.get(self.nodes[j])
            if reply is None:
                lacked.append(names[j])
                continue
            ledgers[names[j]] = ClientLedger(**from_record(like, reply.content["message"]))
            if transcript is not None:
                transcript.record(last_round - 1, names[j], "server", ledgers[names[j]]._asdict(), exchange="ledger")
        if lacked:
            warnings.warn(f"client(s) {lacked} did not send their privacy ledger after the last round (errors: "
                          f"{ {n: self.errors[n] for n in lacked if n in self.errors} }): privacy_report cannot "
                          f"cover them; each ledger stays on its node", MissingClientsWarning,
                          stacklevel=find_stack_level())
        return ledgers

    def _warn_missing(self) -> None:
        if not self.missing:
            return
        by_client: Dict[str, List[int]] = {}
        for rnd, _, lacked in self.missing:
            for name in lacked:
                by_client.setdefault(name, []).append(rnd)
        parts = [f"client {n!r} missed round(s) {rs}" + (f" (its error: {self.errors[n]})" if n in self.errors else "")
                 for n, rs in by_client.items()]
        back = "".join(f"; client {n!r} rejoined before round {rnd} on a new node (its state from its node's "
                       f"storage)" for rnd, n, _, _ in self.rejoined)
        warnings.warn("the fit continued without some clients (the dropout policy: a client that does not "
                      "answer within the reply timeout is left out of that round's server step): "
                      + "; ".join(parts) + back + " (round 0 is the set-up)", MissingClientsWarning,
                      stacklevel=find_stack_level())


class ClientLedger(NamedTuple):
    """What a client reports of its state over Flower at the end of a DP run: its privacy
    ledger (``releases``: the updates it sent), the input of ``privacy_report``."""

    releases: Any


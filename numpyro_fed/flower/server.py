"""The server's side: :class:`FlowerBackend`, the round loop over Flower's ``Grid``.

:class:`FlowerBackend` offers the simulation backend's ``run`` (same arguments, same
:class:`~numpyro_fed.run.protocol.RunResult`), so an inference object's ``run(...,
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
from typing import Any, Callable, Dict, List, Optional

from .._validation import check_callable, check_positive_number
from ..run.backends.driver import checkpoint_interval, drive
from ..run.protocol import RunResult
from ..warnings import MissingClientsWarning
from .messaging import Messenger
from .rounds import ClientLedger, OverFlower
from .runtime.stream import split_address
from .sealed import ROLE_KEY
from .task import FlowerTask, kind_of
from .wire import Template, shapes_of

__all__ = ["ClientLedger", "FlowerBackend", "MissingClientsWarning"]


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
        super().__init__(grid, check_positive_number("FlowerBackend", "poll", poll),
                         check_positive_number("FlowerBackend", "reply_timeout", reply_timeout))
        self.first_timeout = check_positive_number("FlowerBackend", "first_timeout", first_timeout)
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
        self.missing: List[tuple] = []  # (round, exchange, [client names]) that did not answer
        self.round_seconds: List[float] = []
        self.timings: Dict[str, float] = {}  # seconds: connect, setup
        self.collect_ledgers = False  # ask each client for its privacy ledger after the last round (DP runs)
        self.aggregator_key = ""  # its public key (hex), relayed to the clients at set-up
        self.rejoined: List[tuple] = []  # (round, client name, old node, new node): sites that came back
        if stream is not None:

            split_address(stream)  # checked now, opened by run()
        self.stream = stream  # HOST:PORT: the run's exchanges over one stream per client (module stream)
        self.stream_tls = (stream_certfile, stream_keyfile)

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
        replies = self.query(nodes, hello, self.first_timeout, enough=named)
        aggregators = [n for n, r in replies.items() if str(r.content["nf"].get("role", "")) == "aggregator"]
        if len(aggregators) > 1:
            raise RuntimeError(f"{len(aggregators)} nodes say they are the trusted aggregator; start one")
        self.aggregator = aggregators[0] if aggregators else None
        self.aggregator_key = str(replies[self.aggregator].content["nf"]["key"]) if aggregators else ""
        info = {n: r.content["nf"] for n, r in replies.items() if str(r.content["nf"]["name"])}
        failed = {n: self.errors.get(self.name_of(n), "no answer within first_timeout")
                  for n in nodes if n not in replies}
        nodes = [n for n in nodes if n in info]  # nodes whose load_client returned None take no part
        if len(nodes) != num_clients:
            why = "; ".join(f"{self.name_of(n)}: {reason}" for n, reason in failed.items())
            raise RuntimeError(f"{len(nodes)} node(s) answered the hello with data for this task, not {num_clients}"
                               + (f". The hello failed on {why}. Fix that node (its log has the full reason) and "
                                  f"run again" if failed else ""))
        order = sorted(nodes, key=lambda n: (int(info[n]["order"]), str(info[n]["name"])))
        names = [str(info[n]["name"]) for n in order]
        if len(set(names)) != len(names):
            raise ValueError(f"two nodes gave the same client name: {names}")
        shapes = {str(info[n]["name"]): {k: (tuple(s), dt) for k, (s, dt) in json.loads(str(info[n]["shapes"])).items()}
                  for n in order}

        kind = kind_of(task.make_inference())
        server = {}
        if task.load_server is not None:

            server = shapes_of(task.load_server())
        groups = {str(info[n]["name"]): {p: (int(g), tuple(a)) for p, (g, a) in
                                         json.loads(str(info[n].get("groups", "{}"))).items()} for n in order}
        self.nodes, self.template = order, Template(kind, shapes, server, {c: g for c, g in groups.items() if g})
        self.timings["connect"] = time.perf_counter() - t0
        return self.template

    # ------------------------------------------------------------------ run
    def run(self, algorithm, clients, num_rounds: int, rng_key=None, *, init_state=None, availability: Any = None,
            stage: str = "", **options: Any) -> RunResult:
        """The simulation backend's ``run`` over the network (``clients``: the plan built from
        :meth:`connect`'s template), through the same round loop
        (:func:`~numpyro_fed.run.backends.driver.drive`). Dropout is real here, so ``availability``
        is refused; so is ``init_state`` (resume with ``FlowerBackend(resume_from=...)``: the
        clients' states are on their nodes). ``checkpoint=`` saves the server's part; each client
        keeps its own on its node. ``stage``: the ``nf.fit`` rung this run is
        (:meth:`~numpyro_fed.fitting.ladder.Ladder.stage`), sent to every node at set-up."""
        self._checked_run(algorithm, clients, availability, init_state)
        every = checkpoint_interval(num_rounds, options.get("checkpoint"), options.get("checkpoint_every"))
        return drive(OverFlower(self, algorithm, clients, num_rounds, every, stage), algorithm, num_rounds, rng_key,
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
        trusted = [ex for ex in algorithm.exchanges if ex.secure_sum and ex.aggregation != "masking"]
        if trusted and self.aggregator is None:
            raise ValueError("this algorithm sends parts of its messages through a trusted aggregator (secure_sum, "
                             "e.g. trusted_aggregator=True), and no SuperNode is one: start a SuperNode with "
                             f"node_config '{ROLE_KEY}=\"aggregator\"' (LocalFederation(..., aggregator=True))")

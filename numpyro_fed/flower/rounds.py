"""Flower's :class:`~numpyro_fed.run.backends.driver.Transport`: a run's rounds over a ``Grid``.

:class:`OverFlower` sets the clients up on their nodes, then moves one round at a time: the
server selects, each exchange goes out to the clients that answered the earlier ones (through
Flower, or the run's streams) and its server step runs here. The round loop itself (bar,
callbacks, checkpoints, the non-finite guard, the result) is :func:`~numpyro_fed.run.backends.driver.drive`'s.

What belongs to one run is the transport's: the set-up, the run's stream, the round each client
last answered, sites that rejoin on a new node, the server's checkpoints and the privacy ledgers
asked for at the end. It reaches the nodes only through the backend's public
:class:`~numpyro_fed.flower.messaging.Messenger` (``send``, ``query``, ``secure_sum``) and reads
the backend's public settings.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..run import checkpoint as ckpt
from ..run.backends.driver import NonFinite, Rounds, all_finite, stack_rounds
from ..run.backends.mapping import client_item
from ..run.protocol import Broadcast, ClientStates, RunState, ServerView, last_info
from ..run.secure.fixed_point import decode_message, word_count
from ..run.transcript import Communication, Transcript, message_bytes
from ..warnings import MissingClientsWarning, find_stack_level
from .masking import MaskedAggregation, Traffic, masked_like
from .runtime.runstream import RunStream
from .wire import WireStructures, describe, from_record, to_record, wire_like, wire_structures

__all__ = ["SERVER_CHECKPOINT", "ClientLedger", "OverFlower", "Traffic", "resumed_checkpoint"]

SERVER_CHECKPOINT = "flower.server"  # the family of a Flower run's server checkpoint


class ClientLedger(NamedTuple):
    """What a client reports of its state over Flower at the end of a DP run: its privacy
    ledger (``releases``: the updates it sent), the input of ``privacy_report``."""

    releases: Any


class _ServerSide(NamedTuple):
    """The algorithm's server side, jit-compiled once per run."""

    select: Callable
    steps: List[Callable]
    round_info: Callable
    monitor: Callable


def first_state(algorithm, rng_key, resumed) -> RunState:
    """The server's state before the first round: a fresh ``init_server`` from the server's own
    key (the clients' keys are their own), or the resumed checkpoint's server, key and broadcast."""
    k_server, _, k_env = random.split(rng_key, 3)
    k_init, server_key = random.split(k_server)
    if resumed is None:
        server, broadcast = jax.jit(algorithm.init_server)(k_init)
        start = 0
    else:
        server, server_key, broadcast = resumed[0].server, resumed[0].server_key, resumed[0].broadcast
        start = int(resumed[0].round)
    return RunState(jnp.asarray(start, jnp.int32), server, server_key, broadcast, None, k_env)


class OverFlower:
    """One :meth:`~numpyro_fed.flower.FlowerBackend.run`'s rounds (a transport of the driver)."""

    chunked = False

    def __init__(self, backend: Any, algorithm, plan, num_rounds: int, every: int, stage: str = "") -> None:
        self.backend, self.algorithm, self.plan, self.stage = backend, algorithm, plan, stage
        self.names = list(plan.names)
        self.num_rounds, self.every = int(num_rounds), every
        self.traffic = Traffic()
        self.transcript: Optional[Transcript] = None
        server_step = [jax.jit(lambda k, s, m, v, ex=ex: ex.server_step(k, s, m, v)) for ex in algorithm.exchanges]
        self.server = _ServerSide(jax.jit(algorithm.select), server_step, algorithm.round_info or last_info,
                                  algorithm.monitor or (lambda info: jnp.zeros(())))

    # ------------------------------------------------------------------ transport
    def start(self, rng_key, init_state, transcript: Optional[Transcript]) -> RunState:
        backend, names = self.backend, self.names
        t0 = time.perf_counter()
        self.transcript = transcript
        data = [client_item(self.plan, self.plan.data, j) for j in range(len(names))]
        self.structures: WireStructures = wire_structures(self.algorithm, data, self.plan.server_data)
        self.setup, resumed, self.alive = self._set_up(rng_key)
        if backend.stream is not None:
            self._open_stream()
        backend.timings["setup"] = time.perf_counter() - t0
        state = first_state(self.algorithm, rng_key, resumed)
        self.start_round = int(state.round)
        self.lost = [not a for a in self.alive]  # did not answer the last time asked: may come back on a new node
        backend.last_round = [self.start_round] * len(names)  # per site: the last round whose reply came
        self.seen = set(backend.nodes) | {backend.aggregator}  # nodes asked for their name already
        return state

    def rounds(self, state: RunState, n: int) -> Rounds:
        backend, r = self.backend, int(state.round)
        t0 = time.perf_counter()
        if r > self.start_round and any(self.lost):
            self._take_back(r)
        timeout = backend.first_timeout if r == self.start_round else backend.reply_timeout
        done = self._round(r, state, timeout)
        if isinstance(done, NonFinite):
            return Rounds(state, None, np.zeros(0), None, None, done)
        state, info, figure, asked, answered = done
        backend.last_round = [r + 1 if a else last for a, last in zip(answered, backend.last_round)]
        backend.round_seconds.append(time.perf_counter() - t0)
        if backend.progress is not None:
            backend.progress(int(state.round), [name for name, a in zip(self.names, answered) if a])
        one = jax.tree_util.tree_map(lambda x: np.asarray(x)[None], info)
        return Rounds(state, one, np.asarray(figure)[None], asked[None], answered[None])

    def save(self, path: str, state: RunState) -> None:
        """The server's part of a checkpoint: its state, its broadcast and keys, the round, and (in
        ``meta``) this Flower run's id and its sites. Each client keeps its own part on its node
        (``numpyro-fed-state-dir``), one file per round it completed."""

        ckpt.save(path, state._replace(clients=()), [], family=SERVER_CHECKPOINT,
                  extra={"run_id": int(self.backend.run_id), "sites": list(self.names)},
                  layout=self.algorithm.layout)

    def finish(self, start: RunState, state: RunState, log: Rounds):
        ledgers = self._ledgers(int(state.round)) if self.backend.collect_ledgers else {}
        for ledger in ledgers.values():  # what crossed the wire
            self.traffic.add_up(message_bytes(ledger._asdict()))
        self._warn_missing()
        t, names = self.traffic, self.names
        communication = Communication(len(log.figure), t.up, t.down, t.msgs_up, t.msgs_down)
        return communication, ClientStates(names, lambda j: ledger_of(names[j], ledgers))

    def close(self) -> None:
        stream, self.backend.run_stream = self.backend.run_stream, None
        if stream is not None:
            stream.close(self.backend.reply_timeout)

    # ------------------------------------------------------------------ set-up, stream, rejoins
    def _set_up(self, rng_key) -> tuple:
        """Every client builds the same algorithm from the template and keys itself (or, resuming,
        loads its stored state). Returns ``(the set-up records, the resumed server checkpoint or
        None, which clients answered)``; a client that did not stops the run or is left out
        (``on_setup_failure``)."""
        from flwr.app import ConfigRecord, RecordDict

        backend, names = self.backend, self.names
        text = describe(backend.template)
        resumed = (resumed_checkpoint(backend.resume_from, self.algorithm, names, rng_key)
                   if backend.resume_from is not None else None)
        kind = {"kind": "setup"} if resumed is None else {"kind": "resume", "from_run": resumed[1],
                                                            "round": int(resumed[0].round)}
        setup = [RecordDict({"nf": ConfigRecord({**kind, "template": text, "index": j,
                                                 "num_rounds": int(self.num_rounds),
                                                 "aggregator_key": backend.aggregator_key,
                                                 "checkpoint_every": int(self.every), "stage": self.stage})})
                 for j in range(len(names))]
        ready = backend.query(backend.nodes, setup, backend.first_timeout)
        alive = [n in ready for n in backend.nodes]
        self._check_setup(alive)
        return setup, resumed, alive

    def _check_setup(self, alive: Sequence[bool]) -> None:
        """A site whose set-up failed stops the run, naming it, its node and the reason;
        with ``on_setup_failure="absent"`` it is reported absent from every round instead."""
        backend, names = self.backend, self.names
        failed = [n for n, ok in zip(names, alive) if not ok]
        if not failed:
            return
        why = "; ".join(f"client {n!r} (node {backend.nodes[names.index(n)]}): "
                        f"{backend.errors.get(n, 'no answer within first_timeout')}" for n in failed)
        if backend.on_setup_failure == "raise" or len(failed) == len(names):
            raise RuntimeError(f"set-up failed on {len(failed)} of {len(names)} client(s): {why}. Fix that node "
                               f"(its log has the full reason) and run again, or pass on_setup_failure='absent' "
                               f"(run config 'on-setup-failure') to fit without it")
        backend.missing.append((0, "setup", failed))
        warnings.warn(f"client(s) {failed} failed their set-up and are absent from every round of this run "
                      f"(on_setup_failure='absent'): {why}", MissingClientsWarning, stacklevel=find_stack_level())

    def _open_stream(self) -> None:
        """Invite every client that answered its set-up (and the trusted aggregator) to the run's
        stream (:mod:`numpyro_fed.flower.runtime.runstream`); a client that does not connect within
        ``first_timeout`` is a failed set-up (it stops the run, or is absent with
        ``on_setup_failure="absent"``)."""

        backend, alive = self.backend, self.alive
        stream = backend.run_stream = RunStream(backend.grid, backend.stream, *backend.stream_tls, poll=backend.poll)
        t0 = time.perf_counter()
        aggregator = backend.aggregator
        nodes = [n for n, a in zip(backend.nodes, alive) if a] + ([aggregator] if aggregator is not None else [])
        connected = stream.invite(nodes, backend.first_timeout)
        backend.timings["stream"] = time.perf_counter() - t0
        if aggregator is not None and aggregator not in connected:
            raise RuntimeError(f"the trusted aggregator (node {aggregator}) did not connect to the run's stream "
                               f"at {stream.address} within first_timeout ({backend.first_timeout:.0f} s)")
        for j, node in enumerate(backend.nodes):
            if alive[j] and node not in connected:
                alive[j] = False
                backend.errors.setdefault(self.names[j], f"did not connect to the run's stream at {stream.address}")
        self._check_setup(alive)

    def _take_back(self, r: int) -> None:
        """Before round ``r + 1``: a node that joined since (a restarted SuperNode has a new node id)
        and answers the hello with the name of a site that stopped answering is that site again. It
        is sent the site's set-up as a ``rejoin`` (its state comes from its node's own storage), and
        from then on asked in its place; the old node id is dropped. Recorded in the backend's
        ``rejoined``."""
        from flwr.app import ConfigRecord, RecordDict

        backend, names, lost = self.backend, self.names, self.lost
        new = [int(n) for n in backend.grid.get_node_ids() if int(n) not in self.seen]
        if not new:
            return
        hello = [RecordDict({"nf": ConfigRecord({"kind": "hello"})}) for _ in new]
        replies = backend.send(new, hello, "query", backend.reply_timeout)
        for node in new:
            reply = replies.get(node)
            if reply is None:  # not ready, or failed: asked again before the next round
                continue
            self.seen.add(node)
            name = str(reply.content["nf"]["name"])
            if name not in names or not lost[names.index(name)]:
                continue  # another task's node, or a duplicate of a site that still answers: left out
            j = names.index(name)
            content = RecordDict({"nf": ConfigRecord({**dict(self.setup[j]["nf"].items()), "kind": "rejoin",
                                                      "round": int(backend.last_round[j])})})
            stream = backend.run_stream
            if node in backend.send([node], [content], "query", backend.first_timeout) and (
                    stream is None or node in stream.invite([node], backend.first_timeout)):
                old, backend.nodes[j] = backend.nodes[j], node
                self.alive[j], lost[j] = True, False
                backend.rejoined.append((r + 1, name, old, node))
            else:
                backend.errors[name] = backend.errors.pop(f"node {node}", "no answer to its rejoin")

    # ------------------------------------------------------------------ after the last round
    def _ledgers(self, last_round: int) -> Dict[str, ClientLedger]:
        """Each client's privacy ledger (its ``releases`` count), asked for after the last
        round when the algorithm's client state keeps one (the DP families); recorded in the
        transcript as what it is, a client -> server message."""
        from flwr.app import ConfigRecord, RecordDict

        backend, names, transcript = self.backend, self.names, self.transcript
        keeps = [j for j in range(len(names))
                 if self.alive[j] and hasattr(self.structures.client_states[j], "releases")]
        if not keeps:
            return {}
        query = [RecordDict({"nf": ConfigRecord({"kind": "ledger", **backend.kept(j)})}) for j in keeps]
        replies = backend.send([backend.nodes[j] for j in keeps], query, "query", backend.reply_timeout)
        ledgers, lacked = {}, []
        like = {"releases": jax.ShapeDtypeStruct((), np.int32)}
        for j in keeps:
            reply = replies.get(backend.nodes[j])
            if reply is None:
                lacked.append(names[j])
                continue
            ledgers[names[j]] = ClientLedger(**from_record(like, reply.content["message"]))
            if transcript is not None:
                transcript.record(last_round - 1, names[j], "server", ledgers[names[j]]._asdict(), exchange="ledger")
        if lacked:
            warnings.warn(f"client(s) {lacked} did not send their privacy ledger after the last round (errors: "
                          f"{ {n: backend.errors[n] for n in lacked if n in backend.errors} }): privacy_report "
                          f"cannot cover them; each ledger stays on its node", MissingClientsWarning,
                          stacklevel=find_stack_level())
        return ledgers

    def _warn_missing(self) -> None:
        backend = self.backend
        if not backend.missing:
            return
        by_client: Dict[str, List[int]] = {}
        for rnd, _, lacked in backend.missing:
            for name in lacked:
                by_client.setdefault(name, []).append(rnd)
        parts = [f"client {n!r} missed round(s) {rs}" + (f" (its error: {backend.errors[n]})"
                                                          if n in backend.errors else "")
                 for n, rs in by_client.items()]
        back = "".join(f"; client {n!r} rejoined before round {rnd} on a new node (its state from its node's "
                       f"storage)" for rnd, n, _, _ in backend.rejoined)
        warnings.warn("the fit continued without some clients (the dropout policy: a client that does not "
                      "answer within the reply timeout is left out of that round's server step): "
                      + "; ".join(parts) + back + " (round 0 is the set-up)", MissingClientsWarning,
                      stacklevel=find_stack_level())

    # ------------------------------------------------------------------ one round
    def _round(self, r: int, state: RunState, timeout: float):
        """Round ``r``: the server selects, then each exchange goes out to the clients that
        answered the earlier ones and its server step runs here. Updates ``lost`` and the
        backend's ``missing``. Returns ``(state, info, figure, asked, answered)``, or the
        :class:`NonFinite` round."""
        names, J, exchanges, server_side = self.names, len(self.names), self.algorithm.exchanges, self.server
        server, broadcast = state.server, state.broadcast
        server_key, k_select, *k_ex = random.split(state.server_key, 2 + len(exchanges))
        asked = np.asarray(server_side.select(k_select, server)) & np.asarray(self.alive)
        answered = asked.copy()
        round_infos, sent = [], []
        for e, (exchange, key) in enumerate(zip(exchanges, k_ex)):
            stacked, summed, seen = self._exchange(r, e, broadcast, answered, timeout)
            sent.append(stacked)
            if exchange.secure_sum:  # the secure_sum fields arrive summed (aggregator or masking)
                stacked = {**stacked, **summed}
            server, broadcast, info = server_side.steps[e](key, server, stacked,
                                                           ServerView(jnp.asarray(seen), self.plan.server_data))
            round_infos.append(info)
        for j in range(J):
            if asked[j]:
                self.lost[j] = not answered[j]
        lacked = [names[j] for j in range(J) if asked[j] and not answered[j]]
        if lacked:
            self.backend.missing.append((r + 1, "round", lacked))
        info = server_side.round_info(tuple(round_infos))
        figure = server_side.monitor(info)
        if not (bool(all_finite(broadcast)) and bool(jnp.isfinite(figure))):
            bad = [names[j] for j in range(J) if answered[j] and not all(
                bool(all_finite(jax.tree_util.tree_map(lambda x, j=j: x[j], m))) for m in sent)]
            return NonFinite(r + 1, bad, True)
        state = RunState(state.round + 1, server, server_key, broadcast, None, state.env_key)
        return state, info, figure, asked, answered.copy()

    def _exchange(self, r: int, e: int, broadcast: Broadcast, answered, timeout: float) -> tuple:
        """Exchange ``e`` of round ``r`` over the wire: each client in ``answered`` gets its
        broadcast, and ``answered`` is cleared for those whose reply did not come. Returns
        ``(the messages stacked, zeros for a client that did not answer; the sum of the
        secure_sum fields, by the trusted aggregator or pairwise masking, or {}; the clients the
        server step sees)``. Under masking, too few answers to remove the masks lose the round's
        sum, as in the simulation: the server step then sees no client."""
        from flwr.app import ConfigRecord, RecordDict

        backend, structures = self.backend, self.structures
        names, J, transcript, traffic = self.names, len(self.names), self.transcript, self.traffic
        exchange = self.algorithm.exchanges[e]
        secure = exchange.secure_sum
        masking = bool(secure) and exchange.aggregation == "masking"
        protocol = MaskedAggregation(backend, transcript, traffic, names, r, e, timeout) if masking else None
        to = [j for j in range(J) if answered[j]]
        if masking:  # the protocol's first two steps: keys advertised and shared
            shared = set(protocol.keys(to))
            for j in to:
                answered[j] = j in shared
            to = sorted(shared)
        contents = []
        shared_b, per_client = jax.tree_util.tree_map(np.asarray, (broadcast.shared, broadcast.per_client))
        for j in to:
            b = Broadcast(shared_b, jax.tree_util.tree_map(lambda x, j=j: x[j], per_client))
            record = to_record(b)
            nf = {"kind": "exchange", "exchange": e, "round": r}
            if e == 0:  # after which round the server holds its state: a late reply's step is taken back
                nf["kept"] = int(backend.last_round[j])
            content = RecordDict({"broadcast": record})
            if masking:  # the ciphertexts addressed to j, in the same message
                extra, arrays = protocol.payload(j)
                nf.update(extra)
                content["shares"] = to_record(arrays["shares"])
            content["nf"] = ConfigRecord(nf)
            contents.append(content)
            traffic.add_down(message_bytes(b))
            if transcript is not None:
                transcript.record(r, "server", names[j], from_record(structures.broadcasts[e], record),
                                  exchange=str(e))
        replies = backend.send([backend.nodes[j] for j in to], contents, "train", timeout) if to else {}
        like, direct_like, hidden_like = (masked_like if masking else wire_like)(structures.messages[e], secure)
        rows, hidden = [], {}
        for j in range(J):
            reply = replies.get(backend.nodes[j]) if answered[j] else None
            if reply is None:
                answered[j] = False
                rows.append(None)
                continue
            message = from_record(like, reply.content["message"])
            traffic.add_up(message_bytes(message))
            if secure:  # the direct fields; the sealed part the server relays unread, or the masked words
                message, hidden[j] = message["direct"], message["masked" if masking else "sealed"]
            if transcript is not None and (message or not secure):
                transcript.record(r, names[j], "server", message, exchange=str(e))
            if transcript is not None and secure and not masking:
                transcript.record(r, names[j], "aggregator", {"sealed": hidden[j]}, exchange=str(e))
            rows.append(message)
        zero = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), direct_like)
        stacked = jax.tree_util.tree_map(stack_rounds, *[m if m is not None else zero for m in rows])
        summed, seen = {}, answered.copy()
        if masking:
            summed = protocol.unmask(hidden, hidden_like, J)
            if summed is None:  # too few to unmask: no client's message reaches the server step
                seen[:] = False
                stacked = jax.tree_util.tree_map(np.zeros_like, stacked)
                summed = decode_message(np.zeros(word_count(hidden_like), np.uint64), hidden_like, J)  # zero sums
        elif secure:
            summed = backend.secure_sum(r, e, J, hidden, hidden_like, timeout)
            if transcript is not None:
                transcript.record(r, "aggregator", "server", summed, exchange=str(e))
        return stacked, summed, seen



def ledger_of(name: str, ledgers: dict):
    """Client ``name``'s privacy ledger, or an error saying why the run has none for it."""
    if name in ledgers:
        return ledgers[name]
    raise KeyError(f"client {name!r}: over Flower each client's state stays on its node (context.state); the server "
                   f"has only the privacy ledger of a DP run's clients that answered at its end")


def resumed_checkpoint(path: str, algorithm, names: Sequence[str], rng_key) -> tuple:
    """``(state, run id)`` of the Flower server checkpoint at ``path``, checked against this
    run's sites and algorithm (every leaf's shape and dtype)."""

    meta = ckpt.read_meta(path)
    if meta.get("family") != SERVER_CHECKPOINT:
        raise ValueError(f"the checkpoint at {path} is not a Flower server checkpoint (family "
                         f"{meta.get('family')!r}); write one with checkpoint= in a Flower run")
    if list(meta.get("sites", ())) != list(names):
        raise ValueError(f"the checkpoint at {path} was written with sites {meta.get('sites')}; this "
                         f"run has {list(names)}. Resume with the same sites")
    key_impl = meta.get("typed_keys", {}).get("server_key")
    key = jax.random.PRNGKey(0) if key_impl is None else jax.random.key(0, impl=key_impl)

    def init(k):
        server, broadcast = algorithm.init_server(k)
        return RunState(jnp.zeros((), jnp.int32), server, k, broadcast, (), k)

    state = ckpt.load(path, jax.eval_shape(init, key), [], layout=algorithm.layout)
    return state, int(meta["run_id"])

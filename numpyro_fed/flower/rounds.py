"""Flower's :class:`~numpyro_fed.backends.driver.Transport`: a run's rounds over a ``Grid``.

:class:`OverFlower` sets the clients up on their nodes, then moves one round at a time: the
server selects, each exchange goes out to the clients that answered the earlier ones (through
Flower, or the run's streams) and its server step runs here. The round loop itself (bar,
callbacks, checkpoints, the non-finite guard, the result) is :func:`~numpyro_fed.backends.driver.drive`'s.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..backends.driver import NonFinite, Rounds, stack_rounds
from ..backends.mapping import client_item
from ..backends.simulation import all_finite
from ..protocol import Broadcast, ClientStates, RunState, ServerView, last_info
from ..transcript import Communication, Transcript, message_bytes
from .wire import WireStructures, from_record, to_record, wire_like, wire_structures

__all__ = ["OverFlower", "Traffic"]


class Traffic:
    """Bytes and messages that crossed the wire in a run, each way (``Communication``)."""

    def __init__(self) -> None:
        self.up = self.down = self.msgs_up = self.msgs_down = 0

    def add_up(self, nbytes: int) -> None:
        self.up, self.msgs_up = self.up + nbytes, self.msgs_up + 1

    def add_down(self, nbytes: int) -> None:
        self.down, self.msgs_down = self.down + nbytes, self.msgs_down + 1


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

    def __init__(self, backend: Any, algorithm, plan, num_rounds: int, every: int) -> None:
        self.backend, self.algorithm, self.plan = backend, algorithm, plan
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
        self.setup, resumed, self.alive = backend._set_up(names, self.num_rounds, rng_key, self.algorithm, self.every)
        if backend.stream is not None:
            backend._open_stream(names, self.alive)
        backend.timings["setup"] = time.perf_counter() - t0
        state = first_state(self.algorithm, rng_key, resumed)
        self.start_round = int(state.round)
        self.lost = [not a for a in self.alive]  # did not answer the last time asked: may come back on a new node
        backend._last_round = [self.start_round] * len(names)  # per site: the last round whose reply came
        backend._seen = set(backend.nodes) | {backend.aggregator}
        return state

    def rounds(self, state: RunState, n: int) -> Rounds:
        backend, r = self.backend, int(state.round)
        t0 = time.perf_counter()
        if r > self.start_round and any(self.lost):
            backend._take_back(r, self.setup, self.alive, self.lost)
        timeout = backend.first_timeout if r == self.start_round else backend.reply_timeout
        done = self._round(r, state, timeout)
        if isinstance(done, NonFinite):
            return Rounds(state, None, np.zeros(0), None, None, done)
        state, info, figure, asked, answered = done
        backend._last_round = [r + 1 if a else last for a, last in zip(answered, backend._last_round)]
        backend.round_seconds.append(time.perf_counter() - t0)
        if backend.progress is not None:
            backend.progress(int(state.round), [name for name, a in zip(self.names, answered) if a])
        one = jax.tree_util.tree_map(lambda x: np.asarray(x)[None], info)
        return Rounds(state, one, np.asarray(figure)[None], asked[None], answered[None])

    def save(self, path: str, state: RunState) -> None:
        self.backend._save(path, state, self.names)

    def finish(self, start: RunState, state: RunState, log: Rounds):
        backend = self.backend
        ledgers = (backend._ledgers(self.structures, self.alive, self.transcript, int(state.round))
                   if backend.collect_ledgers else {})
        for ledger in ledgers.values():  # what crossed the wire
            self.traffic.add_up(message_bytes(ledger._asdict()))
        backend._warn_missing()
        t, names = self.traffic, self.names
        communication = Communication(len(log.figure), t.up, t.down, t.msgs_up, t.msgs_down)
        return communication, ClientStates(names, lambda j: ledger_of(names[j], ledgers))

    def close(self) -> None:
        self.backend._close_stream()

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
            stacked, summed = self._exchange(r, e, broadcast, answered, timeout)
            sent.append(stacked)
            if exchange.secure_sum:  # the secure_sum fields arrive summed by the trusted aggregator
                stacked = {**stacked, **summed}
            server, broadcast, info = server_side.steps[e](key, server, stacked,
                                                           ServerView(jnp.asarray(answered), self.plan.server_data))
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
        ``(the messages stacked, zeros for a client that did not answer; the trusted aggregator's
        sum of the secure_sum fields, or {})``."""
        from flwr.app import ConfigRecord, RecordDict

        backend, structures = self.backend, self.structures
        names, J, transcript, traffic = self.names, len(self.names), self.transcript, self.traffic
        to = [j for j in range(J) if answered[j]]
        contents = []
        shared, per_client = jax.tree_util.tree_map(np.asarray, (broadcast.shared, broadcast.per_client))
        for j in to:
            b = Broadcast(shared, jax.tree_util.tree_map(lambda x, j=j: x[j], per_client))
            record = to_record(b)
            nf = {"kind": "exchange", "exchange": e, "round": r}
            if e == 0:  # after which round the server holds its state: a late reply's step is taken back
                nf["kept"] = int(backend._last_round[j])
            contents.append(RecordDict({"nf": ConfigRecord(nf), "broadcast": record}))
            traffic.add_down(message_bytes(b))
            if transcript is not None:
                transcript.record(r, "server", names[j], from_record(structures.broadcasts[e], record),
                                  exchange=str(e))
        replies = backend._send([backend.nodes[j] for j in to], contents, "train", timeout)
        secure = self.algorithm.exchanges[e].secure_sum
        like, direct_like, hidden_like = wire_like(structures.messages[e], secure)
        rows, sealed = [], {}
        for j in range(J):
            reply = replies.get(backend.nodes[j]) if answered[j] else None
            if reply is None:
                answered[j] = False
                rows.append(None)
                continue
            message = from_record(like, reply.content["message"])
            traffic.add_up(message_bytes(message))
            if secure:  # the direct fields, and the sealed part the server relays unread
                message, sealed[j] = message["direct"], message["sealed"]
            if transcript is not None and (message or not secure):
                transcript.record(r, names[j], "server", message, exchange=str(e))
            if transcript is not None and secure:
                transcript.record(r, names[j], "aggregator", {"sealed": sealed[j]}, exchange=str(e))
            rows.append(message)
        zero = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), direct_like)
        stacked = jax.tree_util.tree_map(stack_rounds, *[m if m is not None else zero for m in rows])
        summed = {}
        if secure:
            summed = backend._secure_sum(r, e, J, sealed, hidden_like, timeout)
            if transcript is not None:
                transcript.record(r, "aggregator", "server", summed, exchange=str(e))
        return stacked, summed


def ledger_of(name: str, ledgers: dict):
    """Client ``name``'s privacy ledger, or an error saying why the run has none for it."""
    if name in ledgers:
        return ledgers[name]
    raise KeyError(f"client {name!r}: over Flower each client's state stays on its node (context.state); the server "
                   f"has only the privacy ledger of a DP run's clients that answered at its end")

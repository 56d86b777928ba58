"""The simulation backend: every client in one process, rounds jit-compiled.

:class:`SimulationBackend` owns the round loop of every algorithm family: client mapping
(:mod:`~numpyro_fed.run.backends.mapping`), client-owned randomness, dropout, transcript,
byte counts, progress bar, checkpoints and guards. It never contains algorithm code.

One round (jit-compiled; without a progress bar, transcript, callbacks or checkpoints all
rounds run in one ``lax.while_loop``):

1. the server splits its own key and asks ``select``'s clients;
2. nature draws who of them answers (``availability``);
3. per exchange, the asked clients compute (only they do: with ``num_selected < J``
   the vectorised mapping gathers them), each splitting its own key; the answered
   clients' new states are kept and their messages go to the server step (the others'
   rows are zeros).

Guards: a round whose loss, server state or broadcast is non-finite, or in which a
client's message or state is, is rolled back and ends the run with a
:class:`NonFiniteError` naming the round and the clients (``on_nonfinite="warn"``: a
warning, and the result at the last finite round).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..._validation import check_positive_int
from .. import checkpoint as ckpt
from ..availability import as_availability, check_schedule
from ..protocol import (
    Broadcast,
    ClientSlot,
    ClientStates,
    FederatedAlgorithm,
    RunResult,
    RunState,
    ServerView,
    last_info,
)
from ..secure import (
    SecureAggregationError,
    decode_message,
    default_threshold,
    encode_message,
    fixed_point_sum,
    masked_sum,
    protocol_bytes,
    sums_like,
    word_count,
)
from ..transcript import Communication, Transcript, message_bytes
from .driver import NonFinite, NonFiniteError, Rounds, all_finite, drive, non_finite_message
from .mapping import ClientPlan, client_item

__all__ = ["NonFiniteError", "SimulationBackend"]

class RoundOutput(NamedTuple):
    info: Any
    figure: jax.Array
    asked: jax.Array
    answered: jax.Array
    client_ok: jax.Array  # (J,) the client's messages were finite
    server_ok: jax.Array


class _Failure(NamedTuple):
    failed: jax.Array
    round: jax.Array
    clients: jax.Array
    server: jax.Array


def _finite_rows(tree, num: int) -> jax.Array:
    """Per row (client): are all its entries finite? A NaN or inf makes the row's sum
    (times zero) NaN; one fused reduction per leaf."""
    total = jnp.zeros(num)
    for leaf in jax.tree_util.tree_leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            total = total + jnp.sum(jnp.reshape(leaf, (num, -1)) * 0.0, axis=1)
    return total == 0.0


def _pick(flags, new, old):
    """Per client: ``new`` where ``flags`` else ``old`` (leaves stacked over clients)."""

    def one(a, b):
        return jnp.where(jnp.reshape(flags, flags.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree_util.tree_map(one, new, old)


class _Compiled(NamedTuple):
    init: Callable
    round: Callable  # (state, failure, data, server_data) -> (state, failure, output, traffic)
    scan: Callable  # (state, failure, data, server_data, num_rounds) -> (state, failure, outputs)
    sizes: Dict[str, Any]  # per-exchange bytes per client message each way, filled on first use


class SimulationBackend:
    """Runs a :class:`~numpyro_fed.run.protocol.FederatedAlgorithm` with every client in this process.

    Compiled rounds are cached per (algorithm, client plan) pair; the cache holds the
    pair itself, so it is never fooled by a reused ``id``. Inference objects keep one
    backend each, so repeated runs compile once.
    """

    def __init__(self) -> None:
        self._cache: List[Tuple[Any, Any, _Compiled]] = []

    # ------------------------------------------------------------------ compile
    def _compiled(self, algorithm: FederatedAlgorithm, plan: ClientPlan) -> _Compiled:
        # the compiled program depends on the plan only through the number of clients and
        # the mapping (the data are arguments): new Clients of the same shape reuse it
        shape = (len(plan.names), plan.mapping)
        for alg, pl, compiled in self._cache:
            if _same_algorithm(alg, algorithm) and pl == shape:
                return compiled
        compiled = _compile(algorithm, plan)
        self._cache = self._cache[-3:] + [(algorithm, shape, compiled)]
        return compiled

    def init(self, algorithm: FederatedAlgorithm, plan: ClientPlan, rng_key: jax.Array) -> RunState:
        """Every party's initial state; each client's key is its own from here on."""
        return self._compiled(algorithm, plan).init(rng_key, plan.data)

    def step(self, algorithm: FederatedAlgorithm, plan: ClientPlan, state: RunState) -> Tuple[RunState, Any]:
        """One round (jit-compiled). Returns ``(state, info)``; guards as in :meth:`run`."""
        compiled = self._compiled(algorithm, plan)
        new, failure, out, _ = compiled.round(state, _no_failure(len(plan.names)), plan.data, plan.server_data,
                                              None, False)
        if bool(failure.failed):
            bad = _non_finite(failure, plan)
            raise NonFiniteError(non_finite_message(bad), bad.round, bad.clients, state)
        return new, out.info

    def lower_round(self, algorithm: FederatedAlgorithm, plan: ClientPlan, state: RunState):
        """The jit-lowered round (``.compile().memory_analysis()`` for memory benchmarks)."""
        compiled = self._compiled(algorithm, plan)
        return compiled.round.lower(state, _no_failure(len(plan.names)), plan.data, plan.server_data, None, False)

    # ------------------------------------------------------------------ run
    def run(
        self,
        algorithm: FederatedAlgorithm,
        clients: ClientPlan,
        num_rounds: int,
        rng_key: Optional[jax.Array] = None,
        *,
        init_state: Optional[RunState] = None,
        availability: Any = None,
        stage: str = "",
        **options: Any,
    ) -> RunResult:
        """Run ``num_rounds`` rounds of ``algorithm`` on the clients of ``clients`` (the round
        loop is :func:`~numpyro_fed.run.backends.driver.drive`'s).

        Args:
            clients: a :class:`~numpyro_fed.run.backends.mapping.ClientPlan`.
            rng_key: the run's key (ignored when resuming from ``init_state``).
            init_state: resume from a :class:`~numpyro_fed.run.protocol.RunState`.
            availability: who answers when asked (:mod:`numpyro_fed.run.availability`):
                ``None`` (everyone), a probability (or one per client) per round, or a
                ``(rounds, J)`` boolean schedule.
            stage: the ``nf.fit`` rung this run is (:meth:`numpyro_fed.fitting.ladder.Ladder.stage`):
                a network backend's nodes build that rung from it; here every party is this
                process, which built it already.
            **options: the driver's: ``progress_bar`` (a tqdm bar with the family's figure),
                ``record_transcript`` (log every message; ``keep_values`` keeps the arrays),
                ``checkpoint`` (a path: the run state is saved there, atomically, before the
                first round, every ``checkpoint_every`` rounds, default ten times per run, and at
                the end; see :mod:`numpyro_fed.run.checkpoint`), ``callbacks``
                (``callback(round, state, info)`` after each round) and ``on_nonfinite``
                (``"raise"``, default, or ``"warn"`` when a round produces NaN/inf).

        Returns:
            a :class:`~numpyro_fed.run.protocol.RunResult` whose ``params`` is the server's
            state (inference objects replace it with their parameters) and whose
            ``client_states`` holds each client's algorithm state by name.
        """
        plan = clients
        avail = None if availability is None else as_availability(availability, len(plan.names))
        start = 0 if init_state is None else int(init_state.round)
        check_schedule(availability, start + check_positive_int("num_rounds", num_rounds))
        transport = _InProcess(self, algorithm, plan, avail)
        return drive(transport, algorithm, num_rounds, rng_key, init_state=init_state, **options)

    def _communication(self, compiled, algorithm, plan, state, outs) -> Communication:
        if "down" not in compiled.sizes:  # per exchange, bytes per client each way (traced once)
            _, _, _, traffic = jax.eval_shape(
                lambda s: compiled.round(s, _no_failure(len(plan.names)), plan.data, plan.server_data, None, True),
                state,
            )
            compiled.sizes["down"] = [
                message_bytes(b.shared) + message_bytes(_row_struct(b.per_client)) for b, _ in traffic
            ]
            compiled.sizes["up"], compiled.sizes["masked"] = [], []
            for (_, m), exchange in zip(traffic, algorithm.exchanges):
                masked = _masked_fields(exchange, m)
                direct = {k: v for k, v in _fields(m).items() if k not in masked} if masked else m
                compiled.sizes["up"].append(message_bytes(_row_struct(direct)) if direct or not masked else 0)
                compiled.sizes["masked"].append(word_count(_row_struct(masked)) if masked else None)
        asked = np.asarray(outs.asked).sum(axis=-1).astype(np.int64)
        answered = np.asarray(outs.answered).sum(axis=-1).astype(np.int64)
        down, up = compiled.sizes["down"], compiled.sizes["up"]
        n_ex = len(algorithm.exchanges)
        bytes_down = int(np.sum(asked * down[0] + answered * sum(down[1:])))
        bytes_up = int(np.sum(answered * sum(up)))
        for size in compiled.sizes["masked"]:  # the pairwise-masking protocol's messages, per round
            if size is not None:
                for a, k in zip(asked.tolist(), answered.tolist()):
                    extra_up, extra_down = protocol_bytes(a, k, k, a - k, size)
                    bytes_up, bytes_down = bytes_up + extra_up, bytes_down + extra_down
        return Communication(
            len(asked), bytes_up, bytes_down, int(np.sum(answered)) * n_ex, int(np.sum(asked + answered * (n_ex - 1)))
        )


def _non_finite(failure: _Failure, plan: ClientPlan) -> NonFinite:
    bad = [n for n, b in zip(plan.names, np.asarray(failure.clients)) if b]
    return NonFinite(int(failure.round), bad, bool(failure.server))


class _InProcess:
    """The simulation's :class:`~numpyro_fed.run.backends.driver.Transport`: every party in this
    process; one compiled round at a time, or many in one compiled loop."""

    chunked = True

    def __init__(self, backend: "SimulationBackend", algorithm: FederatedAlgorithm, plan: ClientPlan, avail) -> None:
        self.backend, self.algorithm, self.plan, self.avail = backend, algorithm, plan, avail
        self.compiled = backend._compiled(algorithm, plan)
        self.transcript: Optional[Transcript] = None

    def start(self, rng_key, init_state: Optional[RunState], transcript: Optional[Transcript]) -> RunState:
        self.transcript = transcript
        return self.compiled.init(rng_key, self.plan.data) if init_state is None else init_state

    def rounds(self, state: RunState, n: int) -> Rounds:
        plan, compiled = self.plan, self.compiled
        if n == 1:  # one round at a time: the transcript's messages come back with it
            new, failure, out, traffic = compiled.round(state, _no_failure(len(plan.names)), plan.data,
                                                        plan.server_data, self.avail, self.transcript is not None)
            if bool(failure.failed):
                return Rounds(state, None, np.zeros(0), None, None, _non_finite(failure, plan))
            if self.transcript is not None:
                _record(self.transcript, int(state.round), plan.names, out, traffic, self.algorithm.exchanges)
            outs = jax.tree_util.tree_map(lambda x: x[None], out)
            return Rounds(new, outs.info, outs.figure, outs.asked, outs.answered)
        new, failure, outs = compiled.scan(state, _no_failure(len(plan.names)), plan.data, plan.server_data,
                                           self.avail, n)
        if not bool(failure.failed):
            return Rounds(new, outs.info, outs.figure, outs.asked, outs.answered)
        good = int(failure.round) - 1 - int(state.round)  # replay the finite rounds: the last finite state
        if good:
            state = compiled.scan(state, _no_failure(len(plan.names)), plan.data, plan.server_data, self.avail,
                                  good)[0]
        outs = jax.tree_util.tree_map(lambda x: x[:good], outs)
        return Rounds(state, outs.info, outs.figure, outs.asked, outs.answered, _non_finite(failure, plan))

    def save(self, path: str, state: RunState) -> None:
        ckpt.save(path, state, self.plan.names, self.algorithm.name, layout=self.algorithm.layout)

    def finish(self, start: RunState, state: RunState, log: Rounds):
        plan = self.plan
        communication = self.backend._communication(self.compiled, self.algorithm, plan, start, log)
        return communication, ClientStates(plan.names, lambda j: client_item(plan, state.clients, j).state)

    def close(self) -> None:
        pass


def _row_struct(stacked):
    """Shape structs of one client's entry of a pytree stacked over clients."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)


def _no_failure(num_clients: int) -> _Failure:
    return _Failure(jnp.zeros((), bool), jnp.zeros((), jnp.int32), jnp.zeros(num_clients, bool), jnp.zeros((), bool))


def aggregate_messages(messages, secure_sum: Tuple[str, ...], aggregation: str = "trusted"):
    """The messages as the server receives them: the ``secure_sum`` fields summed over the
    clients (the rows of clients that did not answer are zeros), by the trusted aggregator or,
    with ``aggregation="masking"``, as the pairwise-masking protocol decodes the sum (the
    fixed-point sum, :func:`~numpyro_fed.run.secure.fixed_point_sum`, computed on the host: the
    masks cancel exactly, so the protocol itself runs only where its messages are recorded)."""
    if not secure_sum:
        return messages
    fields = _fields(messages)
    hidden = {k: v for k, v in fields.items() if k in secure_sum}
    if aggregation == "masking":
        summed = jax.pure_callback(fixed_point_sum, sums_like(hidden), hidden)
    else:
        summed = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), hidden)
    out = {k: summed[k] if k in secure_sum else v for k, v in fields.items()}
    return type(messages)(**out) if hasattr(messages, "_fields") else out


def _fields(messages) -> dict:
    """A message's top-level fields by name (a dict's items, or a NamedTuple's)."""
    return messages._asdict() if hasattr(messages, "_fields") else dict(messages)


def _masked_fields(exchange, messages):
    """The fields of ``messages`` that ``exchange`` sums by pairwise masking (``{}`` if none)."""
    if not exchange.secure_sum or exchange.aggregation != "masking":
        return {}
    return {k: v for k, v in _fields(messages).items() if k in exchange.secure_sum}


def _record(transcript: Transcript, rnd: int, names, out: RoundOutput, traffic, exchanges) -> None:
    asked, answered = np.asarray(out.asked), np.asarray(out.answered)
    for e, ((broadcast, messages), exchange) in enumerate(zip(traffic, exchanges)):
        receivers = asked if e == 0 else answered
        for j, name in enumerate(names):
            if receivers[j]:
                part = jax.tree_util.tree_map(lambda x: x[j], broadcast.per_client)
                transcript.record(rnd, "server", name, Broadcast(broadcast.shared, part), exchange=str(e))
        secure = exchange.secure_sum
        direct = {k: v for k, v in _fields(messages).items() if k not in secure} if secure else messages
        hidden = {k: v for k, v in _fields(messages).items() if k in secure} if secure else None
        masking = bool(secure) and exchange.aggregation == "masking"
        for j, name in enumerate(names):
            if answered[j]:
                if not secure or direct:
                    transcript.record(
                        rnd, name, "server", jax.tree_util.tree_map(lambda x: x[j], direct), exchange=str(e)
                    )
                if secure and not masking:
                    transcript.record(
                        rnd, name, "aggregator", jax.tree_util.tree_map(lambda x: x[j], hidden), exchange=str(e)
                    )
        if masking:
            _record_masking(transcript, rnd, names, asked, answered, hidden, str(e))
        elif secure:
            transcript.record(rnd, "aggregator", "server", aggregate_messages(hidden, secure), exchange=str(e))


def _record_masking(transcript: Transcript, rnd: int, names, asked, answered, hidden, exchange: str) -> None:
    """Run the pairwise-masking protocol among the asked clients on the fields they sent (an
    asked client that did not answer shares its keys and drops), record its messages, and
    check that it decodes the sum the server step received."""
    who = [j for j in range(len(names)) if asked[j]]
    n, J = len(who), len(names)
    rows = [encode_message(jax.tree_util.tree_map(lambda x: np.asarray(x)[j], hidden), J) if answered[j] else None
            for j in who]

    def send(step, sender, receiver, message):
        src = "server" if sender < 0 else names[who[sender]]
        dst = "server" if receiver < 0 else names[who[receiver]]
        transcript.record(rnd, src, dst, {step: message}, exchange=exchange)

    try:
        total = masked_sum(rows, send=send)
    except SecureAggregationError:
        if sum(r is not None for r in rows) < default_threshold(n):  # as the round itself: no sum this round
            return
        raise
    got = decode_message(total, sums_like(hidden), J)
    used = fixed_point_sum(hidden)
    if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                                     jax.tree_util.tree_leaves(used))):
        raise SecureAggregationError(f"round {rnd}: the masked protocol decoded another sum than the server used")


def _same_algorithm(a: FederatedAlgorithm, b: FederatedAlgorithm) -> bool:
    """The same functions and settings (a set-up may rename a copy of the algorithm)."""
    return a is b or (len(a) == len(b) and all(x is y or (isinstance(x, (str, int)) and x == y) for x, y in zip(a, b)))


class _Layout(NamedTuple):
    """How the clients are mapped (static): ``J`` clients, under ``vmap`` or a loop, ``m``
    asked per round (``None``: not static), gathered under ``vmap`` when ``m < J``."""

    J: int
    vmapped: bool
    m: Optional[int]
    gather: bool


def _init_run(algorithm: FederatedAlgorithm, layout: _Layout, rng_key, data) -> RunState:
    """The run's first state: the server's state and key, every client's slot (its own key)."""
    k_server, k_clients, k_env = random.split(rng_key, 3)
    k_init, server_key = random.split(k_server)
    server, broadcast = algorithm.init_server(k_init)

    def one(key, d):
        k_init_c, own = random.split(key)
        return ClientSlot(own, algorithm.init_client(k_init_c, d))

    keys = random.split(k_clients, layout.J)
    if layout.vmapped:
        slots = jax.vmap(one)(keys, data)
    else:
        slots = tuple(one(keys[j], d) for j, d in enumerate(data))
    return RunState(jnp.zeros((), jnp.int32), server, server_key, broadcast, slots, k_env)


def _client_fn(exchange):
    """An exchange's client step on a client's slot: the client splits its own key."""
    def fn(slot: ClientSlot, broadcast: Broadcast, data):
        key, sub = random.split(slot.rng_key)
        state, message = exchange.client_step(sub, slot.state, broadcast, data)
        return ClientSlot(key, state), message

    return fn


def _map_clients(layout: _Layout, fn, slots, broadcast, data, asked):
    """``fn`` on every asked client: vmapped (gathering the ``m`` asked ones when ``m < J``)
    or in a loop (``lax.cond`` skips a client not asked). Messages are stacked over J."""
    J, m = layout.J, layout.m
    if layout.vmapped:
        axes = (0, Broadcast(None, 0), 0)
        if not layout.gather:
            return jax.vmap(fn, in_axes=axes)(slots, broadcast, data)
        idx = jnp.nonzero(asked, size=m, fill_value=0)[0]
        take = partial(jax.tree_util.tree_map, lambda x: x[idx])
        sub = Broadcast(broadcast.shared, take(broadcast.per_client))
        new_sub, msgs = jax.vmap(fn, in_axes=axes)(take(slots), sub, take(data))
        new = jax.tree_util.tree_map(lambda full, part: full.at[idx].set(part), slots, new_sub)
        msgs = jax.tree_util.tree_map(lambda part: jnp.zeros((J,) + part.shape[1:], part.dtype).at[idx].set(part), msgs)
        return new, msgs
    new, msgs = [], []
    for j in range(J):
        bj = Broadcast(broadcast.shared, jax.tree_util.tree_map(lambda x: x[j], broadcast.per_client))
        if m is not None and m >= J:
            s, msg = fn(slots[j], bj, data[j])
        else:
            shape = jax.eval_shape(fn, slots[j], bj, data[j])[1]

            def skip(operand, j=j, shape=shape):
                return slots[j], jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shape)

            s, msg = jax.lax.cond(asked[j], lambda operand, j=j, bj=bj: fn(slots[j], bj, data[j]), skip, None)
        new.append(s)
        msgs.append(msg)
    return tuple(new), jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *msgs)


def _keep(layout: _Layout, answered, new, old):
    """The new slots of the clients that answered, the old ones of the others."""
    if layout.vmapped:
        return _pick(answered, new, old)
    return tuple(
        jax.tree_util.tree_map(lambda a, b, j=j: jnp.where(answered[j], a, b), n, o)
        for j, (n, o) in enumerate(zip(new, old))
    )


def _one_round(algorithm: FederatedAlgorithm, layout: _Layout, state: RunState, data, server_data, avail):
    """One round: select, who answers, each exchange (clients, then the server on the
    aggregate), and the guard's flags. Returns ``(state, RoundOutput, traffic)``."""
    J, m = layout.J, layout.m
    server_key, k_select, *k_exchanges = random.split(state.server_key, 2 + len(algorithm.exchanges))
    env_key, k_available = random.split(state.env_key)
    asked = algorithm.select(k_select, state.server)
    answered = asked if avail is None else asked & avail.draw(k_available, state.round)
    everyone = avail is None and m is not None and m >= J  # static
    view = ServerView(answered, server_data)
    server, broadcast, slots = state.server, state.broadcast, state.clients
    infos, traffic = [], []
    sent_ok = jnp.ones((), bool)
    for exchange, key in zip(algorithm.exchanges, k_exchanges):
        new, messages = _map_clients(layout, _client_fn(exchange), slots, broadcast, data, asked)
        if everyone:  # every client is asked and answers: nothing to mask
            slots = new
        else:
            messages = _pick(answered, messages, jax.tree_util.tree_map(jnp.zeros_like, messages))
            slots = _keep(layout, answered, new, slots)
        traffic.append((broadcast, messages))
        seen = view
        if exchange.secure_sum and exchange.aggregation == "masking" and not everyone:
            # too few answers to unmask: the round's sum is lost, as if no client had answered
            unmasked = jnp.sum(answered) >= jnp.sum(asked) // 2 + 1
            seen = view._replace(answered=answered & unmasked)
            messages = _pick(seen.answered, messages, jax.tree_util.tree_map(jnp.zeros_like, messages))
        server, broadcast, info = exchange.server_step(
            key, server, aggregate_messages(messages, exchange.secure_sum, exchange.aggregation), seen)
        sent_ok = sent_ok & all_finite(broadcast)
        infos.append(info)
    info = (algorithm.round_info or last_info)(tuple(infos))
    figure = algorithm.monitor(info) if algorithm.monitor is not None else jnp.zeros(())
    # Guard: what the server sends on (its parameters) and the figure must be finite; a
    # client's non-finite message reaches them through the aggregate, and only then are
    # the clients' messages scanned one by one to name them (full states are not scanned
    # each round: a non-finite state shows in its owner's next message).
    server_ok = sent_ok & jnp.isfinite(figure)
    client_ok = jax.lax.cond(
        server_ok, lambda m: jnp.ones(J, bool), lambda m: _finite_rows(m, J), tuple(m for _, m in traffic)
    )
    new_state = RunState(state.round + 1, server, server_key, broadcast, slots, env_key)
    return new_state, RoundOutput(info, figure, asked, answered, client_ok, server_ok), traffic


def _failure_after(failure: _Failure, state: RunState, out: RoundOutput, first_only: bool) -> _Failure:
    """The failure record after a round: a round whose messages or broadcast are non-finite
    fails (``first_only``: the first failing round is kept)."""
    bad = ~(jnp.all(out.client_ok) & out.server_ok)
    if first_only:
        bad = bad & ~failure.failed
    return _Failure(
        failure.failed | bad if first_only else bad,
        jnp.where(bad, state.round + 1, failure.round),
        jnp.where(bad, ~out.client_ok, failure.clients),
        jnp.where(bad, ~out.server_ok, failure.server),
    )


def _guarded(one_round, state, failure: _Failure, data, server_data, avail, with_traffic):
    """One round with the guard's record (the per-round path)."""
    new, out, traffic = one_round(state, data, server_data, avail)
    return new, _failure_after(failure, state, out, True), out, (traffic if with_traffic else None)


def _scan_rounds(one_round, done, state, failure, data, server_data, avail, num_rounds, capacity):
    """Up to ``num_rounds`` rounds in one ``lax.while_loop`` stopping after the first failing
    round (or once the algorithm is ``done``), the outputs in ``capacity`` preallocated rows.
    Returns ``(state, failure, outputs, rounds run)``."""
    shapes = jax.eval_shape(lambda s: one_round(s, data, server_data, avail)[1], state)
    buffers = jax.tree_util.tree_map(lambda x: jnp.zeros((capacity,) + x.shape, x.dtype), shapes)

    def going(carry):
        i, state, failure, _ = carry
        more = (i < num_rounds) & ~failure.failed
        return more if done is None else more & ~done(state.server)

    def body(carry):
        i, state, failure, buffers = carry
        new, out, _ = one_round(state, data, server_data, avail)
        failure = _failure_after(failure, state, out, False)
        buffers = jax.tree_util.tree_map(lambda buf, x: buf.at[i].set(x), buffers, out)
        return i + 1, new, failure, buffers

    ran, state, failure, outs = jax.lax.while_loop(going, body, (jnp.zeros((), jnp.int32), state, failure, buffers))
    return state, failure, outs, ran


def _scan(scan_rounds, state, failure, data, server_data, avail, num_rounds):
    """``num_rounds`` rounds in one ``lax.while_loop`` that stops after the first
    non-finite round (the returned state includes it: the caller replays the finite
    rounds, which is deterministic, rather than every round paying for a rollback);
    per-round outputs go to preallocated buffers. (A ``lax.cond`` around each round to
    skip the rest cost ~40% of a round on CPU.) The round count is a traced argument and
    the buffers' length the next power of two (at least 16), so runs of different
    lengths share one compilation per bucket instead of compiling once per length."""
    capacity = max(16, 1 << (int(num_rounds) - 1).bit_length())
    state, failure, outs, ran = scan_rounds(state, failure, data, server_data, avail,
                                            jnp.asarray(num_rounds, jnp.int32), capacity)
    return state, failure, jax.tree_util.tree_map(lambda x: x[:int(ran)], outs)


def _compile(algorithm: FederatedAlgorithm, plan: ClientPlan) -> _Compiled:
    """Bind the module's round functions to ``algorithm`` and the plan's client layout, and
    jit-compile them."""
    J, m = len(plan.names), algorithm.num_selected
    vmapped = plan.mapping == "vmap"
    layout = _Layout(J, vmapped, m, vmapped and m is not None and m < J)
    # jit-wrapped so that its trace is cached: the scan's shape probe, the scan body, the
    # per-round path and the traffic probe all reuse one trace of the clients' steps
    # (tracing a model-heavy local update can take seconds)
    one_round = jax.jit(partial(_one_round, algorithm, layout))
    round_fn = jax.jit(partial(_guarded, one_round), static_argnums=5)
    scan_rounds = jax.jit(partial(_scan_rounds, one_round, algorithm.done), static_argnums=6)
    return _Compiled(jax.jit(partial(_init_run, algorithm, layout)), round_fn, partial(_scan, scan_rounds), {})

"""The one round loop: :func:`drive` runs an algorithm's rounds over a :class:`Transport`.

Every backend runs its rounds through :func:`drive`, which owns what a run does between
rounds: the progress bar, callbacks, the checkpoint cadence, the end of an open-ended run
(``algorithm.done``), the non-finite guard and the :class:`~numpyro_fed.run.protocol.RunResult`.
A transport only moves rounds: it starts the parties, runs up to ``n`` rounds (sending each
round's messages and gathering the answers) and says what crossed.

- :class:`~numpyro_fed.run.backends.simulation.SimulationBackend`'s transport runs every client in
  this process, many rounds in one compiled ``lax.while_loop`` when nothing between rounds
  needs the host (no bar, transcript or callbacks);
- :class:`~numpyro_fed.flower.FlowerBackend`'s transport runs one round at a time over
  Flower's ``Grid``, the client computations on their nodes.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..._validation import check_positive_int
from ...warnings import NonFiniteWarning, find_stack_level
from .. import checkpoint as ckpt
from ..budget import Pace, projection_text
from ..progress import make_bar, show_chunk
from ..protocol import ClientStates, FederatedAlgorithm, RunResult, RunState
from ..transcript import Communication, Transcript

__all__ = ["GUARDS", "NonFinite", "NonFiniteError", "Rounds", "Transport", "all_finite", "drive", "stack_rounds"]

GUARDS = ("raise", "warn")
CHECKPOINTS_PER_RUN = 10  # a checkpoint= run without checkpoint_every saves this many times (and at the start)
OPEN_ENDED_CHUNK = 4096  # rounds per compiled chunk of a run that ends when its algorithm is done
OPEN_ENDED_BAR_CHUNK = 256  # the same with a progress bar, which moves once per chunk
PACE_CHUNK = 1024  # the same for a sampler whose pace is checked against a bound of more than OPEN_ENDED_CHUNK rounds
_NONFINITE = (
    "round {round}: non-finite values ({what}); the run stopped there and error.state holds the last "
    "finite state. Lower the learning rate or damping, check the data and priors, or pass "
    "on_nonfinite='warn' to stop with a warning and keep the result so far"
)


class NonFiniteError(FloatingPointError):
    """A round produced NaN or inf. ``round``, ``clients`` and ``state`` (the last finite
    run state) are attributes."""

    def __init__(self, message: str, round: int, clients: Sequence[str], state: RunState) -> None:
        super().__init__(message)
        self.round, self.clients, self.state = round, list(clients), state


class NonFinite(NamedTuple):
    """A round whose values were not finite: its number (1-based), the clients whose messages
    or states were, and whether the server's state, broadcast or figure was."""

    round: int
    clients: List[str]
    server: bool


class Rounds(NamedTuple):
    """What a transport gives back for a stretch of rounds: the state after the last finite
    one, and per finite round its info, figure and who was asked and answered (stacked)."""

    state: RunState
    info: Any
    figure: Any  # (n,)
    asked: Any  # (n, J) bool
    answered: Any  # (n, J) bool
    failure: Optional[NonFinite] = None  # the round after them, when it was not finite


class Transport(Protocol):
    """How a backend moves rounds (the parties' computations and the messages between them).

    ``chunked``: :meth:`rounds` may run many rounds in one call (the simulation's compiled
    loop); a transport that is not runs them one at a time."""

    chunked: bool

    def start(self, rng_key: Any, init_state: Optional[RunState], transcript: Optional[Transcript]) -> RunState:
        """Set every party up; the server's (and, where they live here, the clients') state."""

    def rounds(self, state: RunState, n: int) -> Rounds:
        """Up to ``n`` rounds from ``state``: stops before a non-finite round (``failure``) or
        when the algorithm is done."""

    def save(self, path: str, state: RunState) -> None:
        """A checkpoint of this side's part of ``state``."""

    def finish(self, start: RunState, state: RunState, log: Rounds) -> Tuple[Communication, ClientStates]:
        """After the last round: what crossed the wire, and what the run shows of each client."""

    def close(self) -> None:
        """Release what :meth:`start` opened (also after an error)."""


def all_finite(tree) -> jax.Array:
    """Are all entries of the tree's floating leaves finite? (A NaN or inf makes a leaf's sum,
    times zero, NaN: one fused reduction per leaf.)"""
    total = jnp.zeros(())
    for leaf in jax.tree_util.tree_leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            total = total + jnp.sum(leaf * 0.0)
    return total == 0.0


def stack_rounds(*xs) -> jax.Array:
    """One array of the per-round values ``xs``, stacked on the host: ``jnp.stack`` of thousands
    of rounds compiles one concatenation of them all (minutes for a federated NUTS run)."""
    return jnp.asarray(np.stack([np.asarray(x) for x in xs]))


def checkpoint_interval(num_rounds: int, checkpoint: Optional[str], every: Optional[int]) -> int:
    """Rounds between two checkpoints (0: none): ``every``, or :data:`CHECKPOINTS_PER_RUN` saves
    per run; the destination is checked before any round runs."""
    if checkpoint is None:
        if every is not None:
            raise ValueError("checkpoint_every= needs checkpoint=, the path to save the run state to")
        return 0
    ckpt.check_destination(checkpoint)
    if every is None:
        return max(1, -(-int(num_rounds) // CHECKPOINTS_PER_RUN))
    return check_positive_int("checkpoint_every", every)


def check_guard(on_nonfinite: str) -> None:
    if on_nonfinite not in GUARDS:
        raise ValueError(f"on_nonfinite={on_nonfinite!r}: choose one of {GUARDS}")


def non_finite_message(failure: NonFinite) -> str:
    parts = []
    if failure.clients:
        parts.append(f"messages or states of client(s) {failure.clients}")
    if failure.server:
        parts.append("the server's state, broadcast or loss")
    return _NONFINITE.format(round=failure.round, what="; ".join(parts) or "the loss")


def drive(
    transport: Transport,
    algorithm: FederatedAlgorithm,
    num_rounds: int,
    rng_key: Any = None,
    *,
    init_state: Optional[RunState] = None,
    progress_bar: bool = False,
    record_transcript: bool = False,
    keep_values: bool = False,
    checkpoint: Optional[str] = None,
    checkpoint_every: Optional[int] = None,
    callbacks: Sequence[Callable] = (),
    on_nonfinite: str = "raise",
) -> RunResult:
    """Run ``num_rounds`` rounds of ``algorithm`` over ``transport`` (fewer when the algorithm
    says it is done, or a round is not finite). The options are
    :meth:`~numpyro_fed.run.backends.SimulationBackend.run`'s."""
    check_guard(on_nonfinite)
    num_rounds = check_positive_int("num_rounds", num_rounds)
    every = checkpoint_interval(num_rounds, checkpoint, checkpoint_every)
    if init_state is None and rng_key is None:
        raise ValueError("run needs rng_key= (or init_state= to resume)")
    transcript = Transcript(keep_values) if record_transcript else None
    try:
        state = transport.start(rng_key, init_state, transcript)
        first = state
        saved = None  # the round of the last checkpoint written
        if every:  # the starting state: the path and the state's format are proven before round 1
            transport.save(checkpoint, state)
            saved = int(state.round)
        stepwise = (not transport.chunked or (progress_bar and algorithm.done is None) or transcript is not None
                    or bool(callbacks))
        chunk = 1 if stepwise else _chunk(algorithm, num_rounds, every, progress_bar)
        bar = _Bar(algorithm, num_rounds if stepwise else None) if progress_bar else None
        pace = _pace(algorithm, state)
        projected = None
        log: List[Rounds] = []
        failure, done = None, 0
        try:
            while done < num_rounds and failure is None and not (log and _finished(algorithm, state)):
                got = transport.rounds(state, min(chunk, num_rounds - done))
                state, failure = got.state, got.failure
                done += len(got.figure) + (failure is not None)
                if log:  # only the last stretch's state is kept (a stepwise run would hold every round's)
                    log[-1] = log[-1]._replace(state=None)
                log.append(got)
                if pace is not None:
                    projected = pace.add(done, algorithm.progress(state.server)[0])
                    if bar is not None:
                        bar.projected = projected
                if stepwise and len(got.figure):
                    for callback in callbacks:
                        callback(int(state.round), state, jax.tree_util.tree_map(lambda x: x[-1], got.info))
                if every and (int(state.round) % every == 0 or not stepwise):
                    transport.save(checkpoint, state)
                    saved = int(state.round)
                if bar is not None:
                    bar.show(got, state)
                if pace is not None and pace.over(num_rounds):
                    break  # it would not finish within num_rounds: stop before spending them
        finally:
            if bar is not None:
                bar.close()
        if failure is not None:
            _guard(failure, state, on_nonfinite, sum(len(r.figure) for r in log))
        stacked = _concatenate(log)
        if every and saved != int(state.round):  # the last state, unless its chunk just saved it
            transport.save(checkpoint, state)
        communication, client_states = transport.finish(first, state, stacked)
    finally:
        transport.close()
    return RunResult(
        params=state.server,
        state=state,
        trace=stacked.figure,
        info=stacked.info,
        communication=communication,
        client_states=client_states,
        transcript=transcript,
        rounds_answered=np.asarray(np.sum(np.asarray(stacked.answered), axis=-1)),
        projected_rounds=projected if pace is not None and pace.over(num_rounds) else None,
    )


def _chunk(algorithm: FederatedAlgorithm, num_rounds: int, every: int, progress_bar: bool) -> int:
    """Rounds per call of a chunked transport: a checkpoint's interval or the whole run; an
    open-ended algorithm's in chunks, so that the output buffers stay small, and a sampler's whose
    pace is checked against a bound of more than :data:`OPEN_ENDED_CHUNK` rounds in smaller ones."""
    chunk = every or num_rounds
    if algorithm.done is not None:
        chunk = min(chunk, OPEN_ENDED_BAR_CHUNK if progress_bar else OPEN_ENDED_CHUNK)
        if algorithm.progress is not None and num_rounds > OPEN_ENDED_CHUNK:
            chunk = min(chunk, PACE_CHUNK)
    return chunk


def _pace(algorithm: FederatedAlgorithm, state: RunState) -> Optional[Pace]:
    """A :class:`~numpyro_fed.run.budget.Pace` of an open-ended sampler (``progress`` set), from its start."""
    if algorithm.done is None or algorithm.progress is None:
        return None
    done, warmup, total = algorithm.progress(state.server)
    pace = Pace(warmup, total)
    pace.add(0, done)
    return pace


def _finished(algorithm: FederatedAlgorithm, state: RunState) -> bool:
    """Has an open-ended algorithm (``done`` set) finished?"""
    return algorithm.done is not None and bool(algorithm.done(state.server))


def _guard(failure: NonFinite, state: RunState, on_nonfinite: str, finished: int) -> None:
    message = non_finite_message(failure)
    if on_nonfinite == "raise":
        raise NonFiniteError(message, failure.round, failure.clients, state)
    if not finished:
        raise NonFiniteError("no round finished with finite values; nothing to return. " + message,
                             failure.round, failure.clients, state)
    warnings.warn(message, NonFiniteWarning, stacklevel=find_stack_level())


def _concatenate(log: List[Rounds]) -> Rounds:
    """The stretches' rounds as one (stacked on the host)."""
    parts = [r for r in log if len(r.figure)] or [r for r in log if r.info is not None][:1]

    def cat(*xs):
        return jnp.asarray(np.concatenate([np.asarray(x) for x in xs]))

    return Rounds(log[-1].state, *jax.tree_util.tree_map(cat, *[tuple(r[1:5]) for r in parts]))


class _Bar:
    """The run's tqdm bar: per round with the family's figure (a stepwise run), or per chunk
    with the algorithm's own words (a chunked open-ended run)."""

    def __init__(self, algorithm: FederatedAlgorithm, total: Optional[int]) -> None:
        self.algorithm, self.total = algorithm, total
        self.projected: Optional[float] = None  # an open-ended sampler's projected rounds (Pace)
        self.bar = make_bar(total, algorithm.name or "rounds")
        self.figures: List[float] = []
        self.refresh, self.last = max(1, (total or 1) // 20), 0

    def show(self, got: Rounds, state: RunState) -> None:
        n = len(got.figure)
        if self.total is None:
            show_chunk(self.bar, self.algorithm, state.server, n, got.figure, self.projected)
            return
        if not n:
            return
        self.bar.update(n)
        self.figures.extend(float(f) for f in np.asarray(got.figure))
        i = len(self.figures) - 1
        if i % self.refresh == 0 or i == self.total - 1:
            window = self.figures[self.last:]
            words = "{}: {:.4g} (avg. rounds {}-{}: {:.4g})".format(
                self.algorithm.monitor_name, self.figures[-1], self.last + 1, i + 1, float(np.mean(window)))
            if self.projected is not None:
                words = f"{projection_text(self.projected)}, {words}"
            self.bar.set_postfix_str(words)
            self.last = i + 1

    def close(self) -> None:
        self.bar.close()

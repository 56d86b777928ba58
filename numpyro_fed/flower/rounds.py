"""The parts of :class:`~numpyro_fed.flower.server.FlowerBackend`'s round loop that need no
network: what every round of a run shares (:class:`RunContext`, the :class:`Traffic` counts),
the server's state before the first round, the non-finite guard and the run's result."""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..protocol import RunResult, RunState
from ..transcript import Communication, Transcript
from ..warnings import NonFiniteWarning, find_stack_level
from .wire import WireStructures

__all__ = ["RunContext", "Traffic", "first_state", "non_finite", "run_result"]


class Traffic:
    """Bytes and messages that crossed the wire in a run, each way (``Communication``)."""

    def __init__(self) -> None:
        self.up = self.down = self.msgs_up = self.msgs_down = 0

    def add_up(self, nbytes: int) -> None:
        self.up, self.msgs_up = self.up + nbytes, self.msgs_up + 1

    def add_down(self, nbytes: int) -> None:
        self.down, self.msgs_down = self.down + nbytes, self.msgs_down + 1


class RunContext(NamedTuple):
    """What every round of one :meth:`~numpyro_fed.flower.server.FlowerBackend.run` shares: the algorithm and its
    jit-compiled server side, the plan, the wire structures, the transcript and the traffic."""

    algorithm: Any
    plan: Any
    names: List[str]
    structures: WireStructures
    transcript: Optional[Transcript]
    select: Callable
    steps: List[Callable]
    round_info: Callable
    monitor: Callable
    traffic: Traffic
    on_nonfinite: str


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


def non_finite(run: RunContext, r: int, state: RunState, answered, sent, first: bool) -> None:
    """Round ``r`` gave non-finite values: raise :class:`NonFiniteError` (``on_nonfinite="raise"``,
    or nothing finite to return yet) or warn, naming the clients whose messages were non-finite."""
    from ..backends.simulation import NonFiniteError, all_finite

    names = run.names
    bad = [names[j] for j in range(len(names)) if answered[j] and not all(
        bool(all_finite(jax.tree_util.tree_map(lambda x, j=j: x[j], m))) for m in sent)]
    message = (f"round {r + 1}: non-finite values (messages of client(s) {bad}; the server's state, "
               f"broadcast or loss); the run stopped there. Lower the learning rate or damping, "
               f"check the data and priors")
    if run.on_nonfinite == "raise" or first:
        raise NonFiniteError(message, r + 1, bad, state)
    warnings.warn(message, NonFiniteWarning, stacklevel=find_stack_level())  # run's caller, as before the split


def run_result(run: RunContext, state: RunState, infos, figures, answered_log, client_states) -> RunResult:
    """The run's :class:`RunResult` (``client_states``: over Flower only the DP clients' ledgers)."""
    from ..backends.simulation import stack_rounds

    traffic = run.traffic
    return RunResult(
        params=state.server,
        state=state,
        trace=stack_rounds(*figures),
        info=jax.tree_util.tree_map(stack_rounds, *infos),
        communication=Communication(len(figures), traffic.up, traffic.down, traffic.msgs_up, traffic.msgs_down),
        client_states=client_states,
        transcript=run.transcript,
        rounds_answered=np.asarray([a.sum() for a in answered_log]),
    )

"""Client availability for simulated dropout: which asked clients answer in a round.

``availability=`` (of a simulated run) is one of

- ``None``: every asked client answers;
- a probability ``p`` (or one per client, shape ``(J,)``): each asked client answers
  independently with that probability in every round;
- a boolean array of shape ``(R, J)``: row ``r`` says who can answer in round ``r``
  (rounds counted by the run state, so a resumed run continues the schedule); a run that
  goes past round ``R`` is an error.

The draws use the simulation's own key (``RunState.env_key``): nature's randomness, not
the server's and not a client's. The specification travels into the compiled round as
arrays, so changing it does not recompile.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

__all__ = ["Availability", "as_availability", "check_schedule"]

_PROB = "availability={p}: a probability must be in (0, 1] (one for all clients, or one per client)"
_SHAPE = (
    "availability has shape {shape}; give a probability, {J} probabilities (one per client) or a "
    "(rounds, {J}) boolean schedule"
)
_ROUNDS = "the availability schedule covers {R} rounds but the run reaches round {r}; give one row per round"


class Availability(NamedTuple):
    """``probs``: ``(J,)`` answer probabilities; ``table``: ``(R, J)`` bool schedule."""

    probs: jax.Array
    table: jax.Array

    def draw(self, rng_key: jax.Array, rnd: jax.Array) -> jax.Array:
        """``(J,)`` bool: who answers in round ``rnd`` (0-based) if asked."""
        row = self.table[jnp.minimum(rnd, self.table.shape[0] - 1)]
        return row & (random.uniform(rng_key, self.probs.shape) < self.probs)


def as_availability(spec: Any, num_clients: int) -> Availability:
    """An :class:`Availability` for an ``availability=`` specification (see the module)."""
    everyone = jnp.ones((1, num_clients), bool)
    if spec is None:
        return Availability(jnp.ones(num_clients, jnp.float32), everyone)
    arr = np.asarray(spec)
    if arr.dtype == bool:
        if arr.ndim != 2 or arr.shape[1] != num_clients:
            raise ValueError(_SHAPE.format(shape=arr.shape, J=num_clients))
        return Availability(jnp.ones(num_clients, jnp.float32), jnp.asarray(arr))
    if arr.dtype.kind not in "fiu" or arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != num_clients):
        raise ValueError(_SHAPE.format(shape=arr.shape, J=num_clients))
    if not np.all((arr > 0) & (arr <= 1)):
        raise ValueError(_PROB.format(p=spec))
    return Availability(jnp.broadcast_to(jnp.asarray(arr, jnp.float32), (num_clients,)), everyone)


def check_schedule(spec: Any, last_round: int) -> None:
    """Raise when a boolean schedule is shorter than the run."""
    if spec is None:
        return
    arr = np.asarray(spec)
    if arr.dtype == bool and arr.shape[0] < last_round:
        raise ValueError(_ROUNDS.format(R=arr.shape[0], r=last_round))

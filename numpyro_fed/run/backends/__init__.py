"""Backends own the round loop; algorithms never know which one runs them.

- :class:`SimulationBackend`: every client in this process (``vmap`` or a loop), rounds
  jit-compiled, with simulated dropout, transcript, byte counts, checkpoints and guards.

Every backend is a :class:`Backend` (``run(algorithm, plan, num_rounds, rng_key, *,
init_state=None, callbacks=(), ...) -> RunResult``); the typed contracts are in
:mod:`~numpyro_fed.run.backends.base`.
"""

from .base import Backend, NetworkBackend, SteppingBackend
from .mapping import CLIENT_MAPPINGS, ClientPlan, plan_clients
from .simulation import NonFiniteError, SimulationBackend

__all__ = ["Backend", "CLIENT_MAPPINGS", "ClientPlan", "NetworkBackend", "NonFiniteError", "SimulationBackend",
           "SteppingBackend", "plan_clients"]

"""Backends own the round loop; algorithms never know which one runs them.

- :class:`SimulationBackend`: every client in this process (``vmap`` or a loop), rounds
  jit-compiled, with simulated dropout, transcript, byte counts, checkpoints and guards.

Every backend offers ``run(algorithm, clients, num_rounds, rng_key, *, init_state=None,
callbacks=(), ...) -> RunResult``.
"""

from .mapping import CLIENT_MAPPINGS, ClientPlan, plan_clients
from .simulation import NonFiniteError, SimulationBackend

__all__ = ["CLIENT_MAPPINGS", "ClientPlan", "NonFiniteError", "SimulationBackend", "plan_clients"]

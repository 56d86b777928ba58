"""The typed contracts of a backend (as Optax's ``base.py`` types a transformation).

An inference object hands its :class:`~numpyro_fed.run.protocol.FederatedAlgorithm` and client plan
to a :class:`Backend`; ``init`` / ``update`` need a :class:`SteppingBackend` (the simulation);
a :class:`NetworkBackend` (Flower) can also ask its clients, after a run, for values computed
on their own nodes (a fit check's terms). ``isinstance`` checks the methods, never a class.
"""

from __future__ import annotations

from typing import Any, Dict, Protocol, Tuple, runtime_checkable

from ..._typing import Array
from ..protocol import FederatedAlgorithm, RunResult, RunState

__all__ = ["Backend", "NetworkBackend", "SteppingBackend"]


@runtime_checkable
class Backend(Protocol):
    """Owns the round loop: ``run(algorithm, plan, num_rounds, rng_key, **options) -> RunResult``
    (options: ``init_state``, ``progress_bar``, ``record_transcript``, ``keep_values``,
    ``availability``, ``checkpoint``, ``checkpoint_every``, ``on_nonfinite``, ``callbacks``)."""

    def run(self, algorithm: FederatedAlgorithm, plan: Any, num_rounds: int, rng_key: Array,
            **options: Any) -> RunResult: ...


@runtime_checkable
class SteppingBackend(Backend, Protocol):
    """A backend that also runs one round at a time (``FederatedInference.init`` / ``update``)."""

    def init(self, algorithm: FederatedAlgorithm, plan: Any, rng_key: Array) -> RunState: ...

    def step(self, algorithm: FederatedAlgorithm, plan: Any, state: RunState) -> Tuple[RunState, Any]: ...


@runtime_checkable
class NetworkBackend(Backend, Protocol):
    """A backend whose clients live elsewhere: after a run it asks client ``j`` (each key of
    ``payloads``) for the family's client-side value ``name``, computed from its own state and
    data (:meth:`numpyro_fed.flower.FlowerBackend.client_values`)."""

    def client_values(self, name: str, payloads: Dict[int, Any], like: Any, transcript: Any = None,
                      rnd: int = 0) -> Dict[int, Any]: ...

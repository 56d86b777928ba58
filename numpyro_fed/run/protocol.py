"""The protocol every federated algorithm follows, and what a run returns.

An algorithm is a :class:`FederatedAlgorithm`: pure functions over NamedTuple states. A
round is

1. ``select(rng_key, server_state) -> asked``: which clients the server asks;
2. for each :class:`Exchange` in order: every asked client runs
   ``client_step(rng_key, client_state, broadcast, data) -> (client_state, message)`` and
   the server runs ``server_step(rng_key, server_state, messages, view) ->
   (server_state, broadcast, info)`` on the messages of the clients that answered
   (``view.answered``); its broadcast is the input of the next exchange, or of the next
   round's first exchange.

A :class:`Broadcast` has a part every asked client receives (``shared``) and an optional
part with one entry per client (``per_client``, leading axis = client), of which client
``j`` receives entry ``j`` only: e.g. PVI's acknowledgement of the damping the server
applied to that client's last update, or HM1's per-device column.

Randomness is owned: the server's key and each client's key live with their owner (the
backend keeps them next to the algorithm's states and splits them on the owner's side),
and nothing the server holds or receives lets it recompute a client's draws.

A backend (:mod:`numpyro_fed.run.backends`) owns the round loop: client mapping, dropout,
transcript, byte counts, progress bar, checkpoints and guards. Algorithms never know
which backend runs them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np

from .._typing import Array, ClientStepFn, PyTree, ServerStepFn
from .transcript import Communication, Transcript

__all__ = [
    "Broadcast",
    "ClientSlot",
    "ClientStates",
    "Exchange",
    "FederatedAlgorithm",
    "RunResult",
    "RunState",
    "ServerView",
    "all_clients",
    "last_info",
]


class Broadcast(NamedTuple):
    """What the server sends: ``shared`` to every asked client, ``per_client[j]`` to client j."""

    shared: PyTree
    per_client: PyTree = None


class ServerView(NamedTuple):
    """The server's view of an exchange: who answered, and the server's own data.

    Attributes:
        answered: ``(J,)`` bool, the clients whose messages arrived this round (the
            others' rows of ``messages`` are zeros).
        data: data the server itself holds (vertical federation: the response), else
            ``None``.
    """

    answered: Array
    data: PyTree = None


class Exchange(NamedTuple):
    """One message each way: clients compute and answer, the server aggregates.

    - ``client_step(rng_key, client_state, broadcast, data) -> (client_state, message)``
    - ``server_step(rng_key, server_state, messages, view) -> (server_state, broadcast, info)``

    ``messages`` stacks every client's message along a leading client axis.

    ``secure_sum`` names top-level message fields the server receives only summed over the
    clients that answered (no client axis; integer and boolean fields as counts), by
    ``aggregation`` (:mod:`numpyro_fed.run.secure`):

    - ``"trusted"``: a trusted aggregator (Heikkilä et al.'s (2023) black-box secure summation,
      Theorems 11 and 14); the transcript records each client's part as sent to
      ``"aggregator"`` and the sum as sent by ``"aggregator"`` to ``"server"``;
    - ``"masking"``: no third party: pairwise masking with dropout recovery (Bonawitz et al.
      2017, :mod:`numpyro_fed.run.secure.masking`) on fixed-point terms
      (:mod:`numpyro_fed.run.secure.fixed_point`; real fields are summed at a resolution of
      ``2**-24``); the transcript records the protocol's messages, each client's part only
      masked.
    """

    client_step: ClientStepFn
    server_step: ServerStepFn
    name: str = "exchange"
    secure_sum: Tuple[str, ...] = ()
    aggregation: str = "trusted"


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions (see the module docstring).

    Attributes:
        init_server: ``(rng_key) -> (server_state, broadcast)``.
        init_client: ``(rng_key, data) -> client_state``.
        select: ``(rng_key, server_state) -> (J,) bool``, the clients asked this round.
        exchanges: the round's exchanges, in order.
        num_selected: how many clients ``select`` asks (static), or ``None`` when it
            varies; with a number below J the backend computes only those clients.
        round_info: ``(infos of the exchanges) -> info`` of the round (default: the
            last exchange's).
        monitor: ``info -> scalar``, the figure a progress bar shows and
            ``RunResult.trace`` records (``-ELBO``, ``KL(q_new || q)``, ...).
        monitor_name: its name.
        name: the algorithm's name (recorded in checkpoints).
        done: ``server_state -> bool``, or ``None``: an algorithm whose number of rounds is
            not known in advance (federated MCMC) says when it has finished; the backend
            stops after that round (``num_rounds`` is then an upper bound).
        describe: ``server_state -> str``, or ``None``: a few words on the run's progress
            for the progress bar (federated MCMC: the chains' iterations).
        progress: ``server_state -> (iterations done, warmup iterations, iterations in all)``,
            or ``None``: an open-ended sampler's progress, from which the backend projects the
            rounds the run needs (:class:`~numpyro_fed.run.budget.Pace`), shows them, and stops a
            run whose projection exceeds ``num_rounds``.
        layout: the model's sites whose values the states' flat vectors hold, in their order
            (:func:`~numpyro_fed.run.checkpoint.site_layout`; recorded in checkpoints, which a resume
            checks against it), as JSON text; ``""`` where the family lays out no model sites.
    """

    init_server: Callable
    init_client: Callable
    select: Callable
    exchanges: Tuple[Exchange, ...]
    num_selected: Optional[int] = None
    round_info: Callable = None
    monitor: Callable = None
    monitor_name: str = "loss"
    name: str = ""
    done: Callable = None
    describe: Callable = None
    progress: Callable = None
    layout: str = ""


def all_clients(num_clients: int) -> Callable:
    """A ``select`` that asks every client."""
    import jax.numpy as jnp

    def select(rng_key, state):
        del rng_key, state
        return jnp.ones(num_clients, bool)

    return select


def last_info(infos):
    """The default ``round_info``: the last exchange's info."""
    return infos[-1]


class ClientSlot(NamedTuple):
    """A client's state as its owner keeps it: its own PRNG key and the algorithm's state."""

    rng_key: Array
    state: PyTree


class RunState(NamedTuple):
    """Everything a run needs to continue (pass as ``init_state=``; see
    :mod:`numpyro_fed.run.checkpoint` for saving it).

    Attributes:
        round: rounds completed.
        server: the algorithm's server state.
        server_key: the server's own PRNG key.
        broadcast: the server's pending :class:`Broadcast`.
        clients: every client's :class:`ClientSlot` (stacked over clients or a tuple,
            as the simulation maps them; a network backend keeps them on the clients).
        env_key: the simulation's key for client availability (nature's, not the
            server's).
    """

    round: Array
    server: PyTree
    server_key: Array
    broadcast: Broadcast
    clients: PyTree
    env_key: Array


class ClientStates(Mapping):
    """``{client name: that client's state}``, read on demand (slicing a thousand stacked
    client states eagerly would cost more than the rounds)."""

    def __init__(self, names: Sequence[str], get: Callable[[int], Any]) -> None:
        self._names, self._get = tuple(names), get

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(f"no client named {name!r}; clients are {list(self._names)}")
        return self._get(self._names.index(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"ClientStates({list(self._names)})"

    def __reduce__(self):
        """Pickled with every client's state read (the reader function stays behind)."""
        return ClientStates, (self._names, _Listed(tuple(self[n] for n in self._names)))


class _Listed(NamedTuple):
    """``j -> values[j]``: the reader of a pickled :class:`ClientStates`."""

    values: tuple

    def __call__(self, j: int) -> Any:
        return self.values[j]


class RunResult(NamedTuple):
    """What every inference object's ``run`` returns.

    Attributes:
        params: the fitted parameters, typed per family (:mod:`numpyro_fed.run.params`:
            ``GaussianParams(mean, cov)`` for PVI/EP/Laplace, ``GuideParams`` for SFVI, ...;
            server-held; for vertical federation every party's, gathered by the simulation).
        state: the final :class:`RunState` (pass as ``init_state=`` to resume).
        trace: per round, the family's figure (``-ELBO`` for the SVI families,
            ``KL(q_new || q)`` for PVI and EP, the change in ``Theta`` for HM1); also
            available as ``losses``.
        info: per round, the algorithm's full diagnostics (stacked).
        communication: rounds, bytes and messages each way, counted as serialised.
        client_states: ``{client name: that client's final state}`` (the simulation
            gathers them; in a deployment each stays on its client).
        transcript: a :class:`~numpyro_fed.Transcript` when one was recorded.
        rounds_answered: per round, how many clients answered.
        fitted_by: the class name of the inference object whose ``run`` made it (another
            family's methods refuse it, naming both).
        projected_rounds: an open-ended sampler's projection of the rounds its whole run needs,
            from its own pace (:class:`~numpyro_fed.run.budget.Pace`), when it was stopped because
            that exceeds ``num_rounds``; ``None`` otherwise.
        verdict: the family's fit check of this run (:class:`numpyro_fed.check.Verdict`: its
            ``status``, figures and the sites it names); ``None`` before the check ran.
    """

    params: Any
    state: RunState
    trace: jax.Array
    info: Any
    communication: Communication
    client_states: Dict[str, Any]
    transcript: Optional[Transcript] = None
    rounds_answered: Optional[Any] = None
    fitted_by: str = ""
    projected_rounds: Optional[float] = None
    verdict: Any = None

    @property
    def losses(self) -> jax.Array:
        """``trace`` under NumPyro's name."""
        return self.trace

    def __repr__(self) -> str:
        """A few lines (the arrays' shapes, not their values): print ``result.params`` or use
        the inference object's ``print_summary(result)`` for the posterior."""
        params = tuple.__getitem__(self, 0)
        shapes = jax.tree_util.tree_map(np.shape, params)
        trace = np.asarray(self.trace) if self.trace is not None else np.zeros(0)
        last = f", last {float(trace.reshape(-1)[-1]):.4g}" if trace.size else ""
        c = self.communication
        comm = (f"{c.rounds} rounds, {c.bytes_up} B up, {c.bytes_down} B down" if c is not None else "none")
        return (f"RunResult(fitted_by={self.fitted_by!r}, params={shapes}, trace={trace.shape}{last}, "
                f"communication: {comm})")

    def __getattr__(self, name: str):
        """An attribute a ``RunResult`` lacks: the error names ``params``'s fields (``result.params.mean``,
        not ``result.mean``)."""
        params = tuple.__getitem__(self, 0)
        fields = getattr(params, "_fields", ())
        hint = f": use result.params.{name}" if not name.startswith("_") and name in fields else ""
        raise AttributeError(f"RunResult has no attribute {name!r} (params is a {type(params).__name__} of "
                             f"{fields}){hint}")

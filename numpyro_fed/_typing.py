"""Shared type aliases for numpyro_fed."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Protocol, Tuple, runtime_checkable

import jax

PyTree = Any
Array = jax.Array
Trace = Dict[str, Dict[str, Any]]
ClientArgs = Mapping[str, Array]
Message = PyTree
ClientMessage = PyTree
ServerMessage = PyTree
ModelFn = Callable[..., Any]


class ClientStepFn(Protocol):
    """An :class:`~numpyro_fed.run.protocol.Exchange`'s client step:
    ``(rng_key, client_state, broadcast, data) -> (client_state, message)``; ``broadcast`` is a
    :class:`~numpyro_fed.run.protocol.Broadcast` (its ``per_client`` part already this client's row)."""

    def __call__(
        self, rng_key: Array, state: PyTree, broadcast: PyTree, data: PyTree
    ) -> Tuple[PyTree, ClientMessage]: ...


class ServerStepFn(Protocol):
    """An :class:`~numpyro_fed.run.protocol.Exchange`'s server step:
    ``(rng_key, server_state, messages, view) -> (server_state, broadcast, info)``.

    ``messages`` stacks every client's message (leading axis = client; the rows of clients that
    did not answer are zeros, and ``secure_sum`` fields arrive summed); ``view`` is the
    :class:`~numpyro_fed.run.protocol.ServerView`: who answered, and the server's own data.
    """

    def __call__(
        self, rng_key: Array, state: PyTree, messages: ClientMessage, view: PyTree
    ) -> Tuple[PyTree, PyTree, PyTree]: ...


@runtime_checkable
class Structured(Protocol):
    """A family's ``Setup.extra`` that holds the model's :class:`~numpyro_fed.model.structure.ModelStructure`
    (its sites by owner, and the flat layout of the global ones)."""

    structure: Any

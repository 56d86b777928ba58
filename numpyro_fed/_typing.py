"""Shared type aliases for numpyro_fed."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Protocol, Tuple

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
    """``(rng_key, client_state, server_message, data) -> (client_state, client_message)``."""

    def __call__(
        self, rng_key: Array, state: PyTree, message: ServerMessage, data: PyTree
    ) -> Tuple[PyTree, ClientMessage]: ...


class ServerStepFn(Protocol):
    """``(rng_key, server_state, client_messages, data) -> (server_state, server_message, info)``.

    ``client_messages`` is the stack (leading axis = client) of every client's message and
    ``data`` is the server's own view of the round: here the boolean ``active`` vector of
    the clients that took part.
    """

    def __call__(
        self, rng_key: Array, state: PyTree, messages: ClientMessage, data: PyTree
    ) -> Tuple[PyTree, ServerMessage, PyTree]: ...

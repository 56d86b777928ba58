"""What crosses the wire between the ServerApp and the ClientApps, and how.

A message pytree travels as a Flower ``ArrayRecord`` holding one ``uint8`` array: the
message's bytes as :func:`numpyro_fed.run.transcript.message_to_bytes` writes them (each leaf
by ``numpy.save``, in flattening order), the serialisation
:func:`numpyro_fed.run.transcript.message_bytes` counts, so the byte counts are those sent
(Flower adds its own framing: the array's 128-byte ``.npy`` header and the record's
metadata). One array rather than one per leaf: Flower stores and fetches each array as a
separate object, one request each at the SuperNode and at the executor.
Both sides know every message's structure from the algorithm itself
(:func:`wire_structures`), so only the arrays travel.

Before the first round the server sends each client a *template* (:func:`describe`): every
client's name and the shapes and dtypes (not the values) of its arrays, the size of each of
its group plates (:func:`numpyro_fed.group_plate`: a count its node measured on its own
codes, and the argument holding them), and the shapes of the server's own arrays (vertical
federation). Both sides build the same :class:`~numpyro_fed.run.protocol.FederatedAlgorithm` from
it, each with placeholders in place of the data it does not hold: zeros, and codes
``0 .. G_j - 1`` for a group plate. Set-up reads only the structure of a placeholder: group
sizes come from the template, and NumPyro's argument validation is off while set-up traces
the model on them (zeros are no valid scale, yet a model such as eight schools takes its
scales from the data); a client checks its own data with validation as the user set it
(:func:`numpyro_fed.flower.task.build`).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..clients import Clients
from ..run.backends.simulation import aggregate_messages
from ..run.protocol import Broadcast, FederatedAlgorithm, ServerView
from ..run.transcript import message_bytes, message_from_bytes, message_to_bytes, npy_header
from .sealed import OVERHEAD

__all__ = ["Template", "WireStructures", "describe", "from_record", "parse_template", "to_record", "wire_like",
           "wire_structures"]


def to_record(message: Any):
    """A message pytree as a Flower ``ArrayRecord``: one ``uint8`` array of its
    :func:`~numpyro_fed.run.transcript.message_to_bytes`."""
    from flwr.app import ArrayRecord

    return ArrayRecord([np.frombuffer(message_to_bytes(message), np.uint8)])


def from_record(like: Any, record) -> Any:
    """Rebuild a message with the structure of ``like`` from :func:`to_record` output."""
    arrays = [record[k] for k in record]
    if len(arrays) != 1 or str(arrays[0].dtype) != "uint8" or len(arrays[0].shape) != 1:
        raise ValueError(f"a numpyro_fed message record holds one uint8 array, not {len(arrays)} array(s)")
    return message_from_bytes(like, _payload(arrays[0]))


def _payload(array) -> bytes:
    """The bytes of a Flower ``Array`` holding a 1-D ``uint8`` NumPy array: sliced past its
    ``.npy`` header when the header is the one ``numpy.save`` writes for that length (read
    without parsing: ``Array.numpy()`` parses it with ``ast.literal_eval``, a cost per message
    the server paid 40 times a round at 40 clients); otherwise through ``Array.numpy()``."""
    n = int(array.shape[0])
    header = npy_header((n,), "|u1")
    data = array.data
    if array.stype == "numpy.ndarray" and len(data) == len(header) + n and data.startswith(header):
        return data[len(header):]
    return array.numpy().tobytes()


class Template(NamedTuple):
    """The shapes every party's data has: ``clients = {name: {arg: (shape, dtype)}}`` in
    client order, ``server = {arg: (shape, dtype)}`` (vertical federation)."""

    kind: str  # "horizontal" or "vertical"
    clients: Dict[str, Dict[str, tuple]]
    server: Dict[str, tuple]
    groups: Dict[str, Dict[str, tuple]] = {}  # {client: {plate: (G_j, codes arguments)}}

    @property
    def names(self) -> List[str]:
        return list(self.clients)


def shapes_of(arrays: Mapping[str, Any]) -> Dict[str, tuple]:
    return {str(k): (tuple(int(d) for d in np.shape(v)), np.asarray(v).dtype.str) for k, v in arrays.items()}


def describe(template: Template) -> str:
    """The template as JSON (what the server sends in the set-up message)."""
    return json.dumps({"kind": template.kind, "clients": [[n, template.clients[n]] for n in template.clients],
                       "server": template.server, "groups": template.groups})


def parse_template(text: str) -> Template:
    raw = json.loads(text)

    def arrays(d):
        return {k: (tuple(s), dt) for k, (s, dt) in d.items()}

    groups = {c: {p: (int(g), tuple(a)) for p, (g, a) in v.items()} for c, v in raw.get("groups", {}).items()}
    return Template(raw["kind"], {n: arrays(a) for n, a in raw["clients"]}, arrays(raw["server"]), groups)


def _zeros(shapes: Mapping[str, tuple], groups: Mapping[str, tuple] = None) -> Dict[str, np.ndarray]:
    """Placeholders: zeros, and for a group plate's codes argument ``0 .. G - 1`` in turn."""
    out = {k: np.zeros(s, np.dtype(dt)) for k, (s, dt) in shapes.items()}
    for size, args in (groups or {}).values():
        arg = args[0]
        if arg in out and size > 0:
            out[arg] = (np.arange(out[arg].size) % size).reshape(out[arg].shape).astype(out[arg].dtype)
    return out


def inputs_from_template(template: Template, own: Optional[tuple] = None, server: Optional[Mapping] = None):
    """The inference object's inputs as this party sees them: its own arrays (``own =
    (name, arrays)`` on a client, ``server`` on the server) and zeros of the right shapes
    for everything it does not hold."""

    if template.kind == "horizontal":
        data = {n: _zeros(s, template.groups.get(n)) for n, s in template.clients.items()}
        if own is not None:
            data[own[0]] = dict(own[1])
        return Clients(data)
    data: Dict[str, Any] = {}  # zeros first, then what this party holds (never overwritten by zeros)
    for shapes in list(template.clients.values()) + [template.server]:
        data.update(_zeros(shapes))
    if server is not None:
        data.update(dict(server))
    if own is not None:
        data.update(dict(own[1]))
    return data


class WireStructures(NamedTuple):
    """Per exchange: the structure of one client's broadcast (``Broadcast(shared,
    per_client row)``) and of one client's message (shape structs)."""

    broadcasts: tuple
    messages: tuple
    client_states: tuple  # per client: the structure of its algorithm state


def _row(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def wire_structures(algorithm: FederatedAlgorithm, data: Sequence[Any], server_data: Any) -> WireStructures:
    """Every message's structure, traced from the algorithm (no values): both sides call it
    with the same template, so only the leaves need to travel."""
    key = jax.random.PRNGKey(0)
    J = len(data)
    states = [jax.eval_shape(algorithm.init_client, key, d) for d in data]
    first_states = states
    _, broadcast = jax.eval_shape(algorithm.init_server, key)
    server = jax.eval_shape(algorithm.init_server, key)[0]
    broadcasts, messages = [], []
    for exchange in algorithm.exchanges:
        row = Broadcast(broadcast.shared, _row(broadcast.per_client))
        broadcasts.append(row)
        outs = [jax.eval_shape(exchange.client_step, key, s, row, d) for s, d in zip(states, data)]
        states = [o[0] for o in outs]
        messages.append(outs[0][1])
        stacked = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((J,) + x.shape, x.dtype), outs[0][1])
        view = ServerView(jax.ShapeDtypeStruct((J,), jnp.bool_), server_data)
        step = partial(_server_step, exchange)
        server, broadcast, _ = jax.eval_shape(step, key, server, stacked, view)
    return WireStructures(tuple(broadcasts), tuple(messages), tuple(first_states))


def _server_step(exchange, key, server, messages, view):

    return exchange.server_step(key, server, aggregate_messages(messages, exchange.secure_sum), view)


def wire_like(like, secure):
    """``(as it travels, direct part, secure part)`` of one client's message: with
    ``secure_sum`` fields, ``{"direct": the other fields, "sealed": the secure ones sealed}``."""
    if not secure:
        return like, like, None
    direct = {k: v for k, v in like.items() if k not in secure}
    hidden = {k: v for k, v in like.items() if k in secure}
    sealed = jax.ShapeDtypeStruct((message_bytes(hidden) + OVERHEAD,), np.uint8)
    return {"direct": direct, "sealed": sealed}, direct, hidden

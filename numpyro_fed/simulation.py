"""The simulation backend: every client in one process.

Backends decide only how clients are mapped, never what they compute:

- ``"vmap"``: clients of equal shape are vectorised; clients of unequal size are padded
  to the largest along the row axis and masked (padded rows contribute nothing);
- ``"loop"``: clients are unrolled one by one inside the same jit-compiled round, for
  clients that cannot be padded (no plate follows the row count).

``"auto"`` picks ``vmap`` when it can and ``loop`` otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ._structure import ModelStructure, trace_model
from .clients import Clients
from .elbo import ClientData

__all__ = ["SimulationPlan", "plan_clients"]

BACKENDS = ("auto", "vmap", "loop")

_AMBIGUOUS = (
    "clients have different numbers of rows, so they are padded and masked along the row "
    "plate, but plates {plates} all follow the row count; pass row_plate= to say which "
    "one indexes rows"
)
_NO_PLATE = (
    "backend='vmap' pads clients of different sizes along the plate that indexes rows, but "
    "no plate of the model has the clients' row counts ({reason}); wrap per-row sites in "
    "numpyro.plate(name, X.shape[0]) or use backend='loop'"
)
_NOT_A_PLATE = "row_plate='{name}' is not a plate of the model whose size follows the rows; plates: {plates}"


class SimulationPlan(NamedTuple):
    backend: str
    names: Tuple[str, ...]
    data: Any  # ClientData stacked over clients (vmap) or a tuple of ClientData (loop)
    row_plate: Optional[str]
    num_rows: np.ndarray


def _plates(tr):
    return {n: s["args"][0] for n, s in tr.items() if s["type"] == "plate"}


def _client_data(args, n_rows, n_pad=None):
    n_pad = n_rows if n_pad is None else n_pad
    padded = {}
    for k, v in args.items():
        v = np.asarray(v)
        if n_pad > n_rows:
            v = np.pad(v, [(0, n_pad - n_rows)] + [(0, 0)] * (v.ndim - 1), mode="edge")
        padded[k] = jnp.asarray(v)
    mask = jnp.asarray(np.arange(n_pad) < n_rows, jnp.float32)
    return ClientData(padded, mask, jnp.asarray(n_rows, jnp.float32))


def _find_row_plate(model, kwargs, clients: Clients, structure: ModelStructure, row_plate):
    rows = clients.num_rows
    small = min(rows, key=rows.get)
    large = max(rows, key=rows.get)
    tr_a = trace_model(model, clients[small], kwargs)
    tr_b = trace_model(model, clients[large], kwargs)
    pa, pb = _plates(tr_a), _plates(tr_b)
    following = [p for p in pa if pa[p] == rows[small] and pb.get(p) == rows[large]]
    if row_plate is not None:
        if row_plate not in following:
            raise ValueError(_NOT_A_PLATE.format(name=row_plate, plates=pa))
        chosen = row_plate
    elif len(following) > 1:
        raise ValueError(_AMBIGUOUS.format(plates=following))
    elif not following:
        return None, "none found"
    else:
        chosen = following[0]
    # every client-side sample site whose shape follows the rows must sit in that plate
    for name, site in tr_a.items():
        if site["type"] != "sample" or name not in tr_b:
            continue
        if jnp.shape(site["value"]) != jnp.shape(tr_b[name]["value"]):
            frames = [f.name for f in site["cond_indep_stack"]]
            if chosen not in frames:
                return None, f"site '{name}' changes shape with the rows outside plate '{chosen}'"
    return chosen, ""


def plan_clients(
    model, kwargs, clients: Clients, structure: ModelStructure, backend: str = "auto", row_plate=None
) -> Tuple[SimulationPlan, ModelStructure]:
    """Decide how to map clients and lay out their data."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS}")
    names = clients.names
    rows = np.array([clients.num_rows[n] for n in names])
    if backend != "loop" and np.all(rows == rows[0]):
        stacked = [_client_data(clients[n], int(r)) for n, r in zip(names, rows)]
        data = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *stacked)
        return SimulationPlan("vmap", names, data, row_plate, rows), structure._replace(row_plate=row_plate)
    if backend != "loop":
        chosen, reason = _find_row_plate(model, kwargs, clients, structure, row_plate)
        if chosen is not None:
            n_pad = int(rows.max())
            stacked = [_client_data(clients[n], int(r), n_pad) for n, r in zip(names, rows)]
            data = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *stacked)
            return SimulationPlan("vmap", names, data, chosen, rows), structure._replace(row_plate=chosen)
        if backend == "vmap":
            raise ValueError(_NO_PLATE.format(reason=reason))
    data = tuple(_client_data(clients[n], int(r)) for n, r in zip(names, rows))
    return SimulationPlan("loop", names, data, row_plate, rows), structure._replace(row_plate=row_plate)


def map_clients(plan: SimulationPlan, fn, keys, states, message, data):
    """Apply ``fn(key, state, message, data)`` to every client; messages come back stacked."""
    if plan.backend == "vmap":
        return jax.vmap(fn, in_axes=(0, 0, None, 0))(keys, states, message, data)
    outs = [fn(keys[i], states[i], message, d) for i, d in enumerate(data)]
    messages = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[o[1] for o in outs])
    return tuple(o[0] for o in outs), messages


def init_clients(plan: SimulationPlan, init_client, keys, data):
    if plan.backend == "vmap":
        return jax.vmap(init_client)(keys, data)
    return tuple(init_client(keys[i], d) for i, d in enumerate(data))


def keep_active(plan: SimulationPlan, active, new, old):
    """Clients that did not take part keep their previous state."""

    def pick(flag):
        return lambda a, b: jnp.where(jnp.reshape(flag, jnp.shape(flag) + (1,) * (a.ndim - jnp.ndim(flag))), a, b)

    if plan.backend == "vmap":
        return jax.tree_util.tree_map(pick(active), new, old)
    return tuple(jax.tree_util.tree_map(pick(active[i]), n, o) for i, (n, o) in enumerate(zip(new, old)))


def client_state(plan: SimulationPlan, states, index: int):
    if plan.backend == "vmap":
        return jax.tree_util.tree_map(lambda x: x[index], states)
    return states[index]


def client_data(plan: SimulationPlan, index: int) -> ClientData:
    return client_state(plan, plan.data, index)

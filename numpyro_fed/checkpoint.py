"""Saving and loading a run state, independent of how the simulation maps clients.

Format: one NumPy ``.npz`` archive (no pickled objects) with

- ``meta``: a JSON string: ``{"format": "numpyro_fed.run_state", "version": 1,
  "round": rounds completed, "clients": [client names in order], "family": ...}``;
- ``round``, ``server_key``, ``env_key``: the round counter and the server's and the
  simulation's PRNG keys;
- ``server/<path>`` and ``broadcast/<path>``: every leaf of the server's state and of its
  pending broadcast, named by its pytree path (``jax.tree_util.keystr``);
- ``clients/<name>/<path>``: every leaf of each client's state, its own PRNG key included
  (``rng_key``), per client name, whatever the client mapping.

Loading fills the leaves into a template state built for the same model, algorithm and
clients (an inference object's ``load`` does this), so array shapes and dtypes are checked
against the set-up and nothing is unpickled. A checkpoint holds every client's private
state: in a simulation that is one file; a deployment saves each party's part where it
lives.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .protocol import RunState

__all__ = ["load", "save"]

FORMAT = "numpyro_fed.run_state"
VERSION = 1
_CLIENTS = (
    "the checkpoint at {path} was saved with clients {saved}; this run has {now} "
    "(missing from this run: {missing}; not in the checkpoint: {added}). Resume with the same clients"
)
_LEAF = (
    "the checkpoint at {path} does not fit this set-up: {name} is {got} there but {want} here "
    "(a different model, guide, algorithm setting or client data shape)"
)


def _leaves(prefix: str, tree) -> Dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def _per_client(clients, names: Sequence[str]):
    if type(clients) is tuple:  # loop mapping
        return dict(zip(names, clients))
    return {n: jax.tree_util.tree_map(lambda x, j=j: x[j], clients) for j, n in enumerate(names)}


def save(path: str, state: RunState, names: Sequence[str], family: str = "") -> None:
    """Write ``state`` (clients named ``names``) to ``path`` (a ``.npz`` file)."""
    arrays = {"round": np.asarray(state.round), "server_key": np.asarray(state.server_key),
              "env_key": np.asarray(state.env_key)}
    arrays.update(_leaves("server/", state.server))
    arrays.update(_leaves("broadcast/", state.broadcast))
    for name, slot in _per_client(state.clients, names).items():
        arrays.update(_leaves(f"clients/{name}/", slot))
    meta = {"format": FORMAT, "version": VERSION, "round": int(state.round), "clients": list(names),
            "family": family}
    arrays["meta"] = np.asarray(json.dumps(meta))
    tmp = f"{path}.tmp.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def read_meta(path: str) -> dict:
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a numpyro_fed run-state checkpoint")
    return meta


def load(path: str, template: RunState, names: Sequence[str]) -> RunState:
    """Read a state saved by :func:`save` into the structure of ``template``."""
    meta = read_meta(path)
    saved = list(meta["clients"])
    if saved != list(names):
        missing = [n for n in saved if n not in names]
        added = [n for n in names if n not in saved]
        raise ValueError(_CLIENTS.format(path=path, saved=saved, now=list(names), missing=missing, added=added))
    with np.load(path, allow_pickle=False) as archive:
        stored = {k: archive[k] for k in archive.files}

    def fill(prefix, tree):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = []
        for p, leaf in flat:
            name = prefix + jax.tree_util.keystr(p)
            if name not in stored:
                raise ValueError(_LEAF.format(path=path, name=name, got="absent", want=f"{leaf.shape} {leaf.dtype}"))
            value = stored[name]
            if value.shape != leaf.shape or value.dtype != leaf.dtype:
                raise ValueError(_LEAF.format(path=path, name=name, got=f"{value.shape} {value.dtype}",
                                              want=f"{leaf.shape} {leaf.dtype}"))
            leaves.append(jnp.asarray(value))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    per_client = _per_client(template.clients, names)
    slots = [fill(f"clients/{n}/", per_client[n]) for n in names]
    if type(template.clients) is tuple:
        clients = tuple(slots)
    else:
        clients = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *slots)
    return RunState(
        jnp.asarray(stored["round"]), fill("server/", template.server), jnp.asarray(stored["server_key"]),
        fill("broadcast/", template.broadcast), clients, jnp.asarray(stored["env_key"]),
    )

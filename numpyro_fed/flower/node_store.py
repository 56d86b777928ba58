"""A client's state on its own node (``numpyro-fed-state-dir``): what a rejoin or a resume
reads (:mod:`numpyro_fed.flower.client`).

With ``numpyro-fed-state-dir = "PATH"`` in the node config, the client writes its state (its
key and the algorithm's state) after set-up and after every round it completed to
``PATH/run-<run id>-<site name>.npz`` (and keeps the one before as ``...previous.npz``), in the
checkpoint format (:mod:`numpyro_fed.run.checkpoint`: one client, no server state, with the round),
atomically; with server checkpoints every ``k`` rounds, also ``...-round-<r>.npz`` files. The
folder is the site's own (its data's privacy applies: the state holds the client's key);
nothing of it is sent.
"""

from __future__ import annotations

import os
from typing import Any, Dict

import jax
import numpy as np

from ..run import checkpoint
from ..run.protocol import ClientSlot, RunState

__all__ = ["STATE_DIR_KEY", "load_slot", "restore", "round_files", "round_path", "store", "store_round", "stored_path"]

#: node_config key: the folder where the client keeps its state between messages (rejoin)
STATE_DIR_KEY = "numpyro-fed-state-dir"


def stored_path(context, name: str):
    folder = context.node_config.get(STATE_DIR_KEY)
    if folder is None:
        return None
    return os.path.join(os.path.expanduser(str(folder)), f"run-{int(context.run_id)}-{name}.npz")


def previous(path: str) -> str:
    return path[: -len(".npz")] + ".previous.npz"


def store(context, built: Any, slot: ClientSlot, rnd: int) -> None:
    """The client's state after round ``rnd`` to the node's own storage (when configured), in the
    checkpoint format; the one it replaces is kept as the previous. (A node killed after its
    step and before its reply arrived holds a round the server never saw: a rejoin then takes
    the previous, :func:`restore`.)"""
    path = stored_path(context, built.name)
    if path is None:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        os.replace(path, previous(path))
    save_slot(path, built, slot, rnd)


def save_slot(path: str, built: Any, slot: ClientSlot, rnd: int) -> None:
    """One client's slot in the checkpoint format (no server part, its model's layout of sites),
    atomically: the one writer of a node's stored states (:func:`load_slot` reads them)."""

    zero = np.zeros((2,), np.uint32)
    checkpoint.save(path, RunState(np.int32(rnd), (), zero, (), (slot,), zero), [built.name], family="flower.node",
                    layout=built.algorithm.layout)


def restore(context, built: Any, rnd: int) -> ClientSlot:
    """The state :func:`store` kept for this run and site after round ``rnd``, the last round
    whose reply the server received from it: the latest one stored, or the one before it when
    the node stopped between its step and its reply (raises when neither is of that round)."""
    path = stored_path(context, built.name)
    if path is None:
        raise ValueError(
            f"client {built.name!r} cannot rejoin: its node keeps no state ({STATE_DIR_KEY} is not in its node config)"
        )
    found = []
    for candidate in (path, previous(path)):
        if os.path.exists(candidate):
            stored, slot = load_round_slot(built, candidate)
            if stored == rnd:
                return slot
            found.append(stored)
    raise ValueError(
        f"client {built.name!r} cannot rejoin at round {rnd}: its node holds its state after round(s) {found}, "
        f"not after the last round the server received from it"
    )


def round_path(context, run_id: int, name: str, rnd: int):
    return os.path.join(
        os.path.expanduser(str(context.node_config[STATE_DIR_KEY])), f"run-{int(run_id)}-{name}-round-{int(rnd)}.npz"
    )


def round_files(context, run_id: int, name: str) -> Dict[int, str]:
    """This site's per-round states of run ``run_id`` on this node: ``{round: path}``."""
    folder = os.path.expanduser(str(context.node_config[STATE_DIR_KEY]))
    prefix, found = f"run-{int(run_id)}-{name}-round-", {}
    for entry in os.listdir(folder) if os.path.isdir(folder) else ():
        if entry.startswith(prefix) and entry.endswith(".npz") and entry[len(prefix) : -4].isdigit():
            found[int(entry[len(prefix) : -4])] = os.path.join(folder, entry)
    return found


def store_round(context, built: Any, slot: ClientSlot, rnd: int) -> None:
    """With server checkpoints every ``k`` rounds: the client's state after round ``rnd`` (a
    resume from the server's checkpoint at round ``c`` takes the latest at or before ``c``). Files
    no resume can need are removed: those before the latest at or before ``rnd - k``."""
    every = built.checkpoint_every
    if not every:
        return
    save_slot(round_path(context, context.run_id, built.name, rnd), built, slot, rnd)
    files = round_files(context, context.run_id, built.name)
    older = [r for r in files if r <= rnd - every]
    if older:
        for r in [r for r in files if r < max(older)]:
            os.remove(files[r])


def load_round_slot(built: Any, path: str) -> tuple:
    """``(round, slot)`` of a state :func:`save_slot` wrote."""

    like = ClientSlot(jax.ShapeDtypeStruct((2,), np.uint32), built.structures.client_states[built.index])
    zero = jax.ShapeDtypeStruct((2,), np.uint32)
    template = RunState(jax.ShapeDtypeStruct((), np.int32), (), zero, (), (like,), zero)
    state = checkpoint.load(path, template, [built.name], layout=built.algorithm.layout)
    return int(state.round), state.clients[0]


def load_slot(context, built: Any, path: str) -> ClientSlot:
    return load_round_slot(built, path)[1]

"""Saving and loading a run state, independent of how the simulation maps clients.

Format: one NumPy ``.npz`` archive (no pickled objects) with

- ``meta``: a JSON string: ``{"format": "numpyro_fed.run_state", "version": 1,
  "round": rounds completed, "clients": [client names in order], "family": ...,
  "layout": {...}}``, ``layout`` the model's sites whose values the state's flat vectors hold,
  in their order (:func:`site_layout`: each global site's name and unconstrained shape, the
  local sites' and ``numpyro.param`` sites' names);
- ``round``, ``server_key``, ``env_key``: the round counter and the server's and the
  simulation's PRNG keys;
- ``server/<path>`` and ``broadcast/<path>``: every leaf of the server's state and of its
  pending broadcast, named by its pytree path (``jax.tree_util.keystr``);
- ``clients/<name>/<path>``: every leaf of each client's state, its own PRNG key included
  (``rng_key``), per client name, whatever the client mapping.

A typed PRNG key (``jax.random.key``) is stored as its key data, and ``meta`` names it
(``"typed_keys": {leaf: implementation}``); loading wraps it back. The file is written to a
temporary name beside ``path`` and renamed, so a crash never leaves half a checkpoint, and a
run checks the destination (and writes its starting state there) before its first round.
A file that is damaged, truncated or not a checkpoint raises :class:`CheckpointError` naming
it and what is wrong.

Loading fills the leaves into a template state built for the same model, algorithm and
clients (an inference object's ``load`` does this), so array shapes and dtypes are checked
against the set-up and nothing is unpickled. Shapes cannot tell two sites of the same shape
apart, nor the order of sites within a flat vector: a model whose sites are declared in another
order than the saved one's would read one site's values into another. So the saved layout is
compared with this set-up's, and a checkpoint laid out otherwise (sites reordered, renamed,
added, removed or reshaped) is refused, naming the difference. A checkpoint holds every client's private
state: in a simulation that is one file; a deployment saves each party's part where it
lives.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..warnings import CheckpointLayoutWarning, find_stack_level
from .protocol import RunState

__all__ = ["CheckpointError", "check_destination", "check_layout", "conform", "load", "save", "site_layout"]

FORMAT = "numpyro_fed.run_state"
VERSION = 1
_HEAD = ("round", "server_key", "env_key")  # the run state's own leaves, stored under these names
_CLIENTS = (
    "{source} was saved with clients {saved}; this run has {now} "
    "(missing from this run: {missing}; not in {short}: {added}). Resume with the same clients"
)
_COUNT = (
    "{source} holds the states of {count} client(s); this run has {want} ({now}). Resume with the same clients"
)
_LEAF = (
    "{source} does not fit this set-up: {name} is {got} there but {want} here "
    "(a different model, guide, algorithm setting or client data shape)"
)


_LAYOUT = (
    "{source} was saved from a model whose {what} {saved}; this model's are {now}. The state's flat vectors "
    "hold the sites in that order, so they would be read into other sites. Resume with the model as it was saved "
    "(its sites declared in the same order, with the same names and shapes)"
)
_NO_LAYOUT = (
    "{source} records no layout of its sites (saved by an earlier version): its vectors are read in this model's "
    "site order, right only if the model declares its sites as the saved run's did"
)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: damaged, truncated, or not a checkpoint."""


def site_layout(structure) -> str:
    """The layout of a model's sites in a run state (a
    :class:`~numpyro_fed.model.structure.ModelStructure`), as JSON text (hashable, as the algorithm that
    carries it must be; saved in a checkpoint's ``meta``): ``{"global": [[name, unconstrained shape],
    ...], "global_param": [...], "local": [...], "local_param": [...]}``, each in the flat vectors'
    order."""
    glob = structure.global_latent
    return json.dumps({"global": [[n, list(shape)] for n, shape in zip(glob.names, glob.shapes)],
                       "global_param": list(structure.global_param), "local": list(structure.local_latent_names),
                       "local_param": list(structure.local_param_names)})


_LAYOUT_WHAT = {"global": "global sites (name, unconstrained shape) are, in order,",
                "global_param": "global numpyro.param sites are, in order,",
                "local": "local sites are, in order,", "local_param": "local numpyro.param sites are, in order,"}


def check_layout(source: str, saved: Optional[dict], layout: Optional[str]) -> None:
    """Refuse a state saved with another layout of the model's sites than ``layout`` (this set-up's,
    :func:`site_layout`), naming the part that differs; a file without one (an earlier version's)
    warns that it cannot be checked."""
    if not layout:
        return
    layout = json.loads(layout)
    if saved is None:
        warnings.warn(_NO_LAYOUT.format(source=source), CheckpointLayoutWarning, stacklevel=find_stack_level())
        return
    for part, what in _LAYOUT_WHAT.items():
        was, now = _entries(saved.get(part, [])), _entries(layout.get(part, []))
        if was != now:
            raise ValueError(_LAYOUT.format(source=source, what=what, saved=was, now=now))


def _entries(part) -> list:
    return [(e[0], tuple(e[1])) if isinstance(e, (list, tuple)) else e for e in part]


def _is_typed_key(leaf) -> bool:
    return jnp.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key)


def _one(name: str, leaf, typed: Dict[str, str], to_numpy: bool):
    if _is_typed_key(leaf):
        typed[name] = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf) if to_numpy else leaf


def _leaves(prefix: str, tree, typed: Dict[str, str], to_numpy: bool = True) -> Dict[str, np.ndarray]:
    """Every leaf of ``tree`` by its path; typed keys as their key data, named in ``typed``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + jax.tree_util.keystr(p): _one(prefix + jax.tree_util.keystr(p), leaf, typed, to_numpy)
            for p, leaf in flat}


def _num_clients(clients) -> int:
    if type(clients) is tuple:  # loop mapping
        return len(clients)
    leaves = jax.tree_util.tree_leaves(clients)
    return int(leaves[0].shape[0]) if leaves else 0


def _per_client(clients, names: Sequence[str]):
    if type(clients) is tuple:  # loop mapping
        return dict(zip(names, clients))
    return {n: jax.tree_util.tree_map(lambda x, j=j: _item(x, j), clients) for j, n in enumerate(names)}


def _item(x, j: int):
    """Client ``j``'s entry of a stacked leaf (of its shape, for a template's shape struct)."""
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[j]


def _arrays(state: RunState, names: Sequence[str], to_numpy: bool = True) -> Tuple[Dict, Dict[str, str]]:
    typed: Dict[str, str] = {}
    arrays = {k: _one(k, getattr(state, k), typed, to_numpy) for k in _HEAD}
    arrays.update(_leaves("server/", state.server, typed, to_numpy))
    arrays.update(_leaves("broadcast/", state.broadcast, typed, to_numpy))
    for name, slot in _per_client(state.clients, names).items():
        arrays.update(_leaves(f"clients/{name}/", slot, typed, to_numpy))
    return arrays, typed


def check_destination(path: str) -> None:
    """Refuse, before any round runs, a checkpoint path that cannot be written."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"checkpoint={path!r} is a folder; give the path of a file (e.g. {path}/run.npz)")
    if not os.path.isdir(folder):
        raise ValueError(f"checkpoint={path!r}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"checkpoint={path!r}: the folder {folder} is not writable")


def save(path: str, state: RunState, names: Sequence[str], family: str = "", extra: Optional[dict] = None,
         layout: Optional[str] = None) -> None:
    """Write ``state`` (clients named ``names``) to ``path`` (a ``.npz`` file), atomically;
    ``extra``: further JSON entries of ``meta`` (e.g. a Flower run's id and sites); ``layout``: the
    model's sites in the state's vectors (:func:`site_layout`), checked on resume."""
    arrays, typed = _arrays(state, names)
    meta = {**(extra or {}), "format": FORMAT, "version": VERSION, "round": int(state.round), "clients": list(names),
            "family": family, "typed_keys": typed, **({"layout": json.loads(layout)} if layout else {})}
    arrays["meta"] = np.asarray(json.dumps(meta))
    tmp = f"{os.fspath(path)}.tmp.npz"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _damaged(path, what: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint at {path} cannot be read: {what}. It is damaged or truncated (e.g. "
                           f"copied while being written), or not a numpyro_fed checkpoint; use another copy")


def _read(path: str, everything: bool) -> Tuple[dict, Dict[str, np.ndarray]]:
    """``(meta, arrays)`` of the file at ``path`` (arrays only when ``everything``)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "meta" not in archive.files:
                raise _damaged(path, f"it has no 'meta' entry (entries: {sorted(archive.files)[:5]})")
            meta = json.loads(str(archive["meta"]))
            stored = {k: archive[k] for k in archive.files} if everything else {}
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {path}") from None
    except CheckpointError:
        raise
    except zipfile.BadZipFile as err:
        raise _damaged(path, f"not a complete .npz (zip) archive ({err})") from err
    except ValueError as err:  # numpy: a file that is not an .npz (its pickle advice) or a bad entry
        raise _damaged(path, "not an .npz archive of arrays" if "pickle" in str(err) else str(err)) from err
    except (OSError, EOFError, KeyError) as err:
        raise _damaged(path, f"{type(err).__name__}: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _damaged(path, f"its 'meta' entry is not a {FORMAT} header")
    return meta, stored


def read_meta(path: str) -> dict:
    """The header of the checkpoint at ``path`` (:class:`CheckpointError` when unreadable)."""
    return _read(path, everything=False)[0]


def _check_clients(source: str, short: str, saved: Optional[Sequence[str]], count: int, names: Sequence[str]):
    if saved is not None and list(saved) != list(names):
        missing = [n for n in saved if n not in names]
        added = [n for n in names if n not in saved]
        raise ValueError(_CLIENTS.format(source=source, short=short, saved=list(saved), now=list(names),
                                         missing=missing, added=added))
    if count != len(names):
        raise ValueError(_COUNT.format(source=source, count=count, want=len(names), now=list(names)))


def _fill(source: str, stored: Dict, typed: Dict[str, str], template: RunState, names: Sequence[str]) -> RunState:
    """``stored`` (arrays by name, as :func:`_arrays` names them) in the structure of
    ``template``, every leaf's shape and dtype checked."""

    def leaf_value(name, leaf):
        if name not in stored:
            raise ValueError(_LEAF.format(source=source, name=name, got="absent", want=f"{leaf.shape} {leaf.dtype}"))
        value = stored[name]
        if _is_typed_key(leaf):
            if name not in typed:
                raise ValueError(_LEAF.format(source=source, name=name, got=f"raw key data {value.shape}",
                                              want=f"a typed key {leaf.shape} {leaf.dtype}"))
            value = jax.random.wrap_key_data(jnp.asarray(value), impl=typed[name])
        elif name in typed:
            raise ValueError(_LEAF.format(source=source, name=name, got=f"a typed key ({typed[name]})",
                                          want=f"raw key data {leaf.shape} {leaf.dtype}: resume with the same "
                                               f"kind of key (jax.random.key or jax.random.PRNGKey)"))
        if value.shape != leaf.shape or value.dtype != leaf.dtype:
            raise ValueError(_LEAF.format(source=source, name=name, got=f"{value.shape} {value.dtype}",
                                          want=f"{leaf.shape} {leaf.dtype}"))
        return jnp.asarray(value)

    def fill(prefix, tree):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        return jax.tree_util.tree_unflatten(
            treedef, [leaf_value(prefix + jax.tree_util.keystr(p), leaf) for p, leaf in flat])

    per_client = _per_client(template.clients, names)
    slots = [fill(f"clients/{n}/", per_client[n]) for n in names]
    if type(template.clients) is tuple:
        clients = tuple(slots)
    else:
        clients = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *slots)
    head = {k: leaf_value(k, getattr(template, k)) for k in _HEAD}
    return RunState(head["round"], fill("server/", template.server), head["server_key"],
                    fill("broadcast/", template.broadcast), clients, head["env_key"])


def load(path: str, template: RunState, names: Sequence[str], layout: Optional[str] = None) -> RunState:
    """Read a state saved by :func:`save` into the structure of ``template``; ``layout``: this
    set-up's sites (:func:`site_layout`), which the saved ones must equal (:func:`check_layout`)."""
    meta, stored = _read(path, everything=True)
    source = f"the checkpoint at {path}"
    check_layout(source, meta.get("layout"), layout)
    _check_clients(source, "the checkpoint", meta.get("clients"), len(meta.get("clients", ())), names)
    return _fill(source, stored, dict(meta.get("typed_keys", {})), template, names)


def conform(state: RunState, template: RunState, names: Sequence[str], saved: Optional[Sequence[str]] = None,
            source: str = "init_state") -> RunState:
    """``state`` checked against ``template`` (a run's own initial state or its shapes) as
    :func:`load` checks a file: the same clients (``saved``: the names ``state`` was run
    with, when known), every leaf's shape and dtype; laid out as ``template`` lays out
    clients."""
    _check_clients(source, source, saved, _num_clients(state.clients), names)
    same = jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(template) and all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(template)))
    if same:
        return state
    stored, typed = _arrays(state, names, to_numpy=False)
    return _fill(source, stored, typed, template, names)

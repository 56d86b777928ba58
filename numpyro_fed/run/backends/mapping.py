"""How the simulation lays clients out: vectorised (``vmap``) or one by one (``loop``).

- ``"vmap"``: clients of equal shape are vectorised; clients of unequal size are padded
  to the largest along the row axis and masked (padded rows contribute nothing);
- ``"loop"``: clients are unrolled one by one inside the same jit-compiled round, for
  clients that cannot be padded (no plate follows the row count) or that hold different
  kinds of data (vertical parties);
- ``"auto"`` picks ``vmap`` when it can and ``loop`` otherwise.

The layout is the simulation's business only: a run state saved to disk does not depend
on it (see :mod:`numpyro_fed.run.checkpoint`).
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.primitives import Messenger

from ...clients import ClientData, Clients
from ...model.structure import ModelStructure, SiteLayout
from ...model.term_identity import (
    TermMismatch,
    checked_clients,
    client_term_mismatch,
    describe_mismatch,
    split_rows_mismatch,
)
from ...model.trace import program_digest, read_abstractly, update_digest

__all__ = ["CLIENT_MAPPINGS", "ClientPlan", "check_sums_over_rows", "client_data", "client_item", "first_term_mismatch",
           "pad_client",
           "plan_clients", "shape_key", "stack_clients", "traced_args", "unpadder"]

CLIENT_MAPPINGS = ("auto", "vmap", "loop")

_AMBIGUOUS = (
    "clients have different numbers of rows, so they are padded and masked along the row "
    "plate, but plates {plates} all follow the row count; pass row_plate= to say which "
    "one indexes rows"
)
_NO_PLATE = (
    "client_mapping='vmap' pads clients of different sizes along the plate that indexes rows, but "
    "no plate of the model has the clients' row counts ({reason}); wrap per-row sites in "
    "numpyro.plate(name, X.shape[0]) or use client_mapping='loop'"
)
_NOT_A_PLATE = (
    "row_plate='{name}' is not a plate of the model whose size follows the clients' rows; "
    "plates of client '{client}' and their sizes: {plates}"
)


class ClientPlan(NamedTuple):
    """Clients as the simulation maps them.

    Attributes:
        names: client names, in order (index j is client j everywhere).
        data: every client's data, stacked over clients (``vmap``) or a tuple (``loop``).
        mapping: ``"vmap"`` or ``"loop"``.
        row_plate: the plate that indexes rows, when clients were padded along it.
        num_rows: real rows per client.
        server_data: data the server itself holds (vertical federation), else ``None``.
    """

    names: Tuple[str, ...]
    data: Any
    mapping: str
    row_plate: Optional[str]
    num_rows: np.ndarray
    server_data: Any = None


def _plates(tr):
    return {n: s["args"][0] for n, s in tr.items() if s["type"] == "plate"}


def _sample_shapes(tr):
    """A trace's plates, and each sample site's ``(shape, its plates)``."""
    return _plates(tr), {n: (tuple(jnp.shape(s["value"])), [f.name for f in s["cond_indep_stack"]])
                         for n, s in tr.items() if s["type"] == "sample"}


def pad_client(args, n_rows: int, n_pad: Optional[int] = None) -> ClientData:
    """A client's arguments as :class:`ClientData`, padded (edge values) to ``n_pad`` rows."""
    n_pad = n_rows if n_pad is None else n_pad
    padded = {}
    for k, v in args.items():
        v = np.asarray(v)
        if n_pad > n_rows:
            v = np.pad(v, [(0, n_pad - n_rows)] + [(0, 0)] * (v.ndim - 1), mode="edge")
        padded[k] = jnp.asarray(v)
    mask = jnp.asarray(np.arange(n_pad) < n_rows, jnp.float32)
    return ClientData(padded, mask, jnp.asarray(n_rows, jnp.float32))


def stack_clients(items):
    """Stack per-client pytrees along a new leading axis."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *items)


def _check_row_plate(model, kwargs, clients: Clients, row_plate):
    """``row_plate=`` must name a plate whose size is each client's row count."""
    if row_plate is None:
        return
    for name in clients.names:
        plates = read_abstractly(model, clients[name], kwargs, _plates)
        if plates.get(row_plate) != clients.num_rows[name]:
            raise ValueError(_NOT_A_PLATE.format(name=row_plate, client=name, plates=plates))


def _find_row_plate(model, kwargs, clients: Clients, row_plate):
    rows = clients.num_rows
    small = min(rows, key=rows.get)
    large = max(rows, key=rows.get)
    (pa, tr_a), (pb, tr_b) = (read_abstractly(model, clients[c], kwargs, _sample_shapes) for c in (small, large))
    following = [p for p in pa if pa[p] == rows[small] and pb.get(p) == rows[large]]
    if row_plate is not None:
        chosen = row_plate
    elif len(following) > 1:
        raise ValueError(_AMBIGUOUS.format(plates=following))
    elif not following:
        return None, "none found"
    else:
        chosen = following[0]
    # every client-side sample site whose shape follows the rows must sit in that plate
    for name, (shape, frames) in tr_a.items():
        if name not in tr_b:
            continue
        if shape != tr_b[name][0]:
            if chosen not in frames:
                return None, f"site '{name}' changes shape with the rows outside plate '{chosen}'"
    return chosen, ""


def plan_clients(
    model, kwargs, clients: Clients, structure: ModelStructure, client_mapping: str = "auto", row_plate=None
) -> Tuple[ClientPlan, ModelStructure]:
    """Decide how to map clients and lay out their data.

    The model's observed terms must be sums over a client's rows (else the federated model is not
    the pooled one; :func:`check_sums_over_rows`), and every plan is checked before it is
    returned: each client's term as laid out equals NumPyro's own density of the model on the
    client's unpadded rows (:mod:`numpyro_fed.model.term_identity`).
    Under ``"auto"``, clients of unequal size padded side by side whose model reads the padding
    (a term outside the row plate) are laid out one by one on their own rows instead; under
    ``"vmap"`` that is an error naming the client and the term.

    Raises:
        ValueError: a client's term differs from NumPyro's density on its rows, or is not a sum
            over its rows (naming the client, the sites and the fix), or ``"vmap"`` cannot pad
            these clients.
    """
    if client_mapping not in CLIENT_MAPPINGS:
        raise ValueError(f"client_mapping={client_mapping!r}: choose one of {CLIENT_MAPPINGS}")
    _check_row_plate(model, kwargs, clients, row_plate)
    check_sums_over_rows(model, kwargs, clients, structure)
    names = clients.names
    rows = np.array([clients.num_rows[n] for n in names])
    cache: dict = {}  # compiled checks, shared by the layouts tried (NumPyro's side is the same for both)
    if client_mapping != "loop" and np.all(rows == rows[0]):
        data = stack_clients([pad_client(clients[n], int(r)) for n, r in zip(names, rows)])
        return _checked(model, kwargs, clients, ClientPlan(names, data, "vmap", row_plate, rows),
                        structure._replace(row_plate=row_plate), cache)
    if client_mapping != "loop":
        chosen, reason = _find_row_plate(model, kwargs, clients, row_plate)
        if chosen is not None:
            n_pad = int(rows.max())
            data = stack_clients([pad_client(clients[n], int(r), n_pad) for n, r in zip(names, rows)])
            plan, padded = ClientPlan(names, data, "vmap", chosen, rows), structure._replace(row_plate=chosen)
            bad = first_term_mismatch(model, kwargs, clients, plan, padded, cache)
            if bad is None:
                return plan, padded
            if client_mapping == "vmap" or bad.padded_rows == bad.num_rows:
                raise ValueError(describe_mismatch(bad, chosen))
            # "auto": the padded rows reach a term; every client on its own rows instead (checked below)
        elif client_mapping == "vmap":
            raise ValueError(_NO_PLATE.format(reason=reason))
    data = tuple(pad_client(clients[n], int(r)) for n, r in zip(names, rows))
    return _checked(model, kwargs, clients, ClientPlan(names, data, "loop", row_plate, rows),
                    structure._replace(row_plate=row_plate), cache)


def first_term_mismatch(model, kwargs, clients: Clients, plan: ClientPlan, structure: ModelStructure,
                        cache: Optional[dict] = None) -> Optional[TermMismatch]:
    """The first checked client whose laid-out term differs from NumPyro's density on its rows
    (:mod:`numpyro_fed.model.term_identity`), or ``None``. ``cache``: compiled checks to reuse. The
    verdict is remembered for the same model program, data and layout."""
    masks = np.asarray(plan.data.row_mask) if plan.mapping == "vmap" else [np.asarray(d.row_mask) for d in plan.data]
    what = ("terms", plan.mapping, plan.names, masks)
    return _remembered(model, what, clients, kwargs, structure,
                       lambda: _first_term_mismatch(model, kwargs, clients, plan, structure, cache))


def _first_term_mismatch(model, kwargs, clients, plan, structure, cache) -> Optional[TermMismatch]:
    key, cache = jax.random.PRNGKey(0), {} if cache is None else cache
    codes = list(structure.group_plates.values())
    counts = [tuple(int(np.max(clients[n][a])) + 1 for a in codes) for n in plan.names]
    for j in checked_clients([int(n) for n in plan.num_rows], counts):
        name = plan.names[j]
        bad = client_term_mismatch(model, kwargs, structure, client_data(plan, j), clients[name], name,
                                   jax.random.fold_in(key, j), cache=cache)
        if bad is not None:
            return bad
    return None


def _checked(model, kwargs, clients: Clients, plan: ClientPlan, structure: ModelStructure, cache: dict):
    bad = first_term_mismatch(model, kwargs, clients, plan, structure, cache)
    if bad is not None:
        raise ValueError(describe_mismatch(bad, structure.row_plate))
    return plan, structure


def check_sums_over_rows(model, kwargs, clients: Clients, structure: ModelStructure) -> None:
    """Raise when the model's observed terms are not a sum over a client's rows
    (:func:`~numpyro_fed.model.term_identity.split_rows_mismatch`, on the client with the most rows):
    then the federated model would not be the model of the pooled rows."""
    rows = clients.num_rows
    name = max(rows, key=rows.get)
    error = _remembered(model, ("sums", name), clients, kwargs, structure, lambda: split_rows_mismatch(
        model, kwargs, structure, clients[name], name, jax.random.PRNGKey(1)))
    if error is not None:
        raise ValueError(error)


# The checks' verdicts, per user model (held weakly) and fingerprint of the data, settings, layout
# and the program the model traces to (its code and every global it reads: a notebook cell may
# change one between two fits): the rungs of nf.fit, and every family fitted to the same model and
# clients in a process, check once. A verdict depends on nothing else.
_VERDICTS: "weakref.WeakKeyDictionary[Callable, Dict[str, Any]]" = weakref.WeakKeyDictionary()


def _user_model(model):
    fn = getattr(model, "__wrapped_model__", model)
    while isinstance(fn, Messenger) and fn.fn is not None:
        fn = fn.fn
    return fn


def _fingerprint(*parts) -> Optional[str]:
    """A digest of arrays (their bytes, shapes and dtypes) and plain values, or ``None`` when some
    value has no faithful text (then nothing is remembered)."""
    digest = hashlib.sha256()
    parts = [dict(p) if isinstance(p, Mapping) else p for p in parts]
    return digest.hexdigest() if update_digest(digest, parts) else None


def _remembered(model, what: tuple, clients: Clients, kwargs, structure: ModelStructure, compute: Callable):
    """``compute()``, remembered per user model and fingerprint of what the verdict depends on."""
    program = program_digest(model, clients, kwargs)
    key = None if program is None else _fingerprint(
        what, program, {n: dict(clients[n]) for n in clients.names}, dict(kwargs),
        dict(getattr(model, "group_sizes", {})), structure.row_plate, structure.global_latent.names,
        structure.local_latent_names, {n: u for n, (u, _) in structure.global_param.items()})
    user = _user_model(model)
    try:
        memo = _VERDICTS.setdefault(user, {})
    except TypeError:  # not weakly referable: not remembered
        memo, key = {}, None
    if key is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def client_data(plan: ClientPlan, index: int):
    """Client ``index``'s data as laid out (padded under ``vmap``)."""
    return client_item(plan, plan.data, index)


def client_item(plan: ClientPlan, stacked, index: int):
    """Entry ``index`` of a per-client pytree laid out as ``plan`` lays out clients."""
    if plan.mapping == "vmap":
        return jax.tree_util.tree_map(lambda x: x[index], stacked)
    return stacked[index]


def traced_args(args: Mapping[str, Any]):
    """A client's data split into the arrays a compiled function takes as arguments and the
    other values (Python scalars, strings) it is specialised on."""
    arrays = {k: v for k, v in args.items() if isinstance(v, (np.ndarray, jax.Array)) and np.ndim(v) > 0}
    return arrays, {k: v for k, v in args.items() if k not in arrays}


def shape_key(layout: SiteLayout, arrays: Mapping[str, Any], fixed: Mapping[str, Any]) -> tuple:
    """What a compiled per-client function depends on besides its arguments' values."""
    shapes = tuple(sorted((k, np.shape(v), str(np.asarray(v).dtype)) for k, v in arrays.items()))
    return (layout.names, layout.shapes, shapes, tuple(sorted((k, repr(v)) for k, v in fixed.items())))


def unpadder(layout: SiteLayout, real: SiteLayout, num_rows: int):
    """``flat -> flat``: a client's local latents laid out as padded (``layout``) cut to its
    ``num_rows`` real rows and laid out as ``real``."""

    def unpad(flat):
        values = layout.unravel(flat)
        for name, axis in zip(layout.names, layout.row_axes):
            if axis is not None:
                values[name] = jax.lax.slice_in_dim(values[name], 0, num_rows, axis=axis)
        return real.ravel(values)

    return unpad

"""Group effects inside a client: ``group_plate``, a plate the library sizes per client.

The usual hierarchical shape of horizontally split data: a hospital (client) holds
patients in wards (groups), with a ward effect per ward. In the model::

    def model(ward, y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with nf.group_plate("wards", ward), nf.local_site():
            a = numpyro.sample("a", dist.Normal(mu, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(a[ward], 0.5), obs=y)

``ward`` is a data argument holding each row's group code, ``0 .. G_j - 1`` on client
``j`` (:meth:`Clients.split(..., groups="ward") <numpyro_fed.Clients.split>` recodes a
pooled column that way). Run as plain NumPyro (NUTS on pooled data) the plate has
``max(ward) + 1`` entries. Under the library every client's plate has the largest
``G_j`` of all clients (so clients of different sizes are vectorised) and the entries
beyond the client's own ``G_j`` are masked: they add nothing to the model's density, the
SFVI guide leaves them out of ``log q`` and PVI/EP give them a fixed ``N(0, 1)``
independent of everything else, so they change no posterior. Draws read back for a client
(``sample_posterior(client=)``, EP's ``local_posterior``) hold only
its own ``G_j`` groups.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.primitives import Messenger

from .handlers import LOCAL, site_role
from .trace import program_digest, trace_model

__all__ = ["group_plate", "group_sizes", "held_elsewhere", "known_groups", "own_groups", "size_group_plates",
           "sized_model"]

_SIZES: contextvars.ContextVar = contextvars.ContextVar("numpyro_fed_group_sizes", default=None)
_PROBE: contextvars.ContextVar = contextvars.ContextVar("numpyro_fed_group_probe", default=None)
# {client: {plate: (G_j, codes argument)}} for clients whose data this party does not hold (a
# Flower federation's template: each node measured its own codes, see :func:`known_groups`)
_KNOWN: contextvars.ContextVar = contextvars.ContextVar("numpyro_fed_known_groups", default=None)

_TRACED = (
    "group_plate('{name}'): the group codes are traced (inside jit, e.g. MCMC with jit_model_args=True), so the "
    "number of groups is not known; pass size= (the number of groups), or run the model through a numpyro_fed "
    "inference object, which sizes the plate itself"
)
_NOT_CODES = (
    "group_plate('{name}') on client '{client}': the group codes must be integers 0 .. G-1, each used by at least "
    "one row; got {detail}. Recode them per client (nf.Clients.split(..., groups='{arg}') does)"
)
_NOT_AN_ARG = (
    "group_plate('{name}') on client '{client}': its group codes must be one of the model's data arguments (a "
    "column of the client's rows), so every client's own count of groups is read from its own data; pass the "
    "column itself, not an array computed from it"
)
_GLOBAL_IN_GROUP = (
    "site '{site}' is inside group_plate('{plate}') but is not marked local_site: a group's effect belongs to the "
    "client that holds the group. Mark it: with nf.group_plate(...), nf.local_site(): ..."
)


class _GroupMask(Messenger):
    """Mask the log density of every sample site inside plate ``name`` by ``mask``."""

    def __init__(self, name: str, mask):
        self.name, self.mask = name, mask
        super().__init__()

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        for frame in msg["cond_indep_stack"]:
            if frame.name == self.name:
                m = jnp.reshape(self.mask, (-1,) + (1,) * (-frame.dim - 1))
                msg["fn"] = msg["fn"].mask(m)
                return


def _count(ids) -> Optional[int]:
    """``max(ids) + 1`` when ``ids`` is concrete, else ``None``."""
    if isinstance(ids, jax.core.Tracer):
        return None
    ids = np.asarray(ids)
    return int(ids.max()) + 1 if ids.size else 0


@contextlib.contextmanager
def group_plate(name: str, ids: Any, size: Optional[int] = None, dim: Optional[int] = None) -> Iterator[jax.Array]:
    """A plate over the groups of a client's rows (e.g. wards of a hospital).

    Args:
        name: the plate's name.
        ids: each row's group code (a data argument of the model), ``0 .. G - 1``.
        size: the number of groups; by default ``max(ids) + 1`` in plain NumPyro, and the
            largest client's under a numpyro_fed inference object (entries beyond a
            client's own groups masked; see :mod:`numpyro_fed.model.groups`).
        dim: as ``numpyro.plate``'s ``dim``.

    Yields:
        the plate's indices, as ``numpyro.plate``.
    """
    own = _count(ids)
    probe = _PROBE.get()
    if probe is not None:
        probe[name] = ids
    sizes = _SIZES.get()
    if size is None:
        size = sizes[name] if sizes is not None and name in sizes else own
    if size is None:
        raise ValueError(_TRACED.format(name=name))
    size = int(size)
    if own is not None and own == size:  # no padded groups: nothing to mask
        with numpyro.plate(name, size, dim=dim) as idx:
            yield idx
        return
    mask = jnp.arange(size) < (jnp.max(jnp.asarray(ids)) + 1)
    with _GroupMask(name, mask):
        with numpyro.plate(name, size, dim=dim) as idx:
            yield idx


def _probe(model, args, kwargs) -> Dict[str, np.ndarray]:
    """The group plates of ``model`` on ``args`` and the codes each was given."""

    found: Dict[str, np.ndarray] = {}
    token = _PROBE.set(found)
    try:
        trace_model(model, args, kwargs)
    finally:
        _PROBE.reset(token)
    return found


def group_sizes(model, clients, kwargs) -> Tuple[Dict[str, int], Dict[str, str]]:
    """``({plate: largest G_j}, {plate: the data argument holding its codes})`` over the
    clients, each client's codes checked to be ``0 .. G_j - 1``, all used (empty: no group
    plates). A client whose data this party does not hold (inside :func:`known_groups`) is
    taken at the sizes its own node measured, never probed on placeholder values."""
    sizes: Dict[str, int] = {}
    args_of: Dict[str, str] = {}
    known = _KNOWN.get() or {}
    first = clients.names[0]
    found = {first: known[first] if first in known else _probe_codes(model, clients[first], kwargs, first)}
    if not found[first]:  # a model without group plates is traced once, not once per client
        return sizes, args_of
    for client in clients.names:
        if client in found:
            probed = found[client]
        else:
            probed = known[client] if client in known else _probe_codes(model, clients[client], kwargs, client)
        for plate, (size, candidates) in probed.items():
            if args_of.setdefault(plate, candidates[0]) not in candidates:
                raise ValueError(_NOT_AN_ARG.format(name=plate, client=client))
            sizes[plate] = max(sizes.get(plate, 0), size)
    return sizes, args_of


def _probe_codes(model, args, kwargs, client) -> Dict[str, Tuple[int, Tuple[str, ...]]]:
    """``{plate: (G_j, the arguments equal to its codes)}`` of one client's data, its codes checked."""
    out: Dict[str, Tuple[int, str]] = {}
    for plate, ids in _probe(model, args, kwargs).items():
        ids = np.asarray(ids)
        matches = [k for k, v in args.items() if np.shape(v) == ids.shape and np.array_equal(v, ids)]
        if not matches:
            raise ValueError(_NOT_AN_ARG.format(name=plate, client=client))
        detail = _bad_codes(ids)
        if detail:
            raise ValueError(_NOT_CODES.format(name=plate, client=client, detail=detail, arg=matches[0]))
        out[plate] = (int(ids.max()) + 1 if ids.size else 0, tuple(matches))
    return out


def own_groups(model, args, kwargs, client) -> Dict[str, Tuple[int, Tuple[str, ...]]]:
    """``{plate: (G_j, the arguments equal to its codes)}`` of one client's own data (what its
    node tells the server in a Flower federation's hello: counts and names, no values)."""
    return _probe_codes(getattr(model, "__wrapped_model__", model), args, kwargs, client)


@contextlib.contextmanager
def known_groups(groups: Mapping[str, Mapping[str, tuple]]) -> Iterator[None]:
    """Within the block, :func:`group_sizes` takes these clients' group plates as given
    (``{client: {plate: (G_j, codes arguments)}}``, as :func:`own_groups` measured them)
    instead of probing their data."""
    token = _KNOWN.set({c: {p: (int(g), tuple(str(x) for x in a)) for p, (g, a) in v.items()}
                        for c, v in groups.items()})
    try:
        yield
    finally:
        _KNOWN.reset(token)


def held_elsewhere() -> frozenset:
    """The clients whose data this party holds only as placeholders (inside :func:`known_groups`, as
    a Flower party sets up): a check that evaluates the model on their rows has seen nothing of them."""
    known = _KNOWN.get()
    return frozenset(known or ())


def _bad_codes(ids: np.ndarray) -> str:
    if ids.dtype.kind not in "iub":
        return f"dtype {ids.dtype}"
    codes = np.unique(ids)
    if codes.size and codes[0] < 0:
        return f"negative codes {codes[codes < 0][:5].tolist()}"
    missing = np.setdiff1d(np.arange(int(codes.max()) + 1 if codes.size else 0), codes)
    if missing.size:
        return f"codes {missing[:5].tolist()}{' ...' if missing.size > 5 else ''} used by no row"
    return ""


def sized_model(model, clients, kwargs):
    """``model`` with its group plates sized for ``clients`` (itself when it has none).

    The wrapper carries ``group_sizes`` and ``group_args`` (see :func:`group_sizes`)."""
    base = getattr(model, "__wrapped_model__", model)
    sizes, args_of = group_sizes(base, clients, kwargs)
    if not sizes:
        return base

    @functools.wraps(base)
    def sized(*args, **kw):
        token = _SIZES.set(sizes)
        try:
            return base(*args, **kw)
        finally:
            _SIZES.reset(token)

    sized.__wrapped_model__ = base
    sized.group_sizes, sized.group_args = dict(sizes), dict(args_of)
    return sized


def sized_program_digest(model, clients, kwargs) -> Optional[str]:
    """:func:`~numpyro_fed.model.trace.program_digest` of ``model`` sized to the clients' groups (as
    the families run it); ``None`` where it cannot be sized or traced alone."""
    try:
        sized = sized_model(model, clients, kwargs)
    except Exception:  # noqa: BLE001  (any failure: no digest)
        return None
    return program_digest(sized, clients, kwargs)


def size_group_plates(inference, clients) -> None:
    """``inference.model`` sized for ``clients`` (an inference object's ``_size_group_plates``
    for the families whose clients hold rows)."""
    inference.model = sized_model(inference.model, clients, inference.model_kwargs)


def group_axes(site, u, plates: Mapping[str, str]) -> Tuple[Tuple[str, int, str], ...]:
    """``(plate, axis of the unconstrained value, codes argument)`` for each group plate of ``site``."""
    out = []
    for frame in site["cond_indep_stack"]:
        if frame.name in plates:
            event_ndim_u = jnp.ndim(u) - len(site["fn"].batch_shape)
            out.append((frame.name, frame.dim - event_ndim_u, plates[frame.name]))
    return tuple(out)


def group_mask(shape, axes, args) -> jax.Array:
    """1 on a site's entries of real groups, 0 on padded ones (``axes`` from :func:`group_axes`)."""
    mask = jnp.ones(shape)
    for _plate, axis, arg in axes:
        count = jnp.max(jnp.asarray(args[arg])) + 1
        b = [1] * len(shape)
        b[axis] = shape[axis]
        mask = mask * (jnp.arange(shape[axis]) < count).reshape(b)
    return mask


def check_group_sites(tr, plates) -> None:
    """A latent site in a group plate must be local (its group belongs to one client)."""

    for name, site in tr.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        for frame in site["cond_indep_stack"]:
            if frame.name in plates and site_role(site) != LOCAL:
                raise ValueError(_GLOBAL_IN_GROUP.format(site=name, plate=frame.name))


def trim_groups(values: Dict[str, jax.Array], layout, args) -> Dict[str, jax.Array]:
    """A client's draws with its padded groups cut off (the axes count from the right, so
    leading draw axes do not matter)."""
    out = dict(values)
    for name, axes in zip(layout.names, layout.group_axes or ((),) * len(layout.names)):
        for _plate, axis, arg in axes:
            count = int(np.max(np.asarray(args[arg]))) + 1
            out[name] = jax.lax.slice_in_dim(out[name], 0, count, axis=jnp.ndim(out[name]) + axis)
    return out

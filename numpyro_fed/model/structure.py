"""Which sites a federated model has, who owns them, and the split log joint.

The joint log density of a federated model is split by site owner:

.. math::

    \\log p(z, y) = \\underbrace{\\log p(z_G)}_{\\text{server}}
        + \\sum_j \\underbrace{\\log p(z_{L_j}, y_j \\mid z_G)}_{\\text{client } j}.

**No term is ever computed on fabricated data.** The model is only ever run on a
client's real rows. The once-counted global term ``log p(z_G)`` (with its Jacobian) is
shared among the clients that hold data: each client adds ``w_j log p(z_G)`` to its own
term with ``sum_j w_j = 1`` (SFVI: ``w_j = 1/J``), and what the server computes alone
(the entropy of ``q(z_G)``, a Gaussian) does not involve the model. Supports and shapes of
the global sites are read from a client's trace at set-up.
"""

from __future__ import annotations

import importlib.util
from functools import partial
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.distributions.util import sum_rightmost
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from ..compat import distribution_mask
from .checks import check_enumerable, check_imputation, check_traceable, probe_row_sites, warn_client_indexed_globals
from .groups import check_group_sites, group_axes, group_mask
from .handlers import GLOBAL, LOCAL, site_role
from .trace import or_finite_point, read_abstractly, trace_model, unconstrained_shape

__all__ = [
    "ModelStructure",
    "SiteLayout",
    "analyse_model",
    "constrain_params",
    "deterministic_of_globals",
    "global_deterministic_sites",
    "is_enumerated",
    "is_latent",
    "log_joint",
    "make_layout",
    "trace_model",
]

_GLOBAL_SHAPE = (
    "site '{name}' is global (latent sites are global unless marked) but its shape "
    "depends on the client's data: {client_shape} on client '{client}' vs {other_shape} "
    "on {other}. If it is a per-row or per-client variable, mark it with "
    "nf.local_site(model, sites=['{name}'])"
)
_BAD_ROLE = (
    "site '{name}' has infer['federation'] = {role!r}; use nf.global_site / nf.local_site "
    "(roles 'global' or 'local') rather than writing the annotation by hand"
)
_NO_LATENT = "the model has no latent sample site: there is nothing to infer"
_DATA_DEPENDENT_GLOBAL = (
    "site '{name}' is global but is missing when the model runs on client '{client}''s data; "
    "global sites must exist whatever a client's data"
)
_DISCRETE_LOCAL = (
    "local latent site '{name}' is discrete ({support}) and not enumerated: the guides are "
    "Gaussian, so a discrete local site must be summed out inside its client's term. Add "
    "infer={{'enumerate': 'parallel'}} to the site (or wrap the model in "
    "numpyro.contrib.funsor.config_enumerate), or marginalise it in the model (e.g. "
    "dist.MixtureSameFamily for a mixture label)"
)
_ENUM_ONLY_PARALLEL = (
    "local latent site '{name}' has infer['enumerate'] = {how!r}; only 'parallel' enumeration "
    "(as in NumPyro's TraceEnum_ELBO) is supported"
)
_DISCRETE_GLOBAL = (
    "global latent site '{name}' is discrete ({support}); the server's Gaussian family "
    "cannot represent it. Marginalise it out in the model, or make it a per-row local site "
    "(nf.local_site) with infer={{'enumerate': 'parallel'}} so each client sums it out"
)


class SiteLayout(NamedTuple):
    """Flat layout of a group of unconstrained sites (one role, one client shape)."""

    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    row_axes: Tuple[Optional[int], ...]
    size: int
    unravel: Callable
    group_axes: Tuple[Tuple[Tuple[str, int, str], ...], ...] = ()  # per site: (group plate, axis, codes arg)
    plate_axes: Tuple[Tuple[Tuple[str, int], ...], ...] = ()  # per site: (plate, negative axis) of its plates

    def ravel(self, values: Mapping[str, jax.Array]) -> jax.Array:
        if not self.names:
            return jnp.zeros(0)
        return jnp.concatenate([jnp.reshape(values[n], -1) for n in self.names])

    def flat_mask(self, row_mask: jax.Array, args: Optional[Mapping] = None) -> jax.Array:
        """Per-entry mask (1 real, 0 padding) from a per-row mask and, for sites in group
        plates (:func:`numpyro_fed.group_plate`), the client's group codes in ``args``."""
        parts = []
        groups = self.group_axes or ((),) * len(self.names)
        for shape, axis, axes in zip(self.shapes, self.row_axes, groups):
            if axis is None:
                m = jnp.ones(shape, row_mask.dtype)
            else:
                b = [1] * len(shape)
                b[axis] = shape[axis]
                m = jnp.broadcast_to(row_mask.reshape(b), shape)
            if axes:
                if args is None:
                    raise ValueError("flat_mask: sites in group plates need the client's args")
                m = m * group_mask(shape, axes, args).astype(row_mask.dtype)
            parts.append(jnp.reshape(m, -1))
        return jnp.concatenate(parts) if parts else jnp.zeros(0, row_mask.dtype)


def make_layout(entries) -> SiteLayout:
    """``entries``: ``(name, shape, row axis[, group axes])`` per site."""
    names = tuple(e[0] for e in entries)
    shapes = tuple(tuple(e[1]) for e in entries)
    axes = tuple(e[2] for e in entries)
    groups = tuple(e[3] if len(e) > 3 else () for e in entries)
    plates = tuple(e[4] if len(e) > 4 else () for e in entries)
    sizes = [int(np.prod(s)) for s in shapes]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int) if names else np.zeros(1, int)
    size = int(sum(sizes))

    def unravel_ordered(flat):
        # the inverse of SiteLayout.ravel: sites in ``names`` order (not the sorted order of a dict's
        # pytree flattening, which would scramble sites whose names are not in sorted order)
        if jnp.shape(flat) != (size,):
            raise ValueError(f"a flat vector of shape {jnp.shape(flat)} cannot be laid out as "
                             f"{dict(zip(names, shapes))} (size {size})")
        return {n: jnp.reshape(flat[int(a):int(a) + k], s) for n, s, a, k in zip(names, shapes, starts, sizes)}

    return SiteLayout(names, shapes, axes, size, unravel_ordered, groups if any(groups) else (),
                      plates if any(plates) else ())


def _unconstrained(site) -> jax.Array:
    if site["type"] == "param":
        constraint = site["kwargs"].get("constraint")
        return biject_to(constraint).inv(site["value"]) if constraint is not None else site["value"]
    return biject_to(site["fn"].support).inv(site["value"])


def _row_axis(site, u, row_plate) -> Optional[int]:
    if row_plate is None or site["type"] != "sample":
        return None
    for frame in site["cond_indep_stack"]:
        if frame.name == row_plate:
            batch_ndim = len(site["fn"].batch_shape)
            event_ndim_u = jnp.ndim(u) - batch_ndim
            return frame.dim - event_ndim_u
    return None


def _plate_axes(site, u) -> Tuple[Tuple[str, int], ...]:
    """``(plate name, negative axis of u)`` for each plate a sample site is in."""
    event_ndim_u = jnp.ndim(u) - len(site["fn"].batch_shape)
    return tuple((f.name, f.dim - event_ndim_u) for f in site["cond_indep_stack"] if f.size > 1)


def is_latent(site) -> bool:
    return site["type"] == "sample" and not site["is_observed"]


def latent_supports(tr) -> Dict[str, Any]:
    """``{site: support}`` of the latent sites of a trace."""
    return {n: s["fn"].support for n, s in tr.items() if is_latent(s)}


class ModelStructure(NamedTuple):
    """Sites of a federated model, by owner."""

    global_latent: SiteLayout
    global_param: Dict[str, Tuple[jax.Array, object]]  # name -> (unconstrained init, constraint)
    local_latent_names: Tuple[str, ...]
    local_param_names: Tuple[str, ...]
    observed: Tuple[str, ...]
    row_plate: Optional[str]
    global_supports: Dict[str, object] = {}
    enumerated: Tuple[str, ...] = ()  # discrete local sites summed out in their client's term
    group_plates: Dict[str, str] = {}  # group plate -> the data argument of its codes (numpyro_fed.model.groups)

    def constrain_global(self, z: jax.Array) -> Dict[str, jax.Array]:
        """Constrained values of the global latent sites from the flat unconstrained ``z``."""
        return {n: biject_to(self.global_supports[n])(u) for n, u in self.global_latent.unravel(z).items()}

    def local_layout(self, tr) -> SiteLayout:
        entries = []
        for name in self.local_latent_names:
            u = _unconstrained(tr[name])
            entries.append((name, jnp.shape(u), _row_axis(tr[name], u, self.row_plate),
                            group_axes(tr[name], u, self.group_plates), _plate_axes(tr[name], u)))
        return make_layout(entries)

    def local_param_init(self, tr) -> Dict[str, jax.Array]:
        return {n: _unconstrained(tr[n]) for n in self.local_param_names}

    def local_param_constraints(self, tr) -> Dict[str, object]:
        return {n: tr[n]["kwargs"].get("constraint") for n in self.local_param_names}


def _shape_probes(clients):
    """One client per distinct row count (a global site's shape may depend on nothing
    else): ``[(client name, args)]``."""
    seen, probes = set(), []
    for name in clients.names:
        rows = clients.num_rows[name]
        if rows not in seen:
            seen.add(rows)
            probes.append((name, clients[name]))
    return probes


def analyse_model(model, clients, kwargs) -> ModelStructure:
    """Discover the sites of ``model`` and check the annotations against every client's data.

    Roles come from the first client's trace; the shape of every global site is compared
    across all clients (one per distinct row count, which is all a shape can depend on).
    An unmarked latent site inside a plate that indexes a client's rows (a plate of
    observed sites whose size is the row count) is an error, so a per-row site is never
    silently shared, whatever the client sizes. The model runs only on real client data.
    """
    first = clients.names[0]
    tr = trace_model(model, clients[first], kwargs)
    check_imputation(tr)
    plates = dict(getattr(model, "group_args", {}))
    check_group_sites(tr, plates)
    probes = [(label, read_abstractly(model, args, kwargs, partial(probe_row_sites, client=label,
                                                                    rows=clients.num_rows[label])))
              for label, args in _shape_probes(clients)]
    check_traceable(model, clients[first], kwargs, tr, plates)
    supports = {}
    global_entries, global_param = [], {}
    local_latent, local_param, observed, enumerated = [], [], [], []
    for name, site in tr.items():
        if site["type"] == "sample" and site["is_observed"]:
            observed.append(name)
            continue
        if site["type"] not in ("sample", "param"):
            continue
        role = site_role(site)
        if role == LOCAL:
            if site["type"] == "sample" and site["fn"].support.is_discrete:
                how = site["infer"].get("enumerate")
                if how is None:
                    raise ValueError(_DISCRETE_LOCAL.format(name=name, support=site["fn"].support))
                if how != "parallel":
                    raise ValueError(_ENUM_ONLY_PARALLEL.format(name=name, how=how))
                check_enumerable(name, site["fn"])
                enumerated.append(name)
                continue
            (local_latent if site["type"] == "sample" else local_param).append(name)
            continue
        if role != GLOBAL:
            raise ValueError(_BAD_ROLE.format(name=name, role=role))
        if site["type"] == "sample" and site["fn"].support.is_discrete:
            raise ValueError(_DISCRETE_GLOBAL.format(name=name, support=site["fn"].support))
        u = _unconstrained(site)
        for label, other in probes:
            if name not in other:
                raise ValueError(_DATA_DEPENDENT_GLOBAL.format(name=name, client=label))
            if other[name][0] != jnp.shape(u):
                raise ValueError(
                    _GLOBAL_SHAPE.format(
                        name=name, client_shape=jnp.shape(site["value"]), client=first,
                        other=f"client '{label}'", other_shape=other[name][1],
                    )
                )
        if site["type"] == "sample":
            global_entries.append((name, jnp.shape(u), None))
            supports[name] = site["fn"].support
        else:
            global_param[name] = (u, site["kwargs"].get("constraint"))
    if not global_entries and not local_latent:
        raise ValueError(_NO_LATENT)
    if enumerated:
        _require_funsor()
    warn_client_indexed_globals(model, clients, kwargs, tr, plates, clients.names)
    return ModelStructure(
        global_latent=make_layout(global_entries),
        global_param=global_param,
        local_latent_names=tuple(local_latent),
        local_param_names=tuple(local_param),
        observed=tuple(observed),
        row_plate=None,
        global_supports=supports,
        enumerated=tuple(enumerated),
        group_plates=plates,
    )


def constrain_params(unconstrained: Mapping, constraints: Mapping) -> Dict[str, jax.Array]:
    return {
        n: (biject_to(constraints[n])(u) if constraints.get(n) is not None else u)
        for n, u in unconstrained.items()
    }


def _base_distribution(fn):
    while True:
        inner = getattr(fn, "base_dist", None)
        if inner is None:
            return fn
        fn = inner


class improper_values(Messenger):
    """Give a latent site whose prior cannot be sampled (``dist.ImproperUniform``: a flat
    prior) the point at zero in unconstrained space when nothing else set its value.

    The library traces a model to read its structure, initialise a guide or evaluate a
    density; every evaluation substitutes its own values, so this only stands in where NumPyro
    would otherwise raise ``NotImplementedError`` for a flat prior. The log density of such a
    site is zero wherever it is evaluated, as in NumPyro's own inference."""

    def process_message(self, msg):
        if msg["type"] != "sample" or msg["is_observed"] or msg["value"] is not None:
            return
        base = _base_distribution(msg["fn"])
        if isinstance(base, dist.ImproperUniform):
            transform, shape = unconstrained_shape(msg)
            msg["value"] = transform(jnp.zeros(shape))


def with_improper_values(model: Optional[Callable]) -> Optional[Callable]:
    """``model`` under :class:`improper_values` (once; ``None`` stays ``None``)."""
    if model is None or isinstance(model, improper_values):
        return model
    return improper_values(model)


class _RowMask(Messenger):
    """Mask the log density of every sample site inside ``plate`` by ``mask``."""

    def __init__(self, fn, plate: Optional[str], mask: Optional[jax.Array]):
        self.plate, self.mask, self.masks = plate, mask, {}
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample" or self.plate is None or self.mask is None:
            return
        for frame in msg["cond_indep_stack"]:
            if frame.name == self.plate:
                m = jnp.reshape(self.mask, (-1,) + (1,) * (-frame.dim - 1))
                msg["fn"] = msg["fn"].mask(m.astype(bool))
                self.masks[msg["name"]] = m
                return


def log_joint(
    model,
    args: Mapping,
    kwargs: Mapping,
    latent: Mapping[str, jax.Array],
    params: Mapping[str, jax.Array],
    count: Callable[[dict], float],
    row_plate: Optional[str] = None,
    row_mask: Optional[jax.Array] = None,
) -> jax.Array:
    """Sum of the log densities (and Jacobians) of the sites selected by ``count``.

    Args:
        latent: unconstrained values of latent sites (the others, which must not be
            counted, are set to a finite point, never drawn from their prior).
        params: constrained values of ``numpyro.param`` sites.
        count: weight of a trace site's term (``False``/0: not counted); latent sites
            counted get their log-abs-det-Jacobian added.
        row_plate, row_mask: padded rows (mask 0) contribute nothing.
    """
    ladj: Dict[str, jax.Array] = {}

    def substitute_fn(msg):
        name = msg["name"]
        if msg["type"] == "sample" and name in latent:
            u = latent[name]
            t = biject_to(msg["fn"].support)
            x = t(u)
            j = t.log_abs_det_jacobian(u, x)
            ladj[name] = sum_rightmost(j, jnp.ndim(j) - jnp.ndim(x) + len(msg["fn"].event_shape))
            return x
        if msg["type"] == "param" and name in params:
            return params[name]
        return None

    masker = _RowMask(seed(model, 0), row_plate, row_mask)
    tr = trace(substitute(masker, substitute_fn=or_finite_point(substitute_fn))).get_trace(
        **dict(args), **dict(kwargs))
    enumerated = [n for n, site in tr.items() if is_enumerated(site)]
    if enumerated and _uncounted(count(tr[enumerated[0]])):
        # the enumerated values are then not summed over: nothing counted may depend on them
        observed = [n for n, site in tr.items() if site["type"] == "sample" and site["is_observed"]
                    and not _uncounted(count(site))]
        if observed:
            raise ValueError(f"observed site(s) {observed} are counted but the enumerated site(s) {enumerated} "
                             "they depend on are not: count the enumerated sites with the observed ones")
    elif enumerated:
        return _enumerated_log_joint(model, args, kwargs, substitute_fn, count, row_plate, row_mask, tr, masker,
                                     ladj, enumerated)
    return _site_terms(tr, [n for n, site in tr.items() if site["type"] == "sample"], count, masker.masks, ladj)


def _site_terms(tr, names, count, masks, ladj, log_prob: bool = True) -> jax.Array:
    """``sum_site count(site) * sum(scale * (log p(site) + masked Jacobian))`` over ``names``
    (without ``log p`` when ``log_prob`` is False: the Jacobians alone)."""
    total = jnp.zeros(())
    for name in names:
        site = tr[name]
        weight = count(site)
        if _uncounted(weight):
            continue
        term = site["fn"].log_prob(site["value"]) if log_prob else 0.0
        if name in ladj:  # masked as NumPyro masks it: by the padded rows and by the model's own mask handlers
            jacobian = ladj[name] * masks[name] if name in masks else ladj[name]
            term = term + _handler_mask(site["fn"], jacobian)
        if site["scale"] is not None:
            term = term * site["scale"]
        total = total + (1.0 if weight is True else weight) * jnp.sum(term)
    return total


def _handler_mask(fn, jacobian):
    """``jacobian`` times the mask a ``numpyro.handlers.mask`` put on the site's distribution (a
    masked site's Jacobian is dropped with its density, as NumPyro's potential energy drops the
    Jacobian factor it adds inside the model's handlers)."""
    while isinstance(fn, (dist.MaskedDistribution, dist.ExpandedDistribution)):  # (a plate expands a masked site)
        if isinstance(fn, dist.MaskedDistribution):
            mask = distribution_mask(fn)  # (a bool or an array over the batch shape)
            if isinstance(mask, bool):
                jacobian = jacobian if mask else 0.0 * jacobian
            else:
                jacobian = jnp.where(mask, jacobian, 0.0)
        fn = fn.base_dist
    return jacobian


def _uncounted(weight) -> bool:
    return weight is False or (isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight == 0)


def is_enumerated(site) -> bool:
    return (site["type"] == "sample" and not site["is_observed"] and site["fn"].support.is_discrete
            and site["infer"].get("enumerate") == "parallel")


def _require_funsor():
    if importlib.util.find_spec("funsor") is None:  # pragma: no cover - funsor is a dependency
        raise ImportError("enumerating discrete local sites needs funsor (as NumPyro's TraceEnum_ELBO does): "
                          "pip install funsor")


class _Reweigh(Messenger):
    """Set each sample site's scale to its weight (times any scale the model gave it);
    ``0`` drops a site's factor."""

    def __init__(self, fn, weight: Callable[[dict], float]):
        self.weight = weight
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample":
            w = self.weight(msg)
            w = 0.0 if w is False else (1.0 if w is True else w)
            msg["scale"] = w if msg["scale"] is None else msg["scale"] * w


def _enumerated_log_joint(model, args, kwargs, substitute_fn, count, row_plate, row_mask, tr, masker, ladj,
                          enumerated):
    """:func:`log_joint` of a model with enumerated discrete sites, which are summed out
    exactly as NumPyro's ``TraceEnum_ELBO`` does (funsor's sum-product over the plates).

    Sites that depend on an enumerated value (the discrete site and its children: local
    and observed sites of the client) must share the enumerated site's weight ``w``: the
    result is ``w log sum_d exp(...)`` (a client's rows scaled as a whole, e.g. SFVI-Avg's
    ``N / n_j``), with other sites' weights applied relative to ``w`` (they are constant in
    the enumerated values, so in or out of the sum is the same). A padded row (``row_mask``
    0) has every factor masked to 0, so its sum over the enumerated values is the number of
    them; that ``log K`` per padded entry is taken off again."""
    from numpyro.contrib.funsor import enum
    from numpyro.contrib.funsor import log_density as enum_log_density

    w = count(tr[enumerated[0]])  # may be traced: equal weights are the caller's contract
    w = 1.0 if w is True else w

    def relative(site):
        v = count(site)
        v = 0.0 if v is False else (1.0 if v is True else v)
        return v / w

    nesting = max([-f.dim for site in tr.values() if site["type"] == "sample" for f in site["cond_indep_stack"]
                   if f.dim is not None] + [0])
    masked = _RowMask(seed(model, 0), row_plate, row_mask)
    inner = _Reweigh(substitute(masked, substitute_fn=or_finite_point(substitute_fn)), relative)
    value, _ = enum_log_density(enum(inner, first_available_dim=-nesting - 1), tuple(), {**dict(args), **dict(kwargs)},
                                {})
    # the Jacobians of the substituted continuous sites
    total = w * value + _site_terms(tr, list(ladj), count, masker.masks, ladj, log_prob=False)
    for name in enumerated:  # padded entries: all-zero factors summed over the K values
        if name not in masker.masks:
            continue
        fn = tr[name]["fn"]
        size = fn.enumerate_support(expand=False).shape[0]
        padded = jnp.sum(1.0 - jnp.broadcast_to(masker.masks[name], fn.batch_shape))
        total = total - w * padded * jnp.log(size)
    return total


def deterministic_values(tr) -> Dict[str, np.ndarray]:
    """``{name: value}`` of a trace's ``numpyro.deterministic`` sites, as NumPy arrays."""
    return {n: np.asarray(site["value"]) for n, site in tr.items() if site["type"] == "deterministic"}


def changed_deterministic(first: Mapping, others, rtol: float = 0.0, atol: float = 0.0) -> set:
    """Names of the deterministic sites in ``first`` (see :func:`deterministic_values`)
    whose value differs, or is missing, in any of the ``others``: the sites that depend on
    what was varied between the model runs."""
    return {n for n, v in first.items()
            if any(n not in o or o[n].shape != v.shape or not np.allclose(o[n], v, rtol=rtol, atol=atol)
                   for o in others)}


def fixed_discrete(value):
    """A ``substitute_fn`` that sets every enumerated site to ``value`` (clipped to its
    support's size)."""

    def fn(msg):
        if msg["type"] == "sample" and not msg["is_observed"] and msg["infer"].get("enumerate") == "parallel":
            support = msg["fn"].enumerate_support(expand=False)
            pick = support[min(value, support.shape[0] - 1)]
            return jnp.broadcast_to(pick, msg["fn"].shape())
        return None

    return fn


def global_deterministic_sites(model, kwargs: Mapping, clients, global_names, global_params=()) -> Tuple[str, ...]:
    """The ``numpyro.deterministic`` sites that are functions of the global latent sites
    (and the global ``numpyro.param`` sites ``global_params``) alone: equal, at the same
    global values, when the model runs on the first and the last client's data with other
    draws of everything else (local latents; enumerated sites at their first and second
    value) and other values of every other ``numpyro.param``. Only those can be reported
    with draws of ``q(z_G)``."""
    names = clients.names
    base = trace_model(model, clients[names[0]], kwargs)
    fixed = {n: base[n]["value"] for n in global_names}

    def moved(shift, value):
        discrete = fixed_discrete(value)

        def sub(msg):
            if msg["type"] == "sample" and msg["name"] in fixed:
                return fixed[msg["name"]]
            if msg["type"] == "param" and msg["name"] not in global_params and msg["name"] in base:
                t = biject_to(msg["kwargs"].get("constraint") or constraints.real)
                return t(t.inv(base[msg["name"]]["value"]) + shift)
            return discrete(msg)
        return sub

    runs = [deterministic_values(trace(substitute(
        seed(model, s), substitute_fn=or_finite_point(moved(0.1 * s, s - 1)))).get_trace(
        **dict(clients[c]), **dict(kwargs))) for c, s in ((names[0], 1), (names[-1], 2))]
    observed_plates = {f.name for site in base.values() if site["type"] == "sample" and site["is_observed"]
                       for f in site["cond_indep_stack"]}
    first = deterministic_values(base)
    if len(names) == 1:  # one client: per-row values cannot be told from global ones; leave them out
        first = {n: v for n, v in first.items()
                 if not any(f.name in observed_plates for f in base[n]["cond_indep_stack"])}
    changed = changed_deterministic(first, runs, rtol=1e-6, atol=1e-6)
    return tuple(n for n in first if n not in changed)


def deterministic_of_globals(model, kwargs: Mapping, args: Mapping, names) -> Callable:
    """``constrained global values -> {name: value}`` of the deterministic sites ``names``
    (see :func:`global_deterministic_sites`), computed by running the model on ``args``
    (a client's own data); ``params``: constrained values of global ``numpyro.param``
    sites."""

    def values(globals_, params=None):
        data = {**dict(globals_), **dict(params or {})}
        tr = trace(substitute(substitute(seed(model, 0), data=data), substitute_fn=or_finite_point(None))).get_trace(
            **dict(args), **dict(kwargs))
        return {n: tr[n]["value"] for n in names}

    return values

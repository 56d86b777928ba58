"""The per-row (or per-group) terms of a ``dp_noise``-marked model, for the families that clip each
protected unit's term: the exact private sampler (:class:`~numpyro_fed.mcmc.DPMetropolis`) and the
private Laplace fit (:class:`~numpyro_fed.dp.dp_laplace.DPLaplace`).

:func:`row_terms` checks the model (one ``dp_noise`` spec; local latents, if any, inside the
protected unit; ``delta`` below ``1/n``), lays the clients out, plans the noise and builds each
unit's term (:func:`row_log_lik_fn`); :func:`row_locals` and :func:`unit_locals` say which of a
client's flat local entries belong to each row or group, and :func:`unit_mask` which units are real
(not padding).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions.transforms import biject_to
from numpyro.distributions.util import sum_rightmost
from numpyro.handlers import seed, substitute, trace

from ..model.structure import trace_model
from ..run.backends.mapping import client_data
from ..run.inference import Setup
from ..terms.model import build_terms, site_supports
from .accounting import calibrate_noise_multiplier
from .annotation import dp_sites

__all__ = ["RowLocals", "RowTerms", "marked_row_plate", "protected_unit", "row_locals", "row_log_lik_fn", "row_terms",
           "unit_locals", "unit_mask"]

_OUTSIDE = (
    "DPMetropolis clips each row's term, and observed site {name!r} is not in the row plate {plate!r} (a "
    "term over several rows, such as a numpyro.factor outside the plate, has no per-row bound): put it inside "
    "the plate, or leave it out of the model"
)
_NOT_IN_UNIT = (
    "dp_noise(unit={unit!r}) protects each group of that plate as one term, and local site(s) {names} are not in "
    "group_plate({unit!r}): a group's term takes its own effects as one block (a latent shared by several groups "
    "joins their terms, which no clip of one group's term bounds; a latent per row makes the blocks ragged). Put "
    "them in group_plate({unit!r}), or protect rows (dp_noise without unit=)"
)
_OUTSIDE_UNIT = (
    "observed site '{name}' is in neither the row plate '{plate}' nor group_plate('{unit}'): each group's term sums "
    "its rows' log densities, so every observed site must be in one of them"
)


class RowLocals(NamedTuple):
    """The local latents' layout by rows (static): ``row_of[k]`` is the row of entry ``k`` of a
    client's flat locals; ``num_rows`` the (padded) rows."""

    row_of: jax.Array
    num_rows: int


class RowTerms(NamedTuple):
    """What a per-row private family builds from a ``dp_noise``-marked model (:func:`row_terms`)."""

    spec: Any  # the model's one DPSpec
    noise_multiplier: float  # sigma / C, calibrated to the spec's epsilon for the releases, or given
    setup: Setup  # the clients' layout and the model's terms (no algorithm yet)
    local: Any  # the local latents' layout, or None
    row_term: Callable  # (u, data) -> (units,), or (u, v, data) -> (units,) with local latents
    unit: Optional[Tuple[str, str, int]] = None  # dp_noise(unit=): (group plate, codes argument, groups); None: rows


def row_terms(cls: str, model: Callable, model_kwargs: Dict, clients, row_plate: Optional[str], releases: int,
              no_dp: str, shared_locals: str) -> RowTerms:
    """Check a ``dp_noise``-marked model for a family that clips each row's term (one spec; local
    latents, if any, in the row plate; ``delta`` below ``1/n``), lay the clients out, plan the noise
    for ``releases`` releases per client, and build each row's term. With ``dp_noise(unit=plate)``
    the protected unit is a group of that ``group_plate``: each term is a group's (its rows' and its
    local latents' together; every local latent in that plate)."""
    first = clients.names[0]
    tr = trace_model(model, clients[first], model_kwargs)
    specs = dp_sites(tr)
    if not specs:
        raise ValueError(no_dp)
    if len(set(specs.values())) > 1:
        raise ValueError(f"dp_noise marks {sorted(specs)} with different settings; mark them with one")
    spec = next(iter(specs.values()))
    plan, extra = build_terms(model, model_kwargs, clients, cls=cls, client_mapping="vmap",
                              row_plate=marked_row_plate(row_plate, tr, clients.num_rows[first]),
                              prior_factor="none")
    local = extra.terms.local if extra.terms.num_local else None
    unit = protected_unit(model, spec)
    if local is not None:  # each local latent in the unit: its row (row plate) or its group (the unit's plate)
        groups = local.group_axes or ((),) * len(local.names)
        shared = [n for n, a, g in zip(local.names, local.row_axes, groups)
                  if (a is None if unit is None else not any(p == unit[0] for p, _, _ in g))]
        if shared:
            raise ValueError(shared_locals.format(names=shared) if unit is None else _NOT_IN_UNIT.format(
                names=shared, unit=unit[0]))
    for name in clients.names:
        spec.check_rows(clients.num_rows[name] if unit is None else
                        int(np.max(np.asarray(clients[name][unit[1]]))) + 1, name)
    row_plate = plan.row_plate or extra.structure.row_plate or row_plate
    if row_plate is None:
        raise ValueError(f"{cls}: name the plate that indexes rows (row_plate=...)")
    nm = (calibrate_noise_multiplier(spec.epsilon, spec.delta, releases) if spec.epsilon is not None
          else float(spec.noise_multiplier))
    setup = Setup(clients, None, plan, extra, {})
    supports = site_supports(model, model_kwargs, setup, client_data(plan, 0).args)
    row_term = row_log_lik_fn(model, model_kwargs, extra.structure.global_latent, supports, row_plate, local, unit)
    return RowTerms(spec, nm, setup, local, row_term, unit)


def protected_unit(model: Callable, spec) -> Optional[Tuple[str, str, int]]:
    """``dp_noise(unit=plate)``'s ``(plate, codes argument, groups)`` (groups: the largest client's,
    the others' padded); ``None``: the unit is one row."""
    if getattr(spec, "unit", None) is None:
        return None
    sizes, args = getattr(model, "group_sizes", {}), getattr(model, "group_args", {})
    if spec.unit not in sizes:
        raise ValueError(f"dp_noise(unit={spec.unit!r}): the model has no group_plate of that name (its group "
                         f"plates: {sorted(sizes)}); name the nf.group_plate whose groups are the protected unit")
    return spec.unit, args[spec.unit], int(sizes[spec.unit])


def unit_mask(unit: Optional[Tuple[str, str, int]]) -> Callable:
    """``data -> (units,)``: 1 on a client's real rows (or, with ``unit``, its real groups), 0 on padding."""
    if unit is None:
        return lambda data: data.row_mask

    def groups(data):
        codes = jnp.where(data.row_mask > 0, jnp.asarray(data.args[unit[1]]), -1)
        return (jnp.arange(unit[2]) <= jnp.max(codes)).astype(data.row_mask.dtype)

    return groups


def marked_row_plate(row_plate: Optional[str], tr, num_rows: int) -> Optional[str]:
    """The plate that indexes rows: ``row_plate`` when given, else the one plate of the client's
    row count that every ``dp_noise``-marked site sits in (clients of equal size are not padded,
    so the clients' layout does not find it)."""
    if row_plate is not None:
        return row_plate
    marked = [s for s in tr.values() if s["type"] == "sample" and "dp" in (s.get("infer") or {})]
    if not marked:
        return None
    plates = set.intersection(*({f.name for f in s["cond_indep_stack"] if f.size == num_rows} for s in marked))
    return next(iter(plates)) if len(plates) == 1 else None


def unit_locals(local, unit: Tuple[str, str, int]) -> np.ndarray:
    """``(groups, k)``: the entries of a client's flat locals that belong to each group of ``unit``
    (every local site is in the unit's plate: :func:`row_terms` checked it)."""
    index = local.unravel(jnp.arange(local.size, dtype=jnp.float32))
    unit_of = np.full(local.size, -1, np.int64)
    for name, axes in zip(local.names, local.group_axes or ((),) * len(local.names)):
        axis = next(a for p, a, _ in axes if p == unit[0])
        entries = np.moveaxis(np.asarray(index[name]).astype(np.int64), axis, 0)
        for g in range(entries.shape[0]):
            unit_of[np.ravel(entries[g])] = g
    counts = np.bincount(unit_of, minlength=unit[2])
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"dp_noise(unit={unit[0]!r}): the groups hold different numbers of local entries "
                         f"({sorted(set(counts.tolist()))}); every group's local latents must have the same shape")
    return np.stack([np.flatnonzero(unit_of == g) for g in range(unit[2])])


def row_locals(local, num_rows: int, padded_rows: int) -> RowLocals:
    """The row of each entry of a client's flat locals (every local site has a row axis)."""
    del num_rows
    index = local.unravel(jnp.arange(local.size, dtype=jnp.float32))
    row_of = np.zeros(local.size, np.int32)
    for name, axis in zip(local.names, local.row_axes):
        entries = np.moveaxis(np.asarray(index[name]).astype(np.int64), axis, 0)
        for i in range(entries.shape[0]):
            row_of[np.ravel(entries[i])] = i
    return RowLocals(jnp.asarray(row_of), int(padded_rows))


def _per_unit(lp, site, row_plate: str, unit: Tuple[str, str, int], data, name: str):
    """``(groups,)`` a site's log density summed within each group of ``unit``: by its rows' codes
    (a site in the row plate; padded rows left out) or along the group plate itself."""
    if any(f.name == row_plate for f in site["cond_indep_stack"]):
        rows = jnp.where(data.row_mask > 0, _per_row(lp, site, row_plate, name), 0.0)
        return jax.ops.segment_sum(rows, jnp.asarray(data.args[unit[1]]), unit[2])
    frames = [f for f in site["cond_indep_stack"] if f.name == unit[0]]
    if not frames:
        raise ValueError(_OUTSIDE_UNIT.format(name=name, plate=row_plate, unit=unit[0]))
    lp = jnp.moveaxis(jnp.broadcast_to(lp, tuple(site["fn"].batch_shape)), frames[0].dim, 0)
    return jnp.sum(jnp.reshape(lp, (lp.shape[0], -1)), axis=1)


def _per_row(lp, site, row_plate: str, name: str):
    frames = [f for f in site["cond_indep_stack"] if f.name == row_plate]
    if not frames:
        raise ValueError(_OUTSIDE.format(name=name, plate=row_plate))
    lp = jnp.moveaxis(jnp.broadcast_to(lp, tuple(site["fn"].batch_shape)), frames[0].dim, 0)
    return jnp.sum(jnp.reshape(lp, (lp.shape[0], -1)), axis=1)


def row_log_lik_fn(model: Callable, model_kwargs: Dict, layout, supports, row_plate: str,
                   local=None, unit: Optional[Tuple[str, str, int]] = None) -> Callable:
    """``(u, data) -> (rows,)``: each row's log-likelihood (every observed site's log density,
    summed over the row's entries) at the flat unconstrained global sites ``u``; padded rows 0.
    With ``local`` (the local sites' layout, every one in the row plate): ``(u, v, data) ->
    (rows,)``, each row's joint term with its local latents ``v`` (their log densities and
    Jacobians added). With ``unit`` (:func:`protected_unit`): ``(groups,)``, each group's term,
    its rows' summed by their codes and its local latents' (in that group plate) added."""
    mask_of = unit_mask(unit)

    def row_joint(u, v, data):
        values = {k: biject_to(supports[k])(x) for k, x in layout.unravel(u).items()}
        ladj = {}
        if local is not None:
            for k, x in local.unravel(v).items():
                t = biject_to(supports[k])
                values[k] = t(x)
                ladj[k] = t.log_abs_det_jacobian(x, values[k])
        tr = trace(seed(substitute(model, data=values), 0)).get_trace(**dict(data.args), **dict(model_kwargs))
        total = 0.0
        for name, site in tr.items():
            if site["type"] != "sample" or not (site["is_observed"] or name in ladj):
                continue
            lp = site["fn"].log_prob(site["value"])
            if name in ladj:  # the Jacobian, summed over the site's event dimensions
                j = ladj[name]
                lp = lp + sum_rightmost(j, jnp.ndim(j) - jnp.ndim(site["value"]) + len(site["fn"].event_shape))
            total = total + (_per_row(lp, site, row_plate, name) if unit is None else
                             _per_unit(lp, site, row_plate, unit, data, name))
        mask = mask_of(data) if data.row_mask is not None else jnp.ones_like(total)
        return jnp.where(mask > 0, total, 0.0)

    if local is not None:
        return row_joint
    return lambda u, data: row_joint(u, None, data)

"""Checks of a model as users write it, run at set-up before any round.

- :func:`check_unmarked_row_sites`: an unmarked latent site in a plate that indexes a client's
  rows is an error (a per-row variable would be shared by every client).
- :func:`check_enumerable`: a discrete local site marked for enumeration must have a bounded,
  not too large support (:data:`MAX_ENUMERATED_SUPPORT`).
- :func:`check_imputation`: ``numpyro.sample(..., obs=..., obs_mask=...)`` adds a latent site
  ``<name>_unobserved`` whose entries at the observed rows have no density (NumPyro masks them):
  an improper posterior no fit can summarise or sample. It is refused at once, naming the site and
  what to write instead.
- :func:`check_traceable`: a federated fit compiles each client's term once, with the
  client's data as arguments (traced values). A model that reads its data's *values* in
  Python (``numpyro.plate("groups", int(gid.max()) + 1)``) cannot be compiled so; instead of
  JAX's trace from deep inside a round, the user gets an error naming the plate and the fix.
- :func:`warn_client_indexed_globals`: an unmarked latent site in a plain plate whose entries
  each enter one client's likelihood only (a hospital's intercept indexed by a hospital code)
  is global by the rules, so the server would learn every client's own effect. The site is
  named with the two fixes (``local_site``, ``group_plate``). Which entries a client uses is
  read off the gradient of its log-likelihood: an entry the client's rows never touch has an
  exactly zero gradient.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, substitute, trace

from ..warnings import SiteRoleWarning, find_stack_level
from .handlers import FEDERATION_KEY
from .trace import finite_point

__all__ = [
    "MAX_ENUMERATED_SUPPORT",
    "check_enumerable",
    "check_imputation",
    "check_traceable",
    "check_unmarked_row_sites",
    "probe_row_sites",
    "enumerated_support_size",
    "warn_client_indexed_globals",
]

_UNMARKED_ROW_SITE = (
    "latent site '{name}' sits in plate '{plate}', which also holds the observed site(s) "
    "{observed} and has one entry per row of client '{client}' ({rows} rows): it is a "
    "per-row variable, and unmarked latent sites are global (shared by every client). "
    "Mark it local with nf.local_site(model, sites=['{name}']) (or mark it "
    "nf.global_site explicitly if one value really is shared by all clients)"
)
MAX_ENUMERATED_SUPPORT = 1024  # values a client sums over per enumerated site (its memory grows with it)
_UNBOUNDED_ENUM = (
    "local latent site '{name}' is marked for enumeration but {dist} has an unbounded support ({support}): "
    "summing it out would need infinitely many terms, so the result would be wrong. Marginalise it in the model "
    "(e.g. a Poisson count of a Poisson observation), truncate it (a Categorical over the values that matter), or "
    "make it continuous"
)
_HUGE_ENUM = (
    "local latent site '{name}' is marked for enumeration over {size} values ({support}), more than the "
    "{limit} a client sums over: every term of the ELBO and of the fit check would hold {size} copies of the "
    "model. Marginalise it in the model, or use a smaller support"
)


def enumerated_support_size(fn) -> Optional[int]:
    """How many values enumerating ``fn`` sums over, or ``None`` for an unbounded support.

    Read off the support's bounds, without building the values (a ``Binomial(2**20)``
    would otherwise be materialised).

    Example:
        >>> import numpyro.distributions as dist
        >>> enumerated_support_size(dist.Binomial(10, 0.5)), enumerated_support_size(dist.Poisson(3.0))
        (11, None)
    """
    if not getattr(fn, "has_enumerate_support", False):
        return None
    support = fn.support
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    if support is constraints.boolean:
        return 2
    lower, upper = getattr(support, "lower_bound", None), getattr(support, "upper_bound", None)
    if lower is None or upper is None:
        return None
    return int(np.max(np.asarray(upper)) - np.min(np.asarray(lower))) + 1


def check_enumerable(name: str, fn) -> None:
    size = enumerated_support_size(fn)
    if size is None:
        base = fn
        while hasattr(base, "base_dist"):  # name the distribution, not its Expanded/Masked wrapper
            base = base.base_dist
        raise ValueError(_UNBOUNDED_ENUM.format(name=name, dist=type(base).__name__, support=fn.support))
    if size > MAX_ENUMERATED_SUPPORT:
        raise ValueError(_HUGE_ENUM.format(name=name, size=size, support=fn.support, limit=MAX_ENUMERATED_SUPPORT))


_OBS_MASK = (
    "site '{name}' is observed with obs_mask=: NumPyro then adds the latent site '{name}_unobserved', one entry per "
    "row, whose entries at the observed rows are masked out of the density. The posterior of those entries is "
    "flat (improper): no mode to find and nothing for a sampler to converge to (NumPyro's docs say obs_mask is not "
    "meant for MCMC either). Write the missing values as a latent site with a proper prior on every row, local to "
    "its client, and use it only where the value is missing:\n"
    "    with numpyro.plate('rows', n), nf.local_site():\n"
    "        {name}_missing = numpyro.sample('{name}_missing', <the prior of {name}>)\n"
    "        numpyro.sample('{name}', <the prior of {name}>.mask(observed), obs={name}_filled)\n"
    "    {name} = jnp.where(observed, {name}_filled, {name}_missing)\n"
    "({name}_filled: the data with any value where missing). Where '{name}' is the response, the rows where it is "
    "missing tell nothing about the parameters: leave them out, and predict them with Fit.predict"
)


def check_imputation(tr) -> None:
    """Refuse a site observed with ``obs_mask=`` (NumPyro's ``<name>_observed`` and
    ``<name>_unobserved`` pair), naming it and what to write instead (:data:`_OBS_MASK`)."""
    for name, site in tr.items():
        if site["type"] != "sample" or site["is_observed"] or not name.endswith("_unobserved"):
            continue
        base = name[: -len("_unobserved")]
        twin = tr.get(f"{base}_observed")
        if twin is not None and twin["type"] == "sample" and twin["is_observed"]:
            raise ValueError(_OBS_MASK.format(name=base))


def _explicit_role(site) -> Optional[str]:
    return (site.get("infer") or {}).get(FEDERATION_KEY)


def probe_row_sites(tr, client: str, rows: int) -> Dict[str, Tuple[tuple, tuple]]:
    """One client's trace checked for unmarked per-row sites (:func:`check_unmarked_row_sites`),
    and each continuous latent site's ``(unconstrained shape, shape)``."""
    check_unmarked_row_sites(tr, client, rows)
    out = {}
    for name, site in tr.items():
        if site["type"] == "param":
            constraint = site["kwargs"].get("constraint")
            u = site["value"] if constraint is None else biject_to(constraint).inv(site["value"])
        elif site["type"] == "sample" and not site["is_observed"] and not site["fn"].support.is_discrete:
            u = biject_to(site["fn"].support).inv(site["value"])
        else:
            continue
        out[name] = (tuple(jnp.shape(u)), tuple(jnp.shape(site["value"])))
    return out


def check_unmarked_row_sites(tr, client: str, rows: int) -> None:
    """An unmarked latent site sharing a row-sized plate with observed data is an error."""
    observed_plates: Dict[str, list] = {}
    for name, site in tr.items():
        if site["type"] == "sample" and site["is_observed"]:
            for frame in site["cond_indep_stack"]:
                if frame.size == rows:
                    observed_plates.setdefault(frame.name, []).append(name)
    for name, site in tr.items():
        if site["type"] != "sample" or site["is_observed"] or _explicit_role(site) is not None:
            continue
        for frame in site["cond_indep_stack"]:
            if frame.name in observed_plates:
                raise ValueError(_UNMARKED_ROW_SITE.format(
                    name=name, plate=frame.name, observed=observed_plates[frame.name], client=client, rows=rows,
                ))


_CONCRETE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)

_DATA_SIZED = (
    "the model reads the values of its data in Python{where}, which a federated fit cannot do: each client's "
    "term is compiled once, with the client's data as arguments, so a size or a branch may depend on the data's "
    "shapes but not on its values. For a plate over groups coded in a data column (numpyro.plate('{plate}', "
    "int(codes.max()) + 1)), write `with nf.group_plate('{plate}', codes), nf.local_site():` — the library sizes "
    "it for each client and the group effects stay on their client. A number that is the same for every client "
    "goes in as a non-data keyword (model_kwargs=). (JAX: {error})"
)
_CLIENT_INDEXED = (
    "site '{name}' in plate '{plate}' is global (latent sites are global unless marked), but each of its {size} "
    "entries enters the likelihood of one client only ({example}): it looks like a per-client effect, such as a "
    "hospital's intercept indexed by a hospital code, and as a global site the server learns every client's own "
    "value. If each client's entries are its own, mark the site local (`with nf.local_site(): ...`), or sum over "
    "a client's own groups with `nf.group_plate('{plate}', codes)` and `nf.local_site()`. If the values really are "
    "shared, mark the site nf.global_site to say so (and silence this)"
)


def _data_plates(tr, args: Mapping, group_plates: Mapping) -> List[str]:
    """Plates whose size is ``max + 1`` of an integer data argument (sized from data values)."""
    counts = set()
    for value in args.values():
        a = np.asarray(value) if not isinstance(value, jax.core.Tracer) else None
        if a is not None and a.size and np.issubdtype(a.dtype, np.integer):
            counts.add(int(a.max()) + 1)
    found = []
    for site in tr.values():
        for frame in site.get("cond_indep_stack", ()):
            if frame.name not in group_plates and frame.size in counts and frame.name not in found:
                found.append(frame.name)
    return found


def check_traceable(model, args: Mapping, kwargs: Mapping, tr, group_plates: Mapping) -> None:
    """Trace ``model`` with ``args`` abstract (as a round compiles it); raise a ``ValueError``
    naming the data-sized plate (read off the concrete trace ``tr``) when it reads data values."""

    def probe(a):
        trace(substitute(seed(model, 0), substitute_fn=finite_point)).get_trace(**a, **dict(kwargs))
        return jnp.zeros(())

    try:
        jax.eval_shape(probe, {k: jnp.asarray(v) for k, v in args.items()})
    except _CONCRETE_ERRORS as err:
        plates = _data_plates(tr, args, group_plates)
        where = f" (plate '{plates[0]}' is sized from it)" if plates else ""
        first_line = str(err).strip().splitlines()[0]
        raise ValueError(_DATA_SIZED.format(where=where, plate=plates[0] if plates else "groups",
                                            error=first_line)) from None
    except Exception:  # anything else shows in the round itself, with its own message
        return


def _candidates(tr, rows: int, group_plates: Mapping) -> Dict[str, Tuple[str, int, int]]:
    """Unmarked global latent sites in a plain plate of more than one entry that is not a row
    plate: ``{site: (plate, axis of the value, size)}``."""
    out = {}
    for name, site in tr.items():
        if site["type"] != "sample" or site["is_observed"] or (site.get("infer") or {}).get(FEDERATION_KEY):
            continue
        if site["fn"].support.is_discrete:
            continue
        event_ndim = len(site["fn"].event_shape)
        for frame in site["cond_indep_stack"]:
            if frame.size > 1 and frame.size != rows and frame.name not in group_plates:
                out[name] = (frame.name, frame.dim - event_ndim, frame.size)
                break
    return out


def _used_entries(model, args, kwargs, values: Mapping, cands: Mapping) -> Dict[str, np.ndarray]:
    """Per candidate site, which plate entries the client's observed sites depend on."""

    def loglik(sub):
        conditioned = substitute(substitute(seed(model, 0), substitute_fn=finite_point), data={**values, **sub})
        model_tr = trace(conditioned).get_trace(**dict(args), **dict(kwargs))
        total = jnp.zeros(())
        for site in model_tr.values():
            if site["type"] == "sample" and site["is_observed"]:
                total = total + jnp.sum(site["fn"].log_prob(site["value"]))
        return total

    grads = jax.grad(loglik)({n: jnp.asarray(values[n]) for n in cands})
    used = {}
    for name, (_plate, axis, size) in cands.items():
        g = np.abs(np.asarray(grads[name]))
        g = np.moveaxis(g, axis, 0).reshape(size, -1)
        used[name] = np.any(g > 0, axis=1) & np.all(np.isfinite(g), axis=1)
    return used


def warn_client_indexed_globals(model, clients, kwargs: Mapping, tr, group_plates: Mapping,
                                names: Sequence[str]) -> None:
    """Warn (``SiteRoleWarning``) for each unmarked global site whose plate entries are split
    among the clients, each entry used by one client's rows only (see the module's docstring)."""
    if len(names) < 2:
        return
    rows = clients.num_rows[names[0]]
    cands = _candidates(tr, rows, group_plates)
    cands = {n: c for n, c in cands.items() if all(c[2] != clients.num_rows[j] for j in names)}
    if not cands:
        return
    values = {n: tr[n]["value"] for n in cands}
    per_client = {}
    try:
        for client in names:
            per_client[client] = _used_entries(model, clients[client], kwargs, values, cands)
    except Exception:  # a model this check cannot differentiate is left to the fit's own checks
        return
    for name, (plate, _axis, size) in cands.items():
        used = np.stack([per_client[c][name] for c in names])  # (clients, entries)
        if used.sum(axis=0).max() > 1 or used.all(axis=1).any() or (used.any(axis=1).sum() < 2):
            continue  # an entry shared by two clients, or a client using every entry: not per-client
        example = "; ".join(f"client '{c}': {np.flatnonzero(u).tolist()}" for c, u in zip(names, used) if u.any())
        if len(example) > 160:
            example = example[:157] + "..."
        warnings.warn(_CLIENT_INDEXED.format(name=name, plate=plate, size=size, example=example),
                      SiteRoleWarning, stacklevel=find_stack_level())

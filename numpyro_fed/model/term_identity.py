"""Every client's term against NumPyro's own density of the model on that client's rows.

A federated fit adds up one term per client. The simulation lays clients out side by side
(padding unequal clients to the largest, with a row mask), and a term the model computes
outside its row plate (a ``numpyro.factor`` summing over a client's rows, ``len(y)`` or a
column's mean in a term) is not masked: it would see the padded rows. Nothing downstream can
notice, because every check evaluates the same term the fit used. So at set-up, before any
round, each client's term as laid out is compared with NumPyro's own potential energy
(:func:`numpyro.infer.util.potential_energy`) of the model on the client's unpadded rows, at
a few points of the latent sites, value and gradient:

.. math::

    \\log p(z_G) + \\log p(z_{L_j}, y_j \\mid z_G)\\big|_{\\text{laid out, masked}}
    = -U_{\\text{NumPyro}}(z_G, z_{L_j}; \\text{rows of client } j),

with the Jacobians of the unconstrained values on both sides, and the gradient on every padded
local entry zero. :func:`~numpyro_fed.run.backends.mapping.plan_clients` runs it on every plan it
makes, so it holds for every family whose clients hold rows (SFVI and SFVI-Avg, PVI, EP, BCM,
the Laplace fit, federated NUTS/HMC and Metropolis-within-Gibbs, ``nf.fit``); under
``client_mapping="auto"`` a padded layout that fails it is replaced by the clients laid out one
by one on their own rows, which is then checked again.

Clients checked: one per distinct layout (its row count and, with ``nf.group_plate``, its own
group counts: what padding depends on), the smallest and the largest first, up to
:data:`MAX_CHECKED` layouts; clients of one layout share one compiled check. A term that is not
a sum over rows (a column's mean, ``len(y)``) is a different question, answered per client by
:func:`split_rows_mismatch`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import substitute
from numpyro.infer.util import potential_energy

from ..clients import ClientData, Clients
from .groups import held_elsewhere, sized_model
from .structure import ModelStructure, SiteLayout, constrain_params, log_joint
from .trace import compiled_prior_mean, nonfinite_sites, read_abstractly, trace_model

__all__ = ["MAX_CHECKED", "POINTS", "TermMismatch", "checked_clients", "client_term_mismatch", "describe_mismatch",
           "overflow_message", "split_rows_mismatch"]

MAX_CHECKED = 16  # client layouts compared with NumPyro at set-up (see the module's docstring)
POINTS = 2  # points of the latent sites per client
RTOL, ATOL = 2e-4, 2e-3  # float32 sums over rows in another order, relative to the term's size
# run once at set-up: compiled quickly rather than optimised (JAX's jax_disable_most_optimizations)
_QUICK = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

_MISMATCH = (
    "client '{client}': its term as the federation evaluates it ({what}) differs from NumPyro's own log density of "
    "the model on the client's {rows} rows ({fed} against {ref}){sites}. {why}"
)
_PADDED_WHY = (
    "The client's {what} to lay unequal clients side by side, and a term outside the plate that masks the "
    "padding reads the padded entries. Put per-row terms inside the row plate (a factor per row: numpyro.factor "
    "inside numpyro.plate('{plate}', ...)) and per-group terms inside their nf.group_plate{loop}"
)
_OWN_WHY = (
    "The client's data were not padded, so the federated term itself is wrong for this model; please report it "
    "with the model"
)


class TermMismatch(NamedTuple):
    """A client whose federated term differs from NumPyro's density on its rows."""

    client: str
    what: str  # "value", "gradient of 'site'", or "gradient on padded entries of 'site'"
    federated: float
    numpyro: float
    sites: Tuple[str, ...]  # the sites whose own terms differ (empty when they could not be told apart)
    padded: bool  # whether the client's rows were padded in the layout checked
    num_rows: int
    padded_rows: int


def checked_clients(num_rows: Sequence[int], group_counts: Optional[Sequence[tuple]] = None) -> List[int]:
    """Indices of the clients compared at set-up: one per distinct layout (row count and, for
    ``nf.group_plate`` models, the client's own group counts), what padding depends on; the
    smallest and the largest first, at most :data:`MAX_CHECKED`."""
    first: Dict[tuple, int] = {}
    for j, n in enumerate(num_rows):
        first.setdefault((int(n),) + tuple(group_counts[j] if group_counts else ()), j)
    keys = sorted(first)
    order = [k for pair in zip(keys, reversed(keys)) for k in pair]  # smallest, largest, next ...
    picked: List[int] = []
    for k in order:
        if first[k] not in picked:
            picked.append(first[k])
        if len(picked) == MAX_CHECKED:
            break
    return sorted(picked)


def _real_index(padded: SiteLayout, real: SiteLayout) -> np.ndarray:
    """Flat positions in ``padded``'s layout of the real entries, in ``real``'s order (padding
    is always at the end of an axis: rows past the client's count, groups past its own)."""
    at = padded.unravel(jnp.arange(padded.size, dtype=jnp.float32))
    parts = []
    for name, shape in zip(real.names, real.shapes):
        full = at[name]
        if len(shape) != jnp.ndim(full) or any(k > m for k, m in zip(shape, jnp.shape(full))):
            raise ValueError(f"local site '{name}' has shape {shape} on the client's own rows but "
                             f"{tuple(jnp.shape(full))} as laid out; the layout cannot hold it")
        parts.append(np.asarray(full[tuple(slice(0, k) for k in shape)]).reshape(-1))
    return np.concatenate(parts).astype(int) if parts else np.zeros(0, int)


def _enumerated(model, nesting: int):
    from numpyro.contrib.funsor import enum

    return enum(model, first_available_dim=-nesting - 1)


def _nesting(tr) -> int:
    return max([-f.dim for site in tr.values() if site["type"] == "sample" for f in site["cond_indep_stack"]
                if f.dim is not None] + [0])


class _Terms(NamedTuple):
    values: Any  # jit-compiled (u[P, d], v_pad[P, m], laid args, row mask, rows) -> values and gradients
    per_site: Any  # site -> ((u, v_padded) -> federated site term, (u, v_real) -> real site term)
    d: int
    padded: SiteLayout
    index: np.ndarray
    glob: SiteLayout
    real: SiteLayout


def _terms(model, kwargs: Mapping, structure: ModelStructure, laid: ClientData, rows: Mapping, cache: dict) -> _Terms:
    base = getattr(model, "__wrapped_model__", model)
    glob = structure.global_latent
    tr_real = trace_model(base, rows, kwargs)  # concrete: its local params' initial values
    padded, real = read_abstractly(model, laid.args, kwargs, structure.local_layout), structure.local_layout(tr_real)
    params = {
        **constrain_params({n: u for n, (u, _) in structure.global_param.items()},
                           {n: c for n, (_, c) in structure.global_param.items()}),
        **constrain_params(structure.local_param_init(tr_real), structure.local_param_constraints(tr_real)),
    }
    d, index = glob.size, _real_index(padded, real)

    def latent(u, v, layout):
        return {**glob.unravel(u), **layout.unravel(v)}

    def federated(u, v, args, mask, count=lambda s: s["type"] == "sample"):
        return log_joint(model, args, kwargs, latent(u, v, padded), params, count, structure.row_plate, mask)

    # the model as plain NumPyro runs it on these rows alone (group plates of the client's own size)
    own = sized_model(base, Clients({"client": rows}), kwargs)
    reference_model = substitute(own, data=params)
    if structure.enumerated:
        reference_model = _enumerated(reference_model, _nesting(tr_real))

    def reference(u, v, real_rows):
        return -potential_energy(reference_model, (), {**dict(real_rows), **dict(kwargs)}, latent(u, v, real),
                                 enum=bool(structure.enumerated))

    param_key = tuple(sorted((n, np.asarray(v).tobytes()) for n, v in params.items()))
    fed_key = ("federated", _shapes(laid.args), padded.names, padded.shapes, param_key)
    ref_key = ("reference", _shapes(rows), real.names, real.shapes,
               tuple(sorted(getattr(own, "group_sizes", {}).items())), param_key)
    if fed_key not in cache:  # the laid-out term: one compile for every client of this layout
        cache[fed_key] = jax.jit(jax.vmap(jax.value_and_grad(federated, argnums=(0, 1)), (0, 0, None, None)),
                                 compiler_options=_QUICK)
    if ref_key not in cache:  # NumPyro's on the real rows: one per row count, whatever the layout checked
        cache[ref_key] = jax.jit(jax.vmap(jax.value_and_grad(reference, argnums=(0, 1)), (0, 0, None)),
                                 compiler_options=_QUICK)
    fed_fn, ref_fn = cache[fed_key], cache[ref_key]

    def values(u, v_pad, args, mask, real_rows):
        fv, (fu, fv_grad) = fed_fn(u, v_pad, args, mask)
        rv, (ru, rv_grad) = ref_fn(u, v_pad[:, index], real_rows)
        return fv, fu, fv_grad, rv, ru, rv_grad

    def per_site(name):
        def own(site):
            return site["type"] == "sample" and site["name"] == name

        return (lambda u, v: federated(u, v, laid.args, laid.row_mask, own),
                lambda u, v: log_joint(base, rows, kwargs, latent(u, v, real), params, own))

    return _Terms(values, per_site, d, padded, index, glob, real)


def _shapes(args: Mapping) -> tuple:
    return tuple(sorted((k, np.shape(v), str(np.asarray(v).dtype)) for k, v in dict(args).items()))


def _close(a, b, scale) -> bool:
    return bool(np.all(np.abs(np.asarray(a) - np.asarray(b)) <= ATOL * (1.0 + scale) + RTOL * np.abs(np.asarray(b))))


def _differing_sites(terms: _Terms, tr_sites: Sequence[str], u, v_pad, v_real) -> Tuple[str, ...]:
    """The sample sites whose own federated term (value) differs from the same term on the real rows."""
    out = []
    for name in tr_sites:
        fed, ref = terms.per_site(name)
        try:
            a, b = float(fed(u, v_pad)), float(ref(u, v_real))
        except ValueError:  # e.g. an enumerated model's sites cannot be counted one at a time
            return ()
        if not _close(a, b, abs(b)):
            out.append(name)
    return tuple(out)


def _candidates(model, kwargs, laid: ClientData, terms: _Terms, rng_key) -> Tuple[jax.Array, jax.Array]:
    """Points of the latent sites to compare at, in order of preference: :data:`POINTS` drawn uniformly
    in (-1, 1) of unconstrained space (as NumPyro's ``init_to_uniform``), then draws closer in to the
    prior's mean (within 0.1, then 0.01; the local entries as close to 0), then the prior's mean itself
    (local entries 0): a model whose density overflows far out (a covariate in the thousands) is
    compared where it is defined."""
    start = jnp.asarray(compiled_prior_mean(model, laid.args, kwargs, terms.glob), jnp.float32)
    keys = jax.random.split(rng_key, 4)
    far = [jax.random.uniform(k, (POINTS, n), minval=-1.0, maxval=1.0) for k, n in zip(keys[:2], (terms.d,
                                                                                                    terms.padded.size))]
    near = [jax.random.uniform(k, (2, n), minval=-1.0, maxval=1.0) * jnp.asarray([[0.1], [0.01]])
            for k, n in zip(keys[2:], (terms.d, terms.padded.size))]
    us = jnp.concatenate([far[0], start + near[0], start[None]])
    vs = jnp.concatenate([far[1], near[1], jnp.zeros((1, terms.padded.size))])
    return us, vs


def client_term_mismatch(model, kwargs: Mapping, structure: ModelStructure, laid: ClientData, rows: Mapping,
                         client: str, rng_key, points: int = POINTS, cache: Optional[dict] = None
                         ) -> Optional[TermMismatch]:
    """Compare one client's laid-out term with NumPyro's on its own ``rows`` (value and gradient),
    at the first ``points`` of the candidate points (:func:`_candidates`) where NumPyro's own density
    and its gradient are finite; ``None`` when they agree there. Jit-compiled once per shape of the
    client's data (``cache``: shared by clients of the same shapes).

    Raises:
        ValueError: NumPyro's own density of the model on the client's rows is not finite at any
            candidate point, naming the sites whose terms are not finite and the values that
            overflowed (the model, not the federation, has no density there).
    """
    terms = _terms(model, kwargs, structure, laid, rows, {} if cache is None else cache)
    num_rows = int(next(iter(dict(rows).values())).shape[0])
    padded_rows = int(laid.row_mask.shape[0])
    padded = padded_rows > num_rows or terms.padded.size > terms.index.size
    pad_entries = np.setdiff1d(np.arange(terms.padded.size), terms.index)
    us, vs = _candidates(model, kwargs, laid, terms, rng_key)
    real_rows = {k: jnp.asarray(v) for k, v in dict(rows).items()}
    out = [np.asarray(x) for x in terms.values(us, vs, laid.args, laid.row_mask, real_rows)]
    defined = [p for p in range(us.shape[0]) if np.isfinite(out[3][p]) and np.all(np.isfinite(out[4][p]))
               and np.all(np.isfinite(out[5][p]))]
    if not defined:
        if client in held_elsewhere():  # placeholders of a client another party holds: nothing seen to accuse
            return None
        raise ValueError(overflow_message(model, kwargs, structure, terms, rows, client, us[-1], vs[-1]))
    for p in defined[:points]:
        fv, fu, fvv, rv, ru, rvv = (float(out[0][p]), out[1][p], out[2][p], float(out[3][p]), out[4][p], out[5][p])
        u, v_pad = us[p], vs[p]
        scale = abs(rv)

        def found(what, a, b):
            names = _differing_sites(
                terms, [n for n, s in trace_model(model, laid.args, kwargs).items() if s["type"] == "sample"],
                u, v_pad, v_pad[terms.index])
            return TermMismatch(client, what, float(a), float(b), names, padded, num_rows, padded_rows)

        if not np.isfinite(fv) or not _close(fv, rv, scale):
            return found("value", fv, rv)
        gscale = float(np.max(np.abs(np.concatenate([ru.reshape(-1), rvv.reshape(-1), np.zeros(1)]))))
        if not _close(fu, ru, gscale):
            j = int(np.argmax(np.where(np.isfinite(fu), np.abs(fu - ru), np.inf)))
            return found(f"gradient in global site '{_entry_site(structure.global_latent, j)}'", fu[j], ru[j])
        fr = fvv[terms.index]
        if not _close(fr, rvv, gscale):
            j = int(np.argmax(np.where(np.isfinite(fr), np.abs(fr - rvv), np.inf)))
            return found(f"gradient in local site '{_entry_site(terms.padded, int(terms.index[j]))}'", fr[j], rvv[j])
        if pad_entries.size and not _close(fvv[pad_entries], 0.0, gscale):
            j = int(pad_entries[np.argmax(np.abs(fvv[pad_entries]))])
            return found(f"gradient on a padded entry of local site '{_entry_site(terms.padded, j)}'", fvv[j], 0.0)
    return None


_OVERFLOW = (
    "client '{client}': NumPyro's own log density of the model on the client's {rows} rows is not finite ({what}) at "
    "any point tried ({tried}): {sites}. The model has no density there, before any federation. Where a "
    "parameter overflows, scale the covariates that enter it (centre each and divide by its sd: a covariate in the "
    "hundreds or thousands makes exp(x @ beta) overflow) or give their coefficients tighter priors; where it is "
    "nan or outside its support, the model computes it outside its domain (the log of a site that can be 0 or "
    "negative: give that site a positive prior, e.g. HalfNormal)"
)
_TRIED = ("drawn uniformly in (-1, 1) of the unconstrained space, then closer in to the prior's mean, and the "
          "prior's mean")


def overflow_message(model, kwargs: Mapping, structure: ModelStructure, terms: _Terms, rows: Mapping, client: str,
                     u, v_pad) -> str:
    """The refusal of a model whose density is not finite on ``client``'s rows anywhere tried: the
    sites whose own term (or its gradient) is not finite at ``(u, v_pad)`` (the prior's mean) and the
    parameters of their distributions that overflowed there (:func:`~numpyro_fed.model.trace.nonfinite_sites`)."""
    base = getattr(model, "__wrapped_model__", model)
    latent = {**terms.glob.unravel(u), **terms.real.unravel(v_pad[terms.index])}
    kinds, parts = nonfinite_sites(base, rows, kwargs, latent)
    return _OVERFLOW.format(client=client, rows=int(next(iter(dict(rows).values())).shape[0]),
                            what=" and ".join(kinds) or "value or gradient", tried=_TRIED,
                            sites="; ".join(parts) or "no single site's term could be told")


def _entry_site(layout: SiteLayout, flat: int) -> str:
    at = 0
    for name, shape in zip(layout.names, layout.shapes):
        at += int(np.prod(shape))
        if flat < at:
            return name
    return "?"


def describe_mismatch(m: TermMismatch, row_plate: Optional[str]) -> str:
    """The error's text for a mismatch: the client, what differs, the sites, why and the fix."""
    sites = f"; the differing term{'s' if len(m.sites) > 1 else ''}: {', '.join(repr(s) for s in m.sites)}" \
        if m.sites else ""
    if m.padded_rows > m.num_rows:
        what = f"{m.num_rows} rows were padded to {m.padded_rows}"
        loop = ", or pass client_mapping='loop' (each client evaluated on its own rows)"
    else:
        what = "groups were padded (nf.group_plate entries past its own)"
        loop = ""
    why = _PADDED_WHY.format(what=what, plate=row_plate or "rows", loop=loop) if m.padded else _OWN_WHY
    return _MISMATCH.format(client=m.client, what=m.what, rows=m.num_rows, fed=f"{m.federated:.6g}",
                            ref=f"{m.numpyro:.6g}", sites=sites, why=why)


_DATA_FREE = (
    "client '{client}': the model's term{s} {sites} {does} not depend on the client's rows: a term outside every "
    "plate, which every client adds once. Of the global sites alone, a federated fit would count it once per "
    "client, not once; of the client's own effects (a sum-to-zero constraint over its group effects), it is the "
    "client's, not the pooled model's. Express such a constraint through the prior (a parameterisation, e.g. "
    "effects that sum to zero as concatenate([a, -a.sum()])), or make it a sample site with its own prior"
)
_NOT_A_SUM = (
    "client '{client}': the model's term{s} {sites} {is_} not a sum over the client's rows: at the same values of the "
    "latent sites it adds up to {halves:.6g} on two halves of the client's {rows} rows (every other row) and to "
    "{whole:.6g} on all of them. A federated fit adds each client's term, so the model it fits is not the model of "
    "the pooled rows: a statistic of the client's own rows (its mean or sd of a column, len(y) beyond a per-row "
    "count) or a term linking rows (a series) would be the client's, not the pooled data's. Compute such a "
    "statistic over the pooled data once and pass it as model_kwargs=, or write the term per row inside the row "
    "plate"
)


def _observed(site) -> bool:
    return site["type"] == "sample" and site["is_observed"]


def split_rows_mismatch(model, kwargs: Mapping, structure: ModelStructure, rows: Mapping, client: str,
                        rng_key) -> Optional[str]:
    """The error text when ``client``'s observed terms (likelihoods and factors) are not a sum
    over its rows, else ``None``: its term on two halves of its rows (every other row), summed,
    against its term on all of them, at one point of the latent sites (globals drawn uniformly in
    (-1, 1) of unconstrained space; local sites with one entry per row cut with the rows, the
    others kept), in double precision. Each client can run it alone, on its own rows. Skipped
    (``None``) for a client of fewer than 4 rows, where a local site's shape on half the rows is
    not its shape on all of them cut along the rows, or where the model cannot run in double
    precision."""
    rows = {k: np.asarray(v) for k, v in dict(rows).items()}
    n = int(next(iter(rows.values())).shape[0])
    if n < 4:
        return None
    base = getattr(model, "__wrapped_model__", model)
    own = sized_model(base, Clients({client: rows}), kwargs)  # halves keep the client's groups
    halves = [{k: v[i::2] for k, v in rows.items()} for i in (0, 1)]
    local_names = structure.local_latent_names

    def read(tr):  # the observed sites, and each local latent's unconstrained shape
        return ([m for m, site in tr.items() if _observed(site)],
                {m: tuple(jnp.shape(_unconstrained_value(tr[m]))) for m in local_names})

    traces = [read_abstractly(own, a, kwargs, read) for a in [rows] + halves]
    glob = structure.global_latent
    ku, kv = jax.random.split(rng_key)
    u = glob.unravel(jax.random.uniform(ku, (glob.size,), minval=-1.0, maxval=1.0))
    full_local = {}
    for j, name in enumerate(local_names):
        shape = traces[0][1][name]
        full_local[name] = jax.random.uniform(jax.random.fold_in(kv, j), shape, minval=-1.0, maxval=1.0)
    latents = [{**u, **full_local}]
    for i, (_, shapes) in enumerate(traces[1:]):
        cut = {}
        for name, value in full_local.items():
            want = shapes[name]
            axes = [a for a, (w, f) in enumerate(zip(want, value.shape)) if w != f]
            if len(want) != value.ndim or any(value.shape[a] != n for a in axes):
                return None  # a local site not cut along the rows: its halves cannot be told
            cut[name] = value
            for a in axes:
                cut[name] = jnp.take(cut[name], jnp.arange(i, n, 2), axis=a)
        latents.append({**u, **cut})
    params = constrain_params({m: v for m, (v, _) in structure.global_param.items()},
                              {m: c for m, (_, c) in structure.global_param.items()})
    sites = traces[0][0]
    summed_out = set(structure.enumerated)  # discrete local sites summed out with the rows they explain

    def terms(args, latent):  # each observed site's term (with the sites summed out with it)
        def one(name):
            def count(s):
                return (_observed(s) and s["name"] == name) or s["name"] in summed_out
            return log_joint(own, args, kwargs, latent, params, count)
        return jnp.stack([one(m) for m in sites])

    try:
        with jax.enable_x64(True):  # in double precision: a sum over rows in another order is exact to 1e-12
            wide = jax.jit(terms, compiler_options=_QUICK)
            # placed on the device here, in double precision: JAX's dispatch of a NumPy argument would read
            # its precision setting apart from this context and hand an int32 buffer to the int64 program
            as64 = [{k: jnp.asarray(v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in a.items()}
                    for a in [rows] + halves]
            lat64 = [jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), lat) for lat in latents]
            whole, first, second = (np.asarray(wide(a, lat), np.float64) for a, lat in zip(as64, lat64))
    except (TypeError, ValueError):  # the model cannot run in double precision: not judged here
        return None
    split = first + second
    off = ~(np.abs(split - whole) <= 1e-7 * (1.0 + np.abs(whole)))
    if not (np.all(np.isfinite(whole)) and np.all(np.isfinite(split))) or not off.any():
        return None
    bad = [m for m, o in zip(sites, off) if o]
    free = [m for m, o, a, b, w in zip(sites, off, first, second, whole) if o and abs(a - w) <= 1e-7 * (1 + abs(w))
            and abs(b - w) <= 1e-7 * (1 + abs(w))]
    if free:
        return _DATA_FREE.format(client=client, s="s" if len(free) > 1 else "", sites=", ".join(repr(m) for m in free),
                                 does="do" if len(free) > 1 else "does")
    return _NOT_A_SUM.format(client=client, s="s" if len(bad) > 1 else "", sites=", ".join(repr(m) for m in bad),
                             is_="are" if len(bad) > 1 else "is", halves=float(split.sum()),
                             whole=float(whole.sum()), rows=n)


def _unconstrained_value(site):
    """A latent site's unconstrained value (its shape is the layout's)."""
    from numpyro.distributions.transforms import biject_to

    return biject_to(site["fn"].support).inv(site["value"])

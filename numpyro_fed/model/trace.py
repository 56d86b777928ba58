"""The model's evaluations at set-up: at a finite point of each latent site, never a prior draw.

Set-up traces the user's model to read its structure (sites, shapes, plates, roles). Doing
that at a draw from the prior fails on valid models: a draw from a wide prior such as
``LogNormal(0, 100)`` or ``InverseGamma(0.001, 0.001)`` can be infinite, and a likelihood built
on it is then refused by NumPyro's validation ("invalid scale parameter"). So every continuous
latent site is set, as NumPyro's ``init_to_uniform`` does, to a point drawn uniformly in
(-1, 1) of its unconstrained space; when the model still cannot be evaluated there, a few
other points are tried (as NumPyro's initialisation retries), and then the error names the
site. A ``numpyro.param`` whose initial value is not finite, or outside its constraint, is
refused at once, naming it.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Callable, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_median
from numpyro.primitives import Messenger

from .._validation import check_init

__all__ = ["INIT_TRIES", "compiled_prior_mean", "content_digest", "data_digest", "finite_point", "invalid_parameters",
           "is_factor", "nonfinite_sites",
           "observed_draws", "or_finite_point", "prior_median", "program_digest", "read_abstractly", "start_point",
           "trace_model", "unconstrained_shape", "unwrapped", "update_digest"]

INIT_TRIES = 10  # points tried before set-up gives up (NumPyro's initialisation tries 100)
_INVALID = "distribution got invalid"  # NumPyro's validation message for a parameter out of its domain


def finite_point(msg):
    """A continuous latent site's value drawn uniformly in (-1, 1) in unconstrained space, as
    NumPyro's ``init_to_uniform`` does (``None`` for other sites: they keep their draw)."""
    if (msg["type"] != "sample" or msg["is_observed"] or msg["value"] is not None
            or msg["fn"].support.is_discrete or msg["kwargs"].get("rng_key") is None):
        return None  # (a value set by an inner handler, e.g. improper_values, is kept)
    transform, shape = unconstrained_shape(msg)
    return transform(jax.random.uniform(msg["kwargs"]["rng_key"], shape, minval=-1.0, maxval=1.0))


def or_finite_point(substitute_fn: Optional[Callable]) -> Callable:
    """``substitute_fn``, and :func:`finite_point` for the continuous latent sites it leaves
    alone (so no site of the model is drawn from its prior)."""

    def fn(msg):
        value = None if substitute_fn is None else substitute_fn(msg)
        return finite_point(msg) if value is None else value

    return fn


def unconstrained_shape(msg):
    """``(biject_to(support), the unconstrained shape)`` of a sample site's value."""
    fn = msg["fn"]
    shape = tuple(msg["kwargs"].get("sample_shape", ())) + tuple(fn.batch_shape) + tuple(fn.event_shape)
    transform = biject_to(fn.support)
    return transform, transform.inverse_shape(shape)


class InvalidInitialValue(ValueError):
    """A ``numpyro.param`` of the model starts at a value that is not finite or not allowed."""


class _Checked(Messenger):
    """Remember the last site the model reached; refuse a param whose initial value is not
    finite or outside its constraint (concrete values only: under ``jit`` nothing is checked)."""

    def __init__(self, fn):
        self.last: Optional[str] = None
        super().__init__(fn)

    def postprocess_message(self, msg):
        if msg["type"] not in ("sample", "param"):
            return
        self.last = msg["name"]
        value = msg["value"]
        if msg["type"] != "param" or isinstance(value, jax.core.Tracer):
            return
        if not np.all(np.isfinite(np.asarray(value))):
            raise InvalidInitialValue(
                f"param site {msg['name']!r} starts at a value that is not finite ({_shown(value)}): give "
                f"numpyro.param({msg['name']!r}, ...) a finite initial value")
        constraint = msg["kwargs"].get("constraint")
        if constraint is None:
            return
        with jax.ensure_compile_time_eval():  # a concrete check even while a caller traces (jit)
            inside = np.all(np.asarray(constraint(jnp.asarray(value))))
        if not inside:
            raise InvalidInitialValue(
                f"param site {msg['name']!r} starts at {_shown(value)}, outside its constraint {constraint}: "
                f"give numpyro.param({msg['name']!r}, ...) an initial value inside it")


def _shown(value) -> str:
    flat = np.asarray(value).reshape(-1)
    return np.array2string(flat[:5], precision=4) + (" ..." if flat.size > 5 else "")


def _split_args(args: Mapping):
    args = dict(args)
    arrays = {k: v for k, v in args.items() if isinstance(v, (np.ndarray, jax.Array))}
    return arrays, {k: v for k, v in args.items() if k not in arrays}


def compiled_prior_mean(model: Callable, args, kwargs, layout) -> jax.Array:
    """:func:`prior_median` (``exact``) as one compiled program (run op by op, a prior compiles
    one program per operation and shape); op by op where the model reads a concrete value."""
    arrays, fixed = _split_args(args)
    try:
        return jax.jit(lambda a: prior_median(model, {**fixed, **a}, kwargs, layout, exact=True))(arrays)
    except Exception:  # noqa: BLE001  a concrete read, or an error: raised op by op, with no traced value in it
        return prior_median(model, args, kwargs, layout, exact=True)


def read_abstractly(model, args: Mapping, kwargs: Mapping, read: Callable):
    """``read(trace)`` of the model's trace as :func:`trace_model` takes it, the model run on
    abstract arguments (their shapes and dtypes, as ``jax.eval_shape`` runs a function: no
    program is compiled, where an eager run compiles one per operation and shape), or on the
    arguments themselves where the model or ``read`` needs a concrete value. ``read`` returns
    what it reads of the sites (names, shapes, roles), never their values."""
    arrays, fixed = _split_args(args)
    box = []

    def run(values):
        box.append(read(trace_model(model, {**fixed, **values}, kwargs)))

    try:
        jax.eval_shape(run, arrays)
    except Exception:  # noqa: BLE001  a value read as a concrete one, or an error: run on the arguments themselves
        box.clear()  # (an error is raised there, as an eager run raises it, with no abstract value in its frames)
        return read(trace_model(model, {**fixed, **arrays}, kwargs))
    return box[0]


def trace_model(model, args: Mapping, kwargs: Mapping, rng_seed: int = 0):
    """Trace ``model(**args, **kwargs)`` for its structure: continuous latent sites at a
    point drawn uniformly in (-1, 1) of unconstrained space, not from their prior (a draw
    from a heavy prior such as ``InverseGamma(0.001, 0.001)`` can be infinite and make the
    likelihood invalid); discrete sites drawn from their prior with a fixed seed.

    Raises:
        ValueError: naming the param site whose initial value is not finite or outside its
            constraint, or, when a distribution of the model refuses its parameters at
            :data:`INIT_TRIES` such points, the last site the model reached before it.
    """
    error, site = None, None
    for attempt in range(INIT_TRIES):
        checked = _Checked(substitute(seed(model, rng_seed + attempt), substitute_fn=finite_point))
        try:
            return trace(checked).get_trace(**dict(args), **dict(kwargs))
        except InvalidInitialValue:
            raise
        except ValueError as err:
            if _INVALID not in str(err):
                raise
            error, site = err, checked.last
    where = "before its first site" if site is None else f"just after site {site!r}"
    found = invalid_parameters(model, args, kwargs, rng_seed)
    where = found or where
    raise ValueError(
        f"set-up could not evaluate the model: at {INIT_TRIES} points (each latent site drawn uniformly in (-1, 1) "
        f"of its unconstrained space, as NumPyro's init_to_uniform) a distribution refused its parameters "
        f"{where}: {error} Check the parameters computed {'for' if found else 'after'} that site (a param's value, "
        f"a transformation of a latent site, or the data)") from error


def invalid_parameters(model, args: Mapping, kwargs: Mapping, rng_seed: int = 0) -> Optional[str]:
    """Where the model's first distribution with a parameter outside its constraint is, at the
    point :func:`trace_model` tries first (run with NumPyro's validation off, so that the model
    runs through): ``"at site 'z' (Normal: its loc is nan)"``, or ``None`` when none is found."""
    try:
        with numpyro.validation_enabled(False):
            tr = trace(substitute(seed(model, rng_seed), substitute_fn=finite_point)).get_trace(
                **dict(args), **dict(kwargs))
    except Exception:  # noqa: BLE001  (a model that fails otherwise: the caller's message stands)
        return None
    for name, site in tr.items():
        if site["type"] != "sample":
            continue
        fn = site["fn"]
        while hasattr(fn, "base_dist"):
            fn = fn.base_dist
        for param, constraint in getattr(fn, "arg_constraints", {}).items():
            value = getattr(fn, param, None)
            if value is None or not (hasattr(value, "shape") or isinstance(value, (int, float))):
                continue
            try:
                ok = bool(np.all(np.asarray(constraint(jnp.asarray(value)))))
            except Exception:  # noqa: BLE001  (a constraint that cannot be evaluated so)
                continue
            if not ok:
                return f"at site {name!r} ({type(fn).__name__}: its {param} is {_shown(value)}, outside {constraint})"
    return None


def _mean_or_median(site):
    """A site's prior mean where it is finite and in the support (the same for every entry whatever
    the site's shape), else NumPyro's ``init_to_median`` value."""
    sampled = init_to_median(num_samples=15)(site)
    if sampled is None or site["type"] != "sample" or site["is_observed"]:
        return sampled
    try:
        mean = jnp.broadcast_to(site["fn"].mean, jnp.shape(sampled))
    except (NotImplementedError, ValueError, TypeError):
        return sampled
    ok = jnp.isfinite(mean) & site["fn"].support(mean)
    return jnp.where(ok, mean, sampled)


def prior_median(model: Callable, args, kwargs, layout, exact: bool = False) -> jax.Array:
    """The latent sites of ``layout`` at their prior medians (NumPyro's ``init_to_median``: the
    median of 15 prior draws, each site given the earlier ones; a flat prior falls back to a
    uniform draw in (-2, 2) of unconstrained space), flat and unconstrained; a non-finite entry
    is 0. ``exact``: at the prior mean where it is finite instead (no draws, so an entry's start
    does not depend on how many entries the site has, e.g. a client padded to another's rows).
    Pure JAX: runs under ``jit`` on a client's own arguments."""
    if not layout.names:
        return jnp.zeros(0)
    dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
    seeded = seed(model, rng_seed=0)
    start_fn = _mean_or_median if exact else init_to_median(num_samples=15)
    try:  # (NumPyro notes sites whose value is already set, e.g. an improper prior's: not the user's concern)
        with numpyro.validation_enabled(False), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="init_to_median", category=UserWarning)
            tr = trace(substitute(seeded, substitute_fn=start_fn)).get_trace(
                **args, **kwargs)
    except ValueError:  # the medians make a later distribution invalid (e.g. Gamma(0.001, 0.001) for a precision)
        return jnp.zeros(layout.size, dtype)
    values = {}
    for name, shape in zip(layout.names, layout.shapes):
        site = tr[name]
        values[name] = jnp.reshape(biject_to(site["fn"].support).inv(site["value"]), shape)
    start = layout.ravel(values)
    return jnp.where(jnp.isfinite(start), start, 0.0).astype(dtype)


_INIT_SITES = (
    "init: {names} {verb} not global latent sites of the model (its global sites: {known}); init starts the "
    "global sites only{local}"
)
_INIT_VALUE = (
    "init: site {name!r} starts at {value}, {why}; give it a finite value inside its support ({support})"
)


def start_point(model: Callable, args, kwargs, layout, init=None, local_names=()) -> jax.Array:
    """The flat unconstrained start of the global sites of ``layout``: :func:`prior_median`
    (``exact``) for ``init=None``; ``init`` a dict ``{global site: constrained value}`` (the other
    sites at their prior means or medians), or a NumPyro init strategy (``init_to_median``,
    ``init_to_value(values=...)``, ``init_to_uniform``, ...) applied to every site.

    Raises:
        ValueError: naming a key of ``init`` that is not a global latent site (``local_names``:
            the local ones, whose values stay with their clients), or a site whose start is not
            finite or outside its support.
        TypeError: ``init`` neither a dict nor a callable.
    """
    if init is None:
        return compiled_prior_mean(model, args, kwargs, layout)
    if isinstance(init, Mapping):
        unknown = sorted(str(k) for k in init if k not in layout.names)
        if unknown:
            local = sorted(set(unknown) & set(local_names))
            raise ValueError(_INIT_SITES.format(
                names=unknown, verb="is" if len(unknown) == 1 else "are", known=list(layout.names),
                local=f" ({local} stay on their clients, which start them themselves)" if local else ""))
        given = {k: jnp.asarray(v) for k, v in init.items()}

        def strategy(site):
            if site["type"] == "sample" and site["name"] in given:
                return jnp.broadcast_to(given[site["name"]], site["fn"].shape(site["kwargs"].get("sample_shape", ())))
            return _mean_or_median(site)
    else:
        strategy = check_init("init", init)
    with numpyro.validation_enabled(False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="init_to_median", category=UserWarning)
        tr = trace(substitute(seed(model, rng_seed=0), substitute_fn=strategy)).get_trace(**dict(args), **dict(kwargs))
    values = {}
    for name, shape in zip(layout.names, layout.shapes):
        site = tr[name]
        value, support = site["value"], site["fn"].support
        why = ("not finite" if not bool(jnp.all(jnp.isfinite(value))) else
               "outside its support" if not bool(jnp.all(support(value))) else None)
        u = jnp.reshape(biject_to(support).inv(value), shape)
        if why is None and not bool(jnp.all(jnp.isfinite(u))):
            why = "on its support's boundary"
        if why is not None:
            raise ValueError(_INIT_VALUE.format(name=name, value=_shown(value), why=why, support=support))
        values[name] = u
    return layout.ravel(values).astype(jax.dtypes.canonicalize_dtype(jnp.float64))


def nonfinite_sites(model: Callable, args: Mapping, kwargs: Mapping, latent: Mapping) -> Tuple[List[str], List[str]]:
    """``(kinds, descriptions)`` of the model's sample sites whose log density (``"value"``) or its
    gradient in the latent sites (``"gradient"``) is not finite at ``latent`` (unconstrained values
    by site; sites left out are drawn as :func:`trace_model` draws them), each described with the
    parameters of its distribution that overflowed there: ``"site 'y' (Poisson): its log density is
    nan; its rate reaches inf"``. Run with NumPyro's validation off, so that the model runs through; a
    value outside its distribution's support counts as a log density of ``-inf`` (as NumPyro's
    validated density has it), whatever the distribution's own ``log_prob`` returns there."""

    def terms(values):
        def sub(msg):
            if msg["type"] == "sample" and msg["name"] in values:
                return biject_to(msg["fn"].support)(values[msg["name"]])
            return finite_point(msg)

        with numpyro.validation_enabled(False):
            tr = trace(substitute(seed(model, 0), substitute_fn=sub)).get_trace(**dict(args), **dict(kwargs))
            return {n: jnp.sum(s["fn"].log_prob(s["value"])) for n, s in tr.items() if s["type"] == "sample"}, tr

    latent = {k: jnp.asarray(v) for k, v in latent.items()}
    values, tr = terms(latent)
    kinds, parts = [], []
    for name, value in values.items():
        fn = tr[name]["fn"]
        outside = _outside_support(fn, tr[name]["value"])
        value = -np.inf if outside else value
        finite_value = bool(np.isfinite(value))
        # each site's own gradient (a joint Jacobian would carry another site's inf times a zero into it)
        grad = jax.grad(lambda lat, n=name: terms(lat)[0][n])(latent) if latent and finite_value else {}
        if finite_value and all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree_util.tree_leaves(grad)):
            continue
        kinds.append("value" if not finite_value else "gradient")
        what = ("its value lies outside its support, where its log density is -inf" if outside else
                f"its log density is {float(value):.4g}" if not finite_value else
                "its log density's gradient is not finite")
        parts.append(f"site {name!r} ({_named(fn)}): {what}{_overflowed(fn)}")
    return sorted(set(kinds)), parts


def _outside_support(fn, value) -> bool:
    """Whether ``value`` lies outside the support of ``fn`` (its innermost distribution's, where the
    outer one's is a constraint that cannot be evaluated); ``False`` where no support can tell."""
    while True:
        try:
            return not bool(np.all(np.asarray(fn.support(value))))
        except (ValueError, NotImplementedError, TypeError):
            if not hasattr(fn, "base_dist"):
                return False
            fn = fn.base_dist


def unwrapped(fn):
    """A site's distribution under NumPyro's masks, expansions and ``to_event`` (what the model wrote)."""
    while type(fn).__name__ in ("MaskedDistribution", "ExpandedDistribution", "Independent"):
        fn = fn.base_dist
    return fn


def _named(fn) -> str:
    return type(unwrapped(fn)).__name__


def _overflowed(fn) -> str:
    """``"; its scale reaches inf"``: the parameters of ``fn`` (its innermost distribution) that are
    not finite, beyond 1e30 in size or outside their constraint, or ``""``."""
    inner, found = fn, []
    while hasattr(inner, "base_dist"):
        inner = inner.base_dist
    for key, value in vars(inner).items():
        if key.startswith("_") or not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.floating):
            continue
        x = np.asarray(value, np.float64)
        constraint = getattr(inner, "arg_constraints", {}).get(key)
        try:
            outside = constraint is not None and not bool(np.all(np.asarray(constraint(jnp.asarray(value)))))
        except (ValueError, NotImplementedError, TypeError):  # (a dependent constraint cannot be evaluated alone)
            outside = False
        if x.size and (not np.all(np.isfinite(x)) or np.max(np.abs(x)) > 1e30 or outside):
            worst = x.reshape(-1)[np.argmax(np.where(np.isfinite(x), np.abs(x), np.inf).reshape(-1))]
            found.append(f"{key} reaches {worst:.4g}" + (f", outside {constraint}" if outside else ""))
    return ("; its " + ", ".join(found)) if found else ""


def is_factor(site) -> bool:
    """Whether an observed site is a ``numpyro.factor`` (a ``Unit`` distribution: no data)."""
    from numpyro.distributions import Unit

    fn = site["fn"]
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return isinstance(fn, Unit)


def observed_draws(tr, rng_key) -> dict:
    """A draw of new data from each observed site of the trace ``tr`` (the posterior predictive
    at the trace's latent values). A ``numpyro.factor`` has no data to draw, and a site whose
    distribution NumPyro cannot sample (a binomial with float counts indexes with the count; a
    distribution without a sampler) is left out: the caller reports what is missing. Works
    under ``jit`` (a sampler that cannot be traced fails while tracing, and is left out)."""
    observed = [n for n, site in tr.items() if site["type"] == "sample" and site["is_observed"]]
    keys = jax.random.split(rng_key, max(len(observed), 1))
    out = {}
    for name, key in zip(observed, keys):
        if is_factor(tr[name]):
            continue
        try:
            out[name] = tr[name]["fn"].sample(key)
        except (TypeError, NotImplementedError, ValueError, IndexError):
            continue
    return out


def update_digest(digest, value) -> bool:
    """Feed ``value`` (a number, text, array, PRNG key or a mapping / sequence of them) to
    ``digest``, by content; ``False`` for anything else (a value that cannot be compared so)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        digest.update(repr(value).encode())
        return True
    if isinstance(value, dict):
        digest.update(b"{")
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return all(update_digest(digest, k) and update_digest(digest, v) for k, v in items)
    if isinstance(value, (list, tuple)):
        digest.update(b"[")
        return all(update_digest(digest, v) for v in value)
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001  (not array-like: not comparable by content)
        return False
    if array.dtype.kind not in "biuf":
        return False
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    return True


def content_digest(value) -> Optional[str]:
    """A digest of ``value``'s content (numbers, text, arrays and mappings or sequences of them);
    ``None`` for anything else."""
    digest = hashlib.sha256()
    return digest.hexdigest() if update_digest(digest, value) else None


def data_digest(clients) -> Optional[str]:
    """A digest of the clients' content: names, arguments, arrays and recoded groups (``None``: not
    a :class:`~numpyro_fed.Clients`, or a value not comparable by content)."""
    if not (hasattr(clients, "names") and hasattr(clients, "group_values")):
        return None
    return content_digest([[name, dict(clients[name]), dict(clients.group_values.get(name, {}))]
                           for name in clients.names])


MAX_KINDS = 16  # client kinds traced for a program digest (the set-up checks compare as many layouts)


def program_digest(model: Callable, clients, kwargs: Mapping, max_kinds: int = MAX_KINDS) -> Optional[str]:
    """A digest of the programs ``model`` traces to on the clients' rows at a fixed point (every
    latent site as :func:`trace_model` sets it): each site's value and log density as a JAX
    program, its text and constants, traced on one client of each kind (the same array shapes and
    other arguments trace to the same program; at most ``max_kinds`` kinds, the smallest and the
    largest first, as the set-up checks choose the layouts they compare). The data enter as inputs: the digest is of the
    model's code and of everything it reads beside its arguments (a global a notebook cell sets, on
    any branch the clients' shapes take). Traced, not run: nothing is compiled. ``None`` where the
    model cannot be traced so (a Python branch on a data value, for one)."""

    def values(arrays, others):
        out = {}
        for name, site in trace_model(model, {**arrays, **others}, kwargs).items():
            if site["type"] not in ("sample", "deterministic"):
                continue
            density = site["fn"].log_prob(site["value"]) if site["type"] == "sample" else 0.0
            if site.get("scale") is not None:
                density = density * site["scale"]
            out[name] = (site["value"], jnp.sum(density))
        return out

    digest = hashlib.sha256()
    try:
        kinds = {}  # kind -> (its first client's arrays, other arguments, its size)
        for name in clients.names:
            args = dict(clients[name])
            arrays = {k: v for k, v in args.items() if isinstance(v, (jax.Array, np.ndarray))}
            others = {k: v for k, v in args.items() if k not in arrays}
            kind = repr(sorted((k, np.shape(v), str(v.dtype)) for k, v in arrays.items()))
            kind += repr(sorted(others.items()))
            kinds.setdefault(kind, (arrays, others, sum(np.size(v) for v in arrays.values())))
        by_size = sorted(kinds.values(), key=lambda kind: kind[2])
        ends = [k for pair in zip(by_size, reversed(by_size)) for k in pair]  # smallest, largest, next ...
        picked = list({id(k): k for k in ends}.values())[:max_kinds]
        for arrays, others, _ in picked:
            closed = jax.make_jaxpr(lambda a, _o=others: values(a, _o))(arrays)
            digest.update(str(closed.jaxpr).encode())
            if not all(update_digest(digest, const) for const in closed.consts):
                return None
    except Exception:  # noqa: BLE001  (not traceable so: the caller compares nothing)
        return None
    return digest.hexdigest()

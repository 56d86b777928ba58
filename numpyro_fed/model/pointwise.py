"""A client's pointwise log-likelihood at one draw of the latent sites, for every family.

Each family's ``log_likelihood`` (ArviZ's ``log_likelihood`` group, federated PSIS-LOO) comes
here with the constrained values of every continuous latent site at one draw. Each observed
site's log density is evaluated entry by entry on the client's rows, as NumPyro's
``numpyro.infer.log_likelihood`` does.

A model whose discrete local sites are enumerated (``infer={"enumerate": "parallel"}``) has no
value for them in a draw: they were summed out in the fit, and they are summed out here too,
row by row. An observed site that depends on enumerated sites gets the marginal

.. math::

    \\log p(y_i \\mid \\theta, v_i) = \\log \\sum_d p(d, v_i, y_i \\mid \\theta)
        - \\log \\sum_d p(d, v_i \\mid \\theta)

per entry of the plates it shares with those sites (``v_i``: the continuous local latents that
depend on ``d``, conditioned on as they are without enumeration). The sums are funsor's
sum-product over the enumerated values and the inner plates, as NumPyro's ``TraceEnum_ELBO``
computes the marginal; the shared plates are kept, so the result has one value per row. Observed
sites coupled through the same enumerated sites form one term, named by them joined with ``+``.
Never a draw of the discrete site from its prior: that scores each row with a random component.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import jax
from jax import random
from numpyro.handlers import seed, substitute, trace

from .structure import changed_deterministic, deterministic_values, fixed_discrete, is_enumerated
from .trace import observed_draws

__all__ = ["enumerated_terms", "enumeration_dependent", "observed_terms"]


def observed_terms(model, args: Mapping, kwargs: Mapping, values: Mapping[str, jax.Array],
                   rng_key) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
    """``(log_likelihood, predictive)`` at one draw: each observed site's pointwise log density
    of the client's data ``args`` at the constrained ``values`` of the latent (and ``param``)
    sites, enumerated sites summed out (see the module docstring), and a draw of new data
    (:func:`numpyro_fed.model.trace.observed_draws`; an enumerated site's value is drawn from its
    conditional prior there, as NumPyro's ``Predictive`` does). Pure; jit- and vmap-compatible."""
    k_trace, k_obs = random.split(rng_key)
    tr = trace(seed(substitute(model, data=dict(values)), k_trace)).get_trace(**dict(args), **dict(kwargs))
    observed = [n for n, site in tr.items() if site["type"] == "sample" and site["is_observed"]]
    log_lik = {}
    if any(is_enumerated(site) for site in tr.values()):
        nesting = max([-f.dim for site in tr.values() if site["type"] == "sample"
                       for f in site["cond_indep_stack"] if f.dim is not None] + [0])
        marginal = enumerated_terms(model, args, kwargs, values, nesting)
        summed = {n for key in marginal for n in key.split("+")}
        log_lik.update({n: tr[n]["fn"].log_prob(tr[n]["value"]) for n in observed if n not in summed})
        log_lik.update(marginal)
    else:
        log_lik = {n: tr[n]["fn"].log_prob(tr[n]["value"]) for n in observed}
    return log_lik, observed_draws(tr, k_obs)


def enumerated_terms(model, args: Mapping, kwargs: Mapping, values: Mapping[str, jax.Array],
                     nesting: int) -> Dict[str, jax.Array]:
    """The observed sites that depend on enumerated sites, their marginal pointwise log density
    (see the module docstring): ``{"y": (rows, ...)}``, or ``{"y1+y2": ...}`` for sites coupled
    through the same enumerated sites; one array axis per plate every factor of the term shares,
    outermost first. ``nesting``: the model's plate depth (enumeration uses the dims to its left)."""
    import funsor
    from funsor.sum_product import sum_product
    from numpyro.contrib.funsor import enum, plate_to_enum_plate
    from numpyro.contrib.funsor import trace as enum_trace

    enumerated = enum(substitute(seed(model, 0), data=dict(values)), first_available_dim=-nesting - 1)
    with plate_to_enum_plate():
        tr = enum_trace(enumerated).get_trace(**dict(args), **dict(kwargs))
    sites = [s for s in tr.values() if s["type"] == "sample"]
    names = {s["name"] for s in sites if is_enumerated(s)}
    factors = {s["name"]: funsor.to_funsor(s["fn"].log_prob(s["value"]), output=funsor.Real,
                                           dim_to_name=s["infer"]["dim_to_name"]) for s in sites}
    dims = {f.name: f.dim for s in sites for f in s["cond_indep_stack"] if f.dim is not None}
    out = {}
    for group in _coupled(factors, names):
        observed = [s["name"] for s in sites if s["is_observed"] and s["name"] in group]
        if not observed:
            continue
        inputs = [set(factors[n].inputs) - names for n in group]
        kept = set.intersection(*inputs)
        plates = frozenset(set.union(*inputs))
        eliminate = frozenset((plates - kept) | (names & set.union(*[set(factors[n].inputs) for n in group])))

        def total(members: List[str]):
            return sum_product(funsor.ops.logaddexp, funsor.ops.add, [factors[n] for n in members],
                               eliminate=eliminate, plates=plates)

        joint = total(group)
        prior = total([n for n in group if n not in observed])
        order = tuple(sorted(kept, key=lambda p: dims[p]))
        out["+".join(observed)] = (joint - prior).align(order).data
    return out


def _coupled(factors, names) -> List[List[str]]:
    """The sites whose factors depend on enumerated sites (``names``), grouped by the enumerated
    sites that couple them (connected through shared ones)."""
    parent = {n: n for n in names}

    def root(n):
        while parent[n] != n:
            n = parent[n]
        return n

    for f in factors.values():
        linked = [n for n in f.inputs if n in names]
        for a in linked[1:]:
            parent[root(a)] = root(linked[0])
    groups: Dict[str, List[str]] = {}
    for site, f in factors.items():
        linked = [n for n in f.inputs if n in names]
        if linked:
            groups.setdefault(root(linked[0]), []).append(site)
    return list(groups.values())


def enumeration_dependent(model, args: Mapping, kwargs: Mapping) -> Tuple[str, ...]:
    """The ``numpyro.deterministic`` sites whose value depends on an enumerated site: they have no value
    once it is summed out (a draw would compute them at a value drawn from its prior), so every
    family leaves them out of a client's draws. Found by running the model with the enumerated sites
    at two different values (concrete even when called under ``jit``)."""
    with jax.ensure_compile_time_eval():
        first, other = (deterministic_values(trace(substitute(seed(model, 0), substitute_fn=fixed_discrete(value)))
                                             .get_trace(**dict(args), **dict(kwargs))) for value in (0, 1))
    return tuple(sorted(changed_deterministic(first, [other])))

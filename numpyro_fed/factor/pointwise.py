"""A client's pointwise log-likelihood under a PVI or EP fit (for ArviZ and federated PSIS-LOO).

The server's ``q`` approximates the global sites only. At each draw ``u ~ q`` (the same
draws for every client, so the clients' matrices stack into the pooled one) the client
draws its local latents ``v`` from the Laplace approximation of ``p(v | u, y_j)``, on its
own rows and from its own key: the conditional mode and the inverse Hessian there, exact
when ``v | u`` is Gaussian (a Gaussian hierarchical model). It then evaluates every
observed site's log density of each of its rows, and draws new data, at ``(u, v)``. All of
it stays on the client: federated PSIS-LOO sends only sums (:mod:`numpyro_fed.fitting.comparison`).
Pure and jit-compatible given the client's shapes.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.distributions.transforms import biject_to

from ..model.groups import trim_groups
from ..model.pointwise import observed_terms
from ..model.structure import latent_supports, trace_model
from ..run.backends.mapping import pad_client
from ..terms import gaussian as G
from ..terms.local_check import INNER_STEPS, WARM_STEPS, laplace_proposal, local_integral_k, locals_are_gaussian
from ..terms.tilted import PARETO_K_LIMIT
from ..warnings import ModelComparisonWarning, find_stack_level

__all__ = ["client_pass", "conditional_local_draws", "observed_terms_at"]


def conditional_local_draws(log_joint: Callable, num_global: int, num_local: int, mean, u, data, rng_key):
    """``v_s ~ N(v*(u_s), -H_vv(u_s)^-1)`` for each row ``u_s`` of ``u`` (``(S, d)``): the
    Laplace approximation of ``p(v | u_s, y_j)``, warm-started at the conditional mode at
    ``q``'s ``mean``. ``(S, num_local)``."""
    v0 = jnp.zeros(num_local, u.dtype)
    v0 = laplace_proposal(log_joint, num_global, num_local, mean, data, v0, INNER_STEPS)[0]

    def one(x, key):
        v, chol = laplace_proposal(log_joint, num_global, num_local, x, data, v0, WARM_STEPS)
        eps = random.normal(key, (num_local,), x.dtype)
        return v + jax.scipy.linalg.solve_triangular(chol.T, eps, lower=False)

    return jax.vmap(one)(u, random.split(rng_key, u.shape[0]))


def constrained(layout, local, supports, u, v) -> Dict[str, jax.Array]:
    """Constrained values of the global (``u``) and local (``v``) sites at one draw."""
    values = {**layout.unravel(u), **(local.unravel(v) if local.size else {})}
    return {k: biject_to(supports[k])(x) for k, x in values.items()}


_NOT_CLIENT = "client {name!r} is not one of the fitted clients {names}"
_LAPLACE_LOCALS = (
    "{cls}: client '{client}''s local latents given the global sites are not close to Gaussian on its rows "
    "(Pareto k = {k:.2f} > 0.7 for its Laplace approximation of p(v | theta, y_j) at q's mean), so its local "
    "draws, and the pointwise log-likelihood and LOO terms at them, are approximate there"
)


def observed_terms_at(setup, model, model_kwargs, rng_key, draws: Dict[str, jax.Array], client) -> tuple:
    """``(log_likelihood, predictive)`` of ``client``'s rows at given constrained draws of every
    latent site (compiled once per set-up)."""
    args = {k: jnp.asarray(v) for k, v in setup.inputs[client].items()}
    num = jnp.shape(next(iter(draws.values())))[0]
    if "pointwise_at" not in setup.cache:
        setup.cache["pointwise_at"] = jax.jit(jax.vmap(
            lambda values, k, a: observed_terms(model, a, model_kwargs, values, k), in_axes=(0, 0, None)))
    return setup.cache["pointwise_at"](draws, random.split(rng_key, num), args)


def client_pass(setup, state, model, model_kwargs, joint_of: Callable, cls: str, rng_key, num_samples: int,
                client, u=None) -> tuple:
    """``(values, log_likelihood, predictive)`` on ``client``'s rows at ``num_samples`` draws of
    ``q`` (a factor family's fit): the global draws, the client's local draws from the Laplace
    approximation of ``p(v | u, y_j)`` (``joint_of(local layout)`` is its log joint), and its
    observed sites' log densities and new data there. Warns when that approximation fails its
    own Pareto-k check on the client's rows. ``u``: the flat unconstrained global draws to use
    instead of draws of ``q`` (importance-corrected ones), ``(num_samples, d)``."""
    names = list(setup.inputs.names)
    if client not in names:
        hint = f" (names are strings: client={str(client)!r})" if str(client) in names else ""
        raise ValueError(_NOT_CLIENT.format(name=client, names=names) + hint)
    structure = setup.extra.structure
    q = state.server.q
    d = q.shift.shape[0]
    if u is None:
        u = jax.vmap(lambda e: G.sample(q, e))(random.normal(rng_key, (num_samples, d)))
    args = setup.inputs[client]
    data = pad_client(args, int(setup.inputs.num_rows[client]))
    layout = structure.global_latent
    shapes = tuple((k, jnp.shape(v)) for k, v in sorted(data.args.items()))
    if ("layout", shapes) not in setup.cache:  # traced once per client shape, not per call
        tr = trace_model(model, data.args, model_kwargs)
        setup.cache[("layout", shapes)] = (structure.local_layout(tr), latent_supports(tr))
    local, supports = setup.cache[("layout", shapes)]
    key = ("pointwise", shapes)
    if key not in setup.cache:  # compiled once per client shape
        joint, kwargs = joint_of(local), model_kwargs

        def run(q_, u_, data_, local_key, obs_key):
            mean, _ = G.to_moments(q_)
            if local.size:
                v = conditional_local_draws(joint, d, local.size, mean, u_, data_, local_key)
            else:
                v = jnp.zeros((u_.shape[0], 0), u_.dtype)
            values = jax.vmap(lambda a, b: constrained(layout, local, supports, a, b))(u_, v)
            keys = random.split(obs_key, u_.shape[0])
            log_lik, predictive = jax.vmap(
                lambda val, k: observed_terms(model, data_.args, kwargs, val, k))(values, keys)
            return values, log_lik, predictive

        setup.cache[key] = jax.jit(run)
    index = names.index(client)
    local_key, obs_key = random.split(random.fold_in(random.fold_in(rng_key, 0x10C), index))
    if local.size:  # the client checks its Laplace conditional on its own rows, at q's mean
        check = ("pointwise_check", shapes)
        if check not in setup.cache:
            joint = joint_of(local)
            def proposal_k(q_, data_, k):  # 0 where v | theta is Gaussian (Laplace exact; equal weights)
                mean = G.to_moments(q_)[0]
                exact = locals_are_gaussian(joint, d, local.size, mean, data_, random.PRNGKey(5))
                return jnp.where(exact, 0.0, local_integral_k(joint, d, local.size, mean, data_, k))

            setup.cache[check] = jax.jit(proposal_k)
        k_hat = float(setup.cache[check](q, data, random.fold_in(local_key, 1)))
        if k_hat > PARETO_K_LIMIT or not np.isfinite(k_hat):
            warnings.warn(_LAPLACE_LOCALS.format(cls=cls, client=client, k=k_hat),
                          ModelComparisonWarning, stacklevel=find_stack_level())
    values, log_lik, predictive = setup.cache[key](q, u, data, local_key, obs_key)
    return trim_groups(values, local, args), log_lik, predictive  # its own groups only



"""Small pure helpers the algorithm cores share."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

__all__ = ["ascent", "carried_while", "leapfrog", "tree_weighted_sum"]


def ascent(optim: optax.GradientTransformation, grads, opt_state, params):
    """One optax step that *maximises* (optax minimises)."""
    updates, opt_state = optim.update(jax.tree_util.tree_map(jnp.negative, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def tree_weighted_sum(weights, stacked):
    """``sum_j weights[j] * stacked[j]`` over every leaf."""
    return jax.tree_util.tree_map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), stacked)


def carried_while(cond, body, init):
    """``lax.while_loop(cond, body, init)`` with the predicate carried in the state: ``cond`` is
    evaluated once per iteration, after ``body``, and the loop reads the stored flag.

    Under ``vmap`` JAX evaluates a batched predicate twice, in the loop's condition (any lane
    going?) and again in its body (which lanes to step), in two separately compiled XLA
    computations. A predicate near a tie (a line search's ``value <= limit``) can then come out
    true in the one and false in the other: that lane is never stepped, its counter never reaches
    its bound, and the loop never ends (seen with XLA's optimisations off). Carrying the flag makes
    both read one value."""
    def step(carry):
        x = body(carry[0])
        return x, cond(x)

    return jax.lax.while_loop(lambda carry: carry[1], step, (init, cond(init)))[0]


def leapfrog(grad: Callable, x, p, eps, steps: int):
    """``(x, p)`` after ``steps`` leapfrog steps of size ``eps`` on the potential whose gradient is
    ``grad`` (unit mass): Hamiltonian Monte Carlo's trajectory, as a ``lax.scan``."""
    def step(state, _):
        x, r = state
        r = r - 0.5 * eps * grad(x)
        x = x + eps * r
        r = r - 0.5 * eps * grad(x)
        return (x, r), None

    return jax.lax.scan(step, (x, p), None, length=steps)[0]


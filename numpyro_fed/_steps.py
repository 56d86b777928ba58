"""Small pure helpers the algorithm cores share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["ascent", "tree_weighted_sum"]


def ascent(optim: optax.GradientTransformation, grads, opt_state, params):
    """One optax step that *maximises* (optax minimises)."""
    updates, opt_state = optim.update(jax.tree_util.tree_map(jnp.negative, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def tree_weighted_sum(weights, stacked):
    """``sum_j weights[j] * stacked[j]`` over every leaf."""
    return jax.tree_util.tree_map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), stacked)

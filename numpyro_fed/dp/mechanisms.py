"""The Gaussian mechanisms of Heikkilä et al. (2023), as pure functions of a client's own key.

- :func:`dp_sgd_transform`: DP-SGD (§4.1, Theorem 6) as an optax transform, optax's own
  ``differentially_private_aggregate`` (per-example clipping over the whole gradient
  pytree, Gaussian noise on the sum, divided by the batch size) seeded with the client's
  key; chain it first: ``optax.chain(dp_sgd_transform(...), optax.adam(lr))``.
- :func:`fixed_size_subset`: the rows of one DP-SGD step, a uniformly random subset of
  fixed size drawn without replacement among the client's real rows (Heikkilä et al. (2023)
  Definition 4; not epoch shuffling).
- :func:`perturbed_sum`: update perturbation (§4.2, Theorems 7 and 12): clip each shard's
  change in natural parameters to ``C``, add Gaussian noise to the sum.

Noise is drawn from the key passed in, which is the client's own; JAX's default PRNG
(threefry) is not a cryptographically secure generator, so these are research-grade
implementations of the mechanisms, not hardened ones.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import optax
import optax.contrib

__all__ = [
    "DPSGD",
    "add_gradient",
    "clip_per_example",
    "dp_sgd_transform",
    "fixed_size_subset",
    "perturbed_factor_sum",
    "perturbed_sum",
    "update_perturbation",
]


def clip_per_example(tree, clip: float) -> Tuple[object, jax.Array]:
    """Scale each example's slice (leading axis of every leaf) of ``tree`` to L2 norm at
    most ``clip``, the norm taken over the whole pytree. Returns ``(clipped, norms)``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    n = leaves[0].shape[0]
    norms = jnp.sqrt(sum(jnp.sum(jnp.reshape(x, (n, -1)) ** 2, axis=1) for x in leaves))
    factor = jnp.minimum(1.0, clip / jnp.maximum(norms, 1e-30))
    clipped = [x * factor.reshape((n,) + (1,) * (x.ndim - 1)).astype(x.dtype) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, clipped), norms


def perturbed_sum(tree, clip: float, noise_std, key: jax.Array):
    """``sum_k clip(tree_k, C) + N(0, noise_std^2 I)`` over the leading (shard) axis; with
    ``noise_std = noise_multiplier * C``. Under substitution one row changes one shard's
    clipped change by at most ``2C``, which the accountant's ``REPLACE_ONE`` relation
    accounts for."""
    clipped, _ = clip_per_example(tree, clip)
    leaves, treedef = jax.tree_util.tree_flatten(clipped)
    keys = jax.random.split(key, len(leaves))
    noised = [jnp.sum(x, axis=0) + noise_std * jax.random.normal(k, x.shape[1:], x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, noised)


def fixed_size_subset(key: jax.Array, row_mask: jax.Array, size: int) -> jax.Array:
    """Indices of ``size`` rows drawn uniformly without replacement among the rows whose
    ``row_mask`` is 1 (padded rows are never drawn; the caller ensures ``size`` is at most
    the number of real rows)."""
    scores = jnp.where(row_mask > 0, jax.random.uniform(key, row_mask.shape), -1.0)
    return jax.lax.top_k(scores, size)[1]  # the largest of iid uniforms: a uniform subset (top_k: 7x a sort on CPU)


def dp_sgd_transform(clip: float, noise_multiplier: float, key: jax.Array) -> optax.GradientTransformation:
    """optax's DP-SGD aggregation (expects per-example gradients, leading batch axis),
    with its noise drawn from ``key`` (the client's own)."""
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):  # a raw uint32 key, as NumPyro uses
        key = jax.random.wrap_key_data(key)
    return optax.contrib.differentially_private_aggregate(clip, noise_multiplier, key=key)


class DPSGD(NamedTuple):
    """DP-SGD settings of a client's local optimisation: clipping bound, ``sigma / C`` and
    the fixed size of every step's subset of rows."""

    clip: float
    noise_multiplier: float
    batch_size: int


def add_gradient(fn: Callable) -> optax.GradientTransformation:
    """An optax transform that adds ``grad(fn)(params)`` to the updates: a term of the
    objective that does not touch the data (the local ELBO's KL to the cavity), added after
    the DP aggregation of the data term, outside its clipping."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("add_gradient needs params= in update()")
        return jax.tree_util.tree_map(jnp.add, updates, jax.grad(fn)(params)), state

    return optax.GradientTransformation(init_fn, update_fn)


def natural_vector(t) -> jax.Array:
    """A Gaussian factor's canonical natural parameters as one vector: ``eta_1 = shift`` and
    ``eta_2 = -precision / 2``, its diagonal (diagonal family, as DPBayes/DPPVI clips
    mean-field factors) or its upper triangle with the diagonal (full family), each free
    parameter once; the clipping bound refers to this vector's L2 norm."""
    if t.precision.ndim == 1:
        return jnp.concatenate([t.shift, -0.5 * t.precision])
    rows, cols = jnp.triu_indices(t.shift.shape[0])
    return jnp.concatenate([t.shift, -0.5 * t.precision[rows, cols]])


def from_natural_vector(v: jax.Array, like):
    """Inverse of :func:`natural_vector` (the precision rebuilt symmetric)."""
    d = like.shift.shape[0]
    if like.precision.ndim == 1:
        return type(like)(v[:d], -2.0 * v[d:])
    rows, cols = jnp.triu_indices(d)
    upper = jnp.zeros((d, d), v.dtype).at[rows, cols].set(-2.0 * v[d:])
    return type(like)(v[:d], upper + jnp.triu(upper, 1).T)


def perturbed_factor_sum(changes, clip: float, noise_std, key: jax.Array):
    """Update perturbation of shard changes ``lambda*_k - lambda`` (a factor pytree with a
    leading shard axis): each clipped to ``clip`` in the norm of :func:`natural_vector`,
    summed, Gaussian noise of ``noise_std`` added to every free natural parameter (paper
    002 eqs. 4.7 and 4.11). Returns ``(noised sum, noised shard changes)``: the noise is
    drawn as one share of ``noise_std / sqrt(N)`` per shard (the sum's noise has exactly
    ``noise_std``), so virtual factors that keep their noised change add up to what the
    server received and a refit replaces its noise instead of piling it up in ``q`` (as
    the paper's code, DPBayes/DPPVI, does). Divide the sum by ``N`` for local averaging."""
    like = jax.tree_util.tree_map(lambda x: x[0], changes)
    clipped, _ = clip_per_example(jax.vmap(natural_vector)(changes), clip)
    share = noise_std / jnp.sqrt(clipped.shape[0])
    parts = clipped + share * jax.random.normal(key, clipped.shape, clipped.dtype)
    return from_natural_vector(parts.sum(0), like), jax.vmap(lambda v: from_natural_vector(v, like))(parts)


def update_perturbation(clip: float, noise_multiplier: float):
    """The ``perturb`` argument of :func:`~numpyro_fed.factor.updates.factor_protocol`:
    clip to ``clip``, noise of standard deviation ``noise_multiplier * clip``."""

    def perturb(key, changes):
        return perturbed_factor_sum(changes, clip, noise_multiplier * clip, key)

    return perturb

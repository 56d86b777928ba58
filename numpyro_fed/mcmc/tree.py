"""The server's decisions about each leaf of a federated trajectory (one chain).

The server follows NumPyro's iterative NUTS (``numpyro/infer/hmc_util.py``: ``build_tree``,
``_double_tree``, ``_iterative_build_subtree``, ``_combine_tree``) one leaf at a time: it
holds every scalar of the tree (weights, energies, acceptance sums, depth, turning and
diverging flags) and draws every random choice (directions, the uniform transitions
inside a subtree, the biased transition between trees) from its own key, split exactly
as NumPyro splits ``HMCState.rng_key``. With the same key, momenta and positions it
therefore takes NumPyro's decisions. Fixed-length HMC (``_hmc_next``) is the special
case of one subtree of ``num_steps`` leaves, accepted at its end.

Pure and jit-compatible; the caller vmaps over chains.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from .._typing import Array
from .block import Decisions, LeafShares, checkpoint_range

__all__ = ["LeafTotals", "TreeState", "hmc_decide", "init_tree", "nuts_decide", "start_doubling",
           "start_tree"]


class TreeState(NamedTuple):
    """The server's scalars of one chain's trajectory (NumPyro's ``TreeInfo`` without the
    positions, plus the keys of ``build_tree``'s loops)."""

    energy0: Array  # energy at the start of the iteration
    tree_key: Array  # build_tree's loop key
    sub_key: Array  # _iterative_build_subtree's loop key
    trans_key: Array  # the current doubling's transition key
    going_right: Array
    leaf_idx: Array  # index of the next leaf in its subtree
    depth: Array
    weight: Array
    turning: Array
    diverging: Array
    sum_accept: Array
    num_proposals: Array
    pe_prop: Array
    energy_prop: Array
    sub_weight: Array
    sub_sum_accept: Array
    sub_pe_prop: Array
    sub_energy_prop: Array
    num_steps: Array  # fixed-length HMC: leaves in this trajectory


class LeafTotals(NamedTuple):
    """The sums over every party of a leaf: potential energy and the :class:`LeafShares`."""

    pe: Array
    shares: LeafShares


def init_tree(dtype) -> TreeState:
    """An empty tree (its keys are set by :func:`start_tree`)."""
    f, i, b = jnp.zeros((), dtype), jnp.zeros((), jnp.int32), jnp.zeros((), bool)
    key = random.PRNGKey(0)
    return TreeState(f, key, key, key, b, i, i, f, b, b, f, i, f, f, f, f, f, f, i)


def start_tree(tree_key: Array, pe: Array, energy0: Array, num_steps: Array) -> TreeState:
    """A one-point tree at the chain's position (NumPyro's ``build_tree`` before its loop)."""
    tree = init_tree(pe.dtype)
    return tree._replace(energy0=energy0, tree_key=tree_key, pe_prop=pe, energy_prop=energy0, num_steps=num_steps)


def start_doubling(tree: TreeState, hmc: bool = False) -> TreeState:
    """The next doubling: a direction and the doubling's keys from ``build_tree``'s key
    (``hmc``: the one forward trajectory, whose acceptance draw uses the iteration's
    transition key itself, as NumPyro's ``_hmc_next`` does)."""
    zero = jnp.zeros((), jnp.int32)
    if hmc:
        return tree._replace(trans_key=tree.tree_key, going_right=jnp.ones((), bool), leaf_idx=zero)
    tree_key, direction_key, doubling_key = random.split(tree.tree_key, 3)
    sub_key, trans_key = random.split(doubling_key)
    return tree._replace(tree_key=tree_key, sub_key=sub_key, trans_key=trans_key,
                         going_right=random.bernoulli(direction_key), leaf_idx=zero)


def _leaf_energy(tree: TreeState, leaf: LeafTotals, max_delta_energy: float):
    energy = leaf.pe + leaf.shares.kinetic
    delta = energy - tree.energy0
    delta = jnp.where(jnp.isnan(delta), jnp.inf, delta)
    return energy, -delta, delta > max_delta_energy, jnp.clip(jnp.exp(-delta), None, 1.0)


def nuts_decide(tree: TreeState, leaf: LeafTotals, max_tree_depth: int, max_delta_energy: float):
    """NUTS after one leaf: the subtree's uniform transition, its U-turn checks and, when
    it ends, the biased transition to the tree and the tree's own check. Returns
    ``(tree, Decisions without the warmup fields, iteration ended)``."""
    energy, weight, diverging, accept = _leaf_energy(tree, leaf, max_delta_energy)
    first = tree.leaf_idx == 0
    sub_key, t_key = random.split(tree.sub_key)
    take_leaf = first | random.bernoulli(t_key, jax.nn.sigmoid(weight - tree.sub_weight))
    sub_weight = jnp.where(first, weight, jnp.logaddexp(tree.sub_weight, weight))
    sub_sum_accept = jnp.where(first, accept, tree.sub_sum_accept + accept)
    sub_pe = jnp.where(take_leaf, leaf.pe, tree.sub_pe_prop)
    sub_energy = jnp.where(take_leaf, energy, tree.sub_energy_prop)
    sub_num = tree.leaf_idx + 1
    idx_min, idx_max = checkpoint_range(tree.leaf_idx)
    idx = jnp.arange(leaf.shares.turn.shape[0])
    turned = (leaf.shares.turn[:, 0] <= 0) | (leaf.shares.turn[:, 1] <= 0)
    sub_turning = jnp.any((idx >= idx_min) & (idx <= idx_max) & turned)
    sub_end = ~((sub_num < 2 ** tree.depth) & ~sub_turning & ~diverging)
    prob = jnp.where(sub_turning | diverging, 0.0, jnp.clip(jnp.exp(sub_weight - tree.weight), None, 1.0))
    take_sub = sub_end & random.bernoulli(tree.trans_key, prob)
    tree_turning = sub_turning | (leaf.shares.full[0] <= 0) | (leaf.shares.full[1] <= 0)
    joined = tree._replace(
        depth=tree.depth + 1, weight=jnp.logaddexp(tree.weight, sub_weight), turning=tree_turning,
        diverging=diverging, sum_accept=tree.sum_accept + sub_sum_accept,
        num_proposals=tree.num_proposals + sub_num,
        pe_prop=jnp.where(take_sub, sub_pe, tree.pe_prop), energy_prop=jnp.where(take_sub, sub_energy,
                                                                                  tree.energy_prop))
    new = jax.tree_util.tree_map(lambda a, b: jnp.where(sub_end, a, b), joined, tree)
    new = new._replace(sub_key=sub_key, leaf_idx=sub_num, sub_weight=sub_weight, sub_sum_accept=sub_sum_accept,
                       sub_pe_prop=sub_pe, sub_energy_prop=sub_energy)
    iter_end = sub_end & ~((new.depth < max_tree_depth) & ~new.turning & ~new.diverging)
    return new, _decisions(take_leaf, sub_end, take_sub, iter_end), iter_end


def hmc_decide(tree: TreeState, leaf: LeafTotals, max_delta_energy: float):
    """Fixed-length HMC after one leaf: the trajectory ends after ``num_steps`` leaves and
    its last leaf is accepted with probability ``min(1, exp(-delta H))`` (NumPyro's
    ``_hmc_next``). Returns ``(tree, Decisions without the warmup fields, ended)``."""
    energy, _, diverging, accept = _leaf_energy(tree, leaf, max_delta_energy)
    count = tree.leaf_idx + 1
    end = count >= tree.num_steps
    take = end & random.bernoulli(tree.trans_key, accept)
    new = tree._replace(
        leaf_idx=count, sub_pe_prop=leaf.pe, sub_energy_prop=energy,
        sum_accept=jnp.where(end, accept, tree.sum_accept), num_proposals=end.astype(jnp.int32),
        diverging=end & diverging, pe_prop=jnp.where(take, leaf.pe, tree.pe_prop),
        energy_prop=jnp.where(take, energy, tree.energy_prop))
    return new, _decisions(jnp.ones((), bool), end, take, end), end


def _decisions(take_leaf, sub_end, take_sub, iter_end) -> Decisions:
    false = jnp.zeros((), bool)
    return Decisions(take_leaf, sub_end, take_sub, iter_end, false, false, jnp.full((), -1, jnp.int32))

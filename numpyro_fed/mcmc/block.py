"""One party's block of a federated Hamiltonian trajectory.

Federated HMC/NUTS samples ``(theta, z_1, ..., z_J)``: the server holds the global
position ``theta``, client ``j`` its local latents ``z_j``. With a block-diagonal
(here: diagonal) mass matrix, everything NumPyro's iterative NUTS keeps per coordinate
(``numpyro/infer/hmc_util.py``: the leaves of the tree, its proposal, ``r_sum`` and the
U-turn checkpoints) splits into one block per party, and every quantity the tree
decisions need is a sum over blocks:

.. math::

    K(r) = \\sum_b \\tfrac12 r_b^\\top M_b^{-1} r_b, \\qquad
    (M^{-1} r_l)^\\top s = \\sum_b (M_b^{-1} r_{l,b})^\\top s_b .

This module is that block: the same pure functions run on the server (``theta``, whose
gradient is the sum of the clients' ``dU_j / dtheta``) and on each client (``z_j``). A
party never sends its block; it sends its kinetic energy and its share of the U-turn dot
products, and receives the server's decisions (which leaf is the proposal, when a
subtree or an iteration ends), which it applies to its own copy of the tree.

All functions are pure and jit-compatible; one chain (the caller vmaps over chains).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from .._typing import Array

__all__ = ["Block", "Command", "Decisions", "Leaf", "LeafShares", "apply_decisions", "checkpoint_range",
           "finish_leaf", "init_block", "kinetic_energy", "new_iteration", "start_leaf"]


class Leaf(NamedTuple):
    """A point of the trajectory, this party's block: position, momentum, gradient of the potential."""

    z: Array
    r: Array
    g: Array


class Block(NamedTuple):
    """This party's block of one chain's state and of the trajectory being built.

    ``z``, ``g``: the chain's current position and the potential's gradient there;
    ``r0``: the momentum drawn for this iteration; ``left``/``right``/``prop_*``/``r_sum``:
    the NUTS tree built so far; ``sub_*``: the subtree of the current doubling;
    ``ckpt_r``/``ckpt_rsum``: the subtree's U-turn checkpoints (NumPyro's ``r_ckpts``,
    ``r_sum_ckpts``); ``pending``: the last leaf, whose role the server decides;
    ``half``: the half-step momentum of the leaf in progress (the server's, between its
    broadcast and the clients' gradients); ``going_right``: the current doubling's direction.
    """

    z: Array
    g: Array
    r0: Array
    left: Leaf
    right: Leaf
    prop_z: Array
    prop_g: Array
    r_sum: Array
    sub_left: Leaf
    sub_right: Leaf
    sub_prop_z: Array
    sub_prop_g: Array
    sub_r_sum: Array
    ckpt_r: Array
    ckpt_rsum: Array
    pending: Leaf
    half: Array
    going_right: Array


class Command(NamedTuple):
    """What every party does this round (the server's broadcast, per chain).

    ``kind``: 0 evaluate the potential at the current position (set-up), 1 one leapfrog
    step, 2 nothing (the chain is done); ``new_iteration``: draw a fresh momentum and start
    a tree at the current position first; ``new_doubling``: the leaf starts a new subtree
    from the tree's outer leaf; ``going_right``, ``step``: direction and signed step size;
    ``leaf_idx``: the leaf's index in its subtree; ``redraw``: the set-up point was not
    finite, draw another one.
    """

    kind: Array
    new_iteration: Array
    new_doubling: Array
    going_right: Array
    step: Array
    leaf_idx: Array
    redraw: Array


class Decisions(NamedTuple):
    """The server's decisions about the last leaf, applied by every party in this order:
    ``take_leaf`` (the leaf becomes the subtree's proposal), ``sub_end`` (the subtree joins
    the tree) with ``take_sub`` (its proposal becomes the tree's), ``iter_end`` (the tree's
    proposal becomes the chain's position), then the warmup's ``welford`` (add the new
    position to the mass-matrix estimate) and ``window_end`` (adopt it), and ``record``
    (the sample index to store the position at, -1 for none)."""

    take_leaf: Array
    sub_end: Array
    take_sub: Array
    iter_end: Array
    welford: Array
    window_end: Array
    record: Array


class LeafShares(NamedTuple):
    """A party's share of the scalars the server's decisions need, for one leaf."""

    kinetic: Array  # 0.5 r^T M^-1 r at the new leaf
    kinetic0: Array  # the same for the iteration's fresh momentum (when one was drawn)
    turn: Array  # (max_tree_depth, 2): per checkpoint, the two U-turn dot products
    full: Array  # (2,): the two U-turn dot products of the whole tree if the subtree ended here


def kinetic_energy(inv_mass: Array, r: Array) -> Array:
    """``0.5 r^T M^-1 r`` for a diagonal ``M^-1``."""
    return 0.5 * jnp.dot(inv_mass * r, r)


def init_block(z: Array, max_tree_depth: int) -> Block:
    """A block at position ``z`` (gradient and trajectory still empty)."""
    zero = jnp.zeros_like(z)
    leaf = Leaf(z, zero, zero)
    ckpts = jnp.zeros((max_tree_depth,) + z.shape, z.dtype)
    return Block(z, zero, zero, leaf, leaf, z, zero, zero, leaf, leaf, z, zero, zero, ckpts, ckpts, leaf, zero,
                 jnp.zeros((), bool))


def _pick(flag: Array, a, b):
    """``a`` where ``flag`` else ``b``, leaf by leaf."""
    return jax.tree_util.tree_map(lambda x, y: jnp.where(flag, x, y), a, b)


def apply_decisions(block: Block, dec: Decisions) -> Block:
    """The server's decisions about the last leaf (see :class:`Decisions`), NumPyro's
    ``_combine_tree`` of the subtree and of the tree, restricted to this block."""
    sub_prop_z = jnp.where(dec.take_leaf, block.pending.z, block.sub_prop_z)
    sub_prop_g = jnp.where(dec.take_leaf, block.pending.g, block.sub_prop_g)
    right_way = block.going_right
    left = _pick(dec.sub_end & ~right_way, block.sub_left, block.left)
    right = _pick(dec.sub_end & right_way, block.sub_right, block.right)
    r_sum = jnp.where(dec.sub_end, block.r_sum + block.sub_r_sum, block.r_sum)
    take = dec.sub_end & dec.take_sub
    prop_z = jnp.where(take, sub_prop_z, block.prop_z)
    prop_g = jnp.where(take, sub_prop_g, block.prop_g)
    z = jnp.where(dec.iter_end, prop_z, block.z)
    g = jnp.where(dec.iter_end, prop_g, block.g)
    return block._replace(z=z, g=g, left=left, right=right, prop_z=prop_z, prop_g=prop_g, r_sum=r_sum,
                          sub_prop_z=sub_prop_z, sub_prop_g=sub_prop_g)


def new_iteration(block: Block, rng_key: Array, mass_sqrt: Array, mask: Array, inv_mass: Array):
    """A fresh momentum from this party's own key and a one-point tree at the current
    position. Returns ``(block, kinetic energy of the momentum)``."""
    r0 = mass_sqrt * random.normal(rng_key, block.z.shape, block.z.dtype) * mask
    leaf = Leaf(block.z, r0, block.g)
    block = block._replace(r0=r0, left=leaf, right=leaf, prop_z=block.z, prop_g=block.g, r_sum=r0)
    return block, kinetic_energy(inv_mass, r0)


def start_leaf(block: Block, cmd: Command, inv_mass: Array):
    """The first half of a leapfrog step from the outer leaf on ``cmd.going_right``'s side
    (of the tree when the leaf starts a subtree, else of the subtree): the momentum's half
    step and the new position. Returns ``(block, new position)``."""
    right = cmd.going_right
    outer = _pick(cmd.new_doubling, _pick(right, block.right, block.left), _pick(right, block.sub_right,
                                                                               block.sub_left))
    half = outer.r - 0.5 * cmd.step * outer.g
    z_new = outer.z + cmd.step * inv_mass * half
    return block._replace(half=half, going_right=right), z_new


def checkpoint_range(n: Array):
    """NumPyro's ``_leaf_idx_to_ckpt_idxs``: the checkpoints leaf ``n`` of a subtree is
    checked against, ``idx_min..idx_max``."""
    idx_max = jax.lax.population_count(n >> 1).astype(jnp.int32)
    num_subtrees = jax.lax.population_count((~n & (n + 1)) - 1).astype(jnp.int32)
    return idx_max - num_subtrees + 1, idx_max


def finish_leaf(block: Block, cmd: Command, z_new: Array, g_new: Array, inv_mass: Array):
    """The second half of the leapfrog step given the gradient at the new position, the
    leaf added to the subtree (its outer leaves, ``r_sum`` and checkpoints; which leaf is
    the proposal the server decides) and this block's shares of the U-turn checks.
    Returns ``(block, LeafShares without kinetic0)``."""
    r_new = block.half - 0.5 * cmd.step * g_new
    leaf = Leaf(z_new, r_new, g_new)
    first = cmd.leaf_idx == 0
    right = cmd.going_right
    sub_left = _pick(first | ~right, leaf, block.sub_left)
    sub_right = _pick(first | right, leaf, block.sub_right)
    sub_r_sum = jnp.where(first, r_new, block.sub_r_sum + r_new)
    ckpt_r = jnp.where(first, jnp.zeros_like(block.ckpt_r), block.ckpt_r)
    ckpt_rsum = jnp.where(first, jnp.zeros_like(block.ckpt_rsum), block.ckpt_rsum)
    if ckpt_r.shape[0]:  # NUTS: checkpoints are written at even leaf indices
        _, idx_max = checkpoint_range(cmd.leaf_idx)
        even = cmd.leaf_idx % 2 == 0
        ckpt_r = jnp.where(even, ckpt_r.at[idx_max].set(r_new), ckpt_r)
        ckpt_rsum = jnp.where(even, ckpt_rsum.at[idx_max].set(sub_r_sum), ckpt_rsum)
    # subtree checks: the subtree from checkpoint i to this leaf (NumPyro's _is_iterative_turning)
    s = sub_r_sum - ckpt_rsum + ckpt_r - 0.5 * (ckpt_r + r_new)
    turn = jnp.stack([jnp.sum(inv_mass * ckpt_r * s, axis=-1), (inv_mass * r_new) @ s.T], axis=-1)
    # the whole tree's check if the subtree ended with this leaf (NumPyro's _combine_tree)
    r_left = jnp.where(right, block.left.r, r_new)
    r_right = jnp.where(right, r_new, block.right.r)
    s_full = block.r_sum + sub_r_sum - 0.5 * (r_left + r_right)
    full = jnp.stack([jnp.dot(inv_mass * r_left, s_full), jnp.dot(inv_mass * r_right, s_full)])
    block = block._replace(sub_left=sub_left, sub_right=sub_right, sub_r_sum=sub_r_sum, ckpt_r=ckpt_r,
                           ckpt_rsum=ckpt_rsum, pending=leaf)
    return block, LeafShares(kinetic_energy(inv_mass, r_new), jnp.zeros_like(r_new, shape=()), turn, full)

"""Warmup adaptation, split by owner: the step size on the server, each block's diagonal
mass matrix with the party that owns the block.

NumPyro's ``warmup_adapter`` (``numpyro/infer/hmc_util.py``) adapts the step size by dual
averaging of the acceptance statistic and a diagonal mass matrix by Welford's variance
over Stan's windows. A diagonal Welford estimate is one per coordinate, so each party
estimates its own block from its own draws; the server, which computes the summed
acceptance statistic, runs the dual averaging and tells every party when to add a draw
(``welford``) and when a window ends (``window_end``). The functions reuse NumPyro's
``dual_averaging``, ``welford_covariance`` and ``build_adaptation_schedule``; the window
logic is NumPyro's ``update_fn``, so the adapted step sizes and masses are NumPyro's.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import jax.numpy as jnp
import numpy as np
from numpyro.infer.hmc_util import build_adaptation_schedule, dual_averaging, welford_covariance

from .._typing import Array

__all__ = ["MassState", "StepState", "adapt_mass", "adapt_step", "init_mass", "init_step", "window_table"]

_da_init, _da_update = dual_averaging()
_mm_init, _mm_update, _mm_final = welford_covariance(diagonal=True)


class MassState(NamedTuple):
    """A party's diagonal mass-matrix block and its Welford estimate (NumPyro's
    ``inverse_mass_matrix``, ``mass_matrix_sqrt`` and ``mm_state``, for this block)."""

    inv_mass: Array
    mass_sqrt: Array
    welford: Tuple[Array, Array, Array]


class StepState(NamedTuple):
    """The server's step-size adaptation: the step size, NumPyro's dual-averaging state and
    the warmup window the chain is in."""

    step_size: Array
    dual: Tuple[Array, Array, Array, Array, Array]
    window: Array


def window_table(num_warmup: int) -> np.ndarray:
    """Stan's warmup windows as ``(start, end)`` rows (NumPyro's ``build_adaptation_schedule``);
    one dummy row when there is no warmup."""
    schedule = build_adaptation_schedule(num_warmup) if num_warmup > 0 else []
    return np.array([(w.start, w.end) for w in schedule] or [(-1, -1)], np.int32)


def init_mass(size: int, dtype) -> MassState:
    """A unit mass for ``size`` coordinates and an empty Welford estimate."""
    ones = jnp.ones(size, dtype)
    mean, m2, n = _mm_init(size)
    return MassState(ones, ones, (mean.astype(dtype), m2.astype(dtype), n))


def adapt_mass(state: MassState, z: Array, welford: Array, window_end: Array, enabled: bool) -> MassState:
    """Add ``z`` to the block's estimate (``welford``); at a window's end adopt the
    regularised variance as ``M^-1`` and restart the estimate (NumPyro's
    ``_update_at_window_end``)."""
    if not enabled:
        return state
    updated = _mm_update(z, state.welford)
    est = tuple(jnp.where(welford, a, b) for a, b in zip(updated, state.welford))
    cov, inv_sqrt, _ = _mm_final(est, regularize=True)
    mean, m2, n = _mm_init(z.shape[0])
    fresh = (mean.astype(z.dtype), m2.astype(z.dtype), n)
    return MassState(
        jnp.where(window_end, cov, state.inv_mass),
        jnp.where(window_end, inv_sqrt, state.mass_sqrt),
        tuple(jnp.where(window_end, a, b) for a, b in zip(fresh, est)),
    )


def init_step(step_size: float, dtype) -> StepState:
    """The dual averaging centred on ``log(10 * step_size)``, as NumPyro starts it."""
    step = jnp.asarray(step_size, dtype)
    return StepState(step, _da_init(jnp.log(10 * step)), jnp.zeros((), jnp.int32))


def adapt_step(state: StepState, t: Array, accept_prob: Array, table: Array, num_warmup: int,
               target_accept_prob: float, adapt_step_size: bool):
    """NumPyro's ``warmup_adapter.update_fn`` after warmup iteration ``t`` (the server's
    part). Returns ``(state, welford, window_end)``: whether the parties add this
    iteration's position to their mass estimate, and whether they adopt it now."""
    step, dual, window = state
    if adapt_step_size:
        dual = _da_update(target_accept_prob - accept_prob, dual)
        log_step, log_step_avg = dual[0], dual[1]
        step = jnp.exp(jnp.where(t == num_warmup - 1, log_step_avg, log_step))
        info = jnp.finfo(jnp.result_type(step))
        step = jnp.clip(step, info.tiny, info.max)
    num_windows = table.shape[0]
    middle = (window > 0) & (window < num_windows - 1)
    at_end = t == table[window, 1]
    window = jnp.where(at_end, window + 1, window)
    window_end = at_end & middle
    if adapt_step_size:
        fresh = _da_init(jnp.log(10.0) + jnp.log(step))
        dual = tuple(jnp.where(window_end, a, b) for a, b in zip(fresh, dual))
    return StepState(step, dual, window), middle, window_end

"""DP federated SVI: SFVI whose clients send DP-SGD gradients (Heikkilä et al.'s (2023) "global VI,
trusted aggr." baseline; Jälkö et al., 2017).

Every round each client draws a fixed-size subset of its real rows without replacement,
``b_j = round(q n_j)`` rows for a sampling rate ``q`` shared by all clients, takes each
row's gradient of its ELBO term with respect to the server's parameters (``vmap`` over the
rows), clips each to ``C`` over the whole pytree and sends the sum plus Gaussian noise
drawn from its own key, scaled by ``1 / q`` (an unbiased estimate of its data term's
gradient), plus its share of the prior's gradient, which does not touch the data:

- with a trusted aggregator (``secure_sum``) each of the ``M`` clients adds noise of
  standard deviation ``sigma / sqrt(M)`` and the server sees only the sum, whose noise is
  ``sigma``: centralised DP-SGD on the pooled rows;
- without one each client adds ``sigma`` itself (its message is private on its own).

The server adds the gradient of its own term and steps, as in SFVI (a round in which an
asked client did not answer is skipped). The clients send no ELBO value (it depends on
their data): ``info.elbo`` is the server's own term only. The model must have global
latent sites only. Privacy: one Gaussian release per round per client, at sampling rate
``b_j / n_j`` (see :mod:`numpyro_fed.dp.plan`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import random

from .._typing import Array, PyTree
from ..dp.batch import traced_batch_size
from ..dp.mechanisms import fixed_size_subset, perturbed_sum
from ..run.protocol import Exchange, FederatedAlgorithm, all_clients
from ..run.steps import tree_weighted_sum
from .sfvi_algorithm import SFVIInfo, init_server, server_update

if TYPE_CHECKING:  # pragma: no cover
    from .objective import FederatedObjective

__all__ = ["DPSFVIClientState", "client_step", "dp_sfvi", "init_client", "server_step"]


def _grad_dtype(messages):
    return jax.tree_util.tree_leaves(messages["global_grad"])[0].dtype


class DPSFVIClientState(NamedTuple):
    local_params: PyTree  # empty: DP federated SVI needs global latent sites only
    releases: Array  # noised gradients this client has sent (its privacy ledger)


def init_client(objective, rng_key, data):
    del rng_key
    return DPSFVIClientState(objective.init_local(data), jnp.zeros((), jnp.int32))


def client_step(objective, num_particles: int, prior_share: float, sampling_rate: float, max_batch: int, clip: float,
                noise_std: float, rng_key, state, broadcast, data):
    """The client's noised sum of clipped per-row gradients on a subset of ``b_j`` rows (its
    noise from its own key), scaled to all its rows, plus its prior share's gradient."""
    message = broadcast.shared
    k_rows, k_noise = random.split(rng_key)
    size = jnp.minimum(traced_batch_size(sampling_rate, data.num_rows), max_batch)  # = the plan's b_j
    rows = jax.tree_util.tree_map(lambda x: x[fixed_size_subset(k_rows, data.row_mask, max_batch)], data.args)
    use = (jnp.arange(max_batch) < size).astype(data.row_mask.dtype)
    empty = jnp.zeros((0,), message.eps_global.dtype)

    def term(g, one, share, scale):
        return jnp.mean(jax.vmap(lambda e: objective.client_term(g, state.local_params, e, empty, one, share,
                                                                 scale))(message.eps_global))

    def row_term(g, row):
        one = data._replace(args=jax.tree_util.tree_map(lambda x: x[None], row),
                            row_mask=jnp.ones(1, data.row_mask.dtype), num_rows=jnp.ones((), data.num_rows.dtype))
        return term(g, one, 0.0, 1.0)

    per_row = jax.vmap(jax.grad(row_term), in_axes=(None, 0))(message.global_params, rows)
    per_row = jax.tree_util.tree_map(lambda x: x * use.reshape((-1,) + (1,) * (x.ndim - 1)), per_row)
    noised = perturbed_sum(per_row, clip, noise_std, k_noise)
    prior = jax.grad(lambda g: term(g, data, prior_share, 0.0))(message.global_params)  # data-free
    scale = data.num_rows / size.astype(data.row_mask.dtype)  # n_j / b_j: the sum over all rows, unbiased
    grad = jax.tree_util.tree_map(lambda a, p: a * scale + p, noised, prior)
    return DPSFVIClientState(state.local_params, state.releases + 1), {"global_grad": grad}


def server_step(objective, optim, num_particles: int, trusted_aggregator: bool, rng_key, state, messages, view):
    """The summed noised gradients (already summed by the trusted aggregator when there is one)
    and the server term's: one step in a complete round."""
    w = view.answered.astype(_grad_dtype(messages))
    total = messages["global_grad"] if trusted_aggregator else tree_weighted_sum(w, messages["global_grad"])
    complete = jnp.all(view.answered)
    new_state, broadcast, elbo_server = server_update(objective, optim, num_particles, rng_key, state, total,
                                                      complete)
    return new_state, broadcast, SFVIInfo(elbo_server, complete)


def _loss(info):
    return -info.elbo


def dp_sfvi(
    objective: "FederatedObjective",
    optim: optax.GradientTransformation,
    num_clients: int,
    *,
    clip: float,
    noise_multiplier: float,
    sampling_rate: float,
    max_batch: int,
    trusted_aggregator: bool = True,
    num_particles: int = 1,
) -> FederatedAlgorithm:
    """Build DP federated SVI (see the module docstring).

    Args:
        objective: server and client ELBO terms (global latent sites only).
        optim: the server's optax optimiser.
        num_clients: J (= M, the clients whose noise adds up under a trusted aggregator).
        clip: ``C``.
        noise_multiplier: ``sigma / C`` of the released sum.
        sampling_rate: ``q``; client j uses ``b_j = round(q n_j)`` rows (at least 1; in
            integer arithmetic, :mod:`numpyro_fed.dp.batch`, as the privacy plan counts them).
        max_batch: the largest ``b_j`` (static: the subsets are drawn at this size and
            masked to ``b_j``).
        trusted_aggregator: secure summation of the gradients (see above).
        num_particles: Monte Carlo draws per round, shared by every row.
    """
    noise_std = noise_multiplier * clip / (math.sqrt(num_clients) if trusted_aggregator else 1.0)
    step = Exchange(partial(client_step, objective, num_particles, 1.0 / num_clients, sampling_rate, max_batch, clip,
                            noise_std),
                    partial(server_step, objective, optim, num_particles, trusted_aggregator), "dp_gradient",
                    ("global_grad",) if trusted_aggregator else ())
    return FederatedAlgorithm(
        partial(init_server, objective, optim, num_particles), partial(init_client, objective),
        all_clients(num_clients), (step,), num_selected=num_clients, monitor=_loss, monitor_name="-server term",
    )

"""Bayesian neural networks for heterogeneous silos (Hassan et al. (2023) §4.1) and multinomial
regression (Hassan et al. (2023) S3.2).

All networks are ``softmax(W2 ReLU(W1 x))`` without biases, as in the paper.

- :func:`hierarchical_bnn`: the first layer is personal to each silo and shares a Gaussian
  prior across silos, non-centred: ``W1^(j) = mu + sigma eps^(j)`` with ``mu ~ N(0, 1)``
  elementwise and ``sigma ~ N+(0, 1)`` global, ``eps^(j) ~ N(0, I)`` and ``W2^(j) ~ N(0, I)``
  local to silo ``j``.
- :func:`fedpop_bnn`: the fully Bayesian FedPop model (Kotelevskii et al., 2022): a shared
  feature layer ``W1 ~ N(0, I)`` (global) and a personal head drawn from a population
  prior, non-centred: ``W2^(j) = m + s eps^(j)``, ``m ~ N(0, I)``, ``s ~ N+(0, 1)`` global,
  ``eps^(j) ~ N(0, I)`` local.
- :func:`bnn`: the same network with one set of weights, ``W1, W2 ~ N(0, I)``: the
  baseline fitted to one silo alone or to the pooled data.
- :func:`multinomial_regression`: ``softmax(W x + b)`` with ``W ~ N(0, sigma_W^2)``,
  ``b ~ N(0, sigma_b^2)`` and the prior scales learned (``numpyro.param``, empirical
  Bayes).

A silo's local sites (``w1_eps``, ``w2``, ``head_eps``) are one draw per silo, not per
row: every client evaluates the model on its own rows and owns its own copy.
:func:`bnn_predict` turns posterior draws into class probabilities.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_fed import local_site

__all__ = ["bnn", "bnn_predict", "fedpop_bnn", "hierarchical_bnn", "multinomial_regression"]


def _likelihood(logits, y):
    with numpyro.plate("rows", logits.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=logits), obs=y)


def _normal(name, shape):
    return numpyro.sample(name, dist.Normal(0.0, 1.0).expand(list(shape)).to_event(len(shape)))


def hierarchical_bnn(x, y=None, hidden: int = 64, num_classes: int = 10):
    """Hassan et al. (2023) §4.1's hierarchical BNN (see the module docstring). ``x`` is (rows, d),
    ``y`` (rows,) integer labels.

    Fit it with SFVI, or SFVI-Avg with its default ``optimizer_state="average"``: with each
    client's own Adam state the between-silo scale ``sigma`` grew to 0.35-0.67 (SFVI: 0.03)
    on the digits benchmark and every silo fell back to its dominant digit (docs/sfvi_avg.md).
    """
    d = x.shape[-1]
    w1_loc = _normal("w1_loc", (d, hidden))
    w1_scale = numpyro.sample("w1_scale", dist.HalfNormal(1.0))
    with local_site():
        w1_eps = _normal("w1_eps", (d, hidden))
        w2 = _normal("w2", (hidden, num_classes))
    w1 = w1_loc + w1_scale * w1_eps
    _likelihood(jax.nn.relu(x @ w1) @ w2, y)


def fedpop_bnn(x, y=None, hidden: int = 64, num_classes: int = 10):
    """The fully Bayesian FedPop model (see the module docstring)."""
    d = x.shape[-1]
    w1 = _normal("w1", (d, hidden))
    head_loc = _normal("head_loc", (hidden, num_classes))
    head_scale = numpyro.sample("head_scale", dist.HalfNormal(1.0))
    with local_site():
        head_eps = _normal("head_eps", (hidden, num_classes))
    _likelihood(jax.nn.relu(x @ w1) @ (head_loc + head_scale * head_eps), y)


def bnn(x, y=None, hidden: int = 64, num_classes: int = 10):
    """One network, ``W1, W2 ~ N(0, I)``: the silo-alone and pooled baseline."""
    d = x.shape[-1]
    w1 = _normal("w1", (d, hidden))
    w2 = _normal("w2", (hidden, num_classes))
    _likelihood(jax.nn.relu(x @ w1) @ w2, y)


def multinomial_regression(x, y=None, num_classes: int = 10):
    """Hassan et al. (2023) S3.2: ``y ~ Categorical(softmax(W x + b))`` with ``W ~ N(0, sigma_W^2)``
    and ``b ~ N(0, sigma_b^2)``; ``sigma_W`` and ``sigma_b`` are learned (global
    ``numpyro.param`` sites)."""
    d = x.shape[-1]
    sigma_w = numpyro.param("sigma_w", 1.0, constraint=constraints.positive)
    sigma_b = numpyro.param("sigma_b", 1.0, constraint=constraints.positive)
    w = numpyro.sample("w", dist.Normal(0.0, sigma_w).expand([d, num_classes]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0.0, sigma_b).expand([num_classes]).to_event(1))
    _likelihood(x @ w + b, y)


_LAYERS = {  # each layer: its sites in the hierarchical / FedPop form, or as one weight matrix
    "first layer": (("w1_loc", "w1_scale", "w1_eps"), ("w1",)),
    "head": (("head_loc", "head_scale", "head_eps"), ("w2",)),
}


def _layer(draws, layer):
    split, whole = _LAYERS[layer]
    if all(n in draws for n in split):
        return split
    if all(n in draws for n in whole):
        return whole
    raise ValueError(
        f"bnn_predict: the draws have no {layer}: need {' + '.join(split)} or {whole[0]}; got "
        f"{sorted(draws)}. A silo's own weights are local sites: draw them with "
        f"svi.sample_posterior(key, result, num_samples, client=...)")


def bnn_predict(draws: Mapping[str, jax.Array], x) -> jax.Array:
    """Posterior-predictive class probabilities ``(rows, classes)`` of any model above,
    averaged over the draws (each site with a leading draw axis): the draws of one silo
    (``svi.sample_posterior(key, result, S, client=...)``) for the personal models.

    Raises ``ValueError`` naming the missing sites when a layer's draws are absent (for
    example the server's draws of a personal model, which hold no local site)."""
    x = jnp.asarray(x)
    if "w" in draws and "b" in draws:  # multinomial regression
        names = ("w", "b")
    else:
        names = _layer(draws, "first layer") + _layer(draws, "head")

    def weight(sample, names):
        return sample[names[0]] if len(names) == 1 else sample[names[0]] + sample[names[1]] * sample[names[2]]

    def one(sample):
        if "w" in sample:
            logits = x @ sample["w"] + sample["b"]
        else:
            w1 = weight(sample, _layer(sample, "first layer"))
            logits = jax.nn.relu(x @ w1) @ weight(sample, _layer(sample, "head"))
        return jax.nn.softmax(logits, axis=-1)

    return jnp.mean(jax.vmap(one)({n: jnp.asarray(draws[n]) for n in names}), axis=0)

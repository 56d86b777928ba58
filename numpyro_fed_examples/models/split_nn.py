"""Split neural networks for vertical federation (Hassan et al. (2024) §5.3).

Each client j maps its covariates through its own network ``h_ij = f_phi_j(x_ij)``; the
server's logistic likelihood sees the sum of the clients' outputs.

- **Split NN**: ``z_ij = h_ij^T w_j`` with every weight a point estimate
  (``numpyro.param``). Split learning's exchange (z up, dlogp/dz down) gives exactly the
  pooled-data gradient, so the plain split NN is the true model fitted by maximum
  likelihood.
- **Hierarchical Bayes split NN**: the final-layer weights are random,
  ``w_j ~ N(0, I)``, and ``z_ij ~ N(h_ij^T w_j, rho^2)``: the model returned here with
  ``bayesian_last_layer=True`` wrapped in ``nf.vertical_split(..., form="augmented")``
  (use :func:`split_nn` which does both).
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from numpyro_fed import vertical_split

__all__ = ["predict_split_nn", "split_nn", "split_nn_model"]


def _glorot(shape):
    def init(rng_key):
        limit = jnp.sqrt(6.0 / (shape[0] + shape[1]))
        return jax.random.uniform(rng_key, shape, minval=-limit, maxval=limit)

    return init


def _hidden(client: str, x: jax.Array, hidden: Sequence[int]) -> jax.Array:
    h = x
    for k, width in enumerate(hidden):
        w = numpyro.param(f"{client}_W{k}", _glorot((h.shape[-1], width)))
        b = numpyro.param(f"{client}_b{k}", jnp.zeros(width))
        h = jnp.tanh(h @ w + b)
    return h


def split_nn_model(
    inputs: Mapping[str, str], hidden: Sequence[int] = (8, 2), bayesian_last_layer: bool = True
) -> Tuple[Callable, Dict[str, dict]]:
    """A split NN for binary classification, one network per client.

    Args:
        inputs: ``{client: name of its covariate argument}``.
        hidden: widths of each client's hidden layers (the paper: 8 then 2).
        bayesian_last_layer: ``w_j ~ N(0, I)`` (hierarchical Bayes) or a point estimate.

    Returns:
        The pair (model, spec): the model is called as ``model(y=..., **covariates)``; spec is
        the ``clients=`` mapping for :func:`~numpyro_fed.vertical_split`.
    """
    inputs = dict(inputs)
    width = int(hidden[-1]) if hidden else None

    def model(y=None, **xs):
        n = next(iter(xs.values())).shape[0]
        outputs = []
        for client, arg in inputs.items():
            h = _hidden(client, xs[arg], hidden)
            d = h.shape[-1] if width is None else width
            if bayesian_last_layer:
                w = numpyro.sample(f"{client}_w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
            else:
                w = numpyro.param(f"{client}_w", _glorot((d, 1)))[:, 0]
            with numpyro.plate("rows", n):
                outputs.append(numpyro.deterministic(f"g_{client}", h @ w))
        with numpyro.plate("rows", n):
            numpyro.sample("y", dist.Bernoulli(logits=sum(outputs)), obs=y)

    spec = {}
    for client, arg in inputs.items():
        sites = [f"{client}_{k}{i}" for i in range(len(hidden)) for k in ("W", "b")] + [f"{client}_w"]
        spec[client] = dict(data=arg, sites=sites, contribution=f"g_{client}")
    return model, spec


def split_nn(inputs: Mapping[str, str], rho: float, hidden: Sequence[int] = (8, 2)):
    """The hierarchical Bayes split NN (Hassan et al. (2024) §5.3) as a vertical augmented model.

    ``y`` is the server's alone (split learning): fit it with
    ``nf.VerticalSVI(model, nf.VerticalGuide("amortized"), optax.adam(1e-3))``.

    Examples:
        >>> from numpyro_fed_examples import models
        >>> hb = models.split_nn({"a": "xa", "b": "xb"}, rho=1.0)
        >>> hb.form, hb.response_access, hb.client_names
        ('augmented', 'server', ('a', 'b'))
    """
    model, spec = split_nn_model(inputs, hidden, bayesian_last_layer=True)
    return vertical_split(model, clients=spec, rho=rho, response="y", response_access="server")


def predict_split_nn(
    model: Callable,
    params: Mapping,
    rng_key,
    xs: Mapping[str, jax.Array],
    *,
    rho: float = 0.0,
    weights: Optional[Mapping[str, jax.Array]] = None,
) -> jax.Array:
    """Predictive ``P(y = 1 | x)`` for new rows.

    Args:
        model: the (unwrapped) model from :func:`split_nn_model`.
        params: the point estimates (``numpyro.param`` values) by name.
        xs: the covariates of the new rows.
        rho: the augmentation scale (hierarchical Bayes: ``z_j ~ N(h_j^T w_j, rho^2)`` for
            new rows, marginalised by Monte Carlo); 0 for the plain split NN.
        weights: posterior draws of the random last-layer weights ``{name: (S, d)}``;
            the predictive probability averages over them.
    """
    from numpyro.handlers import seed, substitute, trace

    def prob(values, key):
        tr = trace(substitute(seed(model, key), data={**params, **values})).get_trace(**xs)
        eta = sum(site["value"] for name, site in tr.items() if name.startswith("g_"))
        if rho > 0:
            eta = eta + rho * jnp.sqrt(len([n for n in tr if n.startswith("g_")])) * jax.random.normal(key, eta.shape)
        return jax.nn.sigmoid(eta)

    if not weights:
        return prob({}, rng_key)
    num = next(iter(weights.values())).shape[0]
    keys = jax.random.split(rng_key, num)
    draws: Dict[str, jax.Array] = dict(weights)
    return jnp.mean(jax.vmap(lambda v, k: prob(v, k))(draws, keys), axis=0)
